"""``experiment.proof(backend="jax")``: the ZKDV driver, challenged by DVBench.

Example::

  proof = experiment.proof(backend="jax")
  proof.start(rolling_window=4, probe_ratio=0.01)
  ...
  proof.finish()          # uploads the rest and waits for the server's ack
"""

import dataclasses
import logging
import pathlib
import shutil
import tempfile

import zkdv
from zkdv import challenge
from zkdv import challengers
from zkdv import errors as zkdv_errors

from dvbench import errors
from dvbench.upload import Uploader

logger = logging.getLogger("dvbench")


class DVBenchProof(zkdv.jax.ZKDV):
  """``zkdv.jax.ZKDV`` whose checks DVBench chooses, with live upload and cleanup.

  ``start()`` takes a one-time proof slot from the server: its nonce, its
  minimum policy and a commitment to the proof's secret challenge key go into
  the root. Records are sent as they are written; each acknowledgement of a
  step record carries the step's challenge, and the driver answers it with
  check records. ``finish()`` uploads the rest, waits for the server's
  acknowledgement and removes the temporary proof storage.

  Attributes:
    proof_id: the server's id of this proof (the transcript id, hex).
    challenge_timeout: seconds training waits at the rolling window for the
      server's challenges before ``zkdv.errors.ChallengeTimeoutError``.
  """

  upload_timeout = 300.0
  challenge_timeout = 600.0

  def __init__(self, experiment, config=None):
    config = config or zkdv.ZKDVConfig()
    self._temporary = None
    if config.output_dir is None:
      self._temporary = pathlib.Path(tempfile.mkdtemp(prefix="dvbench-proof-"))
      config = dataclasses.replace(config, output_dir=self._temporary / "transcript")
    super().__init__(experiment.name, config)
    self.experiment = experiment
    experiment.client.proofs.append(self)
    self._uploader: Uploader | None = None
    self._upload_done = False

  @property
  def proof_id(self) -> str | None:
    return None if self._uploader is None else self._uploader.proof_id

  def abandon(self) -> None:
    """Stops uploading an unfinished proof (what was sent stays on the server)."""
    if self._uploader is not None and not self._upload_done:
      self._uploader.stop()
      self._upload_done = True
    if isinstance(self._challenger, challengers.ServerChallenger):
      self._challenger.fail("the proof was abandoned")
    if self._temporary is not None:
      shutil.rmtree(self._temporary, ignore_errors=True)

  def _make_challenger(self, policy, seed, group):
    del seed
    if group.multi:
      raise zkdv_errors.ProofStateError(
          "live DVBench challenges need a single-process run. Train a multi-process run "
          "with zkdv.jax.ZKDV and upload its transcript with experiment.upload(path): "
          "it is then labelled self-audited.")
    slot = self.experiment.proof_slot()
    try:
      effective = policy.at_least(challenge.Policy.from_record(slot["policy"]))
      fields = {"kind": "dvbench", "server_key": bytes.fromhex(slot["server_key"]),
                "nonce": bytes.fromhex(slot["nonce"]),
                "key_commitment": bytes.fromhex(slot["key_commitment"]),
                "owner": self.experiment.name.split("/")[0],
                "experiment": self.experiment.name, "policy": effective.to_record()}
    except (KeyError, TypeError, ValueError) as e:
      raise errors.ApiError(502, f"the server's proof slot is malformed ({e}); is "
                            f"{self.experiment.client.url} a DVBench server of this "
                            "version?") from None
    if effective != policy:
      logger.info("DVBench %s raised the proof's policy to its minimum: %s",
                  self.experiment.client.url, effective)
    return challengers.ServerChallenger(fields, effective, timeout_s=self.challenge_timeout,
                                        describe=self._resume_hint)

  def _resume_hint(self) -> str:
    return (f"The transcript so far is intact in {self.path}. Call the step again to resume "
            "once the server answers (the unanswered steps are kept), or proof.finish() to "
            "end the run; a proof with unanswered challenges is invalid on DVBench.")

  def start(self, rolling_window: int = 16, probe_ratio: float = 0.0):
    super().start(rolling_window=rolling_window, probe_ratio=probe_ratio)
    challenger = self._challenger
    self._uploader = Uploader(self.experiment.client.http, self.experiment.name, self.path,
                              on_challenge=challenger.deliver, on_failure=challenger.fail,
                              retry_seconds=self.challenge_timeout)
    challenger.on_waiting = self._uploader.wake
    self._writer.on_append = self._uploader.wake
    self._uploader.start()
    return self

  def finish(self):
    error = None
    try:
      super().finish()
    except zkdv_errors.ZKDVError as e:
      error = e
    if not self._upload_done:
      self._uploader.finish(timeout=self.upload_timeout)
      self._upload_done = True
      if self._temporary is not None:
        shutil.rmtree(self._temporary, ignore_errors=True)
    if error is not None:
      raise error
    return self.path
