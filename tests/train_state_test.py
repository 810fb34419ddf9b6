"""zkdv.jax.contrib.TrainState behaves like Flax's and records only under proof.jit.

The tests that also run the verifier are in ``TrainStateVerifiedTest``.
"""

import contextlib
import copy
import io
import re
from typing import Any
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from absl.testing import parameterized
from flax import linen as nn
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax import struct
from flax.training import train_state as flax_train_state

import zkdv
from tests import testing
from zkdv import errors
from zkdv import verify
from zkdv.jax.contrib import TrainState


def _lowered_step(state) -> str:
  """The StableHLO of the tutorial step on ``state`` under jax.jit, without its module name."""
  lowered = jax.jit(testing.classifier_step).lower(state, jnp.asarray(testing.TUTORIAL_BATCH))
  return re.sub(r"^module @\S+", "module", lowered.as_text(debug_info=False))


def _classifier_states(tx) -> tuple[TrainState, flax_train_state.TrainState]:
  model = testing.TinyClassifier()
  params = model.init(jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
  return (TrainState.create(apply_fn=model.apply, params=params, tx=tx),
          flax_train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx))


class TrainStateTest(chex.TestCase):

  def test_is_a_flax_train_state_with_three_static_fields(self):
    state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
    self.assertIsInstance(state, flax_train_state.TrainState)
    self.assertIsNone(state.proof)
    self.assertIsNone(state.attest_apply_fn)
    self.assertIs(state.zkdv_overlap, zkdv.overlap.UNCHECKED)
    self.assertEqual(jax.tree.structure(state).num_leaves,
                     len(jax.tree.leaves((state.step, state.params, state.opt_state))))

  @chex.variants(with_jit=True, without_jit=True)
  def test_same_transition_as_flax(self):
    params = {"w": jnp.arange(4.0), "b": jnp.ones(())}
    grads = {"w": jnp.full(4, 0.5), "b": jnp.asarray(-1.0)}
    tx = optax.adamw(1e-2)
    ours = TrainState.create(apply_fn=None, params=params, tx=tx)
    theirs = flax_train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    apply = self.variant(lambda s, g: s.apply_gradients(grads=g))
    for _ in range(3):
      ours, theirs = apply(ours, grads), apply(theirs, grads)
    chex.assert_trees_all_equal(ours.params, theirs.params)
    chex.assert_trees_all_equal(ours.opt_state, theirs.opt_state)
    self.assertEqual(int(ours.step), 3)

  def test_runs_flax_apply_gradients(self):
    flax_apply = flax_train_state.TrainState.apply_gradients
    with mock.patch.object(flax_train_state.TrainState, "apply_gradients", autospec=True,
                           side_effect=flax_apply) as spy:
      TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1)
                        ).apply_gradients(grads={"w": jnp.ones(2)})
      TrainState.create(apply_fn=None, params=jnp.ones(2), tx=optax.sgd(0.1)
                        ).apply_gradients(grads=jnp.ones(2))
    self.assertEqual(spy.call_count, 2)

  def test_step_lowers_to_the_same_program_as_flax(self):
    ours, theirs = _classifier_states(optax.adamw(1e-2))
    self.assertEqual(_lowered_step(ours), _lowered_step(theirs))

  @chex.variants(with_jit=True, without_jit=True)
  def test_bare_array_params_of_the_quick_start(self):
    state = TrainState.create(params=jnp.arange(8, dtype=jnp.float32),
                              apply_fn=lambda v, b: v["params"] * b, tx=optax.sgd(0.5))
    new = self.variant(lambda s: s.apply_gradients(grads=jnp.ones(8)))(state)
    np.testing.assert_array_equal(new.params, np.arange(8, dtype=np.float32) - 0.5)
    self.assertIs(new.tx, state.tx)
    with self.assertRaises(Exception):  # Flax's own class raises on bare arrays
      flax_train_state.TrainState.create(
          params=jnp.arange(8.0), apply_fn=None, tx=optax.sgd(0.5)
      ).apply_gradients(grads=jnp.ones(8))

  def test_bare_array_params_update_as_the_same_params_in_a_dict(self):
    tx = optax.adam(1e-1)
    bare = TrainState.create(apply_fn=None, params=jnp.arange(4.0), tx=tx)
    boxed = flax_train_state.TrainState.create(apply_fn=None, params={"w": jnp.arange(4.0)},
                                               tx=tx)
    for grads in (jnp.ones(4), jnp.arange(4.0) - 2):
      bare = bare.apply_gradients(grads=grads)
      boxed = boxed.apply_gradients(grads={"w": grads})
    chex.assert_trees_all_equal(bare.params, boxed.params["w"])
    chex.assert_trees_all_equal(jax.tree.leaves(bare.opt_state), jax.tree.leaves(boxed.opt_state))
    self.assertEqual(int(bare.step), 2)

  def test_a_sequence_of_params_is_created_by_flax_as_the_same_params_in_a_dict(self):
    params = (np.arange(3, dtype=np.float32), np.ones((2, 2), np.float32))
    with self.assertRaises(ValueError):  # Flax's own create cannot ask a tuple of arrays
      flax_train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(0.1))
    ours = TrainState.create(apply_fn=None, params=params, tx=optax.adam(0.1))
    theirs = flax_train_state.TrainState.create(
        apply_fn=None, params={"a": params[0], "b": params[1]}, tx=optax.adam(0.1))
    self.assertIs(ours.params, params)
    self.assertEqual(int(ours.step), 0)
    for a, b in zip(jax.tree.leaves(ours.opt_state), jax.tree.leaves(theirs.opt_state)):
      self.assertEqual((np.asarray(a).dtype, np.asarray(a).tobytes()),
                       (np.asarray(b).dtype, np.asarray(b).tobytes()))

  def test_overwrite_with_gradient_convention(self):
    params = {"params": {"w": jnp.ones(3)}, OVERWRITE_WITH_GRADIENT: {"scale": jnp.ones(())}}
    grads = {"params": {"w": jnp.ones(3)}, OVERWRITE_WITH_GRADIENT: {"scale": jnp.asarray(7.0)}}
    ours = TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    theirs = flax_train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    ours, theirs = ours.apply_gradients(grads=grads), theirs.apply_gradients(grads=grads)
    chex.assert_trees_all_equal(ours.params, theirs.params)
    self.assertEqual(float(ours.params[OVERWRITE_WITH_GRADIENT]["scale"]), 7.0)

  def test_subclass_with_extra_field_and_replace(self):
    state = testing.BatchStatsState.create(
        apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1),
        batch_stats={"mean": jnp.zeros(2)})
    new = state.apply_gradients(grads={"w": jnp.ones(2)}, batch_stats={"mean": jnp.ones(2)})
    np.testing.assert_array_equal(new.batch_stats["mean"], np.ones(2))
    self.assertIs(new.replace(zkdv_overlap=zkdv.overlap.NEVER).zkdv_overlap,
                  zkdv.overlap.NEVER)
    with self.assertRaises(TypeError):
      TrainState.create(apply_fn=None, params={}, tx=optax.sgd(0.1), zkdv_overlap="never")

  def test_plain_jit_and_device_put_record_nothing(self):
    proof = testing.new_proof("plain")
    proof.start()
    state = jax.device_put(testing.classifier_state(proof))
    state = jax.jit(testing.classifier_step)(state, jnp.asarray(testing.TUTORIAL_BATCH))
    self.assertEqual(int(state.step), 1)
    self.assertEqual(proof.steps, 0)
    self.assertEqual(testing.records_of(proof.path, "step"), [])

  def test_bare_array_quick_start_under_proof_jit(self):
    proof, state = _bare_array_run()
    np.testing.assert_allclose(state.params, np.arange(8) - 0.1 * (0 + 1 + 2),
                               rtol=1e-6)
    program = testing.records_of(proof.path, "program")[0]
    self.assertEqual([l["path"] for l in program["state_layout"]], [".step", ".params"])
    self.assertEqual(program["params_leaves"], [1])
    self.assertEqual(proof.failed_checks, [])


