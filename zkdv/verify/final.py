"""Continuity, the final record, and the final state and params it names.

Every step starts from the post-state of the step before it; ``final`` counts
the steps, lists the discontinuities, and names the final state (its piece
digests must make it up) and ``final_params``, which the verifier derives
itself: from the final state's leaves, or for sharded params from a state check
of the last step. A claim it cannot derive is never verified.

Example::

  continuity(ctx)
  check_final(ctx)
"""

import dataclasses

from zkdv import digest
from zkdv.verify import structure
from zkdv.verify.context import Verification
from zkdv.verify.report import UNVERIFIABLE

_FINAL_STATE_FIELDS = ("final_state", "final_state_leaves", "final_params")


def continuity(ctx: Verification) -> None:
  """Each segment starts from the committed end of the one before it, holds at most
  the policy's segment length and one program (one step for an equivalent one)."""
  model, report = ctx.model, ctx.report
  report.steps = len(model.steps)
  report.segments = len(model.segments)
  bound = None if ctx.challenger is None else ctx.challenger.policy.segment_length
  for prev, segment in zip(model.segments, model.segments[1:]):
    if segment.start != prev.end:
      report.discontinuities.append(segment.first)
      how = ("the segment before it has no committed end state" if prev.end is None else
             f"it is not the post-state of step {prev.last}")
      report.fail("discontinuity", f"step {segment.first}",
                  f"pre-state of step {segment.first}: {how}; the state was changed "
                  "outside proof.jit.")
  for segment in model.segments:
    where = f"steps {segment.first}..{segment.last}"
    if bound is not None and segment.length > bound:
      report.fail("segment_length", where, f"a segment of {segment.length} steps exceeds "
                  f"the policy's segment_length {bound}.")
    steps = model.steps[segment.first:segment.last + 1]
    programs = {s.program for s in steps}
    if len(programs) > 1:
      report.fail("segment", where, f"a segment runs programs {sorted(programs)}; each "
                  "segment runs one program.")
    program = model.programs.get(steps[0].program)
    if program is not None and not program.exact and segment.length > 1:
      report.fail("segment", where, "an equivalent-mode (tolerance) program commits every "
                  "step's state: its segments hold one step.")


def check_final(ctx: Verification) -> None:
  report, final, steps = ctx.report, ctx.model.final, ctx.model.steps
  if final is None:
    report.fail("unfinished", "end", "no final record: the transcript did not finish "
                "(training crashed or finish() was not called).", UNVERIFIABLE)
    return
  report.finished = True
  if final["status"] != "clean":
    report.fail("aborted", "final", f"the prover ended with status {final['status']!r}.")
  if final["steps"] != len(steps):
    report.fail("step_count", "final",
                f"final says {final['steps']} steps, the transcript has {len(steps)}.")
  if final.get("discontinuities", []) != report.discontinuities:
    report.fail("final", "final", f"final lists discontinuities "
                f"{final.get('discontinuities')}, the steps show {report.discontinuities}.")
  if not steps:
    report.fail("no_steps", "final", "the transcript has no steps: nothing was trained "
                "or checked.", UNVERIFIABLE)
    named = [f for f in _FINAL_STATE_FIELDS if f in final]
    if named:
      report.fail("final_state", "final", f"final names {named}, but no step produced a "
                  "state.")
    return
  _final_state(ctx, final, steps[-1])


def _final_state(ctx: Verification, final: dict, last_step) -> None:
  report, program = ctx.report, ctx.model.program_of(last_step)
  if last_step.post_state is None or final.get("final_state") != last_step.post_state:
    report.fail("final_state", "final", "final state digest is not the last step's post-state.")
    return
  leaves = final.get("final_state_leaves")
  if program is None:
    return  # the step's unknown program is already a finding
  layouts = program.post
  if not structure.pieces_make(layouts, leaves, final["final_state"]):
    report.fail("final_state", "final", "final state piece digests do not make up the "
                "final state digest.")
    return
  if "final_params" not in final:
    return
  whole = _whole_leaf_digests(ctx, last_step, program, leaves)
  if whole is None:
    report.fail("final_params", "final", f"final_params names sharded params, which only a "
                f"state check of the last step (step {last_step.index}) can open, and it "
                "has none: the params cannot be derived.", UNVERIFIABLE)
    return
  params = digest.params_digest([dataclasses.replace(l, pieces=None) for l in layouts],
                                whole, program.params_leaves)
  if final["final_params"] != params:
    report.fail("final_params", "final", "final params digest is not the digest of the "
                "final state's params.")


def _whole_leaf_digests(ctx, last_step, program, leaves) -> list | None:
  """Each leaf's whole digest: its single piece, or for sharded params the blob name a
  state check of the last step opened (checked against the state by that check)."""
  if not any(program.post[i].pieces is not None for i in program.params_leaves):
    return [p[0] for p in leaves]
  check = ctx.model.checks.get((last_step.index, "state"))
  opened = None if check is None else check.fields.get("post_state_blobs")
  if not isinstance(opened, list) or len(opened) != len(program.post):
    return None
  return opened
