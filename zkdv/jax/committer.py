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
import time

import jax
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
    post_started: their digests as started by the digest backend when the step
      ends a segment (else None: nothing is hashed).
    pre_started: the pre-state's started digests when the step starts a
      segment that does not continue from a committed post-state.
    pre_hashed: the pre-state's piece digests when they had to be computed
      before donation (then ``pre_started`` is None).
    rows_started: the batch rows' started hashes (None when hashed already).
    batch_hashed: the batch's row hashes when computed before donation.
    opened: host views of the input leaves: all of them when the step starts a
      segment (the segment's start state), the batch leaves alone otherwise
      (None for state leaves).
    decision: the challenger's decision for this step, or None while it is pending.
    segment_decision: a self-chosen segment's decision (its first step's), or None
      for a server's (the decision of the segment's last step, which comes later).
    checked: in a multi-process run, (whole post-state, replayed post-state)
      gathered on the training thread for the checks.
    starts: the step starts a segment (its record carries ``pre_state``).
    ends: the step ends a segment by the length rule (its record carries
      ``post_state`` at once); otherwise the record waits for the next step or
      ``finish`` to say whether a segment ends there.
    previous_end_started: at a segment boundary that the previous step did not
      plan (a new program, a state changed outside ``proof.jit``), the started
      digests of the previous step's post-state, or None when it is the
      pre-state (an unchanged state) or could not be read (then that segment
      has no end commitment).
    previous_continues: the previous step's post-state is this step's
      pre-state (the same arrays).
    metrics: (name, output) of the step's outputs beside the post-state.
    start_arrays: the start state's arrays when the step starts a segment whose update
      check is decided already (self-chosen) and ``opened`` views them in place: the
      start is written at once and the check's replay consumes these arrays.
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
  segment_decision: challenge.Decision | None = None
  checked: tuple | None = None
  starts: bool = True
  ends: bool = True
  previous_end_started: object = None
  previous_continues: bool = True
  metrics: list = dataclasses.field(default_factory=list)
  start_arrays: list | None = None


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
class _Kept:
  """What a step keeps until its decision and its segment's are answered."""

  job: StepJob
  trees: tuple  # (row trees, {(leaf, row): bytes})
  answered: bool = False


@dataclasses.dataclass
class _Segment:
  """Steps ``first .. last`` from the committed start state to the end state.

  ``start`` holds host views of the whole inputs of step ``first`` (the
  opened start state); ``end_views`` the end state's host views when a check
  may open it (None otherwise); ``end`` its digest (None: no end commitment);
  ``start_blobs`` the names of its start state's blobs once written.
  """

  first: int
  start_digest: bytes
  start_pieces: list
  last: int | None = None
  end: bytes | None = None
  end_views: list | None = None
  answered: bool = False
  start_blobs: list | None = None


