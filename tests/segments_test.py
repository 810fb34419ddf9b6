"""Segments: a challenged segment is replayed whole from its committed start, so a
faked step anywhere in it is caught."""

import functools
import pathlib
import tempfile
import time
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest
from absl.testing import parameterized

import zkdv
from tests import testing
from tests.verify_test import (VerifierTestCase, copy_of, first, flip_byte, rechained,
                               records_of, write_transcript)
from zkdv import challenge
from zkdv import config
from zkdv import transcript
from zkdv import verify
from zkdv.jax import dispatch
from zkdv.jax import processes
from zkdv.verify import parallel

ALWAYS = {"update_check_probability": 1.0, "state_check_probability": 0.5, "probe_ratio": 0.5}
HALF = {"update_check_probability": 0.5, "state_check_probability": 0.0, "probe_ratio": 0.0}
UPDATES = {"update_check_probability": 1.0, "state_check_probability": 0.0, "probe_ratio": 0.0}


@functools.cache
def chained():
  """Two segments of three, both update-checked (no state check opens the same blobs)."""
  return write_transcript(policy=UPDATES, segment_length=3)


@functools.cache
def segmented(fake_step=None):
  """Six steps in two segments of three, every segment challenged."""
  return write_transcript(policy=ALWAYS, segment_length=3, fake_step=fake_step)


