"""The attested start: the whole initial state as the output of an exported init program.

``proof.init(model.init, key, example)`` exports ``model.init`` with
``jax.export``, runs the exported program (compiled as a verifier compiles
it) and returns its output, so the tutorial's

  params = model.init(jax.random.key(0), x)["params"]

becomes

  params = proof.init(model.init, jax.random.key(0), x)["params"]

Every PRNG key among the arguments is replaced by the proof's start key
(``proof.key()``, derived from its slot, ``zkdv.keys``): the prover does not
choose it, so it cannot grind initializations. ``TrainState.create(proof=proof,
params=params, ...)`` with params that ``proof.init`` returned extends the init
program by ``TrainState.create`` itself (``extend_init``), so the optimizer state,
the step and every added field are outputs of the same program.

Fine-tuning starts from a base checkpoint instead: ``proof.init_from(pretrained)``
exports ``init_fn(base, *args)`` (the identity by default) with the base params as
inputs whose values matter, and the record declares the base's params digest
(``base_checkpoint``, the digest ``final_params`` and measurements use), so a
reader can match it against the final params of another proof.

The ``init`` record holds the program, the opened inputs (the base params, the
key and the example arguments) and the digests of the outputs; it is written
before the first step. At the first step the committer writes a ``start`` check with the
pre-state's piece digests; a verifier replays the init program (with the
recorded inputs, with other example values, with another key) and checks that
every leaf of the first pre-state is one of its outputs (``zkdv.verify.start``).
"""

import dataclasses

import blake3
import jax

from zkdv import digest
from zkdv import errors
from zkdv import keys
from zkdv.jax import _compat
from zkdv.jax import arrays
from zkdv.jax import stablehlo
from zkdv.jax.replay import compile_program


def proof_key(seed: bytes, step: int | None, impl=None) -> jax.Array:
  """The proof's start key (``step`` None) or step ``step``'s key, of ``impl`` (the
  default PRNG implementation when None), from the proof's key seed (``zkdv.keys``).

  Example: ``proof_key(seed, 3)`` is what a PRNG-key batch leaf of step 3 must be.
  """
  template = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
  data = keys.key_array(seed, step, template.dtype, template.shape)
  return jax.random.wrap_key_data(data, impl=jax.random.key_impl(jax.random.key(0, impl=impl)))


@dataclasses.dataclass
class InitProgram:
  """An exported init program, its opened inputs and its outputs' digests."""

  blob: bytes
  record: dict
  input_bytes: list  # host copies of the inputs, to be stored as blobs
  outputs: object  # the init function's output, a pytree of the program's outputs
  init_fn: object = None  # what was exported, and its arguments (for ``extend_init``)
  args: tuple = ()
  kwargs: dict = dataclasses.field(default_factory=dict)
  base: object = None  # the base checkpoint's params (its first argument), or None


def _with_start_key(tree, seed: bytes):
  """``tree`` with every PRNG key leaf replaced by the start key of its implementation."""
  return jax.tree.map(lambda x: proof_key(seed, None, jax.random.key_impl(x))
                      if arrays.is_key(x) else x, tree)


def base_fields(base) -> dict:
  """The init record's ``base_layout`` (keypaths relative to the base) and
  ``base_checkpoint`` (its params digest, ``zkdv.digest.params_digest``'s rule) of
  a params pytree.

  Example: ``base_fields({"w": np.zeros(2, np.float32)})["base_checkpoint"]`` equals the
  ``final_params`` of a proof whose final ``state.params`` are that pytree.
  """
  flat = jax.tree_util.tree_flatten_with_path(base)[0]
  if not flat:
    raise ValueError("a base checkpoint needs at least one params array.")
  if any(arrays.is_key(x) for _, x in flat):
    raise ValueError("a base checkpoint holds params arrays, not PRNG keys: pass keys "
                     "as arguments of the init function (they become the start key).")
  values = [arrays.as_array(x) for _, x in flat]
  layouts = [arrays.layout_of(jax.tree_util.keystr(p), x) for (p, _), x in zip(flat, values)]
  checkpoint = digest.state_digest_from_leaves(
      layouts, [digest.leaf_digest(arrays.host_view(x)) for x in values])
  return {"base_layout": [l.to_record() for l in layouts], "base_checkpoint": checkpoint}


