"""The DVBench ASGI app: JSON API, CBOR stream ingestion, blob upload, page.

Example::

  app = create_app(Store.open("sqlite:///data/dvbench.db"), BlobStore("data/blobs"))
  uvicorn.run(app, host="127.0.0.1", port=8000)
"""

import json
import pathlib
import re

import cbor2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from dvbench import transport
from dvbench.server import page
from dvbench.server.blobs import BlobStore
from dvbench.server.db import Store

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_PROOF_ID = re.compile(r"[0-9a-f]{64}")


def _check_name(owner: str, name: str) -> str:
  if not (_NAME.fullmatch(owner) and _NAME.fullmatch(name)):
    raise HTTPException(400, "experiment names are 'owner/name', each 1-100 characters "
                        "of letters, digits, '.', '_' or '-'.")
  return f"{owner}/{name}"


def _public_proof(p: dict) -> dict:
  return {"id": p["id"], "experiment": p.get("experiment"), "name": p["name"],
          "state": p["state"], "failure": p["failure"], "records": p["records"],
          "steps": p["steps"], "final_params": p["final_params"],
          "created_at": p["created_at"], "updated_at": p["updated_at"]}


class _Api:
  """Request handlers; database work runs in the thread pool."""

  def __init__(self, store: Store, blobs: BlobStore, max_body: int):
    self.store, self.blobs, self.max_body = store, blobs, max_body

  async def body(self, request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > self.max_body:
      raise HTTPException(413, f"request body of {declared} bytes exceeds the limit of "
                          f"{self.max_body}; records above the chunk threshold go in chunks.")
    data = bytearray()
    async for part in request.stream():
      data += part
      if len(data) > self.max_body:
        raise HTTPException(413, f"request body exceeds the limit of {self.max_body} bytes.")
    return bytes(data)

  def owner(self, request: Request) -> str:
    header = request.headers.get("authorization", "")
    if not header.startswith("Bearer "):
      raise HTTPException(401, "missing API token: send 'Authorization: Bearer <token>' "
                          "(create one with 'dvbench token create OWNER').")
    owner = self.store.owner_of_token(header[len("Bearer "):].strip())
    if owner is None:
      raise HTTPException(401, "unknown API token.")
    return owner

  def writable_experiment(self, request: Request, owner: str, name: str) -> dict:
    full = _check_name(owner, name)
    who = self.owner(request)
    if who != owner:
      raise HTTPException(403, f"token of '{who}' cannot write to '{full}'; experiments "
                          "are written only by their owner.")
    return self.store.experiment(full, create_for=owner)

  def proof_for_write(self, request: Request, proof_id: str) -> dict:
    if not _PROOF_ID.fullmatch(proof_id):
      raise HTTPException(404, f"unknown proof {proof_id!r}.")
    proof = self.store.proof(proof_id)
    if proof is None:
      raise HTTPException(404, f"unknown proof {proof_id}: create it by posting its root "
                          "record to /api/v1/experiments/OWNER/NAME/proofs.")
    who = self.owner(request)
    if proof["experiment"].split("/")[0] != who:
      raise HTTPException(403, f"token of '{who}' cannot write to proof {proof_id}.")
    return proof

  # -- experiments and proofs ------------------------------------------------

  async def list_experiments(self, request):
    return JSONResponse(await run_in_threadpool(self.store.list_experiments))

  async def create_experiment(self, request):
    try:
      full = json.loads(await self.body(request))["name"]
      owner, name = full.split("/")
    except (ValueError, KeyError, TypeError, AttributeError):
      raise HTTPException(400, "send JSON {\"name\": \"owner/name\"}.") from None
    exp = await run_in_threadpool(self.writable_experiment, request, owner, name)
    return JSONResponse(exp)

  async def get_experiment(self, request):
    full = _check_name(request.path_params["owner"], request.path_params["name"])
    exp = await run_in_threadpool(self.store.experiment, full)
    if exp is None:
      raise HTTPException(404, f"unknown experiment '{full}'.")
    proofs = await run_in_threadpool(self.store.list_proofs, exp["id"])
    return JSONResponse({**exp, "proofs": [_public_proof(p) for p in proofs]})

  async def create_proof(self, request):
    root = await self.body(request)
    owner, name = request.path_params["owner"], request.path_params["name"]

    def create():
      exp = self.writable_experiment(request, owner, name)
      try:
        record = cbor2.loads(root)
      except (cbor2.CBORDecodeError, ValueError) as e:
        raise HTTPException(400, f"the body is not a CBOR record: {e}") from None
      if not isinstance(record, dict) or record.get("type") != "root" or "prev" in record:
        raise HTTPException(400, "a proof starts with its root record (type 'root', no prev).")
      if cbor2.dumps(record, canonical=True) != root:
        raise HTTPException(400, "the root record is not deterministically encoded.")
      proof_id = transport.record_id(root).hex()
      existing = self.store.proof(proof_id)
      if existing is not None and existing["experiment_id"] != exp["id"]:
        raise HTTPException(409, f"proof {proof_id} belongs to experiment "
                            f"'{existing['experiment']}'.")
      return self.store.create_proof(exp["id"], proof_id, str(record.get("name", "")), root,
                                     "root")
    return JSONResponse(_public_proof(await run_in_threadpool(create)), status_code=201)

  async def get_proof(self, request):
    proof = await run_in_threadpool(self.store.proof, request.path_params["proof_id"])
    if proof is None:
      raise HTTPException(404, "unknown proof.")
    checks = await run_in_threadpool(self.store.proof_checks, proof["id"])
    return JSONResponse({**_public_proof(proof), "checks": len(checks),
                         "checks_verified": sum(c["status"] == "verified" for c in checks)})

  async def get_checks(self, request):
    return JSONResponse(await run_in_threadpool(self.store.proof_checks,
                                                request.path_params["proof_id"]))

  async def get_record_ids(self, request):
    ids = await run_in_threadpool(self.store.record_ids, request.path_params["proof_id"])
    return JSONResponse([i.hex() for i in ids])

  # -- blobs ---------------------------------------------------------------------

  async def has_blob(self, request):
    digest = request.path_params["digest"]
    if not self.blobs.valid_name(digest):
      raise HTTPException(400, "blob names are 64 lowercase hex digits.")
    return Response(status_code=200 if self.blobs.has(digest) else 404)

  async def put_blob(self, request):
    digest = request.path_params["digest"]
    if not self.blobs.valid_name(digest):
      raise HTTPException(400, "blob names are 64 lowercase hex digits.")
    data = await self.body(request)

    def put():
      proof = self.proof_for_write(request, request.path_params["proof_id"])
      if self.blobs.put(digest, data):
        return 201
      failure = (f"blob {digest} uploaded for this proof does not hash to its name: the "
                 "opening was altered.")
      self.store.set_proof_state(proof["id"], "invalid", failure)
      raise HTTPException(400, failure)
    return Response(status_code=await run_in_threadpool(put))

  # -- the stream ------------------------------------------------------------------

  async def stream(self, request):
    body = await self.body(request)
    try:
      envelope = cbor2.loads(body)
    except (cbor2.CBORDecodeError, ValueError) as e:
      raise HTTPException(400, f"the envelope is not CBOR: {e}") from None
    if not isinstance(envelope, dict):
      raise HTTPException(400, "the envelope must be a CBOR map.")
    client_id, seq, kind = envelope.get("client_id"), envelope.get("seq"), envelope.get("kind")
    if not (isinstance(client_id, str) and 0 < len(client_id) <= 64):
      raise HTTPException(400, "envelope.client_id must be a string of 1-64 characters.")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
      raise HTTPException(400, "envelope.seq must be an integer >= 0.")
    if kind not in transport.ENVELOPE_KINDS:
      raise HTTPException(400, f"envelope.kind must be one of {transport.ENVELOPE_KINDS}.")
    ack = await run_in_threadpool(self._ingest, request, envelope)
    return JSONResponse(ack)

  def _ingest(self, request, envelope) -> dict:
    proof = self.proof_for_write(request, request.path_params["proof_id"])
    proof_id, client_id, seq = proof["id"], envelope["client_id"], envelope["seq"]
    with self.store.engine.begin() as conn:
      expected, last_ack = self.store.stream_position(conn, proof_id, client_id)
      if seq < expected:
        ack = json.loads(last_ack) if seq == expected - 1 else {"seq": seq}
        return {**ack, "duplicate": True}
      if seq > expected:
        raise HTTPException(409, f"envelope seq {seq} out of order: expected {expected} for "
                            f"client {client_id}.")
      if proof["state"] != "receiving":
        raise HTTPException(409, f"proof {proof_id} is {proof['state']}; it takes no more "
                            "records.")
      ack = getattr(self, f"_ingest_{envelope['kind']}")(conn, proof_id, envelope)
      ack["seq"] = seq
      self.store.advance_stream(conn, proof_id, client_id, seq, json.dumps(ack))
    return ack

  def _parse_records(self, raws) -> tuple[list, set, set]:
    """(record id, type, bytes) of each record, the blobs they reference, their probe rows."""
    items, refs, probes = [], set(), set()
    for n, raw in enumerate(raws):
      if not isinstance(raw, bytes):
        raise HTTPException(400, f"record {n} of the envelope is not a byte string.")
      try:
        record = cbor2.loads(raw)
      except (cbor2.CBORDecodeError, ValueError) as e:
        raise HTTPException(400, f"record {n} of the envelope is not CBOR: {e}") from None
      if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        raise HTTPException(400, f"record {n} of the envelope is not a record map.")
      items.append((transport.record_id(raw), record["type"][:20], raw))
      refs |= transport.blob_refs(record)
      probes |= transport.probe_blobs(record)
    return items, refs, probes

  def _ingest_records(self, conn, proof_id, envelope) -> dict:
    raws = envelope.get("records")
    if not isinstance(raws, list):
      raise HTTPException(400, "envelope.records must be a list of encoded records.")
    items, refs, probes = self._parse_records(raws)
    stored, duplicates = self.store.append_records(conn, proof_id, items, refs)
    self.store.add_probes(conn, proof_id, probes)
    return {"stored": stored, "duplicates": duplicates}

  def _ingest_chunk(self, conn, proof_id, envelope) -> dict:
    rid, idx, count, data = (envelope.get(k) for k in ("record_id", "index", "count", "data"))
    if not (isinstance(rid, bytes) and len(rid) == 32 and isinstance(data, bytes)
            and isinstance(idx, int) and isinstance(count, int) and 0 <= idx < count <= 65536):
      raise HTTPException(400, "a chunk carries record_id (32 bytes), index < count, data.")
    whole = self.store.put_chunk(conn, proof_id, rid, idx, count, data)
    if whole is None:
      return {"chunk": idx, "of": count}
    if transport.record_id(whole) != rid:
      raise HTTPException(400, "the reassembled chunks do not hash to record_id.")
    items, refs, probes = self._parse_records([whole])
    stored, duplicates = self.store.append_records(conn, proof_id, items, refs)
    self.store.add_probes(conn, proof_id, probes)
    return {"chunk": idx, "of": count, "stored": stored, "duplicates": duplicates}

  def _ingest_close(self, conn, proof_id, envelope) -> dict:
    stored, last_id, last = self.store.last_record(conn, proof_id)
    final_id, count = envelope.get("final_record_id"), envelope.get("record_count")
    if last_id != final_id or count != stored:
      raise HTTPException(409, f"cannot close: the server has {stored} records ending in "
                          f"{last_id.hex() if last_id else '-'}, the client announced {count} "
                          "ending in the final record; send the missing records first.")
    missing = [d for d in self.store.blob_digests(conn, proof_id) if not self.blobs.has(d)]
    if missing:
      raise HTTPException(409, f"cannot close: {len(missing)} referenced blobs are missing "
                          f"(first {missing[0]}); upload them first.")
    final = cbor2.loads(last)
    final_params = final.get("final_params") if isinstance(final, dict) else None
    self.store.set_proof_state(proof_id, "closed", conn=conn, final_params=(
        final_params.hex() if isinstance(final_params, bytes) else None))
    self.store.enqueue_job(conn, "proof", proof_id)
    return {"closed": True, "records": stored}

  # -- measurements ----------------------------------------------------------------

  async def create_measurement(self, request):
    body = await self.body(request)
    owner, name = request.path_params["owner"], request.path_params["name"]

    def create():
      exp = self.writable_experiment(request, owner, name)
      try:
        record = cbor2.loads(body)
        metric, value = record["metric"], record["value"]
        proof_id, checkpoint = record["proof_id"], record["checkpoint"]
        batches, openings = record["batches"], record["openings"]
        assert isinstance(metric, str) and _NAME.fullmatch(metric)
        assert isinstance(value, float) and isinstance(checkpoint, bytes)
        refs = [record["evaluate"], *record["params_blobs"],
                *[b for out in record["outputs"] for b in out],
                *[b for _, blobs in openings for b in blobs]]
        if record["aggregate"] is not None:
          refs.append(record["aggregate"])
        assert all(isinstance(b, bytes) and len(b) == 32 for b in refs)
      except (cbor2.CBORDecodeError, ValueError, KeyError, TypeError, AssertionError):
        raise HTTPException(400, "the body is not a measurement record (see "
                            "dvbench.measurement).") from None
      proof = self.store.proof(str(proof_id))
      if proof is None or proof["experiment_id"] != exp["id"]:
        raise HTTPException(404, f"proof {proof_id} is not a proof of {exp['full_name']}.")
      if proof["state"] != "verified" or proof["final_params"] != checkpoint.hex():
        raise HTTPException(409, f"the checkpoint is not the final state of a verified proof: "
                            f"proof {proof_id} is {proof['state']} with final params "
                            f"{proof['final_params']}.")
      missing = [b.hex() for b in refs if not self.blobs.has(b.hex())]
      if missing:
        raise HTTPException(409, f"{len(missing)} blobs are missing (first {missing[0]}); "
                            "upload them first.")
      return self.store.add_measurement({
          "id": transport.record_id(body).hex(), "experiment_id": exp["id"],
          "proof_id": proof_id, "metric": metric, "value": value,
          "higher_is_better": bool(record.get("higher_is_better", True)),
          "batches": len(batches), "sampled": len(openings), "checkpoint": checkpoint.hex(),
          "record": body})
    row = await run_in_threadpool(create)
    return JSONResponse({k: v for k, v in row.items() if k != "record"}, status_code=201)

  async def get_measurement(self, request):
    row = await run_in_threadpool(self.store.measurement, request.path_params["measurement_id"])
    if row is None:
      raise HTTPException(404, "unknown measurement.")
    return JSONResponse({k: v for k, v in row.items() if k != "record"})

  async def put_eval_set(self, request):
    metric = request.path_params["metric"]
    if not _NAME.fullmatch(metric):
      raise HTTPException(400, "metric names are 1-100 letters, digits, '.', '_' or '-'.")
    try:
      digests = json.loads(await self.body(request))["row_digests"]
      assert isinstance(digests, list) and all(
          isinstance(d, str) and self.blobs.valid_name(d) for d in digests)
    except (ValueError, KeyError, TypeError, AssertionError):
      raise HTTPException(400, "send JSON {\"row_digests\": [hex BLAKE3 of each row]}.") from None

    def put():
      owner = self.owner(request)
      if not self.store.set_eval_rows(metric, owner, digests):
        raise HTTPException(403, f"the evaluation set of {metric} belongs to another owner.")
    await run_in_threadpool(put)
    return JSONResponse({"metric": metric, "rows": len(set(digests))})

  # -- pages -----------------------------------------------------------------------

  async def index(self, request):
    experiments = await run_in_threadpool(self.store.list_experiments)
    proofs = await run_in_threadpool(self.store.list_proofs)
    return HTMLResponse(page.index(experiments, proofs))

  async def leaderboard(self, request):
    def gather():
      rows = self.store.list_measurements()
      metrics = sorted({r["metric"] for r in rows})
      return page.leaderboard(rows, self.store.check_counts(), self.store.probe_counts(),
                              {m: self.store.contamination(m) for m in metrics})
    return HTMLResponse(await run_in_threadpool(gather))

  async def proof_page(self, request):
    proof_id = request.path_params["proof_id"]

    def gather():
      proof = self.store.proof(proof_id)
      if proof is None:
        raise HTTPException(404, "unknown proof.")
      return page.proof(proof, self.store.proof_checks(proof_id),
                        self.store.probe_counts().get(proof_id, 0))
    return HTMLResponse(await run_in_threadpool(gather))

  async def health(self, request):
    return JSONResponse({"ok": True})


async def _http_error(request, exc: HTTPException):
  return JSONResponse({"error": exc.detail}, status_code=exc.status_code)


def create_app(store: Store, blobs: BlobStore,
               max_body: int = transport.MAX_BODY_BYTES) -> Starlette:
  api = _Api(store, blobs, max_body)
  routes = [
      Route("/", api.index),
      Route("/api/v1/health", api.health),
      Route("/api/v1/experiments", api.list_experiments, methods=["GET"]),
      Route("/api/v1/experiments", api.create_experiment, methods=["POST"]),
      Route("/api/v1/experiments/{owner}/{name}", api.get_experiment),
      Route("/api/v1/experiments/{owner}/{name}/proofs", api.create_proof, methods=["POST"]),
      Route("/api/v1/proofs/{proof_id}", api.get_proof),
      Route("/api/v1/proofs/{proof_id}/checks", api.get_checks),
      Route("/api/v1/proofs/{proof_id}/records", api.get_record_ids),
      Route("/api/v1/proofs/{proof_id}/stream", api.stream, methods=["POST"]),
      Route("/api/v1/proofs/{proof_id}/blobs/{digest}", api.put_blob, methods=["PUT"]),
      Route("/api/v1/blobs/{digest}", api.has_blob, methods=["HEAD", "GET"]),
      Route("/api/v1/experiments/{owner}/{name}/measurements", api.create_measurement,
            methods=["POST"]),
      Route("/api/v1/measurements/{measurement_id}", api.get_measurement),
      Route("/api/v1/metrics/{metric}/eval-set", api.put_eval_set, methods=["PUT"]),
      Route("/leaderboard", api.leaderboard),
      Route("/proofs/{proof_id}", api.proof_page),
      Mount("/static", StaticFiles(directory=pathlib.Path(page.__file__).parent / "static"),
            name="static"),
  ]
  return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
