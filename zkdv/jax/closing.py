"""How a run settles and ends: what it has recorded, waiting for its commitments,
``finish()`` and the ``with proof:`` block (a mixin of ``zkdv.jax.ZKDV``).

Example::

  with zkdv.jax.ZKDV("my-run") as proof:  # start() on entry, finish() on exit
    ...
  proof.steps, proof.checks  # what was recorded and answered
"""

import logging
import pathlib

from zkdv import challengers
from zkdv import errors
from zkdv.jax import resume as resume_lib

logger = logging.getLogger("zkdv")

_UNRESUMED = ("the resumed run ended before it went on from the last committed state, so no "
              "final record was written: resume it again.")


class ClosingRun:
  """The end of a ``ZKDV`` run: its counts, ``wait_for_commitments`` and ``finish``."""

  @property
  def steps(self) -> int:
    """The number of steps recorded so far."""
    return 0 if self._dispatcher is None else self._dispatcher.steps

  @property
  def checks(self) -> dict:
    return {} if self._committer is None else self._committer.checks

  @property
  def failed_checks(self) -> list[dict]:
    return [] if self._committer is None else self._committer.failed_checks

  @property
  def discontinuities(self) -> list[int]:
    return [] if self._committer is None else self._committer.discontinuities

  @property
  def segment_lengths(self) -> list[int]:
    """The length of each committed segment (steps between two state commitments)."""
    return [] if self._committer is None else list(self._committer.segment_lengths)

  @property
  def committed_here(self) -> dict:
    return ({"pieces": 0, "rows": 0} if self._committer is None
            else self._committer.committed_here)

  def _report_failure(self, error: BaseException) -> None:
    if isinstance(self._challenger, challengers.ServerChallenger):
      self._challenger.fail(f"committing failed: {type(error).__name__}: {error}")
    self._tell_other_processes(error)

  def _tell_other_processes(self, error: BaseException) -> None:
    """Tells the other processes of a multi-process run that this one stopped, and why:
    they may be waiting for it (a resumed run's first step waits for every process)."""
    try:
      self._group.report_failure(f"{type(error).__name__}: {error}")
    except Exception:  # pylint: disable=broad-except  # the failure itself is raised at finish
      logger.exception("ZKDV proof %r could not tell the other processes it failed", self.name)

  def finish(self) -> pathlib.Path:
    """Waits for every commitment, challenge and check, writes ``final``; idempotent.

    Returns the transcript folder. Raises the first background failure, a
    failed check, or NoTranscriptUpdateError when no step was recorded; the
    ``final`` record is written in every case but one: a resumed run that failed
    before its ``resume`` record (``Dispatcher.check_finishable`` names why first)
    writes none, and stays resumable. In a multi-process run every process calls
    it, and every process raises if process 0's transcript failed.
    """
    if self._finished:
      if self._finish_error is not None:
        raise self._finish_error
      return self.path
    self.ensure_started()
    try:
      self._dispatcher.check_finishable()
    except errors.ZKDVError as e:
      self._complete_commitments()  # what the replay wrote so far stays
      self._end_unresumed(e)
    self._write_pending_init()
    self._dispatcher.close()
    error = self._complete_commitments()
    unresumed = self.resume_from is not None and not self._committer.resume_written and (
        error is not None or self._aborted)  # its restored state refused, its replay failed

    def end_unresumed():  # process 0's outcome on every process: only it compares replays
      if unresumed:
        raise error or errors.ResumeStateError(_UNRESUMED)
    try:
      self._group.agree("finish/unresumed", end_unresumed)
    except errors.ZKDVError as e:
      self._end_unresumed(e)
    owed = self._committer.owed.steps
    if error is None and owed:
      error = errors.UnanswerableChallengeError(
          f"the probes DVBench drew for discarded step{'s' * (len(owed) > 1)} "
          f"{', '.join(map(str, owed))} were never answered: the resumed run did not train "
          f"{'their batches' if len(owed) > 1 else 'its batch'} again (a step of the same "
          "batch answers them), so this proof cannot be verified. Start a new proof.")
    if error is None and self.failed_checks:
      first = self.failed_checks[0]
      error = errors.ReplayError(
          f"{len(self.failed_checks)} sampled check(s) did not reproduce the "
          f"committed state; first at step {first['step']}, leaves "
          f"{first['mismatched_leaves']}.")
    if error is None and self.steps == 0:
      error = (errors.NoTranscriptUpdateError(
          f"proof {self.name!r} finished without recording any update: every call "
          f"of {', '.join(sorted(self._called))} raised before its step was recorded.",
          fix="Fix what that error names and call the step again.") if self._called else
               errors.NoTranscriptUpdateError(
          f"proof {self.name!r} finished without recording any update: the "
          "training step still uses jax.jit."))
    try:
      whole_state = self._dispatcher.gather_last_state()
    except Exception as e:  # pylint: disable=broad-except  # e.g. the final state was deleted
      whole_state = None
      error = error or errors.CommitmentError(
          f"could not gather the sharded params for final_params: {type(e).__name__}: {e}. "
          "Keep the state the last step returned alive until finish().")
    try:
      if self._writer is not None:
        self._committer.write_final(self.steps, error is None and not self._aborted,
                                    whole_state, self._challenger.final_fields())
        self._writer.close()
        (self.path / resume_lib.SEED_FILE).unlink(missing_ok=True)  # final reveals it
    except Exception as e:  # pylint: disable=broad-except  # the others still hear the outcome
      error = error or errors.CommitmentError(
          f"could not write the final record to {self.path}: {type(e).__name__}: {e}")
    error = self._group.agree_on_outcome(error, self.path, self._committer.committed_steps)
    self._finished = True
    self._finish_error = error
    logger.info("ZKDV proof %r: %d steps, %d update, %d state and %d probe checks at %s",
                self.name, self.steps, self.checks["update"], self.checks["state"],
                self.checks["probe"], self.path)
    if error is not None:
      raise error
    return self.path

  def _end_unresumed(self, error) -> None:
    """Ends a resumed run that failed before its ``resume`` record (its restored state was
    refused, its replay failed or stopped short) without ``final``, which would finish a
    proof the run can still resume: the transcript stays as the crash left it, with any
    answers the replay wrote. Raises ``error``, or ResumeStateError saying so. (A resumed
    run with nothing left to train, whose crash came after its last step, finishes.)"""
    if self._writer is not None:
      self._writer.close()
    self.unresumed = True
    self._finished = True
    self._finish_error = error or errors.ResumeStateError(_UNRESUMED)
    raise self._finish_error

  def wait_for_commitments(self) -> None:
    """Blocks until every step so far is committed and its challenges are answered.

    ``finish()`` does this itself; benchmarks and tests use it to settle a run, and a
    run that checkpoints calls it first, at the end of a segment (a fixed
    ``segment_length``; docs/jax.md, "Resuming a run").
    Raises ChallengeTimeoutError when a server's challenges do not come, and what failed
    in the background (CommitmentError, e.g. a full disk) in a single process: a state
    checkpointed after it is then not one its checks were written for.
    """
    self._settle_commitments()
    if not self._group.multi:  # across processes, failures wait for finish()
      self._committer.pipeline.raise_if_failed()

  def _settle_commitments(self) -> None:
    pipeline = self._committer.pipeline
    pipeline.drain()
    shared = self._dispatcher.shared
    if shared is not None:  # every process decides the rest in one last round
      shared.settle(self.steps)
      pipeline.drain()
    elif isinstance(self._challenger, challengers.ServerChallenger) and pipeline.error is None:
      self._challenger.wait_for(self._committer.written_steps)
      pipeline.drain()

  def _complete_commitments(self) -> errors.ZKDVError | None:
    """Waits for every step record and every late challenge's answer."""
    pipeline = self._committer.pipeline
    error = None
    try:
      self._settle_commitments()
    except errors.ZKDVError as e:  # the server's challenges or process 0's round never came
      error = e
    pipeline.close()
    self._challenger.close()
    try:
      pipeline.raise_if_failed()
    except errors.ZKDVError as e:
      error = e
    return error

  def __enter__(self) -> "ClosingRun":
    if self._group is None:
      self.start()
    return self

  def __exit__(self, exc_type, exc, tb):
    if exc_type is None:
      self.finish()
    elif not self._finished and self._group is not None:
      self._aborted = True  # the final record says the run did not end cleanly
      self._tell_other_processes(exc)
      try:
        self.finish()
      except errors.ZKDVError:
        pass  # the exception already propagating says more
