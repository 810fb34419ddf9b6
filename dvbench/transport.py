"""The wire format between the client and the server, and its safe decoding.

Each request to ``/api/v1/proofs/{id}/stream`` carries one CBOR envelope::

  {"client_id": str, "seq": int,  # 0, 1, 2, ... per client_id
   "kind": "records", "records": [encoded record, ...]}
  {"client_id": ..., "seq": ..., "kind": "chunk",
   "record_id": bytes, "index": int, "count": int, "data": bytes}
  {"client_id": ..., "seq": ..., "kind": "close", "final_record_id": bytes,
   "record_count": int}

and is acknowledged with JSON ``{"seq": n, ...}``; an ack that stored (or saw
again) step records carries ``"challenges"`` (``docs/protocol.md``). Records
larger than ``CHUNK_BYTES`` travel as chunks; resending an envelope is harmless.

Everything a prover sends is decoded with ``decode_safely``, and only after its
token was checked, off the server's event loop: definite lengths, no tags (so no
shared references, sets, regular expressions or other rich objects), bounded depth,
item count and string lengths. ``dvbench.server.validation`` then checks each field.

Example::

  envelope = decode_safely(body)
  record = decode_safely(raw, canonical=True)
"""

import io

import cbor2

from zkdv import records
from zkdv.transcript import record_id  # pylint: disable=unused-import  # re-exported

CHUNK_BYTES = 256 * 1024
BATCH_BYTES = 1024 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_DEPTH = 16
MAX_ITEMS = records.MAX_RECORD_ITEMS
MAX_STRING = MAX_BODY_BYTES  # bytes and text strings of an envelope
MAX_RECORD_STRING = records.MAX_STRING_BYTES  # bytes and text strings inside a record
MAX_RECORD_BYTES = records.MAX_RECORD_BYTES  # a record reassembled from chunks
MAX_BLOBS = 4096  # blobs in one POST /api/v1/proofs/{id}/blobs
SMALL_BLOB_BYTES = 64 * 1024  # blobs this small travel together, one request per envelope
ENVELOPE_KINDS = ("records", "chunk", "close")
BLOB_FIELDS = ("blob", "pre_state_blobs", "batch_blobs", "post_state_blobs", "input_blobs")
# An init record names its program blob by the program's id.
_SIMPLE_VALUES = {20, 21, 22}  # false, true, null
_FLOAT_SIZES = {25: 2, 26: 4, 27: 8}


class UnsafeCbor(ValueError):
  """Bytes that are not one well-formed, tag-free, bounded CBOR item."""


def encode(envelope: dict) -> bytes:
  return cbor2.dumps(envelope, canonical=True)


def _argument(data: bytes, at: int, info: int) -> tuple[int, int]:
  """(value, next offset) of the argument of the head at ``at``."""
  if info < 24:
    return info, at + 1
  size = {24: 1, 25: 2, 26: 4, 27: 8}.get(info)
  if size is None:
    raise UnsafeCbor(f"byte {at}: indefinite lengths and reserved values are not accepted.")
  if at + 1 + size > len(data):
    raise UnsafeCbor(f"byte {at}: the item is cut short.")
  return int.from_bytes(data[at + 1:at + 1 + size], "big"), at + 1 + size


def _check_structure(data: bytes, max_depth: int, max_items: int, max_string: int) -> None:
  """Walks the heads of one CBOR item without building it (raises UnsafeCbor)."""
  at, items, pending = 0, 0, [1]  # pending: items still to read at each open level
  while pending:
    if pending[-1] == 0:
      pending.pop()
      continue
    pending[-1] -= 1
    if at >= len(data):
      raise UnsafeCbor(f"byte {at}: the item is cut short.")
    items += 1
    if items > max_items:
      raise UnsafeCbor(f"more than {max_items} items.")
    major, info = data[at] >> 5, data[at] & 31
    if major == 7:
      if info not in _SIMPLE_VALUES and info not in _FLOAT_SIZES:
        raise UnsafeCbor(f"byte {at}: simple value {info} is not accepted.")
      at += 1 + _FLOAT_SIZES.get(info, 0)
      continue
    if major == 6:
      raise UnsafeCbor(f"byte {at}: CBOR tags are not accepted.")
    value, at = _argument(data, at, info)
    if major in (2, 3):
      if value > max_string:
        raise UnsafeCbor(f"byte {at}: a string of {value} bytes; the limit is {max_string}.")
      at += value
      if at > len(data):
        raise UnsafeCbor(f"byte {at - value}: a string of {value} bytes is cut short.")
    elif major in (4, 5):
      if len(pending) > max_depth:
        raise UnsafeCbor(f"byte {at}: nested deeper than {max_depth} levels.")
      pending.append(value * (2 if major == 5 else 1))
  if at != len(data):
    raise UnsafeCbor(f"{len(data) - at} bytes follow the item.")


def decode_safely(data: bytes, *, canonical: bool = False, max_depth: int = MAX_DEPTH,
                  max_items: int = MAX_ITEMS, max_string: int = MAX_STRING):
  """The one CBOR item in ``data``; with ``canonical``, it must be encoded deterministically.

  Raises UnsafeCbor naming what is wrong, e.g.
  ``decode_safely(b"\\xc1\\x00")`` -> "byte 0: CBOR tags are not accepted."
  """
  if not isinstance(data, bytes):
    raise UnsafeCbor("expected a byte string.")
  _check_structure(data, max_depth, max_items, max_string)
  try:
    item = cbor2.loads(data)
  except (cbor2.CBORDecodeError, ValueError, TypeError, RecursionError) as e:
    raise UnsafeCbor(f"not valid CBOR: {e}") from None
  if canonical and cbor2.dumps(item, canonical=True) != data:
    raise UnsafeCbor("not deterministically encoded (RFC 8949 §4.2).")
  return item


def blob_refs(record: dict) -> set[str]:
  """Hex digests of the blobs a record references."""
  refs = set()
  fields = BLOB_FIELDS + (("program_id",) if record.get("type") == "init" else ())
  for field in fields:
    value = record.get(field)
    values = value if isinstance(value, list) else [value]
    if field == "batch_blobs":  # one list per step of the segment
      values = [d for v in values for d in (v if isinstance(v, list) else [v])]
    for d in values:
      if isinstance(d, bytes) and len(d) == 32:
        refs.add(d.hex())
  return refs


class RecordScanner:
  """Splits a growing CBOR sequence into complete records (raw bytes, map)."""

  def __init__(self):
    self._buffer = b""

  def feed(self, data: bytes) -> list[tuple[bytes, dict]]:
    self._buffer += data
    out = []
    stream = io.BytesIO(self._buffer)
    decoder = cbor2.CBORDecoder(stream)
    start = 0
    while start < len(self._buffer):
      try:
        record = decoder.decode()
      except (cbor2.CBORDecodeEOF, EOFError):
        break  # the writer has not finished this record yet
      end = stream.tell()
      out.append((self._buffer[start:end], record))
      start = end
    self._buffer = self._buffer[start:]
    return out

  @property
  def pending_bytes(self) -> int:
    return len(self._buffer)
