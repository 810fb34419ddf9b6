"""Shared fixtures of the test suites: small models, batches and proofs."""

import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import struct

import zkdv

TUTORIAL_BATCH = np.asarray(
    [[0, 0, 0, 1, 0], [0, 1, 0, 1, 0], [1, 0, 1, 0, 1], [1, 1, 1, 0, 1]],
    dtype=np.uint32)


class TinyClassifier(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    return nn.Dense(2)(tokens.astype(jnp.float32))


class MLP(nn.Module):
  width: int = 512

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.width)(x))
    x = nn.relu(nn.Dense(self.width)(x))
    return nn.Dense(10)(x)


class CNN(nn.Module):
  """Conv + BatchNorm + dropout: needs batch_stats and a dropout key."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu(x)
    x = nn.Dropout(0.2, deterministic=not train)(x)
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(10)(x)


class BatchStatsState(zkdv.jax.contrib.TrainState):
  batch_stats: Any = struct.field(pytree_node=True)


OPTIMIZERS = {
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lion": lambda: optax.lion(1e-4),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                      optax.adamw(1e-3)),
}


def new_proof(name: str, update_p: float = 1.0, state_p: float = 0.0,
              folder: pathlib.Path | None = None, **config) -> zkdv.jax.ZKDV:
  folder = folder or pathlib.Path(tempfile.mkdtemp(prefix="zkdv-test-")) / name
  return zkdv.jax.ZKDV(name, zkdv.ZKDVConfig(
      sampling_policy=zkdv.SamplingPolicy(update_check_probability=update_p,
                                          state_check_probability=state_p),
      output_dir=folder, **config))


def wide_rows_transcript(steps: int = 2, **proof_config) -> pathlib.Path:
  """The tutorial's classifier on rows wider than a record's byte strings (1 MiB + 4 bytes:
  the tutorial's 5 columns, then zeros), every step probed: its probed rows travel as
  chunks (``zkdv.records.probe_entry``)."""
  proof = new_proof("wide-rows", update_p=1.0, **proof_config)
  proof.start(probe_ratio=0.5)
  state = classifier_state(proof)
  train_step = proof.jit(classifier_step, donate_argnums=0)
  batch = np.zeros((2, (1 << 18) + 1), np.uint32)
  batch[:, :5] = TUTORIAL_BATCH[:2]
  for _ in range(steps):
    state = train_step(state, jnp.asarray(batch))
  return proof.finish()


def classifier_state(proof, tx=None, **create_kwargs):
  model = TinyClassifier()
  params = model.init(jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
  return zkdv.jax.contrib.TrainState.create(
      proof=proof, apply_fn=model.apply, params=params,
      tx=tx or optax.adam(1e-2), **create_kwargs)


def classifier_loss(state, batch, params=None):
  logits = state.apply_fn({"params": state.params if params is None else params},
                          batch[:, :4])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch[:, 4].astype(jnp.int32)).mean()


def classifier_step(state, batch):
  grads = jax.grad(lambda p: classifier_loss(state, batch, p))(state.params)
  return state.apply_gradients(grads=grads)


@jax.custom_jvp
def opaque_kernel(x):
  """An identity through a host callback: runs under jit, cannot be exported."""
  return jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


@opaque_kernel.defjvp
def _opaque_kernel_jvp(primals, tangents):
  return opaque_kernel(primals[0]), tangents[0]


def records_of(path, kind=None) -> list[dict]:
  from zkdv import transcript  # pylint: disable=g-import-not-at-top
  recs = [r.record for r in transcript.read_transcript(path).records]
  return [r for r in recs if kind is None or r["type"] == kind]


def assert_bitwise_equal(ours, theirs) -> None:
  """Every leaf of two pytrees has the same structure, dtype, shape and bytes.

  >>> assert_bitwise_equal({"w": np.float32([1.0])}, {"w": np.float32([1.0])})
  """
  ours_leaves, ours_tree = jax.tree.flatten(ours)
  theirs_leaves, theirs_tree = jax.tree.flatten(theirs)
  if ours_tree != theirs_tree:
    raise AssertionError(f"structures differ: {ours_tree} != {theirs_tree}")
  for path_and_a, b in zip(jax.tree_util.tree_flatten_with_path(ours)[0], theirs_leaves):
    path, a = path_and_a
    a, b = np.asarray(a), np.asarray(b)
    where = jax.tree_util.keystr(path)
    if (a.dtype, a.shape) != (b.dtype, b.shape):
      raise AssertionError(f"{where}: {a.dtype}{a.shape} != {b.dtype}{b.shape}")
    if a.tobytes() != b.tobytes():
      raise AssertionError(f"{where}: the bytes differ")


class ClientSays(logging.Handler):
  """Sets ``event`` when the ``dvbench.client`` logger says something matching ``pattern``.

  >>> said = ClientSays("cannot reach"); logging.getLogger("dvbench.client").addHandler(said)
  """

  def __init__(self, pattern: str):
    super().__init__(logging.INFO)
    self.pattern, self.event, self.said = re.compile(pattern), threading.Event(), []

  def emit(self, record):
    if self.pattern.search(record.getMessage()):
      self.said.append(record.getMessage())
      self.event.set()


def zkdv_verify(folder, *args) -> tuple[int, dict]:
  """``zkdv verify FOLDER --json ARGS`` in a process of its own: (exit code, report)."""
  result = subprocess.run([sys.executable, "-m", "zkdv.cli", "verify", str(folder), "--json",
                           *args], cwd=pathlib.Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True)
  return result.returncode, json.loads(result.stdout)


def wait_until(predicate, timeout=60.0, every=0.02):
  """``predicate()``'s first truthy value, polled every ``every`` s for at most ``timeout`` s."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    value = predicate()
    if value:
      return value
    time.sleep(every)
  raise AssertionError("condition not reached in time")


def children(pid: int) -> dict[int, str]:
  """pid -> command line of the live child processes of ``pid``."""
  found = {}
  for entry in pathlib.Path("/proc").iterdir():
    try:
      stat = (entry / "stat").read_text()
      if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
        found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, ValueError):
      continue
  return found


def ingest_children(pid: int) -> list[int]:
  """The ingestion processes of the ``dvbench serve`` process ``pid``."""
  return sorted(p for p, command in children(pid).items() if "multiprocessing.spawn" in command)


def exited(pid: int) -> bool:
  """Whether every thread of ``pid`` has exited (a zombie not yet reaped counts)."""
  try:
    state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state == "Z" and len(os.listdir(f"/proc/{pid}/task")) == 1
  except FileNotFoundError:
    return True
