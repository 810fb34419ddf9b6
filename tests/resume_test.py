"""A run killed with SIGKILL mid-training resumes its transcript from a checkpoint.

The trainer (``tests/resume_trainer.py``) checkpoints with ``flax.serialization`` at
segment ends. ``setUpClass`` runs it once to the end (the reference), once until it is
killed mid-segment, once resumed from a checkpoint whose state was altered (refused), and
once resumed as saved; the tests judge the outcomes and attack the resume record.
"""

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile

from unittest import mock

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as orbax
from absl.testing import absltest
from flax import serialization

import dvbench
import zkdv
from dvbench import transport
from dvbench.server import labels
from dvbench.server.local import LocalServer
from tests import benchmark_test
from tests import resume_trainer
from tests import testing
from zkdv import errors
from zkdv import receipt
from zkdv import transcript
from zkdv import verify

NAME = "resumed-run"


def _trainer(folder, checkpoint, *flags, stdin=None):
  return subprocess.Popen([sys.executable, "-m", "tests.resume_trainer", str(folder),
                           str(checkpoint), *flags], stdin=stdin, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=os.environ.copy())


def _finish(process) -> tuple[int, str, str]:
  out, err = process.communicate(timeout=300)
  return process.returncode, out, err


def _kill_when_ready(process) -> tuple[int, list[str]]:
  """Reads the trainer's lines until it says ``ready`` (it then waits on stdin), kills it
  with SIGKILL; (its return code, the lines)."""
  lines = []
  for line in process.stdout:
    lines.append(line.strip())
    if line.strip() == "ready":
      break
  os.kill(process.pid, signal.SIGKILL)
  process.wait(timeout=60)
  return process.returncode, lines


def _rewrite(folder: pathlib.Path, edit) -> pathlib.Path:
  """A copy of the transcript in ``folder`` whose records ``edit(records)`` returns,
  chained and encoded as a prover would write them."""
  copy = pathlib.Path(tempfile.mkdtemp()) / "edited"
  shutil.copytree(folder, copy)
  (copy / transcript.RECORDS_FILE).unlink()
  records = [{k: v for k, v in r.items() if k != "prev"} for r in testing.records_of(folder)]
  writer = transcript.TranscriptWriter(copy)
  for record in edit(records):
    writer.append(record)
  writer.close()
  return copy


class ResumeAfterKillTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    root = pathlib.Path(tempfile.mkdtemp(prefix="zkdv-resume-"))
    cls.reference, cls.folder, cls.checkpoint = root / "reference", root / "run", root / "ckpt"
    reference = _trainer(cls.reference, root / "reference-ckpt")
    # Killed mid-segment: step 6 written, step 7 held.
    cls.killed = _kill_when_ready(
        _trainer(cls.folder, cls.checkpoint, "--stop-at", "7", stdin=subprocess.PIPE))
    cls.crashed, cls.checkpoint5 = root / "crashed", root / "ckpt-5"
    shutil.copytree(cls.folder, cls.crashed)
    shutil.copy(cls.checkpoint, cls.checkpoint5)
    cls.crashed_bytes = (cls.folder / transcript.RECORDS_FILE).read_bytes()
    cls.altered = _finish(_trainer(cls.folder, cls.checkpoint, "--resume", "--alter"))
    cls.altered_bytes = (cls.folder / transcript.RECORDS_FILE).read_bytes()
    cls.resumed = _finish(_trainer(cls.folder, cls.checkpoint, "--resume"))
    cls.reference_run = _finish(reference)

  def test_the_trainer_was_killed_mid_segment(self):
    code, lines = self.killed
    self.assertEqual(code, -signal.SIGKILL)
    self.assertEqual(lines, ["checkpoint 2", "checkpoint 5", "ready"])
    self.assertNotIn("final", [r["type"] for r in testing.records_of(self.crashed)])

  def test_an_altered_restored_state_is_refused_naming_the_leaf(self):
    code, _, err = self.altered
    self.assertNotEqual(code, 0)
    self.assertIn("zkdv.errors.ResumeStateError: the restored state differs from the "
                  "post-state step 5 committed in leaf .params['Dense_0']['bias'].", err)
    self.assertEqual(self.altered_bytes, self.crashed_bytes)  # nothing written

  def test_resumed_run_ends_as_a_never_crashed_one(self):
    self.assertEqual(self.resumed[0], 0, self.resumed[2][-2000:])
    self.assertEqual(self.reference_run[0], 0, self.reference_run[2][-2000:])
    cli = subprocess.run([sys.executable, "-m", "zkdv.cli", "verify", str(self.folder)],
                         capture_output=True, text=True, timeout=300, check=False)
    self.assertEqual(cli.returncode, 0, cli.stdout + cli.stderr)
    self.assertIn("resumed at step 7 from the committed post-state of step 5; step 6 ran "
                  "after it and was discarded", cli.stdout)
    report, reference = verify.verify(self.folder), verify.verify(self.reference)
    self.assertEqual((report.verdict, report.standing), (reference.verdict, reference.standing))
    self.assertEqual(report.claim("start").status, verify.HOLDS)  # the start carried over
    self.assertEqual(len(testing.records_of(self.folder, "init")), 1)
    # The state it ends with is the one training on from the checkpoint without a crash
    # reaches (another proof: a proof's start key, so its init, is its own).
    unbroken = testing.new_proof("unbroken", segment_length=resume_trainer.SEGMENT)
    state = serialization.from_bytes(testing.classifier_state(unbroken),
                                     self.checkpoint5.read_bytes())
    step = unbroken.jit(testing.classifier_step, donate_argnums=(0,))
    for iteration in range(6, resume_trainer.ITERATIONS):
      state = step(state, jnp.asarray(resume_trainer.batch_for(iteration)))
    unbroken.finish()
    final, = testing.records_of(self.folder, "final")
    unbroken_final, = testing.records_of(unbroken.path, "final")
    self.assertEqual(final["final_state_leaves"], unbroken_final["final_state_leaves"])
    self.assertEqual(final["final_state"], unbroken_final["final_state"])
    kinds = [(r["type"], r.get("index", r.get("step"))) for r in testing.records_of(self.folder)
             if r["type"] in ("step", "resume")]
    self.assertEqual(kinds, [("step", i) for i in range(7)] + [("resume", 7)]
                     + [("step", i) for i in range(7, 13)])
    resume, = testing.records_of(self.folder, "resume")
    step5 = testing.records_of(self.folder, "step")[5]
    self.assertEqual((resume["after"], resume["state"]), (5, step5["post_state"]))
    self.assertFalse((self.folder / "challenger-seed").exists())  # final revealed it

  def test_a_resume_past_a_committed_state_is_invalid(self):
    # Discarding a committed segment would drop the checks chosen for it: here the answers
    # of steps 3..5 are removed and the resume claims to go back to step 2.
    def back_to_step_2(records):
      step2 = [r for r in records if r["type"] == "step"][2]
      return [{**r, "after": 2, "state": step2["post_state"]} if r["type"] == "resume" else r
              for r in records if not (r["type"] == "check" and 3 <= r["step"] <= 5)]
    report = verify.verify(_rewrite(self.folder, back_to_step_2), replay="none")
    self.assertIn(("resume", "the resume goes back to step 2, past the committed post-state "
                   "of step 5: only steps after the last committed state may be discarded."),
                  [(f.code, f.message) for f in report.findings])
    self.assertEqual(report.verdict, verify.INVALID)

  def test_a_discarded_step_whose_probes_went_unanswered_is_named(self):
    # The prover saw step 6's probed rows, never answered them and resumed, replacing it.
    def unanswered(records):
      return [r for r in records if not (r["type"] == "check" and r["step"] == 6)]
    self.assertTrue(any(r["type"] == "check" and r["step"] == 6 and r["kind"] == "probe"
                        for r in testing.records_of(self.folder)))
    report = verify.verify(_rewrite(self.folder, unanswered), replay="none")
    self.assertIn("a resume discarded step 6 after self drew its data probes, unanswered: the "
                  "prover saw which rows would be opened and replaced the step (a retried "
                  "probe).", report.notes)
    self.assertNotIn("missing_probe", [f.code for f in report.findings])
    answered = verify.verify(self.folder, replay="none")
    self.assertFalse([n for n in answered.notes if "retried probe" in n])

  def test_a_resume_from_another_state_is_invalid(self):
    def other_state(records):
      return [{**r, "state": bytes(32)} if r["type"] == "resume" else r for r in records]
    report = verify.verify(_rewrite(self.folder, other_state), replay="none")
    self.assertIn(("resume", "the resumed state is not the committed post-state of step 5."),
                  [(f.code, f.message) for f in report.findings])

  def test_post_state_leaves_must_make_up_the_post_state(self):
    def other_leaves(records):
      first = [r for r in records if "post_state_leaves" in r][0]
      return [{**r, "post_state_leaves": [[bytes(32)]] * len(r["post_state_leaves"])}
              if r is first else r for r in records]
    report = verify.verify(_rewrite(self.folder, other_leaves), replay="none")
    self.assertIn("step 2: post_state_leaves do not make up its post_state.",
                  [f.message for f in report.findings])

  def test_a_torn_last_record_is_cut_off(self):
    folder = pathlib.Path(tempfile.mkdtemp()) / "torn"
    shutil.copytree(self.crashed, folder)
    whole = (folder / transcript.RECORDS_FILE).read_bytes()
    with open(folder / transcript.RECORDS_FILE, "ab") as f:
      f.write(transcript.encode_record({"type": "step", "index": 7})[:-3])
    writer, contents = transcript.TranscriptWriter.reopen(folder)
    writer.close()
    self.assertIsNone(contents.torn_tail)
    self.assertEqual((folder / transcript.RECORDS_FILE).read_bytes(), whole)

  def test_a_finished_or_foreign_transcript_is_not_resumed(self):
    with self.assertRaisesRegex(errors.ProofStateError, "a finished proof is not resumed"):
      zkdv.jax.ZKDV(NAME, resume=self.reference).start()
    with self.assertRaisesRegex(errors.ProofStateError, "holds proof 'resumed-run'"):
      zkdv.jax.ZKDV("another-run", resume=self.crashed).start()

  def test_dvbench_takes_a_resumed_transcript_and_refuses_a_resume_past_a_commitment(self):
    server = LocalServer(workers=1).start()
    self.addCleanup(server.stop)
    def back_to_step_2(records):  # another proof (root), as the attack above
      step2 = [r for r in records if r["type"] == "step"][2]
      return [{**records[0], "name": "dropped"}] + [
          {**r, "after": 2, "state": step2["post_state"]} if r["type"] == "resume" else r
          for r in records[1:] if not (r["type"] == "check" and 3 <= r["step"] <= 5)]
    with mock.patch.dict(os.environ, {"DVBENCH_TOKEN": server.token("your-name")}):
      client = dvbench.Client(server.url)
      proof_id = client.experiment("your-name/resumed").upload(self.folder)
      with self.assertRaisesRegex(dvbench.errors.ApiError,
                                  r"409.*resumes the run from step 2's state; it must go on "
                                  r"from the committed post-state of the last step that stored "
                                  r"one \(step 5\)"):
        client.experiment("your-name/dropped").upload(_rewrite(self.folder, back_to_step_2))
      self.assertEqual(client.wait_for_verdict(proof_id, 240)["state"], "self-audited")

