"""The server's outer guard: bounded bodies, slow uploads cut off, bad tokens rate limited.

An ASGI middleware in front of every route (``app.create_app`` installs it):

* a write (POST, PUT, PATCH, DELETE) without one ``Authorization: Bearer ...`` header is
  refused with 401 from its headers, before its body is read (``request_token``: the one
  reading of a request's token, also ``Service.owner``'s);
* a declared ``Content-Length`` above ``max_body`` is refused with 413, and a body that
  grows past it while streaming is cut off with 413;
* a body must arrive within ``body_timeout`` seconds, with no gap over
  ``body_idle_timeout`` seconds (else 408): a client trickling bytes cannot hold a request;
* at most ``max_uploads`` writes run at once, and at most ``max_uploads_per_token`` of one
  token (beyond: 503 with ``Retry-After``), so one owner's slow uploads leave the others
  room; reads such as ``/api/v1/health`` are never queued behind them;
* a client address that sent ``bad_tokens`` unknown tokens (401) within
  ``bad_token_window`` seconds is locked out: until the window has passed, an unknown
  token from it gets 429 with ``Retry-After`` instead of 401. A valid token is never
  refused (the request carries ``LOCKOUT``; ``Service.owner`` answers 429 only after its
  token turned out unknown), so everyone behind one proxy keeps working.

``Limits`` also holds what ``connections`` applies before a request exists: the header
deadline and the connection limits.

Example::

  app = Starlette(routes, middleware=[Middleware(Guard, limits=Limits(max_body=1 << 20))])
"""

import collections
import math
import time

import anyio
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from dvbench.server.limits import Limits
from dvbench.server.refusals import parse_int

_WRITES = {"POST", "PUT", "PATCH", "DELETE"}
MISSING_TOKEN = ("missing API token: send one 'Authorization: Bearer <token>' header (create "
                 "one with 'dvbench token create OWNER').")
_MAX_ADDRESSES = 10000  # addresses with recent bad tokens kept in memory
LOCKOUT = "dvbench.lockout"  # scope key: seconds until the address may send unknown tokens


class _BadTokens:
  """Unknown-token answers per client address within a sliding window."""

  def __init__(self, limit: int, window: float):
    self.limit, self.window = limit, window
    self._seen: dict[str, list[float]] = {}

  def retry_after(self, address: str) -> int:
    """Seconds until ``address`` may authenticate again (0: now)."""
    now = time.monotonic()
    times = [t for t in self._seen.get(address, ()) if t > now - self.window]
    if times:
      self._seen[address] = times
    else:
      self._seen.pop(address, None)
    if len(times) < self.limit:
      return 0
    return max(1, math.ceil(times[-self.limit] + self.window - now))

  def record(self, address: str) -> None:
    if len(self._seen) >= _MAX_ADDRESSES and address not in self._seen:
      self._seen.pop(next(iter(self._seen)))
    self._seen.setdefault(address, []).append(time.monotonic())
    del self._seen[address][:-self.limit]


def _refusal(status: int, message: str, **headers) -> JSONResponse:
  return JSONResponse({"error": message}, status_code=status,
                      headers={k.replace("_", "-"): str(v) for k, v in headers.items()})


def request_token(authorizations: list[str]) -> str | None:
  """The API token of a request whose ``Authorization`` headers are ``authorizations``:
  the token of its one ``Bearer`` header, without surrounding spaces; None without one,
  with several headers (each reader could take another) or with another scheme.

  Example: ``request_token(["Bearer  abc "])`` is ``"abc"``; ``request_token(["Bearer a",
  "Bearer b"])`` is None.
  """
  if len(authorizations) != 1 or not authorizations[0].startswith("Bearer "):
    return None
  return authorizations[0][len("Bearer "):].strip() or None


class Guard:
  """ASGI middleware applying ``Limits`` (see the module docstring)."""

  def __init__(self, app, limits: Limits):
    self.app, self.limits = app, limits
    self.bad_tokens = _BadTokens(limits.bad_tokens, limits.bad_token_window)
    self.uploads = 0
    self.uploads_of: collections.Counter = collections.Counter()  # by token

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    address = (scope.get("client") or ("unknown",))[0]
    token = request_token([v.decode("latin-1") for k, v in scope["headers"]
                           if k.lower() == b"authorization"])
    if "authorization" in headers:
      scope[LOCKOUT] = self.bad_tokens.retry_after(address)
    refusal = self._refusal(scope, headers, token)
    if refusal is not None:
      return await refusal(scope, receive, send)

    async def observed_send(message):
      if message["type"] == "http.response.start" and message["status"] == 401:
        self.bad_tokens.record(address)
      await send(message)

    if scope["method"] not in _WRITES:
      return await self.app(scope, receive, observed_send)
    self.uploads += 1
    self.uploads_of[token] += 1
    try:
      await self.app(scope, self._bounded(receive), observed_send)
    finally:
      self.uploads -= 1
      self.uploads_of[token] -= 1
      if not self.uploads_of[token]:
        del self.uploads_of[token]

  def _refusal(self, scope, headers: dict, token: str | None) -> JSONResponse | None:
    if scope["method"] not in _WRITES:
      return None
    if token is None:
      return _refusal(401, MISSING_TOKEN)
    declared = headers.get("content-length", "0")
    if parse_int(declared, 0, self.limits.max_body) is None:
      return _refusal(413, f"request body of {declared[:20]} bytes exceeds the limit of "
                      f"{self.limits.max_body}; records above the chunk threshold go in chunks.")
    if self.uploads >= self.limits.max_uploads:
      return _refusal(503, f"the server is taking {self.uploads} uploads; retry shortly.",
                      retry_after=1)
    if self.uploads_of[token] >= self.limits.max_uploads_per_token:
      return _refusal(503, f"this token is sending {self.uploads_of[token]} uploads "
                      "already, the most one token may (dvbench serve "
                      "--max-uploads-per-token); retry when one is done.", retry_after=1)
    return None

  def _bounded(self, receive):
    """``receive`` with the body's size and time limits (HTTPException 413/408)."""
    deadline = time.monotonic() + self.limits.body_timeout
    size, complete = 0, False

    async def bounded_receive():
      nonlocal size, complete
      if complete:  # after the body: only the disconnect is left to wait for
        return await receive()
      wait = min(self.limits.body_idle_timeout, deadline - time.monotonic())
      try:
        with anyio.fail_after(max(wait, 0)):
          message = await receive()
      except TimeoutError:
        raise HTTPException(408, "the request body did not arrive in time (limits: "
                            f"{self.limits.body_timeout:g} s in all, "
                            f"{self.limits.body_idle_timeout:g} s without data).") from None
      if message["type"] == "http.request":
        size += len(message.get("body", b""))
        complete = not message.get("more_body", False)
        if size > self.limits.max_body:
          raise HTTPException(413, f"request body exceeds the limit of {self.limits.max_body} "
                              "bytes.")
      return message
    return bounded_receive
