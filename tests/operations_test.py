"""Operating DVBench: supervised workers, kill -9, fair queue, abandoned proofs, confinement.

Against real ``dvbench serve`` processes (SQLite and PostgreSQL where the database
decides), real worker and verifier processes, real kernels' namespaces and Landlock.
"""

import argparse
import concurrent.futures
import contextlib
import json
import os
import pathlib
import signal
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from unittest import mock

import cbor2
import httpx
from absl.testing import absltest
from absl.testing import parameterized

from starlette.testclient import TestClient

import dvbench
from dvbench import cli as dvbench_cli
from dvbench import resume
from dvbench.server import sandbox
from dvbench.server.app import create_app
from dvbench.server.blobs import BlobStore
from dvbench.server.service import Service
from dvbench.server import worker as worker_lib
from dvbench.server.db import Store
from dvbench.server.local import LocalServer
from dvbench.server import store_jobs
from dvbench.server.store_jobs import QueueFull
from dvbench.server.store_tokens import BadName
from dvbench.server.supervisor import Supervisor
from tests import testing
from tests.fake_prover import FakeProver
from tests import postgres
from zkdv import errors as zkdv_errors
from zkdv import receipt
from zkdv import transcript
from zkdv.transcript import record_id

def processes_mentioning(text: str) -> dict[int, str]:
  """pid -> command line of every process whose command line contains ``text``."""
  found = {}
  for entry in pathlib.Path("/proc").iterdir():
    if entry.name.isdigit() and int(entry.name) != os.getpid():
      try:
        cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
      except OSError:
        continue
      if text in cmdline:
        found[int(entry.name)] = cmdline
  return found


def worker_pid(worker_id: str) -> int:
  """The pid of the worker ``worker_id``: of the processes that mention it, the one whose
  parent does not (a verifier child it forked has the same command line)."""
  found = processes_mentioning(f"--worker-id {worker_id}")
  roots = []
  for pid in found:
    try:
      parent = int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:  # a child that exited meanwhile
      continue
    if parent not in found:
      roots.append(pid)
  [pid] = roots
  return pid


def fresh_database(backend: str) -> str:
  if backend == "sqlite":
    return f"sqlite:///{pathlib.Path(tempfile.mkdtemp()) / 'dvbench.db'}"
  return postgres.shared_cluster().new_database()


def send_steps_until_refused(prover: FakeProver) -> bytes:
  """Sends steps (the server challenges none) until a request fails; returns the record
  whose envelope got no answer."""
  while True:
    raw = prover.step_record()
    try:
      response = prover.send(raw)
    except httpx.TransportError:
      return raw
    assert response.status_code == 200, response.text
    prover.state, prover.steps = cbor2.loads(raw)["post_state"], prover.steps + 1


def closed_proof(url: str, token: str, experiment: str, steps: int = 2) -> FakeProver:
  prover = FakeProver(url, token, experiment).start()
  prover.run(steps)
  response = prover.finish()
  assert response.status_code == 200, response.text
  return prover


class Server(LocalServer):
  """A LocalServer that can be SIGKILLed alone (not its process group) and restarted."""

  def store(self) -> Store:
    return Store.open(self.database_url or f"sqlite:///{self.data / 'dvbench.db'}")

  def token(self, owner: str) -> str:
    return self.store().create_token(owner)[1]  # no CLI process: the same query

  def kill_server_only(self) -> None:
    self.process.send_signal(signal.SIGKILL)
    self.process.wait()

  def proof(self, proof_id: str) -> dict:
    return httpx.get(f"{self.url}/api/v1/proofs/{proof_id}", timeout=10).json()

  def settled(self, proof_id: str) -> dict | None:
    proof = self.proof(proof_id)
    return proof if proof["state"] not in ("receiving", "closed", "verifying") else None


# -- supervised workers, kill -9 --------------------------------------------------------


