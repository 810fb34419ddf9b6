"""What a verifiable step costs: proof.jit against jax.jit, a naive baseline and the floor.

  python -m benchmarks.overhead [--workload mlp|mlp256|mlp128|cnn|all] [--rounds 6] [--block 20]
                                [--rows ...] [--pipelined]

Every configuration trains its own copy of the workload in one process; the
configurations take turns in blocks of ``--block`` steps (A, B, C, ..., A, B,
...), after a warm-up. A block's time includes the drain of the proof's pipeline
after it (its commitments and checks). *ms/step incl. checks* is the total time
over all blocks per step (a segment's state hash falls in some blocks only, so
the median block would leave it out), and the ratios are of those; the median
block is shown beside it. Peak RSS is measured for each configuration in a
fresh subprocess. Column *k* is the length of the segment a proof's median step was in;
*checks* counts the update checks its segments drew (each replays its segment: at p=0.01
a run of a few hundred steps may draw none, or one that costs a tenth of it, so the ratio
including checks is measured over runs long enough to draw some: ``--rounds 30 --block
40`` is 1,200 steps a row). The table comes last.

By default every step is awaited (``jax.block_until_ready``), as a loop that reads
each step's loss does: the driver's Python before a step's dispatch adds to every
step. ``--pipelined`` awaits only each block's last step, as a loop that lets JAX
dispatch ahead does: that Python then runs while the previous step computes.

Rows: ``jax.jit``; *naive* (``jax.jit`` + ``jax.device_get`` + ``hashlib.sha256``
of state and batch every step); *floor* (``jax.jit`` + one native BLAKE3 pass
over post-state and batch); ``proof.jit`` at p=0.01 with the adaptive segment
length (the default) for each overlap policy, with segments of one step (every
state committed), with a rolling window of 64 steps (so the adaptive
segments may reach 64), with the device digest backend; ``proof.jit`` at
p=1.0; and Flax NNX: the same model (the Linen module through ``nnx.bridge.ToNNX``) with ``nnx.Optimizer`` under ``nnx.jit``, and
with ``zkdv.jax.contrib.nnx.Optimizer`` under ``proof.jit`` at p=0.01.
"""

import argparse
import gc
import hashlib
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import zkdv
from benchmarks import common
from zkdv import digest
from zkdv import transcript
from zkdv.jax import arrays


