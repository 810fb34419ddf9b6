"""The offline, fail-closed transcript verifier (docs/design.md §7, docs/protocol.md).

``verify(path)`` checks every record, the hash chain, continuity, the root's
challenger and policy, re-derives every challenge, checks that each has its
answer, opens every check against its commitments and replays it through the
screened, deserialized program. It never raises on bad input: every problem is
a finding (``Report.fail``), and only a transcript without findings is
``verified``. Anything else a check raises is a fault of the verifier
(``Report.fault``: "could not verify: internal error", exit code 70), never a
verdict about the transcript. The report
states each claim of docs/design.md §10; the exit code is 0 only when the verdict is
verified and every required claim holds.

Modules, one per concern: ``structure`` (records, chain, schemas), ``policy``
(the verifier's requirements, the root's challenger), ``receipt`` (the
challenge key of a dvbench transcript), ``decisions`` (which checks were
chosen), ``final``, ``programs`` (screening, replay), ``checks``, ``probes``,
``start`` (the attested start), ``schedule`` (the order checks run in, ``parallel``
processes), ``claims``, ``report``.

Example::

  report = verify("zkdv-proofs/my-run-...", required=("chain", "replays", "challenges"))
  print(report.verdict, report.exit_code, report.claim("challenges").detail)
"""

import logging
import os
import pathlib
from collections.abc import Callable

from zkdv import transcript
from zkdv.config import Tolerance
from zkdv.verify import blobs
from zkdv.verify import claims
from zkdv.verify import decisions
from zkdv.verify import final
from zkdv.verify import order
from zkdv.verify import policy
from zkdv.verify import receipt
from zkdv.verify import schedule
from zkdv.verify import start
from zkdv.verify import structure
from zkdv.verify.context import Verification
from zkdv.verify.programs import ProgramLoader
from zkdv.verify.report import (CLAIMS, COULD_NOT_VERIFY, DEFAULT_REQUIRED, DOES_NOT_HOLD,
                                EXIT_CODES, EXIT_INTERNAL_ERROR, HOLDS, INVALID, UNVERIFIABLE,
                                VERIFIED, CheckOutcome, Claim, Finding, Report)

logger = logging.getLogger("zkdv.verify")

__all__ = ["verify", "Report", "Finding", "CheckOutcome", "Claim", "VERIFIED", "INVALID",
           "UNVERIFIABLE", "EXIT_CODES", "CLAIMS", "DEFAULT_REQUIRED", "HOLDS",
           "DOES_NOT_HOLD", "COULD_NOT_VERIFY", "EXIT_INTERNAL_ERROR"]


