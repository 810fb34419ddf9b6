"""Validation workers: take closed proofs and measurements as jobs and replay them.

A job is leased (``SKIP LOCKED`` on PostgreSQL, a conditional update on
SQLite) and the lease is extended while the verifier runs; a worker killed
mid-job loses nothing, as the lease expires and another worker takes the job.
Uploaded programs are untrusted: ``zkdv verify`` runs in a child process with
memory and CPU-time limits, never in the web process.

Example::

  run(store, blobs, worker_id="w1", once=True)
"""

import json
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time

from dvbench.server.blobs import BlobStore
from dvbench.server.db import Store

logger = logging.getLogger("dvbench.worker")


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


def verify_proof(store: Store, blobs: BlobStore, proof_id: str, *, memory_bytes: int,
                 time_limit: int) -> tuple[str, str | None, list[dict]]:
  """(state, failure, check rows) from running ``zkdv verify`` on the proof."""
  with tempfile.TemporaryDirectory(prefix="dvbench-verify-") as folder:
    with open(os.path.join(folder, "records.cborl"), "wb") as f:
      for data in store.record_data(proof_id):
        f.write(data)
    os.symlink(blobs.folder.resolve(), os.path.join(folder, "blobs"))
    report, failure = _run_limited(
        [sys.executable, "-m", "zkdv.cli", "verify", folder, "--json"], memory_bytes, time_limit)
  if report is None:
    return "invalid", failure, []
  rows = [{"step": c["step"], "kind": c["kind"], "mode": c["mode"], "status": c["status"],
           "max_abs_error": c["max_abs_error"], "max_rel_error": c["max_rel_error"],
           "max_ulp_error": c["max_ulp_error"]} for c in report["checks"]]
  if report["verdict"] == "verified":
    return "verified", None, rows
  failure = "; ".join(f"{f['code']} at {f['where']}: {f['message']}"
                      for f in report["findings"][:3])
  return "invalid", f"{report['verdict']}: {failure}", rows


def verify_measurement(store: Store, blobs: BlobStore, measurement_id: str, *,
                       memory_bytes: int, time_limit: int) -> tuple[str, str | None]:
  """(state, failure) from replaying a measurement's sampled evaluations."""
  with tempfile.TemporaryDirectory(prefix="dvbench-measure-") as folder:
    with open(os.path.join(folder, "measurement.cbor"), "wb") as f:
      f.write(store.measurement(measurement_id)["record"])
    os.symlink(blobs.folder.resolve(), os.path.join(folder, "blobs"))
    verdict, failure = _run_limited([sys.executable, "-m", "dvbench.measurement", folder],
                                    memory_bytes, time_limit)
  if verdict is None:
    return "invalid", failure
  return verdict["state"], verdict["failure"]


def run(store: Store, blobs: BlobStore, *, worker_id: str, lease_seconds: float = 60.0,
        poll_seconds: float = 0.5, memory_bytes: int = 16 << 30, time_limit: int = 3600,
        once: bool = False, stop: threading.Event | None = None) -> int:
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
        state, failure, rows = verify_proof(store, blobs, job["subject"], **limits)
        kept = store.complete_proof_job(job["id"], worker_id, job["subject"], state, failure,
                                        rows)
      else:
        state, failure = verify_measurement(store, blobs, job["subject"], **limits)
        kept = store.complete_measurement_job(job["id"], worker_id, job["subject"], state,
                                              failure)
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