class CNN(nn.Module):
  """A compute-heavier workload: two convolutions on 28x28 images."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(32, (3, 3))(x))
    x = nn.avg_pool(nn.relu(nn.Conv(64, (3, 3))(x)), (2, 2), (2, 2))
    return nn.Dense(10)(x.reshape((x.shape[0], -1)))


def cnn_workload(batch_size: int = 128):
  model = CNN()
  params = model.init(jax.random.key(0), jnp.ones((1, 28, 28, 1)))["params"]
  x = jax.random.normal(jax.random.key(1), (batch_size, 28, 28, 1))
  y = jax.random.randint(jax.random.key(2), (batch_size,), 0, 10)
  return model, params, (x, y)


WORKLOADS = {"mlp": ("MLP 784-1024x4-10, Adam, batch 1024", common.mlp_workload),
             "mlp256": ("MLP 784-1024x4-10, Adam, batch 256",
                        lambda: common.mlp_workload(256)),
             "mlp128": ("MLP 784-1024x4-10, Adam, batch 128",
                        lambda: common.mlp_workload(128)),
             "cnn": ("CNN 2 conv + dense, Adam, batch 128", cnn_workload)}

# (row, p, overlap, digest backend, segment length: None is the adaptive default,
#  rolling window: None is proof.start's default)
PROOF_CONFIGS = [(f"proof.jit p=0.01 {o.value} host", 0.01, o, "host", None, None)
                 for o in (zkdv.overlap.UNCHECKED, zkdv.overlap.ALWAYS, zkdv.overlap.NEVER)]
PROOF_CONFIGS += [
    ("proof.jit p=0.01 unchecked host k=1", 0.01, zkdv.overlap.UNCHECKED, "host", 1, None),
    ("proof.jit p=0.01 unchecked host window=64", 0.01, zkdv.overlap.UNCHECKED, "host", None,
     64),
    ("proof.jit p=0.01 unchecked device", 0.01, zkdv.overlap.UNCHECKED, "device", None, None),
    ("proof.jit p=1.0 unchecked host", 1.0, zkdv.overlap.UNCHECKED, "host", None, None)]
NNX_PROOF_ROW = "NNX proof.jit p=0.01 unchecked host"
PROOF_CONFIGS.append((NNX_PROOF_ROW, 0.01, zkdv.overlap.UNCHECKED, "host", None, None))
BASELINES = ["jax.jit", "floor (jit + one BLAKE3 pass)"]  # every table's ratios need them
ROWS = ["jax.jit", "naive (jit + device_get + sha256)", "floor (jit + one BLAKE3 pass)"] + [
    c[0] for c in PROOF_CONFIGS if c[0] != NNX_PROOF_ROW] + ["NNX nnx.jit", NNX_PROOF_ROW]


class Runner:
  """One configuration: its own state, a step() that runs one training step."""

  def __init__(self, row: str, workload: str, folder):
    model, params, batch = WORKLOADS[workload][1]()
    self.batch, self.proof = batch, None
    if row.startswith("proof.jit"):
      _, p, policy, backend, k, window = next(c for c in PROOF_CONFIGS if c[0] == row)
      self.proof = zkdv.jax.ZKDV(row, zkdv.ZKDVConfig(
          sampling_policy=zkdv.SamplingPolicy(update_check_probability=p),
          digest_backend=backend, segment_length=k,
          output_dir=f"{folder}/{row.replace(' ', '_')}"))
      self.proof.start(**({} if window is None else {"rolling_window": window}))
      self.state = zkdv.jax.contrib.TrainState.create(
          proof=self.proof, apply_fn=model.apply, params=params, tx=optax.adam(1e-3),
          zkdv_overlap=policy)
      self._step = self.proof.jit(common.train_step, donate_argnums=0)
    else:
      self.state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                                 tx=optax.adam(1e-3))
      self._step = jax.jit(common.train_step, donate_argnums=0)
    self.extra = {"jax.jit": None, "naive (jit + device_get + sha256)": self._naive,
                  "floor (jit + one BLAKE3 pass)": self._floor}.get(row)

  def _naive(self):
    hasher = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get((self.state, self.batch))):
      hasher.update(np.ascontiguousarray(leaf).tobytes())
    return hasher.digest()

  def _floor(self):
    for leaf in jax.tree.leaves((self.state, self.batch)):
      digest.leaf_digest(arrays.host_view(arrays.as_array(leaf)))

  def step(self):
    self.state = self._step(self.state, *self.batch)
    if self.extra is not None:
      self.extra()
    return self.state

  def settle(self):
    if self.proof is not None:
      self.proof.wait_for_commitments()

  def segment_length(self) -> str:
    """The length of the segment the median step was in (the first, unmeasured
    segments are one step long)."""
    if self.proof is None or not self.proof.segment_lengths:
      return "-"
    return f"{common.median([k for k in self.proof.segment_lengths for _ in range(k)]):.0f}"

  def update_checks(self) -> str:
    return "-" if self.proof is None else str(self.proof.checks["update"])

  def step_record_bytes(self) -> tuple[float, float]:
    """(mean bytes of a step record, transcript bytes per step incl. blobs)."""
    if self.proof is None:
      return 0.0, 0.0
    self.proof.finish()
    contents = transcript.read_transcript(self.proof.path)
    steps = [len(r.raw) for r in contents.records if r.record["type"] == "step"]
    total = sum(f.stat().st_size for f in self.proof.path.rglob("*") if f.is_file())
    return float(np.mean(steps)), total / len(steps)


def nnx_train_step(model, optimizer, x, y):
  """``common.train_step`` for an NNX model: the model and optimizer update in place."""
  def loss(model):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
  optimizer.update(model, nnx.grad(loss)(model))


class NNXRunner(Runner):
  """An NNX row: the workload's Linen module as an NNX module, ``nnx.Optimizer``."""

  def __init__(self, row: str, workload: str, folder):  # pylint: disable=super-init-not-called
    model, _, self.batch = WORKLOADS[workload][1]()
    self.model = nnx.bridge.ToNNX(model, rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(self.model, self.batch[0][:1])
    self.proof = None
    if row == NNX_PROOF_ROW:
      self.proof = zkdv.jax.ZKDV(row, zkdv.ZKDVConfig(
          sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.01),
          output_dir=f"{folder}/{row.replace(' ', '_')}"))
      self.proof.start()
      self.optimizer = zkdv.jax.contrib.nnx.Optimizer(self.model, optax.adam(1e-3),
                                                      wrt=nnx.Param, proof=self.proof)
      self._step = self.proof.jit(nnx_train_step, donate_argnums=(0, 1))
    else:
      self.optimizer = nnx.Optimizer(self.model, optax.adam(1e-3), wrt=nnx.Param)
      self._step = nnx.jit(nnx_train_step, donate_argnums=(0, 1))

  def step(self):
    self._step(self.model, self.optimizer, *self.batch)
    return nnx.state(self.optimizer)  # what to wait for: the step counter and moments


