"""What a run page shows, read from a proof's stored records: its config and its metrics.

Every field comes from records the prover wrote (custody checked their encoding and
chain, the verifier the rest), so the pages escape and bound everything taken from here.
Step metrics are committed values (``zkdv.metrics``): numbers, ``"inf"``/``"-inf"``,
``"nan:HEX"`` or a digest.

Example::

  config = run_config(store, proof_id)            # root and program summaries
  series = metric_series(store, proof_id)          # {"steps": [...], "metrics": {...}}
  marks = step_marks(store, proof_id, series["steps"])  # of the steps the series lists
"""

import re

import cbor2
import sqlalchemy as sa

from dvbench.server.schema import records
from dvbench.server.store_custody import BODY
from zkdv import metrics

MAX_FIELD = 200  # characters of a prover-written string shown on a page
MAX_ENTRIES = 40  # entries of a prover-written map or list shown on a page
SERIES_LIMIT = 20_000  # steps per metrics response (the JSON route pages with ``start``)
# Metric names per metrics response, in the order steps first commit them: a program names
# at most metrics.MAX_METRICS, and a run's steps may name others in turn.
SERIES_NAMES = 2 * metrics.MAX_METRICS
_OPTIMIZER_FIELD = re.compile(r"\.opt_state(?:\[\d+\])*\.(\w+)")


def records_of_kind(proof_id: str, kind: str, start: int = 0, limit: int | None = None):
  """The query of a proof's records of ``kind`` in order (index ``records_kind``)."""
  query = (sa.select(*BODY).where((records.c.proof_id == proof_id)
                                   & (records.c.kind == kind))
           .order_by(records.c.position).offset(start))
  return query if limit is None else query.limit(limit)


def _records(store, proof_id: str, kind: str, start: int = 0, limit: int | None = None):
  query = records_of_kind(proof_id, kind, start, limit)
  with store.engine.connect() as conn:
    for body in conn.execute(query):
      record = cbor2.loads(store.body(proof_id, *body))
      if isinstance(record, dict):
        yield record


def _short(value) -> str:
  text = value if isinstance(value, str) else repr(value)
  return text if len(text) <= MAX_FIELD else text[:MAX_FIELD] + "…"


def _flat_map(value) -> list[tuple[str, str]]:
  """(key, value) pairs of a prover-written map, bounded, as short strings."""
  if not isinstance(value, dict):
    return []
  return [(_short(k), _short(v)) for k, v in list(value.items())[:MAX_ENTRIES]]


def _elements(layout: dict) -> int:
  count = 1
  for n in layout.get("shape", []) if isinstance(layout.get("shape"), list) else []:
    count *= n if isinstance(n, int) else 0
  return count


def _program_summary(record: dict) -> dict:
  state = [l for l in record.get("state_layout", []) if isinstance(l, dict)]
  params = {i for i in record.get("params_leaves", []) if isinstance(i, int)}
  optimizer = sorted({m.group(1) for l in state
                      if (m := _OPTIMIZER_FIELD.match(str(l.get("path", ""))))})
  batch = [l for l in record.get("batch_layout", []) if isinstance(l, dict)]
  return {
      "number": record.get("number"),
      "program_id": record["program_id"].hex() if isinstance(record.get("program_id"),
                                                               bytes) else None,
      "function": _short(record.get("function", "")),
      "mode": _short(record.get("mode", "")),
      "parameters": sum(_elements(l) for i, l in enumerate(state) if i in params),
      "state_leaves": len(state),
      "optimizer_state": [_short(f) for f in optimizer[:MAX_ENTRIES]],
      "batch": [f"{_short(l.get('path', ''))}: {_short(l.get('dtype', ''))}"
                f"{_short(l.get('shape', ''))}" for l in batch[:MAX_ENTRIES]],
      "static_arguments": [(_short(a[0]), _short(a[1])) for a in record.get(
          "static_arguments", [])[:MAX_ENTRIES] if isinstance(a, list) and len(a) == 2],
      "compiler_options": _flat_map(record.get("compiler_options")),
      "platforms": [_short(p) for p in record.get("platforms", [])[:MAX_ENTRIES]],
      "devices": record.get("nr_devices") if isinstance(record.get("nr_devices"), int) else None,
      "metrics": [_short(m[0]) for m in record.get("metric_outputs", [])[:metrics.MAX_METRICS]
                  if isinstance(m, list) and m],
  }


