"""A resumed run's side of dispatching: its first step's restored state, the replay it
plans, and whether it may finish (a mixin of ``zkdv.jax.dispatch.Dispatcher``).

Example::

  dispatcher.restored = point     # a resumed run's ``zkdv.jax.resume.ResumePoint``
  dispatcher.run(program, leaves)  # its first step checks the state and plans a replay
  dispatcher.check_finishable()    # at finish(): ResumeStateError if it stopped short
"""

import jax
import numpy as np

from zkdv import errors
from zkdv.jax import catch_up as catch_up_lib
from zkdv.jax import start as start_lib


class ResumedDispatch:
  """What a ``Dispatcher`` does for a resumed run (its ``restored`` point, ``catch_up``,
  ``_replayed`` and ``_rekey_from`` attributes)."""

  def _check_restored(self, program, leaves: list, data):
    """A resumed run's first step: its state must be the committed one, or an earlier
    committed one the run replays from (``zkdv.jax.catch_up.CatchUp``); ResumeStateError
    names the leaves that differ, and nothing is written. Then the ``resume`` record, or
    the replay first. Returns the step's batch from ``proof.batches`` (``data``), the first
    replayed step's when the run replays."""
    digests = self._digests
    state = [leaves[i] for i in program.state_indices]
    pieces = digests.state_digests(digests.materialize(
        digests.start_state(state, program.state_layouts)))
    catch_up = catch_up_lib.plan_across(self._group, self.restored, program.state_layouts,
                                        pieces, self._challenger.policy)
    if catch_up is None:
      self._committer.submit_resume(self.restored.record())
    else:
      if data is not None:  # proof.batches drew the batch after the last committed state
        data = data.order.go_back(data.number - (catch_up.last + 1 - catch_up.first),
                                  catch_up_lib.state_at(catch_up.restored))
      self._rekey_from = self.steps
      self.catch_up, self.steps = catch_up, catch_up.first
      self._committer.submit_catch_up(catch_up)
    self.restored = None
    return data

  def _rekey(self, program, leaves: list, drawn_for: int, step: int) -> None:
    """Gives the PRNG-key batch leaves that hold step ``drawn_for``'s key (``proof.step_key()``
    named the step after the transcript, before the run knew it replays from ``step``)
    step ``step``'s key instead: the only key that step may hold."""
    seed = self._committer.key_seed
    for i, layout in zip(program.batch_indices, program.batch_layouts):
      if layout.key_impl is None:
        continue
      drawn = start_lib.proof_key(seed, drawn_for, jax.random.key_impl(leaves[i]))
      if np.array_equal(jax.random.key_data(leaves[i]), jax.random.key_data(drawn)):
        leaves[i] = start_lib.proof_key(seed, step, jax.random.key_impl(leaves[i]))

  def check_finishable(self) -> None:
    """Raises, before ``finish`` writes anything, when a resumed run stops short of what
    its resume needs: while it replays committed steps (ResumeStateError), and without a
    step when the transcript holds steps after its last committed state (the first step's
    ``resume`` discards them: ResumeStateError) or checks a crash left unanswered
    (UnanswerableChallengeError). The transcript stays resumable. In a multi-process run
    process 0 decides, and every process raises the same error."""
    if self.restored is not None or self.catch_up is not None or self._replayed is not None:
      self._group.agree("resume/finish", self._check_resume_finishable)

  def _check_resume_finishable(self) -> None:
    fix = "Nothing was written: resume again and train past it before proof.finish()."
    replayed = self._replayed
    if replayed is not None and replayed.resume["step"] > replayed.last + 1:
      raise errors.ResumeStateError(
          f"the resumed run finished after replaying the committed steps "
          f"{replayed.first}..{replayed.last} without a new step: steps "
          f"{replayed.last + 1}..{replayed.resume['step'] - 1} ran after the last committed "
          f"state, and only a resumed run's first new step discards them. {fix}")
    if self.catch_up is not None:
      raise errors.ResumeStateError(
          f"the run finished at step {self.steps} while replaying the committed steps "
          f"{self.catch_up.first}..{self.catch_up.last} from the restored state, before "
          f"the last committed one (step {self.catch_up.last}). {fix}")
    point = self.restored
    if point is None:
      return
    if point.steps > point.after + 1:
      ran = (f"step {point.after + 1}" if point.steps == point.after + 2 else
             f"steps {point.after + 1}..{point.steps - 1}")
      raise errors.ResumeStateError(
          f"the resumed run finished without a step: {ran} ran after the last committed "
          f"state (step {point.after}), and only a resumed run's first step discards "
          f"{'it' if point.steps == point.after + 2 else 'them'}. {fix}")
    if point.replayable is not None and point.replayable.unanswered:
      raise errors.UnanswerableChallengeError(
          f"the resumed run finished without a step: "
          f"{point.replayable.unanswered_message(None)}")
