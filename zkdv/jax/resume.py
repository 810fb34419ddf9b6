"""Resuming a run after a crash: where its transcript stopped, and what the restored state is.

A resumed run appends to the same transcript: a ``resume`` record, then steps whose indices
go on where the transcript stopped. It continues from the last post-state the transcript
committed (the end of its last committed segment); steps recorded after it, in a segment
that never committed its end, are discarded. The restored state must hash to that post-state,
leaf by leaf, or to an earlier committed one: the run then replays the committed steps after
it first (``zkdv.jax.catch_up``: their records are compared, not written again, and the
checks a crash left unanswered are answered from the replay). Else the first step raises
``ResumeStateError`` naming the leaves that differ before anything is written (docs/jax.md,
"Resuming a run").

Example::

  point = read_point(records, lambda step: challenge.step_challenge_self(seed, step))
  catch_up = point.plan(layouts, pieces)  # None, a CatchUp, or ResumeStateError
  writer.append(point.record())
"""

import dataclasses
import logging
import os
import pathlib
from collections.abc import Callable

from zkdv import challenge
from zkdv import challengers
from zkdv import digest
from zkdv import errors
from zkdv import keys
from zkdv import records as records_lib
from zkdv import transcript
from zkdv.digest import LeafLayout
from zkdv.jax import processes
from zkdv.jax import shared_decisions
from zkdv.jax.catch_up import CATCH_UP_STEPS
from zkdv.jax.catch_up import START
from zkdv.jax.catch_up import CatchUp
from zkdv.jax.catch_up import Replayable

logger = logging.getLogger("zkdv")

SEED_FILE = "challenger-seed"  # a self-challenged run's seed, kept until final reveals it


@dataclasses.dataclass(frozen=True)
class OwedProbes:
  """The unanswered probes of a step a resume discarded: its ``decision``, the digest of
  the ``batch`` it committed and its ``data_rows`` (``proof.batches``; None without)."""

  decision: challenge.Decision
  batch: bytes
  data_rows: object = None

  def answered_by(self, layouts, roots: list, key_seed: bytes, data_rows) -> list | None:
    """The batch roots of the discarded step when a step of batch leaves ``layouts`` with
    row roots ``roots`` and ``data_rows`` trained its batch again (its PRNG-key leaves
    hold its own step's keys, which probes never open), else None."""
    if data_rows != self.data_rows:
      return None
    own = [digest.tree_root(digest.batch_trees([l], [keys.key_array(
        key_seed, self.decision.step, digest.numpy_dtype(l.dtype), l.shape)])[0])
           if l.key_impl is not None else r for l, r in zip(layouts, roots)]
    return own if digest.batch_digest(layouts, own) == self.batch else None


