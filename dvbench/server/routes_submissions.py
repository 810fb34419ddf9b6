"""Benchmark submissions: a verified proof's checkpoint, checked, then scored by the server.

A submission names a proof and its checkpoint (the proof's final params); it is refused
(409, naming what) unless the proof was verified at the benchmark's audit level with its
allowed programs, the checkpoint is exactly the proof's final params, uploaded, and no
earlier proof holds the same checkpoint, and unless its training-set membership proofs
hold. The server then scores it in shards on the benchmark's rows.

Example::

  routes = SubmissionRoutes(service)
  # POST /api/v1/benchmarks/{owner}/{name}/submissions   routes.submit
  # GET  /api/v1/submissions/{submission_id}             routes.get_submission
"""

import json

import blake3
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from dvbench import contamination
from dvbench import scoring
from dvbench.server import labels
from dvbench.server import leaderboard
from dvbench.server import pins
from dvbench.server.benchmark_requests import (bad, benchmark_or_404, parse_definition,
                                               parse_submission)
from dvbench.server.service import Service
from zkdv import challenge
from zkdv import digest
from zkdv import merkle

_STATE_REASONS = {
    "self-audited": "its prover chose its own checks (detects faults, not a dishonest prover)",
    "unchallenged": "the server chose no update check in it, so nothing was replayed",
}


def _leaves(layouts: list[digest.LeafLayout]) -> str:
  shown = ", ".join(f"{l.path} {l.dtype}{list(l.shape)}" for l in layouts[:8])
  return f"[{shown}{', …' if len(layouts) > 8 else ''}]"


