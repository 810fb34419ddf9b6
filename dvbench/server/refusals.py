"""Typed refusals: an HTTP error whose JSON answer names what was refused, besides saying
it in words, e.g. ``{"error": "limit is an integer from 1 to 1000; got '0'.",
"parameter": "limit", "range": [1, 1000]}``.

Every number a request carries in its query string goes through ``int_param`` before it
reaches the database: digits only (no sign, spaces, underscores or other scripts' digits),
at most as many as its range needs, within the range.

Example::

  start = int_param(request.query_params, "start", 0, MAX_COLUMN_INT, default=0)
  raise Refusal(403, "quota ...", quota="open_proofs", limit=32, flag="--quota-open-proofs")
"""

import re

from starlette.exceptions import HTTPException

_DIGITS = re.compile(r"[0-9]+")
MAX_COLUMN_INT = 2**31 - 1  # the largest value an INTEGER column holds on every database


def _rebuilt(status_code: int, detail: str, headers: dict | None, fields: dict) -> "Refusal":
  return Refusal(status_code, detail, headers=headers, **fields)


class Refusal(HTTPException):
  """An HTTPException with ``fields`` for its JSON answer (``app`` adds them next to
  ``error``); it pickles, so an ingestion process can raise it."""

  def __init__(self, status_code: int, detail: str, headers: dict | None = None, **fields):
    super().__init__(status_code, detail, headers)
    self.fields = fields

  def __reduce__(self):
    return (_rebuilt, (self.status_code, self.detail, self.headers, self.fields))


def parse_int(text: str | None, low: int, high: int) -> int | None:
  """``text`` as an integer in ``[low, high]`` (``low`` >= 0), or None when it is not one:
  ``parse_int("12", 0, 99)`` -> 12, ``parse_int("1" * 5000, 0, 99)`` -> None."""
  if text is None or len(text) > len(str(high)) or not _DIGITS.fullmatch(text):
    return None
  value = int(text)
  return value if low <= value <= high else None


def int_param(params, name: str, low: int, high: int, default: int | None = None) -> int:
  """Query parameter ``name`` of ``params`` (a mapping) as an integer in ``[low, high]``;
  ``default`` when absent; else a 400 ``Refusal`` naming the parameter and its range."""
  text = params.get(name)
  if text is None and default is not None:
    return default
  value = parse_int(text, low, high)
  if value is None:
    raise Refusal(400, f"{name} is an integer from {low} to {high}; got "
                  f"{(text or '')[:40]!r}{'...' if text and len(text) > 40 else ''}.",
                  parameter=name, range=[low, high])
  return value


def database_refused(error) -> Refusal:
  """The 503 of a statement the database refused (``error``, a ``db.DatabaseRefused``:
  locked past its busy timeout, a full disk): the server's fault, said as such, and sent
  again by clients after ``Retry-After``."""
  return Refusal(503, f"the server's database refused this request ({error.orig}); nothing "
                 "already stored was lost: send it again shortly.",
                 headers={"retry-after": "10"})
