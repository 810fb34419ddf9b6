"""``zkdv inspect``: what a transcript's programs compute, without running them.

Per program (the init program of an attested start among them): its inputs
and outputs (paths, shapes, dtypes), operation counts and custom calls from its
StableHLO, parameter count, and the bytes of constants it embeds against the
budget (``zkdv.config.MAX_PROGRAM_CONSTANT_BYTES``). All of it is derived from the
exported module (``zkdv.jax.stablehlo``), never read from a field the prover
wrote; JAX is imported only when there is a program to read. Whether an update
reads its batch is tested on replay (``zkdv verify``), not here.

Example::

  summary = inspect_transcript("zkdv-proofs/my-run")
  print(human(summary))
  write_stablehlo("zkdv-proofs/my-run", "programs/")
"""

import os
import pathlib

from zkdv import config
from zkdv import errors
from zkdv import transcript
from zkdv.verify import structure
from zkdv.verify.programs import parameter_count
from zkdv.verify.report import Report


def _model(path) -> structure.Transcript:
  """The verifier's model of the transcript, or OSError/TranscriptFormatError."""
  contents = transcript.read_transcript(path)
  model = structure.read(contents, transcript.records_path(path).parent,
                         Report(path=str(path)))
  if model is None:
    first = contents.records[0].record if contents.records else {}
    if first.get("type") == "root":  # UnsupportedFormatError says which format it reads
      transcript.check_format(first.get("format_version"))
    raise errors.TranscriptFormatError(f"{path} does not start with a root record.")
  return model


def _exported(program):
  """(exported, summary, why it is refused) of a program; what cannot be read is None."""
  import jax  # pylint: disable=g-import-not-at-top
  from zkdv.jax import stablehlo  # pylint: disable=g-import-not-at-top
  if program.blob is None:
    return None, None, "the program blob is missing or does not match its id"
  try:
    exported = jax.export.deserialize(bytearray(program.blob))
  except Exception as e:  # pylint: disable=broad-except  # a malformed blob is reported
    return None, None, f"the program blob does not deserialize: {type(e).__name__}"
  summary = None
  try:
    summary = stablehlo.analyze(exported)
    stablehlo.check_safe(exported, summary)
  except stablehlo.UnsafeProgramError as e:
    return exported, summary, str(e)
  return exported, summary, None


def _leaf(layout, aval=None) -> dict:
  return {"path": layout.path, "shape": list(layout.shape), "dtype": layout.dtype,
          **({"exported": f"{aval.dtype}{list(aval.shape)}"} if aval is not None else {})}


def _program(program: structure.Program) -> dict:
  exported, summary, error = _exported(program)
  in_avals = exported.in_avals if exported else [None] * len(program.inputs)
  state, batch = iter(program.state), iter(program.batch)
  inputs = [{"role": kind, **_leaf(next(state if kind == "state" else batch), aval)}
            for kind, aval in zip(program.inputs, in_avals)]
  outputs = [_leaf(l) for l in program.post]
  return {
      "number": program.number, "program_id": program.program_id.hex(),
      "mode": program.mode, "platforms": list(program.platforms),
      "inputs": inputs, "post_state": outputs,
      "outputs": len(exported.out_avals) if exported else None,
      "parameters": parameter_count(program),
      "operations": summary.op_counts if summary else None,
      "custom_calls": list(summary.custom_calls) if summary else None,
      "constant_bytes": summary.constant_bytes if summary else None,
      "constant_budget": config.MAX_PROGRAM_CONSTANT_BYTES,
      "refused": error,
  }


def _init_program(init: structure.Init) -> dict:
  exported, summary, error = _exported(init)
  return {
      "program_id": init.program_id.hex(), "platforms": list(init.platforms),
      "inputs": [_leaf(l) for l in init.inputs],
      "outputs": len(init.outputs),
      # declared by the prover; the verifier checks it against the opened base inputs
      "base_checkpoint": None if init.base_checkpoint is None else init.base_checkpoint.hex(),
      "operations": summary.op_counts if summary else None,
      "custom_calls": list(summary.custom_calls) if summary else None,
      "constant_bytes": summary.constant_bytes if summary else None,
      "constant_budget": config.MAX_PROGRAM_CONSTANT_BYTES,
      "refused": error,
  }


