"""The zkdv command line: claims, requirements, exit codes, help and messages."""

import argparse
import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import cbor2
from absl.testing import absltest

from dvbench.server import worker
from tests.verify_test import _Dvbench, good_transcript, write_transcript
from zkdv import __version__, cli
from zkdv import transcript
from zkdv import verify as verify_lib


def zkdv(*args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "zkdv.cli", *map(str, args)],
                        capture_output=True, text=True, check=False)


def zkdv_here(*args) -> subprocess.CompletedProcess:
  """``zkdv ARGS`` run by ``cli.main`` in this process (no interpreter or JAX to start):
  for transcripts of one CPU device, which need no replay set up before JAX starts."""
  stdout, stderr = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
    try:
      status = cli.main(list(map(str, args)))
    except SystemExit as e:
      status = e.code
  return subprocess.CompletedProcess(args, status, stdout.getvalue(), stderr.getvalue())


class VerifyCliTest(absltest.TestCase):
  """Exit codes and reports of zkdv verify (``python -m zkdv.cli`` in a process of its own
  for the first test, ``cli.main`` in this process for the others)."""

  def test_self_audited_run_exits_0_and_says_so(self):
    result = zkdv("verify", good_transcript())
    self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
    self.assertIn("self-audited: detects faults, not a dishonest prover", result.stdout)
    self.assertIn("exit 0: verified, every required claim holds", result.stdout)

  def test_required_claims_decide_the_exit_code(self):
    path = good_transcript()
    self.assertEqual(zkdv_here("verify", path, "--require", "challenges").returncode, 1)
    self.assertEqual(zkdv_here("verify", path, "--strict", "--quiet").returncode, 1)
    self.assertEqual(zkdv_here("verify", path, "--replay", "none").returncode, 2)
    bad = zkdv_here("verify", path, "--require", "vibes")
    self.assertEqual(bad.returncode, cli.EXIT_USAGE)
    self.assertIn("unknown claims", bad.stderr)

  def test_json_lists_every_claim(self):
    report = json.loads(zkdv_here("verify", good_transcript(), "--json").stdout)
    self.assertEqual([c["name"] for c in report["claims"]],
                     ["chain", "challenges", "replays", "start", "program", "data"])
    replays = next(c for c in report["claims"] if c["name"] == "replays")
    self.assertEqual(replays["facts"]["p"], 1.0)
    self.assertEqual(replays["facts"]["escape_probability"], 0.0)
    self.assertEqual(report["unmet"], [])

  def test_progress_file_names_the_check_running_for_a_worker_out_of_time(self):
    path = good_transcript()
    started = []
    report = verify_lib.verify(path, on_check=lambda kind, step: started.append((kind, step)))
    self.assertEqual(started, [(c.kind, c.step) for c in report.checks])
    self.assertNotEmpty(started)
    progress = pathlib.Path(tempfile.mkdtemp()) / worker.PROGRESS_FILE
    self.assertEqual(zkdv_here("verify", path, "--progress-file", progress, "--quiet").returncode,
                     0)
    kind, step = started[-1]
    self.assertEqual(progress.read_text(), f"{kind} {step}\n")  # the last one started
    # What the server's failure text adds, from the file its verifier child wrote; nothing
    # from a file that says anything else (the child runs the prover's program).
    self.assertEqual(worker.replaying(progress),
                     f" The time ran out in the {kind} check of step {step}, which runs the "
                     "prover's own program (a step that replays for longer than the proof's "
                     "time allows).")
    for text in ("", "update 3", "update 3\nupdate 4\n", "replay 3\n", "update -3\n",
                 "update 3\n" + " " * 100, "update 1234567890123\n", "upd\xe4te 3\n"):
      progress.write_text(text, encoding="latin-1")
      self.assertEqual(worker.replaying(progress), "", repr(text))
    progress.unlink()
    self.assertEqual(worker.replaying(progress), "")
    os.mkfifo(progress)  # a FIFO no one writes: read, it would hold the worker forever
    self.assertEqual(worker.replaying(progress), "")
    progress.unlink()
    elsewhere = progress.with_name("elsewhere")
    elsewhere.write_text(f"{kind} {step}\n")
    progress.symlink_to(elsewhere)  # a link out of the child's folder is not followed
    self.assertEqual(worker.replaying(progress), "")

  def test_server_key_from_hex_or_file_and_challenge_key_file(self):
    server = _Dvbench()
    path = write_transcript(server=server, steps=3)
    self.assertEqual(zkdv_here("verify", path).returncode, 2)  # no key: could not verify
    key_file = pathlib.Path(tempfile.mkdtemp()) / "server.key"
    key_file.write_text(server.server_key.hex())
    for key in (server.server_key.hex(), key_file):
      result = zkdv_here("verify", path, "--server-key", key, "--require",
                         "chain,replays,challenges")
      self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
      self.assertIn("agrees", result.stdout)
    k_file = key_file.with_name("k")
    k_file.write_text(server.key.hex())
    # A key given by hand re-derives the challenges, yet binds nothing: anyone holding a
    # published key could have ground these records under the genuine root, and a prover
    # running its own server holds its key before its first step: replays could not be
    # verified either.
    by_hand = zkdv_here("verify", path, "--challenge-key-file", k_file, "--json")
    self.assertEqual(by_hand.returncode, 2, by_hand.stdout + by_hand.stderr)
    claims = {c["name"]: c["status"] for c in json.loads(by_hand.stdout)["claims"]}
    self.assertEqual((claims["chain"], claims["challenges"], claims["replays"]),
                     ("could not verify", "could not verify", "could not verify"))
    self.assertEqual(zkdv_here("verify", path, "--server-key", "abcd").returncode,
                     cli.EXIT_USAGE)


