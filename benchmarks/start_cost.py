"""What the attested start's init replays and the batch-sensitivity replay cost a verifier.

  python -m benchmarks.start_cost [--repeats 7] [--segments 1 8]

For each workload it trains a proof whose start is attested (``proof.init`` and
``TrainState.create``) with every segment of ``L`` steps checked, then, with the
verifier's own ``ProgramLoader`` (programs compiled once beforehand), times
(median of alternating runs):

* the init program replayed once, and the start check's three replays (recorded
  inputs, other example values, another key), against one training step;
* a checked segment replayed without and with the sensitivity test (its first
  step replayed again on a perturbed batch, params read back; an honest step
  needs one draw): the difference is what the test costs a check.
"""

import argparse
import pathlib
import tempfile

import jax
import optax

import zkdv
from benchmarks import common
from zkdv import transcript
from zkdv.verify import checks
from zkdv.verify import sensitivity
from zkdv.verify import structure
from zkdv.verify import start as start_check
from zkdv.verify.context import Verification
from zkdv.verify.programs import ProgramLoader
from zkdv.verify.report import Report

WORKLOADS = {
    "tutorial (10 params)": (common.tutorial_workload, (1, 4)),
    "MLP (4.2 M params)": (common.mlp_workload, (1, 784)),
}


def _proof(workload, example_shape, length: int, folder: pathlib.Path) -> pathlib.Path:
  model, _, batch = workload()
  proof = zkdv.jax.ZKDV("start-cost", zkdv.ZKDVConfig(
      sampling_policy=zkdv.SamplingPolicy(update_check_probability=1.0),
      segment_length=length, output_dir=folder / f"L{length}"))
  proof.start()
  example = jax.numpy.ones(example_shape, batch[0].dtype)
  params = proof.init(model.init, jax.random.key(0), example)["params"]
  state = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply,
                                             params=params, tx=optax.adam(1e-3))
  step = proof.jit(common.train_step)
  for _ in range(length):
    state = step(state, *batch)
  return proof.finish()


def _context(path: pathlib.Path) -> Verification:
  ctx = Verification(Report(path=str(path)), None)
  folder = transcript.records_path(path).parent
  ctx.model = structure.read(transcript.read_transcript(path), folder, ctx.report)
  ctx.programs = ProgramLoader(ctx.report)
  return ctx


def _init_runs(ctx: Verification) -> dict:
  init = ctx.model.init
  inputs = [(transcript.read_blob(ctx.model.folder, b, l.dtype, l.shape), l)
            for b, l in zip(init.input_blobs, init.inputs)]
  examples = start_check._other_inputs(ctx, inputs, "examples")  # pylint: disable=protected-access
  other_key = start_check._other_inputs(ctx, inputs, "key")  # pylint: disable=protected-access
  ctx.programs.run(init, inputs, "init")  # compiles
  run = lambda xs: lambda: ctx.programs.run(init, xs, "init")  # pylint: disable=unnecessary-lambda-assignment
  return {"init once": run(inputs),
          "start check (3 replays)": lambda: [run(xs)() for xs in (inputs, examples, other_key)]}


def _segment_runs(ctx: Verification) -> dict:
  check = next(c for c in checks.ordered_checks(ctx.model) if c.kind == "update")
  step = ctx.model.steps[check.step]
  program = ctx.model.program_of(step)
  read = lambda b, l: transcript.read_blob(ctx.model.folder, b, l.dtype, l.shape)  # pylint: disable=unnecessary-lambda-assignment
  start = [read(b, l) for b, l in zip(check.fields["pre_state_blobs"], program.state)]
  batches = [[read(b, l) for b, l in zip(blobs, program.batch)]
             for blobs in check.fields["batch_blobs"]]
  seed = sensitivity.seed_of(step.record_id)

  def replay(test: bool):
    def run():
      replayed = ctx.programs.replay_segment(program, start, batches, "bench", False,
                                             0 if test else None)
      if test:  # an honest step: one other batch shows every leaf reads the batch
        assert sensitivity.measure(program, batches, 0, seed, *replayed[3])[0] is None
      return replayed[1]
    return run
  replay(True)()  # compiles
  return {"segment replay": replay(False), "with sensitivity": replay(True)}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--segments", type=int, nargs="+", default=[1, 8])
  args = parser.parse_args(argv)
  rows = []
  with tempfile.TemporaryDirectory(prefix="zkdv-start-cost-") as folder:
    for name, (workload, example_shape) in WORKLOADS.items():
      for length in args.segments:
        ctx = _context(_proof(workload, example_shape, length, pathlib.Path(folder) / name))
        model, params, batch = workload()
        state = zkdv.jax.contrib.TrainState.create(apply_fn=model.apply, params=params,
                                                   tx=optax.adam(1e-3))
        jitted = jax.jit(common.train_step)
        jitted(state, *batch)
        runs = {"jax.jit step": lambda: jitted(state, *batch), **_segment_runs(ctx)}
        if length == args.segments[0]:
          runs.update(_init_runs(ctx))
        ms = {k: 1e3 * common.median(v) for k, v in common.alternate(runs, args.repeats).items()}
        extra = ms["with sensitivity"] - ms["segment replay"]
        rows.append([name, length, f"{ms['jax.jit step']:.2f}",
                     f"{ms.get('init once', float('nan')):.2f}",
                     f"{ms.get('start check (3 replays)', float('nan')):.2f}",
                     f"{ms['segment replay']:.2f}", f"{ms['with sensitivity']:.2f}",
                     f"{extra:+.2f} ({extra / ms['jax.jit step']:.2f} steps)"])
  common.print_table("Init replays and the batch-sensitivity test (ms, medians)",
                     ["workload", "L", "jax.jit step", "init replay", "start check",
                      "segment replay", "+ sensitivity", "sensitivity per check"], rows)


if __name__ == "__main__":
  main()
