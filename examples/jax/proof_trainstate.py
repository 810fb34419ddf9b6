"""The complete program of the tutorial "Train a Flax model with TrainState".

It uses ``zkdv.jax.ZKDV`` directly, so it runs without a DVBench server:

  python examples/jax/proof_trainstate.py [--steps 10] [--output-dir DIR]

It trains the tutorial's classifier (its start attested with ``proof.init``), then the
tutorial's variants (a subclass carrying BatchNorm ``batch_stats``, a PRNG key as a
dynamic argument and its loss committed as a step metric, an ``attest_apply_fn``, and each
overlap policy), and prints where each transcript is (``zkdv-proofs/`` or
``--output-dir``), how many checks ran and the ``zkdv verify PATH`` that checks it. The
tutorial's final params go into its transcript folder as ``jax-checkpoint.msgpack``.
"""

import argparse
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import serialization
from flax import struct

import zkdv


class TinyClassifier(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    return nn.Dense(2)(tokens.astype(jnp.float32))


class NormClassifier(nn.Module):
  """A classifier with BatchNorm and dropout, for the subclass variant."""

  @nn.compact
  def __call__(self, tokens, train: bool = True):
    x = nn.Dense(8)(tokens.astype(jnp.float32))
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.Dropout(0.1, deterministic=not train)(nn.relu(x))
    return nn.Dense(2)(x)


class ModelTrainState(zkdv.jax.contrib.TrainState):
  batch_stats: Any = struct.field(pytree_node=True)


BATCH = jnp.asarray(
    [
        [0, 0, 0, 1, 0],
        [0, 1, 0, 1, 0],
        [1, 0, 1, 0, 1],
        [1, 1, 1, 0, 1],
    ],
    dtype=jnp.uint32,
)


def new_proof(name, args, probability):
  config = zkdv.ZKDVConfig(
      sampling_policy=zkdv.SamplingPolicy(update_check_probability=probability),
      output_dir=None if args.output_dir is None else args.output_dir / name,
  )
  proof = zkdv.jax.ZKDV(name, config)
  proof.start(rolling_window=4, probe_ratio=0.01)
  return proof


def report(proof):
  print(f"{proof.name}: {proof.steps} steps, {proof.checks['update']} update "
        f"checks, {proof.checks['state']} state checks -> {proof.path}\n"
        f"  next: zkdv verify {proof.path}")


def tutorial(args):
  """Steps 2-6 of the tutorial."""
  proof = new_proof("jax-train-state", args, args.probability)

  model = TinyClassifier()
  # proof.init in place of model.init attests the start: the verifier replays it.
  params = proof.init(
      model.init,
      jax.random.key(0),
      jnp.ones((1, 4), dtype=jnp.uint32),
  )["params"]

  state = zkdv.jax.contrib.TrainState.create(
      proof=proof,
      apply_fn=model.apply,
      params=params,
      tx=optax.adam(1e-2),
  )

  @proof.jit(donate_argnums=(0,))
  def train_step(state, batch):
    tokens = batch[:, :4]
    labels = batch[:, 4].astype(jnp.int32)

    def loss(params):
      logits = state.apply_fn({"params": params}, tokens)
      return optax.softmax_cross_entropy_with_integer_labels(
          logits,
          labels,
      ).mean()

    grads = jax.grad(loss)(state.params)
    return state.apply_gradients(grads=grads)

  for _ in range(args.steps):
    state = train_step(state, BATCH)

  proof.finish()
  # The trained params go beside the records they were committed in.
  checkpoint = proof.path / "jax-checkpoint.msgpack"
  checkpoint.write_bytes(serialization.to_bytes(state.params))
  report(proof)
  print(f"  checkpoint (final params): {checkpoint}")


def batch_stats_and_dropout(args):
  """The subclass with batch_stats, and a PRNG key as a dynamic argument."""
  proof = new_proof("batch-stats-dropout", args, args.probability)
  model = NormClassifier()
  variables = model.init(jax.random.key(0), jnp.ones((4, 4), jnp.uint32), train=False)
  state = ModelTrainState.create(
      proof=proof,
      apply_fn=model.apply,
      params=variables["params"],
      tx=optax.adam(1e-2),
      batch_stats=variables["batch_stats"],
  )

  @proof.jit
  def train_step(state, batch, key):
    def loss(params):
      logits, updates = state.apply_fn(
          {"params": params, "batch_stats": state.batch_stats}, batch[:, :4],
          mutable=["batch_stats"], rngs={"dropout": key})
      labels = batch[:, 4].astype(jnp.int32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), updates

    (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
    new_state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
    # Outputs beside the state are committed with each step as its metrics.
    return new_state, {"loss": value}

  for _ in range(args.steps):
    # A PRNG key among a step's arguments must be the proof's key of that step.
    state, metrics = train_step(state, BATCH, proof.step_key())
  proof.finish()
  report(proof)
  print(f"  last committed loss: {float(metrics['loss']):.4f}")


def classifier_step(state, batch):
  """The tutorial's training step, for the variants below."""
  def loss(params):
    logits = state.apply_fn({"params": params}, batch[:, :4])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[:, 4].astype(jnp.int32)).mean()
  return state.apply_gradients(grads=jax.grad(loss)(state.params))


def portable_dense(variables, tokens):
  """The same computation as TinyClassifier, written with jax.numpy only."""
  p = variables["params"]["Dense_0"]
  return tokens.astype(jnp.float32) @ p["kernel"] + p["bias"]


def attested_apply(args):
  """attest_apply_fn: sampled replays use a portable implementation."""
  proof = new_proof("attest-apply-fn", args, args.probability)
  model = TinyClassifier()
  params = model.init(jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
  state = zkdv.jax.contrib.TrainState.create(
      proof=proof, apply_fn=model.apply, attest_apply_fn=portable_dense,
      params=params, tx=optax.sgd(1e-1, momentum=0.9))

  train_step = proof.jit(classifier_step)
  for _ in range(args.steps):
    state = train_step(state, BATCH)
  proof.finish()
  report(proof)


def overlap_policies(args):
  """The same training under each zkdv.overlap policy."""
  for policy in (zkdv.overlap.UNCHECKED, zkdv.overlap.ALWAYS, zkdv.overlap.NEVER):
    proof = new_proof(f"overlap-{policy.value}", args, args.probability)
    model = TinyClassifier()
    params = model.init(jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
    state = zkdv.jax.contrib.TrainState.create(
        proof=proof, apply_fn=model.apply, params=params, tx=optax.adam(1e-2),
        zkdv_overlap=policy)

    train_step = proof.jit(classifier_step, donate_argnums=(0,))
    for _ in range(args.steps):
      state = train_step(state, BATCH)
    proof.finish()
    report(proof)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--probability", type=float, default=0.5,
                      help="update check probability (the tutorial uses 0.01)")
  parser.add_argument("--output-dir", type=pathlib.Path, default=None)
  args = parser.parse_args(argv)
  tutorial(args)
  batch_stats_and_dropout(args)
  attested_apply(args)
  overlap_policies(args)


if __name__ == "__main__":
  main()
