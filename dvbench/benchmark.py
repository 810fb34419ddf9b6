"""Benchmarks: an owner registers the evaluation, the server scores verified checkpoints.

A benchmark ``owner/name`` holds a metric and its direction, an evaluation
program exported with ``jax.export`` (params + a batch of rows -> one output per
row), the aggregate of those outputs (``"mean"`` or ``"sum"``, computed by the
server), the evaluation rows (their digests public, the rows private to the
server unless ``publish_rows``) and the audit a proof needs: a minimum update
check probability and, optionally, the training program ids allowed. Only the
owner's token registers it, once; it cannot be changed afterwards.

A submitter names the benchmark, the checkpoint and the verified proof whose
``final_params`` it is; a worker runs the owner's program on every row. The
submitter sends no outputs, no program and no rows.

Example::

  bench = client.benchmark("alice/tiny-accuracy")
  bench.register(metric="accuracy", evaluate=evaluate, params=params, rows=eval_rows,
                 min_update_check_probability=0.5)
  entry = client.benchmark("alice/tiny-accuracy").submit(proof_id, "checkpoint.msgpack")
  bench.wait(entry["id"])["value"]
  bench.leaderboard(sort="value")
"""

import json
import pathlib
import sys
import time

import blake3
import cbor2
import jax
import numpy as np

from dvbench.measurement import load_checkpoint, tree_layouts
from zkdv import digest
from zkdv import transcript
from zkdv.jax import arrays
from zkdv.jax import replay

AGGREGATES = {"mean": np.mean, "sum": np.sum}
SUBMISSION_SETTLED = ("scored", "failed")


def export_evaluation(evaluate, params, rows, batch_rows: int) -> bytes:
  """``evaluate(params, batch)`` exported on flat leaves for batches of ``batch_rows`` rows."""
  p_leaves, p_tree = jax.tree.flatten(params)
  b_leaves, b_tree = jax.tree.flatten(rows)

  def flat_evaluate(*flat):
    return evaluate(jax.tree.unflatten(p_tree, flat[:len(p_leaves)]),
                    jax.tree.unflatten(b_tree, flat[len(p_leaves):]))

  specs = [jax.ShapeDtypeStruct(np.shape(x), arrays.as_array(x).dtype) for x in p_leaves]
  specs += [jax.ShapeDtypeStruct((batch_rows, *np.shape(x)[1:]), arrays.as_array(x).dtype)
            for x in b_leaves]
  return bytes(jax.export.export(jax.jit(flat_evaluate))(*specs).serialize())


class Benchmark:
  """The benchmark ``owner/name`` on a server (``client.benchmark(name)``)."""

  def __init__(self, client, name: str):
    if not isinstance(name, str) or name.count("/") != 1:
      raise ValueError(f"benchmark names are 'owner/name', got {name!r}.")
    self.client, self.name = client, name
    self.path = f"/api/v1/benchmarks/{name}"

  def __repr__(self):
    return f"Benchmark({self.name!r})"

  def _put(self, data: bytes) -> bytes:
    """Uploads a blob for this benchmark (owner's token) unless the server holds it for it."""
    name = blake3.blake3(data).digest()
    path = f"{self.path}/blobs/{name.hex()}"
    if self.client.http.request("HEAD", path, ok=(200, 404)).status_code != 200:
      self.client.http.request("PUT", path, content=data,
                               headers={"content-type": "application/octet-stream"})
    return name

  def register(self, *, metric: str, evaluate, params, rows, higher_is_better: bool = True,
               aggregate: str = "mean", batch_size: int | None = None,
               min_update_check_probability: float = 0.1, allowed_programs=None,
               publish_rows: bool = False) -> dict:
    """Registers the benchmark (once; the owner's token).

    Args:
      evaluate: ``evaluate(params, batch) -> outputs`` of shape ``(rows in batch,)``.
      params: example params (their structure, dtypes and shapes define the checkpoint).
      rows: the evaluation rows, a pytree of arrays sharing the leading axis.
      aggregate: ``"mean"`` or ``"sum"`` of every row's output, computed by the server.
      batch_size: rows per evaluation call (default: all rows at once).
      allowed_programs: hex ids of the training programs a proof may use (None: any).
    """
    if aggregate not in AGGREGATES:
      raise ValueError(f"aggregate is one of {sorted(AGGREGATES)}, got {aggregate!r}.")
    data_layouts, data = tree_layouts(rows)
    count = data_layouts[0].shape[0] if data_layouts and data_layouts[0].shape else 0
    batch_rows = batch_size or count
    program = export_evaluation(evaluate, params, rows, batch_rows)
    definition = {
        "type": "benchmark", "metric": metric, "higher_is_better": bool(higher_is_better),
        "aggregate": aggregate, "batch_rows": batch_rows, "program": self._put(program),
        "params_layout": [l.to_record() for l in tree_layouts(params)[0]],
        "data_layout": [l.to_record() for l in data_layouts],
        "data_blobs": [self._put(bytes(digest.byte_view(d))) for d in data],
        "min_update_check_probability": float(min_update_check_probability),
        "allowed_programs": None if allowed_programs is None else [
            bytes.fromhex(p) for p in allowed_programs],
        "public_rows": bool(publish_rows),
    }
    return self.client.http.request("PUT", self.path,
                                    content=cbor2.dumps(definition, canonical=True)).json()

  def info(self) -> dict:
    return self.client.http.request("GET", self.path).json()

  def submit(self, proof_id: str, checkpoint) -> dict:
    """Submits ``checkpoint`` (pytree, msgpack bytes or path), the final params of
    ``proof_id`` (a verified proof of the caller); the server scores it."""
    layouts, values = tree_layouts(load_checkpoint(checkpoint))
    blobs = []
    for value in values:
      data = bytes(digest.byte_view(value))
      name = blake3.blake3(data).digest()
      self.client.http.put_blob(proof_id, name.hex(), lambda data=data: data)
      blobs.append(name)
    record = {"type": "submission", "proof_id": proof_id,
              "params_layout": [l.to_record() for l in layouts], "params_blobs": blobs}
    return self.client.http.request("POST", f"{self.path}/submissions",
                                    content=cbor2.dumps(record, canonical=True)).json()

  def wait(self, submission_id: str, timeout: float = 300.0) -> dict:
    """Polls until the submission is ``scored`` or ``failed``; returns it."""
    deadline = time.monotonic() + timeout
    while True:
      entry = self.client.http.request("GET", f"/api/v1/submissions/{submission_id}").json()
      if entry["state"] in SUBMISSION_SETTLED or time.monotonic() > deadline:
        return entry
      time.sleep(0.2)

  def leaderboard(self, sort: str | None = None) -> list[dict]:
    """Every entry with its audit strength; ranked ones first unless ``sort`` says otherwise."""
    params = {"sort": sort} if sort else {}
    return self.client.http.request("GET", f"{self.path}/leaderboard", params=params).json()