class SubmissionRoutes:
  """Submissions of verified checkpoints to a benchmark, and their progress."""

  def __init__(self, service: Service):
    self.service, self.store = service, service.store


  async def submit(self, request):
    body = await self.service.body(request)

    def submit():
      bench = benchmark_or_404(self.store, request)
      spec = parse_submission(body)
      proof = self.service.proof_or_404(spec["proof_id"])
      who = self.service.owner(request)
      if proof["experiment"].split("/")[0] != who:
        raise HTTPException(403, f"token of '{who}' cannot submit the checkpoint of proof "
                            f"{proof['id']} of '{proof['experiment']}': a checkpoint is "
                            "submitted by the owner of the proof that produced it.")
      definition = parse_definition(bench["definition"])
      self._check_audit(bench, definition, proof)
      self._check_checkpoint(definition, proof, spec)
      members = self._training_members(bench, definition, proof, spec["training_proofs"])
      existing = self.store.benchmark_submission(bench["id"], proof["id"])
      # One entry per (benchmark, proof): another encoding of the same submission is it.
      submission_id = existing["id"] if existing else blake3.blake3(
          bench["full_name"].encode() + b"\0" + proof["id"].encode()).hexdigest()
      shards = scoring.shard_ranges(definition["rows"], definition["batch_rows"],
                                    self.service.score_shard_rows)
      return self.store.add_submission({"id": submission_id, "benchmark_id": bench["id"],
                                        "proof_id": proof["id"], "record": body},
                                       shards, members), 200 if existing else 201
    row, status = await run_in_threadpool(submit)
    return JSONResponse(leaderboard.public_submission(row), status_code=status)

  def _check_audit(self, bench: dict, definition: dict, proof: dict) -> None:
    """409 unless the proof's audit meets the benchmark's (state, audit level, programs)."""
    if proof["state"] not in labels.REPLAYED_STATES:
      reason = _STATE_REASONS.get(proof["state"], "only proofs whose server-chosen checks "
                                  "were replayed are scored")
      raise HTTPException(409, f"proof {proof['id']} is {proof['state']}, not verified: "
                          f"{reason}.")
    audit_checks = {"min-probability": self._check_min_probability,
                     "full-replay": self._check_full_replay}
    audit_checks[definition["audit"]](bench, proof)
    self._check_programs(bench, proof)
    broken = pins.check(definition, pins.start_of(self.store, proof["id"]))[1]
    if broken:
      raise HTTPException(409, f"proof {proof['id']} does not meet the pins of "
                          f"'{bench['full_name']}': {'; '.join(broken)}.")

  def _check_min_probability(self, bench: dict, proof: dict) -> None:
    challenger = self.store.challenger(proof["id"])
    p = json.loads(challenger["policy"])["update_check_probability"]
    if challenger["kind"] != "dvbench" or p < bench["min_update_check_probability"]:
      raise HTTPException(409, f"proof {proof['id']} was checked at p = {p:g}; "
                          f"'{bench['full_name']}' requires server-chosen update checks at p "
                          f">= {bench['min_update_check_probability']:g}.")

  def _check_full_replay(self, bench: dict, proof: dict) -> None:
    challenger = self.store.challenger(proof["id"])
    if challenger["kind"] != "dvbench" or not labels.is_full_replay(
        self.store.proof_claims(proof["id"])):
      p = json.loads(challenger["policy"])["update_check_probability"]
      raise HTTPException(409, f"'{bench['full_name']}' requires a full replay: every step "
                          "re-executed by the server's workers from an attested start "
                          "(SamplingPolicy(full_replay=True) and proof.init); proof "
                          f"{proof['id']} was checked at p = {p:g}.")

  def _check_programs(self, bench: dict, proof: dict) -> None:
    if bench["allowed_programs"] is not None:
      allowed = set(json.loads(bench["allowed_programs"]))
      used = set(leaderboard.training_programs(self.store, proof["id"]))
      if not used or not used <= allowed:
        raise HTTPException(409, f"proof {proof['id']} trained with programs "
                            f"{sorted(p[:16] for p in used - allowed)} that "
                            f"'{bench['full_name']}' does not allow (it pins "
                            f"{sorted(p[:16] for p in allowed)}).")

  def _check_checkpoint(self, definition: dict, proof: dict, spec: dict) -> None:
    """409 unless the params are the benchmark's layout, the proof's final params, uploaded."""
    expected = definition["params_layout"]
    if spec["params_layout"] != expected or len(spec["params_blobs"]) != len(expected):
      raise HTTPException(409, f"the checkpoint's leaves {_leaves(spec['params_layout'])} are "
                          f"not the benchmark's {_leaves(expected)}.")
    checkpoint = digest.state_digest_from_leaves(spec["params_layout"], spec["params_blobs"])
    if checkpoint.hex() != proof["final_params"]:
      raise HTTPException(409, f"the checkpoint's params digest {checkpoint.hex()} is not the "
                          f"final_params {proof['final_params']} of proof {proof['id']}: a "
                          "submission scores exactly the params the proof attested.")
    missing = [b.hex() for b in spec["params_blobs"]
               if not self.store.has_proof_blob(proof["id"], b.hex())]
    if missing:
      raise HTTPException(409, f"{len(missing)} checkpoint blobs were not uploaded for proof "
                          f"{proof['id']} (first {missing[0]}).")
    first = leaderboard.copy_of(self.store, proof)
    if first is not None:
      raise HTTPException(409, f"refused: {leaderboard.copy_reason(checkpoint.hex(), first)}; "
                          "one entry per checkpoint, the first proof's.")

  def _training_members(self, bench: dict, definition: dict, proof: dict,
                        entries: list) -> list[str]:
    """The probed rows of ``proof`` that ``entries`` prove members of the benchmark's
    training set (a Merkle proof that fails is refused with 409, never counted)."""
    pin, name = definition["training_set"], bench["full_name"]
    if pin is None:
      if entries:
        raise bad("training_proofs", f"'{name}' registers no training set; send none.")
      return []
    probed = self.store.probed_rows(proof["id"])
    if not probed:
      raise HTTPException(409, f"proof {proof['id']} probed no batch rows, so its rows cannot "
                          f"be shown to be in the training set '{name}' pins: train with "
                          "proof.start(probe_ratio=...) above 0 (a step is probed with "
                          f"probability min(1, {challenge.PROBE_GROUPS} * probe_ratio), so "
                          "a run of a few steps at a small ratio may probe none: raise it "
                          "or train longer).")
    if len(entries) > len(probed):
      raise bad("training_proofs", f"at most one per probed row ({len(probed)}).")
    members = set()
    for row, index, path in entries:
      name_of_row = contamination.row_digest(row).hex()
      if name_of_row in members:
        raise bad("training_proofs", f"row {name_of_row} is proven twice.")
      if name_of_row not in probed:
        raise HTTPException(409, f"row {name_of_row} is not a probed row of proof "
                            f"{proof['id']}: training_proofs prove the rows its probes opened.")
      if not merkle.verify_inclusion(merkle.leaf_hash(row), index, pin["size"], path,
                                     pin["root"]):
        raise HTTPException(409, f"the membership proof of probed row {name_of_row} (index "
                            f"{index}) does not lead to the root {pin['root'].hex()} of the "
                            f"training set '{name}' pins.")
      members.add(name_of_row)
    return sorted(members)

  async def get_submission(self, request):
    def submission():
      row = self.store.submission(request.path_params["submission_id"])
      if row is None:
        raise HTTPException(404, "unknown submission.")
      return {**leaderboard.public_submission(row),
              "shards": self.store.shard_progress(row["id"])}
    return JSONResponse(await run_in_threadpool(submission))
