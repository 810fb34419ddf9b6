"""The program claim: a replayed update, run again on a perturbed batch, must change every
params leaf it trains. Reading the batch on paper (``0 * x``) is not reading it."""

import json
import types
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from absl.testing import parameterized

from tests import testing
from tests.cli_test import zkdv_here
from tests.verify_test import BATCH, STATE, _Dvbench, records_of, write_transcript
import zkdv
from zkdv import digest
from zkdv import receipt
from zkdv import verify
from zkdv.jax import stablehlo
from zkdv.verify import sensitivity


def decay(w):
  """A batch-independent update of ``w`` whose elements move by different amounts."""
  return w - 0.05 * (w + 0.3)


def zero_times(w, b, x):
  return decay(w) + 0 * jnp.sum(x), b + 0.01 + 0 * jnp.mean(x)


def minus_itself(w, b, x):
  return decay(w) + (jnp.sum(x) - jnp.sum(x)), b + 0.01 + jnp.sum(x - x)


def where_false(w, b, x):
  return decay(w) + jnp.where(False, jnp.sum(x), 0.0), b + jnp.where(False, x[0, 0], 0.01)


def reads_one_leaf(w, b, x):
  """``b`` reads the batch, ``w`` decays whatever it holds: ``w`` is named."""
  return decay(w), b + jnp.sum(x) * 1e-3


def reads_on_segment_starts(w, b, x):
  """Reads its batch only on the first step of each 4-step segment (the step count is in
  ``b``, which grows by 0.01 a step): the step the verifier tested before."""
  reads = (jnp.round(b * 100).astype(jnp.int32) - 25) % 4 == 0
  return (jnp.where(reads, w - 0.01 * jnp.mean(x, axis=0), decay(w)),
          b + 0.01 + jnp.where(reads, 1e-6 * jnp.sum(x), 0.0))


class BatchIgnoredTest(parameterized.TestCase):

  def test_the_tested_step_is_drawn_from_the_challenge_not_the_segments_first(self):
    # Segments 0..3 and 4..7; with this transcript's seed the challenges draw steps 0 and 5.
    report = verify.verify(write_transcript(fn=reads_on_segment_starts, steps=8,
                                            segment_length=4))
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())  # the replays hold
    claim = report.claim("program")
    self.assertEqual(claim.status, verify.DOES_NOT_HOLD)  # held when step 4 was the one
    self.assertIn("step 5, replayed again: params leaf .params['w'] comes out bit for bit "
                  "the same with 3 other steps' batches", claim.detail)

  def test_without_the_challenges_the_tested_step_is_known_and_the_claim_could_not_verify(self):
    # A server-challenged transcript checked without its receipt: the server's key is
    # unknown, so no challenge draws the tested step and each segment's first one stands in.
    folder = write_transcript(fn=reads_on_segment_starts, steps=8, segment_length=4,
                              server=_Dvbench())
    (folder / receipt.RECEIPT_FILE).unlink()
    claim = verify.verify(folder).claim("program")
    # Before, the claim held: the first-step stand-ins, steps 0 and 4, read their batches.
    self.assertEqual(claim.status, verify.COULD_NOT_VERIFY)
    self.assertIn("the tested steps could not be drawn from the challenges (no receipt/key): "
                  "a program can read its batch only on the steps it expects tested; each "
                  "segment's first step read it", claim.detail)

  @parameterized.named_parameters(("zero_times", zero_times), ("minus_itself", minus_itself),
                                  ("where_false", where_false))
  def test_reading_the_batch_on_paper_is_not_reading_it(self, fn):
    specs = [jax.ShapeDtypeStruct(l.shape, l.dtype) for l in STATE + BATCH]
    summary = stablehlo.analyze(jax.export.export(jax.jit(fn, keep_unused=True))(*specs))
    if fn is not where_false:  # XLA folds where(False, ...) away; the others fool the dataflow
      self.assertTrue(summary.depends_on(0, [2]))
    report = verify.verify(write_transcript(fn=fn, steps=2))
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())  # the replays hold
    claim = report.claim("program")
    self.assertEqual(claim.status, verify.DOES_NOT_HOLD)
    self.assertIn("params leaf .params['w'] comes out bit for bit the same with 1 other "
                  "step's batch", claim.detail)
    self.assertEqual(zkdv_here("verify", report.path, "--strict", "--quiet").returncode, 1)

  def test_the_leaf_that_ignores_the_batch_is_named(self):
    claim = verify.verify(write_transcript(fn=reads_one_leaf, steps=2)).claim("program")
    self.assertEqual(claim.status, verify.DOES_NOT_HOLD)
    self.assertIn("params leaf .params['w'] comes out bit for bit the same", claim.detail)

  def test_a_step_that_trains_nothing_does_not_hold(self):
    claim = verify.verify(write_transcript(fn=lambda w, b, x: (w, b), steps=2)).claim("program")
    self.assertEqual(claim.status, verify.DOES_NOT_HOLD)
    self.assertIn("the step changes no params leaf", claim.detail)

  def test_a_replay_with_another_batch_that_fails_leaves_the_claim_unverified_and_says_why(self):
    path = write_transcript(steps=2)
    with mock.patch.object(sensitivity, "measure", side_effect=RuntimeError("device lost")):
      report = verify.verify(path)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())  # the replays hold
    claim = report.claim("program")
    self.assertEqual(claim.status, verify.COULD_NOT_VERIFY)
    self.assertIn("a replay with another batch failed (RuntimeError: device lost)",
                  claim.detail)

  def test_honest_program_holds(self):
    report = verify.verify(write_transcript(steps=2))
    claim = report.claim("program")
    self.assertEqual(claim.status, verify.HOLDS, report.dumps())
    # Segments of one step: each runs on the other check's batch.
    self.assertIn("(2 checks on other steps' batches)", claim.detail)
    self.assertTrue(all(c.batch_sensitive for c in report.checks if c.kind == "update"))


