"""Moving leaves between JAX and the host bytes that commitments cover.

A PRNG key leaf is committed as its key data (``jax.random.key_data``); its
layout names the key implementation so it can be rebuilt for replay.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from zkdv import digest
from zkdv import errors
from zkdv.digest import LeafLayout
from zkdv.jax import _compat


def is_key(x) -> bool:
  dtype = getattr(x, "dtype", None)
  if isinstance(dtype, np.dtype):  # the common case, without jnp.issubdtype's Python
    return False
  return jnp.issubdtype(dtype, jax.dtypes.prng_key)


def unwrap_key(x):
  """A PRNG key leaf's key data (the bytes committed for it); any other leaf itself.

  Example: ``unwrap_key(jax.random.key(0))`` is ``uint32[2]``.
  """
  return jax.random.key_data(x) if is_key(x) else x


def as_array(x) -> jax.Array:
  """``x`` as a jax.Array (Python scalars and numpy arrays are converted)."""
  return x if isinstance(x, jax.Array) else jnp.asarray(x)


def index_box(index: tuple, shape: tuple) -> tuple:
  """A shard's index (a tuple of slices) as ((start, stop), ...) per dimension."""
  return tuple((i.start or 0, n if i.stop is None else i.stop) for i, n in zip(index, shape))


def shards_by_box(x: jax.Array) -> dict:
  """The leaf's addressable shards, one per distinct box (replicas hashed once)."""
  return {index_box(s.index, x.shape): s.data
          for s in getattr(x, "addressable_shards", ()) if s.replica_id == 0}


def boxes_of(x: jax.Array) -> tuple | None:
  """The distinct shard boxes of a leaf split over devices; None if it is whole."""
  sharding = getattr(x, "sharding", None)
  if sharding is None or is_key(x) or sharding.is_fully_replicated:
    return None
  boxes = {index_box(index, x.shape)
           for index in sharding.devices_indices_map(tuple(x.shape)).values()}
  return tuple(sorted(boxes)) if len(boxes) > 1 else None


def layout_of(path: str, x: jax.Array, sharded: bool = False) -> LeafLayout:
  """The leaf's layout; with ``sharded``, its pieces are the leaf's shards."""
  if is_key(x):
    data = jax.eval_shape(unwrap_key, x)
    return LeafLayout(path, str(data.dtype), tuple(data.shape),
                      key_impl=str(jax.random.key_impl(x)))
  return LeafLayout(path, str(x.dtype), tuple(x.shape),
                    pieces=boxes_of(x) if sharded else None)


def batch_layout_of(path: str, x: jax.Array) -> LeafLayout:
  """A batch leaf's layout, its rows grouped per Merkle leaf (``digest.row_group_for``);
  in a multi-process run no group spans the rows of two shards."""
  layout = layout_of(path, x)
  boundaries = ()
  if not _fully_addressable(x) and not is_key(x) and x.ndim:
    boundaries = tuple(b for index in x.sharding.devices_indices_map(tuple(x.shape)).values()
                       for b in index_box(index, x.shape)[0])
  return dataclasses.replace(layout, row_group=digest.row_group_for(layout, boundaries))


def piece_views(x: jax.Array, layout: LeafLayout) -> list[np.ndarray | None]:
  """Host views of the leaf's pieces that this process holds, None for the others.

  A piece is taken from its own shard where the shards are the pieces (no
  gather); a leaf whose shards all live here but are placed otherwise is
  sliced from the whole leaf.
  """
  x = unwrap_key(x)
  if layout.pieces is None and _fully_addressable(x):
    return [host_view(x)]
  shards = shards_by_box(x)
  if _fully_addressable(x) and set(shards) != set(layout.boxes):
    whole = np.asarray(x)
    return [whole[tuple(slice(a, b) for a, b in box)] for box in layout.boxes]
  return [host_view(shards[box]) if box in shards else None for box in layout.boxes]


def replica_shards(x: jax.Array, layout: LeafLayout) -> list[tuple[int, str, jax.Array]]:
  """(piece index, device, data) of each replica (replica_id > 0) held here."""
  x = unwrap_key(x)
  boxes = {box: i for i, box in enumerate(layout.boxes)}
  return [(boxes[index_box(s.index, x.shape)], str(s.device), s.data)
          for s in getattr(x, "addressable_shards", ())
          if s.replica_id > 0 and index_box(s.index, x.shape) in boxes]


