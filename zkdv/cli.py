"""The ``zkdv`` command: ``zkdv verify PATH`` and ``zkdv inspect PATH``.

Example::

  $ zkdv verify zkdv-proofs/my-run-20261202-101010-ab12cd --json
  $ zkdv verify downloaded/ --server-key 3b6a27bc... --strict
  $ zkdv inspect zkdv-proofs/my-run-20261202-101010-ab12cd --stablehlo programs/
"""

import argparse
import contextlib
import json
import os
import pathlib
import shlex
import sys
import traceback

import cbor2

import zkdv
from zkdv import challenge
from zkdv import errors
from zkdv import inspect as inspect_lib
from zkdv import receipt
from zkdv import transcript
from zkdv import verify as verify_lib
from zkdv.config import Tolerance


EXIT_USAGE = 64  # sysexits.h EX_USAGE: the command line is wrong
EXIT_NO_TRANSCRIPT = 66  # sysexits.h EX_NOINPUT: no transcript at PATH
_NO_REPORT_CODES = f"""  {EXIT_USAGE}  usage error (unknown option, bad argument)
  {EXIT_NO_TRANSCRIPT}  no transcript at PATH: it does not exist or is not a ZKDV transcript
{EXIT_USAGE} and {EXIT_NO_TRANSCRIPT} write to stderr only: no report on stdout, even with --json.
"""
_EXIT_CODES = f"""exit codes:
  0   verified: every required claim holds
  1   invalid, or a required claim does not hold
  2   could not verify (the transcript, or a required claim)
  {verify_lib.EXIT_INTERNAL_ERROR}  could not verify: the verifier itself failed (a bug, out of
      memory); the report's "fault" says why, the traceback is on stderr. Not a
      verdict: retry on a larger machine or report the bug.
{_NO_REPORT_CODES}"""
_INSPECT_EXIT_CODES = f"""exit codes:
  0   summarized
  2   the transcript or one of its programs cannot be read
{_NO_REPORT_CODES}"""
MAX_LISTED = 10  # transcripts named in the hint for a folder of transcripts


