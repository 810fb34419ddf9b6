"""Blobs in custody of a proof: uploaded for it (hash checked), listed and read back.

A blob counts for a proof only once it was uploaded for that proof, even when
the content-addressed store already holds the same bytes for another one.

Example::

  routes = blob_routes(service)  # PUT/HEAD/GET /api/v1/proofs/{proof_id}/blobs/{digest}
                                 # POST /api/v1/proofs/{proof_id}/blobs: many small ones
"""

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from dvbench import transport
from dvbench.server import labels
from dvbench.server.blobs import hexdigest
from dvbench.server.paging import paged
from dvbench.server.service import Service


class BlobRoutes:

  def __init__(self, service: Service):
    self.service, self.store, self.blobs = service, service.store, service.blobs

  async def put_blob(self, request):
    """Token, proof and name first; then the body, streamed to the store while hashed
    (``Service.receive_blob``)."""
    digest = self.service.blob_name(request.path_params["digest"])
    proof = await run_in_threadpool(self.service.proof_for_write, request,
                                    request.path_params["proof_id"])
    if await run_in_threadpool(self._held_already, proof, digest, request):
      return Response(status_code=201)
    stored = await self.service.receive_blob(request, digest)

    def record():
      if not stored:
        self._refuse_altered(proof, digest)
      self.store.add_proof_blob(proof["id"], digest)
      return 201
    return Response(status_code=await run_in_threadpool(record))

  def _held_already(self, proof: dict, digest: str, request) -> bool:
    """True when the proof holds ``digest`` already (a resend: nothing to store); 409 when
    the proof takes no more records, nor blobs (a proof whose replays held still takes the
    blobs of its measurements and submissions); else checks the storage quota."""
    if self.store.has_proof_blob(proof["id"], digest):
      return True
    self._admit(proof, self.service.declared_size(request))
    return False

  def _admit(self, proof: dict, incoming: int) -> None:
    """409 when the proof takes no more records, nor blobs (a proof whose replays held
    still takes the blobs of its measurements and submissions); else counts ``incoming``
    bytes against its owner's storage quota."""
    if proof["state"] != "receiving" and proof["state"] not in labels.REPLAYED_STATES:
      raise HTTPException(409, f"proof {proof['id']} is {proof['state']}; it takes no more "
                          "records, nor blobs.")
    self.service.quota.check_storage(proof["experiment"].split("/")[0], incoming)

  async def post_blobs(self, request):
    """Many small blobs in one request (a small model's state leaves, say): a CBOR array of
    ``[digest, bytes]`` pairs, each hash checked as ``put_blob`` checks it; all are kept
    or, when one does not hash to its name, none (and the proof is invalid)."""
    proof = await run_in_threadpool(self.service.proof_for_write, request,
                                    request.path_params["proof_id"])
    body = await self.service.body(request)

    def store() -> int:
      pairs = [(d, data) for d, data in _blob_pairs(body)
               if not self.store.has_proof_blob(proof["id"], d)]  # resent ones are held
      for digest, data in pairs:
        if hexdigest(data) != digest:
          self._refuse_altered(proof, digest)
      if pairs:
        self._admit(proof, sum(len(data) for _, data in pairs))
      self.blobs.put_many(pairs)
      self.store.add_proof_blobs(proof["id"], [digest for digest, _ in pairs])
      return len(pairs)
    return JSONResponse({"stored": await run_in_threadpool(store)}, status_code=201)

  def _refuse_altered(self, proof: dict, digest: str):
    """A blob that does not hash to its name: the proof is invalid (while receiving); 400."""
    failure = (f"blob {digest} uploaded for this proof does not hash to its name: the "
               "opening was altered.")
    if proof["state"] == "receiving":
      self.store.set_proof_state(proof["id"], "invalid", failure)
    raise HTTPException(400, failure)

  def _custody(self, request) -> tuple[dict, str]:
    """(proof, digest) when ``digest`` was uploaded for the proof; 404 otherwise."""
    digest = self.service.blob_name(request.path_params["digest"])
    proof = self.service.proof_or_404(request.path_params["proof_id"])
    if not self.store.has_proof_blob(proof["id"], digest):
      raise HTTPException(404, f"blob {digest} was not uploaded for proof {proof['id']}.")
    return proof, digest

  async def has_blob(self, request):
    await run_in_threadpool(self._custody, request)
    return Response(status_code=200)

  async def get_blob(self, request):
    _, digest = await run_in_threadpool(self._custody, request)
    return FileResponse(self.blobs.path(digest), media_type="application/octet-stream")

  async def list_blobs(self, request):
    proof = await run_in_threadpool(self.service.proof_or_404, request.path_params["proof_id"])
    return await paged(request, self.store.page_proof_blobs, proof["id"])


def _blob_pairs(body: bytes) -> list[tuple[str, bytes]]:
  """The ``[[digest, bytes], ...]`` of a ``POST .../blobs`` body, as (hex digest, bytes);
  400 naming what is wrong."""
  try:
    pairs = transport.decode_safely(body, max_depth=2, max_items=3 * transport.MAX_BLOBS + 1)
  except transport.UnsafeCbor as e:
    raise HTTPException(400, f"the blobs: {e}") from None
  if not isinstance(pairs, list) or not all(
      isinstance(p, list) and len(p) == 2 and isinstance(p[0], bytes) and len(p[0]) == 32
      and isinstance(p[1], bytes) for p in pairs):
    raise HTTPException(400, "the blobs: a CBOR array of [digest (32 bytes), bytes] pairs, "
                        "e.g. cbor2.dumps([[blake3(row).digest(), row], ...]).")
  return [(digest.hex(), data) for digest, data in pairs]


def blob_routes(service: Service) -> list[Route]:
  api = BlobRoutes(service)
  return [
      Route("/api/v1/proofs/{proof_id}/blobs", api.list_blobs, name="proof_blobs"),
      Route("/api/v1/proofs/{proof_id}/blobs", api.post_blobs, methods=["POST"],
            name="post_proof_blobs"),
      Route("/api/v1/proofs/{proof_id}/blobs/{digest}", api.put_blob, methods=["PUT"],
            name="put_proof_blob"),
      Route("/api/v1/proofs/{proof_id}/blobs/{digest}", api.has_blob, methods=["HEAD"],
            name="has_proof_blob"),
      Route("/api/v1/proofs/{proof_id}/blobs/{digest}", api.get_blob, methods=["GET"],
            name="proof_blob"),
  ]
