"""Replaying independent segments in parallel processes.

Each process reads the transcript, compiles the programs it needs once and
replays a contiguous group of update checks (chained on its device where one
segment starts where the last ended), with its own read-ahead; the parent
merges each check's outcome and findings in transcript order, so the report is
the one a single process writes. It pays where one replay leaves cores idle
(small programs, many cores): on two cores XLA already uses both.

Example::

  results = replay_groups(path, options, [3, 7, 11, 15], jobs=2, read_ahead=False,
                          decisions=ctx.decisions)
  outcome, findings = results[7]
"""

import concurrent.futures
import multiprocessing

from zkdv import transcript
from zkdv.verify import blobs
from zkdv.verify import checks
from zkdv.verify import structure
from zkdv.verify.context import Verification
from zkdv.verify.programs import ProgramLoader
from zkdv.verify.report import Report


def parallel_checks(ctx: Verification, ordered: list, programs: list) -> list[int]:
  """Positions (in ``ordered``) of the checks a process may replay on its own: the
  update checks of exact programs."""
  if ctx.options.replay == "none":
    return []
  return [n for n, (c, p) in enumerate(zip(ordered, programs))
          if c.kind == "update" and p is not None and p.exact]


def replay_groups(path, options, positions: list[int], jobs: int,
                  read_ahead: bool | None, decisions) -> dict[int, tuple]:
  """{position: (outcome, findings)} of the update checks at ``positions``, replayed
  in ``jobs`` processes, each a contiguous share (``decisions``: the parent's, which
  choose each segment's tested step)."""
  size = -(-len(positions) // jobs)
  groups = [positions[i:i + size] for i in range(0, len(positions), size)]
  context = multiprocessing.get_context("spawn")  # JAX does not survive fork
  with concurrent.futures.ProcessPoolExecutor(len(groups), mp_context=context) as pool:
    futures = [pool.submit(_replay_group, str(path), options, group, read_ahead, decisions)
               for group in groups]
    results = {}
    for future in futures:
      results.update(future.result())
  return results


def _replay_group(path: str, options, positions: list[int], read_ahead,
                  decisions) -> dict[int, tuple]:
  """In a child process: the outcomes and findings of the checks at ``positions``."""
  ctx = Verification(Report(path=path), options)
  ctx.decisions = decisions
  folder = transcript.records_path(path).parent
  ctx.model = structure.read(transcript.RecordReader(path), folder, ctx.report)
  ctx.programs = ProgramLoader(ctx.report)
  ctx.blobs = blobs.BlobReader(folder, read_ahead)
  ordered = checks.ordered_checks(ctx.model)
  results = {}
  try:
    for n, position in enumerate(positions):
      check = ordered[position]
      step = ctx.model.steps[check.step]
      program = ctx.model.program_of(step)
      ctx.programs.load(program)
      if n + 1 < len(positions):
        following = ordered[positions[n + 1]]
        ctx.blobs.prefetch(blobs.wanted_blobs(
            following, ctx.model.program_of(ctx.model.steps[following.step])))
      before = len(ctx.report.findings)  # reading the transcript again found what the parent did
      outcome = checks.update_check(ctx, check, step, program, checks.where_of(check))
      results[position] = (outcome, ctx.report.findings[before:])
  finally:
    ctx.blobs.close()
  return results