class CatchUpAfterKillTest(absltest.TestCase):
  """A run killed mid-segment (step 7) restored from an earlier checkpoint than its last
  committed state (step 5's): it replays the committed steps after it, answers the checks
  the kill left unanswered, and refuses what it cannot replay, leaving the transcript
  resumable."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    root = pathlib.Path(tempfile.mkdtemp(prefix="zkdv-catch-up-"))
    cls.crashed, cls.checkpoint = root / "crashed", root / "ckpt"
    _kill_when_ready(_trainer(cls.crashed, cls.checkpoint, "--stop-at", "7",
                              stdin=subprocess.PIPE))
    cls.crashed_bytes = (cls.crashed / transcript.RECORDS_FILE).read_bytes()
    cls.checkpoint5 = cls.checkpoint.with_name(f"{cls.checkpoint.name}.5")
    # Resumed from its last committed state, as ResumeAfterKillTest checks it.
    cls.folder = root / "resumed"
    shutil.copytree(cls.crashed, cls.folder)
    shutil.copy(cls.checkpoint5, root / "resumed-ckpt")
    _finish(_trainer(cls.folder, root / "resumed-ckpt", "--resume"))

  def _crashed_copy(self, name: str, cut_after_step: int | None = None) -> pathlib.Path:
    """A copy of the crashed transcript, cut after step ``cut_after_step``'s record when
    given (killed before that step's checks were written)."""
    folder = pathlib.Path(tempfile.mkdtemp()) / name
    shutil.copytree(self.crashed, folder)
    if cut_after_step is not None:
      step = next(p for p in transcript.read_transcript(folder).records
                  if p.record["type"] == "step" and p.record["index"] == cut_after_step)
      with open(folder / transcript.RECORDS_FILE, "r+b") as f:
        f.truncate(step.offset + len(step.raw))
    return folder

  def _resumed_from(self, folder: pathlib.Path, iteration: int, *flags):
    """The trainer resumed in ``folder`` from a copy of its checkpoint of ``iteration``."""
    checkpoint = folder.with_name(f"{folder.name}-ckpt")
    shutil.copy(self.checkpoint.with_name(f"{self.checkpoint.name}.{iteration}"), checkpoint)
    return _finish(_trainer(folder, checkpoint, "--resume", *flags))

  def _assert_refused_from(self, folder: pathlib.Path, iteration: int, said: str) -> None:
    """Resumed from its checkpoint of ``iteration``, the run is refused with
    UnanswerableChallengeError saying ``said``, and the transcript is left as it was."""
    size = (folder / transcript.RECORDS_FILE).stat().st_size
    code, _, err = self._resumed_from(folder, iteration)
    self.assertNotEqual(code, 0)
    self.assertIn(f"zkdv.errors.UnanswerableChallengeError: {said}", err)
    self.assertEqual((folder / transcript.RECORDS_FILE).stat().st_size, size)

  def _assert_verified_as_resumed(self, folder: pathlib.Path) -> None:
    """``folder`` verifies and ends in the state the run resumed from step 5's ends in."""
    report = verify.verify(folder)
    self.assertEqual(report.verdict, verify.VERIFIED, report.findings)
    final, = testing.records_of(folder, "final")
    resumed_final, = testing.records_of(self.folder, "final")
    self.assertEqual(final["final_state"], resumed_final["final_state"])

  def test_a_run_killed_before_its_first_checkpoint_replays_from_its_attested_start(self):
    # Killed after step 2's record (the first segment end), before its checks and its
    # checkpoint. Before, the proof was lost: "no committed state before it can be replayed".
    folder = self._crashed_copy("from-start", cut_after_step=2)
    self._assert_refused_from(folder, 2, "step 2 was challenged for an update check before "
                              "the crash and the transcript has no answer. Restore the "
                              "attested start (proof.init's state, no checkpoint restored), "
                              "not the one step 2 committed")
    code, _, err = _finish(_trainer(folder, folder.with_name("none"), "--resume", "--from-start"))
    self.assertEqual(code, 0, err[-2000:])
    self.assertIn("the restored state is the attested start: steps 0..2 are replayed and "
                  "compared with their records before the run goes on at step 3.", err)
    kinds = [(r["type"], r.get("index", r.get("step")), r.get("kind"))
             for r in testing.records_of(folder) if r["type"] in ("step", "resume", "check")]
    resumed_at = kinds.index(("resume", 3, None))
    self.assertEqual([k for k in kinds if k[0] == "step"],
                     [("step", i, None) for i in range(resume_trainer.ITERATIONS)])  # once each
    self.assertEqual([k for k in kinds if k[2] == "start"], [("check", 0, "start")])
    for kind in ("update", "state", "probe"):
      self.assertIn(("check", 2, kind), kinds[:resumed_at])
    self._assert_verified_as_resumed(folder)

  def test_a_run_restored_from_an_earlier_segment_end_replays_to_the_committed_state(self):
    # Killed while saving the checkpoint of step 5, which the transcript committed: the
    # newest checkpoint is step 2's. Before, the resume was refused (ResumeStateError).
    folder = self._crashed_copy("caught-up")
    code, _, err = self._resumed_from(folder, 2)
    self.assertEqual(code, 0, err[-2000:])
    self.assertIn("the restored state is the one step 2 committed: steps 3..5 are replayed "
                  "and compared with their records before the run goes on at step 7.", err)
    kinds = [(r["type"], r.get("index", r.get("step"))) for r in testing.records_of(folder)
             if r["type"] in ("step", "resume")]
    self.assertEqual(kinds, [("step", i) for i in range(7)] + [("resume", 7)]
                     + [("step", i) for i in range(7, 13)])  # nothing written twice
    resume, = testing.records_of(folder, "resume")
    self.assertEqual(resume["after"], 5)
    self._assert_verified_as_resumed(folder)

  def test_a_check_the_kill_left_unanswered_is_answered_by_replaying_its_segment(self):
    folder = self._crashed_copy("replayed", cut_after_step=5)  # step 5's checks never written
    self._assert_refused_from(folder, 5, "step 5 was challenged for an update check before "
                              "the crash and the transcript has no answer. Restore the state "
                              "saved at the end of step 2 or of an earlier segment end, not "
                              "the one step 5 committed")
    code, _, err = self._resumed_from(folder, 2)
    self.assertEqual(code, 0, err[-2000:])
    kinds = [(r["type"], r.get("step"), r.get("kind")) for r in testing.records_of(folder)]
    resumed_at = kinds.index(("resume", 6, None))
    for kind in ("update", "state", "probe"):
      self.assertIn(("check", 5, kind), kinds[:resumed_at])
    self.assertEqual(verify.verify(folder).verdict, verify.VERIFIED)

  def test_a_replay_with_other_batches_is_refused_naming_the_step(self):
    folder = self._crashed_copy("other-batches")
    code, _, err = self._resumed_from(folder, 2, "--other-batches")
    self.assertNotEqual(code, 0)
    self.assertIn("zkdv.errors.ResumeStateError: the replayed step 3 differs from the step the "
                  "transcript committed in its batch", err)
    self.assertEqual((folder / transcript.RECORDS_FILE).read_bytes(), self.crashed_bytes)

  def test_a_resumed_run_that_stops_short_of_its_resume_writes_nothing(self):
    # Before, finish() wrote a final record: the transcript was finished and invalid (its
    # step 6 had no end state), where resuming again could still have saved it.
    folder = self._crashed_copy("no-step")
    proof = zkdv.jax.ZKDV(NAME, resume=folder)
    proof.start()
    with self.assertRaisesRegex(errors.ResumeStateError,
                                r"^the resumed run finished without a step: step 6 ran after "
                                r"the last committed state \(step 5\), and only a resumed "
                                r"run's first step discards it. Nothing was written"):
      proof.finish()
    proof = zkdv.jax.ZKDV(NAME, resume=folder)
    proof.start()
    step = proof.jit(testing.classifier_step, donate_argnums=(0,))
    step(self._state_of(proof, 2), jnp.asarray(resume_trainer.batch_for(3)))
    with self.assertRaisesRegex(errors.ResumeStateError,
                                r"^the run finished at step 4 while replaying the committed "
                                r"steps 3..5 from the restored state"):
      proof.finish()
    self.assertEqual((folder / transcript.RECORDS_FILE).read_bytes(), self.crashed_bytes)

  def _state_of(self, proof, iteration: int):
    """The tutorial state, restored from the trainer's checkpoint of ``iteration``."""
    return serialization.from_bytes(testing.classifier_state(proof), self.checkpoint.with_name(
        f"{self.checkpoint.name}.{iteration}").read_bytes())

  def test_a_resume_refused_or_a_failed_replay_under_with_stays_resumable(self):
    # Before, leaving `with proof:` by the refusal wrote a final record (aborted): the
    # checkpoint the refusal named could no longer be restored, the proof was lost.
    folder = self._crashed_copy("with", cut_after_step=5)  # step 5's checks never written
    before = (folder / transcript.RECORDS_FILE).read_bytes()
    proof = zkdv.jax.ZKDV(NAME, resume=folder)
    proof.start()
    state = self._state_of(proof, 5)
    with self.assertRaisesRegex(errors.UnanswerableChallengeError, "Restore the state saved at "
                                "the end of step 2"):
      with proof:
        proof.jit(testing.classifier_step, donate_argnums=(0,))(
            state, jnp.asarray(resume_trainer.batch_for(6)))
    self.assertEqual((folder / transcript.RECORDS_FILE).read_bytes(), before)
    proof = zkdv.jax.ZKDV(NAME, resume=folder)  # its last replayed step trains another batch
    proof.start()
    state = self._state_of(proof, 2)
    with self.assertRaisesRegex(errors.ResumeStateError, "the replayed step 5 differs from "
                                "the step the transcript committed in its batch"):
      with proof:
        step = proof.jit(testing.classifier_step, donate_argnums=(0,))
        for iteration in range(3, 8):
          batch = resume_trainer.batch_for(iteration)
          state = step(state, jnp.asarray(np.roll(batch, 1, axis=1) if iteration == 5 else batch))
    self.assertEqual((folder / transcript.RECORDS_FILE).read_bytes(), before)
    code, _, err = self._resumed_from(folder, 2)
    self.assertEqual(code, 0, err[-2000:])
    self.assertEqual(verify.verify(folder).verdict, verify.VERIFIED)

  def test_a_second_resume_may_restore_the_state_the_first_went_on_from(self):
    # Resumed from step 5 at step 7 (step 6 discarded), killed after committing step 9 and
    # before its checkpoint: restored from step 5 again, the replay goes on at step 7 (before,
    # it replayed from step 6 and was refused: "starts a segment where the committed run did
    # not").
    folder = self._crashed_copy("twice")
    checkpoint = folder.with_name("twice-ckpt")
    shutil.copy(self.checkpoint5, checkpoint)
    code, _ = _kill_when_ready(_trainer(folder, checkpoint, "--resume", "--stop-at", "9",
                                        stdin=subprocess.PIPE))
    self.assertEqual(code, -signal.SIGKILL)
    shutil.copy(self.checkpoint5, checkpoint)
    code, _, err = _finish(_trainer(folder, checkpoint, "--resume"))
    self.assertEqual(code, 0, err[-2000:])
    self.assertIn("steps 7..9 are replayed", err)
    self.assertEqual([(r["after"], r["step"]) for r in testing.records_of(folder, "resume")],
                     [(5, 7), (9, 10)])
    self.assertEqual(verify.verify(folder).verdict, verify.VERIFIED)

  def test_a_start_check_without_its_pieces_is_no_restore_point(self):
    # A transcript's own records are read: a start check whose pieces are missing or not a
    # list gives no attested start to restore (before, a KeyError at start()).
    steps = [{"type": "step", "index": 0, "pre_state": b"s"}]
    for check in ({"type": "check", "kind": "start", "step": 0},
                  {"type": "check", "kind": "start", "step": 0, "pre_state_pieces": 7}):
      self.assertEqual(zkdv.jax.resume._attested_start([check], steps), [])
    check = {"type": "check", "kind": "start", "step": 0, "pre_state_pieces": [[b"p"]]}
    self.assertEqual(zkdv.jax.resume._attested_start([check], steps),
                     [{"index": zkdv.jax.catch_up.START, "post_state": b"s",
                       "post_state_leaves": [[b"p"]]}])

  def test_an_earlier_end_of_the_same_state_is_restored_when_a_check_needs_it(self):
    same = {"post_state_leaves": [[b"state"]]}
    replayable = zkdv.jax.catch_up.Replayable({2: same, 5: same}, {}, frozenset(), (), {})
    self.assertEqual(replayable.end_of([[b"state"]]), 5)
    unanswered = dataclasses.replace(replayable, unanswered=((5, "update"),))
    self.assertEqual(unanswered.end_of([[b"state"]]), 2)
    self.assertIsNone(unanswered.end_of([[b"other"]]))

  def test_a_run_killed_after_its_last_checkpoint_finishes_when_resumed(self):
    # Nothing is left to train: finish() writes the final record (a regression of the
    # replay's first version raised "resume it again" here, every time).
    folder = pathlib.Path(tempfile.mkdtemp()) / "last"
    checkpoint = folder.with_name("last-ckpt")
    code, _ = _kill_when_ready(_trainer(folder, checkpoint, "--stop-at", "11",
                                        stdin=subprocess.PIPE))
    self.assertEqual(code, -signal.SIGKILL)
    code, _, err = _finish(_trainer(folder, checkpoint, "--resume"))
    self.assertEqual(code, 0, err[-2000:])
    self.assertEqual(len(testing.records_of(folder, "final")), 1)
    self.assertEqual(verify.verify(folder).verdict, verify.VERIFIED)

  def test_a_run_killed_right_after_its_replay_may_restore_the_same_checkpoint(self):
    # Killed after replaying steps 3..5 (saving step 5's checkpoint, say): no resume record
    # was written yet, so step 2's checkpoint is restored again.
    folder = self._crashed_copy("replayed-then-killed")
    checkpoint = folder.with_name("replayed-then-killed-ckpt")
    shutil.copy(self.checkpoint.with_name(f"{self.checkpoint.name}.2"), checkpoint)
    code, _ = _kill_when_ready(_trainer(folder, checkpoint, "--resume", "--stop-at", "5",
                                        stdin=subprocess.PIPE))
    self.assertEqual(code, -signal.SIGKILL)
    self.assertEqual(testing.records_of(folder, "resume"), [])
    shutil.copy(self.checkpoint.with_name(f"{self.checkpoint.name}.2"), checkpoint)
    code, _, err = _finish(_trainer(folder, checkpoint, "--resume"))
    self.assertEqual(code, 0, err[-2000:])
    self.assertEqual(verify.verify(folder).verdict, verify.VERIFIED)


def _computing_init_adam():
  """Adam beside a state its init computes from the params (floats whose bits differ when
  run eagerly and compiled)."""
  adam = optax.adam(1e-2)

  def init(params):
    return adam.init(params), jax.tree.map(
        lambda x: jnp.tanh(x) * 0.3 + jnp.exp(x * 0.1) * jnp.sin(x) + x * x * 1.7, params)

  def update(grads, state, params=None):
    updates, inner = adam.update(grads, state[0], params)
    return updates, (inner, state[1])

  return optax.GradientTransformation(init, update)


class StartStateRebuiltTest(absltest.TestCase):
  """A resume from the attested start builds the start state with the init program that
  recorded it (``TrainState.create`` through ``proof.extend_init``), not eagerly: with an
  optimizer whose init computes floats, the eager state had other bits and the resume was
  refused (``ResumeStateError`` naming every leaf)."""

  def _train(self, folder: pathlib.Path, resume: bool = False, copy_to=None):
    config = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(
        update_check_probability=1.0, state_check_probability=1.0),
                             output_dir=folder, segment_length=resume_trainer.SEGMENT)
    proof = zkdv.jax.ZKDV(NAME, config, resume=folder if resume else None)
    proof.start(rolling_window=4, probe_ratio=0.5)
    model = testing.TinyClassifier()
    params = proof.init(model.init, jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
    state = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply,
                                               params=params, tx=_computing_init_adam())
    step = proof.jit(testing.classifier_step, donate_argnums=(0,))
    for iteration in range(resume_trainer.ITERATIONS):
      state = step(state, jnp.asarray(resume_trainer.batch_for(iteration)))
      if iteration == 4 and copy_to is not None:  # killed here, before its checkpoint
        proof.wait_for_commitments()
        shutil.copytree(folder, copy_to)
    proof.finish()

  def test_a_resume_from_the_start_rebuilds_the_start_state_bit_for_bit(self):
    root = pathlib.Path(tempfile.mkdtemp(prefix="zkdv-start-state-"))
    self._train(root / "run", copy_to=root / "killed")
    step = next(p for p in transcript.read_transcript(root / "killed").records
                if p.record["type"] == "step" and p.record["index"] == 2)
    with open(root / "killed" / transcript.RECORDS_FILE, "r+b") as f:
      f.truncate(step.offset + len(step.raw))  # step 2's checks never written
    self._train(root / "killed", resume=True)
    report = verify.verify(root / "killed")
    self.assertEqual(report.verdict, verify.VERIFIED, report.findings)
    final, = testing.records_of(root / "killed", "final")
    uncrashed, = testing.records_of(root / "run", "final")
    self.assertEqual(final["final_state"], uncrashed["final_state"])


