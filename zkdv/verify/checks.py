"""Answered checks: openings against their commitments, and replays.

An update check opens a segment's start state and its batches, which must hash to
their commitments, and replays the program on them: an exact program must
reproduce the committed end state bit for bit, an equivalent one the opened
post-state within the verifier's tolerance. A state check opens the post-state.
Check records are dispatched by kind through ``CHECKERS`` (``schedule.run_checks``).

Example::

  outcome = CHECKERS[check.kind](ctx, check, step, program, where_of(check))
"""

import blake3
import numpy as np

from zkdv import challenge
from zkdv import digest
from zkdv import errors
from zkdv import metrics
from zkdv import transcript
from zkdv.verify import order
from zkdv.verify import probes
from zkdv.verify import sensitivity
from zkdv.verify import start
from zkdv.verify.context import Verification
from zkdv.verify.report import UNVERIFIABLE, CheckOutcome


def _bad_pieces(folder, blob, layout, pieces) -> list:
  """The boxes of a sharded leaf whose bytes in ``blob`` differ from ``pieces``."""
  try:
    data = transcript.blob_path(folder, blob).read_bytes()
    array = np.frombuffer(data, digest.numpy_dtype(layout.dtype)).reshape(layout.shape)
    return [box for box, got, want in zip(layout.boxes, digest.piece_digests(layout, array),
                                          pieces) if got != want]
  except (OSError, ValueError, TypeError, errors.TranscriptFormatError):
    return []


def open_blobs(ctx: Verification, blobs, layouts, where: str, what: str, pieces=None,
               check_name: bool = True, read: bool = True):
  """The arrays ``blobs`` name, each checked against its name (a batch's are checked
  against its row Merkle tree by the caller instead); None with a finding. Without
  ``read`` each blob is checked where it lies and its array is None."""
  if not isinstance(blobs, list) or len(blobs) != len(layouts):
    ctx.report.fail("schema", where, f"{what} blobs do not match the program layout.")
    return None
  arrays = []
  for b, l in zip(blobs, layouts):
    try:
      arrays.append(ctx.blobs.read(b, l.dtype, l.shape, check_name) if read
                    else ctx.blobs.check(b, l.dtype, l.shape))
    except FileNotFoundError:
      ctx.report.fail("missing_blob", where, f"{what} blob for {l.path} is missing.",
                      UNVERIFIABLE)
      return None
    except (OSError, errors.TranscriptFormatError, TypeError, AttributeError) as e:
      bad = (_bad_pieces(ctx.model.folder, b, l, pieces[len(arrays)])
             if pieces and l.pieces else [])
      named = "".join(f"; shard {l.pieces.index(box)} {list(map(list, box))} differs from "
                      "its commitment" for box in bad)
      ctx.report.fail("blob", where, f"{what} blob for {l.path}: {e}{named}")
      return None
  return arrays


def state_matches(ctx, blobs, arrays, layouts, committed, where, what) -> bool:
  """Opened blobs were checked against their names, the whole-leaf digests; a
  sharded leaf's pieces are hashed from the opened array."""
  pieces = [[b] if l.pieces is None else digest.piece_digests(l, a)
            for b, a, l in zip(blobs, arrays, layouts)]
  if digest.state_digest_from_pieces(layouts, pieces) != committed:
    ctx.report.fail("opening", where, f"opened {what} does not match its commitment.")
    return False
  return True


def _open_post(ctx, check, step, program, where):
  blobs = check.fields.get("post_state_blobs")
  post = open_blobs(ctx, blobs, program.post, where, "post-state")
  if post is None or not state_matches(ctx, blobs, post, program.post, step.post_state,
                                       where, "post-state"):
    return None
  return post


def state_check(ctx: Verification, check, step, program, where: str) -> CheckOutcome:
  if step.post_state is None:
    ctx.report.fail("check_step", where, f"step {step.index} commits no post_state to open.")
    return CheckOutcome(step.index, "state", "opening", "failed")
  post = _open_post(ctx, check, step, program, where)
  return CheckOutcome(step.index, "state", "opening", "failed" if post is None else "verified")


def _open_segment(ctx, check, segment, program, where, chained: bool = False):
  """(start state, [batch per step]) opened and matched to the segment's commitments;
  ``chained``: the start is the last replay's end, its blobs are checked where they lie,
  not read (the start state's arrays are then None)."""
  fields = check.fields
  if fields["first"] != segment.first:
    ctx.report.fail("opening", where, f"the check opens a segment from step {fields['first']}, "
                    f"the segment ending at step {segment.last} starts at step {segment.first}.")
    return None
  batches = _open_batches(ctx, check, segment, program, where)
  if batches is None:
    return None
  pieces = fields.get("pre_state_pieces")
  if pieces is not None and digest.state_digest_from_pieces(program.state,
                                                            pieces) != segment.start:
    ctx.report.fail("opening", where, "pre_state_pieces do not make up the segment's start "
                    "state.")
    return None
  pre = open_blobs(ctx, fields["pre_state_blobs"], program.state, where, "pre-state", pieces,
                   read=not chained)
  if pre is None or not state_matches(ctx, fields["pre_state_blobs"], pre, program.state,
                                      segment.start, where, "start state"):
    return None
  return pre, batches


