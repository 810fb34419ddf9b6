"""`dvbench serve` bounded below and beside the routes: connections before a request,
blob bodies never held whole, ingestion in its own supervised process, no stale chunks,
no segment longer than the root allows. Real servers on loopback, SQLite and PostgreSQL
where the store decides.
"""

import asyncio
import json
import multiprocessing
import os
import pathlib
import re
import signal
import socket
import sqlite3
import threading
import time

import blake3
import httpx
import sqlalchemy as sa
from absl.testing import absltest
from starlette import requests

from dvbench.server import app
from dvbench.server import ingest_processes
from dvbench.server.db import Store
from dvbench.server.local import LocalServer
from dvbench.server.schema import chunks
from tests import postgres
from tests import testing
from tests.fake_prover import FakeProver, digest
from zkdv.transcript import encode_record, record_id

_HEADER_TIMEOUT = 2.0
_MAX_CONNECTIONS = 10
_HEALTH_REQUEST = b"GET /api/v1/health HTTP/1.1\r\nHost: x\r\n\r\n"


def memory_kib(pid: int, field: str) -> int:
  for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
    if line.startswith(field + ":"):
      return int(line.split()[1])
  raise KeyError(field)


def health(url: str) -> dict:
  return httpx.get(f"{url}/api/v1/health", timeout=5).json()



def _answer_length(answer: bytes) -> int:
  """The length of a whole HTTP answer whose headers are in ``answer``."""
  head, _, _ = answer.partition(b"\r\n\r\n")
  found = re.search(rb"(?im)^content-length: *(\d+)", head)
  return len(head) + 4 + (int(found[1]) if found else 0)

