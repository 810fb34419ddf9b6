"""Benchmarks against a real server: an owner registers (its program checked), the server
scores in shards, contamination and rows outside a pinned training set block ranking, and
each attack on a leaderboard is refused with a clear message."""

import concurrent.futures
import html
import io
import os

import blake3
import cbor2
import httpx
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from flax import serialization

import dvbench
from dvbench import contamination
from dvbench.benchmark import TrainingSet, export_evaluation
from dvbench.measurement import tree_layouts
from dvbench.server import labels
from dvbench.server import routes_registration
from dvbench.server.local import LocalServer
from tests.dvbench_test import DVBenchTestCase, local_transcript
from tests.fake_prover import FakeProver
from tests import testing
from tests.measurement_test import Rows, _model, browse, train, tutorial_steps_batch
from zkdv import merkle
from zkdv.digest import LeafLayout

# Rows of 4 tokens and a label (the first token), none of them a row of the tutorial batch.
EVAL_ROWS = np.asarray([[0, 0, 1, 1, 0], [0, 1, 1, 0, 0], [1, 0, 0, 1, 1], [1, 1, 0, 1, 1],
                        [0, 0, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0], [1, 0, 0, 0, 1]],
                       np.uint32)
COLUMNS = ["rank", "experiment", "value", "state", "challenged by", "checks replayed", "p",
           "escape (1 − p; over the owner's attempts)", "start", "program", "contamination",
           "training set", "owner's attempts", "proof"]


def correct(params, batch):
  """Per row: 1.0 when the tiny classifier predicts the label."""
  logits = _model().apply({"params": params}, batch[:, :4])
  return (jnp.argmax(logits, -1) == batch[:, 4].astype(jnp.int32)).astype(jnp.float32)


def correct_split(params, batch):
  """``correct`` for rows given as tokens ``x`` and a separate int32 label ``y``."""
  logits = _model().apply({"params": params}, batch["x"])
  return (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)


def split(rows) -> dict:
  """Rows of 4 tokens and a label as ``{"x": uint32 tokens, "y": int32 labels}``."""
  return {"x": rows[:, :4], "y": rows[:, 4].astype(np.int32)}


# The tutorial, its batch given as tokens and a separate int32 label leaf, every row probed.
SPLIT_BATCH = (
    ("for _ in range(", "batch = {'x': batch[:, :4], 'y': batch[:, 4].astype(jnp.int32)}\n"
     "for _ in range("),
    ("    tokens = batch[:, :4]\n    labels = batch[:, 4].astype(jnp.int32)",
     "    tokens, labels = batch['x'], batch['y']"),
    ("proof.start(probe_ratio=0.5)", "proof.start(probe_ratio=1.0)"))


def program_ids(server_url: str, proof_id: str) -> list[str]:
  """The training program ids of a proof, from its downloaded transcript."""
  data = httpx.get(f"{server_url}/api/v1/proofs/{proof_id}/transcript").content
  decoder, ids = cbor2.CBORDecoder(io.BytesIO(data)), []
  while decoder.fp.tell() < len(data):
    record = decoder.decode()
    if record["type"] == "program":
      ids.append(record["program_id"].hex())
  return ids


