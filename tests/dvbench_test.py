"""DVBench end to end against a real `dvbench serve` process on loopback."""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from unittest import mock

import cbor2
import httpx
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import dvbench
import zkdv
from dvbench import contamination
from dvbench import transport
from dvbench import upload
from dvbench.server import schema
from dvbench.server import worker
from dvbench.server.db import Store
from dvbench.server.local import LocalServer as Server
from tests import testing
from tests import tutorial_steps
from zkdv import records
from zkdv import transcript


def local_transcript(steps: int, update_p: float = 1.0, probe_ratio: float = 0.0,
                     **config) -> pathlib.Path:
  proof = testing.new_proof("local", update_p=update_p, **config)
  proof.start(probe_ratio=probe_ratio)
  state = testing.classifier_state(proof)
  train_step = proof.jit(testing.classifier_step, donate_argnums=0)
  for i in range(steps):
    state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + (i % 2))
  return proof.finish()


def local_ids(path) -> list[str]:
  return [r.record_id.hex() for r in transcript.read_transcript(path).records]


class DVBenchTestCase(absltest.TestCase):
  server: Server
  server_args: tuple[str, ...] = ()  # e.g. the operator's minimum check probability

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = Server(workers=1, extra_args=cls.server_args).start()
    cls.token = cls.server.token("your-name")
    cls.env = mock.patch.dict(os.environ, {"DVBENCH_TOKEN": cls.token})
    cls.env.start()

  @classmethod
  def tearDownClass(cls):
    cls.env.stop()
    cls.server.stop()
    super().tearDownClass()

  @classmethod
  def benchmark_clients(cls) -> None:
    """Clients of the server: ``submitter`` (your-name), ``owner`` (alice, who registers
    benchmarks) and ``mallory``."""
    url = cls.server.url
    cls.submitter = dvbench.Client(url)  # your-name, through DVBENCH_TOKEN
    cls.owner = dvbench.Client(url, token=cls.server.token("alice"))
    cls.mallory = dvbench.Client(url, token=cls.server.token("mallory"))

  def store(self) -> Store:
    return Store.open(f"sqlite:///{self.server.data / 'dvbench.db'}")

  def server_ids(self, client, proof_id) -> list[str]:
    return client.http.request("GET", f"/api/v1/proofs/{proof_id}/records").json()


