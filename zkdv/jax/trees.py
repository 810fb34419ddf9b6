"""Finding a step's state among its arguments and outputs, and its shardings per leaf.

Example: ``find_nodes((x, state), is_train_state)`` is ``[(1, state)]``.
"""

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from zkdv.jax import _compat


def find_nodes(tree, is_node: Callable[[Any], bool]) -> list[tuple[int, Any]]:
  """``(index of its first flat leaf, node)`` of each node of ``tree`` that ``is_node`` picks.

  Example: ``find_nodes((x, state), is_train_state)`` is ``[(1, state)]``.
  """
  found, start = [], 0
  for node in jax.tree.leaves(tree, is_leaf=is_node):
    if is_node(node):
      found.append((start, node))
    start += len(jax.tree.leaves(node))
  return found


def paths(tree) -> list[str]:
  """Each leaf's key path as a string: ``paths({"w": w})`` is ``["['w']"]``."""
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def key_of(entry):
  """A key path entry's dict key, attribute name or index."""
  for field in ("key", "name", "idx"):
    if hasattr(entry, field):
      return getattr(entry, field)
  return str(entry)


def shaped_as(state) -> Callable[[Any], bool]:
  """Whether a node of a step's outputs has ``state``'s tree structure and leaf shapes.

  Example: for ``state = (params, opt_state)``, ``(new_params, new_opt_state)`` is.
  """
  structure = jax.tree.structure(state)
  shapes = [np.shape(x) for x in jax.tree.leaves(state)]

  def matches(node) -> bool:
    return (jax.tree.structure(node) == structure
            and [np.shape(x) for x in jax.tree.leaves(node)] == shapes)
  return matches


def count_phrase(out_shape, is_node: Callable[[Any], bool]) -> str:
  """How many nodes of ``out_shape`` ``is_node`` picks, and where: ``"2 outputs (at [0],
  [1])"``."""
  where = [jax.tree_util.keystr(path) or "the top" for path, node in
           jax.tree_util.tree_flatten_with_path(out_shape, is_leaf=is_node)[0] if is_node(node)]
  return f"{len(where)} outputs (at {', '.join(where)})" if where else "no output"


def flat_prefix(shardings, tree) -> list:
  """One sharding per leaf of ``tree``, ``shardings`` a prefix of it; as ``jax.jit``, a
  None in it leaves its subtree unspecified (XLA places it).

  Example: ``flat_prefix((s, None), (state, {"loss": l}))`` is ``[s] * n + [None]``.
  """
  return _compat.broadcast_prefix(shardings, tree, is_leaf=lambda x: x is None)