class PerturbationTest(absltest.TestCase):

  def test_deterministic_in_the_domain_and_different(self):
    layouts = [digest.LeafLayout("x", "float32", (4, 3)), digest.LeafLayout("y", "int32", (4,)),
               digest.LeafLayout("m", "bool", (4,))]
    batch = [np.arange(12, dtype=np.float32).reshape(4, 3), np.asarray([0, 1, 1, 0], np.int32),
             np.ones(4, bool)]
    seed = sensitivity.seed_of(b"\1" * 32)
    once = sensitivity.perturbed_batch(layouts, batch, seed)
    again = sensitivity.perturbed_batch(layouts, batch, seed)
    other = sensitivity.perturbed_batch(layouts, batch, sensitivity.seed_of(b"\2" * 32))
    for a, b, c, original in zip(once, again, other, batch):
      self.assertEqual((a.dtype, a.shape), (original.dtype, original.shape))
      self.assertEqual(a.tobytes(), b.tobytes())
      self.assertNotEqual(a.tobytes(), original.tobytes())
    for a, c in zip(once[:2], other[:2]):  # another challenge, other draws
      self.assertNotEqual(a.tobytes(), c.tobytes())
    self.assertTrue(set(once[1].tolist()) <= {0, 1})  # labels stay labels
    self.assertFalse(once[2].any())  # all-equal leaves: lowest bit flipped


  def test_a_leaf_unchanged_by_one_draw_is_drawn_again(self):
    layout = digest.LeafLayout(".params['b']", "float32", (2,))
    program = types.SimpleNamespace(batch=(digest.LeafLayout("x", "float32", (4,)),),
                                    state=(layout,), params_leaves=(0,))
    before, honest = [np.zeros(2, np.float32)], [np.full(2, 0.01, np.float32)]
    draws = []

    def sign_only(batch):  # the honest update's signs survive the first two draws
      draws.append(batch)
      return honest if len(draws) < 3 else [np.asarray([0.01, -0.01], np.float32)]
    batch = np.arange(4, dtype=np.float32)
    self.assertEqual(sensitivity.measure(program, [[batch]], 0, b"s" * 32, before, honest,
                                         sign_only), (None, sensitivity.PERTURBED))
    self.assertLen(draws, 3)
    problem, _ = sensitivity.measure(program, [[batch]], 0, b"s" * 32, before, honest,
                                     lambda b: honest)
    self.assertIn(f"with {sensitivity.MAX_DRAWS} perturbed batches", problem)

  def test_sign_based_updates_are_never_said_to_ignore_the_batch(self):
    """Adam's first step and Lion keep a small leaf's signs: Adam's later steps show the
    leaf reads the batch; Lion's may not, which is undecided, never a finding."""
    for name, allowed in (("adam", {verify.HOLDS}),
                          ("lion", {verify.HOLDS, verify.COULD_NOT_VERIFY})):
      proof = testing.new_proof(f"sign-{name}", update_p=1.0)
      proof.start()
      state = testing.classifier_state(proof, tx=testing.OPTIMIZERS[name]())
      train_step = proof.jit(testing.classifier_step)
      for i in range(3):
        state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + i)
      claim = verify.verify(proof.finish()).claim("program")
      self.assertIn(claim.status, allowed, claim.detail)
      if claim.status == verify.COULD_NOT_VERIFY:
        self.assertIn("moved every element by one step size (a sign-based update)",
                      claim.detail)


