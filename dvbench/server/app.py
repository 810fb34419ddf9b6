"""The DVBench ASGI app: the route modules of each area under one Starlette app.

Areas: ``routes_proofs`` (experiments, slots, roots, downloads), ``routes_stream``
(custody and challenges), ``routes_blobs`` (blobs per proof), ``routes_measurements``,
``routes_benchmarks`` and ``routes_pages``; ``/api/v1/health`` is here. Every route is
named, so pages build links with ``url_path_for``. Every response carries the security
headers of ``SECURITY_HEADERS`` (no inline script or style may run on a page).

Example::

  service = Service(Store.open("sqlite:///data/dvbench.db"), BlobStore("data/blobs"),
                    keys.load_or_create(pathlib.Path("data")))
  uvicorn.run(create_app(service), host="127.0.0.1", port=8000)
"""

import logging
import pathlib

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from dvbench.server import page
from dvbench.server import refusals
from dvbench.server import sandbox
from dvbench.server.db import DatabaseRefused
from dvbench.server.guard import Guard
from dvbench.server.record_bodies import StoredRecordDamaged
from dvbench.server.routes_benchmarks import benchmark_routes
from dvbench.server.routes_blobs import blob_routes
from dvbench.server.routes_measurements import measurement_routes
from dvbench.server.routes_pages import not_found_page, page_routes
from dvbench.server.routes_proofs import proof_routes
from dvbench.server.routes_stream import stream_routes
from dvbench.server.service import Service
from dvbench.server.store_jobs import QueueFull

logger = logging.getLogger("dvbench.server")

SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; "
     b"img-src 'self' data:; connect-src 'self'; form-action 'self'; base-uri 'none'; "
     b"frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
]


class SecurityHeaders:
  """ASGI middleware: adds ``SECURITY_HEADERS`` to every HTTP response."""

  def __init__(self, app):
    self.app = app

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)

    async def send_with_headers(message):
      if message["type"] == "http.response.start":
        names = {k.lower() for k, _ in message.get("headers", [])}
        message["headers"] = [*message.get("headers", []),
                              *((k, v) for k, v in SECURITY_HEADERS if k not in names)]
      await send(message)
    return await self.app(scope, receive, send_with_headers)


async def _http_error(request, exc: HTTPException):
  """API paths answer JSON errors; an unknown page answers a browser an HTML page."""
  if exc.status_code == 404 and not request.url.path.startswith("/api/"):
    return not_found_page(request, str(exc.detail) if exc.detail != "Not Found" else
                          f"there is no page at {request.url.path[:200]}.")
  return JSONResponse({"error": exc.detail, **getattr(exc, "fields", {})},
                      status_code=exc.status_code, headers=exc.headers)


async def _storage_damaged(request, exc: StoredRecordDamaged):
  """A stored record this server cannot read back: its fault, said as such (503)."""
  logger.error("%s", exc)
  return JSONResponse({"error": str(exc)}, status_code=503)


async def _database_refused(request, exc: DatabaseRefused):
  """A statement the database refused: 503 (``refusals.database_refused``), never a
  traceback; the client sends it again."""
  logger.error("the database refused %s %s: %s", request.method, request.url.path, exc.orig)
  return await _http_error(request, refusals.database_refused(exc))


async def _queue_full(request, exc: QueueFull):
  return JSONResponse({"error": str(exc)}, status_code=429, headers={"retry-after": "30"})


def _health_route(service: Service) -> Route:
  async def health(request):
    """200 and ``ok`` unless the server runs workers or ingestion processes and none of
    them lives (503); says which isolation the verifier child gets, and which protections
    it lacks (``verifier_sandbox``: "full", or "weak" under --allow-weak-sandbox when a
    protection that is not optional is missing). Answers
    from memory, never waiting on the database."""
    none = {"alive": 0, "expected": 0, "restarts": 0}
    workers = service.workers() if service.workers else none
    ingest = service.ingest_processes.health() if service.ingest_processes else none
    ok = all(p["expected"] == 0 or p["alive"] > 0 for p in (workers, ingest))
    return JSONResponse({"ok": ok, "workers": workers, "ingest_processes": ingest,
                         "verifier_isolation": service.isolation,
                         "verifier_sandbox": "weak" if sandbox.weak(service.sandbox_missing)
                                             else "full",
                         "verifier_missing": service.sandbox_missing},
                        status_code=200 if ok else 503)
  return Route("/api/v1/health", health, name="health")


def create_app(service: Service) -> Starlette:
  static = StaticFiles(directory=pathlib.Path(page.__file__).parent / "static")
  routes = [_health_route(service), *page_routes(service), *proof_routes(service),
            *stream_routes(service),
            *blob_routes(service), *measurement_routes(service), *benchmark_routes(service),
            Mount("/static", static, name="static")]
  return Starlette(routes=routes, exception_handlers={HTTPException: _http_error,
                                                     QueueFull: _queue_full,
                                                     DatabaseRefused: _database_refused,
                                                     StoredRecordDamaged: _storage_damaged},
                   middleware=[Middleware(SecurityHeaders),  # outermost: on every answer
                               Middleware(Guard, limits=service.limits)])
