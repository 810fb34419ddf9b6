"""A dishonest prover's transcripts (issue 11, 16): none of them exits 0."""

import os
import pathlib
import tempfile

import jax
import jax.numpy as jnp
from absl.testing import absltest
from absl.testing import parameterized

from tests.verify_test import (BATCH, STATE, STEPS, VerifierTestCase, _Dvbench, copy_of, first,
                               flip_byte, good_transcript, precomputed_step, rechained, write_receipt,
                               write_transcript)
from zkdv import digest
from zkdv import receipt as receipt_lib
from zkdv import verify


def _set_policy(**fields):
  def edit(records):
    policy = records[0]["challenger"]["policy"]
    for name, value in fields.items():
      if value is None:
        policy.pop(name)
      else:
        policy[name] = value
    return records
  return edit


class PolicyTamperTest(VerifierTestCase):

  @parameterized.named_parameters(
      ("zero", {"update_check_probability": 0.0}),
      ("negative", {"update_check_probability": -0.5}),
      ("missing", {"update_check_probability": None}),
      ("above_one", {"state_check_probability": 1.5}),
      ("string", {"probe_ratio": "all"}),
  )
  def test_root_policy_is_validated(self, fields):
    self.assert_fails(rechained(_set_policy(**fields)), "policy")

  def test_equivalent_mode_with_infinite_tolerance(self):
    def edit(records):
      first(records, "program")["mode"] = "equivalent"
      records[0]["config"].update(rtol=float("inf"), atol=float("inf"))
      return records
    report = self.assert_fails(rechained(edit), "policy")
    self.assertIn("rtol inf is not a finite number", report.dumps())

  def test_mode_outside_the_closed_set(self):
    def edit(records):
      first(records, "program")["mode"] = "trust-me"
      return records
    self.assert_fails(rechained(edit), "schema")

  def test_looser_tolerance_than_the_verifier_accepts(self):
    def edit(records):
      records[0]["config"]["rtol"] = 0.5
      return records
    path = rechained(edit)
    self.assert_fails(path, "policy", verify.UNVERIFIABLE)
    report = verify.verify(path, tolerance=verify.Tolerance(0.5, 1e-6))
    self.assertEqual(report.exit_code, 0, report.dumps())

  def test_zero_step_transcript_naming_a_checkpoint(self):
    def edit(records):
      final = records[-1]
      kept = [r for r in records if r["type"] in ("root", "program")]
      final.update(steps=0, final_params=bytes(range(32)))
      final.pop("final_state"), final.pop("final_state_leaves")
      return kept + [final]
    report = self.assert_fails(rechained(edit), "no_steps")
    self.assertIn("final_state", {f.code for f in report.findings})

  def test_sharded_final_params_without_an_opening(self):
    sharded = (digest.LeafLayout(STATE[0].path, "float32", (3,), pieces=(((0, 2),), ((2, 3),))),
               STATE[1])
    path = write_transcript(state=sharded, policy={"update_check_probability": 1.0})
    def edit(records):
      records[-1]["final_params"] = bytes(32)
      return records
    report = self.assert_fails(rechained(edit, path), "final_params", verify.UNVERIFIABLE)
    self.assertIn("cannot be derived", report.dumps())

  def test_replay_none_never_exits_0(self):
    report = self.assert_fails(good_transcript(), "not_replayed", verify.UNVERIFIABLE,
                               replay="none")
    self.assertEqual(report.exit_code, 2)
    self.assertEqual(report.claim("replays").status, verify.COULD_NOT_VERIFY)

  def test_fewer_checks_than_required(self):
    path = write_transcript(policy={"update_check_probability": 1e-9})
    self.assert_fails(path, "too_few_checks", verify.UNVERIFIABLE)
    self.assertEqual(verify.verify(good_transcript(), min_checks=STEPS + 1).exit_code, 2)



def _hostile(x):
  return jax.ffi.ffi_call("xla_ffi_python_cpu_callback",
                          jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True)(x)


