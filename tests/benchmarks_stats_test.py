"""The statistics the benchmarks report: the interval of a median, probes paired by round,
CPU by part of a live run."""

import itertools
import subprocess
import sys
import threading
import time

from absl.testing import absltest
from absl.testing import parameterized

from benchmarks import common
from benchmarks import cpu_time
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


def _cpu_rounds(parts: dict | None = None) -> dict:
  """Three rounds' CPU seconds a step of each part: ``parts``' where given, else 0."""
  return {part: (parts or {}).get(part, [0.0, 0.0, 0.0]) for part in cpu_time.PARTS}


class CpuTableTest(absltest.TestCase):

  def test_medians_by_part_their_sum_and_what_probes_add_paired_by_round(self):
    rows = ["jax.jit", "offline", "offline, probes", "live", "live, probes"]
    cpu = [["small", row, _cpu_rounds()] for row in rows[:3]]
    cpu.append(["small", "live", _cpu_rounds({"commit thread": [1e-4, 3e-4, 2e-4],
                                              "server: web": [5e-5, 5e-5, 5e-5]})])
    cpu.append(["small", "live, probes", _cpu_rounds({"commit thread": [2e-4, 3e-4, 4e-4],
                                                      "server: web": [1e-4, 2e-4, 3e-4]})])
    table = {row[1]: dict(zip(live.CPU_HEADER, row)) for row in live.cpu_table(cpu)}
    self.assertEqual(list(table), rows + ["offline, probes − offline", "live, probes − live"])
    self.assertEqual(table["live"]["commit thread"], "200")
    self.assertEqual(table["live"]["server: web"], "50")
    self.assertEqual(table["live"]["all"], "250")
    self.assertEqual(table["live, probes"]["all"], "500")  # the median of 300, 500 and 700
    added = table["live, probes − live"]  # rounds' differences: commit 100, 0, 200
    self.assertEqual((added["commit thread"], added["server: web"], added["all"]),
                     ("+100", "+150", "+150"))
    self.assertEqual(table["offline, probes − offline"]["all"], "+0")


class CpuMeterTest(absltest.TestCase):
  """Real threads and processes, their CPU read back from /proc."""

  def test_a_named_thread_and_a_server_process_are_counted_in_their_parts(self):
    server = subprocess.Popen(  # a process of its own session, as a LocalServer's
        [sys.executable, "-c", "import sys, time\nsys.stdin.readline()\n"
         "start = time.process_time()\nwhile time.process_time() < start + 0.3: pass\n"
         "print(flush=True)\nsys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    self.addCleanup(server.wait)
    self.addCleanup(server.kill)
    meter = cpu_time.CpuMeter(server_pid=server.pid)
    spun, read = threading.Event(), threading.Event()

    def spin():  # alive until read: a thread that ended is not in /proc any more
      start = time.thread_time()
      while time.thread_time() < start + 0.3:
        pass
      spun.set()
      read.wait()

    uploader = threading.Thread(target=spin, name="dvbench-upload", daemon=True)
    before = meter.read()
    uploader.start()
    server.stdin.write("spin\n")
    server.stdin.flush()
    server.stdout.readline()
    spun.wait(60)
    try:
      spent = meter.since(before)
    finally:
      read.set()
    uploader.join(60)
    self.assertEqual(set(spent), set(cpu_time.PARTS))
    self.assertGreaterEqual(spent["uploader"], 0.29)
    self.assertGreaterEqual(spent["server: other"], 0.29)
    self.assertLess(spent["training thread"], 0.1)  # it waited
    self.assertEqual(spent["server: ingestion"], 0.0)

if __name__ == "__main__":
  absltest.main()
