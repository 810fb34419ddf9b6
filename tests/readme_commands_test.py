"""The README's local-server commands as written (relative ``--data`` included), then the
tutorial against that server, ending ``verified steps — start unattested`` (every check
replayed; the tutorial's start comes from ``model.init``, which nothing attests)."""

import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import tempfile

import httpx
from absl.testing import absltest

import dvbench
from dvbench.server.local import free_port
from tests import testing
from tests import tutorial_steps

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_server_commands() -> tuple[list[str], list[str]]:
  """``dvbench token create ...`` and ``dvbench serve ...`` as the README writes them
  (without their comments and the trailing ``&``)."""
  lines = (ROOT / "README.md").read_text().splitlines()

  def command(prefix: str) -> list[str]:
    found = [line for line in lines if line.startswith(prefix)]
    assert found, f"the README has no line starting with {prefix!r}"
    words = shlex.split(found[0], comments=True)
    return [w for w in words if w != "&"]

  return command("dvbench token create"), command("dvbench serve")


def as_module(words: list[str]) -> list[str]:
  """``dvbench ARGS`` as this interpreter runs it (the console script's own entry point)."""
  assert words[0] == "dvbench", words
  return [sys.executable, "-m", "dvbench.cli", *words[1:]]


class ReadmeServerCommandsTest(absltest.TestCase):

  def test_relative_data_folder_as_written_ends_with_its_checks_verified(self):
    token_command, serve_command = readme_server_commands()
    self.assertIn("./dvbench-data", token_command)  # the case this test exists for
    self.assertIn("./dvbench-data", serve_command)
    workdir = pathlib.Path(tempfile.mkdtemp())
    created = subprocess.run(as_module(token_command), cwd=workdir, capture_output=True,
                             text=True, check=True)
    token = re.search(r"\b[A-Za-z0-9_\-]{32,}\b", created.stdout)
    self.assertIsNotNone(token, created.stdout)
    port = free_port()  # the README's port 8000 may be taken on a shared machine
    # Every step probed (a ratio of 1/32): at the default 0.01, 2 % of 10-step runs probe none.
    serve = [str(port) if word == "8000" else word for word in serve_command] + [
        "--min-probe-ratio", "0.03125"]
    server = subprocess.Popen(as_module(serve), cwd=workdir, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    self.addCleanup(self._stop, server)
    url = f"http://127.0.0.1:{port}"
    testing.wait_until(lambda: self._healthy(url, server), timeout=60)
    # The tutorial, with every step asked to be checked so that its verdict is certain.
    code = tutorial_steps.STEPS_2_TO_6.replace("update_check_probability=0.01",
                                               "update_check_probability=1.0")
    cwd = os.getcwd()
    os.chdir(workdir)
    self.addCleanup(os.chdir, cwd)
    os.environ["DVBENCH_TOKEN"] = token[0]
    self.addCleanup(os.environ.pop, "DVBENCH_TOKEN", None)
    namespace = {"API_URL": url}
    exec(compile(code, "tutorial", "exec"), namespace)  # pylint: disable=exec-used
    proof = namespace["proof"]
    status = dvbench.Client(url).wait_for_verdict(proof.proof_id, 180)
    self.assertEqual((status["state"], status["shortfalls"]),
                     ("verified steps", ["start unattested"]), repr(status))
    self.assertEqual(status["steps"], 10)
    self.assertGreater(status["checks_verified"], 0)
    self.assertTrue((workdir / "dvbench-data" / "dvbench.db").is_file())

  @staticmethod
  def _healthy(url: str, server: subprocess.Popen) -> bool:
    if server.poll() is not None:
      raise AssertionError(f"dvbench serve exited: {server.stderr.read()}")
    try:
      return httpx.get(f"{url}/api/v1/health", timeout=1).status_code == 200
    except httpx.TransportError:
      return False

  @staticmethod
  def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
      os.killpg(server.pid, signal.SIGTERM)
      try:
        server.wait(15)
      except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


if __name__ == "__main__":
  absltest.main()
