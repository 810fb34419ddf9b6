"""What steps and segments keep until their decisions are answered.

A step keeps its batch trees and opened views until its decision is
answered (its probes); a segment keeps its start and end until the decision
of its deciding step (``challenge.deciding_step``) is: a self-chosen one's
first step, known when it is dispatched, or a server's last step, which
arrives late (``answer_late``). Once a segment and all its steps are answered
what they kept is dropped.

Example::

  answers = Answers(openings)
  answers.keep(job, trees)
  answers.open_segment(segment)
  answers.answer_late(decision)     # writes the probes and the segment's checks
"""

import dataclasses

from zkdv import challenge
from zkdv import errors
from zkdv.jax.commit_jobs import Kept, Segment, StepJob
from zkdv.jax.openings import Openings


class Answers:
  """Kept steps and segments, and the check records that answer their decisions.

  Args:
    openings: writes the check records.
    replay: the prover replays each update check's segment itself (the server
      does not replay every segment); read at each answer.
  """

  def __init__(self, openings: Openings, replay: bool = True):
    self.openings = openings
    self.replay = replay
    self.segments: dict[int, Segment] = {}  # first step -> segment
    self.answered: frozenset = frozenset()  # (step, kind) the records of replayed steps answer
    self._kept: dict[int, Kept] = {}

  @property
  def pending_steps(self) -> int:
    return sum(not kept.answered for kept in self._kept.values())

  def keep(self, job: StepJob, trees) -> None:
    """Keeps what answering the step's decision needs: its batch trees and views."""
    self._kept[job.index] = Kept(job, trees)

  def open_segment(self, segment: Segment) -> None:
    self.segments[segment.first] = segment

  def answer_late(self, decision: challenge.Decision) -> None:
    """Answers a server's decision that arrived after its step was written."""
    kept = self._kept.get(decision.step)
    if kept is None or kept.answered:
      raise errors.CommitmentError(
          f"a challenge arrived for step {decision.step}, which is not awaiting one.")
    segment = self._segment_ending(decision.step)
    decides = segment is not None and challenge.deciding_step(
        "dvbench", segment.first, segment.last) == decision.step
    self.answer(decision, decision if decides else None)

  def answer_shared(self, decision: challenge.Decision, rows: list, opened, post,
                    replayed, owed=()) -> None:
    """Answers a decision every process of a multi-process run took, from what they
    opened: the probed rows each process sent (``[leaf, row, bytes]``) and, for a
    segment's check, ``[(step, whole inputs)]`` of its steps, its post-state and
    replayed post-state; and the probes ``owed`` for discarded steps whose batch this one
    trains again (``[(zkdv.jax.resume.OwedProbes, their batch roots)]``). Raises
    CommitmentError naming a probed row no process sent."""
    kept = self._kept.get(decision.step)
    if kept is None or kept.answered:
      raise errors.CommitmentError(
          f"a challenge arrived for step {decision.step}, which is not awaiting one.")
    job, row_data = kept.job, kept.trees[1]
    for leaf, row, data in rows:
      row_data.setdefault((leaf, row), data)
    for probing in [decision] + [o.decision for o, _ in owed]:
      for leaf, layout in enumerate(job.program.batch_layouts):
        missing = [r for r in probing.leaf_probe_rows(leaf, layout)
                   if (leaf, r) not in row_data]
        if missing:
          raise errors.CommitmentError(
              f"step {probing.step}: no process sent rows {missing} of batch leaf "
              f"{layout.path}, which the challenge probes. Every process must take its "
              "decisions from process 0's rounds (zkdv.jax.shared_decisions).")
    for owed_probes, roots in owed:
      self.openings.probe(dataclasses.replace(job, index=owed_probes.decision.step),
                          owed_probes.decision, kept.trees, roots)
    for step, inputs in opened or []:
      self._kept[step].job.opened = inputs
    job.checked = (post, replayed)
    segment = self._segment_ending(decision.step)
    if segment is not None and post is not None:
      segment.end_views = post
    self.answer_late(decision)

  def answer(self, decision: challenge.Decision, segment_decision) -> None:
    """Writes the check records that answer ``decision``: the probes of its step and,
    when the step ends a segment, the segment's update and state checks as
    ``segment_decision`` chose them (a replayed segment's without the checks a record
    answers: ``zkdv.jax.catch_up.CatchUp.segment``); probes only where no record answers
    them already (``answered``: a resumed run's replayed steps)."""
    kept = self._kept[decision.step]
    segment = self._segment_ending(decision.step) if segment_decision is not None else None
    if segment is not None:
      if segment_decision.update:
        jobs = [self._kept[i].job for i in range(segment.first, segment.last + 1)]
        self.openings.update(segment, jobs, self.replay)
      if segment_decision.state:
        self.openings.state(segment.last, segment.end_views)
      segment.answered = True
    if (decision.step, "probe") not in self.answered:
      self.openings.probe(kept.job, decision, kept.trees)
    kept.answered = True
    self.release()

  def release(self) -> None:
    """Drops what no unanswered decision or segment needs any more."""
    for first in [f for f, s in self.segments.items() if s.answered]:
      segment = self.segments[first]
      if all(self._kept.get(i, Kept(None, None, True)).answered
             for i in range(segment.first, segment.last + 1)):
        for i in range(segment.first, segment.last + 1):
          self._kept.pop(i, None)
        del self.segments[first]

  def _segment_ending(self, step: int) -> Segment | None:
    for segment in self.segments.values():
      if segment.last == step and segment.end is not None and not segment.answered:
        return segment
    return None
