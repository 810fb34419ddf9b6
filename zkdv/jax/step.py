"""``proof.jit`` and ``proof.attest``: tracing, classifying and exporting a step.

On the first call a step is traced (static arguments fixed), its update is
found through the marker, its flat inputs are classified into state and batch
evidence, and the update program is exported with ``jax.export``. Production
then runs that exported program, compiled exactly as a verifier compiles it,
so sampled replays are bitwise equal on the same platform.

Example::

  train_step = ProofFunction(proof, step_fn, {"donate_argnums": (0,)})
  state = train_step(state, batch)  # first call: classify, export, compile, record
"""

import dataclasses
import functools
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import blake3
import jax
import numpy as np

from zkdv import errors
from zkdv import metrics
from zkdv.digest import LeafLayout
from zkdv.interpreters import debug_calls as debug_calls_lib
from zkdv.interpreters.find import find_updates
from zkdv.jax import _compat
from zkdv.jax import arrays
from zkdv.jax.contrib.train_state import TrainState
from zkdv.jax import replay
from zkdv.jax import trees

JIT_OPTIONS = frozenset({
    "in_shardings", "out_shardings", "static_argnums", "static_argnames",
    "donate_argnums", "donate_argnames", "keep_unused", "device", "backend",
    "inline", "compiler_options"})


def _is_train_state(x) -> bool:
  return isinstance(x, TrainState)


def _nnx():
  """``zkdv.jax.contrib.nnx`` once the program uses Flax NNX, else None (no NNX
  object can then be passed, and importing NNX costs a quarter of a second)."""
  if "flax.nnx" not in sys.modules:
    return None
  from zkdv.jax.contrib import nnx  # pylint: disable=g-import-not-at-top
  return nnx


def _is_graph_state(x) -> bool:
  nnx = _nnx()
  return nnx is not None and isinstance(x, nnx.GraphState)


def _is_state(x) -> bool:
  """Whether ``x`` is a step's state: a TrainState, or its NNX objects' GraphState."""
  return _is_train_state(x) or _is_graph_state(x)


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
      inputs = [_compat.weakly_typed(x) if weak and not _weak_type(x) else x
                for x, weak in zip(inputs, self.weak_types)]
      if self.commits_state:
        inputs = _committed(inputs, set(self.state_indices) | (
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
    return _committed(leaves, set(self.state_indices))

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


@dataclasses.dataclass(frozen=True)
class _Call:
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
        (x.shape, x.dtype, _weak_type(x)) for x in self.leaves)

  @property
  def specs(self) -> list[jax.ShapeDtypeStruct]:
    """The leaves' types; weak types kept (a Python scalar, Flax's ``step=0``) as
    ``jax.jit`` keeps them, so the step computes in the dtypes ``jax.jit`` would."""
    return [jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=_weak_type(x))
            for x in self.leaves]


@dataclasses.dataclass(frozen=True)
class _Inputs:
  """A call's flat inputs classified into state and batch evidence."""

  state: Any  # the state argument: a TrainState, or proof.attest's state
  state_indices: list[int]
  batch_indices: list[int]
  state_layouts: list[LeafLayout]
  batch_layouts: list[LeafLayout]
  params_mask: list[bool]