class SegmentsTest(VerifierTestCase):

  def test_segments_replay_from_their_start_and_verify(self):
    report = verify.verify(segmented())
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    self.assertEqual((report.steps, report.segments), (6, 2))
    updates = [(c.first, c.step, c.status) for c in report.checks if c.kind == "update"]
    self.assertEqual(updates, [(0, 2, "verified"), (3, 5, "verified")])
    facts = report.claim("replays").facts
    self.assertEqual((facts["segments"], facts["steps_replayed"], facts["segment_length"]),
                     (2, 6, 3))
    self.assertFalse(facts["full_replay"])  # the policy did not ask for it, no attested start

  def test_the_verifier_compiles_a_program_once(self):
    # The first step of a segment runs on opened (uncommitted) arrays and the next on the
    # previous step's (committed) outputs: each signature used to compile the program.
    # Counted as lowerings (each compiles, or loads from a persistent cache).
    path = segmented()
    compiled = []

    def listen(event, seconds, **kwargs):  # pylint: disable=unused-argument
      if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and "zkdv_update" in str(
          kwargs.get("fun_name")):
        compiled.append(kwargs["fun_name"])
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
      report = verify.verify(path, read_ahead=False)
    finally:
      jax.monitoring.unregister_event_duration_listener(listen)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    self.assertLen(compiled, 1)

  @parameterized.parameters(3, 4, 5)
  def test_a_faked_step_anywhere_in_a_challenged_segment_is_caught(self, faked):
    report = self.assert_fails(segmented(faked), "replay")
    replay = [f for f in report.findings if f.code == "replay"]
    self.assertLen(replay, 1)
    self.assertIn("update check of step 5", replay[0].where)  # the segment 3..5
    self.assertEqual([c.status for c in report.checks if c.kind == "update"],
                     ["verified", "failed"])

  def test_a_segment_longer_than_the_policy_allows(self):
    def edit(records):  # steps 0..5 as one segment of 6 > segment_length 3
      first(records, "step", index=2).pop("post_state")
      first(records, "step", index=3).pop("pre_state")
      return [r for r in records if not (r["type"] == "check" and r["step"] == 2
                                         and r["kind"] in ("update", "state"))]
    report = self.assert_fails(rechained(edit, segmented()), "segment_length")
    self.assertIn("a segment of 6 steps exceeds the policy's segment_length 3", report.dumps())

  def test_a_check_that_opens_another_segment_is_refused(self):
    def edit(records):  # steps 4..5 opened, with their batches
      check = first(records, "check", kind="update", step=5)
      check["first"], check["batch_blobs"] = 4, check["batch_blobs"][1:]
      return records
    report = self.assert_fails(rechained(edit, segmented()), "opening")
    self.assertIn("the segment ending at step 5 starts at step 3", report.dumps())

    def without_its_batches(records):  # steps 4..5 named, with the batches of 3..5
      first(records, "check", kind="update", step=5)["first"] = 4
      return records
    report = self.assert_fails(rechained(without_its_batches, segmented()), "schema")
    self.assertIn("batch_blobs: one list of blobs per step of the segment 4..5 (2), got 3",
                  report.dumps())

  def test_a_segment_without_its_end_is_a_discontinuity(self):
    def edit(records):
      first(records, "step", index=2).pop("post_state")
      return [r for r in records if not (r["type"] == "check" and r["step"] == 2
                                         and r["kind"] in ("update", "state"))]
    report = self.assert_fails(rechained(edit, segmented()), "discontinuity")
    self.assertIn("the segment before it has no committed end state", report.dumps())

  @parameterized.parameters(None, 1, 4)
  def test_read_ahead_reaches_the_same_report(self, fake_step):
    path = segmented(fake_step)
    ahead, inline = (verify.verify(path, read_ahead=r) for r in (True, False))
    self.assertEqual(ahead.dumps(), inline.dumps())
    self.assertEqual(ahead.verdict, verify.VERIFIED if fake_step is None else verify.INVALID)

  def test_segments_replayed_in_two_processes_reach_the_same_report(self):
    path = segmented(fake_step=4)  # the second segment holds a faked step
    with mock.patch.object(parallel, "replay_groups", wraps=parallel.replay_groups) as spy:
      two = verify.verify(path, jobs=2)
    positions, jobs = spy.call_args.args[2:4]
    self.assertEqual((len(positions), jobs), (2, 2))  # the two update checks, in 2 processes
    self.assertEqual(verify.verify(path, jobs=1).dumps(), two.dumps())
    self.assertEqual([c.status for c in two.checks if c.kind == "update"],
                     ["verified", "failed"])

  @parameterized.named_parameters(("a_flipped_byte", "flip"), ("names_swapped", "swap"),
                                  ("a_blob_gone", "remove"), ("a_blob_cut", "cut"))
  def test_a_chained_start_is_checked_where_it_lies(self, how):
    # The second segment continues from the first one's replay and does not need its
    # opened start; its blobs are still hashed (mapped, not read into memory), so a bad
    # one fails as it does where two processes split the checks there.
    path = chained()
    update_checks = [r for r in records_of(path, "check") if r["kind"] == "update"]
    blob = next(b for b in update_checks[1]["pre_state_blobs"]
                if b not in update_checks[0]["pre_state_blobs"])  # not the first start's
    if how == "swap":
      def edit(records):
        check = [r for r in records if r.get("kind") == "update"][1]
        check["pre_state_blobs"] = check["pre_state_blobs"][::-1]
        return records
      path, code = rechained(edit, path), "blob"
    else:
      path = copy_of(path)
      target = transcript.blob_path(path, blob)
      code = {"flip": "blob", "remove": "missing_blob", "cut": "blob"}[how]
      if how == "flip":
        flip_byte(target, target.stat().st_size // 2)
      elif how == "remove":
        target.unlink()
      else:
        target.write_bytes(target.read_bytes()[:-1])
    with mock.patch.object(transcript, "read_blob", wraps=transcript.read_blob) as read:
      one = verify.verify(path, jobs=1, read_ahead=False)
    self.assertNotIn(blob, [c.args[1] for c in read.call_args_list])  # hashed, not read
    self.assertIn(code, [f.code for f in one.findings], one.dumps())
    self.assertEqual([c.status for c in one.checks if c.kind == "update"],
                     ["verified", "failed"])
    self.assertEqual(verify.verify(path, jobs=2, read_ahead=False).dumps(), one.dumps())

  @parameterized.named_parameters(
      ("batch_blobs_a_string", "batch_blobs", "x", "batch_blobs"),
      ("batch_blobs_of_other_types", "batch_blobs", [[1, None], "y", [b"short"]],
       "batch_blobs"),
      ("pre_state_blobs_too_many", "pre_state_blobs", [b"\x00" * 32] * 1000,
       "pre-state blobs do not match the program layout"),
      ("pre_state_blobs_missing", "pre_state_blobs", None, "pre_state_blobs"))
  def test_hostile_openings_read_ahead_reaches_the_same_report(self, field, value, named):
    def edit(records):
      check = next(r for r in records if r.get("kind") == "update")
      if value is None:
        check.pop(field)
      else:
        check[field] = value
      return records
    path = rechained(edit, segmented())
    ahead, inline = (verify.verify(path, read_ahead=r) for r in (True, False))
    self.assertEqual(ahead.dumps(), inline.dumps())
    self.assert_refused_naming(ahead, verify.INVALID, "schema", named)

  @parameterized.named_parameters(
      ("a_string", "x", verify.INVALID, "pre_state_blobs"),
      ("too_many", [b"\x00" * 32] * 1000, verify.INVALID, "pre-state blobs do not match"),
      ("of_other_types", [1, None, "y"], verify.INVALID, "pre_state_blobs"),
      ("short_names", [b"short", b"names"], verify.INVALID, "pre_state_blobs"),
      ("a_name_not_in_the_transcript", "unknown", verify.UNVERIFIABLE,
       "update check of step 5"),
      ("missing", None, verify.INVALID, "pre_state_blobs"))
  def test_hostile_start_of_a_chained_segment(self, value, verdict, named):
    # The start of a segment that continues the last replay is hashed where it lies; its
    # blob names are the prover's, checked as a read start's are, in one process or two.
    def edit(records):
      check = [r for r in records if r.get("kind") == "update"][1]
      if value is None:
        check.pop("pre_state_blobs")
      elif value == "unknown":
        check["pre_state_blobs"] = [b"\x07" * 32] + check["pre_state_blobs"][1:]
      else:
        check["pre_state_blobs"] = value
      return records
    path = rechained(edit, chained())
    one = verify.verify(path, read_ahead=False)
    self.assert_refused_naming(one, verdict, "schema" if verdict == verify.INVALID
                               else "missing_blob", named)
    self.assertEqual([c.status for c in one.checks if c.kind == "update"][0], "verified")
    self.assertEqual(verify.verify(path, jobs=2, read_ahead=False).dumps(), one.dumps())

  def test_a_batch_blob_is_checked_against_its_step_not_its_name(self):
    path = copy_of(segmented())
    check = next(r for r in records_of(path, "check") if r["kind"] == "update")
    blob = transcript.blob_path(path, check["batch_blobs"][1][0])
    flip_byte(blob, 0)
    for read_ahead in (True, False):
      report = self.assert_fails(path, "opening", read_ahead=read_ahead)
      self.assertIn(f"opened batch of step {check['first'] + 1} does not match its commitment",
                    report.dumps())

  def test_escape_probability_with_segments(self):
    self.assertEqual(challenge.escape_probability(0.5, 1, 64), 0.5)  # one faked step: 1 - p
    self.assertEqual(challenge.escape_probability(0.5, 8, 4), 0.25)  # 8 steps touch >= 2
    self.assertEqual(challenge.escape_probability(0.5, 8, 1), 0.5**8)

  def test_time_waiting_on_checks_is_not_step_time(self):
    # A run that waits for every check (p = 1) measured its steps as step + check, and the
    # adaptive k fell to 1: every step opened its whole start state.
    dispatcher = dispatch.Dispatcher(None, None, None, processes.ProcessGroup.current(), None)
    dispatcher.steps = 5
    dispatcher._time_step()  # pylint: disable=protected-access
    with dispatcher._waiting():  # pylint: disable=protected-access
      time.sleep(1.0)
    time.sleep(0.01)
    dispatcher._time_step()  # pylint: disable=protected-access
    (interval,) = dispatcher._step_times  # pylint: disable=protected-access
    self.assertGreaterEqual(interval, 0.01)
    self.assertLess(interval, 1.0)  # the wait counted would make it 1.01 s

  @parameterized.named_parameters(
      # 50 ms steps: a 1 ms budget; the batch leaves 0.5 ms for a 10 ms state hash.
      ("state_and_batch_fit", 0.050, 0.010, 0.0005, 64, 20),
      ("no_batch_cost", 0.050, 0.010, 0.0, 64, 10),
      ("a_fast_state_hash_every_step", 0.025, 0.0001, 0.0, 64, 1),
      ("batches_take_the_budget", 0.025, 0.010, 0.0005, 64, 64),
      ("capped_by_the_bound", 0.050, 0.010, 0.0005, 16, 16))
  def test_adaptive_length_keeps_commitments_within_the_budget(self, step, state, batch, bound,
                                                               expected):
    k = dispatch.adaptive_segment_length(step, state, batch, bound)
    self.assertEqual(k, expected)
    budget = config.COMMITMENT_BUDGET * step
    self.assertEqual(config.COMMITMENT_BUDGET, 0.02)
    if k < bound:  # the shortest k within 2 % of a step
      self.assertLessEqual(state / k + batch, budget + 1e-12)
      if k > 1:
        self.assertGreater(state / (k - 1) + batch, budget)


class AdaptiveBoundTest(absltest.TestCase):

  def _longest_segment(self, most_steps=1000):
    """(bounds the adaptive rule was given, segment lengths) of an offline proof at window 64
    whose rule always takes its bound, trained until its first adaptive segment ended (the
    rule is asked once step and hash times are measured: after a number of one-step
    segments that depends on the machine's pace)."""
    bounds = []

    def takes_the_bound(step, state, batch, bound):
      bounds.append(bound)
      return bound

    folder = pathlib.Path(tempfile.mkdtemp(prefix="zkdv-test-")) / "adaptive"
    proof = zkdv.jax.ZKDV("adaptive", zkdv.ZKDVConfig(
        sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0), output_dir=folder))
    proof.start(rolling_window=64)
    with mock.patch.object(dispatch, "adaptive_segment_length", takes_the_bound):
      state = testing.classifier_state(proof)
      train_step = proof.jit(testing.classifier_step, donate_argnums=0)
      batch = jnp.asarray(testing.TUTORIAL_BATCH)
      for _ in range(most_steps):
        state = train_step(state, batch)
        if len(bounds) >= 2:  # a second adaptive segment started: the first one ended
          break
      proof.finish()
    return bounds, proof.segment_lengths

  def test_a_segment_keeps_at_most_half_the_window_its_batches_memory_allows(self):
    bounds, lengths = self._longest_segment()
    self.assertEqual((max(bounds), max(lengths)), (64, 64))  # the window's
    # Batches of a size of which only 64 fit in KEPT_BATCH_BYTES: segments of 32.
    with mock.patch.object(config, "KEPT_BATCH_BYTES", 64 * testing.TUTORIAL_BATCH.nbytes):
      bounds, lengths = self._longest_segment()
    self.assertEqual((set(bounds), max(lengths)), ({32}, 32))

  def test_kept_window(self):
    self.assertEqual(config.kept_window(1 << 20), 1024)
    self.assertEqual(config.kept_window(64 << 20), 64)  # at least 64 steps
    self.assertEqual(config.kept_window(0), config.KEPT_BATCH_BYTES)


if __name__ == "__main__":
  absltest.main()
