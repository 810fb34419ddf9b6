"""Benchmarks: registration by the owner, blobs, submissions scored by the server, leaderboards.

Example::

  routes = benchmark_routes(service)
  # PUT  /api/v1/benchmarks/{owner}/{name}                  register (owner's token, once)
  # PUT  /api/v1/benchmarks/{owner}/{name}/blobs/{digest}   program and rows (owner's token)
  # POST /api/v1/benchmarks/{owner}/{name}/submissions      a verified proof's checkpoint
  # GET  /api/v1/benchmarks/{owner}/{name}/leaderboard?sort=value
"""

import json
import math
import re

import blake3
import ml_dtypes
import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from dvbench.server import labels
from dvbench.server.service import HEX_ID, NAME, Service, check_name, decode
from zkdv import digest

_DEFINITION = {"type", "metric", "higher_is_better", "aggregate", "batch_rows", "program",
               "params_layout", "data_layout", "data_blobs", "min_update_check_probability",
               "allowed_programs", "public_rows"}
_SUBMISSION = {"type", "proof_id", "params_layout", "params_blobs"}
_AGGREGATES = ("mean", "sum")
_MAX_LEAVES, _MAX_RANK, _MAX_DIM = 4096, 8, 1 << 31
# The leaderboard columns a client may sort by (``?sort=``); unranked entries have no rank.
SORTS = ("rank", "value", "experiment", "state", "challenger", "checks_replayed",
         "update_check_probability", "escape_probability", "start_attested", "program_pinned",
         "contamination", "submitted")
_STATE_REASONS = {
    "self-audited": "its prover chose its own checks (detects faults, not a dishonest prover)",
    "unchallenged": "the server chose no update check in it, so nothing was replayed",
}


def _bad(what: str, rule: str) -> HTTPException:
  return HTTPException(400, f"{what}: {rule}")


def _digest(value, what: str) -> bytes:
  if not (isinstance(value, bytes) and len(value) == 32):
    raise _bad(what, "a 32-byte digest.")
  return value


def _digests(value, what: str) -> list[bytes]:
  if not isinstance(value, list) or len(value) > _MAX_LEAVES:
    raise _bad(what, f"a list of at most {_MAX_LEAVES} 32-byte digests.")
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
      getattr(ml_dtypes, name, None), type))


def _layouts(value, what: str) -> list[digest.LeafLayout]:
  """Leaf layouts ``{"path", "dtype", "shape"}`` (no keys, no pieces), strictly checked."""
  if not isinstance(value, list) or not 0 < len(value) <= _MAX_LEAVES:
    raise _bad(what, f"a list of 1 to {_MAX_LEAVES} leaf layouts.")
  layouts = []
  for leaf in value:
    ok = (isinstance(leaf, dict) and set(leaf) == {"path", "dtype", "shape"}
          and isinstance(leaf["path"], str) and len(leaf["path"]) <= 400
          and isinstance(leaf["dtype"], str) and isinstance(leaf["shape"], list)
          and len(leaf["shape"]) <= _MAX_RANK
          and all(type(n) is int and 0 <= n < _MAX_DIM for n in leaf["shape"]))
    if not (ok and _known_dtype(leaf["dtype"])):
      raise _bad(what, "each leaf is {\"path\": str, \"dtype\": a numpy dtype name, \"shape\": "
                 f"[up to {_MAX_RANK} non-negative ints]}}.")
    layouts.append(digest.LeafLayout.from_record(leaf))
  return layouts


