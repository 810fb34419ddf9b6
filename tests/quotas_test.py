"""Quotas per owner against a real `dvbench serve` process (SQLite and PostgreSQL).

Each quota is reached by one owner and refused with a typed answer naming the quota, the
usage, the limit and the flag that raises it, while other owners are not affected;
``dvbench usage`` shows what an owner holds.
"""

import os
import subprocess
import sys

import cbor2
import httpx
import sqlalchemy as sa
from absl.testing import absltest

from dvbench.server import quotas
from dvbench.server.db import Store
from dvbench.server.schema import streams
from dvbench.server.local import LocalServer
from tests import postgres
from tests.fake_prover import FakeProver
from zkdv import records

_STORED_BYTES = 100_000
_QUOTAS = ("--quota-stored-gb", str(_STORED_BYTES / (1 << 30)), "--max-slots-per-hour", "4",
           "--quota-open-proofs", "2", "--quota-experiments", "2",
           "--min-update-check-probability", "0")


class QuotaCases:
  """One server per class; ``database_url`` None is SQLite. Each test is its own owner."""

  database_url: str | None = None

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=0, database_url=cls.database_url,
                             extra_args=_QUOTAS).start()

  @classmethod
  def tearDownClass(cls):
    cls.server.stop()
    super().tearDownClass()

  def client(self, owner: str) -> httpx.Client:
    http = httpx.Client(base_url=self.server.url, timeout=30,
                        headers={"Authorization": f"Bearer {self.server.token(owner)}"})
    self.addCleanup(http.close)
    return http

  def assertQuota(self, response: httpx.Response, status: int, quota: str, used: int,
                  limit: int, flag: str):
    self.assertEqual(response.status_code, status, response.text)
    answer = response.json()
    self.assertEqual((answer["quota"], answer["used"], answer["limit"], answer["flag"]),
                     (quota, used, limit, flag))
    self.assertIn(f"dvbench serve {flag}", answer["error"])

  def test_experiments(self):
    http = self.client("erin")
    for name in ("a", "b"):
      self.assertEqual(http.post("/api/v1/experiments", json={"name": f"erin/{name}"})
                       .status_code, 200)
    self.assertQuota(http.post("/api/v1/experiments", json={"name": "erin/c"}), 403,
                     "experiments", 2, 2, "--quota-experiments")
    self.assertQuota(http.post("/api/v1/experiments/erin/d/slots"), 403,  # made on the fly
                     "experiments", 2, 2, "--quota-experiments")
    self.assertEqual(http.post("/api/v1/experiments/erin/a/slots").status_code, 201)
    other = self.client("otto")  # another owner is not affected
    self.assertEqual(other.post("/api/v1/experiments", json={"name": "otto/a"}).status_code,
                     200)

  def test_slots_per_hour(self):
    http = self.client("sam")
    for _ in range(4):
      self.assertEqual(http.post("/api/v1/experiments/sam/run/slots").status_code, 201)
    self.assertQuota(http.post("/api/v1/experiments/sam/run/slots"), 429,
                     "slots_per_hour", 4, 4, "--max-slots-per-hour")

  def test_open_proofs(self):
    token = self.server.token("olga")
    provers = [FakeProver(self.server.url, token, "olga/run").start(f"p{i}") for i in range(2)]
    third = FakeProver(self.server.url, token, "olga/run")
    self.assertQuota(third.post_root(third.root(third.slot(), "p2")), 403, "open_proofs", 2, 2,
                     "--quota-open-proofs")
    provers[0].run(steps=1)
    self.assertEqual(provers[0].finish().json()["state"], "closed")
    self.assertEqual(third.post_root(third.root(third.slot(), "p2")).status_code, 201)

  def test_a_measurement_record_is_stored_bytes(self):
    # A measurement's record is stored whole; it was charged to no quota, so one owner
    # stored 1.2 GB of padded measurements against a 20 MB quota.
    http = self.client("mona")
    self.assertEqual(http.post("/api/v1/experiments", json={"name": "mona/m"}).status_code, 200)
    n = 1500
    record = {"type": "measurement", "metric": "accuracy", "value": 0.5, "proof_id": "0" * 64,
              "checkpoint": bytes(32), "batches": [[bytes(32), bytes(32)]] * n,
              "evaluate": bytes(32), "params_blobs": [], "outputs": [[bytes(32)]] * n,
              "aggregate": None, "params_layout": [], "batch_layout": [],
              "output_layout": [], "sample": 0.25}
    body = cbor2.dumps(record, canonical=True)
    self.assertGreater(len(body), _STORED_BYTES)
    self.assertQuota(http.post("/api/v1/experiments/mona/m/measurements", content=body), 403,
                     "stored_bytes", 0, _STORED_BYTES, "--quota-stored-gb")

  def test_stored_bytes_and_usage(self):
    prover = FakeProver(self.server.url, self.server.token("dora"), "dora/run").start()
    data = os.urandom(_STORED_BYTES // 2)
    prover.upload(data)
    more = os.urandom(_STORED_BYTES // 2)
    response = prover.http.put(f"/api/v1/proofs/{prover.proof_id}/blobs/"
                               f"{FakeProver.digest_hex(more)}", content=more)
    self.assertEqual(response.status_code, 403, response.text)
    self.assertEqual((response.json()["quota"], response.json()["flag"]),
                     ("stored_bytes", "--quota-stored-gb"))
    self.assertGreaterEqual(response.json()["used"], len(data))
    prover.upload(data)  # the resend of a held blob stores nothing: served
    rows = self.usage("dora")
    self.assertGreaterEqual(int(rows["stored_bytes"][0]), len(data))
    self.assertEqual(rows["stored_bytes"][1], str(_STORED_BYTES))
    self.assertEqual(rows["open_proofs"], ["1", "2"])
    self.assertEqual(rows["slots_per_hour"], ["1", "4"])

  def test_benchmark_blobs_are_stored_bytes(self):
    # Attack: blobs put under benchmark names never registered were charged to no quota:
    # 80 MiB stored against 10 MB, and usage said 0.
    http = self.client("bea")
    data = os.urandom(_STORED_BYTES // 2)
    url = lambda name, blob: f"/api/v1/benchmarks/bea/{name}/blobs/{FakeProver.digest_hex(blob)}"  # pylint: disable=unnecessary-lambda-assignment
    self.assertEqual(http.put(url("never-registered", data), content=data).status_code, 201)
    self.assertEqual(http.put(url("another", data), content=data).status_code, 201)  # counted once
    more = os.urandom(_STORED_BYTES // 2 + 1)
    response = http.put(url("a-third", more), content=more)
    self.assertEqual(response.status_code, 403, response.text)
    self.assertEqual((response.json()["quota"], response.json()["flag"]),
                     ("stored_bytes", "--quota-stored-gb"))
    self.assertEqual(http.get(url("a-third", more)).status_code, 404)  # nothing kept
    self.assertEqual(http.put(url("never-registered", data), content=data).status_code, 201)
    self.assertEqual(int(self.usage("bea")["stored_bytes"][0]), len(data))

  def test_a_discarded_proofs_blobs_stay_stored_bytes(self):
    # Attack: blobs up to the quota, DELETE the proof (it has no step), again: the blobs
    # stayed on disk and the quota forgot them (40 MiB stored against 10 MB in 5 rounds).
    prover = FakeProver(self.server.url, self.server.token("dan"), "dan/run").start()
    data = os.urandom(_STORED_BYTES // 3)
    prover.upload(data)
    self.assertEqual(prover.http.delete(f"/api/v1/proofs/{prover.proof_id}").status_code, 204)
    self.assertEqual(int(self.usage("dan")["stored_bytes"][0]), len(data))  # its record gone
    again = FakeProver(self.server.url, self.server.token("dan"), "dan/run").start()
    again.upload(data)  # the same blob: counted once (beside the new proof's root record)
    self.assertBetween(int(self.usage("dan")["stored_bytes"][0]), len(data), 2 * len(data) - 1)

  def test_probed_row_digests_are_stored_bytes(self):
    # Attack: a probe record of many tiny rows (4 bytes of record each) made the server
    # store a digest row per row, uncounted: the quota charges each opened row as its
    # record is stored, before the worker indexes the digests at verification.
    prover = FakeProver(self.server.url, self.server.token("pia"), "pia/run").start()
    prover.run(steps=1, skip_answer=(0,))
    rows = [i.to_bytes(3, "little") for i in range(2000)]
    response = prover.send(prover.chain({"type": "check", "step": 0, "kind": "probe",
                                         "batch_roots": [bytes(32)],
                                         "probes": [[0, 0, len(rows), b"".join(rows),
                                                     []]]}))
    self.assertEqual(response.status_code, 200, response.text)
    record_bytes = len(prover.records[-1])
    self.assertLess(record_bytes, _STORED_BYTES // 10)
    shown = self.usage("pia")  # what the quota keeper sums (quotas.usage)
    self.assertGreaterEqual(int(shown["stored_bytes"][0]),
                            len(rows) * quotas.OPENED_ROW_BYTES)  # over the quota now
    store = Store.open(self.database_url or f"sqlite:///{self.server.data / 'dvbench.db'}")
    self.assertEqual(store.proof(prover.proof_id)["probed_rows"], len(rows))
    self.assertEqual(store.probe_count(prover.proof_id), 0)  # indexed by the worker, later

  def test_stream_acknowledgements_are_stored_bytes(self):
    # Attack: the same records resent under ever new client ids are taken as duplicates,
    # and each stream keeps its last acknowledgement (every challenge of the envelope):
    # the database grew by those acknowledgements while the quota counted none of them.
    prover = FakeProver(self.server.url, self.server.token("sid"), "sid/run").start()
    prover.run(steps=8)
    envelope = {"seq": 0, "kind": "records", "records": list(prover.records[1:])}
    before = int(self.usage("sid")["stored_bytes"][0])
    for n in range(20):
      response = prover.http.post(f"/api/v1/proofs/{prover.proof_id}/stream",
                                  content=cbor2.dumps({**envelope, "client_id": f"again-{n}"}))
      self.assertEqual(response.status_code, 200, response.text)
    store = Store.open(self.database_url or f"sqlite:///{self.server.data / 'dvbench.db'}")
    with store.engine.connect() as conn:
      kept = conn.execute(sa.select(sa.func.sum(sa.func.length(streams.c.last_ack))).where(
          (streams.c.proof_id == prover.proof_id)
          & streams.c.client_id.startswith("again-"))).scalar()
    self.assertGreater(kept, 0)
    self.assertEqual(int(self.usage("sid")["stored_bytes"][0]), before + kept)

  def test_a_row_count_its_bytes_do_not_carry_is_not_charged(self):
    # Attack: an entry says how many rows its bytes join. Counted as said, 4,096 entries
    # of 2^20 rows of no bytes (40 KB of record) would charge 2^32 rows, past a 32-bit
    # column, and another owner's rows could not be told from them.
    prover = FakeProver(self.server.url, self.server.token("pim"), "pim/run").start()
    prover.run(steps=1, skip_answer=(0,))
    entries = [[0, 0, records.MAX_RECORD_ITEMS, b"", []]] * 4096
    response = prover.send(prover.chain({"type": "check", "step": 0, "kind": "probe",
                                         "batch_roots": [bytes(32)], "probes": entries}))
    self.assertEqual(response.status_code, 200, response.text)
    store = Store.open(self.database_url or f"sqlite:///{self.server.data / 'dvbench.db'}")
    self.assertEqual(store.proof(prover.proof_id)["probed_rows"], 0)
    self.assertLess(int(self.usage("pim")["stored_bytes"][0]), _STORED_BYTES)  # its bytes

  def usage(self, owner: str) -> dict[str, list[str]]:
    """``dvbench usage OWNER``: per quota, [used, limit]."""
    args = ["usage", owner, "--data", str(self.server.data)]
    if self.database_url:
      args += ["--database-url", self.database_url]
    shown = subprocess.run([sys.executable, "-m", "dvbench.cli", *args], check=True,
                           capture_output=True, text=True).stdout
    return {line.split()[0]: line.split()[1:3] for line in shown.splitlines()[1:]}

  def test_a_blob_for_a_proof_that_takes_no_more_records_is_refused(self):
    prover = FakeProver(self.server.url, self.server.token("cleo"), "cleo/run").start()
    held = prover.upload(b"uploaded while receiving")
    prover.run(steps=1)
    self.assertEqual(prover.finish().json()["state"], "closed")
    late = b"uploaded after the close"
    response = prover.http.put(f"/api/v1/proofs/{prover.proof_id}/blobs/"
                               f"{FakeProver.digest_hex(late)}", content=late)
    self.assertEqual(response.status_code, 409, response.text)
    self.assertIn("takes no more records, nor blobs", response.json()["error"])
    self.assertEqual(prover.http.head(f"/api/v1/proofs/{prover.proof_id}/blobs/"
                                      f"{FakeProver.digest_hex(late)}").status_code, 404)
    self.assertEqual(prover.upload(b"uploaded while receiving"), held)  # a resend: served


  def test_blobs_posted_together_are_counted_and_refused_as_put_ones_are(self):
    prover = FakeProver(self.server.url, self.server.token("fern"), "fern/run").start()
    url = f"/api/v1/proofs/{prover.proof_id}/blobs"

    def post(*blobs: bytes) -> httpx.Response:
      return prover.http.post(url, content=cbor2.dumps(
          [[bytes.fromhex(FakeProver.digest_hex(b)), b] for b in blobs]))

    first = os.urandom(_STORED_BYTES // 4)
    self.assertEqual(post(first).status_code, 201)
    response = post(os.urandom(_STORED_BYTES // 2), os.urandom(_STORED_BYTES // 2))
    self.assertEqual(response.status_code, 403, response.text)
    self.assertEqual((response.json()["quota"], response.json()["flag"]),
                     ("stored_bytes", "--quota-stored-gb"))
    self.assertEqual(prover.http.get(url).json(), [FakeProver.digest_hex(first)])  # none kept
    self.assertEqual(post(first).status_code, 201)  # a resend of a held blob: served
    prover.run(steps=1)
    self.assertEqual(prover.finish().json()["state"], "closed")
    response = post(b"posted after the close")
    self.assertEqual(response.status_code, 409, response.text)
    self.assertIn("takes no more records, nor blobs", response.json()["error"])


class SqliteQuotaTest(QuotaCases, absltest.TestCase):
  pass


class PostgresQuotaTest(postgres.OnPostgres, QuotaCases, absltest.TestCase):
  pass


if __name__ == "__main__":
  absltest.main()
