"""One segment-decision rule: the prover, the server and the verifier require the same checks.

``zkdv.challenge.deciding_step`` says which step's challenge decides a segment's update and
state checks, ``required_checks`` which checks a step answers. Real training runs with
segments of 1, 2 and 3 steps (self-challenged, and challenged live by a real ``dvbench
serve``) give three tables of (step, kind) that must be equal: the check records the
prover wrote, the challenges the server stored, and the verifier's re-derived decisions.
"""

import pathlib
import tempfile
from unittest import mock

import jax.numpy as jnp
from absl.testing import absltest
from absl.testing import parameterized

import dvbench
import zkdv
from dvbench.server import custody
from dvbench.server.db import Store
from dvbench.server.local import LocalServer
from tests import testing
from zkdv import challenge
from zkdv import transcript
from zkdv import verify
from zkdv.verify import decisions
from zkdv.verify import policy as policy_lib
from zkdv.verify import receipt as receipt_lib
from zkdv.verify import structure
from zkdv.verify.context import Verification
from zkdv.verify.report import Report

STEPS = 7
LAYOUTS = {1: [1] * 7, 2: [2, 2, 2, 1], 3: [3, 3, 1]}  # segment_length -> segment lengths
# Every server segment draws its update check (so its replay always runs); state checks and
# probes are drawn, so which step decides them still shows.
SAMPLING = zkdv.SamplingPolicy(update_check_probability=1.0, state_check_probability=0.5)
SELF_POLICY = challenge.Policy(0.5, 0.5, 0.25)


def seed_drawing_an_update_at_step_0() -> bytes:
  """A self-challenger seed whose first segment (decided by step 0) draws an update check,
  so the self-challenged runs replay something every time, never by chance."""
  for i in range(1 << 16):
    seed = i.to_bytes(32, "little")
    if challenge.decide(0, challenge.step_challenge_self(seed, 0), SELF_POLICY).update:
      return seed
  raise AssertionError("no such seed")
KINDS = ("update", "state", "probe")


def train(proof) -> pathlib.Path:
  proof.start(probe_ratio=0.25)
  state = testing.classifier_state(proof)
  train_step = proof.jit(testing.classifier_step, donate_argnums=0)
  for t in range(STEPS):
    state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + (t % 2))
  proof.finish()
  return pathlib.Path(proof.path)


def prover_table(path) -> set:
  """(step, kind) of every check record the prover wrote (the attested start's aside)."""
  return {(r["step"], r["kind"]) for r in testing.records_of(path, "check")
          if r["kind"] != "start"}


def verifier_table(path, key: bytes | None = None) -> tuple[set, list[int]]:
  """(step, kind) the verifier's re-derived decisions require, and its segment lengths."""
  report = Report(path=str(path))
  ctx = Verification(report, policy_lib.VerifierPolicy())
  ctx.model = structure.read(transcript.read_transcript(path), pathlib.Path(path), report)
  ctx.challenger = policy_lib.parse_challenger(ctx.model.root, report)
  ctx.keys = receipt_lib.challenge_key(ctx, server_key=None, challenge_key=key)
  derived = decisions.derive(ctx)
  assert derived.known, derived.unknown
  required = {(s.index, kind) for s in ctx.model.steps for kind in KINDS
              if derived.challenged(s.index, kind)}
  return required, [s.length for s in ctx.model.segments]


class RuleTest(parameterized.TestCase):

  @parameterized.parameters(("self", 4, 7, 4), ("dvbench", 4, 7, 7), ("self", 4, None, 4),
                            ("dvbench", 4, None, None), ("self", 5, 5, 5), ("dvbench", 5, 5, 5))
  def test_which_step_decides_a_segment(self, kind, first, last, expected):
    self.assertEqual(challenge.deciding_step(kind, first, last), expected)

  def test_an_unknown_challenger_kind_is_refused(self):
    with self.assertRaisesRegex(ValueError, "unknown challenger kind 'oracle'"):
      challenge.deciding_step("oracle", 0, 1)

  def test_a_step_ending_no_segment_answers_its_probes_only(self):
    policy = challenge.Policy(1.0, 1.0, 0.5)
    decision = challenge.decide(3, bytes(32), policy)
    self.assertEqual(challenge.required_checks(decision, None),
                     {"update": False, "state": False, "probe": True})
    self.assertEqual(challenge.required_checks(decision, decision),
                     {"update": True, "state": True, "probe": True})
    unchecked = challenge.decide(1, bytes(32), challenge.Policy(0.0, 0.0, 0.0))
    self.assertEqual(challenge.required_checks(unchecked, decision),
                     {"update": True, "state": True, "probe": False})


