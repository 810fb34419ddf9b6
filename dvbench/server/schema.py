"""The DVBench schema: every table (SQLAlchemy Core); migrations live in ``db``.

Example::

  conn.execute(sa.select(proofs.c.state).where(proofs.c.id == proof_id))
"""

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
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("name", sa.String(200)),  # migration 6: listed and revoked by name
    sa.Column("expires_at", sa.Float),  # migration 6
    sa.Column("revoked_at", sa.Float),  # migration 6
    sa.Index("tokens_name", "name", unique=True))

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
    sa.Column("updated_at", sa.Float, nullable=False),
    # migration 7: the root's declared run name and tags (JSON list), searched and filtered
    # by the pages; when the proof stopped receiving (closed, crashed or abandoned)
    sa.Column("run_name", sa.String(200)),
    sa.Column("tags", sa.String(2200)),
    sa.Column("ended_at", sa.Float),
    # migration 10: the batch rows its probe records opened, counted as they are stored (the
    # quota charges their digests before the worker indexes them)
    sa.Column("probed_rows", sa.Integer, default=0),
    # migration 13: the bytes of its records file that stored records cover
    # (``record_bodies``; later bytes are a rolled-back write's, overwritten by the next)
    sa.Column("body_end", sa.BigInteger, default=0))

records = sa.Table(
    "records", metadata,
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), primary_key=True),
    sa.Column("position", sa.Integer, primary_key=True),
    sa.Column("record_id", sa.LargeBinary(32), nullable=False),
    sa.Column("kind", sa.String(20), nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False),  # b"" when the body is out of line
    # migration 13: where a body kept out of line lies in the proof's records file
    sa.Column("body_offset", sa.BigInteger),
    sa.Column("body_size", sa.BigInteger),
    sa.UniqueConstraint("proof_id", "record_id"))
# migration 11: a proof's records of one kind, in order, without reading the others (its page
# lists its programs and resumes among millions of steps); new databases make it with the table
MIGRATION_11_INDEX = sa.Index("records_kind", records.c.proof_id, records.c.kind,
                              records.c.position)

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
    sa.Column("kind", sa.String(20), nullable=False),  # "proof", "measurement", "score-shard"
    sa.Column("subject", sa.String(64), nullable=False),  # the proof, measurement or shard id
    sa.Column("state", sa.String(20), nullable=False),  # queued, running, done, failed
    sa.Column("lease_owner", sa.String(100)),
    sa.Column("lease_expires", sa.Float),
    sa.Column("attempts", sa.Integer, nullable=False, default=0),
    sa.Column("created_at", sa.Float, nullable=False),
    # migration 6: whose job (queue fairness, quotas), when the current attempt began, the
    # worker's last sign of life, why the last attempt ended (or the job was given up)
    sa.Column("owner", sa.String(200)),
    sa.Column("started_at", sa.Float),
    sa.Column("heartbeat_at", sa.Float),
    sa.Column("failure", sa.Text),
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


# -- migration 2: server challenges, custody of blobs per proof, receipts ------------

settings = sa.Table(
    "settings", metadata,
    sa.Column("name", sa.String(100), primary_key=True),
    sa.Column("value", sa.Text, nullable=False))

slots = sa.Table(
    "slots", metadata,
    sa.Column("nonce", sa.String(64), primary_key=True),  # hex
    sa.Column("experiment_id", sa.Integer, sa.ForeignKey("experiments.id"), nullable=False),
    sa.Column("challenge_key", sa.LargeBinary(32), nullable=False),  # K: secret until receipt
    sa.Column("policy", sa.Text, nullable=False),  # the server's minimum when issued, JSON
    sa.Column("proof_id", sa.String(64), unique=True),  # set once a root used the nonce
    sa.Column("created_at", sa.Float, nullable=False))

challengers = sa.Table(
    "challengers", metadata,
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), primary_key=True),
    sa.Column("kind", sa.String(20), nullable=False),  # "dvbench" or "self"
    sa.Column("nonce", sa.String(64), sa.ForeignKey("slots.nonce")),  # dvbench only
    sa.Column("policy", sa.Text, nullable=False))  # the root's effective policy, JSON

