"""Scoring arithmetic shared by the client, the workers and the server: shards of an
evaluation set and the aggregate of outputs.

A submission's rows are scored in shards (row ranges, whole evaluation batches),
each a worker job; once every shard's per-row outputs are in, the server
computes the aggregate itself. Only numpy here: the web process and the store
use it without loading JAX.

Example::

  shard_ranges(rows=10, batch_rows=3, max_shard_rows=6)  # [(0, 6), (6, 4)]
  aggregate("mean", np.array([1.0, 0.0]))                # 0.5
"""

import numpy as np

AGGREGATES = {"mean": np.mean, "sum": np.sum}
SHARD_JOB = "score-shard"  # the job kind of one shard
# A shard, and its submission, the server gave up scoring (out of time or killed, each
# attempt): the server's fault, not the entry's; submitting the proof again scores it again.
UNSCORED = "unscored"
OUTPUT_DTYPE = np.dtype("<f8")  # per-row outputs as workers return them
OUTPUTS_FILE = "outputs.f64"  # where a scoring child writes them


def shard_ranges(rows: int, batch_rows: int, max_shard_rows: int) -> list[tuple[int, int]]:
  """(first row, rows) of each shard: whole batches of ``batch_rows``, at most
  ``max_shard_rows`` rows (but at least one batch) each, covering ``rows``."""
  per_shard = max(batch_rows, max_shard_rows // batch_rows * batch_rows)
  return [(first, min(per_shard, rows - first)) for first in range(0, rows, per_shard)]


def aggregate(name: str, outputs: np.ndarray) -> float:
  """The benchmark's aggregate of every row's output; ValueError naming the rows whose
  output is NaN or infinite (such an entry is not scored: no value of it favours a model).

  Example: ``aggregate("mean", np.array([1.0, np.nan]))`` raises "... on row 1 (nan) ...".
  """
  outputs = np.asarray(outputs, np.float64)
  bad = np.flatnonzero(~np.isfinite(outputs))
  if bad.size:
    shown = ", ".join(f"{i} ({outputs[i]})" for i in bad[:8])
    raise ValueError(f"the evaluation program's output is not finite on {bad.size} of "
                     f"{outputs.size} rows: row{'s' if bad.size > 1 else ''} {shown}"
                     f"{' …' if bad.size > 8 else ''}; the entry is not scored.")
  value = float(AGGREGATES[name](outputs))
  if not np.isfinite(value):
    raise ValueError(f"the {name} of the outputs is {value}.")
  return value
