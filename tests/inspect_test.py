"""zkdv inspect: what each program computes, derived from its module."""

import dataclasses
import json
import pathlib
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from dvbench import benchmark
from dvbench import contamination
from tests.verify_test import precomputed_step, write_transcript
from zkdv import config
from zkdv import inspect
from zkdv.jax import stablehlo
from zkdv.jax._compat import ir, mlir


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

  def test_a_call_whose_operands_share_an_input_maps_it_once(self):
    # jnp.where and jnp.remainder are private functions of the module, called with two
    # operands derived from the same input: their masks combine as a set. Summed, they
    # carried into the next input's bit: a program read as not reading what it reads
    # (here the params, 0), or as reading an input it never touches.
    def f(a, b, unused):
      del unused
      hit = (a[0] == 0.25) & (jnp.arange(8) % 3 == 2)
      reads_a = jnp.where(hit, jnp.nan, a[1] * jnp.ones(8))
      twice = jnp.where(a[0] > 0, a[1], a[0])  # one input, twice, through one call
      return reads_a, twice, b + 0
    exported = jax.export.export(jax.jit(f, keep_unused=True))(
        jnp.ones(2), jnp.ones(8), jnp.ones(8))
    summary = stablehlo.analyze(exported)
    self.assertEqual([[summary.depends_on(o, [i]) for i in range(3)] for o in range(3)],
                     [[True, False, False], [True, False, False], [False, True, False]])

  def test_constant_arrays_and_the_rows_they_hold(self):
    rows = np.arange(40, dtype=np.uint32).reshape(8, 5) * 7 + 3
    baked = jnp.asarray(np.concatenate([np.zeros(3, np.uint32), rows[2], rows[5]]))
    exported = jax.export.export(jax.jit(lambda x: x * 2 + baked[:1]))(
        jnp.ones(1, jnp.uint32))
    constants = stablehlo.constant_arrays(exported)
    self.assertTrue(any(c.dtype == np.uint32 and c.tobytes() == np.asarray(baked).tobytes()
                        for c in constants))
    leaves = [rows.reshape(8, -1).view(np.uint8)]
    self.assertEqual(contamination.rows_in_constants(constants, leaves), [2, 5])
    # Another dtype of the same numbers is other bytes: found as the dtype of the rows ...
    as_float = [np.asarray(baked, np.float32)]
    self.assertEqual(contamination.rows_in_constants(as_float, leaves), [])
    self.assertEqual(contamination.rows_in_constants(
        contamination.in_dtypes(as_float, [np.uint32]), leaves), [2, 5])
    # ... when they convert exactly: other numbers are not those rows (a limit docs state).
    self.assertEqual(contamination.rows_in_constants(
        contamination.in_dtypes([as_float[0] + 0.5], [np.uint32]), leaves), [])
    # A label leaf alone identifies nothing: label values in a constant are not rows.
    tokens, labels = rows[:, :4].reshape(8, -1).view(np.uint8), np.int32([0, 1] * 4)
    self.assertEqual(contamination.rows_in_constants(
        [labels], [tokens, labels.reshape(8, -1).view(np.uint8)]), [])

  def test_attack_evaluation_rows_in_another_dtype_transposed_or_dense_resource(self):
    rows = np.arange(64, dtype=np.int32).reshape(4, 16) * 5 + 1
    folder = pathlib.Path(tempfile.mkdtemp())
    (folder / "blobs").mkdir()

    def scan(exported):
      blob = exported.serialize()
      program_id = bytes(range(32))
      (folder / "blobs" / program_id.hex()).write_bytes(blob)
      benchmark.scan_programs(folder, [["init program", program_id]], [rows])

    # The rows baked as float32 and converted back inside the step.
    as_float = jnp.asarray(rows, jnp.float32)
    exported = jax.export.export(jax.jit(lambda x: x + as_float.astype(jnp.int32)[1:3]))(
        jnp.ones((2, 16), jnp.int32))
    with self.assertRaisesRegex(benchmark.EmbeddedRowsError, r"^init program 0001020304050607… "
                                r"embeds evaluation rows \[0, 1, 2, 3\] as constants"):
      scan(exported)
    # The rows baked transposed (column-major) and transposed back inside the step.
    columns = jnp.asarray(rows.T)
    with self.assertRaisesRegex(benchmark.EmbeddedRowsError, r"embeds evaluation rows "
                                r"\[0, 1, 2, 3\] as constants"):
      scan(jax.export.export(jax.jit(lambda x: x + columns.T[1:3]))(
          jnp.ones((2, 16), jnp.int32)))
    # The rows as a dense_resource constant: a constant the MLIR bindings do not hand over
    # as dense elements, so neither the budget nor the scan read it.
    text = exported.mlir_module()
    dense = re.search(r"dense<[^>]*> : tensor<4x16xf32>", text).group(0)
    text = text.replace(dense, "dense_resource<rows> : tensor<4x16xf32>") + (
        '{-#\n dialect_resources: { builtin: { rows: "0x04000000%s" } }\n#-}\n'
        % np.asarray(as_float).tobytes().hex())
    with mlir.make_ir_context():
      module = mlir.module_to_bytecode(ir.Module.parse(text))
    hostile = dataclasses.replace(exported, mlir_module_serialized=module)
    self.assertEqual(stablehlo.analyze(hostile).constant_bytes, rows.size * 4)
    with self.assertRaisesRegex(benchmark.EmbeddedRowsError, r"^init program 0001020304050607… "
                                r"cannot be scanned for evaluation rows: a dense_resource "
                                r"constant of type tensor<4x16xf32> cannot be read"):
      scan(hostile)

  def test_constants_over_the_budget_are_refused(self):
    weights = np.arange(config.MAX_PROGRAM_CONSTANT_BYTES // 4 + 1, dtype=np.float32)
    small = weights[:16]
    for baked, refused in ((weights, True), (small, False)):
      exported = jax.export.export(jax.jit(lambda x, c=baked: x + c))(
          jax.ShapeDtypeStruct(baked.shape, jnp.float32))
      summary = stablehlo.analyze(exported)
      self.assertEqual(summary.constant_bytes, baked.nbytes)
      if refused:
        with self.assertRaisesRegex(stablehlo.UnsafeProgramError,
                                    f"embeds {baked.nbytes:,} bytes of constants, over the "
                                    f"budget of {config.MAX_PROGRAM_CONSTANT_BYTES:,}"):
          stablehlo.check_safe(exported, summary)
      else:
        stablehlo.check_safe(exported, summary)

  def test_programs_that_read_state_outside_their_inputs_are_refused(self):
    # Each would let a program tell a verifier's replay from training: stateful random
    # numbers advance with every call of an executable; an uninitialized buffer holds
    # whatever the device computed before.
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    hidden = {
        "rng": (jax.export.export(jax.jit(
            lambda v: v + jax.lax.rng_uniform(0.0, 1.0, (4,))))(x),
                r"reads state outside its inputs \(stablehlo\.rng"),
        "empty": (jax.export.export(jax.jit(
            lambda v: v + jax.lax.empty((4,), jnp.float32)), platforms=["tpu"])(x),
                  r"reads uninitialized device memory \(AllocateBuffer"),
    }
    for name, (exported, message) in hidden.items():
      with self.subTest(name):
        summary = stablehlo.analyze(exported)
        with self.assertRaisesRegex(stablehlo.UnsafeProgramError, message):
          stablehlo.check_safe(exported, summary)
    # An empty buffer of no elements holds nothing (jnp.linspace(..., num=0) makes one).
    nothing = jax.export.export(jax.jit(lambda v: jax.lax.empty((0,), jnp.float32) + v[:0]),
                                platforms=["tpu"])(x)
    self.assertIn("AllocateBuffer", nothing.mlir_module())
    stablehlo.check_safe(nothing, stablehlo.analyze(nothing))

  def test_linear_algebra_custom_calls_are_allowed(self):
    exported = jax.export.export(jax.jit(jnp.linalg.solve))(jnp.eye(3), jnp.ones(3))
    summary = stablehlo.analyze(exported)
    self.assertTrue(summary.custom_calls)
    stablehlo.check_safe(exported, summary)


class InspectTest(absltest.TestCase):

  def test_constant_bytes_are_shown_against_the_budget(self):
    summary = inspect.inspect_transcript(write_transcript(fn=precomputed_step, steps=1))
    program = summary["programs"][0]
    # full_like(w, 0.5), b * 0 and 2.0: three splats, one float32 each, whatever the shape.
    self.assertEqual(program["constant_bytes"], 12)
    self.assertEqual(program["constant_budget"], config.MAX_PROGRAM_CONSTANT_BYTES)
    self.assertIn(f"constants: 12 bytes (budget {config.MAX_PROGRAM_CONSTANT_BYTES:,})",
                  inspect.human(summary))

  def test_summary_fields(self):
    summary = inspect.inspect_transcript(write_transcript(steps=2))
    program = summary["programs"][0]
    self.assertEqual(summary["steps"], 2)
    self.assertEqual(program["parameters"], 4)  # w: 3, b: 1
    self.assertEqual([i["role"] for i in program["inputs"]], ["state", "state", "batch"])
    self.assertEqual(program["inputs"][2]["shape"], [5, 3])
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