class _Terminal(io.StringIO):
  """A stream that says it is a terminal, e.g. ``cli.progress_bar(_Terminal(), "x")``."""

  def isatty(self):
    return True


class CommandLineTest(absltest.TestCase):
  """--version, help, usage errors, and paths that hold no transcript."""

  def tempdir(self) -> pathlib.Path:
    return pathlib.Path(self.enterContext(tempfile.TemporaryDirectory(prefix="zkdv-cli-")))

  def test_version(self):
    result = zkdv("--version")
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout.strip(), f"zkdv {__version__}")

  def test_help_documents_every_argument_its_default_and_the_exit_codes(self):
    parser = cli._parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for p in (parser, *commands.choices.values()):
      for action in p._actions:
        self.assertTrue(action.help, f"{p.prog} {action.dest} has no help")
    helps = {command: zkdv(*command, "--help") for command in ((), ("verify",), ("inspect",))}
    for result in helps.values():
      self.assertEqual(result.returncode, 0, result.stderr)
      self.assertIn("64  usage error", result.stdout)
      self.assertIn("66  no transcript at PATH", result.stdout)
    verify_help = " ".join(helps[("verify",)].stdout.split())
    for text in ("0 verified: every required claim holds", "2 could not verify",
                 "(default: sampled)", "(default: chain,replays)", "(default: 1)",
                 "(default: 1e-05 1e-06)"):
      self.assertIn(text, verify_help)

  def test_usage_errors_exit_64_not_2(self):
    for args in ([], ["verify", "x", "--no-such-option"], ["verify", "x", "--require", "vibes"],
                 ["verify", "x", "--min-checks", "one"]):
      result = zkdv(*args)
      self.assertEqual(result.returncode, cli.EXIT_USAGE, (args, result.stderr))
      self.assertIn("usage: zkdv", result.stderr)
      self.assertEqual(result.stdout, "")

  def test_missing_path_is_one_line_naming_it_and_exits_66(self):
    missing = self.tempdir() / "no-such-run"
    for command in ("verify", "inspect"):
      result = zkdv(command, missing, "--json")
      self.assertEqual(result.returncode, cli.EXIT_NO_TRANSCRIPT, result.stderr)
      self.assertEqual(result.stdout, "")
      self.assertEqual(result.stderr, f"zkdv {command}: no such file or folder: "
                       f"{str(missing)!r}\n")

  def test_a_file_or_folder_that_is_not_a_transcript_is_not_called_invalid(self):
    folder = self.tempdir()
    (folder / "notes.txt").write_text("hello")
    (folder / "list.cbor").write_bytes(cbor2.dumps([1, 2, 3]))
    (folder / "empty").mkdir()
    (folder / "not-root").mkdir()
    (folder / "not-root" / transcript.RECORDS_FILE).write_bytes(cbor2.dumps({"type": "step"}))
    for name, args in (("notes.txt", ["verify"]), ("list.cbor", ["verify", "--json"]),
                       ("empty", ["verify"]), ("not-root", ["inspect"])):
      result = zkdv(*args, folder / name)
      with self.subTest(name):
        self.assertEqual(result.returncode, cli.EXIT_NO_TRANSCRIPT, result.stderr)
        self.assertIn(f"{str(folder / name)!r} is not a ZKDV transcript", result.stderr)
        self.assertIn("\nhint: ", result.stderr)
        self.assertNotIn("invalid", (result.stdout + result.stderr).lower())

  def test_a_damaged_transcript_is_still_invalid(self):
    path = write_transcript(self.tempdir(), steps=2)
    records = path / transcript.RECORDS_FILE
    data = bytearray(records.read_bytes())
    data[transcript.read_transcript(path).records[1].offset] = 0xff  # not CBOR from record 1
    records.write_bytes(bytes(data))
    result = zkdv("verify", path)
    self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
    self.assertRegex(result.stdout, r"\nverdict +INVALID\n")

  def test_a_folder_of_transcripts_lists_them_newest_first(self):
    proofs = self.tempdir() / "zkdv-proofs"
    proofs.mkdir()
    (proofs / "stray-file").write_text("")
    (proofs / "not-a-run").mkdir()
    root = transcript.encode_record({"type": "root"})
    for n in range(12):
      run = proofs / f"run-{n:02d}"
      run.mkdir()
      (run / transcript.RECORDS_FILE).write_bytes(root)
      os.utime(run / transcript.RECORDS_FILE, (1_700_000_000 + n * (-1) ** n,) * 2)
    newest = sorted(range(12), key=lambda n: -n * (-1) ** n)
    for command in ("verify", "inspect"):
      result = zkdv(command, proofs)
      self.assertEqual(result.returncode, cli.EXIT_NO_TRANSCRIPT, result.stderr)
      lines = result.stderr.splitlines()
      self.assertEqual(lines[0], f"zkdv {command}: {str(proofs)!r} is a folder of 12 "
                       "transcripts, not a transcript. Pick one of them (newest first):")
      self.assertEqual(lines[1:11], [f"  zkdv {command} {proofs}/run-{n:02d}"
                                     for n in newest[:10]])
      self.assertEqual(lines[11:], ["  ... and 2 more"])

  def test_progress_bar_redraws_only_on_a_terminal(self):
    terminal, log = _Terminal(), io.StringIO()
    for stream in (terminal, log):
      show = cli.progress_bar(stream, "replaying checks")
      for done in range(101):
        show(done, 100)
    self.assertEqual(terminal.getvalue().count("\r"), 101)
    self.assertTrue(terminal.getvalue().endswith("] 100/100\n"))
    self.assertNotIn("\r", log.getvalue())
    self.assertEqual(log.getvalue().splitlines(),
                     [f"replaying checks: {n}/100" for n in range(0, 101, 10)])
    result = zkdv("verify", write_transcript(self.tempdir(), steps=3))
    self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
    self.assertNotIn("\r", result.stderr)
    self.assertRegex(result.stderr, r"^replaying checks: 0/(\d+)\n(.*\n)*replaying checks: \1/\1\n$")


