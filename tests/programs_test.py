"""Third-party training programs, shaped as their originals, with the two swaps.

Each program runs under ``proof.jit`` (or ``proof.attest``) and under the plain JAX
transform it replaces, side by side: every step is checked (update check probability
1), the trained state is compared leaf by leaf (dtype and bytes), and ``zkdv verify``
exits 0.
"""

import contextlib
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from flax import linen as nn
from flax import nnx
from flax.training import dynamic_scale as dynamic_scale_lib
from flax.training import train_state as flax_train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import zkdv
from tests import testing
from zkdv import cli
from zkdv import errors
from zkdv.jax.contrib import nnx as zkdv_nnx


def _host(x) -> np.ndarray:
  return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                    else x)


class ProgramTestCase(absltest.TestCase):

  def assert_bitwise_equal(self, ours, theirs):
    """Leaf by leaf (the two sides' pytree classes differ: ZKDV's and Flax's)."""
    testing.assert_bitwise_equal([_host(x) for x in jax.tree.leaves(ours)],
                                 [_host(x) for x in jax.tree.leaves(theirs)])

  def assert_verified(self, proof, steps: int):
    """Every step recorded and checked, and ``zkdv verify`` exits 0."""
    self.assertEqual(proof.steps, steps)
    self.assertEqual(proof.checks["update"], steps)
    self.assertEqual(proof.discontinuities, [])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
      status = cli.main(["verify", str(proof.path)])
    self.assertEqual(status, 0, out.getvalue())


# --- Flax lm1b: in_shardings/out_shardings with None, static arguments ---------------

class _LM(nn.Module):

  @nn.compact
  def __call__(self, tokens, train: bool):
    x = nn.Embed(16, 8)(tokens)
    x = nn.Dropout(0.1, deterministic=not train)(x)
    return nn.Dense(16)(x)


def _lm1b_train_step(state, batch, config, learning_rate_fn, label_smoothing=0.0,
                     dropout_rng=None):
  """Flax lm1b's ``train_step``: dropout keyed by the step, metrics beside the state."""
  inputs = batch["inputs"]
  weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
  dropout_rng = jax.random.fold_in(dropout_rng, state.step)

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, inputs, train=config["train"],
                            rngs={"dropout": dropout_rng})
    targets = optax.smooth_labels(jax.nn.one_hot(inputs, 16), label_smoothing)
    loss = (optax.softmax_cross_entropy(logits, targets) * weights).sum()
    return loss / weights.sum(), logits

  (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  new_state = state.apply_gradients(grads=grads)
  metrics = {"accuracy": (logits.argmax(-1) == inputs).mean(),
             "learning_rate": learning_rate_fn(state.step)}
  return new_state, metrics


class Lm1bShardingsTest(ProgramTestCase):

  def test_none_in_shardings_leaves_those_inputs_and_outputs_unspecified(self):
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    replicated, data_sharding = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    model = _LM()
    params = model.init(jax.random.key(0), jnp.ones((4, 6), jnp.int32), train=False)["params"]
    learning_rate_fn = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    proof = testing.new_proof("lm1b")
    proof.start()
    ours = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply,
                                              params=params, tx=optax.adamw(learning_rate_fn))
    theirs = flax_train_state.TrainState.create(apply_fn=model.apply, params=params,
                                                tx=optax.adamw(learning_rate_fn))
    options = dict(in_shardings=(replicated, data_sharding, None),
                   out_shardings=(replicated, None), static_argnums=(2, 3, 4),
                   donate_argnums=0)
    proof_step = proof.jit(_lm1b_train_step, **options)
    plain_step = jax.jit(_lm1b_train_step, **options)
    config = _Frozen(train=True)
    for i in range(2):
      dropout_rngs = proof.key(i)  # a key batch argument is the proof's key of the step
      batch = {"inputs": jax.random.randint(jax.random.key(10 + i), (4, 6), 0, 16)}
      ours, our_metrics = proof_step(ours, batch, config, learning_rate_fn, 0.1, dropout_rngs)
      theirs, their_metrics = plain_step(theirs, batch, config, learning_rate_fn, 0.1,
                                         dropout_rngs)
      self.assert_bitwise_equal((ours.params, ours.opt_state, our_metrics),
                                (theirs.params, theirs.opt_state, their_metrics))
    proof.finish()
    self.assert_verified(proof, 2)


