"""Layouts a dishonest prover writes: shard pieces that leave elements uncommitted, batch
rows of no bytes, params that differ per program, and tolerances on what must be equal."""

import blake3
import ml_dtypes
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from tests.verify_test import first, rechained, write_transcript
from zkdv import digest
from zkdv import verify
from zkdv.config import Tolerance
from zkdv.jax import replay
from zkdv.transcript import blob_path


def _layout(shape, pieces, key_impl=None) -> digest.LeafLayout:
  return digest.LeafLayout("w", "float32", shape, key_impl=key_impl, pieces=pieces)


def _findings(report) -> str:
  return " ".join(f.message for f in report.findings)


class PiecesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("halves", (4,), (((0, 2),), ((2, 4),))),
      ("a 2 x 2 grid", (4, 6), (((0, 2), (0, 3)), ((0, 2), (3, 6)), ((2, 4), (0, 3)),
                                ((2, 4), (3, 6)))),
      ("uneven rows, whole columns", (5, 3), (((0, 3), (0, 3)), ((3, 5), (0, 3)))),
      ("an empty dimension", (0, 4), (((0, 0), (0, 2)), ((0, 0), (2, 4)))))
  def test_shards_that_tile_the_leaf_are_accepted(self, shape, pieces):
    digest.check_pieces(_layout(shape, pieces))

  @parameterized.named_parameters(
      ("one element of three", (3,), (((0, 1),),), "do not partition dimension 0"),
      ("nothing", (3,), (((0, 0),),), "do not partition dimension 0"),
      ("overlapping", (4,), (((0, 3),), ((2, 4),)), "do not partition dimension 0"),
      ("past the end", (4,), (((0, 2),), ((2, 5),)), "do not partition dimension 0"),
      ("a box of two dimensions on one", (3,), (((0, 3), (0, 1)),), "one \\(start, stop\\)"),
      ("a cell left out", (4, 4), (((0, 2), (0, 2)), ((0, 2), (2, 4)), ((2, 4), (0, 2))),
       "not each cell of their grid once"),
      ("a cell twice", (4,), (((0, 2),), ((2, 4),), ((2, 4),)), "not each cell"))
  def test_shards_that_do_not_tile_it_are_refused(self, shape, pieces, message):
    with self.assertRaisesRegex(ValueError, message):
      digest.check_pieces(_layout(shape, pieces))

  def test_a_key_leaf_has_no_pieces(self):
    with self.assertRaisesRegex(ValueError, "PRNG key leaf, which is never split"):
      digest.check_pieces(_layout((4, 2), (((0, 2), (0, 2)), ((2, 4), (0, 2))), "threefry"))

  def test_attack_a_params_leaf_committed_by_one_element_of_three(self):
    # Before, the state digests bound w[0] alone: w[1:] could be anything the prover chose
    # and every replay held bit for bit.
    def edit(records):
      first(records, "program")["state_layout"][0]["pieces"] = [[[0, 1]]]
      return records
    report = verify.verify(rechained(edit, write_transcript(steps=1)))
    self.assertEqual(report.verdict, verify.INVALID, report.dumps())
    self.assertIn("state_layout[0].pieces: shard boxes that tile the leaf: the pieces of "
                  ".params['w'] do not partition dimension 0 (0 to 3): [(0, 1)]",
                  _findings(report))

  def test_attack_a_box_of_more_dimensions_than_its_leaf_is_a_finding_not_a_fault(self):
    # Before, with digests made to match, the verifier stopped on an IndexError: "could
    # not verify" in place of a finding.
    box = [[[0, 3], [0, 1]]]

    def edit(records):
      program = first(records, "program")
      program["state_layout"][0]["pieces"] = box
      state = [digest.LeafLayout.from_record(l) for l in program["state_layout"]]
      update, final, step = (first(records, "check", kind="update"), first(records, "final"),
                             first(records, "step"))
      step["pre_state"] = digest.state_digest_from_leaves(state, update["pre_state_blobs"])
      step["post_state"] = final["final_state"] = digest.state_digest_from_leaves(
          state, [p[0] for p in final["final_state_leaves"]])
      return records
    report = verify.verify(rechained(edit, write_transcript(steps=1)))
    self.assertIsNone(report.fault, report.dumps())
    self.assertEqual(report.verdict, verify.INVALID)
    self.assertIn("each piece of .params['w'] has one (start, stop) per dimension of its "
                  "shape [3]", _findings(report))


