"""Does the update read the batch? A replay with another batch must change the params.

A step of each challenged segment, drawn from the segment's challenge
(``zkdv.challenge.tested_step``: not one the program can expect, such as the
segment's first), is replayed again from the state before it with other batches:
the segment's other opened batches whose every row leaf holds other rows (real data,
in an order drawn from the challenged step's record id: a program cannot tell them
from its committed batches by how they look, as it could a rescaled one; where the
segment has none, the verifier adds other update checks' batches), or, where none
does, the tested batch with its rows perturbed (each row leaf's elements
resampled, with replacement, from its own elements, and a floating leaf's elements
each scaled by a factor in [0.5, 1.5): labels and token ids stay in their domain, sums
and means change). PRNG-key and scalar leaves stay the step's own either way: a key,
step number or learning rate is not data, and an update moved by them alone reads no
batch (a batch of them alone is undecided). Every params leaf the step trains (one that
either replay changes) must come out different: a leaf equal in every replay ignores
the batch, whatever the program's dataflow says (``0 * x``, ``x - x`` and
``where(False, x, c)`` all read ``x`` on paper and not at all in value). A step that
changes no params leaf trains nothing and fails too.

What it shows is that the batch changes the params, not how much nor how: a program
written against the test (one that recognizes its own committed batches by their
step, or lets the batch move only one element of each params leaf, or the last bits of
params it carries as constants) passes it. Only a pinned program (a benchmark's
``allowed_programs``) rules that out.

Example::

  draws = other_batches(program.batch, batches, tested, seed_of(step.record_id))
  problem = measure(program, batches, tested, seed, before, honest, replay)  # None: reads it
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


def perturbed_batch(layouts, batch, seed: bytes, draw: int = 0,
                    leaves=None) -> list[np.ndarray]:
  """``batch`` (host arrays, one per layout) with its leaves ``leaves`` (default: every one
  but PRNG keys) perturbed from ``seed`` (the ``draw``-th perturbation), the others as
  they are.

  Example: ``perturbed_batch(program.batch, [np.arange(4)], seed)`` is one leaf of four
  values drawn from 0..3.
  """
  if leaves is None:
    leaves = [i for i, l in enumerate(layouts) if l.key_impl is None]
  return [_perturbed_leaf(np.asarray(a), "float" in l.dtype, seed, i, draw) if i in leaves
          else a for i, (a, l) in enumerate(zip(batch, layouts))]


def row_leaves(layouts) -> list[int]:
  """The batch leaves that hold data rows: not a PRNG key, a scalar or an empty leaf (a
  step's key, step number or learning rate is not data another batch would change)."""
  return [i for i, l in enumerate(layouts)
          if l.key_impl is None and l.logical_ndim >= 1 and l.nbytes]


def _rows(array: np.ndarray) -> list[bytes]:
  """A leaf's rows (its leading axis) as sorted byte strings."""
  array = np.ascontiguousarray(array)
  return sorted(np.frombuffer(array.tobytes(), f"V{array.nbytes // array.shape[0]}").tolist())


def other_batches(layouts, batches: list, tested: int, seed: bytes) -> list[list]:
  """The batches of ``batches`` (a segment's opened batches) whose every row leaf holds
  other rows than batch ``tested``'s (not the same rows reordered), each with batch
  ``tested``'s other leaves (PRNG keys, scalars), in an order drawn from ``seed``; at most
  ``MAX_DRAWS``. A batch that shares a row leaf with the tested one is not drawn: a params
  leaf that reads only that leaf would come out the same, ignoring nothing.

  Example: with ``batches`` ``[a, b, a]`` and ``tested`` 0, ``[b]``.
  """
  own, data = batches[tested], row_leaves(layouts)
  rows = {i: _rows(own[i]) for i in data}
  others = [b for n, b in enumerate(batches)
            if n != tested and data and all(_rows(b[i]) != rows[i] for i in data)]
  rng = np.random.Generator(np.random.PCG64(
      int.from_bytes(blake3.blake3(seed + b"other batches").digest(8), "little")))
  return [[others[n][i] if i in data else own[i] for i in range(len(layouts))]
          for n in rng.permutation(len(others))[:MAX_DRAWS]]


def same_bytes(a, b) -> bool:
  a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
  return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


OTHER_STEPS, PERTURBED = "other steps' batches", "perturbed batches"
_ONE = {OTHER_STEPS: "other step's batch", PERTURBED: "perturbed batch"}


def counted(n: int, drawn: str) -> str:
  """``n`` batches of kind ``drawn``, e.g. "1 other step's batch", "16 perturbed batches"."""
  return f"{n} {_ONE[drawn] if n == 1 else drawn}"


# The prefix of ``batch_ignored``'s answer when the test could not decide.
UNDECIDED = "could not be shown to read the batch: "
TRAINS_NOTHING = "the step changes no params leaf"


def _sign_like(before, honest) -> bool:
  """Whether the honest update moved every changed element by one magnitude (a sign-based
  update such as Lion's): a small leaf's signs may survive every perturbation."""
  delta = np.abs(np.asarray(honest, np.float64) - np.asarray(before, np.float64)).reshape(-1)
  delta = delta[delta > 0]
  return delta.size > 0 and bool(np.all(np.abs(delta - delta[0]) <= 1e-3 * delta[0]))


def batch_ignored(program, before: list, honest: list, perturbed: list,
                  drawn: str = PERTURBED) -> str | None:
  """Why the step ignores its batch, or None when every trained params leaf reads it; an
  answer starting with ``UNDECIDED`` when a sign-based update left a leaf unchanged.

  ``before``/``honest``: the params leaves (in ``program.params_leaves`` order) before the
  step and after it with the committed batch; ``perturbed``: after it with each other
  batch drawn so far (``drawn`` says which kind, e.g. "other steps' batches").
  """
  trained = [n for n, b in enumerate(before)
             if not all(same_bytes(b, after[n]) for after in (honest, *perturbed))]
  if not trained:
    return f"{TRAINS_NOTHING}, with the committed batch or another one: it trains nothing"
  for n in trained:
    if all(same_bytes(honest[n], after[n]) for after in perturbed):
      path = program.state[program.params_leaves[n]].path
      if _sign_like(before[n], honest[n]):
        return (f"{UNDECIDED}params leaf {path} moved every element by one step size (a "
                "sign-based update) and came out the same with "
                f"{counted(len(perturbed), drawn)}")
      return (f"params leaf {path} comes out bit for bit the same with "
              f"{counted(len(perturbed), drawn)}: the update ignores the batch")
  return None


def measure(program, batches: list, tested: int, seed: bytes, before, honest, replay,
            honest_state=None, more=None) -> tuple[str | None, str]:
  """(``batch_ignored``, the batches drawn: ``OTHER_STEPS`` or ``PERTURBED``) after
  replaying step ``tested`` of a segment (``batches``: its opened batches) with up to
  ``MAX_DRAWS`` other batches (``replay(batch)``: the params leaves after the step), drawn
  while a trained leaf has not changed: the segment's other batches of other rows, else
  those among ``more()`` (other checks' batches), else ones with the tested batch's rows
  perturbed. A batch without data rows (PRNG keys and
  scalars only) is undecided: nothing in it is data another batch would change. So is a
  step that changes no params leaf while the rest of its state changes with the batch
  (``replay(batch, whole=True)`` against ``honest_state()``): an update accumulated over
  steps (``optax.MultiSteps``) applies on other steps."""
  layouts, data = program.batch, row_leaves(program.batch)
  others = other_batches(layouts, batches, tested, seed)
  if not others and data and more is not None:
    others = other_batches(layouts, batches + more(), tested, seed)
  drawn = OTHER_STEPS if others else PERTURBED
  if not data:
    return (f"{UNDECIDED}the batch holds no data rows (PRNG keys and scalars only), nothing "
            "another batch would change"), drawn
  draws = iter(others) if others else (
      perturbed_batch(layouts, batches[tested], seed, draw, data) for draw in range(MAX_DRAWS))
  perturbed = []
  problem = batch = None
  for batch in draws:
    perturbed.append(replay(batch))
    problem = batch_ignored(program, before, honest, perturbed, drawn)
    if problem is None or problem.startswith(TRAINS_NOTHING):
      break
  if problem and problem.startswith(TRAINS_NOTHING) and honest_state is not None and (
      _state_reads(program, honest_state(), replay(batch, whole=True))):
    problem = (f"{UNDECIDED}the step changes no params leaf, and the rest of its state "
               f"changes with {counted(1, drawn)} (an update accumulated over steps, say)")
  return problem, drawn


def _state_reads(program, honest: list, other: list) -> bool:
  """Whether a state leaf other than the params comes out different with another batch."""
  params = set(program.params_leaves)
  return any(not same_bytes(a, b) for i, (a, b) in enumerate(zip(honest, other))
             if i not in params)
