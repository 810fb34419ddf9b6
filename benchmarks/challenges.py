"""What live server challenges cost: DVBench-chosen checks against self-sampling.

  python -m benchmarks.challenges [--batch 1024 128] [--p 0.1] [--window 8] [--rounds 6] [--block 5]

On the benchmark MLP (784-1024x4-10, Adam), in one process and alternating in
blocks of ``--block`` steps: ``jax.jit``; ``proof.jit`` with self-sampled
checks at p (offline, no upload); ``proof.jit`` through a live ``dvbench serve``
on loopback (no workers, so the server only stores, challenges and acks) with
the server's p, once with the adaptive segment length (the default) and once
committing every step's state (``segment_length=1``). Each step is timed to its outputs being ready; *throughput*
also counts the time to settle the block (every step committed and, with the
server, every challenge answered). Peak RSS comes from a fresh subprocess per
configuration; "generations" is its excess over ``jax.jit`` in units of the
training state's bytes. The table comes last.
"""

import argparse
import os
import tempfile
import time

import jax

import zkdv
from benchmarks import common

ROWS = ("jax.jit", "proof.jit self-sampled", "proof.jit DVBench live",
        "proof.jit DVBench live, k=1")


class Runner(common.TrainRow):
  """One configuration's state and step."""

  def __init__(self, row: str, batch_size: int, p: float, folder: str, window: int = 4):
    model, params, batch = common.mlp_workload(batch_size)
    if row == "jax.jit":
      super().__init__(model, params, batch)
      return
    config = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=p),
                             output_dir=f"{folder}/{row.replace(' ', '_')}-{batch_size}",
                             segment_length=1 if row.endswith("k=1") else None)
    if row == "proof.jit self-sampled":
      proof = zkdv.jax.ZKDV("challenges-benchmark", config)
    else:
      import dvbench  # pylint: disable=g-import-not-at-top
      client = dvbench.Client(os.environ["DVBENCH_URL"], token=os.environ["DVBENCH_TOKEN"])
      proof = client.experiment("bench/challenges").proof(config=config)
    proof.start(rolling_window=window)
    super().__init__(model, params, batch, proof)


def state_bytes(batch_size: int) -> int:
  _, params, _ = common.mlp_workload(batch_size)
  return 3 * sum(x.nbytes for x in jax.tree.leaves(params))  # params + Adam's mu and nu


def peak_rss_mb(row: str, batch_size: int, p: float, window: int, steps: int) -> float:
  """Peak RSS (VmHWM) of a fresh process running ``steps`` steps of one configuration."""
  return common.peak_rss_mb(
      "challenges", f"challenges.Runner({row!r}, {batch_size}, {p}, folder, {window})", steps)


def measure(batch_size: int, p: float, window: int, rounds: int, block: int) -> list[list]:
  with tempfile.TemporaryDirectory(prefix="zkdv-challenges-") as folder:
    return _measure(batch_size, p, window, rounds, block, folder)


def _measure(batch_size, p, window, rounds, block, folder) -> list[list]:
  runners = {row: Runner(row, batch_size, p, folder, window) for row in ROWS}
  for r in runners.values():  # warm-up: compile, first commitments
    for _ in range(3):
      jax.block_until_ready(r.step())
    r.settle()
  steps = {row: [] for row in ROWS}
  blocks = {row: [] for row in ROWS}
  for _ in range(rounds):
    for row, r in runners.items():
      started = time.perf_counter()
      for _ in range(block):
        steps[row].append(common.timed(r.step))
      r.settle()
      blocks[row].append((time.perf_counter() - started) / block)
  checks = {row: (r.proof.checks.get("update", 0) if r.proof else 0)
            for row, r in runners.items()}
  for r in runners.values():
    if r.proof is not None:
      r.proof.finish()
  base_step, base_block = common.median(steps["jax.jit"]), common.median(blocks["jax.jit"])
  rss = {row: peak_rss_mb(row, batch_size, p, window, 4 * window + 8) for row in ROWS}
  generation = state_bytes(batch_size) / 2**20
  table = []
  for row in ROWS:
    table.append([f"{row}, batch {batch_size}", f"{common.median(steps[row]) * 1e3:.1f}",
                  f"{common.median(steps[row]) / base_step:.3f}",
                  f"{common.median(blocks[row]) / base_block:.3f}", str(checks[row]),
                  f"{rss[row]:.0f}", f"{(rss[row] - rss['jax.jit']) / generation:+.2f}"])
  return table


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, nargs="+", default=[1024, 128])
  parser.add_argument("--p", type=float, default=0.1, help="update check probability")
  parser.add_argument("--window", type=int, default=8, help="rolling window")
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--block", type=int, default=5)
  args = parser.parse_args(argv)
  from dvbench.server.local import LocalServer  # pylint: disable=g-import-not-at-top
  server = LocalServer(workers=0, extra_args=(
      "--min-update-check-probability", str(args.p), "--max-window", str(args.window))).start()
  try:
    os.environ.update(DVBENCH_URL=server.url, DVBENCH_TOKEN=server.token("bench"))
    tables = [row for b in args.batch
              for row in measure(b, args.p, args.window, args.rounds, args.block)]
  finally:
    server.close()
  common.print_table(
      f"Live challenges on the MLP, p={args.p}, window {args.window}, "
      f"{args.rounds * args.block} steps "
      f"per row, {jax.devices()[0].platform}",
      ["configuration", "median step ms", "step ratio", "throughput ratio (incl. settle)",
       "update checks", "peak RSS MB", "generations over jax.jit"], tables)


if __name__ == "__main__":
  main()
