"""A pure-Python prover that writes records by hand and speaks the DVBench protocol.

It needs no JAX: states are 32-byte digests, a step's post-state is a hash of
its pre-state and batch, and a *faked* step's post-state is anything else. The
state is committed every ``segment_length`` steps. A dishonest prover cannot
open a segment holding a faked step (its replay would not reach the committed
end), so it leaves the challenges that hit one unanswered (or answers them with
openings of its own choosing).

Example::

  prover = FakeProver(server.url, token, "alice/run")
  prover.start()
  outcome = prover.run(steps=30, faked={3, 4, 5})
  prover.close().json()["state"]  # "invalid" when a challenge hit a faked step
"""

import dataclasses

import blake3
import cbor2
import httpx

from zkdv import challenge
from zkdv.transcript import FORMAT_VERSION, encode_record, record_id


def digest(data: bytes) -> bytes:
  return blake3.blake3(data).digest()


@dataclasses.dataclass
class RunOutcome:
  """What a run sent: the challenged steps (step -> decision) and the faked ones hit."""

  decisions: dict[int, challenge.Decision] = dataclasses.field(default_factory=dict)
  faked_hit: list[int] = dataclasses.field(default_factory=list)  # faked steps caught
  segments: dict[int, int] = dataclasses.field(default_factory=dict)  # last step -> first
  step_ids: dict[int, bytes] = dataclasses.field(default_factory=dict)


