"""The attested start: step 0's whole state is the output of a replayed init program.

An ``init`` record (docs/protocol.md) names an exported init program, its
opened inputs (the PRNG key, example arguments) and its outputs' digests; a
``start`` check of step 0 opens the piece digests of step 0's pre-state. The
start is attested when the pieces make up step 0's pre-state, every key input
is the proof's start key (derived from its slot, ``zkdv.keys``), replaying the
init program gives exactly the recorded outputs, every leaf of step 0's state
(params, optimizer state, step, added fields) equals one of those outputs, and
two more replays show that the inputs carry nothing: with other example values
the outputs are bit for bit the same, with another key every params leaf that
is not one value repeated (a zero bias, a unit scale) changes.

A start from a base checkpoint (``proof.init_from``) opens the base params as
the first inputs: their params digest must be the declared ``base_checkpoint``,
replayed with other base values some params leaf must change (the base is
read), and every params leaf that is not one value repeated must change with
the key or with the base.

Example::

  require_start(ctx)
  outcome = start_check(ctx, check, step, program, "record 4")
"""

import blake3
import numpy as np

from zkdv import digest
from zkdv import errors
from zkdv import keys
from zkdv import transcript
from zkdv.verify import sensitivity
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


def key_seed(ctx: Verification) -> bytes:
  """The seed of the proof's public keys (``zkdv.keys``), from its root."""
  return keys.key_seed(ctx.model.root.get("challenger"), ctx.model.transcript_id)


def keys_derived(ctx: Verification, step: int, layouts, batch, where: str) -> bool:
  """Whether every PRNG-key leaf of step ``step``'s opened batch is the proof's key of that
  step (``proof.key(step)``); a finding names the first that is not."""
  seed = key_seed(ctx)
  for array, layout in zip(batch, layouts):
    if layout.key_impl is not None and array.tobytes() != keys.key_data(seed, step,
                                                                         array.nbytes):
      ctx.report.fail("batch_key", where, f"PRNG-key leaf {layout.path} of step {step} is not "
                      f"the proof's key of step {step} (proof.key({step})): a key the prover "
                      "chooses can carry data no probe opens.")
      return False
  return True


def _opened_inputs(ctx: Verification, where: str):
  """The init program's recorded inputs [(array, layout)]; None with a finding."""
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
  seed = key_seed(ctx)
  for array, layout in inputs:
    if layout.key_impl is not None and array.tobytes() != keys.key_data(seed, None,
                                                                         array.nbytes):
      ctx.report.fail("start", where, f"the init program's key input {layout.path} is not "
                      "the proof's start key (derived from its slot): a chosen key can be "
                      "ground for a favourable start.")
      return None
  return inputs


def _init_outputs(ctx: Verification, inputs, where: str):
  """The init program's outputs replayed from ``inputs``; None with a finding."""
  init = ctx.model.init
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


def _base_declared(ctx: Verification, where: str) -> bool:
  """Whether the base params the init program reads are the declared base checkpoint (no
  base: True); a finding names both digests when they are not."""
  init = ctx.model.init
  if init.base_checkpoint is None:
    return True
  read = digest.state_digest_from_leaves(init.base_layout,
                                         init.input_blobs[:len(init.base_layout)])
  if read != init.base_checkpoint:
    ctx.report.fail("start", where, f"the base params the init program reads have params "
                    f"digest {read.hex()}, not the declared base checkpoint "
                    f"{init.base_checkpoint.hex()}: a start is from the checkpoint it names.")
    return False
  return True


def _input_kind(n: int, layout, base_leaves: int) -> str:
  """"key", "base" (a base checkpoint's params: the first inputs) or "examples"."""
  return "key" if layout.key_impl is not None else "base" if n < base_leaves else "examples"


def _other_inputs(ctx: Verification, inputs, what: str):
  """``inputs`` with the example values (``what`` "examples"), the key ("key") or the base
  params ("base") replaced by others, drawn from the init program's id."""
  seed = blake3.blake3(b"zkdv init replay " + ctx.model.init.program_id).digest()
  base = len(ctx.model.init.base_layout)
  other = []
  for n, (array, layout) in enumerate(inputs):
    if _input_kind(n, layout, base) == what == "key":
      array = keys.key_array(seed, n, array.dtype, array.shape)
    elif _input_kind(n, layout, base) == what:
      array = sensitivity.perturbed_batch([layout], [array], seed, draw=n)[0]
    other.append((array, layout))
  return other


