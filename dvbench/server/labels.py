"""Honest labels: who chose a proof's checks, how many were answered and replayed, what escaped.

Used by the proof JSON and the pages, so both say the same.

Example::

  summary = challenge_summary(proof, challenger, challenge_rows, checks)
  summary["label"]  # 'verified: 7 server-chosen update checks replayed at p = 0.1; ...'
"""

import json

from zkdv import challenge

SELF_AUDITED = "self-audited (detects faults, not a dishonest prover)"


def _counts(rows: list[dict], checks: list[dict]) -> dict:
  needed = {k: sum(r[f"needs_{k}"] for r in rows) for k in challenge.ANSWER_KINDS}
  answered = sum(r[f"needs_{k}"] and r[f"answered_{k}"] for r in rows
                 for k in challenge.ANSWER_KINDS)
  update_steps = {r["step"] for r in rows if r["needs_update"]}
  replayed = sum(c["kind"] == "update" and c["status"] == "verified" and c["step"] in update_steps
                 for c in checks)
  return {"steps": len(rows), **needed, "answered": answered,
          "required": sum(needed.values()), "update_replayed": replayed}


def label(state: str, chooser: str, p: float, counts: dict, failure: str | None) -> str:
  if state == "invalid":
    return f"invalid: {failure}"
  if chooser == "self":
    return SELF_AUDITED if state == "self-audited" else f"{state}; {SELF_AUDITED}"
  if state == "verified":
    return (f"verified: {counts['update_replayed']} server-chosen update checks replayed at "
            f"p = {p:g}; one faked step escapes with probability "
            f"{challenge.escape_probability(p):.3g}")
  if state == "unchallenged":
    return (f"unchallenged: the server chose no update check (p = {p:g}), so nothing was "
            "replayed against a dishonest prover")
  return state


def challenge_summary(proof: dict, challenger: dict | None, rows: list[dict],
                      checks: list[dict]) -> dict:
  """The fields of the proof JSON that say what its state means."""
  chooser = challenger["kind"] if challenger else "self"
  policy = json.loads(challenger["policy"]) if challenger else None
  p = policy["update_check_probability"] if policy else 0.0
  counts = _counts(rows, checks)
  return {"challenger": chooser, "policy": policy, "update_check_probability": p,
          "escape_probability_one_faked_step": challenge.escape_probability(p),
          "server_challenges": counts,
          "label": label(proof["state"], chooser, p, counts, proof["failure"])}
