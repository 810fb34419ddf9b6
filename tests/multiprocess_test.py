"""Multi-process training: two local processes with two CPU devices each, joined
by ``jax.distributed`` with gloo collectives, write one transcript; the same two processes
run it once with each digest backend (host and device)."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from flax import serialization

import dvbench
from dvbench import measurement
from dvbench.server.local import LocalServer
from dvbench.server.local import free_port
from tests import testing
from tests.verify_test import rechained
from zkdv import transcript
from zkdv import verify

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROCESSES, LOCAL_DEVICES, STEPS = 2, 2, 3
BACKENDS = ("host", "device")

# Joins the run as process ``process`` of two (two CPU devices each) at ``port``.
JOIN = """
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
"""
# Diagonal: each process holds one row block of the batch and one column of each kernel.
MESH = """
d = jax.devices()
mesh = Mesh(np.array([[d[0], d[2]], [d[3], d[1]]]), ("data", "model"))
model = testing.MLP(width=64)
"""
# The shardings of the state (kernels by column) and of batches (by row) on MESH, a host
# value placed with one of them, and the training step.
STEP = """
replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
by_column = NamedSharding(mesh, P(None, "model"))
place = lambda v, s: jax.make_array_from_callback(np.shape(v), s, lambda i: np.asarray(v)[i])

def plain_step(state, x, y):
  def loss(params):
    logits = state.apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return state.apply_gradients(grads=jax.grad(loss)(state.params))
"""

TRAINER = """
import json, os, sys
process, port = int(sys.argv[1]), sys.argv[2]
""" + JOIN + """
import jax.numpy as jnp, numpy as np, optax
from flax import serialization
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import zkdv
from tests import testing
""" + MESH + """
params = model.init(jax.random.key(0), jnp.ones((1, 16)))["params"]
x = np.asarray(jax.random.normal(jax.random.key(1), (8, 16)))
y = np.arange(8, dtype=np.int32) % 10

""" + STEP + """
def train(backend, name, folder, steps, checks, overlap, break_blobs=False, donate=(0,),
          placed=False):
  proof = zkdv.jax.ZKDV(name, zkdv.ZKDVConfig(
      sampling_policy=zkdv.SamplingPolicy(update_check_probability=checks,
                                          state_check_probability=checks),
      output_dir=folder, digest_backend=backend))
  proof.start(probe_ratio=1.0)
  if break_blobs and proof.writes_transcript:  # process 0 can no longer store blobs
    blobs = proof.path / "blobs"
    blobs.rmdir()
    blobs.write_bytes(b"")
  state = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply, params=params,
                                             tx=optax.adam(1e-3), zkdv_overlap=overlap)
  shardings = jax.tree.map(lambda v: by_column if getattr(v, "ndim", 0) == 2 else replicated,
                           state)
  state = jax.tree.map(place, state, shardings)
  if placed:  # no shardings given: the step follows its inputs' placement, as jax.jit does
    step = proof.jit(plain_step, donate_argnums=donate)
  else:
    step = proof.jit(plain_step, in_shardings=(shardings, rows, rows), out_shardings=shardings,
                     donate_argnums=donate)
  for _ in range(steps):
    state = step(state, place(x, rows), place(y, rows))
  path = proof.finish()
  return proof, path, state

def runs(backend, folder):
  # Checked on every step, beside training (ALWAYS); then unchecked steps, pipelined, in the
  # idiomatic style (no shardings given to proof.jit).
  proof, path, state = train(backend, "two-processes", folder, 3, 1.0, zkdv.overlap.ALWAYS)
  final = multihost_utils.process_allgather(state.params, tiled=True)
  if process == 0:
    (path.parent / "final-params.msgpack").write_bytes(serialization.to_bytes(final))
  # (p = 1e-12: a valid policy under which no step is checked in practice.)
  unchecked, unchecked_path, _ = train(backend, "two-processes-unchecked", folder + "-unchecked",
                                       4, 1e-12, zkdv.overlap.UNCHECKED, donate=(0, 1, 2),
                                       placed=True)
  try:
    train(backend, "two-processes-broken", folder + "-broken", 3, 0.0, zkdv.overlap.UNCHECKED,
          break_blobs=True, donate=(0, 1, 2))
    broken = None
  except zkdv.errors.ZKDVError as e:
    broken = f"{type(e).__name__}: {e}"
  try:  # the folder already holds a transcript: process 0 cannot start, so no process does
    train(backend, "two-processes-again", folder, 1, 0.0, zkdv.overlap.UNCHECKED)
    restarted = None
  except zkdv.errors.ZKDVError as e:
    restarted = f"{type(e).__name__}: {e}"
  return {"process": process, "path": str(path), "steps": proof.steps, "broken": broken,
          "restarted": restarted,
          "committed_here": proof.committed_here, "checks": proof.checks,
          "failed": proof.failed_checks, "unchecked_path": str(unchecked_path),
          "unchecked_committed_here": unchecked.committed_here}

