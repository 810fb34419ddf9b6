"""No unprobed data channel: PRNG-key leaves are derived, scalars bounded and opened by every
probe, row groups fixed by the protocol. Each attack is a proof a dishonest prover writes
through the driver; ``zkdv verify --strict`` refuses it naming what does not hold."""

import json
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from tests import testing
from tests.cli_test import zkdv_here
from zkdv import config
from zkdv import verify
from zkdv.jax import arrays

# Rows of an evaluation set (4 tokens and a label each), what a prover must not train on.
EVAL_ROWS = np.asarray([[1, 0, 0, 1, 1], [0, 0, 1, 1, 0], [1, 1, 0, 0, 1], [0, 1, 1, 1, 0]],
                       np.uint32)


def keyed_step(state, batch, key):
  """The tutorial's step, reading ``key`` as a dropout mask would (all rows kept)."""
  keep = jax.random.uniform(key.reshape(-1)[0] if key.ndim else key, batch.shape) >= 0.0
  return testing.classifier_step(state, batch * keep.astype(batch.dtype))


def strict(path) -> dict:
  result = zkdv_here("verify", path, "--strict", "--json")
  assert result.returncode == 1, result.stdout
  return json.loads(result.stdout)


def claim(report: dict, name: str) -> dict:
  return next(c for c in report["claims"] if c["name"] == name)


def new_proof(name):
  proof = testing.new_proof(name, update_p=1.0)
  proof.start(probe_ratio=0.5)
  return proof


class KeyLeafTest(absltest.TestCase):

  def _run(self, key_for):
    proof = new_proof("keys")
    state = testing.classifier_state(proof)
    train_step = proof.jit(keyed_step)
    for i in range(2):
      state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + i, key_for(proof, i))
    return proof.finish()

  def test_the_proofs_step_key_verifies(self):
    report = verify.verify(self._run(lambda proof, i: proof.step_key()))
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    self.assertEqual(report.claim("data").status, verify.HOLDS)

  def test_eval_rows_in_a_key_leaf_fail(self):
    smuggled = lambda proof, i: jax.random.wrap_key_data(  # pylint: disable=unnecessary-lambda-assignment
        jnp.asarray(EVAL_ROWS[:, :4].reshape(-1, 2)))
    report = strict(self._run(smuggled))
    self.assertEqual(report["verdict"], verify.INVALID)
    data = claim(report, "data")
    self.assertEqual(data["status"], verify.DOES_NOT_HOLD)
    self.assertRegex(data["detail"], r"batch_key at .*: PRNG-key leaf \S+ of step 0 is not the "
                     r"proof's key of step 0 \(proof.key\(0\)\)")

  def test_a_key_of_the_provers_own_fails(self):
    report = strict(self._run(lambda proof, i: jax.random.fold_in(jax.random.key(3), i)))
    self.assertIn("is not the proof's key of step 0", claim(report, "data")["detail"])


class ScalarLeavesTest(absltest.TestCase):

  def test_rows_in_40_scalar_leaves_fail(self):
    proof = new_proof("scalars")
    state = testing.classifier_state(proof)

    @proof.jit
    def train_step(state, batch, *scalars):
      return testing.classifier_step(state, batch + 0 * jnp.stack(scalars).sum().astype(
          jnp.uint32))

    scalars = [jnp.float32(v) for v in np.resize(EVAL_ROWS.reshape(-1), 40)]  # two copies
    state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH), *scalars)
    report = strict(proof.finish())
    self.assertEqual(report["verdict"], verify.INVALID)
    data = claim(report, "data")
    self.assertEqual(data["status"], verify.DOES_NOT_HOLD)
    self.assertIn("the batch carries 160 bytes in 40 scalar leaves", data["detail"])
    self.assertIn(f"over the budget of {config.MAX_SCALAR_BATCH_BYTES} bytes a step",
                  data["detail"])

  def test_a_few_scalars_are_opened_by_every_probe(self):
    proof = new_proof("lr")
    state = testing.classifier_state(proof)

    @proof.jit
    def train_step(state, batch, scale):
      return testing.classifier_step(state, batch * scale.astype(jnp.uint32))

    for _ in range(2):
      state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH), jnp.float32(1.0))
    path = proof.finish()
    report = verify.verify(path)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    probes = [r for r in testing.records_of(path, "check") if r["kind"] == "probe"]
    self.assertLen(probes, 2)
    for record in probes:  # leaf 1 (the scalar) is opened, row 0
      self.assertIn(1, [entry[0] for entry in record["probes"]])


class RowGroupTest(absltest.TestCase):

  def test_a_prover_chosen_row_group_fails(self):
    proof = new_proof("row-group")
    state = testing.classifier_state(proof)
    train_step = proof.jit(testing.classifier_step)
    with mock.patch.object(arrays.digest, "row_group_for", lambda layout, boundaries=(): 1):
      for i in range(2):
        state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + i)
      path = proof.finish()
    report = strict(path)
    self.assertEqual(report["verdict"], verify.INVALID)
    self.assertIn("row_group 1 of [0][1]: the protocol groups 4 rows of its layout uint32[4, 5]",
                  json.dumps(report["findings"]))


if __name__ == "__main__":
  absltest.main()
