"""Self-reported measurements of a checkpoint: evaluate, aggregate, submit.

Example::

  measurement = experiment.measure(checkpoint)

  @measurement.evaluate(params=0, batch=1)
  def evaluate(params, batch):
    return score(params, batch)

  @measurement.aggregate
  def aggregate(outputs):
    return sum(outputs) / len(outputs)

  measurement.submit("accuracy", measurement.run(checkpoint, batches))

The evaluation is exported once (``jax.export``) and run through the same
compiled program the server replays; each batch and its output are committed,
then the server draws the sample of batches to open (``sample`` of them, at least
a quarter) and replays them. The program and the batches are the submitter's, so
a measurement is labelled self-reported and never ranked: a ranked score comes from
a benchmark (``dvbench.benchmark``), where the server runs the owner's program.
"""

import os
import pathlib
import sys

import blake3
import cbor2
import jax
import numpy as np
from flax import serialization

from dvbench import errors
from zkdv import digest
from zkdv import errors as zkdv_errors
from zkdv.cli import progress_bar
from zkdv.jax import arrays
from zkdv.jax.replay import compile_program
from zkdv.verify import claims


def load_checkpoint(checkpoint) -> object:
  """A params pytree from a pytree, msgpack bytes, or the path of a msgpack file."""
  if isinstance(checkpoint, (str, os.PathLike)):
    checkpoint = pathlib.Path(checkpoint).read_bytes()
  if isinstance(checkpoint, (bytes, bytearray)):
    return serialization.msgpack_restore(bytes(checkpoint))
  return checkpoint


def tree_layouts(tree) -> tuple[list[digest.LeafLayout], list[np.ndarray]]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  values = [np.asarray(arrays.host_view(arrays.as_array(v))) for _, v in flat]
  layouts = [arrays.layout_of(jax.tree_util.keystr(p), arrays.as_array(v)) for p, v in flat]
  return layouts, values


def params_digest(tree) -> bytes:
  layouts, values = tree_layouts(tree)
  return digest.digest_state_arrays(layouts, values)[0]


