"""The update marker: an identity primitive around the post-update state.

``TrainState.apply_gradients`` binds it on the new state's leaves, so a traced
training step shows where (and for which proof) an optimizer update happened.
It is the identity under every interpretation: evaluation, lowering, JVP
(tangents pass through), transposition (never needed: tangents carry no
marker) and batching, so it survives ``vmap``, ``grad``, control flow,
``remat``, nested ``jit``, ``shard_map`` and ``pmap``.

Example::

  new_leaves = mark_update(new_leaves, proof_id=id(proof))
"""

from collections.abc import Sequence

from jax.extend import core
from jax.interpreters import ad, batching, mlir

update_marker_p = core.Primitive("zkdv_update")
update_marker_p.multiple_results = True


def mark_update(leaves: Sequence, *, proof_id: int | None) -> list:
  """Binds the marker on ``leaves``; ``proof_id`` is ``id(proof)`` or None."""
  if not leaves:
    return []
  return update_marker_p.bind(*leaves, proof_id=proof_id)


def _impl(*leaves, proof_id):
  del proof_id
  return list(leaves)


def _abstract_eval(*avals, proof_id):
  del proof_id
  return list(avals)


def _lowering(ctx, *operands, proof_id):
  del ctx, proof_id
  return list(operands)


def _jvp(primals, tangents, *, proof_id):
  return update_marker_p.bind(*primals, proof_id=proof_id), list(tangents)


def _batching(args, dims, *, proof_id):
  return update_marker_p.bind(*args, proof_id=proof_id), list(dims)


update_marker_p.def_impl(_impl)
update_marker_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(update_marker_p, _lowering)
ad.primitive_jvps[update_marker_p] = _jvp
batching.primitive_batchers[update_marker_p] = _batching
