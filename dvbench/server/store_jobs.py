"""Queries of validation jobs, measurements, probes, evaluation sets and replayed checks.

A mixin of ``db.Store``. Example::

  job = store.claim_job("w1", lease_seconds=60)
"""

import json
import math
import time

import sqlalchemy as sa

from dvbench import scoring
from dvbench.server.schema import (challengers, checks, chunks, experiments, jobs,
                                   measurement_samples, measurements, owners, pending_verdicts,
                                   probes, proof_claims, proofs, records, score_shards,
                                   submissions)
from dvbench.server.store_custody import add_proof_digests

# The state of a proof or measurement whose verification itself failed (its worker died, ran
# out of memory, or the verifier faulted) and was given up: "could not verify: <cause>".
UNVERIFIABLE = "unverifiable"
# "committed": outputs committed, the server chose the batches to open; "self-reported":
# the opened batches replayed and the aggregate recomputed, on the submitter's own program
# and data (never ranked); "invalid": what failed; "unverifiable": the replay itself failed
# (its worker, out of memory), so nothing is said about the submission.
MEASUREMENT_STATES = ("committed", "pending", "verifying", "self-reported", "invalid",
                      UNVERIFIABLE)
_RUNNING = {"proof": (proofs, "verifying"), "measurement": (measurements, "verifying"),
            scoring.SHARD_JOB: (score_shards, "scoring")}
# A job given up never says "invalid": that needs a finding about what was verified; nor
# "failed" for a scoring shard: its program and rows are the benchmark's, the params' layout
# fixed, so what gave up is the server (resubmitting scores it again).
_GIVEN_UP = {"proof": UNVERIFIABLE, "measurement": UNVERIFIABLE,
             scoring.SHARD_JOB: scoring.UNSCORED}
DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_MAX_QUEUED_PER_OWNER = 16


def _duration(seconds: float) -> str:
  """E.g. '24 h', '90 s'."""
  for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
    if seconds >= size:
      return f"{seconds / size:g} {unit}"
  return f"{seconds:g} s"


def owner_share(workers: int) -> int:
  """The most running jobs one owner may hold while another owner's job waits: half the
  workers, rounded up (e.g. 1 of 2, 2 of 3), so a long job leaves the rest to others."""
  return max(1, math.ceil(workers / 2))


def claim_order(conn, claimable, now: float, share: int | None) -> list:
  """The owners with a claimable job, in the order the queue serves them: fewest running
  jobs first, then the one served least recently, then the oldest job. Where more than
  one owner waits, those already holding ``share`` running jobs are left out.

  Example: alice running 0, mallory 1 (share 1) -> ['alice'] while both wait.
  """
  waiting = dict(conn.execute(sa.select(jobs.c.owner, sa.func.min(jobs.c.id)).where(
      claimable).group_by(jobs.c.owner)).all())
  running = dict(conn.execute(sa.select(jobs.c.owner, sa.func.count()).where(
      (jobs.c.state == "running") & (jobs.c.lease_expires >= now)).group_by(jobs.c.owner)).all())
  served = dict(conn.execute(sa.select(jobs.c.owner, sa.func.max(sa.func.coalesce(
      jobs.c.started_at, 0.0))).where(jobs.c.owner.in_(list(waiting)) | jobs.c.owner.is_(None))
                             .group_by(jobs.c.owner)).all())
  owners = list(waiting)
  if share is not None and len(owners) > 1:
    owners = [o for o in owners if running.get(o, 0) < share] or owners
  return sorted(owners, key=lambda o: (running.get(o, 0), served.get(o) or 0.0, waiting[o]))


class QueueFull(Exception):
  """An owner already has the most jobs the server queues per owner (HTTP 429)."""


def bounded_errors(row: dict) -> dict:
  """A check row every database stores: a NaN or infinite error is stored as infinity, an
  ulp error beyond 64 bits as the largest one (the row's status says it failed)."""
  errors = {k: math.inf if math.isnan(row[k]) else row[k]
            for k in ("max_abs_error", "max_rel_error")}
  return {**row, **errors, "max_ulp_error": min(int(row["max_ulp_error"]), 2**63 - 1)}


