"""pytest hooks: each test process keeps its temporary files in one folder it removes.

Tests, the servers and workers they start (through ``TMPDIR``) and the browsers they run
all use ``tempfile``'s folder; pointing it at a folder of the test process's own leaves
nothing (``dvbench-test-*``, ``zkdv-test-*``, ...) in the system's temporary folder. The
PostgreSQL cluster the process's suites shared (tests/postgres.py) is stopped first.
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


def pytest_unconfigure(config):
  if "tests.postgres" in sys.modules:  # the PostgreSQL cluster the suites shared
    sys.modules["tests.postgres"].stop_shared_cluster()
  root = config.stash.get(_TEMPORARY, None)
  if root:
    shutil.rmtree(root, ignore_errors=True)