class SupervisionTest(absltest.TestCase):
  """Real servers killed with SIGKILL, real workers and verifier children killed too."""

  def server(self, *args: str, workers: int = 1) -> Server:
    server = Server(workers=workers, lease_seconds=60, extra_args=args).start()
    self.addCleanup(server.stop)
    return server

  def assert_only_live_workers_have_folders(self, server: Server) -> None:
    """The folders of killed workers (and their verifiers' files) were removed."""
    def live_ids():
      return sorted(c.split("--worker-id ")[1].split()[0]
                    for c in processes_mentioning(str(server.data)).values() if "--worker-id" in c)

    def folders():
      return sorted(p.name for p in (server.data / "work").iterdir())
    testing.wait_until(lambda: live_ids() and folders() == live_ids(), timeout=30)

  def end_leaving_no_process(self, server: Server, end) -> None:
    """``end()`` ends the server; then no process naming its data folder (workers, verifier
    children) is left, nor any child it had before (its ingestion process among them)."""
    before = testing.children(server.process.pid)
    self.assertTrue(testing.ingest_children(server.process.pid))
    end()
    testing.wait_until(lambda: not processes_mentioning(str(server.data))
                       and all(testing.exited(pid) for pid in before), timeout=10)

  def test_kill_9_of_the_server_during_ingestion_and_verification(self):
    # Steps only, no challenges (no update checks, no data probes).
    server = self.server("--min-update-check-probability", "0", "--min-probe-ratio", "0")
    token = server.token("alice")
    ingesting = FakeProver(server.url, token, "alice/ingest").start()
    uploads = concurrent.futures.ThreadPoolExecutor(1).submit(send_steps_until_refused, ingesting)
    testing.wait_until(lambda: ingesting.steps >= 2)
    verifying = closed_proof(server.url, token, "alice/verify")
    # Killed as the verification starts: waiting for steps after it, a loaded machine let
    # the verification end first (its one attempt, not the killed one and another).
    testing.wait_until(lambda: server.proof(verifying.proof_id)["state"] == "verifying")
    # With a step in flight and the other proof mid-verification; its children die with it.
    self.end_leaving_no_process(server, server.kill_server_only)
    in_flight = uploads.result(timeout=60)
    server.start()  # the same data folder and port
    resent = ingesting.send(in_flight)  # its ack may have been lost: the same envelope again
    self.assertEqual(resent.status_code, 200, resent.text)
    ingesting.state, ingesting.steps = cbor2.loads(in_flight)["post_state"], ingesting.steps + 1
    ingesting.run(1)
    ingesting.finish()
    for prover in (ingesting, verifying):
      testing.wait_until(lambda p=prover: server.settled(p.proof_id), timeout=120)
      listed = httpx.get(f"{server.url}/api/v1/proofs/{prover.proof_id}/records").json()
      self.assertEqual(listed, [record_id(r).hex() for r in prover.records])
    jobs = [server.store().job("proof", p.proof_id) for p in (ingesting, verifying)]
    self.assertEqual([j["state"] for j in jobs], ["done", "done"])
    self.assertEqual(jobs[1]["attempts"], 2)  # the killed attempt, then one that finished
    self.assert_only_live_workers_have_folders(server)
    self.end_leaving_no_process(server, server.stop)
    self.assertTrue((server.data / "dvbench.db").is_file())  # stop() keeps it for a restart
    server.close()
    self.assertFalse(server.data.exists())  # close() removes the data folder it made

  def test_a_job_that_kills_its_workers_is_given_up_with_the_reason(self):
    server = self.server("--max-attempts", "2", workers=1)
    prover = closed_proof(server.url, server.token("alice"), "alice/deadly")
    store = server.store()
    for attempt in (1, 2):
      job = testing.wait_until(lambda a=attempt: (j := store.job("proof", prover.proof_id))[
          "state"] == "running" and j["attempts"] == a and j)
      self.assertRegex(server.proof(prover.proof_id)["label"],
                       rf"verifying: attempt {attempt}, running for \d+ s, its worker reported")
      os.kill(worker_pid(job["lease_owner"]), signal.SIGKILL)
    proof = testing.wait_until(lambda: server.settled(prover.proof_id), timeout=60)
    self.assertEqual(proof["state"], "unverifiable")  # no finding: never "invalid"
    self.assertIn("could not verify: verification was given up after 2 attempts; the last one "
                  "ended because the worker process was killed by SIGKILL", proof["failure"])
    self.assertTrue(proof["label"].startswith(proof["failure"]), proof["label"])
    self.assertEqual(store.job("proof", prover.proof_id)["state"], "failed")
    self.assert_only_live_workers_have_folders(server)
    health = httpx.get(f"{server.url}/api/v1/health").json()
    self.assertEqual(health["workers"], {"alive": 1, "expected": 1, "restarts": 2})
    self.assertTrue(health["ok"])

  def test_a_verifier_out_of_memory_is_retried_then_could_not_verify(self):
    # A verifier that cannot even start in its memory limit: a fault of the server, never a
    # finding about the proof.
    server = self.server("--max-attempts", "2", "--memory-limit-gb", "0.05", workers=1)
    prover = closed_proof(server.url, server.token("alice"), "alice/big")
    proof = testing.wait_until(lambda: server.settled(prover.proof_id), timeout=120)
    self.assertEqual(proof["state"], "unverifiable", proof)
    self.assertRegex(proof["failure"], r"^could not verify: verification was given up after 2 "
                     r"attempts; the last one ended because the verifier (ran out of memory|"
                     r"stopped|crashed|was killed)")
    job = server.store().job("proof", prover.proof_id)
    self.assertEqual((job["state"], job["attempts"]), ("failed", 2))

  def test_health_is_not_ok_without_a_live_worker(self):
    store = Store.open(fresh_database("sqlite"))
    dying = Supervisor([sys.executable, "-c", "raise SystemExit(3)"], 2, store,
                       poll_seconds=0.05).start()
    self.addCleanup(dying.stop)
    health = testing.wait_until(lambda: (h := dying.health())["restarts"] >= 4 and h)
    self.assertEqual(health["alive"], 0)  # restarted with a growing delay, never alive
    service = Service(store, BlobStore(pathlib.Path(tempfile.mkdtemp())),
                      receipt.new_signing_key(), workers=dying.health)
    response = TestClient(create_app(service)).get("/api/v1/health")
    self.assertEqual(response.status_code, 503)
    self.assertEqual(response.json()["workers"]["expected"], 2)


