"""Configuration of a proof: sampling, tolerance, digests, output folder.

Example::

  config = zkdv.ZKDVConfig(
      sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.01))
"""

import dataclasses
import os

DIGEST_BACKENDS = ("auto", "host", "device")
RETENTIONS = ("window", "snapshot")


def _check_probability(name: str, value: float) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(f"{name} must be a number in [0, 1], got {value!r}.")
  if not 0.0 <= value <= 1.0:
    raise ValueError(f"{name} must be in [0, 1], got {value!r}.")
  return float(value)


@dataclasses.dataclass(frozen=True)
class SamplingPolicy:
  """Probabilities that a step gets an update check or a state check.

  An update check keeps the pre-update state and batch, replays the exported
  update program on them and opens them; a state check opens the post-state.
  """

  update_check_probability: float = 0.01
  state_check_probability: float = 0.0

  def __post_init__(self):
    for field in dataclasses.fields(self):
      object.__setattr__(self, field.name, _check_probability(
          field.name, getattr(self, field.name)))


@dataclasses.dataclass(frozen=True)
class Tolerance:
  """Bounds for *equivalent* checks: ``|a - b| <= atol + rtol * |b|``."""

  rtol: float = 1e-5
  atol: float = 1e-6

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"Tolerance.{field.name} must be a number >= 0, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class ZKDVConfig:
  """Everything a proof needs besides its name.

  Attributes:
    sampling_policy: which steps get update and state checks.
    tolerance: the bound for equivalent (non-bitwise) checks.
    digest_backend: ``"host"`` (native BLAKE3 on a worker thread), ``"device"``
      (BLAKE3 in jax.numpy on the leaf's device) or ``"auto"`` (host on CPU).
    output_dir: where the transcript folder goes; by default a new folder per
      proof under ``./zkdv-proofs``.
    cross_check_replicas: also hash every replica of a replicated or partly
      replicated leaf after each step and raise ``ReplicaDivergenceError`` when
      one differs from the committed copy (replicas are otherwise hashed once;
      across processes, process 0 raises it from ``finish()``).
    retention: what a step keeps while its challenge is pending (a server's
      challenges arrive after the step ran): ``"window"`` keeps zero-copy views
      of each unanswered step's inputs and outputs (up to ``rolling_window`` + 1
      generations of state alive, nothing recomputed); ``"snapshot"`` keeps one
      snapshot of the state per window plus each step's batch and recomputes a
      challenged step's pre- and post-state exactly on demand (about two
      generations; up to ``rolling_window`` extra steps run per challenge).
  """

  sampling_policy: SamplingPolicy = SamplingPolicy()
  tolerance: Tolerance = Tolerance()
  digest_backend: str = "auto"
  output_dir: str | os.PathLike | None = None
  cross_check_replicas: bool = False
  retention: str = "window"

  def __post_init__(self):
    if not isinstance(self.sampling_policy, SamplingPolicy):
      raise TypeError("sampling_policy must be a zkdv.SamplingPolicy, got "
                      f"{type(self.sampling_policy).__name__}.")
    if not isinstance(self.tolerance, Tolerance):
      raise TypeError("tolerance must be a zkdv.Tolerance, got "
                      f"{type(self.tolerance).__name__}.")
    if not isinstance(self.cross_check_replicas, bool):
      raise TypeError("cross_check_replicas must be a bool, got "
                      f"{self.cross_check_replicas!r}.")
    if self.retention not in RETENTIONS:
      raise ValueError(f"retention must be one of {RETENTIONS}, got {self.retention!r}.")
    if self.digest_backend not in DIGEST_BACKENDS:
      raise ValueError(f"digest_backend must be one of {DIGEST_BACKENDS}, got "
                       f"{self.digest_backend!r}.")

  def to_record(self) -> dict:
    """The config as it is written into the root record."""
    return {
        "rtol": self.tolerance.rtol,
        "atol": self.tolerance.atol,
        "digest_backend": self.digest_backend,
        "cross_check_replicas": self.cross_check_replicas,
        "retention": self.retention,
    }
