"""Benchmarks: an owner registers the evaluation, the server scores verified checkpoints.

A benchmark ``owner/name`` holds a metric and its direction, an evaluation
program exported with ``jax.export`` (params + a batch of rows -> one output per
row; checked when registered), the aggregate of those outputs (``"mean"`` or
``"sum"``, computed by the server), the evaluation rows (their digests public,
the rows private to the server unless ``publish_rows``) and the audit a proof
needs: its level (``"min-probability"``: server-chosen update checks at p at
least ``min_update_check_probability``), optionally the training program ids
allowed and the Merkle root of the training set (``TrainingSet``) that probed
batch rows must be members of. Only the owner's token registers it, once; it
cannot be changed afterwards.

A submitter names the benchmark, the checkpoint and the verified proof whose
``final_params`` it is, with Merkle proofs that its probed rows are training
rows where the benchmark pins a training set; workers run the owner's program
on every row (in shards of rows for large sets) and the server aggregates. The
submitter sends no outputs, no program and no rows.

Example::

  train_set = TrainingSet(train_rows)  # from dvbench.benchmark
  bench = client.benchmark("alice/tiny-accuracy")
  bench.register(metric="accuracy", evaluate=evaluate, params=params, rows=eval_rows,
                 min_update_check_probability=0.5, training_set=train_set)
  entry = client.benchmark("alice/tiny-accuracy").submit(proof_id, "checkpoint.msgpack",
                                                         training_set=train_set)
  bench.wait(entry["id"])["value"]
  bench.leaderboard(sort="value")
"""

import io
import json
import pathlib
import sys
import time

import blake3
import cbor2
import jax
import numpy as np

from dvbench import contamination
from dvbench import scoring
from dvbench.measurement import load_checkpoint, params_digest, tree_layouts
from zkdv import data as data_lib
from zkdv import digest
from zkdv import errors as zkdv_errors
from zkdv import records
from zkdv import transcript
from zkdv.jax import arrays
from zkdv.jax import replay
from zkdv.jax import stablehlo

AGGREGATES = tuple(scoring.AGGREGATES)
SUBMISSION_SETTLED = ("scored", "failed", scoring.UNSCORED)


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


class TrainingSet(data_lib.DatasetTree):
  """The Merkle tree of a training set's rows (``zkdv.data.DatasetTree``: every row of
  every leaf, leaf after leaf, hashed as a probe hashes a batch row), as a benchmark pins it.

  Example::

    train_set = TrainingSet({"tokens": tokens, "labels": labels})
    train_set.root, train_set.size                  # what a benchmark registers
    train_set.membership_proofs([row_bytes])         # [[row bytes, index, path]]
  """

  def __init__(self, rows):
    layouts, values = tree_layouts(rows)
    super().__init__(values, [l.path for l in layouts])
    self._index = {}
    for leaf, value in enumerate(self.leaves):
      for i, r in enumerate(digest.byte_view(value).reshape(self.rows, -1)):
        self._index.setdefault(contamination.row_digest(r.tobytes()), self.position(leaf, i))

  def __repr__(self):
    return f"TrainingSet(root={self.root.hex()[:16]}…, size={self.size})"

  def membership_proofs(self, rows) -> list[list]:
    """``[row bytes, index, audit path]`` for each row (its bytes) of this set; others are
    left out (a leaderboard shows them as outside)."""
    indices = {contamination.row_digest(row): row for row in rows}
    return [[indices[d], self._index[d], self.inclusion_proof(self._index[d])]
            for d in sorted(indices) if d in self._index]


