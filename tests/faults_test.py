"""Faults of the verifier are not findings about the transcript.

A bug in a check, XLA running out of memory, or a replay process that dies gives
"could not verify: internal error" (exit code 70) with the traceback in the log,
never ``invalid``; and every hostile transcript is a finding, never a fault.
"""

import contextlib
import io
import json
import pathlib
import subprocess
import sys

import blake3
import jax.numpy as jnp
from absl.testing import absltest

import dvbench
from dvbench.server.db import Store
from dvbench.server.local import LocalServer

from tests.verify_test import (VerifierTestCase, copy_of, exported_program, records_of,
                               rechained, sgd_step, write_transcript)
from zkdv import cli
from zkdv import transcript
from zkdv import verify
from zkdv.verify import checks
from zkdv.verify import claims

HUGE = 2**40  # float32 elements: 4 TiB, more than any test machine can allocate


def hungry_step(w, b, x):
  """``sgd_step`` with an intermediate of 4 TiB: a program an honest prover's machine may
  run and the verifier's cannot (XLA: RESOURCE_EXHAUSTED)."""
  big = jnp.cumsum(jnp.broadcast_to(x[0, 0], (HUGE,)))[-1]
  w2, b2 = sgd_step(w, b, x)
  return w2 + big * 0, b2


def with_program(src: pathlib.Path, fn) -> pathlib.Path:
  """A copy of ``src`` whose program is ``fn`` exported (same layouts), re-chained."""
  folder = copy_of(src)
  blob, _ = exported_program(fn)
  program_id = blake3.blake3(blob).digest()
  (folder / transcript.BLOBS_DIR / program_id.hex()).write_bytes(blob)

  def edit(records):
    for r in records:
      if r["type"] == "program":
        r["program_id"] = r["blob"] = program_id
    return records
  return rechained(edit, folder)


