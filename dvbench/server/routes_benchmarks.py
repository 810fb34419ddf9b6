"""Benchmarks: registration by the owner, blobs, submissions scored by the server, leaderboards.

Example::

  routes = benchmark_routes(service)
  # PUT  /api/v1/benchmarks/{owner}/{name}                  register (owner's token, once)
  # PUT  /api/v1/benchmarks/{owner}/{name}/blobs/{digest}   program and rows (owner's token)
  # POST /api/v1/benchmarks/{owner}/{name}/submissions      a verified proof's checkpoint
  # GET  /api/v1/benchmarks/{owner}/{name}/leaderboard?sort=value
"""

import json
import pathlib
import re
import sys
import tempfile

import blake3
import cbor2
import ml_dtypes
import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from dvbench import contamination
from dvbench.server import labels
from dvbench.server import leaderboard
from dvbench.server import sandbox
from dvbench import scoring
from dvbench.server import pins
from dvbench.server import worker
from dvbench.server.paging import next_link, page_params, paged
from dvbench.server.decoding import decode
from dvbench.server.refusals import MAX_COLUMN_INT, int_param
from dvbench.server.service import HEX_ID, NAME, Service, check_name
from zkdv import config
from zkdv import digest
from zkdv import merkle

_DEFINITION = {"type", "metric", "higher_is_better", "aggregate", "batch_rows", "program",
               "params_layout", "data_layout", "data_blobs", "min_update_check_probability",
               "allowed_programs", "public_rows"}
# absent from definitions registered before them
_DEFINITION_ADDED = {"audit", "training_set", "reference_params", *pins.FIELDS}
_SUBMISSION = {"type", "proof_id", "params_layout", "params_blobs", "training_proofs"}
# The audit levels a benchmark may require; each names the check of a submitted proof in
# ``BenchmarkRoutes``. "full-replay": the server's workers re-executed every step of the
# proof from its attested start (docs/protocol.md).
AUDITS = ("min-probability", "full-replay")
_MAX_LEAVES, _MAX_RANK, _MAX_DIM = 4096, 8, 1 << 31
_MAX_PROGRAM_BYTES = 64 << 20
_MAX_PROOF_LENGTH = 64  # a training set of up to 2**64 rows
_CHECKED_PROGRAMS = 1024  # (program, signature) pairs remembered as checked
# The leaderboard columns a client may sort by (``?sort=``); unranked entries have no rank.
SORTS = ("rank", "value", "experiment", "state", "challenger", "checks_replayed",
         "update_check_probability", "escape_probability", "start_attested", "program_pinned",
         "contamination", "outside_training_set", "attempts", "submitted")
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
  if not (isinstance(record, dict) and _DEFINITION <= set(record)
          <= _DEFINITION | _DEFINITION_ADDED and record["type"] == "benchmark"):
    raise HTTPException(400, "a benchmark has exactly the fields "
                        f"{sorted(_DEFINITION | _DEFINITION_ADDED)} (see dvbench.benchmark).")
  audit = record.get("audit", "min-probability")
  if audit not in AUDITS:
    raise _bad("audit", f"one of {list(AUDITS)}, got {str(audit)[:40]!r}.")
  if not (isinstance(record["metric"], str) and NAME.fullmatch(record["metric"])):
    raise _bad("metric", "1-100 letters, digits, '.', '_' or '-'.")
  if not isinstance(record["higher_is_better"], bool) or not isinstance(
      record["public_rows"], bool):
    raise _bad("higher_is_better and public_rows", "booleans.")
  if record["aggregate"] not in scoring.AGGREGATES:
    raise _bad("aggregate", f"one of {list(scoring.AGGREGATES)} (computed by the server).")
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
  params_layout = _layouts(record["params_layout"], "params_layout")
  reference = record.get("reference_params")
  if reference is not None:
    reference = _digests(reference, "reference_params")
    if len(reference) != len(params_layout):
      raise _bad("reference_params", "null or one blob per params_layout leaf (the owner's "
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
    raise _bad("training_set", "null or {\"root\": its Merkle root, \"size\": its rows} "
               "(dvbench.benchmark.TrainingSet).")
  return {"root": _digest(value["root"], "training_set root"), "size": value["size"]}


def _training_proofs(value) -> list[tuple[bytes, int, list[bytes]]]:
  """``[row digest, index, audit path]`` entries, strictly typed."""
  if not isinstance(value, list) or len(value) > 1 << 16:
    raise _bad("training_proofs", "a list of at most 65536 [row digest, index, path].")
  entries = []
  for entry in value:
    if not (isinstance(entry, list) and len(entry) == 3 and type(entry[1]) is int
            and isinstance(entry[2], list) and len(entry[2]) <= _MAX_PROOF_LENGTH):
      raise _bad("training_proofs", "each entry is [row digest, index, [up to "
                 f"{_MAX_PROOF_LENGTH} 32-byte hashes]].")
    entries.append((_digest(entry[0], "training_proofs row digest"), entry[1],
                     [_digest(h, "training_proofs path") for h in entry[2]]))
  return entries


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
          "params_blobs": _digests(record["params_blobs"], "params_blobs"),
          "training_proofs": _training_proofs(record["training_proofs"])}


