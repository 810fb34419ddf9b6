"""Does the update read the batch? A replay with a perturbed batch must change the params.

A step of each challenged segment, drawn from the segment's challenge
(``zkdv.challenge.tested_step``: not one the program can expect, such as the
segment's first), is replayed twice from the state before it: with
the committed batch and with a perturbed one (each batch leaf's elements
resampled, with replacement, from its own elements, and a floating leaf's
elements each scaled by a factor in [0.5, 1.5), by draws seeded from the
challenged step's record id, so the prover cannot know them when it commits:
labels and token ids stay in their domain, sums and means change). Every params
leaf the step trains (one that either replay changes) must come out different: a
leaf equal in both replays ignores the batch, whatever the program's dataflow says
(``0 * x``, ``x - x`` and ``where(False, x, c)`` all read ``x`` on paper and not
at all in value). A step that changes no params leaf trains nothing and fails too.

Example::

  batch = perturbed_batch(program.batch, opened[0], seed_of(step.record_id))
  problem = batch_ignored(program, before, honest, perturbed)  # None: sensitive
"""

import blake3
import numpy as np

_SEED_CONTEXT = b"zkdv batch perturbation v1"
# Perturbed replays made before a leaf that never changes is named as ignoring the batch.
MAX_DRAWS = 16


def seed_of(record_id: bytes) -> bytes:
  """The perturbation seed of a challenged step, from its record id (bound to the chain)."""
  return blake3.blake3(_SEED_CONTEXT + record_id).digest()


def _perturbed_leaf(array: np.ndarray, floating: bool, seed: bytes, index: int,
                    draw: int) -> np.ndarray:
  """``array``'s elements drawn again from themselves with replacement (``floating``: each
  also scaled); if that changes no byte (all elements equal), its lowest bit flipped in
  every element."""
  flat = np.ascontiguousarray(array).reshape(-1)
  rng = np.random.Generator(np.random.PCG64(
      int.from_bytes(blake3.blake3(seed + index.to_bytes(4, "little")
                                   + draw.to_bytes(4, "little")).digest(8), "little")))
  shuffled = flat[rng.integers(0, flat.size, flat.size)] if flat.size > 1 else flat.copy()
  if floating:
    scale = rng.uniform(0.5, 1.5, flat.size)
    shuffled = (shuffled.astype(np.float64) * scale).astype(flat.dtype)
  if shuffled.tobytes() == flat.tobytes():
    bits = shuffled.view(np.dtype(f"u{shuffled.dtype.itemsize}")) ^ 1
    shuffled = bits.view(flat.dtype)
  return shuffled.reshape(array.shape)


def perturbed_batch(layouts, batch, seed: bytes, draw: int = 0) -> list[np.ndarray]:
  """Every leaf of ``batch`` (host arrays, one per layout) perturbed from ``seed`` (the
  ``draw``-th perturbation).

  Example: ``perturbed_batch(program.batch, [np.arange(4)], seed)`` is one leaf of four
  values drawn from 0..3.
  """
  return [_perturbed_leaf(np.asarray(a), l.key_impl is None and "float" in l.dtype, seed, i,
                          draw) for i, (a, l) in enumerate(zip(batch, layouts))]


def same_bytes(a, b) -> bool:
  a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
  return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# The prefix of ``batch_ignored``'s answer when the test could not decide.
UNDECIDED = "could not be shown to read the batch: "


def _sign_like(before, honest) -> bool:
  """Whether the honest update moved every changed element by one magnitude (a sign-based
  update such as Lion's): a small leaf's signs may survive every perturbation."""
  delta = np.abs(np.asarray(honest, np.float64) - np.asarray(before, np.float64)).reshape(-1)
  delta = delta[delta > 0]
  return delta.size > 0 and bool(np.all(np.abs(delta - delta[0]) <= 1e-3 * delta[0]))


def batch_ignored(program, before: list, honest: list, perturbed: list) -> str | None:
  """Why the step ignores its batch, or None when every trained params leaf reads it; an
  answer starting with ``UNDECIDED`` when a sign-based update left a leaf unchanged.

  ``before``/``honest``: the params leaves (in ``program.params_leaves`` order) before the
  step and after it with the committed batch; ``perturbed``: after it with each perturbed
  batch drawn so far.
  """
  trained = [n for n, b in enumerate(before)
             if not all(same_bytes(b, after[n]) for after in (honest, *perturbed))]
  if not trained:
    return ("the step changes no params leaf, with the committed batch or a perturbed one: "
            "it trains nothing")
  for n in trained:
    if all(same_bytes(honest[n], after[n]) for after in perturbed):
      path = program.state[program.params_leaves[n]].path
      if _sign_like(before[n], honest[n]):
        return (f"{UNDECIDED}params leaf {path} moved every element by one step size (a "
                f"sign-based update) and came out the same with {len(perturbed)} perturbed "
                "batches")
      return (f"params leaf {path} comes out bit for bit the same with {len(perturbed)} "
              "perturbed batches: the update ignores the batch")
  return None


def measure(program, batch, seed: bytes, before, honest, replay) -> str | None:
  """``batch_ignored`` after up to ``MAX_DRAWS`` perturbed replays (``replay(batch)``: the
  params leaves after the step), drawn while a trained leaf has not changed."""
  perturbed = []
  for draw in range(MAX_DRAWS):
    perturbed.append(replay(perturbed_batch(program.batch, batch, seed, draw)))
    problem = batch_ignored(program, before, honest, perturbed)
    if problem is None or problem.startswith("the step changes no params leaf"):
      return problem
  return problem
