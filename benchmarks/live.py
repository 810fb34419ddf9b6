"""The live path against ``jax.jit``: offline and live, with and without probes.

  python -m benchmarks.live [--quick] [--workloads small mlp tiny] [--batch 128 256 1024]
                            [--rounds 4] [--block 64] [--p 0.01] [--probe-ratio 0.01]
                            [--processes 2] [--runs 5] [--server-nice 19]
                            [--server-cpus 1]

Rows, in one process and alternating in blocks of ``--block`` steps (in the reverse order
every other round, so that no row always runs after another): ``jax.jit``;
``proof.jit`` offline (self-sampled checks at p, no upload) without and with probes;
``proof.jit`` through a live ``dvbench serve`` on loopback (no workers: the server
stores, challenges and acknowledges) without and with probes. A block is timed from
its first step to its last step's outputs being ready, then settled (every step
committed and, live, every challenge answered) outside the timing; *settled* counts
the settle too. A block spans at least 64 steps (two live segments at DVBench's default
``--max-segment-length`` of 32), so that each carries its share of their state
commitments (*median segment steps* says how long they were), and at least
``MIN_BLOCK_SECONDS`` of ``jax.jit``'s steps (at most ``MAX_BLOCK`` steps; *block steps*),
so that a fast step's live row runs past its window and shows what the server's pace
allows, not a backlog the settle hides. Every row starts at the same ``--window``: an
offline proof's segments are at most that long (4 steps at the tutorial's window), a live
proof's grow to half the server's window, at most its longest segment (32 by default), as
its window grows. Workloads: ``small`` (MLP 784-128-10, batch 256, where a fixed cost
per step shows), ``mlp`` (784-1024x4-10, Adam, at each ``--batch``) and ``tiny`` (the
tutorial's model). ``--processes P`` adds the small MLP trained in P local processes,
offline and live in the same run (``benchmarks.live_processes``). ``--server-nice 19``
runs the loopback server at the lowest priority; ``--server-cpus 1`` runs it on CPU 1 and
training on the other CPUs, so that training pays only its own side of the live path, as
beside a server on another machine. ``--runs N`` repeats
the whole measurement in N fresh processes and ends with a table of each row's median
ratio over them and its range. What probes cost is read paired: each round's block with
probes over the same round's block without, offline and live; the last table gives these
ratios' median over every round of every run and the interval that holds it with 95 %
confidence (order statistics, whatever their distribution).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import linen as nn

import zkdv
from benchmarks import common
from benchmarks import cpu_time

ROWS = ("jax.jit", "offline", "offline, probes", "live", "live, probes")
# What probes cost, each round's block with probes over the same round's without: paired,
# a round's ratio leaves out what moves the machine's pace between rounds and runs.
PAIRS = (("offline, probes", "offline"), ("live, probes", "live"))
MIN_BLOCK_SECONDS = 1.0
MAX_BLOCK = 2048


class SmallMLP(nn.Module):
  """784 -> 128 -> 10."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.relu(nn.Dense(128)(x)))


def workload(name: str, batch_size: int):
  """(model, params, batch) of a workload."""
  if name == "tiny":
    return common.tutorial_workload()
  model, params, batch = common.mlp_workload(batch_size)
  if name == "small":
    model = SmallMLP()
    params = model.init(jax.random.key(0), batch[0][:1])["params"]
  return model, params, batch


class Runner(common.TrainRow):
  """One row's state and step."""

  def __init__(self, row: str, model, params, batch, p: float, probe_ratio: float,
               folder: str, window: int):
    params = jax.tree.map(jnp.copy, params)  # each row donates its own
    if row == "jax.jit":
      super().__init__(model, params, batch)
      return
    proof = started_proof(row, "bench/live", p, probe_ratio if row.endswith("probes") else 0.0,
                          folder, window)
    super().__init__(model, params, batch, proof)


def started_proof(row: str, experiment: str, p: float, probe_ratio: float, folder: str,
                  window: int):
  """The started proof of a row: offline (``zkdv.jax.ZKDV``), or live on the server at
  ``DVBENCH_URL`` in ``experiment``."""
  config = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=p),
                           output_dir=os.path.join(folder, row.replace(", ", "-")))
  if row.startswith("offline"):
    proof = zkdv.jax.ZKDV("live-benchmark", config)
  else:
    import dvbench  # pylint: disable=g-import-not-at-top
    client = dvbench.Client(os.environ["DVBENCH_URL"], token=os.environ["DVBENCH_TOKEN"])
    proof = client.experiment(experiment).proof(config=config)
  return proof.start(rolling_window=window, probe_ratio=probe_ratio)


