"""Server challenges, custody and receipts against a real `dvbench serve` on loopback.

Each attack is played by a pure-Python prover (tests/fake_prover.py) that writes
format-3 records by hand; no JAX is involved.
"""

import ast
import os
import pathlib
import subprocess
import sys
import tempfile

import blake3
import cbor2
import httpx
from absl.testing import absltest

from dvbench.server import worker
from dvbench.server.db import Store
from dvbench.server.local import LocalServer
from tests import postgres
from tests import testing
from tests.fake_prover import FakeProver, digest
from zkdv import challenge
from zkdv import errors
from zkdv import receipt
from zkdv import verify
from zkdv.transcript import BLOBS_DIR, RECORDS_FILE, encode_record, record_id
from zkdv.verify import claims

REPO = pathlib.Path(__file__).resolve().parent.parent


class ServerChallengeTestCase(absltest.TestCase):
  """One server (update check probability at least 0.5, no workers) per test class."""

  workers = 0
  database_url = None  # SQLite in the server's data folder

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=cls.workers, database_url=cls.database_url, extra_args=(
        "--min-update-check-probability", "0.5", "--max-window", "16")).start()
    cls.token = cls.server.token("alice")
    cls.mallory = cls.server.token("mallory")

  @classmethod
  def tearDownClass(cls):
    cls.server.stop()
    super().tearDownClass()

  def prover(self, experiment: str = "alice/run", token: str | None = None,
             segment_length: int = 1, probe_ratio: float | None = None) -> FakeProver:
    prover = FakeProver(self.server.url, token or self.token, experiment, segment_length,
                        probe_ratio)
    self.addCleanup(prover.http.close)
    return prover

  def get(self, path: str) -> httpx.Response:
    return httpx.get(self.server.url + path, timeout=30)

  def proof(self, proof_id: str) -> dict:
    return self.get(f"/api/v1/proofs/{proof_id}").json()

  def assertRefused(self, response: httpx.Response, status: int, *fragments: str):
    self.assertEqual(response.status_code, status, response.text)
    for fragment in fragments:
      self.assertIn(fragment, response.json()["error"])

  def store(self) -> Store:
    return Store.open(self.database_url or f"sqlite:///{self.server.data / 'dvbench.db'}")


