"""A server's decisions on every process of a multi-process run.

Process 0 alone holds the stream to DVBench and learns each step's challenge.
Every ``window // 2`` steps (``SharedDecisions.due``), before a step is dispatched,
every process holds a *round*: process 0 publishes the challenges of the steps that
would otherwise outlast the rolling window (waiting for them if the server is late)
through the coordination service's key-value store, the others read them, and every
process takes the same decisions (``challenge.decide`` with the root's policy) for
the same steps. Segments are the root's length on every process. Until its segment's
last step is decided, each process keeps what the segment's checks open: the start state
(a device copy, made before the first step runs, of what it donates), every step's batch
and the last step's post-state. A round gathers what an update or state check opens
(collectives on the training thread, in the same order on every process; an update
check's replay runs the segment there too) and sends process 0 the probed rows held here.
A resumed run answers the steps it replays right after each runs (``answer_replayed``), and
a round asks for the rows of probes owed for discarded steps whose batch a step trains again.

Example::

  shared = SharedDecisions(group, challenger, committer)
  shared.keep(job, leaves)          # at dispatch, instead of gathering openings
  shared.keep_post(job, post)
  if shared.due(steps, window):
    shared.settle(steps, window)    # before the next step: decide what leaves the window
  shared.close()                    # at finish: the last step ends its segment
  shared.settle(steps)              # then decide every step
"""

import dataclasses

import numpy as np

from zkdv import challenge
from zkdv import challengers
from zkdv import errors
from zkdv.jax import arrays


def follower_challenger(fields: dict, seed: bytes | None):
  """The challenger of a process other than 0, from the root's challenger fields process 0
  shared: the same effective policy, and process 0's seed or its server's decisions."""
  policy = challenge.Policy.from_record(fields["policy"])
  if fields["kind"] == "dvbench":
    return FollowerChallenger(fields, policy)
  return challengers.SelfChallenger(policy, seed)


class FollowerChallenger:
  """The server's challenger on a process other than 0: it never decides itself; every
  decision comes from process 0 in a ``SharedDecisions`` round.

  Args:
    root_fields: the root's ``challenger`` map, as process 0 wrote it.
    policy: the effective policy (the root's).
  """

  kind = "dvbench"

  def __init__(self, root_fields: dict, policy: challenge.Policy):
    self._root_fields = root_fields
    self.policy = policy

  def root_fields(self) -> dict:
    return dict(self._root_fields)

  def final_fields(self) -> dict:
    return {}

  def decision_now(self, step: int) -> None:
    """Never known before the step runs (process 0 publishes it in a later round)."""
    del step
    return None

  def close(self) -> None:
    pass


@dataclasses.dataclass
class PendingStep:
  """What one dispatched step keeps until its segment is answered: its input leaves
  (the state leaves only at a segment's first step, the batch leaves always; a leaf some
  step donates is kept as a copy made before that step ran) and, until the next step
  shows that it ends no segment, its post-state."""

  job: object
  inputs: list
  first: int  # the first step of its segment
  ends: bool  # it ends its segment (planned, or known once the next step starts)
  post: list | None = None


