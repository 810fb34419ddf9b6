"""Host views of leaves: zero-copy, byte-exact, and never in the way of donation."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from zkdv.jax import _compat
from zkdv.jax import arrays


class HostViewTest(parameterized.TestCase):

  @parameterized.parameters(jnp.float32, jnp.bfloat16, jnp.float16, jnp.bool_, jnp.int8,
                            jnp.uint32, jnp.int64)
  def test_a_view_has_the_leaf_s_dtype_and_bytes(self, dtype):
    x = (jnp.arange(12) % 3).astype(dtype).reshape(3, 4)
    view = arrays.host_view(x)
    expected = np.asarray(x)
    self.assertEqual(view.dtype, expected.dtype)
    self.assertEqual(view.shape, (3, 4))
    self.assertEqual(view.tobytes(), expected.tobytes())

  def test_a_view_of_an_array_on_one_cpu_is_its_buffer(self):
    x = jnp.arange(1000.0) + 1
    self.assertTrue(_compat.on_one_cpu(x))
    view = arrays.host_view(x)
    self.assertEqual(view.ctypes.data, x.unsafe_buffer_pointer())
    self.assertFalse(view.flags.writeable)

  def test_a_view_waits_for_the_computation(self):
    a = jnp.ones((600, 600))
    view = arrays.host_view(a @ a + 1)  # dispatched, not yet computed
    np.testing.assert_array_equal(view, np.full((600, 600), 601.0, np.float32))

  def test_scalars_keys_and_host_arrays(self):
    self.assertEqual(arrays.host_view(jnp.float32(2.5)).shape, ())
    np.testing.assert_array_equal(arrays.host_view(jax.random.key(3)),
                                  np.asarray(jax.random.key_data(jax.random.key(3))))
    self.assertTrue(arrays.is_key(jax.random.key(0)))
    self.assertFalse(arrays.is_key(jnp.zeros(2, jnp.uint32)))
    host = np.arange(4.0)
    self.assertFalse(_compat.on_one_cpu(host))
    np.testing.assert_array_equal(arrays.host_view(host), host)

  def test_a_live_view_keeps_its_bytes_through_a_donating_step(self):
    double = jax.jit(lambda a: a * 2, donate_argnums=0)
    x = jnp.arange(1000.0) + 1
    view = arrays.host_view(x)
    y = double(x)  # JAX copies instead of donating a buffer a view holds
    np.testing.assert_array_equal(view[:3], [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(np.asarray(y)[:3], [2.0, 4.0, 6.0])

  def test_a_dropped_view_does_not_pin_the_buffer(self):
    double = jax.jit(lambda a: a * 2, donate_argnums=0)
    x = jnp.arange(1000.0) + 1
    self.assertEqual(arrays.host_view(x)[0], 1.0)  # a view taken and dropped
    double(x)
    self.assertTrue(x.is_deleted())

  def test_a_deleted_leaf_raises(self):
    x = jnp.arange(10.0) + 1
    x.delete()
    with self.assertRaises(RuntimeError):
      arrays.host_view(x)



class KeptForOpeningTest(absltest.TestCase):
  """A leaf still being computed is kept without waiting: the training thread goes on."""

  def test_a_pending_donated_leaf_is_copied_behind_its_computation_without_waiting(self):
    @jax.jit
    def slow(x):  # about a second of CPU: still running when the next lines run
      for _ in range(16):
        x = jnp.tanh(x @ x) / 2000
      return x

    ready = jnp.arange(6, dtype=jnp.float32)
    start = jnp.full((2000, 2000), 0.5, jnp.float32)
    expected = np.asarray(slow(start))
    pending = slow(start)
    self.assertFalse(pending.is_ready())
    kept = arrays.kept_for_opening([pending, ready])
    self.assertFalse(pending.is_ready())  # returned while the computation still runs
    self.assertIsInstance(kept[0], jax.Array)  # a copy: the step may donate the leaf
    self.assertIsNot(kept[0], pending)
    self.assertIsInstance(kept[1], np.ndarray)  # ready: viewed at once
    jax.jit(lambda x: x + 1, donate_argnums=0)(pending)  # the step donates it
    self.assertTrue(pending.is_deleted())
    views = arrays.opened_views(kept + [None])
    self.assertEqual(views[0].dtype, np.float32)
    self.assertEqual(views[0].tobytes(), expected.tobytes())
    self.assertEqual(views[1].tobytes(), np.arange(6, dtype=np.float32).tobytes())
    self.assertIsNone(views[2])


if __name__ == "__main__":
  absltest.main()
