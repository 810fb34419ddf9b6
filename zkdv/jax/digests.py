"""Digest backends: where leaf and row hashes are computed (DESIGN §4).

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

import jax
import jax.numpy as jnp
import numpy as np

from zkdv import digest
from zkdv.digest import LeafLayout
from zkdv.jax import arrays
from zkdv.jax import device_digest


class HostDigests:
  name = "host"

  def start_state(self, leaves: list, layouts: list[LeafLayout]):
    return leaves, layouts

  def materialize(self, started) -> list[list[np.ndarray]]:
    """Host views of each leaf's pieces (blocks until they are computed)."""
    leaves, layouts = started
    return [arrays.piece_views(x, l) for x, l in zip(leaves, layouts)]

  def state_digests(self, materialized) -> list[list[bytes]]:
    """Each leaf's piece digests."""
    return [[digest.leaf_digest(v) for v in views] for views in materialized]

  def start_rows(self, leaves: list, layouts: list[LeafLayout]) -> list:
    return leaves

  def row_hashes(self, started: list, layouts: list[LeafLayout]) -> list[list[bytes]]:
    return [digest.row_leaf_hashes(l, arrays.host_view(x)) for x, l in zip(started, layouts)]

  def row_bytes(self, leaf, layout: LeafLayout, row: int) -> np.ndarray:
    return digest.row_view(layout, arrays.host_view(leaf), row)


class DeviceDigests(HostDigests):
  name = "device"

  def __init__(self):
    self._state = jax.jit(lambda *xs: jnp.stack([device_digest.digest_words(x) for x in xs]))

  def start_state(self, leaves: list, layouts: list[LeafLayout]):
    """Whole leaves in one program; a sharded leaf's shards each where it lives."""
    whole = [x for x, l in zip(leaves, layouts) if l.pieces is None]
    sharded = [[device_digest.digest_words(v) for v in _shard_data(x, l)]
               for x, l in zip(leaves, layouts) if l.pieces is not None]
    return (self._state(*whole) if whole else None), sharded, layouts

  def materialize(self, started):
    whole, sharded, layouts = started
    whole = iter(np.zeros((0, 8), np.uint32) if whole is None else np.asarray(whole))
    sharded = iter([[np.asarray(w) for w in s] for s in sharded])
    return [next(sharded) if l.pieces is not None else [next(whole)] for l in layouts]

  def state_digests(self, materialized) -> list[list[bytes]]:
    return [[device_digest.words_to_bytes(w) for w in pieces] for pieces in materialized]

  def start_rows(self, leaves: list, layouts: list[LeafLayout]) -> list:
    return [(x, None if l.key_impl or not l.shape else device_digest.row_leaf_words(x))
            for x, l in zip(leaves, layouts)]

  def row_hashes(self, started: list, layouts: list[LeafLayout]) -> list[list[bytes]]:
    out = []
    for (leaf, words), layout in zip(started, layouts):
      if words is None:  # keys and scalars are one row: hash it on the host
        out.append(digest.row_leaf_hashes(layout, arrays.host_view(leaf)))
      else:
        out.append([device_digest.words_to_bytes(w) for w in np.asarray(words)])
    return out

  def row_bytes(self, started, layout: LeafLayout, row: int) -> np.ndarray:
    leaf = started[0] if isinstance(started, tuple) else started
    return digest.byte_view(np.asarray(arrays.host_view(leaf[row])))


def _shard_data(x: jax.Array, layout: LeafLayout) -> list:
  by_box = arrays.shards_by_box(x)
  if set(by_box) != set(layout.pieces):  # placed otherwise: slice the pieces out
    return [x[tuple(slice(a, b) for a, b in box)] for box in layout.pieces]
  return [by_box[box] for box in layout.pieces]


def for_config(name: str):
  """The backend a config names; ``auto`` is host on CPU, device elsewhere."""
  if name == "auto":
    name = "host" if jax.devices()[0].platform == "cpu" else "device"
  return {"host": HostDigests, "device": DeviceDigests}[name]()