# -- the queue: fair across owners, capped per owner ------------------------------------


@parameterized.parameters("sqlite", "postgresql")
class QueueTest(parameterized.TestCase):

  def enqueue(self, store: Store, owner: str, n: int) -> list[str]:
    """``n`` closed proofs of ``owner`` queued for verification; their ids."""
    from zkdv import challenge  # pylint: disable=g-import-not-at-top
    exp = store.experiment(f"{owner}/run", create_for=owner)
    ids = []
    for _ in range(n):
      proof_id = os.urandom(32).hex()
      store.create_proof(exp["id"], proof_id, "run", b"root", {
          "kind": "self", "nonce": None, "policy": json.dumps(challenge.Policy().to_record())})
      with store.engine.begin() as conn:
        store.enqueue_job(conn, "proof", proof_id)
      ids.append(proof_id)
    return ids

  def test_digests_of_a_proof_are_added_once_each(self, backend):
    store = Store.open(fresh_database(backend))
    [proof], [other] = self.enqueue(store, "alice", 1), self.enqueue(store, "bob", 1)
    first, again = {"01" * 32, "02" * 32}, {"02" * 32, "03" * 32}
    with store.engine.begin() as conn:
      store.add_probes(conn, proof, first)
      store.add_probes(conn, proof, again)  # one repeated: kept once, the request not refused
      store.add_probes(conn, proof, set())
      store.add_probes(conn, other, first)  # the same digest under another proof is its own
    with store.engine.begin() as conn:
      store.add_probes(conn, proof, first | again)  # a later acknowledgement repeats them all
    self.assertEqual((store.probe_count(proof), store.probe_count(other)), (3, 2))

  def test_a_real_proof_does_not_wait_behind_another_owners_junk(self, backend):
    store = Store.open(fresh_database(backend))
    junk = self.enqueue(store, "mallory", 6)
    real = self.enqueue(store, "alice", 2)
    order = [store.claim_job(f"w{i}", 60)["subject"] for i in range(4)]
    self.assertEqual(order, [junk[0], real[0], junk[1], real[1]])

  def test_a_long_job_does_not_take_a_second_worker_from_another_owner(self, backend):
    store = Store.open(fresh_database(backend))
    mallory = self.enqueue(store, "mallory", 3)
    long_job = store.claim_job("w0", 600, owner_share=1)  # holds w0 for its whole run
    self.assertEqual(long_job["subject"], mallory[0])
    [first] = self.enqueue(store, "alice", 1)
    done = store.claim_job("w1", 60, owner_share=1)
    self.assertEqual(done["subject"], first)
    self.assertTrue(store.complete_proof_job(done["id"], "w1", first, "verified", None, [],
                                             receipt=("verified", 0)))
    [second] = self.enqueue(store, "alice", 1)  # alice was served after mallory
    # Mallory's older jobs wait: mallory runs one, alice none.
    self.assertEqual(store.claim_job("w1", 60, owner_share=1)["subject"], second)
    # With nobody else waiting, mallory may use the free worker.
    self.assertEqual(store.claim_job("w2", 60, owner_share=1)["subject"], mallory[1])

  def test_a_claim_and_a_heartbeat_are_stamped_once_they_hold_the_write_lock(self, backend):
    # Two workers claiming at once: the one that waited for the lock claims second, so its
    # job's started_at must not precede the first claim's (fairness reads started_at).
    store = Store.open(fresh_database(backend))
    [proof] = self.enqueue(store, "alice", 1)
    begin, held = store.engine.begin, []

    @contextlib.contextmanager
    def begin_and_note():
      with begin() as conn:
        held.append(time.time())
        yield conn

    with mock.patch.object(store.engine, "begin", begin_and_note):
      job = store.claim_job("w", 60)
      self.assertTrue(store.extend_lease(job["id"], "w", 60))
    self.assertEqual(job["subject"], proof)
    self.assertGreaterEqual(job["started_at"], held[0])
    # A heartbeat that waited for the lock extends the lease from when it holds it.
    extended = store.job("proof", proof)
    self.assertGreaterEqual(extended["heartbeat_at"], held[1])
    self.assertGreaterEqual(extended["lease_expires"], held[1] + 60)

  def test_owner_share_is_half_the_workers(self, backend):
    del backend
    self.assertEqual([store_jobs.owner_share(n) for n in (1, 2, 3, 4, 5)], [1, 1, 2, 2, 3])
    args = argparse.Namespace(data="/srv/data", lease_seconds=60.0, memory_limit_gb=1.0,
                              time_limit=60, time_per_check=1.0, max_attempts=3,
                              database_url=None, workers=3, allow_weak_sandbox=False)
    command = dvbench_cli._worker_command(args)  # what dvbench serve starts its workers with
    self.assertEqual(command[command.index("--owner-share") + 1], "2")
    usage = subprocess.run([*command[:4], "--help"], capture_output=True, text=True,
                           check=True, timeout=60).stdout
    self.assertIn("--owner-share OWNER_SHARE", usage)  # the worker takes what serve passes

  def test_an_owner_queues_at_most_the_cap(self, backend):
    store = Store.open(fresh_database(backend))
    store.max_queued_per_owner = 3
    self.enqueue(store, "mallory", 3)
    with self.assertRaisesRegex(QueueFull, "'mallory' already has 3 jobs waiting .* at most 3"):
      self.enqueue(store, "mallory", 1)
    self.enqueue(store, "alice", 1)  # others are not affected
    store.claim_job("w", 60)
    with self.assertRaises(QueueFull):  # a running job still counts
      self.enqueue(store, "mallory", 1)


