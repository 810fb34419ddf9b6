"""The tutorial's code as written, the example program, and the package root."""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from unittest import mock

import jax
from absl.testing import absltest
from absl.testing import parameterized
from flax import serialization

from tests import testing
from tests import tutorial_steps
from zkdv import challenge
from zkdv import digest
from zkdv import verify

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE_STEPS = 3  # every step checked (p = 1): each of the example's proofs replays them all
TUTORIAL_POLICY = challenge.Policy(0.01, 0.0, 0.0, 16, 16, False)  # its offline proof's


def tutorial_seed(drawn: bool) -> bytes:
  """A self-challenger seed under which the tutorial's first step draws an update check
  (``drawn``: its first segment is decided by it), or none of its 10 steps does."""
  for i in range(1 << 16):
    seed = i.to_bytes(32, "little")
    draws = [challenge.decide(t, challenge.step_challenge_self(seed, t), TUTORIAL_POLICY).update
             for t in range(10)]
    if (draws[0] if drawn else not any(draws)):
      return seed
  raise AssertionError("no such seed")


class TutorialTest(parameterized.TestCase):

  # The prover's seed is fixed so that each run takes the path it names, never by chance.
  @parameterized.named_parameters(("a_check_drawn", True), ("no_check_drawn", False))
  def test_tutorial_steps_2_to_6_as_written(self, drawn):
    workdir = pathlib.Path(tempfile.mkdtemp())
    cwd = os.getcwd()
    os.chdir(workdir)
    self.addCleanup(os.chdir, cwd)
    namespace = {}
    with mock.patch.object(challenge, "new_key", return_value=tutorial_seed(drawn)):
      exec(compile(tutorial_steps.without_server(tutorial_steps.STEPS_2_TO_6), "tutorial",
                   "exec"), namespace)  # pylint: disable=exec-used
    proof, state = namespace["proof"], namespace["state"]
    # -- what it must show -----------------------------------------------------
    path = proof.path
    self.assertEqual(proof.finish(), path)  # a second finish is harmless
    self.assertTrue(str(path).startswith(str(workdir / "zkdv-proofs")))
    self.assertTrue((workdir / "jax-checkpoint.msgpack").stat().st_size > 0)
    self.assertEqual(int(state.step), 10)
    steps = testing.records_of(path, "step")
    self.assertEqual([s["index"] for s in steps], list(range(10)))
    for prev, step in zip(steps, steps[1:]):  # segments chain: each starts where one ended
      self.assertEqual("pre_state" in step, "post_state" in prev)
      self.assertEqual(step.get("pre_state"), prev.get("post_state"))
    root = testing.records_of(path, "root")[0]
    # The configured proof of step 2 is never started explicitly: it starts itself.
    self.assertEqual(root["challenger"]["policy"], {
        "update_check_probability": 0.01, "state_check_probability": 0.0,
        "probe_ratio": 0.0, "rolling_window": 16, "segment_length": 16, "full_replay": False})
    self.assertEqual(root["prover"], "whitebox-jax")
    final = testing.records_of(path, "final")
    self.assertLen(final, 1)
    self.assertEqual(final[0]["status"], "clean")
    self.assertEqual(final[0]["final_state"], steps[-1]["post_state"])
    report = verify.verify(path)
    # At p = 0.01 most 10-step runs have no check: the verifier then says it could not
    # verify (it requires a replayed check), never that the run is verified.
    self.assertEqual(proof.checks["update"] > 0, drawn)
    if drawn:
      self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    else:
      self.assertEqual(report.verdict, verify.UNVERIFIABLE, report.dumps())
      self.assertEqual([f.code for f in report.findings], ["too_few_checks"])
    # Offline, the prover chose its own checks; the state names the start nothing attests.
    self.assertEqual(report.standing["state"], "self-audited")
    self.assertIn("start unattested", report.standing["shortfalls"])
    # The checkpoint written in step 6 is the transcript's final params.
    restored = serialization.msgpack_restore(
        (workdir / "jax-checkpoint.msgpack").read_bytes())
    flat = jax.tree_util.tree_flatten_with_path(restored)[0]
    layouts = [digest.LeafLayout(jax.tree_util.keystr(p), str(v.dtype), v.shape)
               for p, v in flat]
    self.assertEqual(
        digest.digest_state_arrays(layouts, [v for _, v in flat])[0], final[0]["final_params"])

  def test_example_program_and_cli(self):
    out = pathlib.Path(tempfile.mkdtemp())
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples/jax/proof_trainstate.py"),
         "--steps", str(EXAMPLE_STEPS), "--probability", "1.0", "--output-dir", str(out)],
        capture_output=True, text=True, check=True, cwd=out)
    names = ["jax-train-state", "batch-stats-dropout", "attest-apply-fn",
             "overlap-unchecked", "overlap-always", "overlap-never"]
    cli = subprocess.run([sys.executable, "-m", "zkdv.cli", "verify", str(out / names[0]),
                          "--json"], capture_output=True, text=True)
    self.assertEqual(cli.returncode, 0, cli.stdout + cli.stderr)
    reports = {names[0]: json.loads(cli.stdout)}
    reports.update({name: verify.verify(out / name).to_json() for name in names[1:]})
    for name in names:
      self.assertIn(f"{name}: {EXAMPLE_STEPS} steps", result.stdout)
      self.assertIn(f"zkdv verify {out / name}", result.stdout)  # what to run next
      report = reports[name]
      self.assertEqual(report["verdict"], "verified", report)
      self.assertEqual(report["steps"], EXAMPLE_STEPS)
      self.assertEqual(len(report["checks"]),
                       len(testing.records_of(out / name, "check")))
    checkpoint = out / "jax-train-state" / "jax-checkpoint.msgpack"  # beside its records
    self.assertIn(f"checkpoint (final params): {checkpoint}", result.stdout)
    self.assertTrue(checkpoint.is_file())
    self.assertFalse((out / "jax-checkpoint.msgpack").exists())  # nothing in the cwd
    self.assertTrue(all("loss" in r["metrics"] for r in testing.records_of(
        out / "batch-stats-dropout", "step")))
    claims = {c["name"]: c["status"] for c in reports["jax-train-state"]["claims"]}
    self.assertEqual(claims["start"], "holds")  # the example attests its start
    modes = {c["mode"] for c in reports["attest-apply-fn"]["checks"] if c["kind"] == "update"}
    self.assertEqual(modes, {"equivalent"})
    inspect = subprocess.run([sys.executable, "-m", "zkdv.cli", "inspect", "--json",
                              str(out / "jax-train-state")], capture_output=True, text=True,
                             check=True)
    summary = json.loads(inspect.stdout)
    self.assertEqual(summary["root"]["name"], "jax-train-state")
    self.assertEqual(summary["steps"], EXAMPLE_STEPS)
    self.assertEqual(summary["programs"][0]["mode"], "exact")

  def test_import_zkdv_does_not_import_jax(self):
    code = ("import sys, zkdv; assert 'jax' not in sys.modules, 'jax imported';"
            "zkdv.SamplingPolicy(); zkdv.ZKDVConfig(); zkdv.overlap.NEVER; zkdv.errors;"
            "import zkdv.verify, zkdv.cli; assert 'jax' not in sys.modules;"
            "zkdv.jax.ZKDV; assert 'jax' in sys.modules; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    self.assertEqual(result.stdout.strip(), "ok", result.stderr)


if __name__ == "__main__":
  absltest.main()
