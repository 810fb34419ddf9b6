"""What a server's state certifies, attacked as a dishonest prover would, against a real
`dvbench serve` and `zkdv verify --strict`.

- The server's state is the strict verdict: an unattested start or a tolerance check is
  never "verified", and the state, label, JSON, receipt and page name what does not hold.
- An honest proof whose server drew no update check is "unchallenged", not "invalid".
- A challenge key given by hand (a receipt's, or a prover's own server's) proves nothing:
  the challenges claim, and every claim resting on the server's secrets, could not be
  verified.
- Free retries: a prover that drops every proof whose faked segment was challenged, and
  retries in throwaway experiments, shows in its owner's attempts, whose escape
  probability accounts for them; slots per owner are rate-limited.
"""

import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

import httpx
import jax
import jax.numpy as jnp
import optax
from absl.testing import absltest

import dvbench
import zkdv
from dvbench import transport
from dvbench.server import labels
from dvbench.server import leaderboard
from dvbench.server import schema
from dvbench.server import worker
from dvbench.server.db import Store
from dvbench.server.local import LocalServer
from tests import testing
from tests import fake_prover
from tests.fake_prover import FakeProver
from zkdv import receipt
from zkdv.verify import claims as claims_lib

REPO = pathlib.Path(__file__).resolve().parent.parent
SLOTS_PER_HOUR = 40
RETRY_P = 0.5  # the cheater's proofs: each one-step segment challenged with probability 1/2
MAX_RETRIES = 30  # all 30 escaping or all caught: 2 * 2**-30


def portable_dense(variables, tokens):
  """TinyClassifier's computation in jax.numpy: replays match within a tolerance only."""
  p = variables["params"]["Dense_0"]
  return tokens.astype(jnp.float32) @ p["kernel"] + p["bias"]


def train(client, experiment: str, p: float, *, attested_start: bool = False,
          steps: int = 2, **create_kwargs) -> str:
  """The tutorial's classifier trained through ``experiment``; returns the proof id."""
  proof = client.experiment(experiment).proof(backend="jax", config=zkdv.ZKDVConfig(
      sampling_policy=zkdv.SamplingPolicy(update_check_probability=p)))
  model = testing.TinyClassifier()
  init = proof.init if attested_start else (lambda f, *args: f(*args))
  params = init(model.init, jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
  state = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply, params=params,
                                             tx=optax.adam(1e-2), **create_kwargs)
  train_step = proof.jit(testing.classifier_step)
  for t in range(steps):
    state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + (t % 2))
  proof.finish()
  return proof.proof_id



