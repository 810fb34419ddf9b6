"""Validation workers: take closed proofs, measurements and benchmark submissions as jobs.

A job is leased (``SKIP LOCKED`` on PostgreSQL, a conditional update on
SQLite) and the lease is extended while the verifier runs; a worker killed
mid-job loses nothing, as the lease expires and another worker takes the job.
Uploaded programs are untrusted: ``zkdv verify`` runs in a child process with
memory and CPU-time limits, never in the web process, on a private folder
holding the proof's records and only the blobs uploaded for that proof. A
server-challenged proof is verified with its challenge key K, then gets a
signed receipt. A benchmark submission is scored the same way, shard by shard
(a range of rows per job): the owner's screened program runs on the shard's
rows in a limited child; the server aggregates once every shard is in.

Example::

  run(store, blobs, signing_key, worker_id="w1", once=True)
"""

import dataclasses
import json
import logging
import os
import pathlib
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time

import cbor2
from cryptography.hazmat.primitives.asymmetric import ed25519

from dvbench.server import receipts
from dvbench.server import scoring
from dvbench.server.blobs import BlobStore
from dvbench.server.db import Store
from zkdv.transcript import BLOBS_DIR, RECORDS_FILE

logger = logging.getLogger("dvbench.worker")


@dataclasses.dataclass(frozen=True)
class Verdict:
  """A proof's state, the verifier's own verdict (for the receipt), the failure, the checks."""

  state: str
  verifier_verdict: str
  failure: str | None
  rows: list[dict]
  claims: dict | None = None  # {claim: status}, as zkdv verify reported them
  strict: bool = False  # every claim holds with exact replays: what rankings require


def _limits(memory_bytes: int, cpu_seconds: int):
  def apply():
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    # SIGXCPU at the soft limit; the hard limit is a backstop.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 5))
  return apply


def _run_limited(command: list[str], memory_bytes: int, time_limit: int):
  """(completed process, or None on timeout, failure text or None)."""
  try:
    result = subprocess.run(command, capture_output=True, text=True, timeout=time_limit,
                            preexec_fn=_limits(memory_bytes, time_limit))
  except subprocess.TimeoutExpired:
    return None, f"verification exceeded the time limit of {time_limit} s."
  if result.returncode == -signal.SIGXCPU:
    return None, f"verification exceeded the time limit of {time_limit} s (CPU time)."
  try:
    return json.loads(result.stdout), None
  except json.JSONDecodeError:
    return None, (f"the verifier stopped (exit {result.returncode}) without a report, e.g. "
                  f"over the memory limit: {result.stderr.strip()[-300:]}")


def _materialize(store: Store, blobs: BlobStore, proof_id: str, folder: pathlib.Path) -> None:
  """The proof's records and only the blobs uploaded for it, as a transcript folder."""
  folder.mkdir()
  with open(folder / RECORDS_FILE, "wb") as f:
    for data in store.record_data(proof_id):
      f.write(data)
  blobs.link_into(folder / BLOBS_DIR, store.proof_blob_digests(proof_id))


def _clean_state(challenger: str, update_replayed: int) -> str:
  """The state a clean verification earns (labels in ``dvbench.server.labels``)."""
  if challenger == "self":
    return "self-audited"
  return "verified" if update_replayed > 0 else "unchallenged"


def verify_proof(store: Store, blobs: BlobStore, proof_id: str, *, memory_bytes: int,
                 time_limit: int) -> Verdict:
  """The verdict of ``zkdv verify`` on the proof, given K for a server-challenged one."""
  challenger = store.challenger(proof_id) or {"kind": "self"}  # proofs older than slots
  with tempfile.TemporaryDirectory(prefix="verify-", dir=blobs.folder.parent) as work:
    folder = pathlib.Path(work) / "transcript"
    _materialize(store, blobs, proof_id, folder)
    command = [sys.executable, "-m", "zkdv.cli", "verify", str(folder), "--json"]
    if challenger["kind"] == "dvbench":
      key_file = pathlib.Path(work) / "challenge_key"
      key_file.write_text(challenger["challenge_key"].hex())
      command += ["--challenge-key-file", str(key_file)]
    report, failure = _run_limited(command, memory_bytes, time_limit)
  if report is None:
    return Verdict("invalid", "could not verify", failure, [])
  rows = [{"step": c["step"], "kind": c["kind"], "mode": c["mode"], "status": c["status"],
           "max_abs_error": c["max_abs_error"], "max_rel_error": c["max_rel_error"],
           "max_ulp_error": c["max_ulp_error"]} for c in report["checks"]]
  if report["verdict"] != "verified":
    failure = "; ".join(f"{f['code']} at {f['where']}: {f['message']}"
                        for f in report["findings"][:3])
    return Verdict("invalid", report["verdict"], f"{report['verdict']}: {failure}", rows)
  required = {r["step"] for r in store.challenge_rows(proof_id) if r["needs_update"]}
  replayed = sum(r["kind"] == "update" and r["status"] == "verified" and r["step"] in required
                 for r in rows)
  claims = {c["name"]: c["status"] for c in report.get("claims", [])}
  strict = (bool(claims) and all(status == "holds" for status in claims.values())
            and all(r["mode"] == "exact" for r in rows if r["kind"] == "update"))
  return Verdict(_clean_state(challenger["kind"], replayed), "verified", None, rows, claims,
                 strict)


