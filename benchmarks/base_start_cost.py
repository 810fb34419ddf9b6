"""What a start from a base checkpoint costs, against a start from the key.

  python -m benchmarks.base_start_cost [--repeats 5]

For each workload it records two one-step proofs, one started with ``proof.init(model.init,
key, x)`` and one with ``proof.init_from(params)`` (both extended by ``TrainState.create``,
Adam), and reports (medians of alternating runs, programs compiled beforehand):

* the prover's start (export, compile and run the init program, digest its outputs and,
  from a base, the base's params digest), once per proof;
* the bytes of the init program's inputs stored as blobs (the base is uploaded once);
* the verifier's init replays: once, and every replay its start check makes (from the key:
  recorded inputs, other example values, another key; from a base: recorded inputs and
  other base values, drawn in numpy).
"""

import argparse
import pathlib
import tempfile
import time

import jax
import optax

import zkdv
from benchmarks import common
from benchmarks.start_cost import WORKLOADS, _context
from zkdv import transcript
from zkdv.verify import start as start_check


def _proof(workload, example_shape, base: bool, folder: pathlib.Path):
  """(transcript folder, seconds the prover's start took) of a one-step proof."""
  model, params, batch = workload()
  proof = zkdv.jax.ZKDV("base-start-cost", zkdv.ZKDVConfig(
      sampling_policy=zkdv.SamplingPolicy(update_check_probability=1.0),
      output_dir=folder / ("base" if base else "key")))
  proof.start()
  example = jax.numpy.ones(example_shape, batch[0].dtype)
  began = time.perf_counter()
  start = (proof.init_from(params) if base else
           proof.init(model.init, jax.random.key(0), example)["params"])
  state = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply,
                                             params=start, tx=optax.adam(1e-3))
  jax.block_until_ready(state)
  seconds = time.perf_counter() - began
  state = proof.jit(common.train_step)(state, *batch)
  return proof.finish(), seconds


def _replays(ctx) -> dict:
  """The verifier's init replays: once, and the start check's (its other inputs drawn)."""
  init = ctx.model.init
  inputs = [(transcript.read_blob(ctx.model.folder, b, l.dtype, l.shape), l)
            for b, l in zip(init.input_blobs, init.inputs)]
  base = len(init.base_layout)
  kinds = {start_check._input_kind(n, l, base)  # pylint: disable=protected-access
           for n, (_, l) in enumerate(inputs)}
  run = lambda xs: ctx.programs.run(init, xs, "init")  # pylint: disable=unnecessary-lambda-assignment
  run(inputs)  # compiles

  def check():
    run(inputs)
    for what in sorted(kinds):
      run(start_check._other_inputs(ctx, inputs, what))  # pylint: disable=protected-access
  stored = sum(int(a.nbytes) for a, _ in inputs)
  return {"init once": lambda: run(inputs), "start check": check}, 1 + len(kinds), stored


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  rows = []
  with tempfile.TemporaryDirectory(prefix="zkdv-base-start-") as folder:
    _proof(common.tutorial_workload, (1, 4), False, pathlib.Path(folder) / "warm-up")
    for name, (workload, example_shape) in WORKLOADS.items():
      for base in (False, True):
        path, prover = _proof(workload, example_shape, base, pathlib.Path(folder) / name)
        runs, count, stored = _replays(_context(path))
        ms = {k: 1e3 * common.median(v) for k, v in common.alternate(runs, args.repeats).items()}
        rows.append([name, "base checkpoint" if base else "key", f"{1e3 * prover:.1f}",
                     f"{stored:,}", f"{ms['init once']:.2f}",
                     f"{ms['start check']:.2f} ({count} replays)"])
  common.print_table("A start from the key and from a base checkpoint (ms, medians)",
                     ["workload", "start", "prover's start", "init input bytes",
                      "init replay", "start check"], rows)


if __name__ == "__main__":
  main()