class BenchmarkTest(DVBenchTestCase, parameterized.TestCase):
  # 6 rows per scoring job: a benchmark evaluating 3 rows per call is scored in two shards.
  server_args = ("--score-shard-rows", "6")

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    url = cls.server.url
    cls.benchmark_clients()
    cls.honest, cls.honest_proof = train(url, "your-name/honest", 3)
    cls.dirty, cls.dirty_proof = train(url, "your-name/on-eval-set", 3, batch=EVAL_ROWS[:4])
    # Checked at p = 0.9, from initial weights no init program attests.
    cls.loose, cls.loose_proof = train(url, "your-name/loose", 3, update_check_probability=0.9,
                                       attested_start=False)
    # Trained one step further than the honest run: another checkpoint, from the same start.
    cls.longer, cls.longer_proof = train(url, "your-name/honest-longer", 4)
    # Attack: mallory's proof starts from the honest run's published final params and
    # trains one step at learning rate 0: the same checkpoint. (An init program returning
    # them is refused by the verifier; this start is unattested, its steps verified.)
    stolen = serialization.msgpack_restore(cls.honest.read_bytes())
    cls.copy, cls.copy_proof = train(url, "mallory/copy", 1, attested_start=False, edits=(
        ("Client(API_URL)", "Client(API_URL, token=TOKEN)"),
        ("state = zkdv.jax.contrib.TrainState.create(",
         "params = STOLEN\nstate = zkdv.jax.contrib.TrainState.create("),
        ("optax.adam(1e-2)", "optax.adam(0.0)")),
        names={"TOKEN": cls.server.token("mallory"), "STOLEN": stolen})
    # Attack: the step trains on the evaluation rows too, closed over as a constant (160
    # bytes, well within the constants budget): no probe opens them.
    cls.baked, cls.baked_proof = train(url, "your-name/baked-eval", 2, edits=((
        "    tokens = batch[:, :4]\n",
        "    batch = jnp.concatenate([batch, BAKED])\n    tokens = batch[:, :4]\n"),),
        names={"BAKED": jnp.asarray(EVAL_ROWS)})
    # Attack: the init program closes over the evaluation rows (an attested start's
    # program may compute anything from them); the steps are honest.
    cls.baked_init, cls.baked_init_proof = train(url, "your-name/baked-init", 2, edits=((
        "params = proof.init(model.init, ", "params = proof.init(READING_ROWS(model.init), "),),
        names={"READING_ROWS": lambda init: lambda *args: jax.tree.map(
            lambda p: p + 0 * jnp.sum(jnp.asarray(EVAL_ROWS)).astype(p.dtype), init(*args))})
    cls.split, cls.split_proof = train(url, "your-name/split-labels", 2, edits=SPLIT_BATCH)
    cls.split_dirty, cls.split_dirty_proof = train(url, "your-name/split-on-eval-set", 2,
                                                   batch=EVAL_ROWS[:4], edits=SPLIT_BATCH)
    for proof_id, state in ((cls.honest_proof, "verified"), (cls.dirty_proof, "verified"),
                            (cls.loose_proof, "verified steps"),  # its start is unattested
                            (cls.longer_proof, "verified"), (cls.split_proof, "verified"),
                            (cls.baked_proof, "verified"), (cls.baked_init_proof, "verified"),
                            (cls.split_dirty_proof, "verified")):
      assert cls.submitter.wait_for_verdict(proof_id, 120)["state"] == state
    assert cls.mallory.wait_for_verdict(cls.copy_proof, 120)["state"] in (
        labels.REPLAYED_STATES), cls.copy_proof
    # The owner allows the training programs it reviewed.
    cls.pinned = sorted({*program_ids(url, cls.honest_proof), *program_ids(url, cls.dirty_proof)})
    cls.params = _model().init(jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
    cls.training_set = TrainingSet(tutorial_steps_batch())  # the rows the tutorial trains on
    cls.bench = cls.register(cls.owner, "alice/tiny-accuracy", min_update_check_probability=1.0,
                             allowed_programs=cls.pinned, training_set=cls.training_set)
    cls.entry = cls.submitter.benchmark("alice/tiny-accuracy")  # the bench as a submitter
    cls.register(cls.owner, "alice/any-program", min_update_check_probability=0.5)

  @classmethod
  def register(cls, client, name, **options):
    options = {"metric": "accuracy", "evaluate": correct, "params": cls.params,
               "rows": EVAL_ROWS, **options}
    client.benchmark(name).register(**options)
    return client.benchmark(name)

  def expected(self, checkpoint) -> float:
    params = serialization.msgpack_restore(checkpoint.read_bytes())
    return float(np.mean(correct(params, jnp.asarray(EVAL_ROWS))))

  def refused(self, status: int, pattern: str):
    return self.assertRaisesRegex(dvbench.errors.ApiError, f"{status}.*{pattern}")

  def raw_submit(self, client, record: dict,
                 bench: str = "alice/tiny-accuracy") -> httpx.Response:
    return httpx.post(f"{self.server.url}/api/v1/benchmarks/{bench}/submissions",
                      content=cbor2.dumps(record, canonical=True),
                      headers={"Authorization": f"Bearer {client.token}"})

  def honest_record(self, **fields) -> dict:
    """The honest checkpoint's submission record, its blobs uploaded by its owner."""
    layouts, values = tree_layouts(serialization.msgpack_restore(self.honest.read_bytes()))
    blobs = [blake3.blake3(v.tobytes()).digest() for v in values]
    for blob, value in zip(blobs, values):
      self.submitter.http.put_blob(self.honest_proof, blob.hex(), value.tobytes)
    return {"type": "submission", "proof_id": self.honest_proof,
            "params_layout": [l.to_record() for l in layouts], "params_blobs": blobs,
            "training_proofs": [], **fields}

  def test_end_to_end_honest_ranked_contaminated_shown_unranked_in_a_browser(self):
    submit = lambda proof, checkpoint: self.entry.wait(self.entry.submit(  # pylint: disable=g-long-lambda
        proof, checkpoint, training_set=self.training_set)["id"])
    honest = submit(self.honest_proof, self.honest)
    dirty = submit(self.dirty_proof, self.dirty)
    self.assertEqual((honest["state"], dirty["state"]), ("scored", "scored"), str((honest, dirty)))
    self.assertAlmostEqual(honest["value"], self.expected(self.honest), places=6)
    self.assertEqual(honest["shards"], {"scored": 1, "total": 1})  # 8 rows per call
    board = {e["experiment"]: e for e in self.bench.leaderboard()}
    self.assertEqual(board["your-name/honest"]["rank"], 1)
    self.assertEqual((board["your-name/honest"]["contamination"],
                      board["your-name/honest"]["outside_training_set"]), (0, 0))
    contaminated = board["your-name/on-eval-set"]
    self.assertFalse(contaminated["ranked"])
    self.assertIsNone(contaminated["rank"])
    # Its probed rows are evaluation rows, and not rows of the registered training set.
    self.assertGreater(contaminated["contamination"], 0)
    self.assertEqual(contaminated["outside_training_set"], contaminated["contamination"])
    self.assertEqual(contaminated["unranked_because"], [
        f"contaminated: {contaminated['contamination']} evaluation examples were probed in its "
        "training batches",
        f"{contaminated['contamination']} probed rows are outside the registered training set"])
    self.assertTrue(board["your-name/honest"]["strict"])
    for entry in board.values():
      self.assertEqual((entry["challenger"], entry["update_check_probability"],
                        entry["escape_probability"], entry["checks_replayed"],
                        entry["program_pinned"], entry["start_attested"]),
                       ("dvbench", 1.0, 0.0, 3, True, True))
      self.assertEqual(entry["training_programs"],
                       program_ids(self.server.url, entry["proof_id"]))
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
    self.assertIn("unranked: contaminated: ", dom)
    self.assertIn(f"evaluation set\">contaminated: {contaminated['contamination']}</span>", dom)
    self.assertIn(f"training set\">outside: {contaminated['contamination']}</span>", dom)
    self.assertIn(f"/proofs/{self.honest_proof}", dom)
    for program in board["your-name/honest"]["training_programs"]:  # linked, downloadable
      link = f"/api/v1/proofs/{self.honest_proof}/blobs/{program}"
      self.assertIn(f"href=\"{link}\"", dom)
      self.assertEqual(blake3.blake3(httpx.get(self.server.url + link).content).hexdigest(),
                       program)
    self.assertIn("<svg class=\"values\"", dom)
    self.assertIn("/benchmarks/alice/tiny-accuracy", httpx.get(
        self.server.url + "/leaderboard").text)

  def test_attack_one_entry_per_proof_and_per_checkpoint(self):
    bench = self.register(self.owner, "alice/one-entry", min_update_check_probability=0.5,
                          training_set=self.training_set)
    proofs = self.training_set.membership_proofs(self.entry.probed_rows(self.honest_proof))
    first = self.raw_submit(self.submitter, self.honest_record(training_proofs=proofs),
                            bench.name)
    self.assertEqual(first.status_code, 201, first.text)
    # Attack: the same proof again with other submission fields (its membership proofs
    # left out) is the same entry, not a second rank.
    again = self.raw_submit(self.submitter, self.honest_record(), bench.name)
    self.assertEqual((again.status_code, again.json()["id"]), (200, first.json()["id"]))
    self.entry.wait(first.json()["id"])
    # Attack: another owner's proof whose checkpoint is the honest run's final params.
    copy = self.mallory.benchmark(bench.name)
    with self.refused(409, f"refused: a copy: its checkpoint "
                      f"{self.checkpoint_of(self.honest_proof)[:16]}… equals the final params "
                      f"of proof {self.honest_proof} of 'your-name/honest', which closed "
                      "first; one entry per checkpoint"):
      copy.submit(self.copy_proof, self.copy, training_set=self.training_set)
    (entry,) = bench.leaderboard()
    self.assertEqual((entry["proof_id"], entry["rank"], entry["copy_of"]),
                     (self.honest_proof, 1, None))
    self.assertEqual(entry["pins"], {"audit": "min-probability: holds",
                                     "training_programs": "not pinned", "training_set": "holds",
                                     "init_program": "not pinned",
                                     "base_checkpoint": "not pinned",
                                     "probe_ratio": "not pinned (the proof opened each batch "
                                                    "row with probability 0.5)",
                                     "data_order": "not pinned (data: probed)"})

  def checkpoint_of(self, proof_id: str) -> str:
    return httpx.get(f"{self.server.url}/api/v1/proofs/{proof_id}").json()["final_params"]

  def test_attack_ties_share_a_rank_and_attempts_are_shown(self):
    # Equal values whatever the two checkpoints learned (their starts come from the
    # server's key): each row with either label, so a two-class model is right on exactly
    # half of them. (Rows chosen from the checkpoints' predictions could leave the owner's
    # params scoring the same when they change, which registration refuses.)
    tied = np.concatenate([EVAL_ROWS, EVAL_ROWS])
    tied[len(EVAL_ROWS):, 4] = 1 - EVAL_ROWS[:, 4]
    bench = self.register(self.owner, "alice/tied", min_update_check_probability=0.5,
                          rows=tied)
    entry = self.submitter.benchmark(bench.name)
    for proof_id, checkpoint in ((self.honest_proof, self.honest),
                                 (self.longer_proof, self.longer)):
      self.assertEqual(entry.wait(entry.submit(proof_id, checkpoint)["id"])["state"], "scored")
    board = bench.leaderboard()
    self.assertEqual([e["value"] for e in board][0], board[1]["value"])
    self.assertEqual([e["rank"] for e in board], [1, 1])  # not 1, 2 by submission time
    for e in board:
      shown = httpx.get(f"{self.server.url}/api/v1/proofs/{e['proof_id']}").json()["attempts"]
      self.assertEqual(e["attempts"], shown)
      self.assertGreaterEqual(e["attempts"]["slots"], 4)  # your-name's runs of this test
    page = httpx.get(f"{self.server.url}/benchmarks/{bench.name}").text
    self.assertIn(f"title='{html.escape(board[0]['attempts']['summary'], quote=True)}'>"
                  f"{board[0]['attempts']['slots']}</td>", page)

  def test_attack_evaluation_rows_baked_into_the_training_program_are_found(self):
    entry = self.submitter.benchmark("alice/any-program")  # training programs not pinned
    # Row 5 is all ones, as the honest init program's float constants are once converted:
    # a row of one element repeated is never looked for (the honest entry is scored).
    baked = entry.wait(entry.submit(self.baked_proof, self.baked)["id"])
    self.assertEqual((baked["state"], baked["value"]), ("failed", None), baked)
    self.assertRegex(baked["failure"], r"^shard 0 \(rows 0-7\): training program [0-9a-f]{16}… "
                     r"embeds evaluation rows \[0, 1, 2, 3, 4, 6, 7\] as constants: the "
                     r"proof's steps read them, unseen by any probe; the entry is refused\.$")
    baked_init = entry.wait(entry.submit(self.baked_init_proof, self.baked_init)["id"])
    self.assertEqual((baked_init["state"], baked_init["value"]), ("failed", None), baked_init)
    self.assertRegex(baked_init["failure"], r"^shard 0 \(rows 0-7\): init program "
                     r"[0-9a-f]{16}… embeds evaluation rows \[0, 1, 2, 3, 4, 6, 7\] as "
                     r"constants")
    honest = entry.wait(entry.submit(self.honest_proof, self.honest)["id"])
    self.assertEqual(honest["state"], "scored", str(honest))  # no evaluation row in its programs
    board = {e["experiment"]: e for e in entry.leaderboard()}
    self.assertIsNone(board["your-name/baked-eval"]["rank"])
    self.assertIn("embeds evaluation rows", httpx.get(
        f"{self.server.url}/benchmarks/alice/any-program").text)

  def test_contamination_by_whole_example_labels_never_count_alone(self):
    # A new user's classification benchmark: fresh evaluation tokens, a separate int32 label
    # leaf (two distinct rows, equal to training labels).
    labels_apart = self.register(self.owner, "alice/split-labels", evaluate=correct_split,
                                 rows=split(EVAL_ROWS), min_update_check_probability=0.5)
    # Whole examples only: every evaluation example twice, so no leaf identifies one alone.
    repeated = self.register(self.owner, "alice/split-repeated", evaluate=correct_split,
                             rows=split(np.concatenate([EVAL_ROWS[:4], EVAL_ROWS[:4]])),
                             min_update_check_probability=0.5)
    for bench in (labels_apart, repeated):
      entry = self.submitter.benchmark(bench.name)
      for proof_id, checkpoint in ((self.split_proof, self.split),
                                   (self.split_dirty_proof, self.split_dirty)):
        self.assertEqual(entry.wait(entry.submit(proof_id, checkpoint)["id"])["state"],
                         "scored")
    clean = {e["experiment"]: e for e in labels_apart.leaderboard()}
    self.assertEqual((clean["your-name/split-labels"]["contamination"],
                      clean["your-name/split-labels"]["rank"]), (0, 1))
    # Trained on 4 evaluation examples: caught by their tokens (16 distinct bytes a row) ...
    self.assertEqual(clean["your-name/split-on-eval-set"]["contamination"], 4)
    # ... and, where no leaf identifies an example, by the whole example.
    whole = {e["experiment"]: e for e in repeated.leaderboard()}
    self.assertEqual(whole["your-name/split-labels"]["contamination"], 0)
    dirty = whole["your-name/split-on-eval-set"]
    self.assertEqual((dirty["contamination"], dirty["rank"]), (4, None))
    self.assertIn("contaminated: 4 evaluation examples were probed in its training batches",
                  dirty["unranked_because"])
    page = httpx.get(f"{self.server.url}/benchmarks/{repeated.name}").text
    self.assertIn("unranked: contaminated: 4 evaluation examples were probed", page)
    # The public digests: every example's, and the rows of identifying leaves only.
    # Its programs are not pinned: a batch leaf the evaluation set lacks would leave only
    # identifying leaves to match, and the recipe says so.
    self.assertIn("the batch's leaves: a run whose batches carry a leaf the evaluation set "
                  "lacks has no whole example in common with it; only identifying leaves "
                  "(distinct rows of 16 bytes or more) are matched then",
                  labels_apart.info()["left_open"])
    listed = httpx.get(f"{self.server.url}/api/v1/benchmarks/{labels_apart.name}/rows").json()
    self.assertLen(listed, 2 * len(EVAL_ROWS))  # 8 examples, 8 token rows; no label rows
    self.assertNotIn(blake3.blake3(np.int32(1).tobytes()).hexdigest(), listed)

  def test_the_recipe_says_what_it_leaves_open(self):
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(self.params))
    start = ["the init: any attested start from the key (an init program of the prover's, "
             "proof.init); starts from a base checkpoint are not accepted",
             "the probe ratio: any above the server's minimum",
             "the init's constants: an init program may embed up to 65536 bytes, enough for a "
             f"copy of the model's {params_bytes} bytes of params, so a start may be a checkpoint "
             "it carries (another entry's, say), returned for the slot's key only or plus a "
             "little of the key's noise; pinning init_program closes this"]
    self.assertEqual(self.bench.info()["left_open"], [  # programs and rows pinned, not order
        *start, "the data order: a run may choose which training rows it draws and when "
        "(probed rows are members of the set, at no index)"])
    loose = self.submitter.benchmark("alice/any-program").info()["left_open"]
    self.assertEqual(loose, [
        *start, "the training program's constants: enough for a copy of the model's "
        f"{params_bytes} bytes of params, so an update may return a model it carries on the "
        "batches it was committed with, moved by them only in its last bits or in one element "
        "a leaf (the program claim shows that other batches change the params, not how "
        "much); pinning allowed_programs closes this",
        "the training program: any, and a program may embed up to 65536 bytes of "
        f"constants (410× the evaluation set's {EVAL_ROWS.nbytes} bytes), unseen by probes",
        # A run training on the evaluation rows plus one (its program subtracts it) was
        # verified, uncontaminated and ranked first; the recipe now says this is open.
        "the training set: probed rows are compared with the evaluation set only, as a batch "
        "carries them: a program may change its batch before training on it (add one, XOR a "
        "key), so a run with no probed row in common with the evaluation set may still train "
        "on it"])
    page = httpx.get(f"{self.server.url}/benchmarks/alice/any-program").text
    self.assertIn(html.escape(loose[3], quote=True), page)

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

  @parameterized.named_parameters(
      # A verified 1.0 from a constant program of the submitter's.
      ("constant_program", {"evaluate": b"constant 1.0 program"}),
      # sample=0: nothing opened, every output forged.
      ("forged_outputs_unsampled", {"outputs": [1.0] * len(EVAL_ROWS), "sample": 0.0}),
      # Batches reordered until the server's opened sample misses the forged outputs.
      ("ground_batch_order", {"batch_order": [7, 6, 5, 4, 3, 2, 1, 0], "outputs": [1.0]}),
      # A program that ignores the checkpoint and scores weights baked into it.
      ("baked_in_weights", {"evaluate": b"program with constant params", "params": []}),
      # Only the rows the model gets right.
      ("cherry_picked_rows", {"rows": [blake3.blake3(EVAL_ROWS[0].tobytes()).digest()]}),
      # A value stated outright.
      ("claimed_value", {"value": 1.0}),
      # The metric's direction set by whoever submits first (0.01 ranked above 0.81).
      ("direction_of_first_submission", {"metric": "accuracy", "higher_is_better": False}),
  )
  def test_attack_refused_a_submitter_supplies_nothing_the_server_computes(self, extra):
    before = self.entry.leaderboard()
    response = self.raw_submit(self.submitter, self.honest_record(**extra))
    self.assertEqual(response.status_code, 400)
    # Each attack is refused for the very fields it supplies, named.
    self.assertIn(f"not {sorted(extra)}: the server runs the benchmark's program on its rows, "
                  "so a submitter sends no outputs, values, programs or rows",
                  response.json()["error"])
    self.assertEqual(self.entry.leaderboard(), before)  # nothing stored

  def test_attack_refused_measuring_another_owners_checkpoint(self):
    # Refused at the blob upload: a blob of another owner's proof is its owner's to write.
    forged = b"the checkpoint mallory would have scored"
    with self.refused(403, f"token of 'mallory' cannot write to proof {self.honest_proof}"):
      self.mallory.http.put_blob(self.honest_proof, blake3.blake3(forged).hexdigest(),
                                 lambda: forged)
    # Refused at the submission once its owner uploaded the blobs (the client sends none).
    record = self.honest_record()
    with self.refused(403, "token of 'mallory' cannot submit the checkpoint of proof "
                      f"{self.honest_proof}"):
      self.mallory.benchmark("alice/tiny-accuracy").submit(self.honest_proof, self.honest)
    response = self.raw_submit(self.mallory, record)
    self.assertEqual(response.status_code, 403)
    self.assertIn("a checkpoint is submitted by the owner of the proof", response.json()["error"])

  @parameterized.named_parameters(
      # Attack: a constant "evaluation" (verified 1.0 whatever the checkpoint).
      ("constant", lambda params, batch: jnp.ones(batch.shape[0]) + 0 * jax.tree.leaves(
          params)[0].sum(), "its output does not read the batch: a constant"),
      # Attack: an evaluation scoring weights baked into it, not the checkpoint.
      ("baked_in_weights", lambda params, batch: correct(
          jax.tree.map(jnp.zeros_like, params), batch),
       "its output does not read the params: it would score weights baked into the program"),
  )
  def test_registration_checks_the_evaluation_program(self, evaluate, message):
    with self.refused(400, f"the evaluation program: {message}"):
      self.register(self.owner, "alice/bad-program", evaluate=evaluate)

  @parameterized.named_parameters(
      # Attack: 0 * params + 1 reads both structurally, scores 1.0 whatever the checkpoint.
      ("zero_times_params", lambda params, batch: 0 * jax.tree.leaves(params)[0].sum()
       + 0 * batch[:, 0] + 1.0, "its outputs do not change when the params change, at the "
       "owner's params: it scores something other than the checkpoint"),
      # Attack: the labels alone.
      ("labels_only", lambda params, batch: (batch[:, 4] == 1).astype(jnp.float32)
       + 0 * jax.tree.leaves(params)[0].sum(), "its outputs do not change when the params "
       "change, at the owner's params"),
      # Attack: a reward for one weight value (the owner's bias), nothing for any model.
      ("magic_weight", lambda params, batch: (1.0 + correct(params, batch)) * (
          params["Dense_0"]["bias"][0] == 0.0), "its outputs change with the params at the "
       "owner's params but not at a perturbed model: it rewards particular weight values"),
      # An output that is NaN or inf on some of the owner's rows (token 1 set: 1, 3, 5, 6).
      ("nan_rows", lambda params, batch: correct(params, batch) / (
          1.0 - batch[:, 1].astype(jnp.float32)),
       r"its outputs on rows \[1, 3, 5, 6\] at the owner's params are not finite"),
  )
  def test_attack_registration_checks_the_program_numerically(self, evaluate, message):
    self.assertEqual(float(self.params["Dense_0"]["bias"][0]), 0.0)  # the magic value
    name = f"alice/numerically-bad-{blake3.blake3(message.encode()).hexdigest()[:8]}"
    with self.refused(400, f"the evaluation program: {message}"):
      self.register(self.owner, name, evaluate=evaluate)

  def test_a_non_finite_score_fails_the_entry_naming_its_rows(self):
    # The program passes registration (finite on the owner's params and on perturbed
    # models) but is NaN on rows 2 and 5 of one model: the honest checkpoint.
    magic = serialization.msgpack_restore(self.honest.read_bytes())["Dense_0"]["bias"][0]
    def nan_for_one_model(params, batch):
      hit = (params["Dense_0"]["bias"][0] == magic) & (jnp.arange(batch.shape[0]) % 3 == 2)
      return jnp.where(hit, jnp.nan, correct(params, batch))
    bench = self.register(self.owner, "alice/nan-for-one-model", evaluate=nan_for_one_model)
    entry = self.submitter.benchmark("alice/nan-for-one-model")
    scored = entry.wait(entry.submit(self.honest_proof, self.honest)["id"])
    self.assertEqual((scored["state"], scored["value"]), ("failed", None), scored)
    self.assertEqual(scored["failure"], "shard 0 (rows 0-7): the evaluation program: its "
                     "outputs on rows [2, 5] of this checkpoint are not finite (nan or inf); "
                     "the entry fails rather than favour a model.")
    self.assertEqual([e["rank"] for e in bench.leaderboard()], [None])

  def test_registration_says_which_checks_it_ran(self):
    bench = self.owner.benchmark("alice/checked")
    registered = bench.register(metric="accuracy", evaluate=correct, params=self.params,
                                rows=EVAL_ROWS)
    self.assertEqual(registered["checks_run"], [
        "structure: takes the params and a batch, one number per row, reads both",
        "params: outputs change with the params at the owner's params and at a perturbed "
        "model",
        "batch: outputs change with the rows of the batch",
        "finite: every output on the owner's first batch at its params"])

  def test_registration_screens_host_callbacks(self):
    def calls_host(params, batch):
      out = correct(params, batch)
      return jax.ffi.ffi_call("xla_ffi_python_cpu_callback",
                              jax.ShapeDtypeStruct(out.shape, out.dtype),
                              has_side_effect=True)(out)
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(self.params)]
    exported = jax.export.export(jax.jit(lambda *flat: calls_host(
        jax.tree.unflatten(jax.tree.structure(self.params), flat[:-1]), flat[-1])),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
            "xla_ffi_python_cpu_callback")])(*specs, jax.ShapeDtypeStruct((8, 5), jnp.uint32))
    with self.refused(400, "the evaluation program: the program is refused before compiling: "
                      "it calls back into the host"):
      self.owner.benchmark("alice/host-callback").register_exported(
          bytes(exported.serialize()), metric="accuracy", params=self.params, rows=EVAL_ROWS,
          batch_rows=8)
    with self.refused(400, "the evaluation program: it takes"):  # exported for 3 rows a call
      self.owner.benchmark("alice/other-batch").register_exported(
          export_evaluation(correct, self.params, EVAL_ROWS, 3), metric="accuracy",
          params=self.params, rows=EVAL_ROWS, batch_rows=8)

  def test_registration_fields_are_checked(self):
    bench = self.owner.benchmark("alice/fields")
    definition = {"type": "benchmark", "metric": "accuracy", "higher_is_better": True,
                  "aggregate": "mean", "batch_rows": 8, "program": b"\1" * 32,
                  "params_layout": [{"path": "w", "dtype": "float32", "shape": [2]}],
                  "data_layout": [{"path": "", "dtype": "uint32", "shape": [8, 5]}],
                  "data_blobs": [b"\2" * 32],
                  "audit": "min-probability", "min_update_check_probability": 0.5,
                  "allowed_programs": None, "training_set": None, "public_rows": False}
    for fields, message in (
        ({"audit": "every-step"}, "audit: one of \\['min-probability', 'full-replay'\\], got "
         "'every-step'"),
        ({"training_set": {"root": b"\0" * 31, "size": 4}}, "training_set root: a 32-byte"),
        ({"training_set": {"root": b"\0" * 32, "size": 0}}, "training_set: null or"),
        ({"params_layout": [{"path": "w", "dtype": "object", "shape": []}]},
         "params_layout: each leaf is"),
        ({"batch_rows": 9}, r"batch_rows: an int in \[1, 8\]")):
      with self.refused(400, message):
        bench.client.http.request("PUT", bench.path, content=cbor2.dumps(
            {**definition, **fields}, canonical=True))

  def test_training_set_membership_is_proven_or_refused(self):
    probed = self.entry.probed_rows(self.honest_proof)
    self.assertNotEmpty(probed)
    proofs = self.training_set.membership_proofs(probed)
    self.assertLen(proofs, len(probed))  # the honest run probed only training rows
    row, index, path = proofs[0]
    name = blake3.blake3(row).hexdigest()
    # Attack: a membership proof for another index (or another tree) is refused.
    forged = [[row, (index + 1) % self.training_set.size, path]]
    response = self.raw_submit(self.submitter, self.honest_record(training_proofs=forged))
    self.assertEqual(response.status_code, 409)
    self.assertIn(f"the membership proof of probed row {name} (index "
                  f"{(index + 1) % self.training_set.size}) does not lead to the root "
                  f"{self.training_set.root.hex()}", response.json()["error"])
    # Attack: proving a training row the proof never probed.
    unprobed = TrainingSet(EVAL_ROWS).membership_proofs([EVAL_ROWS[0].tobytes()])
    response = self.raw_submit(self.submitter, self.honest_record(training_proofs=unprobed))
    self.assertEqual(response.status_code, 409)
    self.assertIn("is not a probed row of proof", response.json()["error"])
    # Attack: entries of other shapes (a row as text, as its digest, a negative index).
    for entry, status, says in (([row.hex(), index, path], 400, "each entry is [row bytes"),
                                ([row, index, [1]], 400, "training_proofs path"),
                                ([blake3.blake3(row).digest(), index, path], 409,
                                 "is not a probed row of proof"),
                                ([row, -1, path], 409, "(index -1) does not lead")):
      response = self.raw_submit(self.submitter, self.honest_record(training_proofs=[entry]))
      self.assertEqual(response.status_code, status, response.text)
      self.assertIn(says, response.json()["error"])
    response = self.raw_submit(self.submitter, self.honest_record(
        training_proofs=[proofs[0], proofs[0]]))
    self.assertEqual(response.status_code, 400)
    self.assertIn(f"row {name} is proven twice", response.json()["error"])
    unpinned = self.submitter.benchmark("alice/any-program")
    with self.refused(400, "'alice/any-program' registers no training set; send none"):
      unpinned.submit(self.honest_proof, self.honest, training_set=self.training_set)

  def test_unverified_and_self_audited_proofs_are_refused(self):
    receiving = FakeProver(self.server.url, self.server.token("your-name"),
                           "your-name/unfinished").start()
    receiving.run(steps=1)
    with self.refused(409, "is receiving, not verified"):
      self.entry.submit(receiving.proof_id, self.honest)
    experiment = self.submitter.experiment("your-name/offline")
    offline = experiment.upload(local_transcript(2))
    self.assertEqual(self.submitter.wait_for_verdict(offline, 120)["state"], "self-audited")
    response = self.raw_submit(self.submitter, self.honest_record(proof_id=offline))
    self.assertEqual(response.status_code, 409)
    self.assertIn("self-audited, not verified: its prover chose its own checks",
                  response.json()["error"])

  def test_a_checkpoint_that_is_not_the_proofs_final_params_is_refused(self):
    params = serialization.msgpack_restore(self.honest.read_bytes())
    further = jax.tree.map(lambda p: p - 1e-3, params)  # trained on without a proof
    with self.refused(409, "is not the final_params"):
      self.entry.submit(self.honest_proof, further)
    for checkpoint, message in ((further, "is not the final_params"),
                                ({"w": np.zeros(3, np.float32)}, "checkpoint's leaves")):
      layouts, values = tree_layouts(checkpoint)  # its blobs never uploaded
      response = self.raw_submit(self.submitter, {
          "type": "submission", "proof_id": self.honest_proof, "training_proofs": [],
          "params_layout": [l.to_record() for l in layouts],
          "params_blobs": [blake3.blake3(np.asarray(v).tobytes()).digest() for v in values]})
      self.assertEqual(response.status_code, 409)
      self.assertIn(message, response.json()["error"])

  def test_scoring_in_shards_aggregated_by_the_server(self):
    sharded = self.register(self.owner, "alice/sharded", batch_size=3, aggregate="sum")
    self.assertEqual(sharded.info()["audit"], "min-probability")
    entry = self.entry.client.benchmark(sharded.name)
    scored = entry.wait(entry.submit(self.honest_proof, self.honest)["id"])
    # 8 rows, 3 per call, at most 6 per job: rows 0-5 and rows 6-7 (a short batch).
    self.assertEqual((scored["state"], scored["shards"]), ("scored", {"scored": 2, "total": 2}))
    params = serialization.msgpack_restore(self.honest.read_bytes())
    self.assertEqual(scored["value"], float(np.sum(np.asarray(
        correct(params, jnp.asarray(EVAL_ROWS)), np.float64))))

  def test_audit_level_pinned_programs_and_an_unattested_start(self):
    with self.refused(409, r"checked at p = 0.9; 'alice/tiny-accuracy' requires .* p >= 1"):
      self.entry.submit(self.loose_proof, self.loose)
    pinned_elsewhere = self.register(self.owner, "alice/other-program",
                                     allowed_programs=["ab" * 32])
    with self.refused(409, "trained with programs .* does not allow"):
      self.submitter.benchmark(pinned_elsewhere.name).submit(self.honest_proof, self.honest)
    # Every step checked (p = 1) from an attested start is still not a full replay: the
    # policy did not ask for it, so the workers replayed only what was challenged.
    full = self.register(self.owner, "alice/full-replay-only", audit="full-replay")
    self.assertEqual(self.submitter.benchmark(full.name).info()["audit"], "full-replay")
    with self.refused(409, "'alice/full-replay-only' requires a full replay"):
      self.submitter.benchmark(full.name).submit(self.honest_proof, self.honest)
    loose = self.submitter.benchmark("alice/any-program")
    entry = loose.wait(loose.submit(self.loose_proof, self.loose)["id"])
    self.assertEqual(entry["state"], "scored", str(entry))
    row = next(e for e in loose.leaderboard() if e["experiment"] == "your-name/loose")
    self.assertEqual((row["program_pinned"], row["update_check_probability"],
                      row["outside_training_set"]), (False, 0.9, None))
    self.assertAlmostEqual(row["escape_probability"], 0.1)
    # A run from weights no init program attests is scored and shown, not ranked: its
    # proof does not pass --strict.
    self.assertEqual((row["ranked"], row["rank"], row["strict"], row["start_attested"]),
                     (False, None, False, False))
    self.assertEqual(row["unmet_claims"], ["start: does not hold"])
    self.assertEqual(row["unranked_because"],
                     ["the proof does not pass --strict (start: does not hold)"])
    page = httpx.get(f"{self.server.url}/benchmarks/alice/any-program").text
    self.assertIn("data-ranked='false' data-strict='false'", page)
    self.assertIn("unranked: the proof does not pass --strict (start: does not hold)", page)
    self.assertIn("<td>unattested</td>", page)


