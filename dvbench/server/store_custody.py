"""Queries of custody: the stream, stored records, slots, challenges, blobs per proof, receipts.

A mixin of ``db.Store``. Example::

  with store.engine.begin() as conn:
    head = store.custody_head(conn, proof_id)
"""

import dataclasses
import time

import cbor2
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as postgresql_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect

from dvbench.server.record_bodies import OUT_OF_LINE_BYTES
from dvbench.server.schema import (blob_refs, challengers, challenges, chunks, discarded_steps,
                                   proof_blobs, proofs, receipts, records, slots, streams)
from zkdv import challenge


def unanswered():
  """The clause of a challenge row that needs a check no record answered yet."""
  return sa.or_(*(challenges.c[f"needs_{k}"] & ~challenges.c[f"answered_{k}"]
                  for k in challenge.ANSWER_KINDS))


# The columns a stored record's body is read from (``CustodyQueries.body``), and its size.
BODY = (records.c.record_id, records.c.data, records.c.body_offset, records.c.body_size)
BODY_SIZE = sa.func.coalesce(records.c.body_size, sa.func.length(records.c.data))
_INSERTS = {"sqlite": sqlite_dialect.insert, "postgresql": postgresql_dialect.insert}
# A transcript read in pages of at most this many bytes (one record at least) and records.
RECORD_PAGE_BYTES = 8 << 20
MISSING_COUNTED = 1000  # missing blobs a refused close counts (``missing_blobs``)
RECORD_PAGE_ROWS = 4096


def insert_ignoring(conn, table):
  """An insert into ``table`` that skips each row whose primary key exists."""
  return _INSERTS[conn.dialect.name](table).on_conflict_do_nothing()


def add_proof_digests(conn, table, proof_id: str, digests: set[str]) -> None:
  """Adds to ``table`` (``proof_id``, ``digest`` rows, its primary key) the ``digests`` it
  does not hold for the proof yet, e.g. the blobs its records name or the rows its probes
  opened: one statement, each row skipped where the key exists (no lookup first: 290
  digests an acknowledgement took 1.7 ms, now 1.1)."""
  if digests:
    conn.execute(insert_ignoring(conn, table),
                 [{"proof_id": proof_id, "digest": d} for d in sorted(digests)])


# The statements an envelope runs, built once with bound parameters: building a statement
# (its clauses and cache key) cost more CPU than running it, about 150 us of a stream
# position's 195 (benchmarks/RESULTS.md).
_P = sa.bindparam
_OF_STREAM = (streams.c.proof_id == _P("proof")) & (streams.c.client_id == _P("client"))
# A stream's next seq and the head of its last entry (``STREAM_HEAD`` characters: the
# envelope's digest comes first), not the acknowledgement, which grows with the envelope.
STREAM_HEAD = 80
_STREAM_POSITION = sa.select(streams.c.next_seq,
                             sa.func.substr(streams.c.last_ack, 1, STREAM_HEAD)).where(_OF_STREAM)
_STREAM_ENTRY = sa.select(streams.c.last_ack).where(_OF_STREAM)
_ADVANCE_STREAM = streams.update().where(_OF_STREAM).values(
    next_seq=_P("new_seq"), last_ack=_P("new_ack"))
_HEAD = sa.select(proofs.c.records, proofs.c.steps, proofs.c.state, proofs.c.probed_rows,
                  proofs.c.body_end).where(proofs.c.id == _P("proof"))
_RECORD_AT = sa.select(records.c.record_id, records.c.kind).where(
    (records.c.proof_id == _P("proof")) & (records.c.position == _P("at")))
_RECORD_POSITIONS = sa.select(records.c.record_id, records.c.position).where(
    (records.c.proof_id == _P("proof")) & records.c.record_id.in_(_P("ids", expanding=True)))
_TAIL = sa.select(records.c.kind, *BODY).where(
    (records.c.proof_id == _P("proof")) & records.c.kind.in_(("step", "resume"))
).order_by(records.c.position.desc()).limit(_P("limit"))
_ADVANCE_HEAD = proofs.update().where(proofs.c.id == _P("proof")).values(
    records=_P("new_records"), steps=_P("new_steps"), probed_rows=_P("new_probed_rows"),
    body_end=_P("new_body_end"), updated_at=_P("now"))