class ServerStateTest(absltest.TestCase):
  """Honest and dishonest JAX runs on one server (minimum p tiny: each run picks its own)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # Every step probed (a ratio of 1/32): at 0.01 a two-step run probes none a run in two.
    cls.server = LocalServer(workers=1, extra_args=(
        "--min-update-check-probability", "1e-9", "--min-probe-ratio", "0.03125",
        "--max-slots-per-hour", str(SLOTS_PER_HOUR))).start()
    cls.client = dvbench.Client(cls.server.url, token=cls.server.token("alice"))
    cls.server_key = httpx.get(f"{cls.server.url}/api/v1/server-key").json()["server_key"]
    cls.proofs = {
        "unattested": train(cls.client, "alice/unattested", 1.0),
        "tolerance": train(cls.client, "alice/tolerance", 1.0, attested_start=True,
                           attest_apply_fn=portable_dense),
        "attested": train(cls.client, "alice/attested", 1.0, attested_start=True),
        # p = 1e-9: the server draws no update check but once in about 10**9 runs.
        "unchallenged": train(cls.client, "alice/short", 1e-9, steps=1),
    }
    cls.status = {name: cls.client.wait_for_verdict(proof_id, 240)
                  for name, proof_id in cls.proofs.items()}
    cls.downloaded = {}

  @classmethod
  def tearDownClass(cls):
    cls.client.close()
    cls.server.stop()
    super().tearDownClass()

  def download(self, name: str) -> pathlib.Path:
    """A fresh copy of the proof as `dvbench download` writes it (downloaded once)."""
    if name not in self.downloaded:
      self.downloaded[name] = pathlib.Path(tempfile.mkdtemp()) / name
      subprocess.run([sys.executable, "-m", "dvbench.cli", "download", self.proofs[name],
                      str(self.downloaded[name]), "--url", self.server.url], cwd=REPO,
                     check=True, capture_output=True)
    folder = pathlib.Path(tempfile.mkdtemp()) / name
    shutil.copytree(self.downloaded[name], folder)
    return folder

  def receipt_fields(self, name: str) -> dict:
    return receipt.open_receipt((self.download(name) / receipt.RECEIPT_FILE).read_bytes(),
                                bytes.fromhex(self.server_key))

  def test_an_unattested_start_is_verified_steps_never_verified(self):
    status = self.status["unattested"]
    self.assertEqual(status["state"], "verified steps", str(status))
    self.assertEqual(status["shortfalls"], ["start unattested"])
    self.assertTrue(status["label"].startswith("verified steps — start unattested: "),
                    str(status))
    self.assertFalse(status["ranked_state"])
    self.assertEqual(self.receipt_fields("unattested")["standing"],
                     {"state": "verified steps", "shortfalls": ["start unattested"],
                      "label": "verified steps — start unattested", "base_checkpoint": None})
    page = httpx.get(f"{self.server.url}/proofs/{self.proofs['unattested']}").text
    self.assertIn("verified steps — start unattested", page)
    code, report = testing.zkdv_verify(self.download("unattested"), "--strict", "--server-key",
                               self.server_key)
    self.assertEqual((code, report["unmet"]), (1, ["start"]), str(report))
    self.assertEqual(report["standing"]["label"], "verified steps — start unattested")

  def test_a_tolerance_check_is_within_tolerance_never_verified(self):
    status = self.status["tolerance"]
    self.assertEqual(status["state"], "within tolerance", str(status))
    self.assertTrue(status["label"].startswith("within tolerance: "), str(status))
    self.assertEqual(self.receipt_fields("tolerance")["standing"]["state"], "within tolerance")
    code, report = testing.zkdv_verify(self.download("tolerance"), "--strict", "--server-key",
                               self.server_key)
    self.assertEqual((code, report["unmet"]), (1, ["replays"]), str(report))
    replays = next(c for c in report["claims"] if c["name"] == "replays")
    self.assertIn("--strict requires exact replays", replays["detail"])

  def test_every_claim_holding_is_verified_with_every_step_probed(self):
    status = self.status["attested"]
    self.assertEqual((status["state"], status["shortfalls"]), ("verified", []), str(status))
    self.assertEqual(status["policy"]["probe_ratio"], 0.03125)  # the server's minimum
    code, report = testing.zkdv_verify(self.download("attested"), "--strict", "--server-key",
                               self.server_key)
    self.assertEqual((code, report["standing"]["state"]), (0, "verified"), str(report))

  def test_an_honest_proof_without_an_update_check_is_unchallenged(self):
    status = self.status["unchallenged"]
    self.assertEqual(status["state"], "unchallenged", str(status))
    self.assertIsNone(status["failure"])
    self.assertEqual(status["server_challenges"]["update"], 0)
    self.assertIn("the server chose no update check", status["label"])
    self.assertEqual(self.receipt_fields("unchallenged")["standing"]["state"], "unchallenged")

  def test_a_challenge_key_given_by_hand_confirms_none_of_the_servers_secrets(self):
    # A prover running its own server knows its nonce and key K before its first step, and
    # hands K to an auditor. Before, replays, start, program and data held with such a key
    # ("one faked step escapes with probability 1 - p", "from the slot's key") and
    # --require replays,start,program,data exited 0: only chain and challenges said no.
    folder = self.download("attested")
    published = self.receipt_fields("attested")["challenge_key"]
    (folder / receipt.RECEIPT_FILE).unlink()  # the receipt binds the records; drop it
    key_file = folder.parent / "published.key"
    key_file.write_text(published.hex())
    code, report = testing.zkdv_verify(folder, "--challenge-key-file", str(key_file),
                                       "--require", "replays,start,program,data")
    claims = {c["name"]: c for c in report["claims"]}
    self.assertEqual(code, 2, str(report))
    self.assertEqual(claims["challenges"]["status"], "could not verify")
    self.assertIn("given by hand", claims["challenges"]["detail"])
    self.assertEqual(claims["chain"]["status"], "could not verify")
    for name in claims_lib.ON_SERVER_SECRETS:
      self.assertEqual(claims[name]["status"], "could not verify", name)
      self.assertIn("unconfirmed: this rests on the slot's nonce and challenge key being the "
                    "server's secrets, which only the server's signed receipt for this "
                    "transcript shows (the challenge key was given by hand)",
                    claims[name]["detail"])
    self.assertEqual(report["standing"]["state"], "could not verify")
    # DVBench's worker gives the verifier the server's own key: every claim holds there.
    self.assertEqual(set(worker.server_claims(report, "dvbench").values()), {"holds"})
    code, report = testing.zkdv_verify(self.download("attested"), "--server-key",
                                       self.server_key, "--require",
                                       "replays,start,program,data")
    self.assertEqual(code, 0, str(report))  # the receipt confirms them


class CheckpointSquatTest(absltest.TestCase):
  """Another owner's proof declaring an honest run's final params, closed first."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=0).start()
    cls.store = Store.open(f"sqlite:///{(cls.server.data / 'dvbench.db').resolve()}")

  @classmethod
  def tearDownClass(cls):
    cls.store.engine.dispose()
    cls.server.stop()
    super().tearDownClass()

  def prover(self, owner: str, experiment: str) -> FakeProver:
    prover = FakeProver(self.server.url, self.server.token(owner), experiment).start()
    self.addCleanup(prover.http.close)
    return prover

  def test_a_final_record_read_before_its_proof_closed_makes_no_original(self):
    alice = self.prover("alice", "alice/honest")
    alice.run(3)
    final = alice.chain({"type": "final", "steps": alice.steps, "status": "clean",
                         "discontinuities": [], "final_state": alice.state,
                         "final_state_leaves": [], "final_params": bytes(range(32))})
    self.assertEqual(alice.send(final).status_code, 200)
    # Bob reads alice's final params from her open transcript and closes a proof of no
    # step declaring them before she closes hers.
    transcript = httpx.get(f"{self.server.url}/api/v1/proofs/{alice.proof_id}/transcript")
    declared = [r for _, r in transport.RecordScanner().feed(transcript.content)
                if r["type"] == "final"][0]["final_params"]
    bob = self.prover("bob", "bob/squat")
    bob_final = bob.chain({"type": "final", "steps": 0, "status": "clean",
                           "discontinuities": [], "final_state": bob.state,
                           "final_state_leaves": [], "final_params": declared})
    self.assertEqual(bob.send(bob_final).status_code, 200)
    self.assertEqual(bob.close().json()["state"], "closed")
    self.assertEqual(alice.close().json()["state"], "closed")
    # Before, bob's proof was the original and alice's "a copy ... which closed first":
    # her submission refused, her entry earning nothing. Declared params are no original.
    honest = self.store.proof(alice.proof_id)
    self.assertIsNone(leaderboard.copy_of(self.store, honest))
    # Once alice's replays hold, hers is the original, and bob's a copy of it; a verified
    # proof whose start was these very params (a base trained to itself) is not.
    self.store.set_proof_state(alice.proof_id, "verified")
    self.store.set_proof_state(bob.proof_id, "verified")
    with self.store.engine.begin() as conn:
      conn.execute(schema.proof_claims.insert().values(
          proof_id=bob.proof_id, strict=True,
          claims=json.dumps({labels.BASE_CHECKPOINT: bytes(range(32)).hex()})))
    self.assertIsNone(leaderboard.copy_of(self.store, honest))
    self.assertEqual(leaderboard.copy_of(self.store, self.store.proof(bob.proof_id))["id"],
                     alice.proof_id)


