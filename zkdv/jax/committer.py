"""The committer: everything that runs on the commit thread.

The driver dispatches a step and hands the committer a ``StepJob``; on the
commit thread the committer hashes the pre-state, batch and post-state,
writes the ``step`` record and answers the step's challenges with ``check``
records (update: replay and open the pre-state and batch; state: open the
post-state; probe: open batch rows with Merkle proofs). A step whose decision
is not known yet (a server challenger) keeps its openings until ``answer``.

In a multi-process run every process hashes what it holds and sends it to
process 0, which writes the records (``processes.ProcessGroup``).

Example::

  committer = Committer(writer, group, digests, config, window=4)
  committer.submit_step(job)            # from the training thread
  committer.answer(decision)            # when a late decision arrives
"""

import dataclasses
import logging

import numpy as np

from zkdv import challenge
from zkdv import digest
from zkdv import errors
from zkdv import merkle
from zkdv import metrics
from zkdv.jax import arrays
from zkdv.jax import processes
from zkdv.jax import replay
from zkdv.jax.pipeline import CommitPipeline

logger = logging.getLogger("zkdv")


@dataclasses.dataclass
class StepJob:
  """One dispatched step, as the commit thread needs it.

  Attributes:
    index: the step's index in the transcript.
    program: the ``step.Program`` that ran.
    post: the post-state leaves the executable returned.
    post_started: their digests as started by the digest backend.
    pre_started: the pre-state's started digests, or None when the step
      continues from the previous post-state (not hashed again).
    pre_hashed: the pre-state's piece digests when they had to be computed
      before donation (then ``pre_started`` is None).
    rows_started: the batch rows' started hashes (None when hashed already).
    batch_hashed: the batch's row hashes when computed before donation.
    opened: host views of every input leaf, kept when an update check is
      decided or may be (a pending decision); with ``retention="snapshot"``,
      of the batch leaves alone (None for state leaves) except at a snapshot.
    decision: the challenger's decision, or None while it is pending.
    checked: in a multi-process run, (whole post-state, replayed post-state)
      gathered on the training thread for the checks.
    snapshot: whether ``opened`` holds the whole inputs a pending step's
      successors are recomputed from (``retention="snapshot"``).
    metrics: (name, output) of the step's outputs beside the post-state.
  """

  index: int
  program: object
  post: list
  post_started: object
  pre_started: object = None
  pre_hashed: list | None = None
  rows_started: list | None = None
  batch_hashed: "HashedBatch | None" = None
  opened: list | None = None
  decision: challenge.Decision | None = None
  checked: tuple | None = None
  snapshot: bool = False
  metrics: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class HashedBatch:
  """What this process holds of a step's batch: row hashes (None: held
  elsewhere) and ``[leaf, row, bytes]`` of the probed rows held here."""

  row_hashes: list
  probes: list


@dataclasses.dataclass
class CommittedState:
  """The last committed post-state: its digest, piece digests and layout."""

  digest: bytes
  pieces: list
  layouts: list
  params_mask: list


@dataclasses.dataclass
class _Pending:
  """What a step whose decision is pending keeps to answer any challenge
  (``post_views`` is None when it is recomputed from a snapshot)."""

  job: StepJob
  post_views: list | None
  trees: list
  post_digest: bytes