_ANSWER = {kind: challenges.update().where(
    (challenges.c.proof_id == _P("proof")) & challenges.c.step.in_(_P("steps", expanding=True))
    & ~challenges.c[f"answered_{kind}"]).values({f"answered_{kind}": True}
                                                ).returning(challenges.c.step)
           for kind in challenge.ANSWER_KINDS}
_CHALLENGER = (sa.select(challengers, slots.c.challenge_key, slots.c.policy.label("slot_policy"))
               .select_from(challengers.outerjoin(slots, slots.c.nonce == challengers.c.nonce))
               .where(challengers.c.proof_id == _P("proof")))


def _of_steps(proof_id: str, through: int | None):
  """The clause of a proof's challenge rows: of every step (``through`` None), or of the
  steps up to ``through`` that no resume discarded."""
  clause = challenges.c.proof_id == proof_id
  if through is None:
    return clause
  return clause & (challenges.c.step <= through) & challenges.c.step.not_in(
      sa.select(discarded_steps.c.step).where(discarded_steps.c.proof_id == proof_id))


class RecordTooLarge(ValueError):
  """A chunked record larger than the server takes."""


class SlotTaken(ValueError):
  """The nonce was not issued to this experiment, or a root already used it."""


@dataclasses.dataclass(frozen=True)
class CustodyHead:
  """Where a proof's stored records end."""

  records: int
  steps: int
  last_id: bytes
  last_kind: str
  state: str = "receiving"  # the proof's state, read in the same transaction
  probed_rows: int = 0  # the batch rows its probe records opened
  body_end: int = 0  # the bytes of its records file its stored records cover


def has_held_blob(engine, holder_column, holder, digest: str, conn=None) -> bool:
  """Whether ``digest`` was uploaded for ``holder`` (a proof or a benchmark), in the table
  of ``holder_column`` (which has a ``digest`` column)."""
  table = holder_column.table
  query = sa.select(table.c.digest).where((holder_column == holder) & (table.c.digest == digest))
  if conn is not None:
    return conn.execute(query).first() is not None
  with engine.connect() as c:
    return c.execute(query).first() is not None


def add_held_blob(engine, holder_column, holder, *digests: str) -> None:
  """Records that each of ``digests`` was uploaded for ``holder`` (once), in one transaction."""
  with engine.begin() as conn:
    for digest in dict.fromkeys(digests):
      if not has_held_blob(engine, holder_column, holder, digest, conn):
        conn.execute(holder_column.table.insert().values(
            {holder_column.name: holder, "digest": digest}))


