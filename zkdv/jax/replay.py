"""Compiling and comparing exported update programs.

Production and replay compile the *same* serialized program through
``compile_program``, so on one platform their results are bitwise equal. A
verifier loads an untrusted program with ``load_program``: it is screened
(``zkdv.jax.stablehlo.check_safe``) before anything compiles it, and only
compiler options on ``REPLAY_COMPILER_OPTIONS`` are kept.

Example::

  exported, summary = load_program(blob)
  run = compile_program(exported, compiler_options=replay_compiler_options(recorded)[0])
  outputs = run(*inputs)
"""

import socket
from collections.abc import Sequence

import jax
import numpy as np

from zkdv import errors
from zkdv.config import Tolerance
from zkdv.digest import LeafLayout, byte_view
from zkdv.jax import _compat
from zkdv.jax import stablehlo

# Compiler options a transcript may carry into a replay: flags that change
# numerics (so a program compiled with them replays bitwise only with them),
# each a boolean. Every other option (dump folders, autotuning caches, ...) is
# ignored: nothing a transcript says may make the verifier write or read files.
REPLAY_COMPILER_OPTIONS = frozenset({
    "xla_cpu_enable_fast_math", "xla_cpu_fast_math_honor_nans",
    "xla_cpu_fast_math_honor_infs", "xla_cpu_fast_math_honor_division",
    "xla_cpu_fast_math_honor_functions", "xla_cpu_enable_fast_min_max",
    "xla_gpu_enable_fast_min_max", "xla_allow_excess_precision",
})
_BOOLEANS = {"true": True, "false": False}


def replay_mesh(exported: jax.export.Exported) -> jax.sharding.Mesh | None:
  """A mesh of local devices shaped like the one a multi-device program was exported with.

  None when the program names no such mesh. Raises ReplayError when this
  machine has fewer devices than the program needs.
  """
  needed, devices = exported.nr_devices, jax.devices()
  if len(devices) < needed:
    raise errors.ReplayError(
        f"the update program was exported for {needed} devices and this machine has "
        f"{len(devices)} {devices[0].platform} devices: replay it where {needed} are "
        f"available (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={needed} "
        "before JAX starts).")
  shape = _compat.exported_abstract_mesh(exported)
  if shape is None:
    return None  # the program names no mesh at its boundary
  return jax.sharding.Mesh(np.array(devices[:needed]).reshape(shape.axis_sizes),
                           shape.axis_names, axis_types=shape.axis_types)


def collectives() -> str:
  """The collectives this process runs across devices, as programs record them.

  On CPU, in-process collectives and cross-process ones (gloo, mpi) reduce in
  different orders, so a program replays bitwise only with the kind it ran with.
  """
  if jax.devices()[0].platform != "cpu":
    return "default"
  if _compat.distributed_client() is None:
    return "in-process"
  return jax.config.jax_cpu_collectives_implementation


def check_collectives(recorded: str | None) -> None:
  """Raises ReplayError if this process cannot replay a program that ran with ``recorded``."""
  if recorded is None or recorded == collectives():
    return
  raise errors.ReplayError(
      f"the update program ran with {recorded} CPU collectives and this process runs "
      f"{collectives()} ones, which sum in another order. `zkdv verify` sets this up "
      "itself; in Python, call zkdv.jax.replay.use_cpu_collectives("
      f"{recorded!r}) before the first JAX computation.")


def use_cpu_collectives(name: str) -> None:
  """Makes this single process run ``name`` CPU collectives ("gloo"/"mpi"), as a
  multi-process run did, by starting a one-process ``jax.distributed``.

  Call it before JAX runs its first computation.
  """
  if _compat.distributed_client() is not None:  # already in a distributed run
    return
  jax.config.update("jax_cpu_collectives_implementation", name)
  with socket.socket() as probe:  # a free loopback port for the coordinator
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0)


def load_program(blob: bytes) -> tuple[jax.export.Exported, stablehlo.ModuleSummary]:
  """Deserializes an untrusted program and screens it before it may compile.

  Raises UnsafeProgramError for a blob that does not deserialize, custom calls
  off the allow-list, host callbacks or transfers, and side effects.
  """
  try:
    exported = jax.export.deserialize(bytearray(blob))
  except Exception as e:  # a malformed blob is a refusal, never a crash
    if errors.out_of_memory(e):
      raise  # a fault of this machine, not of the blob
    raise stablehlo.UnsafeProgramError(
        f"the program blob does not deserialize: {type(e).__name__}") from None
  summary = stablehlo.analyze(exported)
  stablehlo.check_safe(exported, summary)
  return exported, summary


def replay_compiler_options(recorded) -> tuple[dict, list[str]]:
  """(the options a replay uses, the names it ignores) of a program record's options.

  Example: ``{"xla_cpu_enable_fast_math": "False", "xla_dump_to": "/x"}`` gives
  ``({"xla_cpu_enable_fast_math": False}, ["xla_dump_to"])``.
  """
  if not isinstance(recorded, dict):
    return {}, [] if recorded is None else ["compiler_options"]
  kept, ignored = {}, []
  for name, value in recorded.items():
    flag = _BOOLEANS.get(str(value).lower())
    if name in REPLAY_COMPILER_OPTIONS and flag is not None:
      kept[name] = flag
    else:
      ignored.append(str(name))
  return kept, sorted(ignored)


