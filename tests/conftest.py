"""pytest hooks: each test process keeps its temporary files in one folder it removes.

Tests, the servers and workers they start (through ``TMPDIR``) and the browsers they run
all use ``tempfile``'s folder; pointing it at a folder of the test process's own leaves
nothing (``dvbench-test-*``, ``zkdv-test-*``, ...) in the system's temporary folder. The
PostgreSQL cluster the process's suites shared (tests/postgres.py) is stopped first.

Compiled XLA programs are kept in JAX's persistent compilation cache in that folder, shared by
the test processes (pytest-xdist's workers inherit the first process's folder) and every
process they start (servers, verifiers, training scripts): most tests compile the same small
train steps and replays again. The cache starts empty for each run of the suite; a cached
executable is the one XLA would compile, so what the tests show is unchanged.

The longest test files are collected first (``_LONGEST_FIRST``, from ``--durations`` on two
cores), so pytest-xdist's two workers do not end with one of them alone on a long class.

The run prints a line as each test file finishes (``tests/cli_test.py: 19 passed (3 of 40
files, 1:02)``), also under pytest-xdist, whose ``-q`` output is otherwise dots alone.

pytest-xdist's workers leave their folders (inside the first process's) to that process: a
worker still busy a few seconds after its last test is sent SIGINT by execnet, whose
KeyboardInterrupt lands wherever the worker is (a finalizer prints its traceback after the
green result). The first process removes everything once the workers are gone.
"""

import collections
import os
import shutil
import sys
import tempfile
import time

import pytest

_TEMPORARY = pytest.StashKey[str]()


class FileProgress:
  """Prints ``FILE: N passed, M failed (K of T files, M:SS)`` when a file's last test ends."""

  def __init__(self, terminal):
    self.terminal, self.started = terminal, time.monotonic()
    self.remaining: collections.Counter = collections.Counter()
    self.outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    self.files = self.done = 0

  def collected(self, node_ids) -> None:
    if not self.remaining:  # every xdist worker collects the same tests
      self.remaining.update(node_id.split("::")[0] for node_id in node_ids)
      self.files = len(self.remaining)

  def pytest_collection_finish(self, session):
    self.collected(item.nodeid for item in session.items)

  @pytest.hookimpl(optionalhook=True)
  def pytest_xdist_node_collection_finished(self, node, ids):  # pylint: disable=unused-argument
    self.collected(ids)

  def pytest_runtest_logreport(self, report):
    path = report.nodeid.split("::")[0]
    counts = self.outcomes[path]
    if type(report) is not pytest.TestReport:  # pylint: disable=unidiomatic-typecheck
      counts["subtests failed"] += report.failed  # a subtest's report: its test reports too
      return
    if report.failed:
      counts["failed" if report.when == "call" else "error"] += 1
    elif report.skipped:
      counts["skipped"] += 1
    elif report.when == "call":
      counts["passed"] += 1
    if report.when != "teardown" or path not in self.remaining:
      return
    self.remaining[path] -= 1
    if self.remaining[path] == 0:
      del self.remaining[path]
      self.done += 1
      minutes, seconds = divmod(int(time.monotonic() - self.started), 60)
      said = ", ".join(f"{n} {outcome}" for outcome, n in counts.items() if n)
      if self.terminal._tw.width_of_current_line:  # pylint: disable=protected-access
        self.terminal.write("\n")  # after the dots of a -q run
      self.terminal.write_line(f"{path}: {said} ({self.done} of {self.files} files, "
                               f"{minutes}:{seconds:02d})")


# Test files whose classes take longest (their servers, trained proofs and subprocesses),
# longest first; the others follow in their usual order.
_LONGEST_FIRST = ("benchmark_test", "multiprocess_test", "sharding_test", "multiprocess_live_test",
                  "resume_test", "run_lifecycle_test", "multiprocess_resume_test",
                  "multiprocess_live_resume_test", "live_challenges_test", "server_challenge_test",
                  "data_order_server_test", "claims_attack_test", "programs_test",
                  "optimizer_matrix_test", "dvbench_test", "operations_test", "pages_test")


def pytest_collection_modifyitems(items):
  """Puts the longest test files first (a stable sort: each file's tests keep their order)."""
  rank = {f"tests/{name}.py": i for i, name in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def pytest_sessionstart(session):
  config = session.config
  terminal = config.pluginmanager.get_plugin("terminalreporter")
  if terminal is not None and not hasattr(config, "workerinput"):
    config.pluginmanager.register(FileProgress(terminal), "zkdv-file-progress")


def pytest_configure(config):
  root = tempfile.mkdtemp(prefix="zkdv-tests-")
  os.chmod(root, 0o711)  # PostgreSQL's test clusters run as the postgres user
  config.stash[_TEMPORARY] = root
  os.environ["TMPDIR"] = root
  tempfile.tempdir = root
  _share_compiled_programs(os.path.join(root, "jax-compilation-cache"))


def _share_compiled_programs(folder: str) -> None:
  """Points JAX's persistent compilation cache at ``folder`` (unless an outer pytest process
  already chose one) for this process and the processes it starts, caching every program."""
  settings = {"JAX_COMPILATION_CACHE_DIR": folder,
              "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
  for name, value in settings.items():
    os.environ.setdefault(name, value)
  if "jax" in sys.modules:  # imported before this hook: its flags were read already
    config = sys.modules["jax"].config
    config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  if "tests.postgres" in sys.modules:  # the PostgreSQL cluster the suites shared
    sys.modules["tests.postgres"].stop_shared_cluster()
  root = config.stash.get(_TEMPORARY, None)
  if root and not hasattr(config, "workerinput"):  # a worker's folder is inside this one
    shutil.rmtree(root, ignore_errors=True)
