"""Benchmark registration: the owner's blobs, its definition, the evaluation program's checks.

The owner uploads the evaluation program and rows as blobs, then registers the definition
once (it cannot change, so scores stay comparable); the program is checked in a limited
child process before anything is stored. Anyone reads the definition and the program; the
rows only when the owner published them.

Example::

  routes = RegistrationRoutes(service)
  # PUT  /api/v1/benchmarks/{owner}/{name}                  routes.register
  # PUT  /api/v1/benchmarks/{owner}/{name}/blobs/{digest}   routes.put_blob
"""

import contextlib
import json
import pathlib
import sys
import tempfile
import threading

import blake3
import cbor2
import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, JSONResponse, Response

from dvbench import contamination
from dvbench.server import pins
from dvbench.server import sandbox
from dvbench.server import worker
from dvbench.server.benchmark_requests import bad, benchmark_or_404, parse_definition
from dvbench.server.paging import paged
from dvbench.server.refusals import Refusal
from dvbench.server.service import Service, check_name
from zkdv import config
from zkdv import digest

_MAX_PROGRAM_BYTES = 64 << 20
_CHECKED_PROGRAMS = 1024  # (program, signature) pairs remembered as checked or failed
# Program checks at once: server-wide, and one per owner. A check may run a program for
# the server's --time-limit (at most 600 s) on a core; more are answered "retry later".
PROGRAM_CHECKS = 2
RETRY_SECONDS = 10


def leaf_rows(path, layout: digest.LeafLayout) -> np.ndarray:
  """A stored leaf's rows as ``(rows, bytes per row)`` uint8, e.g. ``leaf_rows(p, l)``."""
  return np.fromfile(path, np.uint8).reshape(layout.shape[0], -1)


