"""Decoding what a prover sends: bounded, safe CBOR, or a 400 naming what was refused.

Example::

  envelope = decode(body, "the envelope")  # HTTPException(400) when not acceptable
"""

from starlette.exceptions import HTTPException

from dvbench import transport


def decode(data: bytes, what: str, *, canonical: bool = False,
           max_string: int = transport.MAX_STRING):
  """Prover-sent CBOR, safely decoded; 400 naming ``what`` when it is not acceptable.

  Call it in a worker thread (``run_in_threadpool``), never on the event loop.
  """
  try:
    return transport.decode_safely(data, canonical=canonical, max_string=max_string)
  except transport.UnsafeCbor as e:
    raise HTTPException(400, f"{what} is not acceptable CBOR: {e}") from None