def run_init(init_fn, args: tuple, kwargs: dict, key_seed: bytes, base=None) -> InitProgram:
  """Exports ``init_fn(*args, **kwargs)`` (its PRNG keys replaced by the start key), or
  ``init_fn(base, *args, **kwargs)`` from a base checkpoint, runs the exported program,
  digests its outputs."""
  based = base_fields(base) if base is not None else {}
  args, kwargs = _with_start_key((args, kwargs), key_seed)
  full_args = args if base is None else (base, *args)
  leaves, in_tree = jax.tree.flatten((full_args, kwargs))
  leaves = [arrays.as_array(x) for x in leaves]
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      (full_args, kwargs))[0]]

  def structured_init(*flat):
    a, kw = jax.tree.unflatten(in_tree, flat)
    return init_fn(*a, **kw)

  def flat_init(*flat):
    return tuple(jax.tree.leaves(structured_init(*flat)))

  try:
    out_shape = jax.eval_shape(structured_init, *leaves)
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    exported = _compat.without_locations(
        jax.export.export(jax.jit(flat_init, keep_unused=True))(*specs))
    blob = bytes(exported.serialize())
  except Exception as e:  # jax.export raises many types; name what failed
    raise errors.ExportError(
        f"jax.export could not export the init function "
        f"{getattr(init_fn, '__qualname__', init_fn)!r}: {type(e).__name__}: {e}") from e
  try:  # a verifier refuses what this refuses (weights baked in as constants among it)
    stablehlo.check_safe(exported, stablehlo.analyze(exported))
  except stablehlo.UnsafeProgramError as e:
    raise errors.ExportError(f"the init function {getattr(init_fn, '__qualname__', init_fn)!r}"
                             f": {e}", fix="Initialize from the key: an init program may not "
                             "return weights it closes over.") from None
  outs = compile_program(jax.export.deserialize(blob))(*leaves)
  out_paths = [jax.tree_util.keystr(p) for p, _ in
               jax.tree_util.tree_flatten_with_path(out_shape)[0]]
  out_layouts = [arrays.layout_of(p, x) for p, x in zip(out_paths, outs)]
  out_digests = [digest.leaf_digest(arrays.host_view(x)) for x in outs]
  input_bytes = [arrays.host_copy(x) for x in leaves]
  program_id = blake3.blake3(blob).digest()
  record = {
      "type": "init",
      "program_id": program_id,
      "function": getattr(init_fn, "__qualname__", repr(init_fn)),
      "input_layout": [arrays.layout_of(p, x).to_record() for p, x in zip(paths, leaves)],
      "output_layout": [l.to_record() for l in out_layouts],
      "outputs": out_digests,
      "platforms": list(exported.platforms),
      **based,
  }
  return InitProgram(blob, record, input_bytes,
                     jax.tree.unflatten(jax.tree.structure(out_shape), list(outs)),
                     init_fn, args, kwargs, base)


def extend_init(init: InitProgram, part, build, key_seed: bytes) -> InitProgram | None:
  """``init`` followed by ``build(part)``, exported as one init program, where ``part`` is
  made of ``init``'s outputs (the very arrays it returned); None when it is not.

  Example: ``extend_init(init, params, lambda p: TrainState.create(params=p, ...), seed)``
  gives an init program whose outputs are the whole state.
  """
  positions = {id(x): n for n, x in enumerate(jax.tree.leaves(init.outputs))}
  leaves, tree = jax.tree.flatten(part)
  if not leaves or any(id(x) not in positions for x in leaves):
    return None
  picked = [positions[id(x)] for x in leaves]
  first = init.init_fn

  def extended(*args, **kwargs):
    outputs = jax.tree.leaves(first(*args, **kwargs))
    return build(jax.tree.unflatten(tree, [outputs[n] for n in picked]))

  extended.__qualname__ = f"{getattr(first, '__qualname__', 'init')} + start state"
  return run_init(extended, init.args, init.kwargs, key_seed, init.base)
