"""The one definition of the rules across a program record's fields (and an init's).

``zkdv.records`` types and bounds each field on its own; the rules here relate them: the
leaf layouts parse, the post-state is laid out as the state, the inputs and outputs match
the layouts, metric outputs are distinct. ``zkdv.records.check_record`` applies them, so
the server refuses at upload (``dvbench.server.custody``) the program record the verifier
refuses (``zkdv.verify.structure``), with the same message naming the field and the rule,
e.g. ``record 2 (program).inputs: one "state" per state leaf and one "batch" per batch
leaf (2 and 1), got 3 inputs.``

Example::

  layouts = check_program(record, "record 2 (program)")   # raises fields.Invalid
  layouts.state[0].shape, layouts.metric_outputs          # {"loss": 3}
"""

import dataclasses
from collections.abc import Callable

from zkdv import digest
from zkdv import metrics
from zkdv.fields import Invalid, describe

MAX_LEAF_ELEMENTS = 1 << 40  # a layout larger than this is malformed, not allocated
_MAX_ERROR = 200  # characters of a parser's message quoted in a refusal
MAX_EMPTY_ROWS = 1 << 16  # leading-axis rows of a batch leaf whose rows hold no bytes


@dataclasses.dataclass(frozen=True)
class ProgramLayouts:
  """A program record's parsed layouts and metric outputs (name -> output index)."""

  state: tuple
  post: tuple  # as the program writes the state (by default as it reads it)
  batch: tuple
  metric_outputs: dict


def parse_layouts(value: list, where: str) -> tuple:
  """``LeafLayout``s of a list of layout records (``zkdv.records.LAYOUTS``); raises
  ``Invalid`` naming the leaf whose layout does not parse, has an unknown dtype or a
  shape past ``MAX_LEAF_ELEMENTS``.

  Example: ``parse_layouts([{"path": "w", "dtype": "float32", "shape": [2]}], "x")``.
  """
  layouts = []
  for n, leaf in enumerate(value):
    at = f"{where}[{n}]"
    try:
      layout = digest.LeafLayout.from_record(leaf)
      if not (isinstance(layout.path, str) and isinstance(layout.dtype, str)):
        raise TypeError(f"path and dtype are {describe(layout.path)} and "
                        f"{describe(layout.dtype)}, not text")
      digest.numpy_dtype(layout.dtype)
    except KeyError as e:
      raise Invalid(f"{at}: a leaf layout, whose field {str(e)[:_MAX_ERROR]} is missing.") from None
    except (TypeError, ValueError, AttributeError) as e:
      raise Invalid(f"{at}: a leaf layout (a text path, a known dtype, a shape): "
                    f"{str(e)[:_MAX_ERROR].rstrip('.')}.") from None
    if not all(isinstance(n, int) and 0 <= n < MAX_LEAF_ELEMENTS for n in layout.shape):
      raise Invalid(f"{at}.shape: non-negative integers below 2**40, got "
                    f"{str(list(layout.shape))[:_MAX_ERROR]}.")
    elements = 1
    for size in layout.shape:
      elements *= size
    if elements >= MAX_LEAF_ELEMENTS:
      raise Invalid(f"{at}.shape: fewer than 2**40 elements ({layout.path[:_MAX_ERROR]}).")
    try:
      digest.check_pieces(layout)
    except (TypeError, ValueError) as e:
      raise Invalid(f"{at}.pieces: shard boxes that tile the leaf: "
                    f"{str(e)[:_MAX_ERROR]}.") from None
    layouts.append(layout)
  return tuple(layouts)


def _row_groups_only_in_batches(record, layouts: ProgramLayouts):
  for field, leaves in (("state_layout", layouts.state), ("post_state_layout", layouts.post)):
    grouped = [l.path[:_MAX_ERROR] for l in leaves if l.row_group != 1]
    if grouped:
      return field, f"row_group is a field of batch layouts only, got it on {grouped[:4]}"
  return None


def _batch_row_groups(record, layouts: ProgramLayouts):
  multi = isinstance(record.get("processes"), int) and record["processes"] > 1
  for n, layout in enumerate(layouts.batch):
    try:
      digest.check_row_group(layout, multi)
    except ValueError as e:
      return f"batch_layout[{n}]", str(e)[:2 * _MAX_ERROR]
  return None


def _few_empty_batch_rows(record, layouts: ProgramLayouts):
  # Rows of no bytes cost nothing to send, yet each is a Merkle leaf to hash.
  for n, layout in enumerate(layouts.batch):
    if layout.logical_ndim >= 1 and layout.shape[0] > MAX_EMPTY_ROWS and not layout.nbytes:
      return f"batch_layout[{n}]", (f"at most {MAX_EMPTY_ROWS} rows where rows hold no "
                                    f"bytes; {layout.path[:_MAX_ERROR]} has "
                                    f"{layout.shape[0]}, which commit nothing")
  return None