def parse_definition(body: bytes) -> dict:
  """The registered benchmark's fields; 400 naming the first wrong one."""
  record = decode(body, "the benchmark", canonical=True)
  if not isinstance(record, dict) or set(record) != _DEFINITION or record["type"] != "benchmark":
    raise HTTPException(400, f"a benchmark has exactly the fields {sorted(_DEFINITION)} "
                        "(see dvbench.benchmark).")
  if not (isinstance(record["metric"], str) and NAME.fullmatch(record["metric"])):
    raise _bad("metric", "1-100 letters, digits, '.', '_' or '-'.")
  if not isinstance(record["higher_is_better"], bool) or not isinstance(
      record["public_rows"], bool):
    raise _bad("higher_is_better and public_rows", "booleans.")
  if record["aggregate"] not in _AGGREGATES:
    raise _bad("aggregate", f"one of {list(_AGGREGATES)} (computed by the server).")
  p = record["min_update_check_probability"]
  if not (isinstance(p, float) and 0 < p <= 1):
    raise _bad("min_update_check_probability", "a float in (0, 1].")
  data_layouts = _layouts(record["data_layout"], "data_layout")
  count = data_layouts[0].shape[0] if data_layouts[0].shape else 0
  if count == 0 or any(not l.shape or l.shape[0] != count for l in data_layouts):
    raise _bad("data_layout", "every leaf has the same positive number of rows (leading axis).")
  rows = record["batch_rows"]
  if type(rows) is not int or not 0 < rows <= count:
    raise _bad("batch_rows", f"an int in [1, {count}] (the rows of one evaluation call).")
  allowed = record["allowed_programs"]
  return {"metric": record["metric"], "higher_is_better": record["higher_is_better"],
          "aggregate": record["aggregate"], "public_rows": record["public_rows"],
          "min_update_check_probability": p, "batch_rows": rows, "rows": count,
          "program": _digest(record["program"], "program"),
          "params_layout": _layouts(record["params_layout"], "params_layout"),
          "data_layout": data_layouts,
          "data_blobs": _digests(record["data_blobs"], "data_blobs"),
          "allowed_programs": None if allowed is None else _digests(allowed, "allowed_programs")}


def parse_submission(body: bytes) -> dict:
  record = decode(body, "the submission", canonical=True)
  if not isinstance(record, dict) or set(record) != _SUBMISSION or record["type"] != "submission":
    raise HTTPException(400, f"a submission has exactly the fields {sorted(_SUBMISSION)}: the "
                        "server runs the benchmark's program on its rows, so a submitter sends "
                        "no outputs, values, programs or rows.")
  if not (isinstance(record["proof_id"], str) and HEX_ID.fullmatch(record["proof_id"])):
    raise _bad("proof_id", "64 lowercase hex digits.")
  return {"proof_id": record["proof_id"],
          "params_layout": _layouts(record["params_layout"], "params_layout"),
          "params_blobs": _digests(record["params_blobs"], "params_blobs")}


def _leaves(layouts: list[digest.LeafLayout]) -> str:
  shown = ", ".join(f"{l.path} {l.dtype}{list(l.shape)}" for l in layouts[:8])
  return f"[{shown}{', …' if len(layouts) > 8 else ''}]"


def row_digests(path, layout: digest.LeafLayout) -> set[str]:
  """BLAKE3 of each row's bytes (as probes hash a batch row), e.g. ``row_digests(p, l)``."""
  data = np.fromfile(path, np.uint8).reshape(layout.shape[0], -1)
  return {blake3.blake3(row.tobytes()).hexdigest() for row in data}


