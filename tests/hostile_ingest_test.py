"""Hostile and faulty clients against a real `dvbench serve` process, on SQLite and PostgreSQL.

Each test writes its attack out and shows the server refuses it with a message naming what
failed, stays responsive, and never answers 5xx.
"""

import json
import math
import os
import pathlib
import socket
import tempfile
import threading
import time

import blake3
import cbor2
import httpx
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric import ed25519
from absl.testing import absltest

import dvbench
from dvbench import transport
from dvbench.server import schema
from dvbench.server import store_custody
from dvbench.server.db import Store
from dvbench.server.ingestion import Ingestion
from dvbench.server.local import LocalServer
from tests import postgres
from tests.fake_prover import FakeProver, write_self_transcript
from zkdv import records
from zkdv.transcript import encode_record, record_id

# Short limits so that slow-client cases finish in about a second.
_LIMITS = ("--body-timeout", "2", "--body-idle-timeout", "1", "--max-uploads", "6",
           "--max-uploads-per-token", "4", "--bad-token-limit", "5", "--bad-token-window", "30")
_HUGE_RECORDS = 4000  # an envelope that takes the server seconds to store in one go


def together(n: int, fn):
  """Runs ``fn(i)`` in ``n`` threads released at once; returns the results in order."""
  barrier, results = threading.Barrier(n), [None] * n

  def run(i):
    barrier.wait()
    try:
      results[i] = fn(i)
    except Exception as e:  # pylint: disable=broad-except  # reported by the caller
      results[i] = e
  threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  return results


def raw_request(port: int, head: str, body: bytes = b"", source: str = "127.0.0.1",
                timeout: float = 3.0) -> tuple[int, bytes]:
  """(status, whole answer) of a hand-written request, ``body`` sent after the headers."""
  with socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                source_address=(source, 0)) as s:
    s.sendall(head.encode() + b"\r\n\r\n" + body)
    answer = b""
    while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < int(
        answer.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]):
      part = s.recv(65536)
      if not part:
        break
      answer += part
  return int(answer.split(b" ", 2)[1]), answer


def _chunks_held(store: Store, proof_id: str) -> int:
  """How many chunks of a proof's record being sent the server holds."""
  with store.engine.connect() as conn:
    return conn.execute(sa.select(sa.func.count()).select_from(schema.chunks).where(
        schema.chunks.c.proof_id == proof_id)).scalar()


class HostileTestCase(absltest.TestCase):
  """One server per class; ``database_url`` None is SQLite."""

  database_url: str | None = None

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=0, database_url=cls.database_url, max_body_mb=4,
                             extra_args=_LIMITS).start()
    cls.token = cls.server.token("alice")
    cls.auth = {"Authorization": f"Bearer {cls.token}"}
    cls.http = httpx.Client(base_url=cls.server.url, headers=cls.auth, timeout=10)

  @classmethod
  def tearDownClass(cls):
    cls.http.close()
    cls.server.stop()
    super().tearDownClass()

  def prover(self, name: str) -> FakeProver:
    return FakeProver(self.server.url, self.token, f"alice/{name}").start(name)

  def assertRefused(self, response: httpx.Response, status: int, *fragments: str):
    self.assertEqual(response.status_code, status, response.text)
    for fragment in fragments:
      self.assertIn(fragment, response.json()["error"])

  def record_ids(self, proof_id: str) -> list[str]:
    return self.http.get(f"/api/v1/proofs/{proof_id}/records").json()


