"""The data order: each step's rows are the next batch of the seeded order, each opened
row is the declared dataset's row at its index (``zkdv.data``).

A ``data`` record (before any step) declares the dataset's Merkle root, rows, leaf layouts
and batch size. Then every step ``t`` commits ``data_rows``, which must be batch ``t`` (less
the steps a resume discarded before it) of the order the proof's key seed gives
(``check_order``: every step, cheap), and every row a probe opens, or an update check opens
under full replay, must prove itself in the dataset tree at the index its step committed
(``probed_rows_in_dataset``, ``opened_rows_in_dataset``).

Example::

  check_order(ctx)                      # findings "data_order" name the step and row
  probed_rows_in_dataset(ctx, step, program, entries, check.fields, "record 12")
"""

import numpy as np

from zkdv import data
from zkdv import digest
from zkdv import merkle
from zkdv.verify import start
from zkdv.verify.context import Verification

ORDER_CODES = ("data_order", "data_row")


def read_data(model, parsed, where: str, report) -> None:
  """The ``data`` record: once, before any step."""
  if model.data is not None or model.steps:
    report.fail("data_order", where, "a data record comes once, before any step.")
    return
  model.data = data.Declaration.from_record(parsed.record)  # checked by records.check_data


def seeded_by(ctx: Verification) -> str:
  """Who seeded the order: "server-seeded" (the slot's nonce) or "self-seeded"."""
  return "server-seeded" if ctx.challenger.kind == "dvbench" else "self-seeded"


def _order(ctx: Verification) -> data.Order:
  if ctx.data_order is None:
    ctx.data_order = data.Order(start.key_seed(ctx), ctx.model.data)
  return ctx.data_order


def _committed_rows(step, declared) -> np.ndarray | None:
  rows = step.data_rows
  if not isinstance(rows, bytes) or len(rows) != data.INDEX_BYTES * declared.batch_size:
    return None
  return data.unpack_rows(rows)


def check_order(ctx: Verification) -> None:
  """Every step's ``data_rows`` are batch ``t`` of the seeded order (a finding names the
  step and its first row that is not), and every program a step runs takes the dataset's
  leaves as its batch (``_data_leaves``: a batch of PRNG keys alone would commit indices of
  rows it never reads); none without a data record."""
  model, report = ctx.model, ctx.report
  declared = model.data
  if declared is None:
    stray = next((s for s in model.steps if s.data_rows is not None), None)
    if stray is not None:
      report.fail("data_order", stray.where, f"step {stray.index} commits data_rows, but no "
                  "data record declares the dataset they index.")
    return
  order, discarded = _order(ctx), 0
  for step in model.steps:
    program = model.programs.get(step.program)
    if program is not None:  # its batch is the dataset's (checked once per program)
      _data_leaves(ctx, program, step.where)
    number = step.index - discarded  # a step a resume discarded trained no batch that counts
    discarded += model.discarded(step.index)
    got = _committed_rows(step, declared)
    if got is None:
      report.fail("data_order", step.where, f"step {step.index} commits no rows of the "
                  f"declared dataset (data_rows: {declared.batch_size} indices): every step "
                  "of a transcript that declares one draws the next batch of its order.")
      continue
    want = order.batch(number)
    if np.array_equal(got, want):
      continue
    row = int(np.flatnonzero(got != want)[0])
    known = next((f" (it is batch {n} of the order: {what})" for n, what in (
        (number - 1, "the batch before, repeated"), (number + 1, "the next one, "
                                                     "out of order"))
                  if n >= 0 and np.array_equal(got, order.batch(n))), "")
    report.fail("data_order", step.where, f"step {step.index}: row {row} of its batch is "
                f"dataset row {got[row]}, but batch {number} of the {seeded_by(ctx)} "
                f"order holds row {want[row]} there{known}.")


def _data_leaves(ctx: Verification, program, where: str) -> list | None:
  """Per batch leaf, the dataset leaf it holds (``zkdv.data.batch_leaves``); None when the
  program's batch is not the declared dataset's, with a finding the first time."""
  if program.number not in ctx.data_leaves:
    try:
      ctx.data_leaves[program.number] = data.batch_leaves(program.batch, ctx.model.data)
    except ValueError as e:
      ctx.data_leaves[program.number] = None
      ctx.report.fail("data_order", where, f"program {program.number}: {e}.")
  return ctx.data_leaves[program.number]


