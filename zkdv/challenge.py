"""Which steps are checked: decisions derived from a per-step challenge.

Every step ``t`` has a 32-byte *step challenge* ``c_t``; the update check, the
state check and the probed batch rows of step ``t`` are public functions of
``c_t`` and the effective policy (``docs/protocol.md``). Who knows ``c_t`` when
decides what a transcript proves:

* ``self``: ``c_t`` is a keyed BLAKE3 of a seed the prover drew (committed in
  ``root``, revealed in ``final``). The prover knows every decision in advance:
  this detects faults, not a dishonest prover.
* ``dvbench``: ``c_t`` is a keyed BLAKE3 of the server's secret per-proof key
  ``K`` and the id of step ``t``'s record, derived after the server stored it.

A step is probed with probability ``min(1, PROBE_GROUPS * probe_ratio)``, and a
probed step opens ``ceil(rows * max(probe_ratio, 1 / PROBE_GROUPS))`` Merkle rows of each
batch leaf (``probe_count``): every row is opened with probability at least
``probe_ratio``, and a record of opened rows costs a step only where it is probed. States
are committed once per
*segment* (up to ``Policy.segment_length`` steps); a segment's update and state
checks are those its deciding step's challenge chose (``deciding_step``: a
server's segment by its last step, a self-chosen one by its first), answered
at its last step (``required_checks``). The prover, the server and the verifier
all apply these two functions.

Example::

  seed = new_key()
  c = step_challenge_self(seed, 7)
  decide(c, Policy(update_check_probability=0.5)).update
  probe_rows(c, leaf=0, rows=128, ratio=0.01)
"""

import dataclasses
import math
import os

import blake3

KEY_BYTES = 32
CHECK_KINDS = ("update", "state")
ANSWER_KINDS = ("update", "state", "probe")
# How a message names the check of each answer kind ("step 3 was challenged for probes").
CHECK_NAMES = {"update": "an update check", "state": "a state check", "probe": "probes"}
CHALLENGER_KINDS = ("self", "dvbench")
# A probed step opens at least a PROBE_GROUPS-th of each batch leaf's rows, so below a
# ratio of 1 / PROBE_GROUPS only that share of steps is probed (docs/protocol.md).
PROBE_GROUPS = 32
_SELF_CONTEXT = b"zkdv-self-step\x00"
_SERVER_CONTEXT = b"zkdv-server-step\x00"


def new_key() -> bytes:
  """A fresh secret: a self-challenger seed or a server's per-proof key."""
  return os.urandom(KEY_BYTES)


def key_commitment(key: bytes) -> bytes:
  return blake3.blake3(key).digest()


def step_challenge_self(seed: bytes, step: int) -> bytes:
  """``c_t`` of a self-challenged transcript (known before the step runs)."""
  return blake3.blake3(_SELF_CONTEXT + int(step).to_bytes(8, "little"), key=seed).digest()


def step_challenge_server(key: bytes, step_record_id: bytes) -> bytes:
  """``c_t`` of a server-challenged transcript: the server's key and the stored record."""
  return blake3.blake3(_SERVER_CONTEXT + bytes(step_record_id), key=key).digest()


def _draw(challenge: bytes, label: bytes) -> int:
  return int.from_bytes(blake3.blake3(label, key=challenge).digest()[:8], "little")


def _chosen(challenge: bytes, label: bytes, probability: float) -> bool:
  # p * 2**64 is exact in binary floating point, so this has no rounding slack.
  return _draw(challenge, label) < int(probability * 2.0**64)


def _chosen_at_least(challenge: bytes, label: bytes, probability: float) -> bool:
  # Rounded up: a probability above 0 is never drawn as 0, however small.
  return _draw(challenge, label) < math.ceil(probability * 2.0**64)


