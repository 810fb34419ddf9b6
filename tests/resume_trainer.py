"""A trainer that checkpoints at segment ends, for the resume tests (run as a subprocess).

``python -m tests.resume_trainer FOLDER CHECKPOINT [--resume] [--stop-at I] [--alter]
[--unanswered I] [--other-batches] [--key] [--finish-after I] [--unsent-blobs]
[--server URL --experiment OWNER/NAME [--proof-id ID]] [--orbax]`` trains ``ITERATIONS``
steps of the tutorial classifier (its start attested with ``proof.init``) with
``flax.serialization`` checkpoints after every segment (``SEGMENT`` steps), as docs/jax.md
shows. ``--stop-at I`` waits for its commitments after iteration ``I`` and blocks on stdin
(the test kills it there); ``--resume`` restores the checkpoint and continues the
transcript; ``--alter`` changes one leaf of the restored state first; ``--unanswered I``
writes no answer to step ``I``'s probes (as a run killed before its answer left),
``--other-batches`` trains other batches than the first run did, ``--key`` passes
``proof.step_key()`` to a step that drops no input with it (as dropout would); ``--data``
draws the batches with ``proof.batches`` from ``DATASET``; ``--finish-after I`` calls
``proof.finish()`` right after iteration ``I``. With ``--server`` the proof is DVBench's,
challenged live (``$DVBENCH_TOKEN``), and ``--resume`` continues proof ``--proof-id``
(``experiment.proof(resume=...)``); ``--unsent-blobs`` sends no blob (as a run killed
before its uploads left); ``--from-start`` resumes without a checkpoint, from the state
``proof.init`` gives (as a run killed before its first checkpoint); ``--prefetch N`` draws
``--data`` batches ``N`` ahead of the loop, on the device; ``--interrupt-first`` interrupts
the first step after the start while it waits for the window (``KeyboardInterrupt``) and
calls it again with the same arguments, as a notebook's cell run again would. Prints
``checkpoint I``, ``ready`` and ``proof ID`` lines. ``--orbax`` checkpoints with Orbax's ``StandardCheckpointer`` into CHECKPOINT/I
instead (restoring the newest).
"""

import argparse
import collections
import itertools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization

import dvbench
from dvbench import upload
import zkdv
from tests import testing
from zkdv import transcript

ITERATIONS = 12
SEGMENT = 3
# With --data: 16 rows of the tutorial's kind, drawn in the proof's seeded order.
DATASET = np.concatenate([np.roll(testing.TUTORIAL_BATCH, n, axis=1) for n in range(4)])


def batch_for(iteration: int) -> np.ndarray:
  """The batch of a training iteration: the same wherever a run resumes."""
  return np.roll(testing.TUTORIAL_BATCH, iteration, axis=0)


def _prefetched(batches, ahead: int):
  """``batches`` drawn ``ahead`` batches ahead of the loop and put on the first device, as
  a loader that prefetches to the device does."""
  queue = collections.deque(jax.device_put(b, jax.devices()[0])
                            for b in itertools.islice(batches, ahead))
  while queue:
    yield queue.popleft()
    queue.extend(jax.device_put(b, jax.devices()[0]) for b in itertools.islice(batches, 1))


def _flax_serialization(path: pathlib.Path):
  """(save, restore) of the state as one ``flax.serialization`` file at ``path`` (a copy of
  each kept as ``path.I``, for resumes from an earlier one)."""
  def save(iteration, state):
    data = serialization.to_bytes(state)
    transcript.write_atomically(path, data)
    transcript.write_atomically(path.with_name(f"{path.name}.{iteration}"), data)
  return save, lambda state: serialization.from_bytes(state, path.read_bytes())


