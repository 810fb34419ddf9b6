"""Ingestion of the stream: envelopes of records, chunks and the close, each checked and
stored in bounded transactions (a large envelope in slices, ``EnvelopeJob``).

``Ingestion`` runs wherever the server puts it: in a worker thread of the web process,
or in an ingestion process (``ingest_processes``), so that decoding and storing
envelopes does not compete with reads for the web process's GIL.

Example::

  ingestion = Ingestion(store, signing_key)
  job = ingestion.begin(store.proof(proof_id), body)  # decoded, fields checked; or 4xx
  while (ack := job.step()) is None:  # a slice a transaction, others' writes in between
    pass
  ack  # {"seq", "stored", "duplicates", "challenges"}
"""

import json
import time

import blake3
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric import ed25519
from starlette.exceptions import HTTPException

from dvbench import transport
from dvbench.server import receipts
from dvbench.server import validation
from dvbench.server.custody import Ingest, ProofChallenger, first_unanswered, parse_record
from dvbench.server.decoding import decode
from dvbench.server.db import Store
from dvbench.server.store_custody import MISSING_COUNTED, RecordTooLarge
from zkdv.transcript import record_id
from zkdv.verify import claims

# One transaction of a large envelope: records are decoded and checked SLICE_RECORDS (or
# SLICE_BYTES) at a time, before the transaction, which stores them for SLICE_SECONDS at
# most; then it commits and the next writer, of any proof, gets its turn.
SLICE_RECORDS = 256
SLICE_BYTES = 1 << 20
SLICE_SECONDS = 0.1


CHUNKS_GONE = object()  # a record's chunks, joined by another envelope or dropped


class ChunksRefused(Exception):
  """Record ``record_id``, reassembled from its chunks, was refused (``refusal``): its
  chunks are dropped (else each resend of its last chunk would reassemble, hash, decode
  and check it all again)."""

  def __init__(self, refusal: HTTPException, record_id_: bytes):
    super().__init__(refusal.detail)
    self.refusal, self.record_id = refusal, record_id_


def parse_envelope(body: bytes) -> dict:
  """The envelope with its fields checked (a ``records`` envelope's records are checked
  slice by slice, ``EnvelopeJob``); 400 else."""
  try:
    return validation.check_envelope(decode(body, "the envelope"))
  except validation.Invalid as e:
    raise HTTPException(400, str(e)) from None


