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
batch's row hashes recomputed from the dataset and compared; ``probe_paths`` at probe ratio
0.01 and 1; ``batch_paths``: every row's audit path, a full replay's update check), and the
one-off cost of the dataset's Merkle tree (``DatasetTree``) that each sampler builds. The
table is printed last.
"""

import argparse
import pathlib
import statistics
import tempfile
import time

import grain
import numpy as np

import zkdv
from zkdv import challenge
from zkdv import data as data_lib
from zkdv import digest
from zkdv import merkle


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


def _proof(name: str) -> zkdv.jax.ZKDV:
  return zkdv.jax.ZKDV(name, zkdv.ZKDVConfig(
      output_dir=pathlib.Path(tempfile.mkdtemp(prefix="zkdv-bench-")) / name)).start()


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
    decision = challenge.Decision(0, bytes(32), False, False, ratio)
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


if __name__ == "__main__":
  main()
