"""zkdv verify on the command line: claims, requirements and exit codes."""

import json
import pathlib
import subprocess
import sys
import tempfile

from absl.testing import absltest

from tests.verify_test import _Dvbench, good_transcript, write_transcript


def zkdv(*args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "zkdv.cli", *map(str, args)],
                        capture_output=True, text=True, check=False)


class VerifyCliTest(absltest.TestCase):

  def test_self_audited_run_exits_0_and_says_so(self):
    result = zkdv("verify", good_transcript())
    self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
    self.assertIn("self-audited: detects faults, not a dishonest prover", result.stdout)
    self.assertIn("exit 0: verified, every required claim holds", result.stdout)

  def test_required_claims_decide_the_exit_code(self):
    self.assertEqual(zkdv("verify", good_transcript(), "--require", "challenges").returncode, 1)
    self.assertEqual(zkdv("verify", good_transcript(), "--strict", "--quiet").returncode, 1)
    self.assertEqual(zkdv("verify", good_transcript(), "--replay", "none").returncode, 2)
    bad = zkdv("verify", good_transcript(), "--require", "vibes")
    self.assertEqual(bad.returncode, 2)
    self.assertIn("unknown claims", bad.stderr)

  def test_json_lists_every_claim(self):
    report = json.loads(zkdv("verify", good_transcript(), "--json").stdout)
    self.assertEqual([c["name"] for c in report["claims"]],
                     ["chain", "challenges", "replays", "start", "program", "data"])
    replays = next(c for c in report["claims"] if c["name"] == "replays")
    self.assertEqual(replays["facts"]["p"], 1.0)
    self.assertEqual(replays["facts"]["escape_probability"], 0.0)
    self.assertEqual(report["unmet"], [])

  def test_server_key_from_hex_or_file_and_challenge_key_file(self):
    server = _Dvbench()
    path = write_transcript(server=server, steps=3)
    self.assertEqual(zkdv("verify", path).returncode, 2)  # no key: could not verify
    key_file = pathlib.Path(tempfile.mkdtemp()) / "server.key"
    key_file.write_text(server.server_key.hex())
    for key in (server.server_key.hex(), key_file):
      result = zkdv("verify", path, "--server-key", key, "--require",
                    "chain,replays,challenges")
      self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
      self.assertIn("agrees", result.stdout)
    k_file = key_file.with_name("k")
    k_file.write_text(server.key.hex())
    self.assertEqual(zkdv("verify", path, "--challenge-key-file", k_file).returncode, 0)
    self.assertEqual(zkdv("verify", path, "--server-key", "abcd").returncode, 2)


if __name__ == "__main__":
  absltest.main()