def verify(path: str | os.PathLike, *, replay: str = "sampled",
           tolerance: Tolerance | None = None, min_checks: int = 1,
           required=DEFAULT_REQUIRED, strict: bool = False,
           server_key: bytes | None = None, challenge_key: bytes | None = None,
           progress: Callable[[int, int], None] | None = None,
           read_ahead: bool | None = None, jobs: int = 1,
           on_check: Callable[[str, int], None] | None = None,
           dataset_root: bytes | None = None) -> Report:
  """Verifies the transcript at ``path`` (a folder or its records file).

  ``server_key`` (32 bytes) checks ``receipt.cbor`` beside the records;
  ``challenge_key`` (the server's ``K``) is for DVBench's own workers: it
  re-derives the challenges, but the ``challenges`` claim then could not be
  verified (only a signed receipt binds a key to this transcript).
  ``read_ahead`` reads and hashes the next check's openings on a thread while
  the current check replays (None: where there are more than two cores).
  ``jobs`` > 1 replays a segmented transcript's update checks in that many
  processes (same report). ``on_check(kind, step)`` is called as each check
  starts in this process (what a verification out of time was doing).
  ``dataset_root``: the dataset the run must have drawn its batches from. Raises
  ValueError only for bad arguments, never for a bad transcript.
  """
  if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= 256:
    raise ValueError(f"jobs must be an int in [1, 256], got {jobs!r}.")
  options = policy.VerifierPolicy(replay, tolerance or Tolerance(), min_checks,
                                  tuple(required), strict, dataset_root)
  path = pathlib.Path(path)
  ctx = Verification(Report(path=str(path), required=options.required), options)
  try:
    contents = transcript.RecordReader(path)  # read record by record by structure.read
  except OSError as e:  # an item that is no record is a finding of structure.read
    ctx.report.fail("unreadable", str(path), str(e), UNVERIFIABLE)
  else:
    ctx.blobs = blobs.BlobReader(transcript.records_path(path).parent, read_ahead)
    try:
      _run(ctx, contents, transcript.records_path(path).parent, server_key, challenge_key,
           progress, jobs, on_check)
    except Exception as e:  # pylint: disable=broad-except  # a fault, not a finding
      _fault(ctx.report, e)
    finally:
      ctx.blobs.close()
  try:
    claims.build_claims(ctx)
  except Exception as e:  # pylint: disable=broad-except  # a fault of the claims' code
    _fault(ctx.report, e)
    ctx.report.claims = []
    claims.build_claims(ctx)  # after a fault no builder runs: none could be verified
  ctx.report.standing = claims.standing(ctx.report).to_json()
  return ctx.report


def _fault(report: Report, error: Exception) -> None:
  """Records that the verifier itself failed: every finding about the transcript is
  recorded by the checks (``Report.fail``), so whatever else they raise (a bug, a
  MemoryError, XLA's RESOURCE_EXHAUSTED, a replay process that died) is a fault of the
  verifier. The report says "could not verify"; the traceback goes to the log."""
  cause = str(error).strip().splitlines()
  report.fault = f"internal error: {type(error).__name__}" + (
      f": {cause[0][:300]}" if cause else "")
  logger.error("zkdv verify %s: could not verify: %s", report.path, report.fault,
               exc_info=error)


def _run(ctx: Verification, contents, folder, server_key, challenge_key, progress,
         jobs, on_check) -> None:
  report = ctx.report
  ctx.model = structure.read(contents, folder, report)
  if ctx.model is None or ctx.model.root is None:
    return
  ctx.challenger = policy.parse_challenger(ctx.model.root, report)
  if ctx.challenger is not None:
    report.challenger, report.challenger_kind = ctx.challenger.label, ctx.challenger.kind
  policy.check_tolerance(ctx.model.root["config"], ctx.options.tolerance, report)
  ctx.keys = receipt.challenge_key(ctx, server_key=server_key, challenge_key=challenge_key)
  ctx.decisions = decisions.derive(ctx)
  final.continuity(ctx)
  order.check_order(ctx)
  final.check_final(ctx)
  ctx.programs = ProgramLoader(report)
  for program in ctx.model.programs.values():
    ctx.programs.load(program)
  decisions.require_answers(ctx, ctx.decisions)
  start.require_start(ctx)
  schedule.run_checks(ctx, progress, jobs, on_check)
  _enough_replays(ctx)
  receipt.compare_verdicts(ctx)


def _enough_replays(ctx: Verification) -> None:
  updates = [c for c in ctx.report.checks if c.kind == "update" and c.challenged]
  if any(c.status == "not replayed" for c in updates):
    ctx.report.fail("not_replayed", "checks", f"{len(updates)} update checks were opened "
                    "but not replayed (--replay none): nothing shows the updates were "
                    "computed.", UNVERIFIABLE)
    return
  replayed = sum(c.status == "verified" for c in updates)
  if replayed < ctx.options.min_checks:
    ctx.report.fail("too_few_checks", "checks", f"{replayed} challenged update checks "
                    f"replayed; this verifier requires at least {ctx.options.min_checks} "
                    "(--min-checks).", UNVERIFIABLE)