class Measurement:
  """One measurement of a verified checkpoint of an experiment."""

  def __init__(self, experiment, checkpoint):
    self.experiment = experiment
    self.checkpoint_digest = params_digest(load_checkpoint(checkpoint))
    proofs = experiment.proofs()
    matching = [p for p in proofs if p["state"] in claims.REPLAYED_STATES
                and p["final_params"] == self.checkpoint_digest.hex()]
    if not matching:
      compared = ", ".join(f"{p['id'][:16]}… ({p['state']}, final params "
                           f"{(p['final_params'] or '-')[:16]}…)" for p in proofs) or "none"
      raise errors.MeasurementError(
          f"the checkpoint (params digest {self.checkpoint_digest.hex()[:16]}…) is not the "
          f"final state of a verified proof of {experiment.name}; compared with: {compared}. "
          "Measure the params that proof.finish() attested, without training further.")
    self.proof_id = matching[0]["id"]
    self._evaluate = None
    self._aggregate = None
    self._result = None

  def evaluate(self, fn=None, *, params: int = 0, batch: int = 1):
    """Marks the evaluation function and which arguments are the params and the batch."""
    if sorted((params, batch)) != [0, 1]:
      raise ValueError("evaluate takes exactly two positional arguments: params and batch "
                       "(e.g. params=0, batch=1).")
    if fn is None:
      return lambda f: self.evaluate(f, params=params, batch=batch)
    self._evaluate = (fn, params, batch)
    return fn

  def aggregate(self, fn):
    """Marks the function that turns the list of batch outputs into the value."""
    self._aggregate = fn
    return fn

  def run(self, checkpoint, batches, progress: bool = True) -> float:
    """Evaluates every batch, commits batches and outputs, returns the aggregate."""
    if self._evaluate is None or self._aggregate is None:
      raise errors.MeasurementError("decorate the evaluation with @measurement.evaluate and "
                                    "the aggregation with @measurement.aggregate first.")
    params = load_checkpoint(checkpoint)
    if params_digest(params) != self.checkpoint_digest:
      raise errors.MeasurementError("run() got a different checkpoint than measure().")
    batches = list(batches)
    if not batches:
      raise errors.MeasurementError("run() needs at least one batch.")
    fn, params_at, batch_at = self._evaluate
    p_leaves, p_tree = jax.tree.flatten(params)
    b_leaves, b_tree = jax.tree.flatten(batches[0])
    n_params = len(p_leaves)

    def flat_evaluate(*flat):
      args = [None, None]
      args[params_at] = jax.tree.unflatten(p_tree, flat[:n_params])
      args[batch_at] = jax.tree.unflatten(b_tree, flat[n_params:])
      return tuple(jax.tree.leaves(fn(*args)))

    specs = [jax.ShapeDtypeStruct(np.shape(x), arrays.as_array(x).dtype)
             for x in p_leaves + b_leaves]
    evaluate_blob = bytes(jax.export.export(jax.jit(flat_evaluate))(*specs).serialize())
    run_evaluate = compile_program(jax.export.deserialize(bytearray(evaluate_blob)))
    params_j = [arrays.as_array(x) for x in p_leaves]
    batch_layouts = tree_layouts(batches[0])[0]
    commitments, outputs, out_layouts = [], [], None
    show = progress_bar(sys.stderr, "evaluating") if progress else None
    for i, b in enumerate(batches):
      leaves = [arrays.as_array(x) for x in jax.tree.leaves(b)]
      if [(x.shape, x.dtype) for x in leaves] != [(s.shape, s.dtype) for s in specs[n_params:]]:
        raise errors.MeasurementError(f"batch {i} differs in shape or dtype from batch 0.")
      out = [np.asarray(arrays.host_view(o)) for o in run_evaluate(*params_j, *leaves)]
      if out_layouts is None:
        out_layouts = [digest.LeafLayout(f"[{k}]", str(o.dtype), o.shape)
                       for k, o in enumerate(out)]
      commitments.append([
          digest.digest_batch_arrays(batch_layouts, [arrays.host_view(x) for x in leaves]),
          digest.digest_state_arrays(out_layouts, out)[0]])
      outputs.append(out)
      if show is not None:
        show(i + 1, len(batches))
    value, aggregate_blob = self._run_aggregate(outputs)
    self._result = {"params": params, "batches": batches, "evaluate_blob": evaluate_blob,
                    "aggregate_blob": aggregate_blob, "batch_layouts": batch_layouts,
                    "out_layouts": out_layouts, "commitments": commitments,
                    "outputs": outputs, "value": value}
    return value

  def _run_aggregate(self, outputs) -> tuple[float, bytes | None]:
    """The value through the exported aggregate, or by plain Python if it cannot export."""
    count, width = len(outputs), len(outputs[0])

    def flat_aggregate(*flat):
      return self._aggregate([list(flat[i * width:(i + 1) * width]) if width > 1
                              else flat[i] for i in range(count)])

    flat = [o for out in outputs for o in out]
    try:
      exported = jax.export.export(jax.jit(flat_aggregate))(
          *[jax.ShapeDtypeStruct(o.shape, o.dtype) for o in flat])
      blob = bytes(exported.serialize())
      value = compile_program(jax.export.deserialize(bytearray(blob)))(*flat)
      return float(np.asarray(value)), blob
    except Exception:  # not exportable: the value is self-reported
      return float(flat_aggregate(*flat)), None

  def submit(self, metric: str, value: float, *, higher_is_better: bool = True,
             sample: float = 0.25) -> dict:
    """Uploads the commitments, then opens the batches the server drew (``sample`` of them)."""
    if self._result is None:
      raise errors.MeasurementError("call measurement.run(checkpoint, batches) before submit().")
    r = self._result
    http = self.experiment.client.http
    params_layouts, params_values = tree_layouts(r["params"])

    def put(data) -> bytes:
      data = bytes(digest.byte_view(data)) if isinstance(data, np.ndarray) else data
      name = blake3.blake3(data).digest()
      http.put_blob(self.proof_id, name.hex(), lambda: data)
      return name

    record = {
        "type": "measurement", "metric": metric, "value": float(value),
        "higher_is_better": bool(higher_is_better), "proof_id": self.proof_id,
        "checkpoint": self.checkpoint_digest,
        "params_layout": [l.to_record() for l in params_layouts],
        "params_blobs": [put(v) for v in params_values],
        "evaluate": put(r["evaluate_blob"]),
        "aggregate": None if r["aggregate_blob"] is None else put(r["aggregate_blob"]),
        "batch_layout": [l.to_record() for l in r["batch_layouts"]],
        "output_layout": [l.to_record() for l in r["out_layouts"]],
        "batches": r["commitments"],
        "outputs": [[put(o) for o in out] for out in r["outputs"]],
        "sample": float(sample),
    }
    owner, name = self.experiment.name.split("/")
    committed = http.request("POST", f"/api/v1/experiments/{owner}/{name}/measurements",
                             content=cbor2.dumps(record, canonical=True)).json()
    openings = [[i, [put(np.asarray(arrays.host_view(arrays.as_array(x))))
                     for x in jax.tree.leaves(r["batches"][i])]] for i in committed["open"]]
    return http.request("POST", f"/api/v1/measurements/{committed['id']}/openings",
                        content=cbor2.dumps(openings, canonical=True)).json()


