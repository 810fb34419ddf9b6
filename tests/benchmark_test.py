"""Benchmarks against a real server: an owner registers, the server scores, contamination
blocks ranking, and each attack of issue 12 is refused with a clear message."""

import io

import blake3
import cbor2
import httpx
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import serialization

import dvbench
from dvbench.measurement import tree_layouts
from tests.dvbench_test import DVBenchTestCase, local_transcript
from tests.measurement_test import Rows, _model, browse, train

# Rows of 4 tokens and a label (the first token), none of them a row of the tutorial batch.
EVAL_ROWS = np.asarray([[0, 0, 1, 1, 0], [0, 1, 1, 0, 0], [1, 0, 0, 1, 1], [1, 1, 0, 1, 1],
                        [0, 0, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0], [1, 0, 0, 0, 1]],
                       np.uint32)
COLUMNS = ["rank", "experiment", "value", "state", "challenged by", "checks replayed", "p",
           "escape (1 − p)", "start", "program", "contamination", "proof"]


def correct(params, batch):
  """Per row: 1.0 when the tiny classifier predicts the label."""
  logits = _model().apply({"params": params}, batch[:, :4])
  return (jnp.argmax(logits, -1) == batch[:, 4].astype(jnp.int32)).astype(jnp.float32)


def program_ids(server_url: str, proof_id: str) -> list[str]:
  """The training program ids of a proof, from its downloaded transcript."""
  data = httpx.get(f"{server_url}/api/v1/proofs/{proof_id}/transcript").content
  decoder, ids = cbor2.CBORDecoder(io.BytesIO(data)), []
  while decoder.fp.tell() < len(data):
    record = decoder.decode()
    if record["type"] == "program":
      ids.append(record["program_id"].hex())
  return ids


