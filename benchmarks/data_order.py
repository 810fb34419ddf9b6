"""What drawing batches in the proof's seeded order costs per step, against plain loaders.

  python -m benchmarks.data_order [--rows 60000] [--width 784] [--batch 128] [--steps 200]
                                  [--rounds 5]

A dataset of ``--rows`` rows (``x``: float32[width], ``y``: int32), batches of ``--batch``.
Rows, each the median over ``--rounds`` rounds of the mean time per batch over ``--steps``
batches (the loader's ``next`` only, no training step):

* *numpy*: a seeded ``np.random.permutation`` per epoch and a fancy-indexed gather;
* *proof.batches*: ``zkdv``'s sampler (the order from the proof's slot, the same gather);
* *grain*: Grain's ``MapDataset.source(...).shuffle(seed).batch(...)``, iterated in-process;
* *proof.grain_batches*: the same Grain pipeline reading the seeded order.

Then what the sampler adds on the commit thread per step (``SampledBatch.check``: the
batch's row hashes recomputed from the dataset and compared; ``probe_paths`` of a probed
step at probe ratio 0.01 and 1 (at 0.01 a third of the steps is probed); ``batch_paths``: every row's audit path, a full replay's update check), and the
one-off cost of the dataset's Merkle tree (``DatasetTree``) that each sampler builds; and a
``proof.jit`` training loop (an MLP 784-128-10, update checks at p = 0.01, probe ratio 0.01)
fed by the NumPy loader and by ``proof.batches``, in blocks of ``--steps`` steps taking
turns, each block settled (``wait_for_commitments``). The tables are printed last.
"""

import argparse
import pathlib
import statistics
import tempfile
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import zkdv
from zkdv import challenge
from zkdv import data as data_lib
from zkdv import digest
from zkdv import merkle

from benchmarks import scratch


def _per_batch(iterator, steps: int) -> float:
  next(iterator)  # the first batch builds what the loader needs
  started = time.perf_counter()
  for _ in range(steps):
    next(iterator)
  return (time.perf_counter() - started) / steps


