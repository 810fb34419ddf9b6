"""Shared pieces of the benchmarks: models, timing and the result table."""

import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax.training import train_state

import zkdv


class MLP(nn.Module):
  """784 -> 1024 x 4 -> 10, about 4 M parameters."""

  @nn.compact
  def __call__(self, x):
    for _ in range(4):
      x = nn.relu(nn.Dense(1024)(x))
    return nn.Dense(10)(x)


class TinyClassifier(nn.Module):
  """The tutorial's model."""

  @nn.compact
  def __call__(self, tokens):
    return nn.Dense(2)(tokens.astype(jnp.float32))


def mlp_workload(batch_size: int = 1024):
  """(model, params, batch, loss_fn) for the MLP on random data."""
  model = MLP()
  params = model.init(jax.random.key(0), jnp.ones((1, 784)))["params"]
  x = jax.random.normal(jax.random.key(1), (batch_size, 784))
  y = jax.random.randint(jax.random.key(2), (batch_size,), 0, 10)
  return model, params, (x, y)


def tutorial_workload():
  model = TinyClassifier()
  params = model.init(jax.random.key(0), jnp.ones((1, 4), jnp.uint32))["params"]
  batch = jnp.asarray([[0, 0, 0, 1, 0], [0, 1, 0, 1, 0], [1, 0, 1, 0, 1], [1, 1, 1, 0, 1]],
                      jnp.uint32)
  return model, params, (batch[:, :4], batch[:, 4].astype(jnp.int32))


def train_step(state, x, y):
  """The step every benchmark trains: softmax cross-entropy and apply_gradients."""
  def loss(params):
    logits = state.apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return state.apply_gradients(grads=jax.grad(loss)(state.params))


class TrainRow:
  """A benchmark row's state and step: ``jax.jit`` with Flax's TrainState when ``proof``
  is None, else ``proof.jit`` with ZKDV's (``proof`` already started); the state is
  donated to each step unless ``donate`` is False.

  Example: ``row = TrainRow(model, params, batch); row.step(); row.settle()``
  """

  def __init__(self, model, params, batch, proof=None, donate: bool = True):
    self.batch, self.proof = batch, proof
    options = {"donate_argnums": 0} if donate else {}
    if proof is None:
      self.state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                                 tx=optax.adam(1e-3))
      self._step = jax.jit(train_step, **options)
    else:
      self.state = zkdv.jax.contrib.TrainState.create(
          proof=proof, apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
      self._step = proof.jit(train_step, **options)

  def step(self):
    self.state = self._step(self.state, *self.batch)
    return self.state

  def settle(self):
    """Waits for the last step and, with a proof, for every commitment and check."""
    jax.block_until_ready(self.state)
    if self.proof is not None:
      self.proof.wait_for_commitments()


def timed(fn: Callable[[], object]) -> float:
  """Seconds one call takes, results ready."""
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def alternate(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
  """Times each run ``repeats`` times, interleaved A, B, C, A, B, C, ..."""
  times = {name: [] for name in runs}
  for _ in range(repeats):
    for name, fn in runs.items():
      times[name].append(timed(fn))
  return times


def median(xs: Sequence[float]) -> float:
  return statistics.median(xs)


def median_interval(xs: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
  """(low, high, coverage): order statistics k and n + 1 - k of ``xs``, an interval that
  holds the median of what ``xs`` samples with probability ``coverage``, whatever its
  distribution; k is the largest for which ``coverage`` is at least ``confidence``. Too few
  values for ``confidence`` give their whole range and the smaller coverage it has.

  Example: ``median_interval(range(1, 21))`` is ``(6, 15, 0.959)`` (rounded).
  """
  values, n = sorted(xs), len(xs)
  if not n:
    raise ValueError("median_interval: no values.")

  def coverage(k: int) -> float:  # 1 - 2 P(Binomial(n, 1/2) < k)
    return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n

  k = 1
  while k < (n + 1) // 2 and coverage(k + 1) >= confidence:
    k += 1
  return values[k - 1], values[n - k], coverage(k)


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence]) -> str:
  """Prints (and returns) a Markdown table."""
  cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  lines = [f"### {title}", ""]
  for n, r in enumerate(cells):
    lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    if n == 0:
      lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
  text = "\n".join(lines)
  print(text, flush=True)
  return text


def peak_rss_mb(module: str, runner: str, steps: int) -> float:
  """Peak RSS (VmHWM) of a fresh process that builds ``runner`` (an expression over
  ``benchmarks.<module>`` and ``folder``, a scratch folder removed afterwards), runs
  ``steps`` of its steps and lets its commitments settle.

  Example: ``peak_rss_mb("overhead", "overhead.make_runner('jax.jit', 'mlp', folder)", 60)``.
  """
  # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork/exec.
  with tempfile.TemporaryDirectory(prefix=f"zkdv-{module}-rss-") as folder:
    code = (f"import jax; from benchmarks import {module}; folder = {folder!r}\n"
            f"r = {runner}\n"
            f"for _ in range({steps}): jax.block_until_ready(r.step())\n"
            f"r.settle(); print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
  return int(out.stdout.split()[-1]) / 1024
