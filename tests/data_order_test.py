"""The verifiable data order: ``proof.batches`` draws batches in the order the proof's slot
seeds, each step commits its rows, and the verifier checks the order at every step and every
opened row against the dataset's Merkle root at its index.

Attacks are provers that skip their own refusal (``SampledBatch.check``) and commit the rows
they choose: a swapped row, two batches reordered, a batch repeated. Each is invalid, naming
the step and the row, with every row probed and under full replay (no probes at all).
"""

import contextlib
import pathlib
import tempfile
from unittest import mock

import blake3
import cbor2
import jax
import numpy as np
import optax
from absl.testing import absltest
from absl.testing import parameterized
from starlette.exceptions import HTTPException

import zkdv
from dvbench.benchmark import TrainingSet
from dvbench.server import custody
from tests import resume_test
from tests import testing
from tests.cli_test import zkdv_here
from zkdv import cli as zkdv_cli
from zkdv import challenge
from zkdv import data as data_lib
from zkdv import errors
from zkdv import inspect as inspect_lib
from zkdv import merkle
from zkdv import verify
from zkdv.jax import sampler

ROWS, WIDTH, BATCH = 64, 4096, 16  # float32 rows of 16 KiB: one row per Merkle leaf of x
STEPS = ROWS // BATCH
_rng = np.random.default_rng(0)
DATA = {"x": _rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
        "y": _rng.integers(0, 2, ROWS).astype(np.int32)}


def _state(proof):
  model = testing.TinyClassifier()
  params = model.init(jax.random.key(0), np.ones((1, WIDTH), np.float32))["params"]
  return zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply, params=params,
                                             tx=optax.sgd(1e-2))


