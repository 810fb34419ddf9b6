"""Format 4 row groups: where a batch's rows are small, a Merkle leaf of its row tree holds
several of them (``digest.row_group_for``), so committing a batch takes a few hashes
instead of one per row. A probe opens a whole group inline, its rows' bytes joined with
their count (the server splits them and names each row by its own BLAKE3)."""

import functools

import blake3
import jax
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from dvbench import contamination
from tests import testing
from tests.verify_test import VerifierTestCase, first, rechained
from zkdv import digest
from zkdv import errors
from zkdv import records
from zkdv import transcript
from zkdv import verify
from zkdv.digest import LeafLayout

ROWS, WIDTH, STEPS = 32, 256, 4  # uint32 rows of 1 KiB: 16 per Merkle leaf, 2 leaves


def batch(step: int) -> np.ndarray:
  return np.random.default_rng(step).integers(0, 2, (ROWS, WIDTH), dtype=np.uint32)


@functools.cache
def grouped_transcript():
  """Four steps of the tutorial's classifier on 1 KiB rows, every step probed."""
  proof = testing.new_proof("grouped", update_p=1.0)
  proof.start(probe_ratio=0.5)
  state = testing.classifier_state(proof)
  train_step = proof.jit(testing.classifier_step, donate_argnums=0)
  for step in range(STEPS):
    state = train_step(state, jax.numpy.asarray(batch(step)))
  return proof.finish()


class RowGroupForTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("images_784_floats", LeafLayout("x", "float32", (128, 784)), (), 8),
      ("labels", LeafLayout("y", "int32", (128,)), (), 128),
      ("divides_the_leading_axis", LeafLayout("y", "int32", (100,)), (), 4),
      ("large_rows_alone", LeafLayout("x", "float32", (8, 64, 64, 3)), (), 1),
      ("within_each_process", LeafLayout("y", "int32", (128,)), (0, 48, 48, 128), 16),
      ("key", LeafLayout("k", "uint32", (4, 2), key_impl="threefry2x32"), (), 1),
      ("scalar", LeafLayout("s", "float32", ()), (), 1),
      ("no_rows", LeafLayout("x", "float32", (0, 3)), (), 1))
  def test_group(self, layout, boundaries, expected):
    group = digest.row_group_for(layout, boundaries)
    self.assertEqual(group, expected)
    grouped = LeafLayout(layout.path, layout.dtype, layout.shape, layout.key_impl,
                         row_group=group)
    self.assertEqual(grouped.rows, layout.rows // group if layout.shape else 1)

  @parameterized.parameters(0, -2, True, 3, 2.0, "4")
  def test_a_row_group_that_does_not_divide_the_rows_is_refused(self, group):
    with self.assertRaisesRegex(ValueError, "row_group"):
      LeafLayout.from_record({"path": "y", "dtype": "int32", "shape": [128],
                              "row_group": group})

  def test_a_scalar_has_no_groups(self):
    with self.assertRaisesRegex(ValueError, "does not divide"):
      LeafLayout("s", "float32", (), row_group=2)


class RowGroupsTest(VerifierTestCase):

  def test_small_rows_are_grouped_and_verify(self):
    report = verify.verify(grouped_transcript())
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    self.assertEqual(report.probed_rows, STEPS * 16)  # one group of the two at each step
    records = testing.records_of(grouped_transcript())
    self.assertEqual(records[0]["format_version"], transcript.FORMAT_VERSION)
    layout = first(records, "program")["batch_layout"][0]
    self.assertEqual((layout["shape"], layout["row_group"]), ([ROWS, WIDTH], 16))

  def test_a_probe_opens_each_row_of_its_group_under_the_rows_own_digest(self):
    probes = [r for r in testing.records_of(grouped_transcript(), "check")
              if r["kind"] == "probe"]
    self.assertLen(probes, STEPS)
    for record in probes:
      (entry,) = record["probes"]
      leaf, group, count, opened, proof = entry
      rows = batch(record["step"])[group * 16:(group + 1) * 16]
      self.assertEqual((leaf, count, len(proof)), (0, 16, 1))
      self.assertEqual(opened, rows.tobytes())  # inline, one byte string
      self.assertEqual(records.probed_rows(entry), [r.tobytes() for r in rows])
      # The server matches each row's digest against benchmark and training-set rows.
      self.assertEqual(contamination.probed_rows(record), [
          (0, group * 16, [blake3.blake3(r.tobytes()).digest() for r in rows])])

  def test_probes_that_do_not_fit_in_one_record_are_refused_before_the_step(self):
    proof = testing.new_proof("too-many-probed", update_p=1.0)
    proof.start(probe_ratio=1.0)
    state = testing.classifier_state(proof)
    train_step = proof.jit(testing.classifier_step, donate_argnums=0)
    with self.assertRaisesRegex(errors.StepInputError, r"a step's probes would open 4194304 "
                                r"rows \(167772160 bytes.* choose a smaller probe_ratio"):
      train_step(state, jax.numpy.zeros((1 << 22, 10), np.uint32))
    state = train_step(state, jax.numpy.asarray(batch(0)))  # nothing was taken: it goes on
    report = verify.verify(proof.finish())
    self.assertEqual((report.verdict, report.probed_rows), (verify.VERIFIED, ROWS))

  def test_a_row_wider_than_a_record_string_travels_as_chunks_and_verifies(self):
    path = testing.wide_rows_transcript()
    (probe, *_) = [r for r in testing.records_of(path, "check") if r["kind"] == "probe"]
    ((_, _, count, chunks, _),) = probe["probes"]
    self.assertEqual((count, [len(c) for c in chunks]), (1, [1 << 20, 4]))
    report = verify.verify(path)
    self.assertEqual((report.verdict, report.probed_rows), (verify.VERIFIED, 2))

  def test_a_leaf_of_empty_rows_opens_no_rows(self):
    # Attack: a batch leaf whose rows hold no bytes costs nothing to commit or to open, yet
    # each of its probe entries named a Merkle row of rows (up to 2**20). The report counted
    # them as opened, and the contamination index built and hashed each one.
    proof = testing.new_proof("empty-rows", update_p=1.0)
    proof.start(probe_ratio=1.0)
    state = testing.classifier_state(proof)
    train_step = proof.jit(lambda state, rows, empty: testing.classifier_step(state, rows),
                           donate_argnums=0)
    for step in range(2):
      state = train_step(state, jax.numpy.asarray(batch(step)),
                         jax.numpy.zeros((ROWS, 0), np.float32))
    path = proof.finish()
    report = verify.verify(path)
    self.assertEqual((report.verdict, report.probed_rows), (verify.VERIFIED, 2 * ROWS))
    for record in testing.records_of(path, "check"):
      if record["kind"] != "probe":
        continue
      empty = [e for e in record["probes"] if e[0] == 1]
      self.assertEqual([e[2:4] for e in empty], [[ROWS, b""]])  # all rows, no bytes
      self.assertEqual((records.opened_row_count(empty[0]), records.probed_rows(empty[0])),
                       (0, []))
      self.assertEqual({leaf for leaf, _, _ in contamination.probed_rows(record)}, {0})

  def test_rows_swapped_within_a_group_are_caught(self):
    def swap(records):
      probe = first(records, "check", kind="probe")
      data, width = probe["probes"][0][3], WIDTH * 4  # 1 KiB rows
      probe["probes"][0][3] = data[width:2 * width] + data[:width] + data[2 * width:]
      return records
    report = self.assert_fails(rechained(swap, grouped_transcript()), "probe")
    self.assertIn("not in the committed batch", report.dumps())

  def test_a_group_opened_as_one_row_is_malformed(self):
    def one_row(records):
      probe = first(records, "check", kind="probe")
      probe["probes"][0][2] = 1  # the group's bytes said to be one row
      return records
    report = self.assert_fails(rechained(one_row, grouped_transcript()), "probe")
    self.assertIn("malformed probe entry", report.dumps())

  @parameterized.parameters(1, 8, 32)
  def test_a_grouping_other_than_the_protocols_is_refused(self, group):
    def regroup(records):
      first(records, "program")["batch_layout"][0]["row_group"] = group
      return records
    report = self.assert_fails(rechained(regroup, grouped_transcript()), "schema")
    self.assertIn(f"row_group {group} of [0][1]: the protocol groups 16 rows of its layout "
                  "uint32[32, 256]", report.dumps())

  def test_a_row_group_on_a_state_layout_is_malformed(self):
    def group_state(records):
      layout = next(l for l in first(records, "program")["state_layout"]
                    if l["shape"] and l["shape"][0] % 2 == 0)
      layout["row_group"] = 2
      return records
    report = self.assert_fails(rechained(group_state, grouped_transcript()), "schema")
    self.assertIn("row_group is a field of batch layouts only", report.dumps())


if __name__ == "__main__":
  absltest.main()