def placement(jit_options: dict) -> dict:
  """``jit_options`` with ``device``/``backend`` (deprecated on ``jax.jit``) given
  as shardings: the computation runs on that device (the backend's first local
  one) and its inputs move there, as they did with those arguments.

  Example: ``placement({"backend": "cpu"})`` gives
  ``{"in_shardings": s, "out_shardings": s}`` with
  ``s = SingleDeviceSharding(jax.local_devices(backend="cpu")[0])``.
  """
  options = dict(jit_options)
  device, backend = options.pop("device", None), options.pop("backend", None)
  if device is None and backend is None:
    return options
  if device is not None and backend is not None:
    raise ValueError("pass either device or backend to jit, not both.")
  if "in_shardings" in options or "out_shardings" in options:
    raise ValueError("pass either device/backend or in_shardings/out_shardings to jit.")
  sharding = jax.sharding.SingleDeviceSharding(
      device if device is not None else jax.local_devices(backend=backend)[0])
  return {**options, "in_shardings": sharding, "out_shardings": sharding}


def compile_program(exported: jax.export.Exported, *, donate_argnums=(),
                    compiler_options=None, **jit_options):
  """A jitted callable running ``exported`` (flat arguments, flat results).

  A program exported for several devices runs with its own shardings on a mesh
  of as many local devices, unless the caller passes shardings (or a ``device``
  or ``backend``, see ``placement``).
  """
  jit_options = placement(jit_options)
  if exported.nr_devices > 1 and "in_shardings" not in jit_options:
    mesh = replay_mesh(exported)
    if mesh is not None:
      in_shardings = exported.in_shardings_jax(mesh)
      out_shardings = exported.out_shardings_jax(mesh)
    else:  # no mesh at the boundary (e.g. shard_map inside): replicate over the devices
      replicated = jax.sharding.NamedSharding(
          jax.sharding.Mesh(np.array(jax.devices()[:exported.nr_devices]), ("devices",)),
          jax.sharding.PartitionSpec())
      in_shardings = (replicated,) * len(exported.in_avals)
      out_shardings = (replicated,) * len(exported.out_avals)
    jit_options = {**jit_options, "in_shardings": in_shardings,
                   "out_shardings": out_shardings}

  def run(*args):
    return exported.call(*args)
  run.__name__ = f"zkdv_update_{exported.fun_name}"
  return jax.jit(run, donate_argnums=tuple(donate_argnums),
                 compiler_options=compiler_options, **jit_options)


def _ordered_int(a: np.ndarray) -> np.ndarray:
  """Maps floats to integers whose order is the floats' order (for ulps)."""
  bits = a.view(np.dtype(f"i{a.dtype.itemsize}")).astype(np.int64)
  magnitude_mask = (1 << (8 * a.dtype.itemsize - 1)) - 1
  return np.where(bits < 0, -(bits & magnitude_mask), bits)


def _tolerant(layout: LeafLayout, array: np.ndarray) -> bool:
  """Whether a leaf may differ within the tolerance (equivalent mode): floating point,
  real or complex (each part); integers, booleans and PRNG keys must be equal."""
  dtype = array.dtype
  return layout.key_impl is None and (np.issubdtype(dtype, np.inexact)
                                      or "float" in dtype.name)  # ml_dtypes' bfloat16, fp8


def compare(layouts: Sequence[LeafLayout], actual: Sequence[np.ndarray],
            expected: Sequence[np.ndarray], *, exact: bool,
            tolerance: Tolerance) -> dict:
  """The check result: equality, mismatching leaves and max abs/rel/ulp error."""
  mismatched, max_abs, max_rel, max_ulp = [], 0.0, 0.0, 0
  for layout, a, e in zip(layouts, actual, expected, strict=True):
    a, e = np.asarray(a), np.asarray(e)
    same_bytes = (a.dtype == e.dtype and a.shape == e.shape
                  and np.array_equal(byte_view(a), byte_view(e)))
    within = same_bytes
    if not same_bytes and a.shape == e.shape and a.dtype == e.dtype:
      tolerant = _tolerant(layout, a)
      if np.iscomplexobj(a):  # each part on its own
        a, e = np.stack([a.real, a.imag]), np.stack([e.real, e.imag])
      af, ef = a.astype(np.float64), e.astype(np.float64)
      abs_err = np.abs(af - ef)
      with np.errstate(divide="ignore", invalid="ignore"):
        rel_err = np.where(ef != 0, abs_err / np.abs(ef), abs_err)
      max_abs = max(max_abs, float(np.nanmax(abs_err, initial=0.0)))
      max_rel = max(max_rel, float(np.nanmax(rel_err, initial=0.0)))
      if tolerant:
        ulp = np.abs(_ordered_int(a) - _ordered_int(e))
        max_ulp = max(max_ulp, int(ulp.max(initial=0)))
        with np.errstate(invalid="ignore"):
          close = abs_err <= tolerance.atol + tolerance.rtol * np.abs(ef)
        # As numpy.isclose: an infinity is close only to itself, NaN only to NaN.
        finite = np.isfinite(af) & np.isfinite(ef)
        within = bool(np.all(np.where(finite, close,
                                      (af == ef) | (np.isnan(af) & np.isnan(ef)))))
    if not (same_bytes if exact else within):
      mismatched.append(layout.path)
  return {
      "mode": "exact" if exact else "equivalent",
      "equal": not mismatched,
      "mismatched_leaves": mismatched,
      "max_abs_error": max_abs,
      "max_rel_error": max_rel,
      "max_ulp_error": max_ulp,
  }
