"""What a fresh process pays to start: the imports of a training script, a verifier child and
the server, under the installed packages and under another ml_dtypes.

  python -m benchmarks.process_start --other-ml-dtypes DIR [--repeats 10]

``DIR`` holds another ml_dtypes release, e.g. ``pip install --no-deps --target DIR
ml_dtypes==0.7.0``; its environment puts ``DIR`` first on ``PYTHONPATH``. Each child (``python
-c CODE``) runs ``--repeats`` times in each environment, the environments alternating; the
table gives median wall time and median CPU time of the child (user + system, steadier on a
shared machine), and the CPU over the installed packages.
"""

import argparse
import os
import resource
import subprocess
import sys
import time

from benchmarks import common

CHILDREN = {
    "python -c pass": "pass",
    "import ml_dtypes": "import ml_dtypes",
    "import jax": "import jax",
    "import zkdv.jax (training, verifier child)": "import zkdv.jax",
    "import dvbench.server.app (server)": "import dvbench.server.app",
}


def _environments(other: str) -> dict[str, dict[str, str]]:
  installed = dict(os.environ)
  first = {**installed, "PYTHONPATH": os.pathsep.join(
      p for p in (other, installed.get("PYTHONPATH")) if p)}
  return {_version(env): env for env in (installed, first)}


def _version(env: dict[str, str]) -> str:
  out = subprocess.run([sys.executable, "-c", "import ml_dtypes; print(ml_dtypes.__version__)"],
                       env=env, check=True, capture_output=True, text=True).stdout.strip()
  return f"ml_dtypes {out}"


def _time(code: str, env: dict[str, str]) -> tuple[float, float]:
  """(wall seconds, the child's CPU seconds)."""
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  start = time.perf_counter()
  subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL)
  wall = time.perf_counter() - start
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--other-ml-dtypes", required=True, metavar="DIR")
  parser.add_argument("--repeats", type=int, default=10)
  args = parser.parse_args()
  environments = _environments(os.path.abspath(args.other_ml_dtypes))
  if len(environments) != 2:
    parser.error(f"with {args.other_ml_dtypes} first, Python imports the installed "
                 f"{next(iter(environments))}; give a folder holding another release.")
  times = {(child, name): [] for child in CHILDREN for name in environments}
  for _ in range(args.repeats):
    for child, code in CHILDREN.items():
      for name, env in environments.items():
        times[child, name].append(_time(code, env))
  installed = next(iter(environments))
  rows = []
  for child in CHILDREN:
    base = common.median([cpu for _, cpu in times[child, installed]])
    for name in environments:
      wall = common.median([w for w, _ in times[child, name]])
      cpu = common.median([c for _, c in times[child, name]])
      over = round((cpu - base) * 1e3)
      rows.append([child, name, f"{wall:.3f}", f"{cpu:.3f}", f"{over:+d}"])
  common.print_table(
      f"Process start, {args.repeats} alternating runs each (installed: {installed})",
      ["child", "environment", "wall, median s", "CPU, median s", "CPU over installed, ms"],
      rows)


if __name__ == "__main__":
  main()