def _step(state, batch):
  def loss(params):
    logits = state.apply_fn({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return state.apply_gradients(grads=jax.grad(loss)(state.params))


def _proof(name: str, full_replay: bool = False) -> zkdv.jax.ZKDV:
  policy = zkdv.SamplingPolicy(update_check_probability=1.0, full_replay=full_replay)
  return zkdv.jax.ZKDV(name, zkdv.ZKDVConfig(
      sampling_policy=policy, segment_length=2,
      output_dir=pathlib.Path(tempfile.mkdtemp(prefix="zkdv-order-")) / name))


def _rows(batch) -> np.ndarray:
  return np.asarray(batch)


@contextlib.contextmanager
def _attacker(committed: list):
  """A prover that does not refuse its own batches and commits ``committed[t]`` at step t."""
  def take(order, step):
    order._pending.pop(0)  # pylint: disable=protected-access
    return sampler.SampledBatch(order, step, np.asarray(committed[step]))
  with mock.patch.object(sampler.SampledBatch, "check", lambda *a: None), \
       mock.patch.object(sampler.DataOrder, "take", take):
    yield


def train(name: str, attack=None, full_replay: bool = False, probe_ratio: float = 1.0,
          seed: bytes | None = None, attacked=("x", "y")) -> pathlib.Path:
  """A run over DATA, one epoch; ``attack(order_rows) -> (used, committed)`` per step, the
  ``attacked`` leaves taking the used rows, the others the committed ones."""
  proof = _proof(name, full_replay)
  with mock.patch.object(challenge, "new_key", return_value=seed or bytes(32)):
    proof.start(probe_ratio=probe_ratio)
  state, step = _state(proof), proof.jit(_step)
  drawn = list(proof.batches(DATA, batch_size=BATCH))
  drawn_order = proof._data_order.order  # pylint: disable=protected-access
  order = [drawn_order.batch(n) for n in range(STEPS)]
  if attack is None:
    for batch in drawn:
      state = step(state, batch)
  else:
    used, committed = attack(order)
    with _attacker(committed):
      for rows, honest in zip(used, committed):
        state = step(state, {k: v[rows if k in attacked else honest] for k, v in DATA.items()})
  return proof.finish()


def _swapped(order):
  """Row 3 of batch 1 replaced by a row of batch 2."""
  used = [o.copy() for o in order]
  used[1][3] = order[2][0]
  return used


ATTACKS = {
    # the data differ from the rows the step commits (its own, honest indices)
    "swap_row_data": (lambda order: (_swapped(order), order), "data_row", 1,
                      "step 1: row 3 of batch leaf"),
    # the step commits the row it swapped in
    "swap_row_index": (lambda order: (_swapped(order), _swapped(order)), "data_order", 1,
                       "step 1: row 3 of its batch is dataset row"),
    "reorder_batches": (lambda order: ([order[0], order[2], order[1], order[3]],) * 2,
                        "data_order", 1, "it is batch 2 of the order: the next one, out of order"),
    "repeat_batch": (lambda order: ([order[0], order[1], order[1], order[3]],) * 2,
                     "data_order", 2, "it is batch 1 of the order: the batch before, repeated"),
}


class _Records:
  """DATA as a Grain data source: ``len`` and records ``{"x": row, "y": label}``."""

  def __len__(self):
    return ROWS

  def __getitem__(self, i):
    return {"x": DATA["x"][i], "y": DATA["y"][i]}


def _finding(report, code):
  return next((f for f in report.findings if f.code == code), None)


class DataOrderTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.honest = train("honest")
    cls.report = verify.verify(cls.honest)

  def test_an_honest_run_verifies_with_the_data_order_claim(self):
    report = self.report
    self.assertEqual(report.verdict, "verified", [f.message for f in report.findings])
    claim = report.claim("data")
    self.assertEqual(claim.status, "holds")
    self.assertStartsWith(claim.detail, "data order: self-seeded")
    self.assertEqual(claim.facts["dataset"], TrainingSet(DATA).root.hex())  # a benchmark's pin
    # Any rows can be a dataset (a model's weights among them): the root is the prover's.
    self.assertIn("a root the prover declared: zkdv verify --dataset-root or a benchmark's "
                  "training_set pin names the one it needs", claim.detail)

  def test_a_required_dataset_root_is_the_one_the_run_drew_from(self):
    root = TrainingSet(DATA).root
    claim = verify.verify(self.honest, dataset_root=root).claim("data")
    self.assertEqual(claim.status, "holds", claim.detail)
    self.assertIn("the dataset required", claim.detail)
    # Any other root, e.g. the run's dataset was the weights it meant to end with: the
    # run "verified" with "data order: server-seeded" over rows the prover chose.
    other = TrainingSet({"x": DATA["x"] + 1, "y": DATA["y"]}).root
    claim = verify.verify(self.honest, dataset_root=other).claim("data")
    self.assertEqual(claim.status, "does not hold")
    self.assertIn(f"the dataset {other.hex()[:16]}… is required, and the run declared "
                  f"{root.hex()[:16]}…", claim.detail)
    result = zkdv_here("verify", self.honest, "--dataset-root", other.hex(), "--require", "data",
                       "--quiet")
    self.assertEqual(result.returncode, 1)
    self.assertEqual(zkdv_here("verify", self.honest, "--dataset-root", "ab").returncode,
                     zkdv_cli.EXIT_USAGE)
    # every row of every leaf probed: x one row per Merkle leaf, y one group of 16
    self.assertEqual(claim.facts["dataset_rows"], STEPS * BATCH * 2)

  def test_each_step_commits_its_batch_of_the_seeded_order(self):
    steps = testing.records_of(self.honest, "step")
    (declared,) = testing.records_of(self.honest, "data")
    self.assertEqual(declared["root"], TrainingSet(DATA).root)
    committed = [data_lib.unpack_rows(s["data_rows"]) for s in steps]
    self.assertEqual(sorted(np.concatenate(committed).tolist()), list(range(ROWS)))
    self.assertNotEqual(np.concatenate(committed).tolist(), list(range(ROWS)))  # shuffled
    root = testing.records_of(self.honest, "root")[0]
    from zkdv import keys  # pylint: disable=import-outside-toplevel
    from zkdv import transcript  # pylint: disable=import-outside-toplevel
    tid = transcript.read_transcript(self.honest).records[0].record_id
    order = data_lib.Order(keys.key_seed(root["challenger"], tid),
                           data_lib.Declaration.from_record(declared))
    for t, rows in enumerate(committed):
      np.testing.assert_array_equal(rows, order.batch(t))
    shown = inspect_lib.inspect_transcript(self.honest)["data"]
    self.assertEqual((shown["root"], shown["rows"], shown["batch_size"]),
                     (TrainingSet(DATA).root.hex(), ROWS, BATCH))

  @parameterized.product(attack=sorted(ATTACKS), full_replay=[False, True])
  def test_a_deviating_run_is_invalid_naming_the_step_and_row(self, attack, full_replay):
    make, code, step, says = ATTACKS[attack]
    path = train(f"{attack}-{full_replay}", make, full_replay=full_replay,
                 probe_ratio=0.0 if full_replay else 1.0)
    report = verify.verify(path)
    self.assertEqual(report.verdict, "invalid")
    finding = _finding(report, code)
    self.assertIsNotNone(finding, [f"{f.code}: {f.message}" for f in report.findings])
    self.assertIn(says, finding.message)
    self.assertIn(f"step {step}", finding.message)
    self.assertEqual(report.claim("data").status, "does not hold")

  @parameterized.named_parameters(
      ("no_data_record", lambda rs: [r for r in rs if r["type"] != "data"], "data_order",
       "step 0 commits data_rows, but no data record declares the dataset"),
      ("probes_without_paths", lambda rs: [
          {k: v for k, v in r.items() if k != "data_paths"} for r in rs], "data_row",
       "the probes of step 0 carry no dataset audit path per probe"),
      ("another_dataset", lambda rs: [{**r, "root": bytes(32)} if r["type"] == "data" else r
                                      for r in rs], "data_order",
       "step 0: row 0 of its batch is dataset row"),
      ("a_step_without_rows", lambda rs: [
          {k: v for k, v in r.items() if not (k == "data_rows" and r["index"] == 2)}
          for r in rs], "data_order", "step 2 commits no rows of the declared dataset"),
      # No epoch holds a batch: the order would divide by zero batches per epoch.
      ("a_batch_larger_than_the_dataset", lambda rs: [
          {**r, "batch_size": r["rows"] + 1} if r["type"] == "data" else r for r in rs],
       "schema", f"(data): a batch of {ROWS + 1} rows from a dataset of {ROWS}"),
      ("a_leaf_of_other_rows", lambda rs: [
          {**r, "rows": r["rows"] - 1} if r["type"] == "data" else r for r in rs],
       "schema", f"(data): every leaf of the dataset has {ROWS - 1} rows"))
  def test_an_edited_transcript_is_invalid_naming_what(self, edit, code, says):
    edited = resume_test._rewrite(self.honest, edit)  # pylint: disable=protected-access
    report = verify.verify(edited)
    self.assertEqual(report.verdict, "invalid")
    finding = _finding(report, code)
    self.assertIsNotNone(finding, [f"{f.code}: {f.message}" for f in report.findings])
    self.assertIn(says, finding.message)

  def test_a_row_count_its_bytes_do_not_carry_costs_the_verifier_nothing(self):
    # Attack: a probe entry says how many rows its bytes join. Split and hashed as said
    # before the count was compared with the leaf's grouping, two entries of 2^20 rows of
    # no bytes (20 bytes of record, which the server stores) made the verifier hash and
    # keep 2^21 row digests; about 150 exhausted a worker's memory, never judged invalid.
    def padded(records):
      probe = next(r for r in records if r.get("kind") == "probe")
      probe["probes"] += [[0, 0, 1 << 20, b"", []]] * 2
      return records
    edited = resume_test._rewrite(self.honest, padded)  # pylint: disable=protected-access
    with mock.patch.object(merkle, "leaf_hash", wraps=merkle.leaf_hash) as hashed:
      report = verify.verify(edited)
    self.assertLess(hashed.call_count, 1 << 12)  # the honest rows' and paths' hashes
    self.assertEqual(report.verdict, "invalid")
    self.assertIn("malformed probe entry [0, 0, OpenedRows(rows=1048576",
                  _finding(report, "probe").message)

  @parameterized.named_parameters(
      ("a_batch_larger_than_the_dataset", "batch_size", ROWS + 1,
       f"a batch of {ROWS + 1} rows from a dataset of {ROWS}"),
      ("a_leaf_of_other_rows", "rows", ROWS - 1,
       f"every leaf of the dataset has {ROWS - 1} rows"),
      ("a_key_leaf", "layout", None, "every leaf of the dataset has"))
  def test_the_server_refuses_the_data_records_the_verifier_refuses(self, field, value, says):
    (declared,) = testing.records_of(self.honest, "data")
    if field == "layout":  # a PRNG key leaf: no rows a probe could hash
      value = [{**declared["layout"][0], "key_impl": "threefry2x32"}, *declared["layout"][1:]]
    raw = cbor2.dumps({**declared, field: value}, canonical=True)
    with self.assertRaises(HTTPException) as refused:
      custody.parse_record(raw, 3)
    self.assertEqual(refused.exception.status_code, 400)
    self.assertIn(f"record 3 (data): {says}", refused.exception.detail)

  @parameterized.named_parameters(("unprobed", 0.0), ("probed", 1.0))
  def test_a_batch_that_is_not_the_declared_dataset_is_invalid(self, probe_ratio):
    # Unprobed, no probe or full replay opens a row, so no row is checked: the batch's
    # leaves must be the dataset's all the same (else its committed indices name rows it
    # never reads). Probed, the probes' rows are not checked against it a second time.
    def float16_dataset(records):
      return [{**r, "layout": [{**r["layout"][0], "dtype": "float16"}, *r["layout"][1:]]}
              if r["type"] == "data" else r for r in records]
    edited = resume_test._rewrite(train(f"not-the-dataset-{probe_ratio}",  # pylint: disable=protected-access
                                        probe_ratio=probe_ratio), float16_dataset)
    report = verify.verify(edited)
    self.assertEqual(report.verdict, "invalid")
    finding = _finding(report, "data_order")
    self.assertIsNotNone(finding, [f"{f.code}: {f.message}" for f in report.findings])
    self.assertIn("is not dataset leaf 0", finding.message)
    self.assertLen([f for f in report.findings if "is not dataset leaf" in f.message], 1)
    self.assertEqual(report.claim("data").status, "does not hold")

  def test_a_grain_source_is_read_in_the_same_seeded_order(self):
    proof = _proof("grain")
    with mock.patch.object(challenge, "new_key", return_value=bytes(32)):
      proof.start(probe_ratio=1.0)  # the honest run's seed, another root: another order
    state, step = _state(proof), proof.jit(_step)
    for batch in proof.grain_batches(_Records(), batch_size=BATCH):
      self.assertEqual(set(batch), {"x", "y"})
      state = step(state, batch)
    report = verify.verify(proof.finish())
    self.assertEqual(report.verdict, "verified", [f.message for f in report.findings])
    self.assertStartsWith(report.claim("data").detail, "data order: self-seeded")
    self.assertEqual(report.claim("data").facts["dataset"], TrainingSet(DATA).root.hex())
    committed = [data_lib.unpack_rows(s["data_rows"]) for s in testing.records_of(
        proof.path, "step")]
    self.assertEqual(sorted(np.concatenate(committed).tolist()), list(range(ROWS)))

  def test_the_prover_refuses_a_batch_it_did_not_draw(self):
    proof = _proof("refuses")
    proof.start(probe_ratio=1.0)
    state, step = _state(proof), proof.jit(_step)
    batches = proof.batches(DATA, batch_size=BATCH)
    first, second = next(batches), next(batches)
    state = step(state, second)  # takes the first batch drawn: its rows differ
    with self.assertRaisesRegex(errors.DataOrderError,
                                r"step 0: row 0 of batch leaf \[0\]\[1\]\[.x.\] "
                                r"is not dataset row \d+ of batch 0"):
      step(state, first)
      proof.finish()

  def test_a_batch_that_is_not_the_datasets_leaves_is_refused(self):
    proof = _proof("other-leaves")
    proof.start(probe_ratio=1.0)
    state, step = _state(proof), proof.jit(_step)
    batch = next(proof.batches(DATA, batch_size=BATCH))
    with self.assertRaisesRegex(errors.DataOrderError, r"batch leaf \[0\]\[1\]\['x'\] "
                                r"\(float16\[16, 4096\]\) is not dataset leaf 0 with 16 rows "
                                r"\(float32\[16, 4096\]\)"):
      step(state, {**batch, "x": batch["x"].astype(np.float16)})
      proof.finish()

  def test_a_step_without_a_new_batch_is_refused(self):
    proof = _proof("no-batch")
    proof.start(probe_ratio=1.0)
    state, step = _state(proof), proof.jit(_step)
    batch = next(proof.batches(DATA, batch_size=BATCH))
    state = step(state, batch)
    with self.assertRaisesRegex(errors.DataOrderError, "step 1 has no batch from proof.batches"):
      step(state, batch)
    proof.finish()  # the refused step was not recorded: the run stays valid
    self.assertEqual(verify.verify(proof.path).verdict, "verified")

  def test_a_step_interrupted_before_it_ran_takes_its_batch_again(self):
    proof = _proof("interrupted")
    proof.start(probe_ratio=1.0)
    state, step = _state(proof), proof.jit(_step)
    batches = proof.batches(DATA, batch_size=BATCH)
    state = step(state, next(batches))
    pipeline = proof._committer.pipeline
    reserve = pipeline.reserve

    def interrupted(*args, **kwargs):  # Ctrl-C while the step waits for the window
      del args, kwargs
      pipeline.reserve = reserve
      raise KeyboardInterrupt
    pipeline.reserve = interrupted
    batch = next(batches)
    with self.assertRaises(KeyboardInterrupt):
      step(state, batch)
    state = step(state, batch)  # the same call again: the batch was given back
    proof.finish()
    self.assertEqual(verify.verify(proof.path).verdict, "verified")
    self.assertLen(testing.records_of(proof.path, "step"), 2)


def _swap_caught(seed: bytes, ratio: float, layout) -> bool:
  """Whether the probes of step 1 (the real decision functions) open row 3 of leaf x."""
  policy = challenge.Policy(1.0, 0.0, ratio, 16, 2)
  decision = challenge.decide(1, challenge.step_challenge_self(seed, 1), policy)
  return 3 in decision.leaf_probe_rows(0, layout)


class DetectionRateTest(absltest.TestCase):
  """At probe ratio r ≥ 1/32 (every step probed) a swapped row of R Merkle rows is opened
  with probability ceil(r R) / R; over 4000 fixed challenges the real decisions match it,
  and the verifier catches exactly the runs whose decisions open the row (of leaf x alone:
  leaf y is one Merkle row, opened by every probed step)."""

  RATIO = 0.25

  def test_detection_rate_matches_theory(self):
    from zkdv import digest  # pylint: disable=import-outside-toplevel
    layout = digest.LeafLayout("['x']", "float32", (BATCH, WIDTH))
    self.assertEqual(layout.rows, BATCH)
    seeds = [blake3.blake3(b"seed %d" % i).digest() for i in range(4000)]
    caught = [_swap_caught(s, self.RATIO, layout) for s in seeds]
    expected = int(np.ceil(self.RATIO * BATCH)) / BATCH
    spread = np.sqrt(expected * (1 - expected) / len(seeds))
    self.assertLess(abs(np.mean(caught) - expected), 4 * spread,
                    f"rate {np.mean(caught)}, theory {expected}")
    # the verifier agrees with the decision on a run of each kind
    for seed in (seeds[caught.index(True)], seeds[caught.index(False)]):
      path = train(f"rate-{seed.hex()[:8]}", ATTACKS["swap_row_data"][0],
                   probe_ratio=self.RATIO, seed=seed, attacked=("x",))
      report = verify.verify(path)
      found = _finding(report, "data_row")
      if _swap_caught(seed, self.RATIO, layout):
        self.assertIsNotNone(found)
        self.assertIn("step 1: row 3 of batch leaf [0][1]['x']", found.message)
      else:
        self.assertIsNone(found, found and found.message)


if __name__ == "__main__":
  absltest.main()
