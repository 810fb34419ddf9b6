"""The ZKDV driver: jit options, attest, the context manager, sampling, failures.

Each test observes what an option or a lifecycle event does (deleted buffers,
output shardings, compiled files, transcript records). Tests that also run the
verifier on the transcript are grouped in the classes named ``...VerifiedTest``.
"""

import dataclasses
import functools
import gc
import os
import tempfile
import threading
import weakref
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import zkdv
from tests import testing
from zkdv import challenge
from zkdv import challengers
from zkdv import errors
from zkdv import transcript
from zkdv import verify

BATCH = jnp.asarray(testing.TUTORIAL_BATCH)


def _rows_sharding() -> NamedSharding:
  """A NamedSharding on a one-device mesh: unlike the default placement, it names an axis."""
  return NamedSharding(Mesh(np.array(jax.devices()[:1]), ("rows",)), PartitionSpec())


def _array_leaves(tree) -> list[jax.Array]:
  return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def _train(name: str, steps: int = 3, update_p: float = 1.0, **jit_options):
  """``steps`` classifier steps under ``proof.jit(**jit_options)``; returns (proof, state)."""
  proof = testing.new_proof(name, update_p=update_p)
  proof.start()
  state = testing.classifier_state(proof)
  train_step = proof.jit(testing.classifier_step, **jit_options)
  for _ in range(steps):
    state = train_step(state, BATCH)
  proof.finish()
  return proof, state


def _assert_checks_exact(test, proof, steps: int) -> None:
  test.assertEqual(proof.steps, steps)
  test.assertEqual(proof.checks["update"], steps)
  test.assertEqual(proof.failed_checks, [])
  for check in testing.records_of(proof.path, "check"):
    test.assertEqual((check["result"]["mode"], check["result"]["equal"]), ("exact", True))


def _assert_verified(test, proof, steps: int) -> verify.Report:
  report = verify.verify(proof.path)
  test.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
  test.assertEqual(report.steps, steps)
  return report


class JitOptionsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("static_argnums", {"static_argnums": 2}, (2.0,), {}, [[2, "2.0"]]),
      ("static_argnames", {"static_argnames": "scale"}, (), {"scale": 2.0}, [["scale", "2.0"]]),
  )
  def test_static_arguments_are_fixed_and_recorded(self, options, args, kwargs, recorded):
    proof = testing.new_proof("static", update_p=1.0)
    proof.start()
    state = testing.classifier_state(proof)

    def train_step(state, batch, scale):
      grads = jax.grad(lambda p: scale * testing.classifier_loss(state, batch, p))(state.params)
      return state.apply_gradients(grads=grads)

    state = proof.jit(train_step, **options)(state, BATCH, *args, **kwargs)
    proof.finish()
    program = testing.records_of(proof.path, "program")[0]
    self.assertEqual(program["static_arguments"], recorded)
    self.assertEqual(program["inputs"].count("batch"), 1)  # scale is not batch evidence
    _assert_checks_exact(self, proof, 1)

  @parameterized.named_parameters(
      ("donate_argnums", {"donate_argnums": 0}, True),
      ("donate_argnames", {"donate_argnames": "state"}, True),
      ("without_donation", {}, False),
  )
  def test_donated_state_is_deleted_by_each_step(self, options, donated):
    # Unchecked steps under NEVER: no opening or hash holds a view of an input
    # when it is donated (a live view makes JAX copy instead of donating).
    proof = testing.new_proof("donate", update_p=0.0)
    proof.start()
    state = testing.classifier_state(proof, zkdv_overlap=zkdv.overlap.NEVER)
    train_step = proof.jit(testing.classifier_step, **options)
    for _ in range(3):
      new_state = train_step(state, BATCH)
      self.assertEqual([x.is_deleted() for x in _array_leaves(state)],
                       [donated] * len(_array_leaves(state)))
      self.assertFalse(any(x.is_deleted() for x in _array_leaves(new_state)))
      state = new_state
    proof.finish()

  def test_compiler_options_reach_the_compiled_step(self):
    dump = tempfile.mkdtemp(prefix="zkdv-xla-dump-")
    proof, _ = _train("compiler-options", update_p=0.0, compiler_options={"xla_dump_to": dump})
    self.assertEqual(testing.records_of(proof.path, "program")[0]["compiler_options"],
                     {"xla_dump_to": dump})
    self.assertTrue(any("zkdv_update_classifier_step" in f for f in os.listdir(dump)),
                    os.listdir(dump))

  @parameterized.named_parameters(
      ("in_shardings", lambda: {"in_shardings": _rows_sharding()}),
      ("out_shardings", lambda: {"out_shardings": _rows_sharding()}),
  )
  def test_shardings_place_outputs_as_jax_jit_does(self, options):
    _, state = _train("shardings", steps=2, **options())
    plain = jax.jit(testing.classifier_step, **options())(testing.classifier_state(None), BATCH)
    self.assertEqual([x.sharding for x in _array_leaves(state)],
                     [x.sharding for x in _array_leaves(plain)])
    self.assertTrue(all(x.sharding == _rows_sharding() for x in _array_leaves(state)))

  @parameterized.parameters(True, False)
  def test_unused_input_is_committed_whatever_keep_unused_says(self, keep_unused):
    proof = testing.new_proof("keep-unused", update_p=1.0)
    proof.start()
    state = testing.classifier_state(proof)
    train_step = proof.jit(lambda state, batch, unused: testing.classifier_step(state, batch),
                           keep_unused=keep_unused)
    for marker in (0.0, 1.0):
      state = train_step(state, BATCH, jnp.full((3,), marker))
    proof.finish()
    program = testing.records_of(proof.path, "program")[0]
    self.assertEqual(program["inputs"][-2:], ["batch", "batch"])
    exported = jax.export.deserialize(
        bytearray(transcript.blob_path(proof.path, program["blob"]).read_bytes()))
    self.assertEqual(exported.module_kept_var_idx, tuple(range(len(program["inputs"]))))
    batches = [s["batch"] for s in testing.records_of(proof.path, "step")]
    self.assertNotEqual(batches[0], batches[1])  # only the unused input differs
    _assert_checks_exact(self, proof, 2)

  def test_keyword_arguments_and_extra_outputs(self):
    proof = testing.new_proof("kwargs", update_p=1.0)
    proof.start()
    state = testing.classifier_state(proof)

    @proof.jit
    def train_step(state, *, batch):
      loss, grads = jax.value_and_grad(
          lambda p: testing.classifier_loss(state, batch, p))(state.params)
      return {"loss": loss, "state": state.apply_gradients(grads=grads)}

    losses = []
    for _ in range(4):
      out = train_step(state, batch=BATCH)
      state = out["state"]
      losses.append(float(out["loss"]))
    proof.finish()
    self.assertLess(losses[-1], losses[0])
    program = testing.records_of(proof.path, "program")[0]
    self.assertEqual(program["inputs"].count("batch"), 1)
    _assert_checks_exact(self, proof, 4)


