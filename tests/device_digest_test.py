"""BLAKE3 in jax.numpy equals the reference package; both backends commit alike."""

from unittest import mock

import blake3
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from tests import testing
from zkdv import merkle
from zkdv import verify
from zkdv.digest import LeafLayout
from zkdv.jax import digests
from zkdv.jax import device_digest

EDGE_SIZES = [0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 3 * 1024 + 1, 5 * 1024, 9 * 1024 + 7]


def reference(x) -> bytes:
  return blake3.blake3(np.asarray(x).tobytes()).digest()


class DeviceBlake3Test(parameterized.TestCase):

  # Each test hashes its leaves in one program (a compilation each, not one a leaf).

  @parameterized.parameters(None, bytes(range(32)))
  def test_edge_sizes_side_by_side(self, key):
    # one chunk, a partial chunk, odd and even trees, empty: each leaf its own digest
    leaves = [np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8) for n in EDGE_SIZES]
    leaves.append(np.arange(33 * 17, dtype=np.float32).reshape(33, 17))
    got = np.asarray(device_digest.digest_many([jnp.asarray(x) for x in leaves], key=key))
    self.assertEqual(got.dtype, np.uint32)
    self.assertEqual(got.shape, (len(leaves), 8))
    keyed = {} if key is None else {"key": key}
    for x, words in zip(leaves, got):
      with self.subTest(nbytes=x.nbytes):
        self.assertEqual(device_digest.words_to_bytes(words),
                         blake3.blake3(x.tobytes(), **keyed).digest())

  def test_one_leaf(self):
    data = np.random.default_rng(0).integers(0, 256, 3 * 1024 + 1, dtype=np.uint8)
    got = device_digest.digest_words(jnp.asarray(data), key=bytes(range(32)))
    self.assertEqual(got.shape, (8,))
    self.assertEqual(device_digest.words_to_bytes(got),
                     blake3.blake3(data.tobytes(), key=bytes(range(32))).digest())

  def test_every_dtype(self):
    key = jax.random.key(7)
    leaves = {}
    for dtype in ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "bool",
                  "int2", "uint2", "int4", "uint4", "float4_e2m1fn", "int8", "uint16", "int32",
                  "uint32", "complex64"):
      if dtype == "complex64":
        real, imag = jax.random.normal(key, (2, 33, 17))
        leaves[dtype] = jax.lax.complex(real, -3 * imag)
      elif dtype == "bool":
        leaves[dtype] = jax.random.bernoulli(key, 0.5, (33, 17))
      elif "int" in dtype:  # random bits of the full width
        bits = jax.random.bits(key, (33, 17), jnp.uint32)
        leaves[dtype] = jax.lax.bitcast_convert_type(bits, jnp.int32).astype(dtype)
      else:
        leaves[dtype] = (100 * jax.random.normal(key, (33, 17))).astype(dtype)
    got = device_digest.digest_many(list(leaves.values()))
    for (dtype, x), words in zip(leaves.items(), got):
      with self.subTest(dtype=dtype):
        self.assertEqual(device_digest.words_to_bytes(words), reference(x))

  def test_key_leaf_is_its_key_data(self):
    key = jax.random.split(jax.random.key(3), 5)
    got = device_digest.words_to_bytes(device_digest.digest_words(key))
    self.assertEqual(got, reference(jax.random.key_data(key)))

  def test_a_key_is_32_bytes(self):
    for key in (bytes(31), bytes(33), "k" * 32):
      with self.assertRaisesRegex(ValueError, "a BLAKE3 key is 32 bytes"):
        device_digest.digest_words(jnp.zeros(4, jnp.uint8), key=key)

  def test_row_leaf_hashes(self):
    x = jax.random.normal(jax.random.key(0), (70, 9))
    labels = jnp.arange(5, dtype=jnp.uint8)  # rows of one byte, beside rows of 36
    rows = device_digest.rows_to_bytes(device_digest.rows_leaf_words([x, labels]))
    self.assertEqual(rows, [merkle.leaf_hash(r.tobytes())
                            for r in [*np.asarray(x), *np.asarray(labels)]])

  def test_a_batch_of_several_leaves_hashes_as_on_the_host(self):
    # rows of two widths (one in groups of 4 rows), a key and a scalar (on the host): one
    # program for the rows, each block's hashes taken from its part of the program's words
    leaves = [jnp.arange(64, dtype=jnp.float32).reshape(16, 4), jnp.arange(16, dtype=jnp.int8),
              jax.random.key_data(jax.random.split(jax.random.key(0), 16)), jnp.float32(3)]
    layouts = [LeafLayout("x", "float32", (16, 4), row_group=4), LeafLayout("y", "int8", (16,)),
               LeafLayout("key", "uint32", (16, 2), key_impl="threefry2x32"),
               LeafLayout("scale", "float32", ())]
    host, device = digests.HostDigests(), digests.DeviceDigests()
    expected = host.row_hashes(host.start_rows(leaves, layouts), layouts)
    self.assertEqual([len(h) for h in expected], [4, 16, 16, 1])
    self.assertEqual(device.row_hashes(device.start_rows(leaves, layouts), layouts), expected)

  def test_programs_hold_at_most_program_bytes_and_hash_as_on_the_host(self):
    leaves = [jnp.arange(n, dtype=jnp.float32) for n in (100, 10, 10, 300, 5)]
    layouts = [LeafLayout(f"w{i}", "float32", x.shape) for i, x in enumerate(leaves)]
    host, device = digests.HostDigests(), digests.DeviceDigests()
    expected = host.state_digests(host.materialize(host.start_state(leaves, layouts)))
    with mock.patch.object(digests, "PROGRAM_BYTES", 400):
      started = device.start_state(leaves, layouts)
      rows = device.start_rows(leaves, layouts)
    # 400 B, then 40 + 40, 1,200 B alone (larger than a program), 20 B
    self.assertEqual([keys for _, keys in started[0]],
                     [[(0, 0)], [(1, 0), (2, 0)], [(3, 0)], [(4, 0)]])
    self.assertEqual(device.state_digests(device.materialize(started)), expected)
    self.assertEqual(device.row_hashes(rows, layouts),
                     host.row_hashes(host.start_rows(leaves, layouts), layouts))
    self.assertLen({id(block[1][0]) for blocks in rows for _, _, block in blocks}, 4)

  def test_a_batch_without_rows_has_no_row_hashes_on_either_backend(self):
    x, layout = jnp.zeros((0, 4)), LeafLayout("x", "float32", (0, 4))
    for backend in (digests.HostDigests(), digests.DeviceDigests()):
      self.assertEqual(backend.row_hashes(backend.start_rows([x], [layout]), [layout]), [[]])

  def test_a_sub_byte_dtype_without_a_device_path_says_to_hash_on_the_host(self):
    with self.assertRaisesRegex(TypeError, "digest_backend='host'"):
      device_digest.digest_words(jnp.zeros(8, jnp.int1))