def _start_pins(init_program, base_checkpoint, min_probe_ratio) -> dict:
  """The definition's start and probe pins that are set (an unset one is left out, so a
  definition registered before them reads the same)."""
  pins = {}
  if init_program is not None:
    pins["init_program"] = bytes.fromhex(init_program)
  if base_checkpoint is not None:
    pins["base_checkpoint"] = (bytes.fromhex(base_checkpoint) if isinstance(
        base_checkpoint, str) and len(base_checkpoint) == 64 else params_digest(
            load_checkpoint(base_checkpoint)))
  if min_probe_ratio is not None:
    pins["min_probe_ratio"] = float(min_probe_ratio)
  return pins


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

  def register(self, *, evaluate, params, rows, batch_size: int | None = None,
               **options) -> dict:
    """Registers the benchmark (once; the owner's token) with ``evaluate`` exported.

    Args:
      evaluate: ``evaluate(params, batch) -> outputs`` of shape ``(rows in batch,)``.
      params: example params (their structure, dtypes and shapes define the checkpoint).
      rows: the evaluation rows, a pytree of arrays sharing the leading axis.
      batch_size: rows per evaluation call (default: all rows at once).
      **options: those of ``register_exported`` (``metric`` among them).
    """
    count = len(tree_layouts(rows)[1][0])
    program = export_evaluation(evaluate, params, rows, batch_size or count)
    return self.register_exported(program, params=params, rows=rows,
                                  batch_rows=batch_size or count, **options)

  def register_exported(self, program: bytes, *, metric: str, params, rows, batch_rows: int,
                        higher_is_better: bool = True, aggregate: str = "mean",
                        audit: str = "min-probability",
                        min_update_check_probability: float = 0.1, allowed_programs=None,
                        training_set: TrainingSet | None = None,
                        publish_rows: bool = False, init_program: str | None = None,
                        base_checkpoint=None, min_probe_ratio: float | None = None,
                        data_order: str | None = None) -> dict:
    """Registers a serialized ``jax.export`` program taking the flat leaves of ``params``
    and of a batch of ``batch_rows`` rows (``export_evaluation``); the server checks it.

    Args:
      aggregate: ``"mean"`` or ``"sum"`` of every row's output, computed by the server.
      audit: the audit level a proof needs: ``"min-probability"`` (server-chosen checks at
        ``min_update_check_probability``) or ``"full-replay"`` (every step re-executed by
        the server's workers from an attested start); the server lists the levels it
        supports in its 400 for another.
      allowed_programs: hex ids of the training programs a proof may use (None: any).
      training_set: a ``TrainingSet`` (its root and size) that probed rows must be in.
      init_program: the hex program id of the attested init a proof must start with
        (its ``init`` record's, ``proof.init``/``proof.init_from``; None: any).
      base_checkpoint: the checkpoint a fine-tuning run must start from
        (``proof.init_from``): its hex params digest, or the params (pytree, msgpack bytes
        or path). None: only starts from the key are accepted.
      min_probe_ratio: the least probability with which the server's challenges must
        open each batch row (the proof's probe ratio; None: the server's minimum).
      data_order: ``"server-seeded"``: a proof draws its batches from ``training_set`` with
        ``proof.batches``, each step its batch of the order its server slot seeds, every
        step checked; None: any order.
    """
    if aggregate not in AGGREGATES:
      raise ValueError(f"aggregate is one of {list(AGGREGATES)}, got {aggregate!r}.")
    data_layouts, data = tree_layouts(rows)
    definition = {
        "type": "benchmark", "metric": metric, "higher_is_better": bool(higher_is_better),
        "aggregate": aggregate, "batch_rows": batch_rows, "program": self._put(program),
        "params_layout": [l.to_record() for l in tree_layouts(params)[0]],
        "reference_params": [self._put(bytes(digest.byte_view(v)))
                             for v in tree_layouts(params)[1]],
        "data_layout": [l.to_record() for l in data_layouts],
        "data_blobs": [self._put(bytes(digest.byte_view(d))) for d in data],
        "audit": audit, "min_update_check_probability": float(min_update_check_probability),
        "allowed_programs": None if allowed_programs is None else [
            bytes.fromhex(p) for p in allowed_programs],
        "training_set": None if training_set is None else {
            "root": training_set.root, "size": training_set.size},
        "public_rows": bool(publish_rows),
        **_start_pins(init_program, base_checkpoint, min_probe_ratio),
        **({} if data_order is None else {"data_order": data_order}),
    }
    return self.client.http.request("PUT", self.path,
                                    content=cbor2.dumps(definition, canonical=True)).json()

  def info(self) -> dict:
    return self.client.http.request("GET", self.path).json()

  def probed_rows(self, proof_id: str) -> list[bytes]:
    """The batch rows (their bytes, each once) the proof's probe checks opened."""
    data = self.client.http.request("GET", f"/api/v1/proofs/{proof_id}/transcript").content
    decoder, probed = cbor2.CBORDecoder(io.BytesIO(data)), {}
    while decoder.fp.tell() < len(data):
      probed.update((contamination.row_digest(row), row)
                    for entry in records.probe_entries(decoder.decode())
                    for row in records.probed_rows(entry))
    return list(probed.values())

  def submit(self, proof_id: str, checkpoint, training_set: TrainingSet | None = None) -> dict:
    """Submits ``checkpoint`` (pytree, msgpack bytes or path), the final params of
    ``proof_id`` (a verified proof of the caller); the server scores it. With
    ``training_set``, the proof's probed rows found in it are proven members."""
    layouts, values = tree_layouts(load_checkpoint(checkpoint))
    blobs = []
    for value in values:
      data = bytes(digest.byte_view(value))
      name = blake3.blake3(data).digest()
      self.client.http.put_blob(proof_id, name.hex(), lambda data=data: data)
      blobs.append(name)
    members = ([] if training_set is None
               else training_set.membership_proofs(self.probed_rows(proof_id)))
    record = {"type": "submission", "proof_id": proof_id,
              "params_layout": [l.to_record() for l in layouts], "params_blobs": blobs,
              "training_proofs": members}
    return self.client.http.request("POST", f"{self.path}/submissions",
                                    content=cbor2.dumps(record, canonical=True)).json()

  def wait(self, submission_id: str, timeout: float = 300.0) -> dict:
    """Polls until the submission is ``scored``, ``failed`` or ``unscored`` (the server
    gave up scoring it: submit it again); returns it."""
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


