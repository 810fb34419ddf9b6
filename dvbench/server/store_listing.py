"""Pages of every listing: at most ``limit`` rows after a cursor, in a stable order.

A mixin of ``db.Store``. Each method returns ``(rows, next_cursor)``; ``next_cursor``
is None on the last page. Example::

  ids, after = store.page_record_ids(proof_id, limit=1000)
  more, after = store.page_record_ids(proof_id, limit=1000, after=after)
"""

import dataclasses
import json

import sqlalchemy as sa

from dvbench.server.refusals import MAX_COLUMN_INT, parse_int
from dvbench.server.schema import (benchmark_rows, challenges, checks, experiments, proof_blobs,
                                   proofs, records)


class BadCursor(ValueError):
  """An ``after`` cursor this listing did not hand out."""


def _int(after: str | None, what: str) -> int:
  if after is None:
    return -1
  value = parse_int(after, 0, MAX_COLUMN_INT)
  if value is None:
    raise BadCursor(f"after is the {what} that ended the previous page, an integer from 0 "
                    f"to {MAX_COLUMN_INT}; got {after[:40]!r}.")
  return value


@dataclasses.dataclass(frozen=True)
class ProofFilter:
  """Which proofs a listing shows: ``search`` (a case-insensitive part of the run name, the
  experiment's name or the proof id), a ``state`` and a ``tag`` (exact). Example::

    ProofFilter(search="lr-3e-4", state="verified", tag="sweep-1")
  """

  search: str = ""
  state: str = ""
  tag: str = ""

  def where(self, query):
    if self.search:
      text = self.search.lower()
      query = query.where(sa.func.lower(sa.func.coalesce(proofs.c.run_name, "")).contains(
          text, autoescape=True) | sa.func.lower(experiments.c.full_name).contains(
              text, autoescape=True) | proofs.c.id.startswith(text, autoescape=True))
    if self.state:
      query = query.where(proofs.c.state == self.state)
    if self.tag:
      query = query.where(proofs.c.tags.contains(json.dumps(self.tag), autoescape=True))
    return query

  def __bool__(self):
    return bool(self.search or self.state or self.tag)


class ListingQueries:
  """Paged reads; the routes bound ``limit`` (``paging.MAX_PAGE``)."""

  def _page(self, query, limit: int, cursor_of) -> tuple[list, str | None]:
    with self.engine.connect() as conn:
      rows = conn.execute(query.limit(limit + 1)).mappings().all()
    rows, more = [dict(r) for r in rows[:limit]], len(rows) > limit
    return rows, cursor_of(rows[-1]) if more else None

  def page_experiments(self, limit: int, after: str | None = None):
    query = sa.select(experiments).order_by(experiments.c.full_name)
    if after is not None:
      query = query.where(experiments.c.full_name > after)
    return self._page(query, limit, lambda r: r["full_name"])

  def page_proofs(self, limit: int, after: str | None = None,
                  experiment_id: int | None = None, only: ProofFilter = ProofFilter()):
    """Newest first, those ``only`` lets through; the cursor is the id of the last proof
    of the page."""
    query = only.where(sa.select(proofs, experiments.c.full_name.label("experiment"))
                       .select_from(proofs.join(experiments))
                       .order_by(proofs.c.created_at.desc(), proofs.c.id.desc()))
    if experiment_id is not None:
      query = query.where(proofs.c.experiment_id == experiment_id)
    if after is not None:
      last = sa.select(proofs.c.created_at).where(proofs.c.id == after).scalar_subquery()
      query = query.where((proofs.c.created_at < last) |
                          ((proofs.c.created_at == last) & (proofs.c.id < after)))
    return self._page(query, limit, lambda r: r["id"])

  def count_proofs(self, only: ProofFilter, experiment_id: int | None = None) -> int:
    """How many proofs ``only`` lets through (of one experiment, or all)."""
    query = only.where(sa.select(sa.func.count()).select_from(proofs.join(experiments)))
    if experiment_id is not None:
      query = query.where(proofs.c.experiment_id == experiment_id)
    with self.engine.connect() as conn:
      return conn.execute(query).scalar_one()

  def page_record_ids(self, proof_id: str, limit: int, after: str | None = None):
    """Record ids in custody order; the cursor is a position."""
    query = (sa.select(records.c.position, records.c.record_id)
             .where((records.c.proof_id == proof_id) &
                    (records.c.position > _int(after, "record position")))
             .order_by(records.c.position))
    rows, cursor = self._page(query, limit, lambda r: str(r["position"]))
    return [r["record_id"] for r in rows], cursor

  def page_checks(self, proof_id: str, limit: int, after: str | None = None):
    """Checks by step, then kind; the cursor is 'STEP.KIND', e.g. '12.update'."""
    query = (sa.select(checks).where(checks.c.proof_id == proof_id)
             .order_by(checks.c.step, checks.c.kind))
    if after is not None:
      step, _, kind = after.partition(".")
      query = query.where((checks.c.step > _int(step, "step")) |
                          ((checks.c.step == int(step)) & (checks.c.kind > kind)))
    rows, cursor = self._page(query, limit, lambda r: f"{r['step']}.{r['kind']}")
    return [{k: v for k, v in r.items() if k != "proof_id"} for r in rows], cursor

  def page_challenges(self, proof_id: str, limit: int, after: str | None = None):
    query = (sa.select(challenges).where((challenges.c.proof_id == proof_id) &
                                         (challenges.c.step > _int(after, "step")))
             .order_by(challenges.c.step))
    return self._page(query, limit, lambda r: str(r["step"]))

  def page_proof_blobs(self, proof_id: str, limit: int, after: str | None = None):
    query = (sa.select(proof_blobs.c.digest).where(
        (proof_blobs.c.proof_id == proof_id) & (proof_blobs.c.digest > (after or "")))
             .order_by(proof_blobs.c.digest))
    rows, cursor = self._page(query, limit, lambda r: r["digest"])
    return [r["digest"] for r in rows], cursor

  def page_benchmark_rows(self, benchmark_id: int, limit: int, after: str | None = None):
    query = (sa.select(benchmark_rows.c.digest).where(
        (benchmark_rows.c.benchmark_id == benchmark_id) &
        (benchmark_rows.c.digest > (after or ""))).order_by(benchmark_rows.c.digest))
    rows, cursor = self._page(query, limit, lambda r: r["digest"])
    return [r["digest"] for r in rows], cursor