def _leaves(layouts: list[digest.LeafLayout]) -> str:
  shown = ", ".join(f"{l.path} {l.dtype}{list(l.shape)}" for l in layouts[:8])
  return f"[{shown}{', …' if len(layouts) > 8 else ''}]"


def leaf_rows(path, layout: digest.LeafLayout) -> np.ndarray:
  """A stored leaf's rows as ``(rows, bytes per row)`` uint8, e.g. ``leaf_rows(p, l)``."""
  return np.fromfile(path, np.uint8).reshape(layout.shape[0], -1)


class BenchmarkRoutes:

  def __init__(self, service: Service):
    self.service, self.store, self.blobs = service, service.store, service.blobs
    # the checks each checked job ran; insertion-ordered, oldest first
    self._checked_programs: dict[bytes, list[str]] = {}

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
    """Token, owner and name first; then the body, streamed to the store while hashed
    (``Service.receive_blob``)."""
    digest_ = self.service.blob_name(request.path_params["digest"])
    full = await run_in_threadpool(self._owned, request)
    if not await self.service.receive_blob(request, digest_):
      raise HTTPException(400, f"blob {digest_} does not hash to its name.")
    await run_in_threadpool(self.store.add_benchmark_blob, full, digest_)
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
        return existing, 200, None
      refs = [spec["program"], *spec["data_blobs"], *(spec["reference_params"] or [])]
      missing = [d.hex() for d in refs if not self.store.has_benchmark_blob(full, d.hex())]
      if missing:
        raise HTTPException(409, f"{len(missing)} blobs were not uploaded for '{full}' (first "
                            f"{missing[0]}); PUT them to .../blobs/DIGEST first.")
      if len(spec["data_blobs"]) != len(spec["data_layout"]):
        raise _bad("data_blobs", "one blob per data_layout leaf.")
      leaves = []
      for blob, layout in zip(spec["data_blobs"], spec["data_layout"]):
        path = self.blobs.path(blob.hex())
        if path.stat().st_size != layout.nbytes:
          raise _bad("data_blobs", f"blob {blob.hex()} holds {path.stat().st_size} bytes; its "
                     f"layout needs {layout.nbytes}.")
        leaves.append(leaf_rows(path, layout))
      for blob, layout in zip(spec["reference_params"] or [], spec["params_layout"]):
        if self.blobs.path(blob.hex()).stat().st_size != layout.nbytes:
          raise _bad("reference_params", f"blob {blob.hex()} is not {layout.nbytes} bytes, "
                     f"the size of params leaf {layout.path}.")
      checks = self._check_program(spec)
      allowed = spec["allowed_programs"]
      row = {"full_name": full, "metric": spec["metric"],
             "higher_is_better": spec["higher_is_better"], "aggregate": spec["aggregate"],
             "program": spec["program"].hex(), "rows": spec["rows"],
             "min_update_check_probability": spec["min_update_check_probability"],
             "allowed_programs": None if allowed is None else json.dumps(
                 sorted(p.hex() for p in allowed)),
             "public_rows": spec["public_rows"], "definition": body}
      return self.store.create_benchmark(full.split("/")[0], row, contamination.evaluation_digests(
          leaves)), 201, checks
    row, status, *checks = await run_in_threadpool(register)
    return JSONResponse({**public_benchmark(row), "checks_run": checks[0] if checks else None},
                        status_code=status)

  def _check_program(self, spec: dict) -> list[str]:
    """400 naming what is wrong with the evaluation program, checked in a limited child
    process as uploaded programs always are (``dvbench.benchmark.check_job``): it
    deserializes, passes the StableHLO screen, takes the params and a batch, returns one
    number per row and reads both; on the owner's rows its outputs change with the params
    (at the owner's params and a perturbed model) and with the batch, and are finite.
    Returns the checks it ran."""
    size = self.blobs.path(spec["program"].hex()).stat().st_size
    if size > _MAX_PROGRAM_BYTES:
      raise _bad("program", f"at most {_MAX_PROGRAM_BYTES >> 20} MiB, got {size} bytes.")
    job = {"mode": "check", "program": spec["program"], "batch_rows": spec["batch_rows"],
           "params_layout": [l.to_record() for l in spec["params_layout"]],
           "data_layout": [l.to_record() for l in spec["data_layout"]],
           "data_blobs": spec["data_blobs"], "reference_params": spec["reference_params"]}
    key = blake3.blake3(cbor2.dumps(job, canonical=True)).digest()
    if key in self._checked_programs:
      return self._checked_programs[key]
    blobs = [spec["program"], *spec["data_blobs"], *(spec["reference_params"] or [])]
    data = self.blobs.folder.parent.resolve()  # the child works elsewhere: absolute paths
    with tempfile.TemporaryDirectory(prefix="program-", dir=data) as work:
      folder = worker.child_folder(pathlib.Path(work), self.blobs, [b.hex() for b in blobs])
      (folder / "job.cbor").write_bytes(cbor2.dumps(job))
      seconds = min(self.service.time_limit, 600)
      limits = worker.Limits(self.service.memory_bytes, seconds, isolation=sandbox.available(),
                             hidden=(str(data),))
      result, failure = worker.run_confined(
          [sys.executable, "-m", "dvbench.benchmark", str(folder)], pathlib.Path(work), limits,
          seconds)
    failure = failure or result["failure"]
    if failure:
      raise HTTPException(400, failure if failure.startswith("the evaluation program") else
                          f"the evaluation program could not be checked: {failure}")
    self._checked_programs[key] = result["checks"]
    if len(self._checked_programs) > _CHECKED_PROGRAMS:
      del self._checked_programs[next(iter(self._checked_programs))]
    return result["checks"]

  async def get_benchmark(self, request):
    row = await run_in_threadpool(self._benchmark_or_404, request)
    return JSONResponse(public_benchmark(row))

  async def get_rows(self, request):
    bench = await run_in_threadpool(self._benchmark_or_404, request)
    return await paged(request, self.store.page_benchmark_rows, bench["id"])

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
      definition = parse_definition(bench["definition"])
      self._check_audit(bench, definition, proof)
      self._check_checkpoint(definition, proof, spec)
      members = self._training_members(bench, definition, proof, spec["training_proofs"])
      existing = self.store.benchmark_submission(bench["id"], proof["id"])
      # One entry per (benchmark, proof): another encoding of the same submission is it.
      submission_id = existing["id"] if existing else blake3.blake3(
          bench["full_name"].encode() + b"\0" + proof["id"].encode()).hexdigest()
      shards = scoring.shard_ranges(definition["rows"], definition["batch_rows"],
                                    self.service.score_shard_rows)
      return self.store.add_submission({"id": submission_id, "benchmark_id": bench["id"],
                                        "proof_id": proof["id"], "record": body},
                                       shards, members), 200 if existing else 201
    row, status = await run_in_threadpool(submit)
    return JSONResponse(leaderboard.public_submission(row), status_code=status)

  def _check_audit(self, bench: dict, definition: dict, proof: dict) -> None:
    """409 unless the proof's audit meets the benchmark's (state, audit level, programs)."""
    if proof["state"] not in labels.REPLAYED_STATES:
      reason = _STATE_REASONS.get(proof["state"], "only proofs whose server-chosen checks "
                                  "were replayed are scored")
      raise HTTPException(409, f"proof {proof['id']} is {proof['state']}, not verified: "
                          f"{reason}.")
    audit_checks = {"min-probability": self._check_min_probability,
                     "full-replay": self._check_full_replay}
    audit_checks[definition["audit"]](bench, proof)
    self._check_programs(bench, proof)
    broken = pins.check(definition, pins.start_of(self.store, proof["id"]))[1]
    if broken:
      raise HTTPException(409, f"proof {proof['id']} does not meet the pins of "
                          f"'{bench['full_name']}': {'; '.join(broken)}.")

  def _check_min_probability(self, bench: dict, proof: dict) -> None:
    challenger = self.store.challenger(proof["id"])
    p = json.loads(challenger["policy"])["update_check_probability"]
    if challenger["kind"] != "dvbench" or p < bench["min_update_check_probability"]:
      raise HTTPException(409, f"proof {proof['id']} was checked at p = {p:g}; "
                          f"'{bench['full_name']}' requires server-chosen update checks at p "
                          f">= {bench['min_update_check_probability']:g}.")

  def _check_full_replay(self, bench: dict, proof: dict) -> None:
    challenger = self.store.challenger(proof["id"])
    if challenger["kind"] != "dvbench" or not labels.is_full_replay(
        self.store.proof_claims(proof["id"])):
      p = json.loads(challenger["policy"])["update_check_probability"]
      raise HTTPException(409, f"'{bench['full_name']}' requires a full replay: every step "
                          "re-executed by the server's workers from an attested start "
                          "(SamplingPolicy(full_replay=True) and proof.init); proof "
                          f"{proof['id']} was checked at p = {p:g}.")

  def _check_programs(self, bench: dict, proof: dict) -> None:
    if bench["allowed_programs"] is not None:
      allowed = set(json.loads(bench["allowed_programs"]))
      used = set(leaderboard.training_programs(self.store, proof["id"]))
      if not used or not used <= allowed:
        raise HTTPException(409, f"proof {proof['id']} trained with programs "
                            f"{sorted(p[:16] for p in used - allowed)} that "
                            f"'{bench['full_name']}' does not allow (it pins "
                            f"{sorted(p[:16] for p in allowed)}).")

  def _check_checkpoint(self, definition: dict, proof: dict, spec: dict) -> None:
    """409 unless the params are the benchmark's layout, the proof's final params, uploaded."""
    expected = definition["params_layout"]
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
    first = leaderboard.copy_of(self.store, proof)
    if first is not None:
      raise HTTPException(409, f"refused: {leaderboard.copy_reason(checkpoint.hex(), first)}; "
                          "one entry per checkpoint, the first proof's.")

  def _training_members(self, bench: dict, definition: dict, proof: dict,
                        entries: list) -> list[str]:
    """The probed rows of ``proof`` that ``entries`` prove members of the benchmark's
    training set (a Merkle proof that fails is refused with 409, never counted)."""
    pin, name = definition["training_set"], bench["full_name"]
    if pin is None:
      if entries:
        raise _bad("training_proofs", f"'{name}' registers no training set; send none.")
      return []
    probed = self.store.probed_rows(proof["id"])
    if not probed:
      raise HTTPException(409, f"proof {proof['id']} probed no batch rows, so its rows cannot "
                          f"be shown to be in the training set '{name}' pins: train with "
                          "proof.start(probe_ratio=...) above 0.")
    if len(entries) > len(probed):
      raise _bad("training_proofs", f"at most one per probed row ({len(probed)}).")
    members = set()
    for row, index, path in entries:
      if row.hex() in members:
        raise _bad("training_proofs", f"row {row.hex()} is proven twice.")
      if row.hex() not in probed or not self.store.has_proof_blob(proof["id"], row.hex()):
        raise HTTPException(409, f"row {row.hex()} is not a probed row of proof "
                            f"{proof['id']}: training_proofs prove the rows its probes opened.")
      leaf = merkle.leaf_hash(self.blobs.path(row.hex()).read_bytes())
      if not merkle.verify_inclusion(leaf, index, pin["size"], path, pin["root"]):
        raise HTTPException(409, f"the membership proof of probed row {row.hex()} (index "
                            f"{index}) does not lead to the root {pin['root'].hex()} of the "
                            f"training set '{name}' pins.")
      members.add(row.hex())
    return sorted(members)

  async def get_submission(self, request):
    def submission():
      row = self.store.submission(request.path_params["submission_id"])
      if row is None:
        raise HTTPException(404, "unknown submission.")
      return {**leaderboard.public_submission(row),
              "shards": self.store.shard_progress(row["id"])}
    return JSONResponse(await run_in_threadpool(submission))

  async def get_leaderboard(self, request):
    """One page of the entries in ``sort`` order; the cursor is a position."""
    sort = sort_key(request.query_params.get("sort", "rank"))
    limit, after = page_params(request)
    start = int_param({"after": after}, "after", 0, MAX_COLUMN_INT, default=0)

    def board():
      bench = self._benchmark_or_404(request)
      return leaderboard.leaderboard_entries(self.store, bench,
                                             parse_definition(bench["definition"]), sort)
    entries = await run_in_threadpool(board)
    more = start + limit < len(entries)
    return JSONResponse(entries[start:start + limit],
                        headers=next_link(request, limit, str(start + limit) if more else None))


