"""Flax NNX's ``Optimizer``, with its update marked for ZKDV, and NNX objects under ``proof.jit``.

An NNX user adopts ZKDV with the same two changes as a Linen user: their
optimizer and their jit. ``proof.jit`` takes NNX objects (modules, optimizers,
metrics, variables) among its arguments as ``nnx.jit`` does: their state is
split out, the pure step runs (exported, committed, replayable), and the new
state is written back into the same objects in place.

Example::

  model = MLP(rngs=nnx.Rngs(0))
  optimizer = zkdv.jax.contrib.nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param,
                                             proof=proof)

  @proof.jit
  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss

  loss = train_step(model, optimizer, x, y)  # model and optimizer are updated in place
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax import struct

from zkdv import errors
from zkdv import overlap as overlap_lib
from zkdv.interpreters import dataflow
from zkdv.interpreters.marker import mark_update
from zkdv.jax import _compat


class Optimizer(nnx.Optimizer):
  """Flax's ``nnx.Optimizer`` whose ``update`` a ZKDV proof can attest.

  Under ``proof.jit`` each ``update`` call becomes one transcript step; under
  ``nnx.jit``, ``jax.jit`` or eagerly it is plain Flax.

  Example::

    optimizer = Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param, proof=proof)
    optimizer.update(model, grads)

  Attributes:
    proof: the ``zkdv.jax.ZKDV`` driver that owns this optimizer's updates.
    zkdv_overlap: a ``zkdv.overlap`` policy for commitments and checks.
  """

  def __init__(self, model, tx: optax.GradientTransformation, *, wrt, graph: bool | None = None,
               proof=None, zkdv_overlap: overlap_lib.Overlap = overlap_lib.UNCHECKED):
    if not isinstance(zkdv_overlap, overlap_lib.Overlap):
      raise TypeError("zkdv_overlap must be zkdv.overlap.UNCHECKED, ALWAYS or "
                      f"NEVER, got {zkdv_overlap!r}.")
    super().__init__(model, tx, wrt=wrt, graph=graph)
    self.proof = proof
    self.zkdv_overlap = zkdv_overlap

  def update(self, model, *args, **kwargs):
    """Flax's ``update``, with the new params and optimizer state marked as an update.

    Example: ``optimizer.update(model, grads)``.
    """
    updates = super().update(model, *args, **kwargs)
    proof_id = None if self.proof is None else id(self.proof)
    states = (nnx.state(model, self.wrt, graph=self.graph), nnx.state(self, graph=self.graph))
    leaves, treedef = jax.tree.flatten(states)
    params, opt_state = jax.tree.unflatten(treedef, mark_update(leaves, proof_id=proof_id))
    nnx.update(model, params)
    nnx.update(self, opt_state)
    return updates


class GraphState(struct.PyTreeNode):
  """The state of a step's NNX objects, as ``proof.jit`` passes it to the pure step.

  ``proof.jit`` builds it from the step's arguments (``split_graph``); the
  pure step rebuilds the objects from it (``merge``) and returns the new one.

  Attributes:
    state: the ``nnx.State`` of every NNX object among the arguments.
    graphdef: their structure (static: a changed structure traces again).
    proof: the proof of the ``Optimizer`` among them.
    zkdv_overlap: that optimizer's overlap policy.
    trained_types: the variable types that are trained state, or None if every
      variable is (``trained_mask``).
  """

  state: Any
  graphdef: Any = struct.field(pytree_node=False)
  proof: Any = struct.field(pytree_node=False)
  zkdv_overlap: overlap_lib.Overlap = struct.field(pytree_node=False)
  attest_apply_fn: Callable | None = struct.field(pytree_node=False, default=None)
  trained_types: tuple[type, ...] | None = struct.field(pytree_node=False, default=None)

  def _per_leaf(self, predicate: Callable[[nnx.Variable], bool]) -> list[bool]:
    variables = jax.tree.leaves(self.state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return [predicate(v) for v in variables for _ in jax.tree.leaves(v)]

  def params_mask(self) -> list[bool]:
    """Per flat leaf, whether it is an ``nnx.Param`` of a model (not optimizer state)."""
    return self._per_leaf(lambda v: isinstance(v, nnx.Param))

  def trained_mask(self) -> list[bool]:
    """Per flat leaf, whether it is trained state: what the optimizer updates (its
    ``wrt`` variables, ``nnx.Param``), the optimizer's own state and a model's
    ``nnx.BatchStat`` (``chained_leaves`` adds what these depend on).

    Example: ``[True, True, False]`` for a kernel, a bias and a metric's count.
    """
    if self.trained_types is None:
      return self._per_leaf(lambda v: True)
    return self._per_leaf(lambda v: isinstance(v, self.trained_types))


class _NodeRef(struct.PyTreeNode):
  """Stands for the ``index``-th NNX object of a call in the pure step's arguments."""

  index: int = struct.field(pytree_node=False)


