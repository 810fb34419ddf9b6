"""The attested start: step 0's params are outputs of a replayed init program.

An ``init`` record (docs/protocol.md) names an exported init program, its
opened inputs (the PRNG key, example arguments) and its outputs' digests; a
``start`` check of step 0 opens the piece digests of step 0's pre-state. The
start is attested when the pieces make up step 0's pre-state, replaying the
init program gives exactly the recorded outputs, and every params leaf of
step 0 equals one of those outputs (same dtype, shape and digests).

Example::

  require_start(ctx)
  outcome = start_check(ctx, check, step, program, "record 4")
"""

from zkdv import digest
from zkdv import errors
from zkdv import transcript
from zkdv.verify.context import Verification
from zkdv.verify.report import UNVERIFIABLE, CheckOutcome


def require_start(ctx: Verification) -> None:
  """An init record needs its start check, and a start check its init record."""
  model = ctx.model
  linked = (0, "start") in model.checks
  if model.init is not None and model.steps and not linked:
    ctx.report.fail("start", model.init.where, "the init record is not linked to step 0 "
                    "by a start check.")
  if linked and model.init is None:
    ctx.report.fail("start", model.checks[(0, "start")].where, "a start check without an "
                    "init record.")


def _pieces_ok(pieces, layouts) -> bool:
  return (isinstance(pieces, list) and len(pieces) == len(layouts)
          and all(isinstance(p, list) and len(p) == len(l.boxes)
                  and all(isinstance(d, bytes) for d in p) for p, l in zip(pieces, layouts)))


def _init_outputs(ctx: Verification, where: str):
  """The init program's outputs replayed from its opened inputs; None with a finding."""
  init = ctx.model.init
  try:
    inputs = [(transcript.read_blob(ctx.model.folder, b, l.dtype, l.shape), l)
              for b, l in zip(init.input_blobs, init.inputs)]
  except FileNotFoundError:
    ctx.report.fail("start", where, "an input blob of the init program is missing.",
                    UNVERIFIABLE)
    return None
  except (OSError, errors.TranscriptFormatError, TypeError, AttributeError) as e:
    ctx.report.fail("start", where, f"an input blob of the init program: {e}")
    return None
  if ctx.options.replay == "none":
    ctx.report.fail("start", where, "the init program was not replayed (--replay none).",
                    UNVERIFIABLE)
    return None
  outs = ctx.programs.run(init, inputs, where)
  if outs is not None and [digest.leaf_digest(o) for o in outs] != list(init.outputs):
    ctx.report.fail("start", where, "replaying the init program does not reproduce its "
                    "recorded outputs bit for bit.")
    return None
  return outs


def start_check(ctx: Verification, check, step, program, where: str) -> CheckOutcome:
  outcome = CheckOutcome(step.index, "start", "init replay", "failed")
  pieces = check.fields["pre_state_pieces"]
  if step.index != 0 or ctx.model.init is None:
    return outcome  # named by require_start or the structure
  if not _pieces_ok(pieces, program.state) or digest.state_digest_from_pieces(
      program.state, pieces) != step.pre_state:
    ctx.report.fail("start", where, "pre_state_pieces do not make up step 0's pre-state.")
    return outcome
  outs = _init_outputs(ctx, where)
  if outs is None:
    return outcome
  for i in program.params_leaves:
    layout = program.state[i]
    if not any(str(o.dtype) == layout.dtype and tuple(o.shape) == layout.shape
               and digest.piece_digests(layout, o) == pieces[i] for o in outs):
      ctx.report.fail("start", where, f"params leaf {layout.path} of step 0 is not an output "
                      "of the init program.")
      return outcome
  outcome.status = "verified"
  return outcome
