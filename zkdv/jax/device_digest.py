"""BLAKE3 in ``jax.numpy``: leaf digests computed where the leaf lives.

Bit for bit ``blake3.blake3(np.asarray(x).tobytes()).digest()`` (with ``key``, BLAKE3's
keyed mode: ``blake3.blake3(data, key=key)``, as Merkle leaves hash). The input is
split into 1 KiB chunks hashed in parallel (16 block compressions each), then
the parent tree is folded level by level. Shapes are static, so each leaf
shape compiles once and only the 32-byte digests leave the device.

Example::

  words = digest_words(x)           # uint32[8] on x's device
  bytes(np.asarray(words).view(np.uint8))
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from zkdv import merkle
from zkdv.jax import arrays

IV = np.array([0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A,
               0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19], np.uint32)
MSG_PERMUTATION = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
CHUNK_START, CHUNK_END, PARENT, ROOT, KEYED_HASH = 1, 2, 4, 8, 16
BLOCK_BYTES, CHUNK_BYTES = 64, 1024


def _rotr(x, n):
  return (x >> np.uint32(n)) | (x << np.uint32(32 - n))


def _g(a, b, c, d, mx, my):
  """The mixing function G on four state words."""
  a = a + b + mx
  d = _rotr(d ^ a, 16)
  c = c + d
  b = _rotr(b ^ c, 12)
  a = a + b + my
  d = _rotr(d ^ a, 8)
  c = c + d
  b = _rotr(b ^ c, 7)
  return a, b, c, d


# The (a, b, c, d) state words each of a round's eight G calls mixes: columns, then diagonals.
_G_WORDS = ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),
            (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14))


def compress(cv, block, counter, block_len, flags):
  """The BLAKE3 compression function, vectorized over a trailing batch axis.

  cv: uint32[8, n]; block: uint32[16, n]; counter, block_len, flags: uint32[n]
  or scalars (the counter's high word is 0: fewer than 2**32 chunks). Returns
  the output chaining value, uint32[8, n]. Each state and message word is its own
  uint32[n] (a round is elementwise over the batch axis), and the message is
  permuted between rounds, as the specification does, rather than gathered.
  """
  n = cv.shape[1]

  def lanes(value):
    return jnp.broadcast_to(jnp.asarray(value, jnp.uint32), (n,))

  def one_round(_, vm):
    v, m = list(vm[0]), vm[1]
    for g, (a, b, c, d) in enumerate(_G_WORDS):
      v[a], v[b], v[c], v[d] = _g(v[a], v[b], v[c], v[d], m[2 * g], m[2 * g + 1])
    return tuple(v), tuple(m[i] for i in MSG_PERMUTATION)

  v = tuple(cv[i] for i in range(8)) + tuple(lanes(IV[i]) for i in range(4)) + (
      lanes(counter), lanes(0), lanes(block_len), lanes(flags))
  v, _ = jax.lax.fori_loop(0, 7, one_round, (v, tuple(block[i] for i in range(16))))
  return jnp.stack([v[i] ^ v[i + 8] for i in range(8)])


_UNSIGNED_BITS = {2: jnp.uint2, 4: jnp.uint4}  # the unsigned dtype of a sub-byte width


def to_bytes(x: jax.Array) -> jax.Array:
  """The leaf's bytes (C order, little-endian) as a flat uint8 array, on device."""
  x = arrays.unwrap_key(x)
  bits = jax.dtypes.itemsize_bits(x.dtype)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  elif bits < 8:  # int2, int4, float4_e2m1fn...: numpy keeps each value in a byte's low bits
    if bits not in _UNSIGNED_BITS:
      raise TypeError(f"no device digest for {x.dtype} leaves; hash them on the host "
                      "(ZKDVConfig(digest_backend='host')).")
    x = jax.lax.bitcast_convert_type(x, _UNSIGNED_BITS[bits]).astype(jnp.uint8)
  elif x.dtype != jnp.uint8:
    x = jax.lax.bitcast_convert_type(x, jnp.uint8)
  return x.reshape(-1)


def to_words(x: jax.Array) -> tuple[jax.Array, int]:
  """(the leaf's bytes as little-endian uint32 words, zero padded; their byte count).

  A 32-bit dtype's elements are its words. Narrower elements are packed into words
  ``_WORDS_PER_ROW`` words at a time, from strided slices of rows of that many words'
  elements, so that every array in between stays lane-dense on an accelerator (an
  ``[n, 4]`` byte array pads its last axis to the vector width there).
  """
  x = arrays.unwrap_key(x)
  if jnp.iscomplexobj(x):  # as numpy lays it out: each element's real part, then imaginary
    x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
  if x.dtype.itemsize == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1), 4 * x.size
  if x.dtype.itemsize == 2:
    units, bits = jax.lax.bitcast_convert_type(x, jnp.uint16).reshape(-1), 16
  else:
    units, bits = to_bytes(x), 8
  per_word = 32 // bits
  count = units.shape[0]
  row = _WORDS_PER_ROW * per_word
  units = jnp.pad(units, (0, -count % row)).reshape(-1, row).astype(jnp.uint32)
  words = units[:, 0::per_word]
  for k in range(1, per_word):
    words = words | (units[:, k::per_word] << np.uint32(bits * k))
  return words.reshape(-1), count * bits // 8


