"""HTML pages: proofs, a proof, the leaderboards of benchmarks; links come from the named routes.

Example::

  routes = page_routes(service)  # "/", "/leaderboard", "/benchmarks/{owner}/{name}", "/proofs/{id}"
"""

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import HTMLResponse
from starlette.routing import Route

from dvbench.server import labels
from dvbench.server import page
from dvbench.server import routes_benchmarks
from dvbench.server.service import Service, check_name


def _url(request) -> page.Url:
  return lambda route, /, **params: str(request.app.url_path_for(route, **params))


class PageRoutes:

  def __init__(self, service: Service):
    self.service, self.store = service, service.store

  async def index(self, request):
    experiments = await run_in_threadpool(self.store.list_experiments)
    proofs = await run_in_threadpool(self.store.list_proofs)
    return HTMLResponse(page.index(_url(request), experiments, proofs))

  async def leaderboard(self, request):
    def gather():
      return page.leaderboards(_url(request), self.store.list_benchmarks(),
                               self.store.list_measurements())
    return HTMLResponse(await run_in_threadpool(gather))

  async def benchmark_page(self, request):
    sort = routes_benchmarks.sort_key(request.query_params.get("sort", "rank"))

    def gather():
      full = check_name(request.path_params["owner"], request.path_params["name"])
      bench = self.store.benchmark(full)
      if bench is None:
        raise HTTPException(404, f"unknown benchmark '{full}'.")
      entries = routes_benchmarks.leaderboard_entries(self.store, bench, sort)
      return page.benchmark(_url(request), routes_benchmarks.public_benchmark(bench), entries,
                            sort, routes_benchmarks.SORTS)
    return HTMLResponse(await run_in_threadpool(gather))

  async def proof_page(self, request):
    proof_id = request.path_params["proof_id"]

    def gather():
      proof = self.service.proof_or_404(proof_id)
      checks = self.store.proof_checks(proof_id)
      summary = labels.challenge_summary(proof, self.store.challenger(proof_id),
                                         self.store.challenge_rows(proof_id), checks,
                                         self.store.job("proof", proof_id))
      return page.proof(_url(request), proof, summary, checks,
                        self.store.probe_counts().get(proof_id, 0))
    return HTMLResponse(await run_in_threadpool(gather))


def page_routes(service: Service) -> list[Route]:
  api = PageRoutes(service)
  return [
      Route("/", api.index, name="index"),
      Route("/leaderboard", api.leaderboard, name="leaderboard"),
      Route("/benchmarks/{owner}/{name}", api.benchmark_page, name="benchmark_page"),
      Route("/proofs/{proof_id}", api.proof_page, name="proof_page"),
  ]
