"""A proof's public randomness: PRNG keys derived from its slot, never chosen by the prover.

Every key of a proof is a function of one seed fixed when the proof starts: the
server's nonce for a proof slot (``challenger.kind == "dvbench"``), otherwise
(a self-audited proof) the transcript's root record id. The start key feeds the
init program (``proof.init``); step ``t``'s key is what a PRNG-key batch leaf
of step ``t`` must hold (``proof.key(t)``, ``proof.step_key()``). A prover
therefore cannot grind initializations, nor hide rows in a "key". The key data
are BLAKE3 output, as many bytes as the key implementation's data take, so
prover and verifier derive them without JAX.

Example::

  seed = key_seed(root["challenger"], transcript_id)
  key_data(seed, None, 8)     # the start key's data (threefry: two uint32)
  key_data(seed, 12, 8)       # step 12's
"""

import blake3
import numpy as np

_CONTEXT = b"zkdv proof keys v1"


def key_seed(challenger: dict, transcript_id: bytes) -> bytes:
  """The seed of a proof's keys: from the server's nonce when a server issued the slot,
  else from the root record id."""
  nonce = challenger.get("nonce") if isinstance(challenger, dict) else None
  if nonce is not None and challenger.get("kind") == "dvbench" and isinstance(nonce, bytes):
    return blake3.blake3(_CONTEXT + b" nonce " + nonce).digest()
  return blake3.blake3(_CONTEXT + b" root " + transcript_id).digest()


def key_data(seed: bytes, step: int | None, nbytes: int) -> bytes:
  """The bytes of the start key (``step`` None) or of step ``step``'s key."""
  label = b"start" if step is None else b"step" + int(step).to_bytes(8, "little")
  return blake3.blake3(seed + label).digest(length=nbytes)


def key_array(seed: bytes, step: int | None, dtype, shape) -> np.ndarray:
  """``key_data`` as an array of ``dtype`` and ``shape`` (a key leaf's data, as its
  layout describes it). Example: ``key_array(seed, 12, np.uint32, (2,))``."""
  dtype = np.dtype(dtype)
  return np.frombuffer(key_data(seed, step, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize),
                       dtype).reshape(shape)
