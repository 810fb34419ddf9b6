"""Programs, screened before they run: loaded, summarized, compiled once, replayed.

Each program blob is deserialized and screened (``zkdv.jax.replay.load_program``:
custom calls on an allow-list, no host callbacks or transfers, no effects); a
refused program is an invalid finding, never compiled (constants over
``zkdv.config.MAX_PROGRAM_CONSTANT_BYTES`` among the reasons). Its summary
(operation counts, constant bytes) is derived from its StableHLO, never read from
a prover field. Compiler options from the
transcript are reduced to ``zkdv.jax.replay.REPLAY_COMPILER_OPTIONS``. JAX is
imported on first use.

Example::

  loader = ProgramLoader(ctx.report)
  info = loader.load(program)
  end, _, per_step, _ = loader.replay_segment(program, start, batches, "record 9")
"""

import dataclasses

from zkdv import errors
from zkdv.verify.report import INVALID, UNVERIFIABLE, Report
from zkdv.verify.structure import Program


class _NotReplayed(Exception):
  """The prover's program failed to compile or run here; the finding is recorded."""


@dataclasses.dataclass
class ProgramInfo:
  """What the verifier derived about one program (``error``: why it could not)."""

  exported: object = None
  summary: object = None  # zkdv.jax.stablehlo.ModuleSummary
  refused: bool = False
  error: str | None = None


def parameter_count(program: Program) -> int:
  count = 0
  for i in program.params_leaves:
    elements = 1
    for n in program.state[i].shape:
      elements *= n
    count += elements
  return count


def params_bytes(program: Program) -> int:
  """The bytes of the params leaves a training program trains."""
  return sum(program.state[i].nbytes for i in program.params_leaves)


