"""The private JAX APIs ``zkdv.jax`` needs, in one place.

The update finder's one private primitive, ``shard_map_p``, is wrapped in
``zkdv/interpreters/_compat.py`` instead: importing this package from there
would be an import cycle (see that module).

Example: ``_compat.distributed_client()`` is None outside ``jax.distributed``.
"""

import dataclasses

import jax
import numpy as np
from jax._src import distributed
from jax._src.export import _export
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.mlir import passmanager
from jax._src.lax import lax
from jax._src.lib import _jax
from jax._src.tree_util import broadcast_prefix

__all__ = ["broadcast_prefix", "cpu_view", "distributed_client", "drop_nnx_static_cache",
           "exported_abstract_mesh", "on_one_cpu", "weakly_typed", "without_locations"]


def without_locations(exported: jax.export.Exported) -> jax.export.Exported:
  """``exported`` with its module's debug locations stripped.

  Locations name the source files (paths on the prover's machine) and lines
  of the traced code; they do not change what XLA compiles. JAX serializes a
  module only through a private function.
  """
  with mlir.make_ir_context():
    module = ir.Module.parse(exported.mlir_module())
    passmanager.PassManager.parse("builtin.module(strip-debuginfo)").run(module.operation)
    return dataclasses.replace(exported,
                               mlir_module_serialized=_export._module_to_bytecode(module))  # pylint: disable=protected-access


def exported_abstract_mesh(exported):
  """The abstract mesh a multi-device program was exported with, or None.

  ``Exported.in_shardings_jax(mesh)`` needs a mesh with the same axis names and
  sizes; JAX keeps that mesh only in private fields.
  """
  if not getattr(exported, "_has_named_shardings", False):
    return None
  for sharding in (*exported._in_named_shardings, *exported._out_named_shardings):  # pylint: disable=protected-access
    if sharding is not None and sharding.mesh.size == exported.nr_devices:
      return sharding.mesh
  return None


def distributed_client():
  """The coordination-service client of ``jax.distributed``, or None.

  Its key-value store (``key_value_set_bytes``, ``blocking_key_value_get_bytes``,
  ``key_value_delete``) carries small messages between processes without XLA
  collectives; JAX exposes it only privately.
  """
  return distributed.global_state.client


def weakly_typed(x: jax.Array) -> jax.Array:
  """``x`` with a weak type (as a Python scalar's), same dtype and bytes.

  A program traced with a weakly typed input (Flax's ``step=0``) runs again without a
  second trace only with one; JAX makes weak arrays only privately.
  """
  return lax._convert_element_type(x, weak_type=True)  # pylint: disable=protected-access


def drop_nnx_static_cache() -> None:
  """Takes the traversal cache ``nnx.cached_partial`` offers the next NNX transform.

  ``cached_partial`` hands its cache to the first NNX transform its call enters and raises
  when none takes it; ``proof.jit`` splits its NNX objects itself, so it takes the cache
  and leaves it unused. Flax keeps the cache only in a private field.
  """
  from flax.nnx import graphlib  # pylint: disable=g-import-not-at-top
  graphlib.GRAPH_CONTEXT.tmp_static_cache = None


def on_one_cpu(x) -> bool:
  """Whether ``x`` is an array on one CPU device (``cpu_view`` can view it)."""
  sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return False
  (device,) = sharding.device_set
  return device.platform == "cpu"


class _CpuBuffer:
  """``x``'s buffer as a DLPack producer: JAX's own export, without the Python of
  ``jax.Array.__dlpack__`` (which copies its checks into every call: 12 us against 2)."""

  __slots__ = ("_x",)

  def __init__(self, x):
    self._x = x

  def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):  # pylint: disable=unused-argument
    return _jax.buffer_to_dlpack_managed_tensor(self._x, stream=None)

  def __dlpack_device__(self):
    return (1, 0)  # kDLCPU, device 0: the host's memory


def cpu_view(x) -> np.ndarray:
  """A read-only zero-copy view of an array on one CPU device (``on_one_cpu``).

  Example: ``cpu_view(jnp.arange(3))`` is ``array([0, 1, 2], dtype=int32)``.
  """
  return np.from_dlpack(_CpuBuffer(x))
