"""zkdv inspect: what each program computes, derived from its module."""

import json
import pathlib
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from absl.testing import absltest

from tests.verify_test import precomputed_step, write_transcript
from zkdv import inspect
from zkdv.jax import stablehlo


class StablehloTest(absltest.TestCase):

  def test_dataflow_follows_calls_loops_and_branches(self):
    def f(s, b, unused):
      del unused
      looped = jax.lax.fori_loop(0, 3, lambda i, x: x + 1, s)
      branched = jax.lax.cond(b[0, 0] > 0, lambda: s, lambda: s + 1)
      return s * 2 + jnp.sum(b), looped, branched
    exported = jax.export.export(jax.jit(f, keep_unused=True))(
        jnp.ones(3), jnp.ones((2, 3)), jnp.ones(2))
    summary = stablehlo.analyze(exported)
    self.assertEqual([summary.depends_on(o, [1]) for o in range(3)], [True, False, True])
    self.assertFalse(any(summary.depends_on(o, [2]) for o in range(3)))
    self.assertEqual(summary.refused, ())
    self.assertIn("stablehlo.while", summary.op_counts)

  def test_linear_algebra_custom_calls_are_allowed(self):
    exported = jax.export.export(jax.jit(jnp.linalg.solve))(jnp.eye(3), jnp.ones(3))
    summary = stablehlo.analyze(exported)
    self.assertTrue(summary.custom_calls)
    stablehlo.check_safe(exported, summary)


class InspectTest(absltest.TestCase):

  def test_batch_independent_program_is_reported(self):
    ignoring = inspect.inspect_transcript(write_transcript(fn=precomputed_step, steps=1))
    honest = inspect.inspect_transcript(write_transcript(steps=1))
    self.assertFalse(ignoring["programs"][0]["post_state_depends_on_batch"])
    self.assertTrue(honest["programs"][0]["post_state_depends_on_batch"])
    self.assertIn("does NOT depend on the batch", inspect.human(ignoring))

  def test_summary_fields(self):
    summary = inspect.inspect_transcript(write_transcript(steps=2))
    program = summary["programs"][0]
    self.assertEqual(summary["steps"], 2)
    self.assertEqual(program["parameters"], 4)  # w: 3, b: 1
    self.assertEqual([i["role"] for i in program["inputs"]], ["state", "state", "batch"])
    self.assertEqual(program["inputs"][2]["shape"], [4, 3])
    self.assertGreater(sum(program["operations"].values()), 0)
    self.assertIsNone(program["refused"])

  def test_cli_json_and_stablehlo(self):
    path = write_transcript(steps=1)
    out = pathlib.Path(tempfile.mkdtemp()) / "hlo"
    result = subprocess.run([sys.executable, "-m", "zkdv.cli", "inspect", str(path), "--json",
                             "--stablehlo", str(out)], capture_output=True, text=True,
                            check=True)
    self.assertEqual(json.loads(result.stdout)["root"]["name"], "hand-written")
    [written] = out.iterdir()
    self.assertIn("func.func public @main", written.read_text())


if __name__ == "__main__":
  absltest.main()