def _with_program(fn, disabled=()) -> pathlib.Path:
  """The good transcript with its program replaced by ``fn`` exported over the same inputs."""
  specs = [jax.ShapeDtypeStruct(l.shape, l.dtype) for l in STATE + BATCH]
  exported = jax.export.export(jax.jit(fn, keep_unused=True), disabled_checks=[
      jax.export.DisabledSafetyCheck.custom_call(t) for t in disabled])(*specs)
  path = copy_of(good_transcript())
  blob = bytes(exported.serialize())
  program_id = digest.leaf_digest(memoryview(blob))
  (path / "blobs" / program_id.hex()).write_bytes(blob)
  def edit(records):
    first(records, "program").update(program_id=program_id, blob=program_id)
    return records
  return rechained(edit, path)


class ProgramTamperTest(VerifierTestCase):

  @parameterized.named_parameters(
      ("host_callback", "xla_ffi_python_cpu_callback", "calls back into the host"),
      ("unknown_custom_call", "my_secret_kernel", "not on the allow-list"),
  )
  def test_custom_call_program_is_refused_before_compiling(self, target, message):
    def step(w, b, x):
      call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(w.shape, w.dtype),
                              has_side_effect=True)
      return call(w) + jnp.sum(x), b
    report = self.assert_fails(_with_program(step, [target]), "unsafe_program")
    self.assertIn(message, report.dumps())
    self.assertEqual(report.claim("program").status, verify.DOES_NOT_HOLD)

  def test_program_with_stateful_random_numbers_is_refused_before_compiling(self):
    # XLA's stateful RNG advances with each call of an executable: a program reading it
    # can train on a verifier's perturbed replays and return carried weights otherwise.
    def step(w, b, x):
      drawn = jax.lax.rng_uniform(0.0, 1.0, w.shape)
      return w + 0.0 * drawn + jnp.sum(x), b
    report = self.assert_fails(_with_program(step), "unsafe_program")
    self.assertIn("reads state outside its inputs (stablehlo.rng", report.dumps())
    self.assertEqual(report.claim("program").status, verify.DOES_NOT_HOLD)

  def test_compiler_options_cannot_write_files(self):
    dump = pathlib.Path(tempfile.mkdtemp()) / "dumped"
    def edit(records):
      first(records, "program")["compiler_options"] = {
          "xla_dump_to": str(dump), "xla_dump_hlo_as_text": "true",
          "xla_cpu_enable_fast_math": "false"}
      return records
    report = verify.verify(rechained(edit))
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    self.assertFalse(dump.exists())
    self.assertIn("ignored compiler options ['xla_dump_hlo_as_text', 'xla_dump_to']",
                  " ".join(report.notes))

  def test_batch_independent_program_does_not_hold_the_program_claim(self):
    report = verify.verify(write_transcript(fn=precomputed_step))
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    self.assertEqual(report.claim("program").status, verify.DOES_NOT_HOLD)
    self.assertEqual(report.exit_code, 0)  # not required by default
    self.assertEqual(verify.verify(write_transcript(fn=precomputed_step),
                                   required=("program",)).exit_code, 1)


def _one_element_a_leaf_step(w, b, x):
  """Trains w[0] and b on the batch; the rest of w is a carried constant."""
  return (w.at[1:].set(jnp.array([0.25, 0.75])).at[0].add(jnp.sum(x) * 1e-3),
          b + jnp.sum(x) * 1e-3)


class ProgramClaimLimitTest(VerifierTestCase):
  """What the program claim does not show, shown: an update moved by its batch in one
  element a leaf reads its batch, and the claim says that is all it shows."""

  def test_a_program_that_trains_one_element_a_leaf_holds_the_claim_and_names_the_limit(self):
    report = verify.verify(write_transcript(fn=_one_element_a_leaf_step))
    program = report.claim("program")
    self.assertEqual(program.status, verify.HOLDS, report.dumps())
    self.assertIn("lets them move only some elements or the last bits of params it carries",
                  program.detail)