# -- a server without workers: abandoned proofs, the cap over HTTP, headers -------------


class LiveQueueTest(absltest.TestCase):
  """The queue's fairness in a running server with two workers (the rule: QueueTest)."""

  def test_another_owners_proof_does_not_wait_behind_an_owners_queue(self):
    # Three closed proofs wait while the server has no worker: mallory's two, then alice's.
    data = pathlib.Path(tempfile.mkdtemp(prefix="dvbench-queue-"))
    idle = LocalServer(workers=0, data=data).start()
    self.addCleanup(idle.stop)
    proofs = []
    for owner, experiment in (("mallory", "mallory/a"), ("mallory", "mallory/b"),
                              ("alice", "alice/c")):
      prover = FakeProver(idle.url, idle.token(owner), experiment).start()
      prover.run(steps=2)
      self.assertEqual(prover.finish().status_code, 200)
      proofs.append(prover.proof_id)
    idle.stop()
    # Restarted with two workers: each claims from the same queue at once.
    served = LocalServer(workers=2, data=data).start()
    self.addCleanup(served.stop)
    store = Store.open(f"sqlite:///{data / 'dvbench.db'}")
    self.addCleanup(store.engine.dispose)
    def settled():
      rows = [store.job("proof", p) for p in proofs]
      return all(r is not None and r["state"] in ("done", "failed") for r in rows) and rows
    rows = testing.wait_until(settled, timeout=120, every=0.2)
    order = [p for _, p in sorted((r["started_at"], p) for r, p in zip(rows, proofs))]
    # First come, first served would run mallory's second proof before alice's only one.
    self.assertEqual(order, [proofs[0], proofs[2], proofs[1]])


