"""Blobs in custody of a proof: uploaded for it (hash checked), listed and read back.

A blob counts for a proof only once it was uploaded for that proof, even when
the content-addressed store already holds the same bytes for another one.

Example::

  routes = blob_routes(service)  # PUT/HEAD/GET /api/v1/proofs/{proof_id}/blobs/{digest}
"""

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from dvbench.server import labels
from dvbench.server.paging import paged
from dvbench.server.refusals import parse_int
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
        failure = (f"blob {digest} uploaded for this proof does not hash to its name: the "
                   "opening was altered.")
        if proof["state"] == "receiving":
          self.store.set_proof_state(proof["id"], "invalid", failure)
        raise HTTPException(400, failure)
      self.store.add_proof_blob(proof["id"], digest)
      return 201
    return Response(status_code=await run_in_threadpool(record))

  def _held_already(self, proof: dict, digest: str, request) -> bool:
    """True when the proof holds ``digest`` already (a resend: nothing to store); 409 when
    the proof takes no more records, nor blobs (a proof whose replays held still takes the
    blobs of its measurements and submissions); else checks the storage quota."""
    if self.store.has_proof_blob(proof["id"], digest):
      return True
    if proof["state"] != "receiving" and proof["state"] not in labels.REPLAYED_STATES:
      raise HTTPException(409, f"proof {proof['id']} is {proof['state']}; it takes no more "
                          "records, nor blobs.")
    declared = parse_int(request.headers.get("content-length"), 0, self.service.limits.max_body)
    self.service.quota.check_storage(proof["experiment"].split("/")[0],
                                     self.service.limits.max_body if declared is None
                                     else declared)
    return False

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


def blob_routes(service: Service) -> list[Route]:
  api = BlobRoutes(service)
  return [
      Route("/api/v1/proofs/{proof_id}/blobs", api.list_blobs, name="proof_blobs"),
      Route("/api/v1/proofs/{proof_id}/blobs/{digest}", api.put_blob, methods=["PUT"],
            name="put_proof_blob"),
      Route("/api/v1/proofs/{proof_id}/blobs/{digest}", api.has_blob, methods=["HEAD"],
            name="has_proof_blob"),
      Route("/api/v1/proofs/{proof_id}/blobs/{digest}", api.get_blob, methods=["GET"],
            name="proof_blob"),
  ]