class TutorialAgainstServerTest(DVBenchTestCase):
  # The operator requires every step checked: the verbatim tutorial (which asks for
  # p = 0.01) is then challenged, answered and replayed at every step, and probed (a ratio
  # of 1/32 probes every step; the tutorial's 0.01 a third of them, in 2 % of runs none).
  server_args = ("--min-update-check-probability", "1.0", "--min-probe-ratio", "0.03125")

  def _run_tutorial(self, code: str, state: str = "verified steps",
                    shortfalls: tuple[str, ...] = ("start unattested",)) -> dict:
    workdir = tempfile.mkdtemp()
    cwd = os.getcwd()
    os.chdir(workdir)
    self.addCleanup(os.chdir, cwd)
    namespace = {"API_URL": self.server.url}
    exec(compile(code, "tutorial", "exec"), namespace)  # pylint: disable=exec-used
    proof = namespace["proof"]
    self.assertTrue((pathlib.Path(workdir) / "jax-checkpoint.msgpack").exists())
    self.assertFalse(proof.path.exists())  # temporary proof storage is released
    proof.finish()  # safe to call again
    status = dvbench.Client(self.server.url).wait_for_verdict(proof.proof_id, 120)
    # Every server-chosen check replayed bit for bit, and the state says what else holds:
    # the verbatim tutorial's params come from model.init, which nothing attests.
    self.assertEqual(status["state"], state, repr(status))
    self.assertEqual(status["shortfalls"], list(shortfalls), repr(status))
    self.assertTrue(status["label"].startswith(
        " — ".join([state, ", ".join(shortfalls)]) if shortfalls else state), repr(status))
    self.assertEqual(status["steps"], 10)
    check_records = sum(kind == "check" for kind in self._record_kinds(proof.proof_id))
    self.assertEqual(status["checks"], check_records)
    self.assertEqual(status["checks_verified"], check_records)
    return status

  def _record_kinds(self, proof_id):
    import sqlalchemy as sa  # pylint: disable=g-import-not-at-top
    from dvbench.server import db  # pylint: disable=g-import-not-at-top
    with self.store().engine.connect() as conn:
      return [r[0] for r in conn.execute(sa.select(db.records.c.kind).where(
          db.records.c.proof_id == proof_id).order_by(db.records.c.position))]

  def test_tutorial_verbatim_reaches_verified(self):
    self._run_tutorial(tutorial_steps.STEPS_2_TO_6)

  def test_tutorial_with_an_attested_start_is_verified_with_every_claim(self):
    one_line = ("params = model.init(\n", "params = proof.init(model.init,\n")
    self.assertIn(one_line[0], tutorial_steps.STEPS_2_TO_6)
    status = self._run_tutorial(tutorial_steps.STEPS_2_TO_6.replace(*one_line),
                                state="verified", shortfalls=())
    self.assertTrue(status["label"].startswith("verified: "), repr(status))

  def test_tutorial_with_every_step_checked_is_replayed_by_the_server(self):
    code = tutorial_steps.STEPS_2_TO_6.replace("update_check_probability=0.01",
                                               "update_check_probability=1.0")
    status = self._run_tutorial(code)
    # Steps are committed in segments (format 3): a segment's update check replays each of
    # its steps, from its first pre-state to its last post-state. Every segment is checked,
    # and the segments end at the last step.
    data = httpx.get(f"{self.server.url}/api/v1/proofs/{status['id']}/transcript").content
    records = cbor2.loads(b"\x9f" + data + b"\xff")  # CBOR items, read as one open array
    ends = [r["index"] for r in records
            if r["type"] == "step" and "post_state" in r]
    self.assertEqual(ends[-1], 9)
    checks = httpx.get(f"{self.server.url}/api/v1/proofs/{status['id']}/checks").json()
    updates = [c for c in checks if c["kind"] == "update"]  # besides the default data probes
    self.assertEqual([c["step"] for c in updates], ends)
    self.assertEqual({c["kind"] for c in checks}, {"update", "probe"})
    self.assertTrue(all(c["status"] == "verified" and c["mode"] == "exact" for c in updates))
    page = httpx.get(self.server.url + "/").text
    self.assertIn(status["id"], page)
    self.assertIn("your-name/jax-train-state", page)


class PostgresServerTest(TutorialAgainstServerTest):
  """The same tutorial run, with the server on PostgreSQL."""

  @classmethod
  def setUpClass(cls):
    from tests import postgres  # pylint: disable=g-import-not-at-top
    cls.database_url = postgres.shared_cluster().new_database()
    cls.server = Server(workers=1, database_url=cls.database_url,
                        extra_args=cls.server_args).start()
    cls.token = cls.server.token("your-name")
    cls.env = mock.patch.dict(os.environ, {"DVBENCH_TOKEN": cls.token})
    cls.env.start()

  def store(self) -> Store:
    return Store.open(self.database_url)


