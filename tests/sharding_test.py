"""Sharded training on 4 and 8 forced CPU devices. The device count is fixed before JAX
starts, so each count runs in a process of its own, which trains every case of that count
(each with its own proof) once for the whole class."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

from absl.testing import absltest

from tests import testing
from zkdv import verify

ROOT = pathlib.Path(__file__).resolve().parent.parent

PRELUDE = """
import os, sys, json, traceback
N = int(os.environ["ZKDV_TEST_DEVICES"])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={N}"
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import zkdv
from tests import testing
from zkdv import transcript
from zkdv import verify

assert len(jax.devices()) == N
mesh = Mesh(np.array(jax.devices()).reshape(2, N // 2), ("data", "model"))
model = testing.MLP(width=64)
fresh_params = lambda: model.init(jax.random.key(0), jnp.ones((1, 16)))["params"]
params = fresh_params()
x = jax.random.normal(jax.random.key(1), (8, 16))
y = jnp.arange(8) % 10

def loss(state, params, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(
      state.apply_fn({"params": params}, x), y).mean()

def plain_step(state, x, y):
  return state.apply_gradients(grads=jax.grad(lambda p: loss(state, p, x, y))(state.params))

def new_state(name, update_p=1.0, **config):
  proof = testing.new_proof(name, update_p=update_p, **config)
  proof.start()
  return proof, testing.zkdv.jax.contrib.TrainState.create(
      proof=proof, apply_fn=model.apply, params=params, tx=optax.adam(1e-3))

def run(step_fn, proof, state, x, y, steps=3, replicas=False, verified=True):
  for _ in range(steps):
    state = step_fn(state, x, y)
  proof.finish()
  if not verified:  # only what it committed
    return {"path": str(proof.path)}
  if replicas:  # pmap: every replica holds the same state; compare the first
    assert all(np.array_equal(v[0], v[i]) for v in jax.tree.leaves(state.params)
               for i in range(v.shape[0]))
    state = jax.tree.map(lambda v: v[0], state)
    x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1)
  report = verify.verify(proof.path)
  reference = testing.zkdv.jax.contrib.TrainState.create(
      apply_fn=model.apply, params=fresh_params(), tx=optax.adam(1e-3))
  for _ in range(steps):
    reference = jax.jit(plain_step)(reference, jnp.asarray(x), jnp.asarray(y))
  close = all(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
              for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(reference.params)))
  return {"verdict": report.verdict, "findings": [f.message for f in report.findings],
          "checks": [c.status for c in report.checks], "close": close,
          "path": str(proof.path), "failed": proof.failed_checks}

# Idiomatic JAX: the state placed on the mesh and jit left to follow; XLA then picks output
# shardings of its own (some biases come back split), and the next call follows those.
def placed(proof_and_state, verified=True):
  proof, state = proof_and_state
  replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  by_column = NamedSharding(mesh, P(None, "model"))
  state = jax.device_put(state, jax.tree.map(
      lambda v: by_column if getattr(v, "ndim", 0) == 2 and v.shape[1] % (N // 2) == 0
      else replicated, state))
  return run(proof.jit(plain_step, donate_argnums=0), proof, state,
             jax.device_put(x, rows), jax.device_put(y, rows), verified=verified)
"""

# Each case is the body of a function of the training process that returns a JSON value.
CASES = {
    "mesh": """
        proof, state = new_state("mesh")
        replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        state = jax.device_put(state, replicated)
        step = proof.jit(plain_step, in_shardings=(replicated, rows, rows),
                         out_shardings=replicated, donate_argnums=0)
        return run(step, proof, state, jax.device_put(x, rows), jax.device_put(y, rows))
        """,
    "placed": """
        return placed(new_state("placed"))
        """,
    # The same with digests computed on the devices (the state's pieces where they live, the
    # batch rows of every leaf in one program), unchecked: its commitments are compared.
    "placed_device": """
        return placed(new_state("placed-device", update_p=0.0, digest_backend="device"),
                      verified=False)
        """,
    "shard_map": """
        proof, state = new_state("shard-map")
        flat_mesh = Mesh(np.array(jax.devices()), ("data",))

        def step(state, x, y):
          def local_grads(params, x, y):
            g = jax.grad(lambda p: loss(state, p, x, y))(params)
            return jax.lax.pmean(g, "data")
          grads = jax.shard_map(local_grads, mesh=flat_mesh,
                                in_specs=(P(), P("data"), P("data")), out_specs=P())(
                                    state.params, x, y)
          return state.apply_gradients(grads=grads)

        return run(proof.jit(step), proof, state, x, y)
        """,
    # Trained, verified, then one shard of one opened leaf tampered with and verified again.
    "model_parallel": """
        proof, state = new_state("model-parallel")
        replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        by_column = NamedSharding(mesh, P(None, "model"))
        shardings = jax.tree.map(
            lambda v: by_column if getattr(v, "ndim", 0) == 2 and v.shape[1] % (N // 2) == 0
            else replicated, state)
        state = jax.device_put(state, shardings)
        step = proof.jit(plain_step, in_shardings=(shardings, rows, rows),
                         out_shardings=shardings, donate_argnums=0)
        result = run(step, proof, state, jax.device_put(x, rows), jax.device_put(y, rows))
        program = testing.records_of(proof.path, "program")[0]
        paths = [l["path"] for l in program["state_layout"]]
        kernel = next(p for p in paths if p.endswith("['kernel']"))
        check = testing.records_of(proof.path, "check")[0]
        blob = transcript.blob_path(proof.path, check["pre_state_blobs"][paths.index(kernel)])
        data = bytearray(blob.read_bytes())
        data[-1] ^= 0x40  # the last column: the last shard
        blob.write_bytes(bytes(data))
        report = verify.verify(proof.path)
        return {**result, "tampered_leaf": kernel, "tampered_verdict": report.verdict,
                "tampered_report": report.dumps()}
        """,
    "replicas": """
        replicated = NamedSharding(mesh, P())
        def train(cross_check):
          proof = testing.new_proof("replicas", update_p=0.0, cross_check_replicas=cross_check)
          state = jax.device_put(testing.zkdv.jax.contrib.TrainState.create(
              proof=proof, apply_fn=model.apply, params=params, tx=optax.sgd(0.1)), replicated)
          # The copy of one bias on the second device diverges, as on a faulty device.
          bias = state.params["Dense_0"]["bias"]
          copies = [jax.device_put(s.data + 1, s.device) if s.device == jax.devices()[1]
                    else s.data for s in bias.addressable_shards]
          diverged = jax.make_array_from_single_device_arrays(bias.shape, bias.sharding, copies)
          state = state.replace(params={**state.params, "Dense_0": {
              **state.params["Dense_0"], "bias": diverged}})
          step = proof.jit(plain_step)
          try:
            for _ in range(2):
              state = step(state, x, y)
            proof.finish()
          except zkdv.errors.ReplicaDivergenceError as e:
            return str(e)
          return None
        return {"unchecked": train(False), "checked": train(True),
                "device": str(jax.devices()[1])}
        """,
    "pmap": """
        proof, state = new_state("pmap")
        def local(state, x, y):
          grads = jax.grad(lambda p: loss(state, p, x, y))(state.params)
          return state.apply_gradients(grads=jax.lax.pmean(grads, "devices"))
        replicated = jax.tree.map(lambda v: jnp.stack([jnp.asarray(v)] * N), state)
        return run(proof.jit(jax.pmap(local, axis_name="devices")), proof, replicated,
                   x.reshape(N, 8 // N, 16), y.reshape(N, 8 // N), replicas=True)
        """,
}
# Every case on 4 devices; the model-parallel one on 8 as well.
DEVICE_COUNTS = {4: list(CASES), 8: ["model_parallel"]}


def run_cases(devices: int, names: list[str]) -> tuple[dict, str]:
  """Runs the named cases, in order, in one process with ``devices`` CPU devices; returns
  each case's result (or its traceback) and the process's stderr."""
  script = PRELUDE + "".join(
      f"\ndef case_{name}():\n" + textwrap.indent(textwrap.dedent(CASES[name]), "  ")
      for name in names) + textwrap.dedent(f"""
      results = {{}}
      for name in {names!r}:
        try:
          results[name] = {{"result": globals()["case_" + name]()}}
        except Exception:  # each case fails on its own
          results[name] = {{"error": traceback.format_exc()}}
      print(json.dumps(results))
      """)
  result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "ZKDV_TEST_DEVICES": str(devices)})
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


class ShardingTest(absltest.TestCase):
  """On 4 forced CPU devices; the model-parallel case on 8 as well."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.results, cls.stderr = {}, {}
    for devices, names in DEVICE_COUNTS.items():
      cls.results[devices], cls.stderr[devices] = run_cases(devices, names)

  def result(self, case: str, devices: int = 4):
    outcome = self.results[devices][case]
    self.assertNotIn("error", outcome, outcome.get("error"))
    return outcome["result"]

  def assert_verified(self, result):
    self.assertEqual(result["verdict"], "verified", result)
    # Three update checks, and for sharded params the opening of the last post-state
    # that final_params is derived from.
    self.assertIn(len(result["checks"]), (3, 4))
    self.assertEqual(set(result["checks"]), {"verified"})
    self.assertEqual(result["failed"], [])
    self.assertTrue(result["close"], "sharded training differs from the unsharded run")

  def test_commitments_never_gather_a_sharded_array_to_one_device(self):
    for devices, stderr in self.stderr.items():
      self.assertNotIn("involuntary full rematerialization", stderr.lower(),
                       f"{devices} devices: {stderr[-3000:]}")

  def test_mesh_with_in_shardings(self):
    result = self.result("mesh")
    self.assert_verified(result)
    # A verifier with one device cannot replay it, and says how many it needs.
    report = verify.verify(result["path"])
    self.assertEqual(report.verdict, verify.UNVERIFIABLE)
    self.assertIn("exported for 4 devices", report.dumps())

  def test_placed_inputs_without_in_shardings(self):
    result = self.result("placed")
    self.assert_verified(result)
    programs = testing.records_of(result["path"], "program")
    self.assertEqual(programs[0]["nr_devices"], 4)
    kernel = next(l for l in programs[0]["state_layout"] if l["path"].endswith("['kernel']"))
    self.assertLen(kernel["pieces"], 2)
    # Each program's post-state is laid out as it placed it, and the next takes it from there.
    for before, after in zip(programs, programs[1:]):
      self.assertEqual(before.get("post_state_layout", before["state_layout"]),
                       after["state_layout"])

  def test_device_digests_of_placed_pieces_commit_what_the_host_commits(self):
    host, device = self.result("placed"), self.result("placed_device")
    self.assert_verified(host)
    fields = ("pre_state", "batch", "post_state", "post_state_leaves")
    steps = [[[r.get(f) for f in fields] for r in testing.records_of(result["path"], "step")]
             for result in (host, device)]
    self.assertLen(steps[0], 3)
    self.assertEqual(steps[1], steps[0])
    pieces = testing.records_of(device["path"], "step")[-1]["post_state_leaves"]
    self.assertGreater(max(map(len, pieces)), 1)  # some leaves committed shard by shard

  def test_shard_map_gradients(self):
    self.assert_verified(self.result("shard_map"))

  def test_model_parallel_params_are_committed_by_shard(self):
    for devices in DEVICE_COUNTS:
      with self.subTest(devices=devices):
        result = self.result("model_parallel", devices)
        self.assert_verified(result)
        program = testing.records_of(result["path"], "program")[0]
        kernel = next(l for l in program["state_layout"] if l["path"].endswith("['kernel']"))
        self.assertLen(kernel["pieces"], devices // 2)
        self.assertEqual([len(p) for p in testing.records_of(result["path"], "final")[0][
            "final_state_leaves"]], [len(l.get("pieces", [0])) for l in program["state_layout"]])
        # One shard of one opened leaf tampered with: the report names the leaf and the shard.
        self.assertEqual(result["tampered_leaf"], kernel["path"])
        self.assertEqual(result["tampered_verdict"], "invalid")
        self.assertIn(kernel["path"], result["tampered_report"])
        self.assertIn(f"shard {devices // 2 - 1}", result["tampered_report"])

  def test_diverged_replica_is_reported_when_replicas_are_cross_checked(self):
    result = self.result("replicas")
    self.assertIsNone(result["unchecked"])  # replicas are hashed once by default
    self.assertIn("step 0: the replica of .params['Dense_0']['bias']", result["checked"])
    self.assertIn(f"on {result['device']} differs", result["checked"])

  def test_pmap_data_parallel_with_replicated_state(self):
    self.assert_verified(self.result("pmap"))


if __name__ == "__main__":
  absltest.main()