class _Frozen(dict):
  """lm1b's model config: a static argument, hashable as ``ml_collections`` configs are."""

  def __hash__(self):
    return hash(tuple(sorted(self.items())))


# --- Flax NNX toy example: nnx.cached_partial ----------------------------------------

class _Count(nnx.Variable):
  pass


class _ToyMLP(nnx.Module):
  """The NNX toy example's model (02_lifted_transforms.py)."""

  def __init__(self, din, dhidden, dout, *, rngs: nnx.Rngs):
    self.linear1 = nnx.Linear(din, dhidden, rngs=rngs)
    self.linear2 = nnx.Linear(dhidden, dout, rngs=rngs)

  def __call__(self, x):
    return self.linear2(jax.nn.relu(self.linear1(x)))


def _toy_train_step(model, optimizer, batch):
  x, y = batch
  loss, grads = nnx.value_and_grad(lambda m: jnp.mean((y - m(x)) ** 2))(model)
  optimizer.update(model, grads)
  return loss


def _toy_batches(steps: int):
  xs = np.linspace(0, 1, 100, dtype=np.float32)[:, None]
  ys = 0.8 * xs ** 2 + 0.1
  rng = np.random.default_rng(0)
  for _ in range(steps):
    idx = rng.choice(len(xs), size=32)
    yield xs[idx], ys[idx]


class CachedPartialTest(ProgramTestCase):

  def test_cached_partial_over_proof_jit_and_over_nnx_jit(self):
    for name, wrap in (("proof.jit", lambda p, f: p.jit(f)),
                       ("proof.jit(nnx.jit)", lambda p, f: p.jit(nnx.jit(f)))):
      with self.subTest(name):
        proof = testing.new_proof("cached-partial")
        proof.start()
        ours_model = _ToyMLP(1, 32, 1, rngs=nnx.Rngs(0))
        theirs_model = _ToyMLP(1, 32, 1, rngs=nnx.Rngs(0))
        ours_opt = zkdv_nnx.Optimizer(ours_model, optax.sgd(1e-3), wrt=nnx.Param, proof=proof)
        theirs_opt = nnx.Optimizer(theirs_model, optax.sgd(1e-3), wrt=nnx.Param)
        ours = nnx.cached_partial(wrap(proof, _toy_train_step), ours_model, ours_opt)
        theirs = nnx.cached_partial(nnx.jit(_toy_train_step), theirs_model, theirs_opt)
        for batch in _toy_batches(3):
          self.assert_bitwise_equal(ours(batch), theirs(batch))
        self.assert_bitwise_equal(nnx.state((ours_model, ours_opt)),
                                  nnx.state((theirs_model, theirs_opt)))
        proof.finish()
        self.assert_verified(proof, 3)


# --- Flax's MNIST NNX tutorial: metrics reset and updated by an eval step ------------