def _open_batches(ctx, check, segment, program, where):
  fields = check.fields
  steps = ctx.model.steps[segment.first:segment.last + 1]
  batch_blobs = fields["batch_blobs"]
  if len(batch_blobs) != len(steps):
    ctx.report.fail("schema", where, f"the check opens {len(batch_blobs)} batches for a "
                    f"segment of {len(steps)} steps.")
    return None
  batches = []
  data_paths = fields.get("data_paths")
  if data_paths is not None and (not isinstance(data_paths, list)
                                 or len(data_paths) != len(steps)):
    ctx.report.fail("data_row", where, f"the check carries data_paths for {len(data_paths)} "
                    f"steps of a segment of {len(steps)}." if isinstance(data_paths, list)
                    else "malformed data_paths.")
    return None
  for n, (s, blobs) in enumerate(zip(steps, batch_blobs)):
    batch = open_blobs(ctx, blobs, program.batch, where, f"batch of step {s.index}",
                       check_name=False)
    if batch is None:
      return None
    if digest.digest_batch_arrays(program.batch, batch) != s.batch:
      ctx.report.fail("opening", where, f"opened batch of step {s.index} does not match its "
                      "commitment.")
      return None
    if not start.keys_derived(ctx, s.index, program.batch, batch, where):
      return None
    # a row not in the dataset is a finding of its own; the update is replayed all the same
    order.opened_rows_in_dataset(ctx, s, program, batch,
                                 None if data_paths is None else data_paths[n], where)
    batches.append(batch)
  return batches


def update_check(ctx: Verification, check, step, program, where: str) -> CheckOutcome:
  """Replays the segment ending at ``step`` from its opened start state and
  batches; the end state must match its commitment bit for bit (an exact program) or
  the opened end state within tolerance (an equivalent one, one step)."""
  segment = ctx.model.segment_ending(step.index)
  outcome = CheckOutcome(step.index, "update", program.mode, "failed",
                         first=check.fields.get("first"))
  if segment is None:
    ctx.report.fail("check_step", where, f"step {step.index} ends no segment (it commits "
                    "no post_state): an update check answers a segment's last step.")
    return outcome
  outcome.first = segment.first
  if segment.last > segment.first and [l.dtype for l in program.post] != [
      l.dtype for l in program.state]:
    ctx.report.fail("segment", where, f"program {program.number} returns its state in other "
                    "dtypes than it takes, so it cannot run twice in a row; the segment "
                    f"from step {segment.first} to {segment.last} runs it "
                    f"{segment.last - segment.first + 1} times.")
    return outcome
  # A segment that starts where the last replayed one ended (and was verified there)
  # continues from that replay's state on the device; its opened start is still checked
  # against its names and the commitment (every blob byte is hashed, where it lies: not
  # read into memory), so a verdict does not depend on where ``--jobs`` splits the
  # checks. A state with a leaf in pieces is read (its pieces are hashed from the array).
  last = ctx.replayed_end
  chained = (ctx.options.replay != "none" and last is not None and program.exact
             and last[0] == segment.first - 1 and last[1] == program.number
             and segment.start == last[2])
  opened = _open_segment(ctx, check, segment, program, where,
                         chained and not any(l.pieces for l in program.state))
  post = None if program.exact else _open_post(ctx, check, step, program, where)
  ctx.replayed_end = None
  if opened is None or (post is None and not program.exact):
    return outcome
  if ctx.options.replay == "none":
    outcome.status = "not replayed"
    return outcome
  start, batches = (last[3], opened[1]) if chained else opened
  tested = challenge.tested_step(ctx.decisions.by_segment.get(segment.last), segment.first,
                                 segment.last) - segment.first
  replayed = ctx.programs.replay_segment(program, start, batches, where, chained, tested)
  if replayed is None:
    return outcome
  outcome = _compare(ctx, outcome, program, replayed[0], post, segment.end, where)
  _check_sensitivity(ctx, outcome, program, replayed[3], batches, tested, step,
                     segment.first, where)
  steps = ctx.model.steps[segment.first:segment.last + 1]
  if not all([_metrics_match(ctx, s, program, outputs, where)
              for s, outputs in zip(steps, replayed[2])]):
    outcome.status = "failed"
  if outcome.status == "verified" and program.exact:
    ctx.replayed_end = (segment.last, program.number, segment.end, replayed[1])
  return outcome


