"""Honest labels: who chose a proof's checks, how many were answered and replayed, what escaped.

Used by the proof JSON and the pages, so both say the same.

Example::

  summary = challenge_summary(proof, challenger, store.challenge_counts(proof_id))
  summary["label"]  # 'verified: 7 server-chosen update checks replayed at p = 0.1; ...'
"""

import json
import time

from dvbench.server import attempts as attempts_lib
from zkdv import challenge
from zkdv.verify import claims as claims_lib

STALE_SECONDS = 15.0  # workers report every 5 s while they verify
SELF_AUDITED = "self-audited (detects faults, not a dishonest prover)"
# The audit level a worker stores beside the claims when the verifier reported a full
# replay: every segment replayed, chained from the attested start (docs/protocol.md).
FULL_REPLAY = "full_replay"
# What a worker stores beside the claims when the verifier checked a declared dataset's
# seeded order at every step: "<server-seeded or self-seeded> <dataset root, hex>".
DATA_ORDER = "data_order"
REPLAYED_STATES = claims_lib.REPLAYED_STATES  # their server-chosen update checks replayed
# What a start that holds came from, stored beside the claims: the init program's hex id and,
# for a start from a base checkpoint (proof.init_from), its declared params digest.
INIT_PROGRAM, BASE_CHECKPOINT = "init_program", "base_checkpoint"
# How many stored steps a resume discarded (they ran after the last committed state; no
# segment of theirs ended, so none was replayed), when any did: str(int).
DISCARDED_STEPS = "discarded_steps"
STORED_FACTS = (FULL_REPLAY, INIT_PROGRAM, BASE_CHECKPOINT, DATA_ORDER, DISCARDED_STEPS)


def replayed_checks(tally: dict[tuple[str, str], int]) -> dict:
  """``{"checks", "checks_verified"}`` of a proof's ``Store.check_tally``."""
  return {"checks": sum(tally.values()),
          "checks_verified": sum(n for (_, status), n in tally.items() if status == "verified")}


def progress(job: dict | None, now: float | None = None) -> str:
  """What a running verification is doing, e.g. 'attempt 1, running for 12 s, its worker
  reported 2 s ago'; a silent worker is named as such."""
  if job is None or job["state"] != "running" or job["started_at"] is None:
    return "waiting for a worker"
  now = time.time() if now is None else now
  if job["lease_expires"] is not None and job["lease_expires"] <= now:
    return f"attempt {job['attempts']} ended because {job['failure']}; waiting for a worker"
  silent = now - (job["heartbeat_at"] or job["started_at"])
  text = f"attempt {job['attempts']}, running for {now - job['started_at']:.0f} s"
  if silent > STALE_SECONDS:
    return (f"{text}; its worker has not reported for {silent:.0f} s, so another worker takes "
            "the job when its lease expires")
  return f"{text}, its worker reported {silent:.0f} s ago"


def label(state: str, chooser: str, p: float, counts: dict, failure: str | None,
          job: dict | None = None, full_replay: bool = False,
          standing: claims_lib.Standing | None = None) -> str:
  """E.g. 'verified steps — start unattested: 3 server-chosen update checks replayed at
  p = 0.1; one faked segment escapes with probability 0.9'."""
  if state == "unverifiable":  # the verification failed: no verdict, the failure says why
    return failure or "could not verify"
  if state in ("invalid", "abandoned", "crashed"):
    return f"{state}: {failure}"
  if state in ("closed", "verifying"):
    return f"{state}: {progress(job)}"
  if chooser == "self":
    return SELF_AUDITED if state == "self-audited" else f"{state}; {SELF_AUDITED}"
  standing = standing or claims_lib.Standing(state)
  if state == claims_lib.VERIFIED_ALL and full_replay:
    kept = counts["steps"] - counts["discarded"]
    n = counts["discarded"]
    dropped = f"; a resume discarded {n} more step{'s' * (n > 1)}, not replayed" if n else ""
    return (f"{standing.label} (full replay): every one of {kept} steps re-executed "
            f"by the server's workers from the attested start ({counts['update_replayed']} "
            f"segments){dropped}")
  if state in REPLAYED_STATES:
    return (f"{standing.label}: {counts['update_replayed']} "
            f"server-chosen update checks replayed at p = {p:g}; one faked segment escapes "
            f"with probability {challenge.escape_probability(p):.3g}")
  if state == "unchallenged":
    return (f"unchallenged: the server chose no update check (p = {p:g}), so nothing was "
            "replayed against a dishonest prover")
  return state


def is_full_replay(claims: dict | None) -> bool:
  """Whether the stored claims (``Store.proof_claims``) show a full replay."""
  return bool(claims) and claims["claims"].get(FULL_REPLAY) == "holds"


