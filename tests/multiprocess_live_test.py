"""Multi-process training challenged live: two local processes with two CPU devices each,
joined by ``jax.distributed`` with gloo collectives, train the tutorial's proof
(``experiment.proof``, ``rolling_window=4``, ``probe_ratio=0.01``) against a real
``dvbench serve``. Process 0 holds the stream; both processes take the server's decisions
in the rounds process 0 publishes (``zkdv.jax.shared_decisions``)."""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import httpx
from absl.testing import absltest

import dvbench
from dvbench.server.local import LocalServer
from dvbench.server.local import free_port
from tests import multiprocess_test
from tests import testing

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROCESSES, STEPS, ROWS = 2, 5, 8
SEGMENTS = [(0, 1), (2, 3), (4, 4)]  # half the server's largest window: 2 steps, the root's
ALTERNATING = 4  # steps of a run that alternates two programs

# The server's minimum raises the tutorial's policy: every step is update- and state-checked
# and every row probed, so both processes open shards at every step, whatever the challenges.
# Its largest window is the tutorial's: the window never grows, so rounds come before steps
# 0, 2, 4, ... and the one before step 4 decides steps 0 and 1.
SERVER_MINIMUM = ("--min-update-check-probability", "1.0", "--min-state-check-probability",
                  "1.0", "--min-probe-ratio", "1.0", "--max-window", "4")

TRAINER = """
import dataclasses, json, os, sys
process, port, url, token = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
""" + multiprocess_test.JOIN + """
import jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import dvbench, zkdv
from zkdv.jax import shared_decisions
from tests import testing
""" + multiprocess_test.MESH + """
x = np.asarray(jax.random.normal(jax.random.key(1), (8, 16)))
y = np.arange(8, dtype=np.int32) % 10
""" + multiprocess_test.STEP + """
def halved_step(state, x, y):  # a second program: a new segment wherever it follows the first
  def loss(params):
    logits = state.apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() / 2
  return state.apply_gradients(grads=jax.grad(loss)(state.params))

def train(name, steps, attested=True, stop_upload_after=None, alternate=False):
  # The tutorial's proof, as every process runs it.
  experiment = dvbench.Client(url, token=token).experiment(f"your-name/{name}")
  config = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.01))
  if stop_upload_after is not None:  # a folder of its own: the transcript outlives the upload
    config = dataclasses.replace(config, output_dir=os.path.join(os.getcwd(), name))
  proof = experiment.proof(backend="jax", config=config)
  proof.start(rolling_window=4, probe_ratio=0.01)
  init = proof.init if attested else lambda f, *args: f(*args)
  params = init(model.init, jax.random.key(0), jnp.ones((1, 16)))["params"]
  state = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply, params=params,
                                             tx=optax.adam(1e-3))
  shardings = jax.tree.map(lambda v: by_column if getattr(v, "ndim", 0) == 2 else replicated,
                           state)
  state = jax.tree.map(place, state, shardings)
  step, other = (proof.jit(f, in_shardings=(shardings, rows, rows), out_shardings=shardings,
                          donate_argnums=(0,)) for f in (plain_step, halved_step))
  error = None
  try:
    for t in range(steps):
      if t == stop_upload_after and proof.writes_transcript:
        proof.abandon("the upload was stopped")  # no more challenges from the server
      state = (other if alternate and t % 2 else step)(state, place(x, rows), place(y, rows))
  except zkdv.errors.ZKDVError as e:
    error = f"{type(e).__name__}: {e}"
  try:
    proof.finish()
  except zkdv.errors.ZKDVError as e:
    error = error or f"{type(e).__name__}: {e}"
  return {"proof_id": proof.proof_id, "steps": proof.steps, "checks": proof.checks,
          "policy": proof.policy.to_record(), "error": error}

honest = train("two-processes-live", STEPS)
stopped = train("two-processes-stopped", STEPS, attested=False, stop_upload_after=1)
alternating = train("two-processes-two-programs", ALTERNATING, alternate=True)
if process == 1:  # a process that opens none of the rows the server probes
  take = shared_decisions.SharedDecisions._open
  shared_decisions.SharedDecisions._open = lambda self, decision, rows: take(
      self, dataclasses.replace(decision, probe_ratio=0.0), rows)
forged = train("two-processes-forged", 1, attested=False)
print(json.dumps({"honest": honest, "stopped": stopped, "alternating": alternating,
                  "forged": forged}))
""".replace("STEPS", str(STEPS)).replace("ALTERNATING", str(ALTERNATING))