class SelfChallengedTest(parameterized.TestCase):
  """The prover and the verifier (a self-challenged proof has no server challenges)."""

  @parameterized.parameters(1, 2, 3)
  def test_prover_and_verifier_require_the_same_checks(self, segment_length):
    with mock.patch.object(challenge, "deciding_step",
                           wraps=challenge.deciding_step) as rule, mock.patch.object(
                               challenge, "new_key",
                               return_value=seed_drawing_an_update_at_step_0()):
      path = train(testing.new_proof(f"rule-{segment_length}", update_p=0.5, state_p=0.5,
                                     segment_length=segment_length))
      required, layout = verifier_table(path)
    self.assertEqual(layout, LAYOUTS[segment_length])
    self.assertEqual(prover_table(path), required)
    self.assertTrue(any(kind == "update" for _, kind in required))
    calls = [c.args for c in rule.call_args_list]
    firsts = [sum(LAYOUTS[segment_length][:n]) for n in range(len(layout))]
    # The prover asks at each segment's start; the verifier for each whole segment.
    self.assertContainsSubset([("self", f, None) for f in firsts], calls)
    self.assertContainsSubset([("self", f, f + n - 1) for f, n in zip(firsts, layout)], calls)
    self.assertEqual(verify.verify(path).verdict, verify.VERIFIED)


class ServerChallengedTest(parameterized.TestCase):
  """The prover, a real ``dvbench serve`` (its stored challenges) and the verifier."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=0).start()
    cls.client = dvbench.Client(cls.server.url, token=cls.server.token("alice"))
    cls.store = Store.open(f"sqlite:///{cls.server.data / 'dvbench.db'}")

  @classmethod
  def tearDownClass(cls):
    cls.client.close()
    cls.server.stop()
    super().tearDownClass()

  @parameterized.parameters(2, 3)
  def test_prover_server_and_verifier_require_the_same_checks(self, segment_length):
    experiment = self.client.experiment(f"alice/rule-{segment_length}")
    proof = experiment.proof(config=zkdv.ZKDVConfig(
        sampling_policy=SAMPLING, segment_length=segment_length,
        output_dir=pathlib.Path(tempfile.mkdtemp(prefix="zkdv-rule-")) / "t"))
    path = train(proof)
    rows = self.store.challenge_rows(proof.proof_id)
    server = {(r["step"], kind) for r in rows for kind in KINDS if r[f"needs_{kind}"]}
    key = self.store.challenger(proof.proof_id)["challenge_key"]
    required, layout = verifier_table(path, key)
    tables = f"server {sorted(server)}, verifier {sorted(required)}, layout {layout}"
    self.assertEqual(layout, LAYOUTS[segment_length], tables)
    self.assertEqual([r["step"] for r in rows], list(range(STEPS)), tables)
    self.assertEqual(server, required)
    self.assertEqual(prover_table(path), required)
    report = verify.verify(path, challenge_key=key)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())

  def test_the_server_asks_the_one_rule(self):
    policy = challenge.Policy(1.0, 1.0, 0.0, segment_length=3)
    challenger = custody.ProofChallenger("dvbench", policy, bytes(32))
    with mock.patch.object(challenge, "deciding_step",
                           wraps=challenge.deciding_step) as rule:
      _, inner = challenger.needs(5, bytes(32), 4, ends_segment=False)
      _, last = challenger.needs(6, bytes(32), 4, ends_segment=True)
    self.assertEqual(rule.call_args_list, [mock.call("dvbench", 4, 6)])
    self.assertEqual((inner["update"], last["update"]), (False, True))


if __name__ == "__main__":
  absltest.main()