@dataclasses.dataclass(frozen=True)
class ResumePoint:
  """Where an unfinished transcript stopped.

  Attributes:
    steps: the number of step records: the resumed run's first step index.
    after: the last step that committed its post-state.
    state: that post-state's digest; ``pieces`` its piece digests per leaf.
    layouts: its leaf layouts; ``params_mask`` which leaves are params.
    program_numbers: program id -> number of the programs recorded.
    attested_start: whether the transcript holds an ``init`` record.
    owed_probes: ``OwedProbes`` of the discarded steps whose probes have no answer: the
      resumed run answers them when it trains the same batch again
      (``zkdv.jax.owed.OwedAnswers``).
  """

  steps: int
  after: int
  state: bytes
  pieces: list
  layouts: list
  params_mask: list
  program_numbers: dict
  attested_start: bool
  owed_probes: list = dataclasses.field(default_factory=list)
  replayable: "Replayable | None" = None

  def record(self) -> dict:
    return {"type": "resume", "step": self.steps, "after": self.after, "state": self.state}

  def shared(self) -> dict:
    """What the other processes of a multi-process run follow of it (``following``)."""
    return {"steps": self.steps, "after": self.after, "attested_start": self.attested_start,
            "programs": [[i, n] for i, n in self.program_numbers.items()]}

  @classmethod
  def following(cls, shared: dict) -> "ResumePoint":
    """The point of a process other than 0, from process 0's ``shared()``: process 0
    alone reads the transcript and decides what the restored state is (``plan_across``),
    so the committed state's digests are empty here, and never read."""
    return cls(shared["steps"], shared["after"], b"", [], [], [],
               {i: n for i, n in shared["programs"]}, shared["attested_start"])

  def plan(self, layouts: list, pieces: list) -> "CatchUp | None":
    """None when the restored state (its ``layouts`` and piece digests) is the committed
    post-state of step ``after`` and every check up to it is answered; a ``CatchUp`` when
    it is an earlier committed end the run replays from. Raises ResumeStateError naming
    the leaves that differ from the last committed state, and UnanswerableChallengeError
    when a check the crash left unanswered is not after the restored state."""
    replayable = self.replayable
    if replayable is not None:
      end = replayable.end_of(pieces)
      if end is not None and end != self.after:
        return replayable.catch_up(end, self)
    self.check_restored(layouts, pieces)
    if replayable is not None and replayable.unanswered:
      raise errors.UnanswerableChallengeError(replayable.unanswered_message(self.after))
    return None

  def check_restored(self, layouts: list, pieces: list) -> None:
    """Raises ResumeStateError unless the restored state (its ``layouts`` and piece
    digests) is the committed post-state of step ``after``, naming the leaves that differ."""
    start = self.replayable is not None and START in self.replayable.ends
    fix = (f"Restore the state saved at the end of step {self.after} (the last state the "
           "transcript committed), or one of the last segment ends since the last resume"
           f"{' or, with no checkpoint, the attested start' if start else ''} (the run "
           "replays the committed steps after it). Checkpoint where a segment "
           "ends: fix ZKDVConfig(segment_length=K) and save every K steps, after "
           "proof.wait_for_commitments().")
    shapes = [(l.path, l.dtype, tuple(l.shape)) for l in layouts]
    committed = [(l.path, l.dtype, tuple(l.shape)) for l in self.layouts]
    if shapes != committed:
      differ = [c[0] for c, s in zip(committed, shapes) if c != s] or ["the number of leaves"]
      raise errors.ResumeStateError(
          f"the restored state is laid out differently from the post-state of step "
          f"{self.after}: {', '.join(differ[:4])}. {fix}")
    differ = [l.path for l, p, q in zip(layouts, pieces, self.pieces) if list(p) != list(q)]
    if differ:
      raise errors.ResumeStateError(
          f"the restored state differs from the post-state step {self.after} committed in "
          f"leaf {', '.join(differ[:4])}{' …' if len(differ) > 4 else ''}. {fix}")


def check_unfinished(records: list[dict]) -> None:
  """Raises ProofStateError for a finished transcript: it is never continued."""
  if any(r.get("type") == "final" for r in records):
    raise errors.ProofStateError("the transcript is finished; a finished proof is not "
                                 "resumed. Start a new proof.")


