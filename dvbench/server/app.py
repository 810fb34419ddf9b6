"""The DVBench ASGI app: the route modules of each area under one Starlette app.

Areas: ``routes_proofs`` (experiments, slots, roots, downloads), ``routes_stream``
(custody and challenges), ``routes_blobs`` (blobs per proof), ``routes_measurements``,
``routes_benchmarks`` and ``routes_pages``. Every route is named, so pages build links with
``url_path_for``.

Example::

  service = Service(Store.open("sqlite:///data/dvbench.db"), BlobStore("data/blobs"),
                    keys.load_or_create(pathlib.Path("data")))
  uvicorn.run(create_app(service), host="127.0.0.1", port=8000)
"""

import pathlib

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from dvbench.server import page
from dvbench.server.guard import Guard
from dvbench.server.routes_benchmarks import benchmark_routes
from dvbench.server.routes_blobs import blob_routes
from dvbench.server.routes_measurements import measurement_routes
from dvbench.server.routes_pages import page_routes
from dvbench.server.routes_proofs import proof_routes
from dvbench.server.routes_stream import stream_routes
from dvbench.server.service import Service


async def _http_error(request, exc: HTTPException):
  return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)


def create_app(service: Service) -> Starlette:
  static = StaticFiles(directory=pathlib.Path(page.__file__).parent / "static")
  routes = [*page_routes(service), *proof_routes(service), *stream_routes(service),
            *blob_routes(service), *measurement_routes(service), *benchmark_routes(service),
            Mount("/static", static, name="static")]
  return Starlette(routes=routes, exception_handlers={HTTPException: _http_error},
                   middleware=[Middleware(Guard, limits=service.limits)])
