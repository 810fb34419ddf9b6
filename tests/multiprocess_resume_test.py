"""A preempted two-process run resumes: both processes are killed after step 5 (the last
step's checks not yet written), then resumed from a checkpoint saved two steps earlier. The
processes agree on what the restored state is (process 0 decides from every process's
pieces), replay the committed steps 4 and 5, answer step 5's checks from the replay, and go
on to a transcript that verifies and ends where a run that never crashed ends."""

import json
import pathlib
import tempfile

from absl.testing import absltest
from flax import serialization

from tests import testing
from tests.multiprocess_test import JOIN
from tests.multiprocess_test import each_process
from tests.multiprocess_test import MESH
from tests.multiprocess_test import STEP
from tests.multiprocess_test import run_python
from zkdv import transcript

STEPS, KILLED_AFTER, EVERY = 8, 6, 2  # steps in all; steps the killed run trained; checkpoints

TRAINER = """
import json, os, pathlib, sys
process, port, work, mode = int(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3]), sys.argv[4]
""" + JOIN + """
import jax.numpy as jnp, numpy as np, optax
from flax import serialization
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import zkdv
from tests import testing
""" + MESH + """
""" + f"STEPS, KILLED_AFTER, EVERY = {STEPS}, {KILLED_AFTER}, {EVERY}\n" + """
params = model.init(jax.random.key(0), jnp.ones((1, 16)))["params"]
xs = np.asarray(jax.random.normal(jax.random.key(1), (STEPS, 8, 16)))
y = np.arange(8, dtype=np.int32) % 10
""" + STEP + """
def proof_of(name, resume=None):
  config = zkdv.ZKDVConfig(output_dir=str(work / name), sampling_policy=zkdv.SamplingPolicy(
      update_check_probability=1.0, state_check_probability=1.0))
  return zkdv.jax.ZKDV(name, config, resume=resume)

def run(proof, first=0, last=STEPS, restore=None, altered=False, lost=None, other=None):
  state = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply, params=params,
                                             tx=optax.adam(1e-3))
  if process == lost:  # this process's checkpoint is gone
    (work / "no-such-checkpoint").read_bytes()
  shardings = jax.tree.map(lambda v: by_column if getattr(v, "ndim", 0) == 2 else replicated,
                           state)
  if restore is not None:  # every process restores the whole state and places its shards
    state = serialization.from_bytes(state, (work / f"ckpt-{process}-{restore}").read_bytes())
    if altered:
      state = state.replace(params=jax.tree.map(lambda v: v + 1, state.params))
  state = jax.tree.map(place, state, shardings)
  step = proof.jit(plain_step, in_shardings=(shardings, rows, rows), out_shardings=shardings,
                   donate_argnums=0)
  for i in range(first, last):
    state = step(state, place(xs[i] + (i == other), rows), place(y, rows))
    if proof.resume_from is None and (i + 1) % EVERY == 0:
      proof.wait_for_commitments()
      whole = multihost_utils.process_allgather(state, tiled=True)
      (work / f"ckpt-{process}-{i + 1}").write_bytes(serialization.to_bytes(whole))
  return multihost_utils.process_allgather(state.params, tiled=True)

def attempt(restore, altered=False, resumed_here=True, lost=None, other=None):
  proof = proof_of("killed", resume=str(work / "killed") if resumed_here else None)
  try:
    with proof:
      final = run(proof, restore, STEPS, restore, altered, lost, other)
  except (zkdv.errors.ZKDVError, OSError) as e:
    return {"error": type(e).__name__, "message": str(e)}
  if process == 0:
    (work / "resumed-final").write_bytes(serialization.to_bytes(final))
  return {"steps": proof.steps, "path": str(proof.path)}

if mode == "kill":
  with proof_of("reference") as proof:
    final = run(proof)
  if process == 0:
    (work / "reference-final").write_bytes(serialization.to_bytes(final))
  run(proof_of("killed"), 0, KILLED_AFTER)
  print(json.dumps({"process": process}), flush=True)
  os._exit(0)  # as a preemption: no finish(), nothing flushed or shut down
print(json.dumps({"altered": attempt(KILLED_AFTER - EVERY, altered=True),
                  "mismatched": attempt(KILLED_AFTER - EVERY, resumed_here=process == 0),
                  "lost": attempt(KILLED_AFTER - EVERY, lost=1),
                  "mixed": attempt(KILLED_AFTER - EVERY * process),  # one checkpoint each
                  "too_late": attempt(KILLED_AFTER),
                  "replay_differs": attempt(KILLED_AFTER - EVERY, other=KILLED_AFTER - EVERY),
                  "resumed": attempt(KILLED_AFTER - EVERY)}))
"""


class MultiProcessResumeTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.work = pathlib.Path(tempfile.mkdtemp(prefix="zkdv-multiprocess-resume-"))
    each_process(TRAINER, cls.work, "kill", cwd=cls.work)
    cls.folder = cls.work / "killed"
    # The kill came after step 5's record, before its checks: cut them off.
    records = transcript.read_transcript(cls.folder).records
    last = next(p for p in reversed(records) if p.record["type"] == "step")
    assert last.record["index"] == KILLED_AFTER - 1, last.record
    cls.cut = [p.record["kind"] for p in records[records.index(last) + 1:]]
    with open(cls.folder / transcript.RECORDS_FILE, "r+b") as f:
      f.truncate(last.offset + len(last.raw))
    cls.crashed = (cls.folder / transcript.RECORDS_FILE).read_bytes()
    cls.outputs = each_process(TRAINER, cls.work, "resume", cwd=cls.work)

  def test_the_kill_left_step_5_committed_and_its_checks_unwritten(self):
    self.assertEqual(self.cut, ["update", "state"])
    self.assertTrue(self.crashed)

  def test_an_altered_restored_state_is_refused_on_every_process(self):
    for output in self.outputs:
      refused = output["altered"]
      self.assertEqual(refused["error"], "ResumeStateError", refused)
      self.assertIn("the restored state differs from the post-state", refused["message"])
      self.assertIn(".params['Dense_0']['bias']", refused["message"])

  def test_a_process_that_does_not_resume_while_process_0_does_is_named(self):
    # Refused before process 0 opens anything (a DVBench proof's would take a proof slot).
    said = ("process 0 resumes a proof while process 1 starts a new one: pass the same "
            "resume= on every process.")
    self.assertEqual(self.outputs[0]["mismatched"], {"error": "ProofStateError",
                                                     "message": said})
    self.assertEqual(self.outputs[1]["mismatched"], {
        "error": "ProofStateError",
        "message": f"process 0 could not start the proof: ProofStateError: {said}"})

  def test_a_replay_that_differs_is_refused_on_every_process(self):
    # Process 0 alone compares the replayed records. Before, process 1 went on into the
    # final state's collective at finish() while process 0 raised, and hung.
    for output in self.outputs:
      refused = output["replay_differs"]
      self.assertEqual(refused["error"], "ResumeStateError", refused)
      self.assertIn(f"the replayed step {KILLED_AFTER - EVERY} differs from the step the "
                    "transcript committed in its batch", refused["message"])

  def test_a_process_that_fails_before_its_first_step_is_named_not_waited_for(self):
    # Before, process 0 waited 600 s for process 1's restored state, which never came.
    self.assertEqual(self.outputs[1]["lost"]["error"], "FileNotFoundError")
    self.assertEqual(self.outputs[0]["lost"]["error"], "CommitmentError")
    self.assertIn("process 1 stopped committing, so resume/state from process 1 never came: "
                  "FileNotFoundError:", self.outputs[0]["lost"]["message"])

  def test_processes_that_restore_different_checkpoints_are_named(self):
    for output in self.outputs:
      refused = output["mixed"]
      self.assertEqual(refused["error"], "ResumeStateError", refused)
      self.assertIn("the restored state differs from the post-state step 5 committed",
                    refused["message"])
      self.assertIn("Only process 1 restored pieces that differ: every process restores the "
                    "same checkpoint.", refused["message"])

  def test_a_checkpoint_too_late_for_an_unanswered_check_is_refused_on_every_process(self):
    for output in self.outputs:
      refused = output["too_late"]
      self.assertEqual(refused["error"], "UnanswerableChallengeError", refused)
      self.assertIn(f"step {KILLED_AFTER - 1} was challenged for", refused["message"])
      self.assertIn(f"Restore the state saved at the end of step {KILLED_AFTER - 2}",
                    refused["message"])

  def test_the_resumed_run_replays_answers_and_goes_on_in_one_chain(self):
    self.assertEqual([o["resumed"] for o in self.outputs],
                     [{"steps": STEPS, "path": str(self.folder)}] * 2)
    records = testing.records_of(self.folder)
    self.assertEqual([r["index"] for r in records if r["type"] == "step"], list(range(STEPS)))
    resume = [(r["step"], r["after"]) for r in records if r["type"] == "resume"]
    self.assertEqual(resume, [(KILLED_AFTER, KILLED_AFTER - 1)])
    checks = [(r["step"], r["kind"]) for r in records if r["type"] == "check"]
    self.assertEqual(sorted(checks), [(i, k) for i in range(STEPS) for k in ("state", "update")])
    # The refused attempts wrote nothing: the transcript goes on from the crashed bytes.
    self.assertEqual((self.folder / transcript.RECORDS_FILE).read_bytes()[:len(self.crashed)],
                     self.crashed)

  def test_the_resumed_run_verifies_and_ends_as_a_run_that_never_crashed(self):
    result = run_python("from zkdv import cli; import sys; sys.exit(cli.main(sys.argv[1:]))",
                        "verify", self.folder, "--json")
    self.assertEqual(result.returncode, 0, result.stdout[-3000:] + result.stderr[-3000:])
    self.assertEqual(json.loads(result.stdout)["verdict"], "verified")
    reference = serialization.msgpack_restore((self.work / "reference-final").read_bytes())
    resumed = serialization.msgpack_restore((self.work / "resumed-final").read_bytes())
    testing.assert_bitwise_equal(resumed, reference)


if __name__ == "__main__":
  absltest.main()
