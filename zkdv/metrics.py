"""Step metrics: what a step returns beside the state, committed in its step record.

A ``proof.jit`` step may return other outputs beside the updated state (a
loss, an accuracy, a gradient norm). Each is committed in the step's record
under its pytree path (``"loss"``, ``"metrics.accuracy"``): a scalar as its
exact value, any other array as the BLAKE3 of its bytes. A checked step's
metrics are replayed with its post-state, so a verifier compares them bit for
bit (docs/protocol.md, "Step metrics").

Values (``encode``), chosen so every scalar round-trips exactly and a JSON
reader can show it:

* an integer or boolean scalar: its integer value;
* a finite floating scalar: its value as a float (exact: every float type of
  64 bits or fewer is a subset of float64);
* ``"inf"`` / ``"-inf"``: an infinite floating scalar;
* ``"nan:HEX"``: a NaN, with its raw bits in hex (``"nan:7fc00000"`` for
  float32's quiet NaN), so a replay is compared bit for bit here too;
* 32 bytes: the BLAKE3 of a non-scalar array's bytes (C order, little-endian).

Example::

  encode(np.float32(0.25)) == 0.25
  problems({"loss": 0.25, "accuracy": "nan:7fc00000"}) == []
  as_float("inf") == math.inf
"""

import math
import re
import struct

import numpy as np

from zkdv import digest

MAX_METRICS = 64  # metrics a step record may carry
MAX_NAME_LENGTH = 100
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/\-\[\]]*")
_NAN = re.compile(r"nan:[0-9a-f]{2,16}")
_INT_BOUND = 1 << 64  # the widest integer scalar (uint64) fits below it


def encode(array) -> int | float | str | bytes:
  """The committed value of one step output (a numpy array or scalar)."""
  array = np.asarray(array)
  if array.ndim or array.dtype.kind not in "biuf" and not _is_float(array.dtype):
    return digest.leaf_digest(array)
  if array.dtype.kind in "biu":
    return int(array)
  value = float(array)
  if math.isnan(value):
    bits = int(array.reshape(1).view(f"u{array.dtype.itemsize}")[0])
    return f"nan:{bits:0{2 * array.dtype.itemsize}x}"
  if math.isinf(value):
    return "inf" if value > 0 else "-inf"
  return value


def _is_float(dtype: np.dtype) -> bool:
  """ml_dtypes' floats (bfloat16, float8_*) are not numpy kind "f"."""
  return dtype.kind == "V" and dtype.name.startswith(("bfloat", "float"))


def valid_name(name) -> bool:
  return isinstance(name, str) and len(name) <= MAX_NAME_LENGTH and bool(NAME.fullmatch(name))


def value_problem(value) -> str | None:
  """Why ``value`` is not a committed metric value (None when it is one)."""
  if isinstance(value, bool):
    return "a boolean (booleans are committed as 0 or 1)"
  if isinstance(value, int):
    return None if -_INT_BOUND < value < _INT_BOUND else "an integer beyond 64 bits"
  if isinstance(value, float):
    return None if math.isfinite(value) else (
        "a non-finite float (committed as \"inf\", \"-inf\" or \"nan:HEX\")")
  if isinstance(value, str):
    return None if value in ("inf", "-inf") or _NAN.fullmatch(value) else (
        f"the string {value[:20]!r} (only \"inf\", \"-inf\" and \"nan:HEX\")")
  if isinstance(value, bytes):
    return None if len(value) == 32 else "bytes that are not a 32-byte digest"
  return f"a {type(value).__name__}"


def problems(metrics) -> list[str]:
  """What makes ``metrics`` (a step record's field) malformed; [] when it is well formed."""
  if not isinstance(metrics, dict):
    return [f"metrics is a {type(metrics).__name__}, not a map of name to value"]
  if len(metrics) > MAX_METRICS:
    return [f"metrics holds {len(metrics)} entries; at most {MAX_METRICS}"]
  found = []
  for name, value in metrics.items():
    if not valid_name(name):
      found.append(f"metric name {str(name)[:40]!r} is not 1-{MAX_NAME_LENGTH} characters "
                   "of letters, digits and _.:/-[]")
    elif (problem := value_problem(value)) is not None:
      found.append(f"metric {name!r} is {problem}")
  return found


def as_float(value) -> float | None:
  """The number a committed value stands for (None for a digest): for curves."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return float(value)
  if value == "inf":
    return math.inf
  if value == "-inf":
    return -math.inf
  if isinstance(value, str) and value.startswith("nan:"):
    return math.nan
  return None


def identical(a, b) -> bool:
  """Whether two committed values are the same bits (``-0.0`` is not ``0.0``)."""
  if isinstance(a, float) and isinstance(b, float):
    return struct.pack("<d", a) == struct.pack("<d", b)
  return type(a) is type(b) and a == b


def describe(value) -> str:
  """A committed value for a message: a number as written, a digest abbreviated."""
  return f"digest {value.hex()[:16]}…" if isinstance(value, bytes) else repr(value)


def output_names(paths: list[tuple]) -> list[str]:
  """Metric names for the key paths of a step's outputs beside the state.

  Each path is a tuple of keys (dict keys, attribute names, sequence indices);
  a name joins them with ``.``, dropping the top-level position when the step
  returns ``(state, outputs)``; a bare output is ``"output"`` (``outputN`` for
  the N-th of several). Characters a name may not hold become ``_``; a name
  taken already gets ``_2``, ``_3``, ... Example:
  ``output_names([(1, "loss"), (1, "metrics", "accuracy")])`` is
  ``["loss", "metrics.accuracy"]``.
  """
  drop_top = bool(paths) and all(p and isinstance(p[0], int) for p in paths) and len(
      {p[0] for p in paths}) == 1
  names = []
  for path in paths:
    parts = list(path[1:] if drop_top else path)
    if parts and isinstance(parts[0], int):
      parts[0] = f"output{parts[0]}"
    name = ".".join(str(k) for k in parts) or "output"
    name = re.sub(r"[^A-Za-z0-9_.:/\-\[\]]", "_", name)
    name = ("_" + name if not NAME.fullmatch(name) else name)[:MAX_NAME_LENGTH - 4]
    unique, n = name, 1
    while unique in names:
      n += 1
      unique = f"{name}_{n}"
    names.append(unique)
  return names
