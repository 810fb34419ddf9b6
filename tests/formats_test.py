"""One transcript format: a transcript of any other ``format_version`` is refused, naming it.

The format 2 and format 3 transcripts here are written byte by byte (deterministic CBOR
records, chained by BLAKE3) as those formats laid them out, without the writer under test:
format 2 committed both states at every step and opened one step's batch as a flat list;
format 3 committed states per segment and had no row groups.
"""

import pathlib
import tempfile

import blake3
import cbor2
import httpx
from absl.testing import absltest
from absl.testing import parameterized

import dvbench
from dvbench.server.local import LocalServer
from tests.cli_test import zkdv, zkdv_here
from tests.fake_prover import FakeProver
from zkdv import errors
from zkdv import inspect as inspect_lib
from zkdv import transcript
from zkdv import verify

CURRENT = transcript.FORMAT_VERSION


def _digest(data: bytes) -> bytes:
  return blake3.blake3(data).digest()


def legacy_records(version: int, steps: int = 4) -> list[dict]:
  """The records of a self-challenged transcript as format ``version`` (2 or 3) wrote them."""
  policy = {"update_check_probability": 1.0, "state_check_probability": 0.0,
            "probe_ratio": 0.0, "rolling_window": 4}
  if version != 2:
    policy.update(segment_length=2, full_replay=False)
  seed = bytes(range(32))
  records = [{"type": "root", "format_version": version, "prover": "whitebox-jax",
              "name": f"format-{version}", "versions": {}, "platform": "cpu",
              "device_kinds": ["cpu"], "config": {},
              "challenger": {"kind": "self", "seed_commitment": _digest(seed),
                             "policy": policy}}]
  state = _digest(b"start")
  for t in range(steps):
    batch = _digest(b"batch %d" % t)
    post = _digest(state + batch)
    step = {"type": "step", "index": t, "program": 0, "batch": batch}
    starts, ends = (True, True) if version == 2 else (t % 2 == 0, t % 2 == 1)
    if starts:
      step["pre_state"] = state
    if ends:
      step["post_state"] = post
    records.append(step)
    if version == 2:
      records.append({"type": "check", "step": t, "kind": "update",
                      "pre_state_blobs": [state], "batch_blobs": [batch],
                      "result": {"equal": True}})
    elif ends:
      records.append({"type": "check", "step": t, "kind": "update", "first": t - 1,
                      "pre_state_blobs": [state], "batch_blobs": [[batch], [batch]]})
    state = post
  records.append({"type": "final", "steps": steps, "status": "clean", "discontinuities": [],
                  "final_state": state, "seed": seed})
  return records


def write_records(folder: pathlib.Path, records: list[dict]) -> pathlib.Path:
  """``records`` chained (``prev``: BLAKE3 of the record before) into ``folder``."""
  (folder / "blobs").mkdir(parents=True)
  data, prev = b"", None
  for record in records:
    raw = cbor2.dumps(record if prev is None else {**record, "prev": prev}, canonical=True)
    data += raw
    prev = _digest(raw)
  (folder / "records.cborl").write_bytes(data)
  return folder


def legacy_transcript(version: int) -> pathlib.Path:
  folder = pathlib.Path(tempfile.mkdtemp(prefix="zkdv-format-")) / f"format-{version}"
  return write_records(folder, legacy_records(version))


def no_longer(version: int) -> str:
  return (f"transcript format {version} is no longer supported; this zkdv reads format "
          f"{CURRENT}; re-run the training with this zkdv")


