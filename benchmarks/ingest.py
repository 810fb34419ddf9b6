"""Step records per second into `dvbench serve`, and read latency while 4 clients upload.

  python -m benchmarks.ingest [--records 5000] [--uploaders 4] [--repeats 3] [--before TREE]

Each run writes fresh self-challenged transcripts of ``--records`` step records (real
records: digests, chain, deterministic CBOR) and alternates:

* ``file``: writing one transcript to a local file with ``TranscriptWriter``;
* ``server``: ``--uploaders`` clients uploading one transcript each at once to a
  ``dvbench serve`` process on loopback (SQLite in WAL mode), until every close is
  acknowledged, while a reader (a process of its own) polls ``GET /api/v1/proofs/ID``
  (read latency, p50/p99).

With ``--before TREE`` (a checkout of an earlier commit, e.g. ``git worktree add
/tmp/before COMMIT``) a second server runs that tree's code and the runs alternate
between the two servers; the clients are this tree's in both.
"""

import argparse
import contextlib
import json
import os
import pathlib
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import httpx

import dvbench
from benchmarks import common
from dvbench.server.local import LocalServer
from tests.fake_prover import write_self_transcript


@contextlib.contextmanager
def python_path(tree: str | None):
  """Processes started inside run the code of ``tree`` (None: this one); ``python -m``
  puts its working folder first on the path, so they start there too."""
  old, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
  if tree is not None:
    os.environ["PYTHONPATH"] = tree
    os.chdir(tree)
  try:
    yield
  finally:
    os.chdir(cwd)
    if old is None:
      os.environ.pop("PYTHONPATH", None)
    else:
      os.environ["PYTHONPATH"] = old


class Target:
  """A server (of some tree) with a client and a proof to read during uploads."""

  def __init__(self, label: str, tree: str | None, root: pathlib.Path):
    self.label, self.root, self.runs = label, root, 0
    self.server = LocalServer(workers=0)
    # No worker verifies here: the closed proofs wait in the queue, beyond the owner quota.
    # An earlier tree's serve may not know every flag of this one.
    serve = (pathlib.Path(tree or pathlib.Path(__file__).parents[1]) / "dvbench" / "cli.py"
             ).read_text()
    if "--create" not in serve:
      self.server.args.remove("--create")
    if "--max-queued-per-owner" in serve:
      self.server.args += ["--max-queued-per-owner", "100000"]
    with python_path(tree):
      self.server.start()
      token = self.server.token("bench")
    self.client = dvbench.Client(self.server.url, token=token)
    self.experiment = self.client.experiment("bench/ingest")
    self.read_id = self.experiment.upload(self.transcript(10))

  def transcript(self, steps: int) -> pathlib.Path:
    self.runs += 1
    folder = self.root / f"{self.label}-{self.runs}-{os.urandom(4).hex()}"
    write_self_transcript(folder, steps, name=folder.name)
    return folder

  def run(self, records: int, uploaders: int) -> tuple[float, list[float], int]:
    """(seconds until every upload closed, read latencies, failed reads)."""
    folders = [self.transcript(records) for _ in range(uploaders)]
    # The reader is a process of its own: in this one it would wait for the GIL of the
    # uploading threads, and the latencies would be the client's, not the server's.
    reader = subprocess.Popen([sys.executable, "-m", "benchmarks.ingest", "--read",
                               self.server.url, self.read_id], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    if reader.stdout.readline() != "reading\n":
      raise RuntimeError(f"{self.label}: the reader did not start")
    errors = []

    def upload(folder):
      try:
        self.experiment.upload(folder)
      except Exception as e:  # pylint: disable=broad-except  # counted, reported
        errors.append(repr(e))
    threads = [threading.Thread(target=upload, args=(f,)) for f in folders]
    start = time.perf_counter()
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    seconds = time.perf_counter() - start
    reader.stdin.close()
    latencies, failed = json.loads(reader.stdout.read())
    reader.wait()
    if errors:
      raise RuntimeError(f"{self.label}: {len(errors)} uploads failed, first {errors[0]}")
    return seconds, latencies, failed

  def stop(self):
    self.client.close()
    self.server.close()


def read_until_stdin_closes(url: str, proof_id: str) -> None:
  """Says ``reading``, polls ``GET /api/v1/proofs/ID`` every 10 ms until stdin closes,
  then prints ``[latencies, failed reads]`` as JSON."""
  latencies, failed = [], 0
  with httpx.Client(base_url=url, timeout=30) as http:
    http.get(f"/api/v1/proofs/{proof_id}")
    print("reading", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:
      start = time.perf_counter()
      if http.get(f"/api/v1/proofs/{proof_id}").status_code == 200:
        latencies.append(time.perf_counter() - start)
      else:
        failed += 1
      time.sleep(0.01)
  print(json.dumps([latencies, failed]))


def percentile(xs: list[float], q: float) -> float:
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--records", type=int, default=5000, help="step records per uploader")
  parser.add_argument("--uploaders", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--before", default=None, help="a source tree to compare against")
  parser.add_argument("--read", nargs=2, metavar=("URL", "PROOF_ID"), help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.read:
    return read_until_stdin_closes(*args.read)
  root = pathlib.Path(tempfile.mkdtemp(prefix="dvbench-ingest-"))
  targets, file_times, results = [], [], {}
  try:
    if args.before:
      targets.append(Target("before", args.before, root))
    targets.append(Target("after", None, root))
    results = {t.label: [] for t in targets}
    for _ in range(args.repeats):
      start = time.perf_counter()
      write_self_transcript(root / f"file-{os.urandom(4).hex()}", args.records)
      file_times.append(time.perf_counter() - start)
      for target in targets:
        results[target.label].append(target.run(args.records, args.uploaders))
  finally:
    for target in targets:
      target.stop()
    shutil.rmtree(root, ignore_errors=True)
  n = args.records + 2
  rows = [["local file (TranscriptWriter), 1 writer", f"{n / common.median(file_times):,.0f}",
           "", "", ""]]
  for label, runs in results.items():
    rate = args.uploaders * n / common.median([r[0] for r in runs])
    latencies = [x for r in runs for x in r[1]]
    rows.append([f"dvbench serve ({label}), {args.uploaders} uploaders", f"{rate:,.0f}",
                 f"{percentile(latencies, 0.5) * 1000:.1f}",
                 f"{percentile(latencies, 0.99) * 1000:.1f}", str(sum(r[2] for r in runs))])
  common.print_table(
      f"Ingestion: {args.uploaders} x {n} records, median of {args.repeats} (reads: "
      f"GET /api/v1/proofs/ID during the uploads)",
      ["sink", "records/s", "read p50 ms", "read p99 ms", "failed reads"], rows)


if __name__ == "__main__":
  main()
