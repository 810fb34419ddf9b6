"""Self-reported measurements (server-chosen samples, never ranked), against a real server."""

import html.parser
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import time

import cbor2
import httpx
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import serialization

import dvbench
from dvbench.server import quotas
from dvbench.server import routes_measurements
from tests.dvbench_test import DVBenchTestCase
from tests.fake_prover import FakeProver
from tests import tutorial_steps

EVAL_BATCHES = [np.asarray(np.random.default_rng(i).integers(0, 2, (4, 5)), np.uint32)
                for i in range(6)]


def train(server_url: str, experiment: str, steps: int, batch=None,
          update_check_probability: float = 1.0,
          attested_start: bool = True, edits: tuple[tuple[str, str], ...] = (),
          names: dict | None = None) -> tuple[pathlib.Path, str]:
  """The tutorial (with data probes and every step checked); returns (checkpoint, proof id).

  ``batch``: rows (uint32, 4 tokens and a label) trained on instead of the tutorial's.
  ``attested_start``: the one-line change ``model.init(...)`` -> ``proof.init(model.init,
  ...)`` that attests the initial params. ``edits``: further ``(old, new)`` replacements of
  the code, which runs with ``names`` defined, e.g. ``(("Client(API_URL)",
  "Client(API_URL, token=TOKEN)"),)`` with ``{"TOKEN": ...}``.
  """
  code = tutorial_steps.STEPS_2_TO_6
  if batch is not None:  # row for row, so that no line moves (programs record locations)
    for old, new in zip(tutorial_steps_batch().tolist(), np.asarray(batch).tolist(), strict=True):
      code = code.replace(f"        {old},", f"        {new},")
  code = (code
          .replace("your-name/jax-train-state", experiment)
          .replace("update_check_probability=0.01",
                   f"update_check_probability={update_check_probability}")
          .replace("proof = experiment.proof(backend=\"jax\", config=config)",
                   "proof = experiment.proof(backend=\"jax\", config=config)\n"
                   "proof.start(probe_ratio=0.5)")
          .replace("for _ in range(10):", f"for _ in range({steps}):"))
  if attested_start:
    code = code.replace("params = model.init(", "params = proof.init(model.init, ")
  for old, new in edits:
    assert old in code, old
    code = code.replace(old, new)
  workdir = pathlib.Path(tempfile.mkdtemp())
  cwd = os.getcwd()
  os.chdir(workdir)
  try:
    namespace = {"API_URL": server_url, **(names or {})}
    exec(compile(code, "tutorial", "exec"), namespace)  # pylint: disable=exec-used
  finally:
    os.chdir(cwd)
  return workdir / "jax-checkpoint.msgpack", namespace["proof"].proof_id


def accuracy_measurement(experiment, checkpoint, aggregate=None):
  model_apply = _model().apply
  measurement = experiment.measure(checkpoint)

  @measurement.evaluate(params=0, batch=1)
  def evaluate(params, batch):
    logits = model_apply({"params": params}, batch[:, :4])
    return jnp.mean(jnp.argmax(logits, -1) == batch[:, 4].astype(jnp.int32))

  @measurement.aggregate
  def mean(outputs):
    return sum(outputs) / len(outputs)

  if aggregate is not None:
    measurement.aggregate(aggregate)
  return measurement


