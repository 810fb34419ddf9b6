"""How often DVBench catches a run with k faked steps at update check probability p.

  python -m benchmarks.detection [--runs 100] [--p 0.1 0.25 0.5] [--k 1 2 5 10]

Each run is a hand-written prover (``tests/fake_prover.py``) against a real
``dvbench serve`` on loopback: ``k`` faked steps among ``k + 2`` steps, every
challenge on an honest step answered, every challenge on a faked step left
unanswered (a faked step has no opening that replays). A run is caught when the
server's close marks it invalid. Expected: ``1 - (1 - p)^k``; ``z`` is the
difference in binomial standard errors. The table is printed last.
"""

import argparse
import math
import random

from dvbench.server.local import LocalServer
from tests.fake_prover import FakeProver


def caught(server: LocalServer, token: str, p: float, k: int, run: int) -> bool:
  """One run with ``k`` faked steps placed at random among ``k + 2``; True when caught."""
  prover = FakeProver(server.url, token, "bench/detection")
  try:
    slot = prover.slot()
    policy = {**slot["policy"], "update_check_probability": p}
    response = prover.post_root(prover.root(slot, name=f"p{p}-k{k}-{run}", policy=policy))
    if response.status_code != 201:
      raise RuntimeError(f"root refused: {response.text}")
    steps = k + 2
    faked = set(random.sample(range(steps), k))
    prover.run(steps, faked=faked)
    return prover.finish().json()["state"] == "invalid"
  finally:
    prover.http.close()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--runs", type=int, default=100)
  parser.add_argument("--p", type=float, nargs="+", default=[0.1, 0.25, 0.5])
  parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 5, 10])
  args = parser.parse_args()
  server = LocalServer(workers=0, extra_args=(
      "--min-update-check-probability", str(min(args.p)))).start()
  rows = []
  try:
    token = server.token("bench")
    for p in args.p:
      for k in args.k:
        hits = sum(caught(server, token, p, k, run) for run in range(args.runs))
        expected = 1 - (1 - p) ** k
        error = math.sqrt(expected * (1 - expected) / args.runs) or 1.0
        rows.append((p, k, hits / args.runs, expected, (hits / args.runs - expected) / error))
  finally:
    server.stop()
  print(f"runs per row: {args.runs}")
  print("| p | k faked | caught | 1-(1-p)^k | z |")
  print("|---|---|---|---|---|")
  for p, k, fraction, expected, z in rows:
    print(f"| {p:g} | {k} | {fraction:.3f} | {expected:.3f} | {z:+.2f} |")


if __name__ == "__main__":
  main()