challenges = sa.Table(
    "challenges", metadata,
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), primary_key=True),
    sa.Column("step", sa.Integer, primary_key=True),
    sa.Column("record_id", sa.LargeBinary(32), nullable=False),
    sa.Column("challenge", sa.LargeBinary(32), nullable=False),
    sa.Column("needs_update", sa.Boolean, nullable=False),
    sa.Column("needs_state", sa.Boolean, nullable=False),
    sa.Column("needs_probe", sa.Boolean, nullable=False),
    sa.Column("answered_update", sa.Boolean, nullable=False),
    sa.Column("answered_state", sa.Boolean, nullable=False),
    sa.Column("answered_probe", sa.Boolean, nullable=False))

proof_blobs = sa.Table(
    "proof_blobs", metadata,
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), primary_key=True),
    sa.Column("digest", sa.String(64), primary_key=True))

receipts = sa.Table(
    "receipts", metadata,
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), primary_key=True),
    sa.Column("verdict", sa.String(20), nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False),  # the signed receipt, CBOR
    sa.Column("issued_at", sa.Float, nullable=False))

MIGRATION_2_TABLES = (settings, slots, challengers, challenges, proof_blobs, receipts)


# -- migration 3: benchmarks, server-run scoring, server-chosen measurement samples ----

benchmarks = sa.Table(
    "benchmarks", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("owner_id", sa.Integer, sa.ForeignKey("owners.id"), nullable=False),
    sa.Column("full_name", sa.String(400), unique=True, nullable=False),  # owner/name
    sa.Column("metric", sa.String(100), nullable=False),
    sa.Column("higher_is_better", sa.Boolean, nullable=False),
    sa.Column("aggregate", sa.String(20), nullable=False),  # "mean" or "sum"
    sa.Column("program", sa.String(64), nullable=False),  # the evaluation program's blob
    sa.Column("rows", sa.Integer, nullable=False),
    sa.Column("min_update_check_probability", sa.Float, nullable=False),
    sa.Column("allowed_programs", sa.Text),  # JSON list of training program ids; None: any
    sa.Column("public_rows", sa.Boolean, nullable=False),
    sa.Column("definition", sa.LargeBinary, nullable=False),  # the registered CBOR
    sa.Column("created_at", sa.Float, nullable=False))

benchmark_blobs = sa.Table(  # blobs uploaded by a benchmark's owner for it
    "benchmark_blobs", metadata,
    sa.Column("benchmark", sa.String(400), primary_key=True),  # owner/name
    sa.Column("digest", sa.String(64), primary_key=True))

benchmark_rows = sa.Table(  # the digests identifying evaluation examples (dvbench.contamination)
    "benchmark_rows", metadata,
    sa.Column("benchmark_id", sa.Integer, sa.ForeignKey("benchmarks.id"), primary_key=True),
    sa.Column("digest", sa.String(64), primary_key=True),
    sa.Column("example", sa.Integer))  # its example's index (migration 8; None before)

submissions = sa.Table(
    "submissions", metadata,
    sa.Column("id", sa.String(64), primary_key=True),  # BLAKE3 of benchmark and submission
    sa.Column("benchmark_id", sa.Integer, sa.ForeignKey("benchmarks.id"), nullable=False),
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), nullable=False),
    sa.Column("state", sa.String(20), nullable=False),  # pending, scoring, scored, failed, unscored
    sa.Column("value", sa.Float),
    sa.Column("failure", sa.Text),
    sa.Column("record", sa.LargeBinary, nullable=False),  # params layout and blobs, CBOR
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False))

measurement_samples = sa.Table(  # the batches the server chose to open, after the commitment
    "measurement_samples", metadata,
    sa.Column("measurement_id", sa.String(64), sa.ForeignKey("measurements.id"),
              primary_key=True),
    sa.Column("seed", sa.LargeBinary(32), nullable=False),
    sa.Column("opened", sa.Text, nullable=False),  # JSON list of batch indices
    sa.Column("openings", sa.LargeBinary))  # CBOR [[index, [blob digests]]...] once sent

MIGRATION_3_TABLES = (benchmarks, benchmark_blobs, benchmark_rows, submissions,
                      measurement_samples)

