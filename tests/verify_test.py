"""The verifier fails closed: every tampering is caught and named."""

import pathlib
import random
import shutil
import tempfile

import cbor2
import jax.numpy as jnp
from absl.testing import absltest
from absl.testing import parameterized

from tests import testing
from zkdv import sampling
from zkdv import transcript
from zkdv import verify

STEPS = 8
_GOOD: pathlib.Path | None = None


def good_transcript() -> pathlib.Path:
  """One honest transcript (every step update-checked, some state-checked)."""
  global _GOOD
  if _GOOD is None:
    proof = testing.new_proof("tamper-source", update_p=1.0, state_p=0.5)
    proof.start()
    state = testing.classifier_state(proof)
    train_step = proof.jit(testing.classifier_step, donate_argnums=0)
    for i in range(STEPS):
      state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + (i % 2))
    proof.finish()
    _GOOD = proof.path
  return _GOOD


def copy_of_good() -> pathlib.Path:
  dst = pathlib.Path(tempfile.mkdtemp()) / "t"
  shutil.copytree(good_transcript(), dst)
  return dst


def rechained(edit, src: pathlib.Path | None = None) -> pathlib.Path:
  """A copy whose records are edited by ``edit`` and re-chained consistently."""
  src = src or good_transcript()
  records = [dict(r.record) for r in transcript.read_transcript(src).records]
  for r in records:
    r.pop("prev", None)
  dst = pathlib.Path(tempfile.mkdtemp()) / "t"
  writer = transcript.TranscriptWriter(dst)
  for r in edit(records):
    writer.append(r)
  writer.close()
  shutil.rmtree(dst / transcript.BLOBS_DIR)
  shutil.copytree(src / transcript.BLOBS_DIR, dst / transcript.BLOBS_DIR)
  return dst


def flip_byte(path: pathlib.Path, position: int) -> None:
  data = bytearray(path.read_bytes())
  data[position] ^= 0x01 << (position % 8)
  path.write_bytes(bytes(data))


