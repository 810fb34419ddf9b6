"""The ingestion process's CPU per training step, measured without training beside it.

  python -m benchmarks.ingest_replay [--steps 2000] [--repeats 5] [--before TREE]

A live run on two cores shares them with XLA, so the server's CPU per step read from
``/proc`` during training moves by ±15 % between runs. Here the small MLP of
``benchmarks.live`` (784-128-10, batch 256) first trains ``--steps`` steps live against
a ``dvbench serve`` on loopback, with and without probes (ratio 0.01), while the
envelopes its uploader sends are kept, and the database is copied as the proof is
created. Each measurement then stores those envelopes, in order, into a fresh copy of
that database, in a process of its own, with the server's own ingestion
(``Ingestion.begin(...).step()``, what the ingestion process runs): the same records,
the same challenges, nothing else on the cores. Rows alternate: this tree's ingestion,
``--before TREE``'s (a checkout of an earlier commit, e.g. ``git worktree add
/tmp/before COMMIT``), and a naive baseline, the same records appended to a transcript
file (``TranscriptWriter``: encoding and writing, no checks). ``--before`` trains and
captures again with that tree's code, and replays its own envelopes (a tree may write
another transcript format). Medians of ``--repeats``; the table comes last.
"""

import argparse
import os
import pathlib
import pickle
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time

from benchmarks import common

CAPTURES = ("live", "live, probes")


def capture(row: str, steps: int, folder: pathlib.Path) -> pathlib.Path:
  """Trains the small MLP live (``row``); the envelopes it sent and the database as its
  proof was created, as ``folder/NAME.pkl`` and ``folder/NAME.db``; returns the stem."""
  import jax  # pylint: disable=g-import-not-at-top
  from benchmarks import live  # pylint: disable=g-import-not-at-top
  from dvbench import transport, upload  # pylint: disable=g-import-not-at-top
  from dvbench.server.local import LocalServer  # pylint: disable=g-import-not-at-top
  stem = folder / row.replace(", ", "-")
  server = LocalServer(workers=0, extra_args=(
      "--min-update-check-probability", "0.01", "--min-probe-ratio", "0")).start()
  bodies = []
  # pylint: disable=protected-access
  create, envelope = upload.Uploader._create_proof, upload.Uploader._envelope

  def created(uploader, root):
    create(uploader, root)
    with sqlite3.connect(server.data / "dvbench.db") as src, \
        sqlite3.connect(f"{stem}.db") as dst:
      src.backup(dst)

  def sent(uploader, body):
    if body["kind"] == "records":  # as the uploader numbers it
      bodies.append(transport.encode({**body, "client_id": uploader.client_id,
                                      "seq": uploader._seq}))
    return envelope(uploader, body)
  upload.Uploader._create_proof, upload.Uploader._envelope = created, sent
  try:
    os.environ.update(DVBENCH_URL=server.url, DVBENCH_TOKEN=server.token("bench"))
    model, params, batch = live.workload("small", 256)
    runner = live.Runner(row, model, params, batch, 0.01, 0.01, str(folder / "runs"), 4)
    for _ in range(steps):
      runner.step()
    jax.block_until_ready(runner.state)
    runner.settle()
    proof_id = runner.proof.proof_id
    runner.proof.finish()
  finally:
    upload.Uploader._create_proof, upload.Uploader._envelope = create, envelope
    server.close()
  with open(f"{stem}.pkl", "wb") as f:
    pickle.dump({"proof_id": proof_id, "bodies": bodies}, f)
  return stem


def replay(stem: str) -> float:
  """CPU seconds per step this tree's ingestion takes to store the captured envelopes."""
  # pylint: disable=g-import-not-at-top
  from cryptography.hazmat.primitives.asymmetric import ed25519
  from dvbench.server.db import Store  # pylint: disable=g-import-not-at-top
  from dvbench.server.ingestion import Ingestion  # pylint: disable=g-import-not-at-top
  with open(f"{stem}.pkl", "rb") as f:
    captured = pickle.load(f)
  folder = tempfile.mkdtemp(prefix="dvbench-replay-")
  try:
    path = os.path.join(folder, "dvbench.db")
    shutil.copy(f"{stem}.db", path)
    store = Store.open(f"sqlite:///{path}")
    ingestion = Ingestion(store, ed25519.Ed25519PrivateKey.generate())
    start = time.process_time()
    for body in captured["bodies"]:
      job = ingestion.begin(store.proof(captured["proof_id"]), body)
      while job.step() is None:
        pass
    seconds = time.process_time() - start
    steps = store.proof(captured["proof_id"])["steps"]
    store.engine.dispose()
  finally:
    shutil.rmtree(folder, ignore_errors=True)
  return seconds / steps


