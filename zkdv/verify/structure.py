"""Records into the verifier's own model: encoding, the hash chain, schemas.

Each record is checked against its kind's fields (``zkdv.records``, the definition
the server checks too) and handed to the reader of its type (an explicit table). What the verifier derives (layouts, record ids, where a
record sits) lives in its own dataclasses; the prover's record dicts are never
written to.

Example::

  transcript = read(contents, folder, report)
  transcript.steps[0].record_id, transcript.programs[0].state
"""

import dataclasses
import itertools
import pathlib

import blake3

from zkdv import config
from zkdv import digest
from zkdv import errors
from zkdv import programs
from zkdv import records
from zkdv import transcript as transcript_lib
from zkdv.verify import order
from zkdv.verify import probes
from zkdv.verify.report import INVALID, UNVERIFIABLE, Report

@dataclasses.dataclass(frozen=True)
class Program:
  """A program record as the verifier reads it: parsed layouts and its blob."""

  number: int
  program_id: bytes
  mode: str
  state: tuple  # LeafLayout per state leaf, as the program reads them
  post: tuple  # LeafLayout per state leaf, as the program writes them
  batch: tuple
  inputs: tuple  # "state" / "batch" per flat input
  post_state_outputs: tuple
  params_leaves: tuple
  platforms: tuple
  collectives: str | None
  compiler_options: dict | None
  blob: bytes | None  # None: missing or not matching its id (already a finding)
  where: str
  metric_outputs: dict = dataclasses.field(default_factory=dict)  # name -> output index

  @property
  def exact(self) -> bool:
    return self.mode == "exact"

  def input_indices(self, kind: str) -> list[int]:
    return [i for i, k in enumerate(self.inputs) if k == kind]


@dataclasses.dataclass(frozen=True)
class Init:
  """The init program of an attested start: its opened inputs and output digests."""

  program_id: bytes
  inputs: tuple  # LeafLayout per input (the PRNG key, example arguments)
  input_blobs: tuple
  outputs: tuple  # leaf digest per output
  platforms: tuple
  blob: bytes | None
  where: str
  # As a Program names them, so one loader screens, compiles and runs both.
  number: str = "init"
  collectives: str | None = None
  compiler_options: dict | None = None
  # A start from a base checkpoint: the layouts of its params (the first inputs, keypaths
  # relative to the base) and their declared params digest; () and None otherwise.
  base_layout: tuple = ()
  base_checkpoint: bytes | None = None


@dataclasses.dataclass(frozen=True)
class Step:
  """A step record; ``pre_state``/``post_state`` are None where it commits no state
  (only a segment's first and last steps do)."""

  index: int
  program: int
  pre_state: bytes | None
  batch: bytes
  post_state: bytes | None
  record_id: bytes
  where: str
  metrics: dict = dataclasses.field(default_factory=dict)  # name -> committed value
  data_rows: bytes | None = None  # the dataset rows it drew (zkdv.data), as committed


@dataclasses.dataclass(frozen=True)
class Segment:
  """Steps ``first .. last`` between two state commitments.

  ``start`` is the committed state before step ``first``; ``end`` after step
  ``last``, or None when the next segment starts without it (a discontinuity).
  """

  first: int
  last: int
  start: bytes
  end: bytes | None

  @property
  def length(self) -> int:
    return self.last - self.first + 1


@dataclasses.dataclass(frozen=True)
class Check:
  """A check record: the prover's fields, read-only, and where it sits."""

  step: int
  kind: str
  fields: dict
  where: str


@dataclasses.dataclass(frozen=True)
class Resume:
  """A resume record: steps go on at ``step`` from the committed post-state of step
  ``after``; steps ``after + 1 .. step - 1`` (an open segment) are discarded."""

  step: int
  after: int
  where: str

  @property
  def discarded(self) -> range:
    return records.discarded_steps(self.after, self.step)


