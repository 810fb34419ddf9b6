"""A ``proof.jit`` step's arguments and outputs: which leaves are the state and which the batch.

A call is split into static and dynamic arguments (``ArgSpec``, as ``jax.jit`` splits
them) and flattened (``Call``); its flat inputs are classified into the state's leaves and
batch evidence (``Inputs``); the traced step must perform exactly one update
(``check_updates``) and return the new state once (``locate_post_state``); its other
outputs are its metrics (``metric_outputs``).

Example::

  start, state = locate_state(call, proof, "train_step", state_argnum=None)
  inputs = classify(call, start, state)
  inputs.state_indices, inputs.batch_layouts
"""

import dataclasses
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import jax

from zkdv import digest
from zkdv import errors
from zkdv import metrics
from zkdv.digest import LeafLayout
from zkdv.interpreters.find import find_updates
from zkdv.jax import arrays
from zkdv.jax import trees
from zkdv.jax.contrib.train_state import TrainState
from zkdv.jax.update_program import weak_type


def is_train_state(x) -> bool:
  return isinstance(x, TrainState)


def nnx_module():
  """``zkdv.jax.contrib.nnx`` once the program uses Flax NNX, else None (no NNX
  object can then be passed, and importing NNX costs a quarter of a second)."""
  if "flax.nnx" not in sys.modules:
    return None
  from zkdv.jax.contrib import nnx  # pylint: disable=g-import-not-at-top
  return nnx


def _is_graph_state(x) -> bool:
  nnx = nnx_module()
  return nnx is not None and isinstance(x, nnx.GraphState)


def is_state(x) -> bool:
  """Whether ``x`` is a step's state: a TrainState, or its NNX objects' GraphState."""
  return is_train_state(x) or _is_graph_state(x)


def _as_tuple(x) -> tuple:
  if x is None:
    return ()
  if isinstance(x, (int, str)):
    return (x,)
  return tuple(x)


class ArgSpec:
  """Which positional and keyword arguments are static or donated."""

  def __init__(self, fun: Callable, options: dict):
    try:
      params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
      params = []
    positional = [p.name for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    self._names = positional

    def resolve(nums_key, names_key):
      nums = {n % len(positional) if n < 0 and positional else n
              for n in _as_tuple(options.get(nums_key))}
      names = set(_as_tuple(options.get(names_key)))
      nums |= {positional.index(n) for n in names if n in positional}
      names |= {positional[n] for n in nums if n < len(positional)}
      return frozenset(nums), frozenset(names)

    self.static_nums, self.static_names = resolve("static_argnums", "static_argnames")
    self.has_static = bool(self.static_nums or self.static_names)
    self.donate_nums, self.donate_names = resolve("donate_argnums", "donate_argnames")

  def split(self, args: tuple, kwargs: dict):
    """(dynamic positional args, dynamic kwargs, static values, dynamic positions)."""
    static = []
    dyn_args, positions = [], []
    for i, a in enumerate(args):
      if i in self.static_nums:
        static.append((i, a))
      else:
        dyn_args.append(a)
        positions.append(i)
    dyn_kwargs = {}
    for k in sorted(kwargs):
      if k in self.static_names:
        static.append((k, kwargs[k]))
      else:
        dyn_kwargs[k] = kwargs[k]
    return tuple(dyn_args), dyn_kwargs, tuple(static), tuple(positions)

  @staticmethod
  def merge(dyn_args, dyn_kwargs, static, positions):
    args = dict(zip(positions, dyn_args))
    kwargs = dict(dyn_kwargs)
    for key, value in static:
      if isinstance(key, int):
        args[key] = value
      else:
        kwargs[key] = value
    return tuple(args[i] for i in sorted(args)), kwargs

  def donated_leaves(self, dyn_args, dyn_kwargs, positions) -> list[bool]:
    flags = []
    for p, a in zip(positions, dyn_args):
      flags += [p in self.donate_nums] * len(jax.tree.leaves(a))
    for k, v in dyn_kwargs.items():
      flags += [k in self.donate_names] * len(jax.tree.leaves(v))
    return flags


@dataclasses.dataclass(frozen=True)
class Call:
  """One call of a step, split as its program sees it.

  Attributes:
    dyn_args: the dynamic positional arguments.
    dyn_kwargs: the dynamic keyword arguments.
    static: ``(position or name, value)`` of each static argument.
    positions: the positions of ``dyn_args`` among all positional arguments.
    leaves: the flat dynamic inputs, as jax.Arrays.
    in_tree: their tree structure.
    placement: without in_shardings, each leaf's mesh sharding (else None).
    nnx: whether the call passed NNX objects (its state is then a GraphState).
  """

  dyn_args: tuple
  dyn_kwargs: dict
  static: tuple
  positions: tuple
  leaves: list
  in_tree: Any
  placement: tuple | None
  nnx: bool = False

  @property
  def program_key(self) -> tuple:
    """Calls with equal keys run the same program: as ``jax.jit``, a call with
    other shapes, dtypes or weak types traces again."""
    return self.in_tree, self.positions, self.placement, tuple(
        (x.shape, x.dtype, weak_type(x)) for x in self.leaves)

  @property
  def specs(self) -> list[jax.ShapeDtypeStruct]:
    """The leaves' types; weak types kept (a Python scalar, Flax's ``step=0``) as
    ``jax.jit`` keeps them, so the step computes in the dtypes ``jax.jit`` would."""
    return [jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=weak_type(x))
            for x in self.leaves]


