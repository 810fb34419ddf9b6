"""The stream: acknowledged envelopes of records, chunks and the close.

Example::

  routes = stream_routes(service)  # POST /api/v1/proofs/{proof_id}/stream
"""

import json

import sqlalchemy as sa
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.routing import Route

from dvbench import transport
from dvbench.server import receipts
from dvbench.server.custody import Ingest, ProofChallenger
from dvbench.server.service import Service, decode
from zkdv.transcript import record_id

_MAX_CHUNKS = 65536
_CHECK_NAMES = {"update": "an update check", "state": "a state check", "probe": "probes"}


def _envelope(body: bytes) -> dict:
  envelope = decode(body, "the envelope")
  if not isinstance(envelope, dict):
    raise HTTPException(400, "the envelope must be a CBOR map.")
  client_id, seq, kind = envelope.get("client_id"), envelope.get("seq"), envelope.get("kind")
  if not (isinstance(client_id, str) and 0 < len(client_id) <= 64):
    raise HTTPException(400, "envelope.client_id must be a string of 1-64 characters.")
  if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
    raise HTTPException(400, "envelope.seq must be an integer >= 0.")
  if kind not in transport.ENVELOPE_KINDS:
    raise HTTPException(400, f"envelope.kind must be one of {transport.ENVELOPE_KINDS}.")
  return envelope


def unanswered_failure(rows: list[dict]) -> str | None:
  """Names the first derived challenge without an answering check record, if any."""
  missing = [(r["step"], k) for r in rows for k in _CHECK_NAMES
             if r[f"needs_{k}"] and not r[f"answered_{k}"]]
  if not missing:
    return None
  step, kind = missing[0]
  more = f" ({len(missing) - 1} more challenges unanswered)" if len(missing) > 1 else ""
  return f"step {step} was challenged for {_CHECK_NAMES[kind]} and never answered{more}."


class StreamRoutes:
  """Ingestion: one transaction per envelope, so a refused envelope writes nothing."""

  def __init__(self, service: Service):
    self.service, self.store = service, service.store
    self._kinds = {"records": self._records, "chunk": self._chunk, "close": self._close}

  async def stream(self, request):
    envelope = _envelope(await self.service.body(request))
    try:
      return JSONResponse(await run_in_threadpool(self._ingest, request, envelope))
    except sa.exc.IntegrityError:  # another envelope took the same position meanwhile
      raise HTTPException(503, "another envelope of this proof was stored at the same "
                          "time; resend this one (nothing of it was kept).") from None

  def _ingest(self, request, envelope) -> dict:
    proof = self.service.proof_for_write(request, request.path_params["proof_id"])
    proof_id, client_id, seq = proof["id"], envelope["client_id"], envelope["seq"]
    challenger = ProofChallenger.of(self.store, proof_id)
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
      ingest = Ingest(self.store, conn, proof_id, challenger)
      ack = {**self._kinds[envelope["kind"]](ingest, envelope), "seq": seq}
      self.store.advance_stream(conn, proof_id, client_id, seq, json.dumps(ack))
    return ack

  def _records(self, ingest: Ingest, envelope: dict) -> dict:
    raws = envelope.get("records")
    if not isinstance(raws, list):
      raise HTTPException(400, "envelope.records must be a list of encoded records.")
    for n, raw in enumerate(raws):
      ingest.take(raw, n)
    return ingest.ack()

  def _chunk(self, ingest: Ingest, envelope: dict) -> dict:
    rid, idx, count, data = (envelope.get(k) for k in ("record_id", "index", "count", "data"))
    if not (isinstance(rid, bytes) and len(rid) == 32 and isinstance(data, bytes)
            and isinstance(idx, int) and isinstance(count, int)
            and 0 <= idx < count <= _MAX_CHUNKS):
      raise HTTPException(400, "a chunk carries record_id (32 bytes), index < count, data.")
    whole = self.store.put_chunk(ingest.conn, ingest.proof_id, rid, idx, count, data)
    if whole is None:
      return {"chunk": idx, "of": count}
    if record_id(whole) != rid:
      raise HTTPException(400, "the reassembled chunks do not hash to record_id.")
    ingest.take(whole, 0)
    return {"chunk": idx, "of": count, **ingest.ack()}

  def _close(self, ingest: Ingest, envelope: dict) -> dict:
    head, conn, proof_id = ingest.head, ingest.conn, ingest.proof_id
    final_id, count = envelope.get("final_record_id"), envelope.get("record_count")
    if head.last_id != final_id or count != head.records:
      raise HTTPException(409, f"cannot close: the server has {head.records} records ending in "
                          f"{head.last_id.hex()}, the client announced {count!r} ending in "
                          "the final record; send the missing records first.")
    if head.last_kind != "final":
      raise HTTPException(409, "cannot close: the last stored record is a "
                          f"{head.last_kind} record; a proof closes after its final record.")
    failure = unanswered_failure(self.store.challenges_of(conn, proof_id))
    if failure is not None:
      self.store.set_proof_state(proof_id, "invalid", failure, conn=conn)
      receipts.issue(self.store, self.service.signing_key, proof_id, "invalid", 0, conn)
      return {"closed": True, "records": head.records, "state": "invalid", "failure": failure}
    missing = self.store.missing_blobs(conn, proof_id)
    if missing:
      raise HTTPException(409, f"cannot close: {len(missing)} referenced blobs were not "
                          f"uploaded for this proof (first {missing[0]}); upload them with "
                          f"PUT /api/v1/proofs/{proof_id}/blobs/DIGEST first.")
    final = decode(self.store.last_record(conn, proof_id)[2], "the final record")
    final_params = final.get("final_params")
    self.store.set_proof_state(proof_id, "closed", conn=conn, final_params=(
        final_params.hex() if isinstance(final_params, bytes) else None))
    self.store.enqueue_job(conn, "proof", proof_id)
    return {"closed": True, "records": head.records, "state": "closed"}


def stream_routes(service: Service) -> list[Route]:
  api = StreamRoutes(service)
  return [Route("/api/v1/proofs/{proof_id}/stream", api.stream, methods=["POST"],
                name="proof_stream")]
