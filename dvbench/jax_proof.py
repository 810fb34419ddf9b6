"""``experiment.proof(backend="jax")``: the ZKDV driver, challenged by DVBench.

Example::

  proof = experiment.proof(backend="jax")
  proof.start(rolling_window=4, probe_ratio=0.01)
  ...
  proof.finish()          # uploads the rest and waits for the server's ack
"""

import dataclasses
import pathlib
import shutil
import tempfile


import zkdv
from zkdv import challenge
from zkdv import challengers
from zkdv import errors as zkdv_errors

from dvbench import errors
from dvbench import resume
from dvbench.console import logger
from dvbench.upload import Uploader


class DVBenchProof(zkdv.jax.ZKDV):
  """``zkdv.jax.ZKDV`` whose checks DVBench chooses, with live upload and cleanup.

  ``start()`` takes a one-time proof slot from the server: its nonce, its
  minimum policy and a commitment to the proof's secret challenge key go into
  the root. Records are sent as they are written; each acknowledgement of a
  step record carries the step's challenge, and the driver answers it with
  check records. ``finish()`` uploads the rest, waits for the server's
  acknowledgement and removes the temporary proof storage. In a multi-process run
  every process makes the proof and process 0 alone holds the stream; the others take the
  server's decisions from it (``zkdv.jax.shared_decisions``).

  Attributes:
    proof_id: the server's id of this proof (the transcript id, hex).
    challenge_timeout: seconds training waits at the rolling window for the
      server's challenges before ``zkdv.errors.ChallengeTimeoutError``.
  """

  upload_timeout = 300.0
  challenge_timeout = 600.0

  def __init__(self, experiment, config=None, resume_id: str | None = None, **run):
    config = config or zkdv.ZKDVConfig()
    self._temporary = None
    if config.output_dir is None:
      self._temporary = pathlib.Path(tempfile.mkdtemp(prefix="dvbench-proof-"))
      config = dataclasses.replace(config, output_dir=self._temporary / "transcript")
    try:
      super().__init__(experiment.name, config, **run)
    except (TypeError, ValueError):  # e.g. a tag records.run_fields refuses
      if self._temporary is not None:
        shutil.rmtree(self._temporary, ignore_errors=True)
      raise
    self.experiment = experiment
    experiment.client.proofs.append(self)
    self._uploader: Uploader | None = None
    self._upload_done = False
    self._resume_id = resume_id
    self._stored: resume.StoredProof | None = None  # what the server held of a resumed proof

  @property
  def proof_id(self) -> str | None:
    return None if self._uploader is None else self._uploader.proof_id

  @property
  def unused(self) -> bool:
    """Whether the proof never ran a step and is not finished (replacing it loses nothing)."""
    return not self._finished and not self._upload_done and self.steps == 0

  def abandon(self, reason: str = "the proof was abandoned") -> None:
    """Stops uploading an unfinished proof (what was sent stays on the server)."""
    if self._uploader is not None and not self._upload_done:
      self._uploader.stop()
      self._upload_done = True
    if isinstance(self._challenger, challengers.ServerChallenger):
      self._challenger.fail(reason)
    if self._temporary is not None:
      shutil.rmtree(self._temporary, ignore_errors=True)

  def discard(self, reason: str) -> None:
    """Stops a proof that never ran a step and deletes it from the server, so no empty
    proof is left ``receiving`` (``reason``: why, for the log and for a later use of it)."""
    self.abandon(f"proof {self.proof_id} was discarded: {reason}")
    if self.proof_id is None:
      return
    response = self.experiment.client.http.request(
        "DELETE", f"/api/v1/proofs/{self.proof_id}", ok=(204, 404, 409), retry_seconds=5.0)
    if response.status_code == 409:  # it sent a step after all: left to become crashed
      logger.warning("proof %s was not discarded: %s", self.proof_id, response.text[:300])
    else:
      logger.info("discarded proof %s: %s", self.proof_id, reason)

  def _make_challenger(self, policy, seed, group):
    """Process 0's challenger (it alone holds the stream; the others take its decisions
    in rounds, ``zkdv.jax.shared_decisions``)."""
    del seed
    slot = self.experiment.proof_slot()
    try:
      minimum = challenge.Policy.from_record(slot["policy"])
      # The window starts at the caller's and may grow to the server's while its answers
      # take longer than that many steps (Dispatcher._size_window): the root says so.
      # Across processes segments are the root's length: the configured one, or as below.
      multi = group.multi and policy.rolling_window > 1
      if multi and self.config.segment_length is not None:
        policy = dataclasses.replace(policy, segment_length=self.config.segment_length)
      elif self.config.segment_length is None and (policy.segment_length > 1 or multi):
        # An adaptive segment may be as long as the window the server allows lets it be
        # (the window grows to it), not only the caller's first window.
        policy = dataclasses.replace(policy, segment_length=max(
            policy.segment_length, zkdv.config.adaptive_segment_bound(minimum.rolling_window)))
      effective = dataclasses.replace(policy.at_least(minimum),
                                      rolling_window=minimum.rolling_window)
      fields = {"kind": "dvbench", "server_key": bytes.fromhex(slot["server_key"]),
                "nonce": bytes.fromhex(slot["nonce"]),
                "key_commitment": bytes.fromhex(slot["key_commitment"]),
                "owner": self.experiment.name.split("/")[0],
                "experiment": self.experiment.name, "policy": effective.to_record()}
    except (KeyError, TypeError, ValueError) as e:
      raise errors.ApiError(502, f"the server's proof slot is malformed ({e}); is "
                            f"{self.experiment.client.url} a DVBench server of this "
                            "version?") from None
    if effective != dataclasses.replace(policy, rolling_window=minimum.rolling_window):
      logger.info("DVBench %s raised the proof's policy to its minimum: %s",
                  self.experiment.client.url, effective)
    return challengers.ServerChallenger(fields, effective, timeout_s=self.challenge_timeout,
                                        describe=self._resume_hint)

  def _fetch_transcript(self, path):
    """Reopens the resumed proof on the server and writes its stored records into
    ``path`` (on process 0)."""
    self._stored = resume.reopen(self.experiment, self._resume_id, path)

  def _resumed_challenger(self, path, fields):
    """The server's challenger of the resumed proof, and the challenges it sent."""
    if fields.get("kind") != "dvbench":
      raise zkdv_errors.ProofStateError(
          f"proof {self._resume_id} is self-audited; resume its transcript folder with "
          "zkdv.jax.ZKDV(name, resume=folder) and upload it with experiment.upload(folder).")
    challenger = challengers.ServerChallenger(
        fields, challenge.Policy.from_record(fields["policy"]),
        timeout_s=self.challenge_timeout, describe=self._resume_hint)
    challenger.resume_at(self._stored.steps)
    return challenger, self._stored.challenge

  def _steps_ahead(self) -> str:
    """How far training goes on without the server, e.g. 'training continues 3 more steps'."""
    undecided = self.steps - self._challenger.decided_steps
    ahead = max(0, self._committer.pipeline.window - undecided)
    return (f"training continues {ahead} more steps, then waits for the server's "
            f"challenges for up to {self.challenge_timeout:.0f} s")

  def _resume_hint(self) -> str:
    return (f"The transcript so far is intact in {self.path}. Call the step again to resume "
            "once the server answers (the unanswered steps are kept), or proof.finish() to "
            "end the run; a proof with unanswered challenges is invalid on DVBench. If this "
            f"process ends, resume proof {self.proof_id} from your last checkpoint with "
            f"experiment.proof(resume={self.proof_id!r}).")

  def start(self, rolling_window: int = 16, probe_ratio: float = 0.0):
    """Takes a proof slot and starts the run; a resumed proof (``resume=PROOF_ID``)
    reopens its stored records instead and goes on from its last committed state."""
    if self._resume_id is not None and self._group is None:
      # Process 0 reopens the proof on the server (``_fetch_transcript``); the others follow.
      self.resume_from = pathlib.Path(self.config.output_dir)
    super().start(rolling_window=rolling_window, probe_ratio=probe_ratio)
    if not self.writes_transcript:  # process 0 uploads what every process committed
      return self
    challenger = self._challenger
    self._uploader = Uploader(self.experiment.client.http, self.experiment.name, self.path,
                              on_challenge=challenger.deliver, on_failure=challenger.fail,
                              retry_seconds=self.challenge_timeout,
                              while_retrying=self._steps_ahead)
    if self._stored is not None:
      stored = self._stored
      self._uploader.continue_proof(stored.proof_id, stored.size, stored.records,
                                    stored.heartbeat_seconds, stored.max_body_bytes)
      if stored.unsent_blobs:
        logger.info("%s proof %s: %d blobs its stored records name never reached the server; "
                    "sent from %s", self.experiment.name, stored.proof_id,
                    len(stored.unsent_blobs), self.path)
        self._uploader.send_blobs(stored.unsent_blobs)
      logger.info("%s proof %s resumes at step %d; its page: %s/proofs/%s",
                  self.experiment.name, stored.proof_id, self.steps,
                  self.experiment.client.url, stored.proof_id)
    challenger.on_waiting = self._uploader.hurry
    self._writer.on_append = self._uploader.written
    self._uploader.start()
    return self

  def wait_for_commitments(self) -> None:
    """Blocks until every step so far is committed, its challenges answered, and all of
    it stored by the server: a checkpoint saved then, at the end of a segment (every
    ``segment_length`` steps, fixed in the config), is a state a resumed run goes on from
    (``experiment.proof(resume=...)``)."""
    super().wait_for_commitments()
    if self._uploader is not None and not self._upload_done:
      self._uploader.flush(self.upload_timeout)

  def finish(self):
    error = None
    try:
      super().finish()
    except zkdv_errors.ZKDVError as e:
      error = e
    if not self._upload_done:
      if self._uploader is not None:  # None on the processes other than 0
        # A resumed run that never went on closes nothing: the proof stays resumable.
        self._uploader.finish(timeout=self.upload_timeout, require_final=not self.unresumed)
      self._upload_done = True
      if self._temporary is not None:
        shutil.rmtree(self._temporary, ignore_errors=True)
      if self._uploader is not None:
        logger.info("%s", self.summary())
    if error is not None:
      raise error
    return self.path

  def summary(self, wait: float = 0.0) -> str:
    """One line: the proof's state on the server, its steps and checks, and its page
    (``wait``: seconds to wait for the server's verdict first), e.g.
    ``your-name/run proof 3f..: verified, 10 steps, 4 checks (4 replayed); http://...``."""
    if self._group is not None and not self.writes_transcript:
      return (f"{self.experiment.name}: process {self._group.index} commits its shards; "
              "process 0 uploads the proof")
    if self.proof_id is None:
      return f"{self.experiment.name}: the proof has not started (no record was sent)"
    return self.experiment.client.summary(self.proof_id, wait)
