"""What a benchmark request carries, parsed and checked: a definition, a submission.

A registered definition and a submission are deterministic CBOR maps of fixed fields, each
strictly typed and bounded; a refusal is a 400 naming the field (``bad``). A submission
carries only a proof and its checkpoint: the server runs the benchmark's program on its
rows, so a field naming outputs, values, programs or rows is refused by name.

Example::

  spec = parse_definition(body)      # {"metric": ..., "params_layout": [LeafLayout], ...}
  submission = parse_submission(body)
  bench = benchmark_or_404(store, request)
"""

import re
import sys

from starlette.exceptions import HTTPException

from dvbench import scoring
from dvbench.server import pins
from dvbench.server.decoding import decode
from dvbench.server.service import HEX_ID, NAME, check_name
from zkdv import digest

_DEFINITION = {"type", "metric", "higher_is_better", "aggregate", "batch_rows", "program",
               "params_layout", "data_layout", "data_blobs", "min_update_check_probability",
               "allowed_programs", "public_rows"}
# absent from definitions registered before them
_DEFINITION_ADDED = {"audit", "training_set", "reference_params", *pins.FIELDS}
_SUBMISSION = {"type", "proof_id", "params_layout", "params_blobs", "training_proofs"}
# The audit levels a benchmark may require; each names the check of a submitted proof in
# ``routes_submissions.SubmissionRoutes``. "full-replay": the server's workers re-executed
# every step of the proof from its attested start (docs/protocol.md).
AUDITS = ("min-probability", "full-replay")
_MAX_LEAVES, _MAX_RANK, _MAX_DIM = 4096, 8, 1 << 31
_MAX_PROOF_LENGTH = 64  # a training set of up to 2**64 rows


def benchmark_or_404(store, request) -> dict:
  """The stored benchmark the path names (``{owner}/{name}``); 404 when unknown."""
  full = check_name(request.path_params["owner"], request.path_params["name"])
  bench = store.benchmark(full)
  if bench is None:
    raise HTTPException(404, f"unknown benchmark '{full}'.")
  return bench


def bad(what: str, rule: str) -> HTTPException:
  """A 400 naming the field ``what`` and the rule it breaks."""
  return HTTPException(400, f"{what}: {rule}")


def _digest(value, what: str) -> bytes:
  if not (isinstance(value, bytes) and len(value) == 32):
    raise bad(what, "a 32-byte digest.")
  return value


def _digests(value, what: str) -> list[bytes]:
  if not isinstance(value, list) or len(value) > _MAX_LEAVES:
    raise bad(what, f"a list of at most {_MAX_LEAVES} 32-byte digests.")
  return [_digest(v, what) for v in value]


def _known_dtype(name: str) -> bool:
  """A numeric numpy dtype or one of ml_dtypes' (bfloat16, fp8, int4), e.g. "float32"."""
  if not re.fullmatch(r"[a-z][a-z0-9_]{0,19}", name):
    return False
  try:
    dtype = digest.numpy_dtype(name)
  except (TypeError, ValueError):
    return False
  return dtype.itemsize > 0 and (dtype.kind in "biuf" or isinstance(
      getattr(sys.modules.get("ml_dtypes"), name, None), type))  # numpy_dtype imported it


def _layouts(value, what: str) -> list[digest.LeafLayout]:
  """Leaf layouts ``{"path", "dtype", "shape"}`` (no keys, no pieces), strictly checked."""
  if not isinstance(value, list) or not 0 < len(value) <= _MAX_LEAVES:
    raise bad(what, f"a list of 1 to {_MAX_LEAVES} leaf layouts.")
  layouts = []
  for leaf in value:
    ok = (isinstance(leaf, dict) and set(leaf) == {"path", "dtype", "shape"}
          and isinstance(leaf["path"], str) and len(leaf["path"]) <= 400
          and isinstance(leaf["dtype"], str) and isinstance(leaf["shape"], list)
          and len(leaf["shape"]) <= _MAX_RANK
          and all(type(n) is int and 0 <= n < _MAX_DIM for n in leaf["shape"]))
    if not (ok and _known_dtype(leaf["dtype"])):
      raise bad(what, "each leaf is {\"path\": str, \"dtype\": a numpy dtype name, \"shape\": "
                 f"[up to {_MAX_RANK} non-negative ints]}}.")
    layouts.append(digest.LeafLayout.from_record(leaf))
  return layouts


