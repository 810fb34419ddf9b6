"""The DVBench database: schema, migrations and every query (SQLAlchemy Core).

The same code runs on SQLite (WAL mode; the default, embedded) and on
PostgreSQL (``postgresql+psycopg://...``). Schema changes are numbered
migrations recorded in ``schema_migrations``; ``migrate()`` applies the missing
ones in order, each in its own transaction.

Example::

  store = Store.open("sqlite:///data/dvbench.db")
  owner = store.create_token("alice")[0]
"""

import hashlib
import secrets
import time
from collections.abc import Callable

import sqlalchemy as sa

metadata = sa.MetaData()

schema_migrations = sa.Table(
    "schema_migrations", metadata,
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("applied_at", sa.Float, nullable=False))

owners = sa.Table(
    "owners", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(200), unique=True, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False))

tokens = sa.Table(
    "tokens", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("owner_id", sa.Integer, sa.ForeignKey("owners.id"), nullable=False),
    sa.Column("token_hash", sa.String(64), unique=True, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False))

experiments = sa.Table(
    "experiments", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("owner_id", sa.Integer, sa.ForeignKey("owners.id"), nullable=False),
    sa.Column("full_name", sa.String(400), unique=True, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False))

proofs = sa.Table(
    "proofs", metadata,
    sa.Column("id", sa.String(64), primary_key=True),  # the transcript id, hex
    sa.Column("experiment_id", sa.Integer, sa.ForeignKey("experiments.id"), nullable=False),
    sa.Column("name", sa.String(400), nullable=False),
    sa.Column("state", sa.String(20), nullable=False),
    sa.Column("failure", sa.Text),
    sa.Column("records", sa.Integer, nullable=False, default=0),
    sa.Column("steps", sa.Integer, nullable=False, default=0),
    sa.Column("final_params", sa.String(64)),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False))

records = sa.Table(
    "records", metadata,
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), primary_key=True),
    sa.Column("position", sa.Integer, primary_key=True),
    sa.Column("record_id", sa.LargeBinary(32), nullable=False),
    sa.Column("kind", sa.String(20), nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.UniqueConstraint("proof_id", "record_id"))

streams = sa.Table(
    "streams", metadata,
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), primary_key=True),
    sa.Column("client_id", sa.String(64), primary_key=True),
    sa.Column("next_seq", sa.Integer, nullable=False),
    sa.Column("last_ack", sa.Text, nullable=False))

chunks = sa.Table(
    "chunks", metadata,
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), primary_key=True),
    sa.Column("record_id", sa.LargeBinary(32), primary_key=True),
    sa.Column("idx", sa.Integer, primary_key=True),
    sa.Column("count", sa.Integer, nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False))

blob_refs = sa.Table(
    "blob_refs", metadata,
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), primary_key=True),
    sa.Column("digest", sa.String(64), primary_key=True))

jobs = sa.Table(
    "jobs", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("kind", sa.String(20), nullable=False),  # "proof" or "measurement"
    sa.Column("subject", sa.String(64), nullable=False),  # the proof or measurement id
    sa.Column("state", sa.String(20), nullable=False),  # queued, running, done
    sa.Column("lease_owner", sa.String(100)),
    sa.Column("lease_expires", sa.Float),
    sa.Column("attempts", sa.Integer, nullable=False, default=0),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.UniqueConstraint("kind", "subject"))

measurements = sa.Table(
    "measurements", metadata,
    sa.Column("id", sa.String(64), primary_key=True),  # BLAKE3 of the submission, hex
    sa.Column("experiment_id", sa.Integer, sa.ForeignKey("experiments.id"), nullable=False),
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), nullable=False),
    sa.Column("metric", sa.String(100), nullable=False),
    sa.Column("value", sa.Float, nullable=False),
    sa.Column("higher_is_better", sa.Boolean, nullable=False),
    sa.Column("state", sa.String(20), nullable=False),
    sa.Column("failure", sa.Text),
    sa.Column("batches", sa.Integer, nullable=False),
    sa.Column("sampled", sa.Integer, nullable=False),
    sa.Column("checkpoint", sa.String(64), nullable=False),
    sa.Column("record", sa.LargeBinary, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False))

probes = sa.Table(
    "probes", metadata,
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), primary_key=True),
    sa.Column("digest", sa.String(64), primary_key=True))

eval_sets = sa.Table(
    "eval_sets", metadata,
    sa.Column("metric", sa.String(100), primary_key=True),
    sa.Column("owner_id", sa.Integer, sa.ForeignKey("owners.id"), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False))