def verify_measurement(store: Store, blobs: BlobStore, measurement_id: str, *,
                       memory_bytes: int, time_limit: int) -> tuple[str, str | None]:
  """(state, failure) from replaying a measurement's sampled evaluations."""
  measurement = store.measurement(measurement_id)
  with tempfile.TemporaryDirectory(prefix="measure-", dir=blobs.folder.parent) as work:
    folder = pathlib.Path(work)
    (folder / "measurement.cbor").write_bytes(measurement["record"])
    sample = store.measurement_sample(measurement_id)
    (folder / "sample.cbor").write_bytes(cbor2.dumps(
        [sample["opened"], cbor2.loads(sample["openings"])]))
    blobs.link_into(folder / BLOBS_DIR, store.proof_blob_digests(measurement["proof_id"]))
    verdict, failure = _run_limited([sys.executable, "-m", "dvbench.measurement", str(folder)],
                                    memory_bytes, time_limit)
  if verdict is None:
    return "invalid", failure
  return verdict["state"], verdict["failure"]


def score_shard(store: Store, blobs: BlobStore, shard_id: str, *, memory_bytes: int,
                time_limit: int) -> tuple[bytes | None, str | None]:
  """(per-row outputs as little-endian float64, failure): the benchmark's program on the
  shard's rows in a limited child, on a private folder holding only the program, the
  checkpoint's blobs and the rows."""
  shard = store.score_shard(shard_id)
  definition, record = cbor2.loads(shard["definition"]), cbor2.loads(shard["record"])
  job = {k: definition[k] for k in ("program", "batch_rows", "params_layout", "data_layout",
                                    "data_blobs")}
  job.update(mode="score", params_blobs=record["params_blobs"], first_row=shard["first_row"],
             rows=shard["rows"])
  with tempfile.TemporaryDirectory(prefix="score-", dir=blobs.folder.parent) as work:
    folder = pathlib.Path(work)
    (folder / "job.cbor").write_bytes(cbor2.dumps(job))
    blobs.link_into(folder / BLOBS_DIR, sorted({d.hex() for d in [
        job["program"], *job["data_blobs"], *job["params_blobs"]]}))
    result, failure = _run_limited([sys.executable, "-m", "dvbench.benchmark", str(folder)],
                                   memory_bytes, time_limit)
    outputs = folder / scoring.OUTPUTS_FILE
    if result is not None and result["failure"] is None and outputs.is_file():
      outputs = outputs.read_bytes()
      if len(outputs) == scoring.OUTPUT_DTYPE.itemsize * shard["rows"]:
        return outputs, None
      failure = (f"the program gave {len(outputs) // scoring.OUTPUT_DTYPE.itemsize} outputs "
                 f"for {shard['rows']} rows.")
  return None, failure or (result or {}).get("failure") or "no outputs were written."


def _proof_job(store, blobs, signing_key, job, worker_id, limits) -> tuple[bool, str]:
  verdict = verify_proof(store, blobs, job["subject"], **limits)
  kept = store.complete_proof_job(job["id"], worker_id, job["subject"], verdict.state,
                                  verdict.failure, verdict.rows, verdict.claims, verdict.strict)
  if kept:
    replayed = sum(r["status"] != "not replayed" for r in verdict.rows)
    receipts.issue(store, signing_key, job["subject"], verdict.verifier_verdict, replayed)
  return kept, verdict.state


def _measurement_job(store, blobs, job, worker_id, limits) -> tuple[bool, str]:
  state, failure = verify_measurement(store, blobs, job["subject"], **limits)
  return store.complete_measurement_job(job["id"], worker_id, job["subject"], state,
                                        failure), state


def _shard_job(store, blobs, job, worker_id, limits) -> tuple[bool, str]:
  outputs, failure = score_shard(store, blobs, job["subject"], **limits)
  return store.complete_shard_job(job["id"], worker_id, job["subject"], outputs,
                                  failure), "failed" if failure else "scored"


def run(store: Store, blobs: BlobStore, signing_key: ed25519.Ed25519PrivateKey, *,
        worker_id: str, lease_seconds: float = 60.0, poll_seconds: float = 0.5,
        memory_bytes: int = 16 << 30, time_limit: int = 3600, once: bool = False,
        stop: threading.Event | None = None) -> int:
  """Processes jobs until ``stop`` is set (or one job, with ``once``)."""
  done = 0
  stop = stop or threading.Event()
  while not stop.is_set():
    job = store.claim_job(worker_id, lease_seconds)
    if job is None:
      if once:
        return done
      stop.wait(poll_seconds)
      continue
    logger.info("worker %s verifies %s %s", worker_id, job["kind"], job["subject"])
    alive = threading.Event()
    heartbeat = threading.Thread(target=_heartbeat, daemon=True,
                                 args=(store, job["id"], worker_id, lease_seconds, alive))
    heartbeat.start()
    limits = {"memory_bytes": memory_bytes, "time_limit": time_limit}
    try:
      if job["kind"] == "proof":
        kept, state = _proof_job(store, blobs, signing_key, job, worker_id, limits)
      elif job["kind"] == scoring.SHARD_JOB:
        kept, state = _shard_job(store, blobs, job, worker_id, limits)
      else:
        kept, state = _measurement_job(store, blobs, job, worker_id, limits)
    finally:
      alive.set()
    if kept:
      logger.info("%s %s is %s", job["kind"], job["subject"], state)
    done += 1
    if once:
      return done
  return done


def _heartbeat(store, job_id, worker_id, lease_seconds, stop: threading.Event) -> None:
  while not stop.wait(lease_seconds / 3):
    if not store.extend_lease(job_id, worker_id, lease_seconds):
      return


def default_worker_id() -> str:
  return f"{os.uname().nodename}-{os.getpid()}-{int(time.time())}"