def write_file(stem: str) -> float:
  """CPU seconds per step of appending the captured records to a transcript file."""
  import cbor2  # pylint: disable=g-import-not-at-top
  from zkdv import transcript  # pylint: disable=g-import-not-at-top
  with open(f"{stem}.pkl", "rb") as f:
    captured = pickle.load(f)
  records = [cbor2.loads(raw) for body in captured["bodies"]
             for raw in cbor2.loads(body)["records"]]
  folder = pathlib.Path(tempfile.mkdtemp(prefix="dvbench-file-"))
  try:
    writer = transcript.TranscriptWriter(folder)
    start = time.process_time()
    for record in records:
      writer.append(record)
    writer.close()
    seconds = time.process_time() - start
  finally:
    shutil.rmtree(folder, ignore_errors=True)
  return seconds / sum(record["type"] == "step" for record in records)


def measured(how: str, stem: pathlib.Path, tree: str | None, *more: str) -> str:
  """The last word ``how`` (replay, file, capture) of a capture prints, run in a fresh
  process with ``tree``'s code (this file, with that tree's packages first on the path)."""
  tree = tree or str(pathlib.Path(__file__).parents[1])
  out = subprocess.run([sys.executable, __file__, f"--{how}", str(stem), *more], cwd=tree,
                       env=dict(os.environ, PYTHONPATH=tree), check=True,
                       capture_output=True, text=True).stdout
  return out.split()[-1]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--before", default=None, help="a source tree to compare against")
  parser.add_argument("--replay", help=argparse.SUPPRESS)
  parser.add_argument("--file", help=argparse.SUPPRESS)
  parser.add_argument("--capture", nargs=2, help=argparse.SUPPRESS)  # ROW FOLDER
  args = parser.parse_args(argv)
  if args.replay or args.file:
    print(replay(args.replay) if args.replay else write_file(args.file))
    return
  if args.capture:
    print(capture(args.capture[0], args.steps, pathlib.Path(args.capture[1])))
    return
  folder = pathlib.Path(tempfile.mkdtemp(prefix="dvbench-ingest-replay-"))
  try:
    trees = {"this tree": None, **({"before": args.before} if args.before else {})}
    stems = {}
    for name, tree in trees.items():
      (folder / name.replace(" ", "-")).mkdir()
      for row in CAPTURES:
        stems[row, name] = measured("capture", row, tree, str(folder / name.replace(" ", "-")),
                                    f"--steps={args.steps}")
    ways = [("file", "a transcript file (TranscriptWriter)", "this tree"),
            *(("replay", f"dvbench ingestion ({name})", name) for name in trees)]
    times = {(row, label): [] for row in CAPTURES for _, label, _ in ways}
    for _ in range(args.repeats):  # alternating
      for row in CAPTURES:
        for how, label, name in ways:
          times[row, label].append(float(measured(how, stems[row, name], trees[name])))
  finally:
    shutil.rmtree(folder, ignore_errors=True)
  base = {row: common.median(times[row, ways[1][1]]) for row in CAPTURES}
  rows = [[f"small MLP, {row}", label, f"{common.median(t) * 1e6:.0f}",
           f"{min(t) * 1e6:.0f}-{max(t) * 1e6:.0f}", f"{common.median(t) / base[row]:.2f}"]
          for (row, label), t in times.items()]
  common.print_table(
      f"Ingestion CPU per training step, {args.steps} steps replayed, median of "
      f"{args.repeats} alternating", ["capture", "stored by", "CPU µs a step", "range",
                                      "ratio to this tree"], rows)


if __name__ == "__main__":
  main()