class ScoreError(Exception):
  """The registered program cannot score this checkpoint; the message says why."""


def _read(folder: pathlib.Path, blob: bytes, layout: digest.LeafLayout) -> np.ndarray:
  return transcript.read_blob(folder, blob, layout.dtype, layout.shape)


def score(job: dict, folder: pathlib.Path) -> float:
  """The aggregate of the owner's program over every row. Runs in a worker child.

  ``folder/blobs`` holds the program, the checkpoint and the rows; a program that
  is screened out (``replay.load_program``) or takes other inputs raises.
  """
  exported, _ = replay.load_program(
      (folder / transcript.BLOBS_DIR / job["program"].hex()).read_bytes())
  params_layouts = [digest.LeafLayout.from_record(l) for l in job["params_layout"]]
  data_layouts = [digest.LeafLayout.from_record(l) for l in job["data_layout"]]
  batch_rows, count = job["batch_rows"], data_layouts[0].shape[0]
  expected = [(l.shape, l.dtype) for l in params_layouts] + [
      ((batch_rows, *l.shape[1:]), l.dtype) for l in data_layouts]
  taken = [(tuple(a.shape), str(a.dtype)) for a in exported.in_avals]
  if taken != expected:
    raise ScoreError(f"the evaluation program takes {taken}; the checkpoint and rows give "
                     f"{expected}.")
  if [tuple(a.shape) for a in exported.out_avals] != [(batch_rows,)]:
    raise ScoreError(f"the evaluation program returns {exported.out_avals}; a benchmark's "
                     f"program returns one output per row, shape ({batch_rows},).")
  run = replay.compile_program(exported)
  params = [arrays.from_host(_read(folder, b, l), l)
            for b, l in zip(job["params_blobs"], params_layouts, strict=True)]
  data = [_read(folder, b, l) for b, l in zip(job["data_blobs"], data_layouts, strict=True)]
  outputs = []
  for start in range(0, count, batch_rows):  # the last batch wraps around, extra rows dropped
    rows = (start + np.arange(batch_rows)) % count
    (out,) = jax.tree.leaves(run(*params, *[d[rows] for d in data]))
    out = np.asarray(out, np.float64)
    outputs.append(out[:min(batch_rows, count - start)])
  value = float(AGGREGATES[job["aggregate"]](np.concatenate(outputs)))
  if not np.isfinite(value):
    raise ScoreError(f"the {job['aggregate']} of the outputs is {value}.")
  return value


def main(argv=None) -> int:
  """``python -m dvbench.benchmark FOLDER``: scores ``FOLDER/job.cbor``, prints JSON."""
  folder = pathlib.Path((argv or sys.argv[1:])[0])
  job = cbor2.loads((folder / "job.cbor").read_bytes())
  try:
    print(json.dumps({"value": score(job, folder), "failure": None}))
  except Exception as e:  # an unusable program or checkpoint fails the entry, never the worker
    print(json.dumps({"value": None, "failure": f"{type(e).__name__}: {e}"}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