def _model():
  from flax import linen as nn  # pylint: disable=g-import-not-at-top

  class TinyClassifier(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      return nn.Dense(2)(tokens.astype(jnp.float32))
  return TinyClassifier()


class Rows(html.parser.HTMLParser):
  """The rows (``tr`` attributes) carrying ``attribute``, and every ``th`` text, of a DOM."""

  def __init__(self, dom: str, attribute: str):
    super().__init__()
    self.attribute, self.rows, self.headers, self._in_th = attribute, [], [], False
    self.feed(dom)

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    if tag == "tr" and self.attribute in attrs:
      self.rows.append(attrs)
    if tag == "th":
      self._in_th = True
      self.headers.append("")

  def handle_endtag(self, tag):
    if tag == "th":
      self._in_th = False

  def handle_data(self, data):
    if self._in_th:
      self.headers[-1] += data


def browse(test: absltest.TestCase, url: str, name: str) -> tuple[str, pathlib.Path]:
  """(the DOM headless Chromium rendered, its screenshot ``name``.png) of ``url``."""
  chromium = shutil.which("chromium") or shutil.which("chromium-browser")
  test.assertIsNotNone(chromium, "Debian's chromium package is needed (scripts/test installs it)")
  out = pathlib.Path(os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR", tempfile.mkdtemp()))
  flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={tempfile.mkdtemp()}", "--window-size=1400,1000"]
  dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True,
                       timeout=120, check=True).stdout
  screenshot = out / f"{name}.png"
  subprocess.run(flags + [f"--screenshot={screenshot}", url], capture_output=True, timeout=120,
                 check=True)
  test.assertEqual(screenshot.read_bytes()[:8], b"\x89PNG\r\n\x1a\n")
  test.assertGreater(screenshot.stat().st_size, 5000)
  return dom, screenshot


class MeasurementTest(DVBenchTestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.client = dvbench.Client(cls.server.url)
    cls.checkpoint, cls.proof_id = train(cls.server.url, "your-name/long", 10)
    cls.short_checkpoint, cls.short_proof = train(cls.server.url, "your-name/short", 1)
    for proof_id in (cls.proof_id, cls.short_proof):
      assert cls.client.wait_for_verdict(proof_id, 120)["state"] == "verified"

  def wait_measurement(self, measurement_id):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
      row = self.client.http.request("GET", f"/api/v1/measurements/{measurement_id}").json()
      if row["state"] not in ("pending", "verifying"):
        return row
      time.sleep(0.2)
    self.fail("measurement not verified in time")

  def submit(self, name, checkpoint, **kwargs):
    experiment = self.client.experiment(name)
    measurement = accuracy_measurement(experiment, checkpoint, **kwargs)
    value = measurement.run(checkpoint, EVAL_BATCHES, progress=False)
    return measurement, value

  def test_measurements_are_self_reported_never_ranked(self):
    measurement, value = self.submit("your-name/long", self.checkpoint)
    self.assertBetween(value, 0.0, 1.0)
    row = self.wait_measurement(measurement.submit("accuracy", value, sample=0.5)["id"])
    self.assertEqual(row["state"], "self-reported", row)
    self.assertEqual((row["batches"], row["sampled"], len(row["open"])), (6, 3, 3))
    page = httpx.get(self.server.url + "/leaderboard").text
    rows = Rows(page, "data-measurement")
    self.assertIn(("self-reported", row["id"]),
                  [(r["data-state"], r["data-measurement"]) for r in rows.rows])
    self.assertNotIn("rank", rows.headers)
    proof_page = httpx.get(f"{self.server.url}/proofs/{self.proof_id}").text
    self.assertIn("<svg class='checks'", proof_page)
    # One update check per segment (adaptive segments may join steps), every one replayed.
    replayed = re.search(r"verified: (\d+) server-chosen update checks replayed at p = 1",
                         proof_page)
    self.assertIsNotNone(replayed, proof_page[:2000])
    self.assertEqual(int(replayed.group(1)), proof_page.count(
        "<td>update</td><td>exact</td><td><span class='state verified'>"))
    self.assertBetween(int(replayed.group(1)), 1, 10)

  def test_the_server_chooses_the_sample_after_the_commitment_with_a_minimum(self):
    measurement, value = self.submit("your-name/short", self.short_checkpoint)
    with self.assertRaisesRegex(dvbench.errors.ApiError, r"400.*sample: the fraction of "
                                r"batches the server opens, a finite float in \[0.25, 1\], "
                                r"got 0.0"):
      measurement.submit("accuracy", value, sample=0.0)
    row = self.wait_measurement(measurement.submit("accuracy", value)["id"])
    self.assertEqual((row["state"], row["sampled"]), ("self-reported", 2), row)
    http = self.client.http
    with self.assertRaisesRegex(dvbench.errors.ApiError, "409.*already opened"):
      http.request("POST", f"/api/v1/measurements/{row['id']}/openings",
                   content=cbor2.dumps([[i, []] for i in row["open"]]))

  def test_a_measurement_record_is_bounded_and_counted_as_stored_bytes(self):
    measurement, value = self.submit("your-name/short", self.short_checkpoint)
    store = self.store()
    before = quotas.usage(store, lambda digest: 0, "your-name")["stored_bytes"]
    row = measurement.submit("accuracy", value)
    record = store.measurement(row["id"])["record"]
    after = quotas.usage(store, lambda digest: 0, "your-name")["stored_bytes"]
    self.assertEqual(after - before, len(record))  # before: 0, measurements were not counted
    shown = store.list_measurements(experiment_id=store.experiment("your-name/short")["id"])
    self.assertEqual([m["id"] for m in shown], [row["id"]])
    self.assertNotIn("record", shown[0])  # pages never load a record
    http, path = self.client.http, "/api/v1/experiments/your-name/short/measurements"
    padded = cbor2.dumps({**cbor2.loads(record), "padding": b"x" * 1000}, canonical=True)
    with self.assertRaisesRegex(dvbench.errors.ApiError, r"400.*unknown fields \['padding'\]"):
      http.request("POST", path, content=padded)
    oversized = b"x" * (routes_measurements.MAX_MEASUREMENT_BYTES + 1)
    with self.assertRaisesRegex(dvbench.errors.ApiError,
                                f"413.*over the {routes_measurements.MAX_MEASUREMENT_BYTES}"):
      http.request("POST", path, content=oversized)

  def test_checkpoint_trained_further_is_refused(self):
    params = serialization.msgpack_restore(self.checkpoint.read_bytes())
    further = jax.tree.map(lambda p: p - 1e-3, params)  # one more plain update
    with self.assertRaisesRegex(dvbench.errors.MeasurementError,
                                r"not the final state of a verified proof.*compared with: "
                                + self.proof_id[:16]):
      self.client.experiment("your-name/long").measure(further)

  def test_altered_outputs_end_invalid(self):
    for consistent in (False, True):
      measurement, value = self.submit("your-name/long", self.checkpoint)
      result = measurement._result  # pylint: disable=protected-access
      result["outputs"][2] = [np.asarray(result["outputs"][2][0] + 0.125, np.float32)]
      if consistent:  # recommit the altered output too: only replay can tell
        from zkdv import digest  # pylint: disable=g-import-not-at-top
        result["commitments"][2][1] = digest.digest_state_arrays(
            result["out_layouts"], result["outputs"][2])[0]
      row = self.wait_measurement(measurement.submit("accuracy", value, sample=1.0)["id"])
      self.assertEqual(row["state"], "invalid")
      self.assertIn("batch 2", row["failure"])

  def test_aggregate_that_cannot_be_exported_is_self_reported(self):
    measurement, value = self.submit(
        "your-name/long", self.checkpoint,
        aggregate=lambda outputs: float(np.median([float(o) for o in outputs])))
    row = self.wait_measurement(measurement.submit("median-accuracy", value)["id"])
    self.assertEqual(row["state"], "self-reported", row)

  def test_submission_for_unverified_proof_is_refused_by_the_server(self):
    measurement, value = self.submit("your-name/long", self.checkpoint)
    # A proof of the same experiment still receiving its steps: never verified.
    unverified = FakeProver(self.server.url, self.token, "your-name/long").start()
    self.addCleanup(unverified.http.close)
    unverified.run(steps=1)
    measurement.proof_id = unverified.proof_id
    with self.assertRaisesRegex(dvbench.errors.ApiError, "409.*not the final state"):
      measurement.submit("accuracy", value)
    measurement.proof_id = self.short_proof  # another experiment's verified proof
    with self.assertRaisesRegex(dvbench.errors.ApiError, "404.*not a proof of your-name/long"):
      measurement.submit("accuracy", value)


def tutorial_steps_batch():
  return np.asarray([[0, 0, 0, 1, 0], [0, 1, 0, 1, 0], [1, 0, 1, 0, 1], [1, 1, 1, 0, 1]],
                    np.uint32)


if __name__ == "__main__":
  absltest.main()
