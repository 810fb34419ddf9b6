"""The live path across processes: the rows of ``python -m benchmarks.live --processes P``.

The small MLP (784-128-10, batch 256) trains in P local processes joined by
``jax.distributed`` (gloo collectives, two CPU devices each) on a (2, P) mesh: batch rows
over "data", kernels by columns over "model". Rows, alternating in blocks as in
``benchmarks.live``: the sharded ``jax.jit`` step; ``proof.jit`` offline (self-sampled at p,
with probes); ``proof.jit`` live through the parent's ``dvbench serve`` (process 0 holds the
stream, every process takes the server's decisions in rounds). Every row waits for its
state each ``IN_FLIGHT`` steps. Process 0 prints the rows as one JSON line.
"""

import json
import os
import subprocess
import sys
import tempfile

from dvbench.server import local

from benchmarks import scratch

ROWS = ("jax.jit", "offline, probes", "live, probes")
LOCAL_DEVICES = 2
# Every row waits for its last step after this many: with more dispatched ahead, plain
# jax.jit itself hung here (2 processes of 2 CPU devices, gloo, jax 0.10.2: both
# processes blocked at the 41st step of a 64-step block, every thread idle).
IN_FLIGHT = 16


def rows(args, url: str, token: str) -> list[list]:
  """The table rows of a ``args.processes``-process run against the server at ``url``."""
  port = local.free_port()
  env = {**os.environ, "DVBENCH_URL": url, "DVBENCH_TOKEN": token}
  flags = [str(args.processes), str(args.p), str(args.probe_ratio), str(args.window),
           str(args.rounds), str(args.block)]
  children = [subprocess.Popen([sys.executable, "-m", "benchmarks.live_processes", str(i),
                                str(port), *flags], env=env, stdout=subprocess.PIPE, text=True)
              for i in range(args.processes)]
  outputs = [child.communicate()[0] for child in children]
  if any(child.returncode for child in children):
    raise RuntimeError(f"a benchmark process failed: {[c.returncode for c in children]}")
  return json.loads(outputs[0].strip().splitlines()[-1])


def _train(index: int, port: int, processes: int, p: float, probe_ratio: float, window: int,
           rounds: int, block: int) -> None:
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=processes, process_id=index)
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import zkdv  # pylint: disable=g-import-not-at-top
  from benchmarks import common  # pylint: disable=g-import-not-at-top
  from benchmarks import live  # pylint: disable=g-import-not-at-top

  mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
  replicated, by_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  columns = NamedSharding(mesh, P(None, "model"))

  def place(value, sharding):  # works across processes, where device_put of host data may not
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda i: value[i])

  model, params, batch = live.workload("small", 256)
  folder = tempfile.mkdtemp()

  def setup(row: str):
    kwargs = dict(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    proof = None
    if row == "jax.jit":
      state, jit = train_state.TrainState.create(**kwargs), jax.jit
    else:
      proof = live.started_proof(row, "bench/live-processes", p, probe_ratio, folder, window)
      state, jit = zkdv.jax.contrib.TrainState.create(proof=proof, **kwargs), proof.jit
    shardings = jax.tree.map(lambda v: columns if getattr(v, "ndim", 0) == 2 else replicated,
                             state)
    step = jit(common.train_step, in_shardings=(shardings, by_rows, by_rows),
               out_shardings=shardings, donate_argnums=0)
    return {"state": jax.tree.map(place, state, shardings), "step": step, "proof": proof,
            "batch": [place(x, by_rows) for x in batch]}

  runs = {row: setup(row) for row in ROWS}

  def settle(run):
    jax.block_until_ready(run["state"])
    if run["proof"] is not None:
      run["proof"].wait_for_commitments()

  def steps(run, count: int) -> None:
    for i in range(count):
      run["state"] = run["step"](run["state"], *run["batch"])
      if (i + 1) % IN_FLIGHT == 0:
        jax.block_until_ready(run["state"])
    jax.block_until_ready(run["state"])

  for run in runs.values():  # warm-up: compile, first commitments
    steps(run, 3)
    settle(run)
  warm = {row: len(run["proof"].segment_lengths) for row, run in runs.items() if run["proof"]}
  blocks = {row: [] for row in ROWS}
  settled = {row: [] for row in ROWS}
  for _ in range(rounds):
    for row, run in runs.items():
      seconds = common.timed(lambda run=run: steps(run, block))
      settled[row].append((seconds + common.timed(lambda run=run: settle(run))) / block)
      blocks[row].append(seconds / block)
  segments = {row: run["proof"].segment_lengths[warm[row]:]
              for row, run in runs.items() if run["proof"]}
  for run in runs.values():
    if run["proof"] is not None:
      run["proof"].finish()
  if index != 0:
    return
  base = common.median(blocks["jax.jit"])
  label = f"MLP 784-128-10, batch 256, {processes} processes"
  print(json.dumps([[label, row, f"{common.median(blocks[row]) * 1e3:.2f}",
                     f"{common.median(blocks[row]) / base:.3f}",
                     f"{common.median(settled[row]) / base:.3f}",
                     f"{common.median(segments[row]):.0f}" if segments.get(row) else "-",
                     block] for row in ROWS]))


if __name__ == "__main__":
  with scratch.run_folder("zkdv-live-processes-"):
    _train(*map(int, sys.argv[1:4]), *map(float, sys.argv[4:6]), *map(int, sys.argv[6:9]))