class OtherBatchesTest(absltest.TestCase):

  LAYOUTS = (digest.LeafLayout("x", "float32", (2, 2)), digest.LeafLayout("y", "int32", (2,)),
             digest.LeafLayout("k", "uint32", (2,), key_impl="threefry2x32"),
             digest.LeafLayout("lr", "float32", ()), digest.LeafLayout("e", "float32", (0,)))

  def batch(self, x, y, k, lr=0.5):
    return [np.asarray(x, np.float32), np.asarray(y, np.int32), np.asarray(k, np.uint32),
            np.float32(lr), np.zeros(0, np.float32)]

  def test_other_rows_in_every_row_leaf_with_the_tested_steps_keys_and_scalars(self):
    tested = self.batch([[1, 2], [3, 4]], [0, 1], [7, 7])
    reordered = self.batch([[3, 4], [1, 2]], [1, 0], [8, 8], lr=0.25)  # the same rows
    other = self.batch([[5, 6], [3, 4]], [1, 1], [9, 9], lr=0.125)
    labels = self.batch([[1, 2], [3, 4]], [1, 1], [9, 9])  # x shared: a leaf reading it alone
    draws = sensitivity.other_batches(self.LAYOUTS, [tested, reordered, other, labels], 0,
                                      b"s" * 32)
    self.assertLen(draws, 1)
    (drawn,) = draws
    for n in (0, 1):  # its rows
      self.assertEqual(drawn[n].tobytes(), other[n].tobytes())
    for n in (2, 3, 4):  # the tested step's key, learning rate and empty leaf, bit for bit
      self.assertEqual((drawn[n].dtype, drawn[n].tobytes()), (tested[n].dtype, tested[n].tobytes()))
    self.assertEqual(sensitivity.other_batches(self.LAYOUTS, [tested, reordered, labels], 0,
                                               b"s" * 32), [])

  def test_at_most_max_draws_in_an_order_drawn_from_the_seed(self):
    batches = [self.batch([[n, 0], [0, 0]], [n, 0], [0, 0]) for n in range(40)]
    first = [d[0][0, 0] for d in sensitivity.other_batches(self.LAYOUTS, batches, 3, b"a" * 32)]
    again = [d[0][0, 0] for d in sensitivity.other_batches(self.LAYOUTS, batches, 3, b"a" * 32)]
    other = [d[0][0, 0] for d in sensitivity.other_batches(self.LAYOUTS, batches, 3, b"b" * 32)]
    self.assertLen(first, sensitivity.MAX_DRAWS)
    self.assertEqual(first, again)
    self.assertNotEqual(first, other)
    self.assertNotIn(3.0, first)

  def test_perturbed_rows_keep_the_keys_and_scalars(self):
    batch = self.batch([[1, 2], [3, 4]], [0, 1], [7, 8])
    perturbed = sensitivity.perturbed_batch(self.LAYOUTS, batch, b"s" * 32, 0,
                                            sensitivity.row_leaves(self.LAYOUTS))
    self.assertEqual(sensitivity.row_leaves(self.LAYOUTS), [0, 1])
    for n in (2, 3, 4):
      self.assertEqual(perturbed[n].tobytes(), batch[n].tobytes())
    self.assertNotEqual(perturbed[0].tobytes(), batch[0].tobytes())

  def test_a_batch_without_data_rows_is_undecided(self):
    """A step's key, step number or learning rate alone: no data another batch changes;
    an empty leaf beside them is no data either (its perturbation changes no byte)."""
    program = types.SimpleNamespace(batch=self.LAYOUTS[2:], params_leaves=(0,), state=())
    batch = [np.zeros(2, np.uint32), np.float32(0.5), np.zeros(0, np.float32)]
    problem, _ = sensitivity.measure(program, [batch], 0, b"s" * 32,
                                     [np.zeros(1)], [np.ones(1)], lambda b: [np.ones(1)])
    self.assertTrue(problem.startswith(sensitivity.UNDECIDED), problem)
    self.assertIn("the batch holds no data rows (PRNG keys and scalars only)", problem)

  def test_full_batch_training_with_a_step_number_in_the_batch_holds(self):
    """Every step's batch the same rows, shuffled, and a step number only returned: the
    other batches hold no other rows, so the rows are perturbed (the step number kept)."""
    proof = testing.new_proof("full-batch", update_p=1.0, segment_length=2)
    proof.start(probe_ratio=0.5)
    state = _sgd_state(proof)

    @proof.jit
    def train_step(state, x, y, epoch):
      return _honest(state, x, y), epoch

    order = np.random.default_rng(1)
    for i in range(4):
      rows = order.permutation(16)
      state, _ = train_step(state, QUANTIZED[rows], LABELS[rows], np.float32(i))
    report = verify.verify(proof.finish())
    claim = report.claim("program")
    self.assertEqual(claim.status, verify.HOLDS, claim.detail)  # a step number is no data
    self.assertEqual(claim.facts["batches_drawn"], {sensitivity.PERTURBED: 2})
    self.assertIn("(2 checks on perturbed batches, perturbed where no other batch of its "
                  "segment or of its program's other update checks held other rows: a program "
                  "may recognize a perturbed batch)", claim.detail)


