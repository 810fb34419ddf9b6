"""Validation workers: take closed proofs, measurements and benchmark submissions as jobs.

A job is leased (``SKIP LOCKED`` on PostgreSQL, a conditional update on
SQLite) and the lease is extended while the verifier runs; a worker killed
mid-job loses nothing, as the lease expires (or its supervisor releases it at
once) and another worker takes the job; a job that stops workers
``max_attempts`` times is given up with the reason. Uploaded programs are
untrusted: ``zkdv verify`` runs in a child process confined by
``dvbench.server.sandbox`` (it sees only the runtime and its job folder, runs
unprivileged, no network or unix sockets, writes only in its scratch folder,
dies with the worker), never in the web process, on a private folder holding
the proof's records and only the blobs uploaded for that proof. A
server-challenged proof is verified with its challenge key K; its verdict is
published with a receipt that the server process signs (``receipts.publish_pending``):
no worker reads the signing key. A benchmark submission is scored the same way, shard by shard
(a range of rows per job): the owner's screened program runs on the shard's
rows in a confined child; the server aggregates once every shard is in.

Faults are not verdicts: a child that dies (memory limit, a signal), exits
without a report, or reports that the verifier itself failed (``fault``, exit
70) raises ``VerifierFault``; the job is released with the cause, retried, and
after ``max_attempts`` given up as ``unverifiable`` ("could not verify:
<cause>", ``store_jobs``). Only a report's findings make a proof ``invalid``.
A verification that exceeds its time limit is not retried: it is
``unverifiable`` at once, its failure naming the check it was running (the
verifier's ``--progress-file``). Public failure text names the cause without server
paths or the child's output; those (and the verifier's traceback) go to the
worker's log.

Example::

  run(store, blobs, worker_id="w1", once=True)
"""

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import pathlib
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

import cbor2
from dvbench.server import labels
from dvbench.server import leaderboard
from dvbench.server import sandbox
from dvbench import contamination
from dvbench import scoring
from dvbench import transport
from dvbench.server.blobs import BlobStore
from dvbench.server.db import Store
from dvbench.server.record_bodies import StoredRecordDamaged
from dvbench.server.store_jobs import DEFAULT_MAX_ATTEMPTS, UNVERIFIABLE
from zkdv import records
from zkdv.transcript import BLOBS_DIR, RECORDS_FILE
from zkdv.verify import claims as claims_lib

logger = logging.getLogger("dvbench.worker")

WORK_DIR = "work"  # under the data folder: one folder per live worker
DEFAULT_TIME_LIMIT = 900  # seconds: the most any one verification may take
DEFAULT_TIME_PER_CHECK = 10.0  # seconds per check record, on top of TIME_BASE
TIME_BASE = 60.0  # seconds: starting the verifier, loading and compiling programs
TIME_LIMIT_TEXT = "exceeded the time limit"  # in every failure text of a child out of time
CPU_TIME_TEXT = "(CPU time)"  # in the failure text of a child stopped by its CPU limit
PROGRESS_FILE = "progress"  # in the child's folder: the check it is running (zkdv verify)
_PROGRESS = re.compile(rf"({'|'.join(records.CHECK_KINDS)}) (\d{{1,12}})\n")


