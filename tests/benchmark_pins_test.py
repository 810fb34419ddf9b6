"""Fine-tuned proofs and a benchmark's start and probe pins, against a real server.

A run from a declared base checkpoint (``proof.init_from``) is verified and says so in its
state, JSON, receipt and page; a benchmark accepts it only where it pins that checkpoint,
and a benchmark may pin the init program and a minimum probe ratio. Each entry that does
not meet a pin is refused naming it; the leaderboard shows per entry which pins hold.
"""

import html
import pathlib
import subprocess
import sys
import tempfile

import httpx
import jax
import jax.numpy as jnp
from flax import serialization

import dvbench
from tests.benchmark_test import EVAL_ROWS, correct
from tests import testing
from tests.dvbench_test import DVBenchTestCase
from tests.measurement_test import _model, train
from zkdv import receipt


class BenchmarkPinsTest(DVBenchTestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    url = cls.server.url
    cls.benchmark_clients()
    cls.honest, cls.honest_proof = train(url, "your-name/honest", 2)
    base = serialization.msgpack_restore(cls.honest.read_bytes())
    # Another owner fine-tunes the honest run's published final params.
    cls.tuned, cls.tuned_proof = train(url, "mallory/fine-tuned", 2, attested_start=False,
                                       edits=(
        ("Client(API_URL)", "Client(API_URL, token=TOKEN)"),
        ("state = zkdv.jax.contrib.TrainState.create(",
         "params = proof.init_from(BASE)\nstate = zkdv.jax.contrib.TrainState.create(")),
        names={"TOKEN": cls.server.token("mallory"), "BASE": base})
    for client, proof_id in ((cls.submitter, cls.honest_proof), (cls.mallory, cls.tuned_proof)):
      state = client.wait_for_verdict(proof_id, 120)["state"]
      assert state == "verified", (proof_id, state)
    cls.base_digest = cls.proof_json(cls.honest_proof)["final_params"]
    cls.params = _model().init(jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]

  @classmethod
  def proof_json(cls, proof_id: str) -> dict:
    return httpx.get(f"{cls.server.url}/api/v1/proofs/{proof_id}").json()

  def register(self, name, **pins):
    self.owner.benchmark(name).register(metric="accuracy", evaluate=correct, params=self.params,
                                        rows=EVAL_ROWS, min_update_check_probability=0.5,
                                        **pins)
    return name

  def refused(self, pattern: str):
    return self.assertRaisesRegex(dvbench.errors.ApiError, f"409.*{pattern}")

  def init_program(self, proof_id: str) -> str:
    return self.proof_json(proof_id)["init_program"]

  def test_a_fine_tuned_proof_is_verified_and_names_its_base(self):
    status = self.proof_json(self.tuned_proof)
    base = self.base_digest
    self.assertEqual((status["state"], status["shortfalls"], status["base_checkpoint"]),
                     ("verified", [], base))
    self.assertTrue(status["label"].startswith(f"verified from base checkpoint {base[:16]}…: "),
                    status["label"])
    self.assertIsNone(self.proof_json(self.honest_proof)["base_checkpoint"])
    signed = httpx.get(f"{self.server.url}/api/v1/proofs/{self.tuned_proof}/receipt").content
    fields = receipt.open_receipt(
        signed, httpx.get(f"{self.server.url}/api/v1/server-key").json()["server_key"])
    self.assertEqual(fields["standing"], {"state": "verified", "shortfalls": [],
                                          "label": f"verified from base checkpoint {base[:16]}…",
                                          "base_checkpoint": base})
    page = html.unescape(httpx.get(f"{self.server.url}/proofs/{self.tuned_proof}").text)
    self.assertIn(f"verified from base checkpoint {base[:16]}…", page)
    self.assertIn(f": verified from base checkpoint {base[:16]}…, 2 steps",
                  self.mallory.summary(self.tuned_proof))
    # Downloaded, the proof passes zkdv verify --strict with the start its base.
    folder = pathlib.Path(tempfile.mkdtemp()) / "tuned"
    subprocess.run([sys.executable, "-m", "dvbench.cli", "download", self.tuned_proof,
                    str(folder), "--url", self.server.url], check=True, capture_output=True,
                   cwd=pathlib.Path(__file__).resolve().parent.parent)
    code, report = testing.zkdv_verify(folder, "--strict", "--server-key",
                                       fields["server_key"].hex())
    self.assertEqual((code, report["standing"]["label"]),
                     (0, f"verified from base checkpoint {base[:16]}…"), str(report))

  def test_attack_a_fine_tune_of_another_owners_entry_needs_a_base_pin(self):
    name = self.register("alice/from-scratch")
    with self.refused(f"base_checkpoint: the start is base checkpoint {self.base_digest[:16]}… "
                      f"\\(the final params of proof {self.honest_proof} of 'your-name/honest'"
                      r"\), and the benchmark pins no base checkpoint"):
      self.mallory.benchmark(name).submit(self.tuned_proof, self.tuned)
    board = self.owner.benchmark(name)
    self.assertIn("starts from a base checkpoint are not accepted",
                  " ".join(board.info()["left_open"]))

  def test_a_pinned_base_ranks_fine_tunes_from_it_and_names_whose_it_is(self):
    name = self.register("alice/fine-tune-of-honest", base_checkpoint=self.base_digest)
    self.assertEqual(self.owner.benchmark(name).info()["base_checkpoint"], self.base_digest)
    with self.refused(r"base_checkpoint: the start is not from the pinned base checkpoint "
                      rf"{self.base_digest[:16]}… \(from the key\)"):
      self.submitter.benchmark(name).submit(self.honest_proof, self.honest)
    bench = self.mallory.benchmark(name)
    entry = bench.wait(bench.submit(self.tuned_proof, self.tuned)["id"])
    self.assertEqual(entry["state"], "scored", entry)
    (row,) = bench.leaderboard()
    self.assertEqual((row["rank"], row["base_checkpoint"], row["base_of"]),
                     (1, self.base_digest, {"id": self.honest_proof,
                                            "experiment": "your-name/honest"}))
    self.assertEqual((row["pins"]["base_checkpoint"], row["pins"]["init_program"]),
                     ("holds", "not pinned"))
    page = html.unescape(httpx.get(f"{self.server.url}/benchmarks/{name}").text)
    self.assertIn(f"base checkpoint <code>{self.base_digest[:12]}…</code>", page)
    self.assertIn("the final params of <a href=", page)
    self.assertIn(f"<tr><th>base checkpoint</th><td><code>{self.base_digest}</code>", page)

  def test_attack_another_init_program_than_the_pinned_one(self):
    pinned = "ab" * 32
    name = self.register("alice/pinned-init", init_program=pinned)
    with self.refused(f"init_program: init program {self.init_program(self.honest_proof)[:16]}"
                      f"…, not the pinned {pinned[:16]}…"):
      self.submitter.benchmark(name).submit(self.honest_proof, self.honest)

  def test_the_pinned_init_program_holds(self):
    name = self.register("alice/honest-init",
                         init_program=self.init_program(self.honest_proof))
    bench = self.submitter.benchmark(name)
    entry = bench.wait(bench.submit(self.honest_proof, self.honest)["id"])
    self.assertEqual(entry["state"], "scored", entry)
    (row,) = bench.leaderboard()
    self.assertEqual(row["pins"]["init_program"], "holds")
    self.assertEqual(row["pins"]["probe_ratio"], "not pinned (the proof opened each batch "
                     "row with probability 0.5)")
    self.assertTrue(row["ranked"], row["unranked_because"])

  def test_attack_a_probe_ratio_below_the_pinned_minimum(self):
    name = self.register("alice/probe-most-rows", min_probe_ratio=0.75)
    self.assertEqual(self.owner.benchmark(name).info()["min_probe_ratio"], 0.75)
    with self.refused("min_probe_ratio: probe ratio 0.5, below the pinned minimum 0.75"):
      self.submitter.benchmark(name).submit(self.honest_proof, self.honest)
    page = html.unescape(httpx.get(f"{self.server.url}/benchmarks/{name}").text)
    self.assertIn("<tr><th>min probe ratio</th><td>0.75</td></tr>", page)

  def test_pins_are_checked_at_registration(self):
    for pins, message in (({"min_probe_ratio": 1.5}, "min_probe_ratio: null or a float in "
                           r"\(0, 1\]"),
                          ({"init_program": "ab" * 8}, "init_program: null or a 32-byte "
                           "digest")):
      with self.assertRaisesRegex(dvbench.errors.ApiError, f"400.*{message}"):
        self.register("alice/bad-pin", **pins)
