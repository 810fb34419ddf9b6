"""``experiment.proof(backend="jax")``: the ZKDV driver, uploading to DVBench."""

import dataclasses
import pathlib
import shutil
import tempfile

import zkdv
from zkdv import errors as zkdv_errors

from dvbench.upload import Uploader


class DVBenchProof(zkdv.jax.ZKDV):
  """``zkdv.jax.ZKDV`` with live upload to DVBench and cleanup.

  Records are sent as they are written; ``finish()`` uploads the rest, waits
  for the server's acknowledgement and removes the temporary proof storage.

  Attributes:
    proof_id: the server's id of this proof (the transcript id, hex).
  """

  upload_timeout = 300.0

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
    if self._temporary is not None:
      shutil.rmtree(self._temporary, ignore_errors=True)

  def start(self, rolling_window: int = 4, probe_ratio: float = 0.0):
    super().start(rolling_window=rolling_window, probe_ratio=probe_ratio)
    if not self.writes_transcript:  # multi-process: process 0 writes and uploads
      self._upload_done = True
      if self._temporary is not None:
        shutil.rmtree(self._temporary, ignore_errors=True)
      return self
    self._uploader = Uploader(self.experiment.client.http, self.experiment.name, self.path)
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