class ProgramLoader:
  """Loads each program once; compiles it on its first replay."""

  def __init__(self, report: Report):
    self._report = report
    self._infos, self._compiled = {}, {}
    self._jax = self._arrays = self._replay = None
    self._import_error = None

  def _modules(self) -> bool:
    if self._replay is None and self._import_error is None:
      try:
        import jax  # pylint: disable=g-import-not-at-top
        from zkdv.jax import arrays, replay  # pylint: disable=g-import-not-at-top
        self._jax, self._arrays, self._replay = jax, arrays, replay
      except ImportError as e:
        self._import_error = f"reading programs needs JAX: {e}. Install dvbench[jax]."
    return self._replay is not None

  def load(self, program) -> ProgramInfo:
    """The info of a Program (or the Init program), with a finding the first time it is
    refused or unreadable."""
    key = program.number
    if key in self._infos:
      return self._infos[key]
    info = ProgramInfo()
    if program.blob is None:
      info.error = "its blob is missing or does not match its id"
    elif not self._modules():
      info.error = self._import_error
    else:
      from zkdv.jax import stablehlo  # pylint: disable=g-import-not-at-top
      try:
        info.exported, info.summary = self._replay.load_program(program.blob)
      except stablehlo.UnsafeProgramError as e:
        info.refused, info.error = True, str(e)
        # A refused init program is a start that does not hold; an update program, the
        # program (and every replay of it).
        self._report.fail("start" if program.number == "init" else "unsafe_program",
                          program.where, f"the {'init' if program.number == 'init' else 'update'}"
                          f" program: {e}")
      else:
        self._check_outputs(program, info)
    self._infos[key] = info
    return info

  def _check_outputs(self, program, info: ProgramInfo) -> None:
    """Refuses (with a finding) a program with fewer outputs than its record names as
    the post-state and the metrics: replaying it could not be read."""
    named = [*getattr(program, "post_state_outputs", ()),
             *getattr(program, "metric_outputs", {}).values()]
    outputs = len(info.exported.out_avals)
    if any(i >= outputs for i in named):
      info.exported, info.refused = None, True
      info.error = f"the record names output {max(named)}, the program has {outputs}"
      self._report.fail("schema", program.where, f"program {program.number}: "
                        f"{info.error}.")

  def platform(self) -> str:
    return self._jax.devices()[0].platform

  def replay_segment(self, program: Program, start, batches, where: str,
                     start_on_device: bool = False, sensitivity: int | None = None):
    """(host views of the end state, its device arrays, each step's outputs by index with
    only the metrics' read, the params leaves' sensitivity or None) after replaying
    ``program`` once per batch from ``start`` (host arrays, or the device arrays a
    previous replay returned). The state stays on the device between steps (one compiled
    executable for every step). With ``sensitivity`` the index n of a step, it is (params
    before step n, after it with its committed batch, a function giving them after it with
    another batch (with ``whole=True``: the whole state), and one giving the whole state
    after it with its committed batch), host arrays. None (with a finding) when it cannot
    run here."""
    info = self.load(program)
    if info.exported is None or not batches:
      return None
    metric_indices = set(program.metric_outputs.values())
    per_step = []

    def keep(outs) -> list:  # metrics are read after the last step: none waits for one
      per_step.append([x if i in metric_indices else None for i, x in enumerate(outs)])
      return [outs[i] for i in program.post_state_outputs]

    def params(state) -> list:
      return [self._arrays.host_view(state[i]) for i in program.params_leaves]

    if start_on_device:
      compiled, state = self._compile(program, info, where), list(start)
    else:
      outs = self.run(program, self._inputs(program, list(zip(start, program.state)),
                                            batches[0]), where, host=False)
      if outs is None:
        return None
      compiled = self._compile(program, info, where)
    if compiled is None:
      return None
    try:
      begin = before = after = None  # step ``sensitivity``'s state: ``begin`` stays on the
      steps = enumerate(batches)     # device for the perturbed replays
      if not start_on_device:
        if sensitivity == 0:
          begin = self._untrusted(where, lambda: self._on_device(
              info, [self._arrays.from_host(a, l) for a, l in zip(start, program.state)]))
          before = [start[i] for i in program.params_leaves]
        state = keep(outs)
        after = state if sensitivity == 0 else None
        steps = enumerate(batches[1:], 1)
      for n, batch in steps:
        if n == sensitivity:
          begin, before = state, self._untrusted(where, params, state)
        state = keep(self._untrusted(where, self._step, compiled, info, program, state, batch))
        after = state if n == sensitivity else after
      if sensitivity is not None:
        def perturbed(batch, whole: bool = False) -> list:
          outs = self._step(compiled, info, program, begin, batch)
          post = [outs[i] for i in program.post_state_outputs]
          return [self._arrays.host_view(x) for x in post] if whole else params(post)
        sensitivity = (before, self._untrusted(where, params, after), perturbed,
                       lambda: [self._arrays.host_view(x) for x in after])
      per_step = self._untrusted(where, lambda: [
          [None if x is None else self._arrays.host_view(x) for x in outs]
          for outs in per_step])
      return self._untrusted(where, lambda: [self._arrays.host_view(x) for x in state]), \
          state, per_step, sensitivity or None
    except _NotReplayed:
      return None

  def _step(self, compiled, info, program, state, batch) -> list:
    """Every output of one step of ``compiled`` from ``state`` (device arrays) on ``batch``
    (host arrays)."""
    device_batch = self._on_device(info, [self._arrays.from_host(a, l)
                                          for a, l in zip(batch, program.batch)])
    rows, states = iter(device_batch), iter(state)
    return compiled(*[next(states if kind == "state" else rows) for kind in program.inputs])

  @staticmethod
  def _inputs(program: Program, state, batch) -> list:
    states, rows = iter(state), iter(zip(batch, program.batch))
    return [next(states if kind == "state" else rows) for kind in program.inputs]

  def run(self, program, inputs, where: str, host: bool = True):
    """Every output of ``program`` (a Program or the Init) on ``inputs``, [(array,
    layout)], on the host; None (with a finding) when it cannot run here."""
    info = self.load(program)
    if info.exported is None:
      if not info.refused:
        self._report.fail("no_program" if self._replay else "no_jax", where,
                          f"cannot replay: {info.error}.", UNVERIFIABLE)
      return None
    if self.platform() not in program.platforms:
      self._report.fail("platform", where, f"program was exported for "
                        f"{list(program.platforms)}, this machine runs {self.platform()}.",
                        UNVERIFIABLE)
      return None
    compiled = self._compile(program, info, where)
    if compiled is None:
      return None
    try:
      args = self._untrusted(where, lambda: self._on_device(
          info, [self._arrays.from_host(a, l) for a, l in inputs]))
      outs = self._untrusted(where, compiled, *args)
      return self._untrusted(where, lambda: [self._arrays.host_view(x) for x in outs]) \
          if host else outs
    except _NotReplayed:
      return None

  def _untrusted(self, where: str, call, *args):
    """``call(*args)``, where JAX compiles or runs the prover's program on the prover's
    layouts (placing the opened inputs, compiling, running, reading the outputs back: an
    execution error surfaces where an output is read). What that raises is a finding
    about the program, recorded before ``_NotReplayed`` is raised; running out of memory
    is a fault of this machine and is raised as it is (``zkdv.verify``: could not verify).
    Only these calls are guarded: anything else the verifier raises is its own fault."""
    try:
      return call(*args)
    except errors.ReplayError as e:  # fewer devices, or other collectives, than it needs
      self._report.fail("replay_environment", where, str(e), UNVERIFIABLE)
    except Exception as e:  # pylint: disable=broad-except  # the prover's program failed
      if errors.out_of_memory(e):
        raise
      self._report.fail("replay_error", where, f"replay raised {type(e).__name__}: "
                        f"{str(e)[:500]}", INVALID)
    raise _NotReplayed()

  def _on_device(self, info: ProgramInfo, xs: list) -> list:
    """``xs`` committed to the device, for a one-device program: a jitted exported call
    is lowered and compiled again when its inputs go from uncommitted (opened from the
    host) to committed (the previous step's outputs)."""
    if info.exported.nr_devices != 1:
      return xs
    device = self._jax.devices()[0]
    return [self._jax.device_put(x, device) for x in xs]

  def _compile(self, program, info: ProgramInfo, where: str):
    """The program compiled once; None (with a finding) when it cannot be compiled here."""
    key = program.number
    if key not in self._compiled:
      options, ignored = self._replay.replay_compiler_options(program.compiler_options)
      if ignored:
        self._report.notes.append(f"program {key}: ignored compiler options {ignored} "
                                  "(a replay keeps only numerics flags).")
      try:
        self._untrusted(where, self._replay.check_collectives, program.collectives)
        self._compiled[key] = self._untrusted(where, lambda: self._replay.compile_program(
            info.exported, compiler_options=options or None))
      except _NotReplayed:
        return None
    return self._compiled[key]

  def compare(self, *args, **kwargs) -> dict:
    return self._replay.compare(*args, **kwargs)