class VerifierTest(parameterized.TestCase):

  def assert_fails(self, path, code=None, verdict=verify.INVALID):
    report = verify.verify(path)
    self.assertNotEqual(report.verdict, verify.VERIFIED)
    self.assertNotEqual(report.exit_code, 0)
    self.assertNotEmpty(report.findings)
    if verdict is not None:
      self.assertEqual(report.verdict, verdict, report.dumps())
    if code is not None:
      self.assertIn(code, {f.code for f in report.findings}, report.dumps())
    for f in report.findings:
      self.assertTrue(f.where and f.message)
    return report

  def test_honest_transcript_verifies(self):
    report = verify.verify(good_transcript())
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    self.assertEqual(report.exit_code, 0)
    self.assertEqual(report.steps, STEPS)
    self.assertEqual(sum(c.kind == "update" for c in report.checks), STEPS)
    self.assertTrue(all(c.status == "verified" for c in report.checks))
    self.assertEqual(verify.verify(good_transcript(), replay="none").verdict, verify.VERIFIED)

  @parameterized.parameters(*range(6))
  def test_any_flipped_record_byte_fails(self, seed):
    rng = random.Random(seed)
    size = (good_transcript() / transcript.RECORDS_FILE).stat().st_size
    for _ in range(8):
      path = copy_of_good()
      flip_byte(path / transcript.RECORDS_FILE, rng.randrange(size))
      self.assert_fails(path, verdict=None)

  @parameterized.parameters(*range(4))
  def test_any_flipped_blob_byte_fails(self, seed):
    rng = random.Random(seed)
    blobs = sorted((good_transcript() / transcript.BLOBS_DIR).iterdir())
    for _ in range(6):
      blob = rng.choice(blobs)
      if blob.stat().st_size == 0:
        continue
      path = copy_of_good()
      flip_byte(path / transcript.BLOBS_DIR / blob.name, rng.randrange(blob.stat().st_size))
      report = self.assert_fails(path)
      self.assertTrue({f.code for f in report.findings} & {"blob", "program_id"})

  def test_flipped_program_blob_byte_fails_naming_the_program(self):
    program = testing.records_of(good_transcript(), "program")[0]
    for position in (0, 100, 1000, -1):
      path = copy_of_good()
      blob = transcript.blob_path(path, program["blob"])
      flip_byte(blob, position % blob.stat().st_size)
      self.assert_fails(path, "program_id")

  @parameterized.parameters(*range(1, 6))
  def test_deleted_duplicated_or_reordered_record_fails(self, index):
    raw = transcript.read_transcript(good_transcript()).records
    for edit in ("delete", "duplicate", "swap"):
      parts = [r.raw for r in raw]
      if edit == "delete":
        del parts[index]
      elif edit == "duplicate":
        parts.insert(index, parts[index])
      else:
        parts[index], parts[index + 1] = parts[index + 1], parts[index]
      path = copy_of_good()
      (path / transcript.RECORDS_FILE).write_bytes(b"".join(parts))
      self.assert_fails(path, "chain")

  def test_edited_digest_with_ids_recomputed_downstream(self):
    for k in (0, 3, STEPS - 1):
      def edit(records, k=k):
        step = [r for r in records if r["type"] == "step"][k]
        step["post_state"] = bytes(32)
        return records
      report = self.assert_fails(rechained(edit))
      self.assertTrue({f.code for f in report.findings} & {"replay", "discontinuity",
                                                           "final_state", "opening"})

  def test_edited_batch_digest_fails_the_opening(self):
    def edit(records):
      [r for r in records if r["type"] == "step"][2]["batch"] = bytes(32)
      return records
    self.assert_fails(rechained(edit), "opening")

  def test_unknown_collectives_is_a_format_error_not_an_unverifiable_replay(self):
    def edit(records):
      next(r for r in records if r["type"] == "program")["collectives"] = "carrier-pigeon"
      return records
    report = self.assert_fails(rechained(edit), "schema")
    self.assertIn("unknown collectives 'carrier-pigeon'", report.dumps())

  def test_post_state_layout_must_describe_the_same_leaves(self):
    def edit(records):
      program = next(r for r in records if r["type"] == "program")
      program["post_state_layout"] = [dict(l) for l in program["state_layout"]]
      program["post_state_layout"][0]["shape"] = [7]
      return records
    report = self.assert_fails(rechained(edit), "schema")
    self.assertIn("post_state_layout does not match state_layout", report.dumps())

  def test_replaced_revealed_seed(self):
    def edit(records):
      records[-1]["seed"] = bytes(32)
      return records
    self.assert_fails(rechained(edit), "seed")

  def test_dropped_sampled_check(self):
    for kind in ("update", "state"):
      def edit(records, kind=kind):
        drop = next(i for i, r in enumerate(records)
                    if r["type"] == "check" and r["kind"] == kind)
        return records[:drop] + records[drop + 1:]
      self.assert_fails(rechained(edit), "missing_check")

  def test_sampling_decisions_are_recomputed(self):
    final = testing.records_of(good_transcript(), "final")[0]
    checks = {(c["step"], c["kind"]) for c in testing.records_of(good_transcript(), "check")}
    for t in range(STEPS):
      self.assertEqual((t, "state") in checks,
                       sampling.is_sampled(final["seed"], "state", t, 0.5))

  def test_torn_or_unfinished_transcript_is_never_a_success(self):
    path = copy_of_good()
    records = path / transcript.RECORDS_FILE
    records.write_bytes(records.read_bytes()[:-7])
    report = self.assert_fails(path, "torn_tail", verify.UNVERIFIABLE)
    self.assertIn("unfinished", {f.code for f in report.findings})
    self.assertEqual(report.exit_code, 2)
    self.assertEqual(report.steps, STEPS)  # everything complete was still checked
    self.assertTrue(all(c.status == "verified" for c in report.checks))

  def test_missing_blob_could_not_verify(self):
    path = copy_of_good()
    check = testing.records_of(path, "check")[0]
    blobs = check.get("pre_state_blobs") or check["post_state_blobs"]
    transcript.blob_path(path, blobs[-1]).unlink()
    self.assertEqual(self.assert_fails(path, "missing_blob", verify.UNVERIFIABLE).exit_code, 2)