class ContaminationTest(absltest.TestCase):

  def test_labels_never_count_alone_and_examples_match_whole(self):
    tokens = np.arange(32, dtype=np.uint32).reshape(8, 4)  # 16 distinct bytes a row
    labels = np.asarray([0, 1] * 4, np.int32)
    as_rows = lambda a: a.reshape(len(a), -1).view(np.uint8)  # pylint: disable=g-long-lambda
    found = contamination.evaluation_digests([as_rows(tokens), as_rows(labels)])
    label_digests = {blake3.blake3(l.tobytes()).hexdigest() for l in labels}
    self.assertFalse(label_digests & set(found))
    self.assertEqual(set(found.values()), set(range(8)))
    self.assertLen(found, 16)  # every example's digest and every token row's
    # A probe of tokens row 2 (single rows) and of labels group 0 (rows 0-3, one row each).
    record = {"type": "check", "kind": "probe", "probes": [
        [0, 2, 1, tokens[2].tobytes(), []], [1, 0, 4, labels[:4].tobytes(), []]]}
    opened = contamination.probed_rows(record)
    (example,) = contamination.probed_examples(opened)
    self.assertEqual(found[example], 2)
    self.assertEqual(contamination.probed_examples(opened[:1]),
                     set())  # one leaf probed: its rows are the probed rows

  def test_a_leaf_of_empty_rows_hides_no_example(self):
    # Attack: whole examples take the rows of every probed leaf, so one more batch leaf of
    # empty rows (no bytes to commit, none to open) changed every example's digest, and
    # examples that no leaf identifies alone were never found.
    tokens = np.arange(16, dtype=np.int32).reshape(8, 2)  # 8 bytes a row: not identifying
    labels = np.asarray([0, 1, 2] * 2 + [0, 1], np.int32)
    as_rows = lambda a: a.reshape(len(a), -1).view(np.uint8)  # pylint: disable=g-long-lambda
    found = contamination.evaluation_digests([as_rows(tokens), as_rows(labels)])
    self.assertEqual(found, contamination.evaluation_digests(
        [as_rows(tokens), as_rows(labels), np.zeros((8, 0), np.uint8)]))
    record = {"type": "check", "kind": "probe", "probes": [
        [0, 0, 8, tokens.tobytes(), []], [1, 0, 8, labels.tobytes(), []],
        [2, 0, 8, b"", []]]}  # the empty leaf: all 8 rows opened, no bytes
    rows, examples = contamination.probed_digests([record])
    self.assertEqual(sorted(found[d] for d in examples), list(range(8)))
    self.assertFalse(rows & set(found))  # neither tokens nor labels identify alone
    # 2**20 empty rows a Merkle row: nothing is built for them
    self.assertEqual(contamination.probed_rows(
        {"type": "check", "kind": "probe", "probes": [[0, 0, 1 << 20, b"", []]]}), [])

  def test_the_recipe_says_a_small_model_may_start_from_a_checkpoint_its_init_embeds(self):
    # A near-copy of another entry (its params in the init's constants, plus 1e-4 of the
    # key's noise) was verified with an attested start and ranked beside the original.
    embeds = "an init program may embed up to 65536 bytes, enough for a copy of the model's 40"
    self.assertIn(embeds, _left_open())
    # 512 KiB of params: not even an 8-bit copy fits in 64 KiB (128 KiB would: 32 KiB at 2 bits)
    large = [LeafLayout("w", "float32", (1 << 16, 2))]
    self.assertNotIn("the init's constants", _left_open(params_layout=large))
    self.assertIn("the init's constants", _left_open(
        params_layout=[LeafLayout("w", "float32", (1 << 14, 2))]))
    self.assertNotIn("the init's constants", _left_open(init_program=bytes(32)))
    # The update program's constants likewise, where the programs are not pinned: an update
    # that returned its stolen params on its committed batches (another step's batch moved
    # them) passed the program claim.
    update = "the training program's constants: enough for a copy of the model's 40 bytes"
    self.assertIn(update, _left_open())
    self.assertNotIn("the training program's constants", _left_open(allowed_programs="[]"))
    self.assertNotIn("the training program's constants", _left_open(params_layout=large))

  def test_the_recipe_says_a_program_may_transform_its_batches_unless_programs_are_pinned(self):
    transformed = "a program may change its batch before training on it (add one, XOR a key)"
    self.assertIn(transformed, _left_open())
    self.assertNotIn(transformed, _left_open(allowed_programs="[]"))
    self.assertNotIn(transformed, _left_open(training_set={"root": bytes(32), "size": 8}))

  def test_the_recipe_names_the_leaves_whole_examples_need_where_they_count(self):
    tokens, labels = LeafLayout("t", "int32", (8, 2)), LeafLayout("y", "int32", (8,))
    empty = LeafLayout("e", "float32", (8, 0))
    self.assertIn("the batch's leaves: a run whose batches carry a leaf",
                  _left_open(data_layout=[tokens, labels]))
    # one leaf with bytes: its rows are the examples, no whole example to miss
    self.assertNotIn("the batch's leaves", _left_open(data_layout=[tokens, empty]))