class _CNN(nnx.Module):
  """The tutorial's CNN, narrower (8x8 images)."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(4, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025)
    self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(8, rngs=rngs)
    self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(32, 16, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.025)
    self.linear2 = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    return self.linear2(x)


def _cnn_loss(model, batch, rngs=None):
  logits = model(batch["image"], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits,
                                                         labels=batch["label"]).mean()
  return loss, logits


def _mnist_train_step(model, optimizer, metrics, rngs, batch):
  grad_fn = nnx.value_and_grad(_cnn_loss, has_aux=True)
  (loss, logits), grads = grad_fn(model, batch, rngs)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)


@nnx.jit
def _mnist_eval_step(model, metrics, batch):
  loss, logits = _cnn_loss(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])


def _images(key, n: int = 8) -> dict:
  return {"image": jax.random.normal(key, (n, 8, 8, 1)), "label": jnp.arange(n) % 10}


class _Setup:
  """One side of the tutorial: model, views, optimizer, metrics and dropout stream."""

  def __init__(self, optimizer_class, **proof):
    self.model = _CNN(rngs=nnx.Rngs(0))
    self.optimizer = optimizer_class(self.model, optax.adamw(0.005, 0.9), wrt=nnx.Param,
                                     **proof)
    self.metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                                   loss=nnx.metrics.Average("loss"))
    self.rngs = nnx.Rngs(0)
    self.train_model = nnx.view(self.model, deterministic=False, use_running_average=False)
    self.eval_model = nnx.view(self.model, deterministic=True, use_running_average=True)

  def epoch(self, train_step, batches, test_batches) -> dict:
    for batch in batches:
      train_step(self.train_model, self.optimizer, self.metrics, self.rngs, batch)
    logs = {f"train_{k}": v for k, v in self.metrics.compute().items()}
    self.metrics.reset()
    for batch in test_batches:
      _mnist_eval_step(self.eval_model, self.metrics, batch)
    logs.update({f"test_{k}": v for k, v in self.metrics.compute().items()})
    self.metrics.reset()
    return logs


class NNXMetricsTest(ProgramTestCase):

  def test_mnist_tutorial_loop_with_metrics_reset_and_eval(self):
    proof = testing.new_proof("nnx-mnist")
    proof.start()
    ours = _Setup(zkdv_nnx.Optimizer, proof=proof)
    theirs = _Setup(nnx.Optimizer)
    proof_step, plain_step = proof.jit(_mnist_train_step), nnx.jit(_mnist_train_step)
    keys = iter(jax.random.split(jax.random.key(5), 4))
    for _ in range(2):
      batches = [_images(next(keys))]
      test_batches = [_images(next(keys))]
      self.assert_bitwise_equal(ours.epoch(proof_step, batches, test_batches),
                                theirs.epoch(plain_step, batches, test_batches))
      self.assert_bitwise_equal(nnx.state((ours.model, ours.optimizer, ours.rngs)),
                                nnx.state((theirs.model, theirs.optimizer, theirs.rngs)))
    proof.finish()
    self.assert_verified(proof, 2)
    program = testing.records_of(proof.path, "program")[0]
    state_paths = [l["path"] for l in program["state_layout"]]
    batch_paths = [l["path"] for l in program["batch_layout"]]
    # The dropout stream feeds the update: chained. The metrics do not: batch evidence.
    self.assertTrue(any("count" in p and "[3]" in p for p in state_paths), state_paths)
    self.assertTrue(any("mean" in p for p in state_paths))  # BatchStat: trained state
    self.assertLen([p for p in batch_paths if "total" in p or "count" in p], 4)

  def test_a_metric_that_feeds_the_update_stays_in_the_chain(self):
    def step(model, optimizer, metrics, x, y):
      scale = 1.0 / (1.0 + metrics.compute()["loss"])  # the running loss scales the loss
      loss, grads = nnx.value_and_grad(lambda m: scale * jnp.mean((m(x) - y) ** 2))(model)
      metrics.update(loss=loss)
      optimizer.update(model, grads)
      return loss

    proof = testing.new_proof("nnx-metric-fed")
    proof.start()
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = zkdv_nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param, proof=proof)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    train = proof.jit(step)
    x, y = jnp.ones((4, 2)), jnp.zeros((4, 1))
    train(model, optimizer, metrics, x, y)
    metrics.reset()  # changes state the update depends on: outside proof.jit
    train(model, optimizer, metrics, x, y)
    proof.finish()
    self.assertEqual(proof.discontinuities, [1])
    program = testing.records_of(proof.path, "program")[0]
    self.assertTrue(any("total" in l["path"] for l in program["state_layout"]))

  def test_toy_example_counter_changed_by_a_test_step(self):
    class MLP(_ToyMLP):

      def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.count = _Count(jnp.array(0))

      def __call__(self, x):
        self.count[...] += 1
        return super().__call__(x)

    @nnx.jit
    def test_step(model, batch):
      x, y = batch
      return {"loss": jnp.mean((y - model(x)) ** 2)}

    proof = testing.new_proof("nnx-toy-count")
    proof.start()
    ours_model, theirs_model = (MLP(1, 32, 1, rngs=nnx.Rngs(0)) for _ in range(2))
    ours = nnx.cached_partial(proof.jit(_toy_train_step), ours_model, zkdv_nnx.Optimizer(
        ours_model, optax.sgd(1e-3), wrt=nnx.Param, proof=proof))
    theirs = nnx.cached_partial(nnx.jit(_toy_train_step), theirs_model,
                                nnx.Optimizer(theirs_model, optax.sgd(1e-3), wrt=nnx.Param))
    for step, batch in enumerate(_toy_batches(4)):
      self.assert_bitwise_equal(ours(batch), theirs(batch))
      if step % 2 == 0:
        self.assert_bitwise_equal(test_step(ours_model, batch), test_step(theirs_model, batch))
    self.assertEqual(int(ours_model.count[...]), 6)
    self.assert_bitwise_equal(nnx.state(ours_model), nnx.state(theirs_model))
    proof.finish()
    self.assert_verified(proof, 4)


# --- proof.attest on tuple and list states --------------------------------------------

def _mnist_init(sizes, key):
  """JAX's MNIST from scratch: a list of ``(w, b)``."""
  keys = jax.random.split(key, len(sizes))
  return [(0.1 * jax.random.normal(k, (m, n)), 0.1 * jax.random.normal(k, (n,)))
          for m, n, k in zip(sizes[:-1], sizes[1:], keys)]