@dataclasses.dataclass(frozen=True)
class Inputs:
  """A call's flat inputs classified into state and batch evidence."""

  state: Any  # the state argument: a TrainState, or proof.attest's state
  state_indices: list[int]
  batch_indices: list[int]
  state_layouts: list[LeafLayout]
  batch_layouts: list[LeafLayout]
  params_mask: list[bool]


def classify(call: Call, start: int, state) -> Inputs:
  """Splits the flat inputs into the state's leaves (from flat input ``start``) and batch
  evidence."""
  state_paths = trees.paths(state)
  state_indices = list(range(start, start + len(state_paths)))
  batch_indices = [i for i in range(len(call.leaves))
                   if not start <= i < start + len(state_paths)]
  all_paths = trees.paths((call.dyn_args, call.dyn_kwargs))
  return Inputs(
      state=state, state_indices=state_indices, batch_indices=batch_indices,
      state_layouts=[arrays.layout_of(p, call.leaves[i], sharded=True)
                     for p, i in zip(state_paths, state_indices)],
      batch_layouts=[arrays.batch_layout_of(all_paths[i], call.leaves[i])
                     for i in batch_indices],
      params_mask=(state.params_mask() if call.nnx
                   else [digest.is_params_path(p) for p in state_paths]))


def locate_state(call: Call, proof, name: str, state_argnum: int | None) -> tuple[int, Any]:
  """(index of its first flat leaf, state object) of the state argument: the one
  ``TrainState`` (NNX: GraphState), or under ``proof.attest`` argument ``state_argnum``."""
  if state_argnum is not None:
    if state_argnum not in call.positions:
      raise errors.StepInputError(
          f"{name}: state_argnum={state_argnum} is not a "
          "dynamic positional argument of this call.")
    k = call.positions.index(state_argnum)
    return len(jax.tree.leaves(call.dyn_args[:k])), call.dyn_args[k]
  found = trees.find_nodes((call.dyn_args, call.dyn_kwargs), is_state)
  if len(found) != 1:
    raise errors.StepInputError(
        f"{name} received {len(found)} zkdv.jax.contrib.TrainState "
        "arguments; a proof.jit step takes exactly one. Create the state with "
        "zkdv.jax.contrib.TrainState.create(proof=proof, ...) (with Flax NNX, pass "
        "the model and a zkdv.jax.contrib.nnx.Optimizer(model, tx, wrt=..., "
        "proof=proof)), or use proof.attest(fn, state_argnum=...) for a loop "
        "without TrainState.")
  start, state = found[0]
  if state.proof is not proof:
    kind = "zkdv.jax.contrib.nnx.Optimizer" if call.nnx else "TrainState"
    raise errors.ProofIdentityError(
        f"the {kind} passed to {name} was created with "
        f"proof={state.proof!r}, not with the proof that compiled it "
        f"({proof!r}).")
  return start, state


def check_updates(closed, proof, name: str, manual: bool) -> None:
  """Raises unless the step performs exactly one update of ``proof`` (none under
  ``proof.attest``, which attests the whole call)."""
  sites = find_updates(closed.jaxpr)
  if manual:
    if sites.count:
      raise errors.AttestedProgramAlreadyRegisteredError(
          f"{name} is registered with proof.attest but calls "
          "TrainState.apply_gradients(), which ZKDV already attests.")
    return
  if sites.count == 0:
    raise errors.NoTranscriptUpdateError(
        f"{name} is compiled with proof.jit but never calls "
        "state.apply_gradients() (or, with Flax NNX, optimizer.update()), so it "
        "has no update to commit. Use jax.jit (nnx.jit) for steps that do not "
        "update the state.")
  if sites.count > 1:
    raise errors.UnsupportedUpdateError(
        f"{name} calls apply_gradients() {sites.count} times (or, with "
        "Flax NNX, optimizer.update()); ZKDV commits one optimizer update per "
        "proof.jit call. Split the step into one update per call, or attest it "
        "whole: keep Flax's own TrainState (flax.training.train_state.TrainState) "
        f"and wrap the step with proof.attest({name}, state_argnum=...), "
        "which commits each call, all its updates together, as one step.")
  if sites.proof_ids != {id(proof)}:
    raise errors.ProofIdentityError(
        f"{name} updates a TrainState created with another proof "
        "object.")


