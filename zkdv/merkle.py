"""RFC 9162 Merkle trees over BLAKE3: leaf prefix 0x00, node prefix 0x01.

Example::

  levels = tree_levels([leaf_hash(b"row0"), leaf_hash(b"row1")])
  root = levels[-1][0]
  proof = inclusion_proof(levels, 1)
  assert verify_inclusion(leaf_hash(b"row1"), 1, 2, proof, root)
"""

from collections.abc import Sequence

import blake3
import numpy as np

EMPTY_ROOT = blake3.blake3(b"").digest()


def leaf_hash(data) -> bytes:
  hasher = blake3.blake3(b"\x00")
  hasher.update(data)
  return hasher.digest()


# Rows at least this wide are hashed where they lie; narrower ones from one prefixed copy,
# which saves a hasher per row where hashing a row costs less than creating one.
IN_PLACE_ROW_BYTES = 4096


def leaf_hashes(rows: np.ndarray) -> list[bytes]:
  """``leaf_hash`` of each row of a 2-D uint8 array."""
  if rows.shape[1] >= IN_PLACE_ROW_BYTES:
    return [leaf_hash(row) for row in rows]
  prefixed = np.zeros((rows.shape[0], rows.shape[1] + 1), np.uint8)
  prefixed[:, 1:] = rows
  data, width = prefixed.tobytes(), prefixed.shape[1]
  return [blake3.blake3(data[i:i + width]).digest() for i in range(0, len(data), width)]


def node_hash(left: bytes, right: bytes) -> bytes:
  return blake3.blake3(b"\x01" + left + right).digest()


def tree_levels(leaf_hashes: Sequence[bytes]) -> list[list[bytes]]:
  """All levels, leaves first. A lone last node moves up unchanged (RFC 9162)."""
  levels = [list(leaf_hashes)]
  while len(levels[-1]) > 1:
    below = levels[-1]
    pairs = b"".join(below[:len(below) // 2 * 2])  # 64-byte pairs of 32-byte hashes
    above = [blake3.blake3(b"\x01" + pairs[i:i + 64]).digest()
             for i in range(0, len(pairs), 64)]
    if len(below) % 2:
      above.append(below[-1])
    levels.append(above)
  return levels


def root(leaf_hashes: Sequence[bytes]) -> bytes:
  if not leaf_hashes:
    return EMPTY_ROOT
  return tree_levels(leaf_hashes)[-1][0]


def inclusion_proof(levels: list[list[bytes]], index: int) -> list[bytes]:
  """The audit path of leaf ``index``, bottom up."""
  path = []
  for level in levels[:-1]:
    sibling = index ^ 1
    if sibling < len(level):
      path.append(level[sibling])
    index //= 2
  return path


def verify_inclusion(leaf: bytes, index: int, size: int, proof: Sequence[bytes],
                     expected_root: bytes) -> bool:
  """RFC 9162 §2.1.3.2: does ``proof`` place ``leaf`` at ``index`` of ``size``?"""
  if not 0 <= index < size:
    return False
  fn, sn, r = index, size - 1, leaf
  for p in proof:
    if sn == 0:
      return False
    if fn % 2 == 1 or fn == sn:
      r = node_hash(p, r)
      while fn % 2 == 0 and fn != 0:
        fn >>= 1
        sn >>= 1
    else:
      r = node_hash(r, p)
    fn >>= 1
    sn >>= 1
  return sn == 0 and r == expected_root
