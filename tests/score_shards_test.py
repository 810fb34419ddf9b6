"""Scoring in shards on SQLite and PostgreSQL: shards finishing at once settle into the
server's aggregate, a failed shard fails the submission naming its rows, migration 5 moves
a waiting submission onto a shard; probed rows outside a training set are counted."""

import json
import threading

import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from dvbench.server import db
from dvbench.server import leaderboard
from dvbench import scoring
from dvbench.server import store_benchmarks
from dvbench.server import store_jobs
from tests.store_test import _fresh_url
from zkdv import challenge

SUBMISSION = "cd" * 32


def _benchmark(store, aggregate: str = "mean", rows: int = 5) -> dict:
  experiment = store.experiment("alice/run", create_for="alice")
  challenger = {"kind": "self", "nonce": None,
                "policy": json.dumps(challenge.Policy().to_record())}
  store.create_proof(experiment["id"], "ab" * 32, "alice/run", b"root", challenger)
  return store.create_benchmark("bob", {
      "full_name": "bob/bench", "metric": "accuracy", "higher_is_better": True,
      "aggregate": aggregate, "program": "00" * 32, "rows": rows,
      "min_update_check_probability": 0.5, "allowed_programs": None, "public_rows": False,
      "definition": b"registered"}, {"ee" * 32: 0})


def _outputs(values) -> bytes:
  return np.asarray(values, scoring.OUTPUT_DTYPE).tobytes()


