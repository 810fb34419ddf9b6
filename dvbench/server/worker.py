"""Validation workers: take closed proofs as jobs and verify them with replay.

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


def verify_proof(store: Store, blobs: BlobStore, proof_id: str, *, memory_bytes: int,
                 time_limit: int) -> tuple[str, str | None, list[dict]]:
  """(state, failure, check rows) from running ``zkdv verify`` on the proof."""
  with tempfile.TemporaryDirectory(prefix="dvbench-verify-") as folder:
    with open(os.path.join(folder, "records.cborl"), "wb") as f:
      for data in store.record_data(proof_id):
        f.write(data)
    os.symlink(blobs.folder.resolve(), os.path.join(folder, "blobs"))
    try:
      result = subprocess.run(
          [sys.executable, "-m", "zkdv.cli", "verify", folder, "--json"],
          capture_output=True, text=True, timeout=time_limit,
          preexec_fn=_limits(memory_bytes, time_limit))
    except subprocess.TimeoutExpired:
      return "invalid", f"verification exceeded the time limit of {time_limit} s.", []
  if result.returncode == -signal.SIGXCPU:
    return "invalid", f"verification exceeded the time limit of {time_limit} s (CPU time).", []
  try:
    report = json.loads(result.stdout)
  except json.JSONDecodeError:
    return "invalid", (f"the verifier stopped (exit {result.returncode}) without a report, "
                       f"e.g. over the memory limit: {result.stderr.strip()[-300:]}"), []
  rows = [{"step": c["step"], "kind": c["kind"], "mode": c["mode"], "status": c["status"],
           "max_abs_error": c["max_abs_error"], "max_rel_error": c["max_rel_error"],
           "max_ulp_error": c["max_ulp_error"]} for c in report["checks"]]
  if report["verdict"] == "verified":
    return "verified", None, rows
  failure = "; ".join(f"{f['code']} at {f['where']}: {f['message']}"
                      for f in report["findings"][:3])
  return "invalid", f"{report['verdict']}: {failure}", rows


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
    logger.info("worker %s verifies proof %s", worker_id, job["proof_id"])
    alive = threading.Event()
    heartbeat = threading.Thread(target=_heartbeat, daemon=True,
                                 args=(store, job["id"], worker_id, lease_seconds, alive))
    heartbeat.start()
    try:
      state, failure, rows = verify_proof(store, blobs, job["proof_id"],
                                          memory_bytes=memory_bytes, time_limit=time_limit)
    finally:
      alive.set()
    if store.complete_job(job["id"], worker_id, job["proof_id"], state, failure, rows):
      logger.info("proof %s is %s", job["proof_id"], state)
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
