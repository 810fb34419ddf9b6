"""HTML pages: experiments and proofs, an experiment, a proof, the leaderboards of
benchmarks, and a proof's committed metrics as JSON; links come from the named routes.

An unknown page answers an HTML 404 page (``not_found_page``); API paths keep JSON errors.

Example::

  routes = page_routes(service)  # "/", "/experiments/{owner}/{name}", "/proofs/{id}", ...
"""

import csv
import io

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from dvbench.server import attempts
from dvbench.server import charts
from dvbench.server import labels
from dvbench.server import page
from dvbench.server import leaderboard
from dvbench.server import page_runs
from dvbench.server import routes_benchmarks
from dvbench.server.benchmark_requests import parse_definition
from dvbench.server.routes_registration import public_benchmark
from dvbench.server import run_view
from dvbench.server.db import PROOF_STATES
from dvbench.server.service import HEX_ID, Service, check_name
from dvbench.server.refusals import MAX_COLUMN_INT, int_param, parse_int
from dvbench.server.store_jobs import UNVERIFIABLE
from dvbench.server.store_listing import ProofFilter
from zkdv import records
from zkdv.fields import Invalid

MAX_SEARCH = 200  # characters of a search


def _url(request) -> page.Url:
  return lambda route, /, **params: str(request.app.url_path_for(route, **params))


def proof_filter(request) -> ProofFilter:
  """The ``q``, ``state`` and ``tag`` of a listing's query; 400 saying what each may be."""
  params = request.query_params
  only = ProofFilter(params.get("q", "").strip(), params.get("state", ""),
                     params.get("tag", "").strip())
  if len(only.search) > MAX_SEARCH:
    raise HTTPException(400, f"q is at most {MAX_SEARCH} characters.")
  if only.state and only.state not in PROOF_STATES:
    raise HTTPException(400, f"state is one of {', '.join(PROOF_STATES)}.")
  if only.tag:
    try:
      records.Tag().check(only.tag, "tag")
    except Invalid as e:
      raise HTTPException(400, str(e)) from None
  return only


def step_window(request) -> tuple[tuple[int, int], bool]:
  """The steps the charts draw, ``?from=STEP&to=STEP`` (at most ``run_view.SERIES_LIMIT``),
  and whether the page asked for them (zoomed; an empty field is no bound); 400 naming a
  bad bound."""
  params = {k: v for k, v in request.query_params.items() if k in ("from", "to") and v}
  low = int_param(params, "from", 0, MAX_COLUMN_INT, default=0)
  high = int_param(params, "to", low, MAX_COLUMN_INT, default=low + run_view.SERIES_LIMIT - 1)
  return (low, min(high, low + run_view.SERIES_LIMIT - 1)), bool(params)


def zoom_of(request, window: tuple[int, int], zoomed: bool) -> str:
  """The zoom form of the page ``request`` asked for, keeping its other parameters."""
  keep = [(k, v) for k, v in request.query_params.multi_items() if k not in ("from", "to")]
  return page_runs.zoom_form(request.url.path, window, zoomed, keep)


def series_in(store, proof_id: str, window: tuple[int, int]) -> dict:
  """``run_view.metric_series`` of the steps in ``window``."""
  return run_view.metric_series(store, proof_id, start=window[0],
                                limit=window[1] - window[0] + 1)