# What the server's verification showed, claim by claim (docs/design.md §10).
proof_claims = sa.Table(
    "proof_claims", metadata,
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), primary_key=True),
    sa.Column("claims", sa.Text, nullable=False),  # JSON {claim: status}
    sa.Column("strict", sa.Boolean, nullable=False))  # every claim holds, replays exact

MIGRATION_4_TABLES = (proof_claims,)


# -- migration 5: sharded scoring, training-set membership of probed rows -------------

score_shards = sa.Table(  # a row range of a submission, scored by one worker job
    "score_shards", metadata,
    sa.Column("id", sa.String(64), primary_key=True),  # BLAKE3 of submission id and shard
    sa.Column("submission_id", sa.String(64), sa.ForeignKey("submissions.id"), nullable=False,
              index=True),
    sa.Column("shard", sa.Integer, nullable=False),
    sa.Column("first_row", sa.Integer, nullable=False),
    sa.Column("rows", sa.Integer, nullable=False),
    sa.Column("state", sa.String(20), nullable=False),  # queued, scoring, done, failed, unscored
    sa.Column("outputs", sa.LargeBinary),  # little-endian float64 per row, once done
    sa.Column("failure", sa.Text),
    sa.Column("updated_at", sa.Float))

training_members = sa.Table(  # probed rows proven (Merkle) members of a benchmark's training set
    "training_members", metadata,
    sa.Column("benchmark_id", sa.Integer, sa.ForeignKey("benchmarks.id"), primary_key=True),
    sa.Column("digest", sa.String(64), primary_key=True))

MIGRATION_5_TABLES = (score_shards, training_members)


# -- migration 6: supervised jobs, named expiring tokens ------------------------------

# columns that migration 6 adds to tables created before it
MIGRATION_6_COLUMNS = {"tokens": ("name", "expires_at", "revoked_at"),
                       "jobs": ("owner", "started_at", "heartbeat_at", "failure")}
MIGRATION_7_COLUMNS = {"proofs": ("run_name", "tags", "ended_at")}

# -- migration 8: whole examples (dvbench.contamination) --------------------------------

MIGRATION_8_COLUMNS = {"benchmark_rows": ("example",)}

probe_examples = sa.Table(  # whole examples probes opened (dvbench.contamination.probed_examples)
    "probe_examples", metadata,
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), primary_key=True),
    sa.Column("digest", sa.String(64), primary_key=True))

MIGRATION_8_TABLES = (probe_examples,)

# -- migration 9: verdicts the server process publishes with their receipts -------------

pending_verdicts = sa.Table(  # a worker's verdict on a server-challenged proof, not yet signed
    "pending_verdicts", metadata,
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), primary_key=True),
    sa.Column("state", sa.String(20), nullable=False),
    sa.Column("failure", sa.Text),
    sa.Column("verdict", sa.String(20), nullable=False),  # the verifier's, for the receipt
    sa.Column("checks", sa.Integer, nullable=False),  # the checks it replayed
    sa.Column("created_at", sa.Float, nullable=False))

MIGRATION_9_TABLES = (pending_verdicts,)

# -- migration 10: probed rows counted at ingest, indexed by the worker ----------------

MIGRATION_10_COLUMNS = {"proofs": ("probed_rows",)}

# -- migration 12: blobs of discarded proofs, still on disk, still their owner's ----------

owner_blobs = sa.Table(  # a blob uploaded for a proof since discarded (no step): charged on
    "owner_blobs", metadata,
    sa.Column("owner", sa.String(64), primary_key=True),
    sa.Column("digest", sa.String(64), primary_key=True))

MIGRATION_12_TABLES = (owner_blobs,)

# -- migration 13: large record bodies out of line, in a file per proof -----------------

MIGRATION_13_COLUMNS = {"proofs": ("body_end",), "records": ("body_offset", "body_size")}

# -- migration 14: the steps resumes discarded, each once, found by step ----------------

discarded_steps = sa.Table(  # zkdv.records.discarded_steps of each stored resume record
    "discarded_steps", metadata,
    sa.Column("proof_id", sa.String(64), sa.ForeignKey("proofs.id"), primary_key=True),
    sa.Column("step", sa.Integer, primary_key=True))

MIGRATION_14_TABLES = (discarded_steps,)
