"""zkdv.jax.replay.compare: exact checks compare bytes, equivalent ones a tolerance.

An exact check is equal only when dtype, shape and every byte agree. An
equivalent check (``attest_apply_fn``) is equal when every element satisfies
``|actual - expected| <= atol + rtol * |expected|`` or both are NaN. Either
way the result reports the largest absolute, relative and ulp errors over the
leaves whose bytes differ.
"""


import ml_dtypes
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from zkdv.config import Tolerance
from zkdv.digest import LeafLayout
from zkdv.jax import replay

TOLERANCE = Tolerance(rtol=1e-3, atol=1e-6)


def _compare(actual: list, expected: list, exact: bool, tolerance: Tolerance = TOLERANCE):
  layouts = [LeafLayout(f"leaf{i}", str(np.asarray(e).dtype), np.shape(e))
             for i, e in enumerate(expected)]
  return replay.compare(layouts, actual, expected, exact=exact, tolerance=tolerance)


def _next_up(x: np.ndarray) -> np.ndarray:
  """The next representable value above each (positive, finite) element: one ulp away."""
  bits = x.view(np.dtype(f"u{x.dtype.itemsize}"))
  return (bits + np.asarray(1, bits.dtype)).view(x.dtype)


def _nan_with_payload(dtype, payload: int) -> np.ndarray:
  nan = np.full(1, np.nan, dtype)
  bits = nan.view(np.dtype(f"u{nan.dtype.itemsize}"))
  return (bits | np.asarray(payload, bits.dtype)).view(dtype)


class ExactTest(parameterized.TestCase):

  @parameterized.parameters(np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.uint8)
  def test_same_bytes_are_equal_with_no_error(self, dtype):
    x = np.arange(6).astype(dtype).reshape(2, 3)
    result = _compare([x.copy()], [x], exact=True)
    self.assertEqual(result, {"mode": "exact", "equal": True, "mismatched_leaves": [],
                              "max_abs_error": 0.0, "max_rel_error": 0.0, "max_ulp_error": 0})

  @parameterized.parameters(np.float32, np.float64, np.float16, ml_dtypes.bfloat16)
  def test_one_ulp_is_a_mismatch_and_measured(self, dtype):
    expected = np.asarray([1.0, 2.0, 3.0], dtype)
    actual = expected.copy()
    actual[1:2] = _next_up(expected[1:2])
    result = _compare([actual], [expected], exact=True)
    self.assertFalse(result["equal"])
    self.assertEqual(result["mismatched_leaves"], ["leaf0"])
    self.assertEqual(result["max_ulp_error"], 1)
    step = float(actual[1]) - 2.0
    self.assertEqual(result["max_abs_error"], step)
    self.assertEqual(result["max_rel_error"], step / 2.0)

  def test_signed_zeros_differ_in_bytes_only(self):
    result = _compare([np.asarray([-0.0], np.float32)], [np.asarray([0.0], np.float32)],
                      exact=True)
    self.assertFalse(result["equal"])
    self.assertEqual((result["max_abs_error"], result["max_ulp_error"]), (0.0, 0))

  def test_nan_is_equal_only_to_the_same_nan_bytes(self):
    quiet = np.asarray([1.0, np.nan], np.float32)
    self.assertTrue(_compare([quiet.copy()], [quiet], exact=True)["equal"])
    payload = np.concatenate([quiet[:1], _nan_with_payload(np.float32, 1)])
    self.assertFalse(_compare([payload], [quiet], exact=True)["equal"])

  def test_dtype_or_shape_differences_are_mismatches_without_error_measures(self):
    x = np.arange(4, dtype=np.float32)
    for actual in (x.astype(np.float64), x.reshape(2, 2)):
      result = _compare([actual], [x], exact=True)
      self.assertEqual(result["mismatched_leaves"], ["leaf0"])
      self.assertEqual((result["max_abs_error"], result["max_ulp_error"]), (0.0, 0))

  def test_integers_have_no_ulps(self):
    result = _compare([np.asarray([5, 9], np.int32)], [np.asarray([5, 7], np.int32)], exact=True)
    self.assertFalse(result["equal"])
    self.assertEqual((result["max_abs_error"], result["max_ulp_error"]), (2.0, 0))

  def test_every_mismatched_leaf_is_named_and_errors_are_the_maxima(self):
    one = np.asarray([1.0, 2.0], np.float32)
    two = np.asarray([4.0], np.float32)
    result = _compare([one + 0.5, two.copy(), two - 1.0], [one, two, two], exact=True)
    self.assertEqual(result["mismatched_leaves"], ["leaf0", "leaf2"])
    self.assertEqual(result["max_abs_error"], 1.0)
    self.assertEqual(result["max_rel_error"], 0.5)

  def test_leaf_counts_must_agree(self):
    with self.assertRaises(ValueError):
      _compare([np.zeros(2)], [np.zeros(2), np.zeros(2)], exact=True)


class EquivalentTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("inside_rtol", 1000.0, 1000.9, True),
      ("outside_rtol", 1000.0, 1001.1, False),
      ("inside_atol_at_zero", 0.0, 9e-7, True),
      ("outside_atol_at_zero", 0.0, 2e-6, False),
  )
  def test_tolerance_is_relative_to_the_expected_value(self, expected, actual, equal):
    result = _compare([np.asarray([actual])], [np.asarray([expected])], exact=False)
    self.assertEqual(result["mode"], "equivalent")
    self.assertEqual(result["equal"], equal)
    self.assertAlmostEqual(result["max_abs_error"], abs(actual - expected))
    self.assertEqual(_compare([np.asarray([actual])], [np.asarray([expected])],
                              exact=True)["equal"], False)

  def test_rtol_scales_the_expected_value_not_the_actual_one(self):
    tolerance = Tolerance(rtol=0.5, atol=0.0)
    self.assertFalse(_compare([np.asarray([1.6])], [np.asarray([1.0])], exact=False,
                              tolerance=tolerance)["equal"])
    self.assertTrue(_compare([np.asarray([1.0])], [np.asarray([1.6])], exact=False,
                             tolerance=tolerance)["equal"])

  def test_rel_error_at_an_expected_zero_is_the_abs_error(self):
    result = _compare([np.asarray([0.0, 2e-6])], [np.asarray([0.0, 0.0])], exact=False)
    self.assertEqual(result["max_rel_error"], result["max_abs_error"])

  def test_nan_in_the_same_places_is_equal_whatever_its_bytes(self):
    expected = np.asarray([1.0, np.nan], np.float32)
    actual = np.concatenate([expected[:1], _nan_with_payload(np.float32, 1)])
    self.assertTrue(_compare([actual], [expected], exact=False)["equal"])

  @parameterized.named_parameters(
      ("nan_for_a_number", [1.0, np.nan], [1.0, 2.0]),
      ("number_for_a_nan", [1.0, 2.0], [1.0, np.nan]),
      ("inf_for_a_number", [1.0, np.inf], [1.0, 2.0]),
  )
  def test_nan_or_inf_against_anything_else_is_a_mismatch(self, actual, expected):
    result = _compare([np.asarray(actual, np.float32)], [np.asarray(expected, np.float32)],
                      exact=False, tolerance=Tolerance(rtol=1.0, atol=1.0))
    self.assertFalse(result["equal"])

  def test_an_expected_infinity_admits_only_itself(self):
    # atol + rtol * |inf| is inf: were the bound applied, any actual value (even -inf)
    # would be "within" it, and an equivalent check's opening could claim inf anywhere.
    for actual in ([-np.inf], [2.0]):
      self.assertFalse(_compare([np.asarray(actual, np.float32)],
                                [np.asarray([np.inf], np.float32)], exact=False)["equal"])

  def test_same_infinities_are_equal(self):
    x = np.asarray([np.inf, -np.inf, 1.0], np.float32)
    self.assertTrue(_compare([x.copy()], [x], exact=False)["equal"])

  def test_signed_zeros_are_equal(self):
    self.assertTrue(_compare([np.asarray([-0.0])], [np.asarray([0.0])], exact=False)["equal"])

  def test_bfloat16_errors_are_measured_in_its_own_ulps(self):
    expected = np.asarray([1.0, 256.0], ml_dtypes.bfloat16)
    actual = _next_up(expected)
    result = _compare([actual], [expected], exact=False, tolerance=Tolerance(rtol=1e-2, atol=0))
    self.assertTrue(result["equal"])  # one bfloat16 ulp is 2**-7 relative at most
    self.assertEqual(result["max_ulp_error"], 1)
    self.assertEqual(result["max_abs_error"], 2.0)  # 256 -> 258: bfloat16 has 8 bits
    self.assertEqual(result["max_rel_error"], 2.0 ** -7)
    self.assertFalse(_compare([actual], [expected], exact=False,
                              tolerance=Tolerance(rtol=1e-3, atol=0))["equal"])

  def test_dtype_mismatch_is_never_equivalent(self):
    x = np.arange(3, dtype=np.float32)
    self.assertFalse(_compare([x.astype(ml_dtypes.bfloat16)], [x], exact=False)["equal"])


if __name__ == "__main__":
  absltest.main()