class ConnectionsAndBlobsTest(absltest.TestCase):
  """One SQLite server with a short header deadline, 4 connections per address, 10 in all."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=0, extra_args=(
        "--header-timeout", str(_HEADER_TIMEOUT), "--max-connections-per-address", "4",
        "--max-connections", str(_MAX_CONNECTIONS)))
    left = cls.server.data / "blobs" / f".{'1' * 64}.0123.part"  # by a server killed mid-upload
    left.parent.mkdir()
    left.write_bytes(b"part of a blob")
    os.utime(left, (time.time() - 3600,) * 2)
    cls.server.start()
    cls.token = cls.server.token("alice")

  @classmethod
  def tearDownClass(cls):
    cls.server.stop()
    super().tearDownClass()

  def connect(self, source: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", self.server.port), timeout=10,
                                 source_address=(source, 0))
    self.addCleanup(s.close)
    return s

  def test_headers_trickled_a_byte_at_a_time_are_cut_off(self):
    s = self.connect("127.0.0.2")
    start, answer = time.monotonic(), b""
    s.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: x\r\n")
    health(self.server.url)
    # Ordered: a server that waited on the unfinished headers would answer /health only
    # after cutting them off, so the answer would not come while they are still held.
    self.assertFalse(self.answered(s))
    s.settimeout(0.2)
    while not answer and time.monotonic() - start < 3 * _HEADER_TIMEOUT:
      try:
        s.sendall(b"X")  # one more byte of a header line that never ends
        answer = s.recv(4096) or b"closed"
      except socket.timeout:
        pass
      except ConnectionError:
        answer = b"reset"
    # Cut at its deadline, well before the loop would give up (a deadline reset by each byte
    # would never cut it).
    self.assertLess(time.monotonic() - start, 2 * _HEADER_TIMEOUT)
    self.assertTrue(answer.startswith(b"HTTP/1.1 408 "), answer)
    self.assertIn(b"the request headers did not arrive in time", answer)

  def test_idle_connections_of_an_address_give_way_to_its_new_ones(self):
    idle = [self.connect("127.0.0.3") for _ in range(4)]  # its limit, each served once
    for s in idle:
      self.assertTrue(self.ask(s).startswith(b"HTTP/1.1 200 "))
    extra = self.connect("127.0.0.3")
    self.assertTrue(self.ask(extra).startswith(b"HTTP/1.1 200 "))  # /health still answers
    self.assertEqual(self.closed(idle[0]), b"")  # the oldest idle one made room

  def test_an_address_holds_at_most_its_connections_serving_requests(self):
    base = f"/api/v1/benchmarks/alice/held/blobs/{'0' * 64}"
    busy = [self.connect("127.0.0.5") for _ in range(4)]
    for s in busy:  # a request whose body never comes: the app waits for it
      s.sendall(f"PUT {base} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {self.token}\r\n"
                "Content-Length: 1000\r\nExpect: 100-continue\r\n\r\n".encode())
      self.assertTrue(s.recv(4096).startswith(b"HTTP/1.1 100 "))  # it is with the app now
    extra = self.connect("127.0.0.5")
    extra.sendall(_HEALTH_REQUEST)
    self.assertEqual(self.closed(extra), b"")  # closed unanswered: none of the four is idle
    other = self.connect("127.0.0.4")  # another address is served meanwhile
    self.assertTrue(self.ask(other).startswith(b"HTTP/1.1 200 "))
    for s in busy:
      s.close()
    again = testing.wait_until(lambda: self._health_from("127.0.0.5"), timeout=30)
    self.assertTrue(again.startswith(b"HTTP/1.1 200 "))

  @staticmethod
  def answered(s: socket.socket) -> bool:
    """Whether the server has sent something on ``s`` or closed it, without reading it."""
    timeout = s.gettimeout()
    s.setblocking(False)
    try:
      s.recv(1, socket.MSG_PEEK)
      return True
    except BlockingIOError:
      return False
    except ConnectionError:
      return True
    finally:
      s.settimeout(timeout)

  def closed(self, s: socket.socket) -> bytes:
    """What the server sends on ``s`` before closing it (b"" when it just closes it)."""
    try:
      return s.recv(4096)
    except ConnectionError:
      return b""

  def _health_from(self, source: str) -> bytes:
    with socket.create_connection(("127.0.0.1", self.server.port), timeout=5,
                                  source_address=(source, 0)) as s:
      return self.ask(s)

  def prover(self, experiment: str) -> FakeProver:
    prover = FakeProver(self.server.url, self.token, experiment).start()
    self.addCleanup(prover.http.close)  # no kept-alive connection counts in later tests
    return prover

  def assert_streamed(self, put, data: bytes) -> None:
    """``put(data)`` answers 201 without the server's peak memory growing by the body."""
    pid = self.server.process.pid
    pathlib.Path(f"/proc/{pid}/clear_refs").write_text("5")  # peak RSS := RSS now
    before = memory_kib(pid, "VmRSS")
    response = put(data)
    self.assertEqual(response.status_code, 201, response.text)
    grown_mib = (memory_kib(pid, "VmHWM") - before) / 1024
    self.assertLess(grown_mib, 16, "the server held the blob's body in memory")
    stored = self.server.data / "blobs" / blake3.blake3(data).hexdigest()
    self.assertEqual(stored.read_bytes(), data)
    self.assertEqual(stored.stat().st_mode & 0o777, 0o444)

  def assert_nothing_kept_of(self, refused: str) -> None:
    """Neither the refused blob nor any temporary file is left in the store."""
    self.assertFalse((self.server.data / "blobs" / refused).exists())
    self.assertEqual(list((self.server.data / "blobs").glob(".*")), [])

  def test_a_large_blob_is_streamed_to_disk_not_held_in_memory(self):
    prover = self.prover("alice/blobs")
    data = os.urandom(48 << 20)
    name = blake3.blake3(data).hexdigest()
    self.assert_streamed(
        lambda d: prover.http.put(f"/api/v1/proofs/{prover.proof_id}/blobs/{name}", content=d),
        data)
    # Bytes that do not hash to the name: refused, nothing kept, no temporary file left (nor
    # the one a killed server left, removed at start).
    wrong = "0" * 64
    refused = prover.http.put(f"/api/v1/proofs/{prover.proof_id}/blobs/{wrong}",
                              content=data[:1 << 20])
    self.assertEqual(refused.status_code, 400, refused.text)
    self.assertIn("does not hash to its name", refused.json()["error"])
    self.assert_nothing_kept_of(wrong)

  def test_a_large_benchmark_blob_is_streamed_too(self):
    data = os.urandom(40 << 20)
    name = blake3.blake3(data).hexdigest()
    base = f"{self.server.url}/api/v1/benchmarks/alice/streamed/blobs"
    with httpx.Client(headers={"Authorization": f"Bearer {self.token}"}, timeout=60) as http:
      self.assert_streamed(lambda d: http.put(f"{base}/{name}", content=d), data)
      self.assertEqual(http.head(f"{base}/{name}").status_code, 200)
      wrong = http.put(f"{base}/{'0' * 64}", content=data[:1 << 20])
      self.assertEqual(wrong.status_code, 400, wrong.text)
      self.assertIn("does not hash to its name", wrong.json()["error"])
      self.assert_nothing_kept_of("0" * 64)
      bobs = http.put(base.replace("/alice/", "/bob/") + f"/{name}", content=b"x")
      self.assertEqual(bobs.status_code, 403, bobs.text)  # refused before the body is read

  def ask(self, s: socket.socket) -> bytes:
    """The whole answer (headers and ``Content-Length`` bytes of body) to a health request
    on the open connection ``s``; what came before it closed, if it did."""
    s.sendall(_HEALTH_REQUEST)
    answer = b""
    try:
      while b"\r\n\r\n" not in answer or len(answer) < _answer_length(answer):
        chunk = s.recv(4096)
        if not chunk:
          break
        answer += chunk
    except ConnectionError:
      pass
    return answer

  def test_past_max_connections_every_request_gets_503_health_included(self):
    # 9 open connections from three addresses (each under its own limit of 4) ...
    held = [self.connect(f"127.0.0.{10 + i % 3}") for i in range(_MAX_CONNECTIONS - 1)]
    self.assertTrue(self.ask(held[-1]).startswith(b"HTTP/1.1 200 "))  # ... are served
    full = self.connect("127.0.0.13")  # the tenth: a request on it finds the server full
    answer = self.ask(full)
    while part := full.recv(4096):  # to the end: uvicorn closes that connection
      answer += part
    self.assertTrue(answer.startswith(b"HTTP/1.1 503 "), answer)
    self.assertIn(b"connection: close", answer)
    self.assertTrue(answer.endswith(b"Service Unavailable"), answer)
    self.assertTrue(self.ask(held[0]).startswith(b"HTTP/1.1 200 "))  # 9 again: served