class Ingestion:
  """Each envelope in bounded transactions, so that a refused record writes nothing and a
  large envelope never holds the database for long (``EnvelopeJob``).

  Resending is idempotent, also after the proof was closed: records already stored are
  acknowledged as duplicates and a close matching the stored records as closed; anything
  new for a proof that is not ``receiving`` is refused (409). A client's ``seq`` names
  one envelope: the exact resend of its last acknowledged envelope gets that
  acknowledgement again, any other envelope under a used ``seq`` is refused (409).
  """

  def __init__(self, store: Store, signing_key: ed25519.Ed25519PrivateKey):
    self.store, self.signing_key = store, signing_key

  def begin(self, proof: dict, body: bytes) -> "EnvelopeJob":
    """Envelope ``body`` for ``proof`` (a row of ``Store.proof``), decoded and its fields
    checked (HTTPException when refused); ``step()`` stores it, a slice a call."""
    return EnvelopeJob(self, proof, body)

  def chunk(self, ingest: Ingest, envelope: dict, parsed=None) -> dict | None:
    """Stores a chunk: its acknowledgement, or None once the record's last chunk is here
    (the record is then joined, hashed, decoded and checked outside any transaction,
    ``parse_chunked``, and stored by this again with ``parsed``: 409 when its chunks were
    gone, ``CHUNKS_GONE``, unless another envelope stored the record meanwhile)."""
    rid, idx, count, data = (envelope[k] for k in ("record_id", "index", "count", "data"))
    if self.store.record_position(ingest.conn, ingest.proof_id, rid) is not None:
      # a resend after the record was stored: acknowledged, nothing written
      return {"chunk": idx, "of": count, "stored": 0, "duplicates": 1, "challenges": []}
    ingest.check_receiving()
    if parsed is CHUNKS_GONE:
      raise HTTPException(409, f"the chunks of record {rid.hex()} were dropped (a chunk of "
                          "another record came meanwhile): send every chunk of it again.")
    if parsed is not None:
      try:
        ingest.take(parsed[0], parsed[1], rid, 0)  # not stored: looked up above
      except HTTPException as e:  # the chunks go, so a resent last chunk costs its bytes
        raise ChunksRefused(e, rid) from None
      self.store.drop_chunks(ingest.conn, ingest.proof_id, rid)
      return {"chunk": idx, "of": count, **ingest.ack()}
    try:
      whole = self.store.put_chunk(ingest.conn, ingest.proof_id, rid, idx, count, data,
                                   transport.MAX_RECORD_BYTES)
    except RecordTooLarge as e:
      raise HTTPException(413, f"{e} Records are at most that large.") from None
    return None if whole else {"chunk": idx, "of": count}

  def parse_chunked(self, proof_id: str, envelope: dict):
    """(raw, checked record) of the record whose last chunk ``envelope`` stored; read,
    hashed and decoded outside the write transaction. ``CHUNKS_GONE`` when its chunks are
    no longer there (stored by a resend of this envelope, or dropped), ChunksRefused when
    refused."""
    rid = envelope["record_id"]
    with self.store.engine.connect() as conn:
      whole = self.store.chunked_record(conn, proof_id, rid, envelope["count"])
    if whole is None:
      return CHUNKS_GONE
    try:
      if record_id(whole) != rid:
        raise HTTPException(400, "the reassembled chunks do not hash to record_id; its "
                            "chunks were dropped: send every chunk of the record again.")
      return whole, parse_record(whole, 0)
    except HTTPException as e:
      raise ChunksRefused(e, rid) from None

  def close(self, ingest: Ingest, envelope: dict) -> dict:
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
    failure = first_unanswered(self.store, conn, proof_id)
    if failure is not None:
      self.store.set_proof_state(proof_id, "invalid", failure, conn=conn)
      receipts.issue(self.store, self.signing_key, proof_id, "invalid", 0, conn,
                     standing=claims.Standing(claims.INVALID))
      return {"closed": True, "records": head.records, "state": "invalid", "failure": failure}
    missing, first = self.store.missing_blobs(conn, proof_id)
    if missing:
      many = (f"more than {MISSING_COUNTED}" if missing > MISSING_COUNTED else str(missing))
      raise HTTPException(409, f"cannot close: {many} referenced blobs were not "
                          f"uploaded for this proof (first {first}); upload them with "
                          f"PUT /api/v1/proofs/{proof_id}/blobs/DIGEST first.")
    final = decode(self.store.last_record(conn, proof_id)[2], "the final record")
    final_params = final.get("final_params")
    self.store.set_proof_state(proof_id, "closed", conn=conn, final_params=(
        final_params.hex() if isinstance(final_params, bytes) else None))
    self.store.enqueue_job(conn, "proof", proof_id)
    return {"closed": True, "records": head.records, "state": "closed"}


def _stream_entry(ack: dict, digest: str) -> str:
  """What the stream keeps of its last envelope: the envelope's BLAKE3, first (an exact
  resend is told apart from another envelope under the same seq by the entry's head), and
  the acknowledgement."""
  return json.dumps({"envelope": digest, "ack": ack})


def _entry_digest(head: str) -> str | None:
  """The envelope digest an entry's head starts with; None for an entry that does not
  start with it (written by an older server: the whole entry says)."""
  prefix = '{"envelope": "'
  return head[len(prefix):len(prefix) + 64] if head.startswith(prefix) else None


