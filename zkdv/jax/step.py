"""``proof.jit`` and ``proof.attest``: tracing, classifying and exporting a step.

On the first call a step is traced (static arguments fixed), its update is
found through the marker, its flat inputs are classified into state and batch
evidence, and the update program is exported with ``jax.export``. Production
then runs that exported program, compiled exactly as a verifier compiles it,
so sampled replays are bitwise equal on the same platform.
"""

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import blake3
import jax
import numpy as np

from zkdv import errors
from zkdv.digest import LeafLayout
from zkdv.interpreters.find import find_updates
from zkdv.jax import _compat
from zkdv.jax import arrays
from zkdv.jax.contrib.train_state import TrainState
from zkdv.jax.replay import collectives
from zkdv.jax.replay import compile_program

JIT_OPTIONS = frozenset({
    "in_shardings", "out_shardings", "static_argnums", "static_argnames",
    "donate_argnums", "donate_argnames", "keep_unused", "device", "backend",
    "inline", "compiler_options"})


def _is_train_state(x) -> bool:
  return isinstance(x, TrainState)


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
  post_layouts: list[LeafLayout] | None = None  # as it returns it; set by the first run
  _replay: Callable | None = None
  _replay_sharded: Any = None

  def place_post_state(self, post: list) -> None:
    """Lays the post-state out as the first run placed it (pieces are its own shards)."""
    self.post_layouts = [l if l.key_impl else arrays.layout_of(l.path, x, sharded=True)
                         for l, x in zip(self.state_layouts, post)]
    if self.post_layouts != self.state_layouts:
      self.record["post_state_layout"] = [l.to_record() for l in self.post_layouts]

  def replay(self, *inputs):
    """Runs the update program compiled from its serialized form, as a verifier does."""
    if self._replay is None:
      self._replay = compile_program(jax.export.deserialize(self.blob),
                                     compiler_options=self.compiler_options)
    return self._replay(*inputs)

  def replay_sharded(self, opened: list[np.ndarray]) -> list[np.ndarray]:
    """``replay`` on whole host inputs, placed as the program takes them; returns
    the whole post-state. Every process of a multi-process run calls it."""
    if self._replay_sharded is None:
      self._replay_sharded = compile_program(
          jax.export.deserialize(self.blob), compiler_options=self.compiler_options).lower(
          *[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in self.avals]).compile()
    layouts = dict(zip(self.state_indices, self.state_layouts))
    layouts.update(zip(self.batch_indices, self.batch_layouts))
    shardings = self._replay_sharded.input_shardings[0]
    outs = self._replay_sharded(*[arrays.to_global(a, layouts[i], s)
                                  for i, (a, s) in enumerate(zip(opened, shardings))])
    return [arrays.gather(outs[i]) for i in self.post_indices]