class KeyedCatchUpTest(absltest.TestCase):
  """A run passing ``proof.step_key()`` to its steps, killed after step 7 and restored from
  its checkpoint of step 2: its first step's key was drawn for step 7 before the run knew
  that it replays step 3, and it trains with step 3's, also when the first call is
  interrupted after the replay was planned and made again with the same key; the proof
  verifies."""

  def test_a_keyed_run_replays_with_its_steps_own_keys(self):
    root = pathlib.Path(tempfile.mkdtemp(prefix="zkdv-keyed-"))
    folder, checkpoint = root / "run", root / "ckpt"
    code, _ = _kill_when_ready(_trainer(folder, checkpoint, "--stop-at", "7", "--key",
                                        stdin=subprocess.PIPE))
    self.assertEqual(code, -signal.SIGKILL)
    shutil.copy(checkpoint.with_name("ckpt.2"), checkpoint)
    code, out, err = _finish(_trainer(folder, checkpoint, "--resume", "--key",
                                      "--interrupt-first"))
    self.assertEqual(code, 0, err[-2000:])
    # Before, the call made again kept the key it drew first: a replay mismatch.
    self.assertIn("interrupted at iteration 3", out)
    self.assertIn("steps 3..5 are replayed", err)
    report = verify.verify(folder)
    self.assertEqual(report.verdict, verify.VERIFIED, report.findings)


