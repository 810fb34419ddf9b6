"""Custody at ingest: each record appended once, in chain order, and its challenges derived.

A stored transcript is append-only: a record whose ``prev`` is not the id of the
last stored record is refused (409, naming the position), a resent record is a
duplicate, a ``step`` carries the next index, a check answers a stored step
once per kind, nothing follows ``final``, no segment holds more steps than the root's
``segment_length``. For a ``dvbench`` proof every stored
step record gets its challenge ``c_t`` from the proof's secret key; it decides the
step's probes and, for a step that ends a segment (it commits its post-state), the
segment's update and state checks.

Records are decoded and checked against their kind's fields (``zkdv.records``, the
definition the verifier checks too) before the transaction starts; the transaction only orders and stores them.

Example::

  parsed = [(raw, parse_record(raw, n), record_id(raw))  # before the database
            for n, raw in enumerate(raws)]
  with store.engine.begin() as conn:
    ingest = Ingest(store, conn, proof_id, ProofChallenger.of(store, proof_id))
    ingest.expect(rid for _, _, rid in parsed)
    for n, (raw, record, rid) in enumerate(parsed):
      ingest.take(raw, record, rid, n)
    ack = ingest.ack()
"""

import dataclasses
import json

import cbor2
from starlette.exceptions import HTTPException

from dvbench import transport
from dvbench.server.decoding import decode
from zkdv import challenge
from zkdv import records


def parse_record(raw, n: int) -> dict:
  """Record ``n`` of a request, decoded (deterministic CBOR) and checked; 400 otherwise."""
  what = f"record {n} of the envelope"
  if not isinstance(raw, bytes):
    raise HTTPException(400, f"{what} is not a byte string.")
  record = decode(raw, what, canonical=True, max_string=transport.MAX_RECORD_STRING)
  try:
    records.check_record(record, f"record {n}")
  except records.Invalid as e:
    raise HTTPException(400, str(e)) from None
  return record


_UNKNOWN = object()  # a value not read from the store yet


def challenge_row(proof_id: str, step: int, record_id: bytes, challenge_key: bytes,
                  needs: dict[str, bool]) -> dict:
  """The ``challenges`` row of step ``step``'s derived challenge, answered by nothing yet
  (``needs``: kind -> required)."""
  return {"proof_id": proof_id, "step": step, "record_id": record_id,
          "challenge": challenge_key, **{f"needs_{k}": v for k, v in needs.items()},
          **{f"answered_{k}": False for k in needs}}


def missing_checks(rows: list[dict]) -> list[tuple[int, str]]:
  """(step, check) of each check the challenge rows ``rows`` need and no record answered."""
  return [(r["step"], k) for r in rows for k in challenge.CHECK_NAMES
          if r[f"needs_{k}"] and not r[f"answered_{k}"]]


def first_unanswered(store, conn, proof_id: str, derived=(),
                     through: int | None = None) -> str | None:
  """Names the first check a proof's challenges (of the steps up to ``through`` that no
  resume discarded; default all) need that no record answered, if any: of its stored
  challenges (the first one read, the rest counted by the database) and those ``derived``
  by the request being stored. E.g.
  'step 3 was challenged for probes and never answered (2 more challenges unanswered).'"""
  derived = [r for r in derived if through is None or r["step"] <= through]
  rows = sorted([*store.unanswered_challenges(conn, proof_id, 1, through), *derived],
                key=lambda r: r["step"])
  missing = missing_checks(rows)
  if not missing:
    return None
  step, kind = missing[0]
  others = (store.unanswered_checks(conn, proof_id, through)
            + len(missing_checks(derived)) - 1)
  more = f" ({others} more challenges unanswered)" if others > 0 else ""
  return f"step {step} was challenged for {challenge.CHECK_NAMES[kind]} and never answered{more}."