def _mnist_predict(params, inputs):
  activations = inputs
  for w, b in params[:-1]:
    activations = jnp.tanh(jnp.dot(activations, w) + b)
  final_w, final_b = params[-1]
  logits = jnp.dot(activations, final_w) + final_b
  return logits - jax.nn.logsumexp(logits, axis=1, keepdims=True)


def _mnist_loss(params, batch):
  inputs, targets = batch
  return -jnp.mean(jnp.sum(_mnist_predict(params, inputs) * targets, axis=1))


def _mnist_update(params, batch):
  grads = jax.grad(_mnist_loss)(params, batch)
  return [(w - 0.01 * dw, b - 0.01 * db) for (w, b), (dw, db) in zip(params, grads)]


_OPTAX_TX = optax.adam(1e-2)


def _optax_step(params, opt_state, batch):
  """The pure-optax loop's step: ``(params, opt_state)`` in, the new pair out."""
  loss, grads = jax.value_and_grad(_mnist_loss)(params, batch)
  updates, opt_state = _OPTAX_TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def _optax_update(carry, batch):
  params, opt_state, _ = _optax_step(*carry, batch)
  return params, opt_state


def _mnist_batches(steps: int):
  keys = jax.random.split(jax.random.key(3), steps)
  return [(jax.random.normal(k, (8, 12)), jax.nn.one_hot(jnp.arange(8) % 4, 4)) for k in keys]


class AttestTupleStateTest(ProgramTestCase):

  def run_attested(self, update, state, steps=3, **options):
    proof = testing.new_proof("attest-tuple")
    proof.start()
    ours, theirs = proof.attest(update, **options), jax.jit(update)
    ours_state = theirs_state = state
    for batch in _mnist_batches(steps):
      ours_state, theirs_state = ours(ours_state, batch), theirs(theirs_state, batch)
      self.assert_bitwise_equal(ours_state, theirs_state)
    proof.finish()
    self.assert_verified(proof, steps)
    return proof

  def test_jax_mnist_from_scratch_list_of_layers(self):
    params = _mnist_init([12, 16, 4], jax.random.key(0))
    proof = self.run_attested(_mnist_update, params)
    program = testing.records_of(proof.path, "program")[0]
    self.assertEqual(program["post_state_outputs"], [0, 1, 2, 3])

  def test_pure_optax_params_and_opt_state_returned_as_the_pair(self):
    params = _mnist_init([12, 4], jax.random.key(0))
    proof = self.run_attested(_optax_update, (params, _OPTAX_TX.init(params)),
                              donate_argnums=0)
    self.assertEqual(testing.records_of(proof.path, "program")[0]["inputs"].count("batch"), 2)

  def test_output_with_the_state_shape_twice_is_refused(self):
    proof = testing.new_proof("attest-ambiguous")
    proof.start()

    @proof.attest
    def update(params, batch):
      grads = jax.grad(_mnist_loss)(params, batch)
      return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), grads

    with self.assertRaisesRegex(errors.StepOutputError,
                                r"returns 2 outputs \(at \[0\], \[1\]\) with that argument's"):
      update(_mnist_init([12, 4], jax.random.key(0)), _mnist_batches(1)[0])
    with self.assertRaisesRegex(errors.StepOutputError, "returns no output with"):
      proof.attest(lambda params, batch: jnp.zeros(()))(
          _mnist_init([12, 4], jax.random.key(0)), _mnist_batches(1)[0])


