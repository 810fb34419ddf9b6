"""Queries of benchmarks, their blobs and evaluation rows, submissions and what ranks them.

A mixin of ``db.Store``. Example::

  bench = store.benchmark("alice/tiny-accuracy")
  store.add_submission({"id": ..., "benchmark_id": bench["id"], "proof_id": ..., "record": ...},
                       shards=[(0, 1000), (1000, 500)], member_rows=[])
"""

import json
import time

import blake3
import numpy as np
import sqlalchemy as sa

from dvbench import scoring
from dvbench.server.labels import BASE_CHECKPOINT, REPLAYED_STATES
from dvbench.server.schema import (benchmark_blobs, benchmark_rows, benchmarks, experiments,
                                   jobs, probe_examples, probes, proof_claims, proofs, records,
                                   score_shards, submissions, training_members)
from dvbench.server.store_custody import BODY, add_held_blob, add_proof_digests, has_held_blob

# "pending": no shard scored yet; "scoring": some shards scored; "scored": the server
# aggregated every row's output; "failed": a shard or the aggregate failed (why is shown);
# "unscored": the server gave a shard up (out of time or killed each attempt).
SUBMISSION_STATES = ("pending", "scoring", "scored", "failed", scoring.UNSCORED)


def shard_id(submission_id: str, shard: int) -> str:
  """The id (and job subject) of shard ``shard`` of a submission, hex."""
  return blake3.blake3(f"{submission_id}/{shard}".encode()).hexdigest()


