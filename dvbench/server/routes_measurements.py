"""Self-reported measurements of verified checkpoints and the evaluation sets of metrics.

A measurement runs the submitter's own program on its own batches: it is labelled
self-reported and never ranked (benchmarks rank, see ``routes_benchmarks``). It is
sent in two steps so that the sample cannot be ground: the commitments first, then
the openings of the batches the server drew after storing them (at least
``MIN_SAMPLE`` of them, never fewer than one).

Example::

  routes = measurement_routes(service)  # POST .../measurements, POST .../openings
"""

import secrets

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.routing import Route

from dvbench.server.service import NAME, Service, decode
from zkdv import challenge
from zkdv.transcript import record_id

MIN_SAMPLE = 0.25
_FIELDS = ("metric", "value", "proof_id", "checkpoint", "batches", "evaluate", "params_blobs",
           "outputs", "aggregate", "sample")
_NOT_A_MEASUREMENT = "the body is not a measurement record (see dvbench.measurement)"


def _is_digest(value) -> bool:
  return isinstance(value, bytes) and len(value) == 32


def _digest_list(value, what: str) -> list[bytes]:
  if not isinstance(value, list) or not all(_is_digest(d) for d in value):
    raise HTTPException(400, f"{_NOT_A_MEASUREMENT}: {what} must be a list of 32-byte digests.")
  return value


def parse_measurement(body: bytes) -> tuple[dict, list[bytes]]:
  """(record, every blob digest it references); 400 naming the first wrong field."""
  record = decode(body, "the measurement")
  if not isinstance(record, dict) or not all(k in record for k in _FIELDS):
    raise HTTPException(400, f"{_NOT_A_MEASUREMENT}: it needs the fields {list(_FIELDS)}.")
  if not (isinstance(record["metric"], str) and NAME.fullmatch(record["metric"])):
    raise HTTPException(400, f"{_NOT_A_MEASUREMENT}: metric names are 1-100 letters, digits, "
                        "'.', '_' or '-'.")
  if not isinstance(record["value"], float) or not _is_digest(record["checkpoint"]):
    raise HTTPException(400, f"{_NOT_A_MEASUREMENT}: value is a float, checkpoint 32 bytes.")
  sample = record["sample"]
  if not (isinstance(sample, float) and MIN_SAMPLE <= sample <= 1):
    raise HTTPException(400, f"{_NOT_A_MEASUREMENT}: sample is the fraction of batches the "
                        f"server opens, a float in [{MIN_SAMPLE}, 1], got {sample!r}.")
  outputs = record["outputs"]
  if not isinstance(record["batches"], list) or not record["batches"] or not isinstance(
      outputs, list):
    raise HTTPException(400, f"{_NOT_A_MEASUREMENT}: batches is a non-empty list, outputs a "
                        "list.")
  if "openings" in record:
    raise HTTPException(400, f"{_NOT_A_MEASUREMENT}: openings are sent after the commitment, "
                        "for the batches the server chooses.")
  refs = [*_digest_list([record["evaluate"]], "evaluate"),
          *_digest_list(record["params_blobs"], "params_blobs"),
          *[d for out in outputs for d in _digest_list(out, "outputs")]]
  if record["aggregate"] is not None:
    refs += _digest_list([record["aggregate"]], "aggregate")
  return record, refs


class MeasurementRoutes:

  def __init__(self, service: Service):
    self.service, self.store = service, service.store

  async def create_measurement(self, request):
    body = await self.service.body(request)
    owner, name = request.path_params["owner"], request.path_params["name"]

    def create():
      exp = self.service.writable_experiment(request, owner, name)
      record, refs = parse_measurement(body)
      proof_id, checkpoint = str(record["proof_id"]), record["checkpoint"]
      proof = self.store.proof(proof_id)
      if proof is None or proof["experiment_id"] != exp["id"]:
        raise HTTPException(404, f"proof {proof_id} is not a proof of {exp['full_name']}.")
      if proof["state"] != "verified" or proof["final_params"] != checkpoint.hex():
        raise HTTPException(409, f"the checkpoint is not the final state of a verified proof: "
                            f"proof {proof_id} is {proof['state']} with final params "
                            f"{proof['final_params']}.")
      missing = [b.hex() for b in refs if not self.store.has_proof_blob(proof_id, b.hex())]
      if missing:
        raise HTTPException(409, f"{len(missing)} blobs were not uploaded for proof {proof_id} "
                            f"(first {missing[0]}); upload them first.")
      seed = secrets.token_bytes(32)
      opened = challenge.probe_rows(seed, 0, len(record["batches"]), record["sample"])
      return self.store.add_measurement({
          "id": record_id(body).hex(), "experiment_id": exp["id"],
          "proof_id": proof_id, "metric": record["metric"], "value": record["value"],
          "higher_is_better": bool(record.get("higher_is_better", True)),
          "batches": len(record["batches"]), "sampled": len(opened),
          "checkpoint": checkpoint.hex(), "record": body}, seed, opened)
    row = await run_in_threadpool(create)
    return JSONResponse(await run_in_threadpool(self._public, row), status_code=201)

  def _public(self, row: dict) -> dict:
    sample = self.store.measurement_sample(row["id"])
    return {**{k: v for k, v in row.items() if k != "record"}, "open": sample["opened"]}

  async def open_measurement(self, request):
    """The openings of the batches the server chose: ``[[index, [blob digests]]...]``."""
    body = await self.service.body(request)
    measurement_id = request.path_params["measurement_id"]

    def open_():
      row = self.store.measurement(measurement_id)
      if row is None:
        raise HTTPException(404, "unknown measurement.")
      self.service.proof_for_write(request, row["proof_id"])
      openings = decode(body, "the openings")
      opened = self.store.measurement_sample(measurement_id)["opened"]
      if not isinstance(openings, list) or not all(
          isinstance(o, list) and len(o) == 2 for o in openings) or [
              o[0] for o in openings] != opened:
        raise HTTPException(400, f"send the openings of exactly the batches {opened}, as "
                            "[[index, [blob digests]]...] in that order.")
      refs = [d for _, blobs in openings for d in _digest_list(blobs, "openings")]
      missing = [b.hex() for b in refs if not self.store.has_proof_blob(row["proof_id"],
                                                                         b.hex())]
      if missing:
        raise HTTPException(409, f"{len(missing)} blobs were not uploaded for proof "
                            f"{row['proof_id']} (first {missing[0]}); upload them first.")
      if not self.store.open_measurement(measurement_id, body):
        raise HTTPException(409, f"measurement {measurement_id} was already opened.")
      return self._public(self.store.measurement(measurement_id))
    return JSONResponse(await run_in_threadpool(open_))

  async def get_measurement(self, request):
    row = await run_in_threadpool(self.store.measurement, request.path_params["measurement_id"])
    if row is None:
      raise HTTPException(404, "unknown measurement.")
    return JSONResponse(await run_in_threadpool(self._public, row))


def measurement_routes(service: Service) -> list[Route]:
  api = MeasurementRoutes(service)
  return [
      Route("/api/v1/experiments/{owner}/{name}/measurements", api.create_measurement,
            methods=["POST"], name="create_measurement"),
      Route("/api/v1/measurements/{measurement_id}", api.get_measurement, name="measurement"),
      Route("/api/v1/measurements/{measurement_id}/openings", api.open_measurement,
            methods=["POST"], name="measurement_openings"),
  ]
