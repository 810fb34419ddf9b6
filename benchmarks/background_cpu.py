"""What a millisecond of CPU beside training costs a ``jax.jit`` step on this machine.

  python -m benchmarks.background_cpu [--batch 128] [--cpu-ms 0 1 2 4] [--rounds 5]
                                      [--steps 200]

The 4M MLP (784-1024x4-10, Adam) trains with ``jax.jit``; after each step a thread of the
same process hashes ``--cpu-ms`` milliseconds' worth of BLAKE3 (as ZKDV's commit thread
and a loopback ``dvbench serve`` spend CPU beside XLA's threads). Rows alternate, one
block of ``--steps`` steps per row and round; each row reports its median step time, the
background thread's measured CPU per step, and the wall time that CPU added per
millisecond (against the row without background work, the naive baseline). Where XLA
keeps every core busy, work beside it costs the steps more than its share of the cores:
one of XLA's threads preempted holds up the other at the next join. The table comes last.
"""

import argparse
import os
import statistics
import threading
import time

import blake3
import jax
import numpy as np

from benchmarks import common

_CHUNK = np.random.default_rng(0).bytes(1 << 20)  # 1 MiB


def _chunk_cpu_ms() -> float:
  """Median thread CPU of hashing one chunk, in ms."""
  times = []
  for _ in range(50):
    start = time.thread_time()
    blake3.blake3(_CHUNK).digest()
    times.append(time.thread_time() - start)
  return statistics.median(times) * 1e3


def run_block(row: common.TrainRow, chunks: int, steps: int) -> tuple[float, float]:
  """(seconds per step, background CPU seconds per step) of ``steps`` steps with
  ``chunks`` chunks hashed after each."""
  stepped, stop, cpu = threading.Semaphore(0), threading.Event(), [0.0]

  def background():
    start = time.thread_time()
    while not stop.is_set():
      if stepped.acquire(timeout=0.05):
        for _ in range(chunks):
          blake3.blake3(_CHUNK).digest()
    cpu[0] = time.thread_time() - start

  thread = threading.Thread(target=background, name="background-cpu")
  thread.start()
  row.settle()
  start = time.perf_counter()
  for _ in range(steps):
    row.step()
    stepped.release()
  row.settle()
  wall = time.perf_counter() - start
  stop.set()
  thread.join()
  return wall / steps, cpu[0] / steps


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--cpu-ms", type=float, nargs="+", default=[0, 1, 2, 4])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=200)
  args = parser.parse_args()
  model, params, batch = common.mlp_workload(args.batch)
  row = common.TrainRow(model, params, batch)
  for _ in range(5):
    row.step()
  chunk_ms = _chunk_cpu_ms()
  levels = sorted(set([0.0] + args.cpu_ms))
  times = {ms: [] for ms in levels}
  for _ in range(args.rounds):
    for ms in levels:
      times[ms].append(run_block(row, round(ms / chunk_ms), args.steps))
  base = common.median([w for w, _ in times[0.0]])
  rows = []
  for ms in levels:
    wall = common.median([w for w, _ in times[ms]])
    cpu = common.median([c for _, c in times[ms]])
    added = (wall - base) / cpu if ms else 0.0
    rows.append([f"{ms:g}", f"{cpu * 1e3:.2f}", f"{wall * 1e3:.2f}", f"{wall / base:.3f}",
                 f"{added:.2f}" if ms else "—"])
  with open("/proc/loadavg") as f:
    load = " ".join(f.read().split()[:3])
  common.print_table(
      f"Background CPU beside jax.jit, MLP 784-1024x4-10 batch {args.batch}, "
      f"{args.rounds} alternating rounds of {args.steps} steps, {os.cpu_count()} cores, "
      f"{jax.default_backend()}, load {load}",
      ["background ms asked", "background CPU ms/step", "median step ms",
       "ratio to no background", "step ms added per CPU ms"], rows)


if __name__ == "__main__":
  main()
