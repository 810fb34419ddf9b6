"""The claims of docs/design.md §10, each with its status and what it rests on.

A claim does not hold when a finding it rests on is invalid, could not be
verified when such a finding could not be, and otherwise holds only when what it
says was shown: ``challenges`` needs dvbench's key confirmed (a receipt or the
signed receipt that binds this very transcript; a key given by hand leaves it
unverified), ``start`` an init program replayed to step 0's params, ``program`` each
replayed update changing every trained params leaf when run on other batches, ``data``
probed rows. With ``--strict`` the ``replays`` claim also needs bitwise (exact)
replays. A DVBench proof's ``replays``, ``start``, ``program`` and ``data`` rest on its
slot's nonce and key being the server's secrets: without its receipt they could not be
verified (``ON_SERVER_SECRETS``).

``standing`` is the one rule from a verification's outcome to a proof's state and
label, used by ``zkdv verify``, DVBench's workers, its pages and its rankings:
``verified`` only when every claim holds with exact replays.

Example::

  build_claims(ctx)
  ctx.report.claim("replays").status   # "holds"
  standing(report).label               # "verified steps — start unattested"
"""

import collections
import dataclasses

from zkdv import challenge
from zkdv import config
from zkdv.verify import order
from zkdv.verify.context import Verification
from zkdv.verify.programs import parameter_count, params_bytes
from zkdv.verify.report import (COULD_NOT_VERIFY, DOES_NOT_HOLD, HOLDS, INVALID, Claim)
from zkdv.verify.sensitivity import OTHER_STEPS, PERTURBED, UNDECIDED

_ANY = frozenset({"unreadable", "no_root", "format_version"})
_RECORDS = frozenset({"torn_tail", "encoding", "chain", "schema", "after_final", "step_index",
                      "program_id", "discontinuity", "unfinished", "aborted", "step_count",
                      "final", "final_state", "final_params", "no_steps", "check_step",
                      "segment", "segment_length", "resume"})
_KEYS = frozenset({"challenger", "policy", "seed", "server_key", "challenge_key", "receipt",
                   "receipt_verdict"})
# The finding codes each claim rests on.
CLAIM_CODES = {
    "chain": _ANY | _RECORDS | {"challenger", "server_key", "receipt"},
    "challenges": _ANY | _KEYS,
    "replays": _ANY | _RECORDS | _KEYS | {
        "missing_check", "opening", "blob", "missing_blob", "replay", "replay_error",
        "replay_environment", "platform", "no_jax", "no_program", "not_replayed",
        "too_few_checks", "unsafe_program"},
    "start": _ANY | {"start"},
    "program": _ANY | {"program_id", "missing_blob", "unsafe_program"},
    "data": _ANY | _KEYS | {"probe", "missing_probe", "batch_key", "unprobed",
                            *order.ORDER_CODES},
}


def _blocked(ctx: Verification, name: str) -> Claim | None:
  """The claim as its findings decide it, or None when none of them failed."""
  findings = [f for f in ctx.report.findings if f.code in CLAIM_CODES[name]]
  if not findings:
    return None
  worst = next((f for f in findings if f.blocks == INVALID), findings[0])
  status = DOES_NOT_HOLD if worst.blocks == INVALID else COULD_NOT_VERIFY
  return Claim(name, status, f"{worst.code} at {worst.where}: {worst.message}")


def _chain(ctx: Verification) -> Claim:
  model, challenger = ctx.model, ctx.challenger
  detail = f"{model.records} records in one hash chain from root {model.transcript_id.hex()[:16]}"
  if challenger.kind == "self":
    return Claim("chain", HOLDS, f"{detail}; self-challenged, bound to no server")
  f = challenger.fields
  bound = (f"dvbench {f['server_key'].hex()[:16]}, {f['experiment']} (owner {f['owner']}), "
           f"nonce {f['nonce'].hex()[:16]}")
  if ctx.keys.key is None:
    return Claim("chain", COULD_NOT_VERIFY,
                 f"{detail}; the root names {bound}, unconfirmed ({ctx.keys.missing})")
  if ctx.keys.source != "receipt":
    return Claim("chain", COULD_NOT_VERIFY, f"{detail}; the root names {bound}, unconfirmed "
                 "(a challenge key given by hand does not show that the server stored these "
                 "records; its signed receipt does)", {"key_source": ctx.keys.source})
  return Claim("chain", HOLDS, f"{detail}; bound to {bound} (confirmed by the server's "
               "signed receipt for this transcript)", {"key_source": ctx.keys.source})