def row_shards(x: jax.Array, layout: LeafLayout) -> list[tuple[int, int, jax.Array]]:
  """(first row, row count, data) of the blocks of Merkle rows of a batch leaf held
  here, counted in ``layout.rows`` (groups of ``layout.row_group`` leading-axis rows).

  The whole leaf where it is all here (or has no rows); in a multi-process
  run, each shard this process commits (replica 0), which must hold whole
  rows. A leaf without axes is one row, held by one process.
  """
  if _fully_addressable(x) or layout.rows == 0:
    return [(0, layout.rows, x)]
  if x.ndim == 0:  # a scalar (or a single PRNG key): one row
    return [(0, 1, s.data) for s in x.addressable_shards if s.replica_id == 0]
  x = unwrap_key(x)
  blocks = []
  for s in x.addressable_shards:
    box = index_box(s.index, x.shape)
    if s.replica_id != 0:
      continue
    if any(box[d] != (0, n) for d, n in enumerate(x.shape) if d > 0):
      raise errors.StepInputError(
          f"batch leaf {layout.path} is split along an axis other than its rows "
          f"(shard {box}); a multi-process run commits batch rows where they live. "
          "Shard batches along the leading axis only (PartitionSpec('data')).")
    group = layout.row_group
    blocks.append((box[0][0] // group, (box[0][1] - box[0][0]) // group, s.data))
  return blocks


def gather(x: jax.Array) -> np.ndarray:
  """The whole leaf on the host of every process (a collective across processes)."""
  x = unwrap_key(x)
  if _fully_addressable(x):  # on several devices, np.asarray assembles a fresh copy
    devices = getattr(getattr(x, "sharding", None), "device_set", ())
    return np.asarray(x) if len(devices) > 1 else host_copy(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def to_global(array: np.ndarray, layout: LeafLayout, sharding) -> jax.Array:
  """A leaf placed with ``sharding`` from its whole value on every process's host."""
  data = jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
  if layout.key_impl is not None:
    return jax.random.wrap_key_data(data, impl=layout.key_impl)
  return data


def _fully_addressable(x) -> bool:
  return getattr(x, "is_fully_addressable", True)


def host_view(x: jax.Array) -> np.ndarray:
  """The leaf's bytes on the host, without a copy where JAX allows one.

  A DLPack view does not pin the array afterwards, so donating it later works
  once the view is gone (while it lives, JAX copies instead of donating).
  """
  x = unwrap_key(x)
  try:
    return _compat.cpu_view(x) if _compat.on_one_cpu(x) else np.from_dlpack(x)
  except (RuntimeError, TypeError, BufferError, ValueError, jax.errors.JaxRuntimeError):
    return np.asarray(x)


def kept_for_opening(leaves: list) -> list:
  """``leaves`` kept for a later opening without waiting for their computation: a host
  view of a leaf that is ready; of one still being computed (a view would wait for it),
  a copy dispatched behind that computation (the step may donate the leaf, or the caller
  delete it). ``opened_views`` makes them host views on the commit thread.

  Example: ``kept_for_opening([params_being_computed])`` is ``[a copy]``.
  """
  leaves = [unwrap_key(x) for x in leaves]
  pending = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_ready()]
  copies = dict(zip(pending, device_copies([leaves[i] for i in pending])))
  return [copies[i] if i in copies else host_view(x) for i, x in enumerate(leaves)]


def device_copies(leaves: list) -> list:
  """Copies of ``leaves`` where they live, in one program dispatched behind the ones that
  compute them; of a PRNG key, its key data.

  Example: ``device_copies([x])[0]`` holds ``x``'s bytes in a buffer of its own.
  """
  return _copies([unwrap_key(x) for x in leaves]) if leaves else []


@jax.jit
def _copies(leaves: list) -> list:
  return [jnp.copy(x) for x in leaves]


def opened_views(opened: list) -> list:
  """``opened`` with each array kept by ``kept_for_opening`` as a host view (None stays)."""
  return [host_view(x) if isinstance(x, jax.Array) else x for x in opened]


def host_copy(x: jax.Array) -> np.ndarray:
  return np.array(host_view(x), copy=True)


def from_host(array: np.ndarray, layout: LeafLayout) -> jax.Array:
  if layout.key_impl is not None:
    return jax.random.wrap_key_data(jnp.asarray(array), impl=layout.key_impl)
  return jnp.asarray(array)
