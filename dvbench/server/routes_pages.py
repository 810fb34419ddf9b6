"""HTML pages: proofs, a proof, the leaderboard; links come from the named routes.

Example::

  routes = page_routes(service)  # "/", "/leaderboard", "/proofs/{proof_id}"
"""

from starlette.concurrency import run_in_threadpool
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route

from dvbench.server import labels
from dvbench.server import page
from dvbench.server.service import Service


def _url(request) -> page.Url:
  return lambda name, **params: str(request.app.url_path_for(name, **params))


class PageRoutes:

  def __init__(self, service: Service):
    self.service, self.store = service, service.store

  async def index(self, request):
    experiments = await run_in_threadpool(self.store.list_experiments)
    proofs = await run_in_threadpool(self.store.list_proofs)
    return HTMLResponse(page.index(_url(request), experiments, proofs))

  async def leaderboard(self, request):
    def gather():
      rows = self.store.list_measurements()
      metrics = sorted({r["metric"] for r in rows})
      return page.leaderboard(_url(request), rows, self.store.check_counts(),
                              self.store.probe_counts(),
                              {m: self.store.contamination(m) for m in metrics})
    return HTMLResponse(await run_in_threadpool(gather))

  async def proof_page(self, request):
    proof_id = request.path_params["proof_id"]

    def gather():
      proof = self.service.proof_or_404(proof_id)
      checks = self.store.proof_checks(proof_id)
      summary = labels.challenge_summary(proof, self.store.challenger(proof_id),
                                         self.store.challenge_rows(proof_id), checks)
      return page.proof(_url(request), proof, summary, checks,
                        self.store.probe_counts().get(proof_id, 0))
    return HTMLResponse(await run_in_threadpool(gather))

  async def health(self, request):
    return JSONResponse({"ok": True})


def page_routes(service: Service) -> list[Route]:
  api = PageRoutes(service)
  return [
      Route("/", api.index, name="index"),
      Route("/api/v1/health", api.health, name="health"),
      Route("/leaderboard", api.leaderboard, name="leaderboard"),
      Route("/proofs/{proof_id}", api.proof_page, name="proof_page"),
  ]
