"""``proof.jit`` and ``proof.attest``: tracing, classifying and exporting a step.

On the first call a step is traced (static arguments fixed), its update is
found through the marker, its flat inputs are classified into state and batch
evidence (``zkdv.jax.step_inputs``), and the update program is exported with
``jax.export`` (``zkdv.jax.update_program.Program``). Production
then runs that exported program, compiled exactly as a verifier compiles it,
so sampled replays are bitwise equal on the same platform.

Example::

  train_step = ProofFunction(proof, step_fn, {"donate_argnums": (0,)})
  state = train_step(state, batch)  # first call: classify, export, compile, record
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import blake3
import jax

from zkdv import errors
from zkdv.interpreters import debug_calls as debug_calls_lib
from zkdv.jax import _compat
from zkdv.jax import arrays
from zkdv.jax import replay
from zkdv.jax import trees
from zkdv.jax.step_inputs import (ArgSpec, Call, Inputs, check_updates, classify,
                                  is_train_state, locate_post_state, locate_state,
                                  nnx_module, untrained_as_batch)
from zkdv.jax.step_inputs import metric_outputs as step_metric_outputs
from zkdv.jax.update_program import Program

JIT_OPTIONS = frozenset({
    "in_shardings", "out_shardings", "static_argnums", "static_argnames",
    "donate_argnums", "donate_argnames", "keep_unused", "device", "backend",
    "inline", "compiler_options"})


def _mesh_sharding(x) -> jax.sharding.NamedSharding | None:
  """The leaf's sharding if it is placed on a mesh of several devices, else None."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.device_set) > 1:
    return sharding
  return None


def _avals(leaves) -> list:
  return [(tuple(x.shape), x.dtype) for x in leaves]


def _flat_outputs(fun: Callable) -> Callable:
  """``fun`` returning its outputs' flat leaves; it keeps ``fun``'s name."""
  def flat(*inputs):
    return tuple(jax.tree.leaves(fun(*inputs)))
  flat.__name__ = flat.__qualname__ = fun.__name__
  return flat


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
    nnx = nnx_module()
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

  def _split(self, args: tuple, kwargs: dict, nnx: bool = False, flat=None) -> Call:
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
    return Call(dyn_args, dyn_kwargs, static, positions, leaves, in_tree, placement, nnx)

  # -- building the program: classify, trace, export, compile, record ----------

  def _build(self, call: Call) -> Program:
    start, state = locate_state(call, self._proof, self.__name__, self._state_argnum)
    inputs = classify(call, start, state)
    closed, out_shape, post_indices = self._trace(call, inputs)
    if call.nnx:
      inputs, post_indices = untrained_as_batch(call, inputs, closed, post_indices)
    exact = self.manual or inputs.state.attest_apply_fn is None
    donated = self._spec.donated_leaves(call.dyn_args, call.dyn_kwargs, call.positions)
    if call.nnx and not self._donates_every_nnx_argument(call):  # split together: all or none
      donated = [d and i not in inputs.state_indices for i, d in enumerate(donated)]
    shardings = self._flat_shardings(call, out_shape)
    exported, blob, debug_calls = self._export(call, closed, shardings, exact)
    executable = self._compile(call, exported, blob, exact, donated, shardings)
    self._proof.register(self)
    program_id = blake3.blake3(blob).digest()
    metric_outputs = step_metric_outputs(out_shape, (  # nor are an NNX step's new objects
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

  def _donates_every_nnx_argument(self, call: Call) -> bool:
    """Whether every argument that holds an NNX object is donated (as ``nnx.jit``
    donates an object's state only when its argument is)."""
    holds = nnx_module().holds_node
    return (all(p in self._spec.donate_nums
                for p, a in zip(call.positions, call.dyn_args) if holds(a))
            and all(k in self._spec.donate_names for k, v in call.dyn_kwargs.items() if holds(v)))

  def _step_on_flat_inputs(self, call: Call, swap_apply_fn: bool = False) -> Callable:
    """The step as a function of the call's flat dynamic inputs (static ones bound).

    With ``swap_apply_fn`` the state's ``attest_apply_fn`` replaces ``apply_fn``
    (the replay program of an equivalent check).
    """
    fun = nnx_module().stateful(self._fun, self.__name__) if call.nnx else self._fun

    def step(*flat):
      dyn_args, dyn_kwargs = jax.tree.unflatten(call.in_tree, flat)
      if swap_apply_fn:
        dyn_args, dyn_kwargs = jax.tree.map(
            lambda n: n.replace(apply_fn=n.attest_apply_fn) if is_train_state(n) else n,
            (dyn_args, dyn_kwargs), is_leaf=is_train_state)
      args, kwargs = ArgSpec.merge(dyn_args, dyn_kwargs, call.static, call.positions)
      return fun(*args, **kwargs)
    step.__name__ = self.__name__  # names the exported program and its executables
    return step

  def _trace(self, call: Call, inputs: Inputs) -> tuple[Any, Any, list[int]]:
    """(the step's jaxpr, its output shapes, the flat indices of the post-state among them).

    Raises when the step does not perform exactly one update of this proof.
    """
    closed, out_shape = jax.make_jaxpr(self._step_on_flat_inputs(call), return_shape=True)(
        *call.specs)
    check_updates(closed, self._proof, self.__name__, self.manual)
    return closed, out_shape, locate_post_state(out_shape, inputs, self.__name__,
                                                self._state_argnum)

  def _export(self, call: Call, closed, shardings: dict,
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

  def _compile(self, call: Call, exported, blob: bytes, exact: bool, donated: list[bool],
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

  def _record(self, program_id: bytes, call: Call, inputs: Inputs, exported,
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

  def _flat_shardings(self, call: Call, out_shape) -> dict:
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