def _mesh_sharding(x) -> jax.sharding.NamedSharding | None:
  """The leaf's sharding if it is placed on a mesh of several devices, else None."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.device_set) > 1:
    return sharding
  return None


def _committed(leaves: list, indices: set[int]) -> list:
  """``leaves`` with those at ``indices`` committed to the device they are on (no copy)."""
  return [jax.device_put(x, x.sharding) if i in indices and not x.committed else x
          for i, x in enumerate(leaves)]


def _weak_type(x: jax.Array) -> bool:
  return getattr(x, "weak_type", False)  # a PRNG key array has none


def _avals(leaves) -> list:
  return [(tuple(x.shape), x.dtype) for x in leaves]


def _flat_outputs(fun: Callable) -> Callable:
  """``fun`` returning its outputs' flat leaves; it keeps ``fun``'s name."""
  def flat(*inputs):
    return tuple(jax.tree.leaves(fun(*inputs)))
  flat.__name__ = flat.__qualname__ = fun.__name__
  return flat


def _metric_outputs(out_shape, post_indices) -> list[tuple[str, int]]:
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


class ProofFunction:
  """A training step compiled by ``proof.jit`` (or ``proof.attest``).

  Example::

    train_step = proof.jit(step_fn, donate_argnums=(0,))  # a ProofFunction
    state = train_step(state, batch)
  """

  def __init__(self, proof, fun: Callable, jit_options: dict, *,
               state_argnum: int | None = None):
    unknown = set(jit_options) - JIT_OPTIONS
    if unknown:
      raise TypeError(f"proof.jit got unknown options {sorted(unknown)}; it "
                      f"accepts the jax.jit options {sorted(JIT_OPTIONS)}.")
    self._proof = proof
    self._fun = fun
    self._options = dict(jit_options)
    self._spec = ArgSpec(fun, jit_options)
    self._state_argnum = state_argnum
    self._static = None
    self._programs: dict[Any, Program] = {}
    self.__name__ = type(fun).__name__  # for callables without one (functools.partial)
    functools.update_wrapper(self, fun)

  @property
  def manual(self) -> bool:
    return self._state_argnum is not None

  def __call__(self, *args, **kwargs):
    self._proof.ensure_started()
    self._proof.note_call(self.__name__)
    # Without static arguments, the flat call is the flat dynamic one: flattened once.
    flat = None if self._spec.has_static else jax.tree.flatten((args, kwargs))
    nnx = _nnx()
    graph = None if nnx is None else nnx.split_graph(args, kwargs, self.__name__, flat)
    if graph is not None:  # as nnx.jit: the NNX objects' state in, their new state out
      args, kwargs, nodes = graph
      flat = None
    call = self._split(args, kwargs, nnx=graph is not None, flat=flat)
    program = self._programs.get(call.program_key)
    if program is None:
      program = self._build(call)
      self._programs[call.program_key] = program
      self._static = call.static
    flat = self._proof.run_step(program, program.placed(call.leaves))
    if program.debug_calls:  # the step's jax.debug.print values, returned by the program
      flat = debug_calls_lib.emit(program.debug_calls, flat)
    outs = jax.tree.unflatten(program.out_tree, flat)
    if graph is None:
      return outs
    graph_state, outs = outs
    nnx.write_back(nodes, graph_state)
    return outs

  def _split(self, args: tuple, kwargs: dict, nnx: bool = False, flat=None) -> _Call:
    """The call as its program sees it; ``flat``, when there are no static arguments,
    is ``jax.tree.flatten((args, kwargs))``."""
    dyn_args, dyn_kwargs, static, positions = self._spec.split(args, kwargs)
    if self._static is not None and static != self._static:
      raise errors.StaticArgumentError(
          f"{self.__name__} was attested with static arguments "
          f"{dict(self._static)!r} and is now called with {dict(static)!r}.")
    leaves, in_tree = flat or jax.tree.flatten((dyn_args, dyn_kwargs))
    leaves = [arrays.as_array(x) for x in leaves]
    # As jax.jit does, a step without in_shardings takes its inputs' own placement on a mesh
    # (and is traced again when it changes).
    placement = (None if self._options.get("in_shardings") is not None
                 else tuple(_mesh_sharding(x) for x in leaves))
    return _Call(dyn_args, dyn_kwargs, static, positions, leaves, in_tree, placement, nnx)

  # -- building the program: classify, trace, export, compile, record ----------

  def _build(self, call: _Call) -> Program:
    inputs = self._classify(call)
    closed, out_shape, post_indices = self._trace(call, inputs)
    if call.nnx:
      inputs, post_indices = _untrained_as_batch(call, inputs, closed, post_indices)
    exact = self.manual or inputs.state.attest_apply_fn is None
    donated = self._spec.donated_leaves(call.dyn_args, call.dyn_kwargs, call.positions)
    if call.nnx and not self._donates_every_nnx_argument(call):  # split together: all or none
      donated = [d and i not in inputs.state_indices for i, d in enumerate(donated)]
    shardings = self._flat_shardings(call, out_shape)
    exported, blob, debug_calls = self._export(call, closed, shardings, exact)
    executable = self._compile(call, exported, blob, exact, donated, shardings)
    self._proof.register(self)
    program_id = blake3.blake3(blob).digest()
    metric_outputs = _metric_outputs(out_shape, (  # nor are an NNX step's new objects
        range(len(jax.tree.leaves(out_shape[0]))) if call.nnx else post_indices))
    record = self._record(program_id, call, inputs, exported, post_indices, exact)
    if metric_outputs:
      record["metric_outputs"] = [list(m) for m in metric_outputs]
    return Program(
        program_id=program_id, blob=blob, exact=exact, record=record,
        metric_outputs=metric_outputs,
        avals=_avals(call.leaves), out_tree=jax.tree.structure(out_shape),
        state_indices=inputs.state_indices, batch_indices=inputs.batch_indices,
        post_indices=post_indices, state_layouts=inputs.state_layouts,
        batch_layouts=inputs.batch_layouts, params_mask=inputs.params_mask,
        donated=donated, overlap=None if self.manual else inputs.state.zkdv_overlap,
        executable=executable, compiler_options=self._options.get("compiler_options"),
        weak_types=tuple(s.weak_type for s in call.specs) if exact else (),
        replay_executable=executable if exact else None,
        commits_state=(exact and exported.nr_devices == 1 and not shardings
                        and not {"device", "backend"} & set(self._options)),
        debug_calls=debug_calls if exact else [])  # else production's jax.jit prints itself

  def _donates_every_nnx_argument(self, call: _Call) -> bool:
    """Whether every argument that holds an NNX object is donated (as ``nnx.jit``
    donates an object's state only when its argument is)."""
    holds = _nnx().holds_node
    return (all(p in self._spec.donate_nums
                for p, a in zip(call.positions, call.dyn_args) if holds(a))
            and all(k in self._spec.donate_names for k, v in call.dyn_kwargs.items() if holds(v)))

  def _classify(self, call: _Call) -> _Inputs:
    """Splits the flat inputs into the state's leaves and batch evidence."""
    start, state = self._locate_state(call)
    state_paths = trees.paths(state)
    state_indices = list(range(start, start + len(state_paths)))
    batch_indices = [i for i in range(len(call.leaves))
                     if not start <= i < start + len(state_paths)]
    all_paths = trees.paths((call.dyn_args, call.dyn_kwargs))
    return _Inputs(
        state=state, state_indices=state_indices, batch_indices=batch_indices,
        state_layouts=[arrays.layout_of(p, call.leaves[i], sharded=True)
                       for p, i in zip(state_paths, state_indices)],
        batch_layouts=[arrays.batch_layout_of(all_paths[i], call.leaves[i])
                       for i in batch_indices],
        params_mask=(state.params_mask() if call.nnx
                     else [p.startswith(".params") for p in state_paths]))

  def _locate_state(self, call: _Call) -> tuple[int, Any]:
    """(index of its first flat leaf, state object) of the state argument."""
    if self.manual:
      if self._state_argnum not in call.positions:
        raise errors.StepInputError(
            f"{self.__name__}: state_argnum={self._state_argnum} is not a "
            "dynamic positional argument of this call.")
      k = call.positions.index(self._state_argnum)
      return len(jax.tree.leaves(call.dyn_args[:k])), call.dyn_args[k]
    found = trees.find_nodes((call.dyn_args, call.dyn_kwargs), _is_state)
    if len(found) != 1:
      raise errors.StepInputError(
          f"{self.__name__} received {len(found)} zkdv.jax.contrib.TrainState "
          "arguments; a proof.jit step takes exactly one. Create the state with "
          "zkdv.jax.contrib.TrainState.create(proof=proof, ...) (with Flax NNX, pass "
          "the model and a zkdv.jax.contrib.nnx.Optimizer(model, tx, wrt=..., "
          "proof=proof)), or use proof.attest(fn, state_argnum=...) for a loop "
          "without TrainState.")
    start, state = found[0]
    if state.proof is not self._proof:
      kind = "zkdv.jax.contrib.nnx.Optimizer" if call.nnx else "TrainState"
      raise errors.ProofIdentityError(
          f"the {kind} passed to {self.__name__} was created with "
          f"proof={state.proof!r}, not with the proof that compiled it "
          f"({self._proof!r}).")
    return start, state

  def _step_on_flat_inputs(self, call: _Call, swap_apply_fn: bool = False) -> Callable:
    """The step as a function of the call's flat dynamic inputs (static ones bound).

    With ``swap_apply_fn`` the state's ``attest_apply_fn`` replaces ``apply_fn``
    (the replay program of an equivalent check).
    """
    fun = _nnx().stateful(self._fun, self.__name__) if call.nnx else self._fun

    def step(*flat):
      dyn_args, dyn_kwargs = jax.tree.unflatten(call.in_tree, flat)
      if swap_apply_fn:
        dyn_args, dyn_kwargs = jax.tree.map(
            lambda n: n.replace(apply_fn=n.attest_apply_fn) if _is_train_state(n) else n,
            (dyn_args, dyn_kwargs), is_leaf=_is_train_state)
      args, kwargs = ArgSpec.merge(dyn_args, dyn_kwargs, call.static, call.positions)
      return fun(*args, **kwargs)
    step.__name__ = self.__name__  # names the exported program and its executables
    return step

  def _trace(self, call: _Call, inputs: _Inputs) -> tuple[Any, Any, list[int]]:
    """(the step's jaxpr, its output shapes, the flat indices of the post-state among them).

    Raises when the step does not perform exactly one update of this proof.
    """
    closed, out_shape = jax.make_jaxpr(self._step_on_flat_inputs(call), return_shape=True)(
        *call.specs)
    self._check_updates(closed)
    return closed, out_shape, self._locate_post_state(out_shape, inputs)

  def _export(self, call: _Call, closed, shardings: dict,
              exact: bool) -> tuple[Any, bytes, list[debug_calls_lib.DebugCall]]:
    """(the exported update program, its serialized bytes, its debug callbacks): the
    whole step, every input kept. The operands of the step's debug callbacks
    (``jax.debug.print``) are extra outputs of the program, after the step's own."""
    step = _flat_outputs(self._step_on_flat_inputs(call, swap_apply_fn=not exact))
    debug_calls = []
    if debug_calls_lib.has_debug_calls(closed.jaxpr):
      if "out_shardings" in shardings:
        raise errors.ExportError(
            f"{self.__name__} calls jax.debug.print/jax.debug.callback and is given "
            "out_shardings; proof.jit returns printed values as extra outputs, which "
            "out_shardings does not place.",
            fix=f"Remove the print from {self.__name__}, or its out_shardings.")
      if not exact:  # the replay program's own jaxpr
        closed = jax.make_jaxpr(step)(*call.specs)
      step, debug_calls = debug_calls_lib.lift(closed, self.__name__)
    try:
      exported = _compat.without_locations(  # no paths of the prover's machine
          jax.export.export(jax.jit(step, keep_unused=True, **shardings))(*call.specs))
      return exported, bytes(exported.serialize()), list(debug_calls)
    except errors.ExportError:
      raise
    except Exception as e:  # jax.export raises many types; name what failed
      raise errors.ExportError(
          f"jax.export could not export the update program of "
          f"{self.__name__}: {type(e).__name__}: {e}") from e

  def _compile(self, call: _Call, exported, blob: bytes, exact: bool, donated: list[bool],
               shardings: dict) -> Callable:
    """What production runs: the exported program, compiled as a verifier compiles
    it; for an equivalent check, the step with its production ``apply_fn``.

    The program is the one deserialized from ``blob``, given the traced types of
    its inputs and outputs: serialization drops weak types, which change no bit
    of the program but keep the outputs weakly typed as under ``jax.jit``.
    """
    options = {k: self._options[k] for k in ("device", "backend", "inline") if k in self._options}
    options.update(shardings, donate_argnums=[i for i, d in enumerate(donated) if d],
                   compiler_options=self._options.get("compiler_options"))
    if exact:
      program = dataclasses.replace(jax.export.deserialize(blob), in_avals=exported.in_avals,
                                    out_avals=exported.out_avals)
      return replay.compile_program(program, **options)
    return jax.jit(_flat_outputs(self._step_on_flat_inputs(call)),
                   keep_unused=self._options.get("keep_unused", False),
                   **replay.placement(options))

  def _record(self, program_id: bytes, call: _Call, inputs: _Inputs, exported,
              post_indices: list[int], exact: bool) -> dict:
    """The transcript's ``program`` record."""
    compiler_options = self._options.get("compiler_options") or {}
    state_indices = set(inputs.state_indices)
    record = {
        "type": "program",
        "program_id": program_id,
        "blob": program_id,
        "function": getattr(self._fun, "__qualname__", repr(self._fun)),
        "mode": "exact" if exact else "equivalent",
        "state_layout": [l.to_record() for l in inputs.state_layouts],
        "batch_layout": [l.to_record() for l in inputs.batch_layouts],
        "inputs": ["state" if i in state_indices else "batch"
                   for i in range(len(call.leaves))],
        "post_state_outputs": post_indices,
        "params_leaves": [i for i, m in enumerate(inputs.params_mask) if m],
        "static_arguments": [[k, repr(v)] for k, v in call.static],
        "compiler_options": {str(k): str(v) for k, v in compiler_options.items()},
        "platforms": list(exported.platforms),
        "nr_devices": exported.nr_devices,
    }
    if exported.nr_devices > 1:  # how it sums across devices decides its bits
      record["collectives"] = replay.collectives()
    if jax.process_count() > 1:
      record["processes"] = jax.process_count()
    return record

  def _check_updates(self, closed) -> None:
    sites = find_updates(closed.jaxpr)
    if self.manual:
      if sites.count:
        raise errors.AttestedProgramAlreadyRegisteredError(
            f"{self.__name__} is registered with proof.attest but calls "
            "TrainState.apply_gradients(), which ZKDV already attests.")
      return
    if sites.count == 0:
      raise errors.NoTranscriptUpdateError(
          f"{self.__name__} is compiled with proof.jit but never calls "
          "state.apply_gradients() (or, with Flax NNX, optimizer.update()), so it "
          "has no update to commit. Use jax.jit (nnx.jit) for steps that do not "
          "update the state.")
    if sites.count > 1:
      raise errors.UnsupportedUpdateError(
          f"{self.__name__} calls apply_gradients() {sites.count} times (or, with "
          "Flax NNX, optimizer.update()); ZKDV commits one optimizer update per "
          "proof.jit call. Split the step into one update per call, or attest it "
          "whole: keep Flax's own TrainState (flax.training.train_state.TrainState) "
          f"and wrap the step with proof.attest({self.__name__}, state_argnum=...), "
          "which commits each call, all its updates together, as one step.")
    if sites.proof_ids != {id(self._proof)}:
      raise errors.ProofIdentityError(
          f"{self.__name__} updates a TrainState created with another proof "
          "object.")

  def _locate_post_state(self, out_shape, inputs: _Inputs) -> list[int]:
    """The flat output indices of the post-state: the ``TrainState`` (NNX: GraphState)
    the step returns; under ``proof.attest``, the one output shaped as the state."""
    if self.manual:
      shaped_as_state = trees.shaped_as(inputs.state)
      found = trees.find_nodes(out_shape, shaped_as_state)
      if len(found) != 1:
        raise errors.StepOutputError(
            f"{self.__name__} is attested with state_argnum={self._state_argnum} and "
            f"returns {trees.count_phrase(out_shape, shaped_as_state)} with that argument's "
            "structure and shapes; it must return the new state once: alone, or beside "
            "outputs shaped otherwise (a loss, metrics).")
    else:
      found = trees.find_nodes(out_shape, _is_state)
      if len(found) != 1:
        raise errors.StepOutputError(
            f"{self.__name__} must return the updated state "
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
          f"{self.__name__} returns a state whose leaves "
          f"{[(p, str(x.dtype)) for p, x in zip(post_shapes, post)]} differ from the "
          f"state it received {[(l.shape, l.dtype) for l in state_layouts]}; an update "
          "must keep every state leaf's shape.")
    return list(range(start, start + len(post)))

  def _flat_shardings(self, call: _Call, out_shape) -> dict:
    """jax.jit's in_shardings/out_shardings for the flat inputs and outputs."""
    shardings = {}
    if call.placement is not None and any(s is not None for s in call.placement):
      shardings["in_shardings"] = call.placement
    in_shardings = self._options.get("in_shardings")
    if in_shardings is not None:
      per_arg = (tuple(in_shardings) if isinstance(in_shardings, (list, tuple))
                 else (in_shardings,) * len(call.dyn_args))
      flat = trees.flat_prefix(per_arg, call.dyn_args)
      shardings["in_shardings"] = tuple(flat + [None] * len(jax.tree.leaves(call.dyn_kwargs)))
    if self._options.get("out_shardings") is not None:
      shardings["out_shardings"] = tuple(trees.flat_prefix(self._options["out_shardings"],
                                                           out_shape))
    return shardings


def _untrained_as_batch(call: _Call, inputs: _Inputs, closed,
                        post_indices: list[int]) -> tuple[_Inputs, list[int]]:
  """An NNX step's inputs and post-state with its untrained state (``nnx.chained_leaves``)
  moved to batch evidence: each step commits it as it receives it."""
  keep = _nnx().chained_leaves(inputs.state, closed.jaxpr, inputs.state_indices, post_indices)
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
