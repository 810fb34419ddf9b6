"""Run and experiment pages, read by headless Chromium from a real `dvbench serve` on loopback.

One server (one validation worker) for the whole file: a JAX run whose step returns
its loss (replayed by the worker), and pure-Python proofs (tests/fake_prover.py) for
curves, challenged steps, empty states and the index's pages.
"""

import csv
import html
import html.parser
import io
import math
import re
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
from dvbench.server import run_view
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
                            (0.0, 2.5e-323), (0.0, 5e-324),
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

  def test_a_curve_of_a_full_replay_draws_its_failed_marks_and_a_bounded_rest(self):
    steps = 20_000
    marks = {s: "verified" for s in range(steps)} | {s: "failed" for s in (5, 12_345)}
    svg = charts.metric_chart("loss", [(s, 1.0 / (s + 1)) for s in range(steps)], marks)
    dom = Dom(svg)
    drawn = len(dom.find("circle", class_="mark"))
    self.assertBetween(drawn, charts.MAX_MARKS // 2, charts.MAX_MARKS)  # before: 20,000
    self.assertEqual({c[1]["data-step"] for c in dom.find("circle", class_="failed")},
                     {"5", "12345"})
    self.assertIn(f"{drawn} of {steps} marked steps drawn (failed first)",
                  " ".join(g[2] for g in dom.find("g", class_="legend")))
    self.assertLess(svg.count(","), 2 * (charts.MAX_POINTS + charts.MAX_MARKS))

  def test_the_checks_chart_draws_a_tick_per_group_titled_with_its_steps(self):
    ticks = [{"kind": "update", "status": "verified", "first": 0, "last": 0, "count": 1},
             {"kind": "update", "status": "verified", "first": 649, "last": 1297, "count": 9},
             {"kind": "update", "status": "failed", "first": 700, "last": 700, "count": 1},
             {"kind": "start", "status": "verified", "first": 0, "last": 0, "count": 1}]
    dom = Dom(charts.checks_chart(400_000, ticks))
    lines = dom.find("line", class_="check")
    self.assertLen(lines, len(ticks))
    self.assertEqual([(ln[1]["class"], ln[1]["data-step"], ln[1]["data-count"]) for ln in lines],
                     [(f"check {t['status']}", str(t["first"]), str(t["count"])) for t in ticks])
    titles = [t[2] for t in dom.find("title")]
    self.assertIn("step 0 update check: verified", titles)
    self.assertIn("steps 649–1297: 9 update checks verified", titles)
    self.assertIn("step 700 update check: failed", titles)

  def test_steps_a_resume_discarded_are_dots_off_the_curve(self):
    # Steps 2 and 3 ran after the last committed state (step 1), then the run resumed from
    # it at step 4: the curve goes from step 1 to step 4, and 2 and 3 are grey dots.
    points = [(i, float(10 - i)) for i in range(6)]
    svg = charts.metric_chart("loss", points, {2: "discarded", 3: "discarded", 5: "verified"})
    curve = re.search(r"class='curve'[^>]*points='([^']*)'", svg).group(1).split()
    self.assertLen(curve, 4)  # steps 0, 1, 4, 5: before, the curve drew all six
    self.assertEqual(len(re.findall(r"class='mark discarded'", svg)), 2)
    self.assertIn("data-step='2'", svg)
    self.assertIn("discarded by a resume: not the run&#x27;s training", svg)
    whole = charts.metric_chart("loss", points, {5: "verified"})
    self.assertLen(re.search(r"class='curve'[^>]*points='([^']*)'", whole).group(1).split(), 6)


class PagesTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # The index's pages need more proofs open at once than an owner's default quota.
    cls.server = LocalServer(workers=1, extra_args=(
        "--min-update-check-probability", "0.3", "--quota-open-proofs", "200",
        "--min-probe-ratio", "0.03125")).start()  # every step probed: no data claim by chance
    cls.url = cls.server.url
    cls.token = cls.server.token("alice")
    # A JAX run whose loss the worker replays: one-step segments at p = 0.9, so that the
    # server draws at least one update check but for one run in a million (adaptive segments
    # of a tiny model may join its six steps into one or two segments, left unchallenged
    # with probability 0.1 or 0.01).
    client = dvbench.Client(cls.url, token=cls.token)
    proof = client.experiment("alice/jax").proof(
        backend="jax", config=zkdv.ZKDVConfig(
            sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.9),
            segment_length=1),
        run_name="adam 1e-3", tags=("tutorial",),
        run_config={"learning_rate": np.float32(1e-3), "widths": (4, 2), "seed": 0})
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
    self.assertEqual(dom.find("td", id="run-name")[0][2], "adam 1e-3")
    self.assertEqual(dom.find("td", id="tags")[0][2].split(), ["tutorial"])
    declared = {r[1]["data-key"]: r[2] for r in dom.find("tr") if "data-key" in r[1]}
    self.assertEqual(declared, {"learning_rate": f"learning_rate{float(np.float32(1e-3))!r}",
                                "widths": "widths[4, 2]", "seed": "seed0"})
    self.assertIn("loss_step", dom.find("table", id="config")[0][2])
    self.assertNotIn("<script", httpx.get(f"{self.url}/proofs/{self.jax_proof}").text)

  def test_metrics_json_holds_the_committed_values_bit_for_bit(self):
    series = self.get_json(f"/api/v1/proofs/{self.jax_proof}/metrics")
    self.assertEqual(series["steps"], list(range(6)))
    self.assertEqual([np.float32(v).tobytes() for v in series["metrics"]["loss"]],
                     [x.tobytes() for x in self.losses])
    self.assertTrue(set(series["marks"].values()) <= {"verified"})
    rows = list(csv.reader(io.StringIO(httpx.get(
        f"{self.url}/api/v1/proofs/{self.jax_proof}/metrics.csv").text)))
    self.assertEqual(rows[0], ["step", "loss"])  # the program's metric
    self.assertEqual([np.float32(float(r[1])).tobytes() for r in rows[1:]],
                     [x.tobytes() for x in self.losses])
    fake = self.get_json(f"/api/v1/proofs/{self.fake.proof_id}/metrics?start=2")
    self.assertEqual(fake["steps"][0], 2)
    self.assertEqual(fake["metrics"]["grad_norm"][1], "inf")
    self.assertEqual(fake["metrics"]["logits"][0], "00" * 32)
    challenged = {str(s) for s, d in self.fake_run.decisions.items() if d.update}
    self.assertEqual(set(fake["marks"]), {s for s in challenged if int(s) >= 2})  # its steps
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

  def test_a_zoomed_range_without_marks_says_the_run_has_them(self):
    challenged = {s for s, d in self.fake_run.decisions.items() if d.update}
    quiet = next(s for s in range(30) if s not in challenged)
    dom = Dom(httpx.get(f"{self.url}/proofs/{self.fake.proof_id}?from={quiet}&to={quiet}").text)
    self.assertEqual(dom.find("p", id="no-marks")[0][2],  # before: "No step is challenged yet"
                     f"No step drawn here is challenged ({len(challenged)} of the run's steps "
                     "are).")
    self.assertEqual(dom.find("p", id="drawn")[0][2].split(";")[0],
                     f"Drawn: steps {quiet} to {quiet} of 30")

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

  def test_metric_names_a_response_lists_are_bounded(self):
    # Steps that each commit 64 new names: before, every response held a column of every
    # step for each name (1,000 such steps: a 313 MB JSON answer, 1.2 GiB of server memory).
    prover = FakeProver(self.url, self.token, "alice/many-names")
    self.addCleanup(prover.http.close)
    prover.start()
    new_names = lambda t: {f"m{64 * t + i}": float(i) for i in range(64)}
    prover.run(3, metrics=new_names)
    series = self.get_json(f"/api/v1/proofs/{prover.proof_id}/metrics")
    self.assertEqual(list(series["metrics"]), [f"m{i}" for i in range(run_view.SERIES_NAMES)])
    self.assertTrue(series["more_names"])
    self.assertEqual(series["metrics"]["m127"], [None, 63.0, None])
    self.assertFalse(self.get_json(f"/api/v1/proofs/{self.jax_proof}/metrics")["more_names"])
    rows = list(csv.reader(io.StringIO(httpx.get(
        f"{self.url}/api/v1/proofs/{prover.proof_id}/metrics.csv").text)))
    self.assertLen(rows[0], 1 + run_view.SERIES_NAMES)

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