def _challenges(ctx: Verification) -> Claim:
  challenger = ctx.challenger
  facts = {"challenger": challenger.kind, "by": challenger.label}
  if challenger.kind == "self":
    return Claim("challenges", DOES_NOT_HOLD, challenger.label, facts)
  if ctx.keys.key is None:
    return Claim("challenges", COULD_NOT_VERIFY,
                 f"chosen by {challenger.label}: could not verify ({ctx.keys.missing})", facts)
  facts["key_source"] = ctx.keys.source
  if ctx.keys.source != "receipt":
    return Claim("challenges", COULD_NOT_VERIFY, f"chosen by {challenger.label}: could not "
                 "verify (the challenge key was given by hand; only a receipt the server "
                 "signed for this very transcript shows that it chose them)", facts)
  return Claim("challenges", HOLDS, f"chosen by {challenger.label} after each step was "
               f"stored; key from the {ctx.keys.source}", facts)


def full_replay(ctx: Verification, replayed: list) -> bool:
  """Every step was re-executed, chained from the attested start: the policy challenged
  every segment, each was replayed, and step 0's start is attested."""
  segments = ctx.model.segments
  return (ctx.challenger.policy.full_replay and bool(segments)
          and {c.step for c in replayed} == {s.last for s in segments}
          and any(c.kind == "start" and c.status == "verified" for c in ctx.report.checks))


def _replays(ctx: Verification) -> Claim:
  policy = ctx.challenger.policy
  p, k = policy.update_check_probability, policy.segment_length
  replayed = [c for c in ctx.report.checks if c.kind == "update" and c.challenged
              and c.status == "verified"]
  exact = all(c.mode == "exact" for c in replayed)
  segments = {s.last: s.length for s in ctx.model.segments}
  steps_replayed = sum(segments.get(c.step, 0) for c in replayed)
  full = full_replay(ctx, replayed)
  discarded = sum(map(ctx.model.discarded, (s.index for s in ctx.model.steps)))
  kept = len(ctx.model.steps) - discarded  # the run's training: what a resume left
  facts = {"count": len(replayed), "p": p, "escape_probability": challenge.escape_probability(p),
           "exact": exact, "steps": kept, "steps_discarded": discarded, "segment_length": k,
           "segments": len(segments), "steps_replayed": steps_replayed, "full_replay": full}
  how = "bit for bit" if exact else "within tolerance"
  if full:
    detail = (f"full replay: all {kept} steps re-executed {how} in {len(segments)} segments, "
              f"chained from the attested start")
  else:
    detail = (f"{len(replayed)} challenged segments ({steps_replayed} steps) replayed {how} "
              f"of {len(segments)} segments over {kept} steps at p={p:g}, "
              f"segments of up to {k} steps; one faked step escapes with probability "
              f"{1 - p:g}")
  if discarded:
    detail += (f"; a resume discarded {discarded} more step{'s' * (discarded > 1)}, run after "
               "the last committed state: not replayed, and not what the run goes on from")
  if not ctx.decisions.known:
    return Claim("replays", COULD_NOT_VERIFY, f"{detail}; whether every challenge was "
                 f"answered could not be verified ({ctx.decisions.unknown})", facts)
  if ctx.options.strict and not exact:
    return Claim("replays", DOES_NOT_HOLD, f"{detail}; --strict requires exact replays", facts)
  return Claim("replays", HOLDS, detail, facts)