class BenchmarkRoutes:

  def __init__(self, service: Service):
    self.service, self.store, self.blobs = service, service.store, service.blobs

  def _owned(self, request) -> str:
    """``owner/name`` of the path, after checking the token is the owner's (403)."""
    owner, name = request.path_params["owner"], request.path_params["name"]
    full = check_name(owner, name)
    who = self.service.owner(request)
    if who != owner:
      raise HTTPException(403, f"token of '{who}' cannot write benchmark '{full}'; benchmarks "
                          "are written only by their owner.")
    return full

  def _benchmark_or_404(self, request) -> dict:
    full = check_name(request.path_params["owner"], request.path_params["name"])
    bench = self.store.benchmark(full)
    if bench is None:
      raise HTTPException(404, f"unknown benchmark '{full}'.")
    return bench

  # -- blobs -------------------------------------------------------------------------------

  async def put_blob(self, request):
    digest_ = self.service.blob_name(request.path_params["digest"])
    data = await self.service.body(request)

    def put():
      full = self._owned(request)
      if not self.blobs.put(digest_, data):
        raise HTTPException(400, f"blob {digest_} does not hash to its name.")
      self.store.add_benchmark_blob(full, digest_)
    await run_in_threadpool(put)
    return Response(status_code=201)

  def _custody(self, request) -> str:
    full = check_name(request.path_params["owner"], request.path_params["name"])
    digest_ = self.service.blob_name(request.path_params["digest"])
    if not self.store.has_benchmark_blob(full, digest_):
      raise HTTPException(404, f"blob {digest_} was not uploaded for benchmark '{full}'.")
    return digest_

  async def has_blob(self, request):
    await run_in_threadpool(self._custody, request)
    return Response(status_code=200)

  async def get_blob(self, request):
    """The program to anyone; the rows only when the owner published them."""
    def readable():
      digest_ = self._custody(request)
      bench = self._benchmark_or_404(request)
      if digest_ != bench["program"] and not bench["public_rows"]:
        raise HTTPException(403, f"the rows of '{bench['full_name']}' are private to the "
                            "server; their digests are public (GET .../rows).")
      return digest_
    return FileResponse(self.blobs.path(await run_in_threadpool(readable)),
                        media_type="application/octet-stream")

  # -- registration ---------------------------------------------------------------------

  async def register(self, request):
    body = await self.service.body(request)

    def register():
      full = self._owned(request)
      spec = parse_definition(body)
      existing = self.store.benchmark(full)
      if existing is not None:
        if existing["definition"] != body:
          raise HTTPException(409, f"benchmark '{full}' is registered and cannot change, so "
                              "its scores stay comparable; register a new name.")
        return existing, 200
      refs = [spec["program"], *spec["data_blobs"]]
      missing = [d.hex() for d in refs if not self.store.has_benchmark_blob(full, d.hex())]
      if missing:
        raise HTTPException(409, f"{len(missing)} blobs were not uploaded for '{full}' (first "
                            f"{missing[0]}); PUT them to .../blobs/DIGEST first.")
      if len(spec["data_blobs"]) != len(spec["data_layout"]):
        raise _bad("data_blobs", "one blob per data_layout leaf.")
      rows = set()
      for blob, layout in zip(spec["data_blobs"], spec["data_layout"]):
        path = self.blobs.path(blob.hex())
        if path.stat().st_size != layout.nbytes:
          raise _bad("data_blobs", f"blob {blob.hex()} holds {path.stat().st_size} bytes; its "
                     f"layout needs {layout.nbytes}.")
        rows |= row_digests(path, layout)
      allowed = spec["allowed_programs"]
      row = {"full_name": full, "metric": spec["metric"],
             "higher_is_better": spec["higher_is_better"], "aggregate": spec["aggregate"],
             "program": spec["program"].hex(), "rows": spec["rows"],
             "min_update_check_probability": spec["min_update_check_probability"],
             "allowed_programs": None if allowed is None else json.dumps(
                 sorted(p.hex() for p in allowed)),
             "public_rows": spec["public_rows"], "definition": body}
      return self.store.create_benchmark(full.split("/")[0], row, rows), 201
    row, status = await run_in_threadpool(register)
    return JSONResponse(public_benchmark(row), status_code=status)

  async def get_benchmark(self, request):
    row = await run_in_threadpool(self._benchmark_or_404, request)
    return JSONResponse(public_benchmark(row))

  async def get_rows(self, request):
    def rows():
      return self.store.benchmark_row_digests(self._benchmark_or_404(request)["id"])
    return JSONResponse(await run_in_threadpool(rows))

  # -- submissions ----------------------------------------------------------------------

  async def submit(self, request):
    body = await self.service.body(request)

    def submit():
      bench = self._benchmark_or_404(request)
      spec = parse_submission(body)
      proof = self.service.proof_or_404(spec["proof_id"])
      who = self.service.owner(request)
      if proof["experiment"].split("/")[0] != who:
        raise HTTPException(403, f"token of '{who}' cannot submit the checkpoint of proof "
                            f"{proof['id']} of '{proof['experiment']}': a checkpoint is "
                            "submitted by the owner of the proof that produced it.")
      self._check_audit(bench, proof)
      self._check_checkpoint(bench, proof, spec)
      submission_id = blake3.blake3(bench["full_name"].encode() + b"\0" + body).hexdigest()
      return self.store.add_submission({"id": submission_id, "benchmark_id": bench["id"],
                                        "proof_id": proof["id"], "record": body})
    row = await run_in_threadpool(submit)
    return JSONResponse(public_submission(row), status_code=201)

  def _check_audit(self, bench: dict, proof: dict) -> None:
    """409 unless the proof's audit meets the benchmark's (state, p, pinned programs)."""
    if proof["state"] != "verified":
      reason = _STATE_REASONS.get(proof["state"], "only proofs whose server-chosen checks "
                                  "were replayed are scored")
      raise HTTPException(409, f"proof {proof['id']} is {proof['state']}, not verified: "
                          f"{reason}.")
    challenger = self.store.challenger(proof["id"])
    p = json.loads(challenger["policy"])["update_check_probability"]
    if challenger["kind"] != "dvbench" or p < bench["min_update_check_probability"]:
      raise HTTPException(409, f"proof {proof['id']} was checked at p = {p:g}; "
                          f"'{bench['full_name']}' requires server-chosen update checks at p "
                          f">= {bench['min_update_check_probability']:g}.")
    if bench["allowed_programs"] is not None:
      allowed = set(json.loads(bench["allowed_programs"]))
      used = {decode(r, "a stored program record")["program_id"].hex()
              for r in self.store.records_of_kind(proof["id"], "program")}
      if not used <= allowed:
        raise HTTPException(409, f"proof {proof['id']} trained with programs "
                            f"{sorted(p[:16] for p in used - allowed)} that "
                            f"'{bench['full_name']}' does not allow (it pins "
                            f"{sorted(p[:16] for p in allowed)}).")

  def _check_checkpoint(self, bench: dict, proof: dict, spec: dict) -> None:
    """409 unless the params are the benchmark's layout, the proof's final params, uploaded."""
    expected = parse_definition(bench["definition"])["params_layout"]
    if spec["params_layout"] != expected or len(spec["params_blobs"]) != len(expected):
      raise HTTPException(409, f"the checkpoint's leaves {_leaves(spec['params_layout'])} are "
                          f"not the benchmark's {_leaves(expected)}.")
    checkpoint = digest.state_digest_from_leaves(spec["params_layout"], spec["params_blobs"])
    if checkpoint.hex() != proof["final_params"]:
      raise HTTPException(409, f"the checkpoint's params digest {checkpoint.hex()} is not the "
                          f"final_params {proof['final_params']} of proof {proof['id']}: a "
                          "submission scores exactly the params the proof attested.")
    missing = [b.hex() for b in spec["params_blobs"]
               if not self.store.has_proof_blob(proof["id"], b.hex())]
    if missing:
      raise HTTPException(409, f"{len(missing)} checkpoint blobs were not uploaded for proof "
                          f"{proof['id']} (first {missing[0]}).")

  async def get_submission(self, request):
    row = await run_in_threadpool(self.store.submission, request.path_params["submission_id"])
    if row is None:
      raise HTTPException(404, "unknown submission.")
    return JSONResponse(public_submission(row))

  async def get_leaderboard(self, request):
    sort = sort_key(request.query_params.get("sort", "rank"))

    def board():
      return leaderboard_entries(self.store, self._benchmark_or_404(request), sort)
    return JSONResponse(await run_in_threadpool(board))


