"""Hashing a step on every process and gathering the digests on process 0.

Each process hashes what it holds of a step's states and batch (a digest is
None for a piece or row held elsewhere) and sends it to process 0, which
merges them into the whole commitments it writes (``processes.ProcessGroup``).
In a one-process run the gathering is the identity.

Example::

  gathering = Gathering(group, digests, config)
  step = gathering.gather_step(job, views_ready)   # None on processes other than 0
  step.post_pieces()                               # [leaf][piece] digests
"""

import dataclasses
import threading
import time

from zkdv import errors
from zkdv import merkle
from zkdv.jax import processes
from zkdv.jax.commit_jobs import HashedBatch, StepJob


@dataclasses.dataclass
class GatheredStep:
  """A step's digests from every process, on process 0.

  Attributes:
    states: per process, ``[post pieces, pre pieces, replica digests, previous end
      pieces]``.
    pre_pieces: the merged pre-state piece digests (None: the step continues from the
      committed post-state, not hashed again).
    previous_end: the previous post-state's piece digests when this step's boundary was
      not planned and the state changed (``StepJob.previous_end_started``), else None.
    trees: (row trees, {(leaf, row): bytes}) of the whole batch.
  """

  states: list
  pre_pieces: list | None
  previous_end: list | None
  trees: tuple

  def post_pieces(self) -> list:
    """The merged post-state piece digests (of a step that ends a segment)."""
    return processes.merge([g[0] for g in self.states], "post-state")

  def cross_check_replicas(self, index: int, layouts, pieces) -> None:
    """Raises ReplicaDivergenceError if a replica's digest differs from its piece's."""
    for _, _, replicas, _ in self.states:
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


class Gathering:
  """Hashes what this process holds of each step and gathers it on process 0.

  Attributes:
    committed_here: the pieces and rows this process hashed.
    hash_seconds: the last whole post-state hash's time (for the adaptive k).
    batch_seconds: the recent steps' batch commitment times.
  """

  def __init__(self, group, digests, config):
    self.group, self.digests, self.config = group, digests, config
    self.committed_here = {"pieces": 0, "rows": 0}
    self.hash_seconds: float | None = None
    self.batch_seconds: list[float] = []

  def started_digests(self, started):
    """The piece digests of a state whose hashing ``digests.start_state`` started."""
    if started is None:
      return None
    return self.digests.state_digests(self.digests.materialize(started))

  def gather_end(self, topic: str, started):
    """The piece digests of a state whose hashing ``digests.start_state`` started on every
    process, merged on process 0 (None elsewhere, or when a process could not read its
    part)."""
    gathered = self.group.gather(topic, self.started_digests(started))
    return None if gathered is None else _merged(gathered, "end state")

  def gather_step(self, job: StepJob, views_ready: threading.Event) -> GatheredStep | None:
    """Hashes the step's states and batch here and gathers them: on process 0 the
    whole step's digests, elsewhere None. Sets ``views_ready`` once no view of the
    post-state is held (the next step may donate it)."""
    program = job.program
    previous_end = self.started_digests(job.previous_end_started)  # unplanned boundaries
    pre = job.pre_hashed
    if job.pre_started is not None:
      pre = self.started_digests(job.pre_started)
    local = None
    if job.ends:
      # The host views live only for the hash: a view held longer would keep the next step
      # from donating the post-state (one more generation of memory).
      materialized = job.post_views(self.digests)  # waits for the step
      hashed_at = time.perf_counter()
      local = self.digests.state_digests(materialized)
      self.hash_seconds = time.perf_counter() - hashed_at
      job.release_post_views()
      materialized = None
      self.committed_here["pieces"] += sum(d is not None for leaf in local for d in leaf)
    replicas = (self.digests.replica_digests(job.post, program.post_layouts)
                if self.config.cross_check_replicas and job.ends else [])
    views_ready.set()
    gathered = self.group.gather(f"{job.index}/state", [local, pre, replicas, previous_end])
    batch_started = time.perf_counter()
    hashed = job.batch_hashed or self.hash_batch(program, job.rows_started, job.decision,
                                                 copy=self.group.multi)
    trees = self._gather_batch(job.index, hashed)
    self.batch_seconds = (self.batch_seconds + [time.perf_counter() - batch_started])[-16:]
    if gathered is None:  # another process writes the records
      return None
    pre_pieces = None if pre is None else processes.merge([g[1] for g in gathered],
                                                           "pre-state")
    if previous_end is not None and self.group.multi:
      previous_end = _merged([g[3] for g in gathered], "end state")
    return GatheredStep(gathered, pre_pieces, previous_end, trees)

  def hash_batch(self, program, rows, decision, copy: bool) -> HashedBatch:
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

  def _gather_batch(self, index: int, hashed: HashedBatch):
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


def _merged(per_process: list, what: str):
  """``processes.merge`` of every process's piece digests; None when a process could not
  read its part."""
  return None if any(p is None for p in per_process) else processes.merge(per_process, what)