MAX_DECLARED = 200  # flattened entries of a declared run config shown


def flatten(value, prefix: str = "") -> list[tuple[str, str]]:
  """A declared run config as (dotted key, value text) pairs, bounded. Example:
  ``flatten({"opt": {"lr": 0.1}, "layers": [2, 3]})`` is
  ``[("opt.lr", "0.1"), ("layers", "[2, 3]")]``."""
  pairs, stack = [], [(prefix, value)]
  while stack and len(pairs) < MAX_DECLARED:
    key, item = stack.pop(0)
    if isinstance(item, dict) and item:
      stack[:0] = [(f"{key}.{k}" if key else str(k), v) for k, v in item.items()]
    else:
      pairs.append((_short(key), _short(item if isinstance(item, str) else repr(item))))
  return pairs


def run_config(store, proof_id: str) -> dict:
  """The run's configuration as its root and program records state it: what the prover
  declared (run name, tags, its own config) and what the verified program is."""
  root = next(_records(store, proof_id, "root"), {})
  challenger = root.get("challenger") if isinstance(root.get("challenger"), dict) else {}
  tags = root.get("tags") if isinstance(root.get("tags"), list) else []
  return {
      "run_name": _short(root.get("run_name", "")),
      "tags": [_short(t) for t in tags[:MAX_ENTRIES]],
      "declared": flatten(root.get("run_config")) if isinstance(root.get("run_config"),
                                                               dict) else [],
      "name": _short(root.get("name", "")),
      "platform": _short(root.get("platform", "")),
      "device_kinds": [_short(d) for d in root.get("device_kinds", [])[:MAX_ENTRIES]],
      "processes": root.get("processes", 1) if isinstance(root.get("processes", 1), int) else 1,
      "versions": _flat_map(root.get("versions")),
      "config": _flat_map(root.get("config")),
      "policy": _flat_map(challenger.get("policy")),
      "programs": [_program_summary(r) for r in _records(store, proof_id, "program")],
  }


def json_value(value):
  """A committed metric value as JSON carries it (a digest as hex)."""
  return value.hex() if isinstance(value, bytes) else value


def metric_series(store, proof_id: str, start: int = 0, limit: int = SERIES_LIMIT) -> dict:
  """Steps ``start`` .. ``start + limit`` of the proof's committed metrics.

  ``{"start", "steps": [step...], "metrics": {name: [value per listed step, None where
  that step did not commit it]}, "more_names": whether steps committed names past the
  first ``SERIES_NAMES``, which are not listed, "next": the next start or None}``.
  """
  steps, values, more = [], {}, False
  for record in _records(store, proof_id, "step", start, limit + 1):
    if len(steps) == limit:
      return {"start": start, "steps": steps, "metrics": values,
              "more_names": more, "next": record.get("index")}
    committed = record.get("metrics") if isinstance(record.get("metrics"), dict) else {}
    for name in committed:
      if name not in values:
        if len(values) < SERIES_NAMES:
          values[name] = [None] * len(steps)
        else:
          more = True
    for name, column in values.items():
      column.append(json_value(committed.get(name)))
    steps.append(record.get("index"))
  return {"start": start, "steps": steps, "metrics": values, "more_names": more, "next": None}


def scalar_curves(series: dict) -> dict[str, list[tuple[int, float]]]:
  """name -> [(step, number)] of the metrics that have a number at some step."""
  curves = {}
  for name, column in series["metrics"].items():
    points = [(s, metrics.as_float(v)) for s, v in zip(series["steps"], column)
              if isinstance(v, (int, float, str)) and metrics.as_float(v) is not None]
    if points:
      curves[name] = points
  return curves


def step_marks(store, proof_id: str, steps: list[int]) -> dict[int, str]:
  """step -> "verified", "failed" or "challenged" for those of ``steps`` (a series' steps)
  with an update check: replayed by the server (and how it came out) or chosen and not
  replayed yet; and "discarded" for those a resume discarded (they ran after the last
  committed state, and the run went on from that state instead). Read for the steps' range
  only (``Store.update_marks``, ``Store.discarded_in``)."""
  if not steps:
    return {}
  first, last = min(steps), max(steps)
  return {**store.update_marks(proof_id, first, last),
          **dict.fromkeys(store.discarded_in(proof_id, first, last), "discarded")}
