"""An owner's attempts: every proof slot issued to it, and what became of each.

Challenges are unpredictable, but a prover can drop a proof whose faked segment was
challenged and try again, in any of its experiments. So every slot is counted
against its owner (across all of the owner's experiments), the proof and receipt
show the owner's attempts, and the escape probability they state accounts for them
(``zkdv.challenge.escape_over_attempts``). Slots per owner are rate-limited.

Example::

  attempts = owner_attempts(store, "alice")
  attempts["slots"], attempts["by_outcome"]["abandoned"]   # 40, 35
  check_slot_rate(store, "alice", per_hour=120)          # 429 past the limit
"""

import time

import sqlalchemy as sa
from dvbench.server.refusals import Refusal
from dvbench.server.schema import (blob_refs, challenges, experiments, owners, proof_blobs,
                                   proofs, slots)
from dvbench.server.store_custody import unanswered
from zkdv import challenge

DEFAULT_MAX_SLOTS_PER_HOUR = 120
_HOUR = 3600.0
# What an attempt's proof state counts as: its own state once settled, or "unfinished".
UNFINISHED = "unfinished"  # a slot never used, or a proof still receiving or verifying
_RUNNING = ("receiving", "closed", "verifying")
# The states of a proof that may have stopped on a challenge it did not answer: still
# receiving, refused at close, or fallen silent (crashed: --crash-after, and abandoned
# later: what every dropped proof becomes; an honest preemption, resumed, is receiving).
_STOPPED_STATES = ("receiving", "invalid", "crashed", "abandoned")


def _owner_slots(owner: str):
  return (sa.select(slots.c.nonce, slots.c.created_at, proofs.c.id, proofs.c.state)
          .select_from(slots.join(experiments).join(owners).outerjoin(
              proofs, proofs.c.id == slots.c.proof_id))
          .where(owners.c.name == owner))


def _unanswered(conn, proof_ids: list[str]) -> set[str]:
  """The proofs among ``proof_ids`` holding a challenge they never answered: no record
  answers it, or one does whose openings (the blobs it names) never arrived, which an
  answer to a challenged faked segment can claim as well as a record can be left out."""
  if not proof_ids:
    return set()
  never_sent = ~sa.exists().where((proof_blobs.c.proof_id == blob_refs.c.proof_id)
                                  & (proof_blobs.c.digest == blob_refs.c.digest))
  return {r[0] for r in conn.execute(sa.union(
      sa.select(challenges.c.proof_id).where(challenges.c.proof_id.in_(proof_ids)
                                             & unanswered()),
      sa.select(blob_refs.c.proof_id).where(blob_refs.c.proof_id.in_(proof_ids)
                                            & never_sent)))}


def owner_attempts(store, owner: str, conn=None) -> dict:
  """``{"owner", "slots", "by_outcome": {outcome: n}, "after_unanswered_challenge"}``:
  every slot issued to ``owner``, by what became of it (a settled proof's state, or
  ``unfinished``), and how many proofs stopped right after a challenge they did not
  answer, or answered without its openings (dropped, crashed, abandoned or refused at
  close). ``conn``: read inside that transaction (it sees the state it set)."""
  if conn is None:
    with store.engine.connect() as c:
      return owner_attempts(store, owner, c)
  rows = conn.execute(_owner_slots(owner)).all()
  stopped = _unanswered(conn, [r.id for r in rows if r.id is not None
                               and r.state in _STOPPED_STATES])
  by_outcome = {}
  for row in rows:
    outcome = UNFINISHED if row.state is None or row.state in _RUNNING else row.state
    by_outcome[outcome] = by_outcome.get(outcome, 0) + 1
  return {"owner": owner, "slots": len(rows), "by_outcome": dict(sorted(by_outcome.items())),
          "after_unanswered_challenge": len(stopped)}


def describe(attempts: dict, p: float) -> dict:
  """The attempts with what they mean for one faked segment at challenge probability ``p``:
  it escapes one attempt with ``1 - p``; a prover that retries until it escapes gets at
  least one past in ``n`` attempts with ``1 - p**n``."""
  n = max(attempts["slots"], 1)
  over = challenge.escape_over_attempts(p, n)
  outcomes = ", ".join(f"{k} {v}" for k, v in attempts["by_outcome"].items()) or "none"
  text = (f"{attempts['owner']} took {attempts['slots']} proof slots across all of its "
          f"experiments ({outcomes}; {attempts['after_unanswered_challenge']} stopped right "
          f"after an unanswered challenge); one faked segment escapes one attempt with "
          f"probability {1 - p:.3g}, and at least one of {n} attempts with {over:.3g}")
  return {**attempts, "escape_probability_per_attempt": 1 - p,
          "escape_probability_over_attempts": over, "summary": text}


def check_slot_rate(store, owner: str, per_hour: int) -> None:
  """429 naming the limit when ``owner`` took ``per_hour`` slots in the last hour."""
  since = time.time() - _HOUR
  with store.engine.connect() as conn:
    taken = conn.execute(sa.select(sa.func.count(), sa.func.min(slots.c.created_at))
                         .select_from(slots.join(experiments).join(owners))
                         .where((owners.c.name == owner) & (slots.c.created_at > since))).first()
  if taken[0] >= per_hour:
    wait = max(1, int(taken[1] + _HOUR - time.time()) + 1)
    raise Refusal(429, f"'{owner}' took {taken[0]} proof slots in the last hour; the "
                  f"server issues at most {per_hour} per owner per hour (dvbench serve "
                  f"--max-slots-per-hour). Every slot counts as an attempt; retry in "
                  f"{wait} s.", headers={"retry-after": str(wait)}, quota="slots_per_hour",
                  used=taken[0], limit=per_hour, flag="--max-slots-per-hour")
