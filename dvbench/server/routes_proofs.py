"""Experiments, proof slots, bound roots, and what anyone may read of a proof.

Example::

  routes = proof_routes(service)  # named routes, e.g. url_path_for("proof", proof_id=...)
"""

import itertools
import json
import math
import secrets

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dvbench import transport
from dvbench.server import attempts
from dvbench.server import custody
from dvbench.server import labels
from dvbench.server.paging import fetch_page, paged
from dvbench.server.decoding import decode
from dvbench.server.db import run_columns
from dvbench.server.service import MINIMUM_POLICY_SETTING, Service, check_name
from dvbench.server.store_custody import SlotTaken
from zkdv import challenge
from zkdv import records
from zkdv.transcript import record_id

_CBOR = "application/cbor"
_DVBENCH_FIELDS = {"kind", "server_key", "nonce", "key_commitment", "owner", "experiment",
                   "policy"}
_SELF_FIELDS = {"kind", "seed_commitment", "policy"}


def public_proof(p: dict) -> dict:
  """A proof row as the API shows it (``run_name`` and ``tags``: declared by the prover;
  ``ended_at``: when it stopped receiving, or None)."""
  return {"id": p["id"], "experiment": p.get("experiment"), "name": p["name"],
          "run_name": p.get("run_name"), "tags": json.loads(p.get("tags") or "[]"),
          "state": p["state"], "failure": p["failure"], "records": p["records"],
          "steps": p["steps"], "final_params": p["final_params"],
          "created_at": p["created_at"], "updated_at": p["updated_at"],
          "ended_at": p.get("ended_at")}


def json_number(value):
  """A stored number as JSON can carry it: non-finite floats and integers beyond 2**53
  become strings (``"inf"``, ``"nan"``, ``"18446744073709551615"``)."""
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 1 << 53:
    return str(value)
  return value


def _policy(challenger: dict) -> challenge.Policy:
  try:
    return challenge.Policy.from_record(challenger.get("policy"))
  except (ValueError, TypeError) as e:
    raise HTTPException(409, f"the root's challenger policy is not acceptable: {e}") from None


class RootBinding:
  """Checks that a root is bound to this server, experiment and an unused slot."""

  def __init__(self, service: Service, experiment: dict):
    self.service, self.experiment = service, experiment

  def challenger_row(self, root: dict, proof_id: str) -> dict:
    """``{"kind", "nonce", "policy"}`` to store, or 409 naming what does not match.

    The slot may already hold ``proof_id`` itself: the same root sent again meanwhile.
    """
    challenger = root.get("challenger")
    if not isinstance(challenger, dict) or challenger.get("kind") not in challenge.CHALLENGER_KINDS:
      raise HTTPException(409, "the root has no challenger: a proof for DVBench starts from a "
                          "slot (POST /api/v1/experiments/OWNER/NAME/slots).")
    if challenger["kind"] == "self":
      if set(challenger) != _SELF_FIELDS:
        raise HTTPException(409, f"a self challenger has exactly the fields {sorted(_SELF_FIELDS)}.")
      return {"kind": "self", "nonce": None,
              "policy": json.dumps(_policy(challenger).to_record())}
    if set(challenger) != _DVBENCH_FIELDS:
      raise HTTPException(409, f"a dvbench challenger has exactly the fields "
                          f"{sorted(_DVBENCH_FIELDS)}.")
    nonce = self._slot_nonce(challenger, proof_id)
    return {"kind": "dvbench", "nonce": nonce,
            "policy": json.dumps(_policy(challenger).to_record())}

  def _slot_nonce(self, challenger: dict, proof_id: str) -> str:
    nonce = challenger["nonce"]
    slot = self.service.store.slot(nonce.hex()) if isinstance(nonce, bytes) else None
    full = self.experiment["full_name"]
    if slot is None or slot["experiment_id"] != self.experiment["id"]:
      raise HTTPException(409, f"the root's nonce was not issued to '{full}' by this server: "
                          "a root is bound to the slot of its own experiment.")
    if slot["proof_id"] not in (None, proof_id):
      raise HTTPException(409, f"the root's nonce was already used by proof {slot['proof_id']}; "
                          "every proof takes a fresh slot.")
    expected = {"server_key": self.service.server_key, "owner": full.split("/")[0],
                "experiment": full,
                "key_commitment": challenge.key_commitment(slot["challenge_key"])}
    wrong = sorted(k for k, v in expected.items() if challenger[k] != v)
    if wrong:
      raise HTTPException(409, f"the root's challenger does not match its slot in {wrong}.")
    weaker = _policy(challenger).weaker_than(custody.stored_policy(slot["policy"]))
    if weaker:
      raise HTTPException(409, f"the root's policy is weaker than the server's minimum in "
                          f"{weaker}.")
    return nonce.hex()