class ProbeTamperTest(parameterized.TestCase):
  """Data probes: each step opens the seed's rows, each with its Merkle proof."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    proof = testing.new_proof("probes", update_p=0.0)
    proof.start(probe_ratio=0.5)
    state = testing.classifier_state(proof)
    train_step = proof.jit(testing.classifier_step)
    for i in range(4):
      state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + i)
    cls.path = proof.finish()

  def test_probes_verify_and_are_counted(self):
    report = verify.verify(self.path)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    # 4 steps x (2 of 4 rows of the batch) : one batch leaf.
    self.assertEqual(report.probed_rows, 4 * 2)
    step = testing.records_of(self.path, "step")[0]
    rows = [p[1] for p in step["probes"]]
    seed = testing.records_of(self.path, "final")[0]["seed"]
    self.assertEqual(rows, sampling.probe_rows(seed, 0, 0, 4, 0.5))

  def test_flipped_probe_blob(self):
    path = pathlib.Path(tempfile.mkdtemp()) / "t"
    shutil.copytree(self.path, path)
    probe = testing.records_of(path, "step")[1]["probes"][0]
    flip_byte(transcript.blob_path(path, probe[2]), 0)
    report = verify.verify(path)
    self.assertEqual(report.verdict, verify.INVALID)
    self.assertIn("probe", {f.code for f in report.findings})

  @parameterized.named_parameters(
      ("dropped_probe", lambda s: s["probes"].pop()),
      ("moved_probe", lambda s: s["probes"][0].__setitem__(1, (s["probes"][0][1] + 1) % 4)),
      ("bad_proof", lambda s: s["probes"][0][3].__setitem__(0, bytes(32))),
      ("bad_roots", lambda s: s["batch_roots"].__setitem__(0, bytes(32))),
  )
  def test_edited_probes_fail(self, change):
    def edit(records):
      change([r for r in records if r["type"] == "step"][2])
      return records
    report = verify.verify(rechained(edit, self.path))
    self.assertEqual(report.verdict, verify.INVALID, report.dumps())
    self.assertIn("probe", {f.code for f in report.findings})


class UntrustedInputTest(absltest.TestCase):

  def _write(self, data: bytes) -> pathlib.Path:
    folder = pathlib.Path(tempfile.mkdtemp())
    (folder / transcript.RECORDS_FILE).write_bytes(data)
    return folder

  def test_malformed_cbor(self):
    report = verify.verify(self._write(b"\xff\xff\xff\x1c garbage"))
    self.assertEqual(report.verdict, verify.INVALID)
    self.assertEqual(report.findings[0].code, "unreadable")

  def test_huge_length_prefix_and_deep_nesting(self):
    for data in (b"\x5b" + (2**62).to_bytes(8, "big") + b"abc",
                 b"\xbb" + (2**40).to_bytes(8, "big"),
                 b"\x81" * 100000 + b"\x00"):
      report = verify.verify(self._write(data))
      self.assertNotEqual(report.verdict, verify.VERIFIED)
      self.assertIn(report.findings[0].code, {"unreadable", "torn_tail"})

  def test_record_of_the_wrong_type(self):
    good = transcript.read_transcript(good_transcript()).records
    for bad in ({"type": "step", "index": "zero"}, {"type": "nonsense"}, {"no": "type"}):
      folder = self._write(good[0].raw + cbor2.dumps({**bad, "prev": good[0].record_id},
                                                     canonical=True))
      report = verify.verify(folder)
      self.assertEqual(report.verdict, verify.INVALID)
      self.assertIn("schema", {f.code for f in report.findings})

  def test_blob_path_escaping_the_transcript(self):
    def edit(records):
      check = next(r for r in records if r["type"] == "check")
      key = "pre_state_blobs" if "pre_state_blobs" in check else "post_state_blobs"
      check[key][0] = b"../../../../etc/passwd"
      return records
    report = verify.verify(rechained(edit))
    self.assertEqual(report.verdict, verify.INVALID)
    self.assertIn("not a blob digest", report.dumps())

  def test_missing_path(self):
    report = verify.verify("/nonexistent/zkdv/transcript")
    self.assertEqual(report.verdict, verify.UNVERIFIABLE)


if __name__ == "__main__":
  absltest.main()
