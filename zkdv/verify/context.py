"""What one verification has established so far, shared by its concerns.

Each concern (structure, policy, keys, decisions, final, programs, checks,
claims) fills its own field; the claims read them all, so they can be stated
even when a verification stopped early.

Example::

  ctx = Verification(report, VerifierPolicy())
  ctx.model = structure.read(contents, folder, ctx.report)
"""

import dataclasses

from zkdv.verify.policy import Challenger, VerifierPolicy
from zkdv.verify.report import Report


@dataclasses.dataclass
class KeySource:
  """The challenge key of a dvbench transcript and where it came from, or why it is unknown."""

  key: bytes | None = None
  source: str | None = None  # "receipt" or "challenge key"
  missing: str = "no receipt/key"


@dataclasses.dataclass
class Verification:
  report: Report
  options: VerifierPolicy
  model: object = None  # structure.Transcript
  challenger: Challenger | None = None
  keys: KeySource = dataclasses.field(default_factory=KeySource)
  decisions: object = None  # decisions.Decisions
  programs: object = None  # programs.ProgramLoader
  blobs: object = None  # blobs.BlobReader
  # (last step, program number, end digest, device state) of the last verified segment
  # replay, which the next segment continues from when it starts there
  replayed_end: tuple | None = None
  data_order: object = None  # zkdv.data.Order of a transcript that declares its dataset
  data_leaves: dict = dataclasses.field(default_factory=dict)  # program -> order._data_leaves
