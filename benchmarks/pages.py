"""What a long proof's page and JSON cost the server: a request's wall time at a length.

  python -m benchmarks.pages [--steps 400000] [--p 1.0] [--repeats 5] [--before TREE]

Builds a data folder holding one proof of ``--steps`` steps through the store's own
statements: a step record with a loss each (``append_records``), a derived challenge each
(``add_challenges``), an update check at probability ``--p`` (1.0: a full replay, every
step challenged), each replayed and verified (the checks table). It then serves the folder
with ``dvbench serve`` on loopback and times, alternating: the proof page, the proof JSON,
the metrics JSON, and a naive baseline, ``GET /api/v1/health`` (the fixed cost of a
request). ``--before TREE`` (a checkout of an earlier commit, e.g. ``git worktree add
/tmp/before COMMIT``) builds its own folder and serves it with its own code, beside this
tree's server, in the same alternation. Medians of ``--repeats``; the table comes last.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import httpx

from benchmarks import common
from dvbench.server.local import LocalServer

REQUESTS = {"health (baseline)": "/api/v1/health", "proof page": "/proofs/{id}",
            "proof JSON": "/api/v1/proofs/{id}", "metrics JSON": "/api/v1/proofs/{id}/metrics"}
BATCH = 20_000  # rows a transaction while building


def build(folder: pathlib.Path, steps: int, p: float) -> str:
  """A data folder with one closed proof of ``steps`` steps; returns its id."""
  # pylint: disable=g-import-not-at-top
  import blake3
  import cbor2
  import numpy as np
  from dvbench.server import custody
  from dvbench.server import db
  from zkdv import challenge
  store = db.Store.open(f"sqlite:///{folder / 'dvbench.db'}")
  root = cbor2.dumps({"type": "root", "run_name": "bench"}, canonical=True)
  proof = blake3.blake3(root).hexdigest()
  exp = store.experiment("bench/pages", create_for="bench")
  store.create_proof(exp["id"], proof, "bench/pages", root, {
      "kind": "self", "nonce": None, "policy": json.dumps(challenge.Policy().to_record())})
  challenged = np.random.default_rng(0).random(steps) < p
  for first in range(0, steps, BATCH):
    indices = range(first, min(first + BATCH, steps))
    with store.engine.begin() as conn:
      head = store.custody_head(conn, proof)
      new = [cbor2.dumps({"type": "step", "index": i, "metrics": {"loss": 1.0 / (i + 1)}},
                         canonical=True) for i in indices]
      items = [(blake3.blake3(r).digest(), "step", r) for r in new]
      store.append_records(conn, proof, dataclasses.replace(
          head, records=head.records + len(items), steps=head.steps + len(items),
          last_id=items[-1][0], last_kind="step"), items)
      store.add_challenges(conn, [custody.challenge_row(
          proof, i, items[i - first][0], bytes(32), {
              "update": bool(challenged[i]), "state": False, "probe": False})
                                  for i in indices])
      checked = [i for i in indices if challenged[i]]
      if checked:
        conn.execute(db.checks.insert(), [
            {"proof_id": proof, "step": i, "kind": "update", "mode": "exact",
             "status": "verified", "max_abs_error": 0.0, "max_rel_error": 0.0,
             "max_ulp_error": 0} for i in checked])
  store.set_proof_state(proof, "self-audited")
  store.engine.dispose()
  return proof


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=400_000)
  parser.add_argument("--p", type=float, default=1.0, help="update check probability")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--before", default=None, help="a source tree to compare against")
  parser.add_argument("--build", nargs=3, help=argparse.SUPPRESS)  # FOLDER STEPS P
  args = parser.parse_args(argv)
  if args.build:
    print(build(pathlib.Path(args.build[0]), int(args.build[1]), float(args.build[2])))
    return
  trees = {"this tree": str(pathlib.Path(__file__).resolve().parents[1]),
           **({"before": str(pathlib.Path(args.before).resolve())} if args.before else {})}
  work = pathlib.Path(tempfile.mkdtemp(prefix="dvbench-pages-"))
  servers, proofs = {}, {}
  try:
    for name, tree in trees.items():
      folder = work / name.replace(" ", "-")
      folder.mkdir()
      started = time.perf_counter()
      proofs[name] = subprocess.run(  # this file, with that tree's packages first
          [sys.executable, __file__, "--build", str(folder), str(args.steps), str(args.p)],
          cwd=tree, env=dict(os.environ, PYTHONPATH=tree), check=True, capture_output=True,
          text=True).stdout.split()[-1]
      print(f"{name}: built {args.steps} steps in {time.perf_counter() - started:.0f} s",
            file=sys.stderr)
      servers[name] = LocalServer(workers=0, data=folder, source=tree).start()
    times = {(name, what): [] for name in trees for what in REQUESTS}
    sizes = {}
    with httpx.Client(timeout=600) as http:
      for _ in range(args.repeats):  # alternating
        for what, path in REQUESTS.items():
          for name, server in servers.items():
            started = time.perf_counter()
            response = http.get(server.url + path.format(id=proofs[name]))
            times[name, what].append(time.perf_counter() - started)
            response.raise_for_status()
            sizes[name, what] = len(response.content)
  finally:
    for server in servers.values():
      server.stop()
    shutil.rmtree(work, ignore_errors=True)
  rows = []
  for what in REQUESTS:
    base = common.median(times["this tree", what])
    for name in trees:
      t = times[name, what]
      rows.append([what, name, f"{common.median(t) * 1e3:.1f}",
                   f"{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}", f"{common.median(t) / base:.2f}",
                   f"{sizes[name, what]:,}"])
  common.print_table(
      f"A proof of {args.steps:,} steps (update checks at p = {args.p:g}), median of "
      f"{args.repeats} alternating requests", ["request", "served by", "ms", "range",
                                               "ratio to this tree", "bytes"], rows)


if __name__ == "__main__":
  main()