@functools.cache
def _plain_leaf_types() -> frozenset[type]:
  """Leaf types that are never NNX graph nodes: jax.Array's concrete type (a mutable
  ``jax.Ref`` has its own), numpy arrays and Python scalars."""
  return frozenset({type(jnp.zeros(())), np.ndarray, bool, int, float, complex})


def _is_node(x) -> bool:
  """Whether ``x`` is an NNX graph node; a plain array (most leaves of a call) is answered
  by its type, as ``nnx.graphlib.is_graph_node`` inspects each array's abstract type."""
  return type(x) not in _plain_leaf_types() and nnx.graphlib.is_graph_node(x)


def _the_optimizer(nodes: tuple, name: str) -> Optimizer:
  found = {id(n): n for _, n in nnx.iter_graph(nodes) if isinstance(n, nnx.Optimizer)}
  ours = [n for n in found.values() if isinstance(n, Optimizer)]
  if len(ours) != 1:
    kinds = sorted({type(n).__name__ for n in nodes})
    plain = len(found) - len(ours)
    raise errors.StepInputError(
        f"{name} received the NNX objects {kinds} with {len(ours)} "
        f"zkdv.jax.contrib.nnx.Optimizer{'s' if len(ours) != 1 else ''}"
        f"{f' and {plain} plain nnx.Optimizer' if plain else ''}; a proof.jit step "
        "updates exactly one. Create it with zkdv.jax.contrib.nnx.Optimizer("
        "model, tx, wrt=nnx.Param, proof=proof).")
  return ours[0]


def _trained_types(wrt) -> tuple[type, ...] | None:
  """The variable types of trained state for an optimizer of ``wrt``; None (every
  variable is) when ``wrt`` is a filter other than variable types."""
  types = wrt if isinstance(wrt, tuple) else (wrt,)
  if not all(isinstance(t, type) and issubclass(t, nnx.Variable) for t in types):
    return None
  return (nnx.Param, nnx.BatchStat, nnx.OptState, *types)


# Call structures (pytree definitions) found to hold no NNX object. Whether a pytree node
# is a graph node depends on its type alone, which its definition records, so a call with a
# known definition and plain leaves holds none: a Linen TrainState step skips the search.
_WITHOUT_NODES: set = set()


def _plain_structure(args: tuple, kwargs: dict, flat=None):
  """The call's pytree definition if every leaf is a plain array or scalar and the
  definition can be hashed, else None. ``flat``: ``jax.tree.flatten((args, kwargs))``
  if the caller has it."""
  leaves, treedef = flat or jax.tree.flatten((args, kwargs))
  if not all(type(x) in _plain_leaf_types() for x in leaves):
    return None
  try:
    hash(treedef)
  except TypeError:  # a static field that cannot be hashed
    return None
  return treedef