class SharedDecisions:
  """Rounds in which every process takes the server's decisions for the same steps.

  Args:
    group: the run's ``processes.ProcessGroup``.
    challenger: process 0's ``ServerChallenger``, or a ``FollowerChallenger``.
    committer: this process's ``Committer``.
  """

  def __init__(self, group, challenger, committer):
    self._group, self._challenger, self._committer = group, challenger, committer
    committer.owed.in_rounds = True  # a resumed run's owed probes are answered in rounds
    self._pending: dict[int, PendingStep] = {}
    self._holders: dict[int, list] = {}  # id(leaf) -> [(kept list, index)] holding it
    self._settled = 0  # steps 0 .. settled-1 are decided on every process
    self._rounds = 0
    self._last: PendingStep | None = None  # the last step dispatched

  def keep(self, job, leaves: list) -> None:
    """Keeps what the step's segment's checks open until its round: the state leaves at
    a segment's first step and the batch leaves, as references or, for a leaf the step
    donates, as a device copy made before it runs (which then replaces that leaf wherever
    an earlier step keeps it: its post-state)."""
    program, last = job.program, self._last
    if last is not None and last.post is not None:
      if job.starts:
        last.ends = True  # planned, or a boundary the last step did not plan
      else:  # its post-state is this step's pre-state, inside the segment: not kept
        self._release(last.post)
        last.post = None
    kept = set(program.batch_indices) | (set(program.state_indices) if job.starts else set())
    inputs = [x if i in kept else None for i, x in enumerate(leaves)]
    donated = [i for i in sorted(kept) if program.donated[i]]
    for i, copy in zip(donated, arrays.device_copies([leaves[i] for i in donated])):
      inputs[i] = copy
      for held, n in self._holders.pop(id(leaves[i]), []):
        held[n] = copy
        self._hold(held, n)
    first = job.index if job.starts or last is None else last.first
    self._last = self._pending[job.index] = PendingStep(job, inputs, first, job.ends)
    for n in range(len(inputs)):
      self._hold(inputs, n)

  def keep_post(self, job, post: list) -> None:
    """Keeps a step's post-state (references, copied once a later step donates them)
    until the next step shows whether it ends a segment."""
    post = self._pending[job.index].post = list(post)
    for n in range(len(post)):
      self._hold(post, n)

  def close(self) -> None:
    """The last step dispatched ends its segment (``finish``)."""
    if self._last is not None:
      self._last.ends = True

  def _hold(self, leaves: list, n: int) -> None:
    if leaves[n] is not None:
      self._holders.setdefault(id(leaves[n]), []).append((leaves, n))

  def _release(self, leaves: list) -> None:
    for x in leaves:
      rest = [(held, n) for held, n in self._holders.get(id(x), []) if held is not leaves]
      if rest:
        self._holders[id(x)] = rest
      else:
        self._holders.pop(id(x), None)

  def continue_at(self, steps: int) -> None:
    """A resumed run: the server decided the ``steps`` stored before the crash; rounds
    decide the steps from there on (replayed ones answer as ``answer_replayed`` says)."""
    self._settled = steps

  def answer_replayed(self, step: int, catch_up) -> None:
    """Answers, right after it ran, a step a resumed run replays (``catch_up``, a
    ``zkdv.jax.catch_up.CatchUp``): its decision came before the crash, so no round is
    held; what it opens is gathered as a round's is, on every process, for the checks
    without a record (``CatchUp.segment``; probes answered already are not written again)."""
    pending, decision = self._pending[step], catch_up.decision(step)
    if pending.ends:  # the segment's checks, less those a record answers
      segment = catch_up.segment(pending.first)[1]
      decision = dataclasses.replace(decision, update=segment.update, state=segment.state)
    rows = []
    answer = self._open(decision, rows)
    self._committer.answer_round(f"replayed/{step}", [answer], rows, release=False)

  @staticmethod
  def due(steps: int, window: int) -> bool:
    """Whether a round is held before step ``steps``: every ``window // 2`` steps, so
    that the processes between rounds dispatch steps as they would offline.

    Example: with a window of 8, before steps 4, 8, 12, ...
    """
    return steps % _round_every(window) == 0

  def settle(self, steps: int, window: int | None = None) -> None:
    """Holds a round before step ``steps`` is dispatched (``due``): decides the steps that
    leave a ``window`` of process 0's choosing before the next round (when None, every
    step whose record is written: all ``steps`` once ``close`` ended the last segment) and
    answers them. Every process calls it at the same points."""
    group = self._group
    key = f"decisions/{self._rounds}"
    self._rounds += 1
    if group.is_writer:
      # At most window - 1 undecided steps when the next round comes, window // 2 steps on.
      if window is not None:
        through = max(self._settled, steps - window + _round_every(window))
      else:  # the last step's record waits for its segment's end while that is open
        through = steps if self._last is None or self._last.ends else steps - 1
      deciding = range(self._settled, max(self._settled, through))
      try:
        challenges = [self._challenger.decision(t).challenge for t in deciding]
      except errors.ZKDVError as e:  # the others raise at the same step, not in a collective
        group.broadcast(key, {"error": f"{type(e).__name__}: {e}"})
        raise
      # A resumed run's probes owed for discarded steps whose batch these steps train again.
      owed = list(map(self._committer.owed.rows_for_round, deciding))
      group.broadcast(key, {"window": window, "challenges": challenges, "owed": owed})
    else:
      window, challenges, owed = _round(group.broadcast(key))
      if window is not None:
        self._committer.pipeline.grow(window)
    policy = self._challenger.policy
    answers, rows = [], []
    for t, step_challenge in enumerate(challenges, start=self._settled):
      decision = challenge.decide(t, step_challenge, policy)
      self._held_rows(decision.step, owed[t - self._settled], rows)
      answers.append(self._open(decision, rows))
    self._settled += len(challenges)
    self._committer.answer_round(key, answers, rows)

  def _held_rows(self, step: int, wanted: list, rows: list) -> None:
    """Appends to ``rows`` this process's shards of the ``wanted`` rows (``[leaf, row]``)
    of step ``step``'s batch, as ``[step, leaf, row, bytes]``."""
    pending = self._pending[step]
    program, blocks = pending.job.program, {}
    for leaf, row in wanted:
      layout = program.batch_layouts[leaf]
      if leaf not in blocks:
        blocks[leaf] = arrays.row_shards(pending.inputs[program.batch_indices[leaf]], layout)
      data = self._committer.digests.row_bytes(blocks[leaf], row)
      if data is not None:
        rows.append([step, leaf, row, bytes(data)])

  def _open(self, decision: challenge.Decision, rows: list) -> tuple:
    """What answering ``decision`` needs: (decision, whether it decides its segment's
    checks, ``[(step, whole inputs)]`` of the segment's steps, post-state and replayed
    post-state where a check opens them, else None), gathered by collectives, the same on
    every process; appends the probed rows held here to ``rows`` (``[step, leaf, row,
    bytes]``). A step that ends its segment releases what the segment kept."""
    pending = self._pending[decision.step]
    program = pending.job.program
    self._held_rows(decision.step, [[leaf, row] for leaf, layout in
                                    enumerate(program.batch_layouts)
                                    for row in decision.leaf_probe_rows(leaf, layout)], rows)
    if not pending.ends:  # its segment's checks wait for the segment's last step
      return decision, False, None, None, None
    segment = [self._pending[t] for t in range(pending.first, decision.step + 1)]
    opened = post = replayed = None
    if decision.update:
      opened = [(kept.job.index, _gathered(kept.job.index, kept.inputs)) for kept in segment]
      if self._committer.prover_replays:
        replayed = _replayed(program, [inputs for _, inputs in opened])
    if decision.state or (decision.update and not program.exact):
      post = _gathered(decision.step, pending.post)
    for kept in segment:
      del self._pending[kept.job.index]
      self._release(kept.inputs)
    self._release(pending.post or [])
    if self._last is pending:
      self._last = None
    return decision, True, opened, post, replayed