def _orbax(path: pathlib.Path):
  """(save, restore) of the state with Orbax, one checkpoint per iteration under ``path``."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  checkpointer = ocp.StandardCheckpointer()

  def save(iteration, state):
    checkpointer.save(path.absolute() / str(iteration), state)
    checkpointer.wait_until_finished()

  def restore(state):
    newest = max(int(p.name) for p in path.iterdir() if p.name.isdigit())
    return checkpointer.restore(path.absolute() / str(newest), state)
  return save, restore


def _interrupt_first_wait(proof) -> None:
  """Makes the next window wait raise ``KeyboardInterrupt`` once, as Ctrl-C would."""
  pipeline = proof._committer.pipeline  # pylint: disable=protected-access
  reserve = pipeline.reserve

  def interrupted(*args, **kwargs):
    del args, kwargs
    pipeline.reserve = reserve
    raise KeyboardInterrupt
  pipeline.reserve = interrupted


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("folder", type=pathlib.Path)
  parser.add_argument("checkpoint", type=pathlib.Path)
  parser.add_argument("--resume", action="store_true")
  parser.add_argument("--stop-at", type=int)
  parser.add_argument("--alter", action="store_true")
  parser.add_argument("--server")
  parser.add_argument("--experiment")
  parser.add_argument("--proof-id")
  parser.add_argument("--orbax", action="store_true")
  parser.add_argument("--data", action="store_true", help="draw batches with proof.batches")
  parser.add_argument("--unanswered", type=int, help="write no answer to this step's probes")
  parser.add_argument("--other-batches", action="store_true")
  parser.add_argument("--key", action="store_true", help="pass proof.step_key() to the step")
  parser.add_argument("--finish-after", type=int, help="finish right after this iteration")
  parser.add_argument("--unsent-blobs", action="store_true", help="send no blob to the server")
  parser.add_argument("--prefetch", type=int, default=0,
                      help="with --data, draw this many batches ahead, put on the device")
  parser.add_argument("--from-start", action="store_true",
                      help="resumed, restore no checkpoint: go on from proof.init's state")
  parser.add_argument("--interrupt-first", action="store_true",
                      help="interrupt the first step in its window wait, then call it again")
  args = parser.parse_args()
  if args.unanswered is not None:
    probe = zkdv.jax.openings.Openings.probe
    zkdv.jax.openings.Openings.probe = lambda self, job, *more: (
        None if job.index == args.unanswered else probe(self, job, *more))
  if args.unsent_blobs:
    upload.Uploader._send_blobs = lambda self, digests: None
  save, restore = (_orbax if args.orbax else _flax_serialization)(args.checkpoint)
  config = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=1.0,
                                                               state_check_probability=1.0),
                           output_dir=args.folder, segment_length=SEGMENT)
  if args.server:
    experiment = dvbench.Client(args.server).experiment(args.experiment)
    proof = experiment.proof(config=config, resume=args.proof_id if args.resume else None)
  else:
    proof = zkdv.jax.ZKDV("resumed-run", config, resume=args.folder if args.resume else None)
  proof.start(rolling_window=4, probe_ratio=0.5)
  if args.interrupt_first:
    _interrupt_first_wait(proof)
  model = testing.TinyClassifier()
  # An attested start: resumed, proof.init returns the same params and records nothing.
  params = proof.init(model.init, jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
  state = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply, params=params,
                                             tx=optax.adam(1e-2))
  if args.resume and not args.from_start:
    state = restore(state)
    if args.alter:
      params = state.params
      bias = params["Dense_0"]["bias"]
      state = state.replace(params={"Dense_0": {**params["Dense_0"], "bias": bias + 1}})
  def keyed_step(state, batch, key):  # its key reaches the update, as dropout's would
    keep = jax.random.uniform(key, batch.shape) >= 0.0
    return testing.classifier_step(state, batch * keep.astype(batch.dtype))
  step = proof.jit(keyed_step if args.key else testing.classifier_step, donate_argnums=(0,))
  drawn = proof.batches(DATASET, batch_size=4, epochs=ITERATIONS // 4) if args.data else None
  if drawn is not None and args.prefetch:
    drawn = _prefetched(drawn, args.prefetch)
  for iteration in range(int(state.step), ITERATIONS):
    batch = batch_for(iteration)
    if args.other_batches:  # its columns turned: no row of any batch_for
      batch = np.roll(batch, 1, axis=1)
    inputs = (next(drawn) if drawn else jnp.asarray(batch),)
    inputs += (proof.step_key(),) if args.key else ()
    try:
      state = step(state, *inputs)
    except KeyboardInterrupt:  # --interrupt-first: the same call again
      print(f"interrupted at iteration {iteration}", flush=True)
      state = step(state, *inputs)
    if (iteration + 1) % SEGMENT == 0:  # the state a segment ends with, once committed
      proof.wait_for_commitments()
      save(iteration, state)
      print(f"checkpoint {iteration}", flush=True)
    if iteration == args.stop_at:
      proof.wait_for_commitments()
      if args.server:
        print(f"proof {proof.proof_id}", flush=True)
      print("ready", flush=True)
      sys.stdin.read()  # killed here
    if iteration == args.finish_after:
      break
  proof.finish()
  print("finished", flush=True)


if __name__ == "__main__":
  main()
