"""The verifier's report: findings, check outcomes, claims, verdict and exit code.

The verdict says whether everything the verifier checked held; the claims say
what that amounts to (docs/design.md §10); the exit code is 0 only when the verdict is
verified and every required claim holds.

Example::

  report = Report(path="run", required=("chain", "replays"))
  report.fail("chain", "record 3", "prev does not match.")
  report.verdict, report.exit_code   # ("invalid", 1)
"""

import dataclasses
import json

VERIFIED, INVALID, UNVERIFIABLE = "verified", "invalid", "could not verify"
EXIT_CODES = {VERIFIED: 0, INVALID: 1, UNVERIFIABLE: 2}
# sysexits.h EX_SOFTWARE: the verifier itself failed (a bug, out of memory), so it could
# not verify; never a verdict about the transcript.
EXIT_INTERNAL_ERROR = 70

HOLDS, DOES_NOT_HOLD, COULD_NOT_VERIFY = "holds", "does not hold", "could not verify"
# The claims of docs/design.md §10 that a transcript alone can support, in report order.
CLAIMS = ("chain", "challenges", "replays", "start", "program", "data")
# What `zkdv verify` requires unless told otherwise: the records form one chain
# and every challenged step replays. Who chose the challenges, the start, the
# program and the data are reported, and required with --require or --strict.
DEFAULT_REQUIRED = ("chain", "replays")
_CLAIM_EXIT = {HOLDS: 0, DOES_NOT_HOLD: 1, COULD_NOT_VERIFY: 2}


@dataclasses.dataclass
class Finding:
  """One thing that failed: a machine code, where it is, and what happened."""

  code: str
  where: str
  message: str
  blocks: str = INVALID  # the verdict this finding forces

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass
class CheckOutcome:
  """One answered check: its step and kind, how it was compared, and the result."""

  step: int
  kind: str
  mode: str
  status: str  # "verified", "failed", "not replayed"
  challenged: bool = True  # False: volunteered by the prover, not chosen by the challenger
  max_abs_error: float = 0.0
  max_rel_error: float = 0.0
  max_ulp_error: int = 0
  first: int | None = None  # the first step of the replayed segment
  # Whether the segment's tested step changed every trained params leaf when replayed on
  # other batches (zkdv.verify.sensitivity); None: not tested. ``batch_ignored`` says what
  # did not change; ``batches_drawn`` which batches it ran on ("other steps' batches" or
  # "perturbed batches").
  batch_sensitive: bool | None = None
  batch_ignored: str | None = None
  batches_drawn: str | None = None


@dataclasses.dataclass
class Claim:
  """One claim of docs/design.md §10, its status and what it rests on."""

  name: str
  status: str
  detail: str
  facts: dict = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass
class Report:
  """Everything ``zkdv verify`` found about one transcript."""

  path: str
  required: tuple = DEFAULT_REQUIRED
  transcript_id: str | None = None
  name: str | None = None
  challenger: str | None = None
  challenger_kind: str | None = None  # "dvbench" or "self", once the root's is parsed
  records: int = 0
  steps: int = 0
  segments: int = 0
  finished: bool = False
  checks: list[CheckOutcome] = dataclasses.field(default_factory=list)
  discontinuities: list[int] = dataclasses.field(default_factory=list)
  probed_rows: int = 0
  dataset_rows: int = 0  # opened rows proven the declared dataset's at their index
  findings: list[Finding] = dataclasses.field(default_factory=list)
  claims: list[Claim] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)
  receipt: dict | None = None
  # Why the verifier itself stopped ("internal error: MemoryError: ..."): a fault of the
  # verifier, never a finding about the transcript (its traceback goes to the log).
  fault: str | None = None
  standing: dict | None = None  # claims.Standing.to_json(): the state the claims earn

  @property
  def verdict(self) -> str:
    if any(f.blocks == INVALID for f in self.findings):
      return INVALID
    if self.findings or self.fault:
      return UNVERIFIABLE
    return VERIFIED

  def claim(self, name: str) -> Claim | None:
    return next((c for c in self.claims if c.name == name), None)

  @property
  def unmet(self) -> list[Claim]:
    """The required claims that do not hold (a missing one could not be verified)."""
    return [self.claim(n) or Claim(n, COULD_NOT_VERIFY, "not evaluated")
            for n in self.required if (self.claim(n) is None
                                       or self.claim(n).status != HOLDS)]

  @property
  def exit_code(self) -> int:
    """0 verified with every required claim; 1 invalid or a required claim does
    not hold; 70 (``EXIT_INTERNAL_ERROR``) the verifier failed, so it could not verify;
    2 could not verify (the transcript or a required claim)."""
    codes = [EXIT_CODES[self.verdict]] + [_CLAIM_EXIT[c.status] for c in self.unmet]
    if 1 in codes:
      return 1  # a finding about the transcript stands, whatever stopped the verifier later
    return EXIT_INTERNAL_ERROR if self.fault else max(codes)

  def fail(self, code: str, where: str, message: str, blocks: str = INVALID) -> None:
    self.findings.append(Finding(code, where, message, blocks))

  def to_json(self) -> dict:
    return {
        "path": self.path, "transcript_id": self.transcript_id, "name": self.name,
        "verdict": self.verdict, "exit_code": self.exit_code,
        "challenger": self.challenger, "challenger_kind": self.challenger_kind,
        "standing": self.standing, "required": list(self.required),
        "claims": [c.to_json() for c in self.claims],
        "unmet": [c.name for c in self.unmet],
        "records": self.records, "steps": self.steps, "segments": self.segments, "finished": self.finished,
        "checks": [dataclasses.asdict(c) for c in self.checks],
        "discontinuities": self.discontinuities, "probed_rows": self.probed_rows,
        "dataset_rows": self.dataset_rows,
        "receipt": self.receipt, "notes": self.notes,
        "findings": [f.to_json() for f in self.findings],
        "fault": self.fault,
    }

  def dumps(self) -> str:
    return json.dumps(self.to_json(), indent=2)