class IdleServerTest(absltest.TestCase):
  """A server on SQLite whose queue nobody drains."""

  database = "sqlite"

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    url = fresh_database(cls.database)
    cls.server = Server(workers=0, database_url=None if url.startswith("sqlite") else url,
                        extra_args=("--abandon-after", "2s", "--max-queued-per-owner", "1")
                        ).start()
    cls.token = cls.server.token("alice")

  @classmethod
  def tearDownClass(cls):
    cls.server.stop()
    super().tearDownClass()

  def test_a_run_killed_after_its_final_record_is_closed_by_uploading_its_folder(self):
    # Before, the crashed proof counted as uploaded already: upload(folder) returned at once
    # and the proof stayed crashed, its message saying to resume a finished run.
    token = self.server.token("kim")  # an owner of its own: its closed proof stays queued
    prover = FakeProver(self.server.url, token, "kim/killed-before-close").start()
    folder = pathlib.Path(tempfile.mkdtemp())
    self.addCleanup(shutil.rmtree, folder)
    (folder / transcript.BLOBS_DIR).mkdir()
    upload = prover.upload
    def kept(data):  # the run's transcript folder keeps each blob it sends
      (folder / transcript.BLOBS_DIR / prover.digest_hex(data)).write_bytes(data)
      return upload(data)
    prover.upload = kept
    prover.run(2)
    self.assertEqual(prover.send(prover.final_record()).status_code, 200)  # then killed
    store = self.server.store()
    crashed, _ = store.settle_silent_proofs(silent_seconds=0.0)  # the sweep, run now
    self.assertIn(prover.proof_id, crashed)
    failure = store.proof(prover.proof_id)["failure"]
    self.assertIn("after its final record (2 steps): the run stopped before it closed the "
                  "proof; close it with experiment.upload(FOLDER)", failure)
    (folder / transcript.RECORDS_FILE).write_bytes(b"".join(prover.records))
    experiment = dvbench.Client(self.server.url, token=token).experiment(
        "kim/killed-before-close")
    # Resuming it says how to close it (before: "the transcript is finished ... Start a new
    # proof"), and leaves it as it was.
    with self.assertRaisesRegex(zkdv_errors.ProofStateError,
                                r"holds its final record: its run ended and only its close "
                                r"is missing\. Send what the server lacks and close it with "
                                r"experiment\.upload\(FOLDER\)"):
      resume.reopen(experiment, prover.proof_id, pathlib.Path(tempfile.mkdtemp()))
    self.assertEqual(store.proof(prover.proof_id)["state"], "crashed")
    self.assertEqual(experiment.upload(folder), prover.proof_id)
    proof = store.proof(prover.proof_id)
    self.assertEqual((proof["state"], proof["records"]), ("closed", len(prover.records)))

  def test_a_proof_left_receiving_is_abandoned_and_never_verified(self):
    prover = FakeProver(self.server.url, self.token, "alice/crashed").start()
    prover.run(1)
    proof = testing.wait_until(lambda: self.server.settled(prover.proof_id), timeout=30)
    self.assertEqual(proof["state"], "abandoned")
    self.assertEqual(proof["failure"], "no record arrived for 2 s: the run stopped before "
                     "closing the proof, so it is never verified.")
    self.assertIn("abandoned", proof["label"])
    refused = prover.send(prover.final_record())
    self.assertEqual(refused.status_code, 409)
    self.assertIn("abandoned", refused.json()["error"])
    page = httpx.get(f"{self.server.url}/proofs/{prover.proof_id}").text
    self.assertIn("abandoned", page)

  def test_closing_beyond_the_owners_queue_cap_answers_429(self):
    closed_proof(self.server.url, self.token, "alice/first", steps=1)
    prover = FakeProver(self.server.url, self.token, "alice/second").start()
    prover.run(1)
    response = prover.send(prover.final_record())
    response = response if response.status_code != 200 else prover.close()
    self.assertEqual(response.status_code, 429)
    self.assertIn("'alice' already has 1 jobs waiting for verification", response.json()["error"])

  def follow(self, path: str, limit: int) -> list:
    """Every item of a listing, fetched ``limit`` at a time through its next links."""
    items, url = [], f"{self.server.url}{path}?limit={limit}"
    while url:
      response = httpx.get(url)
      self.assertEqual(response.status_code, 200, response.text)
      page = response.json()
      self.assertLessEqual(len(page), limit)
      items += page
      url = response.links.get("next", {}).get("url")
    return items

  def test_listings_come_in_bounded_pages(self):
    prover = FakeProver(self.server.url, self.token, "alice/paged").start()
    prover.run(4)
    base = f"/api/v1/proofs/{prover.proof_id}"
    self.assertEqual(self.follow(f"{base}/records", 2),
                     [record_id(r).hex() for r in prover.records])
    self.assertEqual([c["step"] for c in self.follow(f"{base}/challenges", 3)], [0, 1, 2, 3])
    names = [e["full_name"] for e in self.follow("/api/v1/experiments", 1)]
    self.assertEqual(names, sorted(set(names)))
    self.assertIn("alice/paged", names)
    for query, error in (("limit=0", "limit is an integer from 1 to 1000"),
                         ("limit=1001", "from 1 to 1000"), ("after=x", "an integer from 0")):
      response = httpx.get(f"{self.server.url}{base}/records?{query}")
      self.assertEqual(response.status_code, 400, query)
      self.assertIn(error, response.json()["error"])

  def test_every_response_carries_the_security_headers(self):
    for path in ("/", "/api/v1/health", "/api/v1/proofs/" + "0" * 64, "/static/style.css"):
      headers = httpx.get(self.server.url + path).headers
      self.assertIn("script-src 'self'", headers["content-security-policy"], path)
      self.assertEqual(headers["x-content-type-options"], "nosniff", path)
      self.assertEqual(headers["x-frame-options"], "DENY", path)
      self.assertEqual(headers["referrer-policy"], "no-referrer", path)