def parse_definition(body: bytes) -> dict:
  """The registered benchmark's fields; 400 naming the first wrong one."""
  record = decode(body, "the benchmark", canonical=True)
  if not (isinstance(record, dict) and _DEFINITION <= set(record)
          <= _DEFINITION | _DEFINITION_ADDED and record["type"] == "benchmark"):
    raise HTTPException(400, "a benchmark has exactly the fields "
                        f"{sorted(_DEFINITION | _DEFINITION_ADDED)} (see dvbench.benchmark).")
  audit = record.get("audit", "min-probability")
  if audit not in AUDITS:
    raise bad("audit", f"one of {list(AUDITS)}, got {str(audit)[:40]!r}.")
  if not (isinstance(record["metric"], str) and NAME.fullmatch(record["metric"])):
    raise bad("metric", "1-100 letters, digits, '.', '_' or '-'.")
  if not isinstance(record["higher_is_better"], bool) or not isinstance(
      record["public_rows"], bool):
    raise bad("higher_is_better and public_rows", "booleans.")
  if record["aggregate"] not in scoring.AGGREGATES:
    raise bad("aggregate", f"one of {list(scoring.AGGREGATES)} (computed by the server).")
  p = record["min_update_check_probability"]
  if not (isinstance(p, float) and 0 < p <= 1):
    raise bad("min_update_check_probability", "a float in (0, 1].")
  data_layouts = _layouts(record["data_layout"], "data_layout")
  count = data_layouts[0].shape[0] if data_layouts[0].shape else 0
  if count == 0 or any(not l.shape or l.shape[0] != count for l in data_layouts):
    raise bad("data_layout", "every leaf has the same positive number of rows (leading axis).")
  rows = record["batch_rows"]
  if type(rows) is not int or not 0 < rows <= count:
    raise bad("batch_rows", f"an int in [1, {count}] (the rows of one evaluation call).")
  allowed = record["allowed_programs"]
  params_layout = _layouts(record["params_layout"], "params_layout")
  reference = record.get("reference_params")
  if reference is not None:
    reference = _digests(reference, "reference_params")
    if len(reference) != len(params_layout):
      raise bad("reference_params", "null or one blob per params_layout leaf (the owner's "
                 "params, on which the program is checked numerically).")
  return {"metric": record["metric"], "higher_is_better": record["higher_is_better"],
          "aggregate": record["aggregate"], "public_rows": record["public_rows"],
          "audit": audit, "training_set": _training_set(record.get("training_set")),
          "min_update_check_probability": p, "batch_rows": rows, "rows": count,
          "program": _digest(record["program"], "program"),
          "params_layout": params_layout, "reference_params": reference,
          "data_layout": data_layouts,
          "data_blobs": _digests(record["data_blobs"], "data_blobs"),
          "allowed_programs": None if allowed is None else _digests(allowed, "allowed_programs"),
          **pins.parse(record)}


def _training_set(value) -> dict | None:
  """``{"root": 32 bytes, "size": rows}`` of a registered training set, or None."""
  if value is None:
    return None
  if not (isinstance(value, dict) and set(value) == {"root", "size"}
          and type(value["size"]) is int and 0 < value["size"] < 1 << _MAX_PROOF_LENGTH):
    raise bad("training_set", "null or {\"root\": its Merkle root, \"size\": its rows} "
               "(dvbench.benchmark.TrainingSet).")
  return {"root": _digest(value["root"], "training_set root"), "size": value["size"]}


def _training_proofs(value) -> list[tuple[bytes, int, list[bytes]]]:
  """``[row bytes, index, audit path]`` entries, strictly typed."""
  if not isinstance(value, list) or len(value) > 1 << 16:
    raise bad("training_proofs", "a list of at most 65536 [row bytes, index, path].")
  entries = []
  for entry in value:
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], bytes)
            and type(entry[1]) is int and isinstance(entry[2], list)
            and len(entry[2]) <= _MAX_PROOF_LENGTH):
      raise bad("training_proofs", "each entry is [row bytes, index, [up to "
                 f"{_MAX_PROOF_LENGTH} 32-byte hashes]].")
    entries.append((entry[0], entry[1],
                     [_digest(h, "training_proofs path") for h in entry[2]]))
  return entries


def parse_submission(body: bytes) -> dict:
  """A submission's proof, checkpoint and membership proofs; 400 naming the fields it has
  that a submission does not (``value``, ``outputs``, ``evaluate``...), or lacks."""
  record = decode(body, "the submission", canonical=True)
  if not isinstance(record, dict) or record.get("type") != "submission":
    raise bad("type", 'a submission is a map whose "type" is "submission".')
  extra = sorted(str(k)[:40] for k in set(record) - _SUBMISSION)
  if extra:
    raise HTTPException(400, f"a submission has exactly the fields {sorted(_SUBMISSION)}, "
                        f"not {extra[:8]}: the server runs the benchmark's program on its "
                        "rows, so a submitter sends no outputs, values, programs or rows.")
  missing = sorted(_SUBMISSION - set(record))
  if missing:
    raise HTTPException(400, f"a submission has exactly the fields {sorted(_SUBMISSION)}; "
                        f"{missing} are missing.")
  if not (isinstance(record["proof_id"], str) and HEX_ID.fullmatch(record["proof_id"])):
    raise bad("proof_id", "64 lowercase hex digits.")
  return {"proof_id": record["proof_id"],
          "params_layout": _layouts(record["params_layout"], "params_layout"),
          "params_blobs": _digests(record["params_blobs"], "params_blobs"),
          "training_proofs": _training_proofs(record["training_proofs"])}