def _numpy(dataset, batch: int):
  rows = len(dataset["y"])
  rng, epoch = np.random.default_rng(0), 0
  while True:
    order = rng.permutation(rows)
    for n in range(rows // batch):
      idx = order[n * batch:(n + 1) * batch]
      yield {k: v[idx] for k, v in dataset.items()}
    epoch += 1


class _Records:
  """A Grain data source of the dataset's rows (records ``{"x": ..., "y": ...}``)."""

  def __init__(self, dataset):
    self.dataset = dataset

  def __len__(self):
    return len(self.dataset["y"])

  def __getitem__(self, i):
    return {k: v[i] for k, v in self.dataset.items()}


def _grain(source, batch: int, epochs: int):
  return iter(grain.MapDataset.source(source).shuffle(seed=0).repeat(epochs).batch(
      batch, drop_remainder=True))


def _proof(name: str, probe_ratio: float = 0.0) -> zkdv.jax.ZKDV:
  return zkdv.jax.ZKDV(name, zkdv.ZKDVConfig(
      output_dir=pathlib.Path(tempfile.mkdtemp(prefix="zkdv-bench-")) / name)).start(
          probe_ratio=probe_ratio)


class _SmallMLP(nn.Module):
  """784 -> 128 -> 10."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.relu(nn.Dense(128)(x)))


def _train_step(state, batch):
  def loss(params):
    logits = state.apply_fn({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return state.apply_gradients(grads=jax.grad(loss)(state.params))


def _training(dataset, batch: int, steps: int, rounds: int) -> dict:
  """Median ms per ``proof.jit`` step (p = 0.01, probe ratio 0.01, every block settled) of
  the small MLP fed by the NumPy loader and by ``proof.batches``; blocks take turns."""
  model = _SmallMLP()
  params = model.init(jax.random.key(0), jnp.ones((1, dataset["x"].shape[1])))["params"]
  epochs = 2 + (rounds + 1) * steps * batch // len(dataset["y"])
  rows = {}
  for name in ("numpy loader", "proof.batches"):
    proof = _proof(name.replace(" ", "-").replace(".", "-"), probe_ratio=0.01)
    state = zkdv.jax.contrib.TrainState.create(  # each its own params: steps donate them
        proof=proof, apply_fn=model.apply, params=jax.tree.map(jnp.copy, params),
        tx=optax.adam(1e-3))
    loader = (_numpy(dataset, batch) if name == "numpy loader"
              else proof.batches(dataset, batch_size=batch, epochs=epochs))
    rows[name] = [proof, state, proof.jit(_train_step, donate_argnums=0), loader, []]
  for block in range(rounds + 1):  # the first block compiles and warms up
    for row in rows.values():
      proof, state, step, loader, times = row
      started = time.perf_counter()
      for _ in range(steps):
        state = step(state, next(loader))
      jax.block_until_ready(state)
      proof.wait_for_commitments()
      row[1] = state
      if block:
        times.append((time.perf_counter() - started) / steps)
  for proof, *_ in rows.values():
    proof.finish()
  return {name: statistics.median(row[4]) for name, row in rows.items()}


def _commit_costs(dataset, batch: int, steps: int) -> dict:
  """Seconds per step of what the sampler adds on the commit thread."""
  proof = _proof("commit-costs")
  loader = proof.batches(dataset, batch_size=batch, epochs=100)
  next(loader)
  order = proof._data_order  # pylint: disable=protected-access
  layouts = [digest.LeafLayout(p, dataset[k].dtype.name, (batch, *dataset[k].shape[1:]))
             for p, k in (("['x']", "x"), ("['y']", "y"))]
  layouts = [digest.LeafLayout(l.path, l.dtype, l.shape, row_group=digest.row_group_for(l))
             for l in layouts]
  sampled = [order.draw() for _ in range(steps)]
  levels = []
  for s in sampled:
    rows = [dataset[k][s.rows] for k in ("x", "y")]
    levels.append([merkle.tree_levels(digest.row_leaf_hashes(l, r)) for l, r in zip(layouts, rows)])
  costs = {}
  started = time.perf_counter()
  for n, (s, lv) in enumerate(zip(sampled, levels)):
    s.check(n, layouts, lv)
  costs["check"] = (time.perf_counter() - started) / steps
  for ratio in (0.01, 1.0):
    decision = next(d for d in (challenge.Decision(0, bytes([c]) * 32, False, False, ratio)
                                for c in range(256)) if d.probed)  # what a probed step costs
    probes = [[leaf, row] for leaf, l in enumerate(layouts)
              for row in decision.leaf_probe_rows(leaf, l)]
    started = time.perf_counter()
    for s in sampled:
      s.probe_paths(layouts, probes)
    costs[f"probe_paths {ratio:g}"] = (time.perf_counter() - started) / steps
  started = time.perf_counter()
  for s in sampled[:max(1, steps // 10)]:
    s.batch_paths(layouts)
  costs["batch_paths"] = (time.perf_counter() - started) / max(1, steps // 10)
  try:
    proof.finish()
  except zkdv.errors.NoTranscriptUpdateError:
    pass  # no step ran: only the sampler was measured
  return costs


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rows", type=int, default=60000)
  parser.add_argument("--width", type=int, default=784)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  dataset = {"x": rng.normal(size=(args.rows, args.width)).astype(np.float32),
             "y": rng.integers(0, 10, args.rows).astype(np.int32)}
  source = _Records(dataset)
  epochs = 1 + (args.steps + 1) * args.batch // args.rows
  started = time.perf_counter()
  tree = data_lib.DatasetTree([dataset["x"], dataset["y"]])
  tree_seconds = time.perf_counter() - started
  print(f"dataset tree: {tree.size} leaves in {tree_seconds:.2f} s", flush=True)

  loaders = {
      "numpy": lambda: _numpy(dataset, args.batch),
      "proof.batches": lambda: _proof("batches").batches(dataset, batch_size=args.batch,
                                                         epochs=epochs),
      "grain": lambda: _grain(source, args.batch, epochs),
      "proof.grain_batches": lambda: _proof("grain").grain_batches(
          source, batch_size=args.batch, epochs=epochs),
  }
  times = {name: [] for name in loaders}
  for r in range(args.rounds):
    for name, make in loaders.items():
      times[name].append(_per_batch(iter(make()), args.steps))
    print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.3f} ms" for k, v in times.items()),
          flush=True)
  commit = _commit_costs(dataset, args.batch, args.steps)
  trained = _training(dataset, args.batch, args.steps, args.rounds)

  median = {k: statistics.median(v) for k, v in times.items()}
  print(f"\n{args.rows} rows (x float32[{args.width}], y int32), batches of {args.batch}, "
        f"{args.steps} batches x {args.rounds} rounds; median ms per batch\n")
  print("| loader | ms per batch | ratio to its plain loader |")
  print("|---|---|---|")
  for name, plain in (("numpy", "numpy"), ("proof.batches", "numpy"), ("grain", "grain"),
                      ("proof.grain_batches", "grain")):
    print(f"| {name} | {median[name] * 1e3:.3f} | {median[name] / median[plain]:.2f} |")
  print("\n| commit thread, per step | ms |")
  print("|---|---|")
  for name, seconds in commit.items():
    print(f"| {name} | {seconds * 1e3:.3f} |")
  print(f"| dataset tree (once per sampler) | {tree_seconds * 1e3:.0f} |")
  print("\n| training step (MLP 784-128-10, proof.jit, p = 0.01, probe ratio 0.01) | ms per step "
        "| ratio |")
  print("|---|---|---|")
  for name, seconds in trained.items():
    print(f"| {name} | {seconds * 1e3:.3f} | {seconds / trained['numpy loader']:.2f} |")


if __name__ == "__main__":
  with scratch.run_folder("zkdv-data-order-"):
    main()