class FakedStepsTest(ServerChallengeTestCase):

  def test_faked_unsampled_steps_are_caught_at_p_one_half(self):
    prover = self.prover().start()
    faked = set(range(5, 29))  # 24 faked steps: all escape with probability 2**-24
    outcome = prover.run(steps=30, faked=faked)
    self.assertNotEmpty(outcome.faked_hit, "no challenge hit any of the 24 faked steps")
    self.assertTrue(all(outcome.decisions[t].update for t in outcome.faked_hit))
    response = prover.finish()
    self.assertEqual(response.status_code, 200, response.text)
    self.assertEqual(response.json()["state"], "invalid")
    first = min(outcome.faked_hit)
    self.assertIn(f"step {first} was challenged for an update check and never answered",
                  response.json()["failure"])
    status = self.proof(prover.proof_id)
    self.assertEqual(status["state"], "invalid")
    self.assertEqual(status["challenger"], "dvbench")
    self.assertEqual(status["update_check_probability"], 0.5)

  def test_faked_steps_inside_segments_are_caught_with_probability_p(self):
    prover = self.prover(segment_length=4).start()
    faked = {4 * s + s % 3 for s in range(30)}  # one faked step inside each segment
    outcome = prover.run(steps=120, faked=faked)
    ends = sorted(outcome.segments)
    self.assertEqual(ends, list(range(3, 120, 4)))
    # The server requires update checks at segment ends only, each with probability 1/2.
    required = sorted(r["step"] for r in self.store().challenge_rows(prover.proof_id)
                      if r["needs_update"])
    self.assertTrue(set(required) <= set(ends), required)
    caught = sorted(outcome.faked_hit)
    self.assertEqual(caught, sorted(t for t in faked if (t | 3) in required))
    # Binomial(30, 1/2): 15 expected; outside [5, 25] has probability < 1e-4.
    self.assertBetween(len(caught), 5, 25)
    response = prover.finish()
    self.assertEqual(response.json()["state"], "invalid", response.text)
    self.assertIn(f"step {caught[0] | 3} was challenged for an update check and never "
                  "answered", self.proof(prover.proof_id)["failure"])

  def test_a_root_with_longer_segments_than_the_server_allows_is_refused(self):
    prover = self.prover(segment_length=128)
    self.assertRefused(prover.post_root(prover.root(prover.slot())), 409,
                       "weaker than the server's minimum", "segment_length")

  def test_unanswered_challenge_is_invalid_naming_the_step(self):
    prover = self.prover(probe_ratio=1 / 32).start()  # the least ratio probing every step
    outcome = prover.run(steps=12, skip_answer={7, 8, 9, 10, 11})
    self.assertTrue(outcome.decisions[7].probed)
    response = prover.finish()
    self.assertEqual(response.json()["state"], "invalid", response.text)
    # Every step's rows are probed, so the first step left unanswered is the one named.
    self.assertRegex(self.proof(prover.proof_id)["failure"],
                     r"^step 7 was challenged for (an update check|probes) and never answered")

  def test_every_challenge_answered_closes_for_replay(self):
    prover = self.prover().start()
    outcome = prover.run(steps=10)
    response = prover.finish()
    self.assertEqual(response.json()["state"], "closed", response.text)
    status = self.proof(prover.proof_id)
    counts = status["server_challenges"]
    required = sum(d.update for d in outcome.decisions.values())
    probes = sum(d.probed for d in outcome.decisions.values())
    self.assertEqual((counts["update"], counts["probe"]), (required, probes))
    self.assertEqual(counts["answered"], required + probes)
    self.assertNotIn("verified", status["label"])

  def test_a_step_its_challenge_did_not_probe_owes_no_probe_record(self):
    # Format 9 required a probe record of every step at any ratio above 0: at the server's
    # default 0.01 each step paid a record opening a Merkle row of every batch leaf.
    prover = self.prover().start()
    self.assertEqual(prover.policy.probe_ratio, 0.01)
    outcome = prover.run(steps=40)  # answers what required_checks requires, nothing more
    probed = sorted(t for t, d in outcome.decisions.items() if d.probed)
    needs = sorted(r["step"] for r in self.store().challenge_rows(prover.proof_id)
                   if r["needs_probe"])
    self.assertEqual(needs, probed)
    # Binomial(40, 0.32): 12.8 expected; outside [2, 30] has probability < 1e-5.
    self.assertBetween(len(probed), 2, 30)
    response = prover.finish()
    self.assertEqual(response.json()["state"], "closed", response.text)
    counts = self.proof(prover.proof_id)["server_challenges"]
    self.assertEqual(counts["probe"], len(probed))

  def test_acks_carry_the_challenges_of_stored_and_resent_steps(self):
    prover = self.prover().start()
    raw = prover.step_record()
    first = prover.send(raw).json()
    self.assertEqual([c["step"] for c in first["challenges"]], [0])
    self.assertEqual(first["challenges"][0]["record_id"], record_id(raw).hex())
    again = prover.send(raw).json()  # a new envelope, the same record: a duplicate
    self.assertEqual((again["stored"], again["duplicates"]), (0, 1))
    self.assertEqual(again["challenges"], first["challenges"])
    listed = self.get(f"/api/v1/proofs/{prover.proof_id}/challenges").json()
    self.assertEqual(listed[0]["challenge"], first["challenges"][0]["challenge"])