def read_point(records: list[dict], challenge_of: Callable[[int], bytes]) -> ResumePoint:
  """The ``ResumePoint`` of an unfinished transcript's records; ``challenge_of(step)`` is
  step ``step``'s challenge (a self-challenged run's from its seed, a DVBench proof's as
  the server sent it).

  Raises ProofStateError when no step committed a state, and
  UnanswerableChallengeError naming the step when a check chosen before the crash is
  missing and no committed state before it is one the run could replay from (its openings
  died with the process, so the proof could never be verified). The probes of a discarded
  step are owed instead (``ResumePoint.owed_probes``).
  """
  root = records[0]
  programs, steps, answered, resumed = {}, [], set(), None
  for r in records:
    if r.get("type") == "program":
      programs[r["number"]] = r
    elif r.get("type") == "step":
      steps.append(r)
    elif r.get("type") == "check":
      answered.add((r["step"], r["kind"]))
    elif r.get("type") == "resume":
      resumed = (r["after"], r["step"])
  committed = [s for s in steps if "post_state" in s]
  if not committed:
    raise errors.ProofStateError(
        "no step of the transcript committed a state yet, so there is nothing to resume "
        "from. Start a new proof: move or delete this transcript's folder, or give the new "
        "proof another output_dir.")
  last = committed[-1]
  if "post_state_leaves" not in last:
    raise errors.ProofStateError(f"step {last['index']} records no post_state_leaves (the "
                                 "transcript was written by an older zkdv); start a new proof.")
  program = programs[last["program"]]
  fields = root["challenger"]
  policy = challenge.Policy.from_record(fields["policy"])
  discarded = set(range(last["index"] + 1, len(steps)))
  for r in records:
    if r.get("type") == "resume":
      discarded |= set(records_lib.discarded_steps(r["after"], r["step"]))
  owed, unanswered, decisions = _require_answers(steps, discarded, answered,
                                                 challenge_of, fields["kind"], policy)
  # The committed ends a run may restore: those of the last CATCH_UP_STEPS steps (their
  # records are kept while the run goes on), none before the state the last resume went on
  # from.
  ends = [s for s in committed if s["index"] > last["index"] - CATCH_UP_STEPS
          and (resumed is None or s["index"] >= resumed[0]) and "post_state_leaves" in s]
  if resumed is None and last["index"] < CATCH_UP_STEPS:
    ends = _attested_start(records, steps) + ends
  replayable = Replayable(
      {s["index"]: s for s in ends},
      {s["index"]: s for s in steps[ends[0]["index"] + 1:last["index"] + 1]},
      frozenset(answered), tuple(unanswered),
      {i: d for i, d in decisions.items() if _step_of(i) > ends[0]["index"]}, resumed)
  if unanswered:
    message = replayable.unanswered_message(None)
    if not replayable.restores_before(unanswered[0][0]):
      raise errors.UnanswerableChallengeError(message)
    logger.warning("ZKDV: %s", message)
  if owed:
    logger.warning("ZKDV: the probes DVBench drew for discarded step%s %s have no answer: "
                   "the resumed run answers them when it trains %s again (the same batch), "
                   "else the proof will not verify.", "s" * (len(owed) > 1),
                   ", ".join(str(o.decision.step) for o in owed),
                   "their batches" if len(owed) > 1 else "its batch")
  params = set(program.get("params_leaves", []))
  layouts = [LeafLayout.from_record(l)
             for l in program.get("post_state_layout", program["state_layout"])]
  return ResumePoint(len(steps), last["index"], last["post_state"], last["post_state_leaves"],
                     layouts, [i in params for i in range(len(layouts))],
                     {p["program_id"]: n for n, p in programs.items()},
                     any(r.get("type") == "init" for r in records), owed, replayable)


def _require_answers(steps: list, discarded: set, answered: set,
                     challenge_of: Callable[[int], bytes], kind: str,
                     policy: challenge.Policy) -> tuple[list, list, dict]:
  """(the ``OwedProbes`` of each discarded step whose probes have no answer, which a run
  can still answer; (step, kind) of each chosen check of a kept step that has no record
  (``zkdv.challenge.required_checks``, as the server and the verifier require them; a
  replay can still answer it), in step order; step -> its decision (with its segment's
  as a ``SegmentDecision`` at a segment's first step)."""
  owed, unanswered, decisions = [], [], {}
  first = None
  for s in steps:
    index = s["index"]
    first = index if "pre_state" in s else first
    decision = challenge.decide(index, challenge_of(index), policy)
    decisions[index] = decision
    if index in discarded:
      required = challenge.discarded_checks(kind, decision)
    else:
      segment = None
      if "post_state" in s:
        deciding = challenge.deciding_step(kind, first, index)
        segment = challenge.decide(deciding, challenge_of(deciding), policy)
        decisions[("segment", first)] = (index - first + 1, segment)
      required = challenge.required_checks(decision, segment)
    missing = [kind for kind, wanted in required.items()
               if wanted and (index, kind) not in answered]
    if missing == ["probe"] and index in discarded:
      owed.append(OwedProbes(decision, s["batch"], s.get("data_rows")))
    elif missing:
      unanswered.extend((index, kind) for kind in missing)
  return owed, unanswered, decisions


def _attested_start(records: list[dict], steps: list[dict]) -> list[dict]:
  """The attested start as an end a run may restore (``START``): step 0's pre-state, with
  the piece digests its ``start`` check links to the init program's outputs; [] without an
  attested start."""
  linked = [r for r in records if r.get("type") == "check" and r.get("kind") == "start"]
  if not linked or "pre_state" not in steps[0] or not isinstance(
      linked[0].get("pre_state_pieces"), list):  # no start, or one no state can match
    return []
  return [{"index": START, "post_state": steps[0]["pre_state"],
           "post_state_leaves": linked[0]["pre_state_pieces"]}]


