"""Paged JSON listings: ``?limit=N&after=CURSOR``, at most ``MAX_PAGE`` items a response.

A listing answers a JSON array; when more items follow, a ``Link: <...>; rel="next"``
header gives the next page's URL (and ``X-Next-After`` its cursor), as GitHub's API does.

Example::

  async def get_records(self, request):
    return await paged(request, self.store.page_record_ids, proof_id, convert=bytes.hex)
"""

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from dvbench.server.refusals import Refusal, int_param
from dvbench.server.store_listing import BadCursor

MAX_PAGE = 1000


def page_params(request: Request) -> tuple[int, str | None]:
  """(limit, after) of the query string; 400 saying the rule when they are not acceptable."""
  limit = int_param(request.query_params, "limit", 1, MAX_PAGE, default=MAX_PAGE)
  after = request.query_params.get("after")
  if after is not None and not 0 < len(after) <= 400:
    raise Refusal(400, "after is the cursor a previous page handed out (its X-Next-After "
                  "header).", parameter="after")
  return limit, after


def next_link(request: Request, limit: int, cursor: str | None) -> dict[str, str]:
  """The headers that point to the next page, if there is one."""
  if cursor is None:
    return {}
  url = request.url.include_query_params(limit=limit, after=cursor)
  return {"link": f'<{url}>; rel="next"', "x-next-after": cursor}


def fetch_page(request: Request, page, *args, **kwargs) -> tuple[list, dict[str, str]]:
  """(items, next-page headers) of ``page(*args, limit=, after=)``, in a worker thread."""
  limit, after = page_params(request)
  try:
    items, cursor = page(*args, limit=limit, after=after, **kwargs)
  except BadCursor as e:
    raise Refusal(400, str(e), parameter="after") from None
  return items, next_link(request, limit, cursor)


async def paged(request: Request, page, *args, convert=None, **kwargs) -> JSONResponse:
  """A JSON array of one page of ``page``'s items, each through ``convert`` if given."""
  items, headers = await run_in_threadpool(fetch_page, request, page, *args, **kwargs)
  return JSONResponse([convert(i) for i in items] if convert else items, headers=headers)