class FakeProver:
  """One proof of ``experiment`` ("owner/name"), sent record by record."""

  def __init__(self, url: str, token: str, experiment: str, segment_length: int = 1,
               probe_ratio: float | None = None):
    self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"},
                             timeout=60)
    self.experiment = experiment
    self.proof_id: str | None = None
    self.last_id: bytes | None = None
    self.policy: challenge.Policy | None = None
    self.records: list[bytes] = []
    self.steps = 0
    self.state = digest(b"initial state")
    self.segment_length = segment_length
    self.probe_ratio = probe_ratio  # None: the slot's
    self.segment_first: int | None = None  # the open segment's first step
    self._seq = 0

  # -- root ----------------------------------------------------------------------

  def slot(self, experiment: str | None = None) -> dict:
    owner, name = (experiment or self.experiment).split("/")
    response = self.http.post(f"/api/v1/experiments/{owner}/{name}/slots")
    response.raise_for_status()
    return response.json()

  def root(self, slot: dict, name: str = "fake", **challenger_changes) -> dict:
    """A root bound to ``slot`` asking for the slot's policy (fields replaceable)."""
    owner = self.experiment.split("/")[0]
    challenger = {"kind": "dvbench", "server_key": bytes.fromhex(slot["server_key"]),
                  "nonce": bytes.fromhex(slot["nonce"]),
                  "key_commitment": bytes.fromhex(slot["key_commitment"]),
                  "owner": owner, "experiment": self.experiment,
                  "policy": {**slot["policy"], "segment_length": self.segment_length,
                             **({} if self.probe_ratio is None else {
                                 "probe_ratio": self.probe_ratio})}}
    challenger.update(challenger_changes)
    return {"type": "root", "format_version": FORMAT_VERSION, "prover": "whitebox-jax",
            "name": name, "versions": {}, "platform": "cpu", "device_kinds": ["cpu"], "config": {},
            "challenger": challenger}

  def post_root(self, root: dict, experiment: str | None = None) -> httpx.Response:
    owner, name = (experiment or self.experiment).split("/")
    raw = encode_record(root)
    response = self.http.post(f"/api/v1/experiments/{owner}/{name}/proofs", content=raw)
    if response.status_code == 201:
      self.proof_id, self.last_id = response.json()["id"], record_id(raw)
      self.policy = challenge.Policy.from_record(root["challenger"]["policy"])
      self.records = [raw]
    return response

  def start(self, name: str = "fake", **run) -> "FakeProver":
    """Posts a root (``run``: its declared ``run_name``, ``tags`` and ``run_config``)."""
    response = self.post_root({**self.root(self.slot(), name), **run})
    if response.status_code != 201:
      raise AssertionError(f"root refused: {response.text}")
    return self

  # -- records -----------------------------------------------------------------------

  def chain(self, fields: dict, prev: bytes | None = None) -> bytes:
    """``fields`` as an encoded record chained to ``prev`` (default: the last sent)."""
    return encode_record({**fields, "prev": self.last_id if prev is None else prev})

  def send(self, *raws: bytes) -> httpx.Response:
    """One envelope of ``raws``; on success the chain continues after the last one."""
    envelope = {"client_id": "fake", "seq": self._seq, "kind": "records", "records": list(raws)}
    response = self.http.post(f"/api/v1/proofs/{self.proof_id}/stream",
                              content=encode_record(envelope))
    if response.status_code == 200:
      self._seq += 1
      self.last_id = record_id(raws[-1]) if raws else self.last_id
      self.records += raws
    return response

  def step_record(self, faked: bool = False, ends: bool | None = None,
                  metrics: dict | None = None) -> bytes:
    """The next step's record (with its committed ``metrics``): it commits its pre-state
    when it starts a segment and its post-state when it ends one (by default every
    ``segment_length`` steps)."""
    fields = {"type": "step", "index": self.steps, "program": 0, "batch": self._batch(),
              **({"metrics": metrics} if metrics is not None else {})}
    if self.segment_first is None:
      fields["pre_state"] = self.state
    if ends if ends is not None else (self.steps + 1) % self.segment_length == 0:
      fields["post_state"] = self._post(faked)
    return self.chain(fields)

  def _batch(self) -> bytes:
    return digest(b"batch %d" % self.steps)

  def _post(self, faked: bool) -> bytes:
    return digest((b"faked" if faked else b"honest") + self.state + self._batch())

  def step(self, faked: bool = False, ends: bool | None = None,
           metrics: dict | None = None) -> dict:
    """Sends the next step; returns its ack (raises on refusal)."""
    raw, post = self.step_record(faked, ends, metrics), self._post(faked)
    response = self.send(raw)
    if response.status_code != 200:
      raise AssertionError(f"step {self.steps} refused: {response.text}")
    if self.segment_first is None:
      self.segment_first = self.steps
    if "post_state" in cbor2.loads(raw):
      self.segment_first = None
    self.state = post
    self.steps += 1
    return response.json()

  @staticmethod
  def digest_hex(data: bytes) -> str:
    """The blob name of ``data``."""
    return digest(data).hex()

  def upload(self, data: bytes) -> bytes:
    name = digest(data)
    response = self.http.put(f"/api/v1/proofs/{self.proof_id}/blobs/{name.hex()}", content=data)
    response.raise_for_status()
    return name

  def check_record(self, step: int, kind: str, first: int | None = None) -> bytes:
    """An answer to step ``step``'s ``kind`` challenge, its openings uploaded (an update
    check opens the segment ``first .. step``)."""
    def put(data: bytes) -> bytes:  # openings of this proof only
      return self.upload(data + self.proof_id.encode())

    fields = {"type": "check", "step": step, "kind": kind}
    if kind == "update":
      first = step if first is None else first
      fields |= {"first": first, "pre_state_blobs": [put(b"pre-state of %d" % first)],
                 "batch_blobs": [[put(b"batch of %d" % t)] for t in range(first, step + 1)],
                 "result": {"equal": True}}
    elif kind == "state":
      fields |= {"post_state_blobs": [put(b"post-state of %d" % step)]}
    else:
      fields |= {"batch_roots": [digest(b"root")],
                 "probes": [[0, 0, 1, b"row 0 of %d" % step, []]]}
    return self.chain(fields)

  def answer(self, decision: challenge.Decision, first: int | None = None) -> None:
    """Answers ``decision``: its probes and, when its step ends the segment from
    ``first`` (None: it ends none), the segment's checks."""
    decides = first is not None and challenge.deciding_step(
        "dvbench", first, decision.step) == decision.step
    for kind, needed in challenge.required_checks(decision,
                                                  decision if decides else None).items():
      if needed:
        response = self.send(self.check_record(decision.step, kind, first))
        if response.status_code != 200:
          raise AssertionError(f"answer to step {decision.step} refused: {response.text}")

  def decisions(self, ack: dict) -> list[challenge.Decision]:
    return [challenge.decide(c["step"], bytes.fromhex(c["challenge"]), self.policy)
            for c in ack["challenges"]]

  def run(self, steps: int, faked=(), skip_answer=(), metrics=None) -> RunOutcome:
    """``steps`` steps, the last one ending a segment; challenges answered except for the
    checks of segments holding a faked step and the steps in ``skip_answer``; ``metrics(t)`` gives
    step t's committed metrics."""
    outcome = RunOutcome()
    for n in range(steps):
      t = self.steps
      first = t if self.segment_first is None else self.segment_first
      ack = self.step(faked=t in faked, ends=True if n == steps - 1 else None,
                      metrics=None if metrics is None else metrics(t))
      if self.segment_first is None:
        outcome.segments[t] = first
      outcome.step_ids[t] = record_id(self.records[-1])
      for decision in self.decisions(ack):
        step = decision.step
        outcome.decisions[step] = decision
        segment = outcome.segments.get(step)
        inside = [] if segment is None else [s for s in faked if segment <= s <= step]
        if inside and decision.any_check:
          outcome.faked_hit += inside
        elif step not in skip_answer:  # a faked step's data probes open real rows
          self.answer(decision, segment)
    return outcome

  def final_record(self, steps: int | None = None, prev: bytes | None = None) -> bytes:
    return self.chain({"type": "final", "steps": self.steps if steps is None else steps,
                       "status": "clean", "discontinuities": [], "final_state": self.state,
                       "final_state_leaves": []}, prev)

  def finish(self) -> httpx.Response:
    """Sends the final record and closes."""
    response = self.send(self.final_record())
    if response.status_code != 200:
      raise AssertionError(f"final refused: {response.text}")
    return self.close()

  def close(self) -> httpx.Response:
    envelope = {"client_id": "fake", "seq": self._seq, "kind": "close",
                "final_record_id": self.last_id, "record_count": len(self.records)}
    response = self.http.post(f"/api/v1/proofs/{self.proof_id}/stream",
                              content=encode_record(envelope))
    if response.status_code == 200:
      self._seq += 1
    return response


