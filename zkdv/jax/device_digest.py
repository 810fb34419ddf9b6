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


def _message_schedule() -> np.ndarray:
  """int32[7, 16]: which message word each round reads (the permutation, composed)."""
  order, rounds = list(range(16)), []
  for _ in range(7):
    rounds.append(order)
    order = [order[i] for i in MSG_PERMUTATION]
  return np.array(rounds, np.int32)


_SCHEDULE = _message_schedule()


def _g(a, b, c, d, mx, my):
  """The mixing function on four lanes at once (rows of the 4x4 state)."""
  a = a + b + mx
  d = _rotr(d ^ a, 16)
  c = c + d
  b = _rotr(b ^ c, 12)
  a = a + b + my
  d = _rotr(d ^ a, 8)
  c = c + d
  b = _rotr(b ^ c, 7)
  return a, b, c, d


def compress(cv, block, counter, block_len, flags):
  """The BLAKE3 compression function, vectorized over a trailing batch axis.

  cv: uint32[8, n]; block: uint32[16, n]; counter, block_len, flags: uint32[n]
  or scalars (the counter's high word is 0: fewer than 2**32 chunks). Returns
  the output chaining value, uint32[8, n].
  """
  n = cv.shape[1]
  tail = jnp.stack([jnp.broadcast_to(jnp.asarray(v, jnp.uint32), (n,))
                    for v in (counter, 0, block_len, flags)])
  state = jnp.concatenate([cv, jnp.broadcast_to(jnp.asarray(IV[:4])[:, None], (4, n)), tail])

  def one_round(r, state):
    m = block[jnp.asarray(_SCHEDULE)[r]]
    v0, v1, v2, v3 = state[0:4], state[4:8], state[8:12], state[12:16]
    v0, v1, v2, v3 = _g(v0, v1, v2, v3, m[0:8:2], m[1:8:2])  # columns
    v1, v2, v3 = jnp.roll(v1, -1, 0), jnp.roll(v2, -2, 0), jnp.roll(v3, -3, 0)
    v0, v1, v2, v3 = _g(v0, v1, v2, v3, m[8:16:2], m[9:16:2])  # diagonals
    v1, v2, v3 = jnp.roll(v1, 1, 0), jnp.roll(v2, 2, 0), jnp.roll(v3, 3, 0)
    return jnp.concatenate([v0, v1, v2, v3])

  state = jax.lax.fori_loop(0, 7, one_round, state)
  return state[:8] ^ state[8:]


def to_bytes(x: jax.Array) -> jax.Array:
  """The leaf's bytes (C order, little-endian) as a flat uint8 array, on device."""
  x = arrays.unwrap_key(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  elif x.dtype in (jnp.int4, jnp.uint4):  # numpy keeps a 4-bit value in the low nibble
    x = jax.lax.bitcast_convert_type(x.astype(jnp.int8), jnp.uint8) & np.uint8(0x0F)
  elif x.dtype != jnp.uint8:
    x = jax.lax.bitcast_convert_type(x, jnp.uint8)
  return x.reshape(-1)


def _words(data: jax.Array, nwords: int) -> jax.Array:
  """uint8[n] -> uint32[nwords], little-endian, zero padded."""
  data = jnp.pad(data, (0, 4 * nwords - data.shape[0])).reshape(nwords, 4).astype(jnp.uint32)
  return data[:, 0] | (data[:, 1] << 8) | (data[:, 2] << 16) | (data[:, 3] << 24)


def _hash_chunks(words: jax.Array, nbytes: int, single_root: bool, key: np.ndarray,
                 mode: int) -> jax.Array:
  """Chaining values of every chunk, uint32[8, n_chunks]."""
  n_chunks = max(1, math.ceil(nbytes / CHUNK_BYTES))
  blocks = words.reshape(n_chunks, 16, 16).transpose(1, 2, 0)  # [block, word, chunk]
  last_len = nbytes - CHUNK_BYTES * (n_chunks - 1)
  last_blocks = max(1, math.ceil(last_len / BLOCK_BYTES))
  counters = jnp.arange(n_chunks, dtype=jnp.uint32)
  is_last_chunk = counters == n_chunks - 1

  def one_block(cv, j_block):
    j, block = j_block
    # Full chunks take 16 blocks; the last chunk stops after `last_blocks`.
    active = jnp.where(is_last_chunk, j < last_blocks, True)
    final_block = jnp.where(is_last_chunk, j == last_blocks - 1, j == 15)
    length = jnp.where(is_last_chunk & final_block,
                       last_len - BLOCK_BYTES * (last_blocks - 1), BLOCK_BYTES)
    flags = (jnp.where(j == 0, CHUNK_START, 0) | jnp.where(final_block, CHUNK_END, 0)
             | jnp.where(final_block & single_root, ROOT, 0) | mode)
    out = compress(cv, block, counters, length.astype(jnp.uint32), flags.astype(jnp.uint32))
    return jnp.where(active, out, cv), None

  cv = jnp.broadcast_to(jnp.asarray(key)[:, None], (8, n_chunks))
  return jax.lax.scan(one_block, cv, (jnp.arange(16), blocks))[0]


def _hash_words(words: jax.Array, nbytes: int, key: np.ndarray, mode: int) -> jax.Array:
  n_chunks = max(1, math.ceil(nbytes / CHUNK_BYTES))
  cv = _hash_chunks(words, nbytes, n_chunks == 1, key, mode)
  while cv.shape[1] > 1:  # left-complete tree: pair neighbours, carry the odd one up
    n = cv.shape[1]
    pairs = n // 2
    block = jnp.concatenate([cv[:, 0:2 * pairs:2], cv[:, 1:2 * pairs:2]])
    parents = compress(jnp.broadcast_to(jnp.asarray(key)[:, None], (8, pairs)), block, 0,
                       BLOCK_BYTES, PARENT | mode | (ROOT if n == 2 else 0))
    cv = jnp.concatenate([parents, cv[:, -1:]], axis=1) if n % 2 else parents
  return cv[:, 0]


@functools.partial(jax.jit, static_argnames=("key",))
def digest_words(x: jax.Array, key: bytes | None = None) -> jax.Array:
  """uint32[8]: the BLAKE3 digest of the leaf's bytes (keyed by ``key``: 32 bytes)."""
  data = to_bytes(x)
  nbytes = data.shape[0]
  n_chunks = max(1, math.ceil(nbytes / CHUNK_BYTES))
  if key is not None and (not isinstance(key, bytes) or len(key) != 32):
    raise ValueError(f"a BLAKE3 key is 32 bytes, got {key!r:.80}.")
  key_words, mode = (IV, 0) if key is None else (np.frombuffer(key, "<u4"), KEYED_HASH)
  return _hash_words(_words(data, n_chunks * CHUNK_BYTES // 4), nbytes, key_words, mode)


@jax.jit
def row_leaf_words(x: jax.Array) -> jax.Array:
  """uint32[rows, 8]: the Merkle leaf hash (``zkdv.merkle.leaf_hash``) of each
  leading-axis row."""
  rows = x.reshape(x.shape[0], -1) if x.ndim else x.reshape(1, 1)
  return jax.vmap(lambda r: digest_words(r, key=merkle.LEAF_KEY))(rows)


def words_to_bytes(words) -> bytes:
  return np.asarray(words, np.uint32).astype("<u4").tobytes()