def _bare_array_run():
  """Three proof.jit steps on bare-array params; returns (proof, last state)."""
  proof = testing.new_proof("quick-start", update_p=1.0)
  proof.start()
  state = TrainState.create(proof=proof, params=jnp.arange(8, dtype=jnp.float32),
                            apply_fn=lambda v, b: v["params"] * b, tx=optax.sgd(0.1))

  @proof.jit
  def train_step(state, batch):
    grads = jax.grad(lambda p: jnp.sum(state.apply_fn({"params": p}, batch)))(state.params)
    return state.apply_gradients(grads=grads)

  for i in range(3):
    state = train_step(state, jnp.full(8, float(i)))
  proof.finish()
  return proof, state


class StatsState(TrainState):
  batch_stats: Any = struct.field(pytree_node=True)


class _Normed(nn.Module):
  """A Dense wrapped in Flax's SpectralNorm or WeightNorm."""

  norm: str

  @nn.compact
  def __call__(self, x):
    if self.norm == "spectral":
      return nn.SpectralNorm(nn.Dense(3))(x, update_stats=True)
    return nn.WeightNorm(nn.Dense(3))(x)


def _plain(state: TrainState) -> flax_train_state.TrainState:
  """The same state as Flax's own class, or Flax's subclass with batch_stats."""
  fields = {f: getattr(state, f) for f in ("step", "apply_fn", "params", "tx", "opt_state")}
  if isinstance(state, StatsState):
    return _FlaxStatsState(batch_stats=state.batch_stats, **fields)
  return flax_train_state.TrainState(**fields)


