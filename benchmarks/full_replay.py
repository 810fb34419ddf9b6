"""Full replay of the tutorial model on a real `dvbench serve`, honest and with one faked step.

  python -m benchmarks.full_replay [--steps 200] [--segment-length 8]

A server started with ``--full-replay`` challenges every segment; the client
uploads every batch and each segment's start state, with the start attested by
``proof.init``; a worker re-executes every step. The honest run must come out
"verified (full replay)", the run whose step ``steps // 2`` was faked "invalid",
naming the segment. Times: training (``proof.finish`` included) and the wait
from ``finish`` to the server's verdict. The table comes last.
"""

import argparse
import time

import dvbench
from dvbench.server.local import LocalServer
from benchmarks import common
from tests import full_replay_test


def run(client, name: str, steps: int, length: int, fake_at=None) -> list:
  started = time.perf_counter()
  proof = full_replay_test.train(client.experiment(f"bench/{name}"), steps, fake_at, length)
  trained = time.perf_counter()
  status = client.wait_for_verdict(proof.proof_id, 1800)
  verdict = time.perf_counter()
  return [name, steps, length, proof.checks["update"], status["state"],
          status.get("full_replay"), f"{trained - started:.1f}", f"{verdict - trained:.1f}",
          (status.get("failure") or status["label"])[:90]]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--segment-length", type=int, default=8)
  args = parser.parse_args(argv)
  server = LocalServer(workers=1, extra_args=("--full-replay",)).start()
  try:
    client = dvbench.Client(server.url, token=server.token("bench"))
    rows = [run(client, "honest", args.steps, args.segment_length),
            run(client, "faked", args.steps, args.segment_length, fake_at=args.steps // 2)]
    client.close()
  finally:
    server.close()
  common.print_table(
      "Full replay of the tutorial model by a DVBench worker",
      ["run", "steps", "L", "segments opened", "state", "full replay", "train s",
       "verdict after s", "label or failure"], rows)


if __name__ == "__main__":
  main()