class IngestProcessTest(absltest.TestCase):
  """Envelopes are stored by a child of the server, replaced when killed, gone with it."""

  def test_a_killed_ingestion_process_is_replaced_at_once_and_dies_with_the_server(self):
    server = LocalServer(workers=0, extra_args=("--min-update-check-probability", "0"))
    self.addCleanup(server.stop)
    server.start()
    prover = FakeProver(server.url, server.token("alice"), "alice/ingest",
                        probe_ratio=1 / 32).start()  # every step probed, none by chance
    prover.run(2)
    self.assertEqual(health(server.url)["ingest_processes"],
                     {"alive": 1, "expected": 1, "restarts": 0})
    (first,) = testing.ingest_children(server.process.pid)
    os.kill(first, signal.SIGKILL)
    replaced = testing.wait_until(  # with no envelope sent meanwhile
        lambda: (h := health(server.url))["ingest_processes"]["restarts"] == 1 and h, timeout=30)
    self.assertEqual(replaced["ingest_processes"], {"alive": 1, "expected": 1, "restarts": 1})
    self.assertTrue(replaced["ok"])
    self.assertTrue(testing.exited(first))
    (second,) = testing.ingest_children(server.process.pid)
    self.assertNotEqual(second, first)
    prover.run(2)  # stored by the replacement
    self.assertEqual(prover.finish().status_code, 200)
    listed = httpx.get(f"{server.url}/api/v1/proofs/{prover.proof_id}").json()
    # Every record the prover sent (root, 4 steps, the answers to its challenges, final).
    self.assertEqual((listed["state"], listed["records"], listed["steps"]),
                     ("closed", len(prover.records), 4))
    self.assertEqual(len(prover.records), 10)  # root, 4 steps, their 4 probes, final
    server.process.send_signal(signal.SIGKILL)  # the web process alone
    server.process.wait()
    testing.wait_until(lambda: testing.exited(second), timeout=10)