def _live_server(cls, prefix: str) -> pathlib.Path:
  """Starts ``cls.server`` (every segment update-checked, a proof silent for 2 s crashed),
  ``cls.env`` and ``cls.client`` of its owner your-name; a new folder for the runs."""
  cls.server = LocalServer(workers=1, extra_args=(
      "--min-update-check-probability", "1.0", "--crash-after", "2s")).start()
  cls.addClassCleanup(cls.server.stop)
  cls.env = {**os.environ, "DVBENCH_TOKEN": cls.server.token("your-name")}
  cls.client = dvbench.Client(cls.server.url, cls.env["DVBENCH_TOKEN"])
  return pathlib.Path(tempfile.mkdtemp(prefix=prefix))


class LiveResumeOwingProbesTest(absltest.TestCase):
  """A live run killed before its answer to step 6's probes left (step 6 in the open
  segment, discarded by the resume): the resumed run trains step 6's batch again, answers
  them from it, and the proof ends ``verified``: with batches fed by the loop, and with a
  PRNG key a step (its keys differ from step 6's) and batches drawn with ``proof.batches``.
  Before, the resume was refused and the whole proof lost (``UnanswerableChallengeError``)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    root = _live_server(cls, "dvbench-owed-")
    cls.proof_id, cls.resumed = cls.killed_and_resumed(root / "owed")
    cls.verdict = cls.client.wait_for_verdict(cls.proof_id, 240)
    cls.records = [p.record for p in transcript.read_transcript(root / "owed/resumed").records]
    flags = ("--key", "--data")  # a PRNG key a step, batches drawn with proof.batches
    proof_id, outcome = cls.killed_and_resumed(root / "keyed", *flags, both=flags)
    cls.keyed = outcome, cls.client.wait_for_verdict(proof_id, 240)
    # Resumed with other batches: step 6's batch never comes again.
    cls.unpaid_id, cls.unpaid = cls.killed_and_resumed(root / "unpaid", "--other-batches")
    cls.unpaid_verdict = cls.client.wait_for_verdict(cls.unpaid_id, 240)

  @classmethod
  def killed_and_resumed(cls, root: pathlib.Path, *resumed_flags, both=()):
    """(proof id, the resumed trainer's outcome) of a run killed after step 7 with step
    6's probes unanswered, resumed from its checkpoint of step 5 (``both``: flags of
    both runs)."""
    killed = _kill_when_ready(cls.trainer(root, "first", "--stop-at", "7", "--unanswered",
                                          "6", *both, stdin=subprocess.PIPE))
    proof_id = killed[1][-2].removeprefix("proof ")
    testing.wait_until(lambda: cls.client.proof_status(proof_id)["state"] == "crashed",
                       timeout=60, every=0.2)
    return proof_id, _finish(cls.trainer(root, "resumed", "--resume", "--proof-id", proof_id,
                                         *resumed_flags))

  @classmethod
  def trainer(cls, root, folder, *flags, stdin=None):
    return subprocess.Popen(
        [sys.executable, "-m", "tests.resume_trainer", str(root / folder), str(root / "ckpt"),
         "--server", cls.server.url, "--experiment", "your-name/owed", *flags],
        stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cls.env)

  def test_the_resumed_run_says_what_it_owes_and_finishes(self):
    code, out, err = self.resumed
    self.assertEqual(code, 0, err)
    self.assertIn("finished", out)
    self.assertIn("the probes DVBench drew for discarded step 6 have no answer: the resumed "
                  "run answers them when it trains its batch again", err)

  def test_step_6_is_answered_after_the_resume_from_a_step_of_its_batch(self):
    kinds = [(r["type"], r.get("step"), r.get("kind")) for r in self.records]
    resumed_at = [k[0] for k in kinds].index("resume")
    first_resumed = self.records[resumed_at]["step"]  # the index iteration 6 trains as
    self.assertEqual(self.records[resumed_at]["after"], 5)
    self.assertIn(("check", 6, "probe"), kinds[resumed_at:])
    self.assertNotIn(("check", 6, "probe"), kinds[:resumed_at])
    steps = {r["index"]: r["batch"] for r in self.records if r["type"] == "step"}
    self.assertEqual(steps[first_resumed], steps[6])  # the same batch, trained again

  def test_the_proof_ends_verified(self):
    self.assertEqual(self.verdict["state"], "verified", self.verdict)

  def test_a_keyed_run_drawing_a_seeded_order_answers_them_too(self):
    (code, _, err), verdict = self.keyed
    self.assertEqual(code, 0, err)
    self.assertEqual(verdict["state"], "verified", verdict)

  def test_probes_still_owed_at_finish_are_named_and_the_proof_is_invalid(self):
    code, _, err = self.unpaid
    self.assertNotEqual(code, 0)
    self.assertIn("UnanswerableChallengeError: the probes DVBench drew for discarded step 6 "
                  "were never answered: the resumed run did not train its batch again", err)
    self.assertEqual((self.unpaid_verdict["state"], self.unpaid_verdict["failure"]),
                     ("invalid", "step 6 was challenged for probes and never answered."))


class _LiveOrbaxRuns:
  """The live trainer with Orbax checkpoints (``cls.server``, ``cls.env`` of
  ``_live_server``, ``cls.EXPERIMENT``; ``cls.checkpoint`` and ``cls.proof_id`` unless
  given)."""

  checkpoint = proof_id = None

  @classmethod
  def trainer(cls, folder, *flags, stdin=None, checkpoint=None, proof_id=None):
    extra = ("--proof-id", proof_id or cls.proof_id) if "--resume" in flags else ()
    return subprocess.Popen(
        [sys.executable, "-m", "tests.resume_trainer", str(folder),
         str(checkpoint or cls.checkpoint),
         "--server", cls.server.url, "--experiment", cls.EXPERIMENT, "--orbax", *flags,
         *extra],
        stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cls.env)


class LiveResumeAfterKillTest(_LiveOrbaxRuns, absltest.TestCase):
  """A DVBench proof whose trainer is killed mid-segment becomes ``crashed``; resumed with
  ``experiment.proof(resume=ID)`` from its Orbax checkpoint it ends ``verified`` and ranks."""

  EXPERIMENT = "your-name/resumed-live"

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    root = _live_server(cls, "dvbench-resume-")
    cls.checkpoint = root / "ckpt"
    # Step 5 committed, step 6 stored in the open segment, step 7 held.
    cls.killed = _kill_when_ready(
        cls.trainer(root / "first", "--stop-at", "7", stdin=subprocess.PIPE))
    cls.proof_id = cls.killed[1][-2].removeprefix("proof ")
    cls.crashed_state = testing.wait_until(
        lambda: cls.client.proof_status(cls.proof_id)["state"] == "crashed" and
        cls.client.proof_status(cls.proof_id), timeout=60, every=0.2)
    cls.records_before = cls.client.proof_status(cls.proof_id)["records"]
    cls.forged = cls.resume_past_a_committed_state()
    cls.altered = _finish(cls.trainer(root / "altered", "--resume", "--alter"))
    cls.records_after_altered = cls.client.proof_status(cls.proof_id)["records"]
    cls.resumed = _finish(cls.trainer(root / "resumed", "--resume"))
    cls.verdict = cls.client.wait_for_verdict(cls.proof_id, 240)

  @classmethod
  def resume_past_a_committed_state(cls):
    """Reopens the crashed proof and sends a ``resume`` record that goes back to step 2's
    state, which would discard the segment of steps 3..5 and the checks the server chose
    for it: the server's answer."""
    path = f"/api/v1/proofs/{cls.proof_id}"
    cls.client.http.request("POST", f"{path}/resume")
    folder = pathlib.Path(tempfile.mkdtemp()) / "stored"
    folder.mkdir()
    (folder / transcript.RECORDS_FILE).write_bytes(
        cls.client.http.request("GET", f"{path}/transcript").content)
    stored = transcript.read_transcript(folder).records
    step2 = [p.record for p in stored if p.record["type"] == "step"][2]
    record = transcript.encode_record({"type": "resume", "step": 7, "after": 2,
                                       "state": step2["post_state"],
                                       "prev": stored[-1].record_id})
    return httpx.post(f"{cls.server.url}{path}/stream", content=transport.encode(
        {"kind": "records", "records": [record], "client_id": "f" * 32, "seq": 0}),
        headers={"content-type": "application/cbor",
                 "authorization": f"Bearer {cls.env['DVBENCH_TOKEN']}"})

  def test_the_killed_run_is_crashed_and_says_how_to_resume(self):
    code, lines = self.killed
    self.assertEqual(code, -signal.SIGKILL)
    self.assertEqual(lines[:2], ["checkpoint 2", "checkpoint 5"])
    self.assertEqual(self.crashed_state["steps"], 7)
    self.assertIn(f"resume it from the checkpoint of its last committed state with "
                  f"experiment.proof(resume='{self.proof_id}')", self.crashed_state["failure"])

  def test_attack_a_resume_past_a_committed_state_is_refused(self):
    self.assertEqual(self.forged.status_code, 409, self.forged.text)
    self.assertIn("resumes the run from step 2's state; it must go on from the committed "
                  "post-state of the last step that stored one (step 5)", self.forged.text)

  def test_only_the_owner_resumes_a_proof(self):
    mallory = dvbench.Client(self.server.url, self.server.token("mallory"))
    response = mallory.http.request("POST", f"/api/v1/proofs/{self.proof_id}/resume",
                                    ok=(403,))
    self.assertIn("token of 'mallory' cannot write to proof", response.text)

  def test_an_altered_restored_state_is_refused_and_nothing_is_sent(self):
    code, _, err = self.altered
    self.assertNotEqual(code, 0)
    self.assertIn("zkdv.errors.ResumeStateError: the restored state differs from the "
                  "post-state step 5 committed in leaf .params['Dense_0']['bias'].", err)
    self.assertEqual(self.records_after_altered, self.records_before)

  def test_the_resumed_proof_is_verified_with_every_claim_and_ranks(self):
    self.assertEqual(self.resumed[0], 0, self.resumed[2][-3000:])
    self.assertEqual(self.verdict["state"], "verified", self.verdict)
    folder = pathlib.Path(tempfile.mkdtemp()) / "downloaded"
    cli = subprocess.run(
        [sys.executable, "-m", "dvbench.cli", "download", self.proof_id, str(folder),
         "--url", self.server.url], capture_output=True, text=True, timeout=120, check=False)
    self.assertEqual(cli.returncode, 0, cli.stderr)
    kinds = [(r["type"], r.get("index", r.get("step"))) for r in testing.records_of(folder)
             if r["type"] in ("step", "resume", "root")]
    self.assertEqual(kinds, [("root", None)] + [("step", i) for i in range(7)]
                     + [("resume", 7)] + [("step", i) for i in range(7, 13)])
    server_key = bytes.fromhex(self.client.http.request("GET", "/api/v1/server-key")
                               .json()["server_key"])
    report = verify.verify(folder, strict=True, server_key=server_key)
    self.assertEqual(report.verdict, verify.VERIFIED, report.findings)
    self.assertIn("resumed at step 7 from the committed post-state of step 5; step 6 ran "
                  "after it and was discarded", "\n".join(report.notes))
    self.assertEqual({c.name: c.status for c in report.claims},
                     {c.name: verify.HOLDS for c in report.claims})
    self.assertIn("dvbench", report.claim("challenges").detail)
    # Step 6 ran and was discarded: the run's training is the 12 other steps, and no claim
    # counts step 6 among them (a run resumed again and again from one state did).
    replays = report.claim("replays")
    self.assertEqual((replays.facts["steps"], replays.facts["steps_discarded"]), (12, 1))
    self.assertIn("over 12 steps at p=1", replays.detail)
    self.assertIn("a resume discarded 1 more step, run after the last committed state: not "
                  "replayed", replays.detail)
    params = orbax.StandardCheckpointer().restore(
        self.checkpoint / str(resume_trainer.ITERATIONS - 1))["params"]
    owner = dvbench.Client(self.server.url, self.server.token("alice"))
    owner.benchmark("alice/resumed").register(
        metric="accuracy", evaluate=benchmark_test.correct, params=params,
        rows=benchmark_test.EVAL_ROWS, min_update_check_probability=1.0)
    bench = self.client.benchmark("alice/resumed")
    entry = bench.wait(bench.submit(self.proof_id, params)["id"])
    self.assertEqual(entry["state"], "scored", entry)
    board, = bench.leaderboard()
    self.assertEqual((board["rank"], board["proof_id"]), (1, self.proof_id), board)
    self.assertEqual((board["steps"], board["steps_discarded"]), (12, 1), board)
    marks = httpx.get(f"{self.server.url}/api/v1/proofs/{self.proof_id}/metrics").json()["marks"]
    self.assertEqual(marks["6"], "discarded")  # off the charts' curve
    self.assertEqual([s for s, m in marks.items() if m == "discarded"], ["6"])

  def test_attack_a_discarded_step_whose_probes_went_unanswered_is_missing(self):
    # The prover saw the rows the server drew for step 6, left them unanswered and resumed.
    folder = pathlib.Path(tempfile.mkdtemp()) / "downloaded"
    cli = subprocess.run(
        [sys.executable, "-m", "dvbench.cli", "download", self.proof_id, str(folder),
         "--url", self.server.url], capture_output=True, text=True, timeout=120, check=False)
    self.assertEqual(cli.returncode, 0, cli.stderr)
    def unanswered(records):
      return [r for r in records if not (r["type"] == "check" and r["step"] == 6)]
    stored = unanswered(testing.records_of(folder))
    challenges = {row["step"]: bytes.fromhex(row["challenge"]) for row in
                  self.client.http.listing(f"/api/v1/proofs/{self.proof_id}/challenges")}
    at_resume = stored[:[r["type"] for r in stored].index("resume")]
    step_6 = next(r for r in at_resume if r["type"] == "step" and r["index"] == 6)
    point = zkdv.jax.resume.read_point(at_resume, challenges.__getitem__)
    self.assertEqual([(o.decision.step, o.batch) for o in point.owed_probes],
                     [(6, step_6["batch"])])  # owed: a step of that batch answers them
    server_key = bytes.fromhex(self.client.http.request("GET", "/api/v1/server-key")
                               .json()["server_key"])
    key = receipt.open_receipt((folder / receipt.RECEIPT_FILE).read_bytes(),
                               server_key)["challenge_key"]
    report = verify.verify(_rewrite(folder, unanswered), challenge_key=key, replay="none")
    self.assertIn(("missing_probe", "step 6 was challenged for data probes but has no check "
                   "record answering it after a resume discarded the step: the prover saw "
                   "which rows would be opened and replaced the step (a retried probe)."),
                  [(f.code, f.message) for f in report.findings])
    self.assertEqual(report.verdict, verify.INVALID)

  def test_a_finished_proof_or_another_experiments_is_not_resumed(self):
    with self.assertRaisesRegex(dvbench.errors.ApiError, "409.*belongs to experiment"):
      self.client.experiment("your-name/other").proof(
          resume=self.proof_id, config=zkdv.ZKDVConfig(
              output_dir=tempfile.mkdtemp() + "/t")).start()
    self.client.wait_for_verdict(self.proof_id, 240)
    with self.assertRaisesRegex(dvbench.errors.ApiError, "409.*is verified: only a proof"):
      self.client.experiment(self.EXPERIMENT).proof(
          resume=self.proof_id, config=zkdv.ZKDVConfig(
              output_dir=tempfile.mkdtemp() + "/t")).start()


