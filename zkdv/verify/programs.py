"""Programs, screened before they run: loaded, summarized, compiled once, replayed.

Each program blob is deserialized and screened (``zkdv.jax.replay.load_program``:
custom calls on an allow-list, no host callbacks or transfers, no effects); a
refused program is an invalid finding, never compiled. Its summary (operation
counts, parameters, whether the post-state depends on the batch) is derived from
its StableHLO, never read from a prover field. Compiler options from the
transcript are reduced to ``zkdv.jax.replay.REPLAY_COMPILER_OPTIONS``. JAX is
imported on first use.

Example::

  loader = ProgramLoader(ctx.report)
  info = loader.load(program)
  end, _, per_step = loader.replay_segment(program, start, batches, "record 9")
"""

import dataclasses

from zkdv import errors
from zkdv.verify.report import INVALID, UNVERIFIABLE, Report
from zkdv.verify.structure import Program


@dataclasses.dataclass
class ProgramInfo:
  """What the verifier derived about one program (``error``: why it could not)."""

  exported: object = None
  summary: object = None  # zkdv.jax.stablehlo.ModuleSummary
  refused: bool = False
  error: str | None = None

  def batch_dependent(self, program: Program) -> bool | None:
    """Whether any post-state output reads any batch input; None when unknown."""
    if self.summary is None:
      return None
    batch = program.input_indices("batch")
    return any(self.summary.depends_on(o, batch) for o in program.post_state_outputs
               if o < len(self.summary.dependencies))


def parameter_count(program: Program) -> int:
  count = 0
  for i in program.params_leaves:
    elements = 1
    for n in program.state[i].shape:
      elements *= n
    count += elements
  return count


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
        self._report.fail("unsafe_program", program.where, str(e))
    self._infos[key] = info
    return info

  def platform(self) -> str:
    return self._jax.devices()[0].platform

  def replay_segment(self, program: Program, start, batches, where: str,
                     start_on_device: bool = False):
    """(host views of the end state, its device arrays, each step's outputs by index with
    only the metrics' read) after replaying ``program`` once per batch from ``start``
    (host arrays, or the device arrays a previous replay returned). The state stays on
    the device between steps (one compiled executable for every step). None (with a
    finding) when it cannot run here."""
    info = self.load(program)
    if info.exported is None or not batches:
      return None
    metric_indices = set(program.metric_outputs.values())
    per_step = []

    def keep(outs) -> list:  # metrics are read after the last step: none waits for one
      per_step.append([x if i in metric_indices else None for i, x in enumerate(outs)])
      return [outs[i] for i in program.post_state_outputs]

    try:
      if start_on_device:
        compiled, state = self._compile(program, info), list(start)
      else:
        outs = self.run(program, self._inputs(program, list(zip(start, program.state)),
                                              batches[0]), where, host=False)
        if outs is None:
          return None
        compiled, batches, state = self._compile(program, info), batches[1:], keep(outs)
      for batch in batches:
        device_batch = self._on_device(info, [self._arrays.from_host(a, l)
                                              for a, l in zip(batch, program.batch)])
        rows, states = iter(device_batch), iter(state)
        state = keep(compiled(*[next(states if kind == "state" else rows)
                                for kind in program.inputs]))
      per_step = [[None if x is None else self._arrays.host_view(x) for x in outs]
                  for outs in per_step]
    except Exception as e:  # pylint: disable=broad-except  # a malformed program is a finding
      self._report.fail("replay_error", where, f"replay raised {type(e).__name__}: "
                        f"{str(e)[:500]}", INVALID)
      return None
    return [self._arrays.host_view(x) for x in state], state, per_step

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
    try:
      outs = self._compile(program, info)(*self._on_device(
          info, [self._arrays.from_host(a, l) for a, l in inputs]))
      return [self._arrays.host_view(x) for x in outs] if host else outs
    except errors.ReplayError as e:  # fewer devices, or other collectives, than it needs
      self._report.fail("replay_environment", where, str(e), UNVERIFIABLE)
    except Exception as e:  # pylint: disable=broad-except  # a malformed program is a finding
      self._report.fail("replay_error", where, f"replay raised {type(e).__name__}: "
                        f"{str(e)[:500]}", INVALID)
    return None

  def _on_device(self, info: ProgramInfo, xs: list) -> list:
    """``xs`` committed to the device, for a one-device program: a jitted exported call
    is lowered and compiled again when its inputs go from uncommitted (opened from the
    host) to committed (the previous step's outputs)."""
    if info.exported.nr_devices != 1:
      return xs
    device = self._jax.devices()[0]
    return [self._jax.device_put(x, device) for x in xs]

  def _compile(self, program, info: ProgramInfo):
    key = program.number
    if key not in self._compiled:
      self._replay.check_collectives(program.collectives)
      options, ignored = self._replay.replay_compiler_options(program.compiler_options)
      if ignored:
        self._report.notes.append(f"program {key}: ignored compiler options {ignored} "
                                  "(a replay keeps only numerics flags).")
      self._compiled[key] = self._replay.compile_program(info.exported,
                                                         compiler_options=options or None)
    return self._compiled[key]

  def compare(self, *args, **kwargs) -> dict:
    return self._replay.compare(*args, **kwargs)
