"""A small owner's acknowledgements while another owner uploads one huge envelope.

  python -m benchmarks.fair_ingest [--records 5000] [--repeats 3] [--before TREE]

Each run starts a proof for ``bob`` and one for ``alice`` on a ``dvbench serve`` process
on loopback (SQLite, one ingestion process, as by default). Bob posts one envelope of
``--records`` chained step records; while that request is in flight, alice sends one
step record per envelope, each after the last was acknowledged. Reported: how long bob's
envelope took, alice's acknowledged envelopes per second during it, and her
acknowledgement latency (p50, p99, max).

With ``--before TREE`` (a checkout of an earlier commit, e.g. ``git worktree add
/tmp/before COMMIT``) a second server runs that tree's code and the runs alternate
between the two servers.
"""

import argparse
import threading
import time

from benchmarks import common
from benchmarks.ingest import percentile, python_path
from dvbench.server.local import LocalServer
from tests.fake_prover import FakeProver
from zkdv.transcript import record_id


def huge_envelope(prover: FakeProver, records: int) -> list[bytes]:
  """``records`` chained step records after the prover's last one (not sent yet)."""
  raws = []
  for _ in range(records):
    raws.append(prover.step_record())
    prover.last_id, prover.state = record_id(raws[-1]), prover._post(False)  # pylint: disable=protected-access
    prover.steps += 1
  return raws


class Target:
  """A server of some tree, with a token for each owner."""

  def __init__(self, label: str, tree: str | None):
    self.label = label
    self.server = LocalServer(workers=0, max_body_mb=64)
    with python_path(tree):
      self.server.start()
      self.tokens = {owner: self.server.token(owner) for owner in ("alice", "bob")}
    self.runs = 0

  def run(self, records: int) -> tuple[float, int, list[float]]:
    """(seconds of bob's envelope, alice's acks during it, alice's latencies)."""
    self.runs += 1
    bob = FakeProver(self.server.url, self.tokens["bob"], f"bob/huge-{self.runs}").start()
    alice = FakeProver(self.server.url, self.tokens["alice"], f"alice/small-{self.runs}")
    alice.start()
    bob.http.timeout = 600
    raws = huge_envelope(bob, records)
    answers = []
    huge = threading.Thread(target=lambda: answers.append(bob.send(*raws)))
    latencies = []
    start = time.perf_counter()
    huge.start()
    while huge.is_alive():
      began = time.perf_counter()
      alice.step()
      latencies.append(time.perf_counter() - began)
    seconds = time.perf_counter() - start
    huge.join()
    if answers[0].status_code != 200:
      raise RuntimeError(f"{self.label}: the huge envelope was refused: {answers[0].text}")
    return seconds, len(latencies), latencies

  def stop(self):
    self.server.close()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--records", type=int, default=5000, help="records of the huge envelope")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--before", default=None, help="a source tree to compare against")
  args = parser.parse_args(argv)
  targets = []
  try:
    if args.before:
      targets.append(Target("before", args.before))
    targets.append(Target("after", None))
    results = {t.label: [] for t in targets}
    for _ in range(args.repeats):
      for target in targets:
        results[target.label].append(target.run(args.records))
  finally:
    for target in targets:
      target.stop()
  rows = []
  for label, runs in results.items():
    latencies = [x for r in runs for x in r[2]]
    rows.append([label, f"{common.median([r[0] for r in runs]):.1f}",
                 f"{sum(r[1] for r in runs) / sum(r[0] for r in runs):.1f}",
                 f"{percentile(latencies, 0.5) * 1000:.0f}",
                 f"{percentile(latencies, 0.99) * 1000:.0f}", f"{max(latencies) * 1000:.0f}"])
  common.print_table(
      f"A small owner during one huge envelope of {args.records} step records (SQLite, one "
      f"ingestion process; {args.repeats} runs)",
      ["server", "huge envelope s (median)", "small owner acks/s", "ack p50 ms", "ack p99 ms",
       "ack max ms"], rows)


if __name__ == "__main__":
  main()