# --- Flax PPO: several apply_gradients in one step ------------------------------------

class _ActorCritic(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16)(x))
    return nn.log_softmax(nn.Dense(3)(x)), nn.Dense(1)(x)


def _ppo_loss(params, apply_fn, minibatch, clip_param, vf_coeff, entropy_coeff):
  states, actions, old_log_probs, returns, advantages = minibatch
  log_probs, values = apply_fn({"params": params}, states)
  values = values[:, 0]
  probs = jnp.exp(log_probs)
  value_loss = jnp.mean(jnp.square(returns - values), axis=0)
  entropy = jnp.sum(-probs * log_probs, axis=1).mean()
  log_probs_act_taken = jax.vmap(lambda lp, a: lp[a])(log_probs, actions)
  ratios = jnp.exp(log_probs_act_taken - old_log_probs)
  advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
  pg_loss = ratios * advantages
  clipped_loss = advantages * jax.lax.clamp(1.0 - clip_param, ratios, 1.0 + clip_param)
  ppo_loss = -jnp.mean(jnp.minimum(pg_loss, clipped_loss), axis=0)
  return ppo_loss + vf_coeff * value_loss - entropy_coeff * entropy


def _ppo_train_step(state, trajectories, batch_size, *, clip_param, vf_coeff, entropy_coeff):
  """Flax PPO's ``train_step``: one epoch, one ``apply_gradients`` per minibatch."""
  iterations = trajectories[0].shape[0] // batch_size
  trajectories = jax.tree.map(
      lambda x: x.reshape((iterations, batch_size) + x.shape[1:]), trajectories)
  loss = 0.0
  for batch in zip(*trajectories):
    l, grads = jax.value_and_grad(_ppo_loss)(state.params, state.apply_fn, batch, clip_param,
                                             vf_coeff, entropy_coeff)
    loss += l
    state = state.apply_gradients(grads=grads)
  return state, loss


def _trajectories(key):
  k = jax.random.split(key, 5)
  return (jax.random.normal(k[0], (8, 6)), jax.random.randint(k[1], (8,), 0, 3),
          -jax.random.uniform(k[2], (8,)), jax.random.normal(k[3], (8,)),
          jax.random.normal(k[4], (8,)))


class SeveralUpdatesTest(ProgramTestCase):

  def test_proof_jit_refuses_and_points_to_proof_attest_which_verifies(self):
    model = _ActorCritic()
    params = model.init(jax.random.key(0), jnp.ones((1, 6)))["params"]
    hyper = dict(clip_param=0.1, vf_coeff=0.5, entropy_coeff=0.01)
    proof = testing.new_proof("ppo")
    proof.start()
    refused = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply,
                                                 params=params, tx=optax.adam(1e-3))
    with self.assertRaisesRegex(errors.UnsupportedUpdateError,
                                r"calls apply_gradients\(\) 2 times.*keep Flax's own "
                                r"TrainState.*proof.attest\(_ppo_train_step, state_argnum"):
      proof.jit(_ppo_train_step, static_argnums=2)(refused, _trajectories(jax.random.key(1)),
                                                   4, **hyper)
    proof = testing.new_proof("ppo-attest")
    proof.start()
    ours = theirs = flax_train_state.TrainState.create(apply_fn=model.apply, params=params,
                                                       tx=optax.adam(1e-3))
    attested = proof.attest(_ppo_train_step, state_argnum=0, static_argnums=2)
    plain = jax.jit(_ppo_train_step, static_argnums=2)
    for i in range(3):
      trajectories = _trajectories(jax.random.key(10 + i))
      ours, our_loss = attested(ours, trajectories, 4, **hyper)
      theirs, their_loss = plain(theirs, trajectories, 4, **hyper)
      self.assert_bitwise_equal((ours, our_loss), (theirs, their_loss))
    self.assertEqual(int(ours.step), 6)  # two updates a step
    proof.finish()
    self.assert_verified(proof, 3)