class _Snapshots:
  """With ``retention="snapshot"``: the steps that pending steps are recomputed through
  (each window's snapshot of the whole inputs, and every step's batch)."""

  def __init__(self):
    self._jobs: dict[int, StepJob] = {}

  def keep(self, job: StepJob) -> None:
    self._jobs[job.index] = job

  def recompute(self, target: StepJob, post_digest: bytes):
    """(job with whole inputs, post-state) of ``target``, recomputed exactly from the last
    snapshot before it by the executable production ran."""
    program = target.program
    start = max(i for i, job in self._jobs.items() if i <= target.index and job.snapshot)
    layouts = program.input_layouts
    state = [self._jobs[start].opened[i] for i in program.state_indices]
    for index in range(start, target.index + 1):
      opened = list(self._jobs[index].opened)
      for i, value in zip(program.state_indices, state):
        opened[i] = value
      outs = program.executable(*[arrays.from_host(a, layouts[i]) for i, a in enumerate(opened)])
      state = [arrays.host_copy(outs[i]) for i in program.post_indices]
    if digest.digest_state_arrays(program.post_layouts, state)[0] != post_digest:
      raise errors.ReplayError(
          f"recomputing step {target.index} from the snapshot of step {start} does not "
          "reproduce its committed post-state: the step is not deterministic here. Use "
          'ZKDVConfig(retention="window").')
    return dataclasses.replace(target, opened=opened), state

  def release(self, oldest_pending: int | None) -> None:
    """Drops the steps that no unanswered or future step is recomputed through."""
    if not self._jobs:
      return
    anchor = max(self._jobs) + 1 if oldest_pending is None else oldest_pending
    start = max((i for i, job in self._jobs.items() if i <= anchor and job.snapshot),
                default=anchor)
    for index in [i for i in self._jobs if i < start]:
      del self._jobs[index]


