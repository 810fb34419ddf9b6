"""Which inputs of a traced step each of its outputs can depend on.

A rules table keyed by primitive: a call (``jit``, remat, custom_jvp/vjp, closed
calls) is followed into its body; every other equation, loops and branches
included, makes each of its outputs depend on all of its inputs. The answer can
only overstate a dependence, never miss one.

Example::

  closed = jax.make_jaxpr(lambda a, b: (a * 2, a + b))(1.0, 2.0)
  dependencies(closed.jaxpr)  # [{0}, {0, 1}]
"""

from collections.abc import Callable

from jax.extend import core
from jax.extend.core import primitives as prims

Deps = frozenset[int]
DataflowRule = Callable[[core.JaxprEqn, list[Deps]], list[Deps]]
dataflow_rules: dict[core.Primitive, DataflowRule] = {}


def dependencies(jaxpr: core.Jaxpr) -> list[Deps]:
  """For each output of ``jaxpr``, the indices of the inputs it can depend on.

  A jaxpr with an effect anywhere (a mutable array written in place, a callback) has
  each output depend on every input: values can flow through the effect unseen.
  """
  if _has_effects(jaxpr):
    return [frozenset(range(len(jaxpr.invars)))] * len(jaxpr.outvars)
  return _walk(jaxpr, [frozenset({i}) for i in range(len(jaxpr.invars))])


def _has_effects(jaxpr: core.Jaxpr) -> bool:
  return any(eqn.effects or any(_has_effects(getattr(j, "jaxpr", j))
                                for j in core.jaxprs_in_params(eqn.params))
             for eqn in jaxpr.eqns)


def _walk(jaxpr: core.Jaxpr, in_deps: list[Deps]) -> list[Deps]:
  deps = dict(zip(jaxpr.invars, in_deps))

  def of(var) -> Deps:
    return deps.get(var, frozenset()) if isinstance(var, core.Var) else frozenset()

  for eqn in jaxpr.eqns:
    rule = dataflow_rules.get(eqn.primitive, default_dataflow_rule)
    deps.update(zip(eqn.outvars, rule(eqn, [of(v) for v in eqn.invars])))
  return [of(v) for v in jaxpr.outvars]


def default_dataflow_rule(eqn: core.JaxprEqn, in_deps: list[Deps]) -> list[Deps]:
  """Every output depends on every input."""
  every = frozenset().union(*in_deps)
  return [every] * len(eqn.outvars)


def _call_rule(eqn: core.JaxprEqn, in_deps: list[Deps]) -> list[Deps]:
  """A call's outputs depend on its inputs as its body's do."""
  bodies = [getattr(j, "jaxpr", j) for j in core.jaxprs_in_params(eqn.params)]
  if len(bodies) != 1 or len(bodies[0].invars) != len(in_deps) or (
      len(bodies[0].outvars) != len(eqn.outvars)):
    return default_dataflow_rule(eqn, in_deps)
  return _walk(bodies[0], in_deps)


for _p in (prims.jit_p, prims.remat_p, prims.closed_call_p, prims.call_p,
           prims.custom_jvp_call_p, prims.custom_vjp_call_p):
  dataflow_rules[_p] = _call_rule