def split_graph(args: tuple, kwargs: dict, name: str, flat=None):
  """(pure args, pure kwargs, the NNX objects) of a call; None if it passes no NNX object.

  The first NNX object's place holds the ``GraphState`` of all of them (split
  together, so shared variables stay shared); the others hold a ``_NodeRef``.
  """
  _compat.drop_nnx_static_cache()  # nnx.cached_partial's, for an NNX transform: unused
  structure = _plain_structure(args, kwargs, flat)
  if structure is not None and structure in _WITHOUT_NODES:
    return None
  leaves = jax.tree.leaves((args, kwargs), is_leaf=_is_node)
  nodes = tuple({id(x): x for x in leaves if _is_node(x)}.values())
  if not nodes:
    if structure is not None:
      if len(_WITHOUT_NODES) >= 64:
        _WITHOUT_NODES.clear()
      _WITHOUT_NODES.add(structure)
    return None
  optimizer = _the_optimizer(nodes, name)
  graphdef, state = nnx.split(nodes)
  graph_state = GraphState(state, graphdef, optimizer.proof, optimizer.zkdv_overlap,
                           trained_types=_trained_types(optimizer.wrt))
  index = {id(n): i for i, n in enumerate(nodes)}
  placed = set()

  def pure(x):
    if not _is_node(x):
      return x
    i = index[id(x)]
    if placed:
      return _NodeRef(i)
    placed.add(i)
    return graph_state
  pure_args, pure_kwargs = jax.tree.map(pure, (args, kwargs), is_leaf=_is_node)
  return pure_args, pure_kwargs, nodes


def stateful(fun: Callable, name: str) -> Callable:
  """``fun`` on pure arguments (``split_graph``'s): it rebuilds the NNX objects, runs
  ``fun`` and returns ``(new GraphState, fun's outputs)``."""
  def step(*args, **kwargs):
    found = [x for x in jax.tree.leaves((args, kwargs), is_leaf=_is_graph_state)
             if isinstance(x, GraphState)]
    graph_state = found[0]
    nodes = nnx.merge(graph_state.graphdef, graph_state.state)

    def restore(x):
      if isinstance(x, GraphState):
        return nodes[0]
      return nodes[x.index] if isinstance(x, _NodeRef) else x
    args, kwargs = jax.tree.map(restore, (args, kwargs), is_leaf=_is_graph_state)
    outs = fun(*args, **kwargs)
    if any(_is_node(x) for x in jax.tree.leaves(outs, is_leaf=_is_node)):
      raise errors.StepOutputError(
          f"{name} returns an NNX object; under proof.jit (as under nnx.jit with "
          "in-place updates) the objects it receives are updated in place: return "
          "arrays only (a loss, metrics).")
    graphdef, state = nnx.split(nodes)
    if graphdef != graph_state.graphdef:
      raise errors.StepOutputError(
          f"{name} changes the structure of its NNX objects (adds, removes or "
          "retypes an attribute or variable); a step may change only their values.")
    return graph_state.replace(state=state), outs
  return step


def chained_leaves(graph_state: GraphState, jaxpr, state_indices: list[int],
                   post_indices: list[int]) -> list[int]:
  """The positions, among the state's leaves, of those that stay in the chain.

  Trained state (``GraphState.trained_mask``) stays, and so does every leaf that a
  chained output can depend on (by dataflow on the step's ``jaxpr``, whose inputs
  ``state_indices`` and outputs ``post_indices`` are the state's, to a fixed point).
  The rest (metrics, counters, an RNG stream the update does not use) cannot influence
  the trained state: it may change between steps (``metrics.reset()``, an eval step).

  Example: ``[0, 1]`` for a kernel, a bias and a metric's count that nothing reads.
  """
  deps = dataflow.dependencies(jaxpr)
  chained = {k for k, trained in enumerate(graph_state.trained_mask()) if trained}
  while True:
    needed = frozenset().union(*(deps[post_indices[k]] for k in chained))
    grown = chained | {k for k, i in enumerate(state_indices) if i in needed}
    if grown == chained:
      return sorted(chained)
    chained = grown


def _is_graph_state(x) -> bool:
  return isinstance(x, (GraphState, _NodeRef))


def holds_node(tree) -> bool:
  """Whether a pure argument (``split_graph``'s) stands for an NNX object."""
  return any(_is_graph_state(x) for x in jax.tree.leaves(tree, is_leaf=_is_graph_state))


def write_back(nodes: tuple, graph_state: GraphState) -> None:
  """Writes the step's new state into the caller's NNX objects, as ``nnx.jit`` does."""
  nnx.update(nodes, graph_state.state)
