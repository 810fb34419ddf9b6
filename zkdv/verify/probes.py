"""Data probes: the rows a challenge selects, each proven in its leaf's row tree.

A probe check record carries the batch's row roots (which must make up the
step's batch digest) and, per probed row, ``[leaf, row, blob, merkle proof]``
(RFC 9162). A Merkle row of a leaf with ``row_group`` g > 1 is g
leading-axis rows, opened as a list of g blobs, one per row. The rows must be
exactly those ``Decision.probe_rows`` selects; the count is compared before any
row is drawn, so hostile sizes cost nothing.

Example::

  outcome = probe_check(ctx, check, step, program, "record 12")
"""

from zkdv import digest
from zkdv import errors
from zkdv import merkle
from zkdv import transcript
from zkdv.verify import order
from zkdv.verify.context import Verification
from zkdv.verify.decisions import probe_count
from zkdv.verify.report import UNVERIFIABLE, CheckOutcome

MAX_PROOF_LENGTH = 64  # a row tree of up to 2**64 rows


def _entry_ok(entry, layouts) -> bool:
  return (isinstance(entry, list) and len(entry) == 4
          and all(isinstance(x, int) and not isinstance(x, bool) for x in entry[:2])
          and 0 <= entry[0] < len(layouts) and 0 <= entry[1] < layouts[entry[0]].rows
          and _blobs_ok(entry[2], layouts[entry[0]].row_group) and isinstance(entry[3], list)
          and len(entry[3]) <= MAX_PROOF_LENGTH
          and all(isinstance(p, bytes) for p in entry[3]))


def _blobs_ok(blobs, row_group: int) -> bool:
  """One blob for a single row; a list of one blob per row for a group."""
  if row_group == 1:
    return isinstance(blobs, bytes)
  return (isinstance(blobs, list) and len(blobs) == row_group
          and all(isinstance(b, bytes) for b in blobs))


def _row_proven(ctx, entry, layout, root, where) -> bool:
  leaf, row, blobs, proof = entry
  blobs = [blobs] if layout.row_group == 1 else blobs
  width = layout.nbytes // max(layout.rows, 1) // layout.row_group
  try:
    data = b"".join(transcript.read_blob(ctx.model.folder, b, "uint8", (width,)).tobytes()
                    for b in blobs)
  except FileNotFoundError:
    ctx.report.fail("probe", where, f"probe blob of row {row} of {layout.path} is missing.",
                    UNVERIFIABLE)
    return False
  except (OSError, errors.TranscriptFormatError, TypeError, ValueError) as e:
    ctx.report.fail("probe", where, f"probe of row {row} of {layout.path}: {e}")
    return False
  if not merkle.verify_inclusion(merkle.leaf_hash(data), row, layout.rows, proof, root):
    ctx.report.fail("probe", where, f"probe of row {row} of {layout.path} (leaf {leaf}) is "
                    "not in the committed batch (its Merkle proof fails).")
    return False
  return True


def _rows_chosen(ctx, step, layouts, opened, where) -> bool:
  """Whether ``opened`` (leaf -> rows) is exactly what the challenge selects."""
  if not ctx.decisions.known:
    return True
  decision = ctx.decisions.by_step[step.index]
  for leaf, layout in enumerate(layouts):
    rows = sorted(opened.get(leaf, []))
    count = probe_count(layout, decision.probe_ratio)
    if len(rows) != count or rows != decision.leaf_probe_rows(leaf, layout):
      ctx.report.fail("probe", where, f"opened rows {rows[:16]} of {layout.path}, but the "
                      f"challenge selects {count} rows"
                      f"{'' if len(rows) != count else ' (others)'}.")
      return False
  return True


def probe_check(ctx: Verification, check, step, program, where: str) -> CheckOutcome:
  layouts, fields = program.batch, check.fields
  roots, entries = fields["batch_roots"], fields["probes"]
  outcome = CheckOutcome(step.index, "probe", "merkle", "failed")
  if (len(roots) != len(layouts) or not all(isinstance(r, bytes) for r in roots)
      or digest.batch_digest(layouts, roots) != step.batch):
    ctx.report.fail("probe", where, "batch_roots do not make up the batch digest.")
    return outcome
  opened = {}
  for entry in entries:
    if not _entry_ok(entry, layouts):
      ctx.report.fail("probe", where, f"malformed probe entry {entry!r:.80}.")
      return outcome
    if entry[1] in opened.setdefault(entry[0], set()):
      ctx.report.fail("probe", where, f"row {entry[1]} of leaf {entry[0]} is opened twice.")
      return outcome
    opened[entry[0]].add(entry[1])
  if not _rows_chosen(ctx, step, layouts, opened, where):
    return outcome
  if all([_row_proven(ctx, e, layouts[e[0]], roots[e[0]], where) for e in entries]):
    ctx.report.probed_rows += sum(layouts[e[0]].row_group for e in entries)  # data rows
    if order.probed_rows_in_dataset(ctx, step, program, entries, fields, where):
      outcome.status = "verified"
  return outcome