class DatabaseCases:
  """Cases where the database matters: bounds of what reaches it, concurrent writers."""

  def test_huge_integers_are_refused_naming_the_field(self):
    prover = self.prover("huge-ints")
    prover.run(steps=1)
    before = self.record_ids(prover.proof_id)
    top = 2**64 - 1  # the largest integer CBOR encodes without a (refused) bignum tag
    cases = [
        ({"type": "step", "index": top, "program": 0, "pre_state": prover.state,
          "batch": bytes(32), "post_state": bytes(32)}, "record 0 (step).index"),
        ({"type": "check", "step": -top, "kind": "update"}, "record 0 (check).step"),
        ({"type": "final", "steps": 2**63, "status": "clean"}, "record 0 (final).steps"),
        ({"type": "check", "step": 0, "kind": "probe", "batch_roots": [],
          "probes": [[0, top, 1, b"row", []]]}, "record 0 (check).probes[0][1]"),
        ({"type": "check", "step": 0, "kind": "probe", "batch_roots": [],
          "probes": ["::/0"]}, "record 0 (check).probes[0]"),
    ]
    for fields, field in cases:
      response = prover.send(prover.chain(fields))
      self.assertRefused(response, 400, field)
      self.assertLess(len(response.text), 400)  # huge values are described, never printed
    envelope = {"client_id": "c", "seq": top, "kind": "records", "records": []}
    self.assertRefused(self.http.post(f"/api/v1/proofs/{prover.proof_id}/stream",
                                      content=encode_record(envelope)), 400, "envelope.seq")
    self.assertEqual(self.record_ids(prover.proof_id), before)

  def test_a_record_naming_more_blobs_than_it_may_is_refused(self):
    # Before, a check record naming a million blobs was stored with a reference row for
    # each: 9 s of the write lock for other owners' requests, and 9 times its own bytes in
    # the database, past its owner's quota.
    prover = self.prover("many-blobs")
    prover.run(steps=1)
    before = self.record_ids(prover.proof_id)
    names = [blake3.blake3(b"%d" % n).digest() for n in range(records.MAX_RECORD_BLOBS + 1)]
    cases = [
        ({"type": "check", "step": 0, "kind": "state", "post_state_blobs": names},
         f"record 0 (check): names {len(names)} blobs, more than a record may "
         f"({records.MAX_RECORD_BLOBS})"),
        ({"type": "check", "step": 0, "kind": "update", "first": 0,
          "pre_state_blobs": names[:1], "batch_blobs": [names[:1]] * 2},
         "record 0 (check).batch_blobs: one list of blobs per step of the segment 0..0 (1), "
         "got 2"),
        # A segment that ends before it starts opens no batch at all.
        ({"type": "check", "step": 0, "kind": "update", "first": 1,
          "pre_state_blobs": names[:1], "batch_blobs": []},
         "record 0 (check).first: the segment's first step, at most its last (0), got 1"),
    ]
    for fields, says in cases:
      self.assertRefused(prover.send(prover.chain(fields)), 400, says)
    self.assertEqual(self.record_ids(prover.proof_id), before)

  def test_long_strings_are_refused_or_bounded(self):
    prover = self.prover("long-strings")
    stream = f"/api/v1/proofs/{prover.proof_id}/stream"
    envelope = {"client_id": "c" * 65, "seq": 0, "kind": "records", "records": []}
    self.assertRefused(self.http.post(stream, content=encode_record(envelope)), 400,
                       "envelope.client_id")
    long_type = prover.chain({"type": "x" * 21})
    self.assertRefused(prover.send(long_type), 400, "record 0.type")
    nul = {"client_id": "c\x00", "seq": 0, "kind": "records", "records": []}
    self.assertRefused(self.http.post(stream, content=encode_record(nul)), 400,
                       "envelope.client_id: a string without NUL")
    self.assertRefused(prover.send(prover.chain({"type": "st\x00ep"})), 400, "record 0.type")
    huge_text = prover.chain({"type": "program", "function": "f" * (transport.MAX_RECORD_STRING
                                                                     + 1)})
    self.assertRefused(prover.send(huge_text), 400, "not acceptable CBOR", "limit")
    # A root name longer than the column is stored cut to it, on every database.
    other = FakeProver(self.server.url, self.token, "alice/long-name")
    slot = other.slot()
    self.assertRefused(other.post_root(other.root(slot, name="n\x00")), 400,
                       "(root).name: a string without NUL")
    response = other.post_root(other.root(slot, name="n" * 60000))
    self.assertEqual(response.status_code, 201, response.text)
    self.assertLen(response.json()["name"], 400)

  def test_the_same_transcript_from_four_clients_at_once(self):
    folder = pathlib.Path(tempfile.mkdtemp()) / "run"
    ids = [i.hex() for i in write_self_transcript(folder, 40, name="four-clients")]
    client = dvbench.Client(self.server.url, token=self.token)
    experiment = client.experiment("alice/four-clients")
    results = together(4, lambda _: experiment.upload(folder, batch_bytes=600))
    self.assertEqual(set(results), {ids[0]}, results)  # every upload succeeded, one proof
    self.assertEqual(self.record_ids(ids[0]), ids)  # every record once, in order
    self.assertEqual(client.proof_status(ids[0])["state"], "closed")

  def test_the_same_root_created_at_once(self):
    prover = FakeProver(self.server.url, self.token, "alice/same-root")
    raw = encode_record(prover.root(prover.slot()))
    results = together(4, lambda _: self.http.post(  # 4 uploads a token
        "/api/v1/experiments/alice/same-root/proofs", content=raw))
    self.assertEqual({r.status_code for r in results}, {201}, [r.text for r in results])
    self.assertEqual({r.json()["id"] for r in results}, {blake3.blake3(raw).hexdigest()})
    self.assertLen(self.http.get("/api/v1/experiments/alice/same-root").json()["proofs"], 1)

  def test_the_same_envelope_sent_at_once(self):
    prover = self.prover("same-seq")
    envelope = encode_record({"client_id": "c", "seq": 0, "kind": "records",
                              "records": [prover.step_record()]})
    results = together(4, lambda _: self.http.post(f"/api/v1/proofs/{prover.proof_id}/stream",
                                                   content=envelope))  # 4 uploads a token
    self.assertEqual({r.status_code for r in results}, {200}, [r.text for r in results])
    acks = [r.json() for r in results]
    self.assertEqual(sorted(a.get("duplicate", False) for a in acks), [False] + [True] * 3)
    self.assertLen(self.record_ids(prover.proof_id), 2)

  def test_a_used_seq_is_refused_for_other_content_and_acknowledged_again_for_its_resend(self):
    prover = self.prover("seq-reuse")
    stream = f"/api/v1/proofs/{prover.proof_id}/stream"
    first_ack = prover.step()  # client "fake", seq 0

    def envelope(seq: int, *raws: bytes) -> bytes:
      return encode_record({"client_id": "fake", "seq": seq, "kind": "records",
                            "records": list(raws)})
    stored = self.record_ids(prover.proof_id)
    other = envelope(0, prover.step_record())  # the next step, under the used seq 0
    self.assertRefused(self.http.post(stream, content=other), 409, "envelope seq 0",
                       "never reused", "under seq 1")
    self.assertEqual(self.record_ids(prover.proof_id), stored)  # nothing stored
    resend = self.http.post(stream, content=envelope(0, prover.records[-1]))
    self.assertEqual(resend.status_code, 200, resend.text)
    self.assertEqual(resend.json(), {**first_ack, "duplicate": True})
    prover.step()  # seq 1 takes the new record
    self.assertLen(self.record_ids(prover.proof_id), 3)
    self.assertRefused(self.http.post(stream, content=envelope(0, prover.records[1])), 409,
                       "envelope seq 0", "only the last envelope can be resent")
    self.assertLen(self.record_ids(prover.proof_id), 3)
    # An envelope under a used seq is told apart by the head of the stream's entry: before,
    # each one read and decoded the whole acknowledgement (a 200,000-step envelope's is
    # 33 MB: 0.2-0.5 s of the write lock for a 42-byte request).
    store = Store.open(self.database_url or f"sqlite:///{self.server.data / 'dvbench.db'}")
    self.addCleanup(store.engine.dispose)
    with store.engine.connect() as conn:
      seq, head = store.stream_position(conn, prover.proof_id, "fake")
    self.assertEqual((seq, len(head)), (2, store_custody.STREAM_HEAD))
    self.assertStartsWith(head, '{"envelope": "')
    # An entry an older server wrote (its acknowledgement first) is read whole.
    older = encode_record({"client_id": "older", "seq": 0, "kind": "records", "records": []})
    with store.engine.begin() as conn:
      store.advance_stream(conn, prover.proof_id, "older", 0, json.dumps(
          {"ack": {"stored": 0}, "envelope": blake3.blake3(older).hexdigest()}))
    self.assertEqual(self.http.post(stream, content=older).json(),
                     {"stored": 0, "duplicate": True})

  def test_numeric_query_parameters_are_bounded_before_the_database(self):
    prover = self.prover("bounds")
    prover.run(steps=2)
    records, metrics = (f"/api/v1/proofs/{prover.proof_id}/{what}" for what in
                        ("records", "metrics"))
    top = 2**31 - 1  # the largest value of an INTEGER column
    cases = [(f"{records}?limit={'9' * 5000}", "limit", [1, 1000]),
             (f"{records}?limit=%C2%B2", "limit", [1, 1000]),  # a superscript two
             (f"{records}?limit=0", "limit", [1, 1000]),
             (f"{records}?limit=-1", "limit", [1, 1000]),
             (f"{records}?limit=1_0", "limit", [1, 1000]),
             (f"{records}?limit=1001", "limit", [1, 1000]),
             (f"{records}?after=99999999999999999999", "after", None),
             (f"{records}?after=%D9%A1", "after", None),  # an Arabic-Indic one
             (f"{metrics}?start=99999999999999999999", "start", [0, top]),
             (f"{metrics}?start={top + 1}", "start", [0, top]),
             (f"{metrics}?start=+1", "start", [0, top]),
             (f"{metrics}?start={'1' * 5000}", "start", [0, top])]
    for url, name, bounds in cases:
      response = self.http.get(url)
      self.assertRefused(response, 400, name)
      self.assertEqual(response.json()["parameter"], name, url)
      if bounds is not None:
        self.assertEqual(response.json()["range"], bounds, url)
        self.assertIn(f"from {bounds[0]} to {bounds[1]}", response.json()["error"])
      self.assertLess(len(response.text), 300)  # the value is described, never echoed whole
    self.assertEqual(self.http.get(f"{records}?after={top}").json(), [])  # the bounds hold
    self.assertEqual(self.http.get(f"{metrics}?start={top}").json()["steps"], [])
    self.assertLen(self.http.get(f"{records}?limit=1").json(), 1)

  def test_a_huge_envelope_never_holds_up_another_owners_acknowledgements(self):
    bob = FakeProver(self.server.url, self.server.token("bob"), "bob/huge").start()
    raws = []
    for _ in range(_HUGE_RECORDS):  # chained step records, written without sending them
      raws.append(bob.step_record())
      bob.last_id, bob.state, bob.steps = record_id(raws[-1]), bob._post(False), bob.steps + 1
    huge = threading.Thread(target=lambda: acks.append(bob.send(*raws)))
    acks, bobs_stored = [], []  # bob's records stored as each of alice's steps was acknowledged
    alice = self.prover("small-owner")
    store = Store.open(self.database_url or f"sqlite:///{self.server.data / 'dvbench.db'}")
    huge.start()
    while huge.is_alive():
      alice.step()
      bobs_stored.append(len(store.record_ids(bob.proof_id)))
    huge.join()
    self.assertEqual(acks[0].status_code, 200, acks[0].text)
    self.assertEqual(acks[0].json()["stored"], _HUGE_RECORDS)
    self.assertEqual(store.record_ids(bob.proof_id), [record_id(r) for r in bob.records])
    # Ordered, not timed: alice's steps were stored between the slices of bob's envelope.
    # Storing it whole in one transaction shows none of them part stored, and keeping the
    # ingestion's turn until it is whole at most one (a step taken before it went on).
    part_stored = [n for n in bobs_stored if 0 < n < _HUGE_RECORDS]
    self.assertGreater(len(part_stored), 1, bobs_stored)

  def test_concurrent_puts_of_one_blob(self):
    prover = self.prover("one-blob")
    data = os.urandom(1 << 20)
    name = blake3.blake3(data).hexdigest()
    path = f"/api/v1/proofs/{prover.proof_id}/blobs/{name}"
    results = together(4, lambda _: self.http.put(path, content=data))  # 4 slots a token
    self.assertEqual({r.status_code for r in results}, {201}, [r.text for r in results])
    self.assertEqual(self.http.get(path).content, data)
    blobs = self.server.data / "blobs"
    self.assertEqual((blobs / name).read_bytes(), data)
    self.assertEqual([p.name for p in blobs.iterdir() if p.name.startswith(".")], [])


  def test_non_finite_and_huge_check_errors_are_stored_and_listed(self):
    prover = self.prover("inf-errors")
    store = Store.open(self.database_url or f"sqlite:///{self.server.data / 'dvbench.db'}")
    with store.engine.begin() as conn:
      store.enqueue_job(conn, "proof", prover.proof_id)
    job = store.claim_job("replay", 60)  # what a worker stores for a diverged replay:
    rows = [{"step": 0, "kind": kind, "mode": "exact", "status": "failed",
             "max_abs_error": math.inf, "max_rel_error": math.nan, "max_ulp_error": 2**64 - 1}
            for kind in ("update", "state")]
    self.assertTrue(store.complete_proof_job(job["id"], "replay", prover.proof_id, "invalid",
                                             "diverged", rows, receipt=("invalid", 1)))
    response = self.http.get(f"/api/v1/proofs/{prover.proof_id}/checks")
    self.assertEqual(response.status_code, 200, response.text)
    self.assertEqual([(c["max_abs_error"], c["max_rel_error"], c["max_ulp_error"])
                      for c in response.json()], [("inf", "inf", str(2**63 - 1))] * 2)