def sweep_curve(scale: float):
  """What a sweep run's step t commits: a loss that falls at a rate ``scale``."""
  return lambda t: {"loss": 2.0 * math.exp(-scale * t), "accuracy": min(1.0, scale * t)}


INJECTED = "<script>alert(1)</script><img src=x onerror=alert(2)>"


class RunPagesTest(absltest.TestCase):
  """Run names, tags, declared configs, overlays, the compare view, search and filter, CSV,
  timing and the crashed state, on one server (no worker: nothing is replayed) whose
  --crash-after is 3 s. Pure-Python runs (tests/fake_prover.py) of 12 steps."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=0, extra_args=("--crash-after", "3s")).start()
    cls.url = cls.server.url
    token = cls.server.token("alice")
    cls.provers = []

    def run(experiment, name, steps, scale, finish=True, **declared):
      prover = FakeProver(cls.url, token, experiment).start(name, **declared)
      cls.provers.append(prover)
      outcome = prover.run(steps, metrics=sweep_curve(scale))
      if finish:
        prover.finish()
      return prover, outcome

    cls.slow, _ = run("alice/sweep", "sweep", 12, 0.1, run_name="lr-0.1",
                      tags=["sweep-1", "baseline"],
                      run_config={"lr": 0.1, "optimizer": {"name": "adam", "b1": 0.9},
                                  "layers": [64, 64]})
    cls.fast, _ = run("alice/sweep", "sweep", 12, 0.3, run_name="lr-0.3", tags=["sweep-1"],
                      run_config={"lr": 0.3, "optimizer": {"name": "adam", "b1": 0.9},
                                  "layers": [64, 64]})
    cls.crashing, _ = run("alice/sweep", "sweep", 3, 0.2, finish=False, run_name="preempted",
                          tags=["sweep-2"])
    cls.hostile, _ = run("alice/hostile", "hostile", 2, 0.1, run_name=INJECTED,
                         run_config={INJECTED: INJECTED, "nested": {"x": INJECTED}})
    testing.wait_until(lambda: httpx.get(f"{cls.url}/api/v1/proofs/{cls.crashing.proof_id}"
                                         ).json()["state"] == "crashed", timeout=60)

  @classmethod
  def tearDownClass(cls):
    for prover in cls.provers:
      prover.http.close()
    cls.server.stop()
    super().tearDownClass()

  def listed(self, path: str) -> list[str]:
    response = httpx.get(self.url + path)
    self.assertEqual(response.status_code, 200, response.text)
    return [r[1]["data-proof"] for r in Dom(response.text).find("tr") if "data-proof" in r[1]]

  def test_experiment_page_overlays_its_runs_curves(self):
    dom = chromium_dom(self, f"{self.url}/experiments/alice/sweep")
    [loss] = dom.find("svg", class_="overlay-chart", **{"data-metric": "loss"})
    curves = {c[1]["data-run"]: c[2] for c in dom.find("polyline", class_="run-curve")
              if ": loss = " in c[2]}
    self.assertTrue({self.slow.proof_id, self.fast.proof_id, self.crashing.proof_id}
                    <= set(curves))
    self.assertIn(f"lr-0.3: loss = {2.0 * math.exp(-0.3 * 11):.6g} at step 11",
                  curves[self.fast.proof_id])
    self.assertIn("lr-0.1", loss[2])  # the legend names the runs
    self.assertLen(dom.find("svg", class_="overlay-chart"), 2)  # loss and accuracy
    self.assertLen(dom.find("input", type="checkbox", name="proof"), 3)
    self.assertEqual(dom.find("form", id="compare-form")[0][1]["action"], "/compare")

  def test_compare_view_marks_what_differs_and_overlays_the_curves(self):
    dom = chromium_dom(self, f"{self.url}/compare?proof={self.slow.proof_id}"
                             f"&proof={self.fast.proof_id}")
    rows = {r[1]["data-key"]: r for r in dom.find("tr") if "data-key" in r[1]}
    self.assertIn("differs", rows["declared: lr"][1].get("class", ""))
    self.assertIn("0.3", rows["declared: lr"][2])
    self.assertIn("differs", rows["tags"][1].get("class", ""))
    for same in ("declared: optimizer.name", "declared: optimizer.b1", "declared: layers",
                 "state", "steps"):
      self.assertNotIn("differs", rows[same][1].get("class", ""), same)
    order = [r[1]["data-key"] for r in dom.find("tr") if "data-key" in r[1]]
    self.assertLess(order.index("declared: lr"), order.index("state"))  # differences first
    self.assertEqual({c[1]["data-run"] for c in dom.find("polyline", class_="run-curve")},
                     {self.slow.proof_id, self.fast.proof_id})
    for query, status in ((f"proof={self.slow.proof_id}", 400), ("", 400),
                          (f"proof={self.slow.proof_id}&proof=" + "ab" * 32, 404),
                          ("&".join(["proof=x"] * 9), 400)):
      self.assertEqual(httpx.get(f"{self.url}/compare?{query}").status_code, status, query)

  def test_a_crashed_run_page_says_crashed_with_its_duration(self):
    dom = chromium_dom(self, f"{self.url}/proofs/{self.crashing.proof_id}")
    self.assertEqual([b[2] for b in dom.find("span", class_="crashed")], ["crashed"])
    self.assertIn("crashed: nothing arrived", dom.find("span", id="label")[0][2])
    self.assertNotIn("running", dom.find("td", id="duration")[0][2])
    self.assertEqual(dom.find("td", id="run-name")[0][2], "preempted")
    self.assertEqual(dom.find("td", id="tags")[0][2].split(), ["sweep-2"])
    api = httpx.get(f"{self.url}/api/v1/proofs/{self.crashing.proof_id}").json()
    self.assertEqual((api["run_name"], api["tags"]), ("preempted", ["sweep-2"]))
    self.assertGreater(api["ended_at"], api["created_at"])
    finished = Dom(httpx.get(f"{self.url}/proofs/{self.slow.proof_id}").text)
    self.assertRegex(finished.find("td", id="duration")[0][2], r"^\d+ s$")
    declared = {r[1]["data-key"]: r[2] for r in finished.find("tr") if "data-key" in r[1]}
    self.assertEqual(declared["optimizer.name"], "optimizer.nameadam")
    self.assertEqual(declared["layers"], "layers[64, 64]")
    headings = [h[2] for h in finished.find("h2")]
    self.assertLess(headings.index("Configuration"), headings.index("Checks over steps"))
    self.assertIn("Declared by the prover", [h[2] for h in finished.find("h3")])

  def test_charts_zoom_into_a_step_range(self):
    dom = chromium_dom(self, f"{self.url}/experiments/alice/sweep?tag=sweep-1&from=5&to=8")
    titles = [c[2] for c in dom.find("polyline", class_="run-curve") if ": loss = " in c[2]]
    self.assertEqual(sorted(titles), [f"lr-0.1: loss = {2.0 * math.exp(-0.1 * 8):.6g} at step 8",
                                      f"lr-0.3: loss = {2.0 * math.exp(-0.3 * 8):.6g} at step 8"])
    [zoom] = dom.find("form", class_="zoom")
    self.assertEqual({i[1]["name"]: i[1]["value"] for i in dom.find("input")
                      if i[1].get("name") in ("from", "to", "tag") and i[1].get("type") != "text"},
                     {"from": "5", "to": "8", "tag": "sweep-1"})  # the filter is kept
    self.assertEqual(dom.find("a", class_="unzoom")[0][1]["href"],
                     "/experiments/alice/sweep?tag=sweep-1")
    proof = Dom(httpx.get(f"{self.url}/proofs/{self.fast.proof_id}?from=&to=3").text)
    self.assertEqual(proof.find("p", id="drawn")[0][2].split(";")[0], "Drawn: steps 0 to 3 of 12")
    [loss] = proof.find("svg", class_="metric-chart", **{"data-metric": "loss"})
    self.assertEqual(loss[1]["aria-label"], "loss over steps")
    beyond = Dom(httpx.get(f"{self.url}/proofs/{self.fast.proof_id}?from=100").text)
    self.assertIn("No step in the zoomed range", beyond.find("p", id="no-metrics")[0][2])
    compare = Dom(httpx.get(f"{self.url}/compare?proof={self.slow.proof_id}"
                            f"&proof={self.fast.proof_id}&from=2&to=2").text)
    self.assertTrue(all("at step 2" in c[2] for c in compare.find("polyline", class_="run-curve")))
    for query in ("from=9&to=3", "from=x", "to=-1"):
      self.assertEqual(httpx.get(f"{self.url}/proofs/{self.fast.proof_id}?{query}").status_code,
                       400, query)

  def test_metrics_csv_holds_the_committed_values(self):
    response = httpx.get(f"{self.url}/api/v1/proofs/{self.fast.proof_id}/metrics.csv")
    self.assertEqual(response.status_code, 200)
    self.assertTrue(response.headers["content-type"].startswith("text/csv"))
    self.assertIn("attachment", response.headers["content-disposition"])
    rows = list(csv.reader(io.StringIO(response.text)))
    self.assertEqual(rows[0], ["step", "loss", "accuracy"])
    self.assertEqual([int(r[0]) for r in rows[1:]], list(range(12)))
    expected = sweep_curve(0.3)
    for step, loss, accuracy in rows[1:]:
      self.assertEqual((float(loss), float(accuracy)),
                       (expected(int(step))["loss"], expected(int(step))["accuracy"]))
    self.assertEqual(httpx.get(f"{self.url}/api/v1/proofs/{'ab' * 32}/metrics.csv")
                     .status_code, 404)

  def test_search_and_filter_the_index_and_the_experiment_page(self):
    self.assertEqual(self.listed("/?q=LR-0.3"), [self.fast.proof_id])
    self.assertEqual(self.listed(f"/?q={self.slow.proof_id[:10]}"), [self.slow.proof_id])
    self.assertEqual(self.listed("/?tag=baseline"), [self.slow.proof_id])
    self.assertEqual(self.listed("/?tag=sweep"), [])  # tags match whole
    self.assertEqual(self.listed("/?state=crashed"), [self.crashing.proof_id])
    self.assertEqual(self.listed("/?state=closed&tag=sweep-1"),
                     [self.fast.proof_id, self.slow.proof_id])
    self.assertEqual(self.listed("/?q=%25"), [])  # a LIKE wildcard is searched as text
    self.assertEqual(self.listed("/experiments/alice/sweep?tag=sweep-1"),
                     [self.fast.proof_id, self.slow.proof_id])
    self.assertEqual(self.listed("/experiments/alice/sweep?q=preempted&state=crashed"),
                     [self.crashing.proof_id])
    empty = Dom(httpx.get(f"{self.url}/experiments/alice/sweep?q=nothing-like-it").text)
    self.assertIn("No proofs match", empty.find("p", id="no-proofs")[0][2])
    form = Dom(httpx.get(f"{self.url}/?state=crashed&q=x").text)
    self.assertEqual([o[1]["value"] for o in form.find("option") if "selected" in o[1]],
                     ["crashed"])
    states = {o[1]["value"] for o in form.find("option")}
    self.assertTrue({"verified", "verified steps", "within tolerance", "unchallenged",
                     "self-audited", "invalid", "unverifiable", "abandoned", "crashed"}
                    <= states)
    for query in ("state=bogus", "tag=a%20b", "q=" + "x" * 201):
      response = httpx.get(f"{self.url}/?{query}")
      self.assertEqual(response.status_code, 400, query)
    proof_page = f"{self.url}/proofs/{self.slow.proof_id}?checks_after="
    for cursor, status in (("3.update", 200), ("x", 400), ("9" * 12 + ".update", 400),
                           ("3.<b>", 400)):
      self.assertEqual(httpx.get(proof_page + cursor).status_code, status, cursor)

  def test_prover_written_text_is_escaped_everywhere(self):
    pages = [f"/proofs/{self.hostile.proof_id}", "/", "/experiments/alice/hostile",
             f"/compare?proof={self.hostile.proof_id}&proof={self.slow.proof_id}",
             f"/?q={self.hostile.proof_id[:12]}"]
    for path in pages:
      text = httpx.get(self.url + path).text
      self.assertNotIn("<script", text, path)
      self.assertNotIn("<img", text, path)
      self.assertIn(html.escape(INJECTED), text, path)
    dom = chromium_dom(self, f"{self.url}/proofs/{self.hostile.proof_id}")
    self.assertEqual(dom.find("td", id="run-name")[0][2], INJECTED)  # shown as text
    self.assertEmpty(dom.find("script"))
    self.assertEmpty(dom.find("img"))

  def test_a_client_refuses_bad_run_fields_before_sending_anything(self):
    with dvbench.Client(self.url, token=self.server.token("alice")) as client:
      experiment = client.experiment("alice/refused")
      for declared, message in (({"tags": ["no spaces"]}, "run.tags[0]: a tag of 1-64"),
                                ({"run_config": {"f": print}}, "run.run_config.f: a number")):
        with self.assertRaisesRegex(ValueError, re.escape(message)):
          experiment.proof(**declared)
      self.assertEmpty(experiment.proofs())
      proof = experiment.proof(run_config={"lr": np.float32(0.5), "shape": (2, 3)})
      self.assertEqual(proof.run, {"run_config": {"lr": 0.5, "shape": [2, 3]}})

  def test_declared_run_fields_are_bounded_at_the_root(self):
    prover = FakeProver(self.url, self.server.token("alice"), "alice/bounds")
    self.provers.append(prover)
    for declared, message in (
        ({"tags": ["a b"]}, "(root).tags[0]: a tag of 1-64"),
        ({"tags": ["t"] * 33}, "(root).tags: a list of 0-32 items"),
        ({"run_name": "x" * 201}, "(root).run_name: a string of 0-200"),
        ({"run_config": {"a": {"b": {"c": {"d": {"e": {"f": {"g": 1}}}}}}}},
         "run_config.a.b.c.d.e.f: nested deeper than 6"),
        ({"run_config": {str(n): n for n in range(1001)}}, "at most 1000 values"),
        ({"run_config": {"lr": b"bytes"}}, "run_config.lr: a number, string"),
        ({"run_config": [1]}, "(root).run_config: a map of hyperparameters")):
      response = prover.post_root({**prover.root(prover.slot()), **declared})
      self.assertEqual(response.status_code, 400, declared)
      self.assertIn(message, response.json()["error"])


if __name__ == "__main__":
  absltest.main()
