"""The tutorial's common integration errors, and bad input, each provoked."""

import jax
import jax.numpy as jnp
from absl.testing import absltest

import zkdv
from tests import testing
from zkdv import errors
from zkdv import verify

BATCH = jnp.asarray(testing.TUTORIAL_BATCH)


class IntegrationErrorsTest(absltest.TestCase):

  def _started(self, name="errors", **kwargs):
    proof = testing.new_proof(name, **kwargs)
    proof.start()
    return proof

  def _assert_transcript_intact(self, proof, steps):
    """The error lost nothing: the transcript still verifies with its steps."""
    proof.finish()
    report = verify.verify(proof.path)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    self.assertEqual(report.steps, steps)

  def test_no_transcript_update_when_step_uses_jax_jit(self):
    proof = self._started()
    state = testing.classifier_state(proof)
    train_step = jax.jit(testing.classifier_step)
    state = train_step(state, BATCH)
    self.assertEqual(int(state.step), 1)
    with self.assertRaisesRegex(errors.NoTranscriptUpdateError,
                                r"proof\.jit.*jax\.jit|jax\.jit.*proof\.jit") as cm:
      proof.finish()
    self.assertIn("Decorate the function containing apply_gradients() with proof.jit",
                  str(cm.exception))
    with self.assertRaises(errors.NoTranscriptUpdateError):
      proof.finish()  # idempotent: the same answer
    final = testing.records_of(proof.path, "final")
    self.assertLen(final, 1)
    self.assertEqual(final[0]["status"], "aborted")

  def test_no_transcript_update_when_proof_jit_step_applies_nothing(self):
    proof = self._started()
    state = testing.classifier_state(proof)
    loss_step = proof.jit(lambda s, b: s.replace(params=s.params))
    with self.assertRaisesRegex(errors.NoTranscriptUpdateError, "apply_gradients"):
      loss_step(state, BATCH)

  def test_proof_identity_error(self):
    proof, other = self._started("a"), self._started("b")
    state = testing.classifier_state(other)
    train_step = proof.jit(testing.classifier_step)
    with self.assertRaisesRegex(errors.ProofIdentityError,
                                "Use the exact proof instance returned"):
      train_step(state, BATCH)
    good = testing.classifier_state(proof)
    train_step(good, BATCH)
    self._assert_transcript_intact(proof, 1)

  def test_attested_program_already_registered(self):
    proof = self._started()
    state = testing.classifier_state(proof)
    manual = proof.attest(testing.classifier_step)
    with self.assertRaisesRegex(errors.AttestedProgramAlreadyRegisteredError,
                                "Remove the manual proof.attest function"):
      manual(state, BATCH)

  def test_attest_and_train_state_on_one_proof(self):
    proof = self._started()
    params = {"w": jnp.ones((4, 2))}

    @proof.attest
    def manual_step(params, batch):
      g = jax.grad(lambda p: jnp.sum((batch[:, :4].astype(jnp.float32) @ p["w"]) ** 2))(params)
      return jax.tree.map(lambda p, g: p - 0.1 * g, params, g)

    params = manual_step(params, BATCH)
    train_step = proof.jit(testing.classifier_step)
    with self.assertRaises(errors.AttestedProgramAlreadyRegisteredError):
      train_step(testing.classifier_state(proof), BATCH)
    self._assert_transcript_intact(proof, 1)

  def test_static_argument_error(self):
    proof = self._started()
    state = testing.classifier_state(proof)

    @proof.jit(static_argnums=(2,))
    def train_step(state, batch, scale):
      grads = jax.grad(lambda p: scale * testing.classifier_loss(state, batch, p))(state.params)
      return state.apply_gradients(grads=grads)

    state = train_step(state, BATCH, 1.0)
    with self.assertRaisesRegex(errors.StaticArgumentError,
                                "Keep their values unchanged.*dynamic input"):
      train_step(state, BATCH, 2.0)
    state = train_step(state, BATCH, 1.0)
    self._assert_transcript_intact(proof, 2)

  def test_export_failure_names_the_primitive(self):
    proof = self._started()
    model = testing.TinyClassifier()
    state = testing.classifier_state(proof)
    state = state.replace(apply_fn=lambda v, t: testing.opaque_kernel(model.apply(v, t)))
    train_step = proof.jit(testing.classifier_step)
    with self.assertRaisesRegex(errors.ExportError,
                                r"(?s)callback.*attest_apply_fn"):
      train_step(state, BATCH)

  def test_attest_apply_fn_makes_non_exportable_model_checkable(self):
    proof = self._started(update_p=1.0)
    model = testing.TinyClassifier()
    fast = lambda v, t: testing.opaque_kernel(model.apply(v, t))
    state = testing.classifier_state(proof).replace(apply_fn=fast,
                                                    attest_apply_fn=model.apply)
    train_step = proof.jit(testing.classifier_step)
    for _ in range(3):
      state = train_step(state, BATCH)
    proof.finish()
    checks = testing.records_of(proof.path, "check")
    self.assertLen(checks, 3)
    self.assertTrue(all(c["result"]["mode"] == "equivalent" and c["result"]["equal"]
                        for c in checks))
    report = verify.verify(proof.path)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    self.assertTrue(all(c.mode == "equivalent" for c in report.checks))

  def test_wrong_mismatched_attest_apply_fn_fails_the_check(self):
    proof = self._started(update_p=1.0)
    model = testing.TinyClassifier()
    state = testing.classifier_state(proof, attest_apply_fn=lambda v, t: 2 * model.apply(v, t))
    train_step = proof.jit(testing.classifier_step)
    state = train_step(state, BATCH)
    with self.assertRaisesRegex(errors.ReplayError, "step 0"):
      proof.finish()
    report = verify.verify(proof.path)
    self.assertEqual(report.verdict, verify.INVALID)
    self.assertIn("replay", {f.code for f in report.findings})

  def test_non_train_state_is_refused(self):
    proof = self._started()
    train_step = proof.jit(lambda params, batch: params)
    with self.assertRaisesRegex(errors.StepInputError,
                                "zkdv.jax.contrib.TrainState.create"):
      train_step({"w": jnp.ones(3)}, BATCH)

  def test_step_returning_no_state_is_refused(self):
    proof = self._started()
    state = testing.classifier_state(proof)
    train_step = proof.jit(lambda s, b: testing.classifier_step(s, b).params)
    with self.assertRaisesRegex(errors.StepOutputError, "must return the updated state"):
      train_step(state, BATCH)
    good = proof.jit(testing.classifier_step)
    good(state, BATCH)
    self._assert_transcript_intact(proof, 1)

  def test_update_inside_scan_is_refused(self):
    proof = self._started()
    state = testing.classifier_state(proof)

    @proof.jit
    def two_updates(state, batch):
      def body(s, _):
        return testing.classifier_step(s, batch), None
      return jax.lax.scan(body, state, None, length=2)[0]

    with self.assertRaisesRegex(errors.UnsupportedUpdateError, "optax.MultiSteps"):
      two_updates(state, BATCH)

  def test_step_before_start_starts_with_defaults_and_after_finish_fails(self):
    proof = testing.new_proof("lifecycle")
    train_step = proof.jit(testing.classifier_step)
    state = testing.classifier_state(proof)
    state = train_step(state, BATCH)
    root = testing.records_of(proof.path, "root")[0]
    self.assertEqual(root["challenger"]["policy"], {
        "update_check_probability": 1.0, "state_check_probability": 0.0,
        "probe_ratio": 0.0, "rolling_window": 16, "segment_length": 16, "full_replay": False})
    with self.assertRaisesRegex(errors.ProofStateError, "already started"):
      proof.start()
    path = proof.finish()
    self.assertEqual(proof.finish(), path)
    with self.assertRaisesRegex(errors.ProofStateError, "finished"):
      train_step(state, BATCH)

  def test_bad_config_values(self):
    with self.assertRaises(ValueError):
      zkdv.SamplingPolicy(update_check_probability=1.5)
    with self.assertRaises(TypeError):
      zkdv.SamplingPolicy(update_check_probability="often")
    with self.assertRaises(ValueError):
      zkdv.ZKDVConfig(digest_backend="gpu-magic")
    proof = testing.new_proof("bad-start")
    with self.assertRaisesRegex(ValueError, "probe_ratio"):
      proof.start(probe_ratio=2.0)
    with self.assertRaisesRegex(ValueError, "rolling_window"):
      proof.start(rolling_window=0)
    with self.assertRaises(TypeError):
      proof.jit(testing.classifier_step, not_a_jit_option=1)

  def test_output_dir_is_never_overwritten(self):
    proof = self._started("first")
    again = zkdv.jax.ZKDV("second", zkdv.ZKDVConfig(output_dir=proof.path))
    with self.assertRaisesRegex(errors.ProofStateError, "never overwritten"):
      again.start()


class DiscontinuityTest(absltest.TestCase):

  def test_plain_jit_step_between_proof_steps_is_a_discontinuity(self):
    proof = testing.new_proof("discontinuity")
    proof.start()
    state = testing.classifier_state(proof)
    proof_step = proof.jit(testing.classifier_step, donate_argnums=0)
    plain_step = jax.jit(testing.classifier_step)
    state = proof_step(state, BATCH)
    state = plain_step(state, BATCH)   # not attested
    state = proof_step(state, BATCH)
    state = proof_step(jax.device_put(state), BATCH)  # same values: continuous
    proof.finish()
    self.assertEqual(proof.discontinuities, [1])
    self.assertEqual(testing.records_of(proof.path, "final")[0]["discontinuities"], [1])
    report = verify.verify(proof.path)
    self.assertEqual(report.discontinuities, [1])
    self.assertEqual(report.verdict, verify.INVALID)
    self.assertEqual([f.code for f in report.findings], ["discontinuity"])


if __name__ == "__main__":
  absltest.main()
