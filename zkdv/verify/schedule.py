"""The order in which a transcript's checks run: in this process, in transcript order,
or (``jobs`` > 1) with segments' update checks replayed in parallel processes first.

Example::

  run_checks(ctx, progress=None, jobs=2)
"""

import dataclasses

from zkdv.verify import checks
from zkdv.verify import parallel
from zkdv.verify.blobs import wanted_blobs
from zkdv.verify.context import Verification


def run_checks(ctx: Verification, progress=None, jobs: int = 1, on_check=None) -> None:
  """Every check record, in transcript order, through its kind's checker; with
  ``jobs`` > 1, segments' update checks replay in that many processes.
  ``on_check(kind, step)`` is told of each check this process starts."""
  ordered = checks.ordered_checks(ctx.model)
  programs = [ctx.model.program_of(ctx.model.steps[c.step]) for c in ordered]
  replayed = {}
  if jobs > 1:
    positions = parallel.parallel_checks(ctx, ordered, programs)
    if len(positions) > 1:
      replayed = parallel.replay_groups(ctx.report.path, ctx.options, positions, jobs,
                                        ctx.blobs.read_ahead, ctx.decisions)
  for n, (check, program) in enumerate(zip(ordered, programs)):
    if progress:
      progress(n, len(ordered))
    step = ctx.model.steps[check.step]
    where = checks.where_of(check)
    if program is None:
      ctx.report.fail("check_step", where, "the step's program is unknown.")
      continue
    if n in replayed:
      outcome, findings = replayed[n]
      ctx.report.findings.extend(findings)
    else:
      following = next((m for m in range(n + 1, len(ordered)) if m not in replayed), None)
      if following is not None and programs[following] is not None:  # read while replaying
        ctx.blobs.prefetch(wanted_blobs(ordered[following], programs[following]))
      if on_check:
        on_check(check.kind, check.step)
      outcome = checks.CHECKERS[check.kind](ctx, check, step, program, where)
    if outcome is not None:
      ctx.report.checks.append(dataclasses.replace(
          outcome, challenged=check.kind == "start"
          or ctx.decisions.challenged(check.step, check.kind)))
  if progress:
    progress(len(ordered), len(ordered))