class EnvelopeBodyPipeTest(absltest.TestCase):
  """An envelope's body crosses to the ingestion process unpickled, through a buffer the
  child keeps: every body arrives whole and byte for byte, whatever came before it."""

  def setUp(self):
    super().setUp()
    self.web, self.child = multiprocessing.Pipe()
    self.addCleanup(self.web.close)
    self.addCleanup(self.child.close)

  def sent(self, bodies: list[bytes]) -> list:
    """What the child end receives of ("begin", n) and body n for each body, then a step
    message: the bodies share the pipe with pickled messages."""
    reader = ingest_processes._BodyReader(self.child.fileno())
    received = []

    def child():
      for _ in bodies:
        message = self.child.recv()
        received.append((message, reader.read()))
      received.append(self.child.recv())

    thread = threading.Thread(target=child, daemon=True)
    thread.start()
    for n, body in enumerate(bodies):  # larger than the socket's buffer: read meanwhile
      self.web.send(("begin", n))
      ingest_processes._send_body(self.web, memoryview(body))
    self.web.send(("step", 7))
    thread.join(60)
    self.assertFalse(thread.is_alive())
    return received

  def test_bodies_of_every_size_arrive_byte_for_byte_after_larger_ones(self):
    kept = ingest_processes.KEPT_BUFFER_BYTES
    bodies = [b"", b"x", os.urandom(3 << 20), b"short", os.urandom(kept + 1), os.urandom(1000),
              os.urandom(kept), b"y" * 7]
    received = self.sent(bodies)
    self.assertEqual(received[-1], ("step", 7))
    self.assertEqual([m for m, _ in received[:-1]], [("begin", n) for n in range(len(bodies))])
    self.assertEqual([len(b) for _, b in received[:-1]], [len(b) for b in bodies])
    for (_, got), body in zip(received, bodies):
      self.assertIs(type(got), bytes)
      self.assertEqual(got, body)

  def test_a_pipe_closed_inside_a_body_is_eof_not_a_short_body(self):
    reader = ingest_processes._BodyReader(self.child.fileno())
    ingest_processes._write_all(self.web, memoryview(ingest_processes._LENGTH.pack(100) + b"cut"))
    self.web.close()
    with self.assertRaisesRegex(EOFError, "inside a body"):
      reader.read()


class StoreCases:
  """Where the database decides: chunk clean-up, the open segment's length."""

  database_url: str | None = None

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=0, database_url=cls.database_url, extra_args=(
        "--min-update-check-probability", "0", "--abandon-after", "3s")).start()
    cls.token = cls.server.token("alice")
    cls.store = Store.open(cls.database_url or f"sqlite:///{cls.server.data / 'dvbench.db'}")

  @classmethod
  def tearDownClass(cls):
    cls.server.stop()
    super().tearDownClass()

  def held_chunks(self, proof_id: str) -> int:
    with self.store.engine.connect() as conn:
      return conn.execute(sa.select(sa.func.count()).select_from(chunks).where(
          chunks.c.proof_id == proof_id)).scalar()

  def send_chunk(self, prover: FakeProver, record: bytes = b"never completed") -> None:
    """Half of a record that never completes; it is the one chunk the proof holds."""
    envelope = {"client_id": "fake", "seq": prover._seq, "kind": "chunk",  # pylint: disable=protected-access
                "record_id": digest(record), "index": 0, "count": 2, "data": b"x" * 1000}
    response = prover.http.post(f"/api/v1/proofs/{prover.proof_id}/stream",
                                content=encode_record(envelope))
    self.assertEqual(response.json(), {"chunk": 0, "of": 2, "seq": prover._seq})  # pylint: disable=protected-access
    prover._seq += 1  # pylint: disable=protected-access
    self.assertEqual(self.held_chunks(prover.proof_id), 1)

  def test_chunks_of_given_up_closed_or_abandoned_records_are_dropped(self):
    closed = FakeProver(self.server.url, self.token, "alice/closed").start()
    closed.run(1)
    self.send_chunk(closed, b"given up")
    self.send_chunk(closed)  # another record's chunk: the one given up is dropped
    self.assertEqual(closed.finish().status_code, 200)
    self.assertEqual(self.held_chunks(closed.proof_id), 0)
    left = FakeProver(self.server.url, self.token, "alice/left").start()
    self.send_chunk(left)
    testing.wait_until(lambda: self.store.proof(left.proof_id)["state"] == "abandoned",
                       timeout=30)
    self.assertEqual(self.held_chunks(left.proof_id), 0)

  def test_a_step_beyond_the_roots_segment_length_is_refused(self):
    prover = FakeProver(self.server.url, self.token, "alice/segments", segment_length=3)
    prover.start()
    self.assertEqual(prover.policy.segment_length, 3)
    prover.step(ends=False)  # steps 0 and 1 open a segment, in envelopes of their own
    prover.step(ends=False)
    third = prover.step_record(ends=False)  # a third step that does not end it
    ending = prover.step_record(ends=True)
    envelope = [ending]  # ...and, after one that does, three more that do not
    for index in (3, 4, 5):
      envelope.append(encode_record({"type": "step", "index": index, "program": 0,
                                     "batch": digest(b"batch %d" % index),
                                     "prev": record_id(envelope[-1])}))
    for records, n, step, first in (([third], 0, 2, 0), (envelope, 3, 5, 3)):
      refused = prover.send(*records)
      self.assertEqual(refused.status_code, 409, refused.text)
      self.assertIn(f"record {n} is step {step}, step 3 of the segment that starts at step "
                    f"{first}, and carries no post_state: the proof's segments hold at most 3 "
                    "steps", refused.json()["error"])
    self.assertEqual(self.store.proof(prover.proof_id)["steps"], 2)  # nothing of either kept
    prover.step(ends=True)  # step 2 ends the segment: accepted
    self.assertEqual(prover.finish().status_code, 200)