class _FlaxStatsState(flax_train_state.TrainState):
  batch_stats: Any = struct.field(pytree_node=True)


def _normed_state(norm: str, proof):
  model = _Normed(norm)
  variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
  if "batch_stats" not in variables:
    return TrainState.create(proof=proof, apply_fn=model.apply, params=variables["params"],
                             tx=optax.adam(1e-2))
  return StatsState.create(proof=proof, apply_fn=model.apply, params=variables["params"],
                           batch_stats=variables["batch_stats"], tx=optax.adam(1e-2))


def _normed_step(state, x, y):
  def loss(params):
    variables = {"params": params}
    if hasattr(state, "batch_stats"):
      variables["batch_stats"] = state.batch_stats
      out, updates = state.apply_fn(variables, x, mutable=["batch_stats"])
    else:
      out, updates = state.apply_fn(variables, x), {}
    return jnp.mean((out - y) ** 2), updates
  grads, updates = jax.grad(loss, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads, **updates)


def _fp8_state(proof):
  model = nn.Dense(3, dot_general_cls=nn.Fp8DirectDotGeneralOp)
  variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
  return TrainState.create(proof=proof, apply_fn=model.apply, params=variables,
                           tx=optax.sgd(1e-1))


def _fp8_step(state, x, y):
  grads = jax.grad(lambda v: jnp.mean((state.apply_fn(v, x) - y) ** 2))(state.params)
  return state.apply_gradients(grads=grads)


def _scaled_step(state, x, scale):
  """A step that scales its gradients by ``scale`` (a Python float: weakly typed)."""
  grads = jax.grad(lambda p: jnp.sum((p["w"] * x) ** 2))(state.params)
  return state.apply_gradients(grads=jax.tree.map(lambda g: g * scale, grads))


