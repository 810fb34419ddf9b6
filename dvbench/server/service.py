"""What every route module shares: the store, the blobs, the server key, request checks.

Example::

  service = Service(store, blobs, signing_key, minimum_policy=Policy(0.1))
  body = await service.body(request)
  stored = await service.receive_blob(request, digest)  # after checking who may write it
  proof = service.proof_for_write(request, proof_id)
"""

import dataclasses
import json
import re
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric import ed25519
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request

from dvbench.server.attempts import DEFAULT_MAX_SLOTS_PER_HOUR
from dvbench.server.blobs import BlobStore
from dvbench.server.db import Store
from dvbench.server.guard import LOCKOUT, MISSING_TOKEN, request_token
from dvbench.server.limits import Limits, Quotas
from dvbench.server.ingest_processes import IngestProcesses
from dvbench.server.quotas import QUOTAS_SETTING, QuotaKeeper
from dvbench.server.refusals import parse_int
from dvbench.server.store_tokens import NAME, NAME_RULE
from zkdv import challenge
from zkdv import receipt

HEX_ID = re.compile(r"[0-9a-f]{64}")
_WRITE_BYTES = 1 << 20  # blob body bytes held in memory before they are written out
MINIMUM_POLICY_SETTING = "minimum_policy"


def check_name(owner: str, name: str) -> str:
  """``owner/name`` after checking both parts, e.g. ``check_name("alice", "mlp")``."""
  if not (NAME.fullmatch(owner) and NAME.fullmatch(name)):
    raise HTTPException(400, f"experiment names are 'owner/name', each {NAME_RULE}.")
  return f"{owner}/{name}"


@dataclasses.dataclass
class Service:
  """The server's state, shared by the route modules of one process."""

  store: Store
  blobs: BlobStore
  signing_key: ed25519.Ed25519PrivateKey
  minimum_policy: challenge.Policy = challenge.Policy(update_check_probability=0.1,
                                                      rolling_window=256, segment_length=32)
  limits: Limits = Limits()
  score_shard_rows: int = 1 << 16  # evaluation rows per scoring job, at most
  memory_bytes: int = 16 << 30  # limits of a child process that loads an uploaded program
  time_limit: int = 3600
  workers: Callable[[], dict] | None = None  # {"alive", "expected", "restarts"} for /health
  isolation: str = ""  # what confines the verifier child, for /health
  sandbox_missing: dict[str, str] = dataclasses.field(default_factory=dict)  # {protection: why}
  ingest_processes: IngestProcesses | None = None  # None: ingestion runs in threads
  crash_after: float = 600.0  # a receiving proof silent this long is crashed (or discarded)
  max_slots_per_hour: int = DEFAULT_MAX_SLOTS_PER_HOUR  # proof slots per owner (attempts)
  quotas: Quotas = Quotas()

  @property
  def heartbeat_seconds(self) -> float:
    """How often an idle client says it is alive: well within ``crash_after``."""
    return min(30.0, self.crash_after / 4)

  def client_settings(self) -> dict:
    """What a proof's uploader adapts to, sent as the proof is created or resumed: how
    often to say it is alive, and the largest request body (its envelopes stay under)."""
    return {"heartbeat_seconds": self.heartbeat_seconds, "max_body_bytes": self.limits.max_body}

  def __post_init__(self):
    self.server_key = receipt.public_key_bytes(self.signing_key)
    self.store.put_setting(MINIMUM_POLICY_SETTING, json.dumps(self.minimum_policy.to_record()))
    self.store.put_setting(QUOTAS_SETTING, json.dumps({
        **dataclasses.asdict(self.quotas), "slots_per_hour": self.max_slots_per_hour}))
    self.quota = QuotaKeeper(self.store, self.blobs, self.quotas)

  async def body(self, request: Request) -> bytes:
    """The request's body, read only once its token is known (``Guard`` bounds size and time)."""
    await run_in_threadpool(self.owner, request)
    return await request.body()

  async def receive_blob(self, request: Request, digest: str) -> bool:
    """Streams the request's body to a temporary file while hashing it (in worker threads,
    ``_WRITE_BYTES`` at a time) and renames it to ``digest``; False, nothing kept, when
    the bytes do not hash to it. Check the token and the right to write first."""
    upload = await run_in_threadpool(self.blobs.upload, digest)
    try:
      pending = bytearray()
      async for part in request.stream():
        pending += part
        if len(pending) >= _WRITE_BYTES:
          await run_in_threadpool(upload.write, bytes(pending))
          pending.clear()
      await run_in_threadpool(upload.write, bytes(pending))
      return await run_in_threadpool(upload.commit)
    finally:
      upload.discard()

  def owner(self, request: Request) -> str:
    """The owner of the request's token (looked up once per request); 401 without one."""
    if "dvbench.owner" not in request.scope:
      request.scope["dvbench.owner"] = self._owner_of_token(request)
    return request.scope["dvbench.owner"]

  def _owner_of_token(self, request: Request) -> str:
    token = request_token(request.headers.getlist("authorization"))
    if token is None:
      raise HTTPException(401, MISSING_TOKEN)
    found = self.store.token_owner(token)
    locked_for = request.scope.get(LOCKOUT, 0)
    if found.owner is None and locked_for:
      raise HTTPException(429, "too many unknown tokens from this address; retry in "
                          f"{locked_for} s (valid tokens are served meanwhile).",
                          headers={"retry-after": str(locked_for)})
    if found.owner is None:
      raise HTTPException(401, found.problem or "unknown API token: check DVBENCH_TOKEN or "
                          "'dvbench login', or ask the server's operator for one.")
    return found.owner

  def writable_experiment(self, request: Request, owner: str, name: str) -> dict:
    """The experiment, created for its owner (within its quota) if it is new."""
    full = check_name(owner, name)
    who = self.owner(request)
    if who != owner:
      raise HTTPException(403, f"token of '{who}' cannot write to '{full}'; experiments "
                          "are written only by their owner.")
    existing = self.store.experiment(full)
    if existing is not None:
      return existing
    self.quota.check_experiments(owner)
    return self.store.experiment(full, create_for=owner)

  def proof_or_404(self, proof_id: str) -> dict:
    proof = self.store.proof(proof_id) if HEX_ID.fullmatch(proof_id) else None
    if proof is None:
      raise HTTPException(404, f"unknown proof {proof_id[:64]!r}: create it by posting its "
                          "root record to /api/v1/experiments/OWNER/NAME/proofs.")
    return proof

  def proof_for_write(self, request: Request, proof_id: str) -> dict:
    proof = self.proof_or_404(proof_id)
    who = self.owner(request)
    if proof["experiment"].split("/")[0] != who:
      raise HTTPException(403, f"token of '{who}' cannot write to proof {proof_id}.")
    return proof

  def declared_size(self, request: Request) -> int:
    """A request body's declared length, or the most a body may carry (none declared, or
    one over it: ``Guard`` refuses that body)."""
    declared = parse_int(request.headers.get("content-length"), 0, self.limits.max_body)
    return self.limits.max_body if declared is None else declared

  def blob_name(self, digest: str) -> str:
    if not self.blobs.valid_name(digest):
      raise HTTPException(400, "blob names are 64 lowercase hex digits.")
    return digest