def _step_of(key) -> int:
  """The step a ``Replayable.decisions`` key is of."""
  return key[1] if isinstance(key, tuple) else key


def saved_seed(path: pathlib.Path, fields: dict) -> bytes:
  """The seed a self-challenged run kept beside its transcript, checked against the root."""
  try:
    seed = (path / SEED_FILE).read_bytes()
  except FileNotFoundError:
    raise errors.ProofStateError(
        f"{path / SEED_FILE} is missing: the challenges of this transcript "
        "cannot be continued. Start a new proof.") from None
  if challenge.key_commitment(seed) != fields.get("seed_commitment"):
    raise errors.ProofStateError(f"{path / SEED_FILE} does not match the root's "
                                 "seed commitment. Start a new proof.")
  return seed


class ResumingRun:
  """Starting a ``ZKDV`` run that continues an unfinished transcript (a mixin)."""

  def _start_resumed(self) -> "ResumingRun":
    """Continues the unfinished transcript in ``resume_from`` (``zkdv.jax.resume``): the
    policy and challenges are the root's, step indices go on, and the first step checks
    that the restored state is the last committed one, or an earlier one it replays from
    (``ResumePoint.plan``). In a multi-process run process 0 reads the transcript and the
    others follow what it shares (every process passes ``resume=``)."""
    group = processes.ProcessGroup.current()
    path, point = self.resume_from, None

    def reopen() -> dict:  # on process 0
      nonlocal point
      self._fetch_transcript(path)
      writer, contents = transcript.TranscriptWriter.reopen(path)
      try:
        records = [p.record for p in contents.records]
        check_unfinished(records)
        root = records[0]
        fields = root.get("challenger", {})
        if root.get("name") != self.name:
          raise errors.ProofStateError(
              f"{path} holds proof {root.get('name')!r}; ZKDV({self.name!r}, resume=...) "
              "continues a transcript of the same name.")
        self._challenger, challenge_of = self._resumed_challenger(path, fields)
        point = read_point(records, challenge_of)
      except BaseException:
        writer.close()
        raise
      self._writer = writer
      return {"run_id": os.urandom(16), "folder": str(path), "challenger": fields,
              "resume": point.shared(),
              "seed": self._challenger.seed if fields.get("kind") == "self" else None,
              "key_seed": keys.key_seed(fields, writer.transcript_id)}

    run = group.open_run(reopen, resuming=True)
    if not group.is_writer:
      self._challenger = shared_decisions.follower_challenger(run["challenger"], run["seed"])
      point = ResumePoint.following(run["resume"])
    path = pathlib.Path(run["folder"])
    self._key_seed = run["key_seed"]
    self._open(path, group)
    self._committer.continue_from(point, self._key_seed)
    self._dispatcher.steps = point.steps
    self._dispatcher.restored = point
    if self._dispatcher.shared is not None:  # a server's decisions go on at the new steps
      self._dispatcher.shared.continue_at(point.steps)
    logger.info("ZKDV proof %r resumes at step %d; its last committed state is step %d's "
                "(%s%s)", self.name, point.steps, point.after, path,
                "" if group.is_writer else f", written by process 0; process {group.index} "
                "commits its shards")
    return self

  def _fetch_transcript(self, path: pathlib.Path) -> None:
    """Puts the transcript the run continues in ``path`` (on process 0): a self-challenged
    run's is there already; a DVBench proof's comes from the server."""
    del path

  def _resumed_challenger(self, path: pathlib.Path, fields: dict):
    """(the challenger of a resumed transcript, step -> its challenge): a self-challenged
    run's, from the seed kept beside its transcript (DVBench proofs override it)."""
    if fields.get("kind") != "self":
      raise errors.ProofStateError(
          f"{path} holds a proof challenged by {fields.get('kind')!r}; "
          f"ZKDV({self.name!r}, resume=...) continues a self-challenged transcript (resume "
          "a DVBench proof with experiment.proof(resume=PROOF_ID)).")
    seed = saved_seed(path, fields)
    challenger = challengers.SelfChallenger(challenge.Policy.from_record(fields["policy"]), seed)
    return challenger, lambda step: challenge.step_challenge_self(seed, step)
