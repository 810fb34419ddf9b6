"""A start from a declared base checkpoint (``proof.init_from``): shown as such, verified by
its digest and by replaying the init program on it.

Each attack writes a transcript the way a dishonest prover would (through the driver, its
own screens removed where it has them) and is refused by ``zkdv verify --strict`` with a
message naming what does not hold.
"""

import json
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from dvbench import measurement
from tests import testing
from tests.cli_test import zkdv_here
from tests.start_test import EXAMPLE, create, new_proof, train
from zkdv import verify
from zkdv.jax import start as start_lib


def strict(path) -> tuple[int, dict]:
  """(exit status, report) of ``zkdv verify --strict --json``."""
  result = zkdv_here("verify", path, "--strict", "--json")
  return result.returncode, json.loads(result.stdout)


def claim(report: dict, name: str) -> dict:
  return next(c for c in report["claims"] if c["name"] == name)


def with_new_head(base, key, x):
  """The base with its output layer initialized again from the key (a new task's head)."""
  head = testing.TinyClassifier().init(key, x)["params"]["Dense_0"]
  return {**base, "Dense_0": {"kernel": head["kernel"], "bias": base["Dense_0"]["bias"]}}


class FineTuneTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # The base: the final params of a run from the key, as a reader would download them.
    model = testing.TinyClassifier()
    proof = new_proof("pretrain")
    state = create(proof, proof.init(model.init, jax.random.key(0), EXAMPLE)["params"], model)
    train_step = proof.jit(testing.classifier_step)
    for i in range(2):
      state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + i)
    cls.base = jax.tree.map(np.asarray, jax.device_get(state.params))
    (final,) = testing.records_of(proof.finish(), "final")
    cls.pretrained_final = final["final_params"]

  def fine_tune(self, name, base=None, init_fn=None, *args, edit=None):
    proof = new_proof(name)
    params = proof.init_from(self.base if base is None else base, init_fn, *args)
    state = create(proof, params)
    if edit is not None:
      state = edit(state)
    return train(proof, state)

  def test_honest_fine_tune_is_verified_from_the_named_base(self):
    path = self.fine_tune("fine-tune")
    (init,) = testing.records_of(path, "init")
    # The declared digest is the checkpoint digest readers use: the pretraining proof's
    # final params and a measurement's digest of the same pytree.
    self.assertEqual(init["base_checkpoint"], self.pretrained_final)
    self.assertEqual(measurement.params_digest(self.base), self.pretrained_final)
    self.assertEqual([l["path"] for l in init["base_layout"]],
                     ["['Dense_0']['bias']", "['Dense_0']['kernel']"])
    status, report = strict(path)
    start = claim(report, "start")
    self.assertEqual(start["status"], verify.HOLDS, start)
    self.assertEqual(claim(report, "program")["status"], verify.HOLDS, claim(report, "program"))
    base = self.pretrained_final.hex()
    self.assertEqual((start["facts"]["start"], start["facts"]["base_checkpoint"]), ("base", base))
    self.assertIn(f"base checkpoint {base} (declared by the prover, not trained here)",
                  start["detail"])
    # Self-challenged here, so not ranked; the label names the base (never "from scratch").
    self.assertEqual(report["standing"]["base_checkpoint"], base)
    self.assertEqual(report["standing"]["label"],
                     f"self-audited from base checkpoint {base[:16]}…")
    self.assertEqual(status, 1)  # self-challenged: --strict needs a server's challenges
    inspected = zkdv_here("inspect", path).stdout
    self.assertIn(f"from base checkpoint {base} (declared)", inspected)

  def test_a_new_head_from_the_key_on_a_base_is_verified(self):
    path = self.fine_tune("new-head", None, with_new_head, jax.random.key(0), EXAMPLE)
    start = claim(strict(path)[1], "start")
    self.assertEqual(start["status"], verify.HOLDS, start)
    self.assertEqual(start["facts"]["base_checkpoint"], self.pretrained_final.hex())

  def test_attack_declared_digest_is_not_the_base_read(self):
    # The prover declares a reputable checkpoint's digest and starts from other params.
    other = jax.tree.map(lambda p: p + 0.25, self.base)
    declared = start_lib.base_fields(self.base)
    with mock.patch.object(start_lib, "base_fields", lambda base: declared):
      path = self.fine_tune("declared-other", other)
    start = claim(strict(path)[1], "start")
    self.assertEqual(start["status"], verify.DOES_NOT_HOLD)
    self.assertRegex(start["detail"], "the base params the init program reads have params "
                     rf"digest [0-9a-f]{{64}}, not the declared base checkpoint "
                     f"{self.pretrained_final.hex()}")

  def test_attack_pre_state_is_not_the_base_named(self):
    # The init runs on the declared base; step 0 starts from other params.
    path = self.fine_tune("swapped-after-init", edit=lambda s: s.replace(
        params=jax.tree.map(lambda p: p + 0.25, s.params)))
    start = claim(strict(path)[1], "start")
    self.assertEqual(start["status"], verify.DOES_NOT_HOLD)
    self.assertRegex(start["detail"], r"params leaf \.params\['Dense_0'\]\['(bias|kernel)'\] "
                     "of step 0 is not an output of the init program")

  def test_attack_base_blob_altered(self):
    path = self.fine_tune("altered-blob")
    (init,) = testing.records_of(path, "init")
    blob = path / "blobs" / init["input_blobs"][1].hex()  # the base's kernel
    blob.write_bytes(np.asarray(self.base["Dense_0"]["kernel"] + 1).tobytes())
    start = claim(strict(path)[1], "start")
    self.assertEqual(start["status"], verify.DOES_NOT_HOLD)
    self.assertIn(f"an input blob of the init program: blob {init['input_blobs'][1].hex()} "
                  "does not hash to its name", start["detail"])

  def test_attack_init_ignoring_its_base(self):
    # A start from the key that names a base it never reads.
    model = testing.TinyClassifier()
    path = self.fine_tune("ignores-base", None, lambda base, key, x: model.init(key, x)[
        "params"], jax.random.key(0), EXAMPLE)
    start = claim(strict(path)[1], "start")
    self.assertEqual(start["status"], verify.DOES_NOT_HOLD)
    self.assertIn("the init program ignores its base checkpoint: no params leaf of step 0 "
                  "changes when the base params do", start["detail"])

  def test_attack_a_base_digest_without_its_layout(self):
    declared = start_lib.base_fields(self.base)
    with mock.patch.object(start_lib, "base_fields", lambda base: {
        "base_checkpoint": declared["base_checkpoint"]}):
      path = self.fine_tune("half-declared")
    start = claim(strict(path)[1], "start")
    self.assertEqual(start["status"], verify.DOES_NOT_HOLD)
    self.assertIn("the init record's base checkpoint: base_layout and base_checkpoint come "
                  "together", start["detail"])

  def test_a_base_holds_params_not_keys(self):
    with self.assertRaisesRegex(ValueError, "a base checkpoint holds params arrays, not PRNG "
                                "keys"):
      new_proof("key-in-base").init_from({"w": jnp.ones(2), "key": jax.random.key(0)})


if __name__ == "__main__":
  absltest.main()