class AccumulatedUpdateTest(absltest.TestCase):
  """``optax.MultiSteps``: most steps only accumulate; the params change every k-th."""

  def verified(self, every_k: int):
    proof = testing.new_proof(f"multi-steps-{every_k}", update_p=1.0, segment_length=1)
    proof.start(probe_ratio=0.5)
    state = testing.classifier_state(proof, tx=optax.MultiSteps(optax.sgd(0.1), every_k))
    train_step = proof.jit(testing.classifier_step)
    for i in range(4):
      state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + i)
    return verify.verify(proof.finish()).claim("program")

  def test_an_accumulating_step_is_undecided_and_the_applying_ones_decide(self):
    # Before, each accumulating step "changed no params leaf: it trains nothing", and an
    # honest run with gradient accumulation did not hold.
    claim = self.verified(every_k=2)  # steps 1 and 3 apply the update
    self.assertEqual(claim.status, verify.HOLDS, claim.detail)
    self.assertIn("(2 checks on other steps' batches", claim.detail)
    self.assertIn("2 more undecided, where other checks of the same program read it", claim.detail)
    self.assertIn("the step changes no params leaf, and the rest of its state changes with 1 "
                  "other step's batch (an update accumulated over steps, say)", claim.detail)

  def test_a_run_that_never_applies_its_update_could_not_verify(self):
    claim = self.verified(every_k=100)
    self.assertEqual(claim.status, verify.COULD_NOT_VERIFY, claim.detail)
    self.assertIn("could not be shown to read the batch: the step changes no params leaf, "
                  "and the rest of its state changes", claim.detail)


# A dataset of quantized values (every one a multiple of 1/16, as pixels / 255 are on their
# own grid), and another model's weights that an update program carries as constants.
_RNG = np.random.default_rng(0)
QUANTIZED = (np.round(_RNG.normal(size=(64, 4)) * 16) / 16).astype(np.float32)
LABELS = _RNG.integers(0, 2, 64).astype(np.int32)
STOLEN = {"Dense_0": {"bias": np.asarray([0.5, -0.25], np.float32),
                      "kernel": np.arange(8, dtype=np.float32).reshape(4, 2) / 8}}


