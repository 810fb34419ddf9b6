"""The ``zkdv`` command: ``zkdv verify PATH`` and ``zkdv inspect PATH``.

Example::

  $ zkdv verify zkdv-proofs/my-run-20261202-101010-ab12cd --json
"""

import argparse
import contextlib
import json
import os
import sys

from zkdv import errors
from zkdv import transcript
from zkdv import verify as verify_lib


def progress_bar(stream, label: str):
  """A ``show(done, total)`` that draws a one-line progress bar on ``stream``."""
  def show(done: int, total: int) -> None:
    if total == 0:
      return
    width = 30
    filled = width * done // total
    stream.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
      stream.write("\n")
    stream.flush()
  return show


def _human_report(report: verify_lib.Report) -> str:
  by_mode = {}
  for c in report.checks:
    by_mode.setdefault((c.kind, c.mode, c.status), 0)
    by_mode[(c.kind, c.mode, c.status)] += 1
  rows = [("transcript", report.path), ("transcript id", report.transcript_id or "-"),
          ("name", report.name or "-"), ("records", str(report.records)),
          ("steps", str(report.steps)), ("finished", "yes" if report.finished else "no")]
  rows += [(f"{kind} checks ({mode}, {status})", str(n))
           for (kind, mode, status), n in sorted(by_mode.items())]
  worst = max((c.max_ulp_error for c in report.checks), default=0)
  if any(c.mode == "equivalent" for c in report.checks):
    rows.append(("max error (equivalent)",
                 f"abs {max(c.max_abs_error for c in report.checks):.3g}, "
                 f"rel {max(c.max_rel_error for c in report.checks):.3g}, ulp {worst}"))
  rows.append(("probed batch rows", str(report.probed_rows)))
  rows.append(("discontinuities", ", ".join(map(str, report.discontinuities)) or "none"))
  rows.append(("verdict", report.verdict.upper()))
  width = max(len(k) for k, _ in rows)
  lines = [f"{k:<{width}}  {v}" for k, v in rows]
  for f in report.findings:
    lines.append(f"FAILED {f.code} at {f.where}: {f.message}")
  return "\n".join(lines)


def _inspect(path) -> dict:
  contents = transcript.read_transcript(path)
  out = {"records": len(contents.records), "torn_tail": None, "root": None,
         "programs": [], "steps": 0, "checks": {}, "final": None}
  if contents.torn_tail:
    out["torn_tail"] = {"offset": contents.torn_tail.offset,
                        "bytes": contents.torn_tail.nbytes}
  for parsed in contents.records:
    rec = parsed.record
    kind = rec.get("type")
    if kind == "root":
      out["root"] = {"transcript_id": parsed.record_id.hex(),
                     **{k: rec.get(k) for k in ("name", "prover", "format_version",
                                                "platform", "versions", "config", "start")}}
    elif kind == "program":
      out["programs"].append({
          "program_id": rec.get("program_id", b"").hex(), "function": rec.get("function"),
          "mode": rec.get("mode"), "state_leaves": len(rec.get("state_layout", [])),
          "batch_leaves": len(rec.get("batch_layout", [])),
          "static_arguments": rec.get("static_arguments")})
    elif kind == "step":
      out["steps"] += 1
    elif kind == "check":
      key = str(rec.get("kind"))
      out["checks"][key] = out["checks"].get(key, 0) + 1
    elif kind == "final":
      out["final"] = {"steps": rec.get("steps"), "status": rec.get("status"),
                      "discontinuities": rec.get("discontinuities")}
  return out


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


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="zkdv", description="Verify and inspect ZKDV transcripts.")
  sub = parser.add_subparsers(dest="command", required=True)
  v = sub.add_parser("verify", help="verify a transcript (exit 0 only if verified; "
                     "1 invalid; 2 could not verify)")
  v.add_argument("path")
  v.add_argument("--replay", choices=("sampled", "none"), default="sampled")
  v.add_argument("--json", action="store_true", help="print the report as JSON")
  v.add_argument("--quiet", action="store_true", help="print nothing; use the exit code")
  i = sub.add_parser("inspect", help="summarize a transcript without replaying it")
  i.add_argument("path")
  args = parser.parse_args(argv)
  if args.command == "inspect":
    try:
      print(json.dumps(_inspect(args.path), indent=2, default=lambda b: b.hex()))
    except (OSError, errors.TranscriptFormatError) as e:
      print(f"zkdv inspect: {e}", file=sys.stderr)
      return 2
    return 0
  show_progress = not (args.quiet or args.json) and sys.stderr.isatty()
  with _stdout_to_stderr():  # native libraries (gloo) print; stdout carries the report
    if args.replay != "none":
      prepare_replay(args.path)
    report = verify_lib.verify(args.path, replay=args.replay,
                               progress=progress_bar(sys.stderr, "replaying checks")
                               if show_progress else None)
  if args.json:
    print(report.dumps())
  elif not args.quiet:
    print(_human_report(report))
  return report.exit_code


if __name__ == "__main__":
  sys.exit(main())
