"""Replaying committed steps after a resume from an earlier committed end (``CatchUp``).

A resumed run may restore a committed segment end before its transcript's last committed
state (a checkpoint saved before the one a kill interrupted), or its attested start: it
replays the committed steps after it first. Each replayed step's record is built again and
compared with the transcript's, nothing is written twice, and the checks a crash left
unanswered are answered from the replay. In a multi-process run process 0 plans from every
process's pieces of the restored state and the others follow (``plan_across``).

Example::

  end = replayable.end_of(pieces)           # the committed end the restored state is
  catch_up = replayable.catch_up(end, point)
  catch_up.check_replayed(record)           # ResumeStateError naming the field that differs
"""

import dataclasses
import logging

from zkdv import challenge
from zkdv import errors
from zkdv.jax import processes

logger = logging.getLogger("zkdv")

# A resumed run may restore the state of a committed segment end among this many last
# steps and replay the committed steps after it (``CatchUp``); their records are kept for
# the replay. (A multi-process run without a server commits every step.)
CATCH_UP_STEPS = 2048
START = -1  # the attested start as an end a run may restore: the state step 0 began from


def state_at(end: int) -> str:
  """How a message names the committed end ``end``: a step's, or the attested start."""
  return "the attested start" if end == START else f"the one step {end} committed"


@dataclasses.dataclass(frozen=True)
class Replayable:
  """What a resumed run may replay of a transcript's committed steps (``CatchUp``).

  Attributes:
    ends: step -> record of the committed segment ends it may restore (those of the last
      ``CATCH_UP_STEPS`` steps, none before a ``resume``; ``START``: the attested start).
    steps: step -> record of every step after the first of them, up to the last end.
    answered: (step, kind) of every check record.
    unanswered: (step, kind) of the chosen checks of kept steps without a record.
    decisions: step -> decision, and ("segment", first step) -> (the segment's length,
      its deciding step's decision), of the steps after the first end.
    resumed: (after, step) of the transcript's last ``resume`` record, or None.
  """

  ends: dict
  steps: dict
  answered: frozenset
  unanswered: tuple
  decisions: dict
  resumed: tuple | None = None

  def end_of(self, pieces: list) -> int | None:
    """The last committed end whose post-state has these piece digests (before the first
    unanswered check, where one matches there: states can repeat), else None."""
    pieces = [list(p) for p in pieces]
    matching = [i for i, record in self.ends.items() if record["post_state_leaves"] == pieces]
    before = [i for i in matching if self.unanswered and i < self.unanswered[0][0]]
    return max(before or matching, default=None)

  def restores_before(self, step: int) -> bool:
    return any(end < step for end in self.ends)

  def unanswered_message(self, restored: int | None) -> str:
    """What the first unanswered check needs: a state restored before it, else a new proof."""
    step, kind = self.unanswered[0]
    said = (f"step {step} was challenged for {challenge.CHECK_NAMES[kind]} before the crash "
            "and the transcript has no answer")
    before = [end for end in self.ends if end < step]
    if not before:
      return (f"{said}; its openings were lost with the process and no committed state "
              "before it can be replayed, so this proof can never be verified. Start a new "
              "proof.")
    restored = "" if restored is None else f", not {state_at(restored)}"
    newest = max(before)
    state = ("the attested start (proof.init's state, no checkpoint restored)"
             if newest == START else
             f"the state saved at the end of step {newest} or of an earlier segment end")
    return (f"{said}. Restore {state}{restored}: the resumed run replays the committed steps "
            "after it (the same batches in the same order) and answers the check from the "
            "replay.")

  def catch_up(self, end: int, point) -> "CatchUp":
    """The ``CatchUp`` of a run restored at committed end ``end``, before ``point.after``
    (``point``: the transcript's ``zkdv.jax.resume.ResumePoint``).
    Raises UnanswerableChallengeError when an unanswered check is not after ``end``."""
    if self.unanswered and self.unanswered[0][0] <= end:
      raise errors.UnanswerableChallengeError(self.unanswered_message(end))
    # From the state a resume went on from, the replay goes on where that resume did.
    first = self.resumed[1] if self.resumed and end == self.resumed[0] else end + 1
    logger.info("ZKDV: the restored state is %s: steps %d..%d are replayed and compared "
                "with their records before the run goes on at step %d.", state_at(end),
                first, point.after, point.steps)
    start = self.ends[end]
    return CatchUp(end, first, point.after,
                   {i: self.steps[i] for i in range(first, point.after + 1)},
                   self.decisions, self.answered, start["post_state"],
                   start["post_state_leaves"], point.record())