class RegistrationRoutes:
  """The owner's blobs and definition of a benchmark, and their public reads."""

  def __init__(self, service: Service):
    self.service, self.store, self.blobs = service, service.store, service.blobs
    # each checked job: the checks it ran, or why it failed; insertion-ordered, oldest first
    self._checked_programs: dict[bytes, tuple[list[str] | None, str | None]] = {}
    self._checking: set[str] = set()  # owners whose program check runs now
    self._checking_lock = threading.Lock()

  def _owned(self, request) -> str:
    """``owner/name`` of the path, after checking the token is the owner's (403)."""
    owner, name = request.path_params["owner"], request.path_params["name"]
    full = check_name(owner, name)
    who = self.service.owner(request)
    if who != owner:
      raise HTTPException(403, f"token of '{who}' cannot write benchmark '{full}'; benchmarks "
                          "are written only by their owner.")
    return full

  def _benchmark(self, request) -> dict:
    return benchmark_or_404(self.store, request)

  # -- blobs -------------------------------------------------------------------------------

  async def put_blob(self, request):
    """Token, owner and name first, then the owner's storage quota (a blob the benchmark
    holds already is a resend); then the body, streamed to the store while hashed
    (``Service.receive_blob``)."""
    digest_ = self.service.blob_name(request.path_params["digest"])
    full = await run_in_threadpool(self._owned, request)
    await run_in_threadpool(self._admit, request, full, digest_)
    if not await self.service.receive_blob(request, digest_):
      raise HTTPException(400, f"blob {digest_} does not hash to its name.")
    await run_in_threadpool(self.store.add_benchmark_blob, full, digest_)
    return Response(status_code=201)

  def _admit(self, request, full: str, digest_: str) -> None:
    """Counts the declared body against the owner's storage quota."""
    if not self.store.has_benchmark_blob(full, digest_):
      self.service.quota.check_storage(full.split("/")[0], self.service.declared_size(request))

  def _custody(self, request) -> str:
    full = check_name(request.path_params["owner"], request.path_params["name"])
    digest_ = self.service.blob_name(request.path_params["digest"])
    if not self.store.has_benchmark_blob(full, digest_):
      raise HTTPException(404, f"blob {digest_} was not uploaded for benchmark '{full}'.")
    return digest_

  async def has_blob(self, request):
    await run_in_threadpool(self._custody, request)
    return Response(status_code=200)

  async def get_blob(self, request):
    """The program to anyone; the rows only when the owner published them."""
    def readable():
      digest_ = self._custody(request)
      bench = self._benchmark(request)
      if digest_ != bench["program"] and not bench["public_rows"]:
        raise HTTPException(403, f"the rows of '{bench['full_name']}' are private to the "
                            "server; their digests are public (GET .../rows).")
      return digest_
    return FileResponse(self.blobs.path(await run_in_threadpool(readable)),
                        media_type="application/octet-stream")

  # -- registration ---------------------------------------------------------------------

  async def register(self, request):
    body = await self.service.body(request)

    def register():
      full = self._owned(request)
      spec = parse_definition(body)
      existing = self.store.benchmark(full)
      if existing is not None:
        if existing["definition"] != body:
          raise HTTPException(409, f"benchmark '{full}' is registered and cannot change, so "
                              "its scores stay comparable; register a new name.")
        return existing, 200, None
      refs = [spec["program"], *spec["data_blobs"], *(spec["reference_params"] or [])]
      missing = [d.hex() for d in refs if not self.store.has_benchmark_blob(full, d.hex())]
      if missing:
        raise HTTPException(409, f"{len(missing)} blobs were not uploaded for '{full}' (first "
                            f"{missing[0]}); PUT them to .../blobs/DIGEST first.")
      if len(spec["data_blobs"]) != len(spec["data_layout"]):
        raise bad("data_blobs", "one blob per data_layout leaf.")
      leaves = []
      for blob, layout in zip(spec["data_blobs"], spec["data_layout"]):
        path = self.blobs.path(blob.hex())
        if path.stat().st_size != layout.nbytes:
          raise bad("data_blobs", f"blob {blob.hex()} holds {path.stat().st_size} bytes; its "
                     f"layout needs {layout.nbytes}.")
        leaves.append(leaf_rows(path, layout))
      for blob, layout in zip(spec["reference_params"] or [], spec["params_layout"]):
        if self.blobs.path(blob.hex()).stat().st_size != layout.nbytes:
          raise bad("reference_params", f"blob {blob.hex()} is not {layout.nbytes} bytes, "
                     f"the size of params leaf {layout.path}.")
      checks = self._check_program(spec, full.split("/")[0])
      allowed = spec["allowed_programs"]
      row = {"full_name": full, "metric": spec["metric"],
             "higher_is_better": spec["higher_is_better"], "aggregate": spec["aggregate"],
             "program": spec["program"].hex(), "rows": spec["rows"],
             "min_update_check_probability": spec["min_update_check_probability"],
             "allowed_programs": None if allowed is None else json.dumps(
                 sorted(p.hex() for p in allowed)),
             "public_rows": spec["public_rows"], "definition": body}
      return self.store.create_benchmark(full.split("/")[0], row, contamination.evaluation_digests(
          leaves)), 201, checks
    row, status, *checks = await run_in_threadpool(register)
    return JSONResponse({**public_benchmark(row), "checks_run": checks[0] if checks else None},
                        status_code=status)

  def _check_program(self, spec: dict, owner: str) -> list[str]:
    """400 naming what is wrong with the evaluation program, checked in a limited child
    process as uploaded programs always are (``dvbench.benchmark.check_job``): it
    deserializes, passes the StableHLO screen, takes the params and a batch, returns one
    number per row and reads both; on the owner's rows its outputs change with the params
    (at the owner's params and a perturbed model) and with the batch, and are finite.
    Returns the checks it ran. A job checked before answers as it did then (its checks, or
    its failure, when the program was at fault); at most ``PROGRAM_CHECKS`` run at once,
    one per owner (429, 503: retry later)."""
    size = self.blobs.path(spec["program"].hex()).stat().st_size
    if size > _MAX_PROGRAM_BYTES:
      raise bad("program", f"at most {_MAX_PROGRAM_BYTES >> 20} MiB, got {size} bytes.")
    job = {"mode": "check", "program": spec["program"], "batch_rows": spec["batch_rows"],
           "params_layout": [l.to_record() for l in spec["params_layout"]],
           "data_layout": [l.to_record() for l in spec["data_layout"]],
           "data_blobs": spec["data_blobs"], "reference_params": spec["reference_params"]}
    key = blake3.blake3(cbor2.dumps(job, canonical=True)).digest()
    known = self._checked_programs.get(key)
    if known is None:
      with self._turn(owner):
        checks, failure = self._run_check(job, spec)
        self._remember(key, checks, failure)  # before the next turn: it never runs twice
    else:
      checks, failure = known
      failure = failure and (f"{failure} (This program failed its check before; it is not "
                             "run again.)")
    if failure:
      raise HTTPException(400, failure)
    return checks

  @contextlib.contextmanager
  def _turn(self, owner: str):
    """A program check's turn: 429 while one of ``owner``'s runs, 503 while
    ``PROGRAM_CHECKS`` of any owner do."""
    retry = {"retry-after": str(RETRY_SECONDS)}
    with self._checking_lock:
      if owner in self._checking:
        raise Refusal(429, f"a program check of '{owner}' is running; an owner's programs "
                      f"are checked one at a time: retry in {RETRY_SECONDS} s.", headers=retry)
      if len(self._checking) >= PROGRAM_CHECKS:
        raise Refusal(503, f"the server is checking {PROGRAM_CHECKS} other owners' evaluation "
                      f"programs; retry in {RETRY_SECONDS} s.", headers=retry)
      self._checking.add(owner)
    try:
      yield
    finally:
      with self._checking_lock:
        self._checking.discard(owner)

  def _remember(self, key: bytes, checks: list[str] | None, failure: str | None) -> None:
    with self._checking_lock:
      self._checked_programs[key] = (checks, failure)
      if len(self._checked_programs) > _CHECKED_PROGRAMS:
        del self._checked_programs[next(iter(self._checked_programs))]

  def _run_check(self, job: dict, spec: dict) -> tuple[list[str] | None, str | None]:
    """(the checks, None) of a program that passed, (None, the 400's text) of one at fault
    (its check's finding, or out of CPU time); other failures of the child (killed,
    crashed, out of wall-clock time on a busy server) are raised, not remembered."""
    blobs = [spec["program"], *spec["data_blobs"], *(spec["reference_params"] or [])]
    data = self.blobs.folder.parent.resolve()  # the child works elsewhere: absolute paths
    with tempfile.TemporaryDirectory(prefix="program-", dir=data) as work:
      folder = worker.child_folder(pathlib.Path(work), self.blobs, [b.hex() for b in blobs])
      (folder / "job.cbor").write_bytes(cbor2.dumps(job))
      seconds = min(self.service.time_limit, 600)
      limits = worker.Limits(self.service.memory_bytes, seconds, isolation=sandbox.available(),
                             hidden=(str(data),))
      result, failure = worker.run_confined(
          [sys.executable, "-m", "dvbench.benchmark", str(folder)], pathlib.Path(work), limits,
          seconds)
    if result is not None and not result["failure"]:
      return result["checks"], None
    failure = failure or result["failure"]
    text = (failure if failure.startswith("the evaluation program") else
            f"the evaluation program could not be checked: {failure}")
    if result is None and worker.CPU_TIME_TEXT not in failure:
      raise HTTPException(400, text)
    return None, text

  async def get_benchmark(self, request):
    row = await run_in_threadpool(self._benchmark, request)
    return JSONResponse(public_benchmark(row))

  async def get_rows(self, request):
    bench = await run_in_threadpool(self._benchmark, request)
    return await paged(request, self.store.page_benchmark_rows, bench["id"])