class CustodyTest(ServerChallengeTestCase):

  def test_truncation_and_re_final_are_refused(self):
    prover = self.prover().start()
    prover.run(steps=8)
    steps = [r for r in prover.records if cbor2.loads(r)["type"] == "step"]
    truncated = prover.final_record(steps=6, prev=record_id(steps[5]))
    position = prover.records.index(steps[5]) + 1
    self.assertRefused(prover.send(truncated), 409, f"rewrite position {position}")
    prover.send(prover.final_record())
    self.assertRefused(prover.send(truncated), 409, "never re-finalized")
    self.assertEqual(self.get(f"/api/v1/proofs/{prover.proof_id}/records").json(),
                     [record_id(r).hex() for r in prover.records],
                     "custody does not hold exactly the records sent")

  def test_a_rewrite_at_a_used_position_is_refused_naming_it(self):
    prover = self.prover().start()
    prover.run(steps=4)
    after_root = prover.records[0]
    rewrite = prover.chain({"type": "step", "index": 0, "program": 0, "pre_state": digest(b"x"),
                            "batch": digest(b"y"), "post_state": digest(b"z")},
                           prev=record_id(after_root))
    self.assertRefused(prover.send(rewrite), 409, "rewrite position 1")

  def test_editing_and_re_chaining_a_stored_record_is_refused(self):
    prover = self.prover().start()
    prover.run(steps=5)
    steps = [r for r in prover.records if cbor2.loads(r)["type"] == "step"]
    edited = {**cbor2.loads(steps[2]), "post_state": digest(b"another model")}
    position = prover.records.index(steps[2])
    response = prover.send(encode_record(edited))
    self.assertRefused(response, 409, f"rewrite position {position}")

  def test_splicing_two_runs_is_refused(self):
    first, second = self.prover().start("first"), self.prover().start("second")
    first.run(steps=4)
    second.run(steps=2)
    spliced = first.records[-1]  # chained to the first run's records
    self.assertRefused(second.send(spliced), 409, "another transcript")

  def test_steps_must_carry_the_next_index(self):
    prover = self.prover().start()
    prover.run(steps=2)
    skipped = prover.chain({"type": "step", "index": 5, "program": 0, "pre_state": prover.state,
                            "batch": digest(b"b"), "post_state": digest(b"p")})
    self.assertRefused(prover.send(skipped), 409, "the next step record is step 2")
    early = prover.chain({"type": "check", "step": 2, "kind": "state", "post_state_blobs": []})
    self.assertRefused(prover.send(early), 409, "before its step record")

  def test_a_start_check_links_step_0_only_and_any_other_kind_is_refused(self):
    prover = self.prover().start()
    prover.run(steps=2)
    late = prover.chain({"type": "check", "step": 1, "kind": "start", "pre_state_pieces": []})
    self.assertRefused(prover.send(late), 409, "only step 0 starts a proof")
    odd = prover.chain({"type": "check", "step": 0, "kind": "everything"})
    self.assertRefused(prover.send(odd), 400, "(check).kind: one of")
    start = prover.chain({"type": "check", "step": 0, "kind": "start", "pre_state_pieces": []})
    self.assertEqual(prover.send(start).status_code, 200)

  def test_unsafe_or_non_deterministic_records_are_refused(self):
    prover = self.prover().start()
    tagged = cbor2.dumps(cbor2.CBORTag(1, 0))
    self.assertRefused(prover.send(tagged), 400, "tags are not accepted")
    unsorted = cbor2.dumps({"type": "step", "index": 0, "prev": prover.last_id})
    self.assertRefused(prover.send(unsorted), 400, "deterministically")
    deep = encode_record({"type": "check", "prev": prover.last_id,
                          "result": [[[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]]})
    self.assertRefused(prover.send(deep), 400, "deeper than")
    self.assertLen(self.get(f"/api/v1/proofs/{prover.proof_id}/records").json(), 1)

  def test_no_assert_on_request_data_in_the_server(self):
    for path in (REPO / "dvbench" / "server").glob("*.py"):
      tree = ast.parse(path.read_text())
      asserts = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)]
      self.assertEqual(asserts, [], f"{path.name} validates with assert at lines {asserts}")


