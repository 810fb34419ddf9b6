"""Every optax optimizer (and optax.contrib's) that Flax's TrainState can drive: trained under
``proof.jit`` with every step checked, the final params and optimizer state equal plain Flax
``TrainState`` + ``jax.jit`` bit for bit (dtype and bytes), and every check replays exactly.

Optimizers whose ``update`` needs more than gradients (``value``, ``value_fn``, per-example
gradients: lbfgs, polyak_sgd, momo, momo_adam, reduce_on_plateau, sophia, dpsgd,
differentially_private_aggregate, sam) cannot be driven by ``TrainState.apply_gradients``
and are left out, as in Flax.
"""

from absl.testing import absltest
from absl.testing import parameterized
from flax.training import train_state as flax_train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib

from tests import testing

STEPS = 2
LR = 1e-2

OPTIMIZERS = {
    **{name: (lambda name=name: getattr(optax, name)(LR)) for name in (
        "adabelief", "adadelta", "adafactor", "adagrad", "adam", "adamax", "adamaxw", "adamw",
        "adan", "amsgrad", "fromage", "lamb", "lars", "lion", "novograd", "optimistic_adam_v2",
        "optimistic_gradient_descent", "radam", "rmsprop", "rprop", "sgd", "sign_sgd",
        "signum", "sm3", "yogi")},
    "noisy_sgd": lambda: optax.noisy_sgd(LR, key=jax.random.key(1)),
    "nadam": lambda: optax.adam(LR, nesterov=True),
    "sgd_nesterov": lambda: optax.sgd(LR, momentum=0.9, nesterov=True),
    "adamw_schedule": lambda: optax.adamw(optax.warmup_cosine_decay_schedule(0., LR, 1, 10)),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(LR), every_k_schedule=2),
    "chain_clip": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(LR)),
    **{f"contrib.{name}": (lambda name=name: getattr(optax.contrib, name)(LR)) for name in (
        "acprop", "ademamix", "adopt", "dadapt_adamw", "madgrad", "prodigy",
        "schedule_free_adamw", "schedule_free_sgd", "simplified_ademamix")},
    "contrib.cocob": lambda: optax.contrib.cocob(),
    "contrib.dog": lambda: optax.contrib.dog(),
    "contrib.dowg": lambda: optax.contrib.dowg(),
    "contrib.mechanize": lambda: optax.contrib.mechanize(optax.adam(LR)),
    "contrib.muon": lambda: optax.contrib.muon(LR),
    "contrib.normalize": lambda: optax.chain(optax.contrib.normalize(), optax.sgd(LR)),
}


def _host(x) -> np.ndarray:
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


def _assert_bitwise(test, ours, theirs, what):
  ours, theirs = jax.tree.leaves(ours), jax.tree.leaves(theirs)
  test.assertEqual(len(ours), len(theirs), what)
  for a, b in zip(map(_host, ours), map(_host, theirs)):
    test.assertEqual(a.dtype, b.dtype, what)
    test.assertEqual(a.tobytes(), b.tobytes(), what)


class OptimizerMatrixTest(parameterized.TestCase):

  @parameterized.named_parameters(*[(name, name) for name in sorted(OPTIMIZERS)])
  def test_bitwise_equal_to_flax_and_every_check_exact(self, name):
    batch = jnp.asarray(testing.TUTORIAL_BATCH)
    proof = testing.new_proof(name.replace(".", "-"), update_p=1.0)
    state = testing.classifier_state(proof, tx=OPTIMIZERS[name]())
    theirs = flax_train_state.TrainState.create(
        apply_fn=state.apply_fn, params=state.params, tx=OPTIMIZERS[name]())
    train_step, flax_step = proof.jit(testing.classifier_step), jax.jit(testing.classifier_step)
    for _ in range(STEPS):
      state, theirs = train_step(state, batch), flax_step(theirs, batch)
    proof.finish()
    _assert_bitwise(self, state.params, theirs.params, f"{name}: params")
    _assert_bitwise(self, state.opt_state, theirs.opt_state, f"{name}: opt_state")
    self.assertEqual(proof.failed_checks, [])
    self.assertEqual(proof.checks["update"], STEPS)


if __name__ == "__main__":
  absltest.main()