class CustodyQueries:
  """Append-only records, one per position, and everything derived from them."""

  # -- the stream --------------------------------------------------------------------

  def stream_position(self, conn, proof_id: str, client_id: str) -> tuple[int, str | None]:
    """(the client's next seq, the first ``STREAM_HEAD`` characters of its last entry)."""
    row = conn.execute(_STREAM_POSITION, {"proof": proof_id, "client": client_id}).first()
    return (row[0], row[1]) if row else (0, None)

  def stream_entry(self, conn, proof_id: str, client_id: str) -> str:
    """The client's last entry whole (``advance_stream``'s ``ack``)."""
    return conn.execute(_STREAM_ENTRY, {"proof": proof_id, "client": client_id}).scalar()

  def advance_stream(self, conn, proof_id: str, client_id: str, seq: int, ack: str) -> None:
    if seq == 0:
      conn.execute(streams.insert().values(proof_id=proof_id, client_id=client_id,
                                           next_seq=1, last_ack=ack))
    else:
      conn.execute(_ADVANCE_STREAM, {"proof": proof_id, "client": client_id,
                                     "new_seq": seq + 1, "new_ack": ack})

  def put_chunk(self, conn, proof_id: str, record_id: bytes, idx: int, count: int,
                data: bytes, max_bytes: int) -> bool:
    """Stores a chunk (a resent one replaces the one before, so a corrupted chunk can be
    mended); True once chunks ``0 .. count - 1`` are here (``chunked_record`` reads them,
    ``drop_chunks`` drops them once the record is stored or refused).

    A proof holds the chunks of one incomplete record, the one being sent: records are
    sent in chain order, so the chunks of any other are of a record that was given up
    (its client crashed and sent another, or never meant to finish it) and are dropped.

    Raises RecordTooLarge when the record's chunks would exceed ``max_bytes``.
    """
    conn.execute(chunks.delete().where((chunks.c.proof_id == proof_id)
                                       & (chunks.c.record_id != record_id)))
    of_record = (chunks.c.proof_id == proof_id) & (chunks.c.record_id == record_id)
    held = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(sa.func.length(chunks.c.data)),
                                                   0)).where(of_record & (chunks.c.idx != idx))
                        ).scalar()
    if held + len(data) > max_bytes:
      raise RecordTooLarge(f"the chunks of record {record_id.hex()} exceed {max_bytes} bytes.")
    conn.execute(chunks.delete().where(of_record & (chunks.c.idx == idx)))
    conn.execute(chunks.insert().values(proof_id=proof_id, record_id=record_id, idx=idx,
                                        count=count, data=data))
    present = of_record & (chunks.c.idx < count)  # counted, not read: a chunk costs its bytes
    return conn.execute(sa.select(sa.func.count()).where(present)).scalar() >= count

  def chunked_record(self, conn, proof_id: str, record_id: bytes, count: int) -> bytes | None:
    """Record ``record_id`` of a proof joined from its chunks ``0 .. count - 1``; None
    when they are no longer all here."""
    of_record = ((chunks.c.proof_id == proof_id) & (chunks.c.record_id == record_id)
                 & (chunks.c.idx < count))
    parts = conn.execute(sa.select(chunks.c.data).where(of_record).order_by(chunks.c.idx)).all()
    return b"".join(p[0] for p in parts) if len(parts) == count else None

  def drop_chunks(self, conn, proof_id: str, record_id: bytes) -> None:
    """Drops the chunks of record ``record_id`` of a proof (refused once whole)."""
    conn.execute(chunks.delete().where((chunks.c.proof_id == proof_id)
                                       & (chunks.c.record_id == record_id)))

  def last_record(self, conn, proof_id: str) -> tuple[int, bytes | None, bytes | None]:
    """(record count, id and bytes of the last record) of a proof."""
    row = conn.execute(sa.select(records.c.position, *BODY)
                       .where(records.c.proof_id == proof_id)
                       .order_by(records.c.position.desc()).limit(1)).first()
    return (0, None, None) if row is None else (row[0] + 1, row[1], self.body(proof_id, *row[1:]))

  def custody_head(self, conn, proof_id: str) -> CustodyHead:
    count, steps, state, probed, end = conn.execute(_HEAD, {"proof": proof_id}).first()
    last_id, last_kind = conn.execute(_RECORD_AT, {"proof": proof_id, "at": count - 1}).first()
    return CustodyHead(count, steps, last_id, last_kind, state, probed, end or 0)

  def record_position(self, conn, proof_id: str, record_id: bytes) -> int | None:
    return conn.execute(sa.select(records.c.position).where(
        (records.c.proof_id == proof_id) & (records.c.record_id == record_id))).scalar()

  def record_positions(self, conn, proof_id: str, record_ids) -> dict[bytes, int]:
    """Positions of those of ``record_ids`` the proof stores (one query per 500 ids)."""
    ids, found = sorted(set(record_ids)), {}
    for i in range(0, len(ids), 500):
      found.update(conn.execute(_RECORD_POSITIONS,
                                {"proof": proof_id, "ids": ids[i:i + 500]}).all())
    return found

  def segment_tail(self, conn, proof_id: str, limit: int) -> tuple[int, int | None]:
    """What the proof's stored tail says of its segments, in one read of at most ``limit``
    + 1 step and resume records (a segment holds at most ``limit`` steps): how many of the
    last stored steps carry no ``post_state`` (the open segment's, at most ``limit``; a
    ``resume`` starts a new one), and the index of the last step whose committed
    post-state a run goes on from (the last step carrying a ``post_state``, or the
    ``after`` of a ``resume`` stored after it; None when no step committed one)."""
    rows = conn.execute(_TAIL, {"proof": proof_id, "limit": limit + 1}).all()
    open_steps = 0
    for kind, *body in rows:  # stored records were decoded and checked at ingestion
      record = cbor2.loads(self.body(proof_id, *body))
      if kind == "resume":
        return min(open_steps, limit), record["after"]
      if isinstance(record.get("post_state"), bytes):
        return min(open_steps, limit), record["index"]
      open_steps += 1
    return min(open_steps, limit), None

  def step_record(self, conn, proof_id: str, index: int) -> dict | None:
    """The stored record of step ``index``, decoded; None when it is not stored."""
    row = conn.execute(sa.select(*BODY).where(
        (records.c.proof_id == proof_id) & (records.c.kind == "step"))
                       .order_by(records.c.position).offset(index).limit(1)).first()
    return None if row is None else cbor2.loads(self.body(proof_id, *row))

  def append_records(self, conn, proof_id: str, head: CustodyHead,
                     new: list[tuple[bytes, str, bytes]]) -> int:
    """Stores ``new`` (record id, kind, bytes) after the ones stored; ``head`` is the head
    with them (records, steps, probed rows). Returns where the proof's records file ends
    now (``record_bodies``: a body over ``OUT_OF_LINE_BYTES`` is written there)."""
    if not new:
      return head.body_end
    first, end = head.records - len(new), head.body_end
    rows = [{"proof_id": proof_id, "position": first + i, "record_id": rid, "kind": kind,
             "data": data, "body_offset": None, "body_size": None}
            for i, (rid, kind, data) in enumerate(new)]
    large = [row for row in rows if len(row["data"]) > OUT_OF_LINE_BYTES] if self.bodies else []
    if large:
      offsets = self.bodies.write(proof_id, end, [row["data"] for row in large])
      for row, offset in zip(large, offsets):
        row.update(data=b"", body_offset=offset, body_size=len(row["data"]))
      end = offsets[-1] + large[-1]["body_size"]
    conn.execute(records.insert(), rows)
    conn.execute(_ADVANCE_HEAD, {"proof": proof_id, "new_records": head.records,
                                 "new_steps": head.steps, "new_probed_rows": head.probed_rows,
                                 "new_body_end": end, "now": time.time()})
    return end

  def add_blob_refs(self, conn, proof_id: str, digests: set[str]) -> None:
    add_proof_digests(conn, blob_refs, proof_id, digests)

  # -- slots and challengers -----------------------------------------------------------

  def create_slot(self, nonce: str, experiment_id: int, challenge_key: bytes,
                  policy: str) -> None:
    with self.engine.begin() as conn:
      conn.execute(slots.insert().values(nonce=nonce, experiment_id=experiment_id,
                                         challenge_key=challenge_key, policy=policy,
                                         created_at=time.time()))

  def slot(self, nonce: str) -> dict | None:
    with self.engine.connect() as conn:
      row = conn.execute(sa.select(slots).where(slots.c.nonce == nonce)).mappings().first()
    return dict(row) if row else None

  def take_slot(self, conn, nonce: str, experiment_id: int, proof_id: str) -> None:
    taken = conn.execute(slots.update().where(
        (slots.c.nonce == nonce) & (slots.c.experiment_id == experiment_id)
        & slots.c.proof_id.is_(None)).values(proof_id=proof_id))
    if taken.rowcount != 1:
      raise SlotTaken(f"nonce {nonce} is not an unused nonce of this experiment.")

  def challenger(self, proof_id: str) -> dict | None:
    """``{"kind", "nonce", "policy", "challenge_key", "slot_policy"}`` of a proof."""
    with self.engine.connect() as conn:
      row = conn.execute(_CHALLENGER, {"proof": proof_id}).mappings().first()
    return dict(row) if row else None

  # -- challenges ------------------------------------------------------------------------

  def add_challenges(self, conn, rows: list[dict]) -> None:
    """Stores new steps' derived challenges (``custody.challenge_row``s), in one statement."""
    if rows:
      conn.execute(challenges.insert(), rows)

  @staticmethod
  def add_discarded(conn, proof_id: str, steps) -> None:
    """Stores ``steps`` as discarded by a resume of the proof (each once)."""
    if steps:
      conn.execute(insert_ignoring(conn, discarded_steps),
                   [{"proof_id": proof_id, "step": s} for s in sorted(set(steps))])

  def challenges_of(self, conn, proof_id: str, steps=None) -> list[dict]:
    query = sa.select(challenges).where(challenges.c.proof_id == proof_id)
    if steps is not None:
      query = query.where(challenges.c.step.in_(sorted(steps)))
    return [dict(r) for r in conn.execute(query.order_by(challenges.c.step)).mappings()]

  def unanswered_challenges(self, conn, proof_id: str, limit: int,
                            through: int | None = None) -> list[dict]:
    """The first ``limit`` (by step) of the proof's derived challenges (of the steps up to
    ``through`` that no resume discarded; default: all) that need a check no record
    answered yet."""
    return [dict(r) for r in conn.execute(sa.select(challenges).where(
        _of_steps(proof_id, through) & unanswered()).order_by(challenges.c.step)
        .limit(limit)).mappings()]

  def unanswered_checks(self, conn, proof_id: str, through: int | None = None) -> int:
    """How many checks the proof's challenges (as ``unanswered_challenges`` selects them)
    need that no record answered yet, counted by the database (a proof may hold millions)."""
    counts = conn.execute(sa.select(*(
        sa.func.coalesce(sa.func.sum(sa.case(
            (challenges.c[f"needs_{k}"] & ~challenges.c[f"answered_{k}"], 1), else_=0)), 0)
        for k in challenge.ANSWER_KINDS)).where(_of_steps(proof_id, through))).one()
    return sum(counts)

  def challenge_rows(self, proof_id: str) -> list[dict]:
    with self.engine.connect() as conn:
      return self.challenges_of(conn, proof_id)

  def answer_challenges(self, conn, proof_id: str, kind: str, steps: list[int]) -> set[int]:
    """Marks the ``kind`` check of each of ``steps`` answered, in one statement; returns
    those that were already (or have no challenge), which the caller refuses, rolling
    the transaction back."""
    marked = conn.execute(_ANSWER[kind], {"proof": proof_id, "steps": steps}).scalars()
    return set(steps).difference(marked)

  # -- blobs uploaded for a proof ----------------------------------------------------------

  def add_proof_blob(self, proof_id: str, digest: str) -> None:
    add_held_blob(self.engine, proof_blobs.c.proof_id, proof_id, digest)

  def add_proof_blobs(self, proof_id: str, digests: list[str]) -> None:
    add_held_blob(self.engine, proof_blobs.c.proof_id, proof_id, *digests)

  def has_proof_blob(self, proof_id: str, digest: str, conn=None) -> bool:
    return has_held_blob(self.engine, proof_blobs.c.proof_id, proof_id, digest, conn)

  def proof_blob_digests(self, proof_id: str) -> list[str]:
    with self.engine.connect() as conn:
      return [r[0] for r in conn.execute(sa.select(proof_blobs.c.digest).where(
          proof_blobs.c.proof_id == proof_id).order_by(proof_blobs.c.digest))]

  def missing_blobs(self, conn, proof_id: str) -> tuple[int, str | None]:
    """(how many, up to ``MISSING_COUNTED`` + 1; the first) of the blobs the proof's
    records reference that were not uploaded for this proof: the first read, the rest
    counted by the database, no further than that (a close refused for them costs little,
    however many there are)."""
    uploaded = sa.select(proof_blobs.c.digest).where(proof_blobs.c.proof_id == proof_id)
    missing = sa.select(blob_refs.c.digest).where(
        (blob_refs.c.proof_id == proof_id) & blob_refs.c.digest.not_in(uploaded))
    first = conn.execute(missing.order_by(blob_refs.c.digest).limit(1)).scalar()
    if first is None:
      return 0, None
    counted = missing.limit(MISSING_COUNTED + 1).subquery()
    return conn.execute(sa.select(sa.func.count()).select_from(counted)).scalar(), first

  # -- receipts ------------------------------------------------------------------------------

  def put_receipt(self, proof_id: str, verdict: str, data: bytes, conn=None) -> None:
    statement = receipts.insert().values(proof_id=proof_id, verdict=verdict, data=data,
                                         issued_at=time.time())
    if conn is not None:
      conn.execute(receipts.delete().where(receipts.c.proof_id == proof_id))
      conn.execute(statement)
      return
    with self.engine.begin() as c:
      self.put_receipt(proof_id, verdict, data, c)

  def receipt(self, proof_id: str) -> bytes | None:
    with self.engine.connect() as conn:
      return conn.execute(sa.select(receipts.c.data).where(
          receipts.c.proof_id == proof_id)).scalar()
