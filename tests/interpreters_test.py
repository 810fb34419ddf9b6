"""The marker primitive's rules and the rules table that finds updates."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from jax.extend import core

from zkdv import errors
from zkdv.interpreters import find
from zkdv.interpreters.marker import mark_update, update_marker_p

PROOF = 1234


def update(x):
  """Stands in for apply_gradients: a transition, then the marker."""
  return mark_update([x * 0.5 + 1.0], proof_id=PROOF)[0]


def sites_of(fn, *args):
  return find.find_updates(jax.make_jaxpr(fn)(*args).jaxpr)


def lowered_text(fn, *args) -> str:
  """The StableHLO ``jax.jit(fn)`` lowers to, without its module name.

  Example: ``lowered_text(update, x) == lowered_text(lambda v: v * 0.5 + 1.0, x)``.
  """
  text = jax.jit(fn).lower(*args).as_text(debug_info=False)
  return re.sub(r"^module @\S+", "module", text)


class MarkerTest(absltest.TestCase):

  def test_identity_under_eval_jit_vmap_grad_jvp(self):
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(update(x), x * 0.5 + 1.0)
    np.testing.assert_array_equal(jax.jit(update)(x), x * 0.5 + 1.0)
    np.testing.assert_array_equal(jax.vmap(update)(jnp.ones((2, 3))), jnp.full((2, 3), 1.5))
    np.testing.assert_array_equal(jax.grad(lambda v: update(v).sum())(x), jnp.full(3, 0.5))
    _, tangent = jax.jvp(update, (x,), (jnp.ones(3),))
    np.testing.assert_array_equal(tangent, jnp.full(3, 0.5))
    np.testing.assert_array_equal(jax.jit(jax.vmap(jax.grad(lambda v: update(v).sum())))(
        jnp.ones((2, 3))), jnp.full((2, 3), 0.5))

  def test_marker_is_in_the_jaxpr_and_lowers_to_nothing(self):
    jaxpr = jax.make_jaxpr(update)(jnp.ones(3))
    self.assertIn(update_marker_p, [e.primitive for e in jaxpr.jaxpr.eqns])
    self.assertEqual(lowered_text(update, jnp.ones(3)),
                     lowered_text(lambda x: x * 0.5 + 1.0, jnp.ones(3)))

  def test_marked_gradient_lowers_as_the_unmarked_one(self):
    x = jnp.arange(3.0)
    self.assertEqual(lowered_text(jax.grad(lambda v: update(v).sum()), x),
                     lowered_text(jax.grad(lambda v: (v * 0.5 + 1.0).sum()), x))

  def test_marker_survives_export(self):
    exported = jax.export.export(jax.jit(update))(jax.ShapeDtypeStruct((3,), jnp.float32))
    np.testing.assert_array_equal(exported.call(jnp.ones(3)), jnp.full(3, 1.5))


class FindUpdatesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("top_level", update),
      ("nested_jit", jax.jit(jax.jit(update))),
      ("remat", jax.checkpoint(update)),
      ("cond_in_both_branches", lambda x: jax.lax.cond(
          x[0] > 0, update, lambda v: update(v + 1), x)),
      ("custom_jvp", jax.custom_jvp(update)),
      ("under_vmap", lambda x: jax.vmap(update)(x[None])[0]),
  )
  def test_finds_exactly_one_update(self, fn):
    if isinstance(fn, jax.custom_jvp):
      fn.defjvp(lambda p, t: (update(p[0]), t[0]))
    sites = sites_of(fn, jnp.ones(3))
    self.assertEqual(sites.count, 1)
    self.assertEqual(sites.proof_ids, {PROOF})

  def test_custom_vjp(self):
    fn = jax.custom_vjp(update)
    fn.defvjp(lambda x: (update(x), None), lambda _, g: (g,))
    self.assertEqual(sites_of(fn, jnp.ones(3)).count, 1)

  def test_no_update(self):
    self.assertEqual(sites_of(lambda x: x + 1, jnp.ones(3)).count, 0)

  def test_cond_with_update_in_one_branch_is_refused(self):
    fn = lambda x: jax.lax.cond(x[0] > 0, update, lambda v: v, x)
    with self.assertRaisesRegex(errors.UnsupportedUpdateError, r"some branches.*\[0, 1\]"):
      sites_of(fn, jnp.ones(3))

  @parameterized.named_parameters(
      ("scan", lambda x: jax.lax.scan(lambda c, _: (update(c), None), x, None, length=2)[0]),
      ("while", lambda x: jax.lax.while_loop(lambda c: c[0] < 5, update, x)),
      ("fori", lambda x: jax.lax.fori_loop(0, 3, lambda i, c: update(c), x)),
  )
  def test_update_in_a_loop_is_refused(self, fn):
    with self.assertRaisesRegex(errors.UnsupportedUpdateError, "loop"):
      sites_of(fn, jnp.ones(3))

  def test_higher_order_primitive_without_rule_is_an_error(self):
    holder_p = core.Primitive("opaque_holder")
    inner = jax.make_jaxpr(update)(jnp.ones(3))
    outer = jax.make_jaxpr(lambda x: x)(jnp.ones(3)).jaxpr
    eqn = core.new_jaxpr_eqn(outer.invars, [core.DropVar(outer.invars[0].aval)], holder_p,
                             {"jaxpr": inner}, core.no_effects)
    jaxpr = core.Jaxpr(outer.constvars, outer.invars, outer.outvars, [eqn])
    with self.assertRaisesRegex(errors.UnsupportedUpdateError,
                                "inside `opaque_holder`.*no rule"):
      find.find_updates(jaxpr)
    plain = core.new_jaxpr_eqn(outer.invars, [core.DropVar(outer.invars[0].aval)], holder_p,
                               {"jaxpr": jax.make_jaxpr(lambda x: x + 1)(jnp.ones(3))},
                               core.no_effects)
    self.assertEqual(find.find_updates(
        core.Jaxpr(outer.constvars, outer.invars, outer.outvars, [plain])).count, 0)


if __name__ == "__main__":
  absltest.main()