class ProofRoutes:
  """Handlers; database work runs in the thread pool."""

  def __init__(self, service: Service):
    self.service, self.store = service, service.store

  async def list_experiments(self, request):
    return await paged(request, self.store.page_experiments)

  async def create_experiment(self, request):
    body = await self.service.body(request)

    def create():
      try:
        owner, name = json.loads(body)["name"].split("/")
      except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise HTTPException(400, "send JSON {\"name\": \"owner/name\"}.") from None
      return self.service.writable_experiment(request, owner, name)
    return JSONResponse(await run_in_threadpool(create))

  async def get_experiment(self, request):
    """The experiment with one page of its proofs, newest first (``limit``, ``after``)."""
    full = check_name(request.path_params["owner"], request.path_params["name"])
    exp = await run_in_threadpool(self.store.experiment, full)
    if exp is None:
      raise HTTPException(404, f"unknown experiment '{full}'.")
    proofs, headers = await run_in_threadpool(fetch_page, request, self.store.page_proofs,
                                              experiment_id=exp["id"])
    counted = await run_in_threadpool(attempts.owner_attempts, self.store, full.split("/")[0])
    return JSONResponse({**exp, "proofs": [public_proof(p) for p in proofs],
                         "proofs_next_after": headers.get("x-next-after"),
                         "attempts": attempts.describe(
                             counted, self.service.minimum_policy.update_check_probability)},
                        headers=headers)

  async def create_slot(self, request):
    """A one-time nonce, the commitment to a fresh key K, the server key and minimum policy."""
    owner, name = request.path_params["owner"], request.path_params["name"]

    def create():
      exp = self.service.writable_experiment(request, owner, name)
      attempts.check_slot_rate(self.store, owner, self.service.max_slots_per_hour)
      nonce, key = secrets.token_bytes(32), challenge.new_key()
      policy = self.service.minimum_policy.to_record()
      self.store.create_slot(nonce.hex(), exp["id"], key, json.dumps(policy))
      return {"nonce": nonce.hex(), "key_commitment": challenge.key_commitment(key).hex(),
              "server_key": self.service.server_key.hex(), "policy": policy}
    return JSONResponse(await run_in_threadpool(create), status_code=201)

  async def create_proof(self, request):
    root = await self.service.body(request)
    owner, name = request.path_params["owner"], request.path_params["name"]

    def create():
      exp = self.service.writable_experiment(request, owner, name)
      record = decode(root, "the root record", canonical=True,
                      max_string=transport.MAX_RECORD_STRING)
      if not isinstance(record, dict) or record.get("type") != "root" or "prev" in record:
        raise HTTPException(400, "a proof starts with its root record (type 'root', no prev).")
      try:
        records.check_record(record, "the root record")
      except records.Invalid as e:
        raise HTTPException(400, str(e)) from None
      proof_id = record_id(root).hex()
      existing = self.store.proof(proof_id)
      if existing is not None:
        if existing["experiment_id"] != exp["id"]:
          raise HTTPException(409, f"proof {proof_id} belongs to experiment "
                              f"'{existing['experiment']}'.")
        return existing  # the same root again
      self.service.quota.check_open_proofs(owner)
      self.service.quota.check_storage(owner, len(root))
      challenger = RootBinding(self.service, exp).challenger_row(record, proof_id)
      try:
        return self.store.create_proof(exp["id"], proof_id, str(record.get("name", ""))[:400],
                                       root, challenger, run_columns(record))
      except SlotTaken:
        raise HTTPException(409, "the root's nonce was used meanwhile by another proof; every "
                            "proof takes a fresh slot.") from None
    return JSONResponse({**public_proof(await run_in_threadpool(create)),
                         **self.service.client_settings()}, status_code=201)

  async def discard_proof(self, request):
    """Deletes a proof that never sent a step (its client replaced or closed it); 409 for
    any other."""
    def discard():
      proof = self.service.proof_for_write(request, request.path_params["proof_id"])
      refused = self.store.discard_unstarted_proof(proof["id"])
      if refused is not None:
        raise HTTPException(409, f"{refused}.")
    await run_in_threadpool(discard)
    return Response(status_code=204)

  async def proof_alive(self, request):
    """A client's heartbeat while it sends nothing (a long step); 409 once the proof takes no
    more records (it crashed meanwhile, or closed)."""
    def touch():
      proof = self.service.proof_for_write(request, request.path_params["proof_id"])
      state = self.store.touch_proof(proof["id"])
      if state != "receiving":
        raise HTTPException(409, f"proof {proof['id']} is {state}; it takes no more records.")
    await run_in_threadpool(touch)
    return Response(status_code=204)

  async def resume_proof(self, request):
    """Reopens a proof whose run stopped before ``finish()`` for its resumed run: the
    client then reads the stored records and challenges and goes on from the last
    committed state (``zkdv.jax.resume``); 409 for a finished proof."""
    def reopen():
      proof = self.service.proof_for_write(request, request.path_params["proof_id"])
      if proof["state"] == "crashed":
        self.service.quota.check_open_proofs(proof["experiment"].split("/")[0])
      refused = self.store.reopen_proof(proof["id"])
      if refused is not None:
        raise HTTPException(409, f"{refused}; start a new proof.")
      return self.service.proof_or_404(proof["id"])
    return JSONResponse({**public_proof(await run_in_threadpool(reopen)),
                         **self.service.client_settings()})

  def proof_json(self, proof_id: str) -> dict:
    proof = self.service.proof_or_404(proof_id)
    summary = labels.challenge_summary(proof, self.store.challenger(proof_id),
                                       self.store.challenge_counts(proof_id),
                                       self.store.job("proof", proof_id),
                                       claims=self.store.proof_claims(proof_id),
                                       attempts=attempts.owner_attempts(
                                           self.store, proof["experiment"].split("/")[0]))
    return {**public_proof(proof), **summary,
            **labels.replayed_checks(self.store.check_tally(proof_id))}

  async def get_proof(self, request):
    return JSONResponse(await run_in_threadpool(self.proof_json, request.path_params["proof_id"]))

  async def get_checks(self, request):
    return await paged(request, self.store.page_checks, request.path_params["proof_id"],
                       convert=lambda r: {k: json_number(v) for k, v in r.items()})

  async def get_record_ids(self, request):
    return await paged(request, self.store.page_record_ids, request.path_params["proof_id"],
                       convert=bytes.hex)

  async def get_challenges(self, request):
    """The derived challenges with their decisions and answers (a resuming client's view)."""
    return await paged(request, self.store.page_challenges, request.path_params["proof_id"],
                       convert=lambda r: {**{k: v for k, v in r.items() if k != "proof_id"},
                                          "record_id": r["record_id"].hex(),
                                          "challenge": r["challenge"].hex()})

  async def get_transcript(self, request):
    """The records as one CBOR sequence, streamed a part at a time
    (``transcript_parts``): a reader holds a page of records or a part of a large one, not
    the transcript (a few readers of a few GB took the server's memory, and idle readers of
    one 60 MB record 120 MB each). The first part is read before the answer starts, so a
    transcript the server cannot read answers 503 (a later damaged part cuts the stream
    short)."""
    proof_id = request.path_params["proof_id"]
    await run_in_threadpool(self.service.proof_or_404, proof_id)
    parts = self.store.transcript_parts(proof_id)
    first = await run_in_threadpool(next, parts, b"")
    return StreamingResponse(itertools.chain([first], parts),  # a sync iterator: in a thread
                             media_type=_CBOR)

  async def get_receipt(self, request):
    proof = await run_in_threadpool(self.service.proof_or_404, request.path_params["proof_id"])
    data = await run_in_threadpool(self.store.receipt, proof["id"])
    if data is None:
      raise HTTPException(404, f"proof {proof['id']} has no receipt: it is {proof['state']} "
                          "(receipts come after the server's replay, and only for "
                          "server-challenged proofs).")
    return Response(data, media_type=_CBOR)

  async def server_key(self, request):
    """The public key receipts are signed with, and the minimum policy slots carry."""
    policy = await run_in_threadpool(self.store.setting, MINIMUM_POLICY_SETTING)
    return JSONResponse({"server_key": self.service.server_key.hex(),
                         "policy": json.loads(policy)})


