"""What an exported program computes, read from its StableHLO module.

Everything here is derived from the module itself, never from a field a prover
wrote: which operations it runs, which custom calls it makes, and which inputs
each output depends on (a dataflow walk over the SSA values of every function),
and how many bytes of constants it embeds. ``check_safe`` refuses a program
before anything compiles it: custom calls off the allow-list (host callbacks
among them), host transfers, operations that read state outside their inputs
(stateful random numbers, uninitialized buffers: a program could tell a verifier's
replay from training by them), external functions, effects, and constants over
``zkdv.config.MAX_PROGRAM_CONSTANT_BYTES`` (weights baked into a program).

Example::

  exported = jax.export.deserialize(blob)
  summary = analyze(exported)
  check_safe(summary)
  summary.depends_on(output=0, inputs=[3, 4])
"""

import collections
import dataclasses
import functools
import operator
import re

import jax
import numpy as np

from zkdv import errors
from zkdv.jax._compat import ir, mlir  # JAX's MLIR bindings: private, kept in _compat

from zkdv import config

# Custom calls that jax.export itself emits for ordinary training programs:
# sharding annotations, and the linear algebra kernels of XLA's CPU and GPU
# runtimes. Anything else (host callbacks, user FFI, Pallas kernels) is refused.
ALLOWED_CUSTOM_CALLS = frozenset({
    "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape",
    "annotate_device_placement", "AllocateBuffer",  # of no elements only: see _screen
    "cu_threefry2x32_ffi", "hip_threefry2x32_ffi",
    "cu_lu_pivots_to_permutation", "hip_lu_pivots_to_permutation", "cusparse_gtsv2_ffi",
})
ALLOWED_CUSTOM_CALL_PATTERNS = (re.compile(r"lapack_[sdcz][a-z]+_ffi"),
                                re.compile(r"(cu|hip)solver_[a-z0-9]+_ffi"))
# Operations that move data between the program and the host while it runs.
HOST_TRANSFERS = frozenset({"stablehlo.send", "stablehlo.recv", "stablehlo.infeed",
                            "stablehlo.outfeed"})
_CALLBACK = re.compile(r"callback", re.IGNORECASE)
# Operations whose results depend on state outside the program's inputs, which a program
# could read to tell a verifier's replay from training: XLA's stateful random numbers
# (a seed per executable and a counter each call advances; ``jax.random`` passes its
# state as an input instead).
HIDDEN_STATE = frozenset({"stablehlo.rng"})
# The custom call of ``lax.empty`` on accelerators: memory as the device left it.
UNINITIALIZED = "AllocateBuffer"


class UnsafeProgramError(ValueError):
  """An exported program that the verifier refuses to compile, and why."""


@dataclasses.dataclass(frozen=True)
class ModuleSummary:
  """Operation counts, custom calls, what is refused, constants, and per output the inputs
  it may read.

  ``dependencies[j]`` is a bit mask over the exported program's flat inputs: every input
  output ``j`` is computed from (an over-approximation: ``0 * x`` counts as reading
  ``x``). ``constant_bytes`` counts the bytes of every dense constant, a splat (one value
  repeated) as one element.
  """

  op_counts: dict
  custom_calls: tuple
  refused: tuple
  dependencies: tuple
  constant_bytes: int = 0

  def depends_on(self, output: int, inputs) -> bool:
    mask = sum(1 << i for i in inputs)
    return bool(self.dependencies[output] & mask)


def allowed_custom_call(target: str) -> bool:
  return target in ALLOWED_CUSTOM_CALLS or any(
      p.fullmatch(target) for p in ALLOWED_CUSTOM_CALL_PATTERNS)


def analyze(exported: jax.export.Exported) -> ModuleSummary:
  """Parses ``exported``'s module and summarizes it (raises UnsafeProgramError if unreadable)."""
  try:
    text = exported.mlir_module()
    with mlir.make_ir_context():
      module = ir.Module.parse(text)
      return _summarize(exported, module)
  except UnsafeProgramError:
    raise
  except Exception as e:  # a malformed module is a refusal, never a crash
    if errors.out_of_memory(e):
      raise  # a fault of this machine, not of the module
    raise UnsafeProgramError(f"the program's module cannot be read: {type(e).__name__}: "
                             f"{e}".splitlines()[0]) from None


