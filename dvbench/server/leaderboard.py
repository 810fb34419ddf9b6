"""A benchmark's leaderboard: every submission with its audit, ranked only when earned.

One entry per (benchmark, proof), one per checkpoint: a checkpoint that equals the final
params of a proof that closed earlier is a copy of that proof's (its blobs were public once it
closed) and is refused at submission and never ranked. Entries with equal values share a rank
("competition" ranking: 1, 1, 3). Each entry shows its owner's attempts (every proof slot the
owner took, ``attempts.owner_attempts``), since a prover may retry until its probes miss.

Example::

  entries = leaderboard_entries(store, bench, parse_definition(bench["definition"]))
  [(e["rank"], e["value"], e["unranked_because"]) for e in entries]
"""

import math

from dvbench import scoring
from dvbench.server import attempts as attempts_lib
from dvbench.server import labels
from dvbench.server import pins
from dvbench.server.decoding import decode


def public_submission(row: dict) -> dict:
  return {k: row[k] for k in ("id", "proof_id", "state", "value", "failure", "created_at",
                              "updated_at")}


def training_programs(store, proof_id: str) -> list[str]:
  """The hex ids of the update programs a proof's steps ran, in record order."""
  return [decode(r, "a stored program record")["program_id"].hex()
          for r in store.records_of_kind(proof_id, "program")]


def scanned_programs(store, proof_id: str) -> list[tuple[str, str]]:
  """``(what, hex id)`` of every program a proof ran, its training programs and its init
  program: the programs scoring scans for evaluation rows baked in as constants."""
  inits = [("init program", decode(r, "a stored init record")["program_id"].hex())
           for r in store.records_of_kind(proof_id, "init")]
  return [("training program", p) for p in training_programs(store, proof_id)] + inits


def copy_of(store, proof: dict) -> dict | None:
  """The proof that ended first with ``proof``'s final params, when it is another one:
  ``{"id", "experiment"}``; None when ``proof`` is the first (or has no final params)."""
  if not proof["final_params"]:
    return None
  first = store.first_with_final_params(proof["final_params"])
  return None if first is None or first["id"] == proof["id"] else first


def copy_reason(checkpoint: str, first: dict) -> str:
  """Why a copied checkpoint earns nothing, naming the proof it copies."""
  return (f"a copy: its checkpoint {checkpoint[:16]}… equals the final params of proof "
          f"{first['id']} of '{first['experiment']}', which closed first")


def audit(store, proof_id: str) -> dict:
  """What a benchmark entry's proof shows: who challenged, checks replayed, p, 1 − p, start,
  and its owner's attempts."""
  proof = store.proof(proof_id)
  owner = proof["experiment"].split("/")[0]
  summary = labels.challenge_summary(proof, store.challenger(proof_id),
                                     store.challenge_counts(proof_id),
                                     claims=store.proof_claims(proof_id),
                                     attempts=attempts_lib.owner_attempts(store, owner))
  return {"challenger": summary["challenger"],
          "checks_replayed": summary["server_challenges"]["update_replayed"],
          "update_check_probability": summary["update_check_probability"],
          "escape_probability": summary["escape_probability_one_faked_step"],
          "full_replay": summary["full_replay"],
          "start_attested": store.check_tally(proof_id).get(("start", "verified"), 0) > 0,
          "attempts": summary.get("attempts"),
          "proof_state": proof["state"],
          "steps": proof["steps"] - summary["server_challenges"]["discarded"],
          "steps_discarded": summary["server_challenges"]["discarded"],
          **labels.data_standing(store.proof_claims(proof_id)), **_strictness(store, proof_id)}


def _strictness(store, proof_id: str) -> dict:
  """Whether the proof passed ``zkdv verify --strict`` on the server, and what it lacks."""
  shown = store.proof_claims(proof_id) or {"claims": {}, "strict": False}
  unmet = [f"{name}: {status}" for name, status in shown["claims"].items()
           if status != "holds" and name not in labels.STORED_FACTS]
  return {"strict": shown["strict"], "unmet_claims": unmet or (
      [] if shown["strict"] else ["replays: not exact"])}