class Committer:
  """Owns the commit thread: step records, checks, late answers, ``final``.

  Args:
    writer: the transcript writer (None on processes other than 0).
    group: the run's ``processes.ProcessGroup``.
    digests: the digest backend.
    config: the proof's ``ZKDVConfig``.
    window: the rolling window: at most this many steps may be dispatched
      whose records are not written or whose challenges are not answered.
    on_error: called with a background failure (the driver reports it to the
      other processes).
  """

  def __init__(self, writer, group, digests, config, window: int, on_error=None):
    self.writer, self.group, self.digests, self.config = writer, group, digests, config
    self.pipeline = CommitPipeline(window, on_error=on_error)
    self.checks = {"update": 0, "state": 0, "probe": 0}
    self.failed_checks: list[dict] = []
    self.discontinuities: list[int] = []
    self.committed_here = {"pieces": 0, "rows": 0}
    self.committed_steps = 0
    self.last: CommittedState | None = None
    self._program_numbers: dict[bytes, int] = {}
    self._pending: dict[int, _Pending] = {}
    self._state_checked: set[int] = set()
    self._kept = _Snapshots()  # steps a pending step is recomputed through
    self._init = None

  # -- the training thread's side ---------------------------------------------

  def program_number(self, program) -> int | None:
    return self._program_numbers.get(program.program_id)

  def submit_program(self, program) -> None:
    """Numbers a program on its first run and queues its record."""
    self._program_numbers[program.program_id] = len(self._program_numbers)
    self.pipeline.submit(lambda job: self._write_program(program))

  @property
  def init_recorded(self) -> bool:
    return self._init is not None

  def submit_init(self, init) -> None:
    """Queues the ``init`` record of an attested start (``zkdv.jax.start``)."""
    self._init = init
    self.pipeline.submit(lambda job: self._write_init(init))

  def submit_step(self, job: StepJob):
    """Queues a step's commitment; it holds its window slot until answered."""
    return self.pipeline.submit(lambda pipeline_job: self._commit_step(pipeline_job, job),
                                holds_slot=job.decision is not None)

  def answer(self, decision: challenge.Decision) -> None:
    """Queues the answer to a decision that arrived after its step was dispatched.

    Called from any thread; the answer is written on the commit thread.
    """
    self.pipeline.submit(lambda pipeline_job: self._answer_pending(decision),
                         holds_slot=True)

  @property
  def pending_steps(self) -> int:
    return len(self._pending)

  # -- the commit thread ------------------------------------------------------

  def _write_program(self, program) -> None:
    if self.writer is None:
      return
    self.writer.put_blob(program.blob)
    self.writer.append({**program.record, "number": self._program_numbers[program.program_id]})

  def _write_init(self, init) -> None:
    if self.writer is None:
      return
    self.writer.put_blob(init.blob)
    blobs = [self.writer.put_blob(digest.byte_view(a)) for a in init.input_bytes]
    self.writer.append({**init.record, "input_blobs": blobs}, durable=True)

  def _commit_step(self, pipeline_job, job: StepJob) -> None:
    """Digests, the step record, then the answers to its decision (or keeps what
    answering needs until the decision arrives).

    In a multi-process run every process sends the digests of what it holds
    to process 0, which writes the records (``job.checked`` then holds the
    whole post-state and replayed outputs, gathered on the training thread).
    """
    program, decision = job.program, job.decision
    recomputed = decision is None and self.config.retention == "snapshot"
    checks_post = (decision is None and not recomputed) or (decision is not None
                                                             and decision.any_check)
    # Checks need the post-state on the host: take views before the next step may donate it.
    post_views = ([arrays.host_view(x) for x in job.post]
                  if checks_post and job.checked is None else None)
    materialized = self.digests.materialize(job.post_started)
    replicas = (self.digests.replica_digests(job.post, program.post_layouts)
                if self.config.cross_check_replicas else [])
    pipeline_job.views_ready.set()
    pre = job.pre_hashed
    if job.pre_started is not None:
      pre = self.digests.state_digests(self.digests.materialize(job.pre_started))
    local = self.digests.state_digests(materialized)
    self.committed_here["pieces"] += sum(d is not None for leaf in local for d in leaf)
    gathered = self.group.gather(f"{job.index}/state", [local, pre, replicas])
    hashed = job.batch_hashed or self.hash_batch(program, job.index, job.rows_started,
                                                 decision, copy=self.group.multi)
    trees = self._gather_batch(program, job.index, hashed)
    if gathered is None:  # another process writes the records
      self._count_checks(decision)
      return
    post_pieces = processes.merge([g[0] for g in gathered], "post-state")
    post_digest = digest.state_digest_from_pieces(program.post_layouts, post_pieces)
    pre_pieces = None if pre is None else processes.merge([g[1] for g in gathered],
                                                           "pre-state")
    pre_digest = self._pre_digest(program, job.index, pre_pieces)
    record = {
        "type": "step", "index": job.index, "program": self._program_numbers[program.program_id],
        "pre_state": pre_digest, "post_state": post_digest,
        "batch": digest.batch_digest(program.batch_layouts,
                                     [digest.tree_root(t) for t in trees[0]]),
    }
    step_metrics = _step_metrics(job.metrics)
    if step_metrics:
      record["metrics"] = step_metrics
    self.writer.append(record)
    if job.index == 0 and self._init is not None:  # links the attested start to step 0
      self.writer.append({"type": "check", "step": 0, "kind": "start",
                          "pre_state_pieces": pre_pieces})
    self.last = CommittedState(post_digest, post_pieces, program.post_layouts,
                               program.params_mask)
    self.committed_steps = job.index + 1
    if job.checked is not None:
      post_views = job.checked[0]
    if decision is None:
      self._pending[job.index] = _Pending(job, post_views, trees, post_digest)
      if recomputed:
        self._kept.keep(job)
    else:
      self._answer(job, decision, post_views, trees)
    _cross_check_replicas(job.index, program.post_layouts, post_pieces,
                          [g[2] for g in gathered])

  def _pre_digest(self, program, index: int, pre_pieces) -> bytes:
    if pre_pieces is None:
      pre_digest = self.last.digest
    else:
      pre_digest = digest.state_digest_from_pieces(program.state_layouts, pre_pieces)
    if self.last is not None and pre_digest != self.last.digest:
      self.discontinuities.append(index)
      logger.warning("ZKDV: step %d does not start from the state step %d returned "
                     "(changed outside proof.jit).", index, index - 1)
    return pre_digest

  def _answer_pending(self, decision: challenge.Decision) -> None:
    pending = self._pending.get(decision.step)
    if pending is None:
      raise errors.CommitmentError(
          f"a challenge arrived for step {decision.step}, which is not awaiting one.")
    job, post_views = pending.job, pending.post_views
    if post_views is None and (decision.update or decision.state):
      job, post_views = self._kept.recompute(job, pending.post_digest)
    self._answer(job, decision, post_views, pending.trees)
    del self._pending[decision.step]
    self._kept.release(min(self._pending, default=None))

  def _answer(self, job: StepJob, decision, post_views, trees) -> None:
    """Writes the check records that answer ``decision``; then the openings go."""
    program = job.program
    if decision.update:
      replayed = None if job.checked is None else job.checked[1]
      self._update_check(program, job.index, job.opened, post_views, replayed)
    if decision.state:
      self._state_check(job.index, post_views)
    self._probe_check(program, job, decision, trees)

  def _count_checks(self, decision) -> None:
    if decision is not None:
      self.checks["update"] += decision.update
      self.checks["state"] += decision.state

  # -- batches and probes -------------------------------------------------------

  def hash_batch(self, program, index: int, rows, decision, copy: bool) -> HashedBatch:
    """The row hashes of the batch rows held here and the probed rows' bytes.

    ``copy`` takes the probed rows out of the batch's buffers (before donation,
    or to send them to process 0). With a pending decision no rows are taken
    here: the answer reads them from the step's opened batch.
    """
    layouts = program.batch_layouts
    held = []
    if decision is not None:
      for leaf, layout in enumerate(layouts):
        for row in decision.leaf_probe_rows(leaf, layout):
          data = self.digests.row_bytes(rows[leaf], row)
          if data is not None:
            held.append([leaf, row, bytes(data) if copy else data])
    hashes = self.digests.row_hashes(rows, layouts)
    self.committed_here["rows"] += sum(h is not None for leaf in hashes for h in leaf)
    return HashedBatch(hashes, held)

  def _gather_batch(self, program, index: int, hashed: HashedBatch):
    """(row trees, {(leaf, row): bytes}) of the whole batch, on process 0 (else None)."""
    gathered = self.group.gather(f"{index}/batch", [hashed.row_hashes, hashed.probes])
    if gathered is None:
      return None
    hashes = processes.merge([g[0] for g in gathered], "batch")
    row_data = {}
    for _, sent in gathered:
      for leaf, row, data in sent:
        row_data.setdefault((leaf, row), data)
    return [merkle.tree_levels(h) for h in hashes], row_data

  def _probe_check(self, program, job: StepJob, decision, trees) -> None:
    tree_levels, row_data = trees
    layouts = program.batch_layouts
    probes = []
    for leaf, layout in enumerate(layouts):
      for row in decision.leaf_probe_rows(leaf, layout):
        data = row_data.get((leaf, row))
        if data is None:  # a pending decision: the row comes from the opened batch
          data = _row_bytes(job.opened[program.batch_indices[leaf]], layout.rows, row)
        probes.append([leaf, row, self.writer.put_blob(data),
                       merkle.inclusion_proof(tree_levels[leaf], row)])
    if not probes:
      return
    self.writer.append({"type": "check", "step": job.index, "kind": "probe",
                        "batch_roots": [digest.tree_root(t) for t in tree_levels],
                        "probes": probes})
    self.checks["probe"] += 1

  # -- checks -------------------------------------------------------------------

  def _update_check(self, program, index, opened, post_views, replayed=None) -> None:
    if replayed is None:
      layouts = program.input_layouts
      inputs = [arrays.from_host(a, layouts[i]) for i, a in enumerate(opened)]
      outs = program.replay(*inputs)
      replayed = [arrays.host_view(outs[i]) for i in program.post_indices]
    result = replay.compare(program.state_layouts, replayed, post_views,
                            exact=program.exact, tolerance=self.config.tolerance)
    blobs = [self.writer.put_blob(digest.byte_view(a)) for a in opened]
    record = {
        "type": "check", "step": index, "kind": "update",
        "pre_state_blobs": [blobs[i] for i in program.state_indices],
        "batch_blobs": [blobs[i] for i in program.batch_indices],
        "result": result,
    }
    if any(l.pieces for l in program.state_layouts):  # name the piece a bad opening breaks
      record["pre_state_pieces"] = [
          digest.piece_digests(l, opened[i])
          for l, i in zip(program.state_layouts, program.state_indices)]
    if not program.exact:  # the verifier compares within tolerance: open post
      record["post_state_blobs"] = [self.writer.put_blob(digest.byte_view(a))
                                    for a in post_views]
    self.writer.append(record, durable=True)
    self.checks["update"] += 1
    if not result["equal"]:
      self.failed_checks.append({"step": index, **result})

  def _state_check(self, index, post_views) -> None:
    self._state_checked.add(index)
    blobs = [self.writer.put_blob(digest.byte_view(a)) for a in post_views]
    self.writer.append({"type": "check", "step": index, "kind": "state",
                        "post_state_blobs": blobs}, durable=True)
    self.checks["state"] += 1

  # -- final ----------------------------------------------------------------------

  def write_final(self, steps: int, clean: bool, whole_state: list | None,
                  challenger_fields: dict) -> None:
    """Writes ``final``; with ``whole_state`` (the last post-state when its params are
    sharded) it first opens that state, so a verifier can derive ``final_params``."""
    final = {"type": "final", "steps": steps, "status": "clean" if clean else "aborted",
             "discontinuities": list(self.discontinuities), **challenger_fields}
    if self.last is not None:
      last = self.last
      final["final_state"] = last.digest
      final["final_state_leaves"] = [list(p) for p in last.pieces]
      if self.committed_steps == steps and (whole_state is not None or not any(
          l.pieces is not None for l, m in zip(last.layouts, last.params_mask) if m)):
        if whole_state is not None and steps - 1 not in self._state_checked:
          self._state_check(steps - 1, whole_state)
        whole = [p[0] if whole_state is None else digest.leaf_digest(whole_state[i])
                 for i, p in enumerate(last.pieces)]
        params = [i for i, m in enumerate(last.params_mask) if m]
        final["final_params"] = digest.params_digest(
            [dataclasses.replace(l, pieces=None) for l in last.layouts], whole, params)
    self.writer.append(final, durable=True)