class AnswersTest(ServerChallengeTestCase):
  """A check is answered once: a second answer is refused, and an envelope's answers to
  earlier envelopes' steps are marked together or not at all."""

  def test_a_second_answer_to_a_check_is_refused_in_its_steps_envelope_and_later(self):
    # Answers to a step stored in the same envelope are counted before the envelope's
    # challenges are written; a second answer is refused there and in a later envelope.
    prover = self.prover().start()
    step = prover.step_record(ends=True)
    first = prover.chain({"type": "check", "step": 0, "kind": "state", "post_state_blobs": []},
                         prev=record_id(step))
    again = prover.chain({"type": "check", "step": 0, "kind": "state", "post_state_blobs": []},
                         prev=record_id(first))
    self.assertRefused(prover.send(step, first, again), 409,
                       "record 2: step 0's state check was already answered by another record")
    self.assertEqual(prover.send(step, first).status_code, 200)
    later = prover.chain({"type": "check", "step": 0, "kind": "state", "post_state_blobs": []})
    self.assertRefused(prover.send(later), 409,
                       "record 0: step 0's state check was already answered by another record")
    rows = self.store().challenge_rows(prover.proof_id)
    self.assertEqual([(r["step"], r["answered_state"]) for r in rows], [(0, True)])

  def test_answers_to_earlier_envelopes_steps_are_written_together_or_not_at_all(self):
    # Checks of steps stored by earlier envelopes are marked answered in one statement at
    # the acknowledgement; one already answered refuses the envelope, naming its record,
    # and marks none of the others.
    prover = self.prover().start()
    prover.step(ends=True)
    prover.step(ends=True)
    prover.step(ends=True)

    def answer(step, prev=None):
      return prover.chain({"type": "check", "step": step, "kind": "state",
                           "post_state_blobs": []}, prev=prev)

    first = answer(0)
    self.assertEqual(prover.send(first).status_code, 200)
    one = answer(1)
    two = answer(2, prev=record_id(one))
    zero = answer(0, prev=record_id(two))
    self.assertRefused(prover.send(one, two, zero), 409,
                       "record 2: step 0's state check was already answered by another record")
    one_again = answer(1, prev=record_id(two))
    self.assertRefused(prover.send(one, two, one_again), 409,
                       "record 2: step 1's state check was already answered by another record")
    answered = {r["step"]: r["answered_state"] for r in self.store().challenge_rows(
        prover.proof_id)}
    self.assertEqual(answered, {0: True, 1: False, 2: False})
    self.assertEqual(prover.send(one, two).status_code, 200)
    answered = {r["step"]: r["answered_state"] for r in self.store().challenge_rows(
        prover.proof_id)}
    self.assertEqual(answered, {0: True, 1: True, 2: True})

  def test_the_first_record_refused_is_named_though_earlier_steps_answers_are_written_late(self):
    prover = self.prover().start()
    for _ in range(4):
      prover.step(ends=True)

    def state(step, prev=None):
      return prover.chain({"type": "check", "step": step, "kind": "state",
                           "post_state_blobs": []}, prev=prev)

    def update(step, prev=None):
      return prover.chain({"type": "check", "step": step, "kind": "update", "first": step,
                           "pre_state_blobs": [], "batch_blobs": [[]]}, prev=prev)

    state_1 = state(1)
    self.assertEqual(prover.send(state_1, update(2, prev=record_id(state_1))).status_code, 200)
    # Kinds refused together: the lowest record, not the first kind's.
    fine = state(3)
    again_2 = update(2, prev=record_id(fine))
    self.assertRefused(prover.send(fine, again_2, state(1, prev=record_id(again_2))), 409,
                       "record 1: step 2's update check was already answered")
    # A record answered before, then a repeat within the request: the first is named.
    again_2 = update(2)
    new_3 = update(3, prev=record_id(again_2))
    self.assertRefused(prover.send(again_2, new_3, update(3, prev=record_id(new_3))), 409,
                       "record 0: step 2's update check was already answered")
    # A record answered before, then a break in the chain: the answer is named.
    self.assertRefused(prover.send(again_2, state(3, prev=b"\x01" * 32)), 409,
                       "record 0: step 2's update check was already answered")
    answered = {r["step"]: (r["answered_state"], r["answered_update"])
                for r in self.store().challenge_rows(prover.proof_id)}
    self.assertEqual(answered, {0: (False, False), 1: (True, False), 2: (False, True),
                                3: (False, False)})


class PostgresAnswersTest(postgres.OnPostgres, AnswersTest):
  """The same answers with the server's store on PostgreSQL."""


