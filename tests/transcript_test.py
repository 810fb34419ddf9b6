"""Digests, Merkle trees, sampling and the transcript file."""

import os
import pathlib
import tempfile

import blake3
import cbor2
import ml_dtypes
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from zkdv import digest
from zkdv import errors
from zkdv import merkle
from zkdv import challenge
from zkdv import transcript


# docs/protocol.md: leaves and nodes are BLAKE3 keyed by the digests of these names.
LEAF_KEY = blake3.blake3(b"zkdv merkle leaf").digest()
NODE_KEY = blake3.blake3(b"zkdv merkle node").digest()


def reference_leaf(data: bytes) -> bytes:
  return blake3.blake3(data, key=LEAF_KEY).digest()


def reference_mth(leaves: list[bytes]) -> bytes:
  """RFC 9162 §2.1.1, written recursively as the RFC does, with keys for its prefixes."""
  n = len(leaves)
  if n == 0:
    return blake3.blake3(b"").digest()
  if n == 1:
    return reference_leaf(leaves[0])
  k = 1 << ((n - 1).bit_length() - 1)
  return blake3.blake3(reference_mth(leaves[:k]) + reference_mth(leaves[k:]),
                       key=NODE_KEY).digest()


class DigestTest(parameterized.TestCase):

  @parameterized.product(
      nbytes=[0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 3 * 1024 + 1],
      dtype=["uint8", "bool", "float32", "bfloat16", "float8_e4m3fn", "int4", "int64"])
  def test_leaf_digest_is_blake3_of_tobytes(self, nbytes, dtype):
    np_dtype = digest.numpy_dtype(dtype)
    count = nbytes // np_dtype.itemsize
    rng = np.random.default_rng(nbytes)
    raw = rng.integers(0, 256, count * np_dtype.itemsize, dtype=np.uint8)
    if dtype == "bool":
      raw = raw % 2
    if dtype == "int4":
      raw = (raw % 16).astype(np.uint8)
    array = raw.view(np_dtype)
    self.assertEqual(digest.leaf_digest(array), blake3.blake3(array.tobytes()).digest())

  def test_large_leaves_are_hashed_on_all_cores_small_ones_on_one(self):
    self.assertEqual(digest.hash_threads(digest.PARALLEL_HASH_BYTES - 1), 1)
    self.assertEqual(digest.hash_threads(digest.PARALLEL_HASH_BYTES), blake3.blake3.AUTO)
    large = np.random.default_rng(0).integers(0, 256, digest.PARALLEL_HASH_BYTES, np.uint8)
    self.assertEqual(digest.leaf_digest(large), blake3.blake3(large.tobytes()).digest())

  def test_non_contiguous_array_is_hashed_in_c_order(self):
    a = np.arange(12, dtype=np.float32).reshape(3, 4).T
    self.assertEqual(digest.leaf_digest(a), blake3.blake3(np.ascontiguousarray(a).tobytes()).digest())

  def test_state_digest_depends_on_every_field(self):
    leaf = digest.LeafLayout(".w", "float32", (2,))
    d = digest.leaf_digest(np.zeros(2, np.float32))
    base = digest.state_digest([leaf], [[digest.whole_piece(leaf, d)]])
    for changed in (digest.LeafLayout(".v", "float32", (2,)),
                    digest.LeafLayout(".w", "int32", (2,)),
                    digest.LeafLayout(".w", "float32", (2, 1))):
      self.assertNotEqual(base, digest.state_digest([changed], [[digest.whole_piece(changed, d)]]))
    other = digest.leaf_digest(np.ones(2, np.float32))
    self.assertNotEqual(base, digest.state_digest([leaf], [[digest.whole_piece(leaf, other)]]))

  def test_batch_digest_rows(self):
    layout = digest.LeafLayout("[0][1]", "uint32", (4, 5))
    rows = np.arange(20, dtype=np.uint32).reshape(4, 5)
    hashes = digest.row_leaf_hashes(layout, rows)
    self.assertEqual(hashes, [merkle.leaf_hash(r.tobytes()) for r in rows])
    key = digest.LeafLayout("[0][2]", "uint32", (2,), key_impl="threefry2x32")
    self.assertEqual(key.rows, 1)
    base = digest.digest_batch_arrays([layout], [rows])
    rows2 = rows.copy()
    rows2[3, 4] += 1
    self.assertNotEqual(base, digest.digest_batch_arrays([layout], [rows2]))


