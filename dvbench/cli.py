"""The ``dvbench`` command: ``serve``, ``worker``, ``token create|list|revoke``, ``login``,
``server-key``, ``download``.

Example::

  $ dvbench token create alice --name alice-laptop --expires-in 30 --data ./dvbench-data
  $ dvbench login --url http://127.0.0.1:8000    # reads the token from stdin or a prompt
  $ dvbench serve --data ./dvbench-data --port 8000 --workers 2 --min-update-check-probability 0.1
  $ dvbench server-key --url http://127.0.0.1:8000
  $ dvbench download PROOF_ID ./proof --url http://127.0.0.1:8000
"""

import argparse
import dataclasses
import getpass
import json
import logging
import os
import pathlib
import re
import signal
import sys
import threading
import time

EXIT_NO_DATA = 66  # the --data folder is missing (or holds no database): pass --create
EXIT_NO_SERVER_EXTRA = 69  # a server command without the server's packages installed
EXIT_WEAK_SANDBOX = 71  # the kernel lacks a protection of the verifier child
EXIT_CODES = f"""exit status: 0 done, 1 failed, 2 usage error, {EXIT_NO_DATA} no data folder
(or no database in it) at --data: check the path, or pass --create to start a new one,
{EXIT_NO_SERVER_EXTRA} the server's packages are not installed: pip install 'dvbench[server]',
{EXIT_WEAK_SANDBOX} the verifier child cannot be fully confined here (see --allow-weak-sandbox)"""
# Imported only by the server's commands; installed by the ``server`` extra.
SERVER_EXTRA_MODULES = ("starlette", "uvicorn", "sqlalchemy", "anyio", "psycopg")
DATABASE_URL_ENV = "DVBENCH_DATABASE_URL"