def sort_key(sort: str) -> str:
  if sort not in SORTS:
    raise HTTPException(400, f"sort is one of {list(SORTS)}, got {sort[:40]!r}.")
  return sort


def left_open(definition: dict, allowed_programs) -> list[str]:
  """What a benchmark's recipe does not pin, and what that lets a run do unseen."""
  eval_bytes = sum(l.nbytes for l in definition["data_layout"])
  budget = config.MAX_PROGRAM_CONSTANT_BYTES
  open_ = pins.left_open(definition)
  if allowed_programs is None:
    open_.append(
        f"the training program: any, and a program may embed up to {budget} bytes of "
        f"constants ({budget / max(eval_bytes, 1):.3g}× the evaluation set's {eval_bytes} "
        "bytes), unseen by probes" if budget >= eval_bytes else
        f"the training program: any, and a program may embed up to {budget} bytes of "
        f"constants, {budget / eval_bytes:.3g} of the evaluation set's {eval_bytes} bytes")
  if definition["training_set"] is None:
    open_.append("the training set: probed rows are compared with the evaluation set only")
  return open_


def public_benchmark(row: dict) -> dict:
  definition = parse_definition(row["definition"])
  pin = definition["training_set"]
  return {"name": row["full_name"], "metric": row["metric"], "audit": definition["audit"],
          "training_set": None if pin is None else {"root": pin["root"].hex(),
                                                    "size": pin["size"]},
          "higher_is_better": row["higher_is_better"], "aggregate": row["aggregate"],
          "program": row["program"], "rows": row["rows"],
          "min_update_check_probability": row["min_update_check_probability"],
          "allowed_programs": None if row["allowed_programs"] is None else json.loads(
              row["allowed_programs"]),
          **{k: definition[k].hex() if isinstance(definition[k], bytes) else definition[k]
             for k in pins.FIELDS},
          "public_rows": row["public_rows"], "created_at": row["created_at"],
          "left_open": left_open(definition, row["allowed_programs"])}


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