class SqliteStoreTest(StoreCases, absltest.TestCase):
  pass


class PostgresStoreTest(postgres.OnPostgres, StoreCases, absltest.TestCase):
  pass


class OwnerTurnsTest(absltest.TestCase):

  def test_owners_waiting_take_turns_round_robin(self):
    # Before, an ingestion process gave turns in arrival order: mallory's eight envelopes
    # of records costly to decode (0.7 s a slice) kept bob's one-step envelope waiting
    # behind all of them (5.7 s); put back in line as her turns were given, she kept owners
    # who came during her turn waiting two of them.
    async def grants() -> list[str]:
      turns, granted = ingest_processes.OwnerTurns(), []

      async def request(owner: str, name: str):
        async with turns.turn(owner):
          granted.append(name)
      async with turns.turn("mallory"):  # a slice of mallory's first envelope
        waiting = [asyncio.create_task(request(owner, name)) for owner, name in (
            ("mallory", "m2"), ("mallory", "m3"), ("mallory", "m4"), ("bob", "b1"),
            ("mallory", "m5"), ("carol", "c1"))]
        await asyncio.sleep(0)  # each task runs up to its wait for a turn
        waiting[4].cancel()  # a client that went away gives up its place
      await asyncio.gather(*waiting, return_exceptions=True)
      return granted
    # mallory goes back in line when her turn ends: bob and carol, who came during it, first.
    self.assertEqual(asyncio.run(grants()), ["b1", "c1", "m2", "m3", "m4"])


class DatabaseRefusalTest(absltest.TestCase):

  def test_a_statement_the_database_refuses_answers_503_not_a_traceback(self):
    # Seen under a hostile load: a heartbeat waited out SQLite's 30 s busy timeout and
    # answered 500 with a traceback, and a proof whose heartbeats fail is counted crashed.
    refused = sa.exc.OperationalError("BEGIN IMMEDIATE", {},
                                      sqlite3.OperationalError("database is locked"))
    request = requests.Request({"type": "http", "method": "POST", "headers": [],
                                "path": "/api/v1/proofs/ab/alive"})
    response = asyncio.run(app._database_refused(request, refused))
    self.assertEqual((response.status_code, response.headers["retry-after"]), (503, "10"))
    self.assertEqual(json.loads(response.body)["error"],
                     "the server's database refused this request (database is locked); "
                     "nothing already stored was lost: send it again shortly.")


if __name__ == "__main__":
  absltest.main()
