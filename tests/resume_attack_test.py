"""A dishonest prover's ``resume`` records against a real `dvbench serve` process, on
SQLite and PostgreSQL.

A pure-Python prover (``tests.fake_prover``) reopens its proof with
``POST /api/v1/proofs/{id}/resume`` and streams ``resume`` records by hand: the server takes
one only from the last committed post-state and once every challenge of the steps up to it
is answered (the probes of the steps it discards stay owed until the close), and takes an
honest second resume after a second crash.
"""

from absl.testing import absltest

from dvbench.server.local import LocalServer
from zkdv import challenge
from tests import postgres
from tests.fake_prover import FakeProver
from zkdv.transcript import record_id

SEGMENT = 3


class ResumeAttackTest(absltest.TestCase):
  """One server per class; ``database_url`` None is SQLite."""

  database_url: str | None = None

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = LocalServer(workers=0, database_url=cls.database_url).start()
    cls.addClassCleanup(cls.server.stop)
    cls.token = cls.server.token("alice")

  def prover(self) -> FakeProver:
    """A started proof of segments of ``SEGMENT`` steps whose every step is probed."""
    prover = FakeProver(self.server.url, self.token, "alice/resumed", SEGMENT)
    root = prover.root(prover.slot())
    root["challenger"]["policy"]["probe_ratio"] = 0.5
    response = prover.post_root(root)
    self.assertEqual(response.status_code, 201, response.text)
    self.assertEqual(response.json()["max_body_bytes"], 64 << 20)  # --max-body-mb 64
    return prover

  def resume(self, prover: FakeProver, after: int, state: bytes):
    """Reopens the proof and sends a resume record going on from step ``after``'s
    ``state``; the prover's next step then starts a segment from that state."""
    reopened = prover.http.post(f"/api/v1/proofs/{prover.proof_id}/resume")
    self.assertEqual(reopened.status_code, 200)
    self.assertEqual(reopened.json()["max_body_bytes"], 64 << 20)  # what the uploader fits
    response = prover.send(prover.chain({"type": "resume", "step": prover.steps,
                                         "after": after, "state": state}))
    if response.status_code == 200:
      prover.segment_first, prover.state = None, state
    return response

  def resumed_owing(self, prover: FakeProver, after: int) -> list:
    """Stores one more step (the server draws its probes), leaves them unanswered and
    resumes from step ``after`` (the state the prover holds); the drawn decisions."""
    committed = prover.state
    drawn = prover.decisions(prover.step())
    self.assertEqual(self.resume(prover, after, committed).status_code, 200)
    return drawn

  def test_attack_probes_a_resume_discards_stay_owed_until_the_close(self):
    # Step 3 is stored, the server draws its probed rows; the prover does not like them,
    # leaves them unanswered and resumes from step 2, to send step 3's batch again as step 4
    # (other rows drawn for step 4). Step 3's rows are still owed: the close refuses to
    # verify without them, and the prover can answer them only with step 3's batch.
    prover = self.prover()
    prover.run(SEGMENT)
    drawn = self.resumed_owing(prover, 2)
    self.assertEqual([(d.step, d.probe_ratio) for d in drawn], [(3, 0.5)])
    prover.run(SEGMENT)
    closed = prover.finish().json()
    self.assertEqual(closed["state"], "invalid", closed)
    self.assertEqual(closed["failure"], "step 3 was challenged for probes and never answered.")

  def test_probes_a_resume_discards_are_answered_after_it(self):
    # An honest run killed before step 3's answer left: its resumed run trains step 3's
    # batch again and answers step 3's probes from it.
    prover = self.prover()
    prover.run(SEGMENT)
    prover.answer(self.resumed_owing(prover, 2)[0])
    prover.run(SEGMENT)
    self.assertEqual(prover.finish().json()["state"], "closed")

  def test_probes_owed_since_an_earlier_resume_do_not_hold_up_the_next(self):
    # Crashed after step 3 (its probes owed), resumed, crashed again after step 7: the
    # second resume goes on from step 6 with step 3 still owed; both are answered later.
    prover = self.prover()
    prover.run(SEGMENT)
    owed = self.resumed_owing(prover, 2)
    prover.run(SEGMENT)
    owed += self.resumed_owing(prover, 6)
    self.assertEqual([d.step for d in owed], [3, 7])
    for decision in owed:
      prover.answer(decision)
    prover.run(SEGMENT)
    self.assertEqual(prover.finish().json()["state"], "closed")

  def test_attack_a_resume_in_the_envelope_of_the_step_it_discards_owes_its_probes(self):
    # Step 3 and the resume that discards it travel together: step 3's probes are drawn
    # while the envelope is stored, before anything of it is written; they stay owed.
    prover = self.prover()
    prover.run(SEGMENT)
    committed = prover.state
    self.assertEqual(prover.http.post(f"/api/v1/proofs/{prover.proof_id}/resume")
                     .status_code, 200)
    step = prover.step_record()
    resume = prover.chain({"type": "resume", "step": SEGMENT + 1, "after": SEGMENT - 1,
                           "state": committed}, prev=record_id(step))
    response = prover.send(step, resume)
    self.assertEqual(response.status_code, 200, response.text)
    prover.steps, prover.segment_first, prover.state = SEGMENT + 1, None, committed
    prover.run(SEGMENT)
    closed = prover.finish().json()
    self.assertEqual((closed["state"], closed["failure"]),
                     ("invalid", "step 3 was challenged for probes and never answered."))

  def test_attack_a_resume_before_a_committed_check_is_answered_is_refused(self):
    prover = self.prover()
    drawn = []
    for _ in range(SEGMENT):
      drawn += prover.decisions(prover.step())  # challenged, never answered
    self.assertEqual((drawn[0].step, drawn[0].probed), (0, True))
    last = drawn[-1]  # the server decides the segment by its last step's challenge
    self.assertEqual(last.step, SEGMENT - 1)
    unanswered = sum(sum(challenge.required_checks(d, last if d is last else None).values())
                     for d in drawn)
    response = self.resume(prover, 2, prover.state)
    self.assertEqual(response.status_code, 409, response.text)
    self.assertIn("record 0 resumes the run, but step 0 was challenged for probes and never "
                  f"answered ({unanswered - 1} more challenges unanswered).", response.text)

  def test_a_run_that_crashes_again_before_it_commits_resumes_again(self):
    # Crashed mid-segment (step 3), resumed from step 2, crashed again after step 4: the
    # last committed state is still step 2's.
    prover = self.prover()
    prover.run(SEGMENT)
    committed = prover.state
    for _ in range(2):
      for decision in prover.decisions(prover.step()):
        prover.answer(decision)
      response = self.resume(prover, 2, committed)
      self.assertEqual(response.status_code, 200, response.text)
    self.assertEqual(sorted(prover.run(SEGMENT).segments.items()), [(5, 5), (7, 6)])
    self.assertEqual(prover.finish().json()["state"], "closed")

  def test_attack_a_resume_that_skips_step_indices_is_refused(self):
    prover = self.prover()
    prover.run(SEGMENT)
    prover.steps += 2  # would leave steps 3 and 4 unsent
    response = self.resume(prover, 2, prover.state)
    self.assertEqual(response.status_code, 409, response.text)
    self.assertIn("record 0 resumes the run at step 5, but 3 steps are stored: step indices "
                  "go on.", response.text)

  def test_attack_a_resume_with_nothing_committed_is_refused(self):
    prover = self.prover()
    response = self.resume(prover, 0, bytes(32))
    self.assertEqual(response.status_code, 409, response.text)
    self.assertIn("record 0 resumes the run, but no stored step committed a post-state yet: "
                  "there is nothing to resume from.", response.text)


class PostgresResumeAttackTest(postgres.OnPostgres, ResumeAttackTest):
  """The same attacks with the server's store on PostgreSQL."""


if __name__ == "__main__":
  absltest.main()