def sort_key(sort: str) -> str:
  if sort not in SORTS:
    raise HTTPException(400, f"sort is one of {list(SORTS)}, got {sort[:40]!r}.")
  return sort


def public_benchmark(row: dict) -> dict:
  return {"name": row["full_name"], "metric": row["metric"],
          "higher_is_better": row["higher_is_better"], "aggregate": row["aggregate"],
          "program": row["program"], "rows": row["rows"],
          "min_update_check_probability": row["min_update_check_probability"],
          "allowed_programs": None if row["allowed_programs"] is None else json.loads(
              row["allowed_programs"]),
          "public_rows": row["public_rows"], "created_at": row["created_at"]}


def public_submission(row: dict) -> dict:
  return {k: row[k] for k in ("id", "proof_id", "state", "value", "failure", "created_at",
                              "updated_at")}


def audit(store, proof_id: str) -> dict:
  """What a benchmark entry's proof shows: who challenged, checks replayed, p, 1 − p, start."""
  proof = store.proof(proof_id)
  checks = store.proof_checks(proof_id)
  summary = labels.challenge_summary(proof, store.challenger(proof_id),
                                     store.challenge_rows(proof_id), checks)
  return {"challenger": summary["challenger"],
          "checks_replayed": summary["server_challenges"]["update_replayed"],
          "update_check_probability": summary["update_check_probability"],
          "escape_probability": summary["escape_probability_one_faked_step"],
          "start_attested": any(c["kind"] == "start" and c["status"] == "verified"
                                for c in checks),
          "proof_state": proof["state"], "steps": proof["steps"], **_strictness(store, proof_id)}


