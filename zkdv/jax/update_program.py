"""One exported update program and how production runs it and the prover replays it.

Example::

  program.replay(*inputs)             # the update program on inputs it may consume
  program.input_layouts[i].path       # names flat input i
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from zkdv.digest import LeafLayout
from zkdv.jax import _compat
from zkdv.jax import arrays
from zkdv.jax import replay


@dataclasses.dataclass
class Program:
  """One exported update program and how production calls it."""

  program_id: bytes
  blob: bytes
  exact: bool
  record: dict
  avals: list
  out_tree: Any
  state_indices: list[int]
  batch_indices: list[int]
  post_indices: list[int]
  state_layouts: list[LeafLayout]  # as the program takes the state
  batch_layouts: list[LeafLayout]
  params_mask: list[bool]
  donated: list[bool]
  overlap: Any
  executable: Callable
  compiler_options: dict | None
  debug_calls: list = dataclasses.field(default_factory=list)  # emitted after each run
  post_layouts: list[LeafLayout] | None = None  # as it returns it; set by the first run
  metric_outputs: list[tuple[str, int]] = dataclasses.field(default_factory=list)
  weak_types: tuple[bool, ...] = ()  # of the inputs, as production's executable takes them
  replay_executable: Callable | None = None  # an exact program's: production's own
  commits_state: bool = False  # an exact program on one device: see ``placed``
  _batch_committed: bool = False  # the last production step's batch was committed
  _replay_sharded: Any = None

  @functools.cached_property
  def input_layouts(self) -> list[LeafLayout]:
    """The layout of each flat input, state and batch leaves in input order.

    Example: ``program.input_layouts[i].path`` names input ``i``.
    """
    layouts = dict(zip(self.state_indices, self.state_layouts))
    layouts.update(zip(self.batch_indices, self.batch_layouts))
    return [layouts[i] for i in range(len(layouts))]

  def place_post_state(self, post: list) -> None:
    """Lays the post-state out as the first run placed it (pieces are its own shards)."""
    self.post_layouts = [l if l.key_impl else arrays.layout_of(l.path, x, sharded=True)
                         for l, x in zip(self.state_layouts, post)]
    if self.post_layouts != self.state_layouts:
      self.record["post_state_layout"] = [l.to_record() for l in self.post_layouts]

  def replay(self, *inputs: jax.Array):
    """Runs the update program on ``inputs``, which it may consume (as production, it
    donates the donated ones): fresh arrays nothing else holds.

    An exact program runs production's executable, compiled once from the serialized
    program (as a verifier compiles it); an equivalent one, the serialized program
    compiled as a verifier does (production runs its own ``apply_fn``).
    """
    if self.replay_executable is None:  # an equivalent program
      self.replay_executable = replay.compile_program(jax.export.deserialize(self.blob),
                                                      compiler_options=self.compiler_options)
    if self.exact:  # as production's types and placement: no second trace and compilation
      inputs = [_compat.weakly_typed(x) if weak and not weak_type(x) else x
                for x, weak in zip(inputs, self.weak_types)]
      if self.commits_state:
        inputs = committed(inputs, set(self.state_indices) | (
            set(self.batch_indices) if self._batch_committed else set()))
    return self.replay_executable(*inputs)

  def placed(self, leaves: list) -> list:
    """Production's inputs, as its executable runs them.

    A jitted exported call is lowered again when an input goes from uncommitted (a new
    ``TrainState``) to committed (a step's outputs), so an exact program on one device
    takes its state committed where it is: one compilation, not two. Batches stay as
    they come (a new uncommitted batch each step, as a numpy batch is); a replay places
    them as the last step had them.
    """
    if not self.commits_state:
      return leaves
    self._batch_committed = all(leaves[i].committed for i in self.batch_indices)
    if all(leaves[i].committed for i in self.state_indices):
      return leaves
    return committed(leaves, set(self.state_indices))

  def replay_sharded(self, opened: list[np.ndarray]) -> list[np.ndarray]:
    """``replay`` on whole host inputs, placed as the program takes them; returns
    the whole post-state. Every process of a multi-process run calls it."""
    if self._replay_sharded is None:
      self._replay_sharded = replay.compile_program(
          jax.export.deserialize(self.blob), compiler_options=self.compiler_options).lower(
          *[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in self.avals]).compile()
    shardings = self._replay_sharded.input_shardings[0]
    outs = self._replay_sharded(*[arrays.to_global(a, l, s) for a, l, s in
                                  zip(opened, self.input_layouts, shardings)])
    return [arrays.gather(outs[i]) for i in self.post_indices]


def committed(leaves: list, indices: set[int]) -> list:
  """``leaves`` with those at ``indices`` committed to the device they are on (no copy)."""
  return [jax.device_put(x, x.sharding) if i in indices and not x.committed else x
          for i, x in enumerate(leaves)]


def weak_type(x: jax.Array) -> bool:
  return getattr(x, "weak_type", False)  # a PRNG key array has none