class RootBindingTest(ServerChallengeTestCase):

  def test_renaming_another_owners_transcript_is_refused(self):
    alice = self.prover("alice/model")
    root = alice.root(alice.slot())
    mallory = self.prover("mallory/model", token=self.mallory)
    self.assertRefused(mallory.post_root(root), 409, "not issued to 'mallory/model'")
    renamed = {**root, "challenger": {**root["challenger"], "owner": "mallory",
                                      "experiment": "mallory/model"}}
    self.assertRefused(mallory.post_root(renamed), 409, "not issued to 'mallory/model'")
    self.assertEqual(alice.post_root(root).status_code, 201)

  def test_foreign_and_reused_nonces_are_refused(self):
    prover = self.prover("alice/nonces")
    foreign = prover.slot("alice/another")
    self.assertRefused(prover.post_root(prover.root(foreign)), 409, "not issued to")
    made_up = {**prover.slot(), "nonce": os.urandom(32).hex()}
    self.assertRefused(prover.post_root(prover.root(made_up)), 409, "not issued to")
    slot = prover.slot()
    root = prover.root(slot, name="first")
    first = prover.post_root(root)
    self.assertEqual(first.status_code, 201, first.text)
    again = prover.post_root(root)  # the same root again: idempotent
    self.assertEqual((again.status_code, again.json()["id"]), (201, first.json()["id"]))
    self.assertRefused(prover.post_root(prover.root(slot, name="second")), 409, "already used")

  def test_a_root_must_match_its_slot_and_policy(self):
    prover = self.prover("alice/binding")
    cases = {"server_key": os.urandom(32), "key_commitment": os.urandom(32)}
    for field, value in cases.items():
      self.assertRefused(prover.post_root(prover.root(prover.slot(), **{field: value})), 409,
                         field)
    slot = prover.slot()
    weaker = {**slot["policy"], "update_check_probability": 0.1}
    self.assertRefused(prover.post_root(prover.root(slot, policy=weaker)), 409,
                       "update_check_probability")
    wider = {**slot["policy"], "rolling_window": 64}
    self.assertRefused(prover.post_root(prover.root(slot, policy=wider)), 409, "rolling_window")
    self.assertRefused(prover.post_root({**prover.root(slot), "challenger": None}), 400,
                       "the root record (root).challenger: a map")
    self.assertRefused(prover.post_root({**prover.root(slot), "challenger": {"kind": "x"}}),
                       409, "no challenger")

  def test_a_self_challenged_root_is_labelled_self_audited(self):
    prover = self.prover("alice/offline")
    root = prover.root(prover.slot())
    root["challenger"] = {"kind": "self", "seed_commitment": digest(b"seed"),
                          "policy": challenge.Policy(0.01).to_record()}
    response = prover.post_root(root)
    self.assertEqual(response.status_code, 201, response.text)
    status = self.proof(prover.proof_id)
    self.assertEqual(status["challenger"], "self")
    self.assertIn("self-audited (detects faults, not a dishonest prover)", status["label"])
    ack = prover.step()
    self.assertEqual(ack["challenges"], [], "the server chose checks for a self proof")
    page = self.get(f"/proofs/{prover.proof_id}").text
    self.assertIn("self-audited (detects faults, not a dishonest prover)", page)

  def test_clean_states_say_who_chose_what_was_replayed_and_what_else_holds(self):
    every = dict.fromkeys(verify.CLAIMS, "holds")
    exact, close = {"mode": "exact", "status": "verified"}, {"mode": "equivalent",
                                                             "status": "verified"}
    cases = [
        (("verified", [], every, [exact], True), ("self-audited", ())),
        (("could not verify", ["too_few_checks"], {**every, "replays": "could not verify"},
          [], False), ("unchallenged", ())),
        (("could not verify", ["too_few_checks"], every, [exact], False),
         ("could not verify", ())),
        (("verified", [], every, [exact], False), ("verified", ())),
        (("verified", [], {**every, "start": "does not hold"}, [exact], False),
         ("verified steps", ("start unattested",))),
        (("verified", [], {**every, "program": "does not hold", "data": "does not hold"},
          [exact], False), ("verified steps", ("program reads no batch", "data unprobed"))),
        (("verified", [], every, [exact, close], False), ("within tolerance", ())),
        (("invalid", ["replay"], every, [exact], False), ("invalid", ())),
    ]
    for args, (state, shortfalls) in cases:
      standing = claims.standing_of(*args)
      self.assertEqual((standing.state, standing.shortfalls), (state, shortfalls), args)
      self.assertEqual(standing.ranked, state == "verified")


