"""What a run says and leaves behind, against a real `dvbench serve` on loopback: its page and
summary, no orphan proofs, `crashed` runs, and a server lost and found again."""

import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from unittest import mock

import httpx
import jax.numpy as jnp
from absl.testing import absltest

import dvbench
import zkdv
from dvbench.server.local import LocalServer
from tests import pages_test
from tests import testing
from tests import tutorial_steps

REPO = pathlib.Path(__file__).resolve().parent.parent


def _proof_ids(server, experiment: str) -> list[str]:
  owner, name = experiment.split("/")
  answer = httpx.get(f"{server.url}/api/v1/experiments/{owner}/{name}").json()
  return [p["id"] for p in answer["proofs"]]


class TutorialMessagesTest(absltest.TestCase):
  """The tutorial as written, in its own process: what it prints, what it leaves."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # Every segment checked (p = 1) and every step probed (a ratio of 1/32), so the verdict
    # is verified, never left to chance.
    cls.server = LocalServer(workers=1, extra_args=("--min-update-check-probability", "1.0",
                                                    "--min-probe-ratio", "0.03125"))
    cls.server.start()
    token = cls.server.token("your-name")
    code = (f"API_URL = {cls.server.url!r}\n" + tutorial_steps.STEPS_2_TO_6
            + "\nprint(proof.proof_id)\n")
    cls.tutorial = subprocess.run([sys.executable, "-c", code], cwd=tempfile.mkdtemp(),
                             env={**os.environ, "DVBENCH_TOKEN": token},
                             capture_output=True, text=True, check=False)
    cls.proof_id = (cls.tutorial.stdout.split() or [""])[-1]  # its last line

  @classmethod
  def tearDownClass(cls):
    cls.server.stop()
    super().tearDownClass()

  def setUp(self):
    super().setUp()
    self.assertEqual(self.tutorial.returncode, 0, self.tutorial.stderr)

  def test_the_run_says_its_page_when_it_starts_and_a_summary_when_it_finishes(self):
    url, proof_id, lines = self.server.url, self.proof_id, self.tutorial.stderr.splitlines()
    self.assertIn(f"dvbench: your-name/jax-train-state proof {proof_id} started; its page: "
                  f"{url}/proofs/{proof_id}", lines)
    summary = [line for line in lines if line.startswith(
        f"dvbench: your-name/jax-train-state proof {proof_id}: ")]
    self.assertLen(summary, 1, self.tutorial.stderr)
    self.assertRegex(summary[0], r": (closed|verifying|verified steps — start unattested), "
                     r"10 steps, \d+ checks "
                     rf"\(\d+ replayed\); {re.escape(url)}/proofs/{proof_id}$")
    # The INFO line that said nothing before: the tutorial asks for p = 0.01.
    self.assertTrue(any(f"DVBench {url} raised the proof's policy to its minimum" in line
                        for line in lines), self.tutorial.stderr)

  def test_the_tutorial_leaves_no_orphan_proof(self):
    # Step 2 starts a proof, then makes the configured one: the first, which never ran a
    # step, is discarded from the server rather than left receiving.
    self.assertEqual(_proof_ids(self.server, "your-name/jax-train-state"), [self.proof_id])
    discarded = re.findall(r"dvbench: discarded proof ([0-9a-f]{64}): experiment\.proof\(\) "
                           r"made a new proof of your-name/jax-train-state", self.tutorial.stderr)
    started = re.findall(r"proof ([0-9a-f]{64}) started", self.tutorial.stderr)
    self.assertLessEqual(len(discarded), 1)
    for proof_id in discarded:  # it had reached the server before it was replaced
      self.assertIn(proof_id, started)
      self.assertEqual(httpx.get(f"{self.server.url}/api/v1/proofs/{proof_id}").status_code,
                       404)

  def test_summary_waits_for_the_verdict_and_download_says_what_it_wrote(self):
    client = dvbench.Client(self.server.url)
    self.addCleanup(client.close)
    summary = client.summary(self.proof_id, wait=120)
    self.assertRegex(summary, rf"^your-name/jax-train-state proof {self.proof_id}: "
                     r"verified steps — start unattested, "
                     r"10 steps, (\d+) checks \(\1 replayed\); ")
    folder = pathlib.Path(tempfile.mkdtemp()) / "proof"
    download = subprocess.run(
        [sys.executable, "-m", "dvbench.cli", "download", self.proof_id, str(folder),
         "--url", self.server.url], cwd=REPO, capture_output=True, text=True, check=False)
    self.assertEqual(download.returncode, 0, download.stderr)
    blobs = len(list((folder / "blobs").iterdir()))
    records = (folder / "records.cborl").stat().st_size
    self.assertEqual(download.stdout.strip(), (
        f"dvbench download: wrote proof {self.proof_id} to {folder}: {records} bytes of "
        f"records, {blobs} blobs and the server's signed receipt; check it with: zkdv verify "
        f"{folder} --server-key $(dvbench server-key --url {self.server.url})"))


_CRASHING_RUN = textwrap.dedent("""
    import sys, time
    import jax.numpy as jnp
    import dvbench, zkdv
    from tests import testing
    client = dvbench.Client(sys.argv[1])
    empty = client.experiment("alice/started-only").proof()
    empty.start()
    testing.wait_until(lambda: empty.proof_id, timeout=60)
    proof = client.experiment("alice/stops-midway").proof(config=zkdv.ZKDVConfig(
        sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.5)))
    proof.start(rolling_window=8)
    state = testing.classifier_state(proof)
    step = proof.jit(testing.classifier_step)
    for _ in range(3):
      state = step(state, jnp.asarray(testing.TUTORIAL_BATCH))
    print(empty.proof_id, proof.proof_id, flush=True)
    time.sleep(600)  # killed here, before proof.finish()
