"""Least privilege for the verifier child, and the server's signing key kept from workers.

The escape test runs a payload through the child start path every job uses
(``worker.run_confined`` on a job folder made by ``WorkFolder`` and ``child_folder``, in a
data folder with a real signing key and SQLite database, named by a relative path); the
refusal tests start real ``dvbench serve`` / ``dvbench worker`` processes with a protection
switched off through ``DVBENCH_SANDBOX_WITHOUT``, the switch the product reads.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import blake3
import httpx
from absl.testing import absltest

from dvbench import cli
from dvbench.server import keys
from dvbench.server import sandbox
from dvbench.server import worker as worker_lib
from dvbench.server.blobs import BlobStore
from dvbench.server.db import Store
from dvbench.server.local import LocalServer, free_port
from tests import postgres
from tests.fake_prover import FakeProver
from zkdv import receipt
from zkdv.transcript import RECORDS_FILE

PAYLOAD = r"""
import json, os, socket, sys
targets = json.loads(sys.argv[1])
out = {}
def attempt(name, action):
  try:
    out[name] = ["done", action()]
  except OSError as e:
    out[name] = ["refused", e.strerror]
for name in ("key", "database", "shadow", "other_transcript", "other_blob", "own_transcript",
             "own_blob"):
  attempt(name, lambda path=targets[name]: open(path, "rb").read(16).hex())
for name in ("tcp", "postgres_tcp"):
  attempt(name, lambda port=targets[name]: socket.create_connection(("127.0.0.1", port), 5).close())
def unix(path):
  s = socket.socket(socket.AF_UNIX)
  s.settimeout(5)
  s.connect(path)
  s.close()
for name in ("unix", "postgres_unix"):
  attempt(name, lambda path=targets[name]: unix(path))
attempt("write_own", lambda: open("mine", "w").write("x"))
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
out.update(uid=os.getuid(), gid=os.getgid(), groups=os.getgroups(),
           CapEff=status["CapEff"].strip(), CapBnd=status["CapBnd"].strip(),
           NoNewPrivs=status["NoNewPrivs"].strip(),
           env=sorted(k for k in os.environ if "DATABASE" in k or "TOKEN" in k))