eval_rows = sa.Table(
    "eval_rows", metadata,
    sa.Column("metric", sa.String(100), sa.ForeignKey("eval_sets.metric"), primary_key=True),
    sa.Column("digest", sa.String(64), primary_key=True))

checks = sa.Table(
    "checks", metadata,
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), primary_key=True),
    sa.Column("step", sa.Integer, primary_key=True),
    sa.Column("kind", sa.String(20), primary_key=True),
    sa.Column("mode", sa.String(20), nullable=False),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("max_abs_error", sa.Float, nullable=False),
    sa.Column("max_rel_error", sa.Float, nullable=False),
    sa.Column("max_ulp_error", sa.BigInteger, nullable=False))


def _migration_1(conn) -> None:
  """The first schema: accounts, experiments, proofs, records, jobs, checks."""
  for table in (owners, tokens, experiments, proofs, records, streams, chunks,
                blob_refs, jobs, checks, measurements, probes, eval_sets, eval_rows):
    table.create(conn)


MIGRATIONS: list[tuple[int, Callable]] = [(1, _migration_1)]

PROOF_STATES = ("receiving", "closed", "verifying", "verified", "invalid")
MEASUREMENT_STATES = ("pending", "verifying", "verified", "self-reported", "invalid")


def _sqlite_pragmas(dbapi_conn, _):
  cur = dbapi_conn.cursor()
  cur.execute("PRAGMA journal_mode=WAL")
  cur.execute("PRAGMA synchronous=NORMAL")
  cur.execute("PRAGMA busy_timeout=30000")
  cur.execute("PRAGMA foreign_keys=ON")
  cur.close()


def hash_token(token: str) -> str:
  return hashlib.sha256(token.encode()).hexdigest()


