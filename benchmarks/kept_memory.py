"""Peak memory of a proof beside ``jax.jit``, with and without donating the state.

  python -m benchmarks.kept_memory [--steps 72] [--window 16] [--repeats 2]

The 4M-parameter MLP (784-1024x4-10, Adam: 48 MB of state) at batch 128, each row in a
fresh process (peak RSS, ``VmHWM``, after ``--steps`` awaited steps and a settle):
``jax.jit`` and ``proof.jit`` (offline, p = 0.01, adaptive segments at ``--window``), each
with the state donated and not. Without donation every step returns a new state, and
what a proof keeps of a step until its segment is answered (its batch, for the probes and
checks) must not keep that state alive too. Rows alternate over ``--repeats``; the table
gives the median peak and the proof's excess over ``jax.jit`` with the same donation.
"""

import argparse
import os

import jax

import zkdv
from benchmarks import common

ROWS = ("jax.jit, donated", "proof.jit, donated", "jax.jit, not donated",
        "proof.jit, not donated")


class Runner(common.TrainRow):
  """One row, as ``common.peak_rss_mb`` runs it."""

  def __init__(self, row: str, folder: str, window: int):
    model, params, batch = common.mlp_workload(128)
    proof = None
    if row.startswith("proof.jit"):
      config = zkdv.ZKDVConfig(
          sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.01),
          output_dir=os.path.join(folder, "proof"))
      proof = zkdv.jax.ZKDV("kept-memory", config).start(rolling_window=window)
    super().__init__(model, params, batch, proof, donate=row.endswith(", donated"))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=72)
  parser.add_argument("--window", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args(argv)
  peaks = {row: [] for row in ROWS}
  for _ in range(args.repeats):
    for row in ROWS:
      peaks[row].append(common.peak_rss_mb(
          "kept_memory", f"kept_memory.Runner({row!r}, folder, {args.window})", args.steps))
  rows = []
  for row in ROWS:
    peak = common.median(peaks[row])
    base = common.median(peaks[row.replace("proof.jit", "jax.jit")])
    rows.append([row, f"{peak:.0f}", "-" if row.startswith("jax.jit") else f"{peak - base:+.0f}"])
  common.print_table(
      f"Peak RSS, MLP 784-1024x4-10 (48 MB of state), batch 128, {args.steps} steps, window "
      f"{args.window}, median of {args.repeats}, {jax.devices()[0].platform}",
      ["row", "peak RSS MB", "over jax.jit MB"], rows)


if __name__ == "__main__":
  main()