class PageRoutes:

  def __init__(self, service: Service):
    self.service, self.store = service, service.store

  async def index(self, request):
    after = request.query_params.get("after")
    if after is not None and not HEX_ID.fullmatch(after):
      raise HTTPException(400, "after is the id of the last proof of the previous page.")

    only = proof_filter(request)

    def gather():
      proofs, following = self.store.page_proofs(page.PAGE_SIZE, after=after, only=only)
      counts = self.store.proof_counts()
      total = self.store.count_proofs(only) if only else sum(counts.values())
      return page.index(_url(request), self.store.list_experiments(), counts, proofs,
                        first=after is None, following=following, total=total, only=only,
                        states=PROOF_STATES)
    return HTMLResponse(await run_in_threadpool(gather))

  async def experiment_page(self, request):
    only = proof_filter(request)
    window, zoomed = step_window(request)

    def gather():
      full = check_name(request.path_params["owner"], request.path_params["name"])
      exp = self.store.experiment(full)
      if exp is None:
        raise HTTPException(404, f"unknown experiment '{full}'.")
      proofs = self.store.page_proofs(page.PAGE_SIZE, experiment_id=exp["id"], only=only)[0]
      latest = {}
      if proofs and proofs[0]["steps"]:
        series = run_view.metric_series(self.store, proofs[0]["id"],
                                        start=proofs[0]["steps"] - 1, limit=1)
        latest = {name: column[-1] for name, column in series["metrics"].items()}
      measurements = self.store.list_measurements(experiment_id=exp["id"])
      return page.experiment(_url(request), full, proofs, latest, measurements,
                             attempts.describe(
                                 attempts.owner_attempts(self.store, full.split("/")[0]),
                                 self.service.minimum_policy.update_check_probability),
                             runs=[self._run(p, window) for p in
                                   proofs[:page_runs.MAX_COMPARED]],
                             only=only, states=PROOF_STATES,
                             zoom=zoom_of(request, window, zoomed))
    return HTMLResponse(await run_in_threadpool(gather))

  def _run(self, proof: dict, window: tuple[int, int], with_config: bool = False) -> dict:
    """A run as the overlay and compare views take it: its proof row and curves in
    ``window`` (and its ``run_view.run_config``)."""
    run = {"proof": proof,
           "curves": run_view.scalar_curves(series_in(self.store, proof["id"], window))}
    if with_config:
      run["config"] = run_view.run_config(self.store, proof["id"])
    return run

  async def compare(self, request):
    """``/compare?proof=ID&proof=ID...``: two to ``MAX_COMPARED`` runs side by side."""
    ids = list(dict.fromkeys(request.query_params.getlist("proof")))
    if not 2 <= len(ids) <= page_runs.MAX_COMPARED:
      raise HTTPException(400, f"compare 2 to {page_runs.MAX_COMPARED} runs: check them on "
                          f"an experiment page (got {len(ids)}).")
    window, zoomed = step_window(request)

    def gather():
      return page_runs.compare(_url(request), [self._run(self._proof_or_404(i), window, True)
                                               for i in ids], zoom_of(request, window, zoomed))
    return HTMLResponse(await run_in_threadpool(gather))

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
      entries = leaderboard.leaderboard_entries(
          self.store, bench, parse_definition(bench["definition"]), sort)
      return page.benchmark(_url(request), public_benchmark(bench), entries,
                            sort, routes_benchmarks.SORTS)
    return HTMLResponse(await run_in_threadpool(gather))

  async def proof_page(self, request):
    proof_id = request.path_params["proof_id"]
    window, zoomed = step_window(request)
    checks_after = request.query_params.get("checks_after")
    if checks_after is not None:
      step, _, kind = checks_after.partition(".")
      if parse_int(step, 0, MAX_COLUMN_INT) is None or not kind.isalpha() or len(kind) > 20:
        raise HTTPException(400, "checks_after is the 'STEP.KIND' that ended the previous "
                            "page of checks, e.g. '12.update'.")

    def gather():
      proof = self._proof_or_404(proof_id)
      table, following = self.store.page_checks(proof_id, page.CHECKS_PAGE, checks_after)
      job = self.store.job("proof", proof_id)
      summary = labels.challenge_summary(proof, self.store.challenger(proof_id),
                                         self.store.challenge_counts(proof_id), job,
                                         claims=self.store.proof_claims(proof_id),
                                         attempts=attempts.owner_attempts(
                                             self.store, proof["experiment"].split("/")[0]))
      series = series_in(self.store, proof_id, window)
      curves = run_view.scalar_curves(series)
      drawn = (series["steps"][0], series["steps"][-1]) if series["steps"] else (0, -1)
      probed = self.store.probe_count(proof_id)  # indexed by the worker (index_probes)
      indexed = probed or (job is not None and job["state"] == "done"
                           and proof["state"] not in ("invalid", UNVERIFIABLE))
      ticks = self.store.check_ticks(proof_id, proof["steps"], charts.CHECK_COLUMNS)
      return page.proof(_url(request), proof, summary, ticks,
                        labels.replayed_checks(self.store.check_tally(proof_id)),
                        probed if indexed else None, run_view.run_config(self.store, proof_id),
                        curves, run_view.step_marks(self.store, proof_id, series["steps"]),
                        [n for n in series["metrics"] if n not in curves],
                        self.store.receipt(proof_id) is not None, drawn,
                        checks_after, following, table, zoom_of(request, window, zoomed))
    return HTMLResponse(await run_in_threadpool(gather))

  def _proof_or_404(self, proof_id: str) -> dict:
    proof = self.store.proof(proof_id) if HEX_ID.fullmatch(proof_id) else None
    if proof is None:
      raise HTTPException(404, f"there is no proof {proof_id[:64]!r} on this server.")
    return proof

  async def proof_metrics(self, request):
    """``run_view.metric_series`` of a proof from ``?start=STEP``, with the marked steps."""
    proof_id = request.path_params["proof_id"]
    start = int_param(request.query_params, "start", 0, MAX_COLUMN_INT, default=0)  # a step

    def gather():
      self.service.proof_or_404(proof_id)
      series = run_view.metric_series(self.store, proof_id, start=start)
      marks = run_view.step_marks(self.store, proof_id, series["steps"])
      return {"proof_id": proof_id, **series,
              "marks": {str(s): m for s, m in sorted(marks.items())}}
    return JSONResponse(await run_in_threadpool(gather))


  async def proof_metrics_csv(self, request):
    """A proof's committed metrics as CSV: a ``step`` column, then one per metric (digests
    in hex, non-finite values as ``inf``, ``-inf`` or ``nan:HEX``, blank where a step did
    not commit it)."""
    proof_id = request.path_params["proof_id"]

    def gather():
      self.service.proof_or_404(proof_id)
      out, start = io.StringIO(), 0
      writer, names = csv.writer(out, lineterminator="\n"), None
      while start is not None:
        series = run_view.metric_series(self.store, proof_id, start=start)
        if names is None:  # the programs' metrics, and any the first steps commit
          programs = run_view.run_config(self.store, proof_id)["programs"]
          names = list(dict.fromkeys([*(m for p in programs for m in p["metrics"]),
                                      *series["metrics"]]))
          writer.writerow(["step", *names])
        columns = [series["metrics"].get(m) for m in names]
        for n, step in enumerate(series["steps"]):
          writer.writerow([step, *("" if c is None or c[n] is None else c[n] for c in columns)])
        start = series["next"]
      return out.getvalue()
    return Response(await run_in_threadpool(gather), media_type="text/csv", headers={
        "content-disposition": f"attachment; filename=metrics-{proof_id[:16]}.csv"})


def not_found_page(request, message: str) -> HTMLResponse:
  """The HTML page of an unknown page (a browser's 404)."""
  return HTMLResponse(page.not_found(_url(request), message), status_code=404)


def page_routes(service: Service) -> list[Route]:
  api = PageRoutes(service)
  return [
      Route("/", api.index, name="index"),
      Route("/leaderboard", api.leaderboard, name="leaderboard"),
      Route("/benchmarks/{owner}/{name}", api.benchmark_page, name="benchmark_page"),
      Route("/experiments/{owner}/{name}", api.experiment_page, name="experiment_page"),
      Route("/proofs/{proof_id}", api.proof_page, name="proof_page"),
      Route("/compare", api.compare, name="compare"),
      Route("/api/v1/proofs/{proof_id}/metrics", api.proof_metrics, name="proof_metrics"),
      Route("/api/v1/proofs/{proof_id}/metrics.csv", api.proof_metrics_csv,
            name="proof_metrics_csv"),
  ]