def _attest_loop(proof, steps: int = 3):
  """A loop without TrainState: (params, opt_state) updated by a proof.attest function."""
  tx = optax.sgd(0.1)
  params = {"w": jnp.ones((4, 2))}
  carry = (params, tx.init(params))

  @proof.attest(state_argnum=1, donate_argnums=1)
  def update(batch, carry):
    params, opt_state = carry
    x = batch[:, :4].astype(jnp.float32)
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  for _ in range(steps):
    carry, loss = update(BATCH, carry)
  return loss


class AttestTest(absltest.TestCase):

  def test_manual_update_function_without_train_state(self):
    proof = testing.new_proof("manual", update_p=1.0)
    proof.start()
    loss = _attest_loop(proof)
    proof.finish()
    self.assertGreater(float(loss), 0)
    self.assertEqual(testing.records_of(proof.path, "program")[0]["inputs"][0], "batch")
    _assert_checks_exact(self, proof, 3)

  def test_one_manual_update_function_per_proof(self):
    proof = testing.new_proof("manual-2")
    proof.start()
    one = proof.attest(lambda s, b: jax.tree.map(lambda v: v + b.sum(), s))
    two = proof.attest(lambda s, b: jax.tree.map(lambda v: v - b.sum(), s))
    fresh = {"w": jnp.ones((4, 2))}
    one(fresh, jnp.ones(2))
    with self.assertRaises(errors.AttestedProgramAlreadyRegisteredError):
      two(fresh, jnp.ones(2))


def _run_in_context(proof, fail: bool):
  """One step inside ``with proof:``, then RuntimeError("user code failed") if ``fail``."""
  with proof:
    state = testing.classifier_state(proof)
    proof.jit(testing.classifier_step)(state, BATCH)
    if fail:
      raise RuntimeError("user code failed")
  return proof


@functools.cache  # LifecycleTest and LifecycleVerifiedTest read the same runs
def _run_with_overlap(policy, backend: str, steps: int = 12):
  proof = testing.new_proof(f"overlap-{policy.value}", update_p=0.5, state_p=0.3,
                            digest_backend=backend, segment_length=1)
  proof.start(rolling_window=2)
  state = testing.classifier_state(proof, zkdv_overlap=policy)
  train_step = proof.jit(testing.classifier_step, donate_argnums=0)
  for _ in range(steps):
    state = train_step(state, BATCH)
  proof.finish()
  return proof, state


