"""A real ``dvbench serve`` process on a free loopback port (tests, benchmarks, notebooks).

Example::

  with LocalServer(workers=1, extra_args=("--min-update-check-probability", "0.5")) as server:
    token = server.token("alice")
    ...
  # stopped, and the data folder it made removed (``stop()`` alone keeps it for a restart)
"""

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class LocalServer:
  """A ``dvbench serve`` subprocess with its own data folder."""

  def __init__(self, workers: int = 1, lease_seconds: float = 10.0, max_body_mb: int = 64,
               data: pathlib.Path | None = None, port: int | None = None,
               database_url: str | None = None, extra_args: tuple[str, ...] = (),
               source: str | None = None):
    self.made_data = data is None  # removed by ``close()``; a folder given is the caller's
    self.data = data or pathlib.Path(tempfile.mkdtemp(prefix="dvbench-test-"))
    self.port = port or free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.args = ["serve", "--create", "--port", str(self.port), "--workers", str(workers),
                 "--lease-seconds", str(lease_seconds), "--max-body-mb", str(max_body_mb),
                 *extra_args]
    self.database_url = database_url
    if database_url:
      self.args += ["--database-url", database_url]
    self.process = None
    # ``source``: a source tree whose dvbench runs instead of this one (a benchmark's --before)
    self.source = source

  def __enter__(self) -> "LocalServer":
    try:
      return self.start()
    except BaseException:
      self.close()
      raise

  def __exit__(self, *exc) -> None:
    self.close()

  def start(self) -> "LocalServer":
    self.process = subprocess.Popen(
        [sys.executable, "-m", "dvbench.cli", *self.args, "--data", str(self.data)],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        cwd=self.source, env=None if self.source is None else dict(os.environ,
                                                                   PYTHONPATH=self.source))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
      try:
        if httpx.get(f"{self.url}/api/v1/health", timeout=1).status_code == 200:
          return self
      except httpx.TransportError:
        pass
      if self.process.poll() is not None:
        raise RuntimeError(f"dvbench serve exited with {self.process.returncode}")
      time.sleep(0.1)
    raise RuntimeError("dvbench serve did not start in 60 s")

  def token(self, owner: str) -> str:
    """A new API token of ``owner``, as ``dvbench token create OWNER`` makes it (in this
    process: no second interpreter to start)."""
    from dvbench.server.db import Store  # pylint: disable=g-import-not-at-top
    store = Store.open(self.database_url or f"sqlite:///{(self.data / 'dvbench.db').resolve()}")
    try:
      return store.create_token(owner)[1]
    finally:
      store.engine.dispose()

  def kill(self) -> None:
    """SIGKILLs the server and its workers (its whole process group)."""
    if self.process and self.process.poll() is None:
      os.killpg(self.process.pid, signal.SIGKILL)
      self.process.wait()

  def stop(self) -> None:
    if self.process and self.process.poll() is None:
      os.killpg(self.process.pid, signal.SIGTERM)
      try:
        self.process.wait(15)
      except subprocess.TimeoutExpired:
        self.kill()

  def close(self) -> None:
    """Stops the server and removes its data folder if this object made it."""
    self.stop()
    if self.made_data:
      shutil.rmtree(self.data, ignore_errors=True)
