"""The DVBench database: migrations and the ``Store`` of every query (SQLAlchemy Core).

The same code runs on SQLite (WAL mode; the default, embedded) and on
PostgreSQL (``postgresql+psycopg://...``). Schema changes are numbered
migrations recorded in ``schema_migrations``; ``migrate()`` applies the missing
ones in order, each in its own transaction.

Every ``store.engine.begin()`` transaction writes, and takes the database's write lock
before its first read (``BEGIN IMMEDIATE`` on SQLite, a transaction-scoped advisory lock
on PostgreSQL): what it reads cannot change before it writes, so concurrent writers
queue instead of racing (a check-then-insert never fails on a duplicate key). Reads
(``store.engine.connect()``) take no lock.

Example::

  store = Store.open("sqlite:///data/dvbench.db")
  owner = store.create_token("alice")[0]
"""

import contextlib
import json
import threading
import time
from collections.abc import Callable

import cbor2
import sqlalchemy as sa

from dvbench.server.schema import (  # pylint: disable=unused-import  # re-exported
    MIGRATION_2_TABLES, MIGRATION_3_TABLES, MIGRATION_4_TABLES, MIGRATION_5_TABLES,
    MIGRATION_6_COLUMNS, MIGRATION_7_COLUMNS, MIGRATION_8_COLUMNS, MIGRATION_8_TABLES,
    MIGRATION_9_TABLES, MIGRATION_10_COLUMNS, MIGRATION_11_INDEX, MIGRATION_12_TABLES,
    MIGRATION_13_COLUMNS, MIGRATION_14_TABLES,
    benchmarks, blob_refs, challengers, challenges, checks, chunks, eval_rows, eval_sets, experiments, jobs,
    measurements, metadata, owners, probe_examples, probes, proof_blobs, proof_claims, proofs,
    receipts, records, schema_migrations, score_shards, settings, slots, streams, submissions,
    tokens)
from dvbench.server import store_benchmarks
from dvbench.scoring import SHARD_JOB
from dvbench.server.store_benchmarks import BenchmarkQueries
from dvbench.server.record_bodies import RecordBodies
from dvbench.server.store_custody import CustodyQueries
from dvbench.server.store_records import RecordReads
from dvbench.server.store_jobs import (MEASUREMENT_STATES, UNVERIFIABLE,  # pylint: disable=unused-import
                                      JobQueries)
from dvbench.server.store_listing import ListingQueries
from dvbench.server.store_liveness import LivenessQueries
from dvbench.server.store_summaries import SummaryQueries
from dvbench.server.store_tokens import TokenQueries, hash_token  # pylint: disable=unused-import
from zkdv.records import discarded_steps
from zkdv.verify import claims

def _migration_1(conn) -> None:
  """The first schema: accounts, experiments, proofs, records, jobs, checks."""
  for table in (owners, tokens, experiments, proofs, records, streams, chunks,
                blob_refs, jobs, checks, measurements, probes, eval_sets, eval_rows):
    table.create(conn)


def _migration_2(conn) -> None:
  """Server challenges: slots, challengers, challenges, blobs per proof, receipts."""
  for table in MIGRATION_2_TABLES:
    table.create(conn)


def _migration_3(conn) -> None:
  """Benchmarks, submissions scored by the server, server-chosen measurement samples.

  Measurements run the submitter's own program on its own data: ones stored as
  "verified" before are relabelled "self-reported".
  """
  for table in MIGRATION_3_TABLES:
    table.create(conn)
  conn.execute(measurements.update().where(measurements.c.state == "verified").values(
      state="self-reported"))


def _migration_4(conn) -> None:
  """The claims each server verification showed; rankings need every claim (--strict)."""
  for table in MIGRATION_4_TABLES:
    table.create(conn)


def _migration_5(conn) -> None:
  """Scoring in shards of rows (one worker job each); training-set members of probed rows.

  A submission still waiting for its (unsharded) score job gets one shard of every row,
  and that job becomes the shard's.
  """
  for table in MIGRATION_5_TABLES:
    table.create(conn)
  waiting = conn.execute(sa.select(submissions.c.id, benchmarks.c.rows).select_from(
      submissions.join(benchmarks)).where(submissions.c.state.in_(("pending", "scoring"))))
  for submission_id, rows in waiting.all():
    shard_id = store_benchmarks.shard_id(submission_id, 0)
    conn.execute(score_shards.insert().values(id=shard_id, submission_id=submission_id,
                                              shard=0, first_row=0, rows=rows, state="queued",
                                              updated_at=time.time()))
    conn.execute(jobs.update().where((jobs.c.kind == "score")
                                     & (jobs.c.subject == submission_id)).values(
        kind=SHARD_JOB, subject=shard_id, state="queued"))