class LifecycleTest(parameterized.TestCase):

  def test_context_manager_starts_and_finishes_clean(self):
    proof = _run_in_context(testing.new_proof("ctx"), fail=False)
    final = testing.records_of(proof.path, "final")
    self.assertEqual([(f["status"], f["steps"]) for f in final], [("clean", 1)])

  def test_exception_inside_context_manager_writes_an_aborted_final(self):
    proof = testing.new_proof("ctx-error")
    with self.assertRaisesRegex(RuntimeError, "user code failed"):
      _run_in_context(proof, fail=True)
    final = testing.records_of(proof.path, "final")
    self.assertEqual([(f["status"], f["steps"]) for f in final], [("aborted", 1)])

  @parameterized.product(
      policy=[zkdv.overlap.UNCHECKED, zkdv.overlap.ALWAYS, zkdv.overlap.NEVER],
      backend=["host", "device"])
  def test_overlap_policies_give_the_same_training(self, policy, backend):
    proof, state = _run_with_overlap(policy, backend)
    reference = testing.classifier_state(None)
    plain = jax.jit(testing.classifier_step)
    for _ in range(12):
      reference = plain(reference, BATCH)
    testing.assert_bitwise_equal(state.params, reference.params)
    self.assertEqual(proof.failed_checks, [])

  def test_a_segment_end_does_not_wait_for_the_commit_threads_queue(self):
    # Every step ends a segment and donates the state the last one ended with; the commit
    # thread is held busy: the steps go on (their post-states are kept by host views, so
    # the donation copies), and every update check replays them bit for bit.
    proof = testing.new_proof("busy", update_p=1.0, segment_length=1)
    proof.start(rolling_window=8)
    state = testing.classifier_state(proof, zkdv_overlap=zkdv.overlap.ALWAYS)
    train_step = proof.jit(testing.classifier_step, donate_argnums=0)
    state = train_step(state, BATCH)
    proof.wait_for_commitments()
    release = threading.Event()
    busy = proof._committer.pipeline.submit(lambda job: release.wait(30))  # pylint: disable=protected-access
    for _ in range(4):
      state = train_step(state, BATCH)
    self.assertFalse(busy.done.is_set())  # the four steps ran while the commit thread waited
    release.set()
    proof.finish()
    _assert_verified(self, proof, 5)
    self.assertEqual(proof.failed_checks, [])
    self.assertEqual(proof.checks["update"], 5)

  def test_a_step_without_donation_leaves_no_post_state_behind(self):
    # Without donation each step returns a new state. A kept step (its batch, until its
    # segment is answered) must not keep that state alive: 8 steps of one open segment
    # held 8 generations of it.
    proof = testing.new_proof("no-donation", update_p=1.0, segment_length=16)
    proof.start(rolling_window=16)
    state = testing.classifier_state(proof)
    train_step = proof.jit(testing.classifier_step)
    outputs = []
    for _ in range(8):
      state = train_step(state, BATCH)
      outputs.append([weakref.ref(x) for x in jax.tree.leaves(state)])
    proof.wait_for_commitments()
    gc.collect()
    alive = [step for step, refs in enumerate(outputs[:-2]) if any(r() is not None for r in refs)]
    self.assertEqual(alive, [])
    proof.finish()
    _assert_verified(self, proof, 8)

  def test_background_failure_surfaces_at_wait_for_commitments_the_next_step_and_finish(self):
    proof = testing.new_proof("failure", update_p=0.0)
    proof.start()
    state = testing.classifier_state(proof)
    train_step = proof.jit(testing.classifier_step, donate_argnums=0)
    state = train_step(state, BATCH)
    proof.wait_for_commitments()
    proof._writer._file.close()  # pylint: disable=protected-access  # the disk goes away
    state = train_step(state, BATCH)  # its commitment fails on the commit thread
    # Before, this returned: a checkpoint saved next was of a step never committed.
    with self.assertRaisesRegex(errors.CommitmentError, "ValueError.*closed file"):
      proof.wait_for_commitments()
    with self.assertRaises(errors.CommitmentError):
      train_step(state, BATCH)
    with self.assertRaises(errors.ZKDVError):
      proof.finish()