class PostgresIdleServerTest(IdleServerTest):
  database = "postgresql"


# -- tokens -----------------------------------------------------------------------------


class TokenTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = Server(workers=0).start()

  @classmethod
  def tearDownClass(cls):
    cls.server.stop()
    super().tearDownClass()

  def cli(self, *args: str, stdin: str = "", env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvbench.cli", *args], input=stdin,
                          capture_output=True, text=True, env=env)

  def token_cli(self, *args: str) -> subprocess.CompletedProcess:
    return self.cli("token", *args, "--data", str(self.server.data))

  def write(self, token: str) -> httpx.Response:
    return httpx.post(f"{self.server.url}/api/v1/experiments/bob/x/slots",
                      headers={"Authorization": f"Bearer {token}"})

  def test_names_are_checked_with_the_rule(self):
    store = self.server.store()
    for bad in ("", "a/b", "bad name"):
      with self.assertRaisesRegex(BadName, f"owner name {bad!r} is not acceptable: use 1-100 "
                                  "characters of letters, digits"):
        store.create_token(bad)
    result = self.token_cli("create", "bob", "--name", "x y")
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("dvbench token create: token name 'x y' is not acceptable", result.stderr)

  def test_revoked_and_expired_tokens_get_401_saying_what_to_do(self):
    store = self.server.store()
    _, token = store.create_token("bob", "bob-ci")
    short = self.token_cli("create", "bob", "--name", "bob-short",
                           "--expires-in", "0.00001").stdout.strip()  # 0.864 s
    self.assertEqual(self.write(token).status_code, 201)
    self.assertEqual(self.token_cli("revoke", "bob-ci").returncode, 0)
    refused = self.write(token)
    self.assertEqual(refused.status_code, 401)
    self.assertIn("API token 'bob-ci' was revoked; ask the server's operator for a new one",
                  refused.json()["error"])
    self.assertFalse(store.revoke_token("bob-ci"))
    testing.wait_until(lambda: self.write(short).status_code == 401, timeout=10)
    self.assertIn("API token 'bob-short' expired", self.write(short).json()["error"])
    listed = self.token_cli("list", "bob").stdout
    self.assertRegex(listed, r"bob-ci +bob .* revoked\n")
    self.assertRegex(listed, r"bob-short +bob .* expired\n")
    self.assertNotIn(token, listed)

  def test_login_reads_the_token_from_stdin_into_a_private_file(self):
    config = pathlib.Path(tempfile.mkdtemp())
    (config / "token").write_text("old")
    os.chmod(config / "token", 0o644)
    env = {**os.environ, "DVBENCH_CONFIG_DIR": str(config)}
    result = self.cli("login", "--url", self.server.url, stdin="dvb_secret\n", env=env)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(oct((config / "token").stat().st_mode & 0o777), "0o600")
    self.assertEqual(json.loads((config / "token").read_text()),
                     {"token": "dvb_secret", "url": self.server.url})
    self.assertIn("no token given", self.cli("login", stdin="", env=env).stderr)