class BenchmarkTest(DVBenchTestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    url = cls.server.url
    cls.submitter = dvbench.Client(url)  # your-name
    cls.owner = dvbench.Client(url, token=cls.server.token("alice"))
    cls.mallory = dvbench.Client(url, token=cls.server.token("mallory"))
    cls.honest, cls.honest_proof = train(url, "your-name/honest", 3)
    cls.dirty, cls.dirty_proof = train(url, "your-name/on-eval-set", 3, batch=EVAL_ROWS[:4])
    cls.weak, cls.weak_proof = train(url, "your-name/weak", 3, update_check_probability=0.9)
    cls.unattested, cls.unattested_proof = train(url, "your-name/unattested", 3,
                                                 attested_start=False)
    for proof_id in (cls.honest_proof, cls.dirty_proof, cls.weak_proof, cls.unattested_proof):
      assert cls.submitter.wait_for_verdict(proof_id, 120)["state"] == "verified"
    # The owner allows the training programs it reviewed.
    cls.pinned = sorted({*program_ids(url, cls.honest_proof), *program_ids(url, cls.dirty_proof),
                         *program_ids(url, cls.unattested_proof)})
    cls.params = _model().init(jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
    cls.bench = cls.register(cls.owner, "alice/tiny-accuracy", min_update_check_probability=1.0,
                             allowed_programs=cls.pinned)
    cls.entry = cls.submitter.benchmark("alice/tiny-accuracy")  # the bench as a submitter

  @classmethod
  def register(cls, client, name, **options):
    options = {"metric": "accuracy", "evaluate": correct, "params": cls.params,
               "rows": EVAL_ROWS, "batch_size": 3, **options}
    client.benchmark(name).register(**options)
    return client.benchmark(name)

  def expected(self, checkpoint) -> float:
    params = serialization.msgpack_restore(checkpoint.read_bytes())
    return float(np.mean(correct(params, jnp.asarray(EVAL_ROWS))))

  def refused(self, status: int, pattern: str):
    return self.assertRaisesRegex(dvbench.errors.ApiError, f"{status}.*{pattern}")

  def raw_submit(self, client, record: dict) -> httpx.Response:
    return httpx.post(f"{self.server.url}/api/v1/benchmarks/alice/tiny-accuracy/submissions",
                      content=cbor2.dumps(record, canonical=True),
                      headers={"Authorization": f"Bearer {client.token}"})

  def test_end_to_end_honest_ranked_contaminated_shown_unranked_in_a_browser(self):
    honest = self.entry.wait(self.entry.submit(self.honest_proof, self.honest)["id"])
    dirty = self.entry.wait(self.entry.submit(self.dirty_proof, self.dirty)["id"])
    unattested = self.entry.wait(self.entry.submit(self.unattested_proof,
                                                   self.unattested)["id"])
    self.assertEqual((honest["state"], dirty["state"], unattested["state"]),
                     ("scored", "scored", "scored"), str((honest, dirty, unattested)))
    self.assertAlmostEqual(honest["value"], self.expected(self.honest), places=6)
    board = {e["experiment"]: e for e in self.bench.leaderboard()}
    self.assertEqual(board["your-name/honest"]["rank"], 1)
    self.assertEqual(board["your-name/honest"]["contamination"], 0)
    contaminated = board["your-name/on-eval-set"]
    self.assertFalse(contaminated["ranked"])
    self.assertIsNone(contaminated["rank"])
    self.assertGreater(contaminated["contamination"], 0)  # its probed rows are eval rows
    # A run from weights no init program attests is scored and shown, not ranked: its
    # proof does not pass --strict.
    loose = board["your-name/unattested"]
    self.assertEqual((loose["ranked"], loose["rank"], loose["strict"]), (False, None, False))
    self.assertEqual(loose["unmet_claims"], ["start: does not hold"])
    self.assertTrue(board["your-name/honest"]["strict"])
    for entry in board.values():
      self.assertEqual((entry["challenger"], entry["update_check_probability"],
                        entry["escape_probability"], entry["checks_replayed"],
                        entry["program_pinned"], entry["start_attested"]),
                       ("dvbench", 1.0, 0.0, 3, True,
                        entry["experiment"] != "your-name/unattested"))
    by_dirt = self.bench.leaderboard(sort="contamination")
    self.assertEqual(by_dirt[-1]["experiment"], "your-name/on-eval-set")
    with self.refused(400, "sort is one of"):
      self.bench.leaderboard(sort="value; drop table")
    dom, _ = browse(self, f"{self.server.url}/benchmarks/alice/tiny-accuracy?sort=value",
                    "benchmark-leaderboard")
    page = Rows(dom, "data-experiment")
    for column in COLUMNS:
      self.assertIn(column, [h.replace(" ▾", "").strip() for h in page.headers])
    rows = {r["data-experiment"]: r for r in page.rows}
    self.assertEqual(rows["your-name/honest"]["data-ranked"], "true")
    self.assertEqual(rows["your-name/on-eval-set"]["data-ranked"], "false")
    self.assertEqual((rows["your-name/unattested"]["data-ranked"],
                      rows["your-name/unattested"]["data-strict"]), ("false", "false"))
    self.assertIn("unranked: the proof does not pass --strict (start: does not hold)", dom)
    self.assertIn(f"evaluation set\">contaminated: {contaminated['contamination']}</span>", dom)
    self.assertIn(f"/proofs/{self.honest_proof}", dom)
    self.assertIn("<svg class=\"values\"", dom)
    self.assertIn("/benchmarks/alice/tiny-accuracy", httpx.get(
        self.server.url + "/leaderboard").text)

  def test_only_the_owner_writes_a_benchmark_and_names_are_namespaced(self):
    with self.refused(403, "token of 'mallory' cannot write benchmark 'alice/tiny-accuracy'"):
      self.register(self.mallory, "alice/tiny-accuracy", higher_is_better=False)
    with self.refused(409, "cannot change"):
      self.register(self.owner, "alice/tiny-accuracy", higher_is_better=False)
    mine = self.register(self.mallory, "mallory/tiny-accuracy", higher_is_better=False)
    self.assertFalse(mine.info()["higher_is_better"])  # the same metric, another namespace
    self.assertTrue(self.bench.info()["higher_is_better"])

  def test_rows_are_private_and_their_digests_public(self):
    info = self.bench.info()
    digests = httpx.get(f"{self.server.url}/api/v1/benchmarks/alice/tiny-accuracy/rows").json()
    self.assertLen(digests, len(EVAL_ROWS))
    base = f"{self.server.url}/api/v1/benchmarks/alice/tiny-accuracy/blobs"
    self.assertEqual(httpx.get(f"{base}/{info['program']}").status_code, 200)
    data = blake3.blake3(EVAL_ROWS.tobytes()).hexdigest()
    response = httpx.get(f"{base}/{data}")
    self.assertEqual(response.status_code, 403)
    self.assertIn("private to the server", response.json()["error"])

  def test_a_submitter_sends_no_outputs_value_program_or_rows(self):
    # A constant program, forged outputs, baked-in weights and cherry-picked rows all need
    # the submitter to supply something the server now computes itself.
    for extra in ({"value": 1.0}, {"outputs": []}, {"evaluate": b"\0" * 32},
                  {"rows": [b"\0" * 32]}, {"sample": 0.0}):
      response = self.raw_submit(self.submitter, {
          "type": "submission", "proof_id": self.honest_proof, "params_layout": [],
          "params_blobs": [], **extra})
      self.assertEqual(response.status_code, 400, extra)
      self.assertIn("sends no outputs, values, programs or rows", response.json()["error"])

  def test_another_owners_checkpoint_is_refused(self):
    with self.refused(403, "token of 'mallory' cannot write to proof"):
      self.mallory.benchmark("alice/tiny-accuracy").submit(self.honest_proof, self.honest)
    layouts, values = tree_layouts(serialization.msgpack_restore(self.honest.read_bytes()))
    response = self.raw_submit(self.mallory, {  # the honest blobs, uploaded by their owner
        "type": "submission", "proof_id": self.honest_proof,
        "params_layout": [l.to_record() for l in layouts],
        "params_blobs": [blake3.blake3(v.tobytes()).digest() for v in values]})
    self.assertEqual(response.status_code, 403)
    self.assertIn("a checkpoint is submitted by the owner of the proof", response.json()["error"])

  def test_unverified_and_self_audited_proofs_are_refused(self):
    receiving = [p for p in self.submitter.experiment("your-name/honest").proofs()
                 if p["state"] == "receiving"]
    self.assertLen(receiving, 1)  # the tutorial's first proof, never finished
    with self.refused(409, "is receiving, not verified"):
      self.entry.submit(receiving[0]["id"], self.honest)
    experiment = self.submitter.experiment("your-name/offline")
    offline = experiment.upload(local_transcript(2))
    self.assertEqual(self.submitter.wait_for_verdict(offline, 120)["state"], "self-audited")
    with self.refused(409, "self-audited, not verified: its prover chose its own checks"):
      self.entry.submit(offline, self.honest)

  def test_a_checkpoint_that_is_not_the_proofs_final_params_is_refused(self):
    params = serialization.msgpack_restore(self.honest.read_bytes())
    further = jax.tree.map(lambda p: p - 1e-3, params)  # trained on without a proof
    with self.refused(409, "is not the final_params"):
      self.entry.submit(self.honest_proof, further)
    with self.refused(409, "checkpoint's leaves"):
      self.entry.submit(self.honest_proof, {"w": np.zeros(3, np.float32)})

  def test_audit_level_and_pinned_programs(self):
    with self.refused(409, r"checked at p = 0.9; 'alice/tiny-accuracy' requires .* p >= 1"):
      self.entry.submit(self.weak_proof, self.weak)
    pinned_elsewhere = self.register(self.owner, "alice/other-program",
                                     allowed_programs=["ab" * 32])
    with self.refused(409, "trained with programs .* does not allow"):
      self.submitter.benchmark(pinned_elsewhere.name).submit(self.honest_proof, self.honest)
    self.register(self.owner, "alice/any-program", min_update_check_probability=0.5)
    loose = self.submitter.benchmark("alice/any-program")
    entry = loose.wait(loose.submit(self.weak_proof, self.weak)["id"])
    self.assertEqual(entry["state"], "scored", str(entry))
    (row,) = loose.leaderboard()
    self.assertEqual((row["program_pinned"], row["update_check_probability"]), (False, 0.9))
    self.assertAlmostEqual(row["escape_probability"], 0.1)


if __name__ == "__main__":
  absltest.main()
