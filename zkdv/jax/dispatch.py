"""The training thread's side of a proof: dispatching steps.

For each ``proof.jit`` call the dispatcher takes a window slot, asks the
challenger for the step's decision, prepares what must be hashed or kept
before the executable may donate its inputs, runs the executable and hands
the committer a ``StepJob``.

Example::

  dispatcher = Dispatcher(committer, challenger, digests, group, config)
  outs = dispatcher.run(program, leaves)
"""

import threading

import numpy as np

from zkdv import challengers
from zkdv import overlap as overlap_lib
from zkdv.jax import arrays
from zkdv.jax.committer import StepJob


class Dispatcher:
  """Runs steps on the training thread and queues their commitments.

  Attributes:
    steps: the number of steps dispatched so far.
  """

  def __init__(self, committer, challenger, digests, group, config):
    self._committer, self._challenger = committer, challenger
    self._digests, self._group, self._config = digests, group, config
    self.steps = 0
    self._lock = threading.Lock()
    self._last_post_leaves: list | None = None
    self._last_program = None
    self._snapshot_at = None  # (step, program) of the last snapshot (retention="snapshot")

  def run(self, program, leaves: list) -> list:
    """Dispatches one step of ``program`` and queues its commitment and checks."""
    committer, multi = self._committer, self._group.multi
    if not multi:  # across processes, failures wait for finish(): see ProcessGroup.agree_on_outcome
      committer.pipeline.raise_if_failed()
    # A step that cannot enter the window raises before anything is taken: call it again.
    committer.pipeline.reserve(waiting=self._waiting_for_window)
    with self._lock:
      index = self.steps
      self.steps += 1
    decision = self._challenger.decision_now(index)
    job = self._prepare(program, index, leaves, decision)
    last = committer.pipeline.last_job
    if any(program.donated) and last is not None:
      last.views_ready.wait()  # no donation of a buffer being hashed
    outs = program.executable(*leaves)
    post = [outs[i] for i in program.post_indices]
    if program.post_layouts is None:  # as the first run of this program placed it
      program.place_post_state(post)
    if committer.program_number(program) is None:
      committer.submit_program(program)
    job.post, job.post_started = post, self._digests.start_state(post, program.post_layouts)
    job.metrics = [(name, outs[i]) for name, i in program.metric_outputs]
    if multi and decision.any_check:  # collectives stay on this thread
      job.checked = ([arrays.gather(x) for x in post],
                     program.replay_sharded(job.opened) if decision.update else None)
    submitted = committer.submit_step(job)
    self._last_post_leaves, self._last_program = post, program
    overlap = program.overlap or overlap_lib.UNCHECKED
    if overlap is overlap_lib.NEVER or (
        overlap is overlap_lib.UNCHECKED and decision is not None and decision.any_check):
      submitted.done.wait()
    if not multi:
      committer.pipeline.raise_if_failed()
    return outs

  def _prepare(self, program, index: int, leaves: list, decision) -> StepJob:
    """The step's job before dispatch: what must be hashed or copied before donation."""
    digests = self._digests
    state = [leaves[i] for i in program.state_indices]
    batch = [leaves[i] for i in program.batch_indices]
    job = StepJob(index, program, post=[], post_started=None, decision=decision)
    continuous = (self._last_post_leaves is not None and len(state) == len(self._last_post_leaves)
                  and all(a is b for a, b in zip(state, self._last_post_leaves)))
    if not continuous:  # otherwise the previous post-state, not hashed again
      job.pre_started = digests.start_state(state, program.state_layouts)
      if any(program.donated[i] for i in program.state_indices):  # hash before donation
        job.pre_hashed = digests.state_digests(digests.materialize(job.pre_started))
        job.pre_started = None
    job.rows_started = digests.start_rows(batch, program.batch_layouts)
    if any(program.donated[i] for i in program.batch_indices):
      job.batch_hashed = self._committer.hash_batch(program, index, job.rows_started,
                                                    decision, copy=True)
      job.rows_started = None
    if decision is None and self._config.retention == "snapshot":
      self._keep_for_recomputation(job, leaves, continuous)
    elif decision is None or decision.update:
      # Openings are whole leaves. A zero-copy host view keeps its input alive (JAX does
      # not donate a buffer a view holds), so nothing is copied; across processes,
      # gathering them is a collective.
      open_leaf = arrays.gather if self._group.multi else arrays.host_view
      job.opened = [open_leaf(x) for x in leaves]
    return job

  def _keep_for_recomputation(self, job: StepJob, leaves: list, continuous: bool) -> None:
    """``retention="snapshot"``: views of the whole inputs at a window's first step (or
    where the chain of identical programs breaks), of the batch alone elsewhere."""
    program, window = job.program, self._challenger.policy.rolling_window
    snapshot = self._snapshot_at
    job.snapshot = (snapshot is None or not continuous or snapshot[1] is not program
                    or job.index - snapshot[0] >= window)
    if job.snapshot:
      self._snapshot_at = (job.index, program)
    batch = set(program.batch_indices)
    job.opened = [arrays.host_view(x) if job.snapshot or i in batch else None
                  for i, x in enumerate(leaves)]

  def _waiting_for_window(self, seconds: float) -> None:
    if not self._group.multi:
      self._committer.pipeline.raise_if_failed()
    if isinstance(self._challenger, challengers.ServerChallenger):
      self._challenger.waiting(seconds, f"step {self.steps} to enter the window of "
                               f"{self._challenger.policy.rolling_window} unanswered steps")

  def gather_last_state(self) -> list[np.ndarray] | None:
    """The whole last post-state, when some params leaf of it is sharded (then only an
    opening can derive ``final_params``); None otherwise. A collective across processes."""
    program = self._last_program
    if program is None or not any(is_param and l.pieces is not None for l, is_param in zip(
        program.post_layouts, program.params_mask)):
      return None
    return [arrays.gather(x) for x in self._last_post_leaves]