# -- the verifier child: confinement and honest failure text ----------------------------


class ConfinedChildTest(absltest.TestCase):

  def run_child(self, code: str, memory_gb: float = 2, seconds: int = 30, work=None):
    work = work or pathlib.Path(tempfile.mkdtemp())
    (work / "scratch").mkdir()
    limits = worker_lib.Limits(int(memory_gb * 2**30), isolation=sandbox.available())
    return worker_lib.run_confined([sys.executable, "-c", code], work, limits, seconds)

  def test_the_child_has_no_network_and_writes_only_in_its_folder(self):
    isolation = sandbox.available()
    if not {sandbox.NETWORK, sandbox.LANDLOCK} <= set(isolation):
      self.skipTest(f"this kernel grants only {isolation}")
    listener = socket.create_server(("127.0.0.1", 0))
    self.addCleanup(listener.close)
    work = pathlib.Path(tempfile.mkdtemp())
    outside = work / "escaped"  # the job folder: the child sees it, read-only
    code = f"""
import json, os, socket
out = {{}}
try:
  socket.create_connection(("127.0.0.1", {listener.getsockname()[1]}), timeout=2)
  out["connect"] = "connected"
except OSError as e:
  out["connect"] = e.strerror
for name, path in (("inside", "mine"), ("outside", {str(outside)!r})):
  try:
    open(path, "w").write("x")
    out[name] = "written"
  except OSError as e:
    out[name] = e.strerror
print(json.dumps(out))
"""
    report, failure = self.run_child(code, work=work)
    self.assertIsNone(failure)
    # Its own loopback is up (a multi-process replay needs it); the server's is not reachable.
    self.assertEqual(report, {"connect": "Connection refused", "inside": "written",
                              "outside": "Read-only file system" if sandbox.FILES in isolation
                              else "Permission denied"})
    self.assertFalse(outside.exists())

  def test_failures_name_the_cause_without_paths_or_output(self):
    cases = {
        "import ctypes; ctypes.string_at(0)": "the verifier crashed with SIGSEGV.",
        "b = bytearray(3 << 30)": "the verifier ran out of memory: its limit is 1 GiB.",
        "while True: pass": "exceeded the time limit of 1 s",  # CPU or wall clock
        "import sys; sys.exit('/srv/secret/path failed')":
            "the verifier stopped (exit 1) without a report.",
    }
    for code, expected in cases.items():  # 1 s for the loop, time to start for the others
      report, failure = self.run_child(code, memory_gb=1, seconds=1 if "while" in code else 30)
      self.assertIsNone(report)
      self.assertIn(expected, failure, code)
      self.assertNotIn("/srv", failure)


if __name__ == "__main__":
  absltest.main()
