"""The commitment pipeline: one worker thread, a bounded window of steps.

Jobs (program records, step commitments, checks) run in submission order, so
records are written in order. ``reserve()`` blocks while ``window`` steps are
in flight, which bounds the buffer generations ZKDV keeps alive (``grow`` widens
it: a server's challenges that take longer than the window's steps); a job
submitted with ``holds_slot`` gives a slot back when it has run (a step whose
challenge comes later gives its slot back with the job that answers it). A
failure is
kept (and passed to ``on_error``) and raised on the training thread at the
next ``raise_if_failed()``.

Example::

  pipeline = CommitPipeline(window=4)
  pipeline.reserve()
  job = pipeline.submit(lambda job: job.views_ready.set())
  job.done.wait()
"""

import queue
import threading
import time
from collections.abc import Callable

from zkdv import errors


class Job:
  """A unit of background work and the events the training thread waits on.

  Attributes:
    views_ready: set once the work holds no view of a buffer the next step may donate.
    replayed: set once a check's replay has a result (its openings may still be written).
    done: set when the work has run.
  """

  def __init__(self, work: Callable[["Job"], None], holds_slot: bool):
    self.work = work
    self.holds_slot = holds_slot
    self.views_ready = threading.Event()
    self.replayed = threading.Event()
    self.done = threading.Event()


class CommitPipeline:

  def __init__(self, window: int, on_error: Callable[[BaseException], None] | None = None):
    self.window = window
    self._on_error = on_error
    self.in_flight = 0  # steps reserved whose records are not yet written
    self._counting = threading.Lock()  # in_flight changes on several threads
    self._slots = threading.Semaphore(window)
    self._queue: queue.Queue[Job | None] = queue.Queue()
    self._error: BaseException | None = None
    self.last_job: Job | None = None
    self.running: Job | None = None  # the job the worker thread is running
    self._thread = threading.Thread(target=self._run, name="zkdv-commit", daemon=True)
    self._thread.start()

  def reserve(self, waiting: Callable[[float], None] | None = None) -> None:
    """Blocks until a step may be dispatched (fewer than ``window`` in flight).

    ``waiting(seconds)`` is called when it must block, then about once a second; it may
    raise to stop waiting (say, when the challenges it waits for cannot come).
    """
    started = time.monotonic()
    if not self._slots.acquire(blocking=False):
      if waiting is not None:  # at once: it may hurry what the step waits for
        waiting(0.0)
      while not self._slots.acquire(timeout=1.0):
        if waiting is not None:
          waiting(time.monotonic() - started)
    with self._counting:
      self.in_flight += 1

  def release(self) -> None:
    """Gives back a slot that ``reserve`` took for a job that holds none."""
    with self._counting:
      self.in_flight -= 1
    self._slots.release()

  @property
  def full(self) -> bool:
    """Whether a step now would wait for a slot."""
    return self.in_flight >= self.window

  def grow(self, window: int) -> None:
    """Admits up to ``window`` steps in flight from now on (a window never shrinks)."""
    while self.window < window:
      self.window += 1
      self._slots.release()

  def submit(self, work: Callable[[Job], None], *, holds_slot: bool = False) -> Job:
    job = Job(work, holds_slot)
    self.last_job = job
    self._queue.put(job)
    return job

  @property
  def error(self) -> BaseException | None:
    """The first background failure, if any."""
    return self._error

  def raise_if_failed(self) -> None:
    if self._error is not None:
      if isinstance(self._error, errors.ZKDVError):
        raise self._error
      raise errors.CommitmentError(
          f"committing a step failed in the background: {self._error!r}. The "
          "transcript holds every record written before it.") from self._error

  def drain(self) -> None:
    """Waits until every submitted job has run."""
    if self.last_job is not None:
      self.last_job.done.wait()

  def close(self) -> None:
    self._queue.put(None)
    self._thread.join()

  def _run(self) -> None:
    while (job := self._queue.get()) is not None:
      self.running = job
      try:
        if self._error is None:
          job.work(job)
      except BaseException as e:  # kept and raised on the training thread
        self._error = e
        if self._on_error is not None:
          self._on_error(e)
      finally:
        job.views_ready.set()
        job.replayed.set()
        job.done.set()
        if job.holds_slot:
          self.release()
