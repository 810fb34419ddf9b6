"""What one round of shared decisions costs across processes, by transport.

  python -m benchmarks.decision_rounds [--processes 2] [--rounds 500]

P local processes joined by ``jax.distributed`` (gloo collectives) pass a round (a window
and one 32-byte challenge, CBOR) from process 0 to the others ``--rounds`` times, each way:
through the coordination service's key-value store (``ProcessGroup.broadcast``, what
``zkdv.jax.shared_decisions`` uses) and through an XLA collective
(``multihost_utils.broadcast_one_to_all``). The last process prints the medians.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

from dvbench.server import local


def _measure(index: int, port: int, processes: int, rounds: int) -> None:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=processes, process_id=index)
  import cbor2  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  from benchmarks import common  # pylint: disable=g-import-not-at-top
  from zkdv import challenge  # pylint: disable=g-import-not-at-top
  from zkdv.jax import processes as processes_lib  # pylint: disable=g-import-not-at-top

  group = processes_lib.ProcessGroup.current()
  group.open_run(lambda: {"run_id": os.urandom(16)})
  message = {"window": 4, "challenges": [challenge.new_key()]}
  size = len(cbor2.dumps(message))

  def key_value(n: int) -> None:
    group.broadcast(f"decisions/{n}", message if group.is_writer else None)

  def collective(n: int) -> None:
    del n
    data = np.frombuffer(cbor2.dumps(message), np.uint8)
    jax.block_until_ready(multihost_utils.broadcast_one_to_all(data))

  times = {}
  for name, fn in (("key-value store", key_value), ("XLA collective", collective)):
    fn(-1)  # warm-up (compiles the collective)
    seconds = []
    for n in range(rounds):
      started = time.perf_counter()
      fn(n)
      seconds.append(time.perf_counter() - started)
    times[name] = seconds
  if index == processes - 1:  # a reader: its rounds wait for process 0's
    common.print_table(
        f"One round of shared decisions ({size} bytes) from process 0, {processes} processes, "
        f"{rounds} rounds, median and 90th percentile on process {index}",
        ["transport", "median us", "p90 us"],
        [[name, f"{statistics.median(t) * 1e6:.0f}",
          f"{sorted(t)[int(0.9 * len(t))] * 1e6:.0f}"] for name, t in times.items()])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--rounds", type=int, default=500)
  args = parser.parse_args(argv)
  port = local.free_port()
  children = [subprocess.Popen([sys.executable, "-c",
                                "import sys; from benchmarks import decision_rounds as d; "
                                "d._measure(*map(int, sys.argv[1:]))",
                                str(i), str(port), str(args.processes), str(args.rounds)])
              for i in range(args.processes)]
  return max(child.wait() for child in children)


if __name__ == "__main__":
  sys.exit(main())
