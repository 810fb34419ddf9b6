"""What this verifier requires, and the root's challenger validated against it.

The verifier owns the policy (docs/design.md §7, §10): every field the prover wrote is
input to validate, never a setting to obey. ``VerifierPolicy`` is the verifier's
own (command line or library arguments); the root's challenger and effective
policy are parsed from the transcript and checked against rules tables.

Example::

  options = VerifierPolicy(tolerance=Tolerance(1e-4, 1e-5), min_checks=2)
  challenger = parse_challenger(transcript.root, report)
"""

import dataclasses
import math

from zkdv import challenge
from zkdv.config import Tolerance
from zkdv.verify.report import CLAIMS, DEFAULT_REQUIRED, UNVERIFIABLE, Report

REPLAY_MODES = ("sampled", "none")
DIGEST_BYTES = 32


@dataclasses.dataclass(frozen=True)
class VerifierPolicy:
  """The verifier's requirements; nothing here is read from a transcript.

  Attributes:
    replay: "sampled" replays every answered check; "none" only opens them
      (never verified: the replays claim then could not be verified).
    tolerance: the loosest bound accepted for equivalent (non-bitwise) replays;
      a transcript asking for a looser one could not be verified.
    min_checks: challenged update checks that must be answered and replayed.
    required: the claims that must hold for exit code 0.
    strict: require every claim, with exact (bitwise) replays.
    dataset_root: the Merkle root (32 bytes) of the dataset the run must declare and draw
      its batches from (``proof.batches``); None: any the run declares, which the data
      claim says is the prover's.
  """

  replay: str = "sampled"
  tolerance: Tolerance = Tolerance()
  min_checks: int = 1
  required: tuple = DEFAULT_REQUIRED
  strict: bool = False
  dataset_root: bytes | None = None

  def __post_init__(self):
    if self.replay not in REPLAY_MODES:
      raise ValueError(f"replay must be one of {REPLAY_MODES}, got {self.replay!r}.")
    if not isinstance(self.tolerance, Tolerance) or not all(
        math.isfinite(v) for v in (self.tolerance.rtol, self.tolerance.atol)):
      raise ValueError(f"tolerance must be a finite zkdv.Tolerance, got {self.tolerance!r}.")
    if isinstance(self.min_checks, bool) or not isinstance(self.min_checks, int) or (
        self.min_checks < 0):
      raise ValueError(f"min_checks must be an int >= 0, got {self.min_checks!r}.")
    unknown = set(self.required) - set(CLAIMS)
    if unknown:
      raise ValueError(f"unknown claims {sorted(unknown)}; the claims are {list(CLAIMS)}.")
    if self.dataset_root is not None and not _digest(self.dataset_root):
      raise ValueError(f"dataset_root must be {DIGEST_BYTES} bytes, got {self.dataset_root!r}.")
    object.__setattr__(self, "required", CLAIMS if self.strict else tuple(self.required))


def _digest(value) -> bool:
  return isinstance(value, bytes) and len(value) == DIGEST_BYTES


def _name(value) -> bool:
  return isinstance(value, str) and 0 < len(value) <= 200 and "/" not in value


def _experiment(value) -> bool:
  return isinstance(value, str) and len(value) <= 400 and all(
      _name(part) for part in value.split("/")) and value.count("/") == 1


# The fields of each challenger besides "kind" and "policy" (docs/protocol.md).
CHALLENGER_FIELDS = {
    "self": {"seed_commitment": _digest},
    "dvbench": {"server_key": _digest, "nonce": _digest, "key_commitment": _digest,
                "owner": _name, "experiment": _experiment},
}
# Rules of an effective policy beyond challenge.Policy's own ranges.
POLICY_RULES = (
    ("update_check_probability", lambda p: p.update_check_probability > 0,
     "is 0: no step can be challenged for a replay"),
)


@dataclasses.dataclass(frozen=True)
class Challenger:
  """The root's challenger: who chose the checks, under which policy."""

  kind: str
  policy: challenge.Policy
  fields: dict  # validated CHALLENGER_FIELDS of its kind

  @property
  def label(self) -> str:
    if self.kind == "self":
      return "self-audited: detects faults, not a dishonest prover"
    return f"dvbench {self.fields['server_key'].hex()[:16]}"


def parse_challenger(root: dict, report: Report) -> Challenger | None:
  """The root's challenger; None (with a finding) when it is malformed."""
  where, record = "record 0 (challenger)", root["challenger"]
  kind = record.get("kind")
  fields = CHALLENGER_FIELDS.get(kind) if isinstance(kind, str) else None
  if fields is None:
    report.fail("challenger", where, f"unknown challenger kind {record.get('kind')!r}; "
                f"expected one of {sorted(CHALLENGER_FIELDS)}.")
    return None
  expected = {"kind", "policy", *fields}
  if set(record) != expected:
    report.fail("challenger", where, f"a {record['kind']} challenger has exactly the fields "
                f"{sorted(expected)}, got {sorted(map(str, record))}.")
    return None
  bad = [name for name, valid in fields.items() if not valid(record[name])]
  if bad:
    report.fail("challenger", where, f"malformed challenger fields {bad}.")
    return None
  try:
    policy = challenge.Policy.from_record(record["policy"])
  except (TypeError, ValueError) as e:
    report.fail("policy", where, f"the effective policy is malformed: {e}")
    return None
  broken = [f"{name} {message}" for name, holds, message in POLICY_RULES if not holds(policy)]
  if broken:
    report.fail("policy", where, f"the effective policy is refused: {'; '.join(broken)}.")
    return None
  return Challenger(record["kind"], policy, {k: record[k] for k in fields})


def check_tolerance(config: dict, limit: Tolerance, report: Report) -> None:
  """A tolerance in the root's config must be finite and no looser than ``limit``."""
  for name in ("rtol", "atol"):
    if name not in config:
      continue
    value = config[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value >= 0):
      report.fail("policy", "record 0 (config)",
                  f"{name} {value!r} is not a finite number >= 0.")
    elif value > getattr(limit, name):
      report.fail("policy", "record 0 (config)",
                  f"{name} {value!r} is looser than this verifier accepts "
                  f"({getattr(limit, name)!r}); accept it with --tolerance.", UNVERIFIABLE)