class HandOffTest(DVBenchTestCase):
  """A live writer hands each record to the uploader (``Uploader.written``)."""

  def rewrite(self, local: pathlib.Path, folder: pathlib.Path, uploader, handed_from: int):
    """Writes ``local``'s records again into ``folder``, handing them to ``uploader`` from
    record ``handed_from`` on."""
    shutil.copytree(local / transcript.BLOBS_DIR, folder / transcript.BLOBS_DIR)
    writer = transcript.TranscriptWriter(folder)
    for n, parsed in enumerate(transcript.read_transcript(local).records):
      if n == handed_from:
        writer.on_append = uploader.written
      writer.append({k: v for k, v in parsed.record.items() if k != "prev"})
    writer.close()

  def test_records_handed_over_are_sent_without_reading_the_file_back(self):
    local = local_transcript(3, probe_ratio=0.5)
    folder = pathlib.Path(tempfile.mkdtemp()) / "t"
    client = dvbench.Client(self.server.url)
    uploader = upload.Uploader(client.http, "your-name/handed", folder)
    self.rewrite(local, folder, uploader, handed_from=0)
    (folder / transcript.RECORDS_FILE).rename(folder.parent / "elsewhere")  # unreadable now
    uploader.start()
    uploader.finish(timeout=120)
    self.assertEqual(self.server_ids(client, uploader.proof_id), local_ids(local))

  def test_records_before_the_hand_off_and_past_its_bound_are_read_back_in_order(self):
    local = local_transcript(3, probe_ratio=0.5)
    parsed = transcript.read_transcript(local).records
    folder = pathlib.Path(tempfile.mkdtemp()) / "t"
    client = dvbench.Client(self.server.url)
    uploader = upload.Uploader(client.http, "your-name/handed-in-part", folder)
    uploader.start()  # reads the file while records are written and handed over
    bound = 2 * max(len(r.raw) for r in parsed)
    with mock.patch.object(upload, "HANDED_BYTES", bound):  # full at times: read back
      self.rewrite(local, folder, uploader, handed_from=len(parsed) // 3)
    uploader.finish(timeout=120)
    self.assertEqual(self.server_ids(client, uploader.proof_id), local_ids(local))
    self.assertEqual(local_ids(folder), local_ids(local))


class TamperedUploadTest(DVBenchTestCase, parameterized.TestCase):

  def test_one_record_byte_is_refused_at_the_next_record(self):
    path = pathlib.Path(tempfile.mkdtemp()) / "t"
    shutil.copytree(local_transcript(4), path)
    records = (path / transcript.RECORDS_FILE).read_bytes()
    parsed = transcript.read_transcript(path).records
    position, step = next((n, r) for n, r in enumerate(parsed)
                          if r.record["type"] == "step" and r.record["index"] == 2)
    at = step.offset + step.raw.find(step.record["batch"]) + 5
    tampered = bytearray(records)
    tampered[at] ^= 0x10
    (path / transcript.RECORDS_FILE).write_bytes(bytes(tampered))
    client = dvbench.Client(self.server.url)
    honest = client.experiment("your-name/honest").upload(local_transcript(3))
    with self.assertRaisesRegex(dvbench.errors.ApiError,
                                f"409.*chains to.*not the last stored record "
                                rf"\(position {position},"):
      client.experiment("your-name/tampered").upload(path)
    proof_id = client.experiment("your-name/tampered").proofs()[0]["id"]
    # Custody: an envelope is stored whole or not at all; what the server kept is a prefix
    # of the transcript that ends before the break.
    stored = self.server_ids(client, proof_id)
    self.assertEqual(stored, local_ids(path)[:len(stored)])
    self.assertLessEqual(len(stored), position + 1)
    self.assertEqual(client.wait_for_verdict(honest, 120)["state"], "self-audited")

  @parameterized.named_parameters(
      ("one_request_per_blob", "pre_state_blobs", 0),  # PUT .../blobs/DIGEST
      ("small_blobs_together", "pre_state_blobs", transport.SMALL_BLOB_BYTES))  # POST
  def test_one_blob_byte_ends_invalid_naming_the_blob(self, field, small_blob_bytes):
    path = pathlib.Path(tempfile.mkdtemp()) / "t"
    shutil.copytree(local_transcript(2, probe_ratio=0.5), path)
    check = next(r for r in testing.records_of(path, "check") if field in r)
    name = check[field][-1]
    blob = transcript.blob_path(path, name)
    data = bytearray(blob.read_bytes())
    data[0] ^= 1
    blob.write_bytes(bytes(data))
    client = dvbench.Client(self.server.url)
    experiment = client.experiment(f"your-name/tampered-blob-{field}-{small_blob_bytes}")
    with mock.patch.object(transport, "SMALL_BLOB_BYTES", small_blob_bytes):
      with self.assertRaisesRegex(dvbench.errors.ApiError, "does not hash to its name"):
        experiment.upload(path)
    proofs = experiment.proofs()
    self.assertLen(proofs, 1)
    self.assertEqual(proofs[0]["state"], "invalid")
    self.assertIn(name.hex(), proofs[0]["failure"])

  def test_a_probed_row_in_chunks_is_taken_whole(self):
    local = testing.wide_rows_transcript()
    client = dvbench.Client(self.server.url)
    proof_id = client.experiment("your-name/wide-rows").upload(local)
    self.assertEqual(client.wait_for_verdict(proof_id, 120)["state"], "self-audited")
    rows = {row for r in testing.records_of(local, "check")
            for entry in records.probe_entries(r) for row in records.probed_rows(entry)}
    self.assertNotEmpty(rows)
    self.assertEqual({len(row) for row in rows}, {(1 << 20) + 4})
    # The server's records hold the row whole (Benchmark.probed_rows reads them back).
    self.assertEqual(set(client.benchmark("your-name/any").probed_rows(proof_id)), rows)

  def test_the_worker_indexes_what_probes_opened_once_the_proof_is_verified(self):
    local = local_transcript(3, probe_ratio=0.5)
    opened, _ = contamination.probed_digests(testing.records_of(local, "check"))
    self.assertNotEmpty(opened)
    client = dvbench.Client(self.server.url)
    proof_id = client.experiment("your-name/indexed").upload(local)
    self.assertEqual(client.wait_for_verdict(proof_id, 120)["state"], "self-audited")
    store = self.store()
    self.assertEqual(store.probed_rows(proof_id), opened)
    self.assertEqual(store.proof(proof_id)["probed_rows"], sum(
        len(records.probed_rows(entry)) for r in testing.records_of(local, "check")
        for entry in records.probe_entries(r)))
    page = client.http.request("GET", f"/proofs/{proof_id}").text
    self.assertIn(f"<td id='probed-rows'>{len(opened)}</td>", page)

  def test_indexing_a_proof_takes_many_short_transactions(self):
    # Attack: a proof of many tiny probed rows made indexing one transaction as long as
    # the whole proof, holding the server's write lock (every other user's writes) meanwhile.
    local = local_transcript(4, probe_ratio=1.0)
    checks = testing.records_of(local, "check")
    opened, _ = contamination.probed_digests(checks)
    most_a_record = max(len(contamination.probed_digests([r])[0]) for r in checks)
    client = dvbench.Client(self.server.url)
    proof_id = client.experiment("your-name/indexed-in-parts").upload(local)
    client.wait_for_verdict(proof_id, 120)
    store, sizes = self.store(), []
    add_probed = store.add_probed

    def counted(proof, rows, examples):
      sizes.append(len(rows) + len(examples))
      add_probed(proof, rows, examples)

    with store.engine.begin() as conn:
      conn.execute(schema.probes.delete().where(schema.probes.c.proof_id == proof_id))
    with mock.patch.object(worker, "INDEX_DIGESTS", most_a_record), \
         mock.patch.object(store, "add_probed", counted):
      worker.index_probes(store, proof_id)
    self.assertEqual(store.probed_rows(proof_id), opened)
    self.assertGreater(len(sizes), 2)
    self.assertLessEqual(max(sizes), 2 * most_a_record)

  def test_small_blobs_travel_together_and_are_named_by_their_hash(self):
    experiment = dvbench.Client(self.server.url).experiment("your-name/probed")
    requests = []
    original = experiment.client.http.request

    def counting(method, path, **kwargs):
      requests.append((method, path.rsplit("/", 1)[-1]))
      return original(method, path, **kwargs)

    with mock.patch.object(experiment.client.http, "request", counting):
      proof_id = experiment.upload(local := local_transcript(3, probe_ratio=0.5))
    small = {d for r in testing.records_of(local) for d in transport.blob_refs(r)
             if transcript.blob_path(local, bytes.fromhex(d)).stat().st_size
             <= transport.SMALL_BLOB_BYTES}
    self.assertGreaterEqual(len(small), 2)
    held = set(httpx.get(f"{self.server.url}/api/v1/proofs/{proof_id}/blobs").json())
    self.assertTrue(small <= held, small - held)
    self.assertFalse({("PUT", d) for d in small} & set(requests))  # no request of its own
    blob_posts = sum(m == "POST" and p == "blobs" for m, p in requests)
    envelopes = sum(m == "POST" and p == "stream" for m, p in requests)
    self.assertBetween(blob_posts, 1, envelopes - 1)  # at most one per envelope of records


class BadRequestsTest(DVBenchTestCase):

  def setUp(self):
    super().setUp()
    self.client = dvbench.Client(self.server.url)
    self.experiment = self.client.experiment("your-name/bad-requests")
    self.local = transcript.read_transcript(local_transcript(1)).records
    root = self.local[0].raw
    self.proof_id = self.client.http.request(
        "POST", "/api/v1/experiments/your-name/bad-requests/proofs", content=root).json()["id"]
    self.stream = f"{self.server.url}/api/v1/proofs/{self.proof_id}/stream"
    self.auth = {"Authorization": f"Bearer {self.token}"}

  def post(self, body, headers=None, url=None):
    return httpx.post(url or self.stream, content=body,
                      headers=self.auth if headers is None else headers)

  def records(self):
    return len(self.server_ids(self.client, self.proof_id))

  def test_unknown_proof_and_missing_or_foreign_tokens(self):
    envelope = transport.encode({"client_id": "c", "seq": 0, "kind": "records", "records": []})
    self.assertEqual(self.post(envelope, url=self.stream.replace(self.proof_id, "0" * 64)
                               ).status_code, 404)
    self.assertEqual(self.post(envelope, headers={}).status_code, 401)
    self.assertEqual(self.post(envelope, headers={"Authorization": "Bearer nope"}).status_code,
                     401)
    foreign = {"Authorization": f"Bearer {self.server.token('mallory')}"}
    response = self.post(envelope, headers=foreign)
    self.assertEqual(response.status_code, 403)
    self.assertIn("mallory", response.json()["error"])
    response = httpx.post(f"{self.server.url}/api/v1/experiments", json={"name": "your-name/x"},
                          headers=foreign)
    self.assertEqual(response.status_code, 403)
    self.assertEqual(httpx.get(f"{self.server.url}/api/v1/experiments/your-name/x").status_code,
                     404)

  def test_malformed_envelopes_and_sequence_numbers_write_nothing(self):
    before = self.records()
    for body in (b"\xff\x00 not cbor", cbor2.dumps([1, 2]),
                 transport.encode({"client_id": "", "seq": 0, "kind": "records"}),
                 transport.encode({"client_id": "c", "seq": -1, "kind": "records"}),
                 transport.encode({"client_id": "c", "seq": 0, "kind": "upload-everything"}),
                 transport.encode({"client_id": "c", "seq": 0, "kind": "records",
                                   "records": [cbor2.dumps({"type": "step"}), b"\xff"]})):
      response = self.post(body)
      self.assertEqual(response.status_code, 400, body)
      self.assertIn("error", response.json())
    self.assertEqual(self.records(), before)  # the valid first record was not kept
    response = self.post(transport.encode({"client_id": "c", "seq": 3, "kind": "records",
                                           "records": []}))
    self.assertEqual(response.status_code, 409)
    self.assertIn("expected 0", response.json()["error"])
    good = transport.encode({"client_id": "c", "seq": 0, "kind": "records",
                             "records": [self.local[1].raw]})
    self.assertEqual(self.post(good).json()["stored"], 1)
    self.assertTrue(self.post(good).json()["duplicate"])  # resent: acknowledged, not doubled
    self.assertEqual(self.records(), before + 1)
    response = self.post(transport.encode({"client_id": "c", "seq": 1, "kind": "close",
                                           "final_record_id": bytes(32), "record_count": 9}))
    self.assertEqual(response.status_code, 409)
    self.assertIn("cannot close", response.json()["error"])

  def test_malformed_blob_batches_store_nothing(self):
    url = f"{self.server.url}/api/v1/proofs/{self.proof_id}/blobs"
    for body, why in ((b"\xc1\x00", "tags are not accepted"),
                      (cbor2.dumps([b"x" * 10]), "pairs"),
                      (cbor2.dumps([[b"short", b"x"]]), "pairs"),
                      (cbor2.dumps({"a": b"x"}), "pairs")):
      response = self.post(body, url=url)
      self.assertEqual(response.status_code, 400, body)
      self.assertIn(why, response.json()["error"])
    self.assertEqual(httpx.get(url).json(), [])
    foreign = {"Authorization": f"Bearer {self.server.token('mallory')}"}
    self.assertEqual(self.post(cbor2.dumps([]), url=url, headers=foreign).status_code, 403)

  def test_oversized_body(self):
    small = Server(workers=0, max_body_mb=1).start()
    self.addCleanup(small.stop)
    token = small.token("your-name")
    response = httpx.put(f"{small.url}/api/v1/proofs/{'a' * 64}/blobs/{'b' * 64}",
                         content=b"x" * (2 << 20), headers={"Authorization": f"Bearer {token}"})
    self.assertEqual(response.status_code, 413)
    self.assertIn("exceeds the limit", response.json()["error"])


class ClientTest(DVBenchTestCase):

  def test_records_sent_in_chunks_are_reassembled(self):
    path = local_transcript(3)
    client = dvbench.Client(self.server.url)
    proof_id = client.experiment("your-name/chunked").upload(path, chunk_bytes=48)
    self.assertEqual(self.server_ids(client, proof_id), local_ids(path))
    self.assertEqual(client.wait_for_verdict(proof_id, 120)["state"], "self-audited")

  def test_envelopes_fit_a_server_that_takes_small_bodies(self):
    # 12 probe records of 8 opened rows (128 KiB each, under the chunk threshold): 1.5 MiB
    # of records, which one envelope of up to BATCH_BYTES (4 MiB) would carry, and a
    # server run with --max-body-mb 1 refuses (413). The uploader keeps to half its limit.
    proof = testing.new_proof("local-wide", update_p=0.0)
    proof.start(probe_ratio=0.1)
    state = testing.classifier_state(proof)
    train_step = proof.jit(testing.classifier_step, donate_argnums=0)
    batch = np.tile(testing.TUTORIAL_BATCH, (1 << 14, 1))  # 65,536 rows: 80 Merkle rows
    for i in range(12):
      state = train_step(state, jnp.asarray(batch) + (i % 2))
    path = proof.finish()
    probes = [r for r in transcript.read_transcript(path).records
              if r.record.get("kind") == "probe"]
    self.assertLen(probes, 12)
    self.assertGreater(min(len(r.raw) for r in probes), 100_000)
    self.assertLess(max(len(r.raw) for r in probes), transport.CHUNK_BYTES)
    small = Server(workers=0, max_body_mb=1).start()
    self.addCleanup(small.stop)
    client = dvbench.Client(small.url, token=small.token("your-name"))
    sizes = []
    request = client.http.request

    def observed(method, path, **kwargs):
      if path.endswith("/stream"):
        sizes.append(len(kwargs["content"]))
      return request(method, path, **kwargs)

    with mock.patch.object(client.http, "request", observed):
      proof_id = client.experiment("your-name/wide").upload(path)
    self.assertEqual(self.server_ids(client, proof_id), local_ids(path))
    self.assertGreater(sum(sizes), 1 << 20)
    self.assertLessEqual(max(sizes), (1 << 19) + 4096)  # records, and the envelope's fields

  def test_the_servers_body_limit_only_ever_shrinks_envelopes(self):
    for sent, kept in [(1 << 20, 1 << 19), (True, 1 << 22), ("1048576", 1 << 22),
                       (0, 1 << 22), (-1, 1 << 22), (1.0e6, 1 << 22), (None, 1 << 22),
                       (1 << 40, 1 << 22), (1, 1)]:
      uploader = upload.Uploader(None, "your-name/fit", pathlib.Path("."))
      uploader.continue_proof("a" * 64, 0, 1, None, sent)
      self.assertEqual(uploader.batch_bytes, kept, sent)
    asked = upload.Uploader(None, "your-name/fit", pathlib.Path("."), batch_bytes=1000)
    asked.continue_proof("a" * 64, 0, 1, None, 1 << 20)
    self.assertEqual(asked.batch_bytes, 1000)

  def test_login_saves_the_token_and_url_for_client(self):
    config = pathlib.Path(tempfile.mkdtemp())
    env = {**os.environ, "DVBENCH_CONFIG_DIR": str(config)}
    env.pop("DVBENCH_TOKEN", None)
    subprocess.run([sys.executable, "-m", "dvbench.cli", "login", "--token", self.token,
                    "--url", self.server.url], env=env, check=True, capture_output=True)
    self.assertEqual(oct((config / "token").stat().st_mode & 0o777), "0o600")
    code = ("import dvbench; c = dvbench.Client(); "
            "print(c.experiment('your-name/login').name, c.url)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    self.assertEqual(out, ["your-name/login", self.server.url])

  def test_missing_url_or_token_is_a_clear_error(self):
    with mock.patch.dict(os.environ, {"DVBENCH_CONFIG_DIR": tempfile.mkdtemp()}):
      os.environ.pop("DVBENCH_URL", None)
      with self.assertRaisesRegex(dvbench.errors.ConfigurationError, "DVBENCH_URL"):
        dvbench.Client()
      os.environ.pop("DVBENCH_TOKEN", None)
      with self.assertRaisesRegex(dvbench.errors.ConfigurationError, "dvbench token create"):
        dvbench.Client(self.server.url).experiment("your-name/x")
    with self.assertRaisesRegex(dvbench.errors.UploadError,
                                "cannot reach a DVBench server at http://127.0.0.1:9"):
      dvbench.client.Http("http://127.0.0.1:9", None, retry_seconds=0.3).request("GET", "/")

  def test_worker_time_limit_ends_could_not_verify(self):
    server = Server(workers=0).start()
    self.addCleanup(server.stop)
    client = dvbench.Client(server.url, token=server.token("your-name"))
    proof_id = client.experiment("your-name/slow").upload(local_transcript(1))
    subprocess.run([sys.executable, "-m", "dvbench.cli", "worker", "--data", str(server.data),
                    "--once", "--time-limit", "1"], check=True, capture_output=True)
    status = client.proof_status(proof_id)
    self.assertEqual(status["state"], "unverifiable")  # no finding about the proof
    self.assertRegex(status["failure"], r"^could not verify: .*time limit of 1 s")
    self.assertEqual(client.wait_for_verdict(proof_id, 1)["state"], "unverifiable")  # settled


class CrashRecoveryTest(DVBenchTestCase):

  def test_killed_client_restarted_sends_exactly_the_transcript(self):
    folder = pathlib.Path(tempfile.mkdtemp()) / "transcript"
    script = textwrap.dedent(f"""
        import time, jax.numpy as jnp, zkdv, dvbench
        from tests import testing
        client = dvbench.Client({self.server.url!r})
        experiment = client.experiment("your-name/killed-client")
        proof = experiment.proof(config=zkdv.ZKDVConfig(
            sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.2),
            output_dir={str(folder)!r}))
        proof.start()
        state = testing.classifier_state(proof)
        step = proof.jit(testing.classifier_step)
        for _ in range(100000):
          state = step(state, jnp.asarray(testing.TUTORIAL_BATCH))
          time.sleep(0.005)
        """)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=str(pathlib.Path(
        __file__).resolve().parent.parent), env={**os.environ, "DVBENCH_TOKEN": self.token})
    client = dvbench.Client(self.server.url)
    experiment = client.experiment("your-name/killed-client")
    proof_id = testing.wait_until(lambda: experiment.proofs() and experiment.proofs()[0]["id"])
    testing.wait_until(lambda: len(self.server_ids(client, proof_id)) >= 30)
    child.send_signal(signal.SIGKILL)
    child.wait()
    self.assertEqual(experiment.upload(folder), proof_id)
    self.assertEqual(self.server_ids(client, proof_id), local_ids(folder))
    self.assertEqual(experiment.upload(folder), proof_id)  # and again: nothing doubles
    self.assertEqual(self.server_ids(client, proof_id), local_ids(folder))

  def test_a_run_the_server_took_for_crashed_reopens_its_proof_and_goes_on(self):
    # A run silent past --crash-after (a suspended machine, a long stall) found its proof
    # crashed: before, its next envelope was refused (409) and the run ended in an error.
    client = dvbench.Client(self.server.url)
    proof = client.experiment("your-name/paused").proof(config=zkdv.ZKDVConfig(
        sampling_policy=zkdv.SamplingPolicy(update_check_probability=1.0)))  # no draw skips
    proof.start()
    state = testing.classifier_state(proof)
    step = proof.jit(testing.classifier_step)
    for _ in range(4):
      state = step(state, jnp.asarray(testing.TUTORIAL_BATCH))
    proof.wait_for_commitments()
    crashed, _ = self.store().settle_silent_proofs(silent_seconds=0.0)  # the sweep, now
    self.assertIn(proof.proof_id, crashed)
    with self.assertLogs("dvbench", "WARNING") as logs:
      for _ in range(4):
        state = step(state, jnp.asarray(testing.TUTORIAL_BATCH))
      proof.finish()
    self.assertIn(f"proof {proof.proof_id} was crashed", "\n".join(logs.output))
    verdict = client.wait_for_verdict(proof.proof_id, 240)
    self.assertEqual((verdict["state"], verdict["steps"]), ("verified steps", 8), verdict)

  def test_server_restarted_mid_upload_loses_nothing(self):
    server = Server(workers=1).start()
    self.addCleanup(server.stop)
    token = server.token("your-name")
    # 30 one-step segments at p = 0.5: some update check is drawn (all but 2**-30 of runs).
    path = local_transcript(30, update_p=0.5, segment_length=1)
    client = dvbench.Client(server.url, token=token)
    experiment = client.experiment("your-name/server-restart")
    held, release, failed = threading.Event(), threading.Event(), threading.Event()
    sent = []
    send = client.http._client.request  # pylint: disable=protected-access

    def gated(method, url, **kwargs):  # holds the 10th envelope until the server is dead
      if str(url).endswith("/stream"):
        sent.append(url)
        if len(sent) == 10:
          held.set()
          release.wait(60)
      try:
        return send(method, url, **kwargs)
      except httpx.TransportError:
        failed.set()
        raise

    result = {}
    with mock.patch.object(client.http._client, "request", gated):  # pylint: disable=protected-access
      uploading = threading.Thread(target=lambda: result.setdefault(
          "id", experiment.upload(path, batch_bytes=200)))
      uploading.start()
      self.assertTrue(held.wait(60))
      server.kill()
      proof_id = result.get("id") or Store.open(
          f"sqlite:///{server.data / 'dvbench.db'}").list_proofs()[0]["id"]
      at_kill = len(Store.open(f"sqlite:///{server.data / 'dvbench.db'}").record_ids(proof_id))
      self.assertLess(at_kill, len(local_ids(path)))  # it really is mid-upload
      release.set()
      self.assertTrue(failed.wait(60))  # the held envelope met the dead server: it retries
      server.start()
      uploading.join(120)
    self.assertEqual(result.get("id"), proof_id)
    self.assertEqual(self.server_ids(client, proof_id), local_ids(path))
    verdict = client.wait_for_verdict(proof_id, 120)
    self.assertEqual(verdict["state"], "self-audited", str(verdict))

  def test_killed_worker_job_completes_on_another(self):
    server = Server(workers=0).start()
    self.addCleanup(server.stop)
    token = server.token("your-name")
    client = dvbench.Client(server.url, token=token)
    proof_id = client.experiment("your-name/worker-kill").upload(local_transcript(3))
    command = [sys.executable, "-m", "dvbench.cli", "worker", "--data", str(server.data),
               "--lease-seconds", "2"]
    first = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    testing.wait_until(lambda: client.proof_status(proof_id)["state"] == "verifying", every=0.01)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    self.assertEqual(client.proof_status(proof_id)["state"], "verifying")
    second = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    self.addCleanup(lambda: (os.killpg(second.pid, signal.SIGTERM), second.wait()))
    self.assertEqual(client.wait_for_verdict(proof_id, 120)["state"], "self-audited")
    store = Store.open(f"sqlite:///{server.data / 'dvbench.db'}")
    self.assertEqual(store.job("proof", proof_id)["attempts"], 2)


if __name__ == "__main__":
  absltest.main()