def inspect_transcript(path: str | os.PathLike) -> dict:
  """A summary of the transcript and each of its programs (JSON-ready)."""
  model = _model(path)
  root = model.root or {}
  kinds = {}
  for kind in (c.kind for c in model.checks.values()):
    kinds[kind] = kinds.get(kind, 0) + 1
  return {
      "transcript_id": model.transcript_id.hex() if model.transcript_id else None,
      "records": model.records,
      "root": {k: root.get(k) for k in ("name", "prover", "format_version", "platform",
                                          "versions")},
      "challenger": (root.get("challenger") or {}).get("kind"),
      "attested_start": model.init is not None,
      "init_program": None if model.init is None else _init_program(model.init),
      "programs": [_program(p) for p in model.programs.values()],
      "data": None if model.data is None else {
          "root": model.data.root.hex(), "rows": model.data.rows,
          "batch_size": model.data.batch_size,
          "leaves": [_leaf(l) for l in model.data.layouts]},
      "steps": len(model.steps), "checks": kinds,
      "final": None if model.final is None else {
          k: model.final.get(k) for k in ("steps", "status", "discontinuities")},
  }


def write_stablehlo(path: str | os.PathLike, out: str | os.PathLike) -> list[pathlib.Path]:
  """Writes each program's StableHLO text to ``out/program-N-ID.mlir``; returns the files."""
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  written = []
  for program in _model(path).programs.values():
    exported, _, error = _exported(program)
    if exported is None:
      raise ValueError(f"program {program.number} cannot be read: {error}")
    target = out / f"program-{program.number}-{program.program_id.hex()[:16]}.mlir"
    target.write_text(exported.mlir_module())
    written.append(target)
  return written


def human(summary: dict) -> str:
  """The summary as text: one block per program."""
  root = summary["root"]
  lines = [f"transcript {summary['transcript_id']} ({root['name']}, {summary['records']} "
           f"records, {summary['steps']} steps, challenger {summary['challenger']}, "
           f"start {'attested' if summary['attested_start'] else 'unattested'})",
           f"checks: {summary['checks'] or 'none'}"]
  data = summary.get("data")
  if data is not None:
    lines.append(f"data: a seeded order over dataset {data['root'][:16]} ({data['rows']:,} rows "
                 f"of " + ", ".join(f"{l['path']} {l['dtype']}{l['shape'][1:]}"
                                    for l in data["leaves"])
                 + f"), batches of {data['batch_size']} (declared; zkdv verify checks it)")
  init = summary.get("init_program")
  if init is not None:
    lines += [f"init program {init['program_id'][:16]} ({'/'.join(init['platforms'])}), "
              f"{init['outputs']} outputs" + (
                  "" if init["base_checkpoint"] is None else
                  f", from base checkpoint {init['base_checkpoint']} (declared)"),
              "  inputs: " + ", ".join(f"{i['path']} {i['dtype']}{i['shape']}"
                                       for i in init["inputs"]),
              *_program_lines(init)]
  for p in summary["programs"]:
    lines += [f"program {p['number']} {p['program_id'][:16]} ({p['mode']}, "
              f"{'/'.join(p['platforms'])})",
              f"  parameters: {p['parameters']:,}",
              "  inputs: " + ", ".join(f"{i['role']} {i['path']} {i['dtype']}{i['shape']}"
                                       for i in p["inputs"]),
              *_program_lines(p)]
  return "\n".join(lines)


def _program_lines(p: dict) -> list[str]:
  """Operations, custom calls, constants against their budget, and any refusal."""
  ops = p["operations"] or {}
  top = sorted(ops.items(), key=lambda kv: -kv[1])[:8]
  constants = ("unknown (program unreadable)" if p["constant_bytes"] is None else
               f"{p['constant_bytes']:,} bytes (budget {p['constant_budget']:,})")
  lines = [f"  operations: {sum(ops.values())} ("
           + ", ".join(f"{k.split('.')[-1]} {v}" for k, v in top) + ")",
           f"  custom calls: {', '.join(p['custom_calls'] or []) or 'none'}",
           f"  constants: {constants}"]
  if p["refused"]:
    lines.append(f"  REFUSED: {p['refused']}")
  return lines