@dataclasses.dataclass
class Transcript:
  """The verifier's model of a transcript (built by ``read``)."""

  folder: pathlib.Path
  records: int = 0
  transcript_id: bytes | None = None
  last_record_id: bytes | None = None
  root: dict | None = None
  init: Init | None = None
  data: object = None  # zkdv.data.Declaration of a data record
  programs: dict = dataclasses.field(default_factory=dict)  # number -> Program
  steps: list = dataclasses.field(default_factory=list)
  checks: dict = dataclasses.field(default_factory=dict)  # (step, kind) -> Check
  final: dict | None = None
  segments: list = dataclasses.field(default_factory=list)  # Segment, in order
  resumes: list = dataclasses.field(default_factory=list)  # Resume, in order

  def discarded(self, step: int) -> bool:
    """Whether a resume discarded ``step`` (it ran after the last committed state)."""
    return any(step in r.discarded for r in self.resumes)

  def program_of(self, step: Step) -> Program | None:
    return self.programs.get(step.program)

  def segment_ending(self, step: int) -> Segment | None:
    """The segment whose last step is ``step`` and that commits its end state."""
    for segment in self.segments:
      if segment.last == step and segment.end is not None:
        return segment
    return None


def read(contents, folder: pathlib.Path, report: Report) -> Transcript | None:
  """The model of ``contents`` (a ``transcript.TranscriptContents`` or, read one record at a
  time, a ``transcript.RecordReader``); None when there is nothing this verifier can read."""
  model = Transcript(folder)
  parsed = iter(contents.records)
  try:
    first = next(parsed, None)
    model.records = int(first is not None)
    if first is None or first.record.get("type") != "root":
      _torn_tail(contents, report)
      report.fail("no_root", "record 0", "the transcript does not start with a root record.")
      return None
    try:
      records.check_format(first.record, "record 0")
    except records.Invalid as e:
      report.fail("format_version", "record 0", f"could not verify: {e}", UNVERIFIABLE)
      return None
    _chain(itertools.chain([first], parsed), model, report)
  except errors.TranscriptFormatError as e:  # an item past the records read: not a record
    report.fail("unreadable", report.path, str(e), INVALID)
    return None
  except OSError as e:  # the file, read record by record (transcript.RecordReader)
    report.fail("unreadable", report.path, str(e), UNVERIFIABLE)
    return None
  finally:
    report.records = model.records
  _torn_tail(contents, report)
  model.segments = _segments(model, report)
  return model


def _torn_tail(contents, report: Report) -> None:
  tail = contents.torn_tail
  if tail is not None:
    report.fail("torn_tail", f"byte {tail.offset}",
                f"the last {tail.nbytes} bytes are not a complete record "
                f"({tail.reason}); the transcript did not finish.", UNVERIFIABLE)


def _segments(model: Transcript, report: Report) -> list:
  """The segments the step records delimit: one starts at a step carrying
  ``pre_state`` and ends at the next step carrying ``post_state``."""
  segments, first, start = [], None, None
  resumed_at = {r.step for r in model.resumes}
  for step in model.steps:
    if step.index in resumed_at:
      if step.pre_state is None:
        report.fail("resume", step.where, f"step {step.index} follows a resume record but "
                    "carries no pre_state: a resumed run starts a segment.")
      first = None  # an open segment before it was discarded
    if step.pre_state is not None:
      if first is not None:  # the segment before has no end commitment
        segments.append(Segment(first, step.index - 1, start, None))
      first, start = step.index, step.pre_state
    elif first is None:
      report.fail("segment", step.where, f"step {step.index} follows the end of a segment "
                  "but carries no pre_state: a segment starts with its committed state.")
      first, start = step.index, b""
    if step.post_state is not None:
      segments.append(Segment(first, step.index, start, step.post_state))
      first = None
  if first is not None:
    last = model.steps[-1]
    report.fail("segment", last.where, f"the last step ({last.index}) commits no post_state: "
                f"the segment from step {first} has no end state.")
    segments.append(Segment(first, last.index, start, None))
  return segments


def _chain(parsed_records, model: Transcript, report: Report) -> None:
  prev = None
  for i, parsed in enumerate(parsed_records):
    model.records = i + 1
    rec, where = parsed.record, f"record {i}"
    if transcript_lib.encode_record(rec) != parsed.raw:
      report.fail("encoding", where, "record is not in deterministic CBOR encoding.")
    if i == 0:
      if "prev" in rec:
        report.fail("chain", where, "the root must not carry prev.")
      model.transcript_id = parsed.record_id
      report.transcript_id = parsed.record_id.hex()
    elif rec.get("prev") != prev:
      report.fail("chain", where, "prev does not match the id of the record before it "
                  "(a record was removed, inserted, reordered or edited).")
    prev = model.last_record_id = parsed.record_id
    try:
      kind = records.check_record(rec, where)
    except records.UnknownField as e:  # read all the same: its listed fields match
      report.fail("schema", where, str(e))
      kind = rec["type"]
    except records.Invalid as e:
      report.fail("schema", where, str(e))
      continue
    if model.final is not None:
      report.fail("after_final", where, f"a {kind} record follows the final record.")
    _READERS[kind](model, parsed, where, report)