def _left_open(allowed_programs=None, **pins) -> str:
  """What a benchmark of no pins (8 rows of 5 tokens, 40 bytes of params) leaves open, with
  ``pins`` changed, as one text."""
  definition = {"training_set": None, "data_order": None, "init_program": None,
                "base_checkpoint": None, "min_probe_ratio": None,
                "data_layout": [LeafLayout("x", "int32", (8, 5))],
                "params_layout": [LeafLayout("w", "float32", (5, 2))], **pins}
  return " ".join(routes_registration.left_open(definition, allowed_programs))


class TrainingSetTest(absltest.TestCase):

  def test_every_row_of_every_leaf_is_proven_against_the_root(self):
    rows = {"x": np.arange(15, dtype=np.float32).reshape(5, 3),
            "y": np.asarray([7, 8, 9, 7, 1], np.int32)}  # row 3 of y repeats row 0
    train_set = TrainingSet(rows)
    self.assertEqual(train_set.size, 10)
    row_bytes = [r.tobytes() for r in rows["x"]] + [r.tobytes() for r in rows["y"]]
    outsider = np.float32([1, 2, 3]).tobytes()
    proofs = train_set.membership_proofs(row_bytes + [outsider])
    self.assertLen(proofs, 9)  # the repeated row once, the outsider left out
    for row, index, path in proofs:
      self.assertEqual(row_bytes[index], row)
      self.assertTrue(merkle.verify_inclusion(merkle.leaf_hash(row), index,
                                              train_set.size, path, train_set.root))
      self.assertFalse(merkle.verify_inclusion(merkle.leaf_hash(b"another row"), index,
                                               train_set.size, path, train_set.root))
    self.assertEqual({p[1] for p in proofs if p[0] == row_bytes[8]}, {5})  # the first 7