def measure(name: str, batch_size: int, args, folder: str,
            meter: cpu_time.CpuMeter) -> tuple[list[list], list[list], list[list]]:
  """(rows, pairs, cpu) of one workload: cpu rows are [workload, row, {part: each round's
  CPU seconds a step}], from the block's start to the end of its settle."""
  model, params, batch = workload(name, batch_size)
  runners = {row: Runner(row, model, params, batch, args.p, args.probe_ratio,
                         os.path.join(folder, f"{name}-{batch_size}"), args.window)
             for row in ROWS}
  for r in runners.values():  # warm-up: compile, first commitments
    for _ in range(3):
      r.step()
    r.settle()
  warm_segments = {row: len(r.proof.segment_lengths) for row, r in runners.items() if r.proof}
  block = block_steps(runners["jax.jit"], args.block)
  blocks = {row: [] for row in ROWS}
  settled = {row: [] for row in ROWS}
  cpu = {row: {part: [] for part in cpu_time.PARTS} for row in ROWS}
  for n in range(args.rounds):
    for row in ROWS if n % 2 == 0 else ROWS[::-1]:  # no row always follows another
      r = runners[row]
      cpu_before = meter.read()
      started = time.perf_counter()
      for _ in range(block):
        r.step()
      jax.block_until_ready(r.state)
      stepped = time.perf_counter()
      r.settle()
      blocks[row].append((stepped - started) / block)
      settled[row].append((time.perf_counter() - started) / block)
      for part, seconds in meter.since(cpu_before).items():
        cpu[row][part].append(seconds / block)
  segments = {row: r.proof.segment_lengths[warm_segments[row]:]
              for row, r in runners.items() if r.proof}
  for r in runners.values():
    if r.proof is not None:
      r.proof.finish()
  base = common.median(blocks["jax.jit"])
  label = {"small": "MLP 784-128-10", "mlp": "MLP 784-1024x4-10",
           "tiny": "tutorial model"}[name]
  workload_name = f"{label}, batch {batch_size if name != 'tiny' else 4}"
  rows = [[workload_name, row, f"{common.median(blocks[row]) * 1e3:.2f}",
           f"{common.median(blocks[row]) / base:.3f}",
           f"{common.median(settled[row]) / base:.3f}",
           f"{common.median(segments[row]):.0f}" if segments.get(row) else "-", block]
          for row in ROWS]
  pairs = [[workload_name, f"{probed} / {plain}",
            [a / b for a, b in zip(blocks[probed], blocks[plain])]] for probed, plain in PAIRS]
  return rows, pairs, [[workload_name, row, cpu[row]] for row in ROWS]


def block_steps(plain: "Runner", least: int) -> int:
  """Steps per block: ``least``, or as many as ``jax.jit`` takes ``MIN_BLOCK_SECONDS``
  for (32 timed steps of ``plain``), at most ``MAX_BLOCK``."""
  seconds = common.timed(lambda: [plain.step() for _ in range(32)][-1].params) / 32
  return max(least, min(MAX_BLOCK, math.ceil(MIN_BLOCK_SECONDS / seconds)))


HEADER = ["workload", "configuration", "median step ms", "ratio to jax.jit",
          "ratio incl. settle", "median segment steps", "block steps"]