def _post_state_as_state(record, layouts: ProgramLayouts):
  # A leaf may leave in another dtype (as jax.jit returns it); its path and shape stay.
  if [(l.path, l.shape, l.key_impl) for l in layouts.post] != [
      (l.path, l.shape, l.key_impl) for l in layouts.state]:
    return "post_state_layout", ("the leaves of state_layout (each one's path, shape and "
                                 "key; its dtype may differ)")
  return None


def _inputs_match_layouts(record, layouts: ProgramLayouts):
  state, batch = len(layouts.state), len(layouts.batch)
  if sorted(record["inputs"]) != sorted(["state"] * state + ["batch"] * batch):
    return "inputs", ('one "state" per state leaf and one "batch" per batch leaf '
                      f"({state} and {batch}), got {len(record['inputs'])} inputs")
  return None


def _params_are_state_leaves(record, layouts: ProgramLayouts):
  leaves = len(layouts.state)
  if not all(i < leaves for i in record.get("params_leaves", [])):
    return "params_leaves", f"indices of state leaves (below {leaves})"
  return None


def _train_state_params_are_params(record, layouts: ProgramLayouts):
  # A leaf left out of params_leaves is left out of the program claim's test.
  declared = set(record.get("params_leaves", []))
  left_out = [l.path[:80] for i, l in enumerate(layouts.state)
              if i not in declared and digest.is_params_path(l.path)]
  if left_out:
    return "params_leaves", (f"every leaf of a TrainState's {digest.PARAMS_PREFIX}, without "
                             f"{left_out[:4]}")
  return None


def _an_output_per_state_leaf(record, layouts: ProgramLayouts):
  if len(record["post_state_outputs"]) != len(layouts.state):
    return "post_state_outputs", (f"one output index per state leaf ({len(layouts.state)}), "
                                  f"got {len(record['post_state_outputs'])}")
  return None


def _distinct_metric_outputs(record, layouts: ProgramLayouts):
  names, outputs = set(), set(record["post_state_outputs"])
  for name, output in record.get("metric_outputs", []):
    if not metrics.valid_name(name):
      return "metric_outputs", f"metric names as zkdv.metrics names them, got {name[:80]!r}"
    if name in names or output in outputs:
      return "metric_outputs", (f"distinct names and outputs beside the post-state: "
                                f"{name[:80]!r} repeats a name or an output")
    names.add(name)
    outputs.add(output)
  return None


# Each rule: (record, its layouts) -> None, or (the field it names, what the field must be).
PROGRAM_RULES: dict[str, Callable] = {
    "row groups only in batches": _row_groups_only_in_batches,
    "batch row groups": _batch_row_groups,
    "few empty batch rows": _few_empty_batch_rows,
    "post-state laid out as the state": _post_state_as_state,
    "inputs match the layouts": _inputs_match_layouts,
    "params are state leaves": _params_are_state_leaves,
    "a TrainState's params are params": _train_state_params_are_params,
    "an output per state leaf": _an_output_per_state_leaf,
    "distinct metric outputs": _distinct_metric_outputs,
}


def check_program(record: dict, where: str) -> ProgramLayouts:
  """The layouts of a program record whose fields each match ``zkdv.records``; raises
  ``Invalid`` naming the field of the first rule (``PROGRAM_RULES``) it breaks."""
  state = parse_layouts(record["state_layout"], f"{where}.state_layout")
  post = (parse_layouts(record["post_state_layout"], f"{where}.post_state_layout")
          if "post_state_layout" in record else state)
  batch = parse_layouts(record["batch_layout"], f"{where}.batch_layout")
  layouts = ProgramLayouts(state, post, batch, {})
  for rule in PROGRAM_RULES.values():
    broken = rule(record, layouts)
    if broken is not None:
      field, must = broken
      raise Invalid(f"{where}.{field}: {must}.")
  return dataclasses.replace(layouts, metric_outputs={
      name: output for name, output in record.get("metric_outputs", [])})


def check_init(record: dict, where: str) -> tuple[tuple, tuple]:
  """The input and base checkpoint layouts of an init record whose fields each match
  ``zkdv.records``; raises ``Invalid`` unless they parse and its blobs and outputs match
  its layouts."""
  inputs = parse_layouts(record["input_layout"], f"{where}.input_layout")
  base = parse_layouts(record.get("base_layout", []), f"{where}.base_layout")
  if len(record["input_blobs"]) != len(inputs):
    raise Invalid(f"{where}.input_blobs: one blob per input leaf ({len(inputs)}), got "
                  f"{len(record['input_blobs'])}.")
  if len(record["outputs"]) != len(record["output_layout"]):
    raise Invalid(f"{where}.outputs: one digest per output leaf "
                  f"({len(record['output_layout'])}), got {len(record['outputs'])}.")
  return inputs, base