_WORDS_PER_ROW = 128  # a TPU's vector width, in 32-bit lanes


def _chunk_lanes(sizes: list[int]) -> tuple[np.ndarray, ...]:
  """Per chunk of leaves of ``sizes`` bytes, chunks of a leaf contiguous: its counter in its
  leaf, its block count, its final block's length, and whether it is its leaf's only chunk
  (then it is the root)."""
  counters, blocks, final_len, root = [], [], [], []
  for nbytes in sizes:
    n_chunks = _chunk_count(nbytes)
    last_len = nbytes - CHUNK_BYTES * (n_chunks - 1)
    last_blocks = max(1, math.ceil(last_len / BLOCK_BYTES))
    counters.append(np.arange(n_chunks))
    blocks.append(np.full(n_chunks, 16))
    blocks[-1][-1] = last_blocks
    final_len.append(np.full(n_chunks, BLOCK_BYTES))
    final_len[-1][-1] = last_len - BLOCK_BYTES * (last_blocks - 1)
    root.append(np.full(n_chunks, n_chunks == 1))
  return tuple(np.concatenate(a).astype(np.uint32) for a in (counters, blocks, final_len, root))


def _chunk_count(nbytes: int) -> int:
  return max(1, math.ceil(nbytes / CHUNK_BYTES))


def _hash_chunks(words: jax.Array, sizes: list[int], key: np.ndarray, mode: int) -> jax.Array:
  """Chaining values of every chunk of leaves of ``sizes`` bytes, uint32[8, chunks], all
  leaves' chunks side by side in one batch (``words``: each leaf zero padded to whole chunks,
  one after another)."""
  counters, n_blocks, final_len, root = _chunk_lanes(sizes)
  n_chunks = counters.shape[0]
  blocks = words.reshape(n_chunks, 16, 16).transpose(1, 2, 0)  # [block, word, chunk]

  def one_block(cv, j_block):
    j, block = j_block
    final_block = j == n_blocks - 1
    length = jnp.where(final_block, final_len, BLOCK_BYTES)
    flags = (jnp.where(j == 0, CHUNK_START, 0) | jnp.where(final_block, CHUNK_END, 0)
             | jnp.where(final_block & (root == 1), ROOT, 0) | mode)
    out = compress(cv, block, counters, length.astype(jnp.uint32), flags.astype(jnp.uint32))
    return jnp.where(j < n_blocks, out, cv), None

  cv = jnp.broadcast_to(jnp.asarray(key)[:, None], (8, n_chunks))
  return jax.lax.scan(one_block, cv, (jnp.arange(16), blocks))[0]