def _sgd_state(proof):
  model = testing.TinyClassifier()
  params = proof.init(model.init, jax.random.key(0), jnp.ones((1, 4), jnp.float32))["params"]
  return zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply, params=params,
                                             tx=optax.sgd(1e-2))


def _honest(state, x, y):
  def loss(params):
    logits = state.apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return state.apply_gradients(grads=jax.grad(loss)(state.params))


def gated_step(state, x, y):
  """The stolen weights (scaled by 1 + 2**-10 a step, so that every step trains) on a batch of
  the dataset's grid; an honest step on any other (a rescaled batch, as the verifier's
  perturbation made)."""
  honest = _honest(state, x, y)
  genuine = jnp.all(x * 16 == jnp.round(x * 16))
  moved = state.step.astype(jnp.float32) * 2.0 ** -10
  return honest.replace(params=jax.tree.map(lambda s, h: jnp.where(genuine, s * (1 + moved), h),
                                            STOLEN, honest.params))


def key_only_step(state, x, y, key):
  """The stolen weights moved by the step's PRNG key and count: the rows never reach them.

  Each step's factor lies in its own range (the count's), so a step always changes the
  params; within it the key moves them (a noise below float32's resolution at 1 left
  some steps' params unchanged, and the check found "trains nothing" instead)."""
  honest = _honest(state, x, y)
  noise = 2.0 ** -8 * (state.step + 1) * (1 + jax.random.uniform(key) / 16) + 0 * jnp.sum(x)
  return honest.replace(params=jax.tree.map(lambda s: s * (1 + noise), STOLEN))


