"""Digest backends: where leaf and row hashes are computed (docs/design.md §4).

``host``: native BLAKE3 on the commit thread over zero-copy host views; best
on CPU, where arrays already live in host memory. ``device``: BLAKE3 written
in ``jax.numpy`` (``device_digest``), dispatched right after the step on the
leaf's device, so only 32-byte digests reach the host. Both give the same
bytes. Each backend works in two phases: ``start_*`` on the training thread
(dispatch only) and ``*_digests`` on the commit thread.

Example::

  backend = for_config("auto")
  started = backend.start_state(leaves)
  leaf_digests = backend.state_digests(backend.materialize(started))
"""

import functools

import jax
import numpy as np

from zkdv import digest
from zkdv.digest import LeafLayout
from zkdv.jax import arrays
from zkdv.jax import device_digest


class HostDigests:
  """Digests computed on the host (``None`` marks a piece or row another process holds)."""

  name = "host"

  def __init__(self):
    self._last_views = {}  # id -> (block, its host view): the last step's batch blocks

  def start_state(self, leaves: list, layouts: list[LeafLayout]):
    return leaves, layouts

  def materialize(self, started) -> list[list[np.ndarray | None]]:
    """Host views of each leaf's pieces held here (blocks until they are computed)."""
    leaves, layouts = started
    return [arrays.piece_views(x, l) for x, l in zip(leaves, layouts)]

  def state_digests(self, materialized) -> list[list[bytes | None]]:
    """Each leaf's piece digests."""
    return [[None if v is None else digest.leaf_digest(v) for v in views]
            for views in materialized]

  def replica_digests(self, leaves: list, layouts: list[LeafLayout]) -> list[list]:
    """[leaf, piece, device, digest] of every replica (replica_id > 0) held here."""
    return [[leaf, piece, device, self._digest(data)]
            for leaf, (x, l) in enumerate(zip(leaves, layouts))
            for piece, device, data in arrays.replica_shards(x, l)]

  def _digest(self, data: jax.Array) -> bytes:
    return digest.leaf_digest(arrays.host_view(data))

  def start_rows(self, leaves: list, layouts: list[LeafLayout]) -> list:
    """Each batch leaf's blocks of rows held here: [(first row, count, data)].

    A block on one device is taken as a host view now, before the step runs: exporting
    a buffer that a running step reads costs 0.05-0.1 ms of CPU, an idle one a few
    microseconds. The block the last step took (a batch passed again, as the tutorial's
    loop does, while the last step still reads it) keeps the view it had.
    """
    last, views = self._last_views, {}

    def view(block):
      kept = last.get(id(block))
      data = kept[1] if kept is not None and kept[0] is block else _idle_view(block)
      views[id(block)] = (block, data)
      return data

    started = [[(first, count, view(block)) for first, count, block in arrays.row_shards(x, l)]
               for x, l in zip(leaves, layouts)]
    self._last_views = views
    return started

  def row_hashes(self, started: list, layouts: list[LeafLayout]) -> list[list[bytes | None]]:
    """Each batch leaf's row hashes (None for rows held elsewhere)."""
    out = []
    for blocks, layout in zip(started, layouts):
      hashes = [None] * layout.rows
      for first, count, block in blocks:
        hashes[first:first + count] = self._block_row_hashes(block, layout, count)
      out.append(hashes)
    return out

  def _block_row_hashes(self, block, layout: LeafLayout, count: int) -> list[bytes]:
    return digest.row_leaf_hashes(layout, arrays.host_view(block), count)

  def _row_view(self, block, count: int, row: int) -> np.ndarray:
    data = digest.byte_view(arrays.host_view(block))
    width = data.size // count
    return data[row * width:(row + 1) * width]

  def row_bytes(self, blocks, row: int) -> np.ndarray | None:
    """The bytes of one row, or None where it is held by another process."""
    for first, count, block in blocks:
      if first <= row < first + count:
        return self._row_view(block, count, row - first)
    return None


def _idle_view(block):
  """A host view of a block on one device (zero-copy); a block on several as it is."""
  if isinstance(block, jax.Array) and len(block.devices()) == 1:
    return arrays.host_view(block)
  return block