def check_safe(exported: jax.export.Exported, summary: ModuleSummary) -> None:
  """Raises UnsafeProgramError naming why ``exported`` must not be compiled here."""
  reasons = list(summary.refused)
  if summary.constant_bytes > config.MAX_PROGRAM_CONSTANT_BYTES:
    reasons.append(f"it embeds {summary.constant_bytes:,} bytes of constants, over the "
                   f"budget of {config.MAX_PROGRAM_CONSTANT_BYTES:,} bytes (a program may not "
                   "carry weights; pass large arrays in the state or the batch)")
  effects = tuple(exported.ordered_effects) + tuple(exported.unordered_effects)
  if effects:
    reasons.append(f"it has side effects {[type(e).__name__ for e in effects]}")
  if reasons:
    raise UnsafeProgramError("the program is refused before compiling: "
                             + "; ".join(reasons) + ".")


def _summarize(exported, module) -> ModuleSummary:
  functions = {}
  for op in module.body.operations:
    if op.operation.name == "func.func":
      functions[ir.StringAttr(op.attributes["sym_name"]).value] = op
  counts, calls, refused, constant_bytes = collections.Counter(), [], [], 0
  for name, func in functions.items():
    if not func.regions[0].blocks:
      refused.append(f"function {name!r} has no body (an external function)")
    for op in _walk(func):
      counts[op.name] += 1
      _screen(op, calls, refused)
      constant_bytes += _constant_bytes(op)
  main = functions.get("main")
  if main is None:
    raise UnsafeProgramError("the program's module has no main function.")
  results = _Dataflow(functions).results(main)
  arguments = len(main.regions[0].blocks[0].arguments)
  kept = sorted(exported.module_kept_var_idx)
  extra_args = arguments - len(kept)
  extra_results = len(results) - len(exported.out_avals)
  if extra_args < 0 or extra_results < 0:
    raise UnsafeProgramError("the program's main function does not match its signature.")
  remap = {extra_args + k: i for k, i in enumerate(kept)}
  dependencies = tuple(sum(1 << remap[a] for a in remap if mask >> a & 1)
                       for mask in results[extra_results:])
  return ModuleSummary(dict(sorted(counts.items())), tuple(sorted(set(calls))),
                       tuple(dict.fromkeys(refused)), dependencies, constant_bytes)


def _element_bits(element_type) -> int:
  for kind in (ir.FloatType, ir.IntegerType):
    try:
      return kind(element_type).width
    except (ValueError, TypeError):
      pass
  if ir.ComplexType.isinstance(element_type):
    return 2 * _element_bits(ir.ComplexType(element_type).element_type)
  return 64  # an element type of unknown width counts as the widest scalar


def _constant_attributes(op):
  """The element attributes ``op`` carries: each ``ir.DenseElementsAttr``, and each
  ``dense_resource`` one as ``ir.DenseResourceElementsAttr`` (the bindings hand it over as
  a plain ``ir.Attribute``: an ``isinstance`` test alone would pass over its bytes)."""
  attributes = op.attributes
  for name in attributes:  # names (recent MLIR bindings) or NamedAttributes
    attr = attributes[name] if isinstance(name, str) else name.attr
    if isinstance(attr, (ir.DenseElementsAttr, ir.DenseResourceElementsAttr)):
      yield attr
      continue
    try:
      yield ir.DenseResourceElementsAttr(attr)
    except ValueError:
      pass


def _constant_bytes(op) -> int:
  """Bytes of the dense element attributes ``op`` carries (a splat: one element).

  Example: ``stablehlo.constant dense<1.0> : tensor<1000xf32>`` is 4 bytes.
  """
  total = 0
  for attr in _constant_attributes(op):
    shaped = ir.ShapedType(attr.type)
    elements = 1
    if not (isinstance(attr, ir.DenseElementsAttr) and attr.is_splat):
      for n in shaped.shape:
        elements *= n
    total += (elements * _element_bits(shaped.element_type) + 7) // 8
  return total