def _read_root(model, parsed, where, report) -> None:
  rec = parsed.record
  if model.root is not None:
    report.fail("schema", where, "a second root record.")
    return
  model.root = rec
  report.name = rec["name"]


def _read_program(model, parsed, where, report) -> None:
  rec = parsed.record
  if rec["blob"] != rec["program_id"]:
    report.fail("program_id", where, "program blob and program id differ.")
  layouts = programs.check_program(rec, where)  # zkdv.records applied its rules already
  program = Program(rec["number"], rec["program_id"], rec["mode"], layouts.state,
                    layouts.post, layouts.batch, tuple(rec["inputs"]),
                    tuple(rec["post_state_outputs"]), tuple(rec.get("params_leaves", [])),
                    tuple(rec["platforms"]), rec.get("collectives"),
                    rec.get("compiler_options"),
                    _program_blob(model.folder, rec["program_id"], where, report), where,
                    layouts.metric_outputs)
  if program.number != len(model.programs):
    report.fail("program_id", where,
                f"program number {program.number}, expected {len(model.programs)}.")
  paths = [l.path for l in program.state]
  for other in model.programs.values():  # one state, one set of params (the program claim)
    if [l.path for l in other.state] == paths and other.params_leaves != program.params_leaves:
      report.fail("schema", where, f"params_leaves {list(program.params_leaves)[:8]} differ "
                  f"from {list(other.params_leaves)[:8]} of program {other.number} over the "
                  "same state: which leaves are params is the state's, not each program's.")
      break
  scalars = [l for l in program.batch if not l.shape and l.key_impl is None]
  if sum(l.nbytes for l in scalars) > config.MAX_SCALAR_BATCH_BYTES:
    report.fail("unprobed", where, f"the batch carries {sum(l.nbytes for l in scalars)} bytes "
                f"in {len(scalars)} scalar leaves ({', '.join(l.path for l in scalars[:4])}"
                f"{', ...' if len(scalars) > 4 else ''}), over the budget of "
                f"{config.MAX_SCALAR_BATCH_BYTES} bytes a step: scalars have no rows to "
                "sample, so pass data as arrays with a leading batch axis.")
  model.programs[program.number] = program


def _program_blob(folder, pid: bytes, where, report) -> bytes | None:
  """The blob named ``pid``; None (with a finding) when it is missing or differs."""
  try:
    data = transcript_lib.blob_path(folder, pid).read_bytes()
  except (OSError, errors.TranscriptFormatError) as e:
    report.fail("missing_blob", where, f"program blob {pid.hex()}: {e}", UNVERIFIABLE)
    return None
  if blake3.blake3(data).digest() != pid:
    report.fail("program_id", where,
                f"program blob {pid.hex()[:16]}… does not hash to the program id.")
    return None
  return data


def _read_init(model, parsed, where, report) -> None:
  rec = parsed.record
  if model.init is not None or model.programs or model.steps:
    report.fail("schema", where, "an init record comes once, before any program or step.")
    return
  inputs, base = programs.check_init(rec, where)  # zkdv.records applied its rules already
  problem = _base_problem(rec, base, inputs)
  if problem:  # the start does not hold; nothing else reads a base that is not one
    report.fail("start", where, f"the init record's base checkpoint: {problem}.")
    base, rec = (), {k: v for k, v in rec.items() if k != "base_checkpoint"}
  model.init = Init(rec["program_id"], inputs, tuple(rec["input_blobs"]),
                    tuple(rec["outputs"]), tuple(map(str, rec["platforms"])),
                    _program_blob(model.folder, rec["program_id"], where, report), where,
                    base_layout=base, base_checkpoint=rec.get("base_checkpoint"))


def _base_problem(rec: dict, base: tuple, inputs: tuple) -> str | None:
  """What is wrong with a start from a base checkpoint: ``base_layout`` and
  ``base_checkpoint`` come together, and each base leaf is the init input at its position."""
  if ("base_layout" in rec) != ("base_checkpoint" in rec):
    return "base_layout and base_checkpoint come together"
  if "base_layout" in rec and not 0 < len(base) <= len(inputs):
    return "base_layout names 1 to as many leaves as the init program has inputs"
  for leaf, given in zip(base, inputs):
    if ((leaf.dtype, leaf.shape) != (given.dtype, given.shape) or leaf.key_impl
        or leaf.pieces or given.key_impl):
      return f"base leaf {leaf.path} is not the init input {given.path}"
  return None


