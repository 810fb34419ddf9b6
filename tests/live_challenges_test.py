"""Real JAX training challenged live by a real `dvbench serve`: independent verification
of downloaded proofs (keys from the slot among them), and a server that restarts mid-run."""

import dataclasses
import json
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
from unittest import mock

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import sqlalchemy as sa
from absl.testing import absltest

import dvbench
import zkdv
from dvbench.server.db import Store
from dvbench.server.local import LocalServer
from dvbench.server.schema import records
from tests import testing
from tests.fake_prover import FakeProver
from zkdv import challenge
from zkdv import keys
from zkdv import receipt
from zkdv import transcript
from zkdv.jax import openings as openings_lib

REPO = pathlib.Path(__file__).resolve().parent.parent


def _train(experiment, steps: int, update_p: float = 0.5, tamper_at: int | None = None,
           on_step=None, finish_raises: type[Exception] | None = None,
           batch=testing.TUTORIAL_BATCH, probe_ratio: float = 0.25):
  """The tutorial model trained through ``experiment.proof`` (on ``batch``); returns the proof.

  ``finish_raises``: the error ``finish()`` must raise (the prover's own replay of a forged
  opening fails); any other outcome fails the test."""
  proof = experiment.proof(config=zkdv.ZKDVConfig(
      sampling_policy=zkdv.SamplingPolicy(update_check_probability=update_p)))
  proof.start(rolling_window=3, probe_ratio=probe_ratio)
  state = testing.classifier_state(proof)
  train_step = proof.jit(testing.classifier_step, donate_argnums=0)
  for t in range(steps):
    if t == tamper_at:  # weights changed outside proof.jit: the chain breaks here
      state = state.replace(params=jax.tree.map(lambda x: x + 1.0, state.params))
    state = train_step(state, jnp.asarray(batch) + (t % 2))
    if on_step is not None:
      on_step(t)
  if finish_raises is None:
    proof.finish()
    return proof
  try:
    proof.finish()
  except finish_raises:
    return proof
  raise AssertionError(f"finish() did not raise {finish_raises.__name__}")


def _keyed_step(state, batch, key):
  keep = jax.random.uniform(key, batch.shape) >= 0.0  # a dropout mask keeping every row
  return testing.classifier_step(state, batch * keep.astype(batch.dtype))


def _train_from_the_slot(experiment, steps: int = 3):
  """The tutorial with its one-line ``proof.init`` change and the proof's key each step."""
  proof = experiment.proof(config=zkdv.ZKDVConfig(
      sampling_policy=zkdv.SamplingPolicy(update_check_probability=1.0)))
  proof.start(rolling_window=3, probe_ratio=0.5)
  model = testing.TinyClassifier()
  params = proof.init(model.init, jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
  state = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply,
                                             params=params, tx=optax.adam(1e-2))
  train_step = proof.jit(_keyed_step)
  for t in range(steps):
    state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + (t % 2), proof.step_key())
  proof.finish()
  return proof



class IndependentVerificationTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=1, extra_args=(
        "--min-update-check-probability", "1.0")).start()  # every segment: no chance
    cls.client = dvbench.Client(cls.server.url, token=cls.server.token("alice"))
    cls.key = httpx.get(f"{cls.server.url}/api/v1/server-key").json()["server_key"]

  @classmethod
  def tearDownClass(cls):
    cls.client.close()
    cls.server.stop()
    super().tearDownClass()

  def _download(self, proof_id) -> pathlib.Path:
    folder = pathlib.Path(tempfile.mkdtemp()) / "proof"
    subprocess.run([sys.executable, "-m", "dvbench.cli", "download", proof_id, str(folder),
                    "--url", self.server.url], cwd=REPO, check=True, capture_output=True)
    return folder

  def test_records_travel_together_until_training_waits_for_their_decisions(self):
    proof = self.client.experiment("alice/coalesced").proof(config=zkdv.ZKDVConfig(
        sampling_policy=zkdv.SamplingPolicy(update_check_probability=1.0)))
    proof.start(rolling_window=3, probe_ratio=0.25)
    uploader = proof._uploader  # pylint: disable=protected-access
    uploader.coalesce_seconds = 600.0  # nothing travels early but what training waits for
    state = testing.classifier_state(proof)
    train_step = proof.jit(testing.classifier_step, donate_argnums=0)
    for t in range(12):
      state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + (t % 2))
    proof.finish()
    # About one envelope each time the window of 3 filled, and the close; sent as written,
    # the records of 12 steps took 9.
    self.assertLessEqual(uploader._seq, 12 // 3 + 2)  # pylint: disable=protected-access
    status = self.client.wait_for_verdict(proof.proof_id, 300)
    self.assertEqual(status["state"], "verified steps", str(status))

  def test_a_flush_ends_when_its_records_are_stored_not_when_coalescing_ends(self):
    proof = self.client.experiment("alice/flushed").proof()
    proof.start(rolling_window=3, probe_ratio=0.25)
    uploader = proof._uploader  # pylint: disable=protected-access
    uploader.coalesce_seconds = 600.0  # a flush waiting out the coalescing would time out
    proof.upload_timeout = 60.0
    state = testing.classifier_state(proof)
    train_step = proof.jit(testing.classifier_step, donate_argnums=0)
    for t in range(6):
      state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + (t % 2))
    proof.wait_for_commitments()  # the checkpoint point of docs/jax.md: flushes the upload
    stored = self.client.http.request("GET", f"/api/v1/proofs/{proof.proof_id}").json()
    self.assertEqual(stored["records"], uploader.sent_records)
    proof.finish()

  def test_downloaded_proof_verifies_with_the_server_key_as_the_server_did(self):
    proof = _train(self.client.experiment("alice/independent"), steps=12)
    status = self.client.wait_for_verdict(proof.proof_id, 180)
    self.assertEqual(status["state"], "verified steps", repr(status))  # start unattested
    self.assertEqual(status["challenger"], "dvbench")
    folder = self._download(proof.proof_id)
    # Adaptive segments may grow to half the server's largest window (256), not only to the
    # caller's first window of 3, capped at the server's longest segment (32): the root says
    # so, and the server took it.
    policy = testing.records_of(folder, "root")[0]["challenger"]["policy"]
    self.assertEqual((policy["rolling_window"], policy["segment_length"]), (256, 32))
    code, report = testing.zkdv_verify(folder, "--server-key", self.key)
    self.assertEqual((code, report["verdict"]), (0, "verified"), report)
    claims = {c["name"]: c for c in report["claims"]}
    self.assertEqual(claims["challenges"]["status"], "holds", claims["challenges"])
    self.assertIn("dvbench", claims["challenges"]["detail"])
    replayed = [c for c in report["checks"] if c["kind"] == "update"]
    self.assertLen(replayed, proof.checks["update"])
    self.assertGreater(len(replayed), 0)
    self.assertTrue(all(c["status"] == "verified" for c in replayed))
    # Without the server's word, the challenges cannot be re-derived.
    code, report = testing.zkdv_verify(folder)
    self.assertEqual(code, 2, report)
    # Another server's key, or a flipped receipt byte, is reported.
    code, report = testing.zkdv_verify(folder, "--server-key", os.urandom(32).hex())
    self.assertNotEqual(code, 0)
    self.assertIn("another server challenged it", json.dumps(report["findings"]))
    path = folder / receipt.RECEIPT_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    code, report = testing.zkdv_verify(folder, "--server-key", self.key)
    self.assertNotEqual(code, 0)
    self.assertTrue(report["findings"], report)

  def test_probe_records_kept_out_of_the_database_verify_as_sent(self):
    # 1,024 rows of 20 bytes: a probe opens a 16 KiB Merkle row, so each probe record is
    # stored in the proof's records file (dvbench.server.record_bodies), not in SQLite.
    proof = _train(self.client.experiment("alice/large-rows"), steps=6,
                   batch=np.tile(testing.TUTORIAL_BATCH, (1024, 1)))
    status = self.client.wait_for_verdict(proof.proof_id, 180)
    self.assertEqual(status["state"], "verified steps", repr(status))
    store = Store.open(f"sqlite:///{self.server.data / 'dvbench.db'}")
    with store.engine.connect() as conn:
      out_of_line = conn.execute(sa.select(sa.func.count()).where(
          (records.c.proof_id == proof.proof_id) & records.c.body_offset.is_not(None))).scalar()
    store.engine.dispose()
    self.assertGreaterEqual(out_of_line, 6)  # a probe record a step at least
    folder = self._download(proof.proof_id)  # its chain holds: every byte as sent
    self.assertLen([r for r in testing.records_of(folder, "check") if r["kind"] == "probe"],
                   out_of_line)
    code, report = testing.zkdv_verify(folder, "--server-key", self.key)
    self.assertEqual((code, report["verdict"]), (0, "verified"), report)

  def test_only_the_steps_the_server_probed_open_rows(self):
    # At the tutorial's ratio of 0.01 a step is probed with probability 0.32 (format 10);
    # format 9 wrote a probe record opening every leaf's one Merkle row at every step.
    proof = _train(self.client.experiment("alice/sparse-probes"), steps=40,
                   probe_ratio=0.01)
    status = self.client.wait_for_verdict(proof.proof_id, 180)
    self.assertEqual(status["state"], "verified steps", repr(status))
    folder = self._download(proof.proof_id)
    key = receipt.open_receipt((folder / receipt.RECEIPT_FILE).read_bytes(),
                               bytes.fromhex(self.key))["challenge_key"]
    contents = transcript.read_transcript(folder).records
    policy = challenge.Policy.from_record(contents[0].record["challenger"]["policy"])
    self.assertEqual(policy.probe_ratio, 0.01)
    probed = sorted(r.record["index"] for r in contents if r.record["type"] == "step" and
                    challenge.decide(r.record["index"], challenge.step_challenge_server(
                        key, r.record_id), policy).probed)
    opened = sorted(r.record["step"] for r in contents
                    if r.record["type"] == "check" and r.record["kind"] == "probe")
    self.assertEqual(opened, probed)
    # Binomial(40, 0.32): 12.8 expected; outside [2, 30] has probability < 1e-5.
    self.assertBetween(len(probed), 2, 30)
    code, report = testing.zkdv_verify(folder, "--server-key", self.key)
    self.assertEqual((code, report["verdict"]), (0, "verified"), report)
    # One batch leaf of 4 rows, one Merkle row: a probed step opens all 4, the others none.
    self.assertEqual(report["probed_rows"], 4 * len(probed))

  def test_a_batch_of_a_key_only_answers_its_probes_with_records_opening_nothing(self):
    # Before, a probed step whose batch holds only the proof's PRNG key (no row to open)
    # wrote no probe record: the server required one (it decides from the challenge alone)
    # and called the honest run invalid, while the verifier required none.
    data = jnp.asarray(testing.TUTORIAL_BATCH)

    def keyed(state, key):
      keep = jax.random.uniform(key, data.shape) >= 0.0
      return testing.classifier_step(state, data * keep.astype(data.dtype))

    proof = self.client.experiment("alice/key-only").proof(config=zkdv.ZKDVConfig(
        sampling_policy=zkdv.SamplingPolicy(update_check_probability=1.0)))
    proof.start(rolling_window=3, probe_ratio=1 / 32)  # every step probed
    state = testing.classifier_state(proof)
    train_step = proof.jit(keyed)
    for _ in range(3):
      state = train_step(state, proof.step_key())
    proof.finish()
    status = self.client.wait_for_verdict(proof.proof_id, 180)
    # A batch of a key alone carries no data, so no program test and no data claim.
    self.assertEqual((status["state"], status["shortfalls"]), (
        "verified steps", ["start unattested", "program not analyzed", "data unprobed"]),
                     repr(status))
    folder = self._download(proof.proof_id)
    probes = [r for r in testing.records_of(folder, "check") if r["kind"] == "probe"]
    self.assertEqual([(r["step"], r["probes"]) for r in probes], [(0, []), (1, []), (2, [])])
    code, report = testing.zkdv_verify(folder, "--server-key", self.key)
    self.assertEqual(report["standing"]["state"], "verified steps", report)
    self.assertEqual(report["findings"], [])
    self.assertEqual(code, 0, report)  # the claims it requires by default hold
    (data_claim,) = [c for c in report["claims"] if c["name"] == "data"]
    self.assertEqual(data_claim["status"], "does not hold")
    self.assertIn("3 probed steps, whose batches hold no rows a probe opens",
                  data_claim["detail"])

  def test_an_invalid_proof_is_invalid_for_both(self):
    proof = _train(self.client.experiment("alice/tampered"), steps=6, tamper_at=3)
    status = self.client.wait_for_verdict(proof.proof_id, 180)
    self.assertEqual(status["state"], "invalid", status)
    self.assertIn("step 3", status["failure"])
    code, report = testing.zkdv_verify(self._download(proof.proof_id), "--server-key", self.key)
    self.assertEqual((code, report["verdict"]), (1, "invalid"), report)
    self.assertIn("discontinuity", [f["code"] for f in report["findings"]])


  def test_the_slots_keys_verify_with_every_claim(self):
    proof = _train_from_the_slot(self.client.experiment("alice/slot-keys"))
    status = self.client.wait_for_verdict(proof.proof_id, 180)
    self.assertEqual(status["state"], "verified", status)
    code, report = testing.zkdv_verify(self._download(proof.proof_id), "--server-key", self.key,
                                "--strict")
    self.assertEqual((code, report["verdict"]), (0, "verified"), report)

  def test_keys_not_derived_from_the_slot_are_refused(self):
    own = keys.key_seed  # the prover derives its keys from its root, not the server's nonce
    with mock.patch.object(keys, "key_seed", lambda challenger, tid: own({"kind": "self"}, tid)):
      proof = _train_from_the_slot(self.client.experiment("alice/own-keys"))
    status = self.client.wait_for_verdict(proof.proof_id, 180)
    self.assertEqual(status["state"], "invalid", status)
    code, report = testing.zkdv_verify(self._download(proof.proof_id), "--server-key", self.key,
                                "--strict")
    self.assertEqual(code, 1)
    findings = json.dumps(report["findings"])
    self.assertIn("is not the proof's start key (derived from its slot)", findings)
    self.assertIn("is not the proof's key of step", findings)

  def test_a_check_answered_with_other_openings_is_invalid_naming_it(self):
    honest = openings_lib.Openings.update

    def forged(openings, segment, jobs, replay):
      # The prover answers with a start state it did not commit (e.g. the weights it
      # wished it had trained from); its own replay of them is what it reports.
      first = jobs[0]
      opened = [None if a is None else np.array(a, copy=True) for a in first.opened]
      opened[first.program.state_indices[-1]] += 1
      jobs = [dataclasses.replace(first, opened=opened), *jobs[1:]]
      return honest(openings, segment, jobs, replay)

    with mock.patch.object(openings_lib.Openings, "update", forged):
      proof = _train(self.client.experiment("alice/forged-openings"), steps=6, update_p=1.0,
                     finish_raises=zkdv.errors.ReplayError)
    status = self.client.wait_for_verdict(proof.proof_id, 180)
    self.assertEqual(status["state"], "invalid", status)
    self.assertRegex(status["failure"], r"opening.*check of step 0|check of step 0.*opening")
    self.assertIn("does not match its commitment", status["failure"])