class BenchmarkQueries:
  """Benchmarks (immutable once registered) and the submissions the server scores."""

  def add_benchmark_blob(self, benchmark: str, digest: str) -> None:
    add_held_blob(self.engine, benchmark_blobs.c.benchmark, benchmark, digest)

  def has_benchmark_blob(self, benchmark: str, digest: str, conn=None) -> bool:
    return has_held_blob(self.engine, benchmark_blobs.c.benchmark, benchmark, digest, conn)

  def benchmark(self, full_name: str) -> dict | None:
    with self.engine.connect() as conn:
      row = conn.execute(sa.select(benchmarks).where(
          benchmarks.c.full_name == full_name)).mappings().first()
    return dict(row) if row else None

  def list_benchmarks(self) -> list[dict]:
    with self.engine.connect() as conn:
      return [dict(r) for r in conn.execute(
          sa.select(benchmarks).order_by(benchmarks.c.full_name)).mappings()]

  def create_benchmark(self, owner: str, row: dict, row_digests: dict[str, int]) -> dict:
    """Registers ``row`` with the digests identifying its examples (``{digest: example}``,
    ``dvbench.contamination.evaluation_digests``) unless the name exists; returns the
    stored one."""
    with self.engine.begin() as conn:
      existing = conn.execute(sa.select(benchmarks).where(
          benchmarks.c.full_name == row["full_name"])).mappings().first()
      if existing is not None:
        return dict(existing)
      owner_id = self._owner_id(conn, owner, create=True)
      benchmark_id = conn.execute(benchmarks.insert().values(
          **row, owner_id=owner_id, created_at=time.time())).inserted_primary_key[0]
      conn.execute(benchmark_rows.insert(), [
          {"benchmark_id": benchmark_id, "digest": d, "example": row_digests[d]}
          for d in sorted(row_digests)])
      return dict(conn.execute(sa.select(benchmarks).where(
          benchmarks.c.id == benchmark_id)).mappings().first())

  def benchmark_row_digests(self, benchmark_id: int) -> list[str]:
    with self.engine.connect() as conn:
      return [r[0] for r in conn.execute(sa.select(benchmark_rows.c.digest).where(
          benchmark_rows.c.benchmark_id == benchmark_id).order_by(benchmark_rows.c.digest))]

  def benchmark_contamination(self, benchmark_id: int) -> dict[str, int]:
    """Per proof: the distinct evaluation examples of the benchmark that a probe opened,
    whole or by an identifying row (``dvbench.contamination``)."""
    opened = sa.union_all(sa.select(probes.c.proof_id, probes.c.digest),
                          sa.select(probe_examples.c.proof_id, probe_examples.c.digest)
                          ).subquery()
    row = benchmark_rows.c
    example = sa.func.coalesce(sa.cast(row.example, sa.String), row.digest)
    query = (sa.select(opened.c.proof_id, sa.func.count(sa.distinct(example)))
             .select_from(opened.join(benchmark_rows, row.digest == opened.c.digest))
             .where(row.benchmark_id == benchmark_id).group_by(opened.c.proof_id))
    with self.engine.connect() as conn:
      return dict(conn.execute(query).all())

  def add_probe_examples(self, conn, proof_id: str, digests: set[str]) -> None:
    """Stores the whole examples a proof's probes opened (``probed_examples``)."""
    add_proof_digests(conn, probe_examples, proof_id, digests)

  def training_outside(self, benchmark_id: int) -> dict[str, int]:
    """Per proof: distinct probed rows not proven members of the benchmark's training set."""
    member = training_members.c
    query = (sa.select(probes.c.proof_id, sa.func.count())
             .select_from(probes.outerjoin(training_members, (member.digest == probes.c.digest)
                                           & (member.benchmark_id == benchmark_id)))
             .where(member.digest.is_(None)).group_by(probes.c.proof_id))
    with self.engine.connect() as conn:
      return dict(conn.execute(query).all())

  def first_with_final_params(self, final_params: str) -> dict | None:
    """``{"id", "experiment"}`` of the proof that closed first with these final params (a
    proof that ended before ``ended_at`` was kept counts from its creation), e.g. the original
    of a copied checkpoint. Only proofs whose server-chosen replays held count (any other
    proof's final params are what its final record declares: another owner's, read from its
    transcript before it closed, say); one that faked the steps to them escapes its checks
    with probability 1 - p, as any faked step does. A proof whose start was these very
    params (a base checkpoint trained to itself) copies them and does not count."""
    query = (sa.select(proofs.c.id, experiments.c.full_name.label("experiment"),
                       proof_claims.c.claims)
             .select_from(proofs.join(experiments).outerjoin(proof_claims))
             .where((proofs.c.final_params == final_params)
                    & proofs.c.state.in_(REPLAYED_STATES))
             .order_by(sa.func.coalesce(proofs.c.ended_at, proofs.c.created_at), proofs.c.id))
    with self.engine.connect() as conn:
      for row in conn.execute(query).mappings():  # read as far as the first that counts
        shown = json.loads(row["claims"]) if row["claims"] else {}
        if shown.get(BASE_CHECKPOINT) != final_params:
          return {"id": row["id"], "experiment": row["experiment"]}
    return None

  def benchmark_submission(self, benchmark_id: int, proof_id: str) -> dict | None:
    """The entry of ``proof_id`` on a benchmark (one per proof), or None."""
    with self.engine.connect() as conn:
      row = conn.execute(sa.select(submissions).where(
          (submissions.c.benchmark_id == benchmark_id)
          & (submissions.c.proof_id == proof_id))).mappings().first()
    return dict(row) if row else None

  def probed_rows(self, proof_id: str) -> set[str]:
    """The digests of the batch rows a proof's probe checks opened."""
    with self.engine.connect() as conn:
      return {r[0] for r in conn.execute(sa.select(probes.c.digest).where(
          probes.c.proof_id == proof_id))}

  def records_of_kind(self, proof_id: str, kind: str) -> list[bytes]:
    """The stored records of one type (e.g. "program", "init"), in chain order."""
    return list(self.iter_records_of_kind(proof_id, kind))

  def iter_records_of_kind(self, proof_id: str, kind: str, page: int = 64):
    """``records_of_kind``, read ``page`` records a query (none held in memory at once)."""
    after = -1
    while True:
      with self.engine.connect() as conn:
        rows = conn.execute(sa.select(records.c.position, *BODY).where(
            (records.c.proof_id == proof_id) & (records.c.kind == kind)
            & (records.c.position > after)).order_by(records.c.position).limit(page)).all()
      yield from (self.body(proof_id, *body) for _, *body in rows)
      if len(rows) < page:
        return
      after = rows[-1][0]

  # -- submissions -----------------------------------------------------------------------

  def add_submission(self, row: dict, shards: list[tuple[int, int]],
                     member_rows: list[str]) -> dict:
    """Stores a submission (idempotent by id), the probed rows it proved training rows, and
    queues a scoring job per shard ``(first row, rows)``; a submission the server could not
    score (``scoring.UNSCORED``) has those shards queued again."""
    now = time.time()
    with self.engine.begin() as conn:
      stored = conn.execute(sa.select(submissions.c.state).where(
          submissions.c.id == row["id"])).first()
      if stored is None:
        conn.execute(submissions.insert().values(**row, state="pending", created_at=now,
                                                 updated_at=now))
        for i, (first, rows) in enumerate(shards):
          conn.execute(score_shards.insert().values(
              id=shard_id(row["id"], i), submission_id=row["id"], shard=i, first_row=first,
              rows=rows, state="queued", updated_at=now))
          self.enqueue_job(conn, scoring.SHARD_JOB, shard_id(row["id"], i))
      elif stored[0] == scoring.UNSCORED:
        self._score_again(conn, row["id"], now)
      known = {r[0] for r in conn.execute(sa.select(training_members.c.digest).where(
          training_members.c.benchmark_id == row["benchmark_id"]))}
      new = sorted(set(member_rows) - known)
      if new:
        conn.execute(training_members.insert(), [
            {"benchmark_id": row["benchmark_id"], "digest": d} for d in new])
    return self.submission(row["id"])

  def _score_again(self, conn, submission_id: str, now: float) -> None:
    """Queues the shards of ``submission_id`` the server gave up scoring again."""
    given_up = [r[0] for r in conn.execute(sa.select(score_shards.c.id).where(
        (score_shards.c.submission_id == submission_id)
        & (score_shards.c.state == scoring.UNSCORED)))]
    conn.execute(jobs.delete().where((jobs.c.kind == scoring.SHARD_JOB)
                                     & jobs.c.subject.in_(given_up)))
    conn.execute(score_shards.update().where(score_shards.c.id.in_(given_up)).values(
        state="queued", failure=None, updated_at=now))
    for shard in given_up:
      self.enqueue_job(conn, scoring.SHARD_JOB, shard)
    conn.execute(submissions.update().where(submissions.c.id == submission_id).values(
        **self._settled(conn, submission_id), updated_at=now))

  def submission(self, submission_id: str) -> dict | None:
    with self.engine.connect() as conn:
      row = conn.execute(sa.select(submissions).where(
          submissions.c.id == submission_id)).mappings().first()
    return dict(row) if row else None

  def list_submissions(self, benchmark_id: int) -> list[dict]:
    query = (sa.select(submissions, experiments.c.full_name.label("experiment"),
                       proofs.c.steps)
             .select_from(submissions.join(proofs, proofs.c.id == submissions.c.proof_id)
                          .join(experiments))
             .where(submissions.c.benchmark_id == benchmark_id)
             .order_by(submissions.c.created_at))
    with self.engine.connect() as conn:
      return [dict(r) for r in conn.execute(query).mappings()]

  def score_shard(self, shard: str) -> dict:
    """A shard with what scoring it needs: its submission's record and benchmark definition."""
    query = (sa.select(score_shards, submissions.c.record, benchmarks.c.definition)
             .select_from(score_shards.join(submissions).join(benchmarks))
             .where(score_shards.c.id == shard))
    with self.engine.connect() as conn:
      return dict(conn.execute(query).mappings().first())

  def shard_progress(self, submission_id: str) -> dict:
    """``{"scored": shards done, "total": shards}`` of a submission."""
    with self.engine.connect() as conn:
      states = [r[0] for r in conn.execute(sa.select(score_shards.c.state).where(
          score_shards.c.submission_id == submission_id))]
    return {"scored": states.count("done"), "total": len(states)}

  def complete_shard_job(self, job_id: int, worker: str, shard: str, outputs: bytes | None,
                         failure: str | None) -> bool:
    """Stores a shard's per-row outputs (or why it failed); once every shard is in, the
    submission's aggregate. False (nothing written) when the lease was lost."""
    with self.engine.begin() as conn:
      if not self._finish_job(conn, job_id, worker):
        return False
      submission_id = conn.execute(sa.select(score_shards.c.submission_id).where(
          score_shards.c.id == shard)).scalar_one()
      # One shard at a time settles a submission (a row lock on PostgreSQL; SQLite
      # serializes writers anyway).
      conn.execute(sa.select(submissions.c.id).where(
          submissions.c.id == submission_id).with_for_update()).first()
      conn.execute(score_shards.update().where(score_shards.c.id == shard).values(
          state="failed" if failure else "done", outputs=outputs, failure=failure,
          updated_at=time.time()))
      conn.execute(submissions.update().where(submissions.c.id == submission_id).values(
          **self._settled(conn, submission_id), updated_at=time.time()))
    return True

  def _settled(self, conn, submission_id: str) -> dict:
    """The submission's state, value and failure from its shards."""
    shards = conn.execute(sa.select(score_shards).where(
        score_shards.c.submission_id == submission_id).order_by(score_shards.c.shard)
    ).mappings().all()
    for state in ("failed", scoring.UNSCORED):  # what the entry's program did comes first
      for s in shards:
        if s["state"] == state:
          rows = f"rows {s['first_row']}-{s['first_row'] + s['rows'] - 1}"
          return {"state": state, "value": None,
                  "failure": f"shard {s['shard']} ({rows}): {s['failure']}"}
    if any(s["state"] != "done" for s in shards):
      return {"state": "scoring", "failure": None}
    name = conn.execute(sa.select(benchmarks.c.aggregate).select_from(
        submissions.join(benchmarks)).where(submissions.c.id == submission_id)).scalar_one()
    outputs = np.concatenate([np.frombuffer(s["outputs"], scoring.OUTPUT_DTYPE)
                              for s in shards])
    try:
      return {"state": "scored", "value": scoring.aggregate(name, outputs), "failure": None}
    except ValueError as e:
      return {"state": "failed", "value": None, "failure": str(e)}