def _fold_trees(cv: jax.Array, counts: list[int], key: np.ndarray, mode: int) -> jax.Array:
  """Each leaf's root, uint32[8, leaves], from its ``counts[i]`` chunks' chaining values
  (contiguous in ``cv``): every leaf's tree a level at a time, all in one compression a
  level. A left-complete tree: neighbours pair, an odd last one is carried up."""
  starts = np.cumsum([0] + counts[:-1])
  while max(counts) > 1:
    pairs = [c // 2 for c in counts]
    total = sum(pairs)
    left = np.concatenate([s + 2 * np.arange(p) for s, p in zip(starts, pairs)])
    is_root = np.concatenate([np.full(p, c == 2) for p, c in zip(pairs, counts)])
    parents = compress(jnp.broadcast_to(jnp.asarray(key)[:, None], (8, total)),
                       jnp.concatenate([cv[:, left], cv[:, left + 1]]), 0, BLOCK_BYTES,
                       np.where(is_root, PARENT | mode | ROOT, PARENT | mode).astype(np.uint32))
    index, new_starts, new_counts, done = [], [], [], 0  # columns of [parents, cv]
    for s, c, p in zip(starts, counts, pairs):
      new_starts.append(len(index))
      index.extend(range(done, done + p))
      if c % 2:
        index.append(total + s + c - 1)
      new_counts.append(len(index) - new_starts[-1])
      done += p
    cv = jnp.concatenate([parents, cv], axis=1)[:, np.asarray(index)]
    starts, counts = np.asarray(new_starts), new_counts
  return cv[:, starts]


def _leaves_digests(groups: list, key: bytes | None) -> jax.Array:
  """uint32[leaves, 8]: the digests of ``groups`` of equal-sized leaves, each group
  (uint32[leaves, words] zero padded, the bytes of each of its leaves), every leaf's chunks
  hashed as one batch: many small leaves cost one wide program, not one narrow one each."""
  if key is not None and (not isinstance(key, bytes) or len(key) != 32):
    raise ValueError(f"a BLAKE3 key is 32 bytes, got {key!r:.80}.")
  key_words, mode = (IV, 0) if key is None else (np.frombuffer(key, "<u4"), KEYED_HASH)
  padded, sizes = [], []
  for words, nbytes in groups:
    if words.shape[0]:
      width = _chunk_count(nbytes) * CHUNK_BYTES // 4
      padded.append(jnp.pad(words, ((0, 0), (0, width - words.shape[1]))).reshape(-1))
      sizes += [nbytes] * words.shape[0]
  if not sizes:
    return jnp.zeros((0, 8), jnp.uint32)
  cv = _hash_chunks(jnp.concatenate(padded), sizes, key_words, mode)
  return _fold_trees(cv, [_chunk_count(n) for n in sizes], key_words, mode).T


@functools.partial(jax.jit, static_argnames=("key",))
def digest_many(xs: list, key: bytes | None = None) -> jax.Array:
  """uint32[len(xs), 8]: the BLAKE3 digest of each leaf's bytes (keyed by ``key``: 32 bytes),
  all in one batch of chunks.

  Example: ``digest_many([w, b])[1]`` equals ``digest_words(b)``.
  """
  groups = []
  for x in xs:
    words, nbytes = to_words(x)
    groups.append((words[None], nbytes))
  return _leaves_digests(groups, key)


@functools.partial(jax.jit, static_argnames=("key",))
def digest_words(x: jax.Array, key: bytes | None = None) -> jax.Array:
  """uint32[8]: the BLAKE3 digest of the leaf's bytes (keyed by ``key``: 32 bytes)."""
  return digest_many([x], key=key)[0]


@jax.jit
def rows_leaf_words(xs: list) -> jax.Array:
  """uint32[rows, 8]: the Merkle leaf hash (``zkdv.merkle.leaf_hash``) of each leading-axis
  row of each array of ``xs``, the arrays' rows one after another, all in one batch of
  chunks (and one transfer to the host).

  Example: ``rows_leaf_words([x, y])[len(x) + i]`` is the leaf hash of ``y[i]``'s bytes.
  """
  return _leaves_digests([_rows_as_words(x) for x in xs], merkle.LEAF_KEY)


def _rows_as_words(x: jax.Array) -> tuple[jax.Array, int]:
  """(uint32[rows, words]: each leading-axis row's words, the bytes of a row)."""
  rows = x.reshape(x.shape[0], math.prod(x.shape[1:])) if x.ndim else x.reshape(1, 1)
  nbytes = []

  def words(row):
    w, n = to_words(row)
    nbytes.append(n)
    return w

  return jax.vmap(words)(rows), nbytes[0]


def words_to_bytes(words) -> bytes:
  return np.asarray(words, np.uint32).astype("<u4").tobytes()


def rows_to_bytes(words) -> list[bytes]:
  """Each row's digest of ``uint32[rows, 8]`` words, converted at once (a call a row cost
  the commit thread 0.2 ms a step at batch 1024)."""
  data = words_to_bytes(words)
  return [data[i:i + 32] for i in range(0, len(data), 32)]
