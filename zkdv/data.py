"""A verifiable data order: a dataset's Merkle tree and the batch order a proof's slot seeds.

A dataset is a list of arrays (leaves) sharing a leading (row) axis of ``rows``. Its tree
(``zkdv.merkle``: RFC 9162's shape over keyed BLAKE3) holds every row of every leaf, leaf
after leaf: row ``i`` of leaf ``l`` is tree leaf ``l * rows + i``, hashed as a probe hashes a batch
row, so a probed row proves itself *at its index*. A benchmark pins a training set by
this root (``dvbench.benchmark.TrainingSet``).

The order is a public function of the proof's key seed (``zkdv.keys``: the server's
nonce, or the root record id of a self-challenged proof), the dataset root and the epoch:
each epoch is a permutation of the rows (the rows sorted by a BLAKE3-drawn 64-bit key, ties
by row), cut into batches of ``batch_size`` rows (a short last batch is dropped). The
``n``-th batch a run draws is ``Order(seed, declaration).batch(n)``; the prover
(``zkdv.jax.sampler``) and the verifier (``zkdv.verify.order``) both call it.

Example::

  tree = DatasetTree([x, y])             # x: (1000, 8) float32, y: (1000,) int32
  declaration = tree.declaration(batch_size=32)
  Order(seed, declaration).batch(0)       # the 32 row indices of the first batch
  tree.path(leaf=1, index=17)             # its audit path in the dataset tree
"""

import dataclasses
import functools

import blake3
import numpy as np

from zkdv import digest
from zkdv import merkle

ORDER = "shuffled"  # the one order a data record declares: seeded permutations per epoch
_CONTEXT = b"zkdv data order v1"
INDEX_BYTES = 8  # a step's row indices are committed as little-endian uint64
MAX_BATCH_ROWS = 1 << 16  # rows a batch of a data order holds at most
# Rows a dataset with a data order holds at most: a verifier derives each epoch's whole
# permutation (8 bytes a row), so a declared size is bounded before anything is allocated.
MAX_DATASET_ROWS = 1 << 26  # 67M rows: an epoch's order is 512 MiB (and as much to sort)


@dataclasses.dataclass(frozen=True)
class Declaration:
  """What a ``data`` record declares: the dataset's root, its rows and row layouts, and
  the batch size its order is cut into."""

  root: bytes
  rows: int
  layouts: tuple  # digest.LeafLayout per leaf, shape (rows, ...)
  batch_size: int

  @property
  def size(self) -> int:
    """Leaves of the dataset tree: every row of every leaf."""
    return self.rows * len(self.layouts)

  @property
  def batches_per_epoch(self) -> int:
    return self.rows // self.batch_size

  def to_record(self) -> dict:
    return {"type": "data", "root": self.root, "rows": self.rows, "order": ORDER,
            "layout": [l.to_record() for l in self.layouts], "batch_size": self.batch_size}

  @classmethod
  def from_record(cls, record: dict) -> "Declaration":
    """The declaration of a checked ``data`` record; ValueError when it is inconsistent."""
    layouts = tuple(digest.LeafLayout.from_record(l) for l in record["layout"])
    rows, size = record["rows"], record["batch_size"]
    if not layouts or any(l.key_impl is not None or not l.shape or l.shape[0] != rows
                          for l in layouts):
      raise ValueError(f"every leaf of the dataset has {rows} rows along its first axis")
    if size > rows:
      raise ValueError(f"a batch of {size} rows from a dataset of {rows}")
    return cls(record["root"], rows, layouts, size)


def batch_leaves(layouts, declaration: Declaration) -> list:
  """Per batch leaf (a ``digest.LeafLayout``), the dataset leaf it holds, or None for a PRNG
  key leaf: the non-key batch leaves are the dataset's, in order, ``batch_size`` rows each.
  Raises ValueError naming the first that is not."""
  mapping, wanted = [], declaration.layouts
  for layout in layouts:
    if layout.key_impl is not None:
      mapping.append(None)
      continue
    n = len(mapping) - mapping.count(None)
    want = wanted[n] if n < len(wanted) else None
    shape = None if want is None else (declaration.batch_size, *want.shape[1:])
    if want is None or layout.dtype != want.dtype or tuple(layout.shape) != shape:
      expected = ("the dataset has no more leaves" if want is None
                  else f"{want.dtype}{list(shape)}")
      raise ValueError(f"batch leaf {layout.path} ({layout.dtype}{list(layout.shape)}) is not "
                       f"dataset leaf {n} with {declaration.batch_size} rows ({expected})")
    mapping.append(n)
  held = len(mapping) - mapping.count(None)
  if held != len(wanted):
    raise ValueError(f"the batch holds {held} of the dataset's {len(wanted)} leaves")
  return mapping