def plan_across(group, point, layouts: list, pieces: list,
                policy: challenge.Policy) -> "CatchUp | None":
  """``point.plan`` (a ``zkdv.jax.resume.ResumePoint``'s) of a restored state of which
  this process hashed ``pieces`` (None where another process holds a piece): process 0
  plans from every process's pieces, and every process gets the same ``CatchUp``, or
  raises the same error."""
  every = group.gather("resume/state", pieces)
  planned = None

  def plan():  # on process 0
    nonlocal planned
    try:
      planned = point.plan(layouts, processes.merge(every, "restored state"))
    except errors.ResumeStateError as e:
      differ = [i for i, held in enumerate(every) if _differs(held, point.pieces)]
      if not 0 < len(differ) < len(every):
        raise
      raise errors.ResumeStateError(
          f"{e} Only process{'es' * (len(differ) > 1)} {', '.join(map(str, differ))} "
          "restored pieces that differ: every process restores the same checkpoint.") from None
    return None if planned is None else planned.shared()

  shared = group.agree("resume/plan", plan)
  return planned if group.is_writer or shared is None else CatchUp.following(shared, policy)


def _differs(held: list, pieces: list) -> bool:
  """Whether a process's piece digests (None where it holds no piece) differ from ``pieces``."""
  return any(h is not None and h != p for leaf, committed in zip(held, pieces)
             for h, p in zip(leaf, committed))


@dataclasses.dataclass
class CatchUp:
  """Committed steps ``first..last`` a resumed run replays from the committed post-state
  of step ``restored``: their records are compared with those built again (``records``),
  not written; the checks with no record (``answered`` lists those with one) are answered
  from the replay; then the ``resume`` record goes on at its ``step``.

  Example::

    catch_up.decision(4)   # step 4's recorded decision
    catch_up.segment(3)    # (3, decision): the recorded segment starting at step 3
  """

  restored: int
  first: int
  last: int
  records: dict
  decisions: dict
  answered: frozenset
  start_state: bytes
  start_pieces: list
  resume: dict

  def decision(self, step: int) -> challenge.Decision:
    return self.decisions[step]

  def shared(self) -> dict:
    """What the other processes of a multi-process run replay of it (``following``): the
    steps, their challenges and segments, and which of their checks have records."""
    steps = range(self.first, self.last + 1)
    segments = []
    for i in steps:
      if ("segment", i) in self.decisions:
        length, decision = self.decisions["segment", i]
        segments.append([i, length, decision.step, decision.challenge])
    return {"restored": self.restored, "first": self.first, "last": self.last,
            "resume": self.resume, "answered": [[i, k] for i, k in self.answered if i in steps],
            "steps": [[i, self.decisions[i].challenge] for i in steps], "segments": segments}

  @classmethod
  def following(cls, shared: dict, policy: challenge.Policy) -> "CatchUp":
    """The replay of a process other than 0, from process 0's ``shared()``: the same
    decisions; process 0 alone compares the records (``records``, ``start_state`` and
    ``start_pieces`` are empty here, and never read)."""
    decisions = {i: challenge.decide(i, c, policy) for i, c in shared["steps"]}
    decisions.update({("segment", i): (length, challenge.decide(at, c, policy))
                      for i, length, at, c in shared["segments"]})
    return cls(shared["restored"], shared["first"], shared["last"], {}, decisions,
               frozenset((i, k) for i, k in shared["answered"]), b"", [], shared["resume"])

  def segment(self, step: int) -> tuple[int, challenge.Decision]:
    """(length, decision) of the committed segment starting at ``step``, the decision
    without the checks a record answers already (nothing is kept to open them);
    ResumeStateError when no committed segment started there."""
    try:
      length, decision = self.decisions[("segment", step)]
    except KeyError:
      raise errors.ResumeStateError(
          f"the replayed step {step} starts a segment where the committed run did not (a "
          "new program, or a state changed outside proof.jit): the committed steps "
          f"{self.first}..{self.last} are replayed as they ran.") from None
    last = step + length - 1
    return length, dataclasses.replace(
        decision, update=decision.update and (last, "update") not in self.answered,
        state=decision.state and (last, "state") not in self.answered)

  def check_replayed(self, record: dict) -> None:
    """Raises ResumeStateError unless a replayed step built its committed record again,
    naming the first field that differs. The program's number may differ: a restored
    state can export as another program (Orbax restores a weakly typed ``step`` as a
    strongly typed one); the batch, the states and the metrics it committed may not, and
    nothing of the replay is written but answers the verifier checks against the
    committed records."""
    index = record["index"]
    recorded = self.records[index]
    differ = sorted(k for k in recorded.keys() | record.keys()
                    if k not in ("prev", "program") and recorded.get(k) != record.get(k))
    if differ:
      field = differ[0]
      raise errors.ResumeStateError(
          f"the replayed step {index} differs from the step the transcript committed in "
          f"its {field} ({_shown(record.get(field))}, committed "
          f"{_shown(recorded.get(field))}): the committed steps {self.first}..{self.last} "
          f"are replayed from the state of step {self.restored}; feed them the same "
          "batches in the same order.")


def _shown(value) -> str:
  """A record field's value, short, for a message."""
  return value[:8].hex() + "…" if isinstance(value, bytes) else f"{value!r:.40}"
