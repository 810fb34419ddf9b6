"""Finding optimizer updates in a traced step.

A rules table keyed by primitive says how many updates an equation performs
per call. The default rule accepts any first-order primitive and raises for a
higher-order one that holds a marker but has no rule, so an update is never
silently missed.

Example::

  sites = find_updates(jax.make_jaxpr(step)(*args).jaxpr)
  assert sites.count == 1
"""

import dataclasses
from collections.abc import Callable

from jax.extend import core
from jax.extend.core import primitives as prims

from zkdv import errors
from zkdv.interpreters import _compat
from zkdv.interpreters.marker import update_marker_p


@dataclasses.dataclass
class UpdateSites:
  """What the walk found: updates per call and the proofs they belong to."""

  count: int = 0
  proof_ids: set = dataclasses.field(default_factory=set)


FindRule = Callable[[core.JaxprEqn, UpdateSites], int]
find_rules: dict[core.Primitive, FindRule] = {}


def find_updates(jaxpr: core.Jaxpr) -> UpdateSites:
  sites = UpdateSites()
  sites.count = _count(jaxpr, sites)
  return sites


def _count(jaxpr: core.Jaxpr, sites: UpdateSites) -> int:
  return sum(find_rules.get(eqn.primitive, default_find_rule)(eqn, sites)
             for eqn in jaxpr.eqns)


def _inner_counts(eqn: core.JaxprEqn, sites: UpdateSites) -> list[int]:
  return [_count(getattr(j, "jaxpr", j), sites)
          for j in core.jaxprs_in_params(eqn.params)]


def default_find_rule(eqn: core.JaxprEqn, sites: UpdateSites) -> int:
  if any(_inner_counts(eqn, sites)):
    raise errors.UnsupportedUpdateError(
        f"apply_gradients() is called inside `{eqn.primitive.name}`, a "
        "higher-order primitive ZKDV has no rule for, so the update cannot be "
        "attested. Call apply_gradients() outside it.")
  return 0


def _marker_rule(eqn: core.JaxprEqn, sites: UpdateSites) -> int:
  sites.proof_ids.add(eqn.params["proof_id"])
  return 1


def _call_rule(eqn: core.JaxprEqn, sites: UpdateSites) -> int:
  """Calls run their body once: jit, remat, custom_jvp/vjp, closed calls; under
  shard_map (and pmap, built on it) every device applies the same logical update."""
  return sum(_inner_counts(eqn, sites))


def _cond_rule(eqn: core.JaxprEqn, sites: UpdateSites) -> int:
  counts = _inner_counts(eqn, sites)
  if len(set(counts)) > 1:
    raise errors.UnsupportedUpdateError(
        "apply_gradients() is called in some branches of a lax.cond/switch but "
        f"not in others (updates per branch: {counts}). Call it unconditionally "
        "and select the gradients or the new values inside the branches.")
  return counts[0] if counts else 0


def _loop_rule(eqn: core.JaxprEqn, sites: UpdateSites) -> int:
  if any(_inner_counts(eqn, sites)):
    raise errors.UnsupportedUpdateError(
        f"apply_gradients() is called inside a `{eqn.primitive.name}` loop, so "
        "one call would apply several updates. ZKDV commits one update per "
        "proof.jit call: accumulate gradients in the loop (or use "
        "optax.MultiSteps) and call apply_gradients() once after it.")
  return 0


find_rules[update_marker_p] = _marker_rule
for _p in (prims.jit_p, prims.remat_p, prims.closed_call_p, prims.call_p,
           prims.custom_jvp_call_p, prims.custom_vjp_call_p, _compat.shard_map_p):
  find_rules[_p] = _call_rule
find_rules[prims.cond_p] = _cond_rule
find_rules[prims.scan_p] = _loop_rule
find_rules[prims.while_p] = _loop_rule
