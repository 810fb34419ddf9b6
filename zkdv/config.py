"""Configuration of a proof: sampling, tolerance, digests, output folder.

Example::

  config = zkdv.ZKDVConfig(
      sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.01))
"""

import dataclasses
import os

DIGEST_BACKENDS = ("auto", "host", "device")
# The largest segment an adaptive proof commits (and DVBench's default maximum).
MAX_SEGMENT_LENGTH = 64
# An adaptive proof keeps its commitments (states and batches) under this share of training
# time. Longer segments cost nothing in detection (one faked step escapes with 1 - p at any
# k) and spread a check's fixed cost (keeping, writing and hashing its start state) over
# more steps; they cost memory (a checked segment's batches) that the rolling window bounds.
COMMITMENT_BUDGET = 0.02
# A live proof keeps each step's batch until the server decides its segment: at most this
# many bytes of them by its own choice (the window it grows to, and twice an adaptive
# segment). A window of 64 steps is always allowed; a step of larger batches may wait.
KEPT_BATCH_BYTES = 1 << 30


def adaptive_segment_bound(window: int) -> int:
  """The longest adaptive segment when the rolling window may grow to ``window``: half
  of it (a server decides a segment after its last step is stored, so its steps must fit
  in the window with room to spare), at most ``MAX_SEGMENT_LENGTH``.

  Example: ``adaptive_segment_bound(64) == 32``; ``adaptive_segment_bound(4) == 2``.
  """
  return max(1, min(MAX_SEGMENT_LENGTH, window // 2))


def kept_window(batch_bytes: int) -> int:
  """The most steps whose batches a proof keeps by its own choice at ``batch_bytes`` a
  step: ``KEPT_BATCH_BYTES`` of them, and at least 64 steps.

  Example: ``kept_window(800 * 1024) == 1310``; ``kept_window(38 << 20) == 64``.
  """
  return max(64, KEPT_BATCH_BYTES // max(1, batch_bytes))
# The most bytes of constants an init or update program may embed (its StableHLO's dense
# constants, a splat counted as one element). Far below one parameter set, so a program
# cannot carry a model in its constants: a step that returns weights baked into it, or an
# init program that returns them. Optimizer hyperparameters, iota tables and small lookup
# tables fit; a larger table belongs in the state or the batch, where it is committed.
MAX_PROGRAM_CONSTANT_BYTES = 64 * 1024


def constants_could_carry(constant_bytes: int, params_bytes: int) -> bool:
  """Whether a program's constants could hold a copy of ``params_bytes`` of params: an
  8-bit copy of float32 params (a quarter of their bytes) or more. Where they could, a
  start or an update may return a model it carries; only a pinned program rules that out.

  Example: ``constants_could_carry(MAX_PROGRAM_CONSTANT_BYTES, 200_000)`` is True.
  """
  return 4 * constant_bytes >= params_bytes
# The most bytes a step's batch may carry in scalar leaves (shape ()), which have no rows to
# sample: every probe opens them whole, and this bounds what they can carry unseen between
# probes (a learning rate, a temperature and a few flags fit; rows of data do not). PRNG-key
# leaves are not counted: each must be the proof's key of its step (``proof.key``).
MAX_SCALAR_BATCH_BYTES = 64


def _check_probability(name: str, value: float) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(f"{name} must be a number in [0, 1], got {value!r}.")
  if not 0.0 <= value <= 1.0:
    raise ValueError(f"{name} must be in [0, 1], got {value!r}.")
  return float(value)


@dataclasses.dataclass(frozen=True)
class SamplingPolicy:
  """Probabilities that a segment gets an update check or a state check.

  An update check opens the segment's start state and every batch in it, and
  the segment is replayed from them; a state check opens the segment's end
  state. ``full_replay=True`` asks for every segment to be replayed (an update
  check probability of 1); attest the start with ``proof.init`` so the whole run
  is shown.
  """

  update_check_probability: float = 0.01
  state_check_probability: float = 0.0
  full_replay: bool = False

  def __post_init__(self):
    for name in ("update_check_probability", "state_check_probability"):
      object.__setattr__(self, name, _check_probability(name, getattr(self, name)))
    if not isinstance(self.full_replay, bool):
      raise TypeError(f"full_replay must be a bool, got {self.full_replay!r}.")
    if self.full_replay:
      object.__setattr__(self, "update_check_probability", 1.0)


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
    segment_length: steps per *segment*: the whole state is committed once per
      segment, every batch at every step. A challenged segment is replayed whole
      from its start state (docs/protocol.md). ``None`` (default) chooses it from
      the measured step time and hashing throughput so that commitments (the
      state every k steps, the batch every step) cost at most 2% of training, up
      to the rolling window (``proof.start``, 16 by default) and at most
      ``MAX_SEGMENT_LENGTH``, the bound the root records; an int fixes it. A
      server's maximum caps either.
  """

  sampling_policy: SamplingPolicy = SamplingPolicy()
  tolerance: Tolerance = Tolerance()
  digest_backend: str = "auto"
  output_dir: str | os.PathLike | None = None
  cross_check_replicas: bool = False
  segment_length: int | None = None

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
    k = self.segment_length
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 1 << 20):
      raise ValueError(f"segment_length must be None (adaptive) or an int in [1, 2**20], "
                       f"got {k!r}.")
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
        "segment_length": "adaptive" if self.segment_length is None else self.segment_length,
    }