class _Parser(argparse.ArgumentParser):
  """An ArgumentParser whose help shows each option's default (its subcommands' too)."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
    kwargs.setdefault("epilog", EXIT_CODES)
    super().__init__(*args, **kwargs)


def absolute_path(text: str) -> pathlib.Path:
  """``--data`` as an absolute path: workers and their sandboxed children run in other
  folders, where a relative path would name another place.

  >>> absolute_path("./dvbench-data") == pathlib.Path.cwd() / "dvbench-data"
  True
  """
  return pathlib.Path(os.path.abspath(os.path.expanduser(text)))


def data_folder(args) -> pathlib.Path:
  """The ``--data`` folder; made with ``--create``, else it must exist and (for SQLite)
  hold ``dvbench.db``, so a mistyped path is refused rather than a new server made."""
  data = pathlib.Path(args.data)
  if getattr(args, "create", False):
    data.mkdir(parents=True, exist_ok=True)
    return data
  missing = None
  if not data.is_dir():
    missing = f"there is no data folder {data.resolve()}"
  elif hasattr(args, "database_url") and args.database_url is None and not (
      data / "dvbench.db").is_file():
    missing = f"{data.resolve()} holds no DVBench database (dvbench.db)"
  if missing:
    print(f"dvbench {args.command}: {missing}. Check --data, or pass --create to start a "
          "new server's data there.", file=sys.stderr)
    raise SystemExit(EXIT_NO_DATA)
  return data


def _database_url(args) -> str:
  return args.database_url or f"sqlite:///{(data_folder(args) / 'dvbench.db').resolve()}"


def _store(args):
  from dvbench.server.db import NewerSchema, Store  # pylint: disable=g-import-not-at-top
  try:
    return Store.open(_database_url(args))
  except NewerSchema as e:
    raise SystemExit(f"dvbench {args.command}: {e}") from None


def _store_and_blobs(args):
  from dvbench.server.blobs import BlobStore  # pylint: disable=g-import-not-at-top
  return _store(args), BlobStore(data_folder(args) / "blobs")


def _worker_command(args) -> list[str]:
  """The command of a worker; its database URL travels in ``DATABASE_URL_ENV``, never on a
  command line that every process on the machine can read."""
  command = [sys.executable, "-m", "dvbench.cli", "worker",
             "--data", str(pathlib.Path(args.data).resolve()),
             "--lease-seconds", str(args.lease_seconds),
             "--memory-limit-gb", str(args.memory_limit_gb),
             "--time-limit", str(args.time_limit), "--time-per-check", str(args.time_per_check),
             "--max-attempts", str(args.max_attempts)]
  if args.workers > 1:
    from dvbench.server import store_jobs  # pylint: disable=g-import-not-at-top
    command += ["--owner-share", str(store_jobs.owner_share(args.workers))]
  return command + (["--allow-weak-sandbox"] if args.allow_weak_sandbox else [])


def _sandbox_or_exit(args):
  """The verifier child's protections; exits naming what the kernel lacks unless the
  operator passed --allow-weak-sandbox (then the logs and /health say it)."""
  from dvbench.server import sandbox  # pylint: disable=g-import-not-at-top
  try:
    gaps = sandbox.missing()
  except ValueError as e:
    raise SystemExit(f"dvbench {args.command}: {e}") from None
  if sandbox.weak(gaps) and not args.allow_weak_sandbox:
    print(f"dvbench {args.command}: the verifier child cannot be fully confined on this "
          f"machine; missing: {sandbox.weakness(gaps)}. Run on a kernel that grants them, or "
          "pass --allow-weak-sandbox to verify uploaded programs without them.",
          file=sys.stderr)
    raise SystemExit(EXIT_WEAK_SANDBOX)
  if gaps:
    logging.getLogger("dvbench").warning(
        "dvbench %s: the verifier sandbox is %s; missing: %s", args.command,
        "weak (--allow-weak-sandbox)" if sandbox.weak(gaps) else "without optional protections",
        sandbox.weakness(gaps))
  return sandbox.available(), gaps


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _positive_int(text: str) -> int:
  if not text.isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1.")
  return int(text)


def duration(text: str) -> float:
  """Seconds in '90', '90s', '30m', '24h' or '7d'."""
  match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip())
  if not match or float(match[1]) <= 0:
    raise argparse.ArgumentTypeError(f"{text!r} is not a duration: give e.g. 90s, 30m, 24h or 7d.")
  return float(match[1]) * _UNITS[match[2] or "s"]


def _signing_key(args):
  from dvbench.server import keys  # pylint: disable=g-import-not-at-top
  return keys.load_or_create(data_folder(args))


def _minimum_policy(args):
  from zkdv.challenge import Policy  # pylint: disable=g-import-not-at-top
  try:
    return Policy(1.0 if args.full_replay else args.min_update_check_probability,
                  args.min_state_check_probability, args.min_probe_ratio, args.max_window,
                  args.max_segment_length, args.full_replay)
  except ValueError as e:
    raise SystemExit(f"dvbench serve: {e}") from None


def serve(args) -> int:
  import uvicorn  # pylint: disable=g-import-not-at-top
  from dvbench.server import connections  # pylint: disable=g-import-not-at-top
  from dvbench.server import sandbox  # pylint: disable=g-import-not-at-top
  from dvbench.server.app import create_app  # pylint: disable=g-import-not-at-top
  from dvbench.server.ingest_processes import IngestProcesses  # pylint: disable=g-import-not-at-top
  from dvbench.server.limits import Limits, Quotas  # pylint: disable=g-import-not-at-top
  from dvbench.server.service import Service  # pylint: disable=g-import-not-at-top
  from dvbench.server.supervisor import Supervisor  # pylint: disable=g-import-not-at-top
  isolation, gaps = _sandbox_or_exit(args)  # probed before any thread starts
  store, blobs = _store_and_blobs(args)
  store.max_queued_per_owner = args.max_queued_per_owner
  blobs.remove_stale_parts(older_than=args.body_timeout)  # no upload lasts longer
  if args.ingest_processes < 1:
    raise SystemExit("dvbench serve: --ingest-processes must be at least 1.")
  signing_key = _signing_key(args)
  ingest_processes = IngestProcesses(args.ingest_processes, _database_url(args), signing_key, {
      "max_queued_per_owner": args.max_queued_per_owner}).start()
  supervisor = Supervisor(_worker_command(args), args.workers, store, env={
                              **os.environ, DATABASE_URL_ENV: args.database_url or ""},
                          abandon_after=args.abandon_after, crash_after=args.crash_after,
                          ingest_processes=ingest_processes, signing_key=signing_key).start()
  service = Service(store, blobs, signing_key, _minimum_policy(args),
                    limits=Limits.from_args(args), score_shard_rows=args.score_shard_rows,
                    memory_bytes=int(args.memory_limit_gb * (1 << 30)),
                    time_limit=args.time_limit, workers=supervisor.health,
                    isolation=sandbox.describe(isolation), sandbox_missing=gaps,
                    ingest_processes=ingest_processes, crash_after=args.crash_after,
                    max_slots_per_hour=args.max_slots_per_hour,
                    quotas=Quotas.from_args(args))
  database = "" if args.database_url is None else ", database " + _redacted(args.database_url)
  print(f"dvbench serve: listening on http://{args.host}:{args.port}, data in "
        f"{pathlib.Path(args.data).resolve()}{database}", file=sys.stderr, flush=True)
  try:
    ingest_processes.wait_ready()
    uvicorn.run(create_app(service), host=args.host, port=args.port, log_level=args.log_level,
                http=connections.guarded_h11(service.limits),
                limit_concurrency=service.limits.max_connections)
  finally:
    ingest_processes.stop()  # first: those the supervisor started die with its thread
    supervisor.stop()
  return 0


def _redacted(url: str) -> str:
  """A database URL without its password."""
  from sqlalchemy.engine import make_url  # pylint: disable=g-import-not-at-top
  try:
    return make_url(url).render_as_string(hide_password=True)
  except Exception:  # pylint: disable=broad-except  # Store.open reports a bad URL
    return "(unparsable URL)"


def worker(args) -> int:
  from dvbench.server import sandbox  # pylint: disable=g-import-not-at-top
  from dvbench.server import worker as worker_lib  # pylint: disable=g-import-not-at-top
  from dvbench.server.db import NewerSchema  # pylint: disable=g-import-not-at-top
  if args.parent_pid is not None:
    sandbox.die_with_parent(args.parent_pid)
  isolation, _ = _sandbox_or_exit(args)
  limits = worker_lib.Limits(int(args.memory_limit_gb * 2**30), args.time_limit,
                             args.time_per_check, isolation)
  store, blobs = _store_and_blobs(args)
  stop = threading.Event()
  signal.signal(signal.SIGTERM, lambda *_: stop.set())
  try:
    done = worker_lib.run(store, blobs,  # never reads the key: the server signs receipts
                          worker_id=args.worker_id or worker_lib.default_worker_id(),
                          lease_seconds=args.lease_seconds, limits=limits,
                          max_attempts=args.max_attempts, once=args.once, stop=stop,
                          owner_share=args.owner_share)
  except NewerSchema as e:  # the server was upgraded while this worker ran: claims nothing
    raise SystemExit(f"dvbench worker: {e}") from None
  if args.once and not done:
    print("dvbench worker: no job was waiting; nothing to verify.", file=sys.stderr)
  return 0


def token_create(args) -> int:
  from dvbench.server.store_tokens import BadName  # pylint: disable=g-import-not-at-top
  store = _store(args)
  try:
    _, token = store.create_token(args.owner, args.name, args.expires_in)
  except (BadName, ValueError) as e:
    raise SystemExit(f"dvbench token create: {e}") from None
  print(token)
  print(f"dvbench token create: a token for {args.owner} (printed above, shown only once); "
        "give it to Client() through DVBENCH_TOKEN or `dvbench login`.", file=sys.stderr)
  return 0


def _when(seconds: float | None) -> str:
  return "-" if seconds is None else time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(seconds))


def token_list(args) -> int:
  store = _store(args)
  rows = store.list_tokens(args.owner)
  now = time.time()
  print(f"{'name':<32} {'owner':<20} {'created':<21} {'expires':<21} state")
  for t in rows:
    state = ("revoked" if t["revoked_at"] is not None else
             "expired" if t["expires_at"] is not None and t["expires_at"] <= now else "active")
    print(f"{t['name']:<32} {t['owner']:<20} {_when(t['created_at']):<21} "
          f"{_when(t['expires_at']):<21} {state}")
  return 0


def token_revoke(args) -> int:
  store = _store(args)
  if not store.revoke_token(args.name):
    raise SystemExit(f"dvbench token revoke: no active token is named {args.name!r} (see "
                     "'dvbench token list').")
  print(f"revoked {args.name}")
  return 0


def usage(args) -> int:
  """An owner's usage against the quotas the server last started with."""
  from dvbench.server import quotas  # pylint: disable=g-import-not-at-top
  from dvbench.server.attempts import DEFAULT_MAX_SLOTS_PER_HOUR  # pylint: disable=g-import-not-at-top
  from dvbench.server.limits import Quotas  # pylint: disable=g-import-not-at-top
  store, blobs = _store_and_blobs(args)
  limits = json.loads(store.setting(quotas.QUOTAS_SETTING) or "null") or {
      **dataclasses.asdict(Quotas()), "slots_per_hour": DEFAULT_MAX_SLOTS_PER_HOUR}
  used = quotas.usage(store, blobs.size, args.owner)
  print(f"{'quota':<16} {'used':>16} {'limit':>16}  raised with")
  for quota, flag in quotas.FLAGS.items():
    print(f"{quota:<16} {used[quotas.USAGE_OF[quota]]:>16} {limits[quota]:>16}  "
          f"dvbench serve {flag}")
  return 0