@parameterized.parameters("sqlite", "postgresql")
class ScoreShardsTest(parameterized.TestCase):

  def submit(self, backend, shards, aggregate="mean"):
    store = db.Store.open(_fresh_url(backend))
    bench = _benchmark(store, aggregate)
    store.add_submission({"id": SUBMISSION, "benchmark_id": bench["id"], "proof_id": "ab" * 32,
                          "record": b"checkpoint"}, shards, [])
    jobs = [store.claim_job(f"w{i}", lease_seconds=30) for i in range(len(shards))]
    self.assertEqual([j["kind"] for j in jobs], [scoring.SHARD_JOB] * len(shards))
    self.assertIsNone(store.claim_job("idle", lease_seconds=30))
    return store, {store.score_shard(j["subject"])["first_row"]: j for j in jobs}

  def complete(self, store, job, outputs=None, failure=None) -> bool:
    return store.complete_shard_job(job["id"], job["lease_owner"], job["subject"],
                                    None if outputs is None else _outputs(outputs), failure)

  def test_shards_finishing_at_once_settle_into_the_servers_aggregate(self, backend):
    shards = scoring.shard_ranges(rows=5, batch_rows=1, max_shard_rows=2)
    self.assertEqual(shards, [(0, 2), (2, 2), (4, 1)])
    store, jobs = self.submit(backend, shards)
    outputs = {0: [1.0, 0.0], 2: [1.0, 1.0], 4: [0.0]}
    barrier = threading.Barrier(len(jobs))

    def complete(first):
      barrier.wait()
      self.assertTrue(self.complete(store, jobs[first], outputs[first]))
    threads = [threading.Thread(target=complete, args=(first,)) for first in jobs]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    submission = store.submission(SUBMISSION)
    self.assertEqual((submission["state"], submission["value"]), ("scored", 0.6))
    self.assertEqual(store.shard_progress(SUBMISSION), {"scored": 3, "total": 3})

  def test_a_failed_shard_fails_the_submission_naming_its_rows(self, backend):
    store, jobs = self.submit(backend, [(0, 3), (3, 2)], aggregate="sum")
    self.assertTrue(self.complete(store, jobs[0], [1.0, 1.0, 0.0]))
    self.assertEqual(store.submission(SUBMISSION)["state"], "scoring")
    self.assertFalse(store.complete_shard_job(jobs[3]["id"], "not-the-lease-owner",
                                              jobs[3]["subject"], _outputs([1, 1]), None))
    self.assertTrue(self.complete(store, jobs[3], failure="the evaluation program: ..."))
    submission = store.submission(SUBMISSION)
    self.assertEqual((submission["state"], submission["value"], submission["failure"]),
                     ("failed", None, "shard 1 (rows 3-4): the evaluation program: ..."))

  def test_a_non_finite_output_fails_the_submission_naming_its_rows(self, backend):
    store, jobs = self.submit(backend, [(0, 5)])
    self.assertTrue(self.complete(store, jobs[0], [1.0, np.inf, 0.0, np.nan, 0.0]))
    submission = store.submission(SUBMISSION)
    self.assertEqual((submission["state"], submission["value"], submission["failure"]), (
        "failed", None, "the evaluation program's output is not finite on 2 of 5 rows: rows "
        "1 (inf), 3 (nan); the entry is not scored."))

  def test_a_non_finite_aggregate_of_finite_outputs_fails_the_submission(self, backend):
    store, jobs = self.submit(backend, [(0, 5)], aggregate="sum")
    self.assertTrue(self.complete(store, jobs[0], [1e308, 1e308, 0.0, 0.0, 0.0]))
    submission = store.submission(SUBMISSION)
    self.assertEqual((submission["state"], submission["failure"]),
                     ("failed", "the sum of the outputs is inf."))

  def test_a_shard_given_up_leaves_the_entry_unscored_and_submitting_again_scores_it(
      self, backend):
    # Before, a shard the server gave up (its child out of time or killed each attempt)
    # failed the entry for good: one entry a proof, and submitting again changed nothing.
    store = db.Store.open(_fresh_url(backend))
    row = {"id": SUBMISSION, "benchmark_id": _benchmark(store)["id"], "proof_id": "ab" * 32,
           "record": b"checkpoint"}
    store.add_submission(row, [(0, 3), (3, 2)], [])
    first = store.claim_job("w0", lease_seconds=30)
    stalled = store.claim_job("w1", lease_seconds=-1)  # its lease ran out at once
    self.assertTrue(self.complete(store, first, [1.0, 1.0, 0.0]))
    self.assertIsNone(store.claim_job("w2", lease_seconds=30, max_attempts=1))  # given up
    submission = store.submission(SUBMISSION)
    self.assertEqual((submission["state"], submission["value"]), (scoring.UNSCORED, None))
    self.assertEqual(submission["failure"], (
        "shard 1 (rows 3-4): could not score: scoring was given up after 1 attempts; the last "
        "one ended because the worker stopped before finishing (its lease expired)."))
    entry = {"state": submission["state"], "copy_of": None, "full_replay": True,
             "contamination": 0, "outside_training_set": 0, "strict": True}
    # pylint: disable-next=protected-access
    reasons = leaderboard._unranked_because(entry, "sampled", [])
    self.assertEqual(reasons, [
        "not scored: the server could not score it (submit the proof again to score it "
        "again)"])
    store.add_submission(row, [(0, 3), (3, 2)], [])  # submitted again: the given-up shard
    again = store.claim_job("w3", lease_seconds=30)
    self.assertEqual(again["subject"], stalled["subject"])
    self.assertIsNone(store.claim_job("idle", lease_seconds=30))  # the scored one stays
    self.assertTrue(self.complete(store, again, [1.0, 0.0]))
    submission = store.submission(SUBMISSION)
    self.assertEqual((submission["state"], submission["value"], submission["failure"]),
                     ("scored", 0.6, None))

  def test_a_submissions_shards_count_as_one_queued_job_of_its_owner(self, backend):
    # Before, each shard counted: an evaluation set of more shards than the per-owner
    # queue could never be submitted (429 with nothing else queued).
    store = db.Store.open(_fresh_url(backend))
    store.max_queued_per_owner = 2
    bench = _benchmark(store)
    shards = [(first, 1) for first in range(5)]
    for n in range(2):
      store.add_submission({"id": f"{n:02x}" * 32, "benchmark_id": bench["id"],
                            "proof_id": "ab" * 32, "record": b"checkpoint"}, shards, [])
    claimed = [store.claim_job(f"w{i}", lease_seconds=30) for i in range(10)]
    self.assertEqual([j["kind"] for j in claimed], [scoring.SHARD_JOB] * 10)
    with self.assertRaisesRegex(store_jobs.QueueFull, "'alice' already has 2 jobs waiting for "
                                "verification .*a submission's scoring counts as one"):
      store.add_submission({"id": "ff" * 32, "benchmark_id": bench["id"],
                            "proof_id": "ab" * 32, "record": b"checkpoint"}, shards, [])

  def test_probed_rows_outside_the_training_set_are_counted_per_proof(self, backend):
    store = db.Store.open(_fresh_url(backend))
    bench = _benchmark(store)
    with store.engine.begin() as conn:
      store.add_probes(conn, "ab" * 32, {"01" * 32, "02" * 32, "03" * 32})
    self.assertEqual(store.training_outside(bench["id"]), {"ab" * 32: 3})
    # Rows proven members by any submission are members for every proof.
    store.add_submission({"id": SUBMISSION, "benchmark_id": bench["id"], "proof_id": "ab" * 32,
                          "record": b"checkpoint"}, [(0, 5)], ["01" * 32, "02" * 32])
    self.assertEqual(store.training_outside(bench["id"]), {"ab" * 32: 1})
    self.assertEqual(store.probed_rows("ab" * 32), {"01" * 32, "02" * 32, "03" * 32})

  def test_migration_5_moves_a_waiting_submission_onto_one_shard(self, backend):
    url = _fresh_url(backend)
    store = db.Store.open(url)
    bench = _benchmark(store, rows=7)
    with store.engine.begin() as conn:  # as migration 4 left it: one job per submission
      for table in reversed(db.MIGRATION_5_TABLES):
        table.drop(conn)
      conn.execute(db.schema_migrations.delete().where(db.schema_migrations.c.version == 5))
      conn.execute(db.submissions.insert().values(
          id=SUBMISSION, benchmark_id=bench["id"], proof_id="ab" * 32, state="pending",
          record=b"checkpoint", created_at=0.0, updated_at=0.0))
      store.enqueue_job(conn, "score", SUBMISSION)
    self.assertEqual(db.Store.open(url).migrate(), [])  # open() applied it
    job = store.claim_job("w", lease_seconds=30)
    self.assertEqual((job["kind"], job["subject"]),
                     (scoring.SHARD_JOB, store_benchmarks.shard_id(SUBMISSION, 0)))
    shard = store.score_shard(job["subject"])
    self.assertEqual((shard["first_row"], shard["rows"]), (0, 7))


if __name__ == "__main__":
  absltest.main()