class BlobCustodyTest(ServerChallengeTestCase):

  def test_a_blob_uploaded_only_for_another_proof_does_not_count(self):
    owner = self.prover("alice/blobs").start("owner")
    borrowed = owner.upload(b"the owner's opening")
    thief = self.prover("alice/blobs").start("thief")
    thief.run(steps=3)
    check = thief.chain({"type": "check", "step": 0, "kind": "state",
                         "post_state_blobs": [borrowed]})
    self.assertEqual(thief.send(check).status_code, 200)
    head = httpx.head(f"{self.server.url}/api/v1/proofs/{thief.proof_id}/blobs/{borrowed.hex()}")
    self.assertEqual(head.status_code, 404)
    self.assertEqual(self.get(f"/api/v1/proofs/{owner.proof_id}/blobs/{borrowed.hex()}"
                              ).status_code, 200)
    self.assertEqual(self.get(f"/api/v1/proofs/{thief.proof_id}/blobs/{borrowed.hex()}"
                              ).status_code, 404)
    self.assertNotIn(borrowed.hex(), self.get(f"/api/v1/proofs/{thief.proof_id}/blobs").json())
    self.assertEqual(thief.send(thief.final_record()).status_code, 200)
    self.assertRefused(thief.close(), 409, "not uploaded for this proof", borrowed.hex())

  def test_the_verifier_sees_only_the_proofs_own_blobs(self):
    first = self.prover("alice/private").start("first")
    first.run(steps=4)
    second = self.prover("alice/private").start("second")
    second.upload(b"only mine")
    work = pathlib.Path(tempfile.mkdtemp())
    store = self.store()
    from dvbench.server.blobs import BlobStore  # pylint: disable=g-import-not-at-top
    folder = worker.child_folder(work, BlobStore(self.server.data / "blobs"),
                                 store.proof_blob_digests(second.proof_id))
    self.assertFalse((work / BLOBS_DIR).is_symlink())
    self.assertEqual(sorted(p.name for p in (folder / BLOBS_DIR).iterdir()),
                     [digest(b"only mine").hex()])
    self.assertEqual(b"".join(store.record_data(second.proof_id)), b"".join(second.records))