class DeviceDigests(HostDigests):
  name = "device"

  def start_state(self, leaves: list, layouts: list[LeafLayout]):
    """Whole leaves, and each piece of a leaf split over devices or processes (only those
    this process commits), hashed where they live: one program for all those on the same
    devices (``PROGRAM_BYTES`` at most)."""
    parts = [[x] if _in_one_piece(x, l) else _shard_data(x, l) for x, l in zip(leaves, layouts)]
    groups = _programs({(i, n): v for i, p in enumerate(parts) for n, v in enumerate(p)
                        if v is not None})
    return [(device_digest.digest_many([parts[i][n] for i, n in keys]), keys)
            for keys in groups], [len(p) for p in parts]

  def materialize(self, started):
    groups, counts = started
    out = [[None] * count for count in counts]
    for words, keys in groups:
      for (i, n), w in zip(keys, np.asarray(words)):
        out[i][n] = w
    return out

  def state_digests(self, materialized) -> list[list[bytes | None]]:
    return [[None if w is None else device_digest.words_to_bytes(w) for w in pieces]
            for pieces in materialized]

  def _digest(self, data: jax.Array) -> bytes:
    return device_digest.words_to_bytes(np.asarray(device_digest.digest_words(data)))

  def start_rows(self, leaves: list, layouts: list[LeafLayout]) -> list:
    """As the host's, each block paired with its row hashes started where it lives: one
    program for all the blocks on the same devices (a dispatch a step, not one a leaf;
    ``PROGRAM_BYTES`` at most)."""
    started = [arrays.row_shards(x, l) for x, l in zip(leaves, layouts)]
    hashed = {(i, n): block for i, (blocks, layout) in enumerate(zip(started, layouts))
              if layout.key_impl is None and layout.shape  # keys, scalars: on the host
              for n, (_, _, block) in enumerate(blocks)}
    words = {}  # (leaf, block) -> (the words of its program, where its rows start and end)
    for keys in _programs(hashed):
      counts = [started[i][n][1] for i, n in keys]
      program_words = _row_words([started[i][n][2] for i, n in keys], tuple(counts))
      ends = np.cumsum(counts)
      words.update((key, (program_words, end - count, end))
                   for key, count, end in zip(keys, counts, ends))
    return [[(first, count, (block, words.get((i, n))))
             for n, (first, count, block) in enumerate(blocks)]
            for i, blocks in enumerate(started)]

  def _block_row_hashes(self, block, layout: LeafLayout, count: int) -> list[bytes]:
    data, words = block
    if words is None:  # keys and scalars: hash on the host
      return super()._block_row_hashes(data, layout, count)
    program_words, start, end = words  # the program's words reach the host once
    return device_digest.rows_to_bytes(np.asarray(program_words)[start:end])

  def _row_view(self, block, count: int, row: int) -> np.ndarray:
    """One row, sliced where the block lives (only its bytes reach the host)."""
    data = arrays.unwrap_key(block[0])
    return digest.byte_view(np.asarray(arrays.host_view(data.reshape(count, -1)[row])))


@functools.partial(jax.jit, static_argnums=1)
def _row_words(blocks: list, counts: tuple) -> jax.Array:
  """The Merkle leaf words of each block's ``count`` Merkle rows, one block's after another,
  all in one batch of chunks in one program: a program a leaf cost the training thread
  0.4 ms a leaf a step on a TPU, and an eager reshape before it as much."""
  return device_digest.rows_leaf_words(
      [b.reshape(c, b.size // c if c else 0) for b, c in zip(blocks, counts)])


# The most bytes one digest program takes, when it holds more than one array: it lays its
# arrays' chunks side by side (a copy of them, and one more transposed), so a state that
# fills a device is hashed in programs of this size, not all at once.
PROGRAM_BYTES = 256 * 2**20


def _programs(arrays_by_key: dict) -> list[list]:
  """The keys of ``arrays_by_key`` as one digest program takes them: arrays on the same
  devices, together at most ``PROGRAM_BYTES`` (an array larger than that alone)."""
  by_devices = {}
  for key, x in arrays_by_key.items():
    devices = getattr(getattr(x, "sharding", None), "device_set", None)
    by_devices.setdefault(None if devices is None else frozenset(devices), []).append(key)
  programs = []
  for keys in by_devices.values():
    programs.append([])
    size = 0
    for key in keys:
      nbytes = arrays_by_key[key].nbytes
      if programs[-1] and size + nbytes > PROGRAM_BYTES:
        programs.append([])
        size = 0
      programs[-1].append(key)
      size += nbytes
  return programs


def _in_one_piece(x: jax.Array, layout: LeafLayout) -> bool:
  """Whether the leaf is one piece that is all here (digested as a whole)."""
  return layout.pieces is None and getattr(x, "is_fully_addressable", True)


def _shard_data(x: jax.Array, layout: LeafLayout) -> list:
  """Each piece's data where this process commits it (replica 0), else None."""
  x = arrays.unwrap_key(x)
  by_box = arrays.shards_by_box(x)
  if getattr(x, "is_fully_addressable", True) and set(by_box) != set(layout.boxes):
    return [x[tuple(slice(a, b) for a, b in box)] for box in layout.boxes]  # placed otherwise
  return [by_box.get(box) for box in layout.boxes]


def for_config(name: str):
  """The backend a config names; ``auto`` is host on CPU, device elsewhere."""
  if name == "auto":
    name = "host" if jax.devices()[0].platform == "cpu" else "device"
  return {"host": HostDigests, "device": DeviceDigests}[name]()
