"""What `zkdv verify` costs against re-running the checked steps.

  python -m benchmarks.verify_cost [--checks 12] [--repeats 3] [--segments 1 8] [--jobs 2]

For each workload and segment length L it trains a proof with every segment
checked, then times ``zkdv.verify`` (median of alternating runs) on a transcript
of one segment and on one of ``--checks`` segments. The ideal cost of verifying
is re-executing each replayed step once: steps x (median ``jax.jit`` step time, timed
a segment's steps at a time in turns with the verifications, the state donated as a
replay's is).
Ratios are reported for the whole verification and for the marginal cost per
replayed step (which leaves out the one-time compilation of the exported
program). The verifier keeps one compiled executable, keeps the state on the
device through a segment, and continues a segment from the previous one's
replayed end state on the device when they meet; each configuration is timed
without and with read-ahead of the next check's openings, and in ``--jobs``
processes (alternating). A transcript of one check runs in one process either
way, so the parallel row's marginal cost includes starting its processes and
compiling the program in each.
"""

import argparse
import functools
import os
import pathlib
import tempfile

import jax
import optax

import zkdv
from benchmarks import common
from zkdv import verify


def _transcript(workload, steps: int, length: int, folder: pathlib.Path) -> pathlib.Path:
  model, params, batch = workload()
  proof = zkdv.jax.ZKDV(f"verify-cost-{steps}", zkdv.ZKDVConfig(
      sampling_policy=zkdv.SamplingPolicy(update_check_probability=1.0),
      segment_length=length, output_dir=folder / f"steps-{steps}-L{length}"))
  proof.start()
  state = zkdv.jax.contrib.TrainState.create(
      proof=proof, apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
  step = proof.jit(common.train_step, donate_argnums=0)
  for _ in range(steps):
    state = step(state, *batch)
  return proof.finish()


class JitSteps:
  """``jax.jit`` steps of a workload, its state donated and chained as a replay's is."""

  def __init__(self, workload):
    model, params, self._batch = workload()
    from flax.training import train_state  # pylint: disable=g-import-not-at-top
    self._state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                                tx=optax.adam(1e-3))
    self._step = jax.jit(common.train_step, donate_argnums=0)
    self.run(3)  # compiled and warm

  def run(self, steps: int) -> None:
    for _ in range(steps):
      self._state = self._step(self._state, *self._batch)
    jax.block_until_ready(self._state)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checks", type=int, default=12)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--segments", type=int, nargs="+", default=[1, 8],
                      help="segment lengths L to measure")
  parser.add_argument("--jobs", type=int, default=2,
                      help="processes for the parallel row (zkdv verify --jobs)")
  parser.add_argument("--workload", choices=["tutorial", "mlp", "all"], default="all")
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory(prefix="zkdv-verify-cost-") as folder:
    rows = _measure(args, pathlib.Path(folder))
  common.print_table(
      "zkdv verify cost against re-running the replayed steps",
      ["workload", "L", "read-ahead", "jobs", "checks", "steps", "jax.jit step ms", "ideal s",
       "verify s", "ratio", "marginal ms/step", "marginal ratio"], rows)


def _measure(args, folder: pathlib.Path) -> list[list]:
  """The table's rows; the transcripts are written under ``folder``."""
  rows = []
  workloads = [("tutorial Dense", common.tutorial_workload),
               ("MLP 784-1024x4-10, batch 1024", common.mlp_workload)]
  if args.workload != "all":
    workloads = [w for w in workloads if w[0].lower().startswith(args.workload)]
  for name, workload in workloads:
    jit = JitSteps(workload)
    for length in args.segments:
      one = _transcript(workload, length, length, folder / name.split()[0])
      many = _transcript(workload, args.checks * length, length, folder / name.split()[0])
      os.sync()  # a transcript at rest: its writeback is not the verifier's to pay
      configs = [(False, 1), (True, 1), (False, args.jobs)]  # (read-ahead, processes)
      runs = {(size, ahead, jobs): functools.partial(verify.verify, path, read_ahead=ahead,
                                                     jobs=jobs)
              for size, path in (("one", one), ("many", many)) for ahead, jobs in configs}
      runs["jit"] = functools.partial(jit.run, length)  # a segment's steps, in turn with them
      times = common.alternate(runs, args.repeats)
      step_s = common.median(times.pop("jit")) / length
      assert verify.verify(many).verdict == verify.VERIFIED
      steps = args.checks * length
      ideal = steps * step_s
      for ahead, jobs in configs:
        t_one, t_many = (common.median(times[(size, ahead, jobs)]) for size in ("one", "many"))
        marginal = (t_many - t_one) / (steps - length)
        rows.append([name, length, "on" if ahead else "off", jobs, args.checks, steps,
                     f"{step_s * 1e3:.2f}", f"{ideal:.3f}", f"{t_many:.3f}",
                     f"{t_many / ideal:.2f}x", f"{marginal * 1e3:.2f}",
                     f"{marginal / step_s:.2f}x"])
  return rows


if __name__ == "__main__":
  main()