def _start(ctx: Verification) -> Claim:
  init = ctx.model.init
  if init is None:
    return Claim("start", DOES_NOT_HOLD, "unattested: nothing shows where the initial "
                 "state came from", {"start": "unattested"})
  facts = {"start": "attested", "init_program": init.program_id.hex()}
  if init.base_checkpoint is not None:
    facts.update(start="base", base_checkpoint=init.base_checkpoint.hex())
  if not any(c.kind == "start" and c.status == "verified" for c in ctx.report.checks):
    return Claim("start", COULD_NOT_VERIFY, f"the init program {init.program_id.hex()[:16]} "
                 "could not be replayed here (see the findings)", facts)
  if init.base_checkpoint is not None:
    return Claim("start", HOLDS, f"base checkpoint {init.base_checkpoint.hex()} (declared by "
                 f"the prover, not trained here): step 0's state is the output of the init "
                 f"program {init.program_id.hex()[:16]} on it, replayed bit for bit", facts)
  detail = (f"attested: step 0's params are outputs of the init program "
            f"{init.program_id.hex()[:16]}, replayed bit for bit from its recorded inputs")
  summary = ctx.programs.load(init).summary
  trained = next(iter(ctx.model.programs.values()), None)
  if summary is not None and trained is not None and config.constants_could_carry(
      summary.constant_bytes, params_bytes(trained)):
    detail += (f"; its {summary.constant_bytes} bytes of constants could hold a copy of the "
               f"{params_bytes(trained)} bytes of params: another key changes the init, which "
               "does not show that it ignores a checkpoint it carries for this key; a pinned "
               "init_program rules that out")
  return Claim("start", HOLDS, detail, facts)


# What the program claim's replays do not show (zkdv.verify.sensitivity), said where it holds.
PROGRAM_TEST_LIMIT = ("this shows that the batch changes the params, not how much: a program "
                      "written against the test (one that recognizes its committed batches, or "
                      "lets them move only some elements or the last bits of params it "
                      "carries) passes it; pinned programs rule that out")


def _program(ctx: Verification) -> Claim:
  """Every replayed update read its batch: a step of each challenged segment, drawn from
  its challenge (``zkdv.challenge.tested_step``), replayed with other batches, changed
  every params leaf it trains (``zkdv.verify.sensitivity``). A check left undecided (a
  sign-based update, an accumulated one) counts where another check showed that the same
  program's updates read their batches. Without the challenges the tested step is
  foreseeable: could not verify."""
  tested, ignored, failed, undecided = {}, None, None, {}
  for check in ctx.report.checks:
    if check.kind != "update" or not (check.batch_ignored or check.batch_sensitive):
      continue
    program = ctx.model.program_of(ctx.model.steps[check.step]).number
    if check.batch_sensitive is not None:
      tested[program] = tested.get(program, True) and check.batch_sensitive
      ignored = ignored or (None if check.batch_sensitive else check.batch_ignored)
    elif UNDECIDED in check.batch_ignored:
      undecided.setdefault(program, []).append(check.batch_ignored)
    else:  # a replay with another batch failed here
      failed = failed or check.batch_ignored
  rows = []
  for program in ctx.model.programs.values():
    info = ctx.programs.load(program)
    rows.append({"number": program.number, "program_id": program.program_id.hex(),
                 "mode": program.mode, "parameters": parameter_count(program),
                 "batch_sensitive": tested.get(program.number),
                 "constant_bytes": info.summary.constant_bytes if info.summary else None,
                 "operations": sum(info.summary.op_counts.values()) if info.summary else None})
  ids = ", ".join(r["program_id"][:16] for r in rows) or "none"
  if False in tested.values():
    return Claim("program", DOES_NOT_HOLD, f"disclosed ({ids}); a replayed update ignores "
                 f"its batch at {ignored}", {"programs": rows})
  shown_nowhere = [found[0] for program, found in undecided.items() if not tested.get(program)]
  if failed or shown_nowhere:
    return Claim("program", COULD_NOT_VERIFY, f"disclosed ({ids}); whether every update "
                 f"reads its batch could not be shown at {failed or shown_nowhere[0]}",
                 {"programs": rows})
  if not tested:
    why = ("no program names a params leaf" if rows and not any(
        p.params_leaves for p in ctx.model.programs.values()) else "no update was replayed")
    return Claim("program", COULD_NOT_VERIFY, f"disclosed ({ids}); whether the updates read "
                 f"the batch could not be tested: {why}", {"programs": rows})
  if not ctx.decisions.known:  # the tested step was each segment's first: foreseeable
    return Claim("program", COULD_NOT_VERIFY, f"disclosed ({ids}); the tested steps could "
                 f"not be drawn from the challenges ({ctx.decisions.unknown}): a program can "
                 f"read its batch only on the steps it expects tested; each segment's first "
                 f"step read it ({len(tested)} of {len(rows)} programs tested)",
                 {"programs": rows})
  drawn = collections.Counter(c.batches_drawn for c in ctx.report.checks
                              if c.kind == "update" and c.batch_sensitive)
  on = ", ".join(f"{drawn[kind]} check{'s' * (drawn[kind] > 1)} on {kind}"
                 for kind in (OTHER_STEPS, PERTURBED) if drawn[kind])
  if drawn[PERTURBED]:
    on += (", perturbed where no other batch of its segment or of its program's other update "
           "checks held other rows: a program may recognize a perturbed batch")
  left = sum(map(len, undecided.values()))
  if left:
    on += (f"; {left} more undecided, where other checks of the same program read it: "
           f"{next(iter(undecided.values()))[0]}")
  return Claim("program", HOLDS, f"disclosed ({ids}); each replayed update, run again on "
               f"other batches ({on}), changed every params leaf it trains "
               f"({len(tested)} of {len(rows)} programs tested); {PROGRAM_TEST_LIMIT}",
               {"programs": rows, "batches_drawn": dict(drawn)})