def _add_columns(conn, columns: dict[str, tuple[str, ...]]) -> None:
  """Adds the ``columns`` (table -> names) a table made before lacks (a new database's
  tables have them from migration 1)."""
  present = {t: {c["name"] for c in sa.inspect(conn).get_columns(t)} for t in columns}
  for table, names in columns.items():
    for name in names:
      if name not in present[table]:
        column = metadata.tables[table].c[name]
        conn.execute(sa.text(f"ALTER TABLE {table} ADD COLUMN {name} "
                             f"{column.type.compile(conn.dialect)}"))


def _migration_6(conn) -> None:
  """Jobs know their owner (fair queue), heartbeat and why an attempt ended; tokens have
  names, expiry and revocation. Tokens made before get the name ``OWNER-ID``."""
  _add_columns(conn, MIGRATION_6_COLUMNS)
  for index in tokens.indexes:  # created with the table by migration 1 on new databases
    index.create(conn, checkfirst=True)
  for token_id, owner in conn.execute(sa.select(tokens.c.id, owners.c.name).select_from(
      tokens.join(owners)).where(tokens.c.name.is_(None))).all():
    conn.execute(tokens.update().where(tokens.c.id == token_id).values(name=f"{owner}-{token_id}"))
  for job_id, kind, subject in conn.execute(sa.select(jobs.c.id, jobs.c.kind, jobs.c.subject)
                                            .where(jobs.c.owner.is_(None))).all():
    conn.execute(jobs.update().where(jobs.c.id == job_id).values(
        owner=JobQueries.subject_owner(conn, kind, subject)))


def _migration_7(conn) -> None:
  """Proofs carry their root's declared run name and tags (searched by the pages) and when
  they stopped receiving; proofs stored before get them from their root records, and a
  settled one its last update as its end."""
  _add_columns(conn, MIGRATION_7_COLUMNS)
  roots = conn.execute(sa.select(records.c.proof_id, records.c.data).where(
      records.c.kind == "root"))
  for proof_id, data in roots.all():
    conn.execute(proofs.update().where(proofs.c.id == proof_id).values(
        **run_columns(cbor2.loads(data))))
  conn.execute(proofs.update().where(proofs.c.state != "receiving").values(
      ended_at=proofs.c.updated_at))


def run_columns(root) -> dict:
  """The proofs columns of a root's declared run fields (checked by ``zkdv.records``)."""
  root = root if isinstance(root, dict) else {}
  tags = root.get("tags") if isinstance(root.get("tags"), list) else []
  return {"run_name": str(root.get("run_name", ""))[:200] or None,
          "tags": json.dumps([str(t)[:64] for t in tags[:32]]) if tags else None}


def _migration_8(conn) -> None:
  """Evaluation digests know their example; probed whole examples are kept."""
  _add_columns(conn, MIGRATION_8_COLUMNS)
  for table in MIGRATION_8_TABLES:
    table.create(conn, checkfirst=True)


def _migration_9(conn) -> None:
  """A worker's verdict on a server-challenged proof waits for the server to sign it."""
  for table in MIGRATION_9_TABLES:
    table.create(conn, checkfirst=True)


def _migration_10(conn) -> None:
  """Proofs count the batch rows their probes opened as records arrive; the worker indexes
  their digests (``dvbench.contamination.probed_digests``) once the proof is closed. A
  proof stored before counts each digest indexed for it as one opened row (the quota's
  charge of a row covers a digest)."""
  _add_columns(conn, MIGRATION_10_COLUMNS)
  indexed = [sa.select(sa.func.count()).where(t.c.proof_id == proofs.c.id).scalar_subquery()
             for t in (probes, probe_examples)]
  conn.execute(proofs.update().where(proofs.c.probed_rows.is_(None)).values(
      probed_rows=indexed[0] + indexed[1]))


def _migration_11(conn) -> None:
  """A proof's records of one kind are found through an index, not by reading all of its
  records (a run page's programs and resumes)."""
  MIGRATION_11_INDEX.create(conn, checkfirst=True)  # new databases: with the table


def _migration_12(conn) -> None:
  """A discarded proof's blobs stay charged to its owner (they stay on disk)."""
  for table in MIGRATION_12_TABLES:
    table.create(conn, checkfirst=True)


def _migration_13(conn) -> None:
  """Record bodies over ``record_bodies.OUT_OF_LINE_BYTES`` are stored in a file per proof
  beside an SQLite database; records stored before stay inline."""
  _add_columns(conn, MIGRATION_13_COLUMNS)
  conn.execute(proofs.update().where(proofs.c.body_end.is_(None)).values(body_end=0))


