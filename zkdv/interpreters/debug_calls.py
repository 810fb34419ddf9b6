"""Lifting debug callbacks out of a traced step: their operands become outputs.

``jax.export`` refuses host callbacks, so a step that calls ``jax.debug.print``
or ``jax.debug.callback`` cannot be exported as written. ``lift`` evaluates the
step's jaxpr without its debug callbacks and returns their operands as extra
outputs. Production runs that program and then the callbacks on those outputs
(``emit``); a verifier replays the same program and ignores them, so the
replay stays exact while the live step still prints.

Example::

  closed = jax.make_jaxpr(step)(*specs)
  lifted, calls = lift(closed, "train_step")  # one DebugCall per callback, in program order
  outs = emit(calls, jax.jit(lifted)(*args))   # prints; returns the step's own outputs
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jax.extend import core
from jax.extend.core import primitives as prims

from zkdv import errors
from zkdv.interpreters import _compat

_DEBUG_PRIMITIVES = (_compat.debug_callback_p, _compat.debug_print_p)


@dataclasses.dataclass(frozen=True)
class DebugCall:
  """One debug callback of a step: its primitive, parameters and number of operands."""

  primitive: core.Primitive
  params: dict
  operands: int

  def emit(self, values: Sequence) -> None:
    """Runs the callback on ``values`` (on the host), as JAX runs it eagerly."""
    self.primitive.impl(*values, **self.params)


def has_debug_calls(jaxpr: core.Jaxpr) -> bool:
  """Whether ``jaxpr`` (or a jaxpr inside it) calls a debug callback."""
  return any(eqn.primitive in _DEBUG_PRIMITIVES
             or any(has_debug_calls(getattr(j, "jaxpr", j))
                    for j in core.jaxprs_in_params(eqn.params))
             for eqn in jaxpr.eqns)


def lift(closed: core.ClosedJaxpr, name: str) -> tuple[Callable, list[DebugCall]]:
  """(``closed`` as a function returning its outputs and then its debug callbacks'
  operands, those callbacks). The list fills when the function is traced.

  Raises ExportError for a callback inside a loop, a branch, ``remat`` or a
  custom derivative: its operands have no single value per step to return.
  """
  calls: list[DebugCall] = []

  def lifted(*args):
    calls.clear()
    operands: list = []
    outs = _eval(closed.jaxpr, closed.consts, args, calls, operands, name)
    return (*outs, *operands)
  lifted.__name__ = lifted.__qualname__ = name  # names the exported program
  return lifted, calls


def emit(calls: Sequence[DebugCall], outs: Sequence) -> list:
  """Runs ``calls`` on the trailing outputs of a lifted program; returns the others."""
  count = sum(c.operands for c in calls)
  own, operands = list(outs[:len(outs) - count]), outs[len(outs) - count:]
  start = 0
  for call in calls:
    call.emit(operands[start:start + call.operands])
    start += call.operands
  return own


def _eval(jaxpr: core.Jaxpr, consts, args, calls: list[DebugCall], operands: list,
          name: str) -> list:
  env: dict = {}

  def read(v) -> Any:
    return v.val if isinstance(v, core.Literal) else env[v]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    if eqn.primitive in _DEBUG_PRIMITIVES:
      calls.append(DebugCall(eqn.primitive, dict(eqn.params), len(invals)))
      operands.extend(invals)
      continue
    inner = [getattr(j, "jaxpr", j) for j in core.jaxprs_in_params(eqn.params)]
    if any(has_debug_calls(j) for j in inner):
      if eqn.primitive is not prims.jit_p:
        raise errors.ExportError(
            f"{name} calls jax.debug.print/jax.debug.callback inside "
            f"`{eqn.primitive.name}` (a loop, a branch, remat or a custom derivative): "
            "proof.jit prints a step's debug values after the step, and these have "
            "no single value per step.",
            fix=f"In the body of {name}, print the values that `{eqn.primitive.name}` "
                "returns instead, outside it (or remove the print).")
      inner_closed = eqn.params["jaxpr"]  # a nested jit: evaluated inline
      outs = _eval(inner_closed.jaxpr, inner_closed.consts, invals, calls, operands, name)
    else:
      outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]