class EnvelopeJob:
  """One envelope being stored: ``step()`` runs one bounded transaction and returns None
  while records are left, then the acknowledgement.

  Each transaction stores whole records in chain order and commits them; a record
  refused in a later slice leaves the earlier ones stored and unacknowledged (its
  resend counts them as duplicates). The stream advances with the last slice.

  Example::

    job = ingestion.begin(proof, body)
    while (ack := job.step()) is None:
      pass  # another writer may take the database here
  """

  def __init__(self, ingestion: Ingestion, proof: dict, body: bytes):
    self.ingestion, self.store = ingestion, ingestion.store
    self.envelope = parse_envelope(body)
    self.digest = blake3.blake3(body).hexdigest()
    self.proof_id, self.seq = proof["id"], self.envelope["seq"]
    self.client_id = self.envelope["client_id"]
    self.challenger = ProofChallenger.of(self.store, self.proof_id)
    self.raws = self.envelope["records"] if self.envelope["kind"] == "records" else []
    self.parsed: list[tuple[bytes, dict, bytes]] = []  # decoded, checked, not yet stored
    self.taken = 0  # records of the envelope stored or counted as duplicates
    self.totals = {"stored": 0, "duplicates": 0}
    self.challenges: dict[int, dict] = {}
    self.chunked = None  # (raw, record) of a record whose last chunk this envelope stored,
    # or CHUNKS_GONE

  def step(self) -> dict | None:
    try:
      return self._step()
    except ChunksRefused as e:  # its transaction rolled back: dropped in one of their own
      with self.store.engine.begin() as conn:
        self.store.drop_chunks(conn, self.proof_id, e.record_id)
      raise e.refusal from None
    except sa.exc.IntegrityError:  # not expected: writes hold the write lock
      raise HTTPException(503, "another envelope of this proof was stored at the same "
                          "time; resend this one (what it stored is kept).") from None

  def _step(self) -> dict | None:
    kind = self.envelope["kind"]
    if kind == "records" and not self.parsed:
      self._parse_slice()
    elif kind == "chunk" and self.chunked is False:  # its last chunk was stored: the record
      self.chunked = self.ingestion.parse_chunked(self.proof_id, self.envelope)
    with self.store.engine.begin() as conn:
      expected, head = self.store.stream_position(conn, self.proof_id, self.client_id)
      if self.seq < expected:
        return self._resent(conn, expected, head)
      if self.seq > expected:
        raise HTTPException(409, f"envelope seq {self.seq} out of order: expected {expected} "
                            f"for client {self.client_id}.")
      ingest = Ingest(self.store, conn, self.proof_id, self.challenger)
      if kind == "records":
        ack = self._records(ingest)
        if ack is None:
          return None
      elif kind == "chunk":
        ack = self.ingestion.chunk(ingest, self.envelope, self.chunked or None)
        if ack is None:  # the last chunk, stored: the record is parsed before it is taken
          self.chunked = False
          return None
      else:
        ack = self.ingestion.close(ingest, self.envelope)
      ack = {**ack, "seq": self.seq}
      self.store.advance_stream(conn, self.proof_id, self.client_id, self.seq,
                                _stream_entry(ack, self.digest))
    return ack

  def _parse_slice(self) -> None:
    size, n = 0, self.taken
    while n < len(self.raws) and n - self.taken < SLICE_RECORDS and size < SLICE_BYTES:
      raw = self.raws[n]
      self.parsed.append((raw, parse_record(raw, n), record_id(raw)))
      size += len(raw) if isinstance(raw, bytes) else 0
      n += 1

  def _records(self, ingest: Ingest) -> dict | None:
    """Stores parsed records for up to ``SLICE_SECONDS``; the acknowledgement once every
    record of the envelope is taken, else None."""
    deadline = time.monotonic() + SLICE_SECONDS
    ingest.expect(rid for _, _, rid in self.parsed)
    done = 0
    for raw, record, rid in self.parsed:
      ingest.take(raw, record, rid, self.taken + done)
      done += 1
      if time.monotonic() > deadline:
        break
    part = ingest.ack()
    self.parsed = self.parsed[done:]
    self.taken += done
    for name in self.totals:
      self.totals[name] += part[name]
    self.challenges.update((c["step"], c) for c in part["challenges"])
    if self.taken < len(self.raws):
      return None
    return {**self.totals, "challenges": [self.challenges[s] for s in sorted(self.challenges)]}

  def _resent(self, conn, expected: int, head: str) -> dict:
    """The earlier acknowledgement of this exact envelope; 409 for any other envelope
    under a seq that was used (told by the entry's head: the acknowledgement, as large as
    its envelope's, is read only for the exact resend)."""
    entry = {}
    if self.seq == expected - 1 and _entry_digest(head) in (None, self.digest):
      entry = json.loads(self.store.stream_entry(conn, self.proof_id, self.client_id))
    if entry.get("envelope") == self.digest:
      return {**entry["ack"], "duplicate": True}
    what = (f"envelope seq {self.seq} of client {self.client_id} was used by another "
            if self.seq == expected - 1 else
            f"envelope seq {self.seq} of client {self.client_id} was used before seq "
            f"{expected - 1} (only the last envelope can be resent) by an ")
    raise HTTPException(409, f"{what}envelope, acknowledged already; a seq is never reused: "
                        f"send new records under seq {expected}.")