class LiveCatchUpTest(_LiveOrbaxRuns, absltest.TestCase):
  """Live runs killed where a resume from the newest checkpoint used to lose the proof:
  while saving a committed segment's checkpoint with a committed step's probes unanswered,
  and before any blob reached the server."""

  EXPERIMENT = "your-name/caught-up"

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    root = _live_server(cls, "dvbench-catch-up-")
    cls.caught_up = cls.killed_saving_a_checkpoint(root)
    cls.unsent = cls.killed_before_its_blobs_left(root)

  @classmethod
  def killed_before_its_blobs_left(cls, root: pathlib.Path) -> dict:
    """A run whose blobs never reached the server, killed after step 7: resumed into
    another folder (refused), then into its own output_dir, which holds them (from its
    attested start, without a checkpoint)."""
    checkpoint, folder, out = root / "ckpt-unsent", root / "unsent", {}
    killed = _kill_when_ready(cls.trainer(folder, "--stop-at", "7", "--unsent-blobs",
                                          stdin=subprocess.PIPE, checkpoint=checkpoint))
    proof_id = killed[1][-2].removeprefix("proof ")
    testing.wait_until(lambda: cls.client.proof_status(proof_id)["state"] == "crashed",
                       timeout=60, every=0.2)
    out["elsewhere"] = _finish(cls.trainer(root / "unsent-elsewhere", "--resume",
                                           checkpoint=checkpoint, proof_id=proof_id))
    blob = sorted((folder / transcript.BLOBS_DIR).iterdir())[0]
    intact = blob.read_bytes()
    blob.write_bytes(bytes([intact[0] ^ 1]) + intact[1:])  # a damaged copy is not sent
    out["damaged"] = _finish(cls.trainer(folder, "--resume", checkpoint=checkpoint,
                                         proof_id=proof_id))
    blob.write_bytes(intact)
    # From the attested start, as a run whose checkpoints were all lost: steps 0..5 replayed.
    out["resumed"] = _finish(cls.trainer(folder, "--resume", "--from-start",
                                         checkpoint=root / "ckpt-unsent-again",
                                         proof_id=proof_id))
    out["verdict"] = cls.client.wait_for_verdict(proof_id, 240)
    return out

  @classmethod
  def killed_saving_a_checkpoint(cls, root: pathlib.Path) -> dict:
    """A run killed after step 7 with the probes of step 5 (a committed step) unanswered
    and its checkpoint of step 5 lost (as when killed while saving it), resumed: first from
    a checkpoint of step 5 (refused), then from the one of step 2 (replays steps 3..5)."""
    checkpoint, out = root / "ckpt-lost", {}
    killed = _kill_when_ready(cls.trainer(root / "lost", "--stop-at", "7", "--unanswered",
                                          "5", stdin=subprocess.PIPE, checkpoint=checkpoint))
    out["proof_id"] = proof_id = killed[1][-2].removeprefix("proof ")
    testing.wait_until(lambda: cls.client.proof_status(proof_id)["state"] == "crashed",
                       timeout=60, every=0.2)
    out["records_before"] = cls.client.proof_status(proof_id)["records"]
    out["refused"] = _finish(cls.trainer(root / "lost-refused", "--resume",
                                         checkpoint=checkpoint, proof_id=proof_id))
    out["records_after_refused"] = cls.client.proof_status(proof_id)["records"]
    shutil.rmtree(checkpoint / "5")  # its save never finished: the newest is step 2's
    out["cut_short"] = _finish(cls.trainer(root / "lost-cut-short", "--resume",
                                           "--finish-after", "3", checkpoint=checkpoint,
                                           proof_id=proof_id))
    out["after_cut_short"] = cls.client.proof_status(proof_id)
    out["folder"] = root / "lost-resumed"
    out["resumed"] = _finish(cls.trainer(out["folder"], "--resume", checkpoint=checkpoint,
                                         proof_id=proof_id))
    out["verdict"] = cls.client.wait_for_verdict(proof_id, 240)
    return out

  def test_a_run_killed_saving_a_checkpoint_replays_from_the_one_before(self):
    # Before, the probes of step 5 could never be answered (UnanswerableChallengeError)
    # and the proof was lost.
    out = self.caught_up
    code, _, err = out["refused"]
    self.assertNotEqual(code, 0)
    self.assertIn("zkdv.errors.UnanswerableChallengeError: step 5 was challenged for probes "
                  "before the crash and the transcript has no answer. Restore the state "
                  "saved at the end of step 2 or of an earlier segment end, not the one step 5 "
                  "committed", err)
    self.assertEqual(out["records_after_refused"], out["records_before"])
    # finish() during the replay names that, and leaves the proof open to be resumed.
    code, _, err = out["cut_short"]
    self.assertNotEqual(code, 0)
    self.assertIn("zkdv.errors.ResumeStateError: the run finished at step 4 while replaying "
                  "the committed steps 3..5", err)
    self.assertNotIn("UploadError", err)
    self.assertIn(out["after_cut_short"]["state"], ("receiving", "crashed"))  # not closed
    code, _, err = out["resumed"]
    self.assertEqual(code, 0, err[-3000:])
    self.assertEqual(out["verdict"]["state"], "verified", out["verdict"])
    kinds = [(r["type"], r.get("index", r.get("step")), r.get("kind"))
             for r in testing.records_of(out["folder"])]
    resumed_at = kinds.index(("resume", 7, None))
    self.assertIn(("check", 5, "probe"), kinds[out["records_before"]:resumed_at])
    self.assertEqual([k[1] for k in kinds if k[0] == "step"], list(range(13)))

  def test_blobs_that_never_left_are_sent_from_the_runs_own_folder(self):
    # Before, any blob the server lacked made the proof impossible to resume or close.
    code, _, err = self.unsent["elsewhere"]
    self.assertNotEqual(code, 0)
    self.assertRegex(err, r"zkdv.errors.ProofStateError: the server never received blob "
                     r"[0-9a-f]{64} \(and \d+ more\) that proof [0-9a-f]{64}'s stored records "
                     r"name, and .*unsent-elsewhere/blobs holds no intact copy")
    code, _, err = self.unsent["damaged"]
    self.assertNotEqual(code, 0)
    self.assertIn("holds no intact copy", err)
    code, _, err = self.unsent["resumed"]
    self.assertEqual(code, 0, err[-3000:])
    self.assertRegex(err, r"blobs its stored records name never reached the server; sent from")
    self.assertIn("the restored state is the attested start: steps 0..5 are replayed", err)
    self.assertEqual(self.unsent["verdict"]["state"], "verified", self.unsent["verdict"])