def _migration_14(conn) -> None:
  """The steps resumes discarded are stored once each as resumes arrive, and read by step
  (a page read every resume record: thousands of resumes made every request slow);
  proofs stored before get them from their resume records (small: always inline)."""
  for table in MIGRATION_14_TABLES:
    table.create(conn, checkfirst=True)
  for proof_id, data in conn.execute(sa.select(records.c.proof_id, records.c.data).where(
      records.c.kind == "resume")).all():
    resume = cbor2.loads(data)
    CustodyQueries.add_discarded(conn, proof_id, discarded_steps(resume["after"],
                                                                 resume["step"]))


class NewerSchema(RuntimeError):
  """The database was migrated by a newer dvbench than this one."""


MIGRATIONS: list[tuple[int, Callable]] = [(1, _migration_1), (2, _migration_2),
                                          (3, _migration_3), (4, _migration_4),
                                          (5, _migration_5), (6, _migration_6),
                                          (7, _migration_7), (8, _migration_8),
                                          (9, _migration_9), (10, _migration_10),
                                          (11, _migration_11), (12, _migration_12),
                                          (13, _migration_13), (14, _migration_14)]

# The states a verification earns are zkdv.verify.claims.standing_of's: "verified" (every
# claim of `zkdv verify --strict` holds), "verified steps" (the server-chosen replays hold,
# another claim does not), "within tolerance" (replays matched within a tolerance only),
# "unchallenged" (a clean server-challenged proof that no update check happened to hit),
# "self-audited" (its prover chose its own checks). "abandoned": left receiving longer than
# the server's idle limit; never verified. "invalid": the verifier found something wrong
# with the transcript; "unverifiable": the verification itself failed and was given up
# ("could not verify: <cause>"), no verdict. "crashed": its client fell silent before
# finish() (--crash-after); never verified as it is.
SETTLED_STATES = (claims.VERIFIED_ALL, claims.VERIFIED_STEPS, claims.WITHIN_TOLERANCE,
                  claims.UNCHALLENGED, claims.SELF_AUDITED, "invalid", UNVERIFIABLE,
                  "abandoned", "crashed")
PROOF_STATES = ("receiving", "closed", "verifying", *SETTLED_STATES)


def _sqlite_pragmas(dbapi_conn, _):
  cur = dbapi_conn.cursor()
  cur.execute("PRAGMA journal_mode=WAL")
  cur.execute("PRAGMA synchronous=NORMAL")
  cur.execute("PRAGMA busy_timeout=30000")
  cur.execute("PRAGMA foreign_keys=ON")
  cur.close()


_PROOF = (sa.select(proofs, experiments.c.full_name.label("experiment"))
          .select_from(proofs.join(experiments)).where(proofs.c.id == sa.bindparam("proof")))
_WRITE = "dvbench_write"
# A statement the database refused (locked past its busy timeout, a full disk): the server's
# fault, answered 503 (``dvbench.server.app``).
DatabaseRefused = sa.exc.OperationalError
_PG_WRITE_LOCK = 0x6476624E  # the advisory lock key every PostgreSQL write transaction takes


def _begin(conn) -> None:
  """Write transactions take the lock first; SQLite reads run each statement on its own, as
  the driver did before (``engine.connect()`` is for reads)."""
  if not conn.get_execution_options().get(_WRITE, False):
    return
  if conn.dialect.name == "sqlite":
    conn.exec_driver_sql("BEGIN IMMEDIATE")
  elif conn.dialect.name == "postgresql":
    conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_WRITE_LOCK})")


class WriteLockingEngine:
  """An ``sa.Engine`` whose ``begin()`` takes the write lock first (see the module doc)."""

  def __init__(self, engine: sa.Engine):
    self._engine = engine
    # SQLite takes one writer at a time: this process's writers wait on a lock (woken in
    # turn) rather than in SQLite's busy handler (which polls); other processes still
    # meet the database lock.
    self._writers = threading.RLock() if engine.dialect.name == "sqlite" else None
    if engine.dialect.name == "sqlite":  # SQLAlchemy, not the driver, starts transactions
      sa.event.listen(engine, "connect", lambda dbapi_conn, _: setattr(
          dbapi_conn, "isolation_level", None))
    sa.event.listen(engine, "begin", _begin)

  def __getattr__(self, name):
    return getattr(self._engine, name)

  @contextlib.contextmanager
  def begin(self):
    with self._writers or contextlib.nullcontext(), self._engine.connect() as conn:
      conn.execution_options(**{_WRITE: True})
      with conn.begin():
        yield conn


