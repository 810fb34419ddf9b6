"""The offline, fail-closed transcript verifier (DESIGN §7).

``verify(path)`` checks every record, the hash chain, continuity, programs,
sampling decisions, blobs and openings, and replays every update check through
the deserialized exported program. It never raises on bad input: every problem
becomes a finding, and only a transcript without findings is ``verified``.

Example::

  report = verify("zkdv-proofs/my-run-...")
  print(report.verdict, report.exit_code)
"""

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable

import blake3
import numpy as np

from zkdv import digest
from zkdv import errors
from zkdv import merkle
from zkdv import sampling
from zkdv import transcript
from zkdv.config import Tolerance

VERIFIED, INVALID, UNVERIFIABLE = "verified", "invalid", "could not verify"
# How a multi-device program's collectives ran (``zkdv.jax.replay.collectives``).
COLLECTIVES = ("default", "in-process", "gloo", "mpi", "megascale")
EXIT_CODES = {VERIFIED: 0, INVALID: 1, UNVERIFIABLE: 2}

# Fields a record of each type may carry besides those it must (any other is an error).
OPTIONAL_FIELDS = {
    "root": {"device_kinds", "processes"},
    "program": {"function", "params_leaves", "static_arguments", "compiler_options",
                "nr_devices", "collectives", "processes", "post_state_layout"},
    "step": {"probes", "batch_roots"},
    "check": {"pre_state_blobs", "batch_blobs", "post_state_blobs", "result",
              "pre_state_pieces"},
    "final": {"discontinuities", "final_state", "final_state_leaves", "final_params"},
}

# Fields every record of a type must carry, with their types.
_BYTES, _INT, _STR, _LIST, _DICT = bytes, int, str, list, dict
SCHEMAS = {
    "root": {"format_version": _INT, "prover": _STR, "name": _STR, "versions": _DICT,
             "platform": _STR, "config": _DICT, "start": _DICT,
             "seed_commitment": _BYTES},
    "program": {"program_id": _BYTES, "number": _INT, "blob": _BYTES, "mode": _STR,
                "state_layout": _LIST, "batch_layout": _LIST, "inputs": _LIST,
                "post_state_outputs": _LIST, "platforms": _LIST},
    "step": {"index": _INT, "program": _INT, "pre_state": _BYTES, "batch": _BYTES,
             "post_state": _BYTES},
    "check": {"step": _INT, "kind": _STR},
    "final": {"steps": _INT, "seed": _BYTES, "status": _STR},
}


@dataclasses.dataclass
class Finding:
  """One thing that failed: a machine code, where it is, and what happened."""

  code: str
  where: str
  message: str
  blocks: str = INVALID  # the verdict this finding forces

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass
class CheckOutcome:
  step: int
  kind: str
  mode: str
  status: str  # "verified", "failed", "not replayed"
  max_abs_error: float = 0.0
  max_rel_error: float = 0.0
  max_ulp_error: int = 0


@dataclasses.dataclass
class Report:
  path: str
  transcript_id: str | None = None
  name: str | None = None
  records: int = 0
  steps: int = 0
  finished: bool = False
  checks: list[CheckOutcome] = dataclasses.field(default_factory=list)
  discontinuities: list[int] = dataclasses.field(default_factory=list)
  probed_rows: int = 0
  findings: list[Finding] = dataclasses.field(default_factory=list)

  @property
  def verdict(self) -> str:
    if any(f.blocks == INVALID for f in self.findings):
      return INVALID
    if self.findings:
      return UNVERIFIABLE
    return VERIFIED

  @property
  def exit_code(self) -> int:
    return EXIT_CODES[self.verdict]

  def fail(self, code: str, where: str, message: str, blocks: str = INVALID) -> None:
    self.findings.append(Finding(code, where, message, blocks))

  def to_json(self) -> dict:
    return {
        "path": self.path, "transcript_id": self.transcript_id, "name": self.name,
        "verdict": self.verdict, "exit_code": self.exit_code,
        "records": self.records, "steps": self.steps, "finished": self.finished,
        "checks": [dataclasses.asdict(c) for c in self.checks],
        "discontinuities": self.discontinuities, "probed_rows": self.probed_rows,
        "findings": [f.to_json() for f in self.findings],
    }

  def dumps(self) -> str:
    return json.dumps(self.to_json(), indent=2)


