"""Run and experiment pages, read by headless Chromium from a real `dvbench serve` on loopback.

One server (one validation worker) for the whole file: a JAX run whose step returns
its loss (replayed by the worker), and pure-Python proofs (tests/fake_prover.py) for
curves, challenged steps, empty states and the index's pages.
"""

import html.parser
import math
import shutil
import subprocess
import tempfile

import httpx
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import dvbench
import zkdv
from dvbench.server import charts
from dvbench.server import page
from dvbench.server.local import LocalServer
from tests import metrics_test
from tests import testing
from tests.fake_prover import FakeProver


class Dom(html.parser.HTMLParser):
  """The elements of a rendered DOM: (tag, attributes, text inside it) in document order."""

  def __init__(self, dom: str):
    super().__init__()
    self.elements: list[list] = []
    self._open: list[list] = []
    self.feed(dom)

  def handle_starttag(self, tag, attrs):
    element = [tag, dict(attrs), ""]
    self.elements.append(element)
    if tag not in ("br", "img", "link", "meta", "input"):
      self._open.append(element)

  def handle_startendtag(self, tag, attrs):
    self.elements.append([tag, dict(attrs), ""])

  def handle_endtag(self, tag):
    if any(element[0] == tag for element in self._open):
      while self._open.pop()[0] != tag:
        pass

  def handle_data(self, data):
    for element in self._open:
      element[2] += data

  def find(self, tag: str, **attrs) -> list[list]:
    """Elements of ``tag`` whose attributes hold ``attrs`` (``class_`` matches one class)."""
    def matches(a):
      return all((v in a.get("class", "").split()) if k == "class_" else a.get(k) == v
                 for k, v in attrs.items())
    return [el for el in self.elements if el[0] == tag and matches(el[1])]


