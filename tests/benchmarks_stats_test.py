"""The statistics the benchmarks report: the interval of a median, probes paired by round."""

import itertools

from absl.testing import absltest
from absl.testing import parameterized

from benchmarks import common
from benchmarks import live


def _coverage_by_count(n: int, k: int) -> float:
  """The chance that order statistics k and n + 1 - k of n draws straddle the median,
  counted over every sign pattern of n draws (each above or below it, evenly)."""
  inside = sum(1 for signs in itertools.product((0, 1), repeat=n)
               if k <= sum(signs) <= n - k)
  return inside / 2 ** n


class MedianIntervalTest(parameterized.TestCase):

  @parameterized.parameters(6, 9, 12, 16)
  def test_the_coverage_is_the_counted_chance_and_the_tightest_over_the_confidence(self, n):
    low, high, coverage = common.median_interval(range(n))
    k = low + 1
    self.assertEqual(high, n - k)
    self.assertAlmostEqual(coverage, _coverage_by_count(n, k), places=12)
    self.assertGreaterEqual(coverage, 0.95)
    if k + 1 <= (n + 1) // 2:
      self.assertLess(_coverage_by_count(n, k + 1), 0.95)

  def test_twenty_values_give_the_sixth_and_fifteenth(self):
    low, high, coverage = common.median_interval([x / 10 for x in range(20, 0, -1)])
    self.assertEqual((low, high), (0.6, 1.5))
    self.assertAlmostEqual(coverage, 0.9586105346679688)

  def test_too_few_values_give_their_range_and_its_smaller_coverage(self):
    self.assertEqual(common.median_interval([3.0, 1.0, 2.0]), (1.0, 3.0, 0.75))


class PairedTest(absltest.TestCase):

  def test_rounds_of_every_run_pool_per_workload_and_pair(self):
    runs = [[["small", "live, probes / live", [1.0, 1.1]],
             ["small", "offline, probes / offline", [0.9]]],
            [["small", "live, probes / live", [1.2, 1.3, 1.4]]]]
    table = live.paired([pair for run in runs for pair in run])
    self.assertEqual([row[:4] for row in table],
                     [["small", "live, probes / live", 5, "1.200"],
                      ["small", "offline, probes / offline", 1, "0.900"]])
    self.assertEqual(table[0][4:], ["1.000-1.400", "0.938"])


if __name__ == "__main__":
  absltest.main()