class VerifierFault(Exception):
  """The verification itself failed (the child died, ran out of memory, or the verifier
  faulted): the job is retried, never given a verdict. ``str()`` is the public cause."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """What a verifier child may use. ``time_limit`` caps ``TIME_BASE + time_per_check * n``."""

  memory_bytes: int = 16 << 30
  time_limit: int = DEFAULT_TIME_LIMIT
  time_per_check: float = DEFAULT_TIME_PER_CHECK
  isolation: tuple[str, ...] = ()
  hidden: tuple[str, ...] = ()  # folders the child never sees (the data folder)

  def for_checks(self, n: int) -> int:
    """Seconds for a proof of ``n`` check records, e.g. 60 + 10 n, at most time_limit."""
    return int(min(self.time_limit, TIME_BASE + self.time_per_check * n))


@dataclasses.dataclass(frozen=True)
class Verdict:
  """A proof's state, the verifier's own verdict (for the receipt), the failure, the checks."""

  state: str
  verifier_verdict: str
  failure: str | None
  rows: list[dict]
  claims: dict | None = None  # {claim: status}, as the server holds them (server_claims)
  strict: bool = False  # every claim holds with exact replays: what rankings require
  standing: claims_lib.Standing | None = None  # the state and what keeps it from verified


def replaying(progress: pathlib.Path) -> str:
  """What the verifier was running when it ran out of time, from its ``--progress-file``
  (it writes ``KIND STEP``; anything else, or none, says nothing)."""
  try:  # the child's folder: a regular file only (no link out, no FIFO to wait on)
    fd = os.open(progress, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
  except OSError:
    return ""
  with os.fdopen(fd, "rb") as f:
    text = f.read(64) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
  found = _PROGRESS.fullmatch(text.decode("ascii", "replace"))
  if found is None:
    return ""
  kind, step = found.groups()
  return (f" The time ran out in the {kind} check of step {step}, which runs the prover's "
          "own program (a step that replays for longer than the proof's time allows).")


def _died(returncode: int, limits: Limits, seconds: int) -> str:
  """The public cause of a child killed by a signal."""
  sig = signal.Signals(-returncode)
  if sig == signal.SIGXCPU:
    return f"the verifier {TIME_LIMIT_TEXT} of {seconds} s {CPU_TIME_TEXT}."
  if sig == signal.SIGKILL:
    return ("the verifier was killed (SIGKILL), e.g. by the system's out-of-memory killer; "
            f"its memory limit is {limits.memory_bytes / 2**30:g} GiB.")
  return f"the verifier crashed with {sig.name}."


def _stopped(returncode: int, stderr: str, limits: Limits) -> str:
  """The public cause of a child that exited without a report (its output stays private)."""
  last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
  if last.startswith("MemoryError") or "RESOURCE_EXHAUSTED" in last:
    return (f"the verifier ran out of memory: its limit is "
            f"{limits.memory_bytes / 2**30:g} GiB.")
  return f"the verifier stopped (exit {returncode}) without a report."


def child_folder(work: pathlib.Path, blobs: BlobStore, digests) -> pathlib.Path:
  """``work/scratch``, the child's folder (the only place it may write), whose ``blobs``
  links to ``work/blobs``: hard links of only ``digests``, which the child cannot change."""
  blobs.link_into(work / BLOBS_DIR, digests)
  scratch = work / "scratch"
  scratch.mkdir()
  (scratch / BLOBS_DIR).symlink_to(work / BLOBS_DIR, target_is_directory=True)
  return scratch


def run_confined(command: list[str], work: pathlib.Path, limits: Limits, seconds: int):
  """(the child's JSON report, or None and the public failure text) of ``command`` confined
  to ``work/scratch`` (see ``child_folder``) for ``seconds`` of CPU and wall-clock time."""
  work = work.resolve()  # the child starts in its scratch folder: no relative path holds
  scratch = work / "scratch"
  sandbox.prepare(work, scratch)
  try:
    result = subprocess.run(command, capture_output=True, text=True, timeout=seconds, cwd=scratch,
                            env=sandbox.child_env(scratch), preexec_fn=sandbox.confine(
                                work, scratch, limits.memory_bytes, seconds, limits.isolation,
                                limits.hidden))
  except subprocess.TimeoutExpired:
    return None, f"verification {TIME_LIMIT_TEXT} of {seconds} s."
  if result.returncode < 0:
    failure = _died(result.returncode, limits, seconds)
  else:
    try:
      report = json.loads(result.stdout)
    except json.JSONDecodeError:
      failure = _stopped(result.returncode, result.stderr, limits)
    else:
      if isinstance(report, dict) and report.get("fault"):  # its traceback, for the log
        logger.warning("%s: could not verify: %s. Its output ended with: %s",
                       " ".join(command[2:4]), report["fault"], result.stderr.strip()[-4000:])
      return report, None
  logger.warning("%s: %s Its output ended with: %s", " ".join(command[2:4]), failure,
                 result.stderr.strip()[-2000:])
  return None, failure


def _public(text: str | None, work: pathlib.Path) -> str | None:
  """``text`` without the private folder's path."""
  if text is None:
    return None
  for folder in (work / "scratch", work):
    text = text.replace(f"{folder}{os.sep}", "").replace(str(folder), ".")
  return text


def verify_proof(store: Store, blobs: BlobStore, proof_id: str, work: pathlib.Path,
                 limits: Limits) -> Verdict:
  """The verdict of ``zkdv verify`` on the proof, given K for a server-challenged one."""
  challenger = store.challenger(proof_id) or {"kind": "self"}  # proofs older than slots
  folder = child_folder(work, blobs, store.proof_blob_digests(proof_id))
  with open(folder / RECORDS_FILE, "wb") as f:
    for data in store.record_data(proof_id):
      f.write(data)
  command = [sys.executable, "-m", "zkdv.cli", "verify", str(folder), "--json",
             "--progress-file", str(folder / PROGRESS_FILE)]
  if challenger["kind"] == "dvbench":
    key_file = work / "challenge_key"  # outside the child's folder: it reads, never writes
    key_file.write_text(challenger["challenge_key"].hex())
    command += ["--challenge-key-file", str(key_file)]
  report, failure = run_confined(command, work, limits,
                                 limits.for_checks(store.check_record_count(proof_id)))
  if report is None and TIME_LIMIT_TEXT in failure:  # running it again takes as long
    return Verdict(UNVERIFIABLE, "could not verify",
                   f"could not verify: {failure}{replaying(folder / PROGRESS_FILE)}", [])
  if report is None or (report.get("fault") and report["verdict"] != "invalid"):
    # A finding recorded before the verifier failed still makes the proof invalid.
    raise VerifierFault(failure or _public(f"the verifier failed: {report['fault']}", work))
  rows = [{"step": c["step"], "kind": c["kind"], "mode": c["mode"], "status": c["status"],
           "max_abs_error": c["max_abs_error"], "max_rel_error": c["max_rel_error"],
           "max_ulp_error": c["max_ulp_error"]} for c in report["checks"]]
  claims = server_claims(report, challenger["kind"])
  standing = claims_lib.standing_of(
      report["verdict"], [f["code"] for f in report["findings"]], claims,
      [c for c in report["checks"] if c["kind"] == "update" and c["challenged"]],
      challenger["kind"] == "self", claims_lib.start_base(report.get("claims", [])))
  if standing.state in (claims_lib.INVALID, claims_lib.NOT_VERIFIED):
    failure = "; ".join(f"{f['code']} at {f['where']}: {f['message']}"
                        for f in report["findings"][:3])
    failure = (f"{report['verdict']}: {failure}" if failure else
               f"could not verify: {', '.join(standing.shortfalls)}")
    return Verdict("invalid", report["verdict"], _public(failure, work), rows, claims,
                   standing=standing)
  replays = next((c for c in report.get("claims", []) if c["name"] == "replays"), {})
  if claims.get("replays") == "holds" and replays.get("facts", {}).get("full_replay") is True:
    claims[labels.FULL_REPLAY] = "holds"  # every step re-executed from the attested start
  claims.update(labels.start_facts(report, claims))
  claims.update(labels.data_facts(report, claims))
  claims.update(labels.discarded_facts(report))
  return Verdict(standing.state, report["verdict"], None, rows, claims, standing.ranked,
                 standing)


INDEX_DIGESTS = 20_000  # digests a transaction of ``index_probes`` inserts at most


def index_probes(store: Store, proof_id: str) -> None:
  """Indexes what a verified proof's probes opened (``contamination.probed_digests``) from
  its stored check records, before its verdict is stored: never while records arrive, and
  only for a proof that could be submitted. Records are read a page at a time and the
  digests inserted ``INDEX_DIGESTS`` at most a transaction (duplicates skipped: a retried
  job inserts nothing twice), so that no proof holds the server's write lock for long."""
  rows: set[str] = set()
  examples: set[str] = set()
  for raw in store.iter_records_of_kind(proof_id, "check"):
    more_rows, more_examples = contamination.probed_digests([transport.decode_safely(
        raw, canonical=True, max_string=transport.MAX_RECORD_STRING)])
    rows |= more_rows
    examples |= more_examples
    if len(rows) + len(examples) >= INDEX_DIGESTS:
      store.add_probed(proof_id, rows, examples)
      rows, examples = set(), set()
  store.add_probed(proof_id, rows, examples)


def server_claims(report: dict, challenger_kind: str) -> dict:
  """``{claim: status}`` of a report as the server holds them: the worker gave the verifier
  the server's own key K for the records the server stored, so the claims that a key given
  by hand leaves unverified (the chain's binding, who chose the challenges) hold."""
  claims = {}
  for c in report.get("claims", []):
    by_hand = c.get("facts", {}).get("key_source") == "challenge key"
    claims[c["name"]] = ("holds" if by_hand and challenger_kind == "dvbench"
                         and c["status"] == "could not verify" else c["status"])
  return claims


def verify_measurement(store: Store, blobs: BlobStore, measurement_id: str,
                       work: pathlib.Path, limits: Limits) -> tuple[str, str | None]:
  """(state, failure) from replaying a measurement's sampled evaluations."""
  measurement = store.measurement(measurement_id)
  folder = child_folder(work, blobs, store.proof_blob_digests(measurement["proof_id"]))
  (folder / "measurement.cbor").write_bytes(measurement["record"])
  sample = store.measurement_sample(measurement_id)
  (folder / "sample.cbor").write_bytes(cbor2.dumps(
      [sample["opened"], cbor2.loads(sample["openings"])]))
  verdict, failure = run_confined([sys.executable, "-m", "dvbench.measurement", str(folder)],
                                  work, limits, limits.time_limit)
  if verdict is None:
    raise VerifierFault(failure)
  return verdict["state"], _public(verdict["failure"], work)


def score_shard(store: Store, blobs: BlobStore, shard_id: str, work: pathlib.Path,
                limits: Limits) -> tuple[bytes | None, str | None]:
  """(per-row outputs as little-endian float64, failure): the benchmark's program on the
  shard's rows in a confined child, on a private folder holding only the program, the
  checkpoint's blobs and the rows."""
  shard = store.score_shard(shard_id)
  definition, record = cbor2.loads(shard["definition"]), cbor2.loads(shard["record"])
  job = {k: definition[k] for k in ("program", "batch_rows", "params_layout", "data_layout",
                                    "data_blobs")}
  job.update(mode="score", params_blobs=record["params_blobs"], first_row=shard["first_row"],
             rows=shard["rows"])
  if shard["first_row"] == 0:  # one shard scans the constants of the proof's programs
    job["scan_programs"] = [[what, bytes.fromhex(p)] for what, p in
                            leaderboard.scanned_programs(store, record["proof_id"])]
  folder = child_folder(work, blobs, sorted({d.hex() for d in [
      job["program"], *job["data_blobs"], *job["params_blobs"],
      *(p for _, p in job.get("scan_programs", []))]}))
  (folder / "job.cbor").write_bytes(cbor2.dumps(job))
  result, failure = run_confined([sys.executable, "-m", "dvbench.benchmark", str(folder)],
                                 work, limits, limits.time_limit)
  if result is None:  # the child died or ran out of time: retried, given up as unscored
    raise VerifierFault(failure)  # the program and rows are the benchmark's, not the entry's
  outputs = _read_own_file(folder / scoring.OUTPUTS_FILE)
  if result["failure"] is None and outputs is not None:
    if len(outputs) == scoring.OUTPUT_DTYPE.itemsize * shard["rows"]:
      return outputs, None
    failure = (f"the program gave {len(outputs) // scoring.OUTPUT_DTYPE.itemsize} outputs "
               f"for {shard['rows']} rows.")
  return None, failure or _public(result.get("failure"), work) or (
      "no outputs were written.")


def _read_own_file(path: pathlib.Path) -> bytes | None:
  """The bytes of a regular file the child wrote, None if it is missing or anything else:
  a symlink it planted there would make the worker read a file the child may not."""
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
  except OSError:
    return None
  with os.fdopen(fd, "rb") as f:
    return f.read() if stat.S_ISREG(os.fstat(fd).st_mode) else None


def _process(store, blobs, job, worker_id, work, limits) -> tuple[bool, str]:
  """(whether the verdict was kept, the subject's state) of one job."""
  if job["kind"] == "proof":
    verdict = verify_proof(store, blobs, job["subject"], work, limits)
    if verdict.state not in ("invalid", UNVERIFIABLE):
      index_probes(store, job["subject"])
    receipt = (verdict.verifier_verdict, sum(r["status"] != "not replayed" for r in verdict.rows))
    return store.complete_proof_job(job["id"], worker_id, job["subject"], verdict.state,
                                    verdict.failure, verdict.rows, receipt=receipt,
                                    claims=verdict.claims, strict=verdict.strict), verdict.state
  if job["kind"] == scoring.SHARD_JOB:
    outputs, failure = score_shard(store, blobs, job["subject"], work, limits)
    return store.complete_shard_job(job["id"], worker_id, job["subject"], outputs,
                                    failure), "failed" if failure else "scored"
  state, failure = verify_measurement(store, blobs, job["subject"], work, limits)
  return store.complete_measurement_job(job["id"], worker_id, job["subject"], state,
                                        failure), state


class WorkFolder:
  """``DATA/work/WORKER``, locked while its worker lives; folders of dead workers (whose
  lock is free) are removed when a worker starts."""

  def __init__(self, data: pathlib.Path, worker_id: str):
    self.root = pathlib.Path(data).resolve() / WORK_DIR
    self.path = self.root / worker_id
    self.path.mkdir(parents=True, exist_ok=True)
    self._lock = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)

  def remove_dead(self) -> list[str]:
    """Removes the folders of workers that no longer run; returns their names."""
    removed = []
    for folder in self.root.iterdir():
      if folder == self.path or not folder.is_dir():
        continue
      try:
        fd = os.open(folder / ".lock", os.O_RDWR | os.O_CLOEXEC)
      except FileNotFoundError:
        fd = None  # being created, or not a worker's
      if fd is None:
        continue
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        continue  # its worker lives
      finally:
        os.close(fd)
      shutil.rmtree(folder, ignore_errors=True)
      removed.append(folder.name)
    return removed

  @contextlib.contextmanager
  def job(self):
    with tempfile.TemporaryDirectory(prefix="job-", dir=self.path) as work:
      yield pathlib.Path(work)

  def close(self) -> None:
    shutil.rmtree(self.path, ignore_errors=True)
    os.close(self._lock)


