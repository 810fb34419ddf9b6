"""proof.jit's programs: one update per call, a program per static state, inputs in order.

The tests that also run the verifier are in ``StepVerifiedTest``.
"""

import pathlib
import warnings

import jax
import jax.numpy as jnp
import optax
from absl.testing import absltest
from absl.testing import parameterized

import zkdv
from tests import testing
from zkdv import errors
from zkdv import verify

BATCH = jnp.asarray(testing.TUTORIAL_BATCH)


def _steps_with_tx_change(name: str):
  """Two steps with adam(1e-2), then two with adam(1e-3) set by ``state.replace(tx=...)``."""
  proof = testing.new_proof(name, update_p=1.0)
  proof.start()
  state = testing.classifier_state(proof, tx=optax.adam(1e-2))
  train_step = proof.jit(testing.classifier_step, donate_argnums=0)
  for _ in range(2):
    state = train_step(state, BATCH)
  state = state.replace(tx=optax.adam(1e-3))  # the same optimizer state, another static tx
  for _ in range(2):
    state = train_step(state, BATCH)
  proof.finish()
  return proof


class StepTest(parameterized.TestCase):

  def test_two_updates_in_one_step_are_refused_and_nothing_is_recorded(self):
    proof = testing.new_proof("two-updates")
    proof.start()
    state = testing.classifier_state(proof)

    @proof.jit
    def two_updates(state, batch):
      return testing.classifier_step(testing.classifier_step(state, batch), batch)

    with self.assertRaisesRegex(errors.UnsupportedUpdateError,
                                r"calls apply_gradients\(\) 2 times"):
      two_updates(state, BATCH)
    self.assertEqual(proof.steps, 0)
    proof.jit(testing.classifier_step)(state, BATCH)  # a correct step still records
    proof.finish()
    self.assertLen(testing.records_of(proof.path, "program"), 1)
    self.assertLen(testing.records_of(proof.path, "step"), 1)

  def test_changed_tx_records_a_new_program_and_the_chain_continues(self):
    proof = _steps_with_tx_change("tx-change")
    programs = testing.records_of(proof.path, "program")
    self.assertLen(programs, 2)
    self.assertNotEqual(programs[0]["program_id"], programs[1]["program_id"])
    self.assertEqual([s["program"] for s in testing.records_of(proof.path, "step")],
                     [0, 0, 1, 1])
    self.assertEqual(proof.discontinuities, [])
    self.assertEqual(proof.failed_checks, [])

  def test_alternating_programs_end_state_checked_segments_at_each_switch(self):
    # A state check chosen at a segment's first step opens the segment's end; when another
    # program ends the segment early, that end is the next step's pre-state.
    proof = testing.new_proof("alternating", update_p=0.01, state_p=1.0)
    proof.start(rolling_window=4)
    state = testing.classifier_state(proof)
    steps = [proof.jit(f, donate_argnums=0) for f in (
        testing.classifier_step, lambda state, batch: testing.classifier_step(state, batch / 2))]
    for t in range(6):
      state = steps[t % 2](state, BATCH)
    proof.finish()
    self.assertEqual([(s["program"], "post_state" in s)
                      for s in testing.records_of(proof.path, "step")], [(t % 2, True)
                                                                         for t in range(6)])
    self.assertEqual([c["step"] for c in testing.records_of(proof.path, "check")
                      if c["kind"] == "state"], list(range(6)))
    report = verify.verify(proof.path, min_checks=0)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())

  def test_the_same_tx_reuses_its_program(self):
    proof = testing.new_proof("same-tx")
    proof.start()
    tx = optax.adam(1e-2)
    state = testing.classifier_state(proof, tx=tx)
    train_step = proof.jit(testing.classifier_step)
    for _ in range(3):
      state = train_step(state.replace(tx=tx), BATCH)
    proof.finish()
    self.assertLen(testing.records_of(proof.path, "program"), 1)

  def test_inputs_are_classified_and_named_in_call_order(self):
    proof = testing.new_proof("input-order")
    proof.start()
    state = testing.classifier_state(proof)

    @proof.jit
    def train_step(batch, state, *, scale):
      return testing.classifier_step(state, batch * scale)

    train_step(BATCH, state, scale=jnp.uint32(1))
    proof.finish()
    program = testing.records_of(proof.path, "program")[0]
    leaves = len(jax.tree.leaves(state))
    self.assertEqual(program["inputs"], ["batch"] + ["state"] * leaves + ["batch"])
    self.assertEqual([l["path"] for l in program["batch_layout"]], ["[0][0]", "[1]['scale']"])
    self.assertEqual(program["state_layout"][0]["path"], ".step")
    self.assertEqual(program["post_state_outputs"], list(range(leaves)))
    (built,) = train_step._programs.values()  # pylint: disable=protected-access
    self.assertEqual([l.path for l in built.input_layouts],
                     ["[0][0]"] + [l["path"] for l in program["state_layout"]] + ["[1]['scale']"])


  def test_a_step_traced_again_into_the_same_program_commits(self):
    # proof.jit(...) called inline in the loop builds a new program of the same id each time.
    proof = testing.new_proof("inline-jit")
    proof.start()
    state = testing.classifier_state(proof)
    for _ in range(3):
      state = proof.jit(testing.classifier_step)(state, jnp.asarray(testing.TUTORIAL_BATCH))
    proof.finish()
    self.assertEqual(proof.steps, 3)
    self.assertLen(testing.records_of(proof.path, "program"), 1)
    self.assertEqual([s["program"] for s in testing.records_of(proof.path, "step")], [0, 0, 0])

  @parameterized.named_parameters(("uncommitted_batch", False), ("committed_batch", True))
  def test_the_provers_replay_runs_productions_executable_without_compiling_again(
      self, commit_batch):
    proof = testing.new_proof("one-compilation", update_p=1.0, segment_length=2)
    proof.start()
    state = testing.classifier_state(proof)
    train_step = proof.jit(testing.classifier_step, donate_argnums=0)
    batch = jax.device_put(BATCH, jax.devices()[0]) if commit_batch else BATCH
    self.assertEqual(batch.committed, commit_batch)
    for _ in range(4):
      state = train_step(state, batch)
    proof.finish()
    (program,) = train_step._programs.values()  # pylint: disable=protected-access
    self.assertIn(True, program.weak_types)  # Flax's step=0: replayed with its weak type
    self.assertIs(program.replay_executable, program.executable)
    # One trace and compilation: the first step's new TrainState (uncommitted arrays),
    # the next steps' outputs (committed) and the replays' fresh inputs run one executable.
    self.assertEqual(program.executable._cache_size(), 1)  # pylint: disable=protected-access
    self.assertEqual(proof.checks["update"], 2)
    self.assertEqual(proof.failed_checks, [])

  def test_a_wrong_production_step_fails_the_provers_own_replay(self):
    # A fault in what production returned (here: one leaf plus one at step 2) is not
    # in the compiled program, which the prover's replay runs again.
    proof = testing.new_proof("fault", update_p=1.0, segment_length=2)
    proof.start()
    state = testing.classifier_state(proof)
    train_step = proof.jit(testing.classifier_step, donate_argnums=0)
    state = train_step(state, BATCH)
    (program,) = train_step._programs.values()  # pylint: disable=protected-access
    honest, calls = program.executable, [1]

    def faulty(*leaves):
      outs = list(honest(*leaves))
      if calls[0] == 2:
        first = program.post_indices[0]
        outs[first] = outs[first] + 1
      calls[0] += 1
      return outs

    program.executable = faulty
    for _ in range(3):
      state = train_step(state, BATCH)
    with self.assertRaisesRegex(errors.ReplayError, "first at step 3, leaves .'end state'."):
      proof.finish()
    self.assertEqual([(f["first"], f["step"]) for f in proof.failed_checks], [(2, 3)])
    self.assertEqual(proof.failed_checks[0]["mismatched_leaves"], ["end state"])

  def test_exported_programs_carry_no_paths_of_the_provers_machine(self):
    proof = testing.new_proof("no-paths")
    proof.start()
    model = testing.TinyClassifier()
    params = proof.init(model.init, jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
    state = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply,
                                               params=params, tx=optax.adam(1e-2))
    train_step = proof.jit(testing.classifier_step)
    state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH))
    proof.finish()
    programs = [testing.records_of(proof.path, kind)[0]["program_id"]
                for kind in ("init", "program")]
    here = pathlib.Path(__file__).resolve()
    for program_id in programs:
      blob = (proof.path / "blobs" / program_id.hex()).read_bytes()
      self.assertNotIn(here.name.encode(), blob)
      self.assertNotIn(str(here.parent).encode(), blob)
      self.assertNotIn(b".py", blob)
      self.assertNotIn("loc(\"/", jax.export.deserialize(bytearray(blob)).mlir_module())


class StepVerifiedTest(absltest.TestCase):

  def test_a_run_with_a_changed_tx_verifies(self):
    report = verify.verify(_steps_with_tx_change("tx-change").path)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    self.assertEqual(report.steps, 4)

  def test_backend_option_places_the_step_without_jax_deprecation_warnings(self):
    proof = testing.new_proof("on-cpu", update_p=1.0)
    proof.start()
    state = testing.classifier_state(proof)
    with warnings.catch_warnings():
      warnings.simplefilter("error", DeprecationWarning)  # jit(backend=...) is deprecated
      train_step = proof.jit(testing.classifier_step, backend="cpu")
      for _ in range(2):
        state = train_step(state, BATCH)
      proof.finish()
    self.assertEqual(state.params["Dense_0"]["bias"].devices(), {jax.local_devices(
        backend="cpu")[0]})
    self.assertEqual(verify.verify(proof.path).verdict, verify.VERIFIED)


if __name__ == "__main__":
  absltest.main()