class BackendsAgreeTest(absltest.TestCase):

  def _train(self, backend):
    proof = testing.new_proof(f"backend-{backend}", update_p=1.0, state_p=0.5,
                              digest_backend=backend, segment_length=2)
    proof.start(probe_ratio=0.5)
    state = testing.classifier_state(proof)
    train_step = proof.jit(testing.classifier_step, donate_argnums=0)
    for i in range(4):
      state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + i)
    return proof.finish()

  def test_same_commitments_and_both_verify(self):
    host, device = self._train("host"), self._train("device")
    for path in (host, device):
      report = verify.verify(path)
      self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    fields = ("pre_state", "batch", "post_state")
    self.assertEqual([[s.get(f) for f in fields] for s in testing.records_of(host, "step")],
                     [[s.get(f) for f in fields] for s in testing.records_of(device, "step")])
    self.assertEqual(testing.records_of(host, "root")[0]["config"]["digest_backend"], "host")
    self.assertEqual(testing.records_of(device, "root")[0]["config"]["digest_backend"],
                     "device")


class HostRowViewsTest(absltest.TestCase):

  def test_a_batch_passed_again_keeps_its_view_and_hashes_alike(self):
    backend = digests.HostDigests()
    layout = LeafLayout("x", "float32", (16, 4))
    x = jnp.arange(64, dtype=jnp.float32).reshape(16, 4)
    (((_, _, first),),) = backend.start_rows([x], [layout])
    (((_, _, again),),) = backend.start_rows([x], [layout])
    self.assertIs(again, first)  # the same array: its view is not exported again
    y = x + 1
    (((_, _, other),),) = backend.start_rows([y], [layout])
    self.assertIsNot(other, first)
    self.assertEqual(other.tobytes(), np.asarray(y).tobytes())
    self.assertEqual(backend.row_hashes([[(0, 16, again)]], [layout]),
                     backend.row_hashes([[(0, 16, np.asarray(x))]], [layout]))
    # Only the last step's blocks are kept.
    self.assertEqual([b for b, _ in backend._last_views.values()], [y])  # pylint: disable=protected-access


if __name__ == "__main__":
  absltest.main()