def run(store: Store, blobs: BlobStore, *,
        worker_id: str, lease_seconds: float = 60.0, poll_seconds: float = 0.5,
        limits: Limits | None = None, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        once: bool = False, stop: threading.Event | None = None,
        owner_share: int | None = None) -> int:
  """Processes jobs until ``stop`` is set (or one job, with ``once``); the server process
  signs the receipts of the verdicts it stores (``receipts.publish_pending``);
  ``owner_share``: the most running jobs one owner may hold while another owner's job
  waits (``store_jobs.owner_share``)."""
  data = blobs.folder.parent.resolve()
  limits = limits or Limits(isolation=sandbox.available())
  limits = dataclasses.replace(limits, hidden=(*limits.hidden, str(data)))
  logger.info("worker %s: verifier isolation: %s", worker_id, sandbox.describe(limits.isolation))
  work = WorkFolder(data, worker_id)
  for name in work.remove_dead():
    logger.info("worker %s removed the work folder of stopped worker %s", worker_id, name)
  done = 0
  stop = stop or threading.Event()
  try:
    while not stop.is_set():
      job = store.claim_job(worker_id, lease_seconds, max_attempts, owner_share)
      if job is None:
        if once:
          return done
        stop.wait(poll_seconds)
        continue
      logger.info("worker %s verifies %s %s (attempt %d)", worker_id, job["kind"],
                  job["subject"], job["attempts"])
      alive = threading.Event()
      threading.Thread(target=_heartbeat, daemon=True,
                       args=(store, job["id"], worker_id, lease_seconds, alive)).start()
      try:
        with work.job() as folder:
          kept, state = _process(store, blobs, job, worker_id, folder, limits)
        if kept:
          logger.info("%s %s is %s", job["kind"], job["subject"], state)
      except (VerifierFault, StoredRecordDamaged) as e:  # retried; then could not verify
        logger.warning("worker %s could not verify %s %s: %s", worker_id, job["kind"],
                       job["subject"], e)
        store.release_jobs(worker_id, str(e))
      except Exception as e:  # pylint: disable=broad-except  # a fault of the worker: the same
        logger.exception("worker %s failed on %s %s", worker_id, job["kind"], job["subject"])
        store.release_jobs(worker_id, f"the worker failed ({type(e).__name__})")
      finally:
        alive.set()
      done += 1
      if once:
        return done
    return done
  finally:
    work.close()


def _heartbeat(store, job_id, worker_id, lease_seconds, stop: threading.Event) -> None:
  while not stop.wait(min(lease_seconds / 3, 5.0)):
    if not store.extend_lease(job_id, worker_id, lease_seconds):
      return


def default_worker_id() -> str:
  return f"{os.uname().nodename}-{os.getpid()}-{int(time.time())}"
