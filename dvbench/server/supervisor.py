"""The server's housekeeping thread: keeps its validation workers and ingestion processes
running, settles proofs whose clients fell silent (crashed, or discarded when they never sent
a step: ``store_liveness``) and closes abandoned ones.

Workers are child processes of ``dvbench serve`` that die with it, even when it is
SIGKILLed: each sets ``PR_SET_PDEATHSIG`` (SIGKILL) on itself at start, bound to this
thread, which lives as long as the server (and checks that the server did not die before
that). A worker that exits is replaced at once (with a growing delay when workers keep
dying right after starting), and its running job is released so that the replacement
takes it now rather than when the lease expires; the cause is kept on the job, which is
given up after ``max_attempts`` (``store_jobs``). Ingestion processes that died idle are
replaced on the same beat (``IngestProcesses.replace_dead``).

Workers never read the server's signing key: they leave their verdicts on server-challenged
proofs pending, and this thread publishes each with the receipt it signs, on every beat
(``receipts.publish_pending``), whether ``dvbench serve`` or the operator started the worker.

Example::

  supervisor = Supervisor(worker_command, count=2, store=store, abandon_after=86400,
                          crash_after=600, ingest_processes=ingest_processes)
  supervisor.start()
  supervisor.health()  # {"alive": 2, "expected": 2, "restarts": 0}
  supervisor.stop()
"""

import dataclasses
import logging
import os
import re
import signal
import subprocess
import threading
import time

from dvbench.server import receipts
from dvbench.server.db import Store

logger = logging.getLogger("dvbench.supervisor")

_FAST_EXIT = 5.0  # seconds: a process that dies sooner than this is restarted with a delay
_MAX_DELAY = 30.0


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  return True


def exit_cause(returncode: int) -> str:
  """How a worker ended, e.g. 'the worker process was killed by SIGKILL'."""
  if returncode < 0:
    return f"the worker process was killed by {signal.Signals(-returncode).name}"
  return f"the worker process exited with status {returncode}"


@dataclasses.dataclass
class Restarts:
  """When a process that exited may start again: at once, or after a delay growing from
  1 s to 30 s while it keeps dying within 5 s of its start (e.g. the database is down).

  Example::

    restarts.started()  # when it starts
    restarts.exited()   # once, when it is found dead
    restarts.due()      # whether to start it again now
  """

  started_at: float = 0.0
  quick_deaths: int = 0
  not_before: float = 0.0

  def started(self) -> None:
    self.started_at = time.monotonic()

  def exited(self) -> None:
    quick = time.monotonic() - self.started_at < _FAST_EXIT
    self.quick_deaths = self.quick_deaths + 1 if quick else 0
    self.not_before = time.monotonic() + (
        min(_MAX_DELAY, 0.5 * 2 ** self.quick_deaths) if quick else 0.0)

  def due(self) -> bool:
    return time.monotonic() >= self.not_before


@dataclasses.dataclass
class _Slot:
  index: int
  process: subprocess.Popen | None = None
  worker_id: str = ""
  restarts: Restarts = dataclasses.field(default_factory=Restarts)


