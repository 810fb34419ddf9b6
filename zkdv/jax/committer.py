"""The committer: the commit thread's step records, segments and ``final``.

The driver dispatches a step and hands the committer a ``StepJob``; on the
commit thread the committer has the pre-state, batch and post-state hashed and
gathered (``zkdv.jax.gathering``), writes the ``step`` record and has the
step's challenges answered with ``check`` records (``zkdv.jax.answers``,
``zkdv.jax.openings``: update: replay and open the pre-state and batch; state:
open the post-state; probe: open batch rows with Merkle proofs). A step whose
decision is not known yet (a server challenger) keeps its openings until
``answer``.

In a multi-process run every process hashes what it holds and sends it to
process 0, which writes the records (``processes.ProcessGroup``).

Example::

  committer = Committer(writer, group, digests, config, window=4)
  committer.submit_step(job)            # from the training thread
  committer.answer(decision)            # when a late decision arrives
"""

import dataclasses
import logging

from zkdv import challenge
from zkdv import digest
from zkdv import metrics
from zkdv.jax import arrays
from zkdv.jax.answers import Answers
from zkdv.jax.commit_jobs import CommittedState, Segment, StepJob
from zkdv.jax.gathering import Gathering, GatheredStep
from zkdv.jax.openings import Openings
from zkdv.jax.owed import OwedAnswers
from zkdv.jax.pipeline import CommitPipeline

logger = logging.getLogger("zkdv")