class RetriesTest(absltest.TestCase):
  """A prover fakes one segment and drops every proof in which it was challenged."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=1, extra_args=(
        "--min-update-check-probability", "0.1",
        "--max-slots-per-hour", str(SLOTS_PER_HOUR))).start()

  @classmethod
  def tearDownClass(cls):
    cls.server.stop()
    super().tearDownClass()

  def attempt(self, token: str, experiment: str) -> tuple[FakeProver, bool]:
    """One proof faking step 1 of 3; (the prover, whether the fake was challenged)."""
    prover = FakeProver(self.server.url, token, experiment)
    self.addCleanup(prover.http.close)
    slot = prover.slot()
    root = prover.root(slot, policy={**slot["policy"], "segment_length": 1,
                                     "update_check_probability": RETRY_P})
    self.assertEqual(prover.post_root(root).status_code, 201)
    outcome = prover.run(3, faked={1})
    return prover, bool(outcome.faked_hit)

  def test_dropped_attempts_show_in_attempts_and_the_escape_probability(self):
    token = self.server.token("mallory")
    caught, winner = 0, None
    for n in range(MAX_RETRIES):  # a fresh throwaway experiment each time
      prover, challenged = self.attempt(token, f"mallory/throwaway-{n}")
      if challenged:
        caught += 1  # dropped right after the unanswered challenge
      elif caught:
        winner = prover
        break
    self.assertIsNotNone(winner, "the faked segment never escaped after being caught")
    self.assertEqual(winner.finish().status_code, 200)
    status = dvbench.Client(self.server.url).wait_for_verdict(winner.proof_id, 120)
    shown = status["attempts"]  # every slot taken counts, the winner's too
    self.assertEqual((shown["slots"], shown["after_unanswered_challenge"]), (n + 1, caught))
    self.assertAlmostEqual(shown["escape_probability_over_attempts"],
                           1 - RETRY_P ** shown["slots"])
    self.assertIn(f"{caught} stopped right after an unanswered challenge", shown["summary"])
    self.assertIn(f"over its owner's {n + 1} attempts", status["label"])
    page = httpx.get(f"{self.server.url}/proofs/{winner.proof_id}").text
    self.assertIn(f"mallory took {n + 1} proof slots across all of its experiments", page)
    # The winner's own experiment shows the attempts made in the throwaway ones.
    experiment = httpx.get(f"{self.server.url}/api/v1/experiments/mallory/"
                           f"throwaway-{n}").json()
    self.assertEqual(experiment["attempts"]["slots"], n + 1)
    page = httpx.get(f"{self.server.url}/experiments/mallory/throwaway-{n}").text
    self.assertIn(f"mallory took {n + 1} proof slots across all of its experiments", page)
    signed = httpx.get(f"{self.server.url}/api/v1/proofs/{winner.proof_id}/receipt").content
    key = bytes.fromhex(httpx.get(f"{self.server.url}/api/v1/server-key").json()["server_key"])
    fields = receipt.open_receipt(signed, key)
    self.assertEqual((fields["attempts"]["slots"],
                      fields["attempts"]["after_unanswered_challenge"]), (n + 1, caught))

  def test_a_dropped_attempt_still_counts_once_the_server_marks_it_crashed(self):
    # A dropped proof falls silent; the server's sweep (--crash-after) makes it crashed.
    # Counting only proofs still receiving, invalid or abandoned, the receipt of the next
    # attempt said "0 stopped right after an unanswered challenge".
    token = self.server.token("trudy")
    for n in range(MAX_RETRIES):
      prover, challenged = self.attempt(token, f"trudy/throwaway-{n}")
      if challenged:
        break
    self.assertTrue(challenged, "no attempt's fake was challenged")
    store = Store.open(f"sqlite:///{self.server.data / 'dvbench.db'}")
    crashed, _ = store.settle_silent_proofs(silent_seconds=0.0)  # the sweep, run now
    self.assertIn(prover.proof_id, crashed)
    shown = httpx.get(f"{self.server.url}/api/v1/experiments/trudy/throwaway-{n}").json()
    self.assertEqual(shown["attempts"]["by_outcome"], {"crashed": n + 1})
    self.assertEqual(shown["attempts"]["after_unanswered_challenge"], 1)
    self.assertIn("1 stopped right after an unanswered challenge", shown["attempts"]["summary"])

  def test_a_caught_attempt_answered_without_openings_still_counts(self):
    # Its answer to the challenged segment claims the replay matched, names openings it
    # never uploads, then the proof falls silent: counting only challenges with no record,
    # the attempts read "0 stopped right after an unanswered challenge", a plain crash.
    token = self.server.token("oscar")
    prover = FakeProver(self.server.url, token, "oscar/throwaway")
    self.addCleanup(prover.http.close)
    slot = prover.slot()
    root = prover.root(slot, policy={**slot["policy"], "segment_length": 1,
                                     "update_check_probability": 1.0})
    self.assertEqual(prover.post_root(root).status_code, 201)
    prover.upload = fake_prover.digest  # openings named, never sent
    prover.run(2)
    store = Store.open(f"sqlite:///{self.server.data / 'dvbench.db'}")
    crashed, _ = store.settle_silent_proofs(silent_seconds=0.0)  # the sweep, run now
    self.assertIn(prover.proof_id, crashed)
    shown = httpx.get(f"{self.server.url}/api/v1/experiments/oscar/throwaway").json()
    self.assertEqual(shown["attempts"]["by_outcome"], {"crashed": 1})
    self.assertEqual(shown["attempts"]["after_unanswered_challenge"], 1)

  def test_slots_per_owner_are_rate_limited_with_a_typed_429(self):
    http = httpx.Client(base_url=self.server.url, headers={
        "Authorization": f"Bearer {self.server.token('greedy')}"})
    self.addCleanup(http.close)
    for n in range(SLOTS_PER_HOUR):
      self.assertEqual(http.post(f"/api/v1/experiments/greedy/run-{n % 3}/slots").status_code,
                       201)
    refused = http.post("/api/v1/experiments/greedy/another/slots")
    self.assertEqual(refused.status_code, 429, refused.text)
    self.assertIn(f"at most {SLOTS_PER_HOUR} per owner per hour", refused.json()["error"])
    self.assertIn("--max-slots-per-hour", refused.json()["error"])
    self.assertGreater(int(refused.headers["retry-after"]), 0)


if __name__ == "__main__":
  absltest.main()
