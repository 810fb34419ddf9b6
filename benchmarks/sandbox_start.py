"""What the verifier child's confinement costs at start: wall time from fork to exit.

  python -m benchmarks.sandbox_start [--repeats 20] [--jax-repeats 5]

Alternates, in one job folder laid out as a worker's, between:

* ``none``: rlimits only;
* ``before``: a network namespace and Landlock write rules (the confinement before reads
  were confined, as root: uid 0 with every capability);
* ``landlock reads``: ``before`` plus Landlock read rules (read, list, execute only
  beneath what Python needs: the candidate that was not chosen; run as uid 0, since a
  uid that cannot traverse /root cannot exec an interpreter installed there);
* ``after``: every protection this kernel grants (``sandbox.available()``): mount
  namespace with bind mounts, unprivileged user, no capabilities, Landlock, seccomp.

Each runs ``python -c pass`` ``--repeats`` times and ``python -c 'import jax; ...'``
``--jax-repeats`` times; the table gives the median wall time and the median CPU time of
the child (user + system: steadier on a shared machine), each with its cost over ``none``.
"""

import argparse
import ctypes
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from dvbench.server import sandbox
from dvbench.server import sandbox_mounts

from benchmarks import scratch

_READS = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read_file, read_dir


def _landlock_reads(work: str):
  """A preexec step: read, list and execute only beneath the runtime and the job folder."""
  paths = [m.path for m in sandbox_mounts.plan(work, work + "/scratch")
           if m.kind in ("ro", "job", "rw", "dev") or m.kind == "proc"] + ["/dev/shm"]

  def apply():
    handled = ctypes.c_uint64(_READS)
    ruleset = sandbox._check(sandbox._libc.syscall(  # pylint: disable=protected-access
        sandbox._SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(handled), ctypes.c_size_t(8),
        ctypes.c_uint32(0)), "landlock_create_ruleset")
    for path in paths:
      if os.path.exists(path):  # a file takes only file rights (no read_dir)
        access = _READS if os.path.isdir(path) else _READS & ~(1 << 3)
        sandbox._allow(ruleset, path, access)  # pylint: disable=protected-access
    sandbox._check(sandbox._libc.syscall(  # pylint: disable=protected-access
        sandbox._SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)),
        "landlock_restrict_self")
  return apply


def _variants(work: pathlib.Path):
  scratch = work / "scratch"
  before = (sandbox.NETWORK, sandbox.LANDLOCK)
  old = sandbox.confine(work, scratch, 8 << 30, 60, before)
  reads = _landlock_reads(str(work))
  return {
      "none": sandbox.confine(work, scratch, 8 << 30, 60, ()),
      "before": old,
      "landlock reads": lambda: (old(), reads()),
      "after": sandbox.confine(work, scratch, 8 << 30, 60, sandbox.available(),
                               hidden=[str(work.parent)]),
  }


def _time(code: str, work: pathlib.Path, preexec) -> tuple[float, float]:
  """(wall seconds, the child's CPU seconds: user + system, less noisy on a busy machine)."""
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  start = time.perf_counter()
  subprocess.run([sys.executable, "-c", code], check=True, cwd=work / "scratch",
                 env=sandbox.child_env(work / "scratch"), preexec_fn=preexec,
                 stdout=subprocess.DEVNULL)
  wall = time.perf_counter() - start
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--jax-repeats", type=int, default=5)
  args = parser.parse_args()
  work = pathlib.Path(tempfile.mkdtemp()).resolve() / "work" / "w" / "job"
  (work / "scratch").mkdir(parents=True)
  sandbox.prepare(work, work / "scratch")
  variants = _variants(work)
  print(f"kernel {os.uname().release}, Landlock ABI {sandbox.landlock_abi()}, "
        f"euid {os.geteuid()}, protections: {', '.join(sandbox.available())}")
  programs = (("python -c pass", "pass", args.repeats),
              ("import jax, one op", "import jax.numpy as j; j.ones(2).sum()", args.jax_repeats))
  print("| child | variant | wall, median s | over none, ms | CPU, median s | over none, ms |\n"
        "|---|---|---|---|---|---|")
  for label, code, repeats in programs:
    times = {name: [] for name in variants}
    for _ in range(repeats):
      for name, preexec in variants.items():  # alternating: drift hits all alike
        times[name].append(_time(code, work, preexec))
    base = [statistics.median(t[i] for t in times["none"]) for i in (0, 1)]
    for name, values in times.items():
      wall, cpu = (statistics.median(v[i] for v in values) for i in (0, 1))
      print(f"| {label} | {name} | {wall:.3f} | {1000 * (wall - base[0]):+.1f} | {cpu:.3f} | "
            f"{1000 * (cpu - base[1]):+.1f} |")


if __name__ == "__main__":
  with scratch.run_folder("zkdv-sandbox-start-"):
    main()