class Supervisor:
  """``count`` worker processes from ``command`` (+ ``--worker-id``, ``--parent-pid``)."""

  def __init__(self, command: list[str], count: int, store: Store, *,
               abandon_after: float | None = None, crash_after: float | None = None,
               poll_seconds: float = 0.2,
               ingest_processes=None,  # an IngestProcesses to keep running
               env: dict[str, str] | None = None,  # the workers' (None: this process's)
               signing_key=None):  # signs the receipts of pending verdicts (receipts.py)
    self.command, self.store, self.ingest_processes = command, store, ingest_processes
    self.env, self.signing_key = env, signing_key
    self.abandon_after, self.poll_seconds = abandon_after, poll_seconds
    self.crash_after = crash_after
    self._started_at = time.monotonic()
    self.slots = [_Slot(i) for i in range(count)]
    self.restarts = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, name="dvbench-supervisor", daemon=True)
    self._started = threading.Event()
    self._generation = 0

  def start(self) -> "Supervisor":
    self._thread.start()
    self._started.wait(30)
    return self

  def health(self) -> dict:
    alive = sum(s.process is not None and s.process.poll() is None for s in self.slots)
    return {"alive": alive, "expected": len(self.slots), "restarts": self.restarts}

  def stop(self, timeout: float = 10.0) -> None:
    """Stops the workers (SIGTERM, then SIGKILL after ``timeout``) and the thread."""
    self._stop.set()
    self._thread.join(timeout + 5)

  def _spawn(self, slot: _Slot) -> None:
    self._generation += 1
    slot.worker_id = f"{os.uname().nodename}-{os.getpid()}-w{slot.index}-{self._generation}"
    command = [*self.command, "--worker-id", slot.worker_id, "--parent-pid", str(os.getpid())]
    slot.process = subprocess.Popen(command, env=self.env)
    slot.restarts.started()

  def _reap(self, slot: _Slot) -> None:
    """Releases the job of a worker that exited and plans its replacement."""
    cause = exit_cause(slot.process.returncode)
    released = self.store.release_jobs(slot.worker_id, cause)
    logger.warning("worker %s stopped: %s; %d running job(s) released, replacing it",
                   slot.worker_id, cause, released)
    slot.restarts.exited()
    slot.process = None
    self.restarts += 1

  def _housekeeping(self, last: float) -> float:
    limits = [t for t in (self.abandon_after, self.crash_after) if t is not None]
    if not limits or time.monotonic() - last < min(60.0, min(limits) / 4):
      return last
    # A server that was down heard from no client meanwhile: judge silence from its start.
    if self.crash_after is not None and time.monotonic() - self._started_at >= self.crash_after:
      crashed, discarded = self.store.settle_silent_proofs(self.crash_after)
      for proof_id in crashed:
        logger.warning("proof %s sent nothing for %g s before finishing: crashed", proof_id,
                       self.crash_after)
      for proof_id in discarded:
        logger.warning("proof %s never sent a step and fell silent: discarded", proof_id)
    if self.abandon_after is not None:
      for proof_id in self.store.abandon_idle_proofs(self.abandon_after):
        logger.warning("proof %s was left receiving for over %g s: abandoned", proof_id,
                       self.abandon_after)
    return time.monotonic()

  def _release_orphaned(self) -> None:
    """Releases jobs leased to workers of a server on this machine that is gone (SIGKILLed):
    its workers died with it, so their jobs need not wait for their leases to expire."""
    node = os.uname().nodename
    for worker in self.store.running_job_workers():
      found = re.fullmatch(rf"{re.escape(node)}-(\d+)-w\d+-\d+", worker or "")
      if found and not _alive(int(found[1])):
        self.store.release_jobs(worker, "the server stopped, and its workers with it")

  def _loop(self) -> None:
    last = -float("inf")
    try:
      self._release_orphaned()
    except Exception:  # pylint: disable=broad-except  # leases expire anyway
      logger.exception("could not release the jobs of a stopped server")
    for slot in self.slots:
      self._spawn(slot)
    self._started.set()
    while not self._stop.wait(self.poll_seconds):
      try:
        for slot in self.slots:
          if slot.process is not None and slot.process.poll() is not None:
            self._reap(slot)
          if slot.process is None and slot.restarts.due():
            self._spawn(slot)
        if self.signing_key is not None:  # first: nothing else on the beat holds it back
          receipts.publish_pending(self.store, self.signing_key)
        if self.ingest_processes is not None:
          self.ingest_processes.replace_dead()
        last = self._housekeeping(last)
      except Exception:  # pylint: disable=broad-except  # e.g. the database is unreachable
        logger.exception("housekeeping failed; retrying")
    self._terminate()

  def _terminate(self, timeout: float = 10.0) -> None:
    running = [s.process for s in self.slots if s.process is not None]
    for process in running:
      if process.poll() is None:
        process.terminate()
    deadline = time.monotonic() + timeout
    for process in running:
      try:
        process.wait(max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
