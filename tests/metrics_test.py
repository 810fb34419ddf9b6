"""Step metrics: a step's outputs beside the state, committed and replayed bit for bit."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from tests import testing
from tests import verify_test
from zkdv import metrics
from zkdv import verify

BATCH = jnp.asarray(testing.TUTORIAL_BATCH)


def step_with_metrics(state, batch):
  """The tutorial step, also returning a loss, a nested accuracy, logits and a NaN."""
  loss, grads = jax.value_and_grad(lambda p: testing.classifier_loss(state, batch, p))(
      state.params)
  logits = state.apply_fn({"params": state.params}, batch[:, :4])
  accuracy = (logits.argmax(-1) == batch[:, 4]).mean()
  return state.apply_gradients(grads=grads), {
      "loss": loss, "metrics": {"accuracy": accuracy, "correct": (accuracy * 4).astype(
          jnp.int32)}, "logits": logits, "nan": jnp.log(-jnp.abs(loss)).astype(jnp.bfloat16)}


@functools.cache
def transcript_with_metrics():
  """(transcript folder, what the step returned at each step): 3 steps, all checked."""
  proof = testing.new_proof("metrics", update_p=1.0)
  proof.start()
  state = testing.classifier_state(proof)
  train_step = proof.jit(step_with_metrics)
  returned = []
  for _ in range(3):
    state, out = train_step(state, BATCH)
    returned.append(jax.tree.map(np.asarray, out))
  proof.finish()
  return proof.path, returned


class EncodeTest(parameterized.TestCase):

  @parameterized.parameters(
      (np.float32(0.1), float(np.float32(0.1))), (np.int8(-3), -3), (np.bool_(True), 1),
      (np.float32(np.inf), "inf"), (np.float64(-np.inf), "-inf"),
      (np.float32(np.nan), "nan:7fc00000"), (np.uint64(2**64 - 1), 2**64 - 1))
  def test_scalars_are_committed_exactly(self, array, expected):
    value = metrics.encode(array)
    self.assertTrue(metrics.identical(value, expected), value)
    self.assertEqual(metrics.problems({"m": value}), [])

  def test_negative_zero_is_not_zero(self):
    self.assertFalse(metrics.identical(metrics.encode(np.float32(-0.0)), 0.0))

  def test_arrays_by_digest(self):
    value = metrics.encode(np.arange(3, dtype=np.float32))
    self.assertIsInstance(value, bytes)
    self.assertLen(value, 32)

  @parameterized.parameters(
      ({"loss": math.nan}, "non-finite"), ({"loss": True}, "boolean"),
      ({"bad name": 1.0}, "metric name"), ({"loss": "nan"}, "only"),
      ({"loss": 2**70}, "beyond 64 bits"), ({"loss": b"x"}, "32-byte"),
      ({f"m{i}": 0 for i in range(metrics.MAX_METRICS + 1)}, "at most"), ([1.0], "not a map"))
  def test_malformed_metrics_are_named(self, value, message):
    self.assertIn(message, " ".join(metrics.problems(value)))

  def test_names_of_outputs(self):
    self.assertEqual(metrics.output_names([(1, "loss"), (1, "metrics", "accuracy")]),
                     ["loss", "metrics.accuracy"])
    self.assertEqual(metrics.output_names([(1,)]), ["output"])
    self.assertEqual(metrics.output_names([(1,), (2,)]), ["output1", "output2"])
    self.assertEqual(metrics.output_names([("a b",), ("a_b",)]), ["a_b", "a_b_2"])


class CommittedMetricsTest(verify_test.VerifierTestCase):

  def test_step_records_carry_what_the_step_returned(self):
    path, returned = transcript_with_metrics()
    steps = testing.records_of(path, "step")
    self.assertLen(steps, 3)
    for record, out in zip(steps, returned):
      m = record["metrics"]
      self.assertEqual(sorted(m), ["logits", "loss", "metrics.accuracy", "metrics.correct", "nan"])
      self.assertEqual(np.float32(m["loss"]).tobytes(), out["loss"].tobytes())
      self.assertEqual(np.float32(m["metrics.accuracy"]).tobytes(),
                       out["metrics"]["accuracy"].tobytes())
      self.assertEqual(m["metrics.correct"], int(out["metrics"]["correct"]))
      self.assertEqual(m["logits"], metrics.encode(out["logits"]))
      self.assertEqual(m["nan"], "nan:" + out["nan"].view(np.uint16).tobytes()[::-1].hex())
    program = testing.records_of(path, "program")[0]
    n = len(program["state_layout"])  # the outputs after the state, in pytree order
    self.assertEqual(program["metric_outputs"], [[name, n + i] for i, name in enumerate(
        ["logits", "loss", "metrics.accuracy", "metrics.correct", "nan"])])

  def test_checked_metrics_are_replayed(self):
    report = verify.verify(transcript_with_metrics()[0])
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())

  @parameterized.parameters(("loss", 0.5), ("metrics.correct", 9), ("nan", "nan:7fc1"),
                            ("logits", bytes(32)))
  def test_forged_metric_on_a_checked_step_is_caught(self, name, forged):
    # The attack: step 1's record claims another value of one metric; everything after
    # it is re-chained, so only the replay can tell.
    def edit(records):
      verify_test.first(records, "step", index=1)["metrics"][name] = forged
      return records
    report = self.assert_fails(verify_test.rechained(edit, transcript_with_metrics()[0]),
                               "replay")
    messages = " ".join(f.message for f in report.findings)
    self.assertIn(f"step 1: metric {name!r} is committed as", messages)

  def test_metric_the_program_does_not_return_is_a_format_error(self):
    def edit(records):
      verify_test.first(records, "step", index=0)["metrics"]["made_up"] = 1.0
      return records
    report = self.assert_fails(verify_test.rechained(edit, transcript_with_metrics()[0]),
                               "schema")
    self.assertIn("'made_up' is not an output", report.dumps())


if __name__ == "__main__":
  absltest.main()
