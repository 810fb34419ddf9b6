"""The stream: acknowledged envelopes of records, chunks and the close.

The route checks the token and the proof, reads the body and hands it to ``Ingestion``:
in the server's ingestion processes when it runs them (``Service.ingest_processes``),
else in a worker thread.

Example::

  routes = stream_routes(service)  # POST /api/v1/proofs/{proof_id}/stream
"""

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse
from starlette.routing import Route

from dvbench.server.ingestion import Ingestion
from dvbench.server.service import Service


class StreamRoutes:

  def __init__(self, service: Service):
    self.service = service
    self.ingestion = Ingestion(service.store, service.signing_key)

  async def stream(self, request):
    """Token and proof first (from the headers), then the body; decoding, checks and the
    transaction run off the event loop."""
    proof = await run_in_threadpool(self.service.proof_for_write, request,
                                    request.path_params["proof_id"])
    body = await self.service.body(request)
    owner = proof["experiment"].split("/")[0]
    await run_in_threadpool(self.service.quota.check_storage, owner, len(body))
    if self.service.ingest_processes is not None:
      return JSONResponse(await self.service.ingest_processes.ingest(proof, body))
    job = await run_in_threadpool(self.ingestion.begin, proof, body)
    while (ack := await run_in_threadpool(job.step)) is None:
      pass  # a slice a turn: other requests' transactions run in between
    return JSONResponse(ack)


def stream_routes(service: Service) -> list[Route]:
  api = StreamRoutes(service)
  return [Route("/api/v1/proofs/{proof_id}/stream", api.stream, methods=["POST"],
                name="proof_stream")]
