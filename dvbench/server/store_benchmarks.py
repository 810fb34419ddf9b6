"""Queries of benchmarks, their blobs and evaluation rows, submissions and what ranks them.

A mixin of ``db.Store``. Example::

  bench = store.benchmark("alice/tiny-accuracy")
  store.add_submission({"id": ..., "benchmark_id": bench["id"], "proof_id": ..., "record": ...})
"""

import time

import sqlalchemy as sa

from dvbench.server.schema import (benchmark_blobs, benchmark_rows, benchmarks, experiments,
                                   probes, proofs, records, submissions)
from dvbench.server.store_custody import add_held_blob, has_held_blob

SUBMISSION_STATES = ("pending", "scoring", "scored", "failed")


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

  def benchmark_by_id(self, benchmark_id: int) -> dict:
    with self.engine.connect() as conn:
      return dict(conn.execute(sa.select(benchmarks).where(
          benchmarks.c.id == benchmark_id)).mappings().first())

  def list_benchmarks(self) -> list[dict]:
    with self.engine.connect() as conn:
      return [dict(r) for r in conn.execute(
          sa.select(benchmarks).order_by(benchmarks.c.full_name)).mappings()]

  def create_benchmark(self, owner: str, row: dict, row_digests: set[str]) -> dict:
    """Registers ``row`` (with its rows' digests) unless the name exists; returns the stored one."""
    with self.engine.begin() as conn:
      existing = conn.execute(sa.select(benchmarks).where(
          benchmarks.c.full_name == row["full_name"])).mappings().first()
      if existing is not None:
        return dict(existing)
      owner_id = self._owner_id(conn, owner, create=True)
      benchmark_id = conn.execute(benchmarks.insert().values(
          **row, owner_id=owner_id, created_at=time.time())).inserted_primary_key[0]
      conn.execute(benchmark_rows.insert(), [{"benchmark_id": benchmark_id, "digest": d}
                                             for d in sorted(row_digests)])
      return dict(conn.execute(sa.select(benchmarks).where(
          benchmarks.c.id == benchmark_id)).mappings().first())

  def benchmark_row_digests(self, benchmark_id: int) -> list[str]:
    with self.engine.connect() as conn:
      return [r[0] for r in conn.execute(sa.select(benchmark_rows.c.digest).where(
          benchmark_rows.c.benchmark_id == benchmark_id).order_by(benchmark_rows.c.digest))]

  def benchmark_contamination(self, benchmark_id: int) -> dict[str, int]:
    """Per proof: distinct probed training rows equal to an evaluation row of the benchmark."""
    query = (sa.select(probes.c.proof_id, sa.func.count())
             .select_from(probes.join(benchmark_rows, benchmark_rows.c.digest == probes.c.digest))
             .where(benchmark_rows.c.benchmark_id == benchmark_id).group_by(probes.c.proof_id))
    with self.engine.connect() as conn:
      return dict(conn.execute(query).all())

  def records_of_kind(self, proof_id: str, kind: str) -> list[bytes]:
    """The stored records of one type (e.g. "program", "init"), in chain order."""
    with self.engine.connect() as conn:
      return [r[0] for r in conn.execute(sa.select(records.c.data).where(
          (records.c.proof_id == proof_id) & (records.c.kind == kind)
      ).order_by(records.c.position))]

  # -- submissions -----------------------------------------------------------------------

  def add_submission(self, row: dict) -> dict:
    """Stores a submission (idempotent by id) and queues its scoring."""
    now = time.time()
    with self.engine.begin() as conn:
      if not conn.execute(sa.select(submissions.c.id).where(
          submissions.c.id == row["id"])).first():
        conn.execute(submissions.insert().values(**row, state="pending", created_at=now,
                                                 updated_at=now))
        self.enqueue_job(conn, "score", row["id"])
    return self.submission(row["id"])

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

  def complete_score_job(self, job_id: int, worker: str, submission_id: str, state: str,
                         value: float | None, failure: str | None) -> bool:
    """Stores the score; False (nothing written) when the lease was lost."""
    if state not in SUBMISSION_STATES:
      raise ValueError(f"unknown submission state {state!r}.")
    with self.engine.begin() as conn:
      if not self._finish_job(conn, job_id, worker):
        return False
      conn.execute(submissions.update().where(submissions.c.id == submission_id).values(
          state=state, value=value, failure=failure, updated_at=time.time()))
    return True
