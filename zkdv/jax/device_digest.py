"""BLAKE3 in ``jax.numpy``: leaf digests computed where the leaf lives.

Bit for bit ``blake3.blake3(np.asarray(x).tobytes()).digest()``. The input is
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

IV = np.array([0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A,
               0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19], np.uint32)
MSG_PERMUTATION = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
CHUNK_START, CHUNK_END, PARENT, ROOT = 1, 2, 4, 8
BLOCK_BYTES, CHUNK_BYTES = 64, 1024


def _rotr(x, n):
  return (x >> np.uint32(n)) | (x << np.uint32(32 - n))


def _g(s, a, b, c, d, mx, my):
  s[a] = s[a] + s[b] + mx
  s[d] = _rotr(s[d] ^ s[a], 16)
  s[c] = s[c] + s[d]
  s[b] = _rotr(s[b] ^ s[c], 12)
  s[a] = s[a] + s[b] + my
  s[d] = _rotr(s[d] ^ s[a], 8)
  s[c] = s[c] + s[d]
  s[b] = _rotr(s[b] ^ s[c], 7)


def compress(cv, block, counter, block_len, flags):
  """The BLAKE3 compression function, vectorized over a leading batch axis.

  cv: 8 arrays, block: 16 arrays (uint32[n] each); counter, block_len, flags:
  uint32[n] or scalars. Returns the 8 output chaining-value words.
  """
  counter = jnp.asarray(counter, jnp.uint64) if jax.config.jax_enable_x64 else counter
  lo = jnp.asarray(counter, jnp.uint32)
  hi = jnp.zeros_like(lo)
  s = list(cv) + [jnp.full_like(cv[0], w) for w in IV[:4]] + [
      lo + jnp.zeros_like(cv[0]), hi + jnp.zeros_like(cv[0]),
      jnp.asarray(block_len, jnp.uint32) + jnp.zeros_like(cv[0]),
      jnp.asarray(flags, jnp.uint32) + jnp.zeros_like(cv[0])]
  m = list(block)
  for r in range(7):
    _g(s, 0, 4, 8, 12, m[0], m[1])
    _g(s, 1, 5, 9, 13, m[2], m[3])
    _g(s, 2, 6, 10, 14, m[4], m[5])
    _g(s, 3, 7, 11, 15, m[6], m[7])
    _g(s, 0, 5, 10, 15, m[8], m[9])
    _g(s, 1, 6, 11, 12, m[10], m[11])
    _g(s, 2, 7, 8, 13, m[12], m[13])
    _g(s, 3, 4, 9, 14, m[14], m[15])
    if r < 6:
      m = [m[i] for i in MSG_PERMUTATION]
  return [s[i] ^ s[i + 8] for i in range(8)]


def to_bytes(x: jax.Array) -> jax.Array:
  """The leaf's bytes (C order, little-endian) as a flat uint8 array, on device."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  elif jnp.dtype(x.dtype).itemsize == 1 and x.dtype != jnp.uint8 and "int4" not in str(x.dtype):
    x = jax.lax.bitcast_convert_type(x, jnp.uint8)
  elif "int4" in str(x.dtype):
    x = jax.lax.bitcast_convert_type(x.astype(jnp.int8), jnp.uint8)
  elif x.dtype != jnp.uint8:
    x = jax.lax.bitcast_convert_type(x, jnp.uint8)
  return x.reshape(-1)


def _words(data: jax.Array, nwords: int) -> jax.Array:
  """uint8[n] -> uint32[nwords], little-endian, zero padded."""
  data = jnp.pad(data, (0, 4 * nwords - data.shape[0])).reshape(nwords, 4).astype(jnp.uint32)
  return data[:, 0] | (data[:, 1] << 8) | (data[:, 2] << 16) | (data[:, 3] << 24)


def _hash_chunks(words: jax.Array, nbytes: int, single_root: bool):
  """Chaining values of every chunk (uint32[n_chunks, 8] as 8 arrays)."""
  n_chunks = max(1, math.ceil(nbytes / CHUNK_BYTES))
  blocks = words.reshape(n_chunks, 16, 16)
  last_len = nbytes - CHUNK_BYTES * (n_chunks - 1)
  last_blocks = max(1, math.ceil(last_len / BLOCK_BYTES))
  counters = jnp.arange(n_chunks, dtype=jnp.uint32)
  cv = [jnp.full((n_chunks,), w, jnp.uint32) for w in IV]
  for j in range(16):
    # Full chunks take 16 blocks; the last chunk stops after `last_blocks`.
    is_last_chunk = counters == n_chunks - 1
    active = jnp.where(is_last_chunk, j < last_blocks, True)
    final_block = jnp.where(is_last_chunk, j == last_blocks - 1, j == 15)
    length = jnp.where(is_last_chunk & final_block,
                       last_len - BLOCK_BYTES * (last_blocks - 1), BLOCK_BYTES)
    flags = (jnp.where(j == 0, CHUNK_START, 0) | jnp.where(final_block, CHUNK_END, 0)
             | jnp.where(final_block & single_root, ROOT, 0)).astype(jnp.uint32)
    out = compress(cv, [blocks[:, j, k] for k in range(16)], counters,
                   length.astype(jnp.uint32), flags)
    cv = [jnp.where(active, o, c) for o, c in zip(out, cv)]
  return cv


def _hash_words(words: jax.Array, nbytes: int) -> jax.Array:
  n_chunks = max(1, math.ceil(nbytes / CHUNK_BYTES))
  cv = _hash_chunks(words, nbytes, single_root=n_chunks == 1)
  while cv[0].shape[0] > 1:  # left-complete tree: pair neighbours, carry the odd one up
    n = cv[0].shape[0]
    pairs = n // 2
    block = [c[0:2 * pairs:2] for c in cv] + [c[1:2 * pairs:2] for c in cv]
    flags = PARENT | (ROOT if n == 2 else 0)
    out = compress([jnp.full((pairs,), w, jnp.uint32) for w in IV], block, 0, BLOCK_BYTES,
                   flags)
    cv = [jnp.concatenate([o, c[-1:]]) if n % 2 else o for o, c in zip(out, cv)]
  return jnp.stack([c[0] for c in cv])


@functools.partial(jax.jit, static_argnames=("prefix",))
def digest_words(x: jax.Array, prefix: int | None = None) -> jax.Array:
  """uint32[8]: the BLAKE3 digest of the leaf's bytes (optionally after one prefix byte)."""
  data = to_bytes(x)
  if prefix is not None:
    data = jnp.concatenate([jnp.full((1,), prefix, jnp.uint8), data])
  nbytes = data.shape[0]
  n_chunks = max(1, math.ceil(nbytes / CHUNK_BYTES))
  return _hash_words(_words(data, n_chunks * CHUNK_BYTES // 4), nbytes)


@jax.jit
def row_leaf_words(x: jax.Array) -> jax.Array:
  """uint32[rows, 8]: RFC 9162 leaf hashes BLAKE3(0x00 || row) of each leading-axis row."""
  rows = x.reshape(x.shape[0], -1) if x.ndim else x.reshape(1, 1)
  return jax.vmap(lambda r: digest_words(r, prefix=0))(rows)


def words_to_bytes(words) -> bytes:
  return np.asarray(words, np.uint32).astype("<u4").tobytes()
