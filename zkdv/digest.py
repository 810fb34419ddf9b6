"""Commitments of arrays and of whole states and batches (docs/design.md §4).

A leaf digest is ``BLAKE3(np.asarray(x).tobytes())``. A state digest is the
BLAKE3 of the deterministic CBOR of ``[(keypath, dtype, shape, pieces)]``; a
batch digest is the same with each leaf's rows (leading axis) folded into an
Merkle tree (``zkdv.merkle``), so single rows can later be opened with a proof. A leaf of
the tree holds ``row_group`` consecutive rows (``row_group``, 1 by default).

Example::

  leaf = LeafLayout(path="['w']", dtype="float32", shape=(2,))
  d = state_digest([leaf], [[whole_piece(leaf, leaf_digest(np.zeros(2, np.float32)))]])
"""

import dataclasses
from collections.abc import Sequence

import blake3
import cbor2
import numpy as np

from zkdv import merkle


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """Where a leaf sits and what its bytes are.

  ``dtype`` and ``shape`` describe the stored bytes; for a PRNG key leaf they
  are those of its key data, and ``key_impl`` names the key implementation.
  """

  path: str
  dtype: str
  shape: tuple[int, ...]
  key_impl: str | None = None
  pieces: tuple | None = None  # distinct shard boxes ((start, stop) per dim); None: whole
  row_group: int = 1  # a batch leaf's leading-axis rows per Merkle leaf

  def __post_init__(self):
    group = self.row_group
    if not isinstance(group, int) or isinstance(group, bool) or group < 1:
      raise ValueError(f"row_group of {self.path} must be a positive int, got {group!r}.")
    if group > 1 and (self.logical_ndim < 1 or self.shape[0] % group):
      raise ValueError(f"row_group {group} of {self.path} does not divide its leading axis "
                       f"(shape {self.shape}).")

  def to_record(self) -> dict:
    record = {"path": self.path, "dtype": self.dtype, "shape": list(self.shape)}
    if self.key_impl is not None:
      record["key_impl"] = self.key_impl
    if self.pieces is not None:
      record["pieces"] = [[list(b) for b in box] for box in self.pieces]
    if self.row_group != 1:
      record["row_group"] = self.row_group
    return record

  @classmethod
  def from_record(cls, record: dict) -> "LeafLayout":
    pieces = record.get("pieces")
    return cls(path=record["path"], dtype=record["dtype"],
               shape=tuple(record["shape"]), key_impl=record.get("key_impl"),
               pieces=None if pieces is None else tuple(
                   tuple((int(s), int(e)) for s, e in box) for box in pieces),
               row_group=record.get("row_group", 1))

  @property
  def boxes(self) -> tuple:
    """The index boxes of the leaf's pieces: its shards, or the whole leaf."""
    return self.pieces or (tuple((0, n) for n in self.shape),)

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * numpy_dtype(self.dtype).itemsize

  @property
  def logical_ndim(self) -> int:
    return len(self.shape) - (1 if self.key_impl else 0)

  @property
  def rows(self) -> int:
    """Rows of the batch Merkle tree: groups of ``row_group`` rows of the logical
    array's leading axis (one row without axes)."""
    return self.shape[0] // self.row_group if self.logical_ndim >= 1 else 1


# A batch's Merkle leaves hold at least this many bytes where its rows allow: BLAKE3 hashes
# 16 KiB (16 chunks) in parallel, so one leaf per small row costs ~5x the bytes' hashing.
MIN_LEAF_BYTES = 16 * 1024


def row_group_for(layout: LeafLayout, boundaries=()) -> int:
  """The rows per Merkle leaf for a batch leaf: the least power of two whose rows hold
  ``MIN_LEAF_BYTES``, at most the largest power of two that divides the leading axis
  and every row ``boundaries`` offset (where processes split the rows).

  Example::

    assert row_group_for(LeafLayout("x", "float32", (128, 784))) == 8   # 8 x 3,136 bytes
  """
  if layout.key_impl is not None or layout.logical_ndim < 1 or layout.shape[0] == 0:
    return 1
  row_bytes = layout.nbytes // layout.shape[0]
  group = 1
  while group * row_bytes < MIN_LEAF_BYTES and all(
      n % (group * 2) == 0 for n in (layout.shape[0], *boundaries)):
    group *= 2
  return group


