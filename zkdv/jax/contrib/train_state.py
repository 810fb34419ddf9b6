"""Flax's TrainState, with the optimizer transition marked for ZKDV."""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax
from flax import struct
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import train_state

from zkdv import overlap as overlap_lib
from zkdv.interpreters.marker import mark_update


def _has_overwrite_with_gradient(tree) -> bool:
  return isinstance(tree, Mapping) and OVERWRITE_WITH_GRADIENT in tree


class TrainState(train_state.TrainState):
  """A Flax ``TrainState`` whose ``apply_gradients`` a ZKDV proof can attest.

  Under ``proof.jit`` each ``apply_gradients`` call becomes one transcript
  step; under ``jax.jit``, ``jax.device_put`` or eagerly it is plain Flax.
  ``params`` may also be a bare array.

  Example::

    state = TrainState.create(proof=proof, apply_fn=model.apply,
                              params=params, tx=optax.adam(1e-2))

  Attributes:
    proof: the ``zkdv.jax.ZKDV`` driver that owns this state's updates.
    attest_apply_fn: an exportable equivalent of ``apply_fn`` used only when
      sampled updates are replayed (checks then compare within a tolerance).
    zkdv_overlap: a ``zkdv.overlap`` policy for commitments and checks.
  """

  proof: Any = struct.field(pytree_node=False)
  attest_apply_fn: Callable | None = struct.field(pytree_node=False)
  zkdv_overlap: overlap_lib.Overlap = struct.field(pytree_node=False)

  def apply_gradients(self, *, grads, **kwargs):
    """Applies ``tx`` to ``grads`` exactly as Flax does, then marks the update."""
    overwrite = _has_overwrite_with_gradient(grads)
    grads_with_opt = grads["params"] if overwrite else grads
    params_with_opt = self.params["params"] if overwrite else self.params
    updates, new_opt_state = self.tx.update(
        grads_with_opt, self.opt_state, params_with_opt)
    new_params = optax.apply_updates(params_with_opt, updates)
    if overwrite:
      new_params = {"params": new_params,
                    OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
    new_state = self.replace(step=self.step + 1, params=new_params,
                             opt_state=new_opt_state, **kwargs)
    leaves, treedef = jax.tree.flatten(new_state)
    proof_id = None if self.proof is None else id(self.proof)
    return jax.tree.unflatten(treedef, mark_update(leaves, proof_id=proof_id))

  @classmethod
  def create(cls, *, apply_fn, params, tx, proof=None, attest_apply_fn=None,
             zkdv_overlap=overlap_lib.UNCHECKED, **kwargs):
    """Creates a state with ``step=0`` and ``opt_state = tx.init(params)``."""
    if not isinstance(zkdv_overlap, overlap_lib.Overlap):
      raise TypeError("zkdv_overlap must be zkdv.overlap.UNCHECKED, ALWAYS or "
                      f"NEVER, got {zkdv_overlap!r}.")
    params_with_opt = (params["params"] if _has_overwrite_with_gradient(params)
                       else params)
    return cls(step=0, apply_fn=apply_fn, params=params, tx=tx,
               opt_state=tx.init(params_with_opt), proof=proof,
               attest_apply_fn=attest_apply_fn, zkdv_overlap=zkdv_overlap,
               **kwargs)
