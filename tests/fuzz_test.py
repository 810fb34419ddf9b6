"""A bounded fuzzer against a real `dvbench serve` process.

For about ``FUZZ_SECONDS`` it sends random bytes, random CBOR (tags, bignums, NaN, deep
nesting, long strings), structure-aware envelopes, chunks, records and roots with one field
mutated, random JSON bodies and odd paths, interleaved with an honest prover's records.
It asserts: no answer is 5xx, every request answers within its timeout, /health answers
within 1 s throughout, the server's memory stays flat, and the server holds exactly the
records it acknowledged, in order, once each; a used ``seq`` takes no other envelope and a
numeric query parameter out of range is a 400 naming it; past its slot quota an owner gets
429 naming the quota. Every draw comes from one seeded
``random.Random``: the seed is printed, ``FUZZ_SEED`` sets it (default ``DEFAULT_SEED``) and
replays a run's requests in the same order (how many fit in ``FUZZ_SECONDS`` varies).
"""

import json
import math
import os
import random
import threading
import time

import cbor2
import httpx
from absl.testing import absltest

from dvbench.server.local import LocalServer
from tests.fake_prover import FakeProver, digest
from zkdv.transcript import encode_record, record_id

FUZZ_SECONDS = float(os.environ.get("FUZZ_SECONDS", 15))
DEFAULT_SEED = 28061
SLOTS_PER_HOUR = 8
REQUEST_TIMEOUT = 10.0
MAX_RSS_GROWTH = 64 << 20


def rss_bytes(pid: int) -> int:
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  raise AssertionError(f"no VmRSS for process {pid}")


class Values:
  """Random values a hostile prover could put anywhere."""

  def __init__(self, rng: random.Random):
    self.rng = rng

  def scalar(self):
    r = self.rng
    return r.choice([
        lambda: r.randint(-2**64 + 1, 2**64 - 1), lambda: r.choice([0, 1, -1, 2**63, 2**64 - 1]),
        lambda: 2**r.randint(64, 300),  # a bignum (a CBOR tag)
        lambda: r.choice([math.nan, math.inf, -math.inf, 1e308, -0.0, r.random()]),
        lambda: r.randbytes(r.choice([0, 31, 32, 33, 1000])),
        lambda: "x" * r.choice([0, 1, 20, 21, 64, 65, 400, 401, 70000]),
        lambda: r.choice([None, True, False]), lambda: cbor2.CBORTag(r.randint(0, 300), 0),
        lambda: cbor2.CBORTag(261, [0, r.randbytes(16)]),  # an IPv6 network
    ])()

  def value(self, depth: int = 0):
    r = self.rng
    kind = r.random()
    if depth > 3 or kind < 0.6:
      return self.scalar()
    if kind < 0.75:
      return [self.value(depth + 1) for _ in range(r.randint(0, 5))]
    if kind < 0.9:
      return {self.rng.choice(["type", "index", "step", "kind", "probes", "x", "prev"]):
              self.value(depth + 1) for _ in range(r.randint(0, 4))}
    return [[[[[[[0]]]]]]] * r.randint(1, 3) if r.random() < 0.5 else [0] * r.randint(0, 2000)

  def encoded(self) -> bytes:
    r = self.rng
    if r.random() < 0.2:
      return r.randbytes(r.randint(0, 4096))
    if r.random() < 0.1:  # deep or wide, written by hand
      return r.choice([b"\x81" * 5000 + b"\x00", b"\x9a\xff\xff\xff\xff",
                       b"\xbb" + b"\xff" * 8, b"\x5b" + b"\x7f" * 8])
    try:
      return cbor2.dumps(self.value())
    except (ValueError, TypeError, OverflowError):
      return b"\xf6"


INNER_STEP = object()


class Chain:
  """The honest prover's view: what the server acknowledged, in order."""

  def __init__(self, prover: FakeProver):
    self.prover = prover
    self.accepted = [record_id(prover.records[0])]
    self.seq = 0

  def step_fields(self) -> dict:
    p = self.prover
    batch = digest(b"batch %d" % p.steps)
    return {"type": "step", "index": p.steps, "program": 0, "pre_state": p.state,
            "batch": batch, "post_state": digest(p.state + batch)}

  def took(self, raw: bytes, ack: dict, failures: list[str]) -> None:
    """Notes a record the server acknowledged as stored (not as a duplicate)."""
    if ack.get("stored"):
      record = cbor2.loads(raw)
      self.accepted.append(record_id(raw))
      self.prover.last_id = record_id(raw)
      if record["type"] == "step":
        self.prover.steps += 1
        post = record.get("post_state", INNER_STEP)
        if isinstance(post, bytes) and len(post) == 32:
          self.prover.state = post
        elif post is not INNER_STEP:  # a segment's inner step commits no state (format 3)
          failures.append(f"a step whose post_state is {post!r:.60} was stored.")


class FuzzTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=0, max_body_mb=8,
                             extra_args=("--max-slots-per-hour", str(SLOTS_PER_HOUR))).start()
    cls.token = cls.server.token("fuzz")

  @classmethod
  def tearDownClass(cls):
    cls.server.stop()
    super().tearDownClass()

  def setUp(self):
    super().setUp()
    self.seed = int(os.environ.get("FUZZ_SEED", DEFAULT_SEED))
    print(f"FUZZ_SEED={self.seed}")
    self.rng = random.Random(self.seed)
    self.values = Values(self.rng)
    auth = {"Authorization": f"Bearer {self.token}"}
    self.http = httpx.Client(base_url=self.server.url, headers=auth, timeout=REQUEST_TIMEOUT)
    # Unknown tokens come from their own address, which the server rate limits on its own.
    self.stranger = httpx.Client(base_url=self.server.url, timeout=REQUEST_TIMEOUT,
                                 transport=httpx.HTTPTransport(local_address="127.0.0.3"))
    self.prover = FakeProver(self.server.url, self.token, "fuzz/run").start()
    self.chain = Chain(self.prover)
    # A wrong blob makes its proof invalid: random blobs go to a proof of their own.
    self.scratch = FakeProver(self.server.url, self.token, "fuzz/scratch").start()
    self.stream = f"/api/v1/proofs/{self.prover.proof_id}/stream"
    self.failures: list[str] = []
    self.sent = 0
    self.last_envelope: tuple[bytes, dict] | None = None  # the last one taken, and its ack
    self.slots = 2  # taken by the two provers

  def tearDown(self):
    self.http.close()
    self.stranger.close()
    super().tearDown()

  # -- sending ----------------------------------------------------------------------------

  def request(self, what: str, method: str, path: str, client=None, **kwargs) -> httpx.Response:
    self.sent += 1
    try:
      response = (client or self.http).request(method, path, **kwargs)
    except httpx.TimeoutException:
      self.failures.append(f"{what}: no answer within {REQUEST_TIMEOUT} s")
      raise
    if response.status_code >= 500:
      self.failures.append(f"{what}: HTTP {response.status_code} {response.text[:200]}")
    return response

  def envelope(self, what: str, body: dict, mutate: bool = False) -> httpx.Response:
    """Posts a stream envelope at the next seq; the seq advances when it was taken."""
    body = {**body, "client_id": "fuzz", "seq": self.chain.seq}
    if mutate:
      self.mutate(body)
    try:
      data = encode_record(body)
    except (ValueError, TypeError, OverflowError):
      data = cbor2.dumps(body)
    response = self.request(what, "POST", self.stream, content=data)
    if response.status_code == 200 and not response.json().get("duplicate"):
      self.chain.seq += 1
      self.last_envelope = (data, response.json())
    return response

  def mutate(self, fields: dict) -> None:
    """Replaces, removes or adds one field."""
    name = self.rng.choice(sorted(fields) + ["extra"])
    if self.rng.random() < 0.2 and name in fields:
      del fields[name]
    else:
      fields[name] = self.values.value()

  # -- the cases ------------------------------------------------------------------------------

  def honest_step(self):
    raw = self.prover.chain(self.chain.step_fields())
    response = self.envelope("honest step", {"kind": "records", "records": [raw]})
    if response.status_code != 200:
      self.failures.append(f"honest step refused: {response.text[:200]}")
    else:
      self.chain.took(raw, response.json(), self.failures)

  def mutated_record(self):
    kind = self.rng.choice(["step", "check", "program", "init", "final", "other"])
    fields = {"step": self.chain.step_fields(),
              "check": {"type": "check", "step": max(self.prover.steps - 1, 0),
                        "kind": self.rng.choice(["update", "state", "probe", "start"]),
                        "probes": [[0, 0, 1, b"row", []]], "batch_roots": [bytes(32)]},
              "final": {"type": "final", "steps": self.prover.steps + 1, "status": "clean"},
              }.get(kind, {"type": kind})
    fields = {**fields, "prev": self.prover.last_id}
    self.mutate(fields)
    try:
      raw = encode_record(fields)
    except (ValueError, TypeError, OverflowError):
      raw = cbor2.dumps(fields)
    response = self.envelope(f"mutated {kind} record {fields!r:.200}",
                             {"kind": "records", "records": [raw]})
    if response.status_code == 200:
      self.chain.took(raw, response.json(), self.failures)

  def chunked(self):
    raw = self.prover.chain(self.chain.step_fields())
    rid, parts = record_id(raw), [raw[i:i + 40] for i in range(0, len(raw), 40)]
    mutate_at = self.rng.randrange(len(parts) + 1)  # len(parts): an honest chunked record
    for i, part in enumerate(parts):
      body = {"kind": "chunk", "record_id": rid, "index": i, "count": len(parts), "data": part}
      response = self.envelope(f"chunk {i}", body, mutate=i == mutate_at)
      if response.status_code != 200:
        return
      if "stored" in response.json():
        self.chain.took(raw, response.json(), self.failures)

  def mutated_envelope(self):
    body = self.rng.choice([
        {"kind": "records", "records": [self.values.encoded()]},
        {"kind": "chunk", "record_id": bytes(32), "index": 0, "count": 2, "data": b"x"},
        {"kind": "close", "final_record_id": bytes(32), "record_count": 3}])
    self.envelope(f"mutated envelope {body!r:.200}", body, mutate=True)

  def random_body(self):
    target = self.rng.choice([
        ("POST", self.stream), ("POST", "/api/v1/experiments/fuzz/run/proofs"),
        ("POST", "/api/v1/experiments/fuzz/run/measurements"),
        ("POST", f"/api/v1/measurements/{'0' * 64}/openings"),
        ("PUT", f"/api/v1/proofs/{self.scratch.proof_id}/blobs/{'a' * 64}"),
        ("PUT", "/api/v1/benchmarks/fuzz/bench"), ("POST", "/api/v1/benchmarks/fuzz/bench/submissions")])
    body = self.values.encoded()
    self.request(f"random body {body[:60]!r} to {target}", *target, content=body)

  def json_body(self):
    value = self.values.value()
    try:
      body = json.dumps(value, default=repr).encode()
    except (ValueError, TypeError):
      body = b"{"
    if self.rng.random() < 0.1:
      body = self.rng.choice([b"[" * 100000, b'{"name": ' * 50000, b"\xff\xfe", b"1e999999"])
    self.request(f"JSON {body[:100]!r}", "POST", "/api/v1/experiments", content=body)
    self.request("JSON name", "POST", "/api/v1/experiments",
                 json={"name": self.rng.choice(["a/b", "/", "fuzz/" + "x" * 200, "fuzz/ok",
                                                "fuzz/a/b", "fuzz/\u0000"])})

  def odd_path(self):
    ident = self.rng.choice(["0" * 64, "x" * 64, "%00", "a" * 1000, self.prover.proof_id])
    path = self.rng.choice(["/api/v1/proofs/{}", "/api/v1/proofs/{}/records",
                            "/api/v1/proofs/{}/checks", "/api/v1/proofs/{}/challenges",
                            "/api/v1/proofs/{}/transcript", "/api/v1/proofs/{}/blobs",
                            "/api/v1/measurements/{}", "/proofs/{}"])
    self.request(f"GET {path}", "GET", path.format(ident))

  def stranger_write(self):
    headers = self.rng.choice([{}, {"Authorization": "Bearer " + "x" * 50},
                               {"Authorization": "Basic abc"}])
    self.request("stranger", "POST", self.stream, client=self.stranger,
                 content=self.values.encoded(), headers=headers)

  def used_seq(self):
    """Another envelope under a used seq is refused; the last one's exact resend gets its
    acknowledgement again."""
    if self.last_envelope is None:
      return
    data, ack = self.last_envelope
    response = self.request("exact resend", "POST", self.stream, content=data)
    if response.status_code != 200 or response.json() != {**ack, "duplicate": True}:
      self.failures.append(f"exact resend of seq {ack['seq']}: {response.status_code} "
                           f"{response.text[:200]}, not its ack {ack}")
    seq = self.rng.randrange(self.chain.seq)
    other = {"client_id": "fuzz", "seq": seq, "kind": "records",
             "records": [self.prover.chain(self.chain.step_fields())]}
    response = self.request(f"records under used seq {seq}", "POST", self.stream,
                            content=encode_record(other))
    if response.status_code != 409 or f"seq {seq}" not in response.text:
      self.failures.append(f"an envelope under used seq {seq} got {response.status_code} "
                           f"{response.text[:200]}, not 409 naming the seq")

  def numeric_query(self):
    name, path, low, high = self.rng.choice([
        ("limit", f"/api/v1/proofs/{self.prover.proof_id}/records", 1, 1000),
        ("after", f"/api/v1/proofs/{self.prover.proof_id}/records", 0, 2**31 - 1),
        ("limit", "/api/v1/experiments", 1, 1000),
        ("start", f"/api/v1/proofs/{self.prover.proof_id}/metrics", 0, 2**31 - 1)])
    r = self.rng
    text = r.choice([lambda: "9" * r.choice([19, 20, 400, 5000]), lambda: str(r.randint(
        -2**70, 2**70)), lambda: str(r.choice([low - 1, low, high, high + 1])),
                     lambda: r.choice(["\u00b2", "\u0661", "+1", " 1", "1_0", "1e3", "0x10",
                                       "", "NaN", "-0"])])()
    response = self.request(f"GET {path}?{name}={text[:40]!r}", "GET", path,
                            params={name: text})
    in_range = (text.isascii() and text.isdigit() and len(text) <= len(str(high))
                and low <= int(text) <= high)
    if in_range != (response.status_code == 200) or (
        not in_range and (response.status_code != 400
                          or response.json().get("parameter") != name)):
      self.failures.append(f"{name}={text[:40]!r} on {path}: {response.status_code} "
                           f"{response.text[:200]}")

  def slot(self):
    """Slots within the quota are issued; past it, 429 names the quota and its flag."""
    response = self.request("slot", "POST", "/api/v1/experiments/fuzz/run/slots")
    self.slots += 1
    expected = 201 if self.slots <= SLOTS_PER_HOUR else 429
    if response.status_code != expected or (expected == 429 and (
        response.json().get("quota"), response.json().get("flag")) != (
            "slots_per_hour", "--max-slots-per-hour")):
      self.failures.append(f"slot {self.slots}: {response.status_code} {response.text[:200]}")

  # -- the run --------------------------------------------------------------------------------

  def test_fuzzed_requests(self):
    cases = [(self.honest_step, 3), (self.mutated_record, 6), (self.chunked, 1),
             (self.mutated_envelope, 3), (self.random_body, 3), (self.json_body, 1),
             (self.odd_path, 1), (self.stranger_write, 1), (self.used_seq, 1),
             (self.numeric_query, 2), (self.slot, 1)]
    functions, weights = zip(*cases)
    health_latencies, health_failures, stop = [], [], threading.Event()

    def watch_health():
      with httpx.Client(base_url=self.server.url, timeout=1.0) as client:
        while not stop.wait(0.2):
          start = time.monotonic()
          try:
            client.get("/api/v1/health").raise_for_status()
            health_latencies.append(time.monotonic() - start)
          except httpx.HTTPError as e:
            health_failures.append(repr(e))
    watcher = threading.Thread(target=watch_health)
    watcher.start()
    pid = self.server.process.pid
    try:
      deadline = time.monotonic() + FUZZ_SECONDS
      rss_start = None
      while time.monotonic() < deadline:
        if rss_start is None and self.sent > 100:  # after warm-up
          rss_start = rss_bytes(pid)
        self.rng.choices(functions, weights)[0]()
      rss_end = rss_bytes(pid)
    finally:
      stop.set()
      watcher.join()
    self.assertEqual(self.failures, [], f"replay with FUZZ_SEED={self.seed}")
    self.assertEqual(health_failures, [])
    self.assertLess(max(health_latencies), 1.0)
    self.assertLess(rss_end - rss_start, MAX_RSS_GROWTH)
    stored = self.http.get(f"/api/v1/proofs/{self.prover.proof_id}/records").json()
    self.assertEqual(stored, [i.hex() for i in self.chain.accepted])
    self.assertGreater(self.prover.steps, 10)
    print(f"{self.sent} requests, {len(stored)} records kept, RSS "
          f"{rss_start >> 20} -> {rss_end >> 20} MiB, health p_max "
          f"{max(health_latencies) * 1000:.0f} ms")


if __name__ == "__main__":
  absltest.main()