def locate_post_state(out_shape, inputs: Inputs, name: str,
                      state_argnum: int | None) -> list[int]:
  """The flat output indices of the post-state: the ``TrainState`` (NNX: GraphState)
  the step returns; under ``proof.attest``, the one output shaped as the state."""
  if state_argnum is not None:
    shaped_as_state = trees.shaped_as(inputs.state)
    found = trees.find_nodes(out_shape, shaped_as_state)
    if len(found) != 1:
      raise errors.StepOutputError(
          f"{name} is attested with state_argnum={state_argnum} and "
          f"returns {trees.count_phrase(out_shape, shaped_as_state)} with that argument's "
          "structure and shapes; it must return the new state once: alone, or beside "
          "outputs shaped otherwise (a loss, metrics).")
  else:
    found = trees.find_nodes(out_shape, is_state)
    if len(found) != 1:
      raise errors.StepOutputError(
          f"{name} must return the updated state "
          "(`return state.apply_gradients(grads=grads)`, optionally with other "
          f"outputs); it returned {len(found)} states.")
  start, state = found[0]
  post = jax.tree.leaves(state)
  post_shapes = [tuple(x.shape) for x in post]
  state_layouts = inputs.state_layouts
  # As under jax.jit, a leaf may come back in another dtype (bf16 moments updated by
  # f32 gradients): the program's post-state layout says so, and the next call, with
  # the new dtype, runs a program of its own.
  if len(post) != len(state_layouts) or any(
      l.key_impl is None and l.shape != p for l, p in zip(state_layouts, post_shapes)):
    raise errors.StepOutputError(
        f"{name} returns a state whose leaves "
        f"{[(p, str(x.dtype)) for p, x in zip(post_shapes, post)]} differ from the "
        f"state it received {[(l.shape, l.dtype) for l in state_layouts]}; an update "
        "must keep every state leaf's shape.")
  return list(range(start, start + len(post)))


def metric_outputs(out_shape, post_indices) -> list[tuple[str, int]]:
  """(metric name, flat output index) of each output beside the post-state.

  Example: a step returning ``(state, {"loss": l})`` has ``[("loss", n)]``,
  ``n`` the number of state leaves. Past ``metrics.MAX_METRICS`` outputs, the
  rest are not committed (a warning says so).
  """
  post = set(post_indices)
  paths = [(i, tuple(trees.key_of(k) for k in path)) for i, (path, _) in
           enumerate(jax.tree_util.tree_flatten_with_path(out_shape)[0]) if i not in post]
  if len(paths) > metrics.MAX_METRICS:
    logging.getLogger("zkdv").warning(
        "ZKDV: the step returns %d outputs beside the state; the first %d are committed as "
        "step metrics, the rest are not.", len(paths), metrics.MAX_METRICS)
    paths = paths[:metrics.MAX_METRICS]
  return list(zip(metrics.output_names([p for _, p in paths]), [i for i, _ in paths]))


def untrained_as_batch(call: Call, inputs: Inputs, closed,
                        post_indices: list[int]) -> tuple[Inputs, list[int]]:
  """An NNX step's inputs and post-state with its untrained state (``nnx.chained_leaves``)
  moved to batch evidence: each step commits it as it receives it."""
  keep = nnx_module().chained_leaves(inputs.state, closed.jaxpr, inputs.state_indices, post_indices)
  if len(keep) == len(inputs.state_indices):
    return inputs, post_indices
  state_indices = [inputs.state_indices[k] for k in keep]
  batch_indices = sorted(set(range(len(call.leaves))) - set(state_indices))
  all_paths = trees.paths((call.dyn_args, call.dyn_kwargs))
  return dataclasses.replace(
      inputs, state_indices=state_indices, batch_indices=batch_indices,
      state_layouts=[inputs.state_layouts[k] for k in keep],
      batch_layouts=[arrays.batch_layout_of(all_paths[i], call.leaves[i])
                     for i in batch_indices],
      params_mask=[inputs.params_mask[k] for k in keep]), [post_indices[k] for k in keep]
