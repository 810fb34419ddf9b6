"""The complete program of the tutorial "Train a Flax NNX model".

It uses ``zkdv.jax.ZKDV`` directly, so it runs without a DVBench server:

  python examples/jax/proof_nnx.py [--steps 10] [--output-dir DIR]

It trains a small CNN with BatchNorm and dropout with ``nnx.Optimizer``, changed in two
places (the optimizer and the jit), keeps the data loader's smaller last batch, prints
the loss with ``jax.debug.print`` inside the step, and prints where the transcript is,
how many checks ran and the ``zkdv verify PATH`` that checks it.
"""

import argparse
import pathlib

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import zkdv


class CNN(nnx.Module):
  """Conv + BatchNorm + dropout + a linear classifier, for 8x8 single-channel images."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 8, (3, 3), rngs=rngs)
    self.norm = nnx.BatchNorm(8, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.out = nnx.Linear(8 * 8 * 8, 10, rngs=rngs)

  def __call__(self, x):
    x = self.dropout(nnx.relu(self.norm(self.conv(x))))
    return self.out(x.reshape(x.shape[0], -1))


def loss_fn(model, images, labels):
  logits = model(images)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits


def batches(steps, batch_size=16):
  """Random images and labels; the last batch keeps the remainder, as data loaders do."""
  key = jax.random.key(42)
  for i in range(steps):
    rows = batch_size if i < steps - 1 else batch_size // 2 + 1
    key, image_key, label_key = jax.random.split(key, 3)
    yield (jax.random.normal(image_key, (rows, 8, 8, 1)),
           jax.random.randint(label_key, (rows,), 0, 10))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--probability", type=float, default=0.5,
                      help="update check probability (the tutorial uses 0.01)")
  parser.add_argument("--output-dir", type=pathlib.Path, default=None)
  args = parser.parse_args(argv)

  config = zkdv.ZKDVConfig(
      sampling_policy=zkdv.SamplingPolicy(update_check_probability=args.probability),
      output_dir=None if args.output_dir is None else args.output_dir / "jax-nnx")
  proof = zkdv.jax.ZKDV("jax-nnx", config)
  proof.start(rolling_window=4)

  model = CNN(nnx.Rngs(0, dropout=1))
  # Change 1 of 2: nnx.Optimizer -> zkdv.jax.contrib.nnx.Optimizer(..., proof=proof).
  optimizer = zkdv.jax.contrib.nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param,
                                             proof=proof)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                            loss=nnx.metrics.Average("loss"))

  # Change 2 of 2: @nnx.jit -> @proof.jit. The objects are updated in place, as by nnx.jit.
  @proof.jit
  def train_step(model, optimizer, metrics, images, labels):
    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, images, labels)
    optimizer.update(model, grads)
    metrics.update(loss=loss, logits=logits, labels=labels)
    jax.debug.print("step {step}: loss {loss:.4f}", step=optimizer.step[...], loss=loss)
    return loss

  for images, labels in batches(args.steps):
    train_step(model, optimizer, metrics, images, labels)

  proof.finish()
  summary = {name: float(value) for name, value in metrics.compute().items()}
  print(f"{proof.name}: {proof.steps} steps, {proof.checks['update']} update checks, "
        f"{proof.checks['state']} state checks, metrics {summary} -> {proof.path}\n"
        f"  next: zkdv verify {proof.path}")
  assert int(optimizer.step[...]) == args.steps and jnp.isfinite(summary["loss"])


if __name__ == "__main__":
  main()
