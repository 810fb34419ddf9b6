"""Ingestion processes: the stream's envelopes are decoded, checked and stored in child
processes of ``dvbench serve``, not in the web process.

Decoding and checking an envelope of thousands of records is Python work that holds a
GIL; in the web process it made every read wait its turn (read p99 under four uploaders:
~0.5 s, benchmarks/RESULTS.md). Each child runs ``Ingestion`` on its own connection to
the database and stores one slice of an envelope at a time (``ingestion.EnvelopeJob``), its
turns given round-robin among the owners waiting (``OwnerTurns``): a large envelope, or
an owner's many, do not hold up another owner's small one for longer than a slice. The
web process only receives bodies and forwards them.

A child dies with the server (``PR_SET_PDEATHSIG``, bound to the thread that starts it:
the server's main thread, its event loop, or the supervisor's thread, all of which live as
long as the server). The server's supervisor calls ``replace_dead`` a few times a second,
so a child that died idle is replaced before the next envelope needs it (with a growing
delay while children die right after start, ``supervisor.Restarts``); ``health`` is
what ``/api/v1/health`` reports. A child that dies while storing an envelope is replaced,
and that request is answered 503: its transaction did not commit, or committed and a
resend is acknowledged as a duplicate.

Example::

  processes = IngestProcesses(2, "sqlite:///data/dvbench.db", signing_key).start()
  processes.wait_ready()
  ack = await processes.ingest(proof, body)  # in the event loop; HTTPException when refused
  processes.replace_dead()  # from the supervisor's thread
  processes.health()  # {"alive": 2, "expected": 2, "restarts": 0}
  processes.stop()
"""

import asyncio
import collections
import contextlib
import logging
import multiprocessing
import os
import signal
import struct
import threading
import time

import anyio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from starlette.exceptions import HTTPException

from dvbench.server import refusals
from dvbench.server.db import DatabaseRefused, Store
from dvbench.server.record_bodies import StoredRecordDamaged
from dvbench.server.store_jobs import QueueFull
from dvbench.server.supervisor import Restarts

logger = logging.getLogger("dvbench.ingest")

# sent back as they are; the app answers them
_REFUSALS = (HTTPException, QueueFull, StoredRecordDamaged)
_SPAWN = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or locks copied
JOB_IDLE_SECONDS = 60.0


def _serve(conn, database_url: str, key: bytes, store_options: dict, parent_pid: int) -> None:
  """A child's loop, until the server closes the pipe: ``("begin", proof)`` followed by
  the body's bytes (``_send_body``), or ``("step", handle)`` in; ``("ok", ack)``,
  ``("more", handle)`` (a slice was stored, records are left) or ``("raise", exception)``
  out."""
  from dvbench.server import sandbox  # pylint: disable=g-import-not-at-top
  from dvbench.server.ingestion import Ingestion  # pylint: disable=g-import-not-at-top
  sandbox.die_with_parent(parent_pid)
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which stops this
  store = Store.open(database_url)
  for name, value in store_options.items():
    setattr(store, name, value)
  ingestion = Ingestion(store, ed25519.Ed25519PrivateKey.from_private_bytes(key))
  jobs, bodies = _Jobs(), _BodyReader(conn.fileno())
  conn.send(("ready", None))
  while True:
    try:
      message = conn.recv()
      if message[0] == "begin":
        message = (*message, bodies.read())
    except EOFError:
      return
    try:
      reply = jobs.step(ingestion, message)
    except _REFUSALS as e:
      reply = ("raise", e)
    except DatabaseRefused as e:  # the server's fault: 503, sent again by the client
      logger.error("the database refused an envelope's statement: %s", e.orig)
      reply = ("raise", refusals.database_refused(e))
    except Exception as e:  # pylint: disable=broad-except  # logged here, a 500 there
      logger.exception("ingesting an envelope of proof %s failed",
                       message[1].get("id") if message[0] == "begin" else "(continued)")
      reply = ("raise", RuntimeError(f"ingestion failed: {type(e).__name__}"))
    conn.send(reply)


_LENGTH = struct.Struct("!Q")
KEPT_BUFFER_BYTES = 16 << 20


def _send_body(conn, body: memoryview) -> None:
  """Writes ``body`` to the pipe of ``conn`` after its length. Not pickled: the child reads
  it into a buffer it keeps (``_BodyReader``). An envelope of 870 KB cost the child 235–400
  µs and the web process 113–133 µs pickled, 100 and 73 µs so (benchmarks/RESULTS.md)."""
  _write_all(conn, memoryview(_LENGTH.pack(len(body))))
  _write_all(conn, body)


def _write_all(conn, view: memoryview) -> None:
  while view:  # the descriptor read again each time: OSError once the server closed it
    view = view[os.write(conn.fileno(), view):]