class _Replayer:
  """Deserializes and compiles each program once (imports JAX lazily)."""

  def __init__(self):
    from zkdv.jax import arrays, replay  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    self._jax, self._arrays, self._replay = jax, arrays, replay
    self._compiled = {}

  def platform(self) -> str:
    return self._jax.devices()[0].platform

  def run(self, program: dict, blob: bytes, inputs, layouts):
    key = program["program_id"]
    self._replay.check_collectives(program.get("collectives"))
    if key not in self._compiled:
      options = program.get("compiler_options") or None
      self._compiled[key] = self._replay.compile_program(
          self._jax.export.deserialize(bytearray(blob)), compiler_options=options)
    outs = self._compiled[key](*[self._arrays.from_host(a, l)
                                 for a, l in zip(inputs, layouts)])
    return [self._arrays.host_view(outs[i]) for i in program["post_state_outputs"]]

  def compare(self, *args, **kwargs):
    return self._replay.compare(*args, **kwargs)


def verify(path: str | os.PathLike, *, replay: str = "sampled",
           progress: Callable[[int, int], None] | None = None) -> Report:
  """Verifies the transcript at ``path`` (a folder or its records file)."""
  if replay not in ("sampled", "none"):
    raise ValueError(f"replay must be 'sampled' or 'none', got {replay!r}.")
  path = pathlib.Path(path)
  report = Report(path=str(path))
  try:
    contents = transcript.read_transcript(path)
  except (OSError, errors.TranscriptFormatError) as e:
    report.fail("unreadable", str(path), str(e),
                UNVERIFIABLE if isinstance(e, OSError) else INVALID)
    return report
  folder = transcript.records_path(path).parent
  try:
    _Verification(report, contents, folder, replay, progress).run()
  except Exception as e:  # fail closed: malformed input never crashes the verifier
    report.fail("malformed", "transcript", f"verification stopped on malformed "
                f"content: {type(e).__name__}: {e}")
  return report