def epoch_order(seed: bytes, root: bytes, rows: int, epoch: int) -> np.ndarray:
  """Epoch ``epoch``'s permutation of ``rows`` rows (int64), from the proof's key seed."""
  key = blake3.blake3(_CONTEXT + root + int(epoch).to_bytes(8, "little"), key=seed).digest()
  draws = np.frombuffer(blake3.blake3(b"rows", key=key).digest(length=8 * rows), "<u8")
  return np.argsort(draws, kind="stable")


class Order:
  """The seeded batch order of a proof over a declared dataset: ``batch(n)`` is the row
  indices of the ``n``-th batch the run draws (counting from 0 over all epochs).

  Example: ``Order(seed, declaration).batch(0)``; the verifier recomputes it the same way.
  """

  def __init__(self, seed: bytes, declaration: Declaration):
    self.seed, self.declaration = seed, declaration
    self._epoch = functools.lru_cache(maxsize=2)(
        lambda epoch: epoch_order(seed, declaration.root, declaration.rows, epoch))

  def batch(self, n: int) -> np.ndarray:
    epoch, offset = divmod(int(n), self.declaration.batches_per_epoch)
    size = self.declaration.batch_size
    return self._epoch(epoch)[offset * size:(offset + 1) * size]


def pack_rows(indices: np.ndarray) -> bytes:
  """A step's row indices as the bytes its record commits."""
  return np.asarray(indices, "<u8").tobytes()


def unpack_rows(data: bytes) -> np.ndarray:
  return np.frombuffer(data, "<u8").astype(np.int64)


class DatasetTree:
  """The Merkle tree of a dataset's rows (see the module docstring).

  Example::

    tree = DatasetTree([tokens, labels])
    tree.root, tree.size, tree.leaf_hash(1, 5) == merkle.leaf_hash(labels[5].tobytes())
  """

  def __init__(self, leaves, paths=None):
    leaves = [np.asarray(x) for x in leaves]
    if not leaves or any(x.ndim == 0 for x in leaves):
      raise ValueError("a dataset's leaves share a leading (row) axis; got a scalar or none.")
    rows = leaves[0].shape[0]
    if rows == 0 or any(x.shape[0] != rows for x in leaves):
      raise ValueError(f"a dataset's leaves share a non-empty leading axis; got "
                       f"{[x.shape for x in leaves]}.")
    if rows > MAX_DATASET_ROWS:
      raise ValueError(f"a dataset holds at most {MAX_DATASET_ROWS} rows; got {rows}.")
    self.leaves, self.rows = leaves, rows
    paths = paths or [f"[{n}]" for n in range(len(leaves))]
    self.layouts = tuple(digest.LeafLayout(p, x.dtype.name, tuple(x.shape))
                         for p, x in zip(paths, leaves))
    hashes = []
    for x in leaves:
      hashes += merkle.leaf_hashes(digest.byte_view(x).reshape(rows, -1))
    self._levels = merkle.tree_levels(hashes)
    self.root, self.size = self._levels[-1][0], len(hashes)

  def __repr__(self):
    return (f"DatasetTree(root={self.root.hex()[:16]}…, rows={self.rows}, "
            f"leaves={len(self.leaves)})")

  def declaration(self, batch_size: int) -> Declaration:
    most = min(self.rows, MAX_BATCH_ROWS)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not (
        1 <= batch_size <= most):
      raise ValueError(f"batch_size must be an int in [1, {most}] (the dataset's rows, at "
                       f"most {MAX_BATCH_ROWS}), got {batch_size!r}.")
    return Declaration(self.root, self.rows, self.layouts, batch_size)

  def position(self, leaf: int, index: int) -> int:
    return leaf * self.rows + int(index)

  def leaf_hash(self, leaf: int, index: int) -> bytes:
    return self._levels[0][self.position(leaf, index)]

  def path(self, leaf: int, index: int) -> list[bytes]:
    """The audit path of row ``index`` of leaf ``leaf``."""
    return merkle.inclusion_proof(self._levels, self.position(leaf, index))

  def inclusion_proof(self, position: int) -> list[bytes]:
    return merkle.inclusion_proof(self._levels, position)


def row_in_dataset(row_leaf: bytes, declaration: Declaration, leaf: int, index: int,
                   path) -> bool:
  """Whether the row whose ``merkle.leaf_hash`` is ``row_leaf`` is row ``index`` of leaf
  ``leaf`` of the declared dataset, by its audit ``path``."""
  return (0 <= index < declaration.rows and isinstance(path, list)
          and all(isinstance(p, bytes) for p in path)
          and merkle.verify_inclusion(row_leaf, leaf * declaration.rows + index,
                                      declaration.size, path, declaration.root))