class PostgresDatabaseTest(postgres.OnPostgres, DatabaseCases, HostileTestCase):
  pass


class TransportCases:
  """Decoding, bodies, slow and unknown clients (the database does not matter here)."""

  def test_cbor_tags_shared_references_and_depth_are_refused(self):
    prover = self.prover("cbor")
    stream = f"/api/v1/proofs/{prover.proof_id}/stream"
    shared = cbor2.dumps(cbor2.CBORTag(28, [cbor2.CBORTag(29, 0)] * 4))
    bodies = {
        b"\xd8\x23\x63a+b": "CBOR tags are not accepted",  # tag 35: a regular expression
        b"\xd9\x01\x05\x82\x00\x01": "CBOR tags are not accepted",  # tag 261: a network
        shared: "CBOR tags are not accepted",  # shared references
        b"\x81" * 100 + b"\x00": "nested deeper than",
        b"\x9f\x00\xff": "indefinite lengths",
        b"\x5b" + (2**63).to_bytes(8, "big"): "the limit is",
    }
    for body, fragment in bodies.items():
      self.assertRefused(self.http.post(stream, content=body), 400, fragment)
    tagged = {"type": "check", "step": 0, "kind": "probe",
              "probes": cbor2.CBORTag(261, [0, b""]), "prev": prover.last_id}
    self.assertRefused(prover.send(cbor2.dumps(tagged, canonical=True)), 400,
                       "record 0 of the envelope", "CBOR tags")

  def test_decoding_never_holds_up_other_requests(self):
    prover = self.prover("wide")
    wide = b"\x9a" + (1 << 20).to_bytes(4, "big") + b"\x00" * (1 << 20)  # 2**20 + 1 items
    stream = f"/api/v1/proofs/{prover.proof_id}/stream"
    answers = []
    posts = threading.Thread(target=lambda: answers.extend(together(2, lambda _: self.http.post(
        stream, content=wide, timeout=60))))
    posts.start()
    latencies = []
    while not latencies or posts.is_alive():  # one at least, however fast the posts were
      start = time.monotonic()
      self.assertEqual(httpx.get(f"{self.server.url}/api/v1/health", timeout=2).status_code, 200)
      latencies.append(time.monotonic() - start)
    posts.join()
    for answer in answers:
      self.assertRefused(answer, 400, "more than 1048576 items")
    self.assertLess(max(latencies), 1.0, latencies)

  def test_no_or_unknown_token_is_refused_before_the_body_is_read(self):
    prover = self.prover("tokens")
    for auth, size in (("", 60 << 20), ("Authorization: Bearer not-a-token\r\n", 1000)):
      head = (f"POST /api/v1/proofs/{prover.proof_id}/stream HTTP/1.1\r\nHost: x\r\n{auth}"
              f"Content-Length: {size}")
      start = time.monotonic()
      status, answer = raw_request(self.server.port, head)  # the body never comes
      self.assertEqual(status, 401, answer)
      self.assertLess(time.monotonic() - start, 1.0)
    big = f"Authorization: Bearer {self.token}\r\nContent-Length: {5 << 20}"
    status, answer = raw_request(self.server.port, f"PUT /api/v1/proofs/{prover.proof_id}/blobs/"
                                 f"{'0' * 64} HTTP/1.1\r\nHost: x\r\n{big}")
    self.assertEqual(status, 413, answer)
    self.assertIn(b"exceeds the limit", answer)

  def test_a_body_growing_past_the_limit_while_streaming(self):
    prover = self.prover("chunked-body")

    def parts():
      for _ in range(5):
        yield b"\x00" * (1 << 20)
    response = self.http.put(f"/api/v1/proofs/{prover.proof_id}/blobs/{'0' * 64}",
                             content=parts())
    self.assertRefused(response, 413, "exceeds the limit")

  def test_a_corrupted_chunk_is_refused_and_mended_by_its_resend(self):
    prover = self.prover("chunks")
    raw = prover.step_record()
    half = len(raw) // 2

    def chunk(seq: int, index: int, data: bytes) -> httpx.Response:
      envelope = {"client_id": "c", "seq": seq, "kind": "chunk", "record_id": record_id(raw),
                  "index": index, "count": 2, "data": data}
      return self.http.post(f"/api/v1/proofs/{prover.proof_id}/stream",
                            content=encode_record(envelope))
    self.assertEqual(chunk(0, 0, b"x" * half).status_code, 200)  # corrupted on the way
    self.assertRefused(chunk(1, 1, raw[half:]), 400, "do not hash to record_id; its chunks "
                       "were dropped: send every chunk of the record again")
    # Attack: resending the last chunk alone made the server read, join and hash every
    # chunk again (0.8-3.3 s a 94-byte request with 240 MB held); the refused record's
    # chunks are gone, so it is one chunk of two, stored.
    self.assertEqual(chunk(1, 1, raw[half:]).json(), {"chunk": 1, "of": 2, "seq": 1})
    self.assertEqual(chunk(2, 0, raw[:half]).json()["stored"], 1)  # the resend completes it
    self.assertEqual(self.record_ids(prover.proof_id)[1], record_id(raw).hex())
    # A record that hashes to its id and is refused by the chain rules goes the same way.
    stray = encode_record({**cbor2.loads(prover.step_record()), "prev": b"\x07" * 32})
    envelope = lambda seq, index, data: encode_record({  # pylint: disable=g-long-lambda
        "client_id": "c", "seq": seq, "kind": "chunk", "record_id": record_id(stray),
        "index": index, "count": 2, "data": data})
    post = lambda body: self.http.post(f"/api/v1/proofs/{prover.proof_id}/stream", content=body)  # pylint: disable=unnecessary-lambda-assignment
    half = len(stray) // 2
    self.assertEqual(post(envelope(3, 0, stray[:half])).status_code, 200)
    self.assertRefused(post(envelope(4, 1, stray[half:])), 409, "chains to 0707")
    self.assertEqual(post(envelope(4, 1, stray[half:])).json(), {"chunk": 1, "of": 2, "seq": 4})

  def test_a_chunked_record_is_decoded_outside_the_write_lock(self):
    # A 1 MiB record of a million empty arrays costs about 0.7 s to decode. Sent in chunks,
    # it was joined, decoded and checked inside the transaction that stored its last
    # chunk: every other write (heartbeats, slots) waited for it, up to a 500 "database
    # is locked" after 30 s of them. Ordered, not timed: bob's heartbeats are answered
    # while mallory's joined chunks wait, stored, for their decode.
    mallory, bob = self.prover("slow-chunks"), self.prover("heartbeats")
    raw = b"\x9a" + ((1 << 20) - 1).to_bytes(4, "big") + b"\x80" * ((1 << 20) - 1)
    half = len(raw) // 2

    def chunk(seq: int, index: int) -> httpx.Response:
      return self.http.post(f"/api/v1/proofs/{mallory.proof_id}/stream", timeout=60,
                            content=encode_record({
                                "client_id": "c", "seq": seq, "kind": "chunk",
                                "record_id": record_id(raw), "index": index, "count": 2,
                                "data": raw[half:] if index else raw[:half]}))
    self.assertEqual(chunk(0, 0).status_code, 200)
    store = Store.open(self.database_url or f"sqlite:///{self.server.data / 'dvbench.db'}")
    self.addCleanup(store.engine.dispose)
    answers = []
    last = threading.Thread(target=lambda: answers.append(chunk(1, 1)))
    last.start()
    held_while_answered = []
    while last.is_alive():
      response = self.http.post(f"/api/v1/proofs/{bob.proof_id}/alive")
      self.assertEqual(response.status_code, 204, response.text)
      held_while_answered.append(_chunks_held(store, mallory.proof_id))
    last.join()
    self.assertRefused(answers[0], 400, "record 0")
    self.assertIn(2, held_while_answered)
    self.assertEqual(_chunks_held(store, mallory.proof_id), 0)  # dropped once refused

  def test_a_last_chunk_sent_twice_at_once_is_acknowledged_twice(self):
    # A client that times out resends its last chunk while the first copy waits its turn.
    # Before, the copy that came second found the chunks gone (the first had stored the
    # record) and answered 409 "send every chunk of it again", failing the upload. The
    # server's own ingestion, in this process, on its database, interleaved turn by turn.
    prover = self.prover("chunk-resent")
    raw = prover.step_record()
    half = len(raw) // 2
    store = Store.open(self.database_url or f"sqlite:///{self.server.data / 'dvbench.db'}")
    self.addCleanup(store.engine.dispose)
    ingestion = Ingestion(store, ed25519.Ed25519PrivateKey.generate())

    def job(seq: int, index: int):
      return ingestion.begin(store.proof(prover.proof_id), encode_record({
          "client_id": "r", "seq": seq, "kind": "chunk", "record_id": record_id(raw),
          "index": index, "count": 2, "data": raw[half:] if index else raw[:half]}))
    self.assertEqual(job(0, 0).step(), {"chunk": 0, "of": 2, "seq": 0})
    first, again = job(1, 1), job(1, 1)
    self.assertIsNone(first.step())  # the last chunk stored, the record not yet
    self.assertIsNone(again.step())  # stored again
    stored = first.step()
    self.assertEqual(stored["stored"], 1)
    self.assertEqual(again.step(), {**stored, "duplicate": True})
    self.assertEqual(self.record_ids(prover.proof_id)[-1], record_id(raw).hex())

  def test_unknown_tokens_are_locked_out_per_address_and_valid_tokens_never(self):
    def post(token: str) -> tuple[int, bytes]:
      body = b'{"name": "alice/behind-a-proxy"}'
      return raw_request(self.server.port, "POST /api/v1/experiments HTTP/1.1\r\nHost: x\r\n"
                         f"Content-Length: {len(body)}\r\nContent-Type: application/json\r\n"
                         f"Authorization: Bearer {token}", body, source="127.0.0.2")
    self.assertEqual([post("wrong")[0] for _ in range(5)], [401] * 5)
    status, answer = post("wrong")
    self.assertEqual(status, 429, answer)
    self.assertIn(b"retry-after: ", answer.lower())
    self.assertIn(b"too many unknown tokens", answer)
    status, answer = post(self.token)  # a valid token from the same address (a shared proxy)
    self.assertIn(status, (200, 201), answer)
    self.assertEqual(post("wrong")[0], 429)  # and the lockout holds on
    self.assertEqual(self.http.get("/api/v1/health").status_code, 200)

  def test_trickling_uploads_are_cut_off_and_never_block_reads_or_other_owners(self):
    prover = self.prover("trickle")
    answers, answered = [], threading.Condition()

    def trickle(n):
      # Each spells alice's token another way (spaces the server strips): one token still.
      head = (f"PUT /api/v1/proofs/{prover.proof_id}/blobs/{'0' * 64} HTTP/1.1\r\nHost: x\r\n"
              f"Authorization: Bearer{' ' * (1 + n)}{self.token}{' ' * (n % 2)}\r\n"
              "Content-Length: 1000\r\n\r\n")
      with socket.create_connection(("127.0.0.1", self.server.port), timeout=10) as s:
        s.sendall(head.encode())
        answer = b""
        try:
          for _ in range(20):  # a byte every half second: under the idle timeout
            s.sendall(b"x")
            s.settimeout(0.5)
            try:
              answer = s.recv(4096)
              if answer.endswith(b"\r\n\r\n"):  # the body follows on its own
                answer += s.recv(4096)
              break
            except socket.timeout:
              continue
        except OSError as e:
          answer = repr(e).encode()
        with answered:
          answers.append(answer)
          answered.notify_all()
    bob = FakeProver(self.server.url, self.server.token("bob"), "bob/trickled").start()
    threads = [threading.Thread(target=trickle, args=(n,)) for n in range(8)]
    start = time.monotonic()
    for t in threads:
      t.start()
    with answered:  # four are refused at once: the other four hold alice's upload slots
      self.assertTrue(answered.wait_for(lambda: len(answers) >= 4, timeout=5), answers)
    # Another owner's upload is served at once meanwhile: one token holds at most 4 slots.
    bob.upload(b"not held up")
    self.assertEqual(httpx.get(f"{self.server.url}/api/v1/health", timeout=30).status_code, 200)
    with answered:  # both served while every trickled upload of alice's held its slot
      self.assertLen(answers, 4, answers)
    # Alice's client, told to retry, gets through once a slot is free.
    http = dvbench.client.Http(self.server.url, self.token, retry_seconds=10)
    data = b"retried"
    http.put_blob(prover.proof_id, blake3.blake3(data).hexdigest(), lambda: data)
    while any(t.is_alive() for t in threads):
      self.assertEqual(httpx.get(f"{self.server.url}/api/v1/health", timeout=30).status_code, 200)
      time.sleep(0.1)  # pacing of the health probes, not a synchronization
    # Cut at the body deadline: uncut, a trickle sends its 20 bytes for 10 s.
    self.assertLess(time.monotonic() - start, 9.0)
    statuses = sorted(int(a.split(b" ", 2)[1]) for a in answers if a.startswith(b"HTTP"))
    self.assertEqual(statuses, [408] * 4 + [503] * 4, answers)
    refused = next(a for a in answers if a.startswith(b"HTTP/1.1 503"))
    self.assertIn(b"--max-uploads-per-token", refused)

  def test_a_write_with_several_authorization_headers_is_refused(self):
    # The guard and the service would each read one of them: the upload slots could be
    # counted against one token while another is served.
    prover = self.prover("two-tokens")
    response = httpx.put(
        f"{self.server.url}/api/v1/proofs/{prover.proof_id}/blobs/{'0' * 64}", content=b"x",
        headers=[("Authorization", f"Bearer {self.token}"),
                 ("Authorization", f"Bearer {self.server.token('bob')}")], timeout=30)
    self.assertRefused(response, 401, "send one 'Authorization: Bearer <token>' header")

  def test_measurement_values_must_be_finite(self):
    self.http.post("/api/v1/experiments", json={"name": "alice/metrics"})
    fields = {"metric": "accuracy", "proof_id": "0" * 64, "checkpoint": bytes(32),
              "batches": [[bytes(32)]], "evaluate": bytes(32), "params_blobs": [],
              "outputs": [[]], "aggregate": None, "sample": 1.0}
    for value in (math.nan, math.inf, -math.inf):
      response = self.http.post("/api/v1/experiments/alice/metrics/measurements",
                                content=cbor2.dumps({**fields, "value": value}))
      self.assertRefused(response, 400, "measurement.value: a finite float")


class SqliteTest(DatabaseCases, TransportCases, HostileTestCase):
  pass


if __name__ == "__main__":
  absltest.main()
