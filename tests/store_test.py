"""The database layer on SQLite and on PostgreSQL: migrations, tokens, leases."""

import collections
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
from unittest import mock

import blake3
import cbor2
import numpy as np
import sqlalchemy as sa
from absl.testing import absltest
from absl.testing import parameterized

from cryptography.hazmat.primitives.asymmetric import ed25519

from dvbench.server import custody
from dvbench.server import db
from dvbench.server import quotas
from dvbench.server import receipts
from dvbench.server import record_bodies
from dvbench.server import run_view
from dvbench.server import store_custody
from zkdv import challenge
from zkdv import receipt
from tests import postgres


def _fresh_url(backend: str) -> str:
  if backend == "sqlite":
    return f"sqlite:///{pathlib.Path(tempfile.mkdtemp()) / 'dvbench.db'}"
  return postgres.shared_cluster().new_database()


@parameterized.parameters("sqlite", "postgresql")
class StoreTest(parameterized.TestCase):

  def _proof(self, store, name="alice/run"):
    exp = store.experiment(name, create_for=name.split("/")[0])
    challenger = {"kind": "self", "nonce": None, "policy": json.dumps(
        challenge.Policy().to_record())}
    return store.create_proof(exp["id"], "ab" * 32, name, b"root", challenger)["id"]

  def test_missing_blobs_are_the_first_named_and_the_rest_counted(self, backend):
    # Before, the close read and sorted every missing digest (a million of them took 0.8 s
    # of the write lock, for a 409 that names one) inside its transaction.
    store = db.Store.open(_fresh_url(backend))
    proof = self._proof(store)
    with store.engine.begin() as conn:
      store.add_blob_refs(conn, proof, {f"{n:064x}" for n in (5, 3, 9, 1)})
    store.add_proof_blobs(proof, [f"{1:064x}"])
    with store.engine.connect() as conn:
      self.assertEqual(store.missing_blobs(conn, proof), (3, f"{3:064x}"))
    store.add_proof_blobs(proof, [f"{n:064x}" for n in (3, 5, 9)])
    with store.engine.connect() as conn:
      self.assertEqual(store.missing_blobs(conn, proof), (0, None))
    # Counted no further than a close's refusal says: 65,536 a record, and many records.
    many = {f"{n:064x}" for n in range(100, 100 + 2 * store_custody.MISSING_COUNTED)}
    with store.engine.begin() as conn:
      store.add_blob_refs(conn, proof, many)
    with store.engine.connect() as conn:
      self.assertEqual(store.missing_blobs(conn, proof),
                       (store_custody.MISSING_COUNTED + 1, min(many)))

  def test_migrations_apply_once_and_record_their_version(self, backend):
    url = _fresh_url(backend)
    store = db.Store.open(url)
    self.assertEqual(store.migrate(), [])  # already applied by open()
    with store.engine.connect() as conn:
      versions = [r[0] for r in conn.execute(sa.select(db.schema_migrations.c.version))]
    self.assertEqual(versions, [v for v, _ in db.MIGRATIONS])
    self.assertEqual(db.Store.open(url).migrate(), [])

  def test_migration_7_gives_stored_proofs_their_run_name_tags_and_end(self, backend):
    url = _fresh_url(backend)
    store = db.Store.open(url)
    exp = store.experiment("alice/run", create_for="alice")
    challenger = {"kind": "self", "nonce": None, "policy": json.dumps(
        challenge.Policy().to_record())}
    root = cbor2.dumps({"type": "root", "run_name": "lr-0.1", "tags": ["sweep-1", "a"]})
    store.create_proof(exp["id"], "ab" * 32, "alice/run", root, challenger)
    store.create_proof(exp["id"], "cd" * 32, "alice/run", cbor2.dumps({"type": "root"}),
                       challenger)
    store.set_proof_state("ab" * 32, "invalid", "wrong")
    with store.engine.begin() as conn:  # as migration 6 left it
      for column in db.MIGRATION_7_COLUMNS["proofs"]:
        conn.execute(sa.text(f"ALTER TABLE proofs DROP COLUMN {column}"))
      conn.execute(db.schema_migrations.delete().where(db.schema_migrations.c.version == 7))
    self.assertEqual(db.Store.open(url).migrate(), [])  # open() applied it
    settled, receiving = store.proof("ab" * 32), store.proof("cd" * 32)
    self.assertEqual((settled["run_name"], json.loads(settled["tags"])),
                     ("lr-0.1", ["sweep-1", "a"]))
    self.assertEqual(settled["ended_at"], settled["updated_at"])
    self.assertEqual((receiving["run_name"], receiving["tags"], receiving["ended_at"]),
                     (None, None, None))

  def test_migration_10_counts_the_digests_indexed_before_it_as_opened_rows(self, backend):
    url = _fresh_url(backend)
    store = db.Store.open(url)
    earlier = self._proof(store, "alice/earlier")
    with store.engine.begin() as conn:
      store.add_probes(conn, earlier, {"01" * 32, "02" * 32})
      store.add_probe_examples(conn, earlier, {"03" * 32})
      conn.execute(sa.text("ALTER TABLE proofs DROP COLUMN probed_rows"))  # as 9 left it
      conn.execute(db.schema_migrations.delete().where(db.schema_migrations.c.version == 10))
    store = db.Store.open(url)
    self.assertEqual(store.proof(earlier)["probed_rows"], 3)  # one opened row a digest
    exp = store.experiment("alice/later", create_for="alice")
    counted = store.create_proof(exp["id"], "cd" * 32, "alice/later", b"root", {
        "kind": "self", "nonce": None, "policy": json.dumps(challenge.Policy().to_record())})
    self.assertEqual(store.proof(counted["id"])["probed_rows"], 0)
    with store.engine.begin() as conn:
      conn.execute(db.proofs.update().where(db.proofs.c.id == counted["id"]).values(
          probed_rows=5))
      store.add_probes(conn, counted["id"], {"04" * 32})  # indexed: charged by its count
    self.assertEqual(quotas.usage(store, lambda digest: 0, "alice")["stored_bytes"],
                     2 * len(b"root") + (3 + 5) * quotas.OPENED_ROW_BYTES)

  def test_migration_11_indexes_records_by_kind_and_a_page_finds_them_through_it(self, backend):
    url = _fresh_url(backend)
    store = db.Store.open(url)
    with store.engine.begin() as conn:  # as migration 10 left it
      conn.execute(sa.text("DROP INDEX records_kind"))
      conn.execute(db.schema_migrations.delete().where(db.schema_migrations.c.version == 11))
    self.assertNotIn("records_kind", self._indexes(store))
    store = db.Store.open(url)
    self.assertIn("records_kind", self._indexes(store))
    if backend == "sqlite":  # before: a scan of every record of the proof
      query = run_view.records_of_kind("ab" * 32, "resume").compile(store.engine)
      with store.engine.connect() as conn:
        plan = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + str(query), tuple(
            query.params[name] for name in query.positiontup)).all()
      self.assertIn("USING INDEX records_kind", " ".join(str(row[-1]) for row in plan))

  @staticmethod
  def _indexes(store) -> set[str]:
    with store.engine.connect() as conn:
      return {index["name"] for index in sa.inspect(conn).get_indexes("records")}

  def test_migration_14_stores_the_steps_earlier_resumes_discarded(self, backend):
    url = _fresh_url(backend)
    store = db.Store.open(url)
    proof = self._proof(store)
    resumes = [{"type": "resume", "step": 10, "after": 7, "state": bytes(32)},
               {"type": "resume", "step": 10, "after": 7, "state": bytes(32)},  # again
               {"type": "resume", "step": 13, "after": 11, "state": bytes(32)}]
    with store.engine.begin() as conn:  # as migration 13 left it: resumes only as records
      conn.execute(sa.text("DROP TABLE discarded_steps"))
      conn.execute(db.schema_migrations.delete().where(db.schema_migrations.c.version == 14))
      conn.execute(db.records.insert(), [
          {"proof_id": proof, "position": 1 + i, "record_id": bytes([i]) * 32, "kind": "resume",
           "data": cbor2.dumps(r)} for i, r in enumerate(resumes)])
    store = db.Store.open(url)
    self.assertEqual(store.discarded_in(proof, 0, 100), {8, 9, 12})
    self.assertEqual(store.discarded_in(proof, 9, 11), {9})

  def test_a_worker_started_before_an_upgrade_claims_nothing_after_it(self, backend):
    # A claim never read the schema: a worker started before migration 13 verified proofs
    # whose bodies the upgraded server keeps in records files from their rows' empty data,
    # found their chains broken, and the server signed "invalid" receipts.
    url = _fresh_url(backend)
    store = db.Store.open(url)  # the worker's, opened before the upgrade
    proof = self._proof(store)
    with store.engine.begin() as conn:
      store.enqueue_job(conn, "proof", proof)
      conn.execute(db.schema_migrations.insert().values(version=db.MIGRATIONS[-1][0] + 1,
                                                        applied_at=0.0))  # the upgrade
    with self.assertRaisesRegex(db.NewerSchema, "a newer dvbench migrated it.*upgrade this one"):
      store.claim_job("old-worker", lease_seconds=30)
    with store.engine.connect() as conn:
      self.assertEqual(conn.execute(sa.select(db.jobs.c.state, db.jobs.c.attempts)).one(),
                       ("queued", 0))

  def test_a_database_a_newer_dvbench_migrated_is_refused(self, backend):
    # An older worker on a newer schema would verify proofs by rules the tables no longer
    # follow (before migration 10, without indexing their probes).
    url = _fresh_url(backend)
    store = db.Store.open(url)
    newer = db.MIGRATIONS[-1][0] + 1
    with store.engine.begin() as conn:
      conn.execute(db.schema_migrations.insert().values(version=newer, applied_at=0.0))
    with self.assertRaisesRegex(db.NewerSchema, f"schema version {newer}, and this dvbench "
                                f"knows versions up to {newer - 1}.*upgrade this one"):
      db.Store.open(url)
    cli = subprocess.run([sys.executable, "-m", "dvbench.cli", "usage", "alice",
                          "--database-url", url, "--data", tempfile.mkdtemp()],
                         capture_output=True, text=True)
    self.assertNotEqual(cli.returncode, 0)
    self.assertIn(f"dvbench usage: the database is at schema version {newer}", cli.stderr)
    self.assertNotIn("Traceback", cli.stderr)

  def test_tokens_are_stored_hashed(self, backend):
    store = db.Store.open(_fresh_url(backend))
    _, token = store.create_token("alice")
    self.assertEqual(store.owner_of_token(token), "alice")
    self.assertIsNone(store.owner_of_token(token + "x"))
    with store.engine.connect() as conn:
      stored = [r[0] for r in conn.execute(sa.select(db.tokens.c.token_hash))]
    self.assertNotIn(token, stored)
    self.assertEqual(stored, [db.hash_token(token)])

  def test_records_append_at_the_head_one_per_position(self, backend):
    store = db.Store.open(_fresh_url(backend))
    proof = self._proof(store)
    items = [(bytes([i]) * 32, "step", b"r%d" % i) for i in range(5)]
    with store.engine.begin() as conn:
      head = store.custody_head(conn, proof)
      head = dataclasses.replace(head, records=head.records + 3, steps=3, last_id=items[2][0])
      store.append_records(conn, proof, head, items[:3])
    with store.engine.begin() as conn:
      head = store.custody_head(conn, proof)
      self.assertEqual((head.records, head.steps, head.last_id), (4, 3, items[2][0]))
      self.assertEqual(store.record_position(conn, proof, items[1][0]), 2)
      self.assertIsNone(store.record_position(conn, proof, items[3][0]))
      self.assertEqual(store.record_positions(conn, proof, [i[0] for i in items]),
                       {items[0][0]: 1, items[1][0]: 2, items[2][0]: 3})
      stale = dataclasses.replace(head, records=3)  # a writer that lost a race for position 2
      with self.assertRaises(sa.exc.IntegrityError):
        store.append_records(conn, proof, stale, [(items[3][0], "step", b"other")])
    self.assertEqual(list(store.record_data(proof)), [b"root"] + [i[2] for i in items[:3]])
    self.assertEqual(store.proof(proof)["steps"], 3)

  def test_a_transcript_is_read_in_pages_of_bounded_bytes(self, backend):
    store = db.Store.open(_fresh_url(backend))
    proof = self._proof(store)
    sizes = [10, 30, 5, 50, 7, 7]
    items = [(bytes([i]) * 32, "step", bytes([i]) * n) for i, n in enumerate(sizes)]
    with store.engine.begin() as conn:
      head = store.custody_head(conn, proof)
      store.append_records(conn, proof, dataclasses.replace(
          head, records=head.records + len(items), steps=len(items)), items)
    pages, after = [], -1
    while page := store.record_page(proof, after, page_bytes=40):
      pages.append([len(data) for _, data in page])
      after = page[-1][0]
    # "root" (4 bytes) first; at most 40 bytes a page, one record at least (the 50)
    self.assertEqual(pages, [[4, 10], [30, 5], [50], [7, 7]])
    self.assertEqual(list(store.record_data(proof)), [b"root"] + [i[2] for i in items])
    self.assertEqual(store.record_page(proof, len(items)), [])

  def test_one_job_one_worker_and_expired_leases_move_on(self, backend):
    store = db.Store.open(_fresh_url(backend))
    proof = self._proof(store)
    with store.engine.begin() as conn:
      store.enqueue_job(conn, "proof", proof)
      store.enqueue_job(conn, "proof", proof)  # idempotent
    claims = []
    barrier = threading.Barrier(6)

    def claim(n):
      barrier.wait()
      claims.append(store.claim_job(f"w{n}", lease_seconds=30))
    threads = [threading.Thread(target=claim, args=(n,)) for n in range(6)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    winners = [c for c in claims if c is not None]
    self.assertLen(winners, 1)
    self.assertEqual(store.proof(proof)["state"], "verifying")
    self.assertIsNone(store.claim_job("late", lease_seconds=30))
    with store.engine.begin() as conn:  # the winner's lease runs out (its worker hangs)
      conn.execute(db.jobs.update().where(db.jobs.c.id == winners[0]["id"]).values(
          lease_expires=time.time() - 1))
    taken = store.claim_job("rescuer", lease_seconds=30)
    self.assertEqual(taken["attempts"], 2)
    self.assertFalse(store.complete_proof_job(taken["id"], winners[0]["lease_owner"], proof,
                                              "verified", None, [],
                                              receipt=("verified", 0)))  # lost its lease
    self.assertTrue(store.complete_proof_job(taken["id"], "rescuer", proof, "verified", None,
                                       [{"step": 0, "kind": "update", "mode": "exact",
                                         "status": "verified", "max_abs_error": 0.0,
                                               "max_rel_error": 0.0, "max_ulp_error": 0}],
                                             receipt=("verified", 1)))
    self.assertEqual(store.proof(proof)["state"], "verified")
    self.assertLen(store.proof_checks(proof), 1)

  def test_a_server_challenged_verdict_is_public_only_with_its_signed_receipt(self, backend):
    store = db.Store.open(_fresh_url(backend))
    exp = store.experiment("alice/run", create_for="alice")
    policy = json.dumps(challenge.Policy().to_record())
    store.create_slot("cd" * 32, exp["id"], b"k" * 32, policy)
    proof = store.create_proof(exp["id"], "ab" * 32, "alice/run", b"root", {
        "kind": "dvbench", "nonce": "cd" * 32, "policy": policy})["id"]
    with store.engine.begin() as conn:
      store.enqueue_job(conn, "proof", proof)
    job = store.claim_job("w1", lease_seconds=30)
    self.assertTrue(store.complete_proof_job(job["id"], "w1", proof, "invalid", "invalid: x", [],
                                             receipt=("invalid", 2)))
    # The worker's verdict waits: no state, no receipt, until the server signs.
    self.assertEqual((store.proof(proof)["state"], store.receipt(proof)), ("verifying", None))
    key = ed25519.Ed25519PrivateKey.generate()
    self.assertEqual(receipts.publish_pending(store, key), [proof])
    self.assertEqual(store.proof(proof)["state"], "invalid")
    fields = receipt.open_receipt(store.receipt(proof), receipt.public_key_bytes(key).hex())
    self.assertEqual((fields["verdict"], fields["checks"], fields["challenge_key"],
                      fields["standing"]["state"]), ("invalid", 2, b"k" * 32, "invalid"))
    # The owner's attempts count this proof by the verdict the receipt publishes.
    self.assertEqual(fields["attempts"]["by_outcome"], {"invalid": 1})
    self.assertEqual(receipts.publish_pending(store, key), [])  # published once


def _append(store, proof: str, bodies: list[bytes], conn=None) -> None:
  """Appends records of ``bodies`` (ids: their BLAKE3) at the proof's head."""
  if conn is None:
    with store.engine.begin() as c:
      return _append(store, proof, bodies, c)
  head = store.custody_head(conn, proof)
  items = [(blake3.blake3(b).digest(), "check", b) for b in bodies]
  store.append_records(conn, proof, dataclasses.replace(
      head, records=head.records + len(items), last_id=items[-1][0]), items)
  return None


@parameterized.parameters("sqlite", "postgresql")
class RecordBodiesTest(parameterized.TestCase):
  """Bodies over OUT_OF_LINE_BYTES in a file per proof beside an SQLite database."""

  LARGE = record_bodies.OUT_OF_LINE_BYTES + 1

  def _stored(self, store, proof: str) -> list[tuple]:
    with store.engine.connect() as conn:
      return conn.execute(sa.select(db.records.c.data, db.records.c.body_offset,
                                    db.records.c.body_size).where(
          db.records.c.proof_id == proof).order_by(db.records.c.position)).all()

  def test_large_bodies_are_read_back_byte_for_byte_wherever_they_are_kept(self, backend):
    store = db.Store.open(_fresh_url(backend))
    proof = StoreTest._proof(self, store)
    bodies = [b"s" * 100, b"a" * self.LARGE, bytes(range(256)) * 120, b"t" * 7]
    _append(store, proof, bodies[:2])
    _append(store, proof, bodies[2:])
    self.assertEqual(list(store.record_data(proof)), [b"root"] + bodies)
    with store.engine.connect() as conn:
      self.assertEqual(store.last_record(conn, proof)[2], bodies[-1])
    self.assertEqual(quotas.usage(store, lambda digest: 0, "alice")["stored_bytes"],
                     len(b"root") + sum(map(len, bodies)))
    stored = self._stored(store, proof)
    if backend == "postgresql":  # no records folder: every body inline
      self.assertIsNone(store.bodies)
      self.assertEqual([row[0] for row in stored], [b"root"] + bodies)
      return
    # The large ones in the file, one after the other, across two transactions.
    self.assertEqual(stored[2], (b"", 0, self.LARGE))
    self.assertEqual(stored[3], (b"", self.LARGE, len(bodies[2])))
    self.assertEqual([row[0] for row in stored[:2]] + [stored[4][0]], [b"root"] + bodies[::3])
    self.assertEqual(store.bodies.path(proof).read_bytes(), bodies[1] + bodies[2])
    self.assertEqual(store.proof(proof)["body_end"], self.LARGE + len(bodies[2]))

  def test_migration_13_keeps_earlier_records_inline_and_readable(self, backend):
    url = _fresh_url(backend)
    store = db.Store.open(url)
    proof = StoreTest._proof(self, store)
    earlier = [b"e" * (3 * self.LARGE)]
    with store.engine.begin() as conn:  # as migration 12 left it: every body inline
      for table, columns in db.MIGRATION_13_COLUMNS.items():
        for column in columns:
          conn.execute(sa.text(f"ALTER TABLE {table} DROP COLUMN {column}"))
      conn.execute(db.records.insert().values(
          proof_id=proof, position=1, record_id=blake3.blake3(earlier[0]).digest(),
          kind="check", data=earlier[0]))
      conn.execute(db.proofs.update().where(db.proofs.c.id == proof).values(records=2))
      conn.execute(db.schema_migrations.delete().where(db.schema_migrations.c.version == 13))
    store = db.Store.open(url)
    self.assertEqual(store.proof(proof)["body_end"], 0)
    later = [b"l" * self.LARGE]
    _append(store, proof, later)
    self.assertEqual(list(store.record_data(proof)), [b"root"] + earlier + later)
    self.assertEqual(self._stored(store, proof)[1], (earlier[0], None, None))


@parameterized.parameters("sqlite", "postgresql")
class SummaryQueriesTest(parameterized.TestCase):
  """Counts, marks and chart ticks of a proof read by the database, checked against the
  rows they count."""

  STEPS = 5000

  def _proof_with_rows(self, backend):
    store = db.Store.open(_fresh_url(backend))
    proof = StoreTest._proof(self, store)
    rng = np.random.default_rng(7)
    needs = {k: rng.random(self.STEPS) < p for k, p in
             (("update", 0.3), ("state", 0.1), ("probe", 0.5))}
    answered = {k: needs[k] & (rng.random(self.STEPS) < 0.8) for k in needs}
    rows = [{**custody.challenge_row(proof, s, bytes(32), bytes(32),
                                     {k: bool(needs[k][s]) for k in needs}),
             **{f"answered_{k}": bool(answered[k][s]) for k in needs}}
            for s in range(self.STEPS)]
    # update checks of some challenged steps (a few failed) and of two unchallenged ones
    checked = [s for s in range(self.STEPS) if needs["update"][s] and s % 3][:900]
    check_rows = [{"step": s, "kind": "update", "mode": "exact",
                   "status": "failed" if s % 50 == 1 else "verified", "max_abs_error": 0.0,
                   "max_rel_error": 0.0, "max_ulp_error": 0} for s in checked]
    unchallenged = [s for s in range(self.STEPS) if not needs["update"][s]][:2]
    check_rows += [{**check_rows[0], "step": s} for s in unchallenged]
    check_rows.append({**check_rows[0], "step": 0, "kind": "start"})
    with store.engine.begin() as conn:
      store.add_challenges(conn, rows)
      conn.execute(db.checks.insert(), [{"proof_id": proof, **r} for r in check_rows])
    return store, proof, rows, check_rows

  def test_counts_are_those_of_the_rows(self, backend):
    store, proof, rows, check_rows = self._proof_with_rows(backend)
    kinds = challenge.ANSWER_KINDS
    update_steps = {r["step"] for r in rows if r["needs_update"]}
    self.assertEqual(store.challenge_counts(proof), {
        "steps": self.STEPS, **{k: sum(r[f"needs_{k}"] for r in rows) for k in kinds},
        "answered": sum(r[f"needs_{k}"] and r[f"answered_{k}"] for r in rows for k in kinds),
        "required": sum(r[f"needs_{k}"] for r in rows for k in kinds),
        "update_replayed": sum(c["kind"] == "update" and c["status"] == "verified"
                               and c["step"] in update_steps for c in check_rows)})
    tally = collections.Counter((c["kind"], c["status"]) for c in check_rows)
    self.assertEqual(store.check_tally(proof), dict(tally))
    self.assertEqual(store.challenge_counts("cd" * 32)["steps"], 0)  # no such proof: zeros

  def test_marks_are_those_of_the_window(self, backend):
    store, proof, rows, check_rows = self._proof_with_rows(backend)
    first, last = 1200, 2199
    expected = {r["step"]: "challenged" for r in rows
                if r["needs_update"] and first <= r["step"] <= last}
    expected.update({c["step"]: "verified" if c["status"] == "verified" else "failed"
                     for c in check_rows if c["kind"] == "update" and first <= c["step"] <= last})
    marks = store.update_marks(proof, first, last)
    self.assertEqual(marks, expected)
    self.assertContainsSubset({"challenged", "verified", "failed"}, set(marks.values()))

  def test_a_chart_gets_at_most_a_tick_per_column_kind_and_outcome(self, backend):
    store, proof, _, check_rows = self._proof_with_rows(backend)
    columns = 100
    ticks = store.check_ticks(proof, self.STEPS, columns)
    by_group = collections.defaultdict(list)
    for c in check_rows:
      by_group[c["kind"], c["status"], c["step"] * columns // self.STEPS].append(c["step"])
    self.assertEqual(sorted((t["kind"], t["status"], t["first"], t["last"], t["count"])
                            for t in ticks),
                     sorted((k, st, min(v), max(v), len(v))
                            for (k, st, _), v in by_group.items()))
    self.assertLessEqual(len(ticks), 3 * columns)  # update verified, update failed, start
    self.assertLess(len(ticks), len(check_rows) / 3)
    statuses = [t["status"] for t in ticks]  # failed ones drawn last, over verified ones
    self.assertEqual(statuses, sorted(statuses, key=lambda status: status == "failed"))
    self.assertIn("failed", statuses)
    squeezed = store.check_ticks(proof, 10, columns)  # checks past the steps it was given
    self.assertLessEqual(len(squeezed), 3 * columns)
    self.assertEqual(sum(t["count"] for t in squeezed), len(check_rows))


class RecordFilesTest(parameterized.TestCase):
  """An SQLite database's records files: rollbacks, damage, discarded proofs."""

  LARGE = RecordBodiesTest.LARGE

  def test_many_bodies_written_in_short_writes_land_at_their_offsets(self):
    folder = tempfile.TemporaryDirectory()
    self.addCleanup(folder.cleanup)
    bodies = record_bodies.RecordBodies(folder.name)
    proof = "ab" * 32
    written = [os.urandom(n) for n in (5000, 1, 0, 7000)] + [
        bytes([i % 251]) * (100 + i) for i in range(2 * record_bodies._IOV_MAX + 3)]
    calls = []
    pwritev = os.pwritev

    def short(fd, buffers, at):  # the kernel may write less than asked: at most 1,000 here
      calls.append(len(buffers))
      return pwritev(fd, [memoryview(b"".join(buffers))[:1000]], at)

    with mock.patch.object(record_bodies.os, "pwritev", short):
      offsets = bodies.write(proof, 10, written)
    self.assertLessEqual(max(calls), record_bodies._IOV_MAX)
    self.assertEqual(offsets, [10 + sum(map(len, written[:i])) for i in range(len(written))])
    data = bodies.path(proof).read_bytes()
    self.assertEqual(data[:10], bytes(10))
    self.assertEqual(data[10:], b"".join(written))
    self.assertEqual(bodies.write(proof, len(data), []), [])

  def test_a_rolled_back_append_leaves_bytes_the_next_one_overwrites(self):
    store = db.Store.open(_fresh_url("sqlite"))
    proof = StoreTest._proof(self, store)
    with self.assertRaisesRegex(RuntimeError, "the client went away"):
      with store.engine.begin() as conn:
        _append(store, proof, [b"x" * (2 * self.LARGE)], conn)
        raise RuntimeError("the client went away")
    self.assertEqual(store.bodies.path(proof).stat().st_size, 2 * self.LARGE)
    self.assertEqual(store.proof(proof)["body_end"], 0)
    kept = [b"y" * self.LARGE, b"z" * self.LARGE]
    _append(store, proof, kept)
    self.assertEqual(list(store.record_data(proof)), [b"root"] + kept)
    self.assertEqual(store.bodies.path(proof).read_bytes()[:2 * self.LARGE], b"".join(kept))

  @parameterized.parameters("flipped", "truncated", "deleted")
  def test_a_damaged_file_is_the_servers_fault_never_a_record(self, damage):
    store = db.Store.open(_fresh_url("sqlite"))
    proof = StoreTest._proof(self, store)
    _append(store, proof, [b"a" * self.LARGE])
    path = store.bodies.path(proof)
    if damage == "flipped":
      data = bytearray(path.read_bytes())
      data[100] ^= 1
      path.write_bytes(bytes(data))
    elif damage == "truncated":
      path.write_bytes(path.read_bytes()[:-1])
    else:
      path.unlink()
    with self.assertRaisesRegex(record_bodies.StoredRecordDamaged,
                                f"record .* of proof {proof} is damaged in the server's "
                                "storage .* a fault of this server, not of the prover"):
      list(store.record_data(proof))

  def test_a_record_larger_than_a_part_is_read_in_parts(self):
    # Before, a page of the transcript held one record whole at least: idle readers of a
    # proof's 60 MB record held 120 MB each in the web process.
    store = db.Store.open(_fresh_url("sqlite"))
    proof = StoreTest._proof(self, store)
    part = 2 * self.LARGE
    bodies = [b"s" * 10, b"L" * (3 * part + 5), b"t" * self.LARGE, b"u" * 30]
    _append(store, proof, bodies)
    parts = list(store.transcript_parts(proof, part_bytes=part))
    self.assertEqual(b"".join(parts), b"root" + b"".join(bodies))
    self.assertEqual(max(map(len, parts)), part)
    path = store.bodies.path(proof)
    data = bytearray(path.read_bytes())
    data[3 * part] ^= 1  # in the large record's last part
    path.write_bytes(bytes(data))
    read = []
    with self.assertRaisesRegex(record_bodies.StoredRecordDamaged, "a fault of this server"):
      for piece in store.transcript_parts(proof, part_bytes=part):
        read.append(piece)
    self.assertEqual(b"".join(read), b"root" + bodies[0] + bytes(data[:len(bodies[1])]))

  def test_bodies_reach_the_disk_before_their_rows_are_committed(self):
    # Before, nothing flushed the file: after a power cut, rows the WAL's checkpoint had
    # written could point at bodies the kernel had not.
    store = db.Store.open(_fresh_url("sqlite"))
    proof = StoreTest._proof(self, store)
    synced = []
    real = os.fdatasync

    def fdatasync(fd):
      real(fd)
      with store.engine.connect() as conn:  # what is committed at that moment
        synced.append(conn.execute(sa.select(db.proofs.c.records).where(
            db.proofs.c.id == proof)).scalar())
    with mock.patch.object(record_bodies.os, "fdatasync", fdatasync):
      _append(store, proof, [b"a" * self.LARGE, b"b" * self.LARGE])
      _append(store, proof, [b"small"])  # nothing out of line: nothing to flush
    self.assertEqual(synced, [1])  # once, while only the root was committed
    self.assertEqual(store.proof(proof)["records"], 4)

  def test_a_discarded_proof_leaves_no_records_file(self):
    store = db.Store.open(_fresh_url("sqlite"))
    proof = StoreTest._proof(self, store)
    _append(store, proof, [b"a" * self.LARGE])
    self.assertTrue(store.bodies.path(proof).exists())
    with self.assertRaisesRegex(RuntimeError, "the disk is full"):
      with store.engine.begin() as conn:  # a discard whose transaction fails keeps it all
        self.assertIsNone(store.discard_in(conn, proof))
        raise RuntimeError("the disk is full")
    self.assertEqual(list(store.record_data(proof)), [b"root", b"a" * self.LARGE])
    self.assertIsNone(store.discard_unstarted_proof(proof))
    self.assertFalse(store.bodies.path(proof).exists())


if __name__ == "__main__":
  absltest.main()