class ServerRestartTest(absltest.TestCase):

  def test_a_server_restarted_mid_run_does_not_invalidate_an_honest_proof(self):
    server = LocalServer(workers=1, extra_args=("--min-update-check-probability", "1.0"))
    server.start()
    self.addCleanup(server.stop)
    client = dvbench.Client(server.url, token=server.token("alice"))
    self.addCleanup(client.close)
    killed, restarted = threading.Event(), threading.Event()
    lost = testing.ClientSays("cannot reach")
    logging.getLogger("dvbench.client").addHandler(lost)
    self.addCleanup(logging.getLogger("dvbench.client").removeHandler, lost)

    def start_again():  # once the client says it lost the server, while training waits
      if lost.event.wait(120):
        server.start()
        restarted.set()

    def restart(step):
      if step == 4:  # the server dies; training runs into the window and waits
        server.kill()
        killed.set()
        threading.Thread(target=start_again, daemon=True).start()

    proof = _train(client.experiment("alice/restart"), steps=12, on_step=restart)
    self.assertTrue(killed.is_set() and restarted.is_set())
    self.assertEqual(proof.steps, 12)
    status = client.wait_for_verdict(proof.proof_id, 180)
    self.assertEqual(status["state"], "verified steps", repr(status))  # start unattested
    records = transcript.read_transcript(self._server_copy(server, proof.proof_id)).records
    self.assertEqual(sum(r.record["type"] == "step" for r in records), 12)

  def _server_copy(self, server, proof_id) -> pathlib.Path:
    folder = pathlib.Path(tempfile.mkdtemp())
    (folder / transcript.RECORDS_FILE).write_bytes(
        httpx.get(f"{server.url}/api/v1/proofs/{proof_id}/transcript").content)
    return folder