def proof_routes(service: Service) -> list[Route]:
  api = ProofRoutes(service)
  return [
      Route("/api/v1/server-key", api.server_key, name="server_key"),
      Route("/api/v1/experiments", api.list_experiments, methods=["GET"], name="experiments"),
      Route("/api/v1/experiments", api.create_experiment, methods=["POST"],
            name="create_experiment"),
      Route("/api/v1/experiments/{owner}/{name}", api.get_experiment, name="experiment"),
      Route("/api/v1/experiments/{owner}/{name}/slots", api.create_slot, methods=["POST"],
            name="slots"),
      Route("/api/v1/experiments/{owner}/{name}/proofs", api.create_proof, methods=["POST"],
            name="create_proof"),
      Route("/api/v1/proofs/{proof_id}", api.get_proof, name="proof"),
      Route("/api/v1/proofs/{proof_id}", api.discard_proof, methods=["DELETE"],
            name="discard_proof"),
      Route("/api/v1/proofs/{proof_id}/alive", api.proof_alive, methods=["POST"],
            name="proof_alive"),
      Route("/api/v1/proofs/{proof_id}/resume", api.resume_proof, methods=["POST"],
            name="resume_proof"),
      Route("/api/v1/proofs/{proof_id}/checks", api.get_checks, name="proof_checks"),
      Route("/api/v1/proofs/{proof_id}/records", api.get_record_ids, name="proof_records"),
      Route("/api/v1/proofs/{proof_id}/challenges", api.get_challenges, name="proof_challenges"),
      Route("/api/v1/proofs/{proof_id}/transcript", api.get_transcript, name="proof_transcript"),
      Route("/api/v1/proofs/{proof_id}/receipt", api.get_receipt, name="proof_receipt"),
  ]