def _read_step(model, parsed, where, report) -> None:
  rec = parsed.record
  expected = len(model.steps)
  if rec["index"] != expected:
    report.fail("step_index", where, f"step index {rec['index']}, expected {expected}.")
  program = model.programs.get(rec["program"])
  if program is None:
    report.fail("program_id", where, "step refers to a program not declared before it.")
  step_metrics = rec.get("metrics", {})  # well-formed: zkdv.records checked them
  problems = [] if program is None else [
      f"metric {name!r} is not an output of program {program.number}"
      for name in step_metrics if name not in program.metric_outputs]
  if problems:
    report.fail("schema", where, f"step {expected}: {'; '.join(problems[:3])}.")
    step_metrics = {}
  leaves = rec.get("post_state_leaves")
  if leaves is not None and (program is None or rec.get("post_state") is None or not pieces_make(
      program.post, leaves, rec["post_state"])):
    report.fail("schema", where, f"step {expected}: post_state_leaves do not make up its "
                "post_state.")
  model.steps.append(Step(expected, rec["program"], rec.get("pre_state"), rec["batch"],
                          rec.get("post_state"), parsed.record_id, where, step_metrics,
                          rec.get("data_rows")))


def pieces_make(layouts, pieces, state: bytes) -> bool:
  """Whether per-leaf piece digests match ``layouts`` and make up the state digest."""
  return (isinstance(pieces, list) and len(pieces) == len(layouts) and all(isinstance(p, list) and len(p) == len(l.boxes) and all(
      isinstance(d, bytes) for d in p) for p, l in zip(pieces, layouts))
          and digest.state_digest_from_pieces(layouts, pieces) == state)


def _read_check(model, parsed, where, report) -> None:
  rec = parsed.record
  kind, step = rec["kind"], rec["step"]
  if not 0 <= step < len(model.steps):
    report.fail("check_step", where, f"a {kind} check of step {step} comes before that "
                "step's record (or names no step).")
    return
  if (step, kind) in model.checks:
    report.fail("schema", where, f"a second {kind} check of step {step}.")
    return
  if kind == "probe":  # its rows' hashes, not their bytes
    program = model.program_of(model.steps[step])
    rec = probes.kept(rec, () if program is None else program.batch,
                      dataset=model.data is not None)
  model.checks[(step, kind)] = Check(step, kind, rec, where)


def _read_resume(model, parsed, where, report) -> None:
  """A resume continues the step indices from the post-state of the last step that
  committed one; only steps after it (whose segment has no end) may be discarded."""
  rec = parsed.record
  steps, after = model.steps, rec["after"]
  if rec["step"] != len(steps):
    report.fail("resume", where, f"a resume at step {rec['step']}; the next step is "
                f"{len(steps)} (step indices go on across a resume).")
    return
  if after >= len(steps) or steps[after].post_state != rec["state"]:
    report.fail("resume", where, f"the resumed state is not the committed post-state of "
                f"step {after}.")
    return
  committed_later = [s.index for s in steps[after + 1:] if s.post_state is not None]
  if committed_later:
    report.fail("resume", where, f"the resume goes back to step {after}, past the committed "
                f"post-state of step {committed_later[-1]}: only steps after the last "
                "committed state may be discarded.")
    return
  resume = Resume(rec["step"], after, where)
  model.resumes.append(resume)
  lost = resume.discarded
  discarded = ("" if not lost else f"; step {lost[0]} ran after it and was discarded" if
               len(lost) == 1 else f"; steps {lost[0]}..{lost[-1]} ran after it and were "
               "discarded")
  report.notes.append(f"resumed at step {resume.step} from the committed post-state of "
                      f"step {after}{discarded} (no state after them was used).")


def _read_final(model, parsed, where, report) -> None:
  del where, report  # its fields are checked by zkdv.verify.final
  model.final = parsed.record


_READERS = {"root": _read_root, "init": _read_init, "data": order.read_data,
            "program": _read_program, "step": _read_step,
            "check": _read_check, "resume": _read_resume, "final": _read_final}
