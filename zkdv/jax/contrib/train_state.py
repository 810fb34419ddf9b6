"""Flax's TrainState, with the optimizer transition marked for ZKDV."""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax
from flax import struct
from flax.training import train_state

from zkdv import overlap as overlap_lib
from zkdv.interpreters.marker import mark_update

_BOX = "params"  # the key params that are not a mapping are boxed under


def _boxed(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` for params boxed as ``{_BOX: params}``, with ``tx``'s own state.

  Flax's ``create`` and ``apply_gradients`` ask ``OVERWRITE_WITH_GRADIENT in
  params``, which a bare array or a sequence cannot answer; boxed, Flax's body
  runs on them unchanged.
  """
  def update(updates, state, params=None):
    updates, state = tx.update(updates[_BOX], state,
                               None if params is None else params[_BOX])
    return {_BOX: updates}, state
  return optax.GradientTransformation(lambda params: tx.init(params[_BOX]), update)


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
    """Flax's ``apply_gradients``, with the new state's leaves marked as an update.

    Example: ``state = state.apply_gradients(grads=grads, batch_stats=stats)``.
    """
    if isinstance(grads, Mapping):
      new_state = super().apply_gradients(grads=grads, **kwargs)
    else:  # a bare array (or a sequence) of params
      boxed = self.replace(params={_BOX: self.params}, tx=_boxed(self.tx))
      new_state = train_state.TrainState.apply_gradients(boxed, grads={_BOX: grads}, **kwargs)
      new_state = new_state.replace(params=new_state.params[_BOX], tx=self.tx)
    leaves, treedef = jax.tree.flatten(new_state)
    proof_id = None if self.proof is None else id(self.proof)
    return jax.tree.unflatten(treedef, mark_update(leaves, proof_id=proof_id))

  @classmethod
  def create(cls, *, apply_fn, params, tx, proof=None, attest_apply_fn=None,
             zkdv_overlap=overlap_lib.UNCHECKED, **kwargs):
    """Flax's ``TrainState.create``: ``step=0`` and ``opt_state = tx.init(params)``.

    With ``params`` from ``proof.init``, the whole state comes out of the init
    program (``proof.extend_init``): the optimizer state, the step and every added
    field are attested with the params.

    Example::

      params = proof.init(model.init, jax.random.key(0), x)["params"]
      state = TrainState.create(proof=proof, apply_fn=model.apply, params=params,
                                tx=optax.adam(1e-2))
    """
    if not isinstance(zkdv_overlap, overlap_lib.Overlap):
      raise TypeError("zkdv_overlap must be zkdv.overlap.UNCHECKED, ALWAYS or "
                      f"NEVER, got {zkdv_overlap!r}.")

    def build(params, **fields):
      fields = {"proof": proof, "attest_apply_fn": attest_apply_fn,
                "zkdv_overlap": zkdv_overlap, **kwargs, **fields}
      flax_create = super(TrainState, cls).create
      if isinstance(params, Mapping):  # Flax's own create (FP8 params included)
        return flax_create(apply_fn=apply_fn, params=params, tx=tx, **fields)
      boxed = flax_create(apply_fn=apply_fn, params={_BOX: params}, tx=_boxed(tx), **fields)
      return boxed.replace(params=params, tx=tx)  # a bare array or a sequence

    extend = getattr(proof, "extend_init", None)
    dynamic = {k: v for k, v in kwargs.items() if jax.tree.leaves(v)}
    if extend is not None:  # the added fields' values come from the init program too
      state = extend((params, dynamic), lambda parts: build(parts[0], **parts[1]))
      if state is not None:
        return state
    return build(params)