def chromium_dom(test: absltest.TestCase, url: str) -> Dom:
  """The DOM headless Chromium renders at 1400 px wide."""
  chromium = shutil.which("chromium") or shutil.which("chromium-browser")
  test.assertIsNotNone(chromium, "Debian's chromium package is needed (scripts/test installs it)")
  profile = tempfile.mkdtemp(prefix="dvbench-chromium-")
  test.addCleanup(shutil.rmtree, profile, True)
  dom = subprocess.run(
      [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
       "--no-first-run", "--disable-background-networking", "--disable-component-update",
       "--disable-sync", f"--user-data-dir={profile}", "--window-size=1400,1000",
       "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True).stdout
  return Dom(dom)


def loss_step(state, batch):
  """The tutorial step, also returning its loss."""
  loss, grads = jax.value_and_grad(lambda p: testing.classifier_loss(state, batch, p))(
      state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


def curve(t: int) -> dict:
  """What the fake run's step t commits."""
  return {"loss": 2.0 * math.exp(-t / 8), "accuracy": min(1.0, t / 20),
          "grad_norm": "inf" if t == 3 else 1.0 / (t + 1), "logits": bytes(32)}


class ChartsTest(parameterized.TestCase):

  @parameterized.parameters((0.0, 0.93), (3.0, 3.0), (-2e-9, 1e-9), (1e-320, 3e-320),
                            (-1e308, 1e308), (1.7e308, 1.7e308), (0.0, 2**63))
  def test_ticks_cover_any_committed_range_in_few_steps(self, low, high):
    ticks = charts.nice_ticks(low, high)
    self.assertBetween(len(ticks), 2, 13)
    self.assertLessEqual(ticks[0], low)
    self.assertGreaterEqual(ticks[-1], high)
    self.assertEqual(ticks, sorted(ticks))

  def test_a_chart_of_extreme_or_non_finite_values_is_still_drawn_or_explained(self):
    self.assertIn("<svg", charts.metric_chart("loss", [(0, -1e308), (1, 1e308)], {}))
    self.assertIn("no finite value", charts.metric_chart("loss", [(0, math.nan)], {0: "verified"}))
    many = charts.metric_chart("loss", [(i, float(i)) for i in range(100_000)], {77_777: "failed"})
    self.assertLess(many.count(","), 2 * charts.MAX_POINTS)  # thinned, the marked step kept
    self.assertIn("data-step='77777'", many)


class PagesTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # The index's pages need more proofs open at once than an owner's default quota.
    cls.server = LocalServer(workers=1, extra_args=(
        "--min-update-check-probability", "0.3", "--quota-open-proofs", "200")).start()
    cls.url = cls.server.url
    cls.token = cls.server.token("alice")
    # A JAX run whose loss the worker replays: one-step segments at p = 0.9, so that the
    # server draws at least one update check but for one run in a million (adaptive segments
    # of a tiny model may join its six steps into one or two segments, left unchallenged
    # with probability 0.1 or 0.01).
    client = dvbench.Client(cls.url, token=cls.token)
    proof = client.experiment("alice/jax").proof(backend="jax", config=zkdv.ZKDVConfig(
        sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.9), segment_length=1))
    state = testing.classifier_state(proof)
    train_step = proof.jit(loss_step)
    cls.losses = []
    for _ in range(6):
      state, out = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH))
      cls.losses.append(np.asarray(out["loss"]))
    proof.finish()
    cls.jax_proof = proof.proof_id
    cls.jax_status = client.wait_for_verdict(cls.jax_proof, 240)
    client.close()
    # A pure-Python run with curves, left open (challenged, not replayed), and one without
    # metrics or checks.
    cls.fake = FakeProver(cls.url, cls.token, "alice/curves").start("curves")
    cls.fake_run = cls.fake.run(30, metrics=curve)
    cls.bare = FakeProver(cls.url, cls.token, "alice/bare").start("bare")
    cls.bare.run(1)
    FakeProver(cls.url, cls.token, "alice/empty").slot()  # an experiment without proofs

  @classmethod
  def tearDownClass(cls):
    for prover in (cls.fake, cls.bare):
      prover.http.close()
    cls.server.stop()
    super().tearDownClass()

  def test_proof_page_draws_the_replayed_loss_curve(self):
    self.assertEqual(self.jax_status["state"], "verified steps", str(self.jax_status))
    dom = chromium_dom(self, f"{self.url}/proofs/{self.jax_proof}")
    [chart] = dom.find("svg", class_="metric-chart", **{"data-metric": "loss"})
    self.assertIn("step", dom.find("g", class_="x")[0][2])
    self.assertIn("loss", dom.find("g", class_="y")[0][2])
    self.assertGreaterEqual(len(dom.find("line", class_="tick")), 6)
    self.assertIn("replayed by the server, verified", dom.find("g", class_="legend")[0][2])
    checks = self.get_json(f"/api/v1/proofs/{self.jax_proof}/checks")
    replayed = {str(c["step"]) for c in checks if c["kind"] == "update"}
    self.assertNotEmpty(replayed)
    self.assertEqual({c[1]["data-step"] for c in dom.find("circle", class_="verified")},
                     replayed)
    self.assertIn("optimizer state: count, mu, nu", dom.find("table", id="config")[0][2])
    self.assertIn("loss_step", dom.find("table", id="config")[0][2])
    self.assertNotIn("<script", httpx.get(f"{self.url}/proofs/{self.jax_proof}").text)

  def test_metrics_json_holds_the_committed_values_bit_for_bit(self):
    series = self.get_json(f"/api/v1/proofs/{self.jax_proof}/metrics")
    self.assertEqual(series["steps"], list(range(6)))
    self.assertEqual([np.float32(v).tobytes() for v in series["metrics"]["loss"]],
                     [x.tobytes() for x in self.losses])
    self.assertTrue(set(series["marks"].values()) <= {"verified"})
    fake = self.get_json(f"/api/v1/proofs/{self.fake.proof_id}/metrics?start=2")
    self.assertEqual(fake["steps"][0], 2)
    self.assertEqual(fake["metrics"]["grad_norm"][1], "inf")
    self.assertEqual(fake["metrics"]["logits"][0], "00" * 32)
    challenged = {str(s) for s, d in self.fake_run.decisions.items() if d.update}
    self.assertEqual(set(fake["marks"]), challenged)
    self.assertEqual(httpx.get(f"{self.url}/api/v1/proofs/{self.fake.proof_id}/metrics?start=x"
                               ).status_code, 400)

  def test_challenged_steps_are_marked_on_each_curve(self):
    dom = chromium_dom(self, f"{self.url}/proofs/{self.fake.proof_id}")
    names = {c[1]["data-metric"] for c in dom.find("svg", class_="metric-chart")}
    self.assertEqual(names, {"loss", "accuracy", "grad_norm"})
    challenged = {str(s) for s, d in self.fake_run.decisions.items() if d.update}
    self.assertNotEmpty(challenged)
    loss_marks = [c for c in dom.find("circle", class_="challenged")]
    self.assertEqual({c[1]["data-step"] for c in loss_marks}, challenged)  # one per step...
    self.assertLen(loss_marks, 3 * len(challenged) - ("3" in challenged))  # ...per curve
    legend = " ".join(g[2] for g in dom.find("g", class_="legend"))
    self.assertIn("challenged, not replayed yet", legend)
    self.assertIn("1 non-finite values not drawn", legend)
    self.assertIn("logits", dom.find("p", id="digest-metrics")[0][2])
    self.assertIn("No checks replayed yet", dom.find("p", id="no-checks")[0][2])

  def test_empty_states_are_readable(self):
    dom = chromium_dom(self, f"{self.url}/proofs/{self.bare.proof_id}")
    self.assertEmpty(dom.find("svg", class_="metric-chart"))
    self.assertIn("No metrics yet", dom.find("p", id="no-metrics")[0][2])
    self.assertIn('{"loss": loss}', dom.find("p", id="no-metrics")[0][2])
    self.assertIn("No checks replayed yet", dom.find("p", id="no-checks")[0][2])
    empty = Dom(httpx.get(f"{self.url}/experiments/alice/empty").text)
    self.assertIn("No proofs yet", " ".join(p[2] for p in empty.find("p", class_="empty")))

  def test_experiment_page_and_links(self):
    dom = chromium_dom(self, f"{self.url}/experiments/alice/curves")
    self.assertEqual([r[1]["data-proof"] for r in dom.find("tr") if "data-proof" in r[1]],
                     [self.fake.proof_id])
    self.assertIn("29", dom.find("table", id="latest")[0][2])  # the last step's metrics
    self.assertIn(f"{2.0 * math.exp(-29 / 8):.6g}",
                  dom.find("tr", **{"data-metric": "loss"})[0][2])
    index = Dom(httpx.get(f"{self.url}/").text)
    links = {a[1]["href"] for a in index.find("a", class_="experiment")}
    self.assertTrue({"/experiments/alice/curves", "/experiments/alice/jax",
                     "/experiments/alice/empty"} <= links)

  def test_unknown_ids_give_an_html_404_page(self):
    for path in ("/proofs/" + "ab" * 32, "/proofs/nope", "/experiments/alice/none", "/nowhere"):
      response = httpx.get(self.url + path)
      self.assertEqual(response.status_code, 404, path)
      self.assertTrue(response.headers["content-type"].startswith("text/html"), path)
    dom = chromium_dom(self, f"{self.url}/proofs/nope")
    self.assertEqual(dom.find("h1")[0][2], "Not found")
    self.assertIn("there is no proof 'nope' on this server", dom.find("p", id="not-found")[0][2])
    api = httpx.get(f"{self.url}/api/v1/proofs/nope")
    self.assertEqual((api.status_code, api.headers["content-type"]), (404, "application/json"))

  def test_index_is_paginated_with_failure_summaries(self):
    prover = FakeProver(self.url, self.token, "alice/many")
    self.addCleanup(prover.http.close)
    for n in range(page.PAGE_SIZE):
      prover.start(f"run {n}")
    total = len(self.get_json("/api/v1/experiments/alice/many")["proofs"])
    first = Dom(httpx.get(self.url + "/").text)
    rows = [r[1]["data-proof"] for r in first.find("tr") if "data-proof" in r[1]]
    self.assertLen(rows, page.PAGE_SIZE)
    [older] = first.find("a", rel="next")
    second = Dom(httpx.get(self.url + older[1]["href"]).text)
    more = [r[1]["data-proof"] for r in second.find("tr") if "data-proof" in r[1]]
    self.assertNotEmpty(more)
    self.assertEmpty(set(rows) & set(more))
    self.assertEqual(second.find("a", rel="first")[0][1]["href"], "/")
    self.assertGreaterEqual(total, page.PAGE_SIZE)
    self.assertEqual(httpx.get(self.url + "/?after=x").status_code, 400)
    self.assertEqual(page.failure_summary("line one\n" + "x" * 500), "line one")
    self.assertLen(page.failure_summary("y" * 500), page.FAILURE_SUMMARY)

  def test_malformed_metrics_are_refused_at_ingest(self):
    prover = FakeProver(self.url, self.token, "alice/bad-metrics")
    self.addCleanup(prover.http.close)
    prover.start()
    for metrics, message in (({"loss": float("nan")}, "metric 'loss' is a non-finite float"),
                             ({"loss": "nan"}, "only"), ({"a b": 1.0}, "metric name 'a b'")):
      response = prover.send(prover.step_record(metrics=metrics))
      self.assertEqual(response.status_code, 400, response.text)
      self.assertIn(message, response.json()["error"])
    self.assertEqual(prover.send(prover.step_record(metrics={"loss": "nan:7fc00000"}))
                     .status_code, 200)

  def test_re_uploading_a_finished_proof_is_a_no_op(self):
    path = metrics_test.transcript_with_metrics()[0]
    with dvbench.Client(self.url, token=self.token) as client:
      experiment = client.experiment("alice/offline")
      proof_id = experiment.upload(path)
      self.assertEqual(experiment.upload(path), proof_id)  # no 409: nothing to send
      self.assertEqual(experiment.proofs()[0]["records"],
                       len(testing.records_of(path)))

  def get_json(self, path: str):
    response = httpx.get(self.url + path, timeout=30)
    self.assertEqual(response.status_code, 200, response.text)
    return response.json()


if __name__ == "__main__":
  absltest.main()
