"""Data probes: the rows a challenge selects, each proven in its leaf's row tree.

A probe check record carries the batch's row roots (which must make up the
step's batch digest) and, per probed Merkle row, ``[leaf, row, g, bytes, merkle proof]``
(``zkdv.merkle``), ``bytes`` inline: a Merkle row of a leaf with ``row_group`` g is g
leading-axis rows, opened as their bytes joined (``zkdv.records.probe_entry``); the
verifier keeps their hashes, not their bytes, once it has read them (``kept``). The
rows must be exactly those ``Decision.probe_rows`` selects; the count is compared before
any row is drawn, so hostile sizes cost nothing.

Example::

  outcome = probe_check(ctx, check, step, program, "record 12")
"""

import dataclasses

from zkdv import digest
from zkdv import merkle
from zkdv import records
from zkdv.verify import order
from zkdv.verify.context import Verification
from zkdv.verify.report import CheckOutcome


@dataclasses.dataclass(frozen=True)
class OpenedRows:
  """A probe entry's Merkle row as the verifier keeps it once read (``kept``): its size
  and leaf hashes, not its bytes, which a long run's transcript may hold more of than
  memory."""

  rows: int  # the leading-axis rows it says it joins
  nbytes: int
  merkle_leaf: bytes  # merkle.leaf_hash of the Merkle row
  # merkle.leaf_hash of each row, where a dataset is declared and the entry is shaped as
  # its leaf (rows of no bytes: none, each is EMPTY_ROW_LEAF)
  row_leaves: tuple[bytes, ...]

  def row_leaf(self, j: int) -> bytes:
    return self.row_leaves[j] if self.nbytes else EMPTY_ROW_LEAF


EMPTY_ROW_LEAF = merkle.leaf_hash(b"")


def kept(record: dict, layouts, dataset: bool) -> dict:
  """A probe check record (checked against ``zkdv.records``) with each entry's inline
  bytes replaced by their ``OpenedRows``; ``layouts``: the step's batch layouts;
  ``dataset``: a data record declares the dataset the rows are checked against. An
  entry's rows are hashed one by one only where it is shaped as its leaf (``_shaped``),
  so a count its bytes do not carry costs nothing."""
  entries = []
  for entry in record["probes"]:
    leaf, row, count, _, proof = entry
    data = records.probed_bytes(entry)
    opened = OpenedRows(count, len(data), merkle.leaf_hash(data), ())
    if dataset and data and leaf < len(layouts) and _shaped(opened, layouts[leaf]):
      opened = dataclasses.replace(opened, row_leaves=tuple(
          merkle.leaf_hash(r) for r in records.probed_rows(entry)))
    entries.append([leaf, row, opened, proof])
  return {**record, "probes": entries}


def _row_width(layout) -> int:
  return layout.nbytes // max(layout.rows, 1) // layout.row_group


def _shaped(opened: OpenedRows, layout) -> bool:
  """Whether an entry opens ``layout``'s ``row_group`` rows of its row width."""
  return (opened.rows == layout.row_group
          and opened.nbytes == _row_width(layout) * opened.rows)


def _entry_ok(entry, layouts) -> bool:
  """Whether a probe entry (``kept``) names a Merkle row of a batch leaf and opens as many
  leading-axis rows as the leaf groups in one."""
  leaf, row, opened, _ = entry
  return (leaf < len(layouts) and row < layouts[leaf].rows
          and opened.rows == layouts[leaf].row_group)


def _row_proven(ctx, entry, layout, root, where) -> bool:
  leaf, row, opened, proof = entry
  if not _shaped(opened, layout):
    ctx.report.fail("probe", where, f"probe of row {row} of {layout.path}: its data rows "
                    f"are {opened.nbytes // opened.rows} bytes, the leaf's rows are "
                    f"{_row_width(layout)}.")
    return False
  if not merkle.verify_inclusion(opened.merkle_leaf, row, layout.rows, proof, root):
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
    count = decision.leaf_probe_count(layout)
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
    ctx.report.probed_rows += sum(records.counted_rows(e[2].rows, e[2].nbytes) for e in entries)
    if order.probed_rows_in_dataset(ctx, step, program, entries, fields, where):
      outcome.status = "verified"
  return outcome
