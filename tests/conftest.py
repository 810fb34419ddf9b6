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
"""

import os
import shutil
import sys
import tempfile

import pytest

_TEMPORARY = pytest.StashKey[str]()


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
  if root:
    shutil.rmtree(root, ignore_errors=True)
