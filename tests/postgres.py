"""A throwaway PostgreSQL cluster on loopback for tests (runs as the postgres user).

Suites share one cluster per test process and take a new database each::

  url = postgres.shared_cluster().new_database()
"""

import atexit
import glob
import os
import pathlib
import shutil
import subprocess
import tempfile
import time

from dvbench.server.local import free_port


def _bin(name: str) -> str:
  found = shutil.which(name) or next(iter(sorted(glob.glob(
      f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
  if found is None:
    raise RuntimeError(f"PostgreSQL's {name} is not installed (scripts/test installs the "
                       "Debian package postgresql).")
  return found


def _as_postgres(*command: str) -> None:
  prefix = [] if os.geteuid() != 0 else ["runuser", "-u", "postgres", "--"]
  subprocess.run(prefix + list(command), check=True, capture_output=True)


class PostgresCluster:
  """initdb + pg_ctl in a temporary folder; ``url`` reaches it with trust auth."""

  def __init__(self):
    self.folder = pathlib.Path(tempfile.mkdtemp(prefix="dvbench-pg-"))
    self.port = free_port()
    self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

  def start(self) -> "PostgresCluster":
    if os.geteuid() == 0:
      shutil.chown(self.folder, "postgres")
    data = self.folder / "data"
    _as_postgres(_bin("initdb"), "-D", str(data), "-U", "postgres", "--auth=trust")
    _as_postgres(_bin("pg_ctl"), "-D", str(data), "-w", "-l", str(self.folder / "log"),
                 "-o", f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1",
                 "start")
    return self

  def new_database(self) -> str:
    """The URL of a new, empty database in this cluster."""
    import sqlalchemy as sa  # pylint: disable=g-import-not-at-top
    name = f"t{time.monotonic_ns()}"
    engine = sa.create_engine(self.url.replace("postgresql://", "postgresql+psycopg://"),
                              isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
      conn.exec_driver_sql(f"CREATE DATABASE {name}")
    engine.dispose()
    return self.url.rsplit("/", 1)[0] + "/" + name

  def stop(self) -> None:
    _as_postgres(_bin("pg_ctl"), "-D", str(self.folder / "data"), "-m", "immediate", "stop")
    shutil.rmtree(self.folder, ignore_errors=True)


_SHARED: PostgresCluster | None = None


def shared_cluster() -> PostgresCluster:
  """This process's cluster: started on first use, stopped by ``stop_shared_cluster`` (which
  pytest calls at the end of the session) or else when the process exits."""
  global _SHARED
  if _SHARED is None:
    _SHARED = PostgresCluster().start()
    atexit.register(stop_shared_cluster)
  return _SHARED


def stop_shared_cluster() -> None:
  global _SHARED
  if _SHARED is not None:
    _SHARED.stop()
    _SHARED = None


class OnPostgres:
  """A test-class mixin: ``database_url`` is a new database of the shared cluster, set
  before the other bases' ``setUpClass`` starts a server or store on it.

  Example: ``class PostgresQuotaTest(OnPostgres, QuotaCases, absltest.TestCase): pass``
  """

  @classmethod
  def setUpClass(cls):
    cls.database_url = shared_cluster().new_database()
    super().setUpClass()