class BatchRowsTest(absltest.TestCase):

  def test_attack_many_rows_of_no_bytes_are_refused_before_any_tree_is_built(self):
    # Before, a batch leaf of shape (2**40 - 1, 0) opened by a 0-byte blob made the
    # verifier hash a Merkle tree of that many rows (1.6 us and 100 bytes each).
    empty = blake3.blake3(b"").digest()

    def edit(records):
      first(records, "program")["batch_layout"] = [
          {"path": "[0]", "dtype": "float32", "shape": [(1 << 40) - 1, 0]}]
      first(records, "check", kind="update")["batch_blobs"] = [[empty]]
      return [r for r in records if not (r["type"] == "check" and r["kind"] == "probe")]
    folder = rechained(edit, write_transcript(steps=1))
    blob_path(folder, empty).write_bytes(b"")
    report = verify.verify(folder)
    self.assertEqual(report.verdict, verify.INVALID, report.dumps())
    self.assertIn(f"batch_layout[0]: at most 65536 rows where rows hold no bytes; [0] has "
                  f"{(1 << 40) - 1}, which commit nothing", _findings(report))


class ParamsLeavesTest(absltest.TestCase):
  """Before, a program overwriting w with chosen weights declared params_leaves [1] (b only)
  and escaped the program claim, which tests the leaves each program declares."""

  def _second_program(self, params_leaves, paths=None):
    def edit(records):
      program = first(records, "program")
      for layout, path in zip(program["state_layout"], paths or []):
        layout["path"] = path
      records.insert(records.index(program) + 1,
                     {**program, "number": 1, "params_leaves": params_leaves})
      return records
    report = verify.verify(rechained(edit, write_transcript(steps=1)))
    self.assertEqual(report.verdict, verify.INVALID, report.dumps())
    return _findings(report)

  def test_attack_a_train_states_params_left_out_of_params_leaves(self):
    self.assertIn("record 2 (program).params_leaves: every leaf of a TrainState's .params, "
                  "without [\".params['w']\"]", self._second_program([1]))

  def test_attack_a_program_that_declares_fewer_params_over_the_same_state(self):
    # Paths outside a TrainState (an NNX state's), which no path rule reaches.
    self.assertIn("params_leaves [1] differ from [0, 1] of program 0 over the same state",
                  self._second_program([1], ["['w']", "['b']"]))


class ToleranceTest(parameterized.TestCase):
  """Equivalent mode lets floating point differ within the tolerance, nothing else."""

  def _compare(self, dtype, committed, replayed, key_impl=None):
    layout = digest.LeafLayout("w", np.dtype(dtype).name, np.shape(committed),
                               key_impl=key_impl)
    return replay.compare([layout], [np.asarray(replayed, dtype)],
                          [np.asarray(committed, dtype)], exact=False, tolerance=Tolerance())

  def test_attack_a_complex_leaf_with_another_imaginary_part(self):
    # Before, both sides were cast to float64, which drops the imaginary part: equal.
    result = self._compare(np.complex64, [1 + 1000j, 2 - 1j], [1 + 1j, 2 - 1j])
    self.assertEqual(result["mismatched_leaves"], ["w"])
    self.assertEqual(result["max_abs_error"], 999.0)

  @parameterized.named_parameters(("int32", np.int32, [1_000_000], [1_000_009]),
                                  ("bool", np.bool_, [True], [False]),
                                  ("key data", np.uint32, [[0, 7]], [[0, 8]], "threefry"))
  def test_what_is_not_floating_point_must_be_equal(self, dtype, committed, replayed,
                                                    key_impl=None):
    # Before, 1,000,009 passed for 1,000,000 under rtol 1e-5.
    result = self._compare(dtype, committed, replayed, key_impl)
    self.assertEqual(result["mismatched_leaves"], ["w"])

  @parameterized.named_parameters(("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16),
                                  ("complex64", np.complex64))
  def test_floating_point_within_the_tolerance_holds(self, dtype):
    committed = np.asarray([1e-7, 0.5], dtype)
    replayed = committed.copy()
    replayed[0] = 2e-7  # other bytes, 1e-7 apart: within atol 1e-6
    result = self._compare(dtype, committed, replayed)
    self.assertEqual((result["equal"], result["max_abs_error"] > 0), (True, True), result)


if __name__ == "__main__":
  absltest.main()
