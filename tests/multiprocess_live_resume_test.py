"""A preempted two-process run challenged live resumes its DVBench proof.

Two processes (``jax.distributed`` on loopback, two CPU devices each) train segments of 4
steps against a real ``dvbench serve`` that checks every segment and probes every row.
They checkpoint after step 3 (after ``proof.wait_for_commitments()``), train on to step 9
and are killed: the server stored steps 0..8 and challenged them, and the run answered
none of steps 4..8 (step 8 is in the segment the kill left open). Both processes then pass
``resume=PROOF_ID`` and restore the checkpoint: they replay steps 4..7 and answer their
checks from every process's shards, go on at step 9 with step 8's batch, answer step 8's
owed probes from it, and the proof ends ``verified``.
"""

import pathlib
import tempfile

from absl.testing import absltest

import dvbench
from dvbench.server.local import LocalServer
from tests import multiprocess_test
from tests import testing
from zkdv import transcript

STEPS, SEGMENT, CHECKPOINT, KILLED_AFTER = 12, 4, 4, 10

TRAINER = """
import json, os, pathlib, sys
process, port, url, token = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
work, proof_id = pathlib.Path(sys.argv[5]), (sys.argv[6] if len(sys.argv) > 6 else None)
""" + multiprocess_test.JOIN + """
import jax.numpy as jnp, numpy as np, optax
from flax import serialization
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import dvbench, zkdv
from tests import testing
from zkdv.jax import shared_decisions
""" + multiprocess_test.MESH + f"""
STEPS, SEGMENT, CHECKPOINT, KILLED_AFTER = {STEPS}, {SEGMENT}, {CHECKPOINT}, {KILLED_AFTER}
""" + """
xs = np.asarray(jax.random.normal(jax.random.key(1), (STEPS, 8, 16)))
y = np.arange(8, dtype=np.int32) % 10
""" + multiprocess_test.STEP + """
experiment = dvbench.Client(url, token=token).experiment("your-name/preempted")
config = zkdv.ZKDVConfig(output_dir=str(work / f"transcript-{process}-{proof_id}"),
                         segment_length=SEGMENT)
proof = experiment.proof(backend="jax", config=config, resume=proof_id)
owed = []  # the rows process 0's rounds ask of this process for probes owed
read_round = shared_decisions._round
shared_decisions._round = lambda message: (lambda out: owed.extend(sum(out[2], [])) or out)(
    read_round(message))
proof.start(rolling_window=8, probe_ratio=1.0)
params = proof.init(model.init, jax.random.key(0), jnp.ones((1, 16)))["params"]
state = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply, params=params,
                                           tx=optax.adam(1e-3))
if proof_id is not None:  # every process restores the whole state and places its shards
  state = serialization.from_bytes(state, (work / f"ckpt-{process}").read_bytes())
shardings = jax.tree.map(lambda v: by_column if getattr(v, "ndim", 0) == 2 else replicated,
                         state)
state = jax.tree.map(place, state, shardings)
step = proof.jit(plain_step, in_shardings=(shardings, rows, rows), out_shardings=shardings,
                 donate_argnums=0)
in_flight = []  # the window slots the replayed steps hold as each is dispatched
for i in range(int(state.step), STEPS if proof_id else KILLED_AFTER):
  state = step(state, place(xs[i], rows), place(y, rows))
  if proof_id and i < 8:
    in_flight.append(proof._committer.pipeline.in_flight)
  if proof_id is None and i + 1 == CHECKPOINT:
    proof.wait_for_commitments()
    whole = multihost_utils.process_allgather(state, tiled=True)
    (work / f"ckpt-{process}").write_bytes(serialization.to_bytes(whole))
if proof_id is None:  # every record written so far stored by the server, then a preemption
  proof._committer.pipeline.drain()
  multihost_utils.sync_global_devices("drained")
  if proof.writes_transcript:
    proof._uploader.flush(120)
  multihost_utils.sync_global_devices("stored")
  print(json.dumps({"proof_id": proof.proof_id}), flush=True)
  os._exit(0)
proof.finish()
print(json.dumps({"steps": proof.steps, "proof_id": proof.proof_id, "path": str(proof.path),
                  "owed": owed, "in_flight": in_flight}))
"""


class MultiProcessLiveResumeTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=1, extra_args=(
        "--min-update-check-probability", "1.0", "--min-state-check-probability", "1.0",
        "--max-window", "8", "--crash-after", "2s")).start()
    cls.addClassCleanup(cls.server.stop)
    cls.token = cls.server.token("your-name")
    cls.client = dvbench.Client(cls.server.url, token=cls.token)
    cls.addClassCleanup(cls.client.close)
    cls.work = pathlib.Path(tempfile.mkdtemp(prefix="zkdv-live-resume-"))
    cls.killed = cls.both()
    cls.proof_id = cls.killed[0]["proof_id"]
    testing.wait_until(lambda: cls.client.proof_status(cls.proof_id)["state"] == "crashed",
                       timeout=60, every=0.2)
    cls.resumed = cls.both(cls.proof_id)
    cls.verdict = cls.client.wait_for_verdict(cls.proof_id, 300)
    cls.records = [p.record for p in transcript.read_transcript(
        pathlib.Path(cls.resumed[0]["path"])).records]

  @classmethod
  def both(cls, *proof_id) -> list[dict]:
    """Runs the trainer as the two processes of a run; each one's JSON output."""
    return multiprocess_test.each_process(TRAINER, cls.server.url, cls.token, cls.work,
                                          *proof_id, cwd=cls.work)

  def test_the_resumed_proof_ends_verified(self):
    # Before, the resume was refused: "DVBench resumes single-process proofs".
    self.assertEqual(self.verdict["state"], "verified", self.verdict)
    self.assertIsNone(self.resumed[1]["proof_id"])  # process 0 alone holds the stream
    self.assertEqual([o["steps"] for o in self.resumed], [STEPS + 1] * 2)  # step 8 discarded

  def test_replayed_steps_hold_window_slots_until_committed(self):
    # Before, a replayed step gave its slot back as it was dispatched: the replay was not
    # bounded by the rolling window (37 steps queued behind a slow commit thread).
    for output in self.resumed:
      self.assertLen(output["in_flight"], 4)
      self.assertBetween(max(output["in_flight"]), 1, 8)

  def test_the_replayed_segments_checks_are_answered_before_the_resume_record(self):
    kinds = [(r["type"], r.get("step"), r.get("kind")) for r in self.records]
    resumed_at = kinds.index(("resume", KILLED_AFTER - 1, None))
    self.assertEqual(self.records[resumed_at]["after"], 7)
    for kind in ("update", "state", "probe"):
      self.assertIn(("check", 7, kind), kinds[:resumed_at])
    for step in range(CHECKPOINT, 8):
      self.assertEqual(kinds.count(("check", step, "probe")), 1, step)

  def test_the_discarded_steps_owed_probes_are_answered_from_its_batch_trained_again(self):
    kinds = [(r["type"], r.get("step"), r.get("kind")) for r in self.records]
    resumed_at = [k[0] for k in kinds].index("resume")
    self.assertIn(("check", 8, "probe"), kinds[resumed_at:])
    self.assertNotIn(("check", 8, "probe"), kinds[:resumed_at])
    steps = {r["index"]: r["batch"] for r in self.records if r["type"] == "step"}
    self.assertEqual(steps[9], steps[8])  # iteration 8's batch, trained again as step 9
    # Process 1 was asked for its shards of the rows they open (every row of leaves x and y,
    # two Merkle rows each), whatever step 9's own probes open.
    self.assertEqual(self.resumed[1]["owed"], [[0, 0], [0, 1], [1, 0], [1, 1]])


if __name__ == "__main__":
  absltest.main()