CPU_HEADER = ["workload", "configuration", *cpu_time.PARTS, "all"]
PAIRED_HEADER = ["workload", "probes / no probes", "rounds", "median ratio",
                 "interval of the median", "its confidence"]


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workloads", nargs="*", default=["small", "mlp", "tiny"],
                      choices=["small", "mlp", "tiny"])
  parser.add_argument("--batch", type=int, nargs="+", default=[128, 256, 1024],
                      help="batch sizes of the mlp workload (small runs at 256)")
  parser.add_argument("--p", type=float, default=0.01, help="update check probability")
  parser.add_argument("--probe-ratio", type=float, default=0.01)
  parser.add_argument("--window", type=int, default=4,
                      help="rolling window (the tutorial's; live, it grows to the server's)")
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--block", type=int, default=64,
                      help="least steps per timed block: two live segments (32 steps at "
                           "DVBench's default longest segment), so that every block carries "
                           "its share of the state commitments; a fast step's block is "
                           "longer (MIN_BLOCK_SECONDS)")
  parser.add_argument("--server-nice", type=int, default=0,
                      help="the server's niceness (its process group's): 19 leaves the "
                           "cores to training first, as a server on another machine would")
  parser.add_argument("--server-cpus", type=int, nargs="+", default=None,
                      help="CPUs the server runs on, training on the others (as a server on "
                           "another machine: training keeps its cores and pays only its own "
                           "side of the live path)")
  parser.add_argument("--processes", type=int, default=1,
                      help="also the small MLP in this many processes (jax.distributed, gloo)")
  parser.add_argument("--runs", type=int, default=1,
                      help="repeat the whole measurement in this many fresh processes, one "
                           "after another, and summarize the ratios over runs")
  parser.add_argument("--json", help=argparse.SUPPRESS)  # where a run of --runs puts its rows
  parser.add_argument("--quick", action="store_true",
                      help="small and tiny workloads, mlp at batch 128 only, 2 rounds (one "
                           "each way)")
  args = parser.parse_args(argv)
  if args.quick:
    args.rounds, args.batch = 2, [128]
  return args


def one_run(args) -> tuple[str, list[list], list[list], list[list]]:
  """(title, rows, pairs, cpu) of one measurement, against its own loopback server: pairs
  are [workload, pair, each round's ratio] (``PAIRS``), cpu as ``measure`` gives it."""
  cases = [(name, b) for name in args.workloads
           for b in (args.batch if name == "mlp" else [256])]
  from dvbench.server.local import LocalServer  # pylint: disable=g-import-not-at-top
  training_cpus = split_cores(args.server_cpus)
  server = LocalServer(workers=0, extra_args=(  # the proofs' own probe ratio, 0 or not
      "--min-update-check-probability", str(args.p), "--min-probe-ratio", "0")).start()
  if training_cpus:  # the server and the processes it started keep the CPUs they had
    os.sched_setaffinity(0, training_cpus)
  try:
    if args.server_nice:
      os.setpriority(os.PRIO_PGRP, server.process.pid, args.server_nice)
    os.environ.update(DVBENCH_URL=server.url, DVBENCH_TOKEN=server.token("bench"))
    rows, pairs, cpu = [], [], []
    meter = cpu_time.CpuMeter(server_pid=server.process.pid)
    with tempfile.TemporaryDirectory(prefix="zkdv-live-") as folder:
      for name, b in cases:
        case_rows, case_pairs, case_cpu = measure(name, b, args, folder, meter)
        rows += case_rows
        pairs += case_pairs
        cpu += case_cpu
    if args.processes > 1:
      from benchmarks import live_processes  # pylint: disable=g-import-not-at-top
      rows += live_processes.rows(args, server.url, os.environ["DVBENCH_TOKEN"])
  finally:
    server.close()
  with open("/proc/loadavg") as f:
    load = f.read().split()[:3]
  title = (f"Live path, p={args.p}, probe ratio {args.probe_ratio}, window {args.window}, "
           f"{args.rounds} rounds of at least {args.block} steps, {jax.devices()[0].platform}, "
           f"load {' '.join(load)}" + (f", server at nice {args.server_nice}"
                                       if args.server_nice else "")
           + (f", server on CPUs {args.server_cpus}, training on the others"
              if args.server_cpus else ""))
  return title, rows, pairs, cpu


def split_cores(server_cpus: list[int] | None) -> set[int] | None:
  """The CPUs training keeps once the server runs on ``server_cpus``; this process runs
  on ``server_cpus`` until the server has started (its processes inherit them). Called
  before JAX starts its backend, which sizes its thread pool by the CPUs it may use."""
  if not server_cpus:
    return None
  cpus = os.sched_getaffinity(0)
  training = cpus - set(server_cpus)
  if not set(server_cpus) <= cpus or not training:
    raise SystemExit(f"--server-cpus {server_cpus}: choose some, not all, of CPUs {sorted(cpus)}")
  os.sched_setaffinity(0, server_cpus)
  return training