class _BodyReader:
  """Reads the bodies ``_send_body`` writes, through one buffer it keeps (up to
  ``KEPT_BUFFER_BYTES``; a larger body gets a buffer of its own)."""

  def __init__(self, fd: int):
    self._fd = fd
    self._buffer = bytearray(1 << 20)

  def read(self) -> bytes:
    """The next body, in memory of its own: a job that stores it in slices keeps it while
    the next body is read into the buffer."""
    (size,) = _LENGTH.unpack(self._read_into(memoryview(bytearray(_LENGTH.size))))
    if size > len(self._buffer):
      buffer = bytearray(max(size, min(KEPT_BUFFER_BYTES, 2 * len(self._buffer))))
      if len(buffer) <= KEPT_BUFFER_BYTES:
        self._buffer = buffer
    else:
      buffer = self._buffer
    return bytes(self._read_into(memoryview(buffer)[:size]))

  def _read_into(self, view: memoryview) -> memoryview:
    got = 0
    while got < len(view):
      n = os.readv(self._fd, [view[got:]])
      if n == 0:
        raise EOFError("the server closed the pipe inside a body")
      got += n
    return view


class _Jobs:
  """A child's envelopes with records left to store, by handle; one nobody continued for
  ``JOB_IDLE_SECONDS`` (its request went away) is dropped."""

  def __init__(self):
    self._jobs: dict[int, tuple[object, float]] = {}
    self._next = 0

  def step(self, ingestion, message: tuple) -> tuple:
    now = time.monotonic()
    for handle in [h for h, (_, at) in self._jobs.items() if at < now - JOB_IDLE_SECONDS]:
      del self._jobs[handle]
    if message[0] == "begin":
      job, handle = ingestion.begin(*message[1:]), self._next
      self._next += 1
    else:
      handle = message[1]
      job = self._jobs.pop(handle, (None,))[0]
      if job is None:
        raise HTTPException(503, "the ingestion process storing this envelope was replaced; "
                            "resend it (records it stored are acknowledged as duplicates).")
    ack = job.step()
    if ack is None:
      self._jobs[handle] = (job, time.monotonic())
      return ("more", handle)
    return ("ok", ack)


class _NotSent(Exception):
  """The child died before it took the envelope."""


class _Child:
  """One ingestion process and the server's end of its pipe."""

  def __init__(self, args: tuple):
    self.conn, child_end = _SPAWN.Pipe()
    self.process = _SPAWN.Process(target=_serve, args=(child_end, *args),
                                  name="dvbench-ingest", daemon=True)
    self.process.start()
    child_end.close()  # so that a dead child reads as EOF here
    self.ready = False
    self.found_dead = False

  def wait_ready(self, timeout: float | None = None) -> None:
    """Waits for the child's store to open (EOFError: it died; TimeoutError)."""
    if not self.ready:
      if not self.conn.poll(timeout):
        raise TimeoutError(f"the ingestion process did not start in {timeout} s.")
      self.conn.recv()
      self.ready = True

  def call(self, message: tuple):
    """The child's reply; ``_NotSent`` when it was dead before taking the message,
    EOFError or OSError when it died with it."""
    try:
      self.wait_ready()
      body = memoryview(message[2]) if message[0] == "begin" else None  # before the header
      self.conn.send(message[:2])
      if body is not None:
        _send_body(self.conn, body)
    except (EOFError, OSError) as e:
      raise _NotSent() from e
    return self.conn.recv()

  def stop(self, timeout: float) -> None:
    self.conn.close()
    self.process.join(timeout)
    if self.process.is_alive():
      self.process.kill()
      self.process.join()


class OwnerTurns:
  """One turn at a time, given round-robin among the owners waiting (each owner's
  requests in arrival order): an owner with eight envelopes waiting gets one turn a round,
  as an owner with one does, and goes back in line when its turn ends. Used in one event
  loop.

  Example::

    async with turns.turn("alice"):
      ...  # one slice of one of alice's envelopes
  """

  def __init__(self):
    self._waiting: dict[str, collections.deque] = {}  # owner -> futures, in arrival order
    self._line: collections.deque = collections.deque()  # owners waiting, in turn order
    self._holder: str | None = None  # the owner whose turn it is

  @contextlib.asynccontextmanager
  async def turn(self, owner: str):
    if self._holder is not None:
      granted = asyncio.get_running_loop().create_future()
      self._waiting.setdefault(owner, collections.deque()).append(granted)
      if owner != self._holder and owner not in self._line:
        self._line.append(owner)
      try:
        await granted
      except asyncio.CancelledError:
        if granted.done() and not granted.cancelled():  # given as it was cancelled: pass it on
          self._end(owner)
        raise
    self._holder = owner
    try:
      yield
    finally:
      self._end(owner)

  def _end(self, owner: str) -> None:
    """Ends ``owner``'s turn (back in line if it waits again) and gives the next owner's
    oldest waiting request the turn, if any."""
    self._holder = None
    if owner in self._waiting and owner not in self._line:
      self._line.append(owner)
    while self._line:
      owner = self._line.popleft()
      queue = self._waiting[owner]
      while queue and queue[0].cancelled():  # a client that went away gave up its place
        queue.popleft()
      if not queue:
        del self._waiting[owner]
        continue
      granted = queue.popleft()
      if not queue:
        del self._waiting[owner]
      self._holder = owner
      granted.set_result(None)
      return