def _unranked_because(entry: dict, audit_level: str, broken: list[str]) -> list[str]:
  """Why a leaderboard entry is not ranked (``broken``: the start and probe pins it breaks,
  ``pins.check``); empty when it is."""
  reasons = ([] if entry["state"] == "scored" else
             ["not scored: the server could not score it (submit the proof again to score "
              "it again)"] if entry["state"] == scoring.UNSCORED else
             [f"not scored ({entry['state']})"])
  reasons += [f"a pin does not hold: {text}" for text in broken]
  if entry["copy_of"] is not None:
    reasons.append(copy_reason(entry["checkpoint"], entry["copy_of"]))
  if audit_level == "full-replay" and not entry["full_replay"]:
    reasons.append("the benchmark requires a full replay; this proof was not fully replayed")
  if entry["contamination"]:
    reasons.append(f"contaminated: {entry['contamination']} evaluation examples were probed "
                   "in its training batches")
  if entry["outside_training_set"]:
    reasons.append(f"{entry['outside_training_set']} probed rows are outside the registered "
                   "training set")
  if not entry["strict"]:
    reasons.append(f"the proof does not pass --strict ({'; '.join(entry['unmet_claims'])})")
  return reasons


def _pins(entry: dict, audit_level: str, start_pins: dict) -> dict:
  """Per pin of the benchmark's recipe: "holds", "not pinned", or what breaks it
  (``start_pins``: those of the start and the probe ratio, ``pins.check``)."""
  outside = entry["outside_training_set"]
  return {**start_pins, "audit": f"{audit_level}: " + (
              "holds" if audit_level != "full-replay" or entry["full_replay"] else
              "not fully replayed"),
          "training_programs": "holds" if entry["program_pinned"] else "not pinned",
          "training_set": "not pinned" if outside is None else "holds" if not outside else
                          f"{outside} probed rows outside it"}


def rank(entries: list[dict], higher_is_better: bool) -> None:
  """Sets ``rank`` of the ranked entries: 1 + the number of ranked entries strictly better,
  so equal values share a rank (1, 1, 3)."""
  sign = -1 if higher_is_better else 1
  values = sorted(sign * e["value"] for e in entries if e["ranked"])
  for e in entries:
    e["rank"] = None
    if e["ranked"]:
      e["rank"] = 1 + sum(1 for v in values if v < sign * e["value"])


def leaderboard_entries(store, bench: dict, definition: dict, sort: str = "rank") -> list[dict]:
  """Every submission with its audit; ranked: scored, not a copy, its proof passed
  ``--strict`` (every claim holds: server challenges, exact replays, attested start, a program
  that reads the batch, probes), no probed example is in the evaluation set, where the
  benchmark pins a training set every probed row is a proven member of it, and its start and
  probe ratio meet the benchmark's pins (``pins``). ``base_of`` names the proof whose final
  params a fine-tuned entry's base checkpoint is."""
  dirty = store.benchmark_contamination(bench["id"])
  pinned_rows = definition["training_set"] is not None
  outside = store.training_outside(bench["id"]) if pinned_rows else {}
  entries = []
  for s in store.list_submissions(bench["id"]):
    proof = store.proof(s["proof_id"])
    entry = {**public_submission(s), "experiment": s["experiment"],
             **audit(store, s["proof_id"]),
             "checkpoint": proof["final_params"], "copy_of": copy_of(store, proof),
             "program_pinned": bench["allowed_programs"] is not None,
             "training_programs": training_programs(store, s["proof_id"]),
             "contamination": dirty.get(s["proof_id"], 0),
             "training_set_pinned": pinned_rows,
             "outside_training_set": outside.get(s["proof_id"], 0) if pinned_rows else None}
    start = pins.start_of(store, s["proof_id"])
    entry.update(init_program=start["init_program"], base_checkpoint=start["base_checkpoint"],
                 base_of=start["base_of"])
    start_pins, broken = pins.check(definition, start)
    entry["pins"] = _pins(entry, definition["audit"], start_pins)
    entry["unranked_because"] = _unranked_because(entry, definition["audit"], broken)
    entry["ranked"] = not entry["unranked_because"]
    entries.append(entry)
  rank(entries, bench["higher_is_better"])
  sign = -1 if bench["higher_is_better"] else 1
  keys = {"rank": lambda e: e["rank"] or math.inf,
          "value": lambda e: math.inf if e["value"] is None else sign * e["value"],
          "outside_training_set": lambda e: e["outside_training_set"] or 0,
          "attempts": lambda e: (e["attempts"] or {}).get("slots", 0),
          "submitted": lambda e: e["created_at"]}
  return sorted(entries, key=keys.get(sort, lambda e: e[sort]))