def _data(ctx: Verification) -> Claim:
  """"data order: server-seeded" (or self-seeded) where a declared dataset's seeded order
  was checked at every step, "data: probed" where rows were only probed, else unknown."""
  ratio, full = ctx.challenger.policy.probe_ratio, ctx.challenger.policy.full_replay
  declared = ctx.model.data
  facts = {"probe_ratio": ratio, "rows": ctx.report.probed_rows,
           "order": None if declared is None else order.seeded_by(ctx),
           "dataset": None if declared is None else declared.root.hex(),
           "dataset_rows": ctx.report.dataset_rows}
  said = (f"data: probed, {ctx.report.probed_rows} challenger-chosen batch rows opened with "
          f"Merkle proofs (ratio {ratio:g})")
  required = ctx.options.dataset_root
  if required is not None and (declared is None or declared.root != required):
    return Claim("data", DOES_NOT_HOLD, f"{said}; the dataset {required.hex()[:16]}… is "
                 "required, and the run " + ("declared none (its batches were not drawn "
                 "with proof.batches)" if declared is None else
                 f"declared {declared.root.hex()[:16]}…"), facts)
  whose = ("the dataset required" if required is not None else "a root the prover declared: "
           "zkdv verify --dataset-root or a benchmark's training_set pin names the one it needs")
  if declared is not None:
    said = (f"data order: {facts['order']}, every step's rows are its batch of the order "
            f"seeded by the proof's slot over dataset {declared.root.hex()[:16]}… "
            f"({declared.rows} rows, batches of {declared.batch_size}; {whose}); "
            f"{ctx.report.dataset_rows} opened rows proven the dataset's at their index "
            f"(probe ratio {ratio:g}{', every row under full replay' if full else ''})")
  if (ratio == 0 or not ctx.report.probed_rows) and not (declared is not None and full):
    why = _why_unprobed(ctx, ratio)
    return Claim("data", DOES_NOT_HOLD, (f"data: unknown, no batch rows were probed ({why})"
                                         if declared is None else
                                         f"{said}; no row was probed ({why})"), facts)
  if not ctx.decisions.known:
    return Claim("data", COULD_NOT_VERIFY, f"{said}; whether the challenger chose the probed "
                 f"rows could not be verified ({ctx.decisions.unknown})", facts)
  return Claim("data", HOLDS, said, facts)