def _replayed_with_other(ctx: Verification, inputs, outs, what: str, where: str):
  """The init program's outputs with other ``what`` inputs (``outs`` when it has none)."""
  base = len(ctx.model.init.base_layout)
  if not any(_input_kind(n, l, base) == what for n, (_, l) in enumerate(inputs)):
    return outs
  return ctx.programs.run(ctx.model.init, _other_inputs(ctx, inputs, what), where)


def _inputs_carry_nothing(ctx: Verification, inputs, outs, matched, program, where) -> bool:
  """Replays with other example values (same outputs), another key and, from a base
  checkpoint, other base params: every params leaf that is not one value repeated changes
  with the key or the base, and a base changes some params leaf."""
  base = len(ctx.model.init.base_layout)
  examples = [l.path for n, (_, l) in enumerate(inputs)
              if _input_kind(n, l, base) == "examples"]
  if examples:
    again = ctx.programs.run(ctx.model.init, _other_inputs(ctx, inputs, "examples"), where)
    if again is None:
      return False
    changed = [n for n, (a, b) in enumerate(zip(outs, again)) if not sensitivity.same_bytes(a, b)]
    if changed:
      ctx.report.fail("start", where, f"the init program's outputs depend on the values of "
                      f"its example inputs {examples} (output {changed[0]} changes when they "
                      "do): a start must come from the key, not from arrays the prover "
                      "passes in.")
      return False
  params = [matched[i] for i in program.params_leaves]
  from_base = _replayed_with_other(ctx, inputs, outs, "base", where) if base else outs
  if from_base is None:
    return False
  if base and all(sensitivity.same_bytes(outs[o], from_base[o]) for o in params):
    ctx.report.fail("start", where, "the init program ignores its base checkpoint: no params "
                    "leaf of step 0 changes when the base params do, so the start does not "
                    "come from the declared base.")
    return False
  varied = [i for i in program.params_leaves if np.unique(outs[matched[i]]).size > 1
            and sensitivity.same_bytes(outs[matched[i]], from_base[matched[i]])]
  if not varied:
    return True
  other = _replayed_with_other(ctx, inputs, outs, "key", where)
  if other is None:
    return False
  for i in varied:
    if sensitivity.same_bytes(outs[matched[i]], other[matched[i]]):
      ctx.report.fail("start", where, f"params leaf {program.state[i].path} of step 0 does "
                      "not change with the init program's key"
                      f"{' or its base checkpoint' if base else ''}: it is not initialized "
                      f"from the key{' or the base' if base else ''}.")
      return False
  return True


def start_check(ctx: Verification, check, step, program, where: str) -> CheckOutcome:
  outcome = CheckOutcome(step.index, "start", "init replay", "failed")
  pieces = check.fields["pre_state_pieces"]
  if step.index != 0 or ctx.model.init is None:
    return outcome  # named by require_start or the structure
  if not _pieces_ok(pieces, program.state) or digest.state_digest_from_pieces(
      program.state, pieces) != step.pre_state:
    ctx.report.fail("start", where, "pre_state_pieces do not make up step 0's pre-state.")
    return outcome
  inputs = _opened_inputs(ctx, where)
  outs = None if inputs is None or not _base_declared(ctx, where) else _init_outputs(
      ctx, inputs, where)
  if outs is None:
    return outcome
  matched = {}
  for i, layout in enumerate(program.state):
    matched[i] = next((n for n, o in enumerate(outs) if str(o.dtype) == layout.dtype
                       and tuple(o.shape) == layout.shape
                       and digest.piece_digests(layout, o) == pieces[i]), None)
    if matched[i] is None:
      kind = "params" if i in program.params_leaves else "state"
      ctx.report.fail("start", where, f"{kind} leaf {layout.path} of step 0 is not an output "
                      "of the init program (export the optimizer state and every field "
                      "with it: TrainState.create on params from proof.init does).")
      return outcome
  if _inputs_carry_nothing(ctx, inputs, outs, matched, program, where):
    outcome.status = "verified"
  return outcome
