"""Which checks the challenger chose, re-derived with ``zkdv.challenge``.

``self``: each step's challenge is keyed by the seed revealed in ``final``
(checked against the root's commitment). ``dvbench``: keyed by the server's key
``K`` (from a receipt, or the server's own worker) and the id of the step's
record. Every decided probe set must have its check record, and every decided update
and state check of a segment, keyed by the segment's last step. Which step's
challenge decides a segment, and which checks a step answers, are
``zkdv.challenge.deciding_step`` and ``required_checks``.

Example::

  decisions = derive(ctx)
  require_answers(ctx, decisions)
  decisions.challenged(3, "update")
"""

import dataclasses

from zkdv import challenge
from zkdv.verify.context import Verification


@dataclasses.dataclass(frozen=True)
class Decisions:
  """Each step's Decision (its probes) and each segment's (its update and state checks,
  keyed by the segment's last step), or None with the reason they are unknown."""

  by_step: tuple | None
  unknown: str | None = None
  by_segment: dict = dataclasses.field(default_factory=dict)

  @property
  def known(self) -> bool:
    return self.by_step is not None

  def challenged(self, step: int, kind: str) -> bool:
    """Whether ``kind`` was chosen for ``step`` (True when the decisions are unknown);
    update and state checks belong to the segment that ``step`` ends."""
    if not self.known:
      return True
    return challenge.required_checks(self.by_step[step],
                                     self.by_segment.get(step)).get(kind, False)


def _self_challenges(ctx: Verification) -> Decisions | list:
  final = ctx.model.final
  if final is None:
    return Decisions(None, "no final record reveals the seed")
  seed = final.get("seed")
  if not isinstance(seed, bytes) or len(seed) != challenge.KEY_BYTES:
    ctx.report.fail("seed", "final", "a self-challenged final must reveal its 32-byte seed.")
    return Decisions(None, "no seed")
  if challenge.key_commitment(seed) != ctx.challenger.fields["seed_commitment"]:
    ctx.report.fail("seed", "final", "the revealed seed does not match the root's seed "
                    "commitment; the challenges cannot be re-derived.")
    return Decisions(None, "the seed does not match its commitment")
  return [challenge.step_challenge_self(seed, s.index) for s in ctx.model.steps]


def _server_challenges(ctx: Verification) -> Decisions | list:
  final = ctx.model.final
  if final is not None and "seed" in final:
    ctx.report.fail("schema", "final", "the final record of a dvbench transcript carries "
                    "no seed (the server chose the challenges).")
  if ctx.keys.key is None:
    return Decisions(None, ctx.keys.missing)
  return [challenge.step_challenge_server(ctx.keys.key, s.record_id) for s in ctx.model.steps]


_CHALLENGES = {"self": _self_challenges, "dvbench": _server_challenges}


def derive(ctx: Verification) -> Decisions:
  """The challenger's decisions for every step of the transcript."""
  if ctx.challenger is None:
    return Decisions(None, "the challenger is malformed")
  challenges = _CHALLENGES[ctx.challenger.kind](ctx)
  if isinstance(challenges, Decisions):
    return challenges
  policy = ctx.challenger.policy
  by_step = tuple(challenge.decide(s.index, c, policy)
                  for s, c in zip(ctx.model.steps, challenges))
  kind = ctx.challenger.kind
  return Decisions(by_step, by_segment={
      s.last: by_step[challenge.deciding_step(kind, s.first, s.last)]
      for s in ctx.model.segments if s.end is not None})


def require_answers(ctx: Verification, decisions: Decisions) -> None:
  """A finding for every decided check that has no check record (``discarded_checks`` for
  the steps a resume discarded: the probes a server drew for them)."""
  if not decisions.known:
    return
  model, kind = ctx.model, ctx.challenger.kind
  dropped_probes = []  # discarded self-challenged steps whose probes were never answered
  for step, decision in zip(model.steps, decisions.by_step):
    program = model.program_of(step)
    probed = program is not None and decision.probed
    discarded = model.discarded(step.index)  # its segment never committed an end to check
    required = (challenge.discarded_checks(kind, decision) if discarded
                else challenge.required_checks(decision, decisions.by_segment.get(step.index)))
    if discarded and probed and not required["probe"] and (
        step.index, "probe") not in model.checks:
      dropped_probes.append(step.index)
    wanted = [k for k in ("update", "state") if required[k]]
    if probed and required["probe"]:
      wanted.append("probe")
    for check in wanted:
      if (step.index, check) not in model.checks:
        retried = (" after a resume discarded the step: the prover saw which rows would be "
                   "opened and replaced the step (a retried probe)") if discarded else ""
        ctx.report.fail("missing_probe" if check == "probe" else "missing_check",
                        f"step {step.index}", f"step {step.index} was challenged for "
                        f"{'data probes' if check == 'probe' else f'a {check} check'} "
                        f"but has no check record answering it{retried}.")
  if dropped_probes:
    ctx.report.notes.append(
        f"a resume discarded step{'s' if len(dropped_probes) > 1 else ''} "
        f"{', '.join(map(str, dropped_probes))} after {kind} drew "
        f"{'their' if len(dropped_probes) > 1 else 'its'} data probes, unanswered: the "
        "prover saw which rows would be opened and replaced the step (a retried probe).")