def _why_unprobed(ctx: Verification, ratio: float) -> str:
  """Why a run opened no batch row: from the steps its challenges probed, not from the
  probe records the prover wrote."""
  if ratio == 0:
    return "probe_ratio 0"
  if not ctx.decisions.known:
    return (f"probe ratio {ratio:g}: which steps were probed could not be derived "
            f"({ctx.decisions.unknown})")
  probed_steps = sum(d.probed for d in ctx.decisions.by_step)
  if probed_steps:
    return (f"probe ratio {ratio:g}: {probed_steps} probed steps, whose batches hold no "
            "rows a probe opens (PRNG keys or rows of no bytes only)")
  return (f"probe ratio {ratio:g}: the challenges probed none of the steps, each probed "
          f"with probability {min(1.0, challenge.PROBE_GROUPS * ratio):.3g}")


BUILDERS = {"chain": _chain, "challenges": _challenges, "replays": _replays,
            "start": _start, "program": _program, "data": _data}
# The claims of a DVBench proof that rest on its slot's nonce and challenge key being the
# server's secrets: the checks (and the step whose batch the program claim tests) could not
# be foreseen, and the start's key and the data order were seeded by the server.
ON_SERVER_SECRETS = ("replays", "start", "program", "data")


def _unconfirmed_secrets(ctx: Verification, claim: Claim) -> Claim:
  """A holding claim of ``ON_SERVER_SECRETS``, could not verify unless the server's signed
  receipt for this transcript confirms its key: one given by hand may be a prover's own
  (its own server's, say). DVBench's workers give the verifier the server's own key, and
  count such a claim as holding (``dvbench.server.worker.server_claims``)."""
  if (claim.status != HOLDS or ctx.challenger.kind != "dvbench"
      or ctx.keys.source == "receipt"):
    return claim
  why = ("the challenge key was given by hand" if ctx.keys.source is not None
         else ctx.keys.missing)
  return Claim(claim.name, COULD_NOT_VERIFY, f"{claim.detail}; unconfirmed: this rests on "
               "the slot's nonce and challenge key being the server's secrets, which only the "
               f"server's signed receipt for this transcript shows ({why})",
               {**claim.facts, "key_source": ctx.keys.source})


def build_claims(ctx: Verification) -> None:
  """Fills ``ctx.report.claims``, one per claim, in report order."""
  for name, build in BUILDERS.items():
    claim = _blocked(ctx, name)
    if claim is None and ctx.report.fault:
      claim = Claim(name, COULD_NOT_VERIFY, f"the verifier stopped: {ctx.report.fault}")
    if claim is None and (ctx.model is None or ctx.model.root is None
                          or ctx.challenger is None or ctx.programs is None):
      claim = Claim(name, COULD_NOT_VERIFY, "the verification stopped before this claim")
    if claim is None:
      claim = build(ctx)
      if name in ON_SERVER_SECRETS:
        claim = _unconfirmed_secrets(ctx, claim)
    ctx.report.claims.append(claim)


# What a proof's state says of each claim that does not hold: (does not hold, could not
# verify). The replays claim is said by the state itself.
SHORTFALLS = {
    "chain": ("chain broken", "chain unconfirmed"),
    "challenges": ("self-challenged", "challenges unconfirmed"),
    "start": ("start unattested", "start not replayed"),
    "program": ("program reads no batch", "program not analyzed"),
    "data": ("data unprobed", "data unconfirmed"),
}
# The states of a proof whose verification found nothing invalid (docs/protocol.md).
VERIFIED_ALL, VERIFIED_STEPS, WITHIN_TOLERANCE = "verified", "verified steps", "within tolerance"
UNCHALLENGED, SELF_AUDITED, NOT_VERIFIED = "unchallenged", "self-audited", "could not verify"
# The states whose challenged update checks all replayed: measured and scored, and ranked
# only when verified.
REPLAYED_STATES = (VERIFIED_ALL, VERIFIED_STEPS, WITHIN_TOLERANCE)
# A finding that only says no update check was challenged: the proof is unchallenged.
_NO_CHECK_DRAWN = "too_few_checks"


