"""The ZKDV driver: jit options, attest, context manager, overlap, failures."""


import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from absl.testing import parameterized

import zkdv
from tests import testing
from zkdv import errors
from zkdv import verify

BATCH = jnp.asarray(testing.TUTORIAL_BATCH)


def _verified(test, proof, steps):
  report = verify.verify(proof.path)
  test.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
  test.assertEqual(report.steps, steps)
  return report


class JitOptionsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("in_out_shardings", lambda: {
          "in_shardings": jax.sharding.SingleDeviceSharding(jax.devices()[0]),
          "out_shardings": jax.sharding.SingleDeviceSharding(jax.devices()[0])}),
      ("donate_argnames", lambda: {"donate_argnames": ("state",)}),
      ("device", lambda: {"device": jax.devices()[0]}),
      ("backend", lambda: {"backend": "cpu"}),
      ("inline_keep_unused", lambda: {"inline": True, "keep_unused": True}),
      ("compiler_options", lambda: {"compiler_options": {"xla_cpu_enable_fast_math": False}}),
  )
  def test_option_is_accepted_and_checks_replay_exactly(self, options):
    proof = testing.new_proof("options", update_p=1.0)
    proof.start()
    state = testing.classifier_state(proof)
    train_step = proof.jit(**options())(testing.classifier_step)
    for _ in range(3):
      state = train_step(state, BATCH)
    proof.finish()
    self.assertEqual(proof.failed_checks, [])
    _verified(self, proof, 3)

  def test_keyword_arguments_and_extra_outputs(self):
    proof = testing.new_proof("kwargs", update_p=1.0)
    proof.start()
    state = testing.classifier_state(proof)

    @proof.jit
    def train_step(state, *, batch):
      loss, grads = jax.value_and_grad(
          lambda p: testing.classifier_loss(state, batch, p))(state.params)
      return {"loss": loss, "state": state.apply_gradients(grads=grads)}

    losses = []
    for _ in range(4):
      out = train_step(state, batch=BATCH)
      state = out["state"]
      losses.append(float(out["loss"]))
    proof.finish()
    self.assertLess(losses[-1], losses[0])
    program = testing.records_of(proof.path, "program")[0]
    self.assertEqual(program["inputs"].count("batch"), 1)
    _verified(self, proof, 4)


class AttestTest(absltest.TestCase):

  def test_manual_update_function_without_train_state(self):
    proof = testing.new_proof("manual", update_p=1.0)
    proof.start()
    tx = optax.sgd(0.1)
    params = {"w": jnp.ones((4, 2))}
    carry = (params, tx.init(params))

    @proof.attest(state_argnum=1, donate_argnums=1)
    def update(batch, carry):
      params, opt_state = carry
      x = batch[:, :4].astype(jnp.float32)
      loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    for _ in range(3):
      carry, loss = update(BATCH, carry)
    proof.finish()
    self.assertEqual(proof.steps, 3)
    self.assertGreater(float(loss), 0)
    _verified(self, proof, 3)
    with self.assertRaises(errors.AttestedProgramAlreadyRegisteredError):
      other = testing.new_proof("manual-2")
      other.start()
      one = other.attest(lambda s, b: jax.tree.map(lambda v: v + b.sum(), s))
      two = other.attest(lambda s, b: jax.tree.map(lambda v: v - b.sum(), s))
      fresh = {"w": jnp.ones((4, 2))}
      one(fresh, jnp.ones(2))
      two(fresh, jnp.ones(2))


class LifecycleTest(parameterized.TestCase):

  def test_context_manager_starts_and_finishes(self):
    with testing.new_proof("ctx", update_p=1.0) as proof:
      state = testing.classifier_state(proof)
      state = proof.jit(testing.classifier_step)(state, BATCH)
    self.assertEqual(testing.records_of(proof.path, "final")[0]["status"], "clean")
    _verified(self, proof, 1)

  def test_context_manager_on_error_writes_aborted_final(self):
    with self.assertRaisesRegex(RuntimeError, "user code failed"):
      with testing.new_proof("ctx-error") as proof:
        state = testing.classifier_state(proof)
        proof.jit(testing.classifier_step)(state, BATCH)
        raise RuntimeError("user code failed")
    final = testing.records_of(proof.path, "final")
    self.assertLen(final, 1)
    self.assertEqual(final[0]["steps"], 1)

  @parameterized.product(
      policy=[zkdv.overlap.UNCHECKED, zkdv.overlap.ALWAYS, zkdv.overlap.NEVER],
      backend=["host", "device"])
  def test_overlap_policies_give_the_same_training(self, policy, backend):
    proof = testing.new_proof(f"overlap-{policy.value}", update_p=0.5, state_p=0.3,
                              digest_backend=backend)
    proof.start(rolling_window=2)
    state = testing.classifier_state(proof, zkdv_overlap=policy)
    train_step = proof.jit(testing.classifier_step, donate_argnums=0)
    for _ in range(12):
      state = train_step(state, BATCH)
    proof.finish()
    reference = testing.classifier_state(None)
    plain = jax.jit(testing.classifier_step)
    for _ in range(12):
      reference = plain(reference, BATCH)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 state.params, reference.params)
    _verified(self, proof, 12)

  def test_background_failure_surfaces_at_the_next_step_and_finish(self):
    proof = testing.new_proof("failure", update_p=0.0)
    proof.start()
    state = testing.classifier_state(proof)
    train_step = proof.jit(testing.classifier_step, donate_argnums=0)
    state = train_step(state, BATCH)
    proof._pipeline.drain()
    proof._writer._file.close()  # the disk goes away under the pipeline
    with self.assertRaises(errors.CommitmentError):
      for _ in range(5):
        state = train_step(state, BATCH)
    with self.assertRaises(errors.ZKDVError):
      proof.finish()

  def test_rolling_window_bounds_steps_in_flight(self):
    for window in (1, 3):
      proof = testing.new_proof(f"window-{window}", update_p=0.0)
      proof.start(rolling_window=window)
      state = testing.classifier_state(proof, zkdv_overlap=zkdv.overlap.ALWAYS)
      # Without donation nothing else holds training back: only the window does.
      train_step = proof.jit(testing.classifier_step)
      state = train_step(state, BATCH)
      pipeline = proof._pipeline
      pipeline.drain()
      pipeline.submit(lambda job: time.sleep(1.0))  # the commit thread falls behind
      seen = []
      for _ in range(6):
        state = train_step(state, BATCH)
        seen.append(pipeline.in_flight)
      self.assertEqual(max(seen), window)  # training ran ahead, but no further
      proof.finish()
      _verified(self, proof, 7)


if __name__ == "__main__":
  absltest.main()
