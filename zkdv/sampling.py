"""Which steps are checked: a keyed BLAKE3 function of a secret seed.

The decision for (kind, step) is known before the step runs and is
recomputable by anyone once the seed is revealed in the ``final`` record.

Example::

  seed = new_seed()
  is_sampled(seed, "update", 7, 0.01)
"""

import math
import os

import blake3

SEED_BYTES = 32
CHECK_KINDS = ("update", "state")


def new_seed() -> bytes:
  return os.urandom(SEED_BYTES)


def seed_commitment(seed: bytes) -> bytes:
  return blake3.blake3(seed).digest()


def is_sampled(seed: bytes, kind: str, step: int, probability: float) -> bool:
  """True when ``step`` gets a ``kind`` check under ``probability``."""
  if kind not in CHECK_KINDS:
    raise ValueError(f"check kind must be one of {CHECK_KINDS}, got {kind!r}.")
  message = kind.encode() + b"\x00" + int(step).to_bytes(8, "little")
  draw = int.from_bytes(blake3.blake3(message, key=seed).digest()[:8], "little")
  # p * 2**64 is exact in binary floating point, so this has no rounding slack.
  return draw < int(probability * 2.0**64)


def probe_rows(seed: bytes, step: int, leaf: int, rows: int, ratio: float) -> list[int]:
  """The rows of batch leaf ``leaf`` that step ``step`` opens as data probes.

  ``ceil(ratio * rows)`` distinct rows, drawn by a keyed BLAKE3 of the seed, so
  the verifier can check that exactly these rows were opened.
  """
  if ratio <= 0 or rows <= 0:
    return []
  count = min(rows, math.ceil(ratio * rows))
  chosen, draw = [], 0
  prefix = b"probe\x00" + int(step).to_bytes(8, "little") + int(leaf).to_bytes(4, "little")
  while len(chosen) < count:
    value = blake3.blake3(prefix + draw.to_bytes(8, "little"), key=seed).digest()[:8]
    row = int.from_bytes(value, "little") % rows
    if row not in chosen:
      chosen.append(row)
    draw += 1
  return sorted(chosen)