def replay(record: dict, opened: list[int], openings: list,
           blob_folder: pathlib.Path) -> tuple[str, str | None]:
  """The server's check of a submission: (state, failure). Runs in a worker child.

  ``opened``: the batches the server chose; ``openings``: their ``[index, blobs]``.
  """
  def read(name, layout):
    from zkdv import transcript  # pylint: disable=g-import-not-at-top
    return transcript.read_blob(blob_folder.parent, name, layout.dtype, layout.shape)

  layouts = {k: [digest.LeafLayout.from_record(l) for l in record[f"{k}_layout"]]
             for k in ("params", "batch", "output")}
  if digest.state_digest_from_leaves(layouts["params"], record["params_blobs"]) != record[
      "checkpoint"]:
    return "invalid", "the params blobs are not the committed checkpoint."
  batches = record["batches"]
  if len(record["outputs"]) != len(batches):
    return "invalid", "outputs and batch commitments differ in number."
  for i, (out, (_, out_digest)) in enumerate(zip(record["outputs"], batches)):
    if digest.state_digest_from_leaves(layouts["output"], out) != out_digest:
      return "invalid", f"the opened output of batch {i} is not its committed output."
  if [o[0] for o in openings] != opened:
    return "invalid", f"opened batches {[o[0] for o in openings]}, the server chose {opened}."
  params = [arrays.from_host(read(b, l), l) for b, l in
            zip(record["params_blobs"], layouts["params"])]
  evaluate = compile_program(jax.export.deserialize(bytearray(
      (blob_folder / record["evaluate"].hex()).read_bytes())))
  for index, blobs in openings:
    batch = [read(b, l) for b, l in zip(blobs, layouts["batch"])]
    if digest.digest_batch_arrays(layouts["batch"], batch) != batches[index][0]:
      return "invalid", f"the opened batch {index} is not its committed batch."
    out = [np.asarray(arrays.host_view(o)) for o in
           evaluate(*params, *[arrays.from_host(b, l) for b, l in zip(batch, layouts["batch"])])]
    if digest.digest_state_arrays(layouts["output"], out)[0] != batches[index][1]:
      return "invalid", (f"replaying batch {index} does not give its reported output: the "
                         "reported outputs were altered.")
  if record["aggregate"] is None:
    return "self-reported", ("the aggregate could not be exported: the sampled evaluations "
                             "were replayed, the value is the submitter's.")
  flat = [arrays.from_host(read(b, l), l) for out in record["outputs"]
          for b, l in zip(out, layouts["output"])]
  aggregate = compile_program(jax.export.deserialize(bytearray(
      (blob_folder / record["aggregate"].hex()).read_bytes())))
  value = float(np.asarray(aggregate(*flat)))
  if value != record["value"]:
    return "invalid", f"the aggregate of the outputs is {value!r}, the submission says " \
                      f"{record['value']!r}."
  return "self-reported", None


def main(argv=None) -> int:
  """``python -m dvbench.measurement FOLDER``: prints the replay verdict as JSON.

  FOLDER holds ``measurement.cbor``, ``sample.cbor`` (``[opened, openings]``) and ``blobs/``.
  """
  import json  # pylint: disable=g-import-not-at-top
  folder = pathlib.Path((argv or sys.argv[1:])[0])
  record = cbor2.loads((folder / "measurement.cbor").read_bytes())
  opened, openings = cbor2.loads((folder / "sample.cbor").read_bytes())
  try:
    state, failure = replay(record, opened, openings, folder / "blobs")
  except Exception as e:  # a malformed submission is invalid, never a crash
    if zkdv_errors.out_of_memory(e):
      raise  # a fault of this machine, not of the submission: the worker retries
    state, failure = "invalid", f"the submission could not be replayed: {type(e).__name__}: {e}"
  print(json.dumps({"state": state, "failure": failure}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