MAX_PIECES = 1 << 16  # shard boxes of one leaf


def check_pieces(layout: LeafLayout) -> None:
  """Raises ValueError unless a leaf's pieces (its shard boxes) tile it: along each
  dimension their (start, stop) intervals partition it, and the boxes are every cell of
  that grid once, as a JAX sharding's shards are. Elements outside every piece would be
  committed by no digest.

  Example: pieces ``(((0, 2),), ((2, 4),))`` of shape ``(4,)`` tile it; ``(((0, 1),),)``
  leaves elements 1 to 3 out and raises.
  """
  boxes, shape = layout.pieces, layout.shape
  if boxes is None:
    return
  if layout.key_impl is not None:
    raise ValueError(f"{layout.path} is a PRNG key leaf, which is never split into pieces")
  if not 0 < len(boxes) <= MAX_PIECES:
    raise ValueError(f"{layout.path} has {len(boxes)} pieces; a leaf has 1 to {MAX_PIECES}")
  if any(len(box) != len(shape) for box in boxes):
    raise ValueError(f"each piece of {layout.path} has one (start, stop) per dimension of "
                     f"its shape {list(shape)}")
  cells = 1
  for dim, size in enumerate(shape):
    intervals = sorted({box[dim] for box in boxes})
    ends = [0] + [stop for _, stop in intervals]
    if [start for start, _ in intervals] != ends[:-1] or ends[-1] != size or any(
        start >= stop for start, stop in intervals if size):
      raise ValueError(f"the pieces of {layout.path} do not partition dimension {dim} "
                       f"(0 to {size}): {intervals[:4]}")
    cells *= len(intervals)
  if len(set(boxes)) != len(boxes) or len(boxes) != cells:
    raise ValueError(f"the pieces of {layout.path} are not each cell of their grid once "
                     f"({len(boxes)} pieces, {cells} cells)")


def check_row_group(layout: LeafLayout, multi_process: bool) -> None:
  """Raises ValueError unless a batch leaf's ``row_group`` is the protocol's for its layout
  (``row_group_for`` without boundaries); a multi-process program, whose groups may not
  span two processes' rows, may use a power of two that divides it.

  Example: ``check_row_group(LeafLayout("x", "float32", (128, 784), row_group=1), False)``
  raises: the protocol groups 8 such rows.
  """
  fixed = row_group_for(layout)
  group = layout.row_group
  if group == fixed or (multi_process and group & (group - 1) == 0 and fixed % group == 0):
    return
  raise ValueError(f"row_group {group} of {layout.path}: the protocol groups {fixed} rows of "
                   f"its layout {layout.dtype}{list(layout.shape)}")


def numpy_dtype(name: str) -> np.dtype:
  """The numpy dtype named ``name``, including ml_dtypes' (bfloat16, fp8, int4)."""
  try:
    return np.dtype(name)
  except TypeError:
    pass
  import ml_dtypes  # pylint: disable=g-import-not-at-top  # servers rarely need it
  dtype = getattr(ml_dtypes, name, None)
  if dtype is None:
    raise TypeError(f"unknown dtype {name!r}.")
  return np.dtype(dtype)


def byte_view(array: np.ndarray) -> np.ndarray:
  """The array's bytes in C order as a flat uint8 view (a copy only if needed)."""
  array = np.ascontiguousarray(array)
  return array.reshape(-1).view(np.uint8)


# Leaves at least this large are hashed on all cores; smaller ones on the calling thread,
# since waking BLAKE3's thread pool costs more than it saves there: its idle workers spin
# (sched_yield) on the cores a training step needs.
PARALLEL_HASH_BYTES = 8 << 20


def hash_threads(nbytes: int) -> int:
  """BLAKE3's ``max_threads`` for hashing ``nbytes`` while training runs.

  Example: ``blake3.blake3(data, max_threads=hash_threads(memoryview(data).nbytes))``.
  """
  return blake3.blake3.AUTO if nbytes >= PARALLEL_HASH_BYTES else 1


def leaf_digest(array: np.ndarray) -> bytes:
  data = byte_view(array)
  return blake3.blake3(data, max_threads=hash_threads(data.nbytes)).digest()


def whole_piece(layout: LeafLayout, digest: bytes) -> list:
  """The single piece of an unsharded leaf: its full index and digest."""
  return [[[0, n] for n in layout.shape], digest]