""")


class CrashedProofTest(absltest.TestCase):
  """A server that takes a run silent for 4 s as crashed."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=0, extra_args=("--crash-after", "4s")).start()
    cls.token = cls.server.token("alice")
    cls.client = dvbench.Client(cls.server.url, token=cls.token)

  @classmethod
  def tearDownClass(cls):
    cls.client.close()
    cls.server.stop()
    super().tearDownClass()

  def test_a_killed_run_becomes_crashed_and_an_unused_proof_is_discarded(self):
    # A live run of this process that only waits (a long step): its heartbeats keep it.
    waiting = self.client.experiment("alice/long-step").proof(config=zkdv.ZKDVConfig(
        sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.5)))
    waiting.start(rolling_window=8)
    state = testing.classifier_state(waiting)
    step = waiting.jit(testing.classifier_step)
    state = step(state, jnp.asarray(testing.TUTORIAL_BATCH))
    testing.wait_until(lambda: self.client.proof_status(waiting.proof_id)["steps"] == 1)
    run = subprocess.Popen([sys.executable, "-c", _CRASHING_RUN, self.server.url], cwd=REPO,
                           env={**os.environ, "DVBENCH_TOKEN": self.token},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    self.addCleanup(run.wait)
    self.addCleanup(run.kill)
    empty_id, crashing_id = run.stdout.readline().split()
    testing.wait_until(lambda: self.client.proof_status(crashing_id)["steps"] == 3)
    os.kill(run.pid, signal.SIGKILL)  # the trainer dies before proof.finish()
    status = self.client.wait_for_verdict(crashing_id, timeout=60)
    self.assertEqual(status["state"], "crashed", repr(status))
    self.assertEqual(status["failure"], (
        "nothing arrived for 4 s after 3 steps: the run stopped before proof.finish(), so it "
        "is never verified as it is; resume it from the checkpoint of its last committed "
        f"state with experiment.proof(resume='{crashing_id}')."))
    self.assertTrue(status["label"].startswith("crashed: nothing arrived"), status)
    page = pages_test.chromium_dom(self, f"{self.server.url}/proofs/{crashing_id}")
    self.assertEqual([badge[2] for badge in page.find("span", class_="crashed")], ["crashed"])
    self.assertIn(f"resume it from the checkpoint of its last committed state with "
                  f"experiment.proof(resume='{crashing_id}')", page.find("span", id="label")[0][2])
    # The dead run's proof that never ran a step is gone, not left receiving.
    testing.wait_until(lambda: httpx.get(
        f"{self.server.url}/api/v1/proofs/{empty_id}").status_code == 404, timeout=30)
    self.assertEqual(_proof_ids(self.server, "alice/started-only"), [])
    # The live run was silent longer than 4 s (the crash above came after its last step)
    # but said it was alive: it is still receiving and finishes as usual.
    self.assertEqual(self.client.proof_status(waiting.proof_id)["state"], "receiving")
    state = step(state, jnp.asarray(testing.TUTORIAL_BATCH))
    waiting.finish()
    self.assertIn(self.client.proof_status(waiting.proof_id)["state"],
                  ("closed", "verifying"))

  def test_a_replaced_or_closed_proof_that_ran_no_step_is_discarded(self):
    client = dvbench.Client(self.server.url, token=self.token)
    experiment = client.experiment("alice/replaced")
    first = experiment.proof()
    first.start()
    first_id = testing.wait_until(lambda: first.proof_id)
    second = experiment.proof()  # the tutorial's step 2: the first is replaced
    self.assertEqual(httpx.get(f"{self.server.url}/api/v1/proofs/{first_id}").status_code, 404)
    second.start()
    second_id = testing.wait_until(lambda: second.proof_id)
    client.close()  # closed before it ran a step
    self.assertEqual(httpx.get(f"{self.server.url}/api/v1/proofs/{second_id}").status_code,
                     404)
    self.assertEqual(_proof_ids(self.server, "alice/replaced"), [])

  def test_only_a_proof_without_steps_can_be_discarded_and_only_by_its_owner(self):
    proof = self.client.experiment("alice/kept").proof()
    proof.start()
    state = testing.classifier_state(proof)
    state = proof.jit(testing.classifier_step)(state, jnp.asarray(testing.TUTORIAL_BATCH))
    testing.wait_until(lambda: self.client.proof_status(proof.proof_id)["steps"] == 1)
    path = f"{self.server.url}/api/v1/proofs/{proof.proof_id}"
    other = httpx.delete(path, headers={"Authorization": f"Bearer {self.server.token('bob')}"})
    self.assertEqual(other.status_code, 403, other.text)
    owner = httpx.delete(path, headers={"Authorization": f"Bearer {self.token}"})
    self.assertEqual(owner.status_code, 409, owner.text)
    self.assertIn("only a proof that never sent a step is discarded", owner.text)
    self.assertEqual(httpx.get(path).status_code, 200)
    proof.finish()


class LostServerTest(absltest.TestCase):

  def listen(self, pattern: str) -> testing.ClientSays:
    said = testing.ClientSays(pattern)
    logging.getLogger("dvbench.client").addHandler(said)
    self.addCleanup(logging.getLogger("dvbench.client").removeHandler, said)
    return said

  def test_a_lost_server_is_said_within_10_s_and_the_run_goes_on_when_it_returns(self):
    self.assertLessEqual(dvbench.client.SAY_AFTER_SECONDS, 10.0)  # what users are promised
    # The run below waits for the message twice: said after 1 s here instead.
    self.enter_context(mock.patch.object(dvbench.client, "SAY_AFTER_SECONDS", 1.0))
    server = LocalServer(workers=1, extra_args=("--min-update-check-probability", "1.0",
                                                "--min-probe-ratio", "0.03125"))
    server.start()
    self.addCleanup(server.stop)
    client = dvbench.Client(server.url, token=server.token("alice"))
    self.addCleanup(client.close)
    proof = client.experiment("alice/lost").proof(config=zkdv.ZKDVConfig(
        sampling_policy=zkdv.SamplingPolicy(update_check_probability=1.0)))
    # Start: the server is down while the proof takes its slot (what step 0 waits for).
    server.kill()
    at_start = self.listen(rf"cannot reach {re.escape(server.url)} \(POST /api/v1/experiments/"
                           r"alice/lost/slots: .*\); retrying for \d+ s more; the proof, and "
                           r"training with it, starts once it answers")
    started = threading.Thread(target=proof.start, kwargs={"rolling_window": 4})
    lost_at = time.monotonic()
    started.start()
    self.assertTrue(at_start.event.wait(20), "nothing was said")
    self.assertLess(time.monotonic() - lost_at, 10)  # the 10 s promised
    server.start()
    started.join(60)
    self.assertFalse(started.is_alive())
    # Mid-run: the server dies after step 1; the next step's upload says so.
    state = testing.classifier_state(proof)
    step = proof.jit(testing.classifier_step)
    for _ in range(2):
      state = step(state, jnp.asarray(testing.TUTORIAL_BATCH))
    testing.wait_until(lambda: client.proof_status(proof.proof_id)["steps"] == 2)
    server.kill()
    mid_run = self.listen(rf"cannot reach {re.escape(server.url)} \((HEAD|PUT|POST) "
                          rf"/api/v1/proofs/{proof.proof_id}/[\w/]+: .*\); retrying for \d+ s "
                          r"more; training continues [0-4] more steps, then waits for the server's "
                          r"challenges for up to 600 s")
    back = self.listen(rf"^{re.escape(server.url)} answers again")
    lost_at = time.monotonic()
    state = step(state, jnp.asarray(testing.TUTORIAL_BATCH))
    self.assertTrue(mid_run.event.wait(20), "nothing was said")
    self.assertLess(time.monotonic() - lost_at, 10)  # the 10 s promised
    server.start()
    proof.finish()
    self.assertTrue(back.event.is_set())
    self.assertRegex(proof.summary(wait=120), rf"^alice/lost proof {proof.proof_id}: "
                     r"verified steps — start unattested, 3 steps")


if __name__ == "__main__":
  absltest.main()