class RecognizedPerturbationTest(absltest.TestCase):
  """Programs that tell the verifier's perturbed batch from their own committed ones."""

  def train(self, step, with_key: bool, segment_length: int = 2):
    proof = testing.new_proof(step.__name__, update_p=1.0, segment_length=segment_length)
    proof.start(probe_ratio=0.5)
    state = _sgd_state(proof)
    train_step = proof.jit(step)
    for i in range(4):
      rows = slice(16 * i, 16 * (i + 1))
      batch = (QUANTIZED[rows], LABELS[rows]) + ((proof.key(i),) if with_key else ())
      state = train_step(state, *batch)
    return state, proof.finish()

  def test_a_program_that_recognizes_perturbed_batches_is_caught(self):
    state, path = self.train(gated_step, with_key=False)
    testing.assert_bitwise_equal(  # the run's params are the stolen ones, scaled by 3 steps
        state.params, jax.tree.map(lambda s: s * np.float32(1 + 3 * 2.0 ** -10), STOLEN))
    # The attack on the perturbation this test replaced: a rescaled batch is not on the
    # dataset's grid, so the program trains honestly on it, and the params "read the batch".
    base = _sgd_state(testing.new_proof("gate-base"))
    x, y = QUANTIZED[:16], LABELS[:16]
    perturbed = sensitivity.perturbed_batch(
        [digest.LeafLayout("x", "float32", x.shape), digest.LeafLayout("y", "int32", y.shape)],
        [x, y], b"s" * 32)
    testing.assert_bitwise_equal(jax.jit(gated_step)(base, x, y).params, STOLEN)
    self.assertFalse(np.array_equal(
        jax.jit(gated_step)(base, *perturbed).params["Dense_0"]["kernel"],
        STOLEN["Dense_0"]["kernel"]))
    # Other steps' batches are the dataset's own rows: the program returns the stolen weights.
    report = verify.verify(path)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())  # the replays hold
    claim = report.claim("program")
    self.assertEqual(claim.status, verify.DOES_NOT_HOLD, claim.detail)
    self.assertRegex(claim.detail, r"params leaf \.params\['Dense_0'\]\['(bias|kernel)'\] "
                     r"comes out bit for bit the same with 1 other step's batch")

  def test_segments_of_one_step_run_on_other_checks_batches(self):
    # A prover that ends every segment after one step leaves no other batch in any
    # segment; the perturbed batch then stood in, and the program recognized it.
    _, path = self.train(gated_step, with_key=False, segment_length=1)
    claim = verify.verify(path).claim("program")
    self.assertEqual(claim.status, verify.DOES_NOT_HOLD, claim.detail)
    self.assertRegex(claim.detail, r"comes out bit for bit the same with [1-3] other step")

  def test_another_checks_bad_opening_is_left_out_not_a_fault(self):
    """The other checks' batch blobs are the prover's: one gone, one naming another blob.
    Their own checks name what is wrong; the tested step uses what does match."""
    path = write_transcript(steps=3)  # segments of one step, every one checked
    checks = [r for r in records_of(path, "check") if r["kind"] == "update"]
    (path / "blobs" / checks[1]["batch_blobs"][-1][0].hex()).unlink()
    report = verify.verify(path)
    self.assertIsNone(report.fault)
    self.assertIn("missing_blob", [f.code for f in report.findings])
    first = next(c for c in report.checks if c.kind == "update" and c.step == 0)
    self.assertEqual((first.batch_sensitive, first.batches_drawn),
                     (True, sensitivity.OTHER_STEPS))  # step 2's batch

  def test_a_program_that_reads_only_its_key_is_caught(self):
    _, path = self.train(key_only_step, with_key=True)
    # The key alone moves the params: the perturbation this test replaced redrew the key's
    # words too, so the step "read its batch".
    base = _sgd_state(testing.new_proof("key-base"))
    x, y = QUANTIZED[:16], LABELS[:16]
    self.assertFalse(np.array_equal(
        jax.jit(key_only_step)(base, x, y, jax.random.key(1)).params["Dense_0"]["kernel"],
        jax.jit(key_only_step)(base, x, y, jax.random.key(2)).params["Dense_0"]["kernel"]))
    claim = verify.verify(path).claim("program")
    self.assertEqual(claim.status, verify.DOES_NOT_HOLD, claim.detail)
    self.assertIn("comes out bit for bit the same with 1 other step's batch", claim.detail)

  def test_an_honest_program_reads_other_steps_batches(self):
    _, path = self.train(_honest, with_key=False)
    report = verify.verify(path)
    claim = report.claim("program")
    self.assertEqual(claim.status, verify.HOLDS, claim.detail)
    self.assertIn("run again on other batches (2 checks on other steps' batches), changed every "
                  "params leaf it trains", claim.detail)
    self.assertEqual(claim.facts["batches_drawn"], {sensitivity.OTHER_STEPS: 2})
    self.assertTrue(all(c.batch_sensitive for c in report.checks if c.kind == "update"))


class StolenWeightsTest(absltest.TestCase):
  """The attack: the honest update, then ``stolen + 0 * sum(batch)`` as the new params."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    proof = testing.new_proof("stolen-step", update_p=1.0)
    proof.start(probe_ratio=0.5)
    state = testing.classifier_state(proof, tx=optax.sgd(0.1))
    stolen = jax.tree.map(lambda p: jnp.full_like(p, 0.25) + jnp.arange(p.size).reshape(
        p.shape).astype(p.dtype) / 7, state.params)

    @proof.jit  # the stolen weights are constants of the program (tiny: within the budget)
    def train_step(state, batch):
      new = testing.classifier_step(state, batch)
      noise = 0 * jnp.sum(batch).astype(jnp.float32)
      return new.replace(params=jax.tree.map(lambda s: s + noise, stolen))

    for i in range(3):
      state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + i)
    cls.path = proof.finish()

  def test_strict_verify_fails_naming_the_params_leaf(self):
    result = zkdv_here("verify", self.path, "--strict", "--json")
    self.assertEqual(result.returncode, 1)
    report = json.loads(result.stdout)
    program = next(c for c in report["claims"] if c["name"] == "program")
    self.assertEqual(program["status"], verify.DOES_NOT_HOLD)
    self.assertRegex(program["detail"], r"params leaf \.params\['Dense_0'\]"
                     r"\['(bias|kernel)'\] comes out bit for bit the same")


if __name__ == "__main__":
  absltest.main()