print(json.dumps({backend: runs(backend, f"{sys.argv[3]}/{backend}/transcript")
                  for backend in sys.argv[4].split(",")}))
"""


def each_process(script: str, *args, cwd) -> list[dict]:
  """Runs ``script`` as the two processes of one run (its arguments: the process's index,
  the coordinator's port, then ``args``); each one's JSON output, its last line."""
  port = free_port()
  trainers = [subprocess.Popen(
      [sys.executable, "-c", script, str(i), str(port), *map(str, args)], cwd=cwd,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env={**os.environ, "PYTHONPATH": str(ROOT)}) for i in range(2)]
  outputs = []
  for trainer in trainers:
    out, err = trainer.communicate(timeout=600)
    assert trainer.returncode == 0, err[-3000:]
    outputs.append(json.loads(out.strip().splitlines()[-1]))
  return outputs


def run_python(script: str, *args, cwd=ROOT, env=None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=cwd,
                        capture_output=True, text=True, timeout=600,
                        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def reference_params(steps: int):
  """The same training, unsharded, on one device."""
  model = testing.MLP(width=64)
  params = model.init(jax.random.key(0), jnp.ones((1, 16)))["params"]
  x = jax.random.normal(jax.random.key(1), (8, 16))
  y = jnp.arange(8, dtype=jnp.int32) % 10
  state = testing.zkdv.jax.contrib.TrainState.create(apply_fn=model.apply, params=params,
                                                     tx=optax.adam(1e-3))

  @jax.jit
  def step(state):
    def loss(p):
      logits = state.apply_fn({"params": p}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  for _ in range(steps):
    state = step(state)
  return state.params


class MultiProcessTest(absltest.TestCase):
  """Tests of one two-process run per digest backend (``BACKENDS``); the two trainer
  processes run every backend's training one after the other."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    work = pathlib.Path(tempfile.mkdtemp(prefix="zkdv-multiprocess-"))
    cls.folder = {backend: work / backend / "transcript" for backend in BACKENDS}
    for backend in BACKENDS:
      (work / backend).mkdir()
    port = free_port()
    cwds = [work / f"process-{i}" for i in range(PROCESSES)]
    trainers = []
    for i, cwd in enumerate(cwds):
      cwd.mkdir()
      trainers.append(subprocess.Popen(
          [sys.executable, "-c", TRAINER, str(i), str(port), str(work), ",".join(BACKENDS)],
          cwd=cwd,
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
          env={**os.environ, "PYTHONPATH": str(ROOT)}))
    cls.outputs = {backend: [] for backend in BACKENDS}
    for trainer in trainers:
      out, err = trainer.communicate(timeout=600)
      assert trainer.returncode == 0, err[-3000:]
      assert "involuntary full rematerialization" not in err.lower(), err[-3000:]
      for backend, output in json.loads(out.strip().splitlines()[-1]).items():
        cls.outputs[backend].append(output)
    cls.cwds = cwds

  def each_run(self):
    """(transcript folder, each process's output) of each backend's run, in a subTest."""
    for backend in BACKENDS:
      with self.subTest(backend=backend):
        yield self.folder[backend], self.outputs[backend]

  def test_one_transcript_whose_steps_combine_both_processes(self):
    for folder, outputs in self.each_run():
      self.assertEqual({o["path"] for o in outputs}, {str(folder)})
      for cwd in self.cwds:  # nothing written beside the runs' own transcripts
        self.assertEqual(list(cwd.iterdir()), [])
      self.assertEqual([o["steps"] for o in outputs], [STEPS] * PROCESSES)
      self.assertEqual(outputs[0]["failed"], [])
      self.assertEqual(outputs[0]["checks"], {"update": STEPS, "state": STEPS, "probe": STEPS})
      records = testing.records_of(folder)
      self.assertEqual([r["type"] for r in records].count("root"), 1)
      self.assertEqual(records[0]["processes"], PROCESSES)
      programs = testing.records_of(folder, "program")
      self.assertLen(programs, 1)
      self.assertEqual(programs[0]["nr_devices"], PROCESSES * LOCAL_DEVICES)
      self.assertEqual(programs[0]["processes"], PROCESSES)
      self.assertEqual(programs[0]["collectives"], "gloo")
      steps = testing.records_of(folder, "step")
      self.assertEqual([s["index"] for s in steps], list(range(STEPS)))
      # Each process hashes the pieces and rows it holds (one column of each kernel, one block
      # of rows), and together they hash each piece and row of every step exactly once.
      for key, run_folder in (("committed_here", folder),
                              ("unchecked_committed_here", outputs[0]["unchecked_path"])):
        layouts = [p.get("post_state_layout", p["state_layout"])
                   for p in testing.records_of(run_folder, "program")]
        run_steps = testing.records_of(run_folder, "step")
        here = [o[key] for o in outputs]
        self.assertTrue(all(h["pieces"] and h["rows"] for h in here), here)
        self.assertEqual(sum(h["pieces"] for h in here),
                         sum(len(l.get("pieces", [0])) for s in run_steps
                             for l in layouts[s["program"]]))
        # Merkle rows: groups of row_group rows, none spanning the two processes' rows.
        merkle_rows = [[8 // l.get("row_group", 1) for l in p["batch_layout"]]
                       for p in testing.records_of(run_folder, "program")]
        self.assertEqual(sum(h["rows"] for h in here),
                         sum(sum(merkle_rows[s["program"]]) for s in run_steps))
      # ... and every row is probed, so process 0 wrote rows that process 1 sent.
      probes = [c for c in testing.records_of(folder, "check") if c["kind"] == "probe"]
      self.assertEqual([c["step"] for c in probes], list(range(STEPS)))
      rows = [8 // l.get("row_group", 1) for l in programs[0]["batch_layout"]]
      self.assertTrue(all(n >= 2 for n in rows), programs[0]["batch_layout"])
      for c in probes:
        self.assertCountEqual([(leaf, row) for leaf, row, *_ in c["probes"]],
                              [(leaf, row) for leaf in (0, 1) for row in range(rows[leaf])])
      # Each kernel is committed as two column pieces, one held by each process.
      kernel = next(i for i, l in enumerate(programs[0]["state_layout"])
                    if l["path"] == ".params['Dense_0']['kernel']")
      final = testing.records_of(folder, "final")[0]
      self.assertLen(programs[0]["state_layout"][kernel]["pieces"], LOCAL_DEVICES)
      self.assertLen(final["final_state_leaves"][kernel], LOCAL_DEVICES)

  def test_transcript_verifies_with_exact_replay(self):
    for folder, _ in self.each_run():
      result = run_python("from zkdv import cli; import sys; sys.exit(cli.main(sys.argv[1:]))",
                          "verify", folder, "--json")
      self.assertEqual(result.returncode, 0, result.stdout[-3000:] + result.stderr[-3000:])
      report = json.loads(result.stdout)
      self.assertEqual(report["verdict"], "verified")
      updates = [c for c in report["checks"] if c["kind"] == "update"]
      self.assertEqual([(c["mode"], c["status"]) for c in updates],
                       [("exact", "verified")] * STEPS)

  def test_unchecked_pipelined_run_holds_its_chain_and_probes(self):
    for _, outputs in self.each_run():
      folder = pathlib.Path(outputs[0]["unchecked_path"])
      self.assertEqual({o["unchecked_path"] for o in outputs}, {str(folder)})
      report = verify.verify(folder)
      # Nothing was replayed, so the verifier cannot call it verified; everything it could
      # check — the chain across both processes' pieces, every probed row — holds.
      self.assertEqual(report.verdict, verify.UNVERIFIABLE)
      self.assertEqual([f.code for f in report.findings], ["too_few_checks"], report.dumps())
      self.assertEqual(report.claim("chain").status, "holds", report.dumps())
      self.assertEqual(report.claim("data").status, "holds", report.dumps())
      self.assertEqual(report.steps, 4)
      # Probes at every step, and the last post-state opened for the sharded final_params.
      self.assertEqual(sorted((c.kind, c.step) for c in report.checks if c.kind == "state"),
                       [("state", 3)])
      self.assertEqual(sorted(c.step for c in report.checks if c.kind == "probe"), [0, 1, 2, 3])
      # Given no shardings, the step took its inputs' placement on the 4-device mesh.
      self.assertEqual({p["nr_devices"] for p in testing.records_of(folder, "program")},
                       {PROCESSES * LOCAL_DEVICES})

  def test_a_failure_on_process_0_is_raised_by_every_process_at_finish(self):
    for folder, outputs in self.each_run():
      writer, other = (o["broken"] for o in outputs)
      self.assertRegex(writer, r"^CommitmentError: .*NotADirectoryError")
      self.assertRegex(other, r"^CommitmentError: process 0 could not complete the transcript "
                       r"at .*-broken: CommitmentError: .*NotADirectoryError")
      records = testing.records_of(f"{folder}-broken")  # what was written is kept
      self.assertEqual([r["type"] for r in records], ["root", "final"])
      self.assertEqual(records[-1]["status"], "aborted")
      self.assertEqual(verify.verify(f"{folder}-broken").verdict, verify.INVALID)

  def test_a_start_that_fails_on_process_0_fails_on_every_process(self):
    for folder, outputs in self.each_run():
      writer, other = (o["restarted"] for o in outputs)
      self.assertRegex(writer, r"^ProofStateError: .*records.cborl already exists")
      self.assertRegex(other, r"^ProofStateError: process 0 could not start the proof: "
                       r"ProofStateError: .*already exists")
      self.assertEqual([r["type"] for r in testing.records_of(folder)].count("root"), 1)

  def test_tampered_shard_opening_is_named(self):
    for run_folder, _ in self.each_run():
      folder = pathlib.Path(tempfile.mkdtemp()) / "t"
      shutil.copytree(run_folder, folder)
      program = testing.records_of(folder, "program")[0]
      paths = [l["path"] for l in program["state_layout"]]
      kernel = paths.index(".params['Dense_0']['kernel']")
      check = testing.records_of(folder, "check")[0]
      blob = transcript.blob_path(folder, check["pre_state_blobs"][kernel])
      data = bytearray(blob.read_bytes())
      data[-1] ^= 0x40  # the last column: the shard process 1 committed
      blob.write_bytes(bytes(data))
      result = run_python("from zkdv import cli; import sys; sys.exit(cli.main(sys.argv[1:]))",
                          "verify", folder, "--json")
      self.assertEqual(result.returncode, 1, result.stderr[-3000:])
      self.assertIn(f"{paths[kernel]}: ", result.stdout)
      self.assertIn("shard 1 [[0, 16], [32, 64]] differs from its commitment", result.stdout)

  def test_final_params_are_derived_from_the_last_state_check(self):
    for folder, _ in self.each_run():
      def edit(records):
        records[-1]["final_params"] = bytes(32)
        return records
      report = verify.verify(rechained(edit, folder), replay="none")
      self.assertIn("final_params", {f.code for f in report.findings}, report.dumps())
      self.assertNotIn("final_params", {f.code for f in verify.verify(
          folder, replay="none").findings})

  def test_replay_with_in_process_collectives_is_refused_with_the_fix(self):
    for folder, _ in self.each_run():
      result = run_python(textwrap.dedent(f"""
          import os, json
          os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
          from zkdv import verify
          report = verify.verify({str(folder)!r})
          print(json.dumps({{"verdict": report.verdict, "text": report.dumps()}}))
          """))
      self.assertEqual(result.returncode, 0, result.stderr[-3000:])
      report = json.loads(result.stdout.strip().splitlines()[-1])
      self.assertEqual(report["verdict"], verify.UNVERIFIABLE)
      self.assertIn("ran with gloo CPU collectives", report["text"])
      self.assertIn("use_cpu_collectives('gloo')", report["text"])

  def test_final_params_match_the_unsharded_run_and_the_checkpoint(self):
    reference = reference_params(STEPS)
    for folder, _ in self.each_run():
      checkpoint = (folder.parent / "final-params.msgpack").read_bytes()
      final = serialization.msgpack_restore(checkpoint)
      for got, want in zip(jax.tree.leaves(final), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)
      # final_params is the digest of the whole params a checkpoint holds.
      self.assertEqual(testing.records_of(folder, "final")[0]["final_params"],
                       measurement.params_digest(measurement.load_checkpoint(checkpoint)))

  def test_dvbench_worker_replays_it(self):
    server = LocalServer(workers=1).start()
    try:
      client = dvbench.Client(server.url, token=server.token("your-name"))
      proof_id = client.experiment("your-name/two-processes").upload(self.folder["host"])
      status = client.wait_for_verdict(proof_id, 300)
      # An offline transcript chose its own checks: replayed, and labelled self-audited.
      self.assertEqual(status["state"], "self-audited", str(status))
      self.assertEqual((status["checks"], status["checks_verified"]), (3 * STEPS, 3 * STEPS))
    finally:
      server.stop()


if __name__ == "__main__":
  absltest.main()
