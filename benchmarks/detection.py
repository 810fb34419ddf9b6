"""How often DVBench catches a run with k faked steps at update check probability p.

  python -m benchmarks.detection [--runs 100] [--p 0.1 0.25 0.5] [--k 1 2 5 10] [--segments 1 4]

Each run is a hand-written prover (``tests/fake_prover.py``) against a real
``dvbench serve`` on loopback: ``k`` faked steps placed at random among ``k + 2``
steps (at least two segments' worth), states committed every ``L`` steps
(``--segments``), every challenge of a segment without a faked step answered,
every challenge of a segment holding one left unanswered (its replay cannot
reach the committed end). A run is caught when the server's close marks it
invalid. Predicted: ``1 - (1 - p)^s`` for a run whose faked steps touch ``s``
segments (``s = k`` when ``L = 1``), averaged over the runs; ``z`` is the
difference in standard errors. The table is printed last.
"""

import argparse
import math
import random
import time

from dvbench.server.local import LocalServer
from tests.fake_prover import FakeProver


def caught(server: LocalServer, token: str, p: float, k: int, length: int,
           run: int) -> tuple[bool, float]:
  """One run with ``k`` faked steps in segments of ``length``: (caught, predicted)."""
  prover = FakeProver(server.url, token, "bench/detection", segment_length=length)
  try:
    slot = prover.slot()
    policy = {**slot["policy"], "update_check_probability": p, "segment_length": length}
    response = prover.post_root(prover.root(slot, name=f"p{p}-k{k}-L{length}-{run}",
                                            policy=policy))
    if response.status_code != 201:
      raise RuntimeError(f"root refused: {response.text}")
    steps = max(k + 2, 2 * length)
    faked = set(random.sample(range(steps), k))
    prover.run(steps, faked=faked)
    touched = len({t // length for t in faked})
    response = prover.finish()
    for _ in range(20):  # a busy server answers 503 or 429 with Retry-After: close again
      if response.status_code not in (429, 503):
        break
      time.sleep(float(response.headers.get("retry-after", 1)))
      response = prover.close()
    if response.status_code != 200:
      raise RuntimeError(f"close refused: {response.status_code} {response.text}")
    return response.json()["state"] == "invalid", 1 - (1 - p) ** touched
  finally:
    prover.http.close()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--runs", type=int, default=100)
  parser.add_argument("--p", type=float, nargs="+", default=[0.1, 0.25, 0.5])
  parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 5, 10])
  parser.add_argument("--segments", type=int, nargs="+", default=[1, 4],
                      help="segment lengths L (steps between state commitments)")
  args = parser.parse_args()
  server = LocalServer(workers=0, extra_args=(  # no workers: honest runs stay queued
      "--min-update-check-probability", str(min(args.p)), "--max-queued-per-owner",
      str(args.runs * len(args.p) * len(args.k) * len(args.segments)))).start()
  rows = []
  try:
    token = server.token("bench")
    for length in args.segments:
      for p in args.p:
        for k in args.k:
          runs = [caught(server, token, p, k, length, run) for run in range(args.runs)]
          hits = sum(c for c, _ in runs)
          expected = sum(e for _, e in runs)
          error = math.sqrt(sum(e * (1 - e) for _, e in runs)) or 1.0
          rows.append((length, p, k, hits / args.runs, expected / args.runs,
                       (1 - p) ** k, (hits - expected) / error))
  finally:
    server.close()
  print(f"runs per row: {args.runs}")
  print("| L | p | k faked | caught | predicted | per-step checks 1-(1-p)^k | z |")
  print("|---|---|---|---|---|---|---|")
  for length, p, k, fraction, expected, escape, z in rows:
    print(f"| {length} | {p:g} | {k} | {fraction:.3f} | {expected:.3f} | {1 - escape:.3f} "
          f"| {z:+.2f} |")


if __name__ == "__main__":
  main()
