"""What the commit thread works on: a dispatched step, and what it keeps until answered.

The training thread hands the committer a ``StepJob`` per step
(``zkdv.jax.dispatch``); the committer keeps it (``Kept``) until its decision
is answered, and groups steps into ``Segment``s from a committed start state to
an end state (``zkdv.jax.answers``).

Example::

  job = StepJob(index=3, program=program, post=outs, post_started=None)
  segment = Segment(first=3, start_digest=state, start_pieces=[[state]])
"""

import dataclasses
import threading

from zkdv import challenge


@dataclasses.dataclass
class StepJob:
  """One dispatched step, as the commit thread needs it.

  Attributes:
    index: the step's index in the transcript.
    program: the ``update_program.Program`` that ran.
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
      (None for state leaves). With a pending decision, leaves not computed yet
      are kept as copies (``arrays.kept_for_opening``), viewed on the commit thread.
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
    data: the ``zkdv.jax.sampler.SampledBatch`` the step consumed, or None.
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
  data: object = None
  _post_views: list | None = None
  _post_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

  def post_views(self, digests) -> list | None:
    """The post-state's host views (``digests.materialize``), taken once by whichever
    thread asks first: the commit thread to hash them, or the training thread before
    the next step donates the state (views alive, JAX copies instead of donating, so
    the step need not wait for the commit thread's queue). None once released.
    """
    with self._post_lock:
      if self._post_views is None and self.post_started is not None:
        self._post_views = digests.materialize(self.post_started)
      return self._post_views

  def release_post_views(self) -> None:
    """Drops the post-state's views once hashed: the next step may donate it."""
    with self._post_lock:
      self.post_started = self._post_views = None


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
class Kept:
  """What a step keeps until its decision and its segment's are answered."""

  job: StepJob
  trees: tuple  # (row trees, {(leaf, row): bytes})
  answered: bool = False


@dataclasses.dataclass
class Segment:
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
