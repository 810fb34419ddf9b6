"""A benchmark that pins its data order, on a real ``dvbench serve``: a run that draws its
batches with ``proof.batches`` from the registered training set verifies with "data order:
server-seeded" and ranks; a run on the same rows in an order of its own is refused, naming
the pin (``dvbench.server.pins``); reordered batches make a proof invalid naming the step."""

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import dvbench
import zkdv
from dvbench.benchmark import TrainingSet
from tests import data_order_test
from tests.benchmark_test import correct
from tests.dvbench_test import DVBenchTestCase
from tests.measurement_test import _model

# 16 training rows of 4 tokens and a label; evaluation rows with tokens no training row has.
_rng = np.random.default_rng(1)
TRAIN = np.concatenate([_rng.integers(0, 2, (16, 4)), _rng.integers(0, 2, (16, 1))],
                       axis=1).astype(np.uint32)
EVAL = np.asarray([[2, 3, 2, 3, 1], [3, 2, 3, 2, 0], [2, 2, 3, 3, 1], [3, 3, 2, 2, 0]],
                  np.uint32)
BENCH = "alice/ordered-accuracy"


def _step(state, batch):
  def loss(params):
    logits = state.apply_fn({"params": params}, batch[:, :4])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[:, 4].astype(jnp.int32)).mean()
  return state.apply_gradients(grads=jax.grad(loss)(state.params))


def train(client, experiment: str, seeded: bool, reorder: bool = False):
  """One epoch over TRAIN in batches of 4, every step checked and every row probed, from an
  attested start; ``seeded``: drawn with ``proof.batches``, else in the rows' own order;
  ``reorder``: drawn, then batches 1 and 2 trained (and committed) the other way round."""
  proof = client.experiment(experiment).proof(config=zkdv.ZKDVConfig(
      sampling_policy=zkdv.SamplingPolicy(update_check_probability=1.0)))
  proof.start(probe_ratio=1.0)
  model = _model()
  params = proof.init(model.init, jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
  state = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply, params=params,
                                             tx=optax.adam(1e-2))
  step = proof.jit(_step)
  batches = (proof.batches(TRAIN, batch_size=4) if seeded
             else [TRAIN[i:i + 4] for i in range(0, 16, 4)])
  if reorder:
    list(batches)
    order = proof._data_order.order  # pylint: disable=protected-access
    rows = [order.batch(n) for n in (0, 2, 1, 3)]
    with data_order_test._attacker(rows):  # pylint: disable=protected-access
      for r in rows:
        state = step(state, TRAIN[r])
  else:
    for batch in batches:
      state = step(state, batch)
  proof.finish()
  return jax.device_get(state.params), proof.proof_id


class ServerSeededOrderTest(DVBenchTestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    url = cls.server.url
    cls.client = dvbench.Client(url)
    cls.training_set = TrainingSet(TRAIN)
    owner = dvbench.Client(url, token=cls.server.token("alice"))
    params = _model().init(jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
    owner.benchmark(BENCH).register(metric="accuracy", evaluate=correct, params=params,
                                    rows=EVAL, min_update_check_probability=1.0,
                                    training_set=cls.training_set, data_order="server-seeded")
    cls.bench = cls.client.benchmark(BENCH)
    cls.seeded, cls.seeded_proof = train(cls.client, "your-name/seeded", True)
    cls.own, cls.own_proof = train(cls.client, "your-name/own-order", False)
    _, cls.reordered_proof = train(cls.client, "your-name/reordered", True, reorder=True)
    for proof_id in (cls.seeded_proof, cls.own_proof):
      assert cls.client.wait_for_verdict(proof_id, 120)["state"] == "verified", proof_id
    entry = cls.bench.submit(cls.seeded_proof, cls.seeded, training_set=cls.training_set)
    assert cls.bench.wait(entry["id"])["state"] == "scored", entry

  def test_the_proof_shows_its_data_order(self):
    seeded = self.client.proof_status(self.seeded_proof)
    self.assertEqual((seeded["data"], seeded["dataset"]),
                     ("order server-seeded", self.training_set.root.hex()))
    own = self.client.proof_status(self.own_proof)
    self.assertEqual((own["data"], own["dataset"]), ("probed", None))
    page = httpx.get(f"{self.server.url}/proofs/{self.seeded_proof}").text
    self.assertIn("order server-seeded over dataset <code>"
                  f"{self.training_set.root.hex()[:16]}", page)

  def test_only_the_server_seeded_run_ranks(self):
    (seeded,) = self.bench.leaderboard()
    self.assertEqual(seeded["experiment"], "your-name/seeded")
    self.assertEqual(seeded["unranked_because"], [])
    self.assertEqual((seeded["rank"], seeded["pins"]["data_order"]), (1, "holds"))
    page = httpx.get(f"{self.server.url}/benchmarks/{BENCH}").text
    self.assertIn("data: order server-seeded", page)
    self.assertIn("<th>data order</th><td><code>server-seeded</code>", page)
    self.assertEqual(self.bench.info()["data_order"], "server-seeded")

  def test_a_run_in_its_own_order_is_refused_naming_the_pin(self):
    with self.assertRaisesRegex(
        dvbench.errors.ApiError, "409.*does not meet the pins of 'alice/ordered-accuracy': "
        "data_order: data probed: the batches were not drawn with proof.batches from the "
        f"pinned training set {self.training_set.root.hex()[:16]}… in a server-seeded order"):
      self.bench.submit(self.own_proof, self.own, training_set=self.training_set)

  def test_reordered_batches_make_the_proof_invalid_naming_the_step(self):
    verdict = self.client.wait_for_verdict(self.reordered_proof, 120)
    self.assertEqual(verdict["state"], "invalid")
    self.assertIn("data_order at record", verdict["failure"])
    self.assertIn("step 1: row 0 of its batch is dataset row", verdict["failure"])
    self.assertIn("server-seeded order", verdict["failure"])
    # Its probes opened rows, but an invalid proof is never submitted: nothing is indexed.
    store = self.store()
    self.assertGreater(store.proof(self.reordered_proof)["probed_rows"], 0)
    self.assertEqual(store.probe_count(self.reordered_proof), 0)

  def test_a_data_order_needs_a_training_set(self):
    owner = dvbench.Client(self.server.url, token=self.server.token("alice"))
    params = _model().init(jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
    with self.assertRaisesRegex(dvbench.errors.ApiError, "400.*data_order.*register "
                                "training_set too"):
      owner.benchmark("alice/no-set").register(metric="accuracy", evaluate=correct,
                                               params=params, rows=EVAL,
                                               data_order="server-seeded")
    # Under full replay every row is a member of the pinned set only through the order.
    with self.assertRaisesRegex(dvbench.errors.ApiError, "400.*a full-replay benchmark with a "
                                "training set pins data_order='server-seeded'"):
      owner.benchmark("alice/full-no-order").register(
          metric="accuracy", evaluate=correct, params=params, rows=EVAL, audit="full-replay",
          training_set=self.training_set)


if __name__ == "__main__":
  from absl.testing import absltest  # pylint: disable=import-outside-toplevel
  absltest.main()