class VerifierFaultTest(VerifierTestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.good = write_transcript(steps=2)

  def assert_fault(self, report, cause: str):
    self.assertEqual(report.verdict, verify.UNVERIFIABLE, report.dumps())
    self.assertEqual(report.exit_code, verify.EXIT_INTERNAL_ERROR)
    self.assertIn(cause, report.fault)
    self.assertTrue(report.fault.startswith("internal error: "), report.fault)
    self.assertEqual([f for f in report.findings if f.blocks == verify.INVALID], [])
    self.assertEqual(report.standing["state"], "could not verify")  # earns no state
    for claim in report.claims:  # nothing is claimed from a verification that stopped
      self.assertNotEqual(claim.status, verify.HOLDS, claim)
      self.assertNotEqual(claim.status, verify.DOES_NOT_HOLD, claim)

  def test_a_bug_in_a_check_is_a_fault_not_a_finding(self):
    def broken(*args):
      raise RuntimeError("a bug in the update check")
    saved = checks.CHECKERS["update"]
    checks.CHECKERS["update"] = broken
    try:
      with self.assertLogs("zkdv.verify", "ERROR") as logged:
        report = verify.verify(self.good)
    finally:
      checks.CHECKERS["update"] = saved
    self.assert_fault(report, "RuntimeError: a bug in the update check")
    self.assertIn("Traceback", "\n".join(logged.output))  # the traceback goes to the log
    self.assertIn("broken", "\n".join(logged.output))
    self.assertEqual(json.loads(report.dumps())["fault"], report.fault)

  def test_a_bug_in_the_claims_or_the_report_exits_70(self):
    def broken(ctx):
      raise KeyError("a bug in a claim")
    saved = claims.BUILDERS["replays"]
    claims.BUILDERS["replays"] = broken
    try:
      with self.assertLogs("zkdv.verify", "ERROR"):
        report = verify.verify(self.good)
    finally:
      claims.BUILDERS["replays"] = saved
    self.assert_fault(report, "KeyError: 'a bug in a claim'")
    self.assertIn("replays", [c.name for c in report.unmet])

    def broken_report(report):
      raise ValueError("a bug in the report")
    saved, cli._human_report = cli._human_report, broken_report
    stderr = io.StringIO()
    try:
      with contextlib.redirect_stderr(stderr):
        code = cli.main(["verify", str(self.good)])
    finally:
      cli._human_report = saved
    self.assertEqual(code, verify.EXIT_INTERNAL_ERROR)  # never 1 ("invalid")
    self.assertIn("ValueError: a bug in the report", stderr.getvalue())
    self.assertIn("could not verify: internal error", stderr.getvalue())

  def test_out_of_memory_in_a_replay_is_a_fault(self):
    report = verify.verify(with_program(self.good, hungry_step))
    self.assert_fault(report, "RESOURCE_EXHAUSTED")

  def test_cli_exit_code_and_traceback(self):
    path = with_program(self.good, hungry_step)
    done = subprocess.run([sys.executable, "-m", "zkdv.cli", "verify", str(path), "--json"],
                          capture_output=True, text=True, timeout=300, check=False)
    self.assertEqual(done.returncode, verify.EXIT_INTERNAL_ERROR, done.stderr[-3000:])
    report = json.loads(done.stdout)
    self.assertEqual(report["verdict"], "could not verify")
    self.assertIn("RESOURCE_EXHAUSTED", report["fault"])
    self.assertIn("Traceback", done.stderr)
    help_text = subprocess.run([sys.executable, "-m", "zkdv.cli", "verify", "--help"],
                               capture_output=True, text=True, timeout=60, check=True).stdout
    self.assertIn("70  could not verify: the verifier itself failed (a bug, out of\n", help_text)
    self.assertIn("internal error: JaxRuntimeError: RESOURCE_EXHAUSTED",
                  cli._human_report(verify.verify(path)))


class ServerFaultTest(absltest.TestCase):
  """A real server whose verifier runs out of memory on an uploaded transcript: retried,
  then "could not verify", never ``invalid``."""

  def test_a_verifier_fault_is_retried_then_unverifiable(self):
    server = LocalServer(workers=1, extra_args=("--max-attempts", "2")).start()
    self.addCleanup(server.stop)
    token = Store.open(f"sqlite:///{server.data / 'dvbench.db'}").create_token("alice")[1]
    client = dvbench.Client(server.url, token)
    self.addCleanup(client.close)
    proof_id = client.experiment("alice/hungry").upload(
        with_program(write_transcript(steps=2), hungry_step))
    proof = client.wait_for_verdict(proof_id, timeout=300)
    self.assertEqual(proof["state"], "unverifiable", proof)
    self.assertRegex(proof["failure"], r"^could not verify: verification was given up after 2 "
                     r"attempts; the last one ended because the verifier failed: internal "
                     r"error: JaxRuntimeError: RESOURCE_EXHAUSTED")
    self.assertTrue(proof["label"].startswith(proof["failure"]), proof["label"])


# Values a hostile prover writes into any field: none, a bignum, a wrong-shaped container.

HOSTILE_VALUES = (None, -2**70, [{}])


class HostileRecordsAreFindingsTest(VerifierTestCase):
  """Every field of one record of each type and check kind (and every field one level
  down: the config, the challenger, a layout), set to each hostile value, re-chained: the
  verifier records findings, never a fault."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.good = write_transcript(steps=2)
    cls.records = records_of(cls.good)

  def _fields(self) -> list[tuple]:
    """(record number, key path) of every field to mutate."""
    seen, fields = set(), []
    for n, r in enumerate(self.records):
      if (r["type"], r.get("kind")) in seen:
        continue
      seen.add((r["type"], r.get("kind")))
      for name, value in sorted(r.items()):
        if name in ("prev", "type"):
          continue
        fields.append((n, (name,)))
        inner = value[0] if isinstance(value, list) and value else value
        if isinstance(inner, dict):
          fields += [(n, (name, *([0] if inner is not value else []), key))
                     for key in sorted(inner)]
    return fields

  def test_every_mutated_field_is_a_finding(self):
    fields = self._fields()
    for n, path in fields:
      for value in HOSTILE_VALUES:
        def edit(records, n=n, path=path, value=value):
          target = records[n]
          for key in path[:-1]:
            target = target[key]
          target[path[-1]] = value
          return records
        report = verify.verify(rechained(edit, self.good), replay="none")
        where = f"record {n} ({self.records[n]['type']}) {path} = {value!r}"
        self.assertIsNone(report.fault, f"{where}: {report.dumps()}")
        self.assertNotEqual(report.verdict, verify.VERIFIED, where)
    self.assertGreater(len(fields), 50)


if __name__ == "__main__":
  absltest.main()