def _check_sensitivity(ctx, outcome, program, measured, batches: list, tested: int, step,
                       first: int, where) -> None:
  """Records in ``outcome`` whether step ``tested`` of the segment from step ``first``
  (``challenge.tested_step``) reads its batch, replayed with the segment's other
  ``batches``, else other update checks' (``_other_checks_batches``), else perturbed ones
  (``zkdv.verify.sensitivity``, drawn from the challenged ``step``; the program claim,
  not the verdict, rests on it)."""
  if not program.params_leaves:
    return  # nothing to test: the program claim says so
  seed = sensitivity.seed_of(step.record_id)
  try:
    problem, outcome.batches_drawn = sensitivity.measure(
        program, batches, tested, seed, *measured,
        more=lambda: _other_checks_batches(ctx, program, step.index, seed))
  except Exception as e:  # pylint: disable=broad-except  # a replay with another batch failed
    if errors.out_of_memory(e):
      raise  # a fault of this machine, not of the program
    outcome.batch_ignored = (f"{where}: step {first + tested}, a replay with another batch "
                             f"failed ({type(e).__name__}: {str(e)[:200]})")
    return
  outcome.batch_sensitive = (None if problem and problem.startswith(sensitivity.UNDECIDED)
                             else problem is None)
  if problem is not None:
    outcome.batch_ignored = f"{where}: step {first + tested}, replayed again: {problem}"


# Other update checks whose batches a segment without another batch of other rows runs on.
OTHER_CHECKS = 4


def _other_checks_batches(ctx: Verification, program, index: int, seed: bytes) -> list:
  """The batches of the last steps of up to ``OTHER_CHECKS`` other update checks of
  ``program`` (drawn from ``seed``), each read and matched to its commitment, or left out
  (its own check names what is wrong with it): real rows for a segment that holds no
  other, as a prover that ends every segment after one step makes them. They depend on
  the transcript alone, so ``--jobs`` changes nothing."""
  others = [c for c in ordered_checks(ctx.model)
            if c.kind == "update" and c.step != index and 0 <= c.step < len(ctx.model.steps)
            and isinstance(c.fields.get("batch_blobs"), list) and c.fields["batch_blobs"]
            and ctx.model.program_of(ctx.model.steps[c.step]) is program]
  rng = np.random.Generator(np.random.PCG64(
      int.from_bytes(blake3.blake3(seed + b"other checks").digest(8), "little")))
  found = []
  for n in rng.permutation(len(others))[:OTHER_CHECKS]:
    step, blobs = ctx.model.steps[others[n].step], others[n].fields["batch_blobs"][-1]
    try:
      batch = [ctx.blobs.read(b, l.dtype, l.shape, False) for b, l in zip(blobs, program.batch)]
    except (OSError, errors.TranscriptFormatError, TypeError, AttributeError, ValueError):
      continue
    if len(batch) == len(program.batch) and digest.digest_batch_arrays(
        program.batch, batch) == step.batch:
      found.append(batch)
  return found


def _metrics_match(ctx: Verification, step, program, outputs, where: str) -> bool:
  """Whether each metric the step committed is what the replay computes, bit for bit
  (``outputs``: the replay's outputs by index, the metrics' at least)."""
  ok = True
  for name, committed in step.metrics.items():
    index = program.metric_outputs[name]
    replayed = (metrics.encode(outputs[index]) if outputs[index] is not None
                else "no such output")
    if not metrics.identical(replayed, committed):
      ctx.report.fail("replay", where, f"step {step.index}: metric {name!r} is committed as "
                      f"{metrics.describe(committed)} but the replay computes "
                      f"{metrics.describe(replayed)}.")
      ok = False
  return ok


def _compare(ctx, outcome, program, replayed, post, committed, where) -> CheckOutcome:
  if program.exact:
    ok = digest.digest_state_arrays(program.post, replayed)[0] == committed
    if not ok:
      ctx.report.fail("replay", where, "replaying the update program does not reproduce "
                      "the committed post-state bit for bit.")
    outcome.status = "verified" if ok else "failed"
    return outcome
  result = ctx.programs.compare(program.post, replayed, post, exact=False,
                                tolerance=ctx.options.tolerance)
  outcome.max_abs_error = result["max_abs_error"]
  outcome.max_rel_error = result["max_rel_error"]
  outcome.max_ulp_error = result["max_ulp_error"]
  outcome.status = "verified" if result["equal"] else "failed"
  if not result["equal"]:
    ctx.report.fail("replay", where, f"replay differs beyond tolerance in "
                    f"{result['mismatched_leaves']} (max abs {result['max_abs_error']:.3g}).")
  return outcome


CHECKERS = {"update": update_check, "state": state_check, "probe": probes.probe_check,
            "start": start.start_check}


def ordered_checks(model) -> list:
  """The transcript's check records in transcript order."""
  return sorted(model.checks.values(), key=lambda c: int(c.where.split()[-1]))


def where_of(check) -> str:
  return f"{check.where} ({check.kind} check of step {check.step})"
