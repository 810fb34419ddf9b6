"""The verifier's own policy: its requirements and what decides the exit code."""

from absl.testing import absltest
from absl.testing import parameterized

from zkdv import challenge
from zkdv.config import Tolerance
from zkdv.verify import policy
from zkdv.verify import report as report_lib


def _root(**challenger):
  base = {"kind": "self", "seed_commitment": bytes(32),
          "policy": challenge.Policy(update_check_probability=0.5).to_record()}
  return {"challenger": {**base, **challenger}}


class VerifierPolicyTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("replay", {"replay": "some"}),
      ("tolerance", {"tolerance": Tolerance(float("inf"), 0.0)}),
      ("min_checks", {"min_checks": -1}),
      ("claims", {"required": ("chain", "vibes")}),
  )
  def test_bad_arguments(self, kwargs):
    with self.assertRaises(ValueError):
      policy.VerifierPolicy(**kwargs)

  def test_strict_requires_every_claim(self):
    self.assertEqual(policy.VerifierPolicy(strict=True).required, report_lib.CLAIMS)
    self.assertEqual(policy.VerifierPolicy().required, ("chain", "replays"))

  @parameterized.named_parameters(
      ("unknown_kind", {"kind": "oracle"}, "challenger"),
      ("extra_field", {"seed": bytes(32)}, "challenger"),
      ("short_commitment", {"seed_commitment": b"x"}, "challenger"),
      ("policy_zero", {"policy": challenge.Policy(update_check_probability=0.0).to_record()},
       "policy"),
      ("policy_fields", {"policy": {"update_check_probability": 1.0}}, "policy"),
  )
  def test_malformed_challenger(self, change, code):
    report = report_lib.Report(path="x")
    self.assertIsNone(policy.parse_challenger(_root(**change), report))
    self.assertEqual([f.code for f in report.findings], [code])

  def test_dvbench_challenger(self):
    root = _root(kind="dvbench", server_key=bytes(range(32)), nonce=bytes(32),
                 key_commitment=bytes(32), owner="alice", experiment="alice/run")
    del root["challenger"]["seed_commitment"]
    parsed = policy.parse_challenger(root, report_lib.Report(path="x"))
    self.assertEqual(parsed.label, f"dvbench {bytes(range(32)).hex()[:16]}")
    root["challenger"]["experiment"] = "alice/run/../bob"
    self.assertIsNone(policy.parse_challenger(root, report_lib.Report(path="x")))


class ExitCodeTest(parameterized.TestCase):

  @parameterized.parameters(
      ([], {"chain": "holds", "replays": "holds"}, 0),
      ([], {"chain": "holds", "replays": "could not verify"}, 2),
      ([], {"chain": "does not hold", "replays": "holds"}, 1),
      ([report_lib.UNVERIFIABLE], {"chain": "holds", "replays": "holds"}, 2),
      ([report_lib.INVALID], {"chain": "holds", "replays": "holds"}, 1),
      ([report_lib.UNVERIFIABLE], {"chain": "does not hold", "replays": "holds"}, 1),
  )
  def test_exit_code_is_the_worst_of_verdict_and_required_claims(self, blocks, claims, code):
    report = report_lib.Report(path="x")
    for b in blocks:
      report.fail("x", "y", "z", b)
    report.claims = [report_lib.Claim(n, s, "") for n, s in claims.items()]
    report.claims.append(report_lib.Claim("challenges", "does not hold", ""))  # not required
    self.assertEqual(report.exit_code, code)

  def test_missing_required_claim_could_not_verify(self):
    report = report_lib.Report(path="x", required=("start",))
    self.assertEqual(report.exit_code, 2)


if __name__ == "__main__":
  absltest.main()