def _read_token(args) -> str:
  if args.token:
    return args.token
  if sys.stdin.isatty():
    return getpass.getpass("API token (input hidden): ")
  return sys.stdin.readline()


def login(args) -> int:
  """Saves the token, readable only by the user from the moment the file exists."""
  from dvbench.client import TOKEN_FILE  # pylint: disable=g-import-not-at-top
  token = _read_token(args).strip()
  if not token:
    raise SystemExit("dvbench login: no token given: paste it at the prompt or pipe it in, "
                     "e.g. 'dvbench login --url URL < token.txt'.")
  TOKEN_FILE.parent.mkdir(parents=True, exist_ok=True)
  fd = os.open(TOKEN_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
  os.fchmod(fd, 0o600)  # a file that existed keeps its mode otherwise
  with os.fdopen(fd, "w") as f:
    json.dump({"token": token, "url": args.url}, f)
  print(f"saved the token to {TOKEN_FILE}")
  return 0


def server_key(args) -> int:
  if args.url:
    import httpx  # pylint: disable=g-import-not-at-top
    print(httpx.get(f"{args.url.rstrip('/')}/api/v1/server-key", timeout=30
                    ).raise_for_status().json()["server_key"])
    return 0
  from zkdv import receipt  # pylint: disable=g-import-not-at-top
  print(receipt.public_key_bytes(_signing_key(args)).hex())
  return 0


def download(args) -> int:
  """Writes DIR/records.cborl, DIR/blobs/* (hash checked) and DIR/receipt.cbor."""
  from dvbench.client import Http  # pylint: disable=g-import-not-at-top
  from dvbench.errors import DVBenchError  # pylint: disable=g-import-not-at-top
  from dvbench.server.blobs import BlobStore, hexdigest  # pylint: disable=g-import-not-at-top
  from zkdv.receipt import RECEIPT_FILE  # pylint: disable=g-import-not-at-top
  from zkdv.transcript import BLOBS_DIR, RECORDS_FILE, write_atomically  # pylint: disable=g-import-not-at-top
  url = args.url or os.environ.get("DVBENCH_URL")
  if not url or not BlobStore.valid_name(args.proof_id):
    raise SystemExit("dvbench download: give a proof id (64 hex digits) and --url or DVBENCH_URL.")
  folder, proof = pathlib.Path(args.dir), f"/api/v1/proofs/{args.proof_id}"
  (folder / BLOBS_DIR).mkdir(parents=True, exist_ok=True)
  blobs = 0
  http = Http(url, None, timeout=120)
  try:
    records = http.request("GET", f"{proof}/transcript").content
    write_atomically(folder / RECORDS_FILE, records)
    for digest in http.listing(f"{proof}/blobs"):
      data = (http.request("GET", f"{proof}/blobs/{digest}").content
              if BlobStore.valid_name(digest) else b"")
      if hexdigest(data) != digest:
        raise SystemExit(f"dvbench download: blob {digest[:80]!r} is not named by its hash.")
      write_atomically(folder / BLOBS_DIR / digest, data)
      blobs += 1
    receipt = http.request("GET", f"{proof}/receipt", ok=(200, 404))
  except DVBenchError as e:
    raise SystemExit(f"dvbench download: {e}") from None
  finally:
    http.close()
  wrote = f"dvbench download: wrote proof {args.proof_id} to {folder}: {len(records)} bytes " \
          f"of records, {blobs} blobs"
  if receipt.status_code != 200:
    print(f"{wrote}, no receipt ({receipt.text[:300]}); check it with: zkdv verify {folder}")
    return 0
  write_atomically(folder / RECEIPT_FILE, receipt.content)
  print(f"{wrote} and the server's signed receipt; check it with: zkdv verify {folder} "
        f"--server-key $(dvbench server-key --url {url})")
  return 0


def _add_receipt_commands(sub) -> None:
  """``server-key`` and ``download``: what anyone needs to check a proof independently."""
  k = sub.add_parser("server-key", help="print the server's Ed25519 public key (hex)")
  k.add_argument("--data", default="dvbench-data", type=absolute_path,
                 help="the server's data folder")
  k.add_argument("--url", default=None, help="ask a running server instead (None: read "
                 "the key in --data)")
  k.set_defaults(run=server_key)
  d = sub.add_parser("download", help="write a proof's records, blobs and receipt to DIR")
  d.add_argument("proof_id", help="the proof's id (64 hex digits)")
  d.add_argument("dir", help="the folder to write the transcript to")
  d.add_argument("--url", default=None, help="the server (default: $DVBENCH_URL)")
  d.set_defaults(run=download)


def main(argv=None) -> int:
  parser = _Parser(prog="dvbench", description="The DVBench service.")
  sub = parser.add_subparsers(dest="command", required=True)

  def storage(p):
    p.add_argument("--data", default="dvbench-data", type=absolute_path,
                   help="folder of the embedded database and the blob store")
    p.add_argument("--database-url", default=os.environ.get(DATABASE_URL_ENV) or None,
                   help="e.g. postgresql://user@host/db (default: $DVBENCH_DATABASE_URL); "
                   "without it, SQLite in --data")
    p.add_argument("--create", action="store_true",
                   help="make the data folder (and database) if missing; without it a "
                   "missing --data folder is refused")

  def limits(p):
    p.add_argument("--allow-weak-sandbox", action="store_true",
                   help="verify uploaded programs even where the kernel cannot give the "
                   "verifier child every protection (the logs and /api/v1/health name "
                   "those missing); without it the server and its workers refuse to start")
    p.add_argument("--lease-seconds", type=float, default=60.0,
                   help="how long a worker holds a job without renewing its lease")
    p.add_argument("--memory-limit-gb", type=float, default=16.0,
                   help="memory of the sandboxed verifier per job")
    p.add_argument("--time-limit", type=int, default=900,
                   help="the most seconds any one verification may take")
    p.add_argument("--time-per-check", type=float, default=10.0,
                   help="a proof gets 60 s plus this per check record, up to --time-limit")
    p.add_argument("--max-attempts", type=int, default=3,
                   help="a job whose worker stops this many times is given up as failed")

  s = sub.add_parser("serve", help="run the server (and its validation workers)")
  storage(s)
  limits(s)
  s.add_argument("--host", default="127.0.0.1", help="address to listen on")
  s.add_argument("--port", type=int, default=8000, help="port to listen on")
  s.add_argument("--workers", type=int, default=1, help="validation worker processes")
  s.add_argument("--ingest-processes", type=int, default=1,
                 help="processes that decode, check and store uploaded envelopes (off the "
                 "web process, so reads do not wait behind uploads)")
  from dvbench.server.limits import add_arguments, add_quota_arguments  # pylint: disable=g-import-not-at-top
  add_arguments(s)  # body size and time, concurrent uploads, bad-token rate
  add_quota_arguments(s)  # per owner: stored bytes, open proofs, experiments
  s.add_argument("--max-queued-per-owner", type=int, default=16,
                 help="jobs an owner may have waiting; beyond it closing a proof answers 429")
  s.add_argument("--abandon-after", type=duration, default=duration("24h"),
                 help="close proofs that received nothing this long as 'abandoned' (e.g. 24h)")
  s.add_argument("--crash-after", type=duration, default=duration("10m"),
                 help="a proof whose client sent nothing (records or heartbeats) this long "
                 "is 'crashed', or discarded if it never sent a step (e.g. 90s, 10m)")
  s.add_argument("--log-level", default="warning", help="uvicorn's log level")
  s.add_argument("--min-update-check-probability", type=float, default=0.1,
                 help="the least update check probability a root may carry")
  s.add_argument("--min-state-check-probability", type=float, default=0.0,
                 help="the least state check probability a root may carry")
  s.add_argument("--min-probe-ratio", type=float, default=0.01,
                 help="the least probe ratio a root may carry: each batch row is opened with "
                 "at least that probability (0 leaves the data claim unmet)")
  s.add_argument("--max-slots-per-hour", type=_positive_int, default=120,
                 help="proof slots (attempts) issued per owner per hour; every slot is "
                 "counted and shown with the owner's proofs")
  s.add_argument("--max-window", type=int, default=256,
                 help="the largest rolling window (steps unanswered or undecided) a root may "
                 "carry; a prover grows its window to it only as far as the round trip needs")
  s.add_argument("--score-shard-rows", type=int, default=1 << 16,
                 help="evaluation rows per scoring job: larger sets split across workers")
  s.add_argument("--max-segment-length", type=int, default=32,
                 help="the most steps between two state commitments a root may carry")
  s.add_argument("--full-replay", action="store_true",
                 help="require every segment replayed (update check probability 1)")
  s.set_defaults(run=serve)

  w = sub.add_parser("worker", help="run one validation worker against the database")
  storage(w)
  limits(w)
  w.add_argument("--worker-id", default=None, help="name in job leases (None: host and pid)")
  w.add_argument("--once", action="store_true", help="process one job, then exit")
  w.add_argument("--owner-share", type=int, default=None,
                 help="the most running jobs one owner may hold while another owner's job "
                 "waits (serve passes half its --workers, rounded up)")
  w.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
  w.set_defaults(run=worker)

  t = sub.add_parser("token", help="manage API tokens")
  tsub = t.add_subparsers(dest="token_command", required=True)
  tc = tsub.add_parser("create", help="create an API token for OWNER and print it")
  storage(tc)
  tc.add_argument("owner", help="the namespace the token writes to")
  tc.add_argument("--name", default=None, help="the token's name, for list and revoke "
                  "(default OWNER-XXXXXX)")
  tc.add_argument("--expires-in", type=float, default=None, metavar="DAYS",
                  help="the token stops working after this many days (default: never)")
  tc.set_defaults(run=token_create)
  tl = tsub.add_parser("list", help="list tokens (names, owners, expiry; never the secret)")
  storage(tl)
  tl.add_argument("owner", nargs="?", default=None)
  tl.set_defaults(run=token_list)
  tr = tsub.add_parser("revoke", help="revoke the token NAME: it gets HTTP 401 from now on")
  storage(tr)
  tr.add_argument("name")
  tr.set_defaults(run=token_revoke)

  u = sub.add_parser("usage", help="an owner's usage of its quotas (stored bytes, slots in "
                     "the last hour, open proofs, experiments)")
  storage(u)
  u.add_argument("owner")
  u.set_defaults(run=usage)

  l = sub.add_parser("login", help="save a token (and server URL) for Client(); the token is "
                     "read from stdin or a hidden prompt")
  l.add_argument("--token", default=None, help="the token on the command line (it leaks into "
                 "shell history and the process list; prefer stdin or the prompt)")
  l.add_argument("--url", default=None, help="the server to save with the token")
  l.set_defaults(run=login)

  _add_receipt_commands(sub)
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.INFO if args.command == "worker" else logging.WARNING)
  try:
    return args.run(args)
  except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] not in SERVER_EXTRA_MODULES:
      raise
    print(f"dvbench {args.command}: needs the server's packages, and {e.name} is not "
          "installed. Install them with: pip install \"dvbench[server]\"", file=sys.stderr)
    return EXIT_NO_SERVER_EXTRA


if __name__ == "__main__":
  sys.exit(main())