class MerkleTest(parameterized.TestCase):

  @parameterized.parameters(0, 1, 7, 1023, 1024, 1025, 3 * 3136 + 5)
  def test_leaf_hashes_are_each_rows_keyed_hash(self, width):
    rows = np.random.default_rng(width).integers(0, 256, (5, width), np.uint8)
    self.assertEqual(merkle.leaf_hashes(rows), [reference_leaf(row.tobytes()) for row in rows])
    self.assertEqual(merkle.leaf_hashes(rows[:, ::-1]),  # a strided view: its bytes in C order
                     [reference_leaf(row[::-1].tobytes()) for row in rows])

  def test_leaves_nodes_and_plain_digests_differ_on_the_same_bytes(self):
    pair = bytes(range(64))
    hashes = {merkle.leaf_hash(pair), merkle.node_hash(pair[:32], pair[32:]),
              blake3.blake3(pair).digest()}
    self.assertLen(hashes, 3)

  @parameterized.parameters(*range(0, 18))
  def test_root_matches_rfc_and_every_proof_verifies(self, n):
    data = [bytes([i]) * (i + 1) for i in range(n)]
    leaves = [merkle.leaf_hash(d) for d in data]
    self.assertEqual(merkle.root(leaves), reference_mth(data))
    if not n:
      return
    levels = merkle.tree_levels(leaves)
    root = levels[-1][0]
    for i in range(n):
      proof = merkle.inclusion_proof(levels, i)
      self.assertTrue(merkle.verify_inclusion(leaves[i], i, n, proof, root))
      self.assertFalse(merkle.verify_inclusion(merkle.leaf_hash(b"x"), i, n, proof, root))
      if n > 1:
        self.assertFalse(merkle.verify_inclusion(leaves[i], (i + 1) % n, n, proof, root))
      self.assertFalse(merkle.verify_inclusion(leaves[i], n, n, proof, root))


class SamplingTest(absltest.TestCase):

  def test_rates_and_determinism(self):
    seed = bytes(range(32))
    policy = challenge.Policy(update_check_probability=0.1, state_check_probability=0.1)

    def decisions(key):
      return [challenge.decide(t, challenge.step_challenge_self(key, t), policy)
              for t in range(20000)]
    draws = [d.update for d in decisions(seed)]
    self.assertBetween(sum(draws), 1800, 2200)  # 0.1 +- 5 sigma
    self.assertEqual(draws, [d.update for d in decisions(seed)])
    self.assertNotEqual(draws, [d.update for d in decisions(b"\x01" * 32)])
    self.assertNotEqual(draws, [d.state for d in decisions(seed)])
    never = challenge.Policy(update_check_probability=0.0)
    always = challenge.Policy(update_check_probability=1.0)
    self.assertFalse(any(challenge.decide(t, challenge.step_challenge_self(seed, t),
                                          never).update for t in range(1000)))
    self.assertTrue(all(challenge.decide(t, challenge.step_challenge_self(seed, t),
                                         always).update for t in range(1000)))


class TranscriptFileTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.folder = pathlib.Path(tempfile.mkdtemp()) / "t"
    self.writer = transcript.TranscriptWriter(self.folder)
    self.ids = [self.writer.append({"type": "root", "n": 0})]
    for i in range(1, 5):
      self.ids.append(self.writer.append({"type": "step", "n": i, "blob": b"\x00" * 32}))
    self.writer.close()

  def test_chain_and_ids(self):
    contents = transcript.read_transcript(self.folder)
    self.assertIsNone(contents.torn_tail)
    self.assertEqual([r.record_id for r in contents.records], self.ids)
    self.assertEqual(self.writer.transcript_id, self.ids[0])
    self.assertNotIn("prev", contents.records[0].record)
    for prev, rec in zip(contents.records, contents.records[1:]):
      self.assertEqual(rec.record["prev"], prev.record_id)
      self.assertEqual(cbor2.dumps(rec.record, canonical=True), rec.raw)

  def test_torn_file_recovers_every_complete_record(self):
    path = self.folder / transcript.RECORDS_FILE
    data = path.read_bytes()
    last_start = transcript.read_transcript(self.folder).records[-1].offset
    for cut in range(last_start + 1, len(data)):
      path.write_bytes(data[:cut])
      contents = transcript.read_transcript(self.folder)
      self.assertLen(contents.records, 4)
      self.assertEqual(contents.torn_tail.offset, last_start)
      self.assertEqual(contents.torn_tail.nbytes, cut - last_start)

  def test_item_that_is_not_a_map(self):
    path = self.folder / transcript.RECORDS_FILE
    path.write_bytes(path.read_bytes() + cbor2.dumps([1, 2, 3]))
    with self.assertRaisesRegex(errors.TranscriptFormatError, "not a record map"):
      transcript.read_transcript(self.folder)

  def test_blobs_are_content_addressed_and_checked(self):
    writer = transcript.TranscriptWriter(pathlib.Path(tempfile.mkdtemp()) / "b")
    a = np.arange(6, dtype=ml_dtypes.bfloat16)
    d = writer.put_blob(digest.byte_view(a))
    self.assertEqual(d, blake3.blake3(a.tobytes()).digest())
    self.assertEqual(writer.put_blob(digest.byte_view(a)), d)  # stored once
    back = transcript.read_blob(writer.folder, d, "bfloat16", (6,))
    np.testing.assert_array_equal(back, a)
    with self.assertRaisesRegex(errors.TranscriptFormatError, "needs"):
      transcript.read_blob(writer.folder, d, "float32", (6,))
    path = transcript.blob_path(writer.folder, d)
    raw = bytearray(path.read_bytes())
    raw[0] ^= 1
    path.write_bytes(bytes(raw))
    with self.assertRaisesRegex(errors.TranscriptFormatError, "does not hash"):
      transcript.read_blob(writer.folder, d, "bfloat16", (6,))
    with self.assertRaisesRegex(errors.TranscriptFormatError, "not a blob digest"):
      transcript.blob_path(writer.folder, "../../etc/passwd")
    self.assertEqual(sorted(os.listdir(writer.folder / transcript.BLOBS_DIR)), [d.hex()])


if __name__ == "__main__":
  absltest.main()