def _row_in_dataset(ctx: Verification, step, layout, held, row: int, index, row_leaf,
                    path, where: str) -> bool:
  declared = ctx.model.data
  if data.row_in_dataset(row_leaf, declared, held, int(index), path):
    ctx.report.dataset_rows += 1
    return True
  ctx.report.fail("data_row", where, f"step {step.index}: row {row} of batch leaf "
                  f"{layout.path} is not row {index} of dataset leaf {held} (root "
                  f"{declared.root.hex()[:16]}…), the index its step committed: its audit "
                  "path does not lead to the declared root.")
  return False


def probed_rows_in_dataset(ctx: Verification, step, program, entries, fields,
                           where: str) -> bool:
  """Whether every probed row is the declared dataset's row at its committed index (True
  when no dataset is declared); a finding names the first that is not."""
  declared, paths = ctx.model.data, fields.get("data_paths")
  if declared is None:
    if paths is not None:
      ctx.report.fail("data_row", where, "the probes carry dataset paths, but no data record "
                      "declares a dataset.")
    return paths is None
  rows, mapping = _committed_rows(step, declared), _data_leaves(ctx, program, where)
  if rows is None or mapping is None:
    return False  # check_order or _data_leaves named it
  if not isinstance(paths, list) or len(paths) != len(entries):
    ctx.report.fail("data_row", where, f"the probes of step {step.index} carry no dataset "
                    "audit path per probe (data_paths).")
    return False
  for (leaf, row, opened, _), entry_paths in zip(entries, paths):
    layout = program.batch[leaf]
    group = layout.row_group
    if not isinstance(entry_paths, list) or len(entry_paths) != group:
      ctx.report.fail("data_row", where, f"probe of row {row} of {layout.path}: one dataset "
                      f"audit path per data row ({group}) expected.")
      return False
    for j, path in enumerate(entry_paths):  # one per row: _entry_ok and _row_proven held
      row_leaf = opened.row_leaf(j)
      at = row * group + j
      if mapping[leaf] is None or not 0 <= at < len(rows):
        ctx.report.fail("data_row", where, f"probe of row {row} of {layout.path}: not a row "
                        "of a dataset leaf of the batch.")
        return False
      if not _row_in_dataset(ctx, step, layout, mapping[leaf], at, rows[at], row_leaf,
                             path, where):
        return False
  return True


def opened_rows_in_dataset(ctx: Verification, step, program, batch, paths,
                           where: str) -> bool:
  """Whether every row of step ``step``'s opened batch (whole leaves, as an update check
  opens them) is the declared dataset's row at its committed index. ``paths``: per data
  leaf, per row, its audit path (an update check's ``data_paths`` for that step). True
  when no dataset is declared; a full-replay proof must carry the paths."""
  declared = ctx.model.data
  if declared is None:
    if paths is not None:
      ctx.report.fail("data_row", where, f"the update check of step {step.index} carries "
                      "dataset paths, but no data record declares a dataset.")
    return paths is None
  if paths is None:
    if ctx.challenger.policy.full_replay:
      ctx.report.fail("data_row", where, f"the update check of step {step.index} carries no "
                      "dataset audit paths (data_paths): under full replay every row is "
                      "checked against the dataset.")
      return False
    return True
  rows, mapping = _committed_rows(step, declared), _data_leaves(ctx, program, where)
  if rows is None or mapping is None:
    return False
  held = [(leaf, m) for leaf, m in enumerate(mapping) if m is not None]
  if not isinstance(paths, list) or len(paths) != len(held) or not all(
      isinstance(p, list) and len(p) == declared.batch_size for p in paths):
    ctx.report.fail("data_row", where, f"the update check's data_paths for step {step.index} "
                    f"are not one path per row ({declared.batch_size}) of each data leaf.")
    return False
  for (leaf, m), leaf_paths in zip(held, paths):
    layout = program.batch[leaf]
    array = digest.byte_view(np.asarray(batch[leaf])).reshape(declared.batch_size, -1)
    for row, path in enumerate(leaf_paths):
      if not _row_in_dataset(ctx, step, layout, m, row, rows[row],
                             merkle.leaf_hash(array[row].tobytes()), path,
                             where):
        return False
  return True