class PostStateDtypeTamperTest(VerifierTestCase):
  """A program record that claims its post-state leaves another dtype than it is."""

  @staticmethod
  def _claiming_float16_bias(segment_length: int) -> pathlib.Path:
    def edit(records):
      layouts = [l.to_record() for l in STATE]
      layouts[1]["dtype"] = "float16"
      first(records, "program")["post_state_layout"] = layouts
      return records
    return rechained(edit, write_transcript(segment_length=segment_length))

  def test_a_program_that_changes_dtypes_cannot_run_twice_in_a_segment(self):
    report = self.assert_fails(self._claiming_float16_bias(2), "segment")
    self.assertIn("returns its state in other dtypes than it takes", report.dumps())

  def test_a_claimed_dtype_the_program_does_not_return_fails_its_replay(self):
    self.assert_fails(self._claiming_float16_bias(1), "replay")


class ReceiptTest(VerifierTestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = _Dvbench()
    cls.path = write_transcript(server=cls.server)

  def test_good_receipt_agrees_and_challenges_hold(self):
    report = verify.verify(self.path, server_key=self.server.server_key, strict=False)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    self.assertTrue(report.receipt["agrees"])
    self.assertEqual(report.claim("challenges").status, verify.HOLDS)
    self.assertIn(f"dvbench {self.server.server_key.hex()[:16]}",
                  report.claim("challenges").detail)
    self.assertEqual(report.exit_code, 0)

  def test_challenge_key_given_by_hand_rederives_but_does_not_verify_challenges(self):
    report = verify.verify(self.path, challenge_key=self.server.key)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    # The replays rest on a key the prover could have held from the start (its own server's).
    self.assertEqual(report.claim("replays").status, verify.COULD_NOT_VERIFY, report.dumps())
    self.assertEqual(report.claim("replays").facts["key_source"], "challenge key")
    self.assertEqual(report.claim("challenges").status, verify.COULD_NOT_VERIFY)
    self.assertIn("given by hand", report.claim("challenges").detail)
    wrong = verify.verify(self.path, challenge_key=bytes(32))
    self.assertIn("challenge_key", {f.code for f in wrong.findings})

  def test_without_key_challenges_could_not_verify(self):
    report = verify.verify(self.path)
    self.assertEqual(report.claim("challenges").status, verify.COULD_NOT_VERIFY)
    self.assertIn("pass --server-key", report.claim("challenges").detail)
    self.assertEqual(report.exit_code, 2)

  def test_flipped_receipt_byte(self):
    for position in (5, 40, -3):
      path = copy_of(self.path)
      receipt = path / receipt_lib.RECEIPT_FILE
      flip_byte(receipt, position % receipt.stat().st_size)
      self.assert_fails(path, "receipt", server_key=self.server.server_key)

  def test_wrong_server_key(self):
    other = _Dvbench()
    report = self.assert_fails(self.path, "server_key", server_key=other.server_key)
    self.assertIn("another server challenged it", report.dumps())
    path = copy_of(self.path)
    other.key, other.nonce = self.server.key, self.server.nonce
    write_receipt(path, other)  # signed by another key than the root names
    self.assert_fails(path, "receipt", server_key=self.server.server_key)

  def test_receipt_of_another_transcript(self):
    path = copy_of(self.path)
    another = write_transcript(server=self.server, steps=3)
    os.replace(another / receipt_lib.RECEIPT_FILE, path / receipt_lib.RECEIPT_FILE)
    report = self.assert_fails(path, "receipt", server_key=self.server.server_key)
    self.assertIn("does not bind to this transcript", report.dumps())

  def test_receipt_saying_invalid_disagrees(self):
    path = copy_of(self.path)
    write_receipt(path, self.server, verdict="invalid")
    report = self.assert_fails(path, "receipt_verdict", verify.UNVERIFIABLE,
                               server_key=self.server.server_key)
    self.assertFalse(report.receipt["agrees"])

  def test_self_transcript_with_seed_in_dvbench_final(self):
    def edit(records):
      records[-1]["seed"] = bytes(32)
      return records
    self.assert_fails(rechained(edit, self.path), "schema", challenge_key=self.server.key)


if __name__ == "__main__":
  absltest.main()
