"""Step records per second sustained into the embedded DVBench server.

  python -m benchmarks.ingest [--records 20000] [--repeats 3]

Writes a transcript of ``--records`` step records (real records: digests,
chain, deterministic CBOR), then alternates two runs and reports medians:
writing the same records to a local file with ``TranscriptWriter``, and
uploading them to a ``dvbench serve`` process on loopback (SQLite in WAL mode)
with the client's uploader, until the server has acknowledged the close.
"""

import argparse
import os
import pathlib
import tempfile
import time

import dvbench
from benchmarks import common
from dvbench.server.local import LocalServer
from zkdv import transcript


def write_transcript(folder: pathlib.Path, steps: int) -> float:
  """Writes a root, ``steps`` step records and a final; returns the seconds taken."""
  start = time.perf_counter()
  writer = transcript.TranscriptWriter(folder)
  writer.append({"type": "root", "format_version": transcript.FORMAT_VERSION,
                 "prover": transcript.PROVER, "name": f"ingest-{os.urandom(8).hex()}", "versions": {},
                 "platform": "cpu", "config": {}, "start": {}, "seed_commitment": bytes(32)})
  digest = os.urandom(32)
  for t in range(steps):
    writer.append({"type": "step", "index": t, "program": digest, "pre_state": digest,
                   "batch": os.urandom(32), "post_state": os.urandom(32), "probes": []})
  writer.append({"type": "final", "steps": steps, "seed": bytes(32), "status": "clean"},
                durable=True)
  writer.close()
  return time.perf_counter() - start


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--records", type=int, default=20000)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  root = pathlib.Path(tempfile.mkdtemp(prefix="dvbench-ingest-"))
  server = LocalServer(workers=0).start()
  try:
    client = dvbench.Client(server.url, token=server.token("bench"))
    runs = iter(range(10**6))
    size = 0

    def to_file():
      return write_transcript(root / f"file-{next(runs)}", args.records)

    def to_server():
      # A fresh transcript each run: one already on the server would be a no-op.
      nonlocal size
      source = root / f"source-{next(runs)}"
      write_transcript(source, args.records)
      size = (source / transcript.RECORDS_FILE).stat().st_size
      experiment = client.experiment("bench/ingest")
      start = time.perf_counter()
      experiment.upload(source)
      return time.perf_counter() - start

    times = {"file": [], "server": []}
    for _ in range(args.repeats):
      times["file"].append(to_file())
      times["server"].append(to_server())
  finally:
    server.stop()
  n = args.records + 2
  file_rate = n / common.median(times["file"])
  server_rate = n / common.median(times["server"])
  common.print_table(
      f"Ingestion of {n} records ({size / n:.0f} bytes each), median of {args.repeats}",
      ["sink", "median s", "records/s", "ratio to file"],
      [["local file (TranscriptWriter)", f"{common.median(times['file']):.3f}",
        f"{file_rate:,.0f}", "1.00"],
       ["dvbench serve (SQLite WAL, loopback)", f"{common.median(times['server']):.3f}",
        f"{server_rate:,.0f}", f"{server_rate / file_rate:.2f}"]])


if __name__ == "__main__":
  main()
