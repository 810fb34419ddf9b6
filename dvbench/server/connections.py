"""Connections before a request exists: headers within a deadline, a bounded number per
client address.

uvicorn times out neither a connection that never sends a request nor headers that
trickle in a byte at a time, so a few hundred such clients would hold the server's
connections for as long as they like (the ``Guard`` bounds bodies, which come later).
``guarded_h11(limits)`` is uvicorn's h11 protocol with:

* a header deadline: from the connection's start, and from the first byte of each next
  request on a kept-alive connection, the request line and headers must be complete
  within ``limits.header_timeout`` seconds, else the server answers 408 and closes;
* at most ``limits.max_connections_per_address`` open connections per client address: one
  more closes that address's oldest connection that is not serving a request (idle, or
  still sending its headers), or, when every one of them is, is closed at once; so idle
  sockets never cut an address off (``/api/v1/health`` included), while requests in
  progress are bounded by the ``Guard``. ``uvicorn``'s ``limit_concurrency`` bounds all
  connections.

Example::

  uvicorn.run(app, http=guarded_h11(limits), limit_concurrency=limits.max_connections)
"""

import collections

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dvbench.server.limits import Limits

_TIMEOUT_TEXT = b"the request headers did not arrive in time."
_TIMEOUT_ANSWER = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
                   b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
                   % (len(_TIMEOUT_TEXT), _TIMEOUT_TEXT))


def guarded_h11(limits: Limits) -> type:
  """An ``H11Protocol`` class applying the connection limits of ``limits``."""
  # One server's open connections per address, oldest first (dicts keep insertion order).
  open_per_address: dict[str, dict] = collections.defaultdict(dict)

  class GuardedH11Protocol(H11Protocol):
    """``H11Protocol`` with a header deadline and a per-address connection limit."""

    def connection_made(self, transport) -> None:
      super().connection_made(transport)
      self._header_deadline = None
      self._address = (self.client or ("unknown",))[0]
      held = open_per_address[self._address]
      if len(held) >= limits.max_connections_per_address:
        idle = next((c for c in held if not c.serving()), None)
        if idle is None:
          self._address = None  # not counted
          transport.close()
          return
        idle.evict()
      held[self] = None
      self._await_headers()

    def serving(self) -> bool:
      """Whether a request of this connection is with the app or being answered."""
      return self.cycle is not None and not self.cycle.response_complete

    def evict(self) -> None:
      """Closes this connection (not serving a request) for a newer one of its address."""
      self._forget()
      self.transport.close()

    def _forget(self) -> None:
      if self._address is not None:
        held = open_per_address[self._address]
        held.pop(self, None)
        if not held:
          del open_per_address[self._address]
        self._address = None

    def connection_lost(self, exc) -> None:
      self._headers_arrived()
      self._forget()
      super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
      if self.conn.their_state is h11.IDLE:  # these bytes begin (or continue) a request
        self._await_headers()
      super().data_received(data)
      if self.conn.their_state is not h11.IDLE:
        self._headers_arrived()

    def _await_headers(self) -> None:
      if self._header_deadline is None:
        self._header_deadline = self.loop.call_later(limits.header_timeout,
                                                     self._headers_too_slow)

    def _headers_arrived(self) -> None:
      if self._header_deadline is not None:
        self._header_deadline.cancel()
        self._header_deadline = None

    def _headers_too_slow(self) -> None:
      self._header_deadline = None
      if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
        self.transport.write(_TIMEOUT_ANSWER)
        self.transport.close()

  return GuardedH11Protocol
