"""The training thread's side of a proof: dispatching steps.

For each ``proof.jit`` call the dispatcher takes a window slot, asks the
challenger for the step's decision, places the step in a segment (a state
commitment every ``k`` steps), prepares what must be hashed or kept before the
executable may donate its inputs, runs the executable and hands the committer
a ``StepJob``.

Example::

  dispatcher = Dispatcher(committer, challenger, digests, group, config)
  outs = dispatcher.run(program, leaves)
"""

import contextlib
import logging
import math
import statistics
import threading
import time

import numpy as np

from zkdv import challenge
from zkdv import challengers
from zkdv import config as config_lib
from zkdv import errors
from zkdv import overlap as overlap_lib
from zkdv import records
from zkdv.jax import _compat
from zkdv.jax import arrays
from zkdv.jax.commit_jobs import StepJob
from zkdv.jax.dispatch_resume import ResumedDispatch
from zkdv.jax.shared_decisions import SharedDecisions

logger = logging.getLogger("zkdv")


def adaptive_segment_length(step_seconds: float, state_seconds: float, batch_seconds: float,
                            bound: int) -> int:
  """The shortest k whose commitments (a state hash per k steps, a batch every step)
  cost at most ``COMMITMENT_BUDGET`` of a step; ``bound`` when the batches alone do not fit.

  Example: 10 ms state hashes, 0.5 ms batches, 50 ms steps: the budget (2 %) is 1 ms a
  step, 0.5 ms of it left for the state, so ``k = ceil(10 / 0.5) = 20``.
  """
  spare = config_lib.COMMITMENT_BUDGET * step_seconds - batch_seconds
  if spare * bound <= state_seconds:
    return bound
  return max(1, math.ceil(state_seconds / spare))