def constant_arrays(exported: jax.export.Exported) -> list:
  """The values of the dense constants ``exported``'s module embeds (numpy arrays; a splat
  is one element), e.g. to scan them for evaluation rows. Raises UnsafeProgramError for
  a constant whose bytes cannot be read (a ``dense_resource`` one among them).
  """
  found = []
  with mlir.make_ir_context():
    module = ir.Module.parse(exported.mlir_module())
    for op in _walk(module.operation):
      for attr in _constant_attributes(op):
        if isinstance(attr, ir.DenseResourceElementsAttr):
          raise UnsafeProgramError(f"a dense_resource constant of type {attr.type} cannot "
                                   "be read (XLA compiles dense constants only).")
        try:
          found.append(np.array(attr))
        except (TypeError, ValueError, RuntimeError) as e:
          raise UnsafeProgramError(f"a constant of type {attr.type} cannot be read "
                                   f"({type(e).__name__}).") from None
  return found


def _screen(op, calls: list, refused: list) -> None:
  if op.name in HOST_TRANSFERS:
    refused.append(f"it transfers data to or from the host ({op.name})")
  elif op.name in HIDDEN_STATE:
    refused.append(f"it reads state outside its inputs ({op.name}: stateful random "
                   "numbers, e.g. lax.rng_uniform; draw them with jax.random from a key)")
  elif op.name == "stablehlo.custom_call":
    target = ir.StringAttr(op.attributes["call_target_name"]).value
    calls.append(target)
    if target == UNINITIALIZED and any(_holds_elements(r.type) for r in op.results):
      refused.append(f"it reads uninitialized device memory ({target}, e.g. lax.empty: "
                     "its contents are whatever the device held; use jnp.zeros)")
    elif _CALLBACK.search(target):
      refused.append(f"it calls back into the host ({target})")
    elif not allowed_custom_call(target):
      refused.append(f"custom call {target!r} is not on the allow-list")


def _holds_elements(value_type) -> bool:
  """Whether a value of ``value_type`` holds anything: not a tensor with a dimension of 0
  (a dynamic dimension counts as holding some)."""
  try:
    return 0 not in ir.RankedTensorType(value_type).shape
  except (ValueError, TypeError):
    return True


def _walk(op):
  """Every operation nested in ``op`` (not ``op`` itself), in order."""
  for region in op.regions:
    for block in region.blocks:
      for inner in block.operations:
        yield inner.operation
        yield from _walk(inner.operation)


class _Dataflow:
  """Per function, which arguments each result depends on (bit masks).

  An operation's results depend on its operands; one with regions (while,
  reduce, case, ...) also on every outer value used inside them. A call maps its
  callee's dependencies onto its operands. This over-approximates, never misses.
  """

  def __init__(self, functions: dict):
    self._functions = functions
    self._memo, self._active = {}, set()

  def results(self, func) -> list[int]:
    name = ir.StringAttr(func.attributes["sym_name"]).value
    if name in self._memo:
      return self._memo[name]
    blocks = func.regions[0].blocks
    if name in self._active or len(blocks) != 1:
      raise UnsafeProgramError(f"function {name!r} is recursive or has several blocks.")
    self._active.add(name)
    block = blocks[0]
    env = {arg: 1 << i for i, arg in enumerate(block.arguments)}
    returned = []
    for op in block.operations:
      op = op.operation
      if op.name == "func.return":
        returned = [env.get(v, 0) for v in op.operands]
        continue
      for result, mask in zip(op.results, self._op_masks(op, env)):
        env[result] = mask
    self._active.discard(name)
    self._memo[name] = returned
    return returned

  def _op_masks(self, op, env) -> list[int]:
    operands = [env.get(v, 0) for v in op.operands]
    if op.name == "func.call":
      callee = self._functions.get(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
      if callee is None:
        raise UnsafeProgramError("a call names a function the module does not define.")
      return [functools.reduce(operator.or_, (m for i, m in enumerate(operands)
                                              if mask >> i & 1), 0)
              for mask in self.results(callee)]
    mask = 0
    for m in operands:
      mask |= m
    for inner in _walk(op):
      for v in inner.operands:
        mask |= env.get(v, 0)
    return [mask] * len(op.results)