class ReceiptTest(ServerChallengeTestCase):

  def _invalid_proof(self) -> FakeProver:
    prover = self.prover("alice/receipts").start()
    # 40 faked steps: all escape checks at p >= 1/2 with probability 2**-40 (10 with 2**-10)
    outcome = prover.run(steps=40, faked=set(range(40)))
    self.assertNotEmpty(outcome.faked_hit, "no challenge hit any of the 40 faked steps")
    self.assertEqual(prover.finish().json()["state"], "invalid")
    return prover

  def test_receipt_verifies_with_the_server_key_and_publishes_k(self):
    prover = self._invalid_proof()
    key = self.get("/api/v1/server-key").json()["server_key"]
    cli = subprocess.run([sys.executable, "-m", "dvbench.cli", "server-key", "--data",
                          str(self.server.data)], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()
    self.assertEqual(cli, key)
    encoded = self.get(f"/api/v1/proofs/{prover.proof_id}/receipt").content
    fields = receipt.open_receipt(encoded, key)
    self.assertEqual((fields["verdict"], fields["proof_id"], fields["records"]),
                     ("invalid", prover.proof_id, len(prover.records)))
    self.assertEqual(fields["last_record_id"], record_id(prover.records[-1]))
    self.assertEqual(challenge.key_commitment(fields["challenge_key"]),
                     cbor2.loads(prover.records[0])["challenger"]["key_commitment"])
    for c in self.get(f"/api/v1/proofs/{prover.proof_id}/challenges").json():
      self.assertEqual(c["challenge"], challenge.step_challenge_server(
          fields["challenge_key"], bytes.fromhex(c["record_id"])).hex(),
                       f"step {c['step']}'s challenge is not derived from K")
    flipped = bytearray(encoded)
    flipped[-5] ^= 1
    with self.assertRaisesRegex(errors.ReceiptError, "does not verify"):
      receipt.open_receipt(bytes(flipped), key)
    with self.assertRaisesRegex(errors.ReceiptError, "does not verify"):
      receipt.open_receipt(encoded, os.urandom(32))

  def test_download_writes_records_blobs_and_receipt(self):
    prover = self._invalid_proof()
    folder = pathlib.Path(tempfile.mkdtemp()) / "download"
    subprocess.run([sys.executable, "-m", "dvbench.cli", "download", prover.proof_id,
                    str(folder), "--url", self.server.url], cwd=REPO, check=True,
                   capture_output=True)
    self.assertEqual((folder / RECORDS_FILE).read_bytes(), b"".join(prover.records))
    blobs = sorted(p.name for p in (folder / BLOBS_DIR).iterdir())
    self.assertEqual(blobs, self.get(f"/api/v1/proofs/{prover.proof_id}/blobs").json())
    for name in blobs:
      self.assertEqual(blake3.blake3((folder / BLOBS_DIR / name).read_bytes()).hexdigest(), name)
    self.assertEqual((folder / receipt.RECEIPT_FILE).read_bytes(),
                     self.get(f"/api/v1/proofs/{prover.proof_id}/receipt").content)

  def test_server_key_file_is_owner_only(self):
    mode = (self.server.data / "server_key.pem").stat().st_mode & 0o777
    self.assertEqual(oct(mode), "0o600")


class ReplayTest(ServerChallengeTestCase):
  """Closed proofs go to a worker running `zkdv verify --challenge-key-file`."""

  def test_a_worker_without_the_key_replays_with_k_and_the_server_signs(self):
    """A worker the operator runs on its own (`dvbench worker`) never reads the signing key:
    it runs here while the key file is gone, and the receipt is signed by the server's key.

    Hand-written openings cannot replay (nor can its steps name a real program), so the
    proof is invalid; the path pinned is the worker's: verifier run with K, the state,
    the receipt signed by the server process.
    """
    prover = self.prover("alice/replay").start()
    prover.run(steps=6)
    self.assertEqual(prover.finish().json()["state"], "closed")
    key_file = self.server.data / "server_key.pem"
    hidden = key_file.with_name("server_key.pem.away")
    key_file.rename(hidden)
    try:
      subprocess.run([sys.executable, "-m", "dvbench.cli", "worker", "--once", "--data",
                      str(self.server.data)], cwd=REPO, check=True, capture_output=True,
                     timeout=300)
      self.assertFalse(key_file.exists(), "the worker wrote a key of its own")
    finally:
      hidden.rename(key_file)
    status = testing.wait_until(lambda: (s := self.proof(prover.proof_id))["state"] not in (
        "closed", "verifying") and s, timeout=120, every=0.1)
    self.assertEqual(status["state"], "invalid", status)
    self.assertTrue(status["failure"].startswith("invalid: "), status["failure"])
    fields = receipt.open_receipt(self.get(f"/api/v1/proofs/{prover.proof_id}/receipt").content,
                                  self.get("/api/v1/server-key").json()["server_key"])
    self.assertEqual((fields["verdict"], fields["records"]), ("invalid", len(prover.records)))
    self.assertEqual(fields["standing"]["state"], "invalid")


class PagesTest(ServerChallengeTestCase):

  def test_pages_link_through_named_routes(self):
    prover = self.prover("alice/pages").start()
    index = self.get("/").text
    self.assertIn(f"href='/proofs/{prover.proof_id}'", index)
    self.assertIn('href="/static/style.css"', index)
    self.assertIn("unchallenged", index)
    self.assertEqual(self.get("/static/style.css").status_code, 200)


if __name__ == "__main__":
  absltest.main()