@dataclasses.dataclass(frozen=True)
class Policy:
  """The checks a challenger requires: probabilities, probe ratio, window, the
  longest segment, full replay.

  A prover may ask for more than a server's minimum, never for less; the
  effective policy is recorded in the root (``to_record``). ``segment_length``
  bounds the steps between two state commitments: a challenged segment is
  replayed whole, so one faked step escapes with ``1 - update_check_probability``
  whatever it is. ``full_replay`` challenges every segment (and needs an
  attested start to show the whole run).
  """

  update_check_probability: float = 0.01
  state_check_probability: float = 0.0
  probe_ratio: float = 0.0
  rolling_window: int = 4
  segment_length: int = 1
  full_replay: bool = False

  def __post_init__(self):
    for name in ("update_check_probability", "state_check_probability", "probe_ratio"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}.")
      object.__setattr__(self, name, float(value))
    for name in ("rolling_window", "segment_length"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
        raise ValueError(f"{name} must be an int in [1, 2**20], got {value!r}.")
    if not isinstance(self.full_replay, bool):
      raise ValueError(f"full_replay must be a bool, got {self.full_replay!r}.")
    if self.full_replay and self.update_check_probability != 1.0:
      raise ValueError("full_replay replays every segment: update_check_probability must "
                       f"be 1, got {self.update_check_probability!r}.")

  def to_record(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_record(cls, record) -> "Policy":
    """Parses prover-written policy fields; ValueError names what is wrong."""
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(record, dict) or set(record) != set(names):
      raise ValueError(f"a policy has exactly the fields {names}.")
    return cls(**record)

  def at_least(self, minimum: "Policy") -> "Policy":
    """This policy raised to ``minimum`` (probabilities, ratio, full replay) and capped at
    its window and segment length."""
    full = self.full_replay or minimum.full_replay
    return Policy(1.0 if full else max(self.update_check_probability,
                                       minimum.update_check_probability),
                  max(self.state_check_probability, minimum.state_check_probability),
                  max(self.probe_ratio, minimum.probe_ratio),
                  min(self.rolling_window, minimum.rolling_window),
                  min(self.segment_length, minimum.segment_length), full)

  def weaker_than(self, minimum: "Policy") -> list[str]:
    """The fields in which this policy asks for less than ``minimum``."""
    weaker = [name for name in ("update_check_probability", "state_check_probability",
                                "probe_ratio") if getattr(self, name) < getattr(minimum, name)]
    weaker += [name for name in ("rolling_window", "segment_length")
               if getattr(self, name) > getattr(minimum, name)]
    if minimum.full_replay and not self.full_replay:
      weaker.append("full_replay")
    return weaker


@dataclasses.dataclass(frozen=True)
class Decision:
  """What step ``step`` must answer: an update check, a state check, probes."""

  step: int
  challenge: bytes
  update: bool
  state: bool
  probe_ratio: float
  # (leaf, rows) -> its probed rows, drawn once: a step's commitment and its answer both ask
  _drawn: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                   compare=False)

  @property
  def probed(self) -> bool:
    """Whether this step's probes open rows (``step_probed``): a step that is not owes no
    probe record."""
    probed = self._drawn.get("probed")
    if probed is None:
      probed = self._drawn["probed"] = step_probed(self.challenge, self.probe_ratio)
    return probed

  def probe_rows(self, leaf: int, rows: int) -> list[int]:
    if not self.probed:
      return []
    drawn = self._drawn.get((leaf, rows))
    if drawn is None:
      drawn = self._drawn[leaf, rows] = tuple(probe_rows(
          self.challenge, leaf, rows, probed_share(self.probe_ratio)))
    return list(drawn)

  def leaf_probe_rows(self, leaf: int, layout) -> list[int]:
    """The rows of batch leaf ``leaf`` (its ``zkdv.digest.LeafLayout``) opened as probes.

    PRNG keys are never probed (each must be the proof's key of its step); a scalar is
    one row, opened by every probed step.
    """
    if layout.key_impl is not None:
      return []
    return self.probe_rows(leaf, layout.rows)

  def leaf_probe_count(self, layout) -> int:
    """How many rows ``leaf_probe_rows`` opens of a batch leaf, without drawing them: the
    verifier compares counts first, so hostile row counts cost nothing."""
    return probe_count(layout, self.probe_ratio) if self.probed else 0

  @property
  def any_check(self) -> bool:
    return self.update or self.state


def decide(step: int, challenge: bytes, policy: Policy) -> Decision:
  return Decision(step, challenge,
                  _chosen(challenge, b"update", policy.update_check_probability),
                  _chosen(challenge, b"state", policy.state_check_probability),
                  policy.probe_ratio)


def tested_step(decision: "Decision | None", first: int, last: int) -> int:
  """The step of segment ``first .. last`` that the verifier runs again on a perturbed batch
  (the program claim: does the update read its batch), drawn from the segment's deciding
  challenge: a program cannot read its batch only on the steps it expects tested (the
  prover sets the segments' bounds, not the challenge). ``first`` when the decisions are
  unknown.

  Example: ``tested_step(decide(7, c, policy), 4, 7)`` is one of 4, 5, 6, 7.
  """
  if decision is None:
    return first
  return first + _draw(decision.challenge, b"tested step") % (last - first + 1)


def deciding_step(challenger_kind: str, first: int, last: int | None) -> int | None:
  """The step whose challenge decides the update and state checks of the segment
  ``first .. last`` (``last`` None while the segment is open); None while unknown.

  A server decides a segment by its last step's challenge, derived once it stored that
  step's record, so after every batch and both states of the segment are committed. A
  self-chosen segment is decided by its first step's (the prover knows every challenge
  in advance anyway), so a segment no update check hits keeps nothing for a replay.

  Example: ``deciding_step("dvbench", 4, 7) == 7``; ``deciding_step("self", 4, None) == 4``.
  """
  if challenger_kind == "self":
    return first
  if challenger_kind == "dvbench":
    return last
  raise ValueError(f"unknown challenger kind {challenger_kind!r}; expected one of "
                   f"{list(CHALLENGER_KINDS)}.")


def required_checks(step_decision: Decision,
                    segment_decision: Decision | None) -> dict[str, bool]:
  """kind -> whether a step must answer it: its own probes and, when it ends a segment,
  the segment's update and state checks as ``segment_decision`` (the decision of the
  segment's ``deciding_step``; None when the step ends no segment) chose them.

  Example: ``required_checks(d, None) == {"update": False, "state": False,
  "probe": d.probed}``.
  """
  return {"update": segment_decision is not None and segment_decision.update,
          "state": segment_decision is not None and segment_decision.state,
          "probe": step_decision.probed}


def discarded_checks(challenger_kind: str, step_decision: Decision) -> dict[str, bool]:
  """kind -> whether a step that a ``resume`` discarded must still answer it: only its
  probes, and only when a server drew them live as it stored the step (the prover saw the
  rows to be opened, so discarding the step instead would retry the probe). A discarded
  step ends no segment, so it has no update or state check; a self-chosen challenge is the
  prover's own from the start, so discarding its step hides nothing.

  Example: ``discarded_checks("self", d)["probe"] is False``.
  """
  return {"update": False, "state": False,
          "probe": challenger_kind == "dvbench" and step_decision.probed}


def step_probed(challenge: bytes, ratio: float) -> bool:
  """Whether a step of challenge ``challenge`` is probed at probe ratio ``ratio``: with
  probability ``min(1, PROBE_GROUPS * ratio)``, so that with the rows a probed step opens
  (``probed_share``) every row is opened with probability at least ``ratio``.

  Example: ``step_probed(c, 0.05)`` is True; ``step_probed(c, 0.01)`` holds for 32 % of
  challenges.
  """
  return ratio > 0 and (ratio * PROBE_GROUPS >= 1
                        or _chosen_at_least(challenge, b"probed step", ratio * PROBE_GROUPS))


def probed_share(ratio: float) -> float:
  """The share of each batch leaf's rows a probed step opens at probe ratio ``ratio``."""
  return max(ratio, 1 / PROBE_GROUPS) if ratio > 0 else 0.0


def probe_count(layout, ratio: float) -> int:
  """How many Merkle rows a probed step opens of a batch leaf (its
  ``zkdv.digest.LeafLayout``) at probe ratio ``ratio``: ``ceil(rows * probed_share)``,
  none of a PRNG key. The most a step's probes open (``Decision.leaf_probe_count`` is a
  step's own count).

  Example: ``probe_count(layout, 0.01)`` is 1 for a leaf of 32 Merkle rows, 2 for 64.
  """
  if layout.key_impl is not None:
    return 0
  return _count(layout.rows, probed_share(ratio))


def _count(rows: int, share: float) -> int:
  return 0 if share <= 0 or rows <= 0 else min(rows, math.ceil(share * rows))


def probe_rows(challenge: bytes, leaf: int, rows: int, share: float) -> list[int]:
  """``ceil(share * rows)`` distinct rows of ``rows``, drawn from ``challenge`` for leaf
  ``leaf``: a probed step's rows at ``probed_share``, a measurement's batches at its
  sample."""
  count = _count(rows, share)
  if count == 0:
    return []
  if count == rows:
    return list(range(rows))
  chosen, draw = set(), 0
  prefix = b"probe\x00" + int(leaf).to_bytes(4, "little")
  while len(chosen) < count:
    chosen.add(_draw(challenge, prefix + draw.to_bytes(8, "little")) % rows)
    draw += 1
  return sorted(chosen)


def escape_probability(probability: float, faked_steps: int = 1,
                       segment_length: int = 1) -> float:
  """The largest chance that ``faked_steps`` faked steps all escape update checks at
  ``probability`` when segments hold up to ``segment_length`` steps.

  A challenged segment is replayed whole, so a faked step escapes only when its
  segment is not challenged: one faked step escapes with ``1 - p`` whatever the
  segment length; ``m`` faked steps touch at least ``ceil(m / k)`` segments.
  """
  return (1.0 - probability) ** math.ceil(faked_steps / segment_length)


def escape_over_attempts(probability: float, attempts: int, faked_steps: int = 1,
                         segment_length: int = 1) -> float:
  """The chance that a prover who fakes the same way in each of ``attempts`` proofs, and
  drops every proof whose fake was challenged, gets at least one past the challenger.

  Each attempt escapes independently with ``e = escape_probability(...)``, so all of
  them are caught with ``(1 - e) ** attempts`` and at least one escapes with
  ``1 - (1 - e) ** attempts``; for one faked segment, ``1 - p ** attempts``.
  Example: ``escape_over_attempts(0.1, 2)`` is 0.99 (it escapes unless both are caught).
  """
  caught = 1.0 - escape_probability(probability, faked_steps, segment_length)
  return 1.0 - caught ** attempts