def progress_bar(stream, label: str):
  """A ``show(done, total)`` that redraws one line on a terminal (``\\r``) and,
  on anything else (a log file, a pipe), writes a full line per tenth done.

  Example: ``show = progress_bar(sys.stderr, "replaying checks"); show(3, 12)``.
  """
  terminal = stream.isatty()
  tenths = set()

  def show(done: int, total: int) -> None:
    if total == 0:
      return
    if terminal:
      width = 30
      filled = width * done // total
      stream.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}"
                   + ("\n" if done == total else ""))
    elif (tenth := 10 * done // total) not in tenths:
      tenths.add(tenth)
      stream.write(f"{label}: {done}/{total}\n")
    stream.flush()
  return show


def _is_transcript(folder: pathlib.Path) -> bool:
  return (folder / transcript.RECORDS_FILE).is_file()


def _starts_with_root(records: pathlib.Path) -> bool:
  """Whether the file's first CBOR item is a ZKDV root record (unreadable: assumed so,
  and left to the verifier to report)."""
  try:
    with open(records, "rb") as f:
      first = cbor2.CBORDecoder(f).decode()
  except OSError:
    return True
  except (cbor2.CBORDecodeError, EOFError, OverflowError, ValueError):
    return False  # a MemoryError propagates: a resource limit, not a malformed file
  return isinstance(first, dict) and first.get("type") == "root"


def _no_transcript(command: str, path: pathlib.Path) -> str | None:
  """Why there is no transcript at ``path`` to ``command``, with what to run
  instead; None when there is one.

  Example: ``_no_transcript("verify", pathlib.Path("zkdv-proofs"))`` lists the
  transcripts in ``zkdv-proofs``, newest first.
  """
  if not path.exists():
    return f"zkdv {command}: no such file or folder: {str(path)!r}"
  if path.is_dir() and not _is_transcript(path):
    found = sorted((p for p in path.iterdir() if p.is_dir() and _is_transcript(p)),
                   key=lambda p: (p / transcript.RECORDS_FILE).stat().st_mtime, reverse=True)
    if not found:
      return (f"zkdv {command}: {str(path)!r} is not a ZKDV transcript: it has no "
              f"{transcript.RECORDS_FILE}.\nhint: a transcript is the folder a run logs as "
              "'transcript at ...', by default ./zkdv-proofs/<name>-<stamp>-<id>.")
    more = f"\n  ... and {len(found) - MAX_LISTED} more" if len(found) > MAX_LISTED else ""
    return (f"zkdv {command}: {str(path)!r} is a folder of {len(found)} transcript"
            f"{'s' if len(found) > 1 else ''}, not a transcript. Pick one of them "
            "(newest first):\n" + "\n".join(
                f"  zkdv {command} {shlex.quote(str(p))}" for p in found[:MAX_LISTED]) + more)
  if not _starts_with_root(transcript.records_path(path)):
    return (f"zkdv {command}: {str(path)!r} is not a ZKDV transcript: it does not start "
            "with a root record.\nhint: pass the transcript folder (the one holding "
            f"{transcript.RECORDS_FILE} and blobs/) or its {transcript.RECORDS_FILE}.")
  return None


def _human_report(report: verify_lib.Report) -> str:
  by_mode = {}
  for c in report.checks:
    by_mode.setdefault((c.kind, c.mode, c.status), 0)
    by_mode[(c.kind, c.mode, c.status)] += 1
  rows = [("transcript", report.path), ("transcript id", report.transcript_id or "-"),
          ("name", report.name or "-"), ("challenger", report.challenger or "-"),
          ("records", str(report.records)), ("steps", str(report.steps)),
          ("finished", "yes" if report.finished else "no")]
  rows += [(f"{kind} checks ({mode}, {status})", str(n))
           for (kind, mode, status), n in sorted(by_mode.items())]
  if any(c.mode == "equivalent" for c in report.checks):
    rows.append(("max error (equivalent)",
                 f"abs {max(c.max_abs_error for c in report.checks):.3g}, "
                 f"rel {max(c.max_rel_error for c in report.checks):.3g}, "
                 f"ulp {max(c.max_ulp_error for c in report.checks)}"))
  rows.append(("batch rows opened as probes", str(report.probed_rows)))
  rows.append(("discontinuities", ", ".join(map(str, report.discontinuities)) or "none"))
  if report.receipt:
    rows.append(("receipt", f"signed by {report.receipt['server_key'][:16]}, says "
                 f"{report.receipt['verdict']!r} "
                 f"({'agrees' if report.receipt['agrees'] else 'DISAGREES'})"))
    attempts = report.receipt.get("attempts")
    if isinstance(attempts, dict):
      rows.append(("owner's attempts", f"{attempts.get('slots')} proof slots, "
                   f"{attempts.get('after_unanswered_challenge')} stopped right after an "
                   f"unanswered challenge (receipt)"))
  rows.append(("verdict", report.verdict.upper()))
  if report.standing:
    rows.append(("state", report.standing["label"]))
  width = max(len(k) for k, _ in rows)
  lines = [f"{k:<{width}}  {v}" for k, v in rows]
  lines.append(f"claims (required: {', '.join(report.required) or 'none'}):")
  for c in report.claims:
    mark = "*" if c.name in report.required else " "
    lines.append(f" {mark}{c.name:<11} {c.status:<17} {c.detail}")
  unmet = report.unmet
  lines.append(f"exit {report.exit_code}: " + (
      "verified, every required claim holds" if report.exit_code == 0 else
      f"verdict {report.verdict}" + (f"; required claims not holding: "
                                     f"{', '.join(c.name for c in unmet)}" if unmet else "")))
  lines += [f"note: {n}" for n in report.notes]
  lines += [f"FAILED {f.code} at {f.where}: {f.message}" for f in report.findings]
  if report.fault:
    lines.append(f"could not verify: {report.fault} (a fault of the verifier, not a "
                 "finding about the transcript; the traceback is above)")
  return "\n".join(lines)


@contextlib.contextmanager
def _stdout_to_stderr():
  """Sends what anything writes to file descriptor 1 to 2 instead."""
  sys.stdout.flush()
  saved = os.dup(1)
  os.dup2(2, 1)
  try:
    yield
  finally:
    sys.stdout.flush()
    os.dup2(saved, 1)
    os.close(saved)


MAX_FORCED_DEVICES = 1024  # an uploaded transcript cannot ask for more host devices


def prepare_replay(path) -> None:
  """Sets up this process to replay the transcript's CPU programs: as many
  forced host devices and the same collectives as they ran with.

  Runs before JAX starts. Anything it cannot read or set up is left to the
  verifier, which then reports what the replay needs.
  """
  try:
    programs = [p.record for p in transcript.read_transcript(path).records
                if p.record.get("type") == "program" and p.record.get("platforms") == ["cpu"]]
  except (OSError, errors.TranscriptFormatError):
    return
  devices = max((n for p in programs if isinstance(n := p.get("nr_devices"), int)
                 and 1 <= n <= MAX_FORCED_DEVICES), default=1)
  flags = os.environ.get("XLA_FLAGS", "")
  if devices > 1 and "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
  wanted = {p.get("collectives") for p in programs
            if p.get("collectives") in ("gloo", "mpi")}
  if len(wanted) == 1:
    from zkdv.jax import replay  # pylint: disable=g-import-not-at-top
    try:
      replay.use_cpu_collectives(wanted.pop())
    except RuntimeError as e:  # JAX already started in this process
      print(f"zkdv verify: cannot set up CPU collectives here: {e}", file=sys.stderr)


_VERIFY_HELP = f"""Verify a transcript: chain, challenges, openings, replays.

Claims (docs/design.md §10): {", ".join(verify_lib.CLAIMS)}.
By default only chain and replays are required: an offline, self-audited run
that replays is accepted (exit 0) and says "self-audited: detects faults, not a
dishonest prover". Use --require to name the claims an audit needs, or --strict
for all of them with exact replays (what DVBench ranks).
"""


def _key_bytes(text: str, what: str, parse) -> bytes:
  """A key from hex on the command line or from a file holding hex (or raw bytes)."""
  path = pathlib.Path(text)
  try:
    data = path.read_bytes() if path.is_file() else text
    if isinstance(data, bytes) and len(data) != 32:
      data = data.decode("ascii")
    return parse(data)
  except (OSError, UnicodeDecodeError, ValueError) as e:
    raise argparse.ArgumentTypeError(f"{what}: {e}") from None


def _server_key(text: str) -> bytes:
  return _key_bytes(text, "--server-key", receipt.parse_public_key)


def _parse_challenge_key(data: str | bytes) -> bytes:
  key = bytes.fromhex(data.strip()) if isinstance(data, str) else data
  if len(key) != challenge.KEY_BYTES:
    raise ValueError(f"a challenge key has {challenge.KEY_BYTES} bytes (64 hex digits).")
  return key


def _challenge_key(text: str) -> bytes:
  if not pathlib.Path(text).is_file():
    raise argparse.ArgumentTypeError(f"--challenge-key-file: no file {text!r}.")
  return _key_bytes(text, "--challenge-key-file", _parse_challenge_key)


def _dataset_root(text: str) -> bytes:
  try:
    root = bytes.fromhex(text)
  except ValueError:
    root = b""
  if len(root) != 32:
    raise argparse.ArgumentTypeError("a dataset root is 64 hex digits (TrainingSet(rows).root).")
  return root


def _claims(text: str) -> tuple:
  names = tuple(n.strip() for n in text.split(",") if n.strip())
  unknown = set(names) - set(verify_lib.CLAIMS)
  if unknown:
    raise argparse.ArgumentTypeError(f"unknown claims {sorted(unknown)}; choose from "
                                     f"{', '.join(verify_lib.CLAIMS)}.")
  return names


class _Parser(argparse.ArgumentParser):
  """An ArgumentParser whose usage errors exit with EXIT_USAGE, not 2 ("could not verify")."""

  def error(self, message):
    self.print_usage(sys.stderr)
    self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
  """Help text as written, with each option's default (unless it is None or False)."""

  def _get_help_string(self, action):
    if action.default is None or action.default is False:
      return action.help
    return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="zkdv", description="Verify and inspect ZKDV transcripts.",
                   epilog=_EXIT_CODES, formatter_class=_Formatter)
  parser.add_argument("--version", action="version", version=f"zkdv {zkdv.__version__}")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                             help="zkdv COMMAND --help shows its options")
  v = sub.add_parser("verify", help="verify a transcript (exit 0 only if verified with every "
                     "required claim)", description=_VERIFY_HELP, epilog=_EXIT_CODES,
                     formatter_class=_Formatter)
  v.add_argument("path", metavar="PATH", help="a transcript folder (holding "
                 f"{transcript.RECORDS_FILE}) or its {transcript.RECORDS_FILE}")
  v.add_argument("--replay", choices=("sampled", "none"), default="sampled",
                 help="sampled: replay every challenged check; none: open checks without "
                 "replaying them (never exit 0)")
  v.add_argument("--json", action="store_true", help="print the report as JSON")
  v.add_argument("--quiet", action="store_true", help="print nothing; use the exit code")
  v.add_argument("--tolerance", nargs=2, type=float, metavar=("RTOL", "ATOL"),
                 help="loosest tolerance accepted for equivalent replays (default: "
                 f"{Tolerance().rtol:g} {Tolerance().atol:g})")
  v.add_argument("--min-checks", type=int, default=1, metavar="N",
                 help="challenged update checks that must replay")
  v.add_argument("--require", type=_claims, default=",".join(verify_lib.DEFAULT_REQUIRED),
                 metavar="CLAIM,...", help="claims that must hold for exit 0")
  v.add_argument("--strict", action="store_true", help="require every claim: server-chosen "
                 "challenges, exact replays, attested start, batch-dependent program, probes")
  v.add_argument("--server-key", type=_server_key, metavar="HEX|FILE",
                 help="DVBench's public key: check PATH/receipt.cbor and re-derive every "
                 "challenge from the key it publishes")
  v.add_argument("--challenge-key-file", type=_challenge_key, metavar="FILE",
                 help="the challenge key K in hex (DVBench's own workers, before a receipt): "
                 "re-derives the challenges, but the chain's binding and the challenges "
                 "claim could not be verified (only a signed receipt shows them)")
  v.add_argument("--dataset-root", type=_dataset_root, metavar="HEX",
                 help="the Merkle root of the dataset the run must draw its batches from "
                 "(proof.batches; TrainingSet(rows).root): else the data claim names the "
                 "root the run declared, which is the prover's choice")
  v.add_argument("--progress-file", metavar="FILE",
                 help="write 'KIND STEP' of the check being run into FILE as each starts "
                 "(what a verification stopped for its time was replaying)")
  v.add_argument("--jobs", type=_jobs, default=1, metavar="N",
                 help="replay segments' update checks in N processes (same report; pays "
                 "where one replay leaves cores idle)")
  i = sub.add_parser("inspect", help="summarize a transcript and its programs without "
                     "running them", description="Summarize a transcript and its programs "
                     "without running them.", epilog=_INSPECT_EXIT_CODES,
                     formatter_class=_Formatter)
  i.add_argument("path", metavar="PATH", help="a transcript folder (holding "
                 f"{transcript.RECORDS_FILE}) or its {transcript.RECORDS_FILE}")
  i.add_argument("--json", action="store_true", help="print the summary as JSON")
  i.add_argument("--stablehlo", metavar="OUT", help="write each program's StableHLO text "
                 "into the folder OUT")
  return parser