def spin(params, batch):
  """The tutorial's accuracy after a loop that runs for minutes: a program registration
  runs until the server's time limit."""
  _, x = jax.lax.while_loop(lambda c: c[0] < 2**30,
                            lambda c: (c[0] + 1, jnp.tanh(c[1] * 1.0001 + 0.1)),
                            (0, jnp.zeros(64)))
  return correct(params, batch) + 0 * x[0]


class ProgramChecksTest(absltest.TestCase):
  """Registration runs the owner's program: one check an owner at a time, two at once on a
  server, a failure once."""

  def test_checks_run_one_an_owner_two_a_server_and_a_failed_one_once(self):
    server = LocalServer(workers=0, extra_args=("--time-limit", "12")).start()
    self.addCleanup(server.close)
    owner, other, impatient, third = (
        dvbench.Client(server.url, token=server.token(name))
        for name in ("mallory", "oscar", "mallory", "trudy"))
    for client in (owner, other, impatient, third):
      self.addCleanup(client.close)
    impatient.http.retry_seconds = third.http.retry_seconds = 0  # no waiting out a 429/503
    params = _model().init(jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]

    def register(name, evaluate, client=owner):
      client.benchmark(name).register(metric="accuracy", evaluate=evaluate, params=params,
                                      rows=EVAL_ROWS)
    thread = concurrent.futures.ThreadPoolExecutor(1)  # one call stack: the same bytes
    self.addCleanup(thread.shutdown)
    other_thread = concurrent.futures.ThreadPoolExecutor(1)
    self.addCleanup(other_thread.shutdown)
    running = [thread.submit(register, "mallory/spin", spin),
               other_thread.submit(register, "oscar/spin", spin, other)]
    testing.wait_until(lambda: len(_checks(server)) == 2, 60)  # two owners' checks at once
    # Before, every request ran one more program for up to 600 s, all at once.
    with self.assertRaisesRegex(dvbench.errors.UploadError, "answered PUT "
                                "/api/v1/benchmarks/mallory/spin-again with HTTP 429: a program "
                                "check of 'mallory' is running; an owner's programs are checked "
                                "one at a time"):
      register("mallory/spin-again", spin, impatient)
    with self.assertRaisesRegex(dvbench.errors.UploadError, "answered PUT "
                                "/api/v1/benchmarks/trudy/spin with HTTP 503: the server is "
                                "checking 2 other owners' evaluation programs; retry in"):
      register("trudy/spin", spin, third)
    for check in running:
      with self.assertRaisesRegex(dvbench.errors.ApiError,  # CPU, or wall clock when busy
                                  "400.*exceeded the time limit of 12 s"):
        check.result(120)
    # Before, sending a failed program again ran it again. (The same bytes: a program's
    # locations name its call stack. Other bytes are another program, and wait their turn.)
    constant = lambda params, batch: jnp.ones(batch.shape[0]) + 0 * params["Dense_0"][
        "bias"].sum()
    refused = "400.*the evaluation program: its output does not read the batch: a constant"
    with self.assertRaisesRegex(dvbench.errors.ApiError, refused):
      thread.submit(register, "mallory/constant", constant).result(60)
    with self.assertRaisesRegex(dvbench.errors.ApiError, refused + r".* \(This program failed "
                                r"its check before; it is not run again.\)"):
      thread.submit(register, "mallory/constant-again", constant).result(60)


def _checks(server: LocalServer) -> set[bytes]:
  """The program folders of ``server``'s evaluation program checks running now."""
  checking = f"{server.data.resolve()}{os.sep}program-".encode()
  return {arg for command in _commands() if b"dvbench.benchmark\x00" in command
          for arg in command.split(b"\x00") if arg.startswith(checking)}


def _commands() -> list[bytes]:
  """The command lines of this machine's processes."""
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        found.append(f.read())
    except OSError:
      pass
  return found


if __name__ == "__main__":
  absltest.main()