class ProgramError(Exception):
  """The registered program cannot evaluate this benchmark; the message says why."""


def _read(folder: pathlib.Path, blob: bytes, layout: digest.LeafLayout) -> np.ndarray:
  return transcript.read_blob(folder, blob, layout.dtype, layout.shape)


def check_program(exported, summary, job: dict) -> None:
  """Raises ProgramError unless ``exported`` maps (params, a batch) to one output per row
  and reads both: a program that ignores the params scores weights baked into it, one
  that ignores the batch is a constant."""
  params_layouts = [digest.LeafLayout.from_record(l) for l in job["params_layout"]]
  data_layouts = [digest.LeafLayout.from_record(l) for l in job["data_layout"]]
  batch_rows = job["batch_rows"]
  expected = [(l.shape, l.dtype) for l in params_layouts] + [
      ((batch_rows, *l.shape[1:]), l.dtype) for l in data_layouts]
  taken = [(tuple(a.shape), str(a.dtype)) for a in exported.in_avals]
  if taken != expected:
    raise ProgramError(f"it takes {taken}; the params and a batch of {batch_rows} rows give "
                       f"{expected}.")
  outs = exported.out_avals
  if len(outs) != 1 or tuple(outs[0].shape) != (batch_rows,) or not (
      np.issubdtype(outs[0].dtype, np.number) or outs[0].dtype == np.bool_):
    raise ProgramError(f"it returns {[str(a) for a in outs]}; a benchmark's program returns "
                       f"one number per row, shape ({batch_rows},).")
  n_params = len(params_layouts)
  if not summary.depends_on(0, range(n_params)):
    raise ProgramError("its output does not read the params: it would score weights baked "
                       "into the program, not the submitted checkpoint.")
  if not summary.depends_on(0, range(n_params, n_params + len(data_layouts))):
    raise ProgramError("its output does not read the batch: a constant, not an evaluation.")


def _perturbed(a: np.ndarray, how: str, rng: np.random.Generator) -> np.ndarray:
  """``a`` changed: "flip" everywhere (ints' low bit flipped, booleans negated, floats
  ``-a - 1``), "noise" at random (ints' and booleans' low bit flipped in a seeded half of
  the elements, floats with noise of their own spread)."""
  if a.dtype.kind in "iub":
    mask = (np.ones(a.shape, bool) if how == "flip"
            else rng.integers(0, 2, a.shape).astype(bool))
    return a ^ mask.astype(a.dtype)
  f = a.astype(np.float64)
  new = -f - 1 if how == "flip" else f + rng.normal(size=f.shape) * (np.std(f) + 1)
  return new.astype(a.dtype)


