"""The attested start: the initial state as the output of an exported init program.

``proof.init(model.init, key, example)`` exports ``model.init`` with
``jax.export``, runs the exported program (compiled as a verifier compiles
it) and returns its output, so the tutorial's

  params = model.init(jax.random.key(0), x)["params"]

becomes

  params = proof.init(model.init, jax.random.key(0), x)["params"]

The ``init`` record holds the program, the opened inputs (the PRNG key and the
example arguments) and the digests of the outputs. At the first step the
committer writes a ``start`` check with the pre-state's leaf digests; a
verifier replays the init program bitwise and checks that every params leaf of
the first pre-state is one of its outputs.
"""

import dataclasses

import blake3
import jax

from zkdv import digest
from zkdv import errors
from zkdv.jax import _compat
from zkdv.jax import arrays
from zkdv.jax.replay import compile_program


@dataclasses.dataclass
class InitProgram:
  """An exported init program, its opened inputs and its outputs' digests."""

  blob: bytes
  record: dict
  input_bytes: list  # host copies of the inputs, to be stored as blobs
  outputs: list


def run_init(init_fn, args: tuple, kwargs: dict) -> InitProgram:
  """Exports ``init_fn(*args, **kwargs)``, runs the exported program, digests its outputs."""
  leaves, in_tree = jax.tree.flatten((args, kwargs))
  leaves = [arrays.as_array(x) for x in leaves]
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      (args, kwargs))[0]]

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
  }
  return InitProgram(blob, record, input_bytes,
                     jax.tree.unflatten(jax.tree.structure(out_shape), list(outs)))