@dataclasses.dataclass(frozen=True)
class ProofChallenger:
  """Who chooses a proof's checks: ``kind``, the effective policy, the server key K."""

  kind: str
  policy: challenge.Policy
  key: bytes | None

  @classmethod
  def of(cls, store, proof_id: str) -> "ProofChallenger":
    row = store.challenger(proof_id)
    if row is None:
      raise HTTPException(409, f"proof {proof_id} predates server challenges (no challenger "
                          "recorded); start a new proof.")
    return cls(row["kind"], stored_policy(row["policy"]), row["challenge_key"])

  def needs(self, step: int, record_id_: bytes, first: int,
            ends_segment: bool) -> tuple[bytes, dict[str, bool]]:
    """(c_t, kind -> required) of the stored step record ``record_id_`` of the segment
    from step ``first``: probes of the step and, when it ends the segment (commits its
    post-state), the segment's update and state checks (``challenge.required_checks``)."""
    c = challenge.step_challenge_server(self.key, record_id_)
    decision = challenge.decide(step, c, self.policy)
    decides = ends_segment and challenge.deciding_step(self.kind, first, step) == step
    return c, challenge.required_checks(decision, decision if decides else None)


def stored_policy(text: str) -> challenge.Policy:
  """A policy stored as JSON (``Policy.to_record``)."""
  return challenge.Policy.from_record(json.loads(text))


