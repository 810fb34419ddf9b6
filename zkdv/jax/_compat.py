"""The private JAX APIs ``zkdv.jax`` needs, in one place.

The update finder's one private primitive, ``shard_map_p``, is wrapped in
``zkdv/interpreters/_compat.py`` instead: importing this package from there
would be an import cycle (see that module).

Example: ``_compat.distributed_client()`` is None outside ``jax.distributed``.
"""

import dataclasses

import jax
from jax._src import distributed
from jax._src.export import _export
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.mlir import passmanager
from jax._src.lax import lax
from jax._src.tree_util import broadcast_prefix

__all__ = ["broadcast_prefix", "distributed_client", "exported_abstract_mesh",
           "weakly_typed", "without_locations"]


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