class TrainStateVerifiedTest(parameterized.TestCase):
  """Runs under proof.jit with every step checked, compared with Flax under jax.jit and
  verified."""

  def lockstep(self, name, make_state, step, calls):
    """(proof, our last state, Flax's last state) of ``calls`` under both jits."""
    proof = testing.new_proof(name)
    proof.start()
    ours = make_state(proof)
    theirs = _plain(ours)
    proof_step, plain_step = proof.jit(step), jax.jit(step)
    for args in calls:
      ours, theirs = proof_step(ours, *args), plain_step(theirs, *args)
      for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        self.assertEqual((a.dtype, jax.typeof(a).weak_type), (b.dtype, jax.typeof(b).weak_type))
        self.assertEqual(np.asarray(a).tobytes(), np.asarray(b).tobytes())
    proof.finish()
    self.assertEqual(proof.checks["update"], len(calls))
    report = verify.verify(proof.path)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    return proof, ours, theirs

  def test_bare_array_quick_start_verifies(self):
    report = verify.verify(_bare_array_run()[0].path)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())

  @parameterized.named_parameters(
      ("spectral_norm", lambda proof: _normed_state("spectral", proof), _normed_step),
      ("weight_norm", lambda proof: _normed_state("weight", proof), _normed_step),
      ("fp8", _fp8_state, _fp8_step))
  def test_flax_train_state_scenarios(self, make_state, step):
    x, y = jnp.linspace(-1, 1, 8).reshape(2, 4), jnp.ones((2, 3))
    _, ours, _ = self.lockstep("flax-scenario", make_state, step, [(x, y)] * 2)
    self.assertEqual(int(ours.step), 2)

  def test_smaller_last_batch_traces_a_new_program(self):
    batch = jnp.asarray(testing.TUTORIAL_BATCH)
    proof, _, _ = self.lockstep("ragged", testing.classifier_state, testing.classifier_step,
                                [(batch,), (batch,), (batch[:3],)])
    programs = testing.records_of(proof.path, "program")
    self.assertEqual([p["batch_layout"][0]["shape"] for p in programs], [[4, 5], [3, 5]])
    self.assertEqual([s["program"] for s in testing.records_of(proof.path, "step")], [0, 0, 1])
    self.assertEqual(proof.discontinuities, [])

  def test_weak_types_as_jax_jit_in_bfloat16(self):
    def make_state(proof):
      return TrainState.create(proof=proof, apply_fn=None, tx=optax.sgd(0.1, momentum=0.9),
                               params={"w": jnp.arange(4, dtype=jnp.bfloat16)})
    x = jnp.ones(4, jnp.bfloat16)
    _, ours, _ = self.lockstep("weak-types", make_state, _scaled_step, [(x, 0.5)] * 2)
    self.assertTrue(jax.typeof(ours.step).weak_type)  # Flax's step=0, as under jax.jit
    self.assertEqual(ours.opt_state[0].trace["w"].dtype, jnp.bfloat16)

  def test_debug_print_prints_in_production_and_replays_exactly(self):
    def step(state, batch):
      loss, grads = jax.value_and_grad(testing.classifier_loss, argnums=2)(
          state, batch, state.params)
      jax.debug.print("step {s} loss {l:.6f}", s=state.step, l=loss)
      return state.apply_gradients(grads=grads)

    batch = jnp.asarray(testing.TUTORIAL_BATCH)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      self.lockstep("debug-print", testing.classifier_state, step, [(batch,)] * 2)
    lines = printed.getvalue().splitlines()
    self.assertLen(lines, 4)  # each step's line, under proof.jit and under jax.jit
    self.assertEqual(lines[0::2], lines[1::2])
    self.assertRegex(lines[2], r"^step 1 loss \d\.\d{6}$")

  def test_debug_print_inside_a_loop_names_what_to_do(self):
    proof = testing.new_proof("debug-loop")
    proof.start()

    @proof.jit
    def train_step(state, batch):
      jax.lax.fori_loop(0, 2, lambda i, c: (jax.debug.print("{}", i), c)[1], 0)
      return testing.classifier_step(state, batch)

    with self.assertRaisesRegex(errors.ExportError,
                                r"train_step calls jax.debug.print.*inside `scan`.*In the body of "
                                r"train_step, print the values that `scan` returns") as raised:
      train_step(testing.classifier_state(proof), jnp.asarray(testing.TUTORIAL_BATCH))
    self.assertNotIn("attest_apply_fn", str(raised.exception))

  def test_copies_share_the_proof_and_continue_the_chain(self):
    proof = testing.new_proof("copies")
    proof.start()
    state = testing.classifier_state(proof)
    train_step = proof.jit(testing.classifier_step)
    batch = jnp.asarray(testing.TUTORIAL_BATCH)
    state = train_step(state, batch)
    for copied in (copy.deepcopy(state), copy.copy(state)):
      self.assertIs(copied.proof, proof)
      chex.assert_trees_all_equal(jax.tree.leaves(copied), jax.tree.leaves(state))
    state = train_step(copy.deepcopy(state), batch)
    proof.finish()
    self.assertEqual(proof.discontinuities, [])
    self.assertEqual(proof.steps, 2)


if __name__ == "__main__":
  absltest.main()