class JobQueries:
  """Jobs (leased, fair across owners, given up after repeated failures), measurements and
  what the leaderboard counts."""

  max_queued_per_owner = DEFAULT_MAX_QUEUED_PER_OWNER

  # -- validation jobs -----------------------------------------------------------------

  @staticmethod
  def subject_owner(conn, kind: str, subject: str) -> str | None:
    """The owner whose proof, measurement or submission a job verifies."""
    if kind == "proof":
      proof_id = subject
    elif kind == "measurement":
      proof_id = conn.execute(sa.select(measurements.c.proof_id).where(
          measurements.c.id == subject)).scalar()
    elif kind == "score":  # a whole submission, as jobs were before migration 5
      proof_id = conn.execute(sa.select(submissions.c.proof_id).where(
          submissions.c.id == subject)).scalar()
    else:  # a scoring shard of a submission
      proof_id = conn.execute(sa.select(submissions.c.proof_id).select_from(
          score_shards.join(submissions)).where(score_shards.c.id == subject)).scalar()
    return conn.execute(sa.select(owners.c.name).select_from(
        proofs.join(experiments).join(owners)).where(proofs.c.id == proof_id)).scalar()

  def enqueue_job(self, conn, kind: str, subject: str) -> None:
    """Queues a job once per subject; QueueFull when its owner has too many waiting."""
    if conn.execute(sa.select(jobs.c.id).where(
        (jobs.c.kind == kind) & (jobs.c.subject == subject))).first():
      return
    owner = self.subject_owner(conn, kind, subject)
    waiting = self._waiting(conn, owner)
    if waiting >= self.max_queued_per_owner and not (
        kind == scoring.SHARD_JOB and self._scoring(conn, subject)):
      raise QueueFull(f"'{owner}' already has {waiting} jobs waiting for verification (the "
                      f"server queues at most {self.max_queued_per_owner} per owner; a "
                      "submission's scoring counts as one); retry when some have finished.")
    conn.execute(jobs.insert().values(kind=kind, subject=subject, state="queued", attempts=0,
                                      owner=owner, created_at=time.time()))

  @staticmethod
  def _waiting(conn, owner: str | None) -> int:
    """The owner's jobs queued or running, a submission's scoring shards as one."""
    active = (jobs.c.owner == owner) & jobs.c.state.in_(("queued", "running"))
    alone = conn.execute(sa.select(sa.func.count()).select_from(jobs).where(
        active & (jobs.c.kind != scoring.SHARD_JOB))).scalar()
    if not conn.execute(sa.select(jobs.c.id).where(
        active & (jobs.c.kind == scoring.SHARD_JOB)).limit(1)).first():
      return alone
    return alone + conn.execute(
        sa.select(sa.func.count(sa.distinct(score_shards.c.submission_id)))
        .select_from(jobs.join(score_shards, score_shards.c.id == jobs.c.subject))
        .where(active & (jobs.c.kind == scoring.SHARD_JOB))).scalar()

  @staticmethod
  def _scoring(conn, shard: str) -> bool:
    """Whether another shard of ``shard``'s submission is queued or running (counted)."""
    submission = sa.select(score_shards.c.submission_id).where(score_shards.c.id == shard)
    return conn.execute(sa.select(jobs.c.id).select_from(
        jobs.join(score_shards, score_shards.c.id == jobs.c.subject)).where(
            (jobs.c.kind == scoring.SHARD_JOB) & jobs.c.state.in_(("queued", "running"))
            & score_shards.c.submission_id.in_(submission)).limit(1)).first() is not None

  def claim_job(self, worker: str, lease_seconds: float,
                max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                owner_share: int | None = None) -> dict | None:
    """Takes a queued job, or one whose lease expired, for ``lease_seconds``.

    Fair across owners (``claim_order``): the oldest job of the owner with the fewest
    running jobs (then the one served least recently); with ``owner_share`` an owner
    holding that many running jobs gets no more while another owner's job waits. A job
    whose lease expired after ``max_attempts`` attempts is given up (``failed``). Raises
    ``db.NewerSchema`` once a newer dvbench migrated the database (checked at each claim:
    a worker started before an upgrade would verify by rules the tables no longer follow).
    """
    with self.engine.begin() as conn:
      self.check_schema(conn)
      now = time.time()  # once the write lock is held: claims' started_at follow their order
      expired = (jobs.c.state == "running") & (jobs.c.lease_expires < now)
      claimable = (jobs.c.state == "queued") | expired
      for exhausted in conn.execute(sa.select(jobs).where(
          expired & (jobs.c.attempts >= max_attempts))).mappings().all():
        self._give_up(conn, dict(exhausted), now)
      row = None
      for owner in claim_order(conn, claimable, now, owner_share):
        query = (sa.select(jobs.c.id).where(claimable & jobs.c.owner.is_not_distinct_from(owner))
                 .order_by(jobs.c.id).limit(1))
        if not self.is_sqlite:  # PostgreSQL: workers skip rows another one holds
          query = query.with_for_update(skip_locked=True)
        row = conn.execute(query).first()
        if row is not None:
          break
      if row is None:
        return None
      updated = conn.execute(jobs.update().where((jobs.c.id == row[0]) & claimable).values(
          state="running", lease_owner=worker, lease_expires=now + lease_seconds,
          attempts=jobs.c.attempts + 1, started_at=now, heartbeat_at=now, failure=None))
      if updated.rowcount != 1:
        return None  # another worker won the race
      job = dict(conn.execute(sa.select(jobs).where(jobs.c.id == row[0])).mappings().first())
      self._set_subject_state(conn, job, _RUNNING[job["kind"]][1], None, now)
    return job

  def _set_subject_state(self, conn, job: dict, state: str, failure: str | None,
                         now: float) -> None:
    if job["kind"] == "proof":
      self.set_proof_state(job["subject"], state, failure, conn=conn)
    else:
      table = _RUNNING[job["kind"]][0]
      conn.execute(table.update().where(table.c.id == job["subject"]).values(
          state=state, failure=failure, updated_at=now))
    if job["kind"] == scoring.SHARD_JOB and state in ("failed", scoring.UNSCORED):
      submission_id = conn.execute(sa.select(score_shards.c.submission_id).where(
          score_shards.c.id == job["subject"])).scalar_one()
      conn.execute(submissions.update().where(submissions.c.id == submission_id).values(
          **self._settled(conn, submission_id), updated_at=now))

  def _give_up(self, conn, job: dict, now: float) -> None:
    cause = job["failure"] or "the worker stopped before finishing (its lease expired)"
    what = ("score", "scoring") if job["kind"] == scoring.SHARD_JOB else ("verify", "verification")
    failure = (f"could not {what[0]}: {what[1]} was given up after {job['attempts']} "
               f"attempts; the last one ended because {cause}.")
    conn.execute(jobs.update().where(jobs.c.id == job["id"]).values(
        state="failed", failure=failure, lease_owner=None))
    self._set_subject_state(conn, job, _GIVEN_UP[job["kind"]], failure, now)

  def release_jobs(self, worker: str, cause: str) -> int:
    """Makes the running jobs of a stopped worker claimable now, noting ``cause`` (said
    publicly when the job is given up); returns how many."""
    with self.engine.begin() as conn:
      return conn.execute(jobs.update().where(
          (jobs.c.lease_owner == worker) & (jobs.c.state == "running")
      ).values(lease_expires=0.0, failure=cause)).rowcount

  def running_job_workers(self) -> list[str]:
    """The workers holding running jobs."""
    with self.engine.connect() as conn:
      return [r[0] for r in conn.execute(sa.select(jobs.c.lease_owner).distinct().where(
          jobs.c.state == "running"))]

  def extend_lease(self, job_id: int, worker: str, lease_seconds: float) -> bool:
    """The worker's heartbeat: a longer lease, and the time it was last heard from."""
    with self.engine.begin() as conn:
      now = time.time()  # once the write lock is held: the lease runs from when it is written
      return conn.execute(jobs.update().where(
          (jobs.c.id == job_id) & (jobs.c.lease_owner == worker) & (jobs.c.state == "running")
      ).values(lease_expires=now + lease_seconds, heartbeat_at=now)).rowcount == 1

  def _finish_job(self, conn, job_id: int, worker: str) -> bool:
    return conn.execute(jobs.update().where(
        (jobs.c.id == job_id) & (jobs.c.lease_owner == worker) & (jobs.c.state == "running")
    ).values(state="done", failure=None)).rowcount == 1

  def check_record_count(self, proof_id: str) -> int:
    """How many check records the proof holds: what its verification replays."""
    with self.engine.connect() as conn:
      return conn.execute(sa.select(sa.func.count()).select_from(records).where(
          (records.c.proof_id == proof_id) & (records.c.kind == "check"))).scalar()

  def abandon_idle_proofs(self, idle_seconds: float) -> list[str]:
    """Closes proofs left ``receiving`` with no record for ``idle_seconds`` as ``abandoned``
    (never verified); returns their ids. Drops the chunks of incomplete records of every
    proof that takes no more records (these and any left by an older server)."""
    cutoff = time.time() - idle_seconds
    stale = (proofs.c.state == "receiving") & (proofs.c.updated_at < cutoff)
    failure = (f"no record arrived for {_duration(idle_seconds)}: the run stopped before "
               "closing the proof, so it is never verified.")
    with self.engine.begin() as conn:
      ids = [r[0] for r in conn.execute(sa.select(proofs.c.id).where(stale))]
      if ids:
        conn.execute(proofs.update().where(stale & proofs.c.id.in_(ids)).values(
            state="abandoned", failure=failure, updated_at=time.time()))
      conn.execute(chunks.delete().where(chunks.c.proof_id.in_(
          sa.select(proofs.c.id).where(proofs.c.state != "receiving"))))
    return ids

  def complete_proof_job(self, job_id: int, worker: str, proof_id: str, state: str,
                         failure: str | None, check_rows: list[dict], *,
                         receipt: tuple[str, int], claims: dict | None = None,
                         strict: bool = False) -> bool:
    """Stores the verdict and the claims; False (nothing written) when the lease was lost.

    ``receipt``: the verifier's verdict and the checks it replayed. On a server-challenged
    proof the state waits with them in ``pending_verdicts``: the server process publishes
    it together with the receipt it signs (``receipts.publish_pending``), so no worker
    needs the signing key and no verdict is public without its receipt."""
    with self.engine.begin() as conn:
      if not self._finish_job(conn, job_id, worker):
        return False
      conn.execute(checks.delete().where(checks.c.proof_id == proof_id))
      if check_rows:
        conn.execute(checks.insert(), [{"proof_id": proof_id, **bounded_errors(r)}
                                       for r in check_rows])
      conn.execute(proof_claims.delete().where(proof_claims.c.proof_id == proof_id))
      if claims is not None:
        conn.execute(proof_claims.insert().values(proof_id=proof_id, claims=json.dumps(claims),
                                                  strict=strict))
      kind = conn.execute(sa.select(challengers.c.kind).where(
          challengers.c.proof_id == proof_id)).scalar()
      if kind != "dvbench":  # the server chose nothing: no receipt
        self.set_proof_state(proof_id, state, failure, conn=conn)
        return True
      conn.execute(pending_verdicts.delete().where(pending_verdicts.c.proof_id == proof_id))
      conn.execute(pending_verdicts.insert().values(
          proof_id=proof_id, state=state, failure=failure, verdict=receipt[0],
          checks=receipt[1], created_at=time.time()))
    return True

  def pending_verdicts(self, limit: int = 16) -> list[dict]:
    """The oldest verdicts waiting for the server to sign their receipts."""
    with self.engine.connect() as conn:
      return [dict(r) for r in conn.execute(sa.select(pending_verdicts).order_by(
          pending_verdicts.c.created_at).limit(limit)).mappings()]

  def take_pending_verdict(self, proof_id: str, conn) -> bool:
    """Removes ``proof_id``'s pending verdict inside ``conn``'s transaction; False when
    another process took it first."""
    return conn.execute(pending_verdicts.delete().where(
        pending_verdicts.c.proof_id == proof_id)).rowcount == 1

  def proof_claims(self, proof_id: str) -> dict | None:
    """``{"claims": {claim: status}, "strict": bool}`` of the server's verification."""
    with self.engine.connect() as conn:
      row = conn.execute(sa.select(proof_claims).where(
          proof_claims.c.proof_id == proof_id)).mappings().first()
    return None if row is None else {"claims": json.loads(row["claims"]),
                                     "strict": bool(row["strict"])}

  def complete_measurement_job(self, job_id: int, worker: str, measurement_id: str,
                               state: str, failure: str | None) -> bool:
    if state not in MEASUREMENT_STATES:
      raise ValueError(f"unknown measurement state {state!r}.")
    with self.engine.begin() as conn:
      if not self._finish_job(conn, job_id, worker):
        return False
      conn.execute(measurements.update().where(measurements.c.id == measurement_id).values(
          state=state, failure=failure, updated_at=time.time()))
    return True

  def job(self, kind: str, subject: str) -> dict | None:
    with self.engine.connect() as conn:
      row = conn.execute(sa.select(jobs).where(
          (jobs.c.kind == kind) & (jobs.c.subject == subject))).mappings().first()
    return dict(row) if row else None

  # -- measurements, probes, evaluation sets ----------------------------------------

  def add_measurement(self, row: dict, seed: bytes, opened: list[int]) -> dict:
    """Stores a committed submission (idempotent by id) with the batches the server chose."""
    now = time.time()
    with self.engine.begin() as conn:
      if not conn.execute(sa.select(measurements.c.id).where(
          measurements.c.id == row["id"])).first():
        conn.execute(measurements.insert().values(**row, state="committed", created_at=now,
                                                  updated_at=now))
        conn.execute(measurement_samples.insert().values(
            measurement_id=row["id"], seed=seed, opened=json.dumps(opened)))
    return self.measurement(row["id"])

  def measurement_sample(self, measurement_id: str) -> dict | None:
    """``{"seed", "opened" (list), "openings" (CBOR or None)}`` of a measurement."""
    with self.engine.connect() as conn:
      row = conn.execute(sa.select(measurement_samples).where(
          measurement_samples.c.measurement_id == measurement_id)).mappings().first()
    return None if row is None else {**row, "opened": json.loads(row["opened"])}

  def open_measurement(self, measurement_id: str, openings: bytes) -> bool:
    """Stores the openings of a committed measurement and queues its replay; False if not
    committed (already opened)."""
    with self.engine.begin() as conn:
      if conn.execute(measurements.update().where(
          (measurements.c.id == measurement_id) & (measurements.c.state == "committed")
      ).values(state="pending", updated_at=time.time())).rowcount != 1:
        return False
      conn.execute(measurement_samples.update().where(
          measurement_samples.c.measurement_id == measurement_id).values(openings=openings))
      self.enqueue_job(conn, "measurement", measurement_id)
    return True

  def measurement(self, measurement_id: str) -> dict | None:
    with self.engine.connect() as conn:
      row = conn.execute(sa.select(measurements).where(
          measurements.c.id == measurement_id)).mappings().first()
    return dict(row) if row else None

  def list_measurements(self, limit: int = 1000,
                        experiment_id: int | None = None) -> list[dict]:
    """The first ``limit`` measurements by metric, then age (what one page shows), of one
    experiment or all; without their records (up to 16 MiB each)."""
    shown = [c for c in measurements.c if c.name != "record"]
    query = (sa.select(*shown, experiments.c.full_name.label("experiment"),
                       proofs.c.state.label("proof_state"), proofs.c.steps)
             .select_from(measurements.join(experiments).join(
                 proofs, proofs.c.id == measurements.c.proof_id))
             .order_by(measurements.c.metric, measurements.c.created_at).limit(limit))
    if experiment_id is not None:
      query = query.where(measurements.c.experiment_id == experiment_id)
    with self.engine.connect() as conn:
      return [dict(r) for r in conn.execute(query).mappings()]

  def add_probes(self, conn, proof_id: str, digests: set[str]) -> None:
    add_proof_digests(conn, probes, proof_id, digests)

  def add_probed(self, proof_id: str, rows: set[str], examples: set[str]) -> None:
    """Stores, in one transaction, row and example digests a proof's probes opened."""
    with self.engine.begin() as conn:
      self.add_probes(conn, proof_id, rows)
      self.add_probe_examples(conn, proof_id, examples)

  def probe_count(self, proof_id: str) -> int:
    """The distinct batch rows a proof's probes opened, as its worker indexed them."""
    with self.engine.connect() as conn:
      return conn.execute(sa.select(sa.func.count()).select_from(probes).where(
          probes.c.proof_id == proof_id)).scalar()

  def check_counts(self) -> dict[str, tuple[int, int]]:
    """Per proof: (checks replayed by the server, of which verified)."""
    query = sa.select(checks.c.proof_id, sa.func.count(),
                      sa.func.sum(sa.case((checks.c.status == "verified", 1), else_=0))
                      ).group_by(checks.c.proof_id)
    with self.engine.connect() as conn:
      return {p: (n, int(v or 0)) for p, n, v in conn.execute(query).all()}

  def proof_checks(self, proof_id: str) -> list[dict]:
    with self.engine.connect() as conn:
      rows = conn.execute(sa.select(checks).where(checks.c.proof_id == proof_id)
                          .order_by(checks.c.step, checks.c.kind)).mappings()
      return [{k: v for k, v in r.items() if k != "proof_id"} for r in rows]
