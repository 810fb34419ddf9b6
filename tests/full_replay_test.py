"""Full replay on a real `dvbench serve`: the tutorial model, every batch and the attested
start uploaded, every step re-executed by a worker; one faked step is caught.

The 200-step run is ``benchmarks/full_replay.py`` (timings in benchmarks/RESULTS.md).
"""

import jax
import jax.numpy as jnp
import optax
from absl.testing import absltest

import dvbench
import zkdv
from dvbench.server.local import LocalServer
from tests import testing

STEPS = 24


def train(experiment, steps: int, fake_at: int | None = None, segment_length: int = 4):
  """The tutorial model through ``experiment.proof`` with its start attested; step
  ``fake_at`` returns weights the program did not compute (the prover's own bytes)."""
  proof = experiment.proof(config=zkdv.ZKDVConfig(
      sampling_policy=zkdv.SamplingPolicy(full_replay=True), segment_length=segment_length))
  proof.start(rolling_window=8)
  model = testing.TinyClassifier()
  params = proof.init(model.init, jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
  state = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply, params=params,
                                             tx=optax.adam(1e-2))
  train_step = proof.jit(testing.classifier_step, donate_argnums=0)
  batch = jnp.asarray(testing.TUTORIAL_BATCH)
  for t in range(steps):
    state = train_step(state, batch + (t % 2))
    if t == 0 and fake_at is not None:
      _fake_step(proof, fake_at)
  proof.finish()
  return proof


def _fake_step(proof, index: int) -> None:
  """Makes step ``index`` of the proof's program add 1 to its first post-state leaf."""
  program = proof._dispatcher._last_program  # pylint: disable=protected-access
  honest, calls = program.executable, [1]  # step 0 already ran

  def faked(*leaves):
    outs = list(honest(*leaves))
    if calls[0] == index:
      first = program.post_indices[0]
      outs[first] = outs[first] + 1
    calls[0] += 1
    return outs

  program.executable = faked


class FullReplayTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=1, extra_args=(  # every step probed: none by chance
        "--full-replay", "--min-probe-ratio", "0.03125")).start()
    cls.client = dvbench.Client(cls.server.url, token=cls.server.token("alice"))

  @classmethod
  def tearDownClass(cls):
    cls.client.close()
    cls.server.stop()
    super().tearDownClass()

  def test_every_step_is_replayed_from_the_attested_start(self):
    proof = train(self.client.experiment("alice/full"), STEPS)
    self.assertEqual(proof.checks["update"], STEPS // 4)  # every segment opened
    status = self.client.wait_for_verdict(proof.proof_id, 240)
    self.assertEqual(status["state"], "verified", status)
    self.assertTrue(status["full_replay"], status)
    self.assertIn("verified (full replay)", status["label"])
    self.assertEqual(status["policy"]["update_check_probability"], 1.0)
    self.assertEqual(status["server_challenges"]["update_replayed"], STEPS // 4)
    self.assertEqual(status["escape_probability_one_faked_step"], 0.0)

  def test_a_single_faked_step_is_caught(self):
    proof = train(self.client.experiment("alice/faked"), STEPS, fake_at=13)
    status = self.client.wait_for_verdict(proof.proof_id, 240)
    self.assertEqual(status["state"], "invalid", status)
    self.assertFalse(status["full_replay"])
    # Step 13 lies in the segment 12..15: its replay cannot reach the committed end.
    self.assertIn("update check of step 15", status["failure"])
    self.assertIn("does not reproduce the committed post-state", status["failure"])

  def test_a_root_asking_for_less_than_full_replay_is_raised_to_it(self):
    experiment = self.client.experiment("alice/raised")
    proof = experiment.proof(config=zkdv.ZKDVConfig(
        sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.1)))
    proof.start()
    self.assertTrue(proof.policy.full_replay)
    self.assertEqual(proof.policy.update_check_probability, 1.0)
    proof.abandon()


if __name__ == "__main__":
  absltest.main()
