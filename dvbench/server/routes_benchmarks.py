"""Benchmarks: the route table (registration, submissions, leaderboards) and the leaderboard.

Registration by the owner is ``routes_registration``, submissions scored by the server
``routes_submissions``; the leaderboard is here.

Example::

  routes = benchmark_routes(service)
  # PUT  /api/v1/benchmarks/{owner}/{name}                  register (owner's token, once)
  # PUT  /api/v1/benchmarks/{owner}/{name}/blobs/{digest}   program and rows (owner's token)
  # POST /api/v1/benchmarks/{owner}/{name}/submissions      a verified proof's checkpoint
  # GET  /api/v1/benchmarks/{owner}/{name}/leaderboard?sort=value
"""

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.routing import Route

from dvbench.server import leaderboard
from dvbench.server.benchmark_requests import benchmark_or_404, parse_definition
from dvbench.server.paging import next_link, page_params
from dvbench.server.refusals import MAX_COLUMN_INT, int_param
from dvbench.server.routes_registration import RegistrationRoutes
from dvbench.server.routes_submissions import SubmissionRoutes
from dvbench.server.service import Service

# The leaderboard columns a client may sort by (``?sort=``); unranked entries have no rank.
SORTS = ("rank", "value", "experiment", "state", "challenger", "checks_replayed",
         "update_check_probability", "escape_probability", "start_attested", "program_pinned",
         "contamination", "outside_training_set", "attempts", "submitted")


class LeaderboardRoutes:
  """A benchmark's entries, ranked by the server's scores."""

  def __init__(self, service: Service):
    self.store = service.store

  async def get_leaderboard(self, request):
    """One page of the entries in ``sort`` order; the cursor is a position."""
    sort = sort_key(request.query_params.get("sort", "rank"))
    limit, after = page_params(request)
    start = int_param({"after": after}, "after", 0, MAX_COLUMN_INT, default=0)

    def board():
      bench = benchmark_or_404(self.store, request)
      return leaderboard.leaderboard_entries(self.store, bench,
                                             parse_definition(bench["definition"]), sort)
    entries = await run_in_threadpool(board)
    more = start + limit < len(entries)
    return JSONResponse(entries[start:start + limit],
                        headers=next_link(request, limit, str(start + limit) if more else None))


def sort_key(sort: str) -> str:
  if sort not in SORTS:
    raise HTTPException(400, f"sort is one of {list(SORTS)}, got {sort[:40]!r}.")
  return sort



def benchmark_routes(service: Service) -> list[Route]:
  registration = RegistrationRoutes(service)
  submissions = SubmissionRoutes(service)
  board = LeaderboardRoutes(service)
  base = "/api/v1/benchmarks/{owner}/{name}"
  return [
      Route(base, registration.register, methods=["PUT"], name="register_benchmark"),
      Route(base, registration.get_benchmark, methods=["GET"], name="benchmark"),
      Route(base + "/rows", registration.get_rows, name="benchmark_rows"),
      Route(base + "/blobs/{digest}", registration.put_blob, methods=["PUT"],
            name="put_benchmark_blob"),
      Route(base + "/blobs/{digest}", registration.has_blob, methods=["HEAD"],
            name="has_benchmark_blob"),
      Route(base + "/blobs/{digest}", registration.get_blob, methods=["GET"],
            name="benchmark_blob"),
      Route(base + "/submissions", submissions.submit, methods=["POST"], name="submit"),
      Route(base + "/leaderboard", board.get_leaderboard, name="benchmark_leaderboard_json"),
      Route("/api/v1/submissions/{submission_id}", submissions.get_submission,
            name="submission"),
  ]