def dvbench_cli(*args, **kwargs) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "dvbench.cli", *map(str, args)],
                        capture_output=True, text=True, check=False, **kwargs)


class DVBenchCommandLineTest(absltest.TestCase):
  """dvbench: defaults in help, a missing --data refused, what serve and worker say, and
  the client's messages for an unreachable server and a failed upload."""

  def tempdir(self) -> pathlib.Path:
    return pathlib.Path(self.enterContext(tempfile.TemporaryDirectory(prefix="dvbench-cli-")))

  def test_ci_runs_the_readme_commands_as_written(self):
    root = pathlib.Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    ci = (root / ".ci" / "run").read_text().splitlines()
    quick_start = readme.split("## Quick start")[1].split("\n## ")[0]
    commands = [block.split("\n")[1] for block in quick_start.split("```bash")[1:3]]
    self.assertEqual(commands[1], ". .venv/bin/activate && scripts/test")
    for command in commands:
      self.assertIn(command, ci)

  def test_help_shows_defaults_and_exit_codes(self):
    from dvbench import cli as dvbench_cli_lib  # pylint: disable=g-import-not-at-top
    result = dvbench_cli("serve", "--help")
    self.assertEqual(result.returncode, 0, result.stderr)
    text = " ".join(result.stdout.split())
    for fragment in ("--port PORT port to listen on (default: 8000)",
                     "(default: dvbench-data)", "(default: 0.1)",
                     f"{dvbench_cli_lib.EXIT_NO_DATA} no data folder"):
      self.assertIn(fragment, text)

  def main(self, *args) -> tuple[int, str]:
    """(exit status, stderr) of ``dvbench ARGS`` run in this process."""
    from dvbench import cli as dvbench_cli_lib  # pylint: disable=g-import-not-at-top
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
      try:
        status = dvbench_cli_lib.main(list(map(str, args)))
      except SystemExit as e:
        status = e.code
    return status, stderr.getvalue()

  def test_a_missing_data_folder_is_refused_unless_created(self):
    missing = self.tempdir() / "dvbench-dat"  # a typo of the real folder
    for args in (("serve",), ("worker", "--once"), ("token", "create", "alice"),
                 ("server-key",)):
      status, stderr = self.main(*args, "--data", missing)
      with self.subTest(args[0]):
        self.assertEqual(status, 66, stderr)
        self.assertIn(f"there is no data folder {missing}", stderr)
        self.assertIn("--create", stderr)
        self.assertFalse(missing.exists())
    empty = self.tempdir()  # a folder, but no server's
    status, stderr = self.main("serve", "--data", empty)
    self.assertEqual(status, 66, stderr)
    self.assertIn("holds no DVBench database", stderr)
    self.assertEqual(self.main("token", "create", "alice", "--data", missing, "--create")[0], 0)
    self.assertTrue((missing / "dvbench.db").is_file())
    idle = dvbench_cli("worker", "--once", "--data", missing)
    self.assertEqual(idle.returncode, 0, idle.stderr)
    self.assertIn("no job was waiting; nothing to verify", idle.stderr)

  def test_server_commands_without_the_server_extra_name_it(self):
    # A meta-path finder on PYTHONPATH (through sitecustomize) makes `starlette` and
    # `sqlalchemy` unimportable, as on a machine without `pip install "dvbench[server]"`.
    blocker = self.tempdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class NotInstalled:\n"
        "  def find_spec(self, name, path=None, target=None):\n"
        "    if name.split('.')[0] in ('starlette', 'sqlalchemy'):\n"
        "      raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NotInstalled())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(blocker), *filter(None, [os.environ.get("PYTHONPATH")])])}
    data = self.tempdir() / "data"
    serve = dvbench_cli("serve", "--data", data, "--create", "--port", "1", env=env)
    from dvbench import cli as dvbench_cli_lib  # pylint: disable=g-import-not-at-top
    self.assertEqual(serve.returncode, dvbench_cli_lib.EXIT_NO_SERVER_EXTRA, serve.stderr)
    self.assertEqual(serve.stderr.strip(), 'dvbench serve: needs the server\'s packages, and '
                     'starlette is not installed. Install them with: pip install '
                     '"dvbench[server]"')
    token = dvbench_cli("token", "create", "alice", "--data", data, "--create", env=env)
    self.assertEqual(token.returncode, dvbench_cli_lib.EXIT_NO_SERVER_EXTRA, token.stderr)
    self.assertIn("sqlalchemy is not installed", token.stderr)
    self.assertNotIn("Traceback", serve.stderr + token.stderr)
    helped = dvbench_cli("serve", "--help", env=env)  # the command line needs no extra
    self.assertEqual(helped.returncode, 0, helped.stderr)
    self.assertIn('pip install \'dvbench[server]\'', " ".join(helped.stdout.split()))

  def test_serve_says_where_it_listens_and_keeps_its_data(self):
    from dvbench.server.local import free_port  # pylint: disable=g-import-not-at-top
    data, port = self.tempdir() / "data", free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "dvbench.cli", "serve", "--create", "--data", str(data),
         "--port", str(port), "--workers", "0"], stderr=subprocess.PIPE, text=True)
    try:
      line = server.stderr.readline().strip()
    finally:
      server.terminate()
      server.communicate(timeout=30)
    self.assertEqual(line, f"dvbench serve: listening on http://127.0.0.1:{port}, data in "
                     f"{data.resolve()}")

  def test_an_unreachable_server_fails_fast_naming_its_url(self):
    import time  # pylint: disable=g-import-not-at-top
    import dvbench  # pylint: disable=g-import-not-at-top
    from dvbench.server.local import free_port  # pylint: disable=g-import-not-at-top
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = dvbench.Client(url, token="t")
    self.addCleanup(client.close)
    started = time.monotonic()
    with self.assertRaises(dvbench.errors.UploadError) as raised:
      client.experiment("alice/run")
    self.assertLess(time.monotonic() - started, 10)  # not the 60 s of a restarting server
    message = str(raised.exception)
    self.assertIn(f"cannot reach a DVBench server at {url}", message)
    self.assertIn("dvbench serve", message)
    self.assertNotIn("Nothing local was lost", message)

  def test_a_failed_upload_names_the_folder_and_the_call_that_resends_it(self):
    from dvbench.client import Http  # pylint: disable=g-import-not-at-top
    from dvbench.errors import UploadError  # pylint: disable=g-import-not-at-top
    from dvbench.server.local import free_port  # pylint: disable=g-import-not-at-top
    from dvbench.upload import Uploader  # pylint: disable=g-import-not-at-top
    folder = self.tempdir() / "run"
    writer = transcript.TranscriptWriter(folder)
    writer.append({"type": "root", "format_version": transcript.FORMAT_VERSION,
                   "name": "run"})
    writer.close()
    http = Http(f"http://127.0.0.1:{free_port()}", token="t")
    self.addCleanup(http.close)
    uploader = Uploader(http, "alice/run", folder)
    uploader.start()
    with self.assertRaises(UploadError) as raised:
      uploader.finish(timeout=30)
    self.assertIn(f"The transcript is intact in {folder}", str(raised.exception))
    self.assertIn(f"experiment.upload({str(folder)!r})", str(raised.exception))


if __name__ == "__main__":
  absltest.main()