def left_open(definition: dict, allowed_programs) -> list[str]:
  """What a benchmark's recipe does not pin, and what that lets a run do unseen."""
  eval_bytes = sum(l.nbytes for l in definition["data_layout"])
  params_bytes = sum(l.nbytes for l in definition["params_layout"])
  budget = config.MAX_PROGRAM_CONSTANT_BYTES
  open_ = pins.left_open(definition)
  carried = config.constants_could_carry(budget, params_bytes)
  if definition["init_program"] is None and carried:
    open_.append(f"the init's constants: an init program may embed up to {budget} bytes, "
                 f"enough for a copy of the model's {params_bytes} bytes of params, so a start "
                 "may be a checkpoint it carries (another entry's, say), returned for the "
                 "slot's key only or plus a little of the key's noise; pinning init_program "
                 "closes this")
  if allowed_programs is None and carried:
    open_.append(f"the training program's constants: enough for a copy of the model's "
                 f"{params_bytes} bytes of params, so an update may return a model it carries "
                 "on the batches it was committed with, moved by them only in its last bits "
                 "or in one element a leaf (the program claim shows that other batches "
                 "change the params, not how much); pinning allowed_programs closes this")
  if allowed_programs is None:
    open_.append(
        f"the training program: any, and a program may embed up to {budget} bytes of "
        f"constants ({budget / max(eval_bytes, 1):.3g}× the evaluation set's {eval_bytes} "
        "bytes), unseen by probes" if budget >= eval_bytes else
        f"the training program: any, and a program may embed up to {budget} bytes of "
        f"constants, {budget / eval_bytes:.3g} of the evaluation set's {eval_bytes} bytes")
    if sum(1 for layout in definition["data_layout"] if layout.nbytes) > 1:  # as examples
      open_.append("the batch's leaves: a run whose batches carry a leaf the evaluation set "
                   "lacks has no whole example in common with it; only identifying leaves "
                   f"(distinct rows of {contamination.MIN_IDENTIFYING_BYTES} bytes or more) "
                   "are matched then")
  if definition["training_set"] is None:
    open_.append("the training set: probed rows are compared with the evaluation set only" + (
        "" if allowed_programs is not None else ", as a batch carries them: a program may "
        "change its batch before training on it (add one, XOR a key), so a run with no "
        "probed row in common with the evaluation set may still train on it"))
  elif definition["data_order"] is None:
    open_.append("the data order: a run may choose which training rows it draws and when "
                 "(probed rows are members of the set, at no index)")
  return open_


def public_benchmark(row: dict) -> dict:
  definition = parse_definition(row["definition"])
  pin = definition["training_set"]
  return {"name": row["full_name"], "metric": row["metric"], "audit": definition["audit"],
          "training_set": None if pin is None else {"root": pin["root"].hex(),
                                                    "size": pin["size"]},
          "higher_is_better": row["higher_is_better"], "aggregate": row["aggregate"],
          "program": row["program"], "rows": row["rows"],
          "min_update_check_probability": row["min_update_check_probability"],
          "allowed_programs": None if row["allowed_programs"] is None else json.loads(
              row["allowed_programs"]),
          **{k: definition[k].hex() if isinstance(definition[k], bytes) else definition[k]
             for k in pins.FIELDS},
          "public_rows": row["public_rows"], "created_at": row["created_at"],
          "left_open": left_open(definition, row["allowed_programs"])}