def numeric_checks(run, params: list[np.ndarray] | None, data: list[np.ndarray],
                   params_layouts, batch_rows: int) -> list[str]:
  """Runs the evaluation program on the owner's first batch of rows and raises ProgramError
  unless its outputs change with the params (at the owner's ``params`` and at a perturbed
  model, so rewarding one weight value fails), change with the batch, and are finite at the
  owner's params. Returns the checks it ran. ``params``: None draws a seeded model."""
  rng = np.random.default_rng(0)
  count = data[0].shape[0]
  batch = [d[np.arange(batch_rows) % count] for d in data]
  owner = params is not None
  if params is None:
    params = [_perturbed(np.zeros(l.shape, l.dtype), "noise", rng) for l in params_layouts]

  def outputs(ps, rows) -> np.ndarray:
    device = [arrays.from_host(p, l) for p, l in zip(ps, params_layouts, strict=True)]
    (out,) = jax.tree.leaves(run(*device, *rows))
    return np.asarray(out, np.float64)

  def varies(ps, changed) -> bool:
    base = outputs(ps, batch)
    return any(not np.array_equal(base, outputs(*c), equal_nan=True) for c in changed)

  base = outputs(params, batch)
  bad = np.flatnonzero(~np.isfinite(base))
  if owner and bad.size:
    raise ProgramError(f"its outputs on rows {bad[:16].tolist()} at the owner's params are "
                       "not finite (nan or inf): an entry would fail there.")
  where = "the owner's params" if owner else "a seeded model"
  moved = [_perturbed(p, "noise", rng) for p in params]
  for point, name in ((params, where), (moved, "a perturbed model")):
    candidates = [([_perturbed(p, how, rng) for p in point], batch) for how in ("flip", "noise")]
    if not varies(point, candidates):
      raise ProgramError(
          f"its outputs do not change when the params change, at {name}: it scores "
          "something other than the checkpoint (a constant, the labels alone)." if name == where
          else f"its outputs change with the params at {where} but not at a perturbed "
          "model: it rewards particular weight values, not a model.")
  changed_batches = [[np.roll(d, 1, axis=0) for d in batch],
                     [_perturbed(d, "flip", rng) for d in batch],
                     *([_perturbed(d, "noise", rng) for d in batch] for _ in range(3))]
  if not varies(params, [(params, b) for b in changed_batches]):
    raise ProgramError("its outputs do not change when the batch changes: it ignores the rows.")
  return ["structure: takes the params and a batch, one number per row, reads both",
          f"params: outputs change with the params at {where} and at a perturbed model",
          "batch: outputs change with the rows of the batch",
          *(["finite: every output on the owner's first batch at its params"] if owner else [])]


def load_checked_program(folder: pathlib.Path, job: dict):
  """The screened (``replay.load_program``) and checked evaluation program of ``job``."""
  blob = (folder / transcript.BLOBS_DIR / job["program"].hex()).read_bytes()
  try:
    exported, summary = replay.load_program(blob)
  except ValueError as e:
    raise ProgramError(str(e)) from None
  check_program(exported, summary, job)
  return exported


def score_rows(job: dict, folder: pathlib.Path) -> np.ndarray:
  """The owner's program's output (float64) on rows ``[first_row, first_row + rows)``.
  Runs in a worker child; ``folder/blobs`` holds the program, the checkpoint and the rows."""
  run = replay.compile_program(load_checked_program(folder, job))
  params_layouts = [digest.LeafLayout.from_record(l) for l in job["params_layout"]]
  data_layouts = [digest.LeafLayout.from_record(l) for l in job["data_layout"]]
  params = [arrays.from_host(_read(folder, b, l), l)
            for b, l in zip(job["params_blobs"], params_layouts, strict=True)]
  data = [_read(folder, b, l) for b, l in zip(job["data_blobs"], data_layouts, strict=True)]
  scan_programs(folder, job.get("scan_programs") or [], data)
  batch_rows, count = job["batch_rows"], data_layouts[0].shape[0]
  first, end = job["first_row"], job["first_row"] + job["rows"]
  outputs = []
  for start in range(first, end, batch_rows):  # a short last batch wraps, extra rows dropped
    rows = (start + np.arange(batch_rows)) % count
    (out,) = jax.tree.leaves(run(*params, *[d[rows] for d in data]))
    outputs.append(np.asarray(out, np.float64)[:min(batch_rows, end - start)])
  outputs = np.concatenate(outputs)
  bad = first + np.flatnonzero(~np.isfinite(outputs))
  if bad.size:
    raise ProgramError(f"its outputs on rows {bad[:16].tolist()} of this checkpoint are not "
                       "finite (nan or inf); the entry fails rather than favour a model.")
  return outputs.astype(scoring.OUTPUT_DTYPE)