class _Verification:

  def __init__(self, report, contents, folder, replay, progress):
    self.report, self.contents, self.folder = report, contents, folder
    self.replay_mode, self.progress = replay, progress
    self.programs: dict[int, dict] = {}  # by number, as steps name them
    self.program_blobs: dict[bytes, bytes] = {}
    self.steps: list[dict] = []
    self.checks: list[dict] = []
    self.root: dict | None = None
    self.final: dict | None = None
    self.replayer = None

  def run(self) -> None:
    report = self.report
    report.records = len(self.contents.records)
    if self.contents.torn_tail is not None:
      tail = self.contents.torn_tail
      report.fail("torn_tail", f"byte {tail.offset}",
                  f"the last {tail.nbytes} bytes are not a complete record "
                  f"({tail.reason}); the transcript did not finish.", UNVERIFIABLE)
    if not self._structure():
      return
    self._steps()
    self._final()
    self._run_checks()

  # -- records and the chain -------------------------------------------------

  def _structure(self) -> bool:
    report, prev = self.report, None
    for i, parsed in enumerate(self.contents.records):
      rec, where = parsed.record, f"record {i}"
      if transcript.encode_record(rec) != parsed.raw:
        report.fail("encoding", where, "record is not in deterministic CBOR encoding.")
      kind = rec.get("type")
      if kind not in SCHEMAS:
        report.fail("schema", where, f"unknown record type {kind!r}.")
        prev = parsed.record_id
        continue
      missing = [f"{k} ({t.__name__})" for k, t in SCHEMAS[kind].items()
                 if not isinstance(rec.get(k), t) or isinstance(rec.get(k), bool)]
      if missing:
        report.fail("schema", where, f"{kind} record lacks or mistypes {missing}.")
      unknown = set(rec) - set(SCHEMAS[kind]) - OPTIONAL_FIELDS[kind] - {"type", "prev"}
      if unknown:
        report.fail("schema", where, f"{kind} record has unknown fields {sorted(map(repr, unknown))}.")
      if i == 0:
        if kind != "root" or "prev" in rec:
          report.fail("chain", where, "the first record must be a root without prev.")
        report.transcript_id = parsed.record_id.hex()
      elif rec.get("prev") != prev:
        report.fail("chain", where, "prev does not match the id of the record before it "
                    "(a record was removed, inserted, reordered or edited).")
      prev = parsed.record_id
      if missing:
        continue
      if self.final is not None:
        report.fail("after_final", where, f"a {kind} record follows the final record.")
      getattr(self, f"_take_{kind}")(rec, where)
    if self.root is None:
      report.fail("no_root", "record 0", "the transcript has no root record.")
      return False
    return True

  def _take_root(self, rec, where) -> None:
    if self.root is not None:
      self.report.fail("schema", where, "a second root record.")
      return
    self.root = rec
    self.report.name = rec["name"]
    if rec["format_version"] != transcript.FORMAT_VERSION:
      self.report.fail("format_version", where,
                       f"format version {rec['format_version']} is not "
                       f"{transcript.FORMAT_VERSION}; use a matching zkdv.", UNVERIFIABLE)
    if rec["prover"] != transcript.PROVER:
      self.report.fail("schema", where, f"unknown prover {rec['prover']!r}.")

  def _take_program(self, rec, where) -> None:
    pid = rec["program_id"]
    if rec["blob"] != pid:
      self.report.fail("program_id", where, "program blob and program id differ.")
    try:
      data = transcript.blob_path(self.folder, pid).read_bytes()
    except (OSError, errors.TranscriptFormatError) as e:
      self.report.fail("missing_blob", where, f"program blob {pid.hex()}: {e}", UNVERIFIABLE)
      data = None
    if data is not None and blake3.blake3(data).digest() != pid:
      self.report.fail("program_id", where,
                       f"program blob {pid.hex()[:16]}… does not hash to the program id.")
      data = None
    try:
      rec["_state"] = [digest.LeafLayout.from_record(l) for l in rec["state_layout"]]
      # The post-state is laid out as the program places its outputs (by default as its inputs).
      rec["_post"] = [digest.LeafLayout.from_record(l)
                      for l in rec.get("post_state_layout", rec["state_layout"])]
      if [(l.path, l.dtype, l.shape) for l in rec["_post"]] != [
          (l.path, l.dtype, l.shape) for l in rec["_state"]]:
        raise ValueError("post_state_layout does not match state_layout")
      rec["_batch"] = [digest.LeafLayout.from_record(l) for l in rec["batch_layout"]]
      for l in rec["_state"] + rec["_post"] + rec["_batch"]:
        digest.numpy_dtype(l.dtype)
        if not all(isinstance(n, int) and 0 <= n < 2**40 for n in l.shape):
          raise ValueError(f"shape {l.shape} of {l.path}")
      if sorted(rec["inputs"]) != sorted(["state"] * len(rec["_state"])
                                         + ["batch"] * len(rec["_batch"])):
        raise ValueError("inputs do not match the layouts")
      if not all(isinstance(i, int) and 0 <= i < len(rec["_state"])
                 for i in rec.get("params_leaves", [])):
        raise ValueError("params_leaves out of range")
      if len(rec["post_state_outputs"]) != len(rec["_state"]):
        raise ValueError("post_state_outputs do not match the state layout")
      if rec.get("collectives", "default") not in COLLECTIVES:
        raise ValueError(f"unknown collectives {rec['collectives']!r}")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
      self.report.fail("schema", where, f"program layout is malformed: {e!r}.")
      return
    if rec["number"] != len(self.programs):
      self.report.fail("program_id", where, f"program number {rec['number']}, expected "
                       f"{len(self.programs)}.")
    self.programs[rec["number"]] = rec
    if data is not None:
      self.program_blobs[pid] = data

  def _take_step(self, rec, where) -> None:
    expected = len(self.steps)
    if rec["index"] != expected:
      self.report.fail("step_index", where, f"step index {rec['index']}, expected {expected}.")
    if rec["program"] not in self.programs:
      self.report.fail("program_id", where, "step refers to a program not declared before it.")
    self.steps.append(rec)

  def _take_check(self, rec, where) -> None:
    rec["_where"] = where
    self.checks.append(rec)

  def _take_final(self, rec, where) -> None:
    self.final = rec

  # -- steps, continuity, sampling --------------------------------------------

  def _steps(self) -> None:
    report = self.report
    report.steps = len(self.steps)
    for prev, step in zip(self.steps, self.steps[1:]):
      if step["pre_state"] != prev["post_state"]:
        report.discontinuities.append(step["index"])
        report.fail("discontinuity", f"step {step['index']}",
                    f"pre-state of step {step['index']} is not the post-state of "
                    f"step {prev['index']}: the state was changed outside proof.jit.")

  def _final(self) -> None:
    report, final = self.report, self.final
    if final is None:
      report.fail("unfinished", "end", "no final record: the transcript did not finish "
                  "(training crashed or finish() was not called).", UNVERIFIABLE)
      return
    report.finished = True
    if final["status"] != "clean":
      report.fail("aborted", "final", f"the prover ended with status {final['status']!r}.")
    if final["steps"] != len(self.steps):
      report.fail("step_count", "final",
                  f"final says {final['steps']} steps, the transcript has {len(self.steps)}.")
    if final.get("discontinuities", []) != report.discontinuities:
      report.fail("final", "final", f"final lists discontinuities "
                  f"{final.get('discontinuities')}, the steps show {report.discontinuities}.")
    if self.steps:
      self._final_state(final, self.steps[-1])
    seed = final["seed"]
    if sampling.seed_commitment(seed) != self.root["seed_commitment"]:
      report.fail("seed", "final", "the revealed seed does not match the root's seed "
                  "commitment; sampling decisions cannot be trusted.")
      return
    self._probes(seed)
    config = self.root["config"]
    have = {(c["step"], c["kind"]) for c in self.checks}
    for kind in sampling.CHECK_KINDS:
      p = config.get(f"{kind}_check_probability", 0.0)
      for t in range(len(self.steps)):
        if sampling.is_sampled(seed, kind, t, p) and (t, kind) not in have:
          report.fail("missing_check", f"step {t}",
                      f"step {t} was sampled for a {kind} check but has none.")

  def _probes(self, seed: bytes) -> None:
    """Data probes: the rows the seed selects, each proven in its leaf's row tree."""
    ratio = self.root["start"].get("probe_ratio", 0.0)
    for t, step in enumerate(self.steps):
      program = self.programs.get(step["program"])
      if program is None:
        continue
      where = f"step {t}"
      layouts = program["_batch"]
      expected = {(leaf, row) for leaf, l in enumerate(layouts)
                  if l.key_impl is None and l.shape
                  for row in sampling.probe_rows(seed, t, leaf, l.rows, ratio)}
      probes = step.get("probes", [])
      if not isinstance(probes, list):
        self.report.fail("probe", where, "probes must be a list.")
        continue
      if not probes and not expected:
        continue
      roots = step.get("batch_roots")
      if (not isinstance(roots, list) or len(roots) != len(layouts)
          or digest.batch_digest(layouts, roots) != step["batch"]):
        self.report.fail("probe", where, "batch_roots do not make up the batch digest.")
        continue
      opened = set()
      for entry in probes:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], int)
                and isinstance(entry[1], int) and 0 <= entry[0] < len(layouts)
                and isinstance(entry[3], list)):
          self.report.fail("probe", where, f"malformed probe entry {entry!r:.80}.")
          continue
        leaf, row, blob, proof = entry
        layout = layouts[leaf]
        opened.add((leaf, row))
        try:
          data = transcript.read_blob(self.folder, blob, "uint8",
                                      (layout.nbytes // max(layout.rows, 1),))
        except FileNotFoundError:
          self.report.fail("missing_blob", where, f"probe blob of row {row} of {layout.path} "
                           "is missing.", UNVERIFIABLE)
          continue
        except (OSError, errors.TranscriptFormatError, TypeError, ValueError) as e:
          self.report.fail("probe", where, f"probe of row {row} of {layout.path}: {e}")
          continue
        if not merkle.verify_inclusion(merkle.leaf_hash(data.tobytes()), row, layout.rows,
                                       proof, roots[leaf]):
          self.report.fail("probe", where, f"probe of row {row} of {layout.path} is not in "
                           "the committed batch (its Merkle proof fails).")
      if opened != expected:
        self.report.fail("probe", where, f"opened rows {sorted(opened)} but the seed selects "
                         f"{sorted(expected)}.")
      self.report.probed_rows += len(probes)

  def _final_state(self, final, last_step) -> None:
    report = self.report
    if final.get("final_state") != last_step["post_state"]:
      report.fail("final_state", "final", "final state digest is not the last step's post-state.")
      return
    program = self.programs.get(last_step["program"])
    leaves = final.get("final_state_leaves")
    if program is None:
      return
    layouts = program["_post"]
    if (not isinstance(leaves, list) or len(leaves) != len(layouts)
        or not all(isinstance(p, list) and len(p) == len(l.boxes)
                   and all(isinstance(d, bytes) for d in p) for p, l in zip(leaves, layouts))
        or digest.state_digest_from_pieces(layouts, leaves) != final["final_state"]):
      report.fail("final_state", "final", "final state piece digests do not make up the "
                  "final state digest.")
      return
    if "final_params" not in final and final["status"] != "clean":
      return  # an aborted prover may not know its final params (already a finding)
    params_leaves = program.get("params_leaves", [])
    whole = [p[0] for p in leaves]
    if any(layouts[i].pieces is not None for i in params_leaves):
      # Sharded params: final_params holds whole-leaf digests, which a state check of the
      # last step names (its blobs are named by them); without one it is not derivable.
      opened = next((c.get("post_state_blobs") for c in self.checks
                     if c.get("kind") == "state" and c.get("step") == last_step["index"]), None)
      if not isinstance(opened, list) or len(opened) != len(layouts):
        return
      whole = opened
    params = digest.params_digest([dataclasses.replace(l, pieces=None) for l in layouts],
                                  whole, params_leaves)
    if final.get("final_params") != params:
      report.fail("final_params", "final", "final params digest is not the digest of the "
                  "final state's params.")

  # -- checks ----------------------------------------------------------------

  def _run_checks(self) -> None:
    steps = {s["index"]: s for s in self.steps}
    tolerance = Tolerance(self.root["config"].get("rtol", 0.0),
                          self.root["config"].get("atol", 0.0))
    for n, check in enumerate(self.checks):
      if self.progress:
        self.progress(n, len(self.checks))
      where = f"{check['_where']} (check of step {check['step']})"
      step = steps.get(check["step"])
      if step is None or step["program"] not in self.programs:
        self.report.fail("check_step", where, "check refers to an unknown step.")
        continue
      program = self.programs[step["program"]]
      if check["kind"] == "state":
        self._state_check(check, step, program, where)
      elif check["kind"] == "update":
        self._update_check(check, step, program, where, tolerance)
      else:
        self.report.fail("schema", where, f"unknown check kind {check['kind']!r}.")
    if self.progress:
      self.progress(len(self.checks), len(self.checks))

  def _bad_pieces(self, blob, layout, pieces) -> list:
    """The boxes of a sharded leaf whose bytes in ``blob`` differ from ``pieces``."""
    try:
      data = transcript.blob_path(self.folder, blob).read_bytes()
      array = np.frombuffer(data, digest.numpy_dtype(layout.dtype)).reshape(layout.shape)
      return [box for box, got, want in zip(layout.boxes, digest.piece_digests(layout, array),
                                            pieces) if got != want]
    except (OSError, ValueError, TypeError, errors.TranscriptFormatError):
      return []

  def _open(self, blobs, layouts, where, what, pieces=None):
    if not isinstance(blobs, list) or len(blobs) != len(layouts):
      self.report.fail("schema", where, f"{what} blobs do not match the program layout.")
      return None
    arrays = []
    for b, l in zip(blobs, layouts):
      try:
        arrays.append(transcript.read_blob(self.folder, b, l.dtype, l.shape))
      except FileNotFoundError:
        self.report.fail("missing_blob", where, f"{what} blob for {l.path} is missing.",
                         UNVERIFIABLE)
        return None
      except (OSError, errors.TranscriptFormatError, TypeError) as e:
        bad = self._bad_pieces(b, l, pieces[len(arrays)]) if pieces and l.pieces else []
        named = "".join(f"; shard {l.pieces.index(box)} {list(map(list, box))} differs from "
                        "its commitment" for box in bad)
        self.report.fail("blob", where, f"{what} blob for {l.path}: {e}{named}")
        return None
    return arrays

  def _state_check(self, check, step, program, where) -> None:
    post = self._open(check.get("post_state_blobs"), program["_post"], where, "post-state")
    ok = post is not None and self._state_matches(check["post_state_blobs"], post,
                                                  program["_post"], step["post_state"], where,
                                                  "post-state")
    self.report.checks.append(CheckOutcome(step["index"], "state", "opening",
                                           "verified" if ok else "failed"))

  def _state_matches(self, blobs, arrays, layouts, committed, where, what) -> bool:
    """Opened blobs were checked against their names, which are the whole-leaf digests;
    a sharded leaf's pieces are hashed from the opened array."""
    pieces = [[b] if l.pieces is None else digest.piece_digests(l, a)
              for b, a, l in zip(blobs, arrays, layouts)]
    if digest.state_digest_from_pieces(layouts, pieces) != committed:
      self.report.fail("opening", where, f"opened {what} does not match its commitment.")
      return False
    return True

  def _update_check(self, check, step, program, where, tolerance) -> None:
    exact = program["mode"] == "exact"
    outcome = CheckOutcome(step["index"], "update", program["mode"], "failed")
    self.report.checks.append(outcome)
    pieces = check.get("pre_state_pieces")
    if pieces is not None and digest.state_digest_from_pieces(
        program["_state"], pieces) != step["pre_state"]:
      self.report.fail("opening", where, "pre_state_pieces do not make up the pre-state digest.")
      return
    pre = self._open(check.get("pre_state_blobs"), program["_state"], where, "pre-state",
                     pieces)
    batch = self._open(check.get("batch_blobs"), program["_batch"], where, "batch")
    if pre is None or batch is None:
      return
    if not self._state_matches(check["pre_state_blobs"], pre, program["_state"],
                               step["pre_state"], where, "pre-state"):
      return
    if digest.digest_batch_arrays(program["_batch"], batch) != step["batch"]:
      self.report.fail("opening", where, "opened batch does not match its commitment.")
      return
    post = None
    if not exact:
      post = self._open(check.get("post_state_blobs"), program["_post"], where, "post-state")
      if post is None or not self._state_matches(check["post_state_blobs"], post,
                                                 program["_post"], step["post_state"], where,
                                                 "post-state"):
        return
    if self.replay_mode == "none":
      outcome.status = "not replayed"
      return
    replayed = self._replay(program, pre, batch, where)
    if replayed is None:
      return
    if exact:
      ok = digest.digest_state_arrays(program["_post"], replayed)[0] == step["post_state"]
      if not ok:
        self.report.fail("replay", where,
                         "replaying the update program does not reproduce the committed "
                         "post-state bit for bit.")
      outcome.status = "verified" if ok else "failed"
      return
    result = self.replayer.compare(program["_state"], replayed, post, exact=False,
                                   tolerance=tolerance)
    outcome.max_abs_error = result["max_abs_error"]
    outcome.max_rel_error = result["max_rel_error"]
    outcome.max_ulp_error = result["max_ulp_error"]
    outcome.status = "verified" if result["equal"] else "failed"
    if not result["equal"]:
      self.report.fail("replay", where, f"replay differs beyond tolerance in "
                       f"{result['mismatched_leaves']} (max abs {result['max_abs_error']:.3g}).")

  def _replay(self, program, pre, batch, where):
    blob = self.program_blobs.get(program["program_id"])
    if blob is None:
      self.report.fail("missing_blob", where, "program blob unavailable; cannot replay.",
                       UNVERIFIABLE)
      return None
    try:
      if self.replayer is None:
        self.replayer = _Replayer()
    except ImportError as e:
      self.report.fail("no_jax", where, f"replay needs JAX: {e}. Install dvbench[jax].",
                       UNVERIFIABLE)
      return None
    if self.replayer.platform() not in program["platforms"]:
      self.report.fail("platform", where, f"program was exported for {program['platforms']}, "
                       f"this machine runs {self.replayer.platform()}.", UNVERIFIABLE)
      return None
    inputs, layouts = [], []
    state_it, batch_it = iter(zip(pre, program["_state"])), iter(zip(batch, program["_batch"]))
    for kind in program["inputs"]:
      a, l = next(state_it if kind == "state" else batch_it)
      inputs.append(a)
      layouts.append(l)
    try:
      return self.replayer.run(program, self.program_blobs[program["program_id"]],
                               inputs, layouts)
    except errors.ReplayError as e:  # fewer devices, or other collectives, than it needs
      self.report.fail("replay_environment", where, str(e), UNVERIFIABLE)
      return None
    except Exception as e:  # a malformed program is a finding, not a crash
      self.report.fail("replay_error", where, f"replay raised {type(e).__name__}: {e}")
      return None