class Ingest:
  """The records of one request, checked and appended inside one transaction."""

  def __init__(self, store, conn, proof_id: str, challenger: ProofChallenger):
    self.store, self.conn, self.proof_id, self.challenger = store, conn, proof_id, challenger
    self.head = store.custody_head(conn, proof_id)
    self._positions: dict[bytes, int] = {}  # of the records this request may repeat
    self._new: list[tuple[bytes, str, bytes]] = []  # appended, written by ack()
    self.stored = self.duplicates = 0
    self.steps_seen: list[int] = []
    self._derived: dict[int, dict] = {}  # step -> its challenge row, written by ack()
    self._discarded: set[int] = set()  # steps this request's resumes discarded, by ack()
    # (step, kind) -> the record answering a check of a step an earlier request stored,
    # written by ack() (``_write_answers``)
    self._answers: dict[tuple[int, str], int] = {}
    self.refs: set[str] = set()
    self._open_segment: int | None = None  # stored steps after the last post_state
    self._committed = _UNKNOWN  # _last_committed(), kept up to date as records are taken
    self._rules = {"root": self._refuse_root, "step": self._check_step,
                   "check": self._check_answer, "resume": self._check_resume,
                   "final": self._check_final}

  def expect(self, ids) -> None:
    """Looks up at once which of the request's records (by id) are stored already."""
    self._positions.update(self.store.record_positions(self.conn, self.proof_id, list(ids)))

  def take(self, raw: bytes, record: dict, rid: bytes, n: int) -> None:
    """Appends record ``n`` of the request (checked by ``parse_record``; ``rid`` is
    ``record_id(raw)``) or counts it as a duplicate (``expect`` it first)."""
    try:
      self._take(raw, record, rid, n)
    except HTTPException:
      self._write_answers()  # a refused answer of an earlier record is named first
      raise

  def _take(self, raw: bytes, record: dict, rid: bytes, n: int) -> None:
    if rid in self._positions:
      self.duplicates += 1
      if record["type"] == "step":
        self.steps_seen.append(record["index"])
      return
    self.check_receiving()
    self._check_chain(record, n)
    self._rules.get(record["type"], self._accept_other)(record, n)
    self._positions[rid] = self.head.records
    self._new.append((rid, record["type"], raw))
    self.head = dataclasses.replace(
        self.head, records=self.head.records + 1,
        steps=self.head.steps + (record["type"] == "step"), last_id=rid,
        last_kind=record["type"], probed_rows=self.head.probed_rows + sum(
            map(records.opened_row_count, records.probe_entries(record))))
    if record["type"] == "step":
      ends_segment = isinstance(record.get("post_state"), bytes)
      first = record["index"] - self._open_segment  # counted by _check_step
      self._open_segment = 0 if ends_segment else self._open_segment + 1
      if ends_segment:
        self._committed = record["index"]
      self._derive(record["index"], rid, first, ends_segment)
    self.stored += 1
    self.refs |= transport.blob_refs(record)

  def ack(self) -> dict:
    """Writes what was appended; the acknowledgement with the challenges of its steps."""
    self._write_answers()
    self.head = dataclasses.replace(self.head, body_end=self.store.append_records(
        self.conn, self.proof_id, self.head, self._new))
    self._new = []
    self.store.add_blob_refs(self.conn, self.proof_id, self.refs)
    self.store.add_challenges(self.conn, list(self._derived.values()))
    self.store.add_discarded(self.conn, self.proof_id, self._discarded)
    self._discarded = set()
    stored = set(self.steps_seen) - set(self._derived)  # steps this request repeats
    rows = sorted([*self._derived.values(), *(self.store.challenges_of(
        self.conn, self.proof_id, stored) if stored else [])], key=lambda r: r["step"])
    self._derived = {}
    return {"stored": self.stored, "duplicates": self.duplicates,
            "challenges": [{"step": r["step"], "record_id": r["record_id"].hex(),
                            "challenge": r["challenge"].hex()} for r in rows]}

  def check_receiving(self) -> None:
    """409 unless the proof still takes records (read inside this transaction)."""
    if self.head.state != "receiving":
      raise HTTPException(409, f"proof {self.proof_id} is {self.head.state}; it takes no "
                          "more records.")

  def _check_chain(self, record: dict, n: int) -> None:
    head = self.head
    if head.last_kind == "final":
      raise HTTPException(409, f"record {n}: the final record is stored at position "
                          f"{head.records - 1}; nothing follows it and a stored transcript "
                          "is never re-finalized.")
    prev = record["prev"]
    if prev == head.last_id:
      return
    earlier = self._positions.get(prev)
    if earlier is None:
      earlier = self.store.record_position(self.conn, self.proof_id, prev)
    if earlier is not None:
      raise HTTPException(409, f"record {n} would rewrite position {earlier + 1}, which "
                          "already holds another record: stored transcripts are append-only.")
    raise HTTPException(409, f"record {n} chains to {prev.hex()}, which is not the last stored "
                        f"record (position {head.records - 1}, {head.last_id.hex()}): it "
                        "belongs to another transcript or skips records.")

  def _refuse_root(self, record: dict, n: int) -> None:
    raise HTTPException(409, f"record {n} is a second root; a proof has one, at position 0.")

  def _check_resume(self, record: dict, n: int) -> None:
    """A run resumed after a crash (``zkdv.jax.resume``): it goes on from the last
    committed post-state, discarding only the steps of the open segment after it (their
    segment was never decided: a server decides a segment at its last step), and only once
    every challenge of the steps up to that state is answered. The probes of a discarded
    step stay owed until the close: drawn when it was stored, they open the rows of the
    batch it committed whatever the prover saw, so a resumed run answers them when it
    trains that batch again."""
    step, after = record["step"], record["after"]
    if step != self.head.steps:
      raise HTTPException(409, f"record {n} resumes the run at step {step}, but "
                          f"{self.head.steps} steps are stored: step indices go on.")
    last = self._last_committed()
    if last is None:
      raise HTTPException(409, f"record {n} resumes the run, but no stored step committed a "
                          "post-state yet: there is nothing to resume from.")
    stored = self._step_record(after) if after == last else None
    if stored is None or stored.get("post_state") != record["state"]:
      raise HTTPException(409, f"record {n} resumes the run from step {after}'s state; it "
                          "must go on from the committed post-state of the last step that "
                          f"stored one (step {last}).")
    self._write_answers()
    # The probes of the steps it discards stay owed: the resumed run answers them when it
    # trains their batches again, and the close requires them (the rows they open are
    # those of the batches the steps committed, seen or not: resending a batch as another
    # step draws other rows for that step, not for these).
    self.store.add_discarded(self.conn, self.proof_id, self._discarded)  # an earlier resume's
    failure = first_unanswered(self.store, self.conn, self.proof_id, [
        r for r in self._derived.values() if r["step"] not in self._discarded], through=after)
    if failure is not None:
      raise HTTPException(409, f"record {n} resumes the run, but {failure} A run resumes only "
                          "once every challenge of the steps up to the state it goes on "
                          "from that no resume discarded is answered; answer it first, or "
                          "start a new proof.")
    self._open_segment = 0
    self._discarded.update(records.discarded_steps(after, step))

  def _last_committed(self) -> int | None:
    """The step whose committed post-state a resume goes on from (``None``: none yet)."""
    if self._committed is _UNKNOWN:
      self._read_tail()
    return self._committed

  def _read_tail(self) -> None:
    """Reads the open segment's stored steps and the last committed step (whichever this
    request has not kept up to date yet) from the stored tail (``segment_tail``)."""
    open_steps, committed = self.store.segment_tail(self.conn, self.proof_id,
                                                    self.challenger.policy.segment_length)
    if self._open_segment is None:
      self._open_segment = open_steps
    if self._committed is _UNKNOWN:
      self._committed = committed

  def _step_record(self, index: int) -> dict | None:
    """Step ``index``'s record, from this request's records or the stored ones."""
    for _, kind, raw in reversed(self._new):
      if kind == "step":
        record = cbor2.loads(raw)
        if record["index"] == index:
          return record
        if record["index"] < index:
          break
    return self.store.step_record(self.conn, self.proof_id, index)

  def _check_step(self, record: dict, n: int) -> None:
    index = record["index"]
    if index != self.head.steps:
      raise HTTPException(409, f"record {n} is step {index}, but {self.head.steps} steps "
                          f"are stored: the next step record is step {self.head.steps}.")
    longest = self.challenger.policy.segment_length
    if self._open_segment is None:
      self._read_tail()
    if self._open_segment + 1 >= longest and not isinstance(record.get("post_state"), bytes):
      raise HTTPException(409, f"record {n} is step {index}, step {self._open_segment + 1} "
                          f"of the segment that starts at step {index - self._open_segment}, "
                          f"and carries no post_state: the proof's segments hold at most "
                          f"{longest} steps (its root's segment_length), so this step must "
                          "end its segment.")

  def _check_answer(self, record: dict, n: int) -> None:
    step, kind = record["step"], record["kind"]
    if step >= self.head.steps:
      raise HTTPException(409, f"record {n} answers step {step} before its step record "
                          f"was stored ({self.head.steps} steps stored).")
    if kind == "start":  # the attested start's link to step 0, not a challenge's answer
      if step != 0:
        raise HTTPException(409, f"record {n} is a start check of step {step}; only step 0 "
                            "starts a proof.")
      return
    if self.challenger.kind == "dvbench" and not self._answer(step, kind, n):
      self._refuse_answer(n, step, kind)

  @staticmethod
  def _refuse_answer(n: int, step: int, kind: str):
    raise HTTPException(409, f"record {n}: step {step}'s {kind} check was already answered "
                        "by another record.")

  def _answer(self, step: int, kind: str, n: int) -> bool:
    """Marks step ``step``'s ``kind`` check answered by record ``n``; False when it already
    was. A step an earlier request stored is marked by ``_write_answers``."""
    row = self._derived.get(step)
    if row is None:
      return self._answers.setdefault((step, kind), n) == n
    answered, row[f"answered_{kind}"] = row[f"answered_{kind}"], True
    return not answered

  def _write_answers(self) -> None:
    """Marks the checks this request answered of steps earlier requests stored, one
    statement per kind; 409 naming the first record whose check was answered before (the
    request rolls back)."""
    by_kind: dict[str, dict[int, int]] = {}
    for (step, kind), n in self._answers.items():
      by_kind.setdefault(kind, {})[step] = n
    self._answers = {}
    refused = [(answering[step], step, kind) for kind, answering in by_kind.items()
               for step in self.store.answer_challenges(self.conn, self.proof_id, kind,
                                                        list(answering))]
    if refused:
      self._refuse_answer(*min(refused))

  def _check_final(self, record: dict, n: int) -> None:
    if record["steps"] != self.head.steps:
      raise HTTPException(409, f"record {n} is a final record of {record['steps']} "
                          f"steps, but {self.head.steps} step records are stored.")

  def _accept_other(self, record: dict, n: int) -> None:
    """Program records and other types are the verifier's to judge."""

  def _derive(self, step: int, rid: bytes, first: int, ends_segment: bool) -> None:
    self.steps_seen.append(step)
    if self.challenger.kind == "dvbench":
      c, needs = self.challenger.needs(step, rid, first, ends_segment)
      self._derived[step] = challenge_row(self.proof_id, step, rid, c, needs)