print(json.dumps(out))
"""


def _serve(*args, env=None, cwd=None, data=None):
  data = data or pathlib.Path(tempfile.mkdtemp(prefix="dvbench-sandbox-"))
  return subprocess.run([sys.executable, "-m", "dvbench.cli", "serve", "--create", "--data",
                         str(data), "--port", str(free_port()), *args],
                        capture_output=True, text=True, timeout=120, cwd=cwd,
                        env={**os.environ, **(env or {})})


class EscapeTest(absltest.TestCase):
  """A payload in the verifier child reads, connects and holds privileges only as allowed."""

  def setUp(self):
    super().setUp()
    gaps = sandbox.missing()
    if sandbox.weak(gaps):  # RefusalTest shows what the server does then
      self.skipTest(f"this kernel lacks {sandbox.weakness(gaps)}")

  def _listeners(self) -> tuple[int, str]:
    """A TCP port on loopback and a unix socket anyone may connect to, both reachable here."""
    tcp = socket.create_server(("127.0.0.1", 0))
    self.addCleanup(tcp.close)
    folder = tempfile.mkdtemp()
    os.chmod(folder, 0o755)
    path = os.path.join(folder, "postgres.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(path)
    os.chmod(path, 0o777)
    unix.listen()
    self.addCleanup(unix.close)
    for family, address in ((socket.AF_INET, tcp.getsockname()), (socket.AF_UNIX, path)):
      with socket.socket(family) as probe:
        probe.connect(address)  # the controls: reachable from outside the sandbox
    return tcp.getsockname()[1], path

  def test_the_child_reads_connects_and_holds_only_what_it_must(self):
    data = pathlib.Path(tempfile.mkdtemp(prefix="dvbench-data-"))
    key_file = data / keys.KEY_FILE
    keys.load_or_create(data)
    store = Store.open(f"sqlite:///{data / 'dvbench.db'}")
    self.addCleanup(store.engine.dispose)
    store.create_token("alice")  # a secret the database holds
    relative = pathlib.Path(os.path.relpath(data))  # `dvbench serve --data dvbench-data`
    blobs = BlobStore(relative / "blobs")
    mine, theirs = (_put(blobs, text) for text in (b"my own blob", b"another proof's blob"))
    other = worker_lib.WorkFolder(relative, "other-worker")
    self.addCleanup(other.close)
    with other.job() as other_work:
      other_scratch = worker_lib.child_folder(other_work, blobs, [])
      (other_scratch / RECORDS_FILE).write_bytes(b"another proof's records")
      own = worker_lib.WorkFolder(relative, "w1")
      self.addCleanup(own.close)
      with own.job() as work:
        scratch = worker_lib.child_folder(work, blobs, [mine])
        (scratch / RECORDS_FILE).write_bytes(b"my own records")
        tcp, unix = self._listeners()
        database = postgres.shared_cluster()  # a real server, on loopback and a unix socket
        postgres_unix = str(database.folder / f".s.PGSQL.{database.port}")
        with socket.socket(socket.AF_UNIX) as probe:
          probe.connect(postgres_unix)  # the control: reachable from outside the sandbox
        targets = {"key": str(key_file), "database": str(data / "dvbench.db"),
                   "shadow": "/etc/shadow", "other_transcript": str(other_scratch / RECORDS_FILE),
                   "other_blob": str(blobs.path(theirs).resolve()),
                   "own_transcript": str(scratch / RECORDS_FILE),
                   "own_blob": f"blobs/{mine}", "tcp": tcp, "unix": unix,
                   "postgres_tcp": database.port, "postgres_unix": postgres_unix}
        limits = worker_lib.Limits(2 << 30, isolation=sandbox.available(),
                                   hidden=(str(data.resolve()),))
        os.environ["DVBENCH_DATABASE_URL"] = "postgresql://dvbench:secret@db/dvbench"
        self.addCleanup(os.environ.pop, "DVBENCH_DATABASE_URL")
        report, failure = worker_lib.run_confined(
            [sys.executable, "-c", PAYLOAD, json.dumps(targets)],
            pathlib.Path(os.path.relpath(work)), limits, 60)
    self.assertIsNone(failure)
    gone = ["refused", "No such file or directory"]  # not in the child's filesystem at all
    self.assertEqual(report["key"], gone)
    self.assertEqual(report["database"], gone)
    self.assertEqual(report["shadow"], gone)
    self.assertEqual(report["other_transcript"], gone)
    self.assertEqual(report["other_blob"], gone)
    self.assertEqual(report["own_transcript"], ["done", b"my own records"[:16].hex()])
    self.assertEqual(report["own_blob"], ["done", b"my own blob".hex()])
    self.assertEqual(report["write_own"], ["done", 1])
    # Its own loopback answers; the listener outside is not reachable.
    self.assertEqual(report["tcp"], ["refused", "Connection refused"])
    self.assertEqual(report["postgres_tcp"], ["refused", "Connection refused"])
    self.assertEqual(report["unix"], ["refused", "Permission denied"])  # seccomp
    self.assertEqual(report["postgres_unix"], ["refused", "Permission denied"])
    uid, gid = sandbox.sandbox_ids() if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    self.assertEqual((report["uid"], report["gid"], report["groups"]),
                     (uid, gid, [] if os.geteuid() == 0 else report["groups"]))
    self.assertNotEqual(report["uid"], 0)
    self.assertEqual(report["CapEff"], "0000000000000000")
    if os.geteuid() == 0:
      self.assertEqual(report["CapBnd"], "0000000000000000")
    self.assertEqual(report["NoNewPrivs"], "1")
    self.assertEqual(report["env"], [])  # the database URL stays with the worker

  def test_a_symlink_the_child_plants_is_not_read_by_the_worker(self):
    folder = pathlib.Path(tempfile.mkdtemp())
    secret = folder / "server_key.pem"
    secret.write_bytes(b"k" * 16)
    (folder / "outputs").symlink_to(secret)
    self.assertIsNone(worker_lib._read_own_file(folder / "outputs"))  # pylint: disable=protected-access
    (folder / "real").write_bytes(b"\0" * 8)
    self.assertEqual(worker_lib._read_own_file(folder / "real"), b"\0" * 8)  # pylint: disable=protected-access


class RefusalTest(absltest.TestCase):
  """A protection the kernel does not give stops the server unless the operator allows it."""

  def test_serve_refuses_without_the_flag_and_names_what_is_missing(self):
    result = _serve("--workers", "1", env={sandbox.WITHOUT_ENV: "seccomp"})
    self.assertEqual(result.returncode, cli.EXIT_WEAK_SANDBOX, result.stderr)
    self.assertIn("missing: seccomp (disabled by DVBENCH_SANDBOX_WITHOUT)", result.stderr)
    self.assertIn("--allow-weak-sandbox", result.stderr)

  def test_worker_refuses_without_the_flag(self):
    data = pathlib.Path(tempfile.mkdtemp())
    Store.open(f"sqlite:///{data / 'dvbench.db'}").engine.dispose()
    result = subprocess.run(
        [sys.executable, "-m", "dvbench.cli", "worker", "--once", "--data", str(data)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, sandbox.WITHOUT_ENV: "mount namespace,landlock scopes"})
    self.assertEqual(result.returncode, cli.EXIT_WEAK_SANDBOX, result.stderr)
    self.assertIn("mount namespace (disabled by", result.stderr)
    self.assertIn("landlock scopes (disabled by", result.stderr)

  def test_an_unknown_protection_name_is_refused(self):
    result = _serve("--workers", "0", env={sandbox.WITHOUT_ENV: "selinux"})
    self.assertEqual(result.returncode, 1, result.stderr)
    self.assertIn("unknown protections ['selinux']", result.stderr)

  def test_with_the_flag_health_names_what_is_missing(self):
    data = pathlib.Path(tempfile.mkdtemp(prefix="dvbench-weak-"))
    server = LocalServer(workers=0, data=data, extra_args=("--allow-weak-sandbox",))
    os.environ[sandbox.WITHOUT_ENV] = "seccomp"
    try:
      server.start()
    finally:
      os.environ.pop(sandbox.WITHOUT_ENV)
    self.addCleanup(server.stop)
    health = httpx.get(f"{server.url}/api/v1/health", timeout=10).json()
    self.assertTrue(health["ok"])
    self.assertEqual(health["verifier_sandbox"], "weak")
    self.assertEqual(health["verifier_missing"],
                     {"seccomp": "disabled by DVBENCH_SANDBOX_WITHOUT"})
    self.assertNotIn("seccomp", health["verifier_isolation"])


  def test_optional_scopes_missing_are_reported_not_refused(self):
    server = LocalServer(workers=0)
    os.environ[sandbox.WITHOUT_ENV] = "landlock scopes"
    try:
      server.start()  # no --allow-weak-sandbox
    finally:
      os.environ.pop(sandbox.WITHOUT_ENV)
    self.addCleanup(server.stop)
    health = httpx.get(f"{server.url}/api/v1/health", timeout=10).json()
    self.assertEqual((health["verifier_sandbox"], health["verifier_missing"]),
                     ("full", {"landlock scopes": "disabled by DVBENCH_SANDBOX_WITHOUT"}))


class ServedTest(absltest.TestCase):
  """A real server on a relative --data: its worker verifies, the server process signs."""

  def test_relative_data_verified_and_signed_by_the_server_not_the_worker(self):
    if sandbox.weak(sandbox.missing()):  # then the server refuses to start (RefusalTest)
      self.skipTest(f"this kernel lacks {sandbox.weakness(sandbox.missing())}")
    cwd = pathlib.Path(tempfile.mkdtemp(prefix="dvbench-cwd-"))
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "dvbench.cli", "serve", "--create", "--data", "data",
         "--port", str(port), "--workers", "1", "--min-update-check-probability", "1.0"],
        cwd=cwd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(  # this checkout, from any folder
            [str(pathlib.Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])})
    self.addCleanup(lambda: (server.terminate(), server.wait(30), server.stderr.close()))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
      try:
        health = httpx.get(f"{url}/api/v1/health", timeout=1).json()
        break
      except httpx.TransportError:
        self.assertIsNone(server.poll(), "dvbench serve exited")
        self.assertLess(time.monotonic(), deadline)
        time.sleep(0.1)
    self.assertEqual(health["verifier_sandbox"], "full")
    self.assertEqual(health["verifier_missing"], sandbox.missing())
    store = Store.open(f"sqlite:///{cwd / 'data' / 'dvbench.db'}")
    self.addCleanup(store.engine.dispose)
    prover = FakeProver(url, store.create_token("alice")[1], "alice/relative").start()
    self.addCleanup(prover.http.close)
    prover.run(steps=4)
    self.assertEqual(prover.finish().json()["state"], "closed")
    deadline = time.monotonic() + 120
    while (state := httpx.get(f"{url}/api/v1/proofs/{prover.proof_id}").json())[
        "state"] in ("closed", "verifying"):
      self.assertLess(time.monotonic(), deadline, state)
      time.sleep(0.2)
    # The worker ran zkdv verify on the proof's records (hand-written openings replay no
    # real program: a finding about the transcript, not a fault of the server).
    self.assertTrue(state["failure"].startswith("invalid: "), state)
    signed = httpx.get(f"{url}/api/v1/proofs/{prover.proof_id}/receipt").content
    server_key = httpx.get(f"{url}/api/v1/server-key").json()["server_key"]
    self.assertEqual(receipt.open_receipt(signed, server_key)["verdict"], "invalid")
    private = keys.load_or_create(cwd / "data").private_bytes_raw()
    workers = [pid for pid in os.listdir("/proc") if pid.isdigit() and  # this server's
               f"--parent-pid\0{server.pid}\0".encode() in _cmdline(pid)]
    self.assertLen(workers, 1)
    cmdline = _cmdline(workers[0]).split(b"\0")
    self.assertTrue(pathlib.Path(cmdline[cmdline.index(b"--data") + 1].decode()).is_absolute())
    self.assertFalse(_memory_holds(int(workers[0]), private),
                     "the worker process holds the server's private key")
    self.assertTrue(_memory_holds(server.pid, private))  # the control: the server does


def _put(blobs: BlobStore, data: bytes) -> str:
  digest = blake3.blake3(data).hexdigest()
  upload = blobs.upload(digest)
  upload.write(data)
  upload.commit()
  return digest


def _cmdline(pid: str) -> bytes:
  """A process's command line; b"" for one that exited since /proc was listed."""
  try:
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
  except (FileNotFoundError, ProcessLookupError):
    return b""


def _memory_holds(pid: int, needle: bytes) -> bool:
  """Whether process ``pid``'s readable memory contains ``needle`` (root may read it)."""
  with open(f"/proc/{pid}/maps", encoding="ascii") as maps, \
       open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
    for line in maps:
      span, perms = line.split()[:2]
      if not perms.startswith("r") or "[vvar" in line or "[vsyscall]" in line:
        continue
      start, end = (int(x, 16) for x in span.split("-"))
      try:
        mem.seek(start)
        if needle in mem.read(end - start):
          return True
      except OSError:
        continue
  return False


if __name__ == "__main__":
  absltest.main()