# --- Flax ImageNet with half precision: bf16 params and DynamicScale ------------------

class _HalfTrainState(zkdv.jax.contrib.TrainState):
  dynamic_scale: dynamic_scale_lib.DynamicScale


class _PlainHalfTrainState(flax_train_state.TrainState):
  dynamic_scale: dynamic_scale_lib.DynamicScale


class _HalfModel(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(8, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x))
    return nn.Dense(3, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x)


def _imagenet_train_step(state, batch):
  """Flax ImageNet's ``train_step`` with a dynamic loss scale (skips non-finite steps)."""
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["label"]).mean()

  dynamic_scale, is_fin, loss, grads = state.dynamic_scale.value_and_grad(loss_fn)(
      state.params)
  new_state = state.apply_gradients(grads=grads)
  select = functools.partial(jnp.where, is_fin)
  new_state = new_state.replace(
      opt_state=jax.tree.map(select, new_state.opt_state, state.opt_state),
      params=jax.tree.map(select, new_state.params, state.params),
      dynamic_scale=dynamic_scale)
  return new_state, {"loss": loss, "scale": dynamic_scale.scale}


class DtypeChangeTest(ProgramTestCase):

  def test_bf16_moments_become_f32_once_the_loss_scale_is_an_array(self):
    model = _HalfModel()
    params = model.init(jax.random.key(0), jnp.ones((1, 4), jnp.bfloat16))["params"]
    proof = testing.new_proof("dynamic-scale")
    proof.start()
    ours = _HalfTrainState.create(proof=proof, apply_fn=model.apply, params=params,
                                  tx=optax.adam(1e-2),
                                  dynamic_scale=dynamic_scale_lib.DynamicScale())
    theirs = _PlainHalfTrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.adam(1e-2),
                                         dynamic_scale=dynamic_scale_lib.DynamicScale())
    proof_step = proof.jit(_imagenet_train_step, donate_argnums=0)
    plain_step = jax.jit(_imagenet_train_step, donate_argnums=0)
    for i in range(3):
      batch = {"image": jax.random.normal(jax.random.key(i), (8, 4), jnp.bfloat16),
               "label": jnp.arange(8) % 3}
      ours, our_metrics = proof_step(ours, batch)
      theirs, their_metrics = plain_step(theirs, batch)
      self.assert_bitwise_equal((ours.params, ours.opt_state, ours.dynamic_scale, our_metrics),
                                (theirs.params, theirs.opt_state, theirs.dynamic_scale,
                                 their_metrics))
    mu = ours.opt_state[0].mu["Dense_0"]["kernel"]
    self.assertEqual(mu.dtype, jnp.float32)  # was bfloat16 before the second step
    proof.finish()
    self.assert_verified(proof, 3)
    # One program takes the moments in bf16 and returns them in f32; the next takes them so.
    programs = testing.records_of(proof.path, "program")
    changing = [p for p in programs if "post_state_layout" in p]
    self.assertLen(changing, 1)
    changed = [(a["path"], a["dtype"], b["dtype"]) for a, b in zip(
        changing[0]["state_layout"], changing[0]["post_state_layout"]) if a != b]
    self.assertIn((".opt_state[0].mu['Dense_0']['kernel']", "bfloat16", "float32"), changed)
    self.assertEqual(programs[changing[0]["number"] + 1]["state_layout"],
                     changing[0]["post_state_layout"])


if __name__ == "__main__":
  absltest.main()
