"""What a proof's page, its JSON and a benchmark's audit say of its challenges and checks,
counted by the database: a request reads counts, a window's marks and a chart's ticks, never
every challenge and check of a proof (one a step at p = 1: millions for a long run).

A mixin of ``db.Store``. Example::

  store.challenge_counts(proof_id)   # {"steps": 40, "update": 4, ..., "update_replayed": 4}
  store.check_tally(proof_id)        # {("update", "verified"): 4}
  store.update_marks(proof_id, 0, 999)  # {7: "verified", 15: "challenged"}
"""

import sqlalchemy as sa

from dvbench.server.schema import challenges, checks, discarded_steps
from zkdv import challenge


def _count(clause):
  """How many rows ``clause`` holds for (booleans are summed alike on SQLite and PostgreSQL)."""
  return sa.func.coalesce(sa.func.sum(sa.case((clause, 1), else_=0)), 0)


class SummaryQueries:
  """Counts over a proof's challenges and checks, and its marks over a window of steps."""

  def challenge_counts(self, proof_id: str) -> dict:
    """``{"steps", KIND: challenged steps of each answer kind, "answered", "required",
    "update_replayed"}``: "steps" counts derived challenges (one a stored step),
    "answered" the required checks a record answered, "update_replayed" the update checks
    a worker verified on steps the server challenged."""
    kinds = challenge.ANSWER_KINDS
    needs = [challenges.c[f"needs_{k}"] for k in kinds]
    answered = [n & challenges.c[f"answered_{k}"] for n, k in zip(needs, kinds)]
    replayed = sa.select(sa.func.count()).select_from(checks.join(challenges, (
        checks.c.proof_id == challenges.c.proof_id) & (checks.c.step == challenges.c.step))
    ).where((checks.c.proof_id == proof_id) & (checks.c.kind == "update")
            & (checks.c.status == "verified") & challenges.c.needs_update)
    with self.engine.connect() as conn:
      row = conn.execute(sa.select(sa.func.count(), *map(_count, needs + answered)).where(
          challenges.c.proof_id == proof_id)).one()
      update_replayed = conn.execute(replayed).scalar()
    needed = {k: int(n) for k, n in zip(kinds, row[1:1 + len(kinds)])}
    return {"steps": row[0], **needed, "answered": sum(map(int, row[1 + len(kinds):])),
            "required": sum(needed.values()), "update_replayed": update_replayed}

  def check_tally(self, proof_id: str) -> dict[tuple[str, str], int]:
    """(kind, status) -> how many of the proof's checks a worker replayed came out so."""
    with self.engine.connect() as conn:
      return {(kind, status): n for kind, status, n in conn.execute(
          sa.select(checks.c.kind, checks.c.status, sa.func.count())
          .where(checks.c.proof_id == proof_id).group_by(checks.c.kind, checks.c.status))}

  def update_marks(self, proof_id: str, first: int, last: int) -> dict[int, str]:
    """step -> "verified" or "failed" (a worker replayed its update check) or
    "challenged" (the server chose it, not replayed yet), for steps ``first`` .. ``last``."""
    with self.engine.connect() as conn:
      marks = dict.fromkeys(conn.execute(sa.select(challenges.c.step).where(
          (challenges.c.proof_id == proof_id) & challenges.c.needs_update
          & challenges.c.step.between(first, last))).scalars(), "challenged")
      for step, status in conn.execute(sa.select(checks.c.step, checks.c.status).where(
          (checks.c.proof_id == proof_id) & (checks.c.kind == "update")
          & checks.c.step.between(first, last))):
        marks[step] = "verified" if status == "verified" else "failed"
    return marks

  def discarded_in(self, proof_id: str, first: int, last: int) -> set[int]:
    """The steps ``first`` .. ``last`` a resume of the proof discarded."""
    with self.engine.connect() as conn:
      return set(conn.execute(sa.select(discarded_steps.c.step).where(
          (discarded_steps.c.proof_id == proof_id)
          & discarded_steps.c.step.between(first, last))).scalars())

  def check_ticks(self, proof_id: str, steps: int, columns: int) -> list[dict]:
    """The proof's checks for a chart ``columns`` wide over ``steps`` steps: per column,
    kind and status, ``{"kind", "status", "first", "last", "count"}`` (first and last
    step), so a chart draws at most ``columns`` ticks a kind and status; failed ones last,
    drawn over a verified tick of their column."""
    scaled = sa.cast(checks.c.step, sa.BigInteger) * columns // max(steps, 1)
    column = sa.case((scaled >= columns, columns - 1), else_=scaled)  # a step past the end
    with self.engine.connect() as conn:
      return [dict(r) for r in conn.execute(
          sa.select(checks.c.kind, checks.c.status, sa.func.min(checks.c.step).label("first"),
                    sa.func.max(checks.c.step).label("last"), sa.func.count().label("count"))
          .where(checks.c.proof_id == proof_id)
          .group_by(checks.c.kind, checks.c.status, column)
          .order_by(sa.case((checks.c.status == "failed", 1), else_=0),
                    sa.func.min(checks.c.step), checks.c.kind, checks.c.status)).mappings()]