def _round(message) -> tuple[int | None, list[bytes], list]:
  """(window, challenges, owed rows of each step) of a round process 0 published;
  ChallengeTimeoutError when process 0 got no challenges for it, CommitmentError if
  malformed."""
  if isinstance(message, dict) and isinstance(message.get("error"), str):
    raise errors.ChallengeTimeoutError(
        f"process 0 has no challenges from DVBench for this round: {message['error']}")
  window = message.get("window") if isinstance(message, dict) else None
  challenges = message.get("challenges") if isinstance(message, dict) else None
  owed = message.get("owed") if isinstance(message, dict) else None
  if (not isinstance(challenges, list) or not (window is None or isinstance(window, int)) or
      not all(isinstance(c, bytes) and len(c) == challenge.KEY_BYTES for c in challenges) or
      not isinstance(owed, list) or len(owed) != len(challenges) or
      not all(isinstance(rows, list) and all(
          isinstance(r, list) and len(r) == 2 and all(type(i) is int and i >= 0 for i in r)
          for r in rows) for rows in owed)):
    raise errors.CommitmentError(f"process 0 published a malformed round: {message!r:.200}.")
  return window, challenges, owed


def _round_every(window: int) -> int:
  return max(1, window // 2)


def _replayed(program, opened: list[list]) -> list[np.ndarray]:
  """The whole post-state of replaying a segment's steps (``program.replay_sharded``,
  collectives) from the whole inputs ``opened`` of each: the first step's state, every
  step's batch."""
  state = [opened[0][i] for i in program.state_indices]
  for inputs in opened:
    inputs = list(inputs)
    for n, i in enumerate(program.state_indices):
      inputs[i] = state[n]
    state = program.replay_sharded(inputs)
  return state


def _gathered(step: int, leaves: list) -> list[np.ndarray | None]:
  """The whole leaves (None stays) on every process (collectives); CommitmentError if
  one was deleted."""
  if any(x is not None and x.is_deleted() for x in leaves):
    raise errors.CommitmentError(
        f"step {step}: a leaf its check opens was deleted before the check (donated to a "
        "step outside proof.jit?). Keep the arrays of a multi-process run challenged live "
        "until their steps' decisions came (the rolling window).")
  return [None if x is None else arrays.gather(x) for x in leaves]