def _step_metrics(outputs: list) -> dict:
  """The committed value of each output beside the post-state (``zkdv.metrics``); an
  output this process cannot read whole (sharded across processes) is left out."""
  return {name: metrics.encode(arrays.host_view(x)) for name, x in outputs
          if getattr(x, "is_fully_addressable", True) or x.is_fully_replicated}


def _row_bytes(array: np.ndarray, rows: int, row: int) -> np.ndarray:
  data = digest.byte_view(np.ascontiguousarray(array))
  width = data.size // rows
  return data[row * width:(row + 1) * width]


def _cross_check_replicas(index: int, layouts, pieces, replicas_per_process) -> None:
  """Raises ReplicaDivergenceError if a replica's digest differs from its piece's."""
  for replicas in replicas_per_process:
    for leaf, piece, device, replica_digest in replicas:
      if replica_digest != pieces[leaf][piece]:
        layout = layouts[leaf]
        shard = ("" if layout.pieces is None else
                 f" (shard {piece}, index {[list(b) for b in layout.pieces[piece]]})")
        raise errors.ReplicaDivergenceError(
            f"step {index}: the replica of {layout.path}{shard} on {device} differs "
            "from the committed copy. Replicas of one array must hold the same bytes; "
            "this device computed something else (a hardware fault or a "
            "non-deterministic kernel).")
