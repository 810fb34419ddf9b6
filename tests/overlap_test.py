"""Overlap policies and the rolling window: what a training call waits for.

The commit thread is held back by a gate (a job that waits for an event) and
the training calls run on another thread, so a call that must wait for its
commitment is seen not to return until the gate opens.
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import zkdv
from tests import testing
from zkdv import verify

BATCH = jnp.asarray(testing.TUTORIAL_BATCH)
HELD_FOR = 1.0  # seconds a waiting call is watched not returning while the gate is shut
TIMEOUT = 120.0  # seconds anything expected to happen may take


def _pipeline(proof):
  """The proof's commit pipeline: one thread running its jobs in order."""
  return proof._committer.pipeline  # pylint: disable=protected-access


class HeldCommitThread:
  """Holds a proof's commit thread until ``release()`` (or the end of the ``with``).

  Example::

    with HeldCommitThread(proof) as held:
      ...  # every commitment queued now waits
      held.release()
  """

  def __init__(self, proof):
    proof.wait_for_commitments()
    self._gate = threading.Event()
    _pipeline(proof).submit(lambda job: self._gate.wait())

  def release(self) -> None:
    self._gate.set()

  def __enter__(self) -> "HeldCommitThread":
    return self

  def __exit__(self, *exc) -> None:
    self.release()  # a failed assertion must not leave the commit thread waiting


class StepsOnAThread:
  """Calls ``train_step(state, BATCH)`` ``count`` times on a thread, chaining the state.

  ``returned[i]`` is set when call ``i`` returns; ``join()`` re-raises a failure.
  """

  def __init__(self, train_step, state, count: int):
    self.returned = [threading.Event() for _ in range(count)]
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, args=(train_step, state), daemon=True)
    self._thread.start()

  def _run(self, train_step, state) -> None:
    try:
      for returned in self.returned:
        state = train_step(state, BATCH)
        returned.set()
    except BaseException as e:  # pylint: disable=broad-except  # re-raised by join()
      self._error = e

  def join(self) -> None:
    self._thread.join(TIMEOUT)
    if self._thread.is_alive():
      raise AssertionError(f"the training thread did not finish in {TIMEOUT} s")
    if self._error is not None:
      raise self._error


def _compiled_step(test_name: str, policy, update_p: float, window: int = 4):
  """A started proof and a step already traced, compiled and committed once."""
  proof = testing.new_proof(test_name, update_p=update_p)
  proof.start(rolling_window=window)
  state = testing.classifier_state(proof, zkdv_overlap=policy)
  train_step = proof.jit(testing.classifier_step)  # no donation: nothing else holds a call
  return proof, train_step, train_step(state, BATCH)


class OverlapPolicyTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("never_waits_for_every_commitment", zkdv.overlap.NEVER, 0.0, True),
      ("unchecked_fences_a_checked_step", zkdv.overlap.UNCHECKED, 1.0, True),
      ("unchecked_pipelines_an_unchecked_step", zkdv.overlap.UNCHECKED, 0.0, False),
      ("always_checks_beside_training", zkdv.overlap.ALWAYS, 1.0, False),
  )
  def test_whether_a_step_waits_for_its_commitment(self, policy, update_p, waits):
    proof, train_step, state = _compiled_step(f"overlap-{policy.value}", policy, update_p)
    with HeldCommitThread(proof) as held:
      steps = StepsOnAThread(train_step, state, count=1)
      if waits:
        self.assertFalse(steps.returned[0].wait(HELD_FOR),
                         f"{policy} returned before its commitment was written")
        held.release()
      self.assertTrue(steps.returned[0].wait(TIMEOUT),
                      f"{policy} waited for a commitment it need not wait for")
    steps.join()
    proof.finish()
    self.assertEqual(proof.steps, 2)
    self.assertEqual(proof.checks["update"], 2 if update_p else 0)
    self.assertEqual(proof.failed_checks, [])


  @parameterized.named_parameters(
      ("unchecked_returns_after_the_replay", zkdv.overlap.UNCHECKED, False),
      ("never_returns_after_the_openings_are_written", zkdv.overlap.NEVER, True))
  def test_a_checked_step_and_the_writing_of_its_openings(self, policy, waits):
    # A check's openings (48 MB of start state for the benchmark MLP) take as long to
    # write as its replay takes to run; UNCHECKED's fence is the replay's result.
    proof, train_step, state = _compiled_step(f"openings-{policy.value}", policy, 1.0)
    proof.wait_for_commitments()  # the first step's openings are written
    writer = proof._committer.writer  # pylint: disable=protected-access
    put_blob, gate, writing = writer.put_blob, threading.Event(), threading.Event()

    def held_put_blob(data):
      writing.set()
      self.assertTrue(gate.wait(TIMEOUT))
      return put_blob(data)
    writer.put_blob = held_put_blob
    try:
      steps = StepsOnAThread(train_step, state, count=1)
      self.assertTrue(writing.wait(TIMEOUT), "the check wrote no opening")
      if waits:
        self.assertFalse(steps.returned[0].wait(HELD_FOR),
                         f"{policy} returned before its openings were written")
      else:
        self.assertTrue(steps.returned[0].wait(TIMEOUT),
                        f"{policy} waited for its openings to be written")
      self.assertEqual(proof.checks["update"], 1)  # the second check's record is not written
    finally:
      gate.set()
    steps.join()
    proof.finish()
    self.assertEqual(proof.checks["update"], 2)
    self.assertEqual(proof.failed_checks, [])
    self.assertEqual(verify.verify(proof.path).verdict, verify.VERIFIED)


class CheckMemoryTest(parameterized.TestCase):

  @parameterized.named_parameters(("donated", True), ("kept", False))
  def test_a_check_replays_on_its_start_not_on_a_copy(self, donated):
    # A check used to keep host views of its segment's start for writing after the replay
    # and to replay on a copy: two state generations. The start is written while the
    # segment runs, and the replay consumes the start's own arrays where production
    # donates them, as jax.jit would have at the segment's first step.
    proof = testing.new_proof(f"check-memory-{donated}", update_p=1.0, segment_length=2)
    state = testing.classifier_state(proof)
    train_step = proof.jit(testing.classifier_step, **({"donate_argnums": 0} if donated else {}))
    state = train_step(train_step(state, BATCH), BATCH)  # the first segment
    start = jax.tree.leaves(state)
    before = [np.asarray(x).tobytes() for x in start]
    state = train_step(train_step(state, BATCH), BATCH)  # a checked segment from ``start``
    proof.wait_for_commitments()
    proof.finish()
    self.assertEqual(proof.checks["update"], 2)
    self.assertEqual(proof.failed_checks, [])
    if donated:
      self.assertTrue(all(x.is_deleted() for x in start), "the replay ran on a copy")
    else:  # a start production did not donate is the caller's: intact
      self.assertEqual([np.asarray(x).tobytes() for x in start], before)
    report = verify.verify(proof.path)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    self.assertEqual([(c.first, c.step, c.status) for c in report.checks if c.kind == "update"],
                     [(0, 1, "verified"), (2, 3, "verified")])


class RollingWindowTest(parameterized.TestCase):

  @parameterized.parameters(1, 3)
  def test_training_runs_ahead_by_the_window_and_no_further(self, window):
    proof, train_step, state = _compiled_step(f"window-{window}", zkdv.overlap.ALWAYS,
                                              update_p=0.0, window=window)
    with HeldCommitThread(proof) as held:
      steps = StepsOnAThread(train_step, state, count=window + 2)
      for returned in steps.returned[:window]:
        self.assertTrue(returned.wait(TIMEOUT))
      self.assertFalse(steps.returned[window].wait(HELD_FOR),
                       f"step {window + 1} ran with {window} steps uncommitted")
      self.assertEqual(_pipeline(proof).in_flight, window)
      held.release()
    steps.join()
    proof.finish()
    self.assertEqual(proof.steps, window + 3)
    self.assertLen(testing.records_of(proof.path, "step"), window + 3)


if __name__ == "__main__":
  absltest.main()
