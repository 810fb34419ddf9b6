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

from dvbench.server import labels
from dvbench.server.decoding import decode
from dvbench.server.service import NAME, Service
from zkdv import challenge
from zkdv.fields import (Bool, Field, Float, Int, Invalid, ListOf, Optional, Row, Text,
                         check_fields)
from zkdv.records import DIGEST, DIGESTS, LAYOUTS
from zkdv.transcript import record_id

MIN_SAMPLE = 0.25
MAX_BATCHES = 1 << 16  # committed batches of one measurement
# A measurement record is digests and layouts: about 110 bytes a batch. Its bytes count
# against the owner's stored_bytes quota.
MAX_MEASUREMENT_BYTES = 16 << 20
_NOT_A_MEASUREMENT = "the body is not a measurement record (see dvbench.measurement)"
_REQ = True
MEASUREMENT_FIELDS = {
    "type": Field(Text(20)), "metric": Field(Text(100, min_len=1), _REQ),
    "value": Field(Float(), _REQ), "higher_is_better": Field(Bool()),
    "proof_id": Field(Text(64), _REQ), "checkpoint": Field(DIGEST, _REQ),
    "batches": Field(ListOf(Row((DIGEST, DIGEST)), MAX_BATCHES, min_len=1), _REQ),
    "evaluate": Field(DIGEST, _REQ), "params_blobs": Field(DIGESTS, _REQ),
    "outputs": Field(ListOf(DIGESTS, MAX_BATCHES), _REQ),
    "aggregate": Field(Optional(DIGEST), _REQ),
    "params_layout": Field(LAYOUTS, _REQ), "batch_layout": Field(LAYOUTS, _REQ),
    "output_layout": Field(LAYOUTS, _REQ),
    "sample": Field(Float(MIN_SAMPLE, 1.0, "the fraction of batches the server opens"), _REQ)}
OPENINGS = ListOf(Row((Int(), DIGESTS)))


def parse_measurement(body: bytes) -> tuple[dict, list[bytes]]:
  """(record, every blob digest it references); 400 naming the first wrong field."""
  if len(body) > MAX_MEASUREMENT_BYTES:
    raise HTTPException(413, f"{_NOT_A_MEASUREMENT}: {len(body)} bytes, over the "
                        f"{MAX_MEASUREMENT_BYTES} a measurement takes ({MAX_BATCHES} batches "
                        "at most).")
  record = decode(body, "the measurement")
  try:
    check_fields(record, MEASUREMENT_FIELDS, "measurement", strict=True)
  except Invalid as e:
    raise HTTPException(400, f"{_NOT_A_MEASUREMENT}: {e}") from None
  if not NAME.fullmatch(record["metric"]):
    raise HTTPException(400, f"{_NOT_A_MEASUREMENT}: metric names are 1-100 letters, digits, "
                        "'.', '_' or '-'.")
  if "openings" in record:
    raise HTTPException(400, f"{_NOT_A_MEASUREMENT}: openings are sent after the commitment, "
                        "for the batches the server chooses.")
  refs = [record["evaluate"], *record["params_blobs"], *(d for out in record["outputs"]
                                                          for d in out)]
  if record["aggregate"] is not None:
    refs.append(record["aggregate"])
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
      self.service.quota.check_storage(owner, len(body))
      proof_id, checkpoint = record["proof_id"], record["checkpoint"]
      proof = self.store.proof(proof_id)
      if proof is None or proof["experiment_id"] != exp["id"]:
        raise HTTPException(404, f"proof {proof_id} is not a proof of {exp['full_name']}.")
      if (proof["state"] not in labels.REPLAYED_STATES
          or proof["final_params"] != checkpoint.hex()):
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
      try:
        OPENINGS.check(openings, "openings")
      except Invalid as e:
        raise HTTPException(400, f"{e} Send [[index, [blob digests]]...].") from None
      if [o[0] for o in openings] != opened:
        raise HTTPException(400, f"send the openings of exactly the batches {opened}, as "
                            "[[index, [blob digests]]...] in that order.")
      refs = [d for _, blobs in openings for d in blobs]
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