def repeated_runs(argv: list[str], runs: int) -> list[dict]:
  """The rows and pairs of ``runs`` measurements, each in a fresh process (its tables
  printed as it ends): between processes a step's time moves more than between rounds of
  one."""
  results = []
  with tempfile.TemporaryDirectory(prefix="zkdv-live-runs-") as folder:
    for run in range(runs):
      path = os.path.join(folder, f"run-{run}.json")
      subprocess.run([sys.executable, "-m", "benchmarks.live", *argv, "--runs", "1",
                      "--json", path], check=True)
      with open(path) as f:
        results.append(json.load(f))
  return results


def summary(results: list[dict]) -> list[list]:
  """One row per workload and configuration: the median over runs of its step time and
  ratio, the ratios' range, and each run's ratio in order."""
  ratios, times = {}, {}
  for result in results:
    for workload, row, ms, ratio, *_ in result["rows"]:
      ratios.setdefault((workload, row), []).append(float(ratio))
      times.setdefault((workload, row), []).append(float(ms))
  return [[workload, row, f"{common.median(times[workload, row]):.2f}",
           f"{common.median(r):.3f}", f"{min(r):.3f}-{max(r):.3f}", " ".join(f"{x:.3f}" for x in r)]
          for (workload, row), r in ratios.items()]


def paired(pairs: list[list]) -> list[list]:
  """One row per workload and pair of ``pairs`` (over one run or many): its rounds, their
  median ratio, and the interval that holds the median with 95 % confidence."""
  ratios = {}
  for workload, pair, each in pairs:
    ratios.setdefault((workload, pair), []).extend(each)
  table = []
  for (workload, pair), each in ratios.items():
    low, high, coverage = common.median_interval(each)
    table.append([workload, pair, len(each), f"{common.median(each):.3f}",
                  f"{low:.3f}-{high:.3f}", f"{coverage:.3f}"])
  return table


def cpu_table(cpu: list[list]) -> list[list]:
  """One row per workload and configuration of ``cpu`` (over one run or many): the median
  over rounds of each part's CPU µs a step and of their sum; then, per pair (``PAIRS``),
  the median over rounds of what its probes add, each round's block with probes less the
  same round's without."""
  rounds = {}
  for workload, row, parts in cpu:
    mine = rounds.setdefault((workload, row), {part: [] for part in cpu_time.PARTS})
    for part in cpu_time.PARTS:
      mine[part].extend(parts[part])
  for mine in rounds.values():
    mine["all"] = [sum(each) for each in zip(*(mine[p] for p in cpu_time.PARTS))]
  table = [[workload, row, *(f"{common.median(mine[p]) * 1e6:.0f}" for p in CPU_COLUMNS)]
           for (workload, row), mine in rounds.items()]
  for workload in dict.fromkeys(w for w, _ in rounds):
    for probed, plain in PAIRS:
      a, b = rounds[workload, probed], rounds[workload, plain]
      table.append([workload, f"{probed} − {plain}", *(
          f"{common.median([x - y for x, y in zip(a[p], b[p])]) * 1e6:+.0f}"
          for p in CPU_COLUMNS)])
  return table


CPU_COLUMNS = (*cpu_time.PARTS, "all")


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if args.runs > 1:
    results = repeated_runs(argv, args.runs)
    common.print_table(
        f"Live path over {args.runs} runs in fresh processes ({args.rounds} rounds of at least "
        f"{args.block} steps each" + (f", server at nice {args.server_nice}"
                                      if args.server_nice else "")
        + (f", server on CPUs {args.server_cpus}" if args.server_cpus else "") + ")",
        ["workload", "configuration", "median step ms", "median ratio to jax.jit",
         "range", "each run"], summary(results))
    common.print_table(f"CPU µs a step by part, median of every round of {args.runs} runs",
                       CPU_HEADER, cpu_table([c for r in results for c in r["cpu"]]))
    common.print_table(f"Probes against no probes, paired by round, over {args.runs} runs",
                       PAIRED_HEADER, paired([p for r in results for p in r["pairs"]]))
    return
  title, rows, pairs, cpu = one_run(args)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"rows": rows, "pairs": pairs, "cpu": cpu}, f)
  common.print_table("CPU µs a step by part, median over rounds", CPU_HEADER, cpu_table(cpu))
  common.print_table("Probes against no probes, paired by round", PAIRED_HEADER, paired(pairs))
  common.print_table(title, HEADER, rows)


if __name__ == "__main__":
  main()
