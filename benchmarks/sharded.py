"""The commitment overhead of a sharded step on forced CPU devices.

  python -m benchmarks.sharded [--devices 4] [--processes 1] [--rounds 6] [--block 5]

The MLP of ``benchmarks.overhead`` on a (2, N/2) mesh: batch split over
"data", kernels split by columns over "model". Rows: the sharded ``jax.jit``
step, and ``proof.jit`` of the same step at p=0.01 (host backend, each shard
hashed where it lives), taking turns in blocks; medians and ratios, table last.
With ``--processes P`` the devices are split over P local processes joined by
``jax.distributed`` (gloo collectives), and process 0 prints the table.
"""

import argparse
import os
import subprocess
import sys

from dvbench.server import local


def _spawn(argv, processes: int) -> int:
  """Runs this benchmark as ``processes`` local processes of one jax.distributed run."""
  port = local.free_port()
  children = [subprocess.Popen(
      [sys.executable, "-m", "benchmarks.sharded", *argv],
      env={**os.environ, "ZKDV_BENCH_PROCESS": f"{i}:{port}"}) for i in range(processes)]
  return max(child.wait() for child in children)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--processes", type=int, default=1)
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--block", type=int, default=5)
  args = parser.parse_args(argv)
  role = os.environ.get("ZKDV_BENCH_PROCESS")
  if args.processes > 1 and role is None:
    return _spawn(sys.argv[1:] if argv is None else argv, args.processes)
  # The device count is fixed when JAX starts, so it is set before the first import.
  local_devices = args.devices // args.processes
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"
  import jax  # pylint: disable=g-import-not-at-top
  if role is not None:
    index, port = map(int, role.split(":"))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=args.processes,
                               process_id=index)
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import zkdv  # pylint: disable=g-import-not-at-top
  from benchmarks import common  # pylint: disable=g-import-not-at-top

  assert len(jax.devices()) == args.devices, jax.devices()
  mesh = Mesh(np.array(jax.devices()).reshape(2, args.devices // 2), ("data", "model"))
  replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  columns = NamedSharding(mesh, P(None, "model"))

  def shardings_of(state):
    return jax.tree.map(lambda v: columns if getattr(v, "ndim", 0) == 2
                        and v.shape[1] % (args.devices // 2) == 0 else replicated, state)

  def setup(proof):
    model, params, (x, y) = common.mlp_workload()
    kwargs = dict(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    if proof is None:
      state = train_state.TrainState.create(**kwargs)
      jit = jax.jit
    else:
      state = zkdv.jax.contrib.TrainState.create(proof=proof, **kwargs)
      jit = proof.jit
    shardings = shardings_of(state)
    state = jax.tree.map(place, state, shardings)
    step = jit(common.train_step, in_shardings=(shardings, rows, rows),
               out_shardings=shardings, donate_argnums=0)
    return [state], step, (place(x, rows), place(y, rows))

  def place(value, sharding):  # works across processes, where device_put of host data may not
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

  proof = zkdv.jax.ZKDV("sharded-benchmark", zkdv.ZKDVConfig(
      sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.01)))
  proof.start()
  runs = {"jax.jit (sharded)": setup(None), "proof.jit p=0.01 unchecked host": setup(proof)}

  def stepper(run):
    holder, step, batch = run
    def one():
      holder[0] = step(holder[0], *batch)
      return holder[0]
    return one

  steppers = {name: stepper(run) for name, run in runs.items()}
  for fn in steppers.values():
    for _ in range(3):
      jax.block_until_ready(fn())
  times = {name: [] for name in steppers}
  for _ in range(args.rounds):
    for name, fn in steppers.items():
      for _ in range(args.block):
        times[name].append(common.timed(fn))
      proof.wait_for_commitments()
  proof.finish()
  if jax.process_index() != 0:
    return 0
  base = common.median(times["jax.jit (sharded)"])
  where = f" in {args.processes} processes (gloo)" if args.processes > 1 else ""
  common.print_table(
      f"Sharded MLP on {args.devices} CPU devices{where} {dict(mesh.shape)}, median of "
      f"{args.rounds * args.block} steps per row",
      ["configuration", "median step ms", "ratio to jax.jit"],
      [[name, f"{common.median(t) * 1e3:.1f}", f"{common.median(t) / base:.3f}"]
       for name, t in times.items()])
  return 0


if __name__ == "__main__":
  sys.exit(main())
