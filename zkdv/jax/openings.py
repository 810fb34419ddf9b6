"""The ``check`` records that answer a decision: the openings of states and batch rows.

An update check opens a segment's start state and every batch in it (and,
unless the server replays every segment, replays them here to report the
result); a state check opens a segment's end state; a probe opens batch rows,
inline in its record, with their Merkle inclusion proofs; a segment decided while its steps run
writes its start state at once (``start_blobs``).

Example::

  openings = Openings(writer, config.tolerance, on_replayed=fence.set)
  openings.update(segment, jobs, replay=True)
  openings.probe(job, decision, trees)
"""

from collections.abc import Callable

import jax
import numpy as np

from zkdv import digest
from zkdv import merkle
from zkdv import records
from zkdv.jax import arrays
from zkdv.jax import replay as replay_lib
from zkdv.jax.commit_jobs import Segment, StepJob


class Openings:
  """Writes check records and counts them.

  Args:
    writer: the transcript writer.
    tolerance: the equivalent-mode tolerance of the prover's own replay.
    on_replayed: called once an update check's replay has a result (its openings
      may still be written).

  Attributes:
    checks: the number of update, state and probe checks written (or, on a process
      that writes no records, decided).
    failed_checks: the prover's own replays that did not match the commitment.
    state_checked: the steps whose end state was opened.
  """

  def __init__(self, writer, tolerance, on_replayed: Callable[[], None]):
    self.writer, self.tolerance, self.on_replayed = writer, tolerance, on_replayed
    self.checks = {"update": 0, "state": 0, "probe": 0}
    self.failed_checks: list[dict] = []
    self.state_checked: set[int] = set()

  def count_decided(self, decision) -> None:
    """Counts the checks of a decision another process answers."""
    if decision is not None:
      self.checks["update"] += decision.update
      self.checks["state"] += decision.state

  def start_blobs(self, job: StepJob, start_pieces) -> list | None:
    """Writes the opened start of a segment whose update check is decided, while its
    steps run, and drops the views of it; its blobs, or None when the start's arrays
    were donated all the same (the views are the start, written with the check).

    The views kept the start's buffers from donation at the segment's first step (JAX
    copies instead), so the start's arrays still hold it; the check's replay consumes
    them. A check then holds one state generation, not two (views kept for writing
    after the replay, and the replay's own copy).
    """
    program = job.program
    if any(x.is_deleted() for x in job.start_arrays):
      job.start_arrays = None
      return None
    # A whole leaf's blob is named by its committed digest (its one piece): not hashed again.
    blobs = [self.writer.put_blob(digest.byte_view(job.opened[i]),
                                  pieces[0] if layout.pieces is None else None)
             for i, layout, pieces in zip(program.state_indices, program.state_layouts,
                                          start_pieces)]
    job.opened = [None if i in program.state_indices else v for i, v in enumerate(job.opened)]
    return blobs

  def update(self, segment: Segment, jobs: list, replay: bool) -> None:
    """Opens the segment's start state and every batch of its ``jobs``; with ``replay``
    (the server does not replay every segment) replays them here too and reports
    whether the end state matches."""
    first = jobs[0]
    program = first.program
    if first.start_arrays is not None:  # written already; the replay consumes the arrays
      start, first.start_arrays = first.start_arrays, None
    else:
      start = [first.opened[i] for i in program.state_indices]
    result = self._replay(segment, jobs, start) if replay else None
    self.on_replayed()  # the training thread's fence (UNCHECKED) ends here
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
    if not replay and all(job.data is not None for job in jobs):  # full replay: every row
      record["data_paths"] = [job.data.batch_paths(job.program.batch_layouts) for job in jobs]
    if any(l.pieces for l in program.state_layouts):  # name the piece a bad opening breaks
      record["pre_state_pieces"] = segment.start_pieces
    if not program.exact:  # the verifier compares within tolerance: open post
      record["post_state_blobs"] = [self.writer.put_blob(digest.byte_view(a))
                                    for a in segment.end_views]
    self.writer.append(record, durable=True)
    self.checks["update"] += 1
    if result is not None and not result["equal"]:
      self.failed_checks.append({"step": segment.last, "first": segment.first, **result})

  def _replay(self, segment: Segment, jobs: list, start: list) -> dict:
    """Replays the segment's steps from its opened start; the result of comparing the
    end state with its commitment (exact) or with the opened end state (equivalent)."""
    # Across processes, the steps up to the last with a replayed post-state were replayed
    # on the training thread (collectives).
    done = max((n for n, job in enumerate(jobs)
                if job.checked is not None and job.checked[1] is not None), default=-1)
    state = None if done < 0 else jobs[done].checked[1]
    for job in jobs[done + 1:]:
      program = job.program
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
    return replay_lib.compare(program.post_layouts, replayed, segment.end_views, exact=False,
                              tolerance=self.tolerance)

  def state(self, index: int, post_views) -> None:
    """Opens the end state of step ``index``."""
    self.state_checked.add(index)
    blobs = [self.writer.put_blob(digest.byte_view(a)) for a in post_views]
    self.writer.append({"type": "check", "step": index, "kind": "state",
                        "post_state_blobs": blobs}, durable=True)
    self.checks["state"] += 1

  def probe(self, job: StepJob, decision, trees, roots: list | None = None) -> None:
    """Opens the batch rows ``decision`` probes with their inclusion proofs (``roots``: the
    batch leaves' roots the record names, where they are not the trees', as a resumed
    run's answer for a discarded step whose keys were another step's). A probed step
    answers with a record even where no leaf has rows to open (PRNG keys only): what a
    step owes is ``challenge.required_checks``, the same for the server and the verifier."""
    program = job.program
    tree_levels, row_data = trees
    layouts = program.batch_layouts
    probes = []
    for leaf, layout in enumerate(layouts):
      for row in decision.leaf_probe_rows(leaf, layout):
        data = row_data.get((leaf, row))
        if data is None:  # a pending decision: the row comes from the opened batch
          data = _row_bytes(job.opened[program.batch_indices[leaf]], layout.rows, row)
        probes.append(records.probe_entry(leaf, row, data, layout.row_group,
                                          merkle.inclusion_proof(tree_levels[leaf], row)))
    if not decision.probed:
      return
    self.writer.append({"type": "check", "step": job.index, "kind": "probe",
                        "batch_roots": roots or [digest.tree_root(t) for t in tree_levels],
                        "probes": probes, **({} if job.data is None else {
                            "data_paths": job.data.probe_paths(layouts, probes)})})
    self.checks["probe"] += 1


def _row_bytes(array: np.ndarray, rows: int, row: int) -> np.ndarray:
  data = digest.byte_view(np.ascontiguousarray(array))
  width = data.size // rows
  return data[row * width:(row + 1) * width]