def _mesh_sharding(x) -> jax.sharding.NamedSharding | None:
  """The leaf's sharding if it is placed on a mesh of several devices, else None."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.device_set) > 1:
    return sharding
  return None


def _avals(leaves) -> list:
  return [(tuple(x.shape), x.dtype) for x in leaves]


def _describe_aval(aval) -> str:
  shape, dtype = aval
  return f"{dtype}{list(shape)}"


class ProofFunction:
  """A training step compiled by ``proof.jit`` (or ``proof.attest``)."""

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
    functools.update_wrapper(self, fun)

  @property
  def manual(self) -> bool:
    return self._state_argnum is not None

  def __call__(self, *args, **kwargs):
    proof = self._proof
    proof.ensure_started()
    dyn_args, dyn_kwargs, static, positions = self._spec.split(args, kwargs)
    if self._static is not None and static != self._static:
      raise errors.StaticArgumentError(
          f"{self.__name__} was attested with static arguments "
          f"{dict(self._static)!r} and is now called with {dict(static)!r}.")
    leaves, in_tree = jax.tree.flatten((dyn_args, dyn_kwargs))
    leaves = [arrays.as_array(x) for x in leaves]
    # As jax.jit does, a step without in_shardings takes its inputs' own placement on a mesh
    # (and is traced again when it changes).
    placement = (None if self._options.get("in_shardings") is not None
                 else tuple(_mesh_sharding(x) for x in leaves))
    program = self._programs.get((in_tree, positions, placement))
    if program is None:
      program = self._build(dyn_args, dyn_kwargs, static, positions, leaves, in_tree, placement)
      self._programs[(in_tree, positions, placement)] = program
      self._static = static
    elif _avals(leaves) != program.avals:
      self._raise_wrong_shapes(program, leaves)
    outs = proof.run_step(program, leaves)
    return jax.tree.unflatten(program.out_tree, outs)

  def _raise_wrong_shapes(self, program: Program, leaves) -> None:
    layouts = {i: l for i, l in zip(program.state_indices, program.state_layouts)}
    layouts.update(zip(program.batch_indices, program.batch_layouts))
    for i, (got, want) in enumerate(zip(_avals(leaves), program.avals)):
      if got != want:
        kind = "state" if i in program.state_indices else "batch"
        raise errors.StepInputError(
            f"{self.__name__}: {kind} leaf {layouts[i].path} is "
            f"{_describe_aval(got)} but the step was attested for "
            f"{_describe_aval(want)}. Keep input shapes fixed (pad or drop the "
            "last partial batch); nothing was recorded for this call.")

  # -- building the program -------------------------------------------------

  def _locate_state(self, dyn_args, dyn_kwargs, positions) -> tuple[int, int, Any]:
    """(first leaf index, leaf count, state object) of the state argument."""
    if self.manual:
      if self._state_argnum not in positions:
        raise errors.StepInputError(
            f"{self.__name__}: state_argnum={self._state_argnum} is not a "
            "dynamic positional argument of this call.")
      k = positions.index(self._state_argnum)
      start = len(jax.tree.leaves(dyn_args[:k]))
      state = dyn_args[k]
      return start, len(jax.tree.leaves(state)), state
    nodes = jax.tree.leaves((dyn_args, dyn_kwargs), is_leaf=_is_train_state)
    found = [i for i, n in enumerate(nodes) if _is_train_state(n)]
    if len(found) != 1:
      raise errors.StepInputError(
          f"{self.__name__} received {len(found)} zkdv.jax.contrib.TrainState "
          "arguments; a proof.jit step takes exactly one. Create the state with "
          "zkdv.jax.contrib.TrainState.create(proof=proof, ...), or use "
          "proof.attest(fn, state_argnum=...) for a loop without TrainState.")
    start = sum(len(jax.tree.leaves(n)) for n in nodes[:found[0]])
    state = nodes[found[0]]
    if state.proof is not self._proof:
      raise errors.ProofIdentityError(
          f"the TrainState passed to {self.__name__} was created with "
          f"{state.proof!r}, not with the proof that compiled it "
          f"({self._proof!r}).")
    return start, len(jax.tree.leaves(state)), state

  def _build(self, dyn_args, dyn_kwargs, static, positions, leaves, in_tree,
             placement) -> Program:
    proof = self._proof
    start, count, state = self._locate_state(dyn_args, dyn_kwargs, positions)
    state_indices = list(range(start, start + count))
    batch_indices = [i for i in range(len(leaves)) if i not in set(state_indices)]
    state_paths = [jax.tree_util.keystr(p)
                   for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    all_paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs))[0]]
    state_layouts = [arrays.layout_of(p, leaves[i], sharded=True)
                     for p, i in zip(state_paths, state_indices)]
    batch_layouts = [arrays.layout_of(all_paths[i], leaves[i]) for i in batch_indices]

    def structured_step(*flat, swap_apply_fn=False):
      d_args, d_kwargs = jax.tree.unflatten(in_tree, flat)
      if swap_apply_fn:
        d_args, d_kwargs = jax.tree.map(
            lambda n: n.replace(apply_fn=n.attest_apply_fn) if _is_train_state(n) else n,
            (d_args, d_kwargs), is_leaf=_is_train_state)
      a, kw = ArgSpec.merge(d_args, d_kwargs, static, positions)
      return self._fun(*a, **kw)

    def flat_step(*flat, swap_apply_fn=False):
      return tuple(jax.tree.leaves(structured_step(*flat, swap_apply_fn=swap_apply_fn)))

    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    closed, out_shape = jax.make_jaxpr(structured_step, return_shape=True)(*specs)
    self._check_updates(closed)
    out_tree = jax.tree.structure(out_shape)
    post_indices = self._locate_post_state(out_shape, state_layouts)

    attest_apply_fn = None if self.manual else state.attest_apply_fn
    exact = attest_apply_fn is None
    donated = self._spec.donated_leaves(dyn_args, dyn_kwargs, positions)
    donate_argnums = [i for i, d in enumerate(donated) if d]
    shardings = self._flat_shardings(dyn_args, dyn_kwargs, out_shape, placement)
    compiler_options = self._options.get("compiler_options")
    export_fn = flat_step if exact else functools.partial(flat_step, swap_apply_fn=True)
    try:
      exported = jax.export.export(
          jax.jit(export_fn, keep_unused=True, **shardings))(*specs)
      blob = bytes(exported.serialize())
    except Exception as e:  # jax.export raises many types; name what failed
      raise errors.ExportError(
          f"jax.export could not export the update program of "
          f"{self.__name__}: {type(e).__name__}: {e}") from e
    program_id = blake3.blake3(blob).digest()
    run_options = {k: self._options[k] for k in
                   ("device", "backend", "inline") if k in self._options}
    if exact:
      executable = compile_program(
          jax.export.deserialize(blob), donate_argnums=donate_argnums,
          compiler_options=compiler_options, **run_options, **shardings)
    else:
      executable = jax.jit(flat_step, donate_argnums=donate_argnums,
                           keep_unused=self._options.get("keep_unused", False),
                           compiler_options=compiler_options, **run_options,
                           **shardings)
    proof.register(self)
    params_mask = [p.startswith(".params") for p in state_paths]
    record = {
        "type": "program",
        "program_id": program_id,
        "blob": program_id,
        "function": getattr(self._fun, "__qualname__", repr(self._fun)),
        "mode": "exact" if exact else "equivalent",
        "state_layout": [l.to_record() for l in state_layouts],
        "batch_layout": [l.to_record() for l in batch_layouts],
        "inputs": ["state" if i in set(state_indices) else "batch"
                   for i in range(len(leaves))],
        "post_state_outputs": post_indices,
        "params_leaves": [i for i, m in enumerate(params_mask) if m],
        "static_arguments": [[k, repr(v)] for k, v in static],
        "compiler_options": {str(k): str(v) for k, v in (compiler_options or {}).items()},
        "platforms": list(exported.platforms),
        "nr_devices": exported.nr_devices,
    }
    if exported.nr_devices > 1:  # how it sums across devices decides its bits
      record["collectives"] = collectives()
    if jax.process_count() > 1:
      record["processes"] = jax.process_count()
    return Program(
        program_id=program_id, blob=blob, exact=exact, record=record,
        avals=_avals(leaves), out_tree=out_tree, state_indices=state_indices,
        batch_indices=batch_indices, post_indices=post_indices,
        state_layouts=state_layouts, batch_layouts=batch_layouts,
        params_mask=params_mask, donated=donated,
        overlap=None if self.manual else state.zkdv_overlap,
        executable=executable, compiler_options=compiler_options)

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
          "state.apply_gradients(), so it has no update to commit. Use jax.jit "
          "for steps that do not update the state.")
    if sites.count > 1:
      raise errors.UnsupportedUpdateError(
          f"{self.__name__} calls apply_gradients() {sites.count} times; ZKDV "
          "commits one optimizer update per proof.jit call. Split the step.")
    if sites.proof_ids != {id(self._proof)}:
      raise errors.ProofIdentityError(
          f"{self.__name__} updates a TrainState created with another proof "
          "object.")

  def _locate_post_state(self, out_shape, state_layouts) -> list[int]:
    if self.manual:
      state_out = out_shape[0] if isinstance(out_shape, (tuple, list)) else out_shape
      want = lambda n: n is state_out  # pylint: disable=unnecessary-lambda-assignment
      nodes = jax.tree.leaves(out_shape, is_leaf=want)
      found = [i for i, n in enumerate(nodes) if want(n)]
    else:
      nodes = jax.tree.leaves(out_shape, is_leaf=_is_train_state)
      found = [i for i, n in enumerate(nodes) if _is_train_state(n)]
    if len(found) != 1:
      raise errors.StepOutputError(
          f"{self.__name__} must return the updated state "
          "(`return state.apply_gradients(grads=grads)`, optionally with other "
          f"outputs); it returned {len(found)} states.")
    start = sum(len(jax.tree.leaves(n)) for n in nodes[:found[0]])
    post = jax.tree.leaves(nodes[found[0]])
    post_layouts = [(tuple(x.shape), str(x.dtype)) for x in post]
    pre_layouts = [(l.shape if not l.key_impl else None, l.dtype) for l in state_layouts]
    if len(post) != len(state_layouts) or any(
        l.key_impl is None and (l.shape, l.dtype) != p
        for l, p in zip(state_layouts, post_layouts)):
      raise errors.StepOutputError(
          f"{self.__name__} returns a state whose leaves {post_layouts} differ "
          f"from the state it received {pre_layouts}; an update must keep every "
          "state leaf's shape and dtype.")
    return list(range(start, start + len(post)))

  def _flat_shardings(self, dyn_args, dyn_kwargs, out_shape, placement) -> dict:
    shardings = {}
    if placement is not None and any(s is not None for s in placement):
      shardings["in_shardings"] = placement
    if self._options.get("in_shardings") is not None:
      flat = _compat.broadcast_prefix(
          (tuple(self._options["in_shardings"])
           if isinstance(self._options["in_shardings"], (list, tuple))
           else (self._options["in_shardings"],) * len(dyn_args)), dyn_args)
      flat += [None] * len(jax.tree.leaves(dyn_kwargs))
      shardings["in_shardings"] = tuple(flat)
    if self._options.get("out_shardings") is not None:
      shardings["out_shardings"] = tuple(_compat.broadcast_prefix(
          self._options["out_shardings"], out_shape))
    return shardings
