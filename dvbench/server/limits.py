"""What one request and one client may take from the server: the ``dvbench serve`` flags of
the guard (``guard``), of the connection limits (``connections``) and of the quotas per
owner (``quotas``).

Kept apart from the guard so that ``dvbench`` builds its command line without the server's
extra installed (``pip install "dvbench[server]"``).

Example::

  limits = Limits.from_args(parser.parse_args(["--max-body-mb", "16"]))
"""

import argparse
import dataclasses

from dvbench import transport


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one request may take from the server (``dvbench serve`` flags)."""

  max_body: int = transport.MAX_BODY_BYTES
  body_timeout: float = 120.0
  body_idle_timeout: float = 15.0
  max_uploads: int = 64
  max_uploads_per_token: int = 8
  bad_tokens: int = 20
  bad_token_window: float = 60.0
  header_timeout: float = 10.0  # these three: ``connections``, before a request exists
  max_connections: int = 1024
  max_connections_per_address: int = 64

  @classmethod
  def from_args(cls, args: argparse.Namespace) -> "Limits":
    return cls(max_body=args.max_body_mb << 20, body_timeout=args.body_timeout,
               body_idle_timeout=args.body_idle_timeout, max_uploads=args.max_uploads,
               max_uploads_per_token=args.max_uploads_per_token,
               bad_tokens=args.bad_token_limit, bad_token_window=args.bad_token_window,
               header_timeout=args.header_timeout, max_connections=args.max_connections,
               max_connections_per_address=args.max_connections_per_address)


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The ``dvbench serve`` flags of ``Limits``."""
  d = Limits()
  parser.add_argument("--max-body-mb", type=int, default=d.max_body >> 20,
                      help="the largest request body (MiB)")
  parser.add_argument("--body-timeout", type=float, default=d.body_timeout,
                      help="seconds a request body may take to arrive")
  parser.add_argument("--body-idle-timeout", type=float, default=d.body_idle_timeout,
                      help="the longest pause (seconds) while a body arrives")
  parser.add_argument("--max-uploads", type=int, default=d.max_uploads,
                      help="writes served at once; more get 503 with Retry-After")
  parser.add_argument("--max-uploads-per-token", type=int, default=d.max_uploads_per_token,
                      help="writes of one token served at once; more get 503 with Retry-After")
  parser.add_argument("--bad-token-limit", type=int, default=d.bad_tokens,
                      help="unknown tokens per client address and window before its "
                      "unknown tokens get 429 (valid tokens are always served)")
  parser.add_argument("--bad-token-window", type=float, default=d.bad_token_window,
                      help="seconds of the bad-token window")
  parser.add_argument("--header-timeout", type=float, default=d.header_timeout,
                      help="seconds a request's line and headers may take to arrive")
  parser.add_argument("--max-connections", type=int, default=d.max_connections,
                      help="open connections and requests at once; more get 503")
  parser.add_argument("--max-connections-per-address", type=int,
                      default=d.max_connections_per_address,
                      help="open connections per client address; one more closes the "
                      "address's oldest connection not serving a request (or itself)")


@dataclasses.dataclass(frozen=True)
class Quotas:
  """What one owner may hold (``dvbench serve`` flags ``--quota-*``; ``quotas`` checks
  them). Slots per hour are the attempts' limit, ``--max-slots-per-hour``."""

  stored_bytes: int = 64 << 30
  open_proofs: int = 32
  experiments: int = 1000

  @classmethod
  def from_args(cls, args: argparse.Namespace) -> "Quotas":
    return cls(stored_bytes=int(args.quota_stored_gb * (1 << 30)),
               open_proofs=args.quota_open_proofs, experiments=args.quota_experiments)


QUOTA_FLAGS = {"stored_bytes": "--quota-stored-gb", "slots_per_hour": "--max-slots-per-hour",
               "open_proofs": "--quota-open-proofs", "experiments": "--quota-experiments"}


def add_quota_arguments(parser: argparse.ArgumentParser) -> None:
  """The ``dvbench serve`` flags of ``Quotas``."""
  d = Quotas()
  parser.add_argument(QUOTA_FLAGS["stored_bytes"], type=float,
                      default=d.stored_bytes / (1 << 30),
                      help="GiB of records and blobs one owner's proofs may hold")
  parser.add_argument(QUOTA_FLAGS["open_proofs"], type=int, default=d.open_proofs,
                      help="proofs of one owner receiving records at once")
  parser.add_argument(QUOTA_FLAGS["experiments"], type=int, default=d.experiments,
                      help="experiments one owner may create")