class Store:
  """All reads and writes of the service; one instance per process."""

  def __init__(self, engine: sa.Engine):
    self.engine = engine
    self.is_sqlite = engine.dialect.name == "sqlite"

  @classmethod
  def open(cls, url: str) -> "Store":
    if url.startswith("postgresql://"):
      url = "postgresql+psycopg://" + url[len("postgresql://"):]
    engine = sa.create_engine(url, future=True, pool_pre_ping=True)
    if engine.dialect.name == "sqlite":
      sa.event.listen(engine, "connect", _sqlite_pragmas)
    store = cls(engine)
    store.migrate()
    return store

  def migrate(self) -> list[int]:
    """Applies missing migrations in order; returns the versions applied."""
    applied = []
    with self.engine.begin() as conn:
      schema_migrations.create(conn, checkfirst=True)
    for version, step in MIGRATIONS:
      with self.engine.begin() as conn:
        done = conn.execute(sa.select(schema_migrations.c.version).where(
            schema_migrations.c.version == version)).first()
        if done:
          continue
        step(conn)
        conn.execute(schema_migrations.insert().values(version=version, applied_at=time.time()))
        applied.append(version)
    return applied

  # -- accounts ----------------------------------------------------------------

  def create_token(self, owner: str) -> tuple[int, str]:
    """Creates ``owner`` if needed and a new API token for it (stored hashed)."""
    token = "dvb_" + secrets.token_urlsafe(32)
    with self.engine.begin() as conn:
      owner_id = self._owner_id(conn, owner, create=True)
      conn.execute(tokens.insert().values(owner_id=owner_id, token_hash=hash_token(token),
                                          created_at=time.time()))
    return owner_id, token

  def owner_of_token(self, token: str) -> str | None:
    with self.engine.connect() as conn:
      row = conn.execute(sa.select(owners.c.name).select_from(tokens.join(owners)).where(
          tokens.c.token_hash == hash_token(token))).first()
    return row[0] if row else None

  def _owner_id(self, conn, owner: str, create: bool = False) -> int | None:
    row = conn.execute(sa.select(owners.c.id).where(owners.c.name == owner)).first()
    if row:
      return row[0]
    if not create:
      return None
    return conn.execute(owners.insert().values(name=owner, created_at=time.time())
                        ).inserted_primary_key[0]

  # -- experiments and proofs ------------------------------------------------------

  def experiment(self, full_name: str, create_for: str | None = None) -> dict | None:
    with self.engine.begin() as conn:
      row = conn.execute(sa.select(experiments).where(
          experiments.c.full_name == full_name)).mappings().first()
      if row is None and create_for is not None:
        owner_id = self._owner_id(conn, create_for, create=True)
        conn.execute(experiments.insert().values(owner_id=owner_id, full_name=full_name,
                                                 created_at=time.time()))
        row = conn.execute(sa.select(experiments).where(
            experiments.c.full_name == full_name)).mappings().first()
    return dict(row) if row else None

  def list_experiments(self) -> list[dict]:
    with self.engine.connect() as conn:
      rows = conn.execute(sa.select(experiments).order_by(experiments.c.full_name)).mappings()
      return [dict(r) for r in rows]

  def create_proof(self, experiment_id: int, proof_id: str, name: str, root: bytes,
                   root_kind: str) -> dict:
    """Creates the proof with its root record; idempotent for the same root."""
    now = time.time()
    with self.engine.begin() as conn:
      row = conn.execute(sa.select(proofs).where(proofs.c.id == proof_id)).mappings().first()
      if row is None:
        conn.execute(proofs.insert().values(
            id=proof_id, experiment_id=experiment_id, name=name, state="receiving",
            records=1, steps=0, created_at=now, updated_at=now))
        conn.execute(records.insert().values(proof_id=proof_id, position=0,
                                             record_id=bytes.fromhex(proof_id),
                                             kind=root_kind, data=root))
        row = conn.execute(sa.select(proofs).where(proofs.c.id == proof_id)).mappings().first()
    return dict(row)

  def proof(self, proof_id: str) -> dict | None:
    with self.engine.connect() as conn:
      row = conn.execute(sa.select(proofs, experiments.c.full_name.label("experiment"))
                         .select_from(proofs.join(experiments))
                         .where(proofs.c.id == proof_id)).mappings().first()
    return dict(row) if row else None

  def list_proofs(self, experiment_id: int | None = None) -> list[dict]:
    query = (sa.select(proofs, experiments.c.full_name.label("experiment"))
             .select_from(proofs.join(experiments)).order_by(proofs.c.created_at.desc()))
    if experiment_id is not None:
      query = query.where(proofs.c.experiment_id == experiment_id)
    with self.engine.connect() as conn:
      return [dict(r) for r in conn.execute(query).mappings()]

  def set_proof_state(self, proof_id: str, state: str, failure: str | None = None,
                      conn=None, **fields) -> None:
    assert state in PROOF_STATES
    statement = proofs.update().where(proofs.c.id == proof_id).values(
        state=state, failure=failure, updated_at=time.time(), **fields)
    if conn is not None:
      conn.execute(statement)
    else:
      with self.engine.begin() as c:
        c.execute(statement)

  # -- the stream --------------------------------------------------------------------

  def stream_position(self, conn, proof_id: str, client_id: str) -> tuple[int, str | None]:
    row = conn.execute(sa.select(streams.c.next_seq, streams.c.last_ack).where(
        (streams.c.proof_id == proof_id) & (streams.c.client_id == client_id))).first()
    return (row[0], row[1]) if row else (0, None)

  def advance_stream(self, conn, proof_id: str, client_id: str, seq: int, ack: str) -> None:
    if seq == 0:
      conn.execute(streams.insert().values(proof_id=proof_id, client_id=client_id,
                                           next_seq=1, last_ack=ack))
    else:
      conn.execute(streams.update().where(
          (streams.c.proof_id == proof_id) & (streams.c.client_id == client_id)
      ).values(next_seq=seq + 1, last_ack=ack))

  def append_records(self, conn, proof_id: str, items: list[tuple[bytes, str, bytes]],
                     blob_digests: set[str]) -> tuple[int, int]:
    """Appends new records (deduplicated by id); returns (stored, duplicates)."""
    existing = {r[0] for r in conn.execute(sa.select(records.c.record_id).where(
        (records.c.proof_id == proof_id)
        & records.c.record_id.in_([i[0] for i in items])))} if items else set()
    count = conn.execute(sa.select(proofs.c.records).where(proofs.c.id == proof_id)).scalar()
    rows, seen = [], set(existing)
    for record_id, kind, data in items:
      if record_id in seen:
        continue
      seen.add(record_id)
      rows.append({"proof_id": proof_id, "position": count + len(rows),
                   "record_id": record_id, "kind": kind, "data": data})
    if rows:
      conn.execute(records.insert(), rows)
      steps = sum(r["kind"] == "step" for r in rows)
      conn.execute(proofs.update().where(proofs.c.id == proof_id).values(
          records=proofs.c.records + len(rows), steps=proofs.c.steps + steps,
          updated_at=time.time()))
    known = {r[0] for r in conn.execute(sa.select(blob_refs.c.digest).where(
        blob_refs.c.proof_id == proof_id))}
    new_refs = [{"proof_id": proof_id, "digest": d} for d in sorted(blob_digests - known)]
    if new_refs:
      conn.execute(blob_refs.insert(), new_refs)
    return len(rows), len(items) - len(rows)

  def put_chunk(self, conn, proof_id: str, record_id: bytes, idx: int, count: int,
                data: bytes) -> bytes | None:
    """Stores a chunk; returns the whole record once every chunk is here."""
    exists = conn.execute(sa.select(chunks.c.idx).where(
        (chunks.c.proof_id == proof_id) & (chunks.c.record_id == record_id)
        & (chunks.c.idx == idx))).first()
    if not exists:
      conn.execute(chunks.insert().values(proof_id=proof_id, record_id=record_id, idx=idx,
                                          count=count, data=data))
    parts = conn.execute(sa.select(chunks.c.idx, chunks.c.data).where(
        (chunks.c.proof_id == proof_id) & (chunks.c.record_id == record_id)
    ).order_by(chunks.c.idx)).all()
    if len(parts) < count:
      return None
    conn.execute(chunks.delete().where((chunks.c.proof_id == proof_id)
                                       & (chunks.c.record_id == record_id)))
    return b"".join(p[1] for p in parts)

  def record_data(self, proof_id: str) -> list[bytes]:
    with self.engine.connect() as conn:
      return [r[0] for r in conn.execute(sa.select(records.c.data).where(
          records.c.proof_id == proof_id).order_by(records.c.position))]

  def last_record(self, conn, proof_id: str) -> tuple[int, bytes | None, bytes | None]:
    """(record count, id and bytes of the last record) of a proof."""
    row = conn.execute(sa.select(records.c.position, records.c.record_id, records.c.data)
                       .where(records.c.proof_id == proof_id)
                       .order_by(records.c.position.desc()).limit(1)).first()
    return (0, None, None) if row is None else (row[0] + 1, row[1], row[2])

  def record_ids(self, proof_id: str) -> list[bytes]:
    with self.engine.connect() as conn:
      return [r[0] for r in conn.execute(sa.select(records.c.record_id).where(
          records.c.proof_id == proof_id).order_by(records.c.position))]

  def blob_digests(self, conn, proof_id: str) -> list[str]:
    return [r[0] for r in conn.execute(sa.select(blob_refs.c.digest).where(
        blob_refs.c.proof_id == proof_id))]

  # -- validation jobs -----------------------------------------------------------------

  def enqueue_job(self, conn, kind: str, subject: str) -> None:
    if not conn.execute(sa.select(jobs.c.id).where(
        (jobs.c.kind == kind) & (jobs.c.subject == subject))).first():
      conn.execute(jobs.insert().values(kind=kind, subject=subject, state="queued",
                                        attempts=0, created_at=time.time()))

  def claim_job(self, worker: str, lease_seconds: float) -> dict | None:
    """Takes a queued job, or one whose lease expired, for ``lease_seconds``."""
    now = time.time()
    claimable = (jobs.c.state == "queued") | (
        (jobs.c.state == "running") & (jobs.c.lease_expires < now))
    with self.engine.begin() as conn:
      query = sa.select(jobs.c.id).where(claimable).order_by(jobs.c.id).limit(1)
      if not self.is_sqlite:  # PostgreSQL: workers skip rows another one holds
        query = query.with_for_update(skip_locked=True)
      row = conn.execute(query).first()
      if row is None:
        return None
      updated = conn.execute(jobs.update().where((jobs.c.id == row[0]) & claimable).values(
          state="running", lease_owner=worker, lease_expires=now + lease_seconds,
          attempts=jobs.c.attempts + 1))
      if updated.rowcount != 1:
        return None  # another worker won the race
      job = dict(conn.execute(sa.select(jobs).where(jobs.c.id == row[0])).mappings().first())
      if job["kind"] == "proof":
        self.set_proof_state(job["subject"], "verifying", conn=conn)
      else:
        conn.execute(measurements.update().where(measurements.c.id == job["subject"]).values(
            state="verifying", updated_at=now))
    return job

  def extend_lease(self, job_id: int, worker: str, lease_seconds: float) -> bool:
    with self.engine.begin() as conn:
      return conn.execute(jobs.update().where(
          (jobs.c.id == job_id) & (jobs.c.lease_owner == worker) & (jobs.c.state == "running")
      ).values(lease_expires=time.time() + lease_seconds)).rowcount == 1

  def _finish_job(self, conn, job_id: int, worker: str) -> bool:
    return conn.execute(jobs.update().where(
        (jobs.c.id == job_id) & (jobs.c.lease_owner == worker) & (jobs.c.state == "running")
    ).values(state="done")).rowcount == 1

  def complete_proof_job(self, job_id: int, worker: str, proof_id: str, state: str,
                         failure: str | None, check_rows: list[dict]) -> bool:
    """Stores the verdict; False (nothing written) when the lease was lost."""
    with self.engine.begin() as conn:
      if not self._finish_job(conn, job_id, worker):
        return False
      conn.execute(checks.delete().where(checks.c.proof_id == proof_id))
      if check_rows:
        conn.execute(checks.insert(), [{"proof_id": proof_id, **r} for r in check_rows])
      self.set_proof_state(proof_id, state, failure, conn=conn)
    return True

  def complete_measurement_job(self, job_id: int, worker: str, measurement_id: str,
                               state: str, failure: str | None) -> bool:
    assert state in MEASUREMENT_STATES
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

  def add_measurement(self, row: dict) -> dict:
    """Stores a submission (idempotent by id) and queues its replay."""
    now = time.time()
    with self.engine.begin() as conn:
      if not conn.execute(sa.select(measurements.c.id).where(
          measurements.c.id == row["id"])).first():
        conn.execute(measurements.insert().values(**row, state="pending", created_at=now,
                                                  updated_at=now))
        self.enqueue_job(conn, "measurement", row["id"])
    return self.measurement(row["id"])

  def measurement(self, measurement_id: str) -> dict | None:
    with self.engine.connect() as conn:
      row = conn.execute(sa.select(measurements).where(
          measurements.c.id == measurement_id)).mappings().first()
    return dict(row) if row else None

  def list_measurements(self) -> list[dict]:
    query = (sa.select(measurements, experiments.c.full_name.label("experiment"),
                       proofs.c.state.label("proof_state"), proofs.c.steps)
             .select_from(measurements.join(experiments).join(
                 proofs, proofs.c.id == measurements.c.proof_id))
             .order_by(measurements.c.metric, measurements.c.created_at))
    with self.engine.connect() as conn:
      return [dict(r) for r in conn.execute(query).mappings()]

  def add_probes(self, conn, proof_id: str, digests: set[str]) -> None:
    known = {r[0] for r in conn.execute(sa.select(probes.c.digest).where(
        probes.c.proof_id == proof_id))}
    new = [{"proof_id": proof_id, "digest": d} for d in sorted(digests - known)]
    if new:
      conn.execute(probes.insert(), new)

  def probe_counts(self) -> dict[str, int]:
    with self.engine.connect() as conn:
      return dict(conn.execute(sa.select(probes.c.proof_id, sa.func.count()).group_by(
          probes.c.proof_id)).all())

  def set_eval_rows(self, metric: str, owner: str, digests: list[str]) -> bool:
    """Registers (or replaces) a metric's evaluation rows; False for another owner's."""
    with self.engine.begin() as conn:
      owner_id = self._owner_id(conn, owner, create=True)
      current = conn.execute(sa.select(eval_sets.c.owner_id).where(
          eval_sets.c.metric == metric)).first()
      if current is not None and current[0] != owner_id:
        return False
      if current is None:
        conn.execute(eval_sets.insert().values(metric=metric, owner_id=owner_id,
                                               created_at=time.time()))
      conn.execute(eval_rows.delete().where(eval_rows.c.metric == metric))
      if digests:
        conn.execute(eval_rows.insert(), [{"metric": metric, "digest": d}
                                          for d in sorted(set(digests))])
    return True

  def contamination(self, metric: str) -> dict[str, int] | None:
    """Per proof: probed training rows equal to rows of the metric's evaluation set."""
    with self.engine.connect() as conn:
      if not conn.execute(sa.select(eval_sets.c.metric).where(
          eval_sets.c.metric == metric)).first():
        return None
      query = (sa.select(probes.c.proof_id, sa.func.count())
               .select_from(probes.join(eval_rows, eval_rows.c.digest == probes.c.digest))
               .where(eval_rows.c.metric == metric).group_by(probes.c.proof_id))
      return dict(conn.execute(query).all())

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