class Store(CustodyQueries, RecordReads, JobQueries, BenchmarkQueries, TokenQueries,
            ListingQueries, LivenessQueries, SummaryQueries):
  """All reads and writes of the service; one instance per process."""

  def __init__(self, engine: sa.Engine):
    self.engine = WriteLockingEngine(engine)
    self.is_sqlite = engine.dialect.name == "sqlite"
    self.bodies = RecordBodies.beside(engine)  # None: every record body stays inline

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

  @staticmethod
  def check_schema(conn) -> None:
    """Raises ``NewerSchema`` when a newer dvbench migrated the database."""
    newest = conn.execute(sa.select(sa.func.max(schema_migrations.c.version))).scalar()
    known = MIGRATIONS[-1][0]
    if newest is not None and newest > known:
      raise NewerSchema(f"the database is at schema version {newest}, and this dvbench knows "
                        f"versions up to {known}: a newer dvbench migrated it. Run the "
                        "server and every worker with that dvbench (upgrade this one).")

  def migrate(self) -> list[int]:
    """Applies missing migrations in order; returns the versions applied. Raises
    ``NewerSchema`` for a database a newer dvbench migrated: this code would run on it
    without the rules its tables now follow (e.g. a worker that does not index probes)."""
    applied = []
    with self.engine.begin() as conn:
      schema_migrations.create(conn, checkfirst=True)
      self.check_schema(conn)
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

  def list_experiments(self, limit: int = 1000) -> list[dict]:
    """The first ``limit`` experiments by name (``page_experiments`` pages further)."""
    return self.page_experiments(limit)[0]

  def create_proof(self, experiment_id: int, proof_id: str, name: str, root: bytes,
                   challenger: dict, run: dict | None = None) -> dict:
    """Creates the proof with its root record; idempotent for the same root.

    ``challenger``: ``{"kind", "nonce" (hex or None), "policy" (JSON)}``; ``run``: the
    root's ``run_columns``. A dvbench
    root takes its slot in the same transaction; raises SlotTaken when the nonce
    was used meanwhile.
    """
    now = time.time()
    with self.engine.begin() as conn:
      row = conn.execute(sa.select(proofs).where(proofs.c.id == proof_id)).mappings().first()
      if row is not None:
        return dict(row)
      conn.execute(proofs.insert().values(
          id=proof_id, experiment_id=experiment_id, name=name, state="receiving",
          records=1, steps=0, created_at=now, updated_at=now, **(run or {})))
      if challenger["nonce"] is not None:
        self.take_slot(conn, challenger["nonce"], experiment_id, proof_id)
      conn.execute(challengers.insert().values(proof_id=proof_id, **challenger))
      conn.execute(records.insert().values(proof_id=proof_id, position=0,
                                           record_id=bytes.fromhex(proof_id),
                                           kind="root", data=root))
      row = conn.execute(sa.select(proofs).where(proofs.c.id == proof_id)).mappings().first()
    return dict(row)

  def proof(self, proof_id: str) -> dict | None:
    with self.engine.connect() as conn:
      row = conn.execute(_PROOF, {"proof": proof_id}).mappings().first()
    return dict(row) if row else None

  def list_proofs(self, experiment_id: int | None = None, limit: int = 1000) -> list[dict]:
    """The newest ``limit`` proofs (``page_proofs`` pages further)."""
    return self.page_proofs(limit, experiment_id=experiment_id)[0]

  def proof_counts(self) -> dict[int, int]:
    """experiment id -> its number of proofs."""
    with self.engine.connect() as conn:
      return dict(conn.execute(sa.select(proofs.c.experiment_id, sa.func.count()).group_by(
          proofs.c.experiment_id)).all())

  def set_proof_state(self, proof_id: str, state: str, failure: str | None = None,
                      conn=None, **fields) -> None:
    """Sets the proof's state; a proof that takes no more records keeps no chunks of
    records it never completed (a ``crashed`` one keeps them: its run may go on)."""
    if state not in PROOF_STATES:
      raise ValueError(f"unknown proof state {state!r}.")
    if conn is None:
      with self.engine.begin() as c:
        return self.set_proof_state(proof_id, state, failure, c, **fields)
    now = time.time()
    conn.execute(proofs.update().where(proofs.c.id == proof_id).values(
        state=state, failure=failure, updated_at=now,
        ended_at=None if state == "receiving" else sa.func.coalesce(proofs.c.ended_at, now),
        **fields))
    if state not in ("receiving", "crashed"):
      conn.execute(chunks.delete().where(chunks.c.proof_id == proof_id))
    return None

  # -- settings ------------------------------------------------------------------------

  def put_setting(self, name: str, value: str) -> None:
    with self.engine.begin() as conn:
      conn.execute(settings.delete().where(settings.c.name == name))
      conn.execute(settings.insert().values(name=name, value=value))

  def setting(self, name: str) -> str | None:
    with self.engine.connect() as conn:
      return conn.execute(sa.select(settings.c.value).where(settings.c.name == name)).scalar()
