"""zkdv.interpreters.dataflow: which inputs each output of a traced step can depend on."""

import jax
import jax.numpy as jnp
from absl.testing import absltest

from zkdv.interpreters.dataflow import dependencies


def _deps(fun, *args) -> list[set[int]]:
  return [set(d) for d in dependencies(jax.make_jaxpr(fun)(*args).jaxpr)]


class DataflowTest(absltest.TestCase):

  def test_elementwise_and_passthrough(self):
    self.assertEqual(_deps(lambda a, b, c: (a * 2, a + b, c, 1.0), 1.0, 2.0, 3.0),
                     [{0}, {0, 1}, {2}, set()])

  def test_a_jit_call_is_followed_into_its_body(self):
    inner = jax.jit(lambda a, b: (jnp.sin(a), b + 1))
    self.assertEqual(_deps(lambda a, b: inner(a, b), 1.0, 2.0), [{0}, {1}])

  def test_loops_and_branches_join_every_input(self):
    def loop(a, b):
      return jax.lax.fori_loop(0, 3, lambda i, c: (c[0] + 1, c[1] * 2), (a, b))
    self.assertEqual(_deps(loop, 1.0, 2.0), [{0, 1}, {0, 1}])
    cond = lambda p, a, b: jax.lax.cond(p, lambda: a, lambda: b)
    self.assertEqual(_deps(cond, True, 1.0, 2.0), [{0, 1, 2}])

  def test_a_value_written_into_a_mutable_array_is_not_missed(self):
    def through_ref(a, b):
      ref = jax.new_ref(a)
      ref[...] = b  # b reaches the first output only through the ref
      return ref[...] * 1, a
    self.assertEqual(_deps(through_ref, 1.0, 2.0), [{0, 1}, {0, 1}])


if __name__ == "__main__":
  absltest.main()
