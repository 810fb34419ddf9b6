"""Flax NNX under proof.jit: zkdv.jax.contrib.nnx.Optimizer and in-place updates as nnx.jit.

Every run checks every step (update check probability 1), is compared leaf by leaf
(dtype and bytes) with the same training under plain ``nnx.jit``, and is verified.
"""

import contextlib
import copy
import io
import pathlib
import runpy
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx

from tests import testing
from zkdv import errors
from zkdv import verify
from zkdv.jax.contrib import nnx as zkdv_nnx


class MLP(nnx.Module):

  def __init__(self, rngs: nnx.Rngs, din: int = 4, dout: int = 3):
    self.hidden = nnx.Linear(din, 8, rngs=rngs)
    self.out = nnx.Linear(8, dout, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


class CNN(nnx.Module):
  """Conv + BatchNorm + dropout: running statistics and an RNG stream in the state."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 2, (2, 2), rngs=rngs)
    self.norm = nnx.BatchNorm(2, rngs=rngs)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.out = nnx.Linear(2 * 3 * 3, 3, rngs=rngs)

  def __call__(self, x):
    x = self.dropout(nnx.relu(self.norm(self.conv(x))))
    return self.out(x.reshape(x.shape[0], -1))


def _cross_entropy(model, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def train_step(model, optimizer, x, y):
  loss, grads = nnx.value_and_grad(_cross_entropy)(model, x, y)
  optimizer.update(model, grads)
  return loss


def _batches(shape, sizes=(8, 8, 5)):
  """Random batches of ``sizes`` rows (the last one smaller, as a data loader keeps it)."""
  keys = jax.random.split(jax.random.key(7), len(sizes))
  return [(jax.random.normal(k, (n, *shape)), jnp.arange(n) % 3) for k, n in zip(keys, sizes)]


def _leaves(*nodes) -> list[np.ndarray]:
  return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                     else x) for x in jax.tree.leaves(nnx.state(nodes))]


class NNXTest(parameterized.TestCase):

  def assert_bitwise_equal(self, ours, theirs):
    self.assertEqual(len(ours), len(theirs))
    for i, (a, b) in enumerate(zip(ours, theirs)):
      self.assertEqual(a.dtype, b.dtype, f"leaf {i}")
      self.assertEqual(a.tobytes(), b.tobytes(), f"leaf {i}")

  def assert_verified(self, proof, steps):
    self.assertEqual(proof.steps, steps)
    self.assertEqual(proof.checks["update"], steps)
    self.assertEqual(proof.discontinuities, [])
    report = verify.verify(proof.path)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())

  def lockstep(self, name, make_model, make_tx, step, batches, wrt=nnx.Param, extra=()):
    """Trains under proof.jit and nnx.jit side by side; returns (proof, ours, theirs)."""
    proof = testing.new_proof(name)
    proof.start()
    ours_model, theirs_model = make_model(), make_model()
    ours = (ours_model, zkdv_nnx.Optimizer(ours_model, make_tx(), wrt=wrt, proof=proof),
            *[make() for make in extra])
    theirs = (theirs_model, nnx.Optimizer(theirs_model, make_tx(), wrt=wrt),
              *[make() for make in extra])
    proof_step, plain_step = proof.jit(step), nnx.jit(step)
    for batch in batches:
      got, want = proof_step(*ours, *batch), plain_step(*theirs, *batch)
      self.assert_bitwise_equal([np.asarray(got)], [np.asarray(want)])
      self.assert_bitwise_equal(_leaves(*ours), _leaves(*theirs))
    proof.finish()
    return proof, ours, theirs

  def test_mlp_trains_as_nnx_jit_bit_for_bit_and_verifies(self):
    proof, (model, _), _ = self.lockstep(
        "nnx-mlp", lambda: MLP(nnx.Rngs(0)), lambda: optax.adam(1e-2), train_step,
        _batches((4,)))
    self.assert_verified(proof, 3)
    programs = testing.records_of(proof.path, "program")
    self.assertLen(programs, 2)  # the smaller last batch traced again, as under jax.jit
    self.assertEqual([s["program"] for s in testing.records_of(proof.path, "step")], [0, 0, 1])
    params = set(programs[0]["params_leaves"])
    paths = [l["path"] for l in programs[0]["state_layout"]]
    self.assertEqual({i for i, p in enumerate(paths) if ".state[0]" in p and "kernel" in p}
                     - params, set())
    self.assertFalse(any("opt_state" in paths[i] for i in params))
    self.assertEqual(len(params), len(jax.tree.leaves(nnx.state(model, nnx.Param))))

  def test_cnn_with_batchnorm_and_dropout_trains_as_nnx_jit_and_verifies(self):
    proof, (model, _), _ = self.lockstep(
        "nnx-cnn", lambda: CNN(nnx.Rngs(0, dropout=1)), lambda: optax.adam(1e-2), train_step,
        _batches((3, 3, 1), (4, 4)))
    self.assertFalse(np.array_equal(model.norm.mean[...], np.zeros(2)))
    self.assertEqual(int(model.dropout.rngs.count[...]), 2)
    self.assert_verified(proof, 2)

  # The scenarios of Flax's own nnx.Optimizer tests, under proof.jit.

  @parameterized.named_parameters(
      ("linear_sgd", lambda: nnx.Linear(2, 4, rngs=nnx.Rngs(0)), lambda: optax.sgd(1e-3)),
      ("adamw", lambda: nnx.Linear(2, 4, rngs=nnx.Rngs(0)), lambda: optax.adamw(0.1)))
  def test_flax_optimizer_scenarios(self, make_model, make_tx):
    def step(model, optimizer, x, y):
      loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
      optimizer.update(model, grads)
      return loss

    batch = (jax.random.normal(jax.random.key(0), (1, 2)), jnp.ones((1, 4)))
    proof, (model, _), _ = self.lockstep("nnx-flax", make_model, make_tx, step, [batch] * 2)
    self.assertLess(float(((model(batch[0]) - batch[1]) ** 2).mean()),
                    float(((make_model()(batch[0]) - batch[1]) ** 2).mean()))
    self.assert_verified(proof, 2)

  def test_linesearch_takes_update_kwargs(self):
    def step(model, optimizer, x, y):
      loss_fn = lambda m: ((m(x) - y) ** 2).mean()
      graphdef = nnx.graphdef(model)
      loss, grads = nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads, grad=grads, value=loss,
                       value_fn=lambda state: loss_fn(nnx.merge(graphdef, state)))
      return loss

    batch = (jax.random.normal(jax.random.key(0), (1, 2)), jnp.ones((1, 4)))
    make_tx = lambda: optax.chain(optax.sgd(1e-1), optax.scale_by_backtracking_linesearch(
        max_backtracking_steps=4))
    proof, _, _ = self.lockstep("nnx-linesearch", lambda: nnx.Linear(2, 4, rngs=nnx.Rngs(0)),
                                make_tx, step, [batch] * 2)
    self.assert_verified(proof, 2)

  def test_wrt_lora_updates_only_the_filtered_variables(self):
    def make_model():
      return nnx.LoRA(4, 2, 10, base_module=MLP(nnx.Rngs(0), 4, 10), rngs=nnx.Rngs(1))

    def step(model, optimizer, x, y):
      loss_fn = lambda m: ((m(x) - y) ** 2).mean()
      loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
      optimizer.update(model, grads)
      return loss

    batch = (jnp.ones((1, 4)), jnp.ones((1, 10)))
    proof, (model, _), _ = self.lockstep("nnx-lora", make_model, lambda: optax.adam(1e-3),
                                         step, [batch] * 2, wrt=nnx.LoRAParam)
    before_lora, before_other = nnx.state(make_model(), nnx.LoRAParam, ...)
    after_lora, after_other = nnx.state(model, nnx.LoRAParam, ...)
    for a, b in zip(jax.tree.leaves(before_lora), jax.tree.leaves(after_lora)):
      self.assertFalse(np.array_equal(a, b))
    for a, b in zip(_leaves(before_other), _leaves(after_other)):
      np.testing.assert_array_equal(a, b)
    self.assert_verified(proof, 2)

  def test_metrics_split_merge_and_nnx_jit_inside(self):
    @nnx.jit  # proof.jit(nnx.jit(step)) works as proof.jit(step)
    def step(model, optimizer, metrics, x, y):
      loss = train_step(model, optimizer, x, y)
      metrics.update(loss=loss, logits=model(x), labels=y)
      return loss

    def make_model():
      return MLP(nnx.Rngs(0))

    make_metrics = lambda: nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                                           loss=nnx.metrics.Average("loss"))
    proof, ours, theirs = self.lockstep("nnx-metrics", make_model, lambda: optax.sgd(0.1),
                                        step, _batches((4,), (8, 8)), extra=(make_metrics,))
    self.assertEqual(jax.tree.map(np.asarray, ours[2].compute()),
                     jax.tree.map(np.asarray, theirs[2].compute()))
    merged = nnx.merge(*nnx.split(ours[1]))
    self.assertIsInstance(merged, zkdv_nnx.Optimizer)
    self.assertIs(merged.proof, proof)
    self.assert_verified(proof, 2)

  def test_state_is_donated_only_when_every_nnx_argument_is(self):
    proof = testing.new_proof("nnx-donate", update_p=0.0)  # no views: donation takes effect
    proof.start()
    model = MLP(nnx.Rngs(0))
    optimizer = zkdv_nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param, proof=proof)
    step = proof.jit(train_step, donate_argnums=0)  # the model only: split with the optimizer
    batch = _batches((4,), (8,))[0]
    step(model, optimizer, *batch)
    moment = optimizer.opt_state[0].mu["out"]["kernel"][...]
    step(model, optimizer, *batch)
    self.assertFalse(moment.is_deleted())  # the optimizer was not donated
    proof.finish()

  def test_copies_share_the_proof(self):
    proof = testing.new_proof("nnx-copy")
    model = MLP(nnx.Rngs(0))
    optimizer = zkdv_nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param, proof=proof)
    for copied in (copy.deepcopy(optimizer), copy.copy(optimizer), nnx.clone(optimizer)):
      self.assertIs(copied.proof, proof)
    copied = copy.deepcopy(optimizer)
    copied.step[...] += 1
    self.assertEqual(int(optimizer.step[...]), 0)

  def test_plain_nnx_jit_records_nothing(self):
    proof = testing.new_proof("nnx-plain")
    proof.start()
    model = MLP(nnx.Rngs(0))
    optimizer = zkdv_nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param, proof=proof)
    nnx.jit(train_step)(model, optimizer, *_batches((4,), (8,))[0])
    self.assertEqual(int(optimizer.step[...]), 1)
    self.assertEqual(proof.steps, 0)


class SplitGraphTest(absltest.TestCase):
  """The search for NNX objects in a call, and the structures it remembers as without."""

  def test_a_structure_known_without_objects_still_finds_them(self):
    array = jnp.ones((2,))
    self.assertIsNone(zkdv_nnx.split_graph(({"x": array},), {}, "step"))
    self.assertIn(zkdv_nnx._plain_structure(({"x": array},), {}), zkdv_nnx._WITHOUT_NODES)
    # The same dict with an NNX object where the array was is searched and the object found
    # (a model without its optimizer is then refused).
    for found in (MLP(nnx.Rngs(0)), nnx.Param(jnp.zeros(()))):
      self.assertNotIn(zkdv_nnx._plain_structure(({"x": found},), {}), zkdv_nnx._WITHOUT_NODES)
      with self.assertRaisesRegex(errors.StepInputError, "0 zkdv.jax.contrib.nnx.Optimizers"):
        zkdv_nnx.split_graph(({"x": found},), {}, "step")
    self.assertFalse(zkdv_nnx._is_node(array))
    self.assertTrue(zkdv_nnx._is_node(jax.new_ref(array)))  # a mutable array is a graph node


class NNXExampleTest(absltest.TestCase):

  def test_example_program_runs_and_checks_its_step(self):
    out = pathlib.Path(tempfile.mkdtemp())
    example = pathlib.Path(__file__).parents[1] / "examples/jax/proof_nnx.py"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      runpy.run_path(str(example), run_name="example").get("main")(
          ["--steps", "1", "--probability", "1.0", "--output-dir", str(out)])
    self.assertIn("step 1: loss", printed.getvalue())  # the step's jax.debug.print
    self.assertIn("jax-nnx: 1 steps, 1 update checks", printed.getvalue())
    self.assertIn(f"zkdv verify {out / 'jax-nnx'}", printed.getvalue())
    # finish() raised no ReplayError: the check replayed bit for bit (transcripts of NNX
    # runs are verified in NNXTest).
    self.assertLen(testing.records_of(out / "jax-nnx", "check"), 1)


class NNXErrorsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.proof = testing.new_proof("nnx-errors")
    self.proof.start()
    self.model = MLP(nnx.Rngs(0))
    self.batch = _batches((4,), (8,))[0]

  def test_plain_nnx_optimizer_is_refused_and_finish_names_the_step(self):
    optimizer = nnx.Optimizer(self.model, optax.adam(1e-2), wrt=nnx.Param)
    with self.assertRaisesRegex(errors.StepInputError,
                                r"1 plain nnx.Optimizer.*zkdv.jax.contrib.nnx.Optimizer\("):
      self.proof.jit(train_step)(self.model, optimizer, *self.batch)
    with self.assertRaisesRegex(errors.NoTranscriptUpdateError,
                                r"every call of train_step raised") as raised:
      self.proof.finish()
    self.assertNotIn("jax.jit", str(raised.exception))

  def test_optimizer_of_another_proof(self):
    other = testing.new_proof("nnx-other")
    optimizer = zkdv_nnx.Optimizer(self.model, optax.adam(1e-2), wrt=nnx.Param, proof=other)
    with self.assertRaisesRegex(errors.ProofIdentityError, "zkdv.jax.contrib.nnx.Optimizer"):
      self.proof.jit(train_step)(self.model, optimizer, *self.batch)

  def test_step_returning_the_model_or_changing_its_structure(self):
    optimizer = zkdv_nnx.Optimizer(self.model, optax.adam(1e-2), wrt=nnx.Param,
                                   proof=self.proof)

    def returns_model(model, optimizer, x, y):
      train_step(model, optimizer, x, y)
      return model

    def adds_variable(model, optimizer, x, y):
      model.extra = nnx.BatchStat(jnp.zeros(()))
      return train_step(model, optimizer, x, y)

    with self.assertRaisesRegex(errors.StepOutputError, "returns an NNX object"):
      self.proof.jit(returns_model)(self.model, optimizer, *self.batch)
    with self.assertRaisesRegex(errors.StepOutputError, "changes the structure"):
      self.proof.jit(adds_variable)(self.model, optimizer, *self.batch)
    self.assertFalse(hasattr(self.model, "extra"))
    self.assertEqual(self.proof.steps, 0)

  def test_step_without_update(self):
    optimizer = zkdv_nnx.Optimizer(self.model, optax.adam(1e-2), wrt=nnx.Param,
                                   proof=self.proof)
    with self.assertRaisesRegex(errors.NoTranscriptUpdateError, r"optimizer.update\(\)"):
      self.proof.jit(lambda model, optimizer, x, y: _cross_entropy(model, x, y))(
          self.model, optimizer, *self.batch)


if __name__ == "__main__":
  absltest.main()
