"""Challengers: who decides which steps a proof must open (docs/design.md §6, §10).

The driver asks its challenger for each step's ``challenge.Decision``. It does
not care which challenger it has beyond *when* the decision arrives:

* ``SelfChallenger`` decides before the step runs, from a seed the prover drew
  (committed in ``root``, revealed in ``final``). Offline runs use it; it
  detects faults, not a dishonest prover.
* ``ServerChallenger`` learns each decision from DVBench after the server has
  stored the step's record (``deliver``, called by the uploader); until then
  the driver keeps what it would need to answer.

Example::

  challenger = SelfChallenger(challenge.Policy(update_check_probability=0.1))
  decision = challenger.decision_now(0)  # known at once
  challenger.root_fields()               # {"kind": "self", "seed_commitment": ..., ...}
"""

import logging
import threading
import time
from collections.abc import Callable

from zkdv import challenge
from zkdv import errors

logger = logging.getLogger("zkdv")


class SelfChallenger:
  """Decisions from a seed the prover drew: known before each step runs."""

  kind = "self"

  def __init__(self, policy: challenge.Policy, seed: bytes | None = None):
    self.policy = policy
    self.seed = challenge.new_key() if seed is None else seed

  def root_fields(self) -> dict:
    return {"kind": self.kind, "seed_commitment": challenge.key_commitment(self.seed),
            "policy": self.policy.to_record()}

  def final_fields(self) -> dict:
    return {"seed": self.seed}

  def decision_now(self, step: int) -> challenge.Decision:
    return challenge.decide(step, challenge.step_challenge_self(self.seed, step), self.policy)

  def close(self) -> None:
    pass


class ServerChallenger:
  """Decisions that DVBench sends after storing each step record.

  Args:
    root_fields: the root's ``challenger`` map, from the server's proof slot.
    policy: the effective policy (the root's).
    timeout_s: how long a wait for a decision may last before
      ``ChallengeTimeoutError``.
    describe: the transcript folder and how to resume, for error messages.
  """

  kind = "dvbench"

  def __init__(self, root_fields: dict, policy: challenge.Policy, timeout_s: float = 600.0,
               describe: Callable[[], str] = lambda: ""):
    self._root_fields = root_fields
    self.policy = policy
    self.timeout_s = timeout_s
    self._describe = describe
    self._decided: dict[int, challenge.Decision] = {}
    self._delivering: set[int] = set()  # decided, its answer being queued (``deliver``)
    self._decided_before = 0  # a resumed proof's stored steps, decided before the crash
    self._asked: dict[int, float] = {}  # step -> when it was dispatched
    self._answer_times: list[float] = []  # the last few dispatch-to-decision intervals
    self._failure: str | None = None
    self._logged_wait = False
    self._changed = threading.Condition()
    self.on_decision: Callable[[challenge.Decision], None] | None = None
    self.on_waiting: Callable[[], None] | None = None

  def root_fields(self) -> dict:
    return dict(self._root_fields)

  def final_fields(self) -> dict:
    return {}

  @property
  def decided_steps(self) -> int:
    """How many steps the server has decided (training may run a window beyond them)."""
    return self._decided_before + len(self._decided)

  def resume_at(self, steps: int) -> None:
    """A resumed proof: its ``steps`` stored steps were decided before the crash."""
    self._decided_before = steps

  @property
  def answer_seconds(self) -> float | None:
    """The median time from a step's dispatch to its decision (None before one came):
    committing, uploading and the server's round trip."""
    with self._changed:
      times = sorted(self._answer_times)
    return times[len(times) // 2] if times else None

  def decision_now(self, step: int) -> None:
    """Never known before the step runs: the server decides after storing it (the
    dispatch time is kept, to measure ``answer_seconds``)."""
    with self._changed:
      self._asked[step] = time.monotonic()
    return None

  def deliver(self, step: int, step_challenge: bytes) -> None:
    """Called by the uploader with the server's challenge for ``step``."""
    if not isinstance(step_challenge, bytes) or len(step_challenge) != challenge.KEY_BYTES:
      self.fail(f"the server sent a malformed challenge for step {step}.")
      return
    decision = challenge.decide(step, step_challenge, self.policy)
    with self._changed:
      if step in self._decided or step in self._delivering:
        return  # a resent acknowledgement
      self._delivering.add(step)
    # Its answer is queued before anyone sees the step decided: finish() waits for the
    # decisions, then for what is queued, and an answer queued after that would be lost.
    if self.on_decision is not None:
      self.on_decision(decision)
    with self._changed:
      self._delivering.discard(step)
      self._decided[step] = decision
      asked = self._asked.pop(step, None)
      if asked is not None:
        self._answer_times = (self._answer_times + [time.monotonic() - asked])[-16:]
      self._changed.notify_all()

  def hurry(self) -> None:
    """Decisions are needed soon (training nears the end of its window): what carries
    them goes now (``on_waiting``)."""
    if self.on_waiting is not None:
      self.on_waiting()

  def fail(self, reason: str) -> None:
    """No more decisions will come (the upload failed): waiting raises."""
    with self._changed:
      self._failure = reason
      self._changed.notify_all()

  def waiting(self, seconds: float, what: str) -> None:
    """Called while training waits on decisions: logs once, raises when they cannot come
    (the upload failed) or after ``timeout_s``."""
    if self._failure is not None:
      raise errors.ChallengeTimeoutError(
          f"no challenges can come from DVBench: {self._failure}. {self._describe()}")
    if seconds > self.timeout_s:
      raise errors.ChallengeTimeoutError(
          f"DVBench sent no challenge for {self.timeout_s:.0f} s while training waited "
          f"for {what}. {self._describe()}")
    if self.on_waiting is not None:
      self.on_waiting()
    if seconds >= 5 and not self._logged_wait:
      self._logged_wait = True
      logger.warning("ZKDV: training waits for DVBench's challenges (%s); it resumes when "
                     "the server answers, or stops after %.0f s.", what, self.timeout_s)

  def decision(self, step: int) -> challenge.Decision:
    """Step ``step``'s decision, once the server sent it (waits as ``wait_for``)."""
    started = time.monotonic()
    with self._changed:
      while step not in self._decided:
        self.waiting(time.monotonic() - started, f"the challenge of step {step}")
        self._changed.wait(1.0)
      return self._decided[step]

  def wait_for(self, steps: int) -> None:
    """Blocks until steps ``0 .. steps-1`` all have decisions."""
    started = time.monotonic()
    with self._changed:
      while self.decided_steps < steps:
        self.waiting(time.monotonic() - started, f"the challenges of {steps} steps")
        self._changed.wait(1.0)

  def close(self) -> None:
    self.fail("the proof was closed")
