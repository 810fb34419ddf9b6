"""Ingestion of the stream: envelopes of records, chunks and the close, each checked and
stored in one transaction.

``Ingestion`` runs wherever the server puts it: in a worker thread of the web process,
or in an ingestion process (``ingest_processes``), so that decoding and storing
envelopes does not compete with reads for the web process's GIL.

Example::

  ingestion = Ingestion(store, signing_key)
  ack = ingestion.ingest(store.proof(proof_id), body)  # {"seq", "stored", ...}; or 4xx
"""

import json

import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric import ed25519
from starlette.exceptions import HTTPException

from dvbench import transport
from dvbench.server import receipts
from dvbench.server import validation
from dvbench.server.decoding import decode
from dvbench.server.custody import Ingest, ProofChallenger, parse_record, parse_records
from dvbench.server.db import Store
from dvbench.server.store_custody import RecordTooLarge
from zkdv.transcript import record_id
from zkdv.verify import claims

_CHECK_NAMES = {"update": "an update check", "state": "a state check", "probe": "probes"}


def parse_envelope(body: bytes) -> dict:
  """The envelope with its fields (and, for ``records``, every record) checked; 400 else."""
  try:
    envelope = validation.check_envelope(decode(body, "the envelope"))
  except validation.Invalid as e:
    raise HTTPException(400, str(e)) from None
  if envelope["kind"] == "records":
    envelope["records"] = parse_records(envelope["records"])
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


class Ingestion:
  """One transaction per envelope, so a refused envelope writes nothing.

  Resending is idempotent, also after the proof was closed: records already stored are
  acknowledged as duplicates and a close matching the stored records as closed; anything
  new for a proof that is not ``receiving`` is refused (409).
  """

  def __init__(self, store: Store, signing_key: ed25519.Ed25519PrivateKey):
    self.store, self.signing_key = store, signing_key
    self._kinds = {"records": self._records, "chunk": self._chunk, "close": self._close}

  def ingest(self, proof: dict, body: bytes) -> dict:
    """The acknowledgement of envelope ``body`` for ``proof`` (a row of ``Store.proof``);
    HTTPException when it is refused."""
    try:
      return self._ingest(proof, body)
    except sa.exc.IntegrityError:  # not expected: writes hold the write lock
      raise HTTPException(503, "another envelope of this proof was stored at the same "
                          "time; resend this one (nothing of it was kept).") from None

  def _ingest(self, proof: dict, body: bytes) -> dict:
    envelope = parse_envelope(body)
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
      ingest = Ingest(self.store, conn, proof_id, challenger)
      ack = {**self._kinds[envelope["kind"]](ingest, envelope), "seq": seq}
      self.store.advance_stream(conn, proof_id, client_id, seq, json.dumps(ack))
    return ack

  def _records(self, ingest: Ingest, envelope: dict) -> dict:
    ingest.expect(raw for raw, _ in envelope["records"])
    for n, (raw, record) in enumerate(envelope["records"]):
      ingest.take(raw, record, n)
    return ingest.ack()

  def _chunk(self, ingest: Ingest, envelope: dict) -> dict:
    rid, idx, count, data = (envelope[k] for k in ("record_id", "index", "count", "data"))
    if self.store.record_position(ingest.conn, ingest.proof_id, rid) is not None:
      return {"chunk": idx, "of": count, "stored": 0, "duplicates": 1, "challenges": []}
    ingest.check_receiving()
    try:
      whole = self.store.put_chunk(ingest.conn, ingest.proof_id, rid, idx, count, data,
                                   transport.MAX_RECORD_BYTES)
    except RecordTooLarge as e:
      raise HTTPException(413, f"{e} Records are at most that large.") from None
    if whole is None:
      return {"chunk": idx, "of": count}
    if record_id(whole) != rid:
      raise HTTPException(400, "the reassembled chunks do not hash to record_id.")
    ingest.take(whole, parse_record(whole, 0), 0)  # not stored: looked up above
    return {"chunk": idx, "of": count, **ingest.ack()}

  def _close(self, ingest: Ingest, envelope: dict) -> dict:
    head, conn, proof_id = ingest.head, ingest.conn, ingest.proof_id
    final_id, count = envelope["final_record_id"], envelope["record_count"]
    closed_again = head.last_id == final_id and count == head.records
    if head.state != "receiving" and closed_again:  # another client closed it meanwhile
      return {"closed": True, "records": head.records, "state": head.state}
    ingest.check_receiving()
    if not closed_again:
      raise HTTPException(409, f"cannot close: the server has {head.records} records ending in "
                          f"{head.last_id.hex()}, the client announced {count!r} ending in "
                          "the final record; send the missing records first.")
    if head.last_kind != "final":
      raise HTTPException(409, "cannot close: the last stored record is a "
                          f"{head.last_kind} record; a proof closes after its final record.")
    failure = unanswered_failure(self.store.challenges_of(conn, proof_id))
    if failure is not None:
      self.store.set_proof_state(proof_id, "invalid", failure, conn=conn)
      receipts.issue(self.store, self.signing_key, proof_id, "invalid", 0, conn,
                     standing=claims.Standing(claims.INVALID))
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