class DamagedStorageTest(absltest.TestCase):

  def test_a_damaged_records_file_makes_a_proof_unverifiable_never_invalid(self):
    # The server's disk, not the prover, damaged a probe record kept out of the database:
    # the worker reports it as the server's fault, and the proof could not be verified.
    server = LocalServer(workers=0, extra_args=("--min-update-check-probability", "1.0",
                                                "--max-attempts", "1")).start()
    self.addCleanup(server.stop)
    client = dvbench.Client(server.url, token=server.token("alice"))
    self.addCleanup(client.close)
    proof = _train(client.experiment("alice/damaged"), steps=3,
                   batch=np.tile(testing.TUTORIAL_BATCH, (1024, 1)))
    store = Store.open(f"sqlite:///{server.data / 'dvbench.db'}")
    self.addCleanup(store.engine.dispose)
    path = store.bodies.path(proof.proof_id)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    for _ in range(2):  # the attempt that meets the damage, then the claim that gives up
      subprocess.run([sys.executable, "-m", "dvbench.cli", "worker", "--data", str(server.data),
                      "--once", "--max-attempts", "1"], cwd=REPO, check=True,
                     capture_output=True)
    status = client.proof_status(proof.proof_id)
    self.assertEqual(status["state"], "unverifiable", status)
    self.assertRegex(status["failure"], r"^could not verify: verification was given up after 1 "
                     r"attempts; the last one ended because record [0-9a-f]{64} of proof "
                     f"{proof.proof_id} is damaged in the server's storage")
    self.assertIn("a fault of this server, not of the prover", status["failure"])
    download = httpx.get(f"{server.url}/api/v1/proofs/{proof.proof_id}/transcript")
    self.assertEqual(download.status_code, 503, download.text[:200])  # before: 200, cut short
    self.assertIn("damaged in the server's storage", download.json()["error"])

  def test_a_damaged_tail_met_by_ingestion_answers_503_naming_the_server(self):
    # A step record over 4 KiB (64 long metric names) is kept in the records file; the next
    # envelope reads it back as the open segment's tail. Before: a bare 500 ("ingestion
    # failed: StoredRecordDamaged"), which clients retry as a passing fault.
    server = LocalServer(workers=0).start()
    self.addCleanup(server.stop)
    prover = FakeProver(server.url, server.token("alice"), "alice/tail", segment_length=4)
    self.addCleanup(prover.http.close)
    prover.start("tail")
    many = {f"metric_{i:02d}_" + "x" * 80: bytes(32) for i in range(64)}
    prover.step(metrics=many)
    store = Store.open(f"sqlite:///{server.data / 'dvbench.db'}")
    self.addCleanup(store.engine.dispose)
    path = store.bodies.path(prover.proof_id)
    self.assertGreater(path.stat().st_size, 4096)  # the step record, out of line
    path.write_bytes(b"\0" * path.stat().st_size)
    response = prover.send(prover.step_record())
    self.assertEqual(response.status_code, 503, response.text)
    self.assertRegex(response.json()["error"], f"record [0-9a-f]{{64}} of proof "
                     f"{prover.proof_id} is damaged in the server's storage .* a fault of "
                     "this server, not of the prover")


if __name__ == "__main__":
  absltest.main()