class MultiProcessLiveTest(absltest.TestCase):
  """One server; the two trainer processes train an honest proof, one whose upload process 0
  stops after its first step, one that alternates two programs, then one whose process 1
  opens none of the probed rows."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=1, extra_args=SERVER_MINIMUM).start()
    token = cls.server.token("your-name")
    cls.client = dvbench.Client(cls.server.url, token=token)
    cls.key = httpx.get(f"{cls.server.url}/api/v1/server-key").json()["server_key"]
    port = free_port()
    trainers = [subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(i), str(port), cls.server.url, token],
        cwd=tempfile.mkdtemp(prefix=f"zkdv-live-process-{i}-"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
                for i in range(PROCESSES)]
    cls.outputs = []
    for trainer in trainers:
      out, err = trainer.communicate(timeout=600)
      assert trainer.returncode == 0, err[-3000:]
      cls.outputs.append(json.loads(out.strip().splitlines()[-1]))
    cls.honest = [o["honest"] for o in cls.outputs]
    cls.stopped = [o["stopped"] for o in cls.outputs]
    cls.alternating = [o["alternating"] for o in cls.outputs]
    cls.forged = [o["forged"] for o in cls.outputs]

  @classmethod
  def tearDownClass(cls):
    cls.client.close()
    cls.server.stop()
    super().tearDownClass()

  def test_server_challenged_run_ends_verified(self):
    leader, follower = self.honest
    self.assertEqual((leader["error"], follower["error"]), (None, None))
    self.assertIsNone(follower["proof_id"])  # process 0 alone holds the stream
    status = self.client.wait_for_verdict(leader["proof_id"], 300)
    self.assertEqual(status["state"], "verified", status)
    self.assertEqual(status["challenger"], "dvbench")
    challenges = status["server_challenges"]
    self.assertEqual((challenges["update"], challenges["state"], challenges["probe"]),
                     (len(SEGMENTS), len(SEGMENTS), STEPS), challenges)
    self.assertEqual(challenges["answered"], challenges["required"])
    self.assertEqual(challenges["update_replayed"], len(SEGMENTS))

  def test_every_process_took_the_servers_decisions_under_the_roots_policy(self):
    leader, follower = self.honest
    # The server raised the tutorial's policy; process 1 decided under the raised one.
    self.assertEqual(leader["policy"], follower["policy"])
    self.assertEqual((leader["policy"]["update_check_probability"],
                      leader["policy"]["probe_ratio"]), (1.0, 1.0))
    self.assertEqual(leader["checks"],
                     {"update": len(SEGMENTS), "state": len(SEGMENTS), "probe": STEPS})
    self.assertEqual((follower["checks"]["update"], follower["checks"]["state"]),
                     (len(SEGMENTS), len(SEGMENTS)))

  def test_downloaded_transcript_verifies_strictly(self):
    self.client.wait_for_verdict(self.honest[0]["proof_id"], 300)  # its receipt is signed
    folder = pathlib.Path(tempfile.mkdtemp()) / "proof"
    subprocess.run([sys.executable, "-m", "dvbench.cli", "download", self.honest[0]["proof_id"],
                    str(folder), "--url", self.server.url], cwd=ROOT, check=True,
                   capture_output=True)
    root = testing.records_of(folder, "root")[0]
    self.assertEqual((root["processes"], root["challenger"]["kind"]), (PROCESSES, "dvbench"))
    # Every row was probed, the rows process 1 holds among them, sent through process 0.
    probes = [c for c in testing.records_of(folder, "check") if c["kind"] == "probe"]
    self.assertEqual([c["step"] for c in probes], list(range(STEPS)))
    layouts = testing.records_of(folder, "program")[0]["batch_layout"]
    merkle_rows = [ROWS // l.get("row_group", 1) for l in layouts]  # half on each process
    self.assertEqual(merkle_rows, [PROCESSES] * 2)
    for c in probes:
      self.assertCountEqual([(leaf, row) for leaf, row, *_ in c["probes"]],
                            [(leaf, row) for leaf in (0, 1) for row in range(merkle_rows[leaf])])
    code, report = testing.zkdv_verify(folder, "--server-key", self.key, "--strict")
    self.assertEqual((code, report["verdict"]), (0, "verified"), report)
    claims = {c["name"]: c for c in report["claims"]}
    self.assertEqual(claims["challenges"]["status"], "holds", claims["challenges"])
    self.assertIn("dvbench", claims["challenges"]["detail"])
    updates = [c for c in report["checks"] if c["kind"] == "update"]
    self.assertEqual([(c["mode"], c["status"]) for c in updates],
                     [("exact", "verified")] * len(SEGMENTS))
    # Segments of the root's length across processes: each update check replays its
    # segment from the start state both processes kept, with every batch in it.
    self.assertEqual(root["challenger"]["policy"]["segment_length"], 2)
    self.assertEqual([(c["first"], c["step"]) for c in testing.records_of(folder, "check")
                      if c["kind"] == "update"], SEGMENTS)
    steps = testing.records_of(folder, "step")
    self.assertEqual([s["index"] for s in steps if "post_state" in s],
                     [last for _, last in SEGMENTS])

  def test_a_second_program_ends_the_open_segment_on_every_process(self):
    leader, follower = self.alternating
    self.assertEqual((leader["error"], follower["error"]), (None, None))
    status = self.client.wait_for_verdict(leader["proof_id"], 300)
    self.assertEqual(status["state"], "verified", str(status))
    folder = pathlib.Path(tempfile.mkdtemp()) / "proof"
    subprocess.run([sys.executable, "-m", "dvbench.cli", "download", leader["proof_id"],
                    str(folder), "--url", self.server.url], cwd=ROOT, check=True,
                   capture_output=True)
    # Each step follows the other program's: a boundary its predecessor did not plan ends
    # that segment there, with every process's pieces of its end state.
    steps = testing.records_of(folder, "step")
    self.assertEqual([(s["index"], s["program"], "post_state" in s) for s in steps],
                     [(t, t % 2, True) for t in range(ALTERNATING)])
    self.assertEqual([(c["first"], c["step"]) for c in testing.records_of(folder, "check")
                      if c["kind"] == "update"], [(t, t) for t in range(ALTERNATING)])
    code, report = testing.zkdv_verify(folder, "--server-key", self.key, "--strict")
    self.assertEqual((code, report["verdict"]), (0, "verified"), report)

  def test_when_process_0_gets_no_more_challenges_every_process_stops_at_the_same_step(self):
    leader, follower = self.stopped
    # The round before step 4 needs the challenges of steps 0 and 1; step 1's never came (its
    # record was written after the upload stopped): both processes raise before step 4.
    self.assertEqual((leader["steps"], follower["steps"]), (4, 4))
    self.assertRegex(leader["error"], r"^ChallengeTimeoutError: no challenges can come from "
                     r"DVBench: the upload was stopped")
    self.assertRegex(follower["error"], r"^ChallengeTimeoutError: process 0 has no challenges "
                     r"from DVBench for this round: ChallengeTimeoutError: no challenges can "
                     r"come from DVBench: the upload was stopped")

  def test_a_process_that_opens_none_of_the_rows_the_server_probes_is_caught(self):
    leader, follower = self.forged
    self.assertRegex(leader["error"], r"CommitmentError: step 0: no process sent rows \[.*\] "
                     r"of batch leaf .*, which the challenge probes")
    self.assertRegex(follower["error"], r"CommitmentError: process 0 .*no process sent rows")
    status = self.client.wait_for_verdict(leader["proof_id"], 300)
    self.assertNotIn(status["state"], ("verified", "verified steps"), status)


if __name__ == "__main__":
  absltest.main()