class Committer:
  """Owns the commit thread: step records, segments, checks, late answers, ``final``.

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
    self.written_steps = 0  # step records written (a step's record waits for its successor)
    self.segment_lengths: list[int] = []
    self.last: CommittedState | None = None
    # For the adaptive k: the last whole-state hash, and the recent steps' batch commitments.
    self.hash_seconds: float | None = None
    self.batch_seconds: list[float] = []
    self.prover_replays = True
    self._program_numbers: dict[bytes, int] = {}
    self._kept: dict[int, _Kept] = {}
    self._segments: dict[int, _Segment] = {}  # first step -> segment
    self._open: _Segment | None = None
    self._held: tuple | None = None  # (job, record) of a step whose end is not known yet
    self._state_checked: set[int] = set()
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

  def continue_from(self, point) -> None:
    """Continues a transcript a crashed run left (a ``zkdv.jax.resume.ResumePoint``):
    its programs keep their numbers and the next segment starts from its committed state."""
    self._program_numbers = dict(point.program_numbers)
    self.last = CommittedState(point.state, point.pieces, point.layouts, point.params_mask)
    self.committed_steps = self.written_steps = point.steps
    self._init = point.attested_start or None

  def submit_resume(self, record: dict) -> None:
    """Queues the ``resume`` record, before the resumed run's first step."""
    self.pipeline.submit(lambda job: self.writer.append(record, durable=True))

  def submit_step(self, job: StepJob):
    """Queues a step's commitment; it holds its window slot until answered."""
    return self.pipeline.submit(lambda pipeline_job: self._commit_step(pipeline_job, job),
                                holds_slot=job.decision is not None)

  def submit_close(self, last_post: list | None, layouts) -> None:
    """Queues the end of the open segment at the last step (``finish``): ``last_post``
    are the last step's post-state leaves (None when they cannot be read)."""
    started = None if last_post is None else self.digests.start_state(last_post, layouts)
    self.pipeline.submit(lambda job: self._close(started, last_post))

  def answer(self, decision: challenge.Decision) -> None:
    """Queues the answer to a decision that arrived after its step was dispatched.

    Called from any thread; the answer is written on the commit thread.
    """
    self.pipeline.submit(lambda pipeline_job: self._answer_late(decision), holds_slot=True)

  @property
  def pending_steps(self) -> int:
    return sum(not kept.answered for kept in self._kept.values())

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
    """Digests, the step record (or holds it until the segment's end is known), then
    the answers to its decision, or keeps what answering needs until it arrives.

    In a multi-process run every segment is one step; every process sends the
    digests of what it holds to process 0, which writes the records
    (``job.checked`` then holds the whole post-state and replayed outputs).
    """
    program = job.program
    end_views = None
    segment_decision = job.segment_decision
    if job.ends and job.checked is None and (
        segment_decision is None or segment_decision.state or not program.exact):
      end_views = [arrays.host_view(x) for x in job.post]  # before the next step may donate
    previous_end = self._started_digests(job.previous_end_started)
    pre = job.pre_hashed
    if job.pre_started is not None:
      pre = self._started_digests(job.pre_started)
    local = None
    if job.ends:
      # The host views live only for the hash: a view held longer would keep the next step
      # from donating the post-state (one more generation of memory).
      materialized = self.digests.materialize(job.post_started)  # waits for the step
      hashed_at = time.perf_counter()
      local = self.digests.state_digests(materialized)
      self.hash_seconds = time.perf_counter() - hashed_at
      job.post_started = materialized = None
      self.committed_here["pieces"] += sum(d is not None for leaf in local for d in leaf)
    replicas = (self.digests.replica_digests(job.post, program.post_layouts)
                if self.config.cross_check_replicas and job.ends else [])
    pipeline_job.views_ready.set()
    gathered = self.group.gather(f"{job.index}/state", [local, pre, replicas])
    batch_started = time.perf_counter()
    hashed = job.batch_hashed or self.hash_batch(program, job.index, job.rows_started,
                                                 job.decision, copy=self.group.multi)
    trees = self._gather_batch(program, job.index, hashed)
    self.batch_seconds = (self.batch_seconds + [time.perf_counter() - batch_started])[-16:]
    if gathered is None:  # another process writes the records
      self._count_checks(job.decision)
      return
    pre_pieces = None if pre is None else processes.merge([g[1] for g in gathered],
                                                           "pre-state")
    if job.starts:
      self._end_previous(job, pre_pieces, previous_end)
      self._start_segment(job, pre_pieces)
      if job.start_arrays is not None:
        self._write_start(job)
    elif self._held is not None:  # the segment goes on through the held step
      held_job, held_record = self._held
      self._held = None
      self._write_step(held_job, held_record, ends=False)
    record = {"type": "step", "index": job.index,
              "program": self._program_numbers[program.program_id],
              "batch": digest.batch_digest(program.batch_layouts,
                                           [digest.tree_root(t) for t in trees[0]])}
    if job.starts:
      record["pre_state"] = self._open.start_digest
    step_metrics = _step_metrics(job.metrics)
    if step_metrics:
      record["metrics"] = step_metrics
    self._kept[job.index] = _Kept(job, trees)
    self._open.last = job.index
    if job.ends:
      post_pieces = processes.merge([g[0] for g in gathered], "post-state")
      post_digest = digest.state_digest_from_pieces(program.post_layouts, post_pieces)
      self.last = CommittedState(post_digest, post_pieces, program.post_layouts,
                                 program.params_mask)
      record["post_state"] = post_digest
      record["post_state_leaves"] = [list(p) for p in post_pieces]
      self._write_step(job, record, post_digest,
                       job.checked[0] if job.checked is not None else end_views)
      _cross_check_replicas(job.index, program.post_layouts, post_pieces,
                            [g[2] for g in gathered])
    else:
      self._held = (job, record)
    self.committed_steps = job.index + 1

  def _started_digests(self, started):
    if started is None:
      return None
    return self.digests.state_digests(self.digests.materialize(started))

  def _start_segment(self, job: StepJob, pre_pieces) -> None:
    program = job.program
    if pre_pieces is None:  # continues from the committed post-state
      start_digest, start_pieces = self.last.digest, self.last.pieces
    else:
      start_digest = digest.state_digest_from_pieces(program.state_layouts, pre_pieces)
      start_pieces = pre_pieces
    if self.last is not None and start_digest != self.last.digest:
      self.discontinuities.append(job.index)
      logger.warning("ZKDV: step %d does not start from the state step %d returned "
                     "(changed outside proof.jit).", job.index, job.index - 1)
    self._open = _Segment(job.index, start_digest, start_pieces)
    self._segments[job.index] = self._open

  def _write_start(self, job: StepJob) -> None:
    """Writes the opened start of a segment whose update check is decided, while its
    steps run, and drops the views of it.

    The views kept the start's buffers from donation at the segment's first step (JAX
    copies instead), so the start's arrays still hold it; the check's replay consumes
    them. A check then holds one state generation, not two (views kept for writing
    after the replay, and the replay's own copy).
    """
    program = job.program
    if any(x.is_deleted() for x in job.start_arrays):
      job.start_arrays = None  # donated all the same: the views are the start
      return
    # A whole leaf's blob is named by its committed digest (its one piece): not hashed again.
    self._open.start_blobs = [
        self.writer.put_blob(digest.byte_view(job.opened[i]),
                             pieces[0] if layout.pieces is None else None)
        for i, layout, pieces in zip(program.state_indices, program.state_layouts,
                                     self._open.start_pieces)]
    job.opened = [None if i in program.state_indices else v for i, v in enumerate(job.opened)]

  def _end_previous(self, job: StepJob, pre_pieces, previous_end) -> None:
    """A segment the previous step did not plan to end ends before ``job``."""
    if self._held is None:
      return
    held_job, record = self._held
    self._held = None
    if job.previous_continues:
      pieces = pre_pieces
      end_views = [v for i, v in enumerate(job.opened) if i in job.program.state_indices]
    else:
      pieces, end_views = previous_end, None
    if pieces is None:  # the previous post-state could not be read: no end commitment
      self._write_step(held_job, record, None, None)
      return
    program = held_job.program
    end = digest.state_digest_from_pieces(program.post_layouts, pieces)
    self.last = CommittedState(end, pieces, program.post_layouts, program.params_mask)
    self._write_step(held_job, {**record, "post_state": end,
                                "post_state_leaves": [list(p) for p in pieces]}, end, end_views)

  def _close(self, started, last_post) -> None:
    """``finish``: the held last step ends the open segment."""
    if self._held is None:
      return
    held_job, record = self._held
    self._held = None
    if started is None:
      self._write_step(held_job, record, None, None)
      return
    program = held_job.program
    pieces = self.digests.state_digests(self.digests.materialize(started))
    end = digest.state_digest_from_pieces(program.post_layouts, pieces)
    self.last = CommittedState(end, pieces, program.post_layouts, program.params_mask)
    self._write_step(held_job, {**record, "post_state": end,
                                "post_state_leaves": [list(p) for p in pieces]}, end,
                     [arrays.host_view(x) for x in last_post])

  def _write_step(self, job: StepJob, record: dict, end: bytes | None = None,
                  end_views=None, ends: bool = True) -> None:
    """Writes a step record (ending the open segment when ``ends``); a decision known
    already (self-chosen) is answered now."""
    self.writer.append(record)
    self.written_steps = job.index + 1
    if job.index == 0 and self._init is not None:  # links the attested start to step 0
      self.writer.append({"type": "check", "step": 0, "kind": "start",
                          "pre_state_pieces": self._segments[0].start_pieces})
    if ends:
      self._open.last = job.index
      self._end_open(end, end_views)
    if job.decision is not None:  # self-chosen: the segment by its first step's decision
      self._answer(job.decision, job.segment_decision if ends else None)

  def _end_open(self, end: bytes | None, end_views) -> None:
    segment = self._open
    segment.end, segment.end_views = end, end_views
    self.segment_lengths.append(segment.last - segment.first + 1)
    if end is None:  # nothing to challenge against: the verifier reports it
      segment.answered = True
      self._release()

  def _answer_late(self, decision: challenge.Decision) -> None:
    kept = self._kept.get(decision.step)
    if kept is None or kept.answered:
      raise errors.CommitmentError(
          f"a challenge arrived for step {decision.step}, which is not awaiting one.")
    segment = self._segment_ending(decision.step)
    decides = segment is not None and challenge.deciding_step(
        "dvbench", segment.first, segment.last) == decision.step
    self._answer(decision, decision if decides else None)

  def _segment_ending(self, step: int) -> _Segment | None:
    for segment in self._segments.values():
      if segment.last == step and segment.end is not None and not segment.answered:
        return segment
    return None

  def _answer(self, decision: challenge.Decision, segment_decision) -> None:
    """Writes the check records that answer ``decision``: the probes of its step and,
    when the step ends a segment, the segment's update and state checks as
    ``segment_decision`` chose them."""
    kept = self._kept[decision.step]
    segment = self._segment_ending(decision.step) if segment_decision is not None else None
    if segment is not None:
      if segment_decision.update:
        self._update_check(segment)
      if segment_decision.state:
        self._state_check(segment.last, segment.end_views)
      segment.answered = True
    self._probe_check(kept.job.program, kept.job, decision, kept.trees)
    kept.answered = True
    self._release()

  def _release(self) -> None:
    """Drops what no unanswered decision or segment needs any more."""
    for first in [f for f, s in self._segments.items() if s.answered]:
      segment = self._segments[first]
      if all(self._kept.get(i, _Kept(None, None, True)).answered
             for i in range(segment.first, segment.last + 1)):
        for i in range(segment.first, segment.last + 1):
          self._kept.pop(i, None)
        del self._segments[first]

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
        probes.append([leaf, row, self._put_row(layout, data),
                       merkle.inclusion_proof(tree_levels[leaf], row)])
    if not probes:
      return
    self.writer.append({"type": "check", "step": job.index, "kind": "probe",
                        "batch_roots": [digest.tree_root(t) for t in tree_levels],
                        "probes": probes})
    self.checks["probe"] += 1

  def _put_row(self, layout, data):
    """The blob of a probed Merkle row; of a group of rows, one blob per leading-axis
    row, so each is named by its own BLAKE3 (a server matches those against datasets)."""
    if layout.row_group == 1:
      return self.writer.put_blob(data, durable=False)
    width = len(data) // layout.row_group
    return [self.writer.put_blob(data[i * width:(i + 1) * width], durable=False)
            for i in range(layout.row_group)]

  # -- checks -------------------------------------------------------------------

  def _update_check(self, segment: _Segment) -> None:
    """Opens the segment's start state and every batch in it; unless the server replays
    every segment, replays them here too and compares the end state."""
    jobs = [self._kept[i].job for i in range(segment.first, segment.last + 1)]
    first = jobs[0]
    program = first.program
    if first.start_arrays is not None:  # written already; the replay consumes the arrays
      start, first.start_arrays = first.start_arrays, None
    else:
      start = [first.opened[i] for i in program.state_indices]
    result = None
    if self.prover_replays:
      result = self._replay_segment(segment, jobs, start)
    self.pipeline.running.replayed.set()  # the training thread's fence (UNCHECKED) ends here
    blobs = segment.start_blobs
    if blobs is None:
      blobs = [self.writer.put_blob(digest.byte_view(a)) for a in start]
    record = {
        "type": "check", "step": segment.last, "kind": "update", "first": segment.first,
        "pre_state_blobs": blobs,
        "batch_blobs": [[self.writer.put_blob(digest.byte_view(job.opened[i]))
                         for i in job.program.batch_indices] for job in jobs],
    }
    if result is not None:
      record["result"] = result
    if any(l.pieces for l in program.state_layouts):  # name the piece a bad opening breaks
      record["pre_state_pieces"] = segment.start_pieces
    if not program.exact:  # the verifier compares within tolerance: open post
      record["post_state_blobs"] = [self.writer.put_blob(digest.byte_view(a))
                                    for a in segment.end_views]
    self.writer.append(record, durable=True)
    self.checks["update"] += 1
    if result is not None and not result["equal"]:
      self.failed_checks.append({"step": segment.last, "first": segment.first, **result})

  def _replay_segment(self, segment: _Segment, jobs: list, start: list) -> dict:
    """Replays the segment's steps from its opened start; the result of comparing the
    end state with its commitment (exact) or with the opened end state (equivalent)."""
    state = None
    for job in jobs:
      program = job.program
      if job.checked is not None and job.checked[1] is not None:  # replayed on the training thread
        state = job.checked[1]
        continue
      layouts = program.input_layouts
      inputs = list(job.opened)
      for n, i in enumerate(program.state_indices):
        inputs[i] = start[n] if state is None else state[n]
      outs = program.replay(*[x if isinstance(x, jax.Array) else arrays.from_host(x, layouts[i])
                              for i, x in enumerate(inputs)])
      state = [outs[i] for i in program.post_indices]
    program = jobs[-1].program
    replayed = [arrays.host_view(x) if isinstance(x, jax.Array) else x for x in state]
    if program.exact:
      equal = digest.digest_state_arrays(program.post_layouts, replayed)[0] == segment.end
      return {"mode": "exact", "equal": equal,
              "mismatched_leaves": [] if equal else ["end state"],
              "max_abs_error": 0.0, "max_rel_error": 0.0, "max_ulp_error": 0}
    return replay.compare(program.post_layouts, replayed, segment.end_views, exact=False,
                          tolerance=self.config.tolerance)

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
