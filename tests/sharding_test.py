"""Sharded training on 4 and 8 forced CPU devices (each case in its own process,
since the device count is fixed before JAX starts)."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

from absl.testing import absltest
from absl.testing import parameterized

from tests import testing
from zkdv import transcript
from zkdv import verify

ROOT = pathlib.Path(__file__).resolve().parent.parent

PRELUDE = """
import os, sys, json
N = int(os.environ["ZKDV_TEST_DEVICES"])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={N}"
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import zkdv
from tests import testing
from zkdv import transcript
from zkdv import verify
from tests import testing

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

def new_state(name):
  proof = testing.new_proof(name, update_p=1.0)
  proof.start()
  return proof, testing.zkdv.jax.contrib.TrainState.create(
      proof=proof, apply_fn=model.apply, params=params, tx=optax.adam(1e-3))

def run(step_fn, proof, state, x, y, steps=3, replicas=False):
  for _ in range(steps):
    state = step_fn(state, x, y)
  proof.finish()
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
  print(json.dumps({"verdict": report.verdict, "findings": [f.message for f in report.findings],
                    "checks": [c.status for c in report.checks], "close": close,
                    "path": str(proof.path), "failed": proof.failed_checks}))
"""


def run_case(body: str, devices: int) -> dict:
  script = PRELUDE + textwrap.dedent(body)
  result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "ZKDV_TEST_DEVICES": str(devices)})
  assert result.returncode == 0, result.stderr[-3000:]
  # Commitments never make XLA gather a sharded array to one device.
  assert "involuntary full rematerialization" not in result.stderr.lower(), result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


class ShardingTest(parameterized.TestCase):
  """On 4 forced CPU devices; the model-parallel case on 8 as well."""

  def assert_verified(self, result):
    self.assertEqual(result["verdict"], "verified", result)
    # Three update checks, and for sharded params the opening of the last post-state
    # that final_params is derived from.
    self.assertIn(len(result["checks"]), (3, 4))
    self.assertEqual(set(result["checks"]), {"verified"})
    self.assertEqual(result["failed"], [])
    self.assertTrue(result["close"], "sharded training differs from the unsharded run")

  @parameterized.parameters((4,))
  def test_mesh_with_in_shardings(self, devices):
    result = run_case("""
        proof, state = new_state("mesh")
        replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        state = jax.device_put(state, replicated)
        step = proof.jit(plain_step, in_shardings=(replicated, rows, rows),
                         out_shardings=replicated, donate_argnums=0)
        run(step, proof, state, jax.device_put(x, rows), jax.device_put(y, rows))
        """, devices)
    self.assert_verified(result)
    # A verifier with one device cannot replay it, and says how many it needs.
    report = verify.verify(result["path"])
    self.assertEqual(report.verdict, verify.UNVERIFIABLE)
    self.assertIn(f"exported for {devices} devices", report.dumps())

  @parameterized.parameters((4,))
  def test_placed_inputs_without_in_shardings(self, devices):
    # Idiomatic JAX: place the state on the mesh and let jit follow; XLA then picks output
    # shardings of its own (some biases come back split), and the next call follows those.
    result = run_case("""
        proof, state = new_state("placed")
        replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        by_column = NamedSharding(mesh, P(None, "model"))
        state = jax.device_put(state, jax.tree.map(
            lambda v: by_column if getattr(v, "ndim", 0) == 2 and v.shape[1] % (N // 2) == 0
            else replicated, state))
        run(proof.jit(plain_step, donate_argnums=0), proof, state,
            jax.device_put(x, rows), jax.device_put(y, rows))
        """, devices)
    self.assert_verified(result)
    programs = testing.records_of(result["path"], "program")
    self.assertEqual(programs[0]["nr_devices"], devices)
    kernel = next(l for l in programs[0]["state_layout"] if l["path"].endswith("['kernel']"))
    self.assertLen(kernel["pieces"], devices // 2)
    # Each program's post-state is laid out as it placed it, and the next takes it from there.
    for before, after in zip(programs, programs[1:]):
      self.assertEqual(before.get("post_state_layout", before["state_layout"]),
                       after["state_layout"])

  @parameterized.parameters((4,))
  def test_shard_map_gradients(self, devices):
    result = run_case("""
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

        run(proof.jit(step), proof, state, x, y)
        """, devices)
    self.assert_verified(result)

  @parameterized.parameters((4,), (8,))
  def test_model_parallel_params_are_committed_by_shard(self, devices):
    result = run_case("""
        proof, state = new_state("model-parallel")
        replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        by_column = NamedSharding(mesh, P(None, "model"))
        shardings = jax.tree.map(
            lambda v: by_column if getattr(v, "ndim", 0) == 2 and v.shape[1] % (N // 2) == 0
            else replicated, state)
        state = jax.device_put(state, shardings)
        step = proof.jit(plain_step, in_shardings=(shardings, rows, rows),
                         out_shardings=shardings, donate_argnums=0)
        run(step, proof, state, jax.device_put(x, rows), jax.device_put(y, rows))
        """, devices)
    self.assert_verified(result)
    program = testing.records_of(result["path"], "program")[0]
    kernel = next(l for l in program["state_layout"] if l["path"].endswith("['kernel']"))
    self.assertLen(kernel["pieces"], devices // 2)
    self.assertEqual([len(p) for p in testing.records_of(result["path"], "final")[0][
        "final_state_leaves"]], [len(l.get("pieces", [0])) for l in program["state_layout"]])
    # Tamper with one shard of one opened leaf: the report names the leaf and the shard.
    check = testing.records_of(result["path"], "check")[0]
    index = [l["path"] for l in program["state_layout"]].index(kernel["path"])
    blob = transcript.blob_path(result["path"], check["pre_state_blobs"][index])
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0x40  # the last column: the last shard
    blob.write_bytes(bytes(data))
    report = run_case(f"""
        report = verify.verify({result["path"]!r})
        print(json.dumps({{"verdict": report.verdict, "text": report.dumps()}}))
        """, devices)
    self.assertEqual(report["verdict"], "invalid")
    self.assertIn(kernel["path"], report["text"])
    self.assertIn(f"shard {devices // 2 - 1}", report["text"])

  @parameterized.parameters((4,))
  def test_diverged_replica_is_reported_when_replicas_are_cross_checked(self, devices):
    result = run_case("""
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
        print(json.dumps({"unchecked": train(False), "checked": train(True),
                          "device": str(jax.devices()[1])}))
        """, devices)
    self.assertIsNone(result["unchecked"])  # replicas are hashed once by default
    self.assertIn("step 0: the replica of .params['Dense_0']['bias']", result["checked"])
    self.assertIn(f"on {result['device']} differs", result["checked"])

  @parameterized.parameters((4,))
  def test_pmap_data_parallel_with_replicated_state(self, devices):
    result = run_case("""
        proof, state = new_state("pmap")
        def local(state, x, y):
          grads = jax.grad(lambda p: loss(state, p, x, y))(state.params)
          return state.apply_gradients(grads=jax.lax.pmean(grads, "devices"))
        replicated = jax.tree.map(lambda v: jnp.stack([jnp.asarray(v)] * N), state)
        run(proof.jit(jax.pmap(local, axis_name="devices")), proof, replicated,
            x.reshape(N, 8 // N, 16), y.reshape(N, 8 // N), replicas=True)
        """, devices)
    self.assert_verified(result)


if __name__ == "__main__":
  absltest.main()