def box_slices(box) -> tuple:
  return tuple(slice(start, stop) for start, stop in box)


def piece_digests(layout: LeafLayout, array: np.ndarray) -> list[bytes]:
  """The digest of each piece of a leaf, from the whole leaf on the host."""
  if layout.pieces is None:
    return [leaf_digest(array)]
  return [leaf_digest(np.asarray(array)[box_slices(box)]) for box in layout.pieces]


def row_leaf_hashes(layout: LeafLayout, array: np.ndarray, rows: int | None = None) -> list[bytes]:
  """The Merkle leaf hash of each row of ``array``: the whole leaf, or ``rows`` of its rows."""
  rows = layout.rows if rows is None else rows
  if rows == 0:
    return []
  return merkle.leaf_hashes(byte_view(array).reshape(rows, -1))


def _table_digest(entries: list) -> bytes:
  return blake3.blake3(cbor2.dumps(entries, canonical=True)).digest()


def state_digest(layouts: Sequence[LeafLayout], pieces: Sequence[list]) -> bytes:
  """Digest of a state from its layout and each leaf's pieces."""
  return _table_digest([[l.path, l.dtype, list(l.shape), p]
                        for l, p in zip(layouts, pieces, strict=True)])


def batch_digest(layouts: Sequence[LeafLayout], row_roots: Sequence[bytes]) -> bytes:
  """Digest of the batch evidence from each leaf's row Merkle root."""
  return _table_digest([[l.path, l.dtype, list(l.shape), l.rows, r]
                        for l, r in zip(layouts, row_roots, strict=True)])


def digest_state_arrays(layouts: Sequence[LeafLayout], arrays: Sequence[np.ndarray]):
  """(state digest, each leaf's piece digests) of whole leaves on the host."""
  pieces = [piece_digests(l, a) for l, a in zip(layouts, arrays, strict=True)]
  return state_digest_from_pieces(layouts, pieces), pieces


def state_digest_from_pieces(layouts: Sequence[LeafLayout],
                             pieces: Sequence[Sequence[bytes]]) -> bytes:
  """State digest from each leaf's piece digests (in the order of ``layout.boxes``)."""
  return state_digest(layouts, [
      [[[list(b) for b in box], d] for box, d in zip(l.boxes, ds, strict=True)]
      for l, ds in zip(layouts, pieces, strict=True)])


def state_digest_from_leaves(layouts: Sequence[LeafLayout], leaf_digests: Sequence[bytes]) -> bytes:
  """State digest of unsharded leaves from their leaf digests."""
  return state_digest_from_pieces(layouts, [[d] for d in leaf_digests])


PARAMS_PREFIX = ".params"  # a TrainState's params, by keypath


def is_params_path(path: str) -> bool:
  """Whether a TrainState leaf at keypath ``path`` is one of its params: the prover's
  params leaves, and the ones a program record must declare (``zkdv.programs``).

  Example: ``is_params_path(".params['Dense_0']['kernel']")`` is True.
  """
  return path.startswith(PARAMS_PREFIX)


def params_digest(layouts: Sequence[LeafLayout], leaf_digests: Sequence[bytes],
                  params_leaves: Sequence[int], prefix: str = PARAMS_PREFIX) -> bytes:
  """Digest of the params subtree alone, keypaths relative to it.

  It equals the state digest of the params pytree on its own, so a checkpoint
  of ``state.params`` can be matched against a transcript's ``final_params``.
  """
  chosen = [(dataclasses.replace(layouts[i], path=layouts[i].path[len(prefix):]),
             leaf_digests[i]) for i in params_leaves]
  return state_digest_from_leaves([l for l, _ in chosen], [d for _, d in chosen])


def batch_trees(layouts: Sequence[LeafLayout], arrays: Sequence[np.ndarray]) -> list:
  """Each batch leaf's row Merkle tree (all levels, leaves first)."""
  return [merkle.tree_levels(row_leaf_hashes(l, a)) for l, a in zip(layouts, arrays, strict=True)]


def tree_root(levels: list[list[bytes]]) -> bytes:
  return levels[-1][0] if levels[0] else merkle.EMPTY_ROOT


def digest_batch_arrays(layouts: Sequence[LeafLayout], arrays: Sequence[np.ndarray]) -> bytes:
  return batch_digest(layouts, [tree_root(t) for t in batch_trees(layouts, arrays)])