class Committer:
  """Owns the commit thread: step records, segments, late answers, ``final``.

  Args:
    writer: the transcript writer (None on processes other than 0).
    group: the run's ``processes.ProcessGroup``.
    digests: the digest backend.
    config: the proof's ``ZKDVConfig``.
    window: the rolling window: at most this many steps may be dispatched
      whose records are not written or whose challenges are not answered.
    on_error: called with a background failure (the driver reports it to the
      other processes).

  Attributes:
    gathering: hashes each step here and gathers the digests on process 0.
    openings: writes the check records (and counts them).
    answers: what steps and segments keep until their decisions are answered.
  """

  def __init__(self, writer, group, digests, config, window: int, on_error=None):
    self.writer, self.group, self.digests, self.config = writer, group, digests, config
    self.pipeline = CommitPipeline(window, on_error=on_error)
    self.gathering = Gathering(group, digests, config)
    self.openings = Openings(writer, config.tolerance,
                             on_replayed=lambda: self.pipeline.running.replayed.set())
    self.answers = Answers(self.openings)
    self.discontinuities: list[int] = []
    self.committed_steps = 0
    self.written_steps = 0  # step records written (a step's record waits for its successor)
    self.segment_lengths: list[int] = []
    self.last: CommittedState | None = None
    self._program_numbers: dict[bytes, int] = {}
    self._open: Segment | None = None
    self._held: tuple | None = None  # (job, record) of a step whose end is not known yet
    self._init = None
    self.owed = OwedAnswers(self.openings)  # a resumed run's probes of discarded steps
    self.key_seed: bytes | None = None  # a resumed run's (``zkdv.keys.key_seed``)
    self._catch_up = None  # a resumed run's ``zkdv.jax.catch_up.CatchUp`` while it replays
    self.resume_written = False  # a resumed run's ``resume`` record is in the transcript

  @property
  def checks(self) -> dict:
    return self.openings.checks

  @property
  def failed_checks(self) -> list[dict]:
    return self.openings.failed_checks

  @property
  def committed_here(self) -> dict:
    return self.gathering.committed_here

  @property
  def prover_replays(self) -> bool:
    """The prover replays each update check's segment (the server does not replay all)."""
    return self.answers.replay

  @prover_replays.setter
  def prover_replays(self, replays: bool) -> None:
    self.answers.replay = replays

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

  def continue_from(self, point, key_seed: bytes) -> None:
    """Continues a transcript a crashed run left (a ``zkdv.jax.resume.ResumePoint``):
    its programs keep their numbers and the next segment starts from its committed state;
    ``key_seed`` derives the keys of the steps whose probes it owes."""
    self._program_numbers = dict(point.program_numbers)
    self.last = CommittedState(point.state, point.pieces, point.layouts, point.params_mask)
    self.committed_steps = self.written_steps = point.steps
    self._init = point.attested_start or None
    self.key_seed = key_seed
    self.owed.start(point.owed_probes, key_seed)

  def submit_catch_up(self, catch_up) -> None:
    """Queues the replay of committed steps (a ``zkdv.jax.catch_up.CatchUp``), before its
    first step: segments go on from the restored committed state, replayed step records
    are compared with the committed ones, and only checks without a record are answered."""
    def start(job):
      del job
      self._catch_up = catch_up
      self.last = dataclasses.replace(self.last, digest=catch_up.start_state,
                                      pieces=catch_up.start_pieces)
      self.answers.answered = catch_up.answered
    self.pipeline.submit(start)

  def submit_resume(self, record: dict) -> None:
    """Queues the ``resume`` record, before the resumed run's first step (after its
    replayed ones)."""
    def write(job):
      del job
      if self.writer is not None:  # in a multi-process run, process 0 writes it
        self.writer.append(record, durable=True)
      self.resume_written = True
      self.answers.answered = frozenset()
    self.pipeline.submit(write)

  def submit_step(self, job: StepJob, answered_with_it: bool = False):
    """Queues a step's commitment; it holds its window slot until answered: until it is
    committed when its decision is known (``answered_with_it``: a replayed step's answer,
    queued after it, across processes), else until a decision comes (``answer``)."""
    return self.pipeline.submit(lambda pipeline_job: self._commit_step(pipeline_job, job),
                                holds_slot=job.decision is not None or answered_with_it)

  def submit_close(self, step: int, last_post: list | None, layouts) -> None:
    """Queues the end of the open segment at the last step, ``step`` (``finish``):
    ``last_post`` are its post-state leaves (None when they cannot be read)."""
    started = None if last_post is None else self.digests.start_state(last_post, layouts)
    self.pipeline.submit(lambda job: self._close(step, started, last_post))

  def answer(self, decision: challenge.Decision) -> None:
    """Queues the answer to a decision that arrived after its step was dispatched, and
    gives the step's window slot back: the answer is written on the commit thread behind
    at most a window of newer steps' commitments, so training need not wait for them.

    Called from any thread.
    """
    self.pipeline.submit(lambda pipeline_job: self.answers.answer_late(decision))
    self.pipeline.release()

  def answer_round(self, topic: str, answers: list, rows: list, release: bool = True) -> None:
    """Queues the answers to the decisions every process of a multi-process run took in
    the round ``topic`` (``zkdv.jax.shared_decisions``): ``answers`` are (decision, whether
    it decides its segment, ``[(step, whole inputs)]`` of the segment, post-state, replayed
    post-state) with None where no check opens them, ``rows``
    the probed rows held here (``[step, leaf, row, bytes]``), sent to process 0, which then
    deletes the round (every process has read it). The round gives its steps' window slots
    back at once (``CommitPipeline.release``): their answers queue behind newer commitments;
    with ``release`` False the steps' own jobs gave them back (``submit_step``)."""
    def work(pipeline_job):
      del pipeline_job
      sent = self.group.gather(f"{topic}/rows", rows)
      if sent is None:  # another process writes the records
        for decision, decides, *_ in answers:
          self.openings.count_decided(decision if decides else None)
        return
      self.group.delete(topic)
      by_step = {}
      for here in sent:
        for step, leaf, row, data in here:
          by_step.setdefault(step, []).append((leaf, row, data))
      for decision, _, opened, post, replayed in answers:
        self.answers.answer_shared(decision, by_step.get(decision.step, []), opened, post,
                                   replayed, self.owed.answered_in_round(decision.step))
    self.pipeline.submit(work)
    for _ in answers if release else ():  # else their steps' jobs gave theirs back
      self.pipeline.release()

  @property
  def pending_steps(self) -> int:
    return self.answers.pending_steps

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

    In a multi-process run every process sends the digests of what it holds to
    process 0, which writes the records (offline, every segment is one step and
    ``job.checked`` holds the whole post-state and replayed outputs).
    """
    program = job.program
    if job.opened is not None:
      job.opened = arrays.opened_views(job.opened)
    end_views = None
    segment_decision = job.segment_decision
    if job.ends and job.checked is None and not self.group.multi and (
        segment_decision is None or segment_decision.state or not program.exact):
      end_views = [arrays.host_view(x) for x in job.post]  # before the next step may donate
    gathered = self.gathering.gather_step(job, pipeline_job.views_ready)
    # The kept step (``Answers``) holds no post-state past its hash: without donation it
    # would be one more generation of the state for every step until its segment is answered.
    job.post = None
    if gathered is None:  # another process writes the records
      self.openings.count_decided(job.decision)
      return
    if job.starts:
      self._end_previous(job, gathered)
      self._start_segment(job, gathered.pre_pieces)
      if job.start_arrays is not None:
        self._open.start_blobs = self.openings.start_blobs(job, self._open.start_pieces)
    elif self._held is not None:  # the segment goes on through the held step
      held_job, held_record = self._held
      self._held = None
      self._write_step(held_job, held_record, ends=False)
    roots = [digest.tree_root(t) for t in gathered.trees[0]]
    record = {"type": "step", "index": job.index,
              "program": self._program_numbers[program.program_id],
              "batch": digest.batch_digest(program.batch_layouts, roots)}
    if job.starts:
      record["pre_state"] = self._open.start_digest
    if job.data is not None:
      job.data.check(job.index, program.batch_layouts, gathered.trees[0])
      record["data_rows"] = job.data.record_field()
    step_metrics = _step_metrics(job.metrics)
    if step_metrics:
      record["metrics"] = step_metrics
    self.answers.keep(job, gathered.trees)
    self.owed.match(job, roots, gathered.trees, replaying=self._catch_up is not None)
    self._open.last = job.index
    if job.ends:
      post_pieces = gathered.post_pieces()
      record, end = self._ended(program, record, post_pieces)
      self._write_step(job, record, end,
                       job.checked[0] if job.checked is not None else end_views)
      gathered.cross_check_replicas(job.index, program.post_layouts, post_pieces)
    else:
      self._held = (job, record)
    self.committed_steps = max(self.committed_steps, job.index + 1)

  def _ended(self, program, record: dict, pieces) -> tuple[dict, bytes]:
    """The step record ending a segment at post-state ``pieces``, and its digest
    (the committed state from now on)."""
    end = digest.state_digest_from_pieces(program.post_layouts, pieces)
    self.last = CommittedState(end, pieces, program.post_layouts, program.params_mask)
    return {**record, "post_state": end, "post_state_leaves": [list(p) for p in pieces]}, end

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
    self._open = Segment(job.index, start_digest, start_pieces)
    self.answers.open_segment(self._open)

  def _end_previous(self, job: StepJob, gathered: GatheredStep) -> None:
    """A segment the previous step did not plan to end ends before ``job``."""
    if self._held is None:
      return
    if job.previous_continues:  # across processes, a round opens the end (answer_shared)
      end_views = (None if job.opened is None else
                   [v for i, v in enumerate(job.opened) if i in job.program.state_indices])
      self._end_held(gathered.pre_pieces, end_views)
    else:
      self._end_held(gathered.previous_end, None)

  def _close(self, step: int, started, last_post) -> None:
    """``finish``: the held last step ends the open segment."""
    pieces = self.gathering.gather_end(f"{step}/close", started)
    if self._held is None:
      return
    self._end_held(pieces, None if pieces is None else [arrays.host_view(x) for x in last_post])

  def _end_held(self, pieces, end_views) -> None:
    """Writes the held step's record, ending the open segment at post-state ``pieces``
    (None: it could not be read, no end commitment)."""
    held_job, record = self._held
    self._held = None
    if pieces is None:
      self._write_step(held_job, record, None, None)
      return
    record, end = self._ended(held_job.program, record, pieces)
    self._write_step(held_job, record, end, end_views)

  def _write_step(self, job: StepJob, record: dict, end: bytes | None = None,
                  end_views=None, ends: bool = True) -> None:
    """Writes a step record (ending the open segment when ``ends``), or compares a
    replayed one with its committed record; a decision known already (self-chosen, or a
    replayed step's) is answered now."""
    catch_up = self._catch_up
    replayed = catch_up is not None and job.index <= catch_up.last
    if replayed:
      catch_up.check_replayed(record)
      if job.index == catch_up.last:
        self._catch_up = None
    else:
      self.writer.append(record)
      self.written_steps = job.index + 1
    if job.index == 0 and self._init is not None and not replayed:  # links the start to step 0
      self.writer.append({"type": "check", "step": 0, "kind": "start",
                          "pre_state_pieces": self.answers.segments[0].start_pieces})
    if ends:
      self._open.last = job.index
      self._end_open(end, end_views, counted=not replayed)
    if job.decision is not None:  # self-chosen: the segment by its first step's decision
      self.answers.answer(job.decision, job.segment_decision if ends else None)

  def _end_open(self, end: bytes | None, end_views, counted: bool = True) -> None:
    segment = self._open
    segment.end, segment.end_views = end, end_views
    if counted:  # a replayed segment was counted by the run that committed it
      self.segment_lengths.append(segment.last - segment.first + 1)
    if end is None:  # nothing to challenge against: the verifier reports it
      segment.answered = True
      self.answers.release()

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
        if whole_state is not None and steps - 1 not in self.openings.state_checked:
          self.openings.state(steps - 1, whole_state)
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