def write_self_transcript(folder, steps: int, name: str = "synthetic") -> list[bytes]:
  """A self-challenged transcript of ``steps`` step records, no checks, written with
  ``TranscriptWriter`` to ``folder``; returns the record ids in order.

  A server takes it without challenges, so ``Experiment.upload(folder)`` stores it whole.
  """
  from zkdv import transcript  # pylint: disable=g-import-not-at-top
  writer = transcript.TranscriptWriter(folder)
  policy = challenge.Policy(update_check_probability=0.1).to_record()
  writer.append({"type": "root", "format_version": FORMAT_VERSION, "prover": "whitebox-jax",
                 "name": name, "versions": {}, "platform": "cpu", "device_kinds": ["cpu"],
                 "config": {}, "challenger": {"kind": "self", "seed_commitment": digest(name.encode()),
                                "policy": policy}})
  state = digest(b"initial state")
  for t in range(steps):
    batch = digest(b"%s batch %d" % (name.encode(), t))
    post = digest(state + batch)
    writer.append({"type": "step", "index": t, "program": 0, "pre_state": state,
                   "batch": batch, "post_state": post})
    state = post
  writer.append({"type": "final", "steps": steps, "status": "clean", "discontinuities": [],
                 "final_state": state, "final_state_leaves": [], "seed": bytes(32)},
                durable=True)
  writer.close()
  return [r.record_id for r in transcript.read_transcript(folder).records]