def make_runner(row: str, workload: str, folder):
  return (NNXRunner if row.startswith("NNX") else Runner)(row, workload, folder)


def peak_rss_mb(row: str, workload: str, steps: int) -> float:
  """Peak RSS of a fresh process that runs ``steps`` steps of one configuration."""
  return common.peak_rss_mb("overhead", f"overhead.make_runner({row!r}, {workload!r}, folder)",
                            steps)


def run_block(runner, steps: int, pipelined: bool) -> None:
  """``steps`` steps, each awaited (``pipelined=False``: a loop that reads every step's
  result) or only the last (a loop that lets JAX dispatch ahead), then the proof's drain."""
  out = None
  for _ in range(steps):
    out = runner.step()
    if not pipelined:
      jax.block_until_ready(out)
  jax.block_until_ready(out)
  runner.settle()


# The columns of a ``measure`` table.
HEADER = ["configuration", "k", "checks", "ms/step incl. checks", "median block ms/step",
          "ratio to jax.jit", "ratio to floor", "peak RSS MB", "step record bytes",
          "transcript bytes/step"]


def measure(workload: str, rounds: int, block: int, rss: bool,
            rows: list[str] = ROWS, pipelined: bool = False) -> list[list]:
  """The table of one workload; the proofs' transcripts are removed afterwards (a
  p=1.0 row opens every segment: gigabytes at batch 1024)."""
  with tempfile.TemporaryDirectory(prefix="zkdv-overhead-") as folder:
    return _measure(workload, rounds, block, rss, rows, pipelined, folder)


def _measure(workload, rounds, block, rss, rows, pipelined, folder) -> list[list]:
  runners = {row: make_runner(row, workload, folder) for row in rows}
  for r in runners.values():  # warm-up: compile, first commitments
    for _ in range(3):
      jax.block_until_ready(r.step())
    r.settle()
  gc.collect()  # the setup's garbage is not the steps' to collect (as pyperf does)
  times = {row: [] for row in rows}
  for _ in range(rounds):
    for row, r in runners.items():
      start = time.perf_counter()
      run_block(r, block, pipelined)
      times[row].append((time.perf_counter() - start) / block)
  # A segment's state hash lands in one block of several: the throughput is over all
  # steps (the mean), beside the median block.
  mean = {row: sum(t) / len(t) for row, t in times.items()}
  table = []
  for row, r in runners.items():
    step_bytes, total_bytes = r.step_record_bytes()
    table.append([row, r.segment_length(), r.update_checks(), f"{mean[row] * 1e3:.1f}",
                  f"{common.median(times[row]) * 1e3:.1f}",
                  f"{mean[row] / mean['jax.jit']:.3f}",
                  f"{mean[row] / mean['floor (jit + one BLAKE3 pass)']:.3f}",
                  f"{peak_rss_mb(row, workload, 3 * block):.0f}" if rss else "-",
                  f"{step_bytes:.0f}" if r.proof else "-",
                  f"{total_bytes:,.0f}" if r.proof else "-"])
  return table


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--block", type=int, default=20)
  parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
  parser.add_argument("--json", default=None, help="also write the tables to this file")
  parser.add_argument("--pipelined", action="store_true",
                      help="await each block's last step only (JAX dispatches ahead), not "
                           "every step")
  parser.add_argument("--rows", nargs="+", default=None, choices=ROWS, metavar="ROW",
                      help=f"only these rows (with {' and '.join(BASELINES)}); one of {ROWS}")
  args = parser.parse_args(argv)
  names = list(WORKLOADS) if args.workload == "all" else [args.workload]
  rows = ROWS if args.rows is None else [r for r in ROWS if r in BASELINES or r in args.rows]
  results = {n: measure(n, args.rounds, args.block, not args.no_rss, rows, args.pipelined)
             for n in names}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  for name in names:
    common.print_table(f"{WORKLOADS[name][0]} — {args.rounds} alternating blocks of "
                       f"{args.block} steps per row, "
                       f"{'pipelined' if args.pipelined else 'every step awaited'}, "
                       f"{jax.devices()[0].platform}", HEADER,
                       results[name])
    print()


if __name__ == "__main__":
  main()