class Dispatcher(ResumedDispatch):
  """Runs steps on the training thread, plans segments and queues their commitments.

  A segment ends after ``segment_length`` steps (fixed, or chosen per segment from
  the measured step time and hashing cost: ``next_segment_length``), and before a
  step of another program or one whose state is not the arrays the last step
  returned. Equivalent-mode programs and multi-process runs without a server's
  decisions commit every step.

  Attributes:
    steps: the number of steps dispatched so far.
    shared: a multi-process run's rounds of a server's decisions, else None.
  """

  def __init__(self, committer, challenger, digests, group, config):
    self._committer, self._challenger = committer, challenger
    self._digests, self._group, self._config = digests, group, config
    self.steps = 0
    self._lock = threading.Lock()
    self._last_post_leaves: list | None = None
    self._last_program = None
    self._segment_first = 0
    self._segment_length = 1
    self._ended = True  # the last step ended its segment
    self._segment_decision = None
    self._step_times: list[float] = []
    self._last_dispatch: float | None = None
    self._waited = 0.0  # since the last dispatch, on the window, hashes and checks
    self._viewing = None  # (pipeline job, step) of the last step, if it views its post-state
    self.restored = None  # a resumed run's ResumePoint, until its first step checked it
    self.catch_up = None  # a resumed run's CatchUp while it replays committed steps
    self._replayed = None  # a CatchUp replayed, until its run's first new step
    self._rekey_from = None  # the step whose keys a replay's first step was given, until it runs
    self.untaken_batch = None  # the batch of the call being dispatched, until it takes its step
    self._said_window_short = False
    self.shared = (SharedDecisions(group, challenger, committer)
                   if group.multi and challenger.kind == "dvbench" else None)

  def run(self, program, leaves: list, data=None) -> list:
    """Dispatches one step of ``program`` and queues its commitment and checks; ``data``:
    the ``zkdv.jax.sampler.SampledBatch`` the step consumes, if any."""
    committer, multi = self._committer, self._group.multi
    self.untaken_batch = data
    if committer.program_number(program) is None:  # a new program: before anything is taken
      _check_probe_size(program, self._challenger.policy.probe_ratio, data)
    if not multi:  # across processes, failures wait for finish(): see ProcessGroup.agree_on_outcome
      committer.pipeline.raise_if_failed()
    if self.restored is not None:
      data = self.untaken_batch = self._check_restored(program, leaves, data)
    if self._rekey_from is not None:  # the call again, after a first try that raised
      self._rekey(program, leaves, self._rekey_from, self.steps)
    if data is not None and data.redrawn:  # drawn before the replay went back: other rows
      leaves = data.put_into(program, leaves)
    elif self._replayed is not None:  # the first step after a replay: the run goes on
      committer.submit_resume(self._replayed.resume)
      self._replayed = None
    if self.shared is not None:  # across processes, the window changes only in rounds
      if self.catch_up is None and self.shared.due(self.steps, committer.pipeline.window):
        if self._group.is_writer:
          self._size_window()
        with self._waiting():  # for process 0's decisions: not a step's own time
          self.shared.settle(self.steps, committer.pipeline.window)
    elif isinstance(self._challenger, challengers.ServerChallenger) and self.catch_up is None:
      if committer.pipeline.full:
        self._size_window()
      elif 2 * (committer.written_steps - self._challenger.decided_steps) >= (
          committer.pipeline.window):
        self._challenger.hurry()  # half the window waits: no more coalescing records
    # A step that cannot enter the window raises before anything is taken: call it again.
    with self._waiting():
      committer.pipeline.reserve(waiting=self._waiting_for_window)
    self._time_step()
    with self._lock:
      index = self.steps
      self.steps += 1
    self.untaken_batch = self._rekey_from = None
    catch_up = self.catch_up
    if catch_up is None:
      decision = self._challenger.decision_now(index)
    else:  # across processes, answered from every process's openings (answer_replayed)
      decision = None if self.shared is not None else catch_up.decision(index)
    job = self._prepare(program, index, leaves, decision)
    job.data = data
    if any(program.donated) and self._viewing is not None:
      viewing, step = self._viewing
      with self._waiting():
        if (self._digests.name == "host" and not self._config.cross_check_replicas
            and step.previous_end_started is None):
          step.post_views(self._digests)  # views held: donation copies (waits for the step)
        else:
          viewing.views_ready.wait()  # no donation of a post-state being hashed
    outs = program.executable(*leaves)
    post = [outs[i] for i in program.post_indices]
    if program.post_layouts is None:  # as the first run of this program placed it
      program.place_post_state(post)
    if committer.program_number(program) is None:
      committer.submit_program(program)
    job.post = post
    if job.ends:
      job.post_started = self._digests.start_state(post, program.post_layouts)
    job.metrics = [(name, outs[i]) for name, i in program.metric_outputs]
    if self.shared is not None:
      self.shared.keep_post(job, post)
    elif multi and job.segment_decision.any_check:  # collectives stay on this thread
      # (a step is a segment here: its decision, less what a replayed step answered)
      job.checked = ([arrays.gather(x) for x in post],
                     program.replay_sharded(job.opened) if job.segment_decision.update
                     else None)
    replayed_across = self.shared is not None and catch_up is not None
    submitted = committer.submit_step(job, answered_with_it=replayed_across)
    if replayed_across:
      self.shared.answer_replayed(index, catch_up)  # opened here: no fence below
    # Only a step that ends a segment views its post-state (this step's input) on the
    # commit thread; a commit thread busy with other work (a check's openings) need not
    # hold training back until the window is full.
    self._viewing = ((submitted, job) if job.ends or job.previous_end_started is not None
                     else None)
    self._last_post_leaves, self._last_program = post, program
    overlap = program.overlap or overlap_lib.UNCHECKED
    checked = (self.shared is None and job.segment_decision is not None
               and job.segment_decision.any_check)
    if overlap is overlap_lib.NEVER:
      with self._waiting():
        submitted.done.wait()
    elif overlap is overlap_lib.UNCHECKED and checked and job.ends:
      with self._waiting():
        submitted.replayed.wait()  # a fence: its openings are written behind training
    if catch_up is not None and index == catch_up.last:  # replayed: the next step goes on
      with self._lock:
        self.steps = catch_up.resume["step"]
      # Its resume record waits for that step: a run killed before it (saving this state's
      # checkpoint, say) may still restore the state it replayed from.
      self.catch_up, self._replayed = None, catch_up
    if not multi:
      committer.pipeline.raise_if_failed()
    return outs

  def _time_step(self) -> None:
    """Records the interval since the last dispatch, less the time it waited on
    commitments and checks (hashing is costed apart; a check is not a step)."""
    now = time.perf_counter()
    if self._last_dispatch is not None and self.steps >= 2:  # not the compiling steps
      interval = now - self._last_dispatch - self._waited
      self._step_times = (self._step_times + [interval])[-16:]
    self._last_dispatch, self._waited = now, 0.0

  @contextlib.contextmanager
  def _waiting(self):
    """Counts the time inside as waiting on the pipeline, not stepping."""
    started = time.perf_counter()
    try:
      yield
    finally:
      self._waited += time.perf_counter() - started

  def next_segment_length(self, program) -> int:
    """The length of a segment starting now: 1 for equivalent programs and across
    processes offline; the root's across processes with a server's decisions (the same on
    every process); else the configured one, or the adaptive choice (1 until measured)."""
    bound = self._challenger.policy.segment_length
    if not program.exact or (self._group.multi and self.shared is None):
      return 1
    if self.shared is not None:
      return bound
    if self._config.segment_length is not None:
      return min(self._config.segment_length, bound)
    gathering = self._committer.gathering
    hash_seconds, batch_seconds = gathering.hash_seconds, gathering.batch_seconds
    if hash_seconds is None or not batch_seconds or len(self._step_times) < 2:
      return 1
    kept = config_lib.adaptive_segment_bound(config_lib.kept_window(_batch_bytes(program)))
    return adaptive_segment_length(statistics.median(self._step_times), hash_seconds,
                                   statistics.median(batch_seconds), min(bound, kept))

  def _prepare(self, program, index: int, leaves: list, decision) -> StepJob:
    """The step's job before dispatch: its place in a segment and what must be hashed
    or kept before donation."""
    digests = self._digests
    state = [leaves[i] for i in program.state_indices]
    batch = [leaves[i] for i in program.batch_indices]
    job = StepJob(index, program, post=[], post_started=None, decision=decision)
    continuous = (self._last_post_leaves is not None and len(state) == len(self._last_post_leaves)
                  and all(a is b for a, b in zip(state, self._last_post_leaves)))
    same_program = program is self._last_program
    job.starts = self._ended or not continuous or not same_program
    ends_checked = False  # the last step's segment ends here, and a chosen check opens its end
    if job.starts:
      if not self._ended:  # a boundary the last step did not plan: it ends there
        job.previous_continues = continuous
        previous = self._segment_decision
        ends_checked = continuous and previous is not None and (
            previous.state or (previous.update and not self._last_program.exact))
        if not continuous:
          job.previous_end_started = self._readable_last_post()
      if self.catch_up is not None:  # a replayed segment: as committed, decided already
        self._segment_first = index
        self._segment_length, self._segment_decision = self.catch_up.segment(index)
      else:
        self._segment_first, self._segment_length = index, self.next_segment_length(program)
        # Known now when this step decides the segment (a self-chosen one's first step); a
        # server decides it after the segment's last step is stored (Committer.answer).
        deciding = challenge.deciding_step(self._challenger.kind, index, None)
        self._segment_decision = decision if deciding == index else None
      if not (continuous and self._ended):  # else the committed post-state, not hashed again
        job.pre_started = digests.start_state(state, program.state_layouts)
        if any(program.donated[i] for i in program.state_indices):  # hash before donation
          job.pre_hashed = digests.state_digests(digests.materialize(job.pre_started))
          job.pre_started = None
    job.ends = index - self._segment_first + 1 >= self._segment_length
    job.segment_decision = self._segment_decision
    self._ended = job.ends
    job.rows_started = digests.start_rows(batch, program.batch_layouts)
    if any(program.donated[i] for i in program.batch_indices):
      job.batch_hashed = self._committer.gathering.hash_batch(program, job.rows_started,
                                                              decision, copy=True)
      job.rows_started = None
    # Openings are whole leaves: the start state and every batch of a segment. A
    # zero-copy host view keeps its input alive (JAX does not donate a buffer a view
    # holds), so nothing is copied; across processes, gathering them is a collective.
    # A self-chosen segment that no update check hit keeps nothing; across processes, a
    # step a server decides later keeps its inputs (a copy of those it donates) until the
    # round that decides it (``SharedDecisions.keep``).
    opens = job.segment_decision is None or job.segment_decision.update
    if self.shared is not None:
      self.shared.keep(job, leaves)
    elif self._group.multi:
      if opens:
        job.opened = [arrays.gather(x) for x in leaves]
    elif opens or ends_checked or decision is None:  # the state leaves are the last end's
      kept = set(program.batch_indices) | (set(program.state_indices) if job.starts else set())
      if decision is None:  # likely never opened: kept without waiting for the last step
        job.opened = [None] * len(leaves)
        indices = sorted(kept)
        for i, x in zip(indices, arrays.kept_for_opening([leaves[i] for i in indices])):
          job.opened[i] = x
      else:
        job.opened = [arrays.host_view(x) if i in kept else None for i, x in enumerate(leaves)]
      # A checked segment that goes on past this step writes its start while it runs and
      # replays from these arrays (``Openings.start_blobs``): one generation kept.
      if job.starts and not job.ends and decision is not None and opens and all(
          _compat.on_one_cpu(arrays.unwrap_key(leaves[i])) for i in program.state_indices):
        job.start_arrays = [leaves[i] for i in program.state_indices]  # viewed in place
    return job

  def _readable_last_post(self):
    """The last post-state's started digests, or None when its arrays are gone."""
    try:
      return self._digests.start_state(self._last_post_leaves, self._last_program.post_layouts)
    except (RuntimeError, ValueError):
      return None

  def close(self) -> None:
    """Ends the open segment at the last step (``finish``)."""
    if self.shared is not None:
      self.shared.close()
    if self._ended or self._last_post_leaves is None:
      return
    leaves = self._last_post_leaves
    if any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
      leaves = None
    self._committer.submit_close(self.steps - 1, leaves, self._last_program.post_layouts)
    self._ended = True

  def _size_window(self) -> None:
    """Widens the window so that training need not wait for the server's round trip:
    doubled while most of it is steps whose records are written and whose decisions have
    not come back, and at least ``window_for`` the measured decision and step times; up
    to the policy's rolling window and ``config.kept_window`` of the step's batches (at
    least twice the root's segments). Says so once when even that is too short.

    Example: a window of 4 with 3 written, undecided steps grows to 8, then 16, ...
    """
    pipeline = self._committer.pipeline
    awaiting = self._committer.written_steps - self._challenger.decided_steps
    answer = self._challenger.answer_seconds
    waits = 2 * awaiting >= pipeline.window
    wanted = 2 * pipeline.window if waits else pipeline.window
    if answer is not None and self._step_times:
      wanted = max(wanted, window_for(answer, statistics.median(self._step_times),
                                      self.shared is not None))
    if wanted <= pipeline.window:
      return
    policy = self._challenger.policy
    bound = min(policy.rolling_window, max(2 * policy.segment_length, config_lib.kept_window(
        _batch_bytes(self._last_program))))
    said = f"{answer * 1e3:.1f} ms" if answer is not None else "not yet measured"
    if pipeline.window < bound:
      window = min(bound, wanted)
      logger.info("ZKDV: %d steps wait for DVBench's decisions (a step's comes %s after it "
                  "starts): the window grows from %d to %d steps.", awaiting, said,
                  pipeline.window, window)
      pipeline.grow(window)
    elif waits and not self._said_window_short:
      self._said_window_short = True
      why = ("the most the server allows" if bound == policy.rolling_window else
             f"the most whose batches fit in {config_lib.KEPT_BATCH_BYTES >> 20} MiB "
             "(zkdv.config.KEPT_BATCH_BYTES)")
      logger.warning("ZKDV: training waits for DVBench: %d written steps wait for decisions "
                     "(a step's comes %s after it starts), %s.", awaiting, said, why)

  def _waiting_for_window(self, seconds: float) -> None:
    if not self._group.multi:
      self._committer.pipeline.raise_if_failed()
    if isinstance(self._challenger, challengers.ServerChallenger):
      self._challenger.waiting(seconds, f"step {self.steps} to enter the window of "
                               f"{self._committer.pipeline.window} unanswered steps")

  def gather_last_state(self) -> list[np.ndarray] | None:
    """The whole last post-state, when some params leaf of it is sharded (then only an
    opening can derive ``final_params``); None otherwise. A collective across processes."""
    program = self._last_program
    if program is None or not any(is_param and l.pieces is not None for l, is_param in zip(
        program.post_layouts, program.params_mask)):
      return None
    return [arrays.gather(x) for x in self._last_post_leaves]


def _batch_bytes(program) -> int:
  """The bytes of one step's batch (all processes' rows)."""
  return sum(layout.nbytes for layout in program.batch_layouts)


def window_for(answer_seconds: float, step_seconds: float, across_processes: bool) -> int:
  """The window in which no step waits for decisions that come ``answer_seconds`` after
  their step starts, at ``step_seconds`` a step; across processes twice that, since a
  round takes the decisions of the steps that leave the window half a window on
  (``SharedDecisions.settle``).

  Example: decisions 85 ms after their step, 20 ms steps: 6 steps, 12 across processes.
  """
  steps = math.ceil(answer_seconds / max(step_seconds, 1e-6)) + 1
  return 2 * steps if across_processes else steps


def _check_probe_size(program, ratio: float, data) -> None:
  """StepInputError unless a step's probes fit in one record (``records.check_probe_size``),
  with their dataset audit paths where the batch is ``proof.batches``' (``data``)."""
  depth = 0 if data is None else (data.order.declaration.size - 1).bit_length()
  try:
    records.check_probe_size(program.batch_layouts, ratio, depth)
  except records.Invalid as e:
    raise errors.StepInputError(f"the step's batch: {e}") from None