def start_facts(report: dict, claims: dict) -> dict:
  """``{INIT_PROGRAM, BASE_CHECKPOINT}`` of a verifier's report whose start claim holds
  (``claims``: ``worker.server_claims``); {} otherwise."""
  if claims.get("start") != "holds":
    return {}
  facts = next(c.get("facts") or {} for c in report["claims"] if c["name"] == "start")
  return {k: facts[k] for k in (INIT_PROGRAM, BASE_CHECKPOINT) if facts.get(k)}


def discarded_facts(report: dict) -> dict:
  """``{DISCARDED_STEPS: "n"}`` of a verifier's report whose replays claim counts steps a
  resume discarded; {} when none were."""
  facts = next((c.get("facts") or {} for c in report.get("claims", [])
                if c["name"] == "replays"), {})
  n = facts.get("steps_discarded")
  return {DISCARDED_STEPS: str(n)} if isinstance(n, int) and n > 0 else {}


def discarded_steps(claims: dict | None) -> int:
  """How many of a proof's stored steps a resume discarded, from its stored claims."""
  return int((claims or {}).get("claims", {}).get(DISCARDED_STEPS, 0))


def data_facts(report: dict, claims: dict) -> dict:
  """``{DATA_ORDER: "<seeded> <dataset root>"}`` of a verifier's report whose data claim
  holds with a checked data order (``zkdv.verify.order``); {} otherwise."""
  if claims.get("data") != "holds":
    return {}
  facts = next(c.get("facts") or {} for c in report["claims"] if c["name"] == "data")
  return {DATA_ORDER: f"{facts['order']} {facts['dataset']}"} if facts.get("order") else {}


def data_standing(claims: dict | None) -> dict:
  """What a proof shows of its data, from its stored claims: ``{"data": "order
  server-seeded" | "order self-seeded" | "probed" | "unknown", "dataset": root hex or None}``.
  """
  stored = (claims or {}).get("claims", {})
  order = stored.get(DATA_ORDER)
  if isinstance(order, str) and " " in order:
    seeded, root = order.split(" ", 1)
    return {"data": f"order {seeded}", "dataset": root}
  return {"data": "probed" if stored.get("data") == "holds" else "unknown", "dataset": None}


def stored_standing(state: str, claims: dict | None) -> claims_lib.Standing:
  """The standing of a proof in ``state`` from its stored claims: what keeps it from
  verified, and the base checkpoint it started from."""
  return claims_lib.Standing(state, shortfalls_of(state, claims),
                             (claims or {}).get("claims", {}).get(BASE_CHECKPOINT))


def shortfalls_of(state: str, claims: dict | None) -> tuple:
  """What keeps a proof in ``state`` from ``verified``, from its stored claims."""
  if state not in REPLAYED_STATES[1:] or not claims:
    return ()
  return claims_lib.shortfalls(claims["claims"])


def challenge_summary(proof: dict, challenger: dict | None, counts: dict,
                      job: dict | None = None, claims: dict | None = None,
                      attempts: dict | None = None) -> dict:
  """The fields of the proof JSON that say what its state means (``counts``: its
  ``Store.challenge_counts``; ``job``: its verification job, for the progress of a running
  one; ``claims``: the stored claims of the server's verification, which say whether it was
  a full replay and what keeps it from verified; ``attempts``: its owner's,
  ``attempts.owner_attempts``)."""
  chooser = challenger["kind"] if challenger else "self"
  policy = json.loads(challenger["policy"]) if challenger else None
  p = policy["update_check_probability"] if policy else 0.0
  counts = {**counts, "discarded": discarded_steps(claims)}
  full = chooser == "dvbench" and proof["state"] == "verified" and is_full_replay(claims)
  standing = stored_standing(proof["state"], claims)
  short = standing.shortfalls
  text = label(proof["state"], chooser, p, counts, proof["failure"], job, full, standing)
  summary = {"challenger": chooser, "policy": policy, "update_check_probability": p,
             "escape_probability_one_faked_step": 0.0 if full else challenge.escape_probability(p),
             "full_replay": full, "server_challenges": counts, "shortfalls": list(short),
             "base_checkpoint": standing.base,
             "init_program": (claims or {}).get("claims", {}).get(INIT_PROGRAM),
             "ranked_state": proof["state"] == claims_lib.VERIFIED_ALL, "label": text,
             **data_standing(claims)}
  if attempts is not None and chooser == "dvbench":
    described = attempts_lib.describe(attempts, 1.0 if full else p)
    summary["attempts"] = described
    summary["label"] = (f"{text}; over its owner's {max(attempts['slots'], 1)} attempts, one "
                        f"faked segment gets past at least once with probability "
                        f"{described['escape_probability_over_attempts']:.3g}")
  return summary