def _check_file(path: str):
  """``on_check`` writing ``KIND STEP`` into ``path``, replacing what it held."""
  def write(kind: str, step: int) -> None:
    with open(path, "w", encoding="ascii") as f:
      f.write(f"{kind} {step}\n")
  return write


def _jobs(text: str) -> int:
  if not text.isdigit() or not 1 <= int(text) <= 256:
    raise argparse.ArgumentTypeError(f"--jobs takes a number of processes in [1, 256], "
                                     f"got {text!r}.")
  return int(text)


def _run_inspect(args) -> int:
  try:
    summary = inspect_lib.inspect_transcript(args.path)
    written = inspect_lib.write_stablehlo(args.path, args.stablehlo) if args.stablehlo else []
  except (OSError, ValueError, errors.TranscriptFormatError) as e:
    print(f"zkdv inspect: {e}", file=sys.stderr)
    return 2
  print(json.dumps(summary, indent=2) if args.json else inspect_lib.human(summary))
  for path in written:
    print(f"wrote {path}", file=sys.stderr)
  return 0


def main(argv=None) -> int:
  """Runs the command; any exception of its own (a bug, out of memory) exits 70 with its
  traceback on stderr: never 1 ("invalid") or 2, which are verdicts."""
  try:
    return _main(argv)
  except Exception:  # pylint: disable=broad-except  # a fault of zkdv, not a verdict
    traceback.print_exc()
    print("zkdv: could not verify: internal error (the traceback is above); this is not a "
          "verdict about the transcript.", file=sys.stderr)
    return verify_lib.EXIT_INTERNAL_ERROR


def _main(argv=None) -> int:
  args = _parser().parse_args(argv)
  missing = _no_transcript(args.command, pathlib.Path(args.path))
  if missing:
    print(missing, file=sys.stderr)
    return EXIT_NO_TRANSCRIPT
  if args.command == "inspect":
    return _run_inspect(args)
  show_progress = not (args.quiet or args.json)
  with _stdout_to_stderr():  # native libraries (gloo) print; stdout carries the report
    if args.replay != "none":
      prepare_replay(args.path)
    report = verify_lib.verify(
        args.path, replay=args.replay, min_checks=args.min_checks, required=args.require,
        strict=args.strict, server_key=args.server_key, challenge_key=args.challenge_key_file,
        tolerance=Tolerance(*args.tolerance) if args.tolerance else None,
        progress=progress_bar(sys.stderr, "replaying checks") if show_progress else None,
        jobs=args.jobs, dataset_root=args.dataset_root,
        on_check=_check_file(args.progress_file) if args.progress_file else None)
  if args.json:
    print(report.dumps())
  elif not args.quiet:
    print(_human_report(report))
  return report.exit_code


if __name__ == "__main__":
  sys.exit(main())