class IngestProcesses:
  """``count`` ingestion processes; ``ingest`` gives each envelope to an idle one."""

  def __init__(self, count: int, database_url: str, signing_key: ed25519.Ed25519PrivateKey,
               store_options: dict | None = None):
    if count < 1:
      raise ValueError(f"ingestion needs at least one process, not {count}.")
    key = signing_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                    serialization.NoEncryption())
    self.count = count
    self.restarts = 0
    self._args = (database_url, key, dict(store_options or {}), os.getpid())
    self._lock = threading.Lock()  # guards the four below (event loop and supervisor)
    self._children: list[_Child] = []
    self._restarts = [Restarts() for _ in range(count)]
    self._taken: set[int] = set()  # indices of children storing an envelope
    self._stopped = False
    self._turns: list[OwnerTurns] | None = None  # per child, made in the event loop
    self._load = [0] * count  # envelopes given to each child and not yet answered

  def start(self) -> "IngestProcesses":
    """Starts the children; call it on a thread that lives as long as the server."""
    self._children = [_Child(self._args) for _ in range(self.count)]
    for restarts in self._restarts:
      restarts.started()
    return self

  def wait_ready(self, timeout: float = 60.0) -> None:
    """Returns once every child has opened the database (raises if one failed to)."""
    for child in self._children:
      try:
        child.wait_ready(timeout)
      except EOFError:
        raise RuntimeError(f"an ingestion process exited at start (code "
                           f"{child.process.exitcode}); see its error above.") from None

  def health(self) -> dict:
    """``{"alive", "expected", "restarts"}`` of the children, e.g. for ``/api/v1/health``."""
    alive = sum(child.process.is_alive() for child in list(self._children))
    return {"alive": alive, "expected": self.count, "restarts": self.restarts}

  async def ingest(self, proof: dict, body: bytes) -> dict:
    """The acknowledgement of ``body`` (see ``Ingestion.begin``), stored by the child
    with the fewest envelopes, one slice per turn: turns of a child go round-robin among
    the owners waiting, so a large envelope's slices, or an owner's many envelopes,
    alternate with other owners' envelopes."""
    if self._turns is None:
      self._turns = [OwnerTurns() for _ in range(self.count)]  # in this event loop
    owner = proof["experiment"].split("/")[0]
    index = min(range(self.count), key=self._load.__getitem__)
    self._load[index] += 1
    try:
      message = ("begin", proof, body)
      while True:
        async with self._turns[index].turn(owner):
          outcome, value = await self._call(index, message)
        if outcome != "more":
          break
        message = ("step", value)
    finally:
      self._load[index] -= 1
    if outcome == "raise":
      raise value
    return value

  async def _call(self, index: int, message: tuple) -> tuple:
    with self._lock:
      self._taken.add(index)
      child = self._children[index]
    try:
      try:
        return await anyio.to_thread.run_sync(child.call, message)
      except _NotSent:  # it died idle: its replacement takes the envelope
        child = self._replace(index, child)
        return await anyio.to_thread.run_sync(child.call, message)
    except (_NotSent, EOFError, OSError):
      self._replace(index, child)
      raise HTTPException(503, "the server's ingestion process ended before or while "
                          "storing this envelope; resend it (what was stored is "
                          "acknowledged as duplicates).") from None
    finally:
      with self._lock:
        self._taken.discard(index)

  def replace_dead(self) -> None:
    """Replaces the children that died idle (the supervisor calls it; a child that dies
    storing an envelope is replaced by ``ingest``)."""
    with self._lock:
      dead = [(index, child) for index, child in enumerate(self._children)
              if index not in self._taken and not child.process.is_alive()]
    for index, child in dead:
      self._replace(index, child)

  def _replace(self, index: int, dead: _Child) -> _Child:
    """The child at ``index``: a new one when it still is ``dead`` (once, whoever asks
    first) and its restart is due, started on the calling thread, which its
    PR_SET_PDEATHSIG is bound to."""
    with self._lock:
      if self._children[index] is not dead or self._stopped:
        return self._children[index]
      restarts = self._restarts[index]
      if not dead.found_dead:
        dead.found_dead = True
        dead.stop(timeout=1.0)
        restarts.exited()
        logger.error("an ingestion process ended (exit code %s); starting another",
                     dead.process.exitcode)
      if not restarts.due():
        return dead
      self._children[index] = _Child(self._args)
      restarts.started()
      self.restarts += 1
      return self._children[index]

  def stop(self, timeout: float = 10.0) -> None:
    with self._lock:
      self._stopped = True
    for child in self._children:
      child.stop(timeout)