class VerifierRefusesOtherFormatsTest(parameterized.TestCase):

  def test_zkdv_verify_exits_2_naming_format_2(self):
    result = zkdv("verify", legacy_transcript(2))  # the command, in a process of its own
    self.assertEqual(result.returncode, 2, result.stderr)
    self.assertIn(no_longer(2), result.stdout)
    self.assertIn("could not verify", result.stdout)

  @parameterized.parameters(3, 4)
  def test_zkdv_verify_exits_2_naming_the_older_format(self, version):
    path = legacy_transcript(3)
    if version != 3:
      records = legacy_records(3)
      records[0]["format_version"] = version
      path = write_records(path.parent / "edited", records)
    result = zkdv_here("verify", "--json", path)
    self.assertEqual(result.returncode, 2, result.stderr)
    self.assertIn(no_longer(version), result.stdout)

  @parameterized.parameters(2, 3)
  def test_the_report_names_the_format_and_nothing_else(self, version):
    report = verify.verify(legacy_transcript(version))
    self.assertEqual(report.verdict, verify.UNVERIFIABLE)
    self.assertEqual([(f.code, f.where) for f in report.findings],
                     [("format_version", "record 0")])
    self.assertIn(no_longer(version), report.findings[0].message)
    self.assertEqual(report.exit_code, 2)

  @parameterized.parameters((CURRENT + 1, str(CURRENT + 1)), ("5", "str '5'"),
                            (True, "True"), (None, "NoneType 'None'"), (2**70, "int"))
  def test_an_unknown_format_is_not_supported(self, version, shown):
    records = legacy_records(3)
    records[0]["format_version"] = version
    folder = pathlib.Path(tempfile.mkdtemp(prefix="zkdv-format-")) / "unknown"
    report = verify.verify(write_records(folder, records))
    self.assertEqual(report.verdict, verify.UNVERIFIABLE)
    self.assertIn(f"transcript format {shown}", report.findings[0].message)
    self.assertIn(f"is not supported; this zkdv reads format {CURRENT}; verify it with the "
                  "zkdv that wrote it", report.findings[0].message)

  @parameterized.parameters(2, 3)
  def test_zkdv_inspect_exits_2_naming_the_format(self, version):
    path = legacy_transcript(version)
    with self.assertRaises(errors.UnsupportedFormatError) as raised:
      inspect_lib.inspect_transcript(path)
    self.assertIn(no_longer(version), str(raised.exception))
    result = zkdv_here("inspect", path)
    self.assertEqual(result.returncode, 2)
    self.assertIn(f"zkdv inspect: {no_longer(version)}", result.stderr)

  def test_check_format_takes_the_current_format_only(self):
    transcript.check_format(CURRENT)
    for version in (1, 2, 3, CURRENT - 1):
      with self.assertRaisesRegex(errors.UnsupportedFormatError, "no longer supported"):
        transcript.check_format(version)


class ServerRefusesOtherFormatsTest(parameterized.TestCase):
  """A real ``dvbench serve`` (SQLite) refuses the root of another format with 400."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=0).start()
    cls.token = cls.server.token("alice")

  @classmethod
  def tearDownClass(cls):
    cls.server.stop()
    super().tearDownClass()

  @parameterized.parameters(2, 3)
  def test_a_root_of_an_older_format_is_refused_naming_it(self, version):
    prover = FakeProver(self.server.url, self.token, f"alice/format-{version}")
    root = prover.root(prover.slot())
    root["format_version"] = version
    response = prover.post_root(root)
    self.assertEqual(response.status_code, 400, response.text)
    self.assertEqual(response.json()["error"], "the root record (root).format_version: "
                     f"{no_longer(version)} to write a format {CURRENT} transcript.")
    self.assertIsNone(prover.proof_id)
    listed = httpx.get(f"{self.server.url}/api/v1/experiments/alice/format-{version}",
                       timeout=10)
    self.assertEqual(listed.json()["proofs"], [])
    self.assertEqual(prover.post_root(prover.root(prover.slot())).status_code, 201)

  @parameterized.parameters(2, 3)
  def test_uploading_a_transcript_of_an_older_format_fails_naming_it(self, version):
    client = dvbench.Client(self.server.url, token=self.token)
    experiment = client.experiment(f"alice/upload-{version}")
    with self.assertRaises(dvbench.errors.ApiError) as raised:
      experiment.upload(legacy_transcript(version), timeout=30)
    self.assertEqual(raised.exception.status, 400)
    self.assertIn(f"{no_longer(version)} to write a format {CURRENT} transcript. The "
                  "transcript is intact in", str(raised.exception))


if __name__ == "__main__":
  absltest.main()
