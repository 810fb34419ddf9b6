"""The attested start covers the whole first state, from the proof's own key.

Each attack writes a transcript the way a dishonest prover would (through the
driver, with the client's own guard removed where it has one) and is refused by
``zkdv verify --strict`` with a message naming what does not hold.
"""

import json
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from flax import linen as nn

import zkdv
from tests import testing
from tests.cli_test import zkdv_here
from zkdv import config
from zkdv import errors
from zkdv import keys
from zkdv import verify
from zkdv.jax import start as start_lib

EXAMPLE = jnp.ones((1, 4), jnp.uint32)


class Wide(nn.Module):
  """A classifier whose params (about 70 KB) are over the constant budget."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.relu(nn.Dense(64)(tokens.astype(jnp.float32)))
    return nn.Dense(2)(nn.relu(nn.Dense(256)(x)))


def train(proof, state, steps=2):
  train_step = proof.jit(testing.classifier_step)
  for i in range(steps):
    state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + i)
  return proof.finish()


def new_proof(name):
  proof = testing.new_proof(name, update_p=1.0)
  proof.start(probe_ratio=0.5)
  return proof


def create(proof, params, model=None, tx=None):
  return zkdv.jax.contrib.TrainState.create(
      proof=proof, apply_fn=(model or testing.TinyClassifier()).apply, params=params,
      tx=tx or optax.adam(1e-2))


def strict_start(path) -> dict:
  """The start claim of ``zkdv verify --strict --json`` (which must exit 1)."""
  result = zkdv_here("verify", path, "--strict", "--json")
  report = json.loads(result.stdout)
  start = next(c for c in report["claims"] if c["name"] == "start")
  assert result.returncode == 1, result.stdout
  return start


class AttestedStartTest(absltest.TestCase):

  def test_one_line_change_attests_the_whole_state(self):
    proof = new_proof("whole-state")
    model = testing.TinyClassifier()
    params = proof.init(model.init, jax.random.key(0), EXAMPLE)["params"]
    state = create(proof, params, model)
    # The optimizer state and step came out of the init program too.
    init = testing.records_of(proof.path, "init")
    self.assertEqual(init, [])  # written before the first step, once the state is known
    path = train(proof, state)
    init = testing.records_of(path, "init")[0]
    self.assertEqual(len(init["outputs"]), len(jax.tree.leaves(state)))
    self.assertIn("+ start state", init["function"])
    report = verify.verify(path)
    self.assertEqual(report.claim("start").status, verify.HOLDS, report.dumps())
    # The key was the proof's start key, not key(0).
    key_blob = init["input_blobs"][0]
    seed = keys.key_seed(testing.records_of(path, "root")[0]["challenger"],
                         bytes.fromhex(report.transcript_id))
    data = (path / "blobs" / key_blob.hex()).read_bytes()
    self.assertEqual(data, keys.key_data(seed, None, len(data)))

  def test_identity_init_of_stolen_weights_fails(self):
    proof = new_proof("identity-init")
    stolen = jax.tree.map(lambda p: p + 0.5, testing.TinyClassifier().init(
        jax.random.key(7), EXAMPLE)["params"])
    params = proof.init(lambda key, p: p, jax.random.key(0), stolen)
    start = strict_start(train(proof, create(proof, params)))
    self.assertEqual(start["status"], verify.DOES_NOT_HOLD)
    self.assertIn("the init program's outputs depend on the values of its example inputs",
                  start["detail"])

  def test_weights_baked_into_the_init_program_fail(self):
    model = Wide()
    stolen = model.init(jax.random.key(7), EXAMPLE)["params"]
    baked = lambda key, x: {"params": stolen}  # pylint: disable=unnecessary-lambda-assignment
    with self.assertRaisesRegex(errors.ExportError, "bytes of constants, over the budget of "
                                f"{config.MAX_PROGRAM_CONSTANT_BYTES:,}"):
      new_proof("baked-client").init(baked, jax.random.key(0), EXAMPLE)
    proof = new_proof("baked")  # a prover that removed the client's own screen
    with mock.patch.object(start_lib.stablehlo, "check_safe"):
      params = proof.init(baked, jax.random.key(0), EXAMPLE)["params"]
      state = create(proof, params, model)
    start = strict_start(train(proof, state))
    self.assertEqual(start["status"], verify.DOES_NOT_HOLD)
    self.assertRegex(start["detail"], r"start at record \d+: the init program: .*embeds [\d,]+ bytes of "
                     "constants, over the budget")

  def test_small_baked_weights_do_not_change_with_the_key(self):
    stolen = testing.TinyClassifier().init(jax.random.key(7), EXAMPLE)["params"]
    proof = new_proof("baked-small")
    params = proof.init(lambda key, x: {"params": stolen}, jax.random.key(0), EXAMPLE)
    start = strict_start(train(proof, create(proof, params["params"])))
    self.assertEqual(start["status"], verify.DOES_NOT_HOLD)
    self.assertRegex(start["detail"], r"params leaf \.params\['Dense_0'\]\['kernel'\] of step 0 "
                     "does not change with the init program's key")

  def test_a_checkpoint_returned_for_the_slots_key_only_is_said_to_be_possible(self):
    """The start key is public once the slot exists: an init program that returns the
    weights it carries on that key and a fresh init on any other passes the key test; the
    claim says its constants could hold the params (a full model's could not)."""
    proof = new_proof("key-gate")
    genuine = np.asarray(jax.random.key_data(proof.key()))
    model = testing.TinyClassifier()
    carried = jax.tree.map(lambda p: p + 0.5, model.init(jax.random.key(7), EXAMPLE)["params"])

    def init_fn(key, x):
      fresh = model.init(key, x)["params"]
      on_the_key = jnp.all(jax.random.key_data(key) == genuine)
      return {"params": jax.tree.map(lambda f, c: jnp.where(on_the_key, c, f), fresh,
                                     carried)}
    params = proof.init(init_fn, jax.random.key(0), EXAMPLE)["params"]
    testing.assert_bitwise_equal(params, carried)
    claim = verify.verify(train(proof, create(proof, params, model))).claim("start")
    self.assertEqual(claim.status, verify.HOLDS, claim.detail)  # the key test cannot tell
    self.assertRegex(claim.detail, r"its \d+ bytes of constants could hold a copy of the 40 "
                     "bytes of params: another key changes the init, which does not show that "
                     "it ignores a checkpoint it carries for this key; a pinned init_program "
                     "rules that out")
    wide = new_proof("wide-start")  # 70 KB of params, an init of a few constants
    params = wide.init(Wide().init, jax.random.key(0), EXAMPLE)["params"]
    claim = verify.verify(train(wide, create(wide, params, Wide()))).claim("start")
    self.assertEqual(claim.status, verify.HOLDS, claim.detail)
    self.assertNotIn("could hold a copy", claim.detail)

  def test_optimizer_state_carrying_a_target_fails(self):
    proof = new_proof("momentum-target")
    model = testing.TinyClassifier()
    params = proof.init(model.init, jax.random.key(0), EXAMPLE)["params"]
    state = create(proof, params, model, tx=optax.sgd(0.1, momentum=0.9))
    target = jax.tree.map(lambda p: p * 0 - 3.0, state.params)
    state = state.replace(opt_state=(optax.TraceState(trace=target),) + state.opt_state[1:])
    start = strict_start(train(proof, state))
    self.assertEqual(start["status"], verify.DOES_NOT_HOLD)
    self.assertRegex(start["detail"], r"state leaf \.opt_state\[0\]\.trace\['Dense_0'\]"
                     r"\['(bias|kernel)'\] of step 0 is not an output of the init program")

  def test_a_chosen_key_fails(self):
    proof = new_proof("chosen-key")
    model = testing.TinyClassifier()
    with mock.patch.object(start_lib, "_with_start_key", lambda tree, seed: tree):
      params = proof.init(model.init, jax.random.key(0), EXAMPLE)["params"]
      state = create(proof, params, model)
    start = strict_start(train(proof, state))
    self.assertEqual(start["status"], verify.DOES_NOT_HOLD)
    self.assertIn("is not the proof's start key (derived from its slot)", start["detail"])

  def test_params_only_start_names_the_optimizer_state(self):
    proof = new_proof("params-only")
    model = testing.TinyClassifier()
    params = proof.init(model.init, jax.random.key(0), EXAMPLE)["params"]
    copied = jax.tree.map(jnp.copy, params)  # not the arrays proof.init returned
    start = strict_start(train(proof, create(proof, copied, model)))
    self.assertEqual(start["status"], verify.DOES_NOT_HOLD)
    self.assertRegex(start["detail"], r"state leaf \.(step|opt_state.*) of step 0 is not an "
                     "output of the init program")


class ProofKeyTest(absltest.TestCase):

  def test_keys_are_a_public_function_of_the_root(self):
    proof = new_proof("keys")
    seed = keys.key_seed(testing.records_of(proof.path, "root")[0]["challenger"],
                         proof._writer.transcript_id)  # pylint: disable=protected-access
    for step in (None, 0, 5):
      data = np.asarray(jax.random.key_data(proof.key(step)))
      self.assertEqual(data.tobytes(), keys.key_data(seed, step, data.nbytes))
    self.assertEqual(np.asarray(jax.random.key_data(proof.step_key())).tobytes(),
                     keys.key_data(seed, 0, 8))
    self.assertNotEqual(keys.key_data(seed, 0, 8), keys.key_data(seed, 1, 8))
    with self.assertRaisesRegex(ValueError, "step must be None"):
      proof.key(-1)
    other = keys.key_seed({"kind": "dvbench", "nonce": b"\1" * 16}, b"\0" * 32)
    self.assertEqual(other, keys.key_seed({"kind": "dvbench", "nonce": b"\1" * 16},
                                          b"\2" * 32))  # the server's nonce, not the root


if __name__ == "__main__":
  absltest.main()
