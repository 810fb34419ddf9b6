"""Every sampled check replays bitwise-equal: optimizers x models; donation.

The tests that also run the verifier are in ``ExactReplayVerifiedTest``.
"""

import jax
import jax.numpy as jnp
import optax
from absl.testing import absltest
from absl.testing import parameterized
from flax.training import train_state as flax_train_state

import zkdv
from tests import testing
from zkdv import verify

STEPS = 3


def _mlp_setup(proof, tx):
  model = testing.MLP(width=512)
  params = model.init(jax.random.key(0), jnp.ones((1, 64)))["params"]
  state = zkdv.jax.contrib.TrainState.create(
      proof=proof, apply_fn=model.apply, params=params, tx=tx)
  x = jax.random.normal(jax.random.key(1), (32, 64))
  y = jnp.arange(32) % 10

  def step(state, x, y):
    def loss(p):
      return optax.softmax_cross_entropy_with_integer_labels(
          state.apply_fn({"params": p}, x), y).mean()
    return state.apply_gradients(grads=jax.grad(loss)(state.params))
  return state, step, lambda i: (x + i, y)


def _dense_setup(proof, tx):
  state = testing.classifier_state(proof, tx=tx)
  batch = jnp.asarray(testing.TUTORIAL_BATCH)
  return state, testing.classifier_step, lambda i: (batch,)


def _cnn_setup(proof, tx):
  model = testing.CNN()
  variables = model.init(jax.random.key(0), jnp.ones((2, 8, 8, 1)), train=False)
  state = testing.BatchStatsState.create(
      proof=proof, apply_fn=model.apply, params=variables["params"], tx=tx,
      batch_stats=variables["batch_stats"])
  x = jax.random.normal(jax.random.key(2), (16, 8, 8, 1))
  y = jnp.arange(16) % 10

  def step(state, x, y, key):
    def loss(p):
      logits, updates = state.apply_fn(
          {"params": p, "batch_stats": state.batch_stats}, x,
          mutable=["batch_stats"], rngs={"dropout": key})
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates
    grads, updates = jax.grad(loss, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
  return state, step, lambda i: (x, y, proof.key(i))  # dropout: the proof's key of step i


MODELS = {"dense": _dense_setup, "mlp512": _mlp_setup, "cnn_bn_dropout": _cnn_setup}


def _train(model: str, optimizer: str, donate: bool, update_p: float = 1.0, state_p: float = 0.5,
           overlap=zkdv.overlap.UNCHECKED, on_step=None):
  """STEPS steps of ``model``; ``on_step(inputs, outputs)`` sees each call's states."""
  proof = testing.new_proof(f"{model}-{optimizer}", update_p=update_p, state_p=state_p)
  proof.start()
  state, step, batch_for = MODELS[model](proof, testing.OPTIMIZERS[optimizer]())
  state = state.replace(zkdv_overlap=overlap)
  train_step = proof.jit(step, donate_argnums=(0,) if donate else ())
  for i in range(STEPS):
    new_state = train_step(state, *batch_for(i))
    if on_step is not None:
      on_step(state, new_state)
    state = new_state
  proof.finish()
  return proof, state


def _assert_all_checks_exact(test, proof) -> None:
  test.assertEqual(proof.steps, STEPS)
  test.assertEqual(proof.checks["update"], STEPS)
  test.assertEqual(proof.failed_checks, [])
  checks = [r for r in testing.records_of(proof.path, "check") if r["kind"] == "update"]
  test.assertLen(checks, STEPS)
  for c in checks:
    test.assertEqual(c["result"]["mode"], "exact")
    test.assertTrue(c["result"]["equal"], c["result"])
    test.assertEqual(c["result"]["max_ulp_error"], 0)


class ExactReplayTest(parameterized.TestCase):

  @parameterized.product(donate=[True, False], checked=[True, False])
  def test_donated_state_is_deleted_unless_the_step_is_opened(self, donate, checked):
    """An update check opens the step's inputs as zero-copy views, and JAX does not
    donate a viewed buffer: a checked step keeps its inputs, an unchecked one
    gives its donated inputs up (NEVER: no view of an earlier step is alive)."""
    deleted = []

    def on_step(state, new_state):
      deleted.append({x.is_deleted() for x in jax.tree.leaves(state) if isinstance(x, jax.Array)})
      self.assertFalse(any(x.is_deleted() for x in jax.tree.leaves(new_state)))

    # No state checks: an opened post-state is a view too, and is kept for the same reason.
    proof, _ = _train("mlp512", "adafactor", donate=donate, update_p=1.0 if checked else 0.0,
                      state_p=0.0, overlap=zkdv.overlap.NEVER, on_step=on_step)
    self.assertEqual(deleted, [{donate and not checked}] * STEPS)
    self.assertEqual(proof.failed_checks, [])
    self.assertEqual(proof.checks["update"], STEPS if checked else 0)

  @parameterized.parameters("adam", "sgd_momentum")
  def test_same_update_as_flax_train_state(self, optimizer):
    """The transition is Flax's: the same params as flax TrainState + jax.jit."""
    _, state = _train("dense", optimizer, donate=False)
    model = testing.TinyClassifier()
    params = model.init(jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
    flax_state = flax_train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=testing.OPTIMIZERS[optimizer]())
    flax_step = jax.jit(testing.classifier_step)
    for _ in range(STEPS):
      flax_state = flax_step(flax_state, jnp.asarray(testing.TUTORIAL_BATCH))
    self.assertEqual(int(state.step), int(flax_state.step))
    testing.assert_bitwise_equal(state.params, flax_state.params)


class ExactReplayVerifiedTest(parameterized.TestCase):

  # Every optimizer on the dense model, and every model with Adam.
  @parameterized.parameters(
      *[("dense", o) for o in sorted(testing.OPTIMIZERS)],
      *[(m, "adam") for m in sorted(MODELS) if m != "dense"])
  def test_every_check_replays_bitwise(self, model, optimizer):
    proof, _ = _train(model, optimizer, donate=True)
    _assert_all_checks_exact(self, proof)
    report = verify.verify(proof.path)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    replayed = [c for c in report.checks if c.kind == "update"]
    self.assertLen(replayed, STEPS)
    self.assertTrue(all(c.status == "verified" and c.mode == "exact" for c in replayed))


if __name__ == "__main__":
  absltest.main()