def _strictness(store, proof_id: str) -> dict:
  """Whether the proof passed ``zkdv verify --strict`` on the server, and what it lacks."""
  shown = store.proof_claims(proof_id) or {"claims": {}, "strict": False}
  unmet = [f"{name}: {status}" for name, status in shown["claims"].items() if status != "holds"]
  return {"strict": shown["strict"], "unmet_claims": unmet or (
      [] if shown["strict"] else ["replays: not exact"])}


def leaderboard_entries(store, bench: dict, sort: str = "rank") -> list[dict]:
  """Every submission with its audit; ranked: scored, its proof passed ``--strict`` (every
  claim holds: server challenges, exact replays, attested start, a program that reads the
  batch, probes) and no probed row is in the evaluation set."""
  dirty = store.benchmark_contamination(bench["id"])
  entries = []
  for s in store.list_submissions(bench["id"]):
    contamination = dirty.get(s["proof_id"], 0)
    entries.append({**public_submission(s), "experiment": s["experiment"],
                    **audit(store, s["proof_id"]),
                    "program_pinned": bench["allowed_programs"] is not None,
                    "contamination": contamination,
                    "rank": None})
    entries[-1]["ranked"] = (s["state"] == "scored" and contamination == 0
                             and entries[-1]["strict"])
  sign = -1 if bench["higher_is_better"] else 1
  ranked = sorted((e for e in entries if e["ranked"]), key=lambda e: sign * e["value"])
  for i, e in enumerate(ranked):
    e["rank"] = i + 1
  keys = {"rank": lambda e: e["rank"] or math.inf,
          "value": lambda e: math.inf if e["value"] is None else sign * e["value"],
          "submitted": lambda e: e["created_at"]}
  return sorted(entries, key=keys.get(sort, lambda e: e[sort]))


def benchmark_routes(service: Service) -> list[Route]:
  api = BenchmarkRoutes(service)
  base = "/api/v1/benchmarks/{owner}/{name}"
  return [
      Route(base, api.register, methods=["PUT"], name="register_benchmark"),
      Route(base, api.get_benchmark, methods=["GET"], name="benchmark"),
      Route(base + "/rows", api.get_rows, name="benchmark_rows"),
      Route(base + "/blobs/{digest}", api.put_blob, methods=["PUT"], name="put_benchmark_blob"),
      Route(base + "/blobs/{digest}", api.has_blob, methods=["HEAD"], name="has_benchmark_blob"),
      Route(base + "/blobs/{digest}", api.get_blob, methods=["GET"], name="benchmark_blob"),
      Route(base + "/submissions", api.submit, methods=["POST"], name="submit"),
      Route(base + "/leaderboard", api.get_leaderboard, name="benchmark_leaderboard_json"),
      Route("/api/v1/submissions/{submission_id}", api.get_submission, name="submission"),
  ]