class ResumedDataOrderTest(absltest.TestCase):
  """A run drawing ``proof.batches``, killed mid-segment and resumed: the resumed run goes
  on with the batch after its restored state's, and verifies with its data order; restored
  from an earlier checkpoint, it replays from that checkpoint's batch."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    root = pathlib.Path(tempfile.mkdtemp(prefix="zkdv-resume-data-"))
    cls.folder, checkpoint = root / "run", root / "ckpt"
    _kill_when_ready(_trainer(cls.folder, checkpoint, "--data", "--stop-at", "7",
                              stdin=subprocess.PIPE))
    # Killed after step 5's record, before its checks, while saving its checkpoint.
    cls.caught_up = root / "caught-up"
    shutil.copytree(cls.folder, cls.caught_up)
    step = next(p for p in transcript.read_transcript(cls.caught_up).records
                if p.record["type"] == "step" and p.record["index"] == 5)
    with open(cls.caught_up / transcript.RECORDS_FILE, "r+b") as f:
      f.truncate(step.offset + len(step.raw))
    shutil.copy(checkpoint.with_name("ckpt.2"), root / "ckpt-2")
    cls.resumed = _finish(_trainer(cls.folder, checkpoint, "--data", "--resume"))
    cls.replayed = _finish(_trainer(cls.caught_up, root / "ckpt-2", "--data", "--resume",
                                    "--prefetch", "2", "--interrupt-first"))

  def test_a_resumed_run_goes_on_with_the_seeded_order(self):
    code, _, err = self.resumed
    self.assertEqual(code, 0, err[-2000:])
    report = verify.verify(self.folder)
    self.assertEqual(report.verdict, "verified", [f.message for f in report.findings])
    self.assertStartsWith(report.claim("data").detail, "data order: self-seeded")
    rows = [r["data_rows"] for r in testing.records_of(self.folder, "step")]
    self.assertEqual(rows[7], rows[6])  # step 6 was discarded: step 7 draws its batch again
    self.assertLen(set(rows[:7]), 7)

  def test_a_run_restored_from_an_earlier_checkpoint_replays_its_batches(self):
    # Before, a run drawing with proof.batches replayed nothing: step 5's unanswered checks
    # made the proof one that could never be verified (UnanswerableChallengeError). Its loop
    # draws two batches ahead, on the device: they are drawn again from the replay's batch.
    # Its first step is interrupted in its window wait after the replay was planned, and
    # called again with the same batch: before, the redrawn batch was not given back and
    # the retry took the next one, a replay mismatch.
    code, out, err = self.replayed
    self.assertEqual(code, 0, err[-2000:])
    self.assertIn("interrupted at iteration 3", out)
    self.assertIn("the restored state is the one step 2 committed: steps 3..5 are replayed",
                  err)
    records = testing.records_of(self.caught_up)
    kinds = [(r["type"], r.get("step"), r.get("kind")) for r in records]
    resumed_at = kinds.index(("resume", 6, None))
    for kind in ("update", "state", "probe"):
      self.assertIn(("check", 5, kind), kinds[:resumed_at])
    report = verify.verify(self.caught_up)
    self.assertEqual(report.verdict, "verified", [f.message for f in report.findings])
    # The same batches, and the same end, as the run resumed from step 5's checkpoint.
    resumed_steps = testing.records_of(self.folder, "step")
    self.assertEqual([(r["index"], r["data_rows"]) for r in records if r["type"] == "step"],
                     [(r["index"] - (r["index"] > 6), r["data_rows"]) for r in resumed_steps
                      if r["index"] != 6])
    final, = testing.records_of(self.caught_up, "final")
    resumed_final, = testing.records_of(self.folder, "final")
    self.assertEqual(final["final_state"], resumed_final["final_state"])

  def test_a_grain_loader_cannot_go_back_and_says_what_can(self):
    proof = testing.new_proof("grain-order")
    proof.start()
    order = zkdv.jax.sampler.DataOrder(
        proof, zkdv.data.DatasetTree([np.arange(8, dtype=np.int32)]),
        zkdv.data.DatasetTree([np.arange(8, dtype=np.int32)]).declaration(2))
    self.assertEqual(order.go_back(1, "the one step 1 committed").number, 1)
    self.assertEqual(order.drawn, 2)
    order.reads_ahead = True  # as proof.grain_batches sets it
    with self.assertRaisesRegex(errors.ResumeStateError,
                                "the restored state is the attested start, before the last "
                                "committed state, and proof.grain_batches reads its batches "
                                "on from the last committed state: draw them with "
                                "proof.batches"):
      order.go_back(0, "the attested start")


class DiscardedStepsLabelTest(absltest.TestCase):
  """What a full replay's label says of a run resumed from one state three times."""

  def test_a_full_replay_counts_only_the_steps_the_run_kept(self):
    # Steps 0..7 committed, 8..25 ran in open segments three resumes discarded, 26..33 kept.
    # (Store.challenge_counts: the two segments' ends, each challenged and replayed)
    counts = {"steps": 34, "update": 2, "state": 0, "probe": 0, "answered": 2, "required": 2,
              "update_replayed": 2}
    claims = {"claims": {labels.FULL_REPLAY: "holds", labels.DISCARDED_STEPS: "18"},
              "strict": True}
    summary = labels.challenge_summary(
        {"state": "verified", "failure": None},
        {"kind": "dvbench", "policy": json.dumps({"update_check_probability": 1.0})},
        counts, claims=claims)
    self.assertEqual(summary["server_challenges"]["discarded"], 18)
    # Before, it said "every one of 34 steps re-executed".
    self.assertIn("every one of 16 steps re-executed by the server's workers from the "
                  "attested start (2 segments); a resume discarded 18 more steps, not replayed",
                  summary["label"])


if __name__ == "__main__":
  absltest.main()