class EmbeddedRowsError(Exception):
  """A program of the entry's proof holds evaluation rows as constants."""


def scan_programs(folder: pathlib.Path, programs: list, data: list) -> None:
  """Raises EmbeddedRowsError when a program of the proof (``[what, id]``, its blob in
  ``folder/blobs``: its training programs and its init program) embeds rows of the
  evaluation set ``data`` as constants (``contamination.rows_in_constants``, also along
  each axis of a constant and in each dtype of ``data`` it converts to exactly): rows read
  unseen by any probe."""
  leaves = [np.ascontiguousarray(d).reshape(len(d), -1).view(np.uint8) for d in data]
  for what, program_id in programs:
    blob = (folder / transcript.BLOBS_DIR / program_id.hex()).read_bytes()
    try:
      constants = stablehlo.constant_arrays(jax.export.deserialize(bytearray(blob)))
    except stablehlo.UnsafeProgramError as e:
      raise EmbeddedRowsError(f"{what} {program_id.hex()[:16]}… cannot be scanned for "
                              f"evaluation rows: {e}") from None
    constants = contamination.in_dtypes(contamination.on_each_axis(constants),
                                        [d.dtype for d in data])
    found = contamination.rows_in_constants(constants, leaves)
    if found:
      raise EmbeddedRowsError(
          f"{what} {program_id.hex()[:16]}… embeds evaluation rows {found[:16]} as "
          "constants: the proof's steps read them, unseen by any probe; the entry is "
          "refused.")


def check_job(folder: pathlib.Path, job: dict) -> list[str]:
  """Checks ``job``'s evaluation program structurally and numerically (``numeric_checks``)
  on the owner's rows and params in ``folder/blobs``; the checks it ran."""
  exported = load_checked_program(folder, job)
  params_layouts = [digest.LeafLayout.from_record(l) for l in job["params_layout"]]
  data_layouts = [digest.LeafLayout.from_record(l) for l in job["data_layout"]]
  data = [_read(folder, b, l) for b, l in zip(job["data_blobs"], data_layouts, strict=True)]
  params = None if job["reference_params"] is None else [
      _read(folder, b, l) for b, l in zip(job["reference_params"], params_layouts, strict=True)]
  return numeric_checks(replay.compile_program(exported), params, data, params_layouts,
                        job["batch_rows"])


def main(argv=None) -> int:
  """``python -m dvbench.benchmark FOLDER``: runs ``FOLDER/job.cbor`` (``"mode"``:
  ``"check"`` a program, or ``"score"`` rows into ``FOLDER/outputs.f64``); prints JSON."""
  folder = pathlib.Path((argv or sys.argv[1:])[0])
  job = cbor2.loads((folder / "job.cbor").read_bytes())
  try:
    checks = None
    if job["mode"] == "check":
      checks = check_job(folder, job)
    else:
      (folder / scoring.OUTPUTS_FILE).write_bytes(score_rows(job, folder).tobytes())
    print(json.dumps({"failure": None, "checks": checks}))
  except ProgramError as e:
    print(json.dumps({"failure": f"the evaluation program: {e}"}))
  except EmbeddedRowsError as e:
    print(json.dumps({"failure": str(e)}))
  except Exception as e:  # an unusable program or checkpoint fails the entry, never the worker
    if zkdv_errors.out_of_memory(e):
      raise  # a fault of this machine: the worker retries (no report)
    print(json.dumps({"failure": f"{type(e).__name__}: {e}"}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