def _decided_checks(path) -> set[tuple[int, str]]:
  """(step, kind) of every check the seed revealed in ``final`` decides."""
  root = testing.records_of(path, "root")[0]
  final = testing.records_of(path, "final")[0]
  policy = challenge.Policy.from_record(root["challenger"]["policy"])
  decisions = [challenge.decide(t, challenge.step_challenge_self(final["seed"], t), policy)
               for t in range(final["steps"])]
  return ({(d.step, "update") for d in decisions if d.update}
          | {(d.step, "state") for d in decisions if d.state})


def _run_sampled(name: str, steps: int = 16):
  # One-step segments: 16 draws at p = 0.5, so some update check is drawn (all but 2**-16).
  proof = testing.new_proof(name, update_p=0.5, state_p=0.5, segment_length=1)
  proof.start()
  state = testing.classifier_state(proof)
  train_step = proof.jit(testing.classifier_step)
  for _ in range(steps):
    state = train_step(state, BATCH)
  proof.finish()
  return proof


class SamplingTest(absltest.TestCase):

  def test_checked_steps_are_those_the_revealed_seed_decides(self):
    proof = _run_sampled("sampling")
    root = testing.records_of(proof.path, "root")[0]
    final = testing.records_of(proof.path, "final")[0]
    self.assertEqual(root["challenger"]["seed_commitment"],
                     challenge.key_commitment(final["seed"]))
    checks = {(c["step"], c["kind"]) for c in testing.records_of(proof.path, "check")}
    self.assertEqual(checks, _decided_checks(proof.path))
    self.assertNotIn(checks, (set(), {(t, k) for t in range(16) for k in ("update", "state")}))


class JitOptionsVerifiedTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("in_out_shardings", lambda: {"in_shardings": _rows_sharding(),
                                    "out_shardings": _rows_sharding()}),
      ("donate_argnames", lambda: {"donate_argnames": ("state",)}),
      ("device", lambda: {"device": jax.devices()[0]}),
      ("backend", lambda: {"backend": "cpu"}),
      ("inline_keep_unused", lambda: {"inline": True, "keep_unused": True}),
      ("compiler_options", lambda: {"compiler_options": {"xla_cpu_enable_fast_math": False}}),
  )
  def test_option_checks_replay_exactly(self, options):
    proof, _ = _train("options", **options())
    _assert_checks_exact(self, proof, 3)
    _assert_verified(self, proof, 3)

  def test_manual_update_function_verifies(self):
    proof = testing.new_proof("manual", update_p=1.0)
    proof.start()
    _attest_loop(proof)
    proof.finish()
    _assert_verified(self, proof, 3)


class LifecycleVerifiedTest(parameterized.TestCase):

  def test_clean_context_manager_run_verifies(self):
    _assert_verified(self, _run_in_context(testing.new_proof("ctx"), fail=False), 1)

  def test_aborted_run_does_not_verify(self):
    proof = testing.new_proof("ctx-error")
    with self.assertRaises(RuntimeError):
      _run_in_context(proof, fail=True)
    report = verify.verify(proof.path)
    self.assertEqual(report.verdict, verify.INVALID, report.dumps())
    self.assertEqual({f.code for f in report.findings}, {"aborted"})

  @parameterized.product(
      policy=[zkdv.overlap.UNCHECKED, zkdv.overlap.ALWAYS, zkdv.overlap.NEVER],
      backend=["host", "device"])
  def test_every_overlap_policy_verifies(self, policy, backend):
    proof, _ = _run_with_overlap(policy, backend)
    _assert_verified(self, proof, 12)


class SamplingVerifiedTest(absltest.TestCase):

  def test_verifier_replays_exactly_the_decided_checks(self):
    proof = _run_sampled("sampling")
    report = _assert_verified(self, proof, 16)
    self.assertEqual({(c.step, c.kind) for c in report.checks if c.kind in ("update", "state")},
                     _decided_checks(proof.path))
    self.assertTrue(all(c.status == "verified" for c in report.checks))

  def test_a_skipped_decided_check_is_found_by_the_verifier(self):
    decide_now = challengers.SelfChallenger.decision_now

    def skip_update_checks(challenger, step):
      return dataclasses.replace(decide_now(challenger, step), update=False)

    with mock.patch.object(challengers.SelfChallenger, "decision_now", skip_update_checks):
      proof = _run_sampled("skipped-check")
    self.assertFalse(any(c["kind"] == "update" for c in testing.records_of(proof.path, "check")))
    self.assertTrue(any(kind == "update" for _, kind in _decided_checks(proof.path)))
    report = verify.verify(proof.path)
    self.assertEqual(report.verdict, verify.INVALID, report.dumps())
    self.assertIn("missing_check", {f.code for f in report.findings})


if __name__ == "__main__":
  absltest.main()