@dataclasses.dataclass(frozen=True)
class Standing:
  """A proof's state and every claim that keeps it from ``verified``.

  Example: ``Standing("verified steps", ("start unattested",)).label`` is
  ``"verified steps — start unattested"``; a start from a base checkpoint (hex
  ``base``) that holds is named: ``"verified from base checkpoint 1f2e…"``.
  """

  state: str
  shortfalls: tuple = ()
  base: str | None = None  # the declared base checkpoint of a start that holds

  @property
  def label(self) -> str:
    state = self.state if self.base is None else (
        f"{self.state} from base checkpoint {self.base[:16]}…")
    return f"{state} — {', '.join(self.shortfalls)}" if self.shortfalls else state

  @property
  def ranked(self) -> bool:
    return self.state == VERIFIED_ALL

  def to_json(self) -> dict:
    return {"state": self.state, "shortfalls": list(self.shortfalls), "label": self.label,
            "base_checkpoint": self.base}


def shortfalls(claims: dict) -> tuple:
  """What each claim ``{name: status}`` that does not hold says, in claim order."""
  said = []
  for name, (broken, unconfirmed) in SHORTFALLS.items():
    status = claims.get(name, COULD_NOT_VERIFY)
    if status != HOLDS:
      said.append(broken if status == DOES_NOT_HOLD else unconfirmed)
  return tuple(said)


def standing_of(verdict: str, finding_codes, claims: dict, update_checks: list[dict],
                self_challenged: bool, base: str | None = None) -> Standing:
  """The state a verification earns, from plain data (a report's JSON works).

  ``update_checks``: the challenged update checks, each ``{"mode", "status"}``. Invalid
  stays invalid; a proof in which the challenger drew no update check is unchallenged (not
  invalid); one replayed within a tolerance is ``within tolerance``; one whose replays hold
  but another claim does not is ``verified steps`` naming each; ``verified`` needs all.
  ``base``: the hex base checkpoint the start claim names (``start_base``), which the
  label then shows: a start from a declared checkpoint is verified, never from scratch.
  """
  if verdict == INVALID:
    return Standing(INVALID)
  drawn = len(update_checks)
  unexplained = set(finding_codes) - ({_NO_CHECK_DRAWN} if drawn == 0 else set())
  if unexplained:
    return Standing(NOT_VERIFIED)
  said = shortfalls(claims)
  base = base if claims.get("start") == HOLDS else None
  if self_challenged:
    return Standing(SELF_AUDITED, tuple(s for s in said if s != SHORTFALLS["challenges"][0]),
                    base)
  if drawn == 0:
    return Standing(UNCHALLENGED, (), base)
  if claims.get("replays") == COULD_NOT_VERIFY:
    return Standing(NOT_VERIFIED, said + ("replays unconfirmed",), base)
  if any(c["mode"] != "exact" for c in update_checks):
    return Standing(WITHIN_TOLERANCE, said, base)
  return Standing(VERIFIED_STEPS if said else VERIFIED_ALL, said, base)


def start_base(claims: list) -> str | None:
  """The hex base checkpoint a report's start claim names (its JSON or its ``Claim``s);
  None for a start from the key or none.

  Example: ``start_base(report["claims"])`` is ``"1f2e…"`` after ``proof.init_from``.
  """
  for claim in claims:
    name, facts = (claim["name"], claim.get("facts") or {}) if isinstance(claim, dict) else (
        claim.name, claim.facts or {})
    if name == "start":
      return facts.get("base_checkpoint")
  return None


def standing(report) -> Standing:
  """``standing_of`` a ``Report`` (``zkdv verify``'s own); a verifier that failed
  (``Report.fault``) earns nothing but what an invalid finding already showed."""
  if report.fault and report.verdict != INVALID:
    return Standing(NOT_VERIFIED, ("the verifier failed",))
  return standing_of(report.verdict, [f.code for f in report.findings],
                     {c.name: c.status for c in report.claims},
                     [{"mode": c.mode, "status": c.status} for c in report.checks
                      if c.kind == "update" and c.challenged],
                     report.challenger_kind == "self", start_base(report.claims))
