"""Device BLAKE3 throughput against a device-to-device copy, and the MLP table,
on whatever accelerator JAX sees. One short run (a few minutes):

  python -m benchmarks.device_digest [--sizes-mb 16 64 256] [--repeats 10] [--batch 1024]

Throughput rows compare ``device_digest.digest_words`` of float32, bfloat16 and
uint8 leaves with a copy kernel reading and writing the same bytes (the bandwidth
bound of a hash that reads each byte once); the digests are checked against the
host ``blake3`` package first. The batching rows hash the MLP's Adam state (30 leaves) and a
batch's rows as the proof does, every leaf's chunks in one batch (``digest_many``,
``rows_leaf_words``), against the naive layout of a loop a leaf in one program (the state) or
a program a leaf (the rows), alternating. The overhead table is ``benchmarks.overhead`` for
the MLP workload.
"""

import argparse
import time

import blake3
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import common
from benchmarks import overhead
from zkdv import digest
from zkdv.jax import device_digest


def _median_seconds(fn, x, repeats: int) -> float:
  jax.block_until_ready(fn(x))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append(time.perf_counter() - start)
  return common.median(times)


def throughput(sizes_mb, repeats: int) -> list[list]:
  copy = jax.jit(lambda x: x + jnp.asarray(0, x.dtype))
  rows = []
  for mb in sizes_mb:
    bits = jax.random.bits(jax.random.key(mb), (mb * 2**20 // 4,), jnp.uint32)
    for dtype in DTYPES:
      x = _leaf(bits, dtype)
      got = device_digest.words_to_bytes(device_digest.digest_words(x))
      assert got == blake3.blake3(np.asarray(x).tobytes()).digest(), "device digest differs"
      t_hash = _median_seconds(device_digest.digest_words, x, repeats)
      t_copy = _median_seconds(copy, x, repeats)
      gb = x.size * x.dtype.itemsize / 2**30
      rows.append([f"{mb} MiB", dtype, f"{t_hash * 1e3:.2f}", f"{gb / t_hash:.1f}",
                   f"{t_copy * 1e3:.2f}", f"{gb / t_copy:.1f}", f"{t_copy / t_hash:.2f}"])
  return rows


def batching(batch_size: int, repeats: int, rounds: int) -> list[list]:
  """The MLP's state and a batch's rows, hashed in one batch of chunks and the naive way."""
  _, params, batch = common.mlp_workload(batch_size)
  state = [l for l in jax.tree.leaves((params, optax.adam(1e-3).init(params))) if l.size > 1]
  rows = [v.reshape(v.shape[0] // g, -1) for v, g in (  # a batch's Merkle rows
      (v, digest.row_group_for(digest.LeafLayout(name, str(v.dtype), v.shape)))
      for name, v in zip("xy", batch))]
  per_leaf = jax.jit(lambda xs: jnp.stack([device_digest.digest_words(v) for v in xs]))
  runs = {
      "state, one batch": lambda: device_digest.digest_many(state),
      "state, a loop a leaf": lambda: per_leaf(state),
      "rows, one batch": lambda: device_digest.rows_leaf_words(rows),
      "rows, a program a leaf": lambda: [device_digest.rows_leaf_words([r]) for r in rows],
  }
  assert (np.asarray(runs["state, one batch"]()).tobytes()
          == np.asarray(runs["state, a loop a leaf"]()).tobytes()), "state digests differ"
  assert (np.asarray(runs["rows, one batch"]()).tobytes()
          == b"".join(np.asarray(w).tobytes() for w in runs["rows, a program a leaf"]())), (
              "row digests differ")
  times = {name: [] for name in runs}
  for n in range(rounds):
    for name in runs if n % 2 == 0 else list(runs)[::-1]:
      times[name].append(_median_seconds(lambda _: runs[name](), None, repeats))
  nbytes = {"state": sum(l.nbytes for l in state), "rows": sum(r.nbytes for r in rows)}
  out = []
  for name, ts in times.items():
    what = name.split(",")[0]
    naive = times["state, a loop a leaf" if what == "state" else "rows, a program a leaf"]
    out.append([name, f"{nbytes[what] / 1e6:.1f}", f"{common.median(ts) * 1e3:.2f}",
                f"{nbytes[what] / common.median(ts) / 2**30:.2f}",
                f"{common.median(ts) / common.median(naive):.2f}"])
  return out


DTYPES = ("float32", "bfloat16", "uint8")  # a state's leaves, and a batch of images


def _leaf(bits: jax.Array, dtype: str) -> jax.Array:
  """``bits``'s bytes as a flat array of ``dtype`` (the same bytes, however many elements)."""
  if dtype == "float32":
    return jax.lax.bitcast_convert_type(bits, jnp.float32)
  narrow = {"bfloat16": jnp.bfloat16, "uint8": jnp.uint8}[dtype]
  return jax.lax.bitcast_convert_type(bits, narrow).reshape(-1)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64, 256])
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--batch", type=int, default=1024)
  args = parser.parse_args(argv)
  device = jax.devices()[0]
  rows = throughput(args.sizes_mb, args.repeats)
  batched = batching(args.batch, args.repeats, args.rounds)
  table = overhead.measure("mlp", args.rounds, 5, rss=False)
  common.print_table(f"Device BLAKE3 on {device.device_kind}", [
      "bytes", "dtype", "digest ms", "digest GB/s", "copy ms", "copy GB/s",
      "fraction of copy"], rows)
  print()
  common.print_table(f"Leaves side by side on {device.device_kind} (MLP 784-1024x4-10, Adam, "
                     f"batch {args.batch}; medians of {args.rounds} alternating rounds)", [
      "what", "MB", "ms awaited", "GB/s", "ratio to the naive layout"], batched)
  print()
  common.print_table(f"MLP overhead on {device.device_kind}", overhead.HEADER, table)


if __name__ == "__main__":
  main()
