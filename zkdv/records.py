"""The one definition of each transcript record kind: its fields, their types and bounds.

The server checks every record it ingests (``dvbench.server.custody``) and the verifier
every record it reads (``zkdv.verify.structure``) with ``check_record``: a field is
added, typed or bounded here and nowhere else (docs/protocol.md describes each). A
record must carry its kind's required fields, each listed field must match its spec,
and a field its kind does not list is refused (``UnknownField``); the rules across a
program's (or init's) fields follow (``zkdv.programs``). A refusal names the field, e.g.
``record 1 (step).index: an integer in [0, 2**40), got -1.``

Example::

  check_record({"type": "step", "index": 0, "program": 0, "batch": bytes(32),
                "prev": bytes(32)}, "record 1")  # returns "step"
  fields_of({"type": "check", "kind": "state"})  # type, step, kind, post_state_blobs, prev
"""

import re

from zkdv import challenge
from zkdv import data
from zkdv import errors
from zkdv import metrics
from zkdv import programs
from zkdv import transcript
from zkdv.fields import (MAX_TEXT, Bytes, Either, Field, Int, Invalid, ListOf, Map,
                         Optional, Row, Spec, Text, UnknownField, check_fields, describe)

MODES = ("exact", "equivalent")
# How a multi-device program's collectives ran (``zkdv.jax.replay.collectives``).
COLLECTIVES = ("default", "in-process", "gloo", "mpi", "megascale")
CHECK_KINDS = (*challenge.ANSWER_KINDS, "start")  # "start": the attested start's link


class FormatVersion(Spec):
  """The transcript format this zkdv reads (``zkdv.transcript.check_format``)."""

  def check(self, value, where):
    try:
      transcript.check_format(value)
    except errors.UnsupportedFormatError as e:
      raise Invalid(f"{where}: {e}") from None


class StepMetrics(Spec):
  """A step's committed metrics (``zkdv.metrics``: bounded names, exact values)."""

  def check(self, value, where):
    problems = metrics.problems(value)
    if problems:
      raise Invalid(f"{where}: {problems[0]}.")


class Tag(Spec):
  """A run tag: 1-64 letters, digits, '.', '_', ':' or '-' (so a filter matches it exactly)."""

  PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,64}")

  def check(self, value, where):
    if not isinstance(value, str) or not self.PATTERN.fullmatch(value):
      self.fail(value, where, "a tag of 1-64 letters, digits, '.', '_', ':' or '-'")


class RunConfig(Spec):
  """The prover's declared hyperparameters: a map of text keys to numbers, text, booleans,
  None, lists and maps, at most ``MAX_DEPTH`` deep and ``MAX_ENTRIES`` values in all.
  Shown as declared, never verified (the program is what is verified)."""

  MAX_DEPTH, MAX_ENTRIES, MAX_KEY, MAX_STRING = 6, 1000, 100, 1000

  def check(self, value, where):
    if not isinstance(value, dict):
      self.fail(value, where, "a map of hyperparameters")
    stack, entries = [(value, where, 0)], 0
    while stack:
      item, at, depth = stack.pop()
      entries += 1
      if entries > self.MAX_ENTRIES:
        raise Invalid(f"{where}: at most {self.MAX_ENTRIES} values in all.")
      if isinstance(item, dict) or isinstance(item, list):
        if depth >= self.MAX_DEPTH:
          raise Invalid(f"{at}: nested deeper than {self.MAX_DEPTH} levels.")
        pairs = item.items() if isinstance(item, dict) else enumerate(item)
        for k, v in pairs:
          if isinstance(item, dict) and (not isinstance(k, str)
                                         or not 1 <= len(k) <= self.MAX_KEY or "\x00" in k):
            self.fail(k, at, f"a map with keys of 1-{self.MAX_KEY} characters")
          stack.append((v, f"{at}.{k}" if isinstance(item, dict) else f"{at}[{k}]", depth + 1))
      elif isinstance(item, str):
        if len(item) > self.MAX_STRING or "\x00" in item:
          self.fail(item, at, f"a string of at most {self.MAX_STRING} characters, no NUL")
      elif isinstance(item, int) and not isinstance(item, bool):
        if not -(1 << 63) <= item < 1 << 64:
          self.fail(item, at, "an integer of at most 64 bits")
      elif not (item is None or isinstance(item, (bool, float))):
        self.fail(item, at, "a number, string, boolean, None, list or map")


REQUIRED = True
INDEX = Int()
DIGEST = Bytes()
DIGESTS = ListOf(DIGEST)
PIECES = ListOf(ListOf(Optional(DIGEST)))  # per leaf, the digest of each piece
# A byte string inside a record is at most this long (the server decodes records with this
# bound); a probed Merkle row wider than it travels as a list of chunks of at most this many
# bytes.
MAX_STRING_BYTES = 1 << 20
# A record travels whole or in chunks; DVBench takes none larger, nor of more CBOR items.
MAX_RECORD_BYTES = 256 * 1024 * 1024
MAX_RECORD_ITEMS = 1 << 20
# A record names at most this many blobs (a state's leaves, each step's batch leaves): DVBench
# keeps a reference to each.
MAX_RECORD_BLOBS = 1 << 16
_CHUNK = Bytes(None, MAX_STRING_BYTES)
PROBED_BYTES = Either(_CHUNK, ListOf(_CHUNK, 256, min_len=2),
                      f"a Merkle row's bytes, or a list of chunks of at most "
                      f"{MAX_STRING_BYTES} bytes")
ROW_COUNT = Int(1, MAX_RECORD_ITEMS + 1)  # the leading-axis rows of a probed Merkle row
LAYOUTS = ListOf(Map())  # each parsed by zkdv.programs.parse_layouts
NAME = Text(400)
NAMES = ListOf(NAME, 4096)
RECORD_TYPE = Field(Text(20, ("root", "init", "data", "program", "step", "check", "resume",
                             "final")), REQUIRED)
PREV = Field(DIGEST, REQUIRED)  # every record but the root chains to the one before

RECORD_FIELDS: dict[str, dict[str, Field]] = {
    "root": {"format_version": Field(FormatVersion(), REQUIRED),
             "prover": Field(Text(400, (transcript.PROVER,)), REQUIRED),
             "name": Field(Text(MAX_TEXT), REQUIRED), "versions": Field(Map(), REQUIRED),
             "platform": Field(NAME, REQUIRED), "config": Field(Map(), REQUIRED),
             # its fields are checked where it is read (zkdv.verify.policy) or bound
             # (dvbench.server.routes_proofs)
             "challenger": Field(Map(), REQUIRED),
             "device_kinds": Field(NAMES), "processes": Field(Int(1, 1 << 20)),
             # declared by the prover for its pages; shown as declared, never verified
             "run_name": Field(Text(200)), "tags": Field(ListOf(Tag(), 32)),
             "run_config": Field(RunConfig())},
    "init": {"program_id": Field(DIGEST, REQUIRED), "input_layout": Field(LAYOUTS, REQUIRED),
             "input_blobs": Field(DIGESTS, REQUIRED), "output_layout": Field(LAYOUTS, REQUIRED),
             "outputs": Field(DIGESTS, REQUIRED), "platforms": Field(NAMES, REQUIRED),
             "function": Field(Text(MAX_TEXT)),
             # a start from a base checkpoint: its params are the first inputs, keypaths
             # relative to it, and their params digest is declared (zkdv.jax.start)
             "base_layout": Field(LAYOUTS), "base_checkpoint": Field(DIGEST)},
    # The dataset whose rows the steps draw in the order the proof's slot seeds
    # (``zkdv.data``); checked further where it is read (``zkdv.verify.order``).
    "data": {"root": Field(DIGEST, REQUIRED),
             "rows": Field(Int(1, data.MAX_DATASET_ROWS + 1), REQUIRED),
             "order": Field(Text(20, (data.ORDER,)), REQUIRED),
             "layout": Field(ListOf(Map(), 4096), REQUIRED),
             "batch_size": Field(Int(1, data.MAX_BATCH_ROWS + 1), REQUIRED)},
    "program": {"program_id": Field(DIGEST, REQUIRED), "number": Field(INDEX, REQUIRED),
                "blob": Field(DIGEST, REQUIRED), "mode": Field(Text(20, MODES), REQUIRED),
                "state_layout": Field(LAYOUTS, REQUIRED),
                "batch_layout": Field(LAYOUTS, REQUIRED),
                "inputs": Field(ListOf(Text(5, ("state", "batch"))), REQUIRED),
                "post_state_outputs": Field(ListOf(INDEX), REQUIRED),
                "platforms": Field(NAMES, REQUIRED), "function": Field(Text(MAX_TEXT)),
                "params_leaves": Field(ListOf(INDEX)),
                # [a static argument's position or name, its repr]
                "static_arguments": Field(ListOf(Row((
                    Either(INDEX, Text(MAX_TEXT), "a position or a name"), Text(MAX_TEXT))))),
                "compiler_options": Field(Map()), "nr_devices": Field(Int(1, 1 << 24)),
                "collectives": Field(Text(20, COLLECTIVES)),
                "processes": Field(Int(1, 1 << 20)), "post_state_layout": Field(LAYOUTS),
                # [metric name, output index]; names and indices: zkdv.programs
                "metric_outputs": Field(ListOf(Row((Text(metrics.MAX_NAME_LENGTH), INDEX)),
                                               metrics.MAX_METRICS))},
    # The states are committed where a segment starts (pre_state) and ends (post_state).
    "step": {"index": Field(INDEX, REQUIRED), "program": Field(INDEX, REQUIRED),
             "batch": Field(DIGEST, REQUIRED), "pre_state": Field(DIGEST),
             "post_state": Field(DIGEST), "metrics": Field(StepMetrics()),
             # the post-state's piece digests, per leaf: a resumed run names the leaf
             # its restored state differs in (``zkdv.jax.resume``)
             "post_state_leaves": Field(PIECES),
             # the dataset rows this step's batch holds, as zkdv.data packs them
             "data_rows": Field(Bytes(None, data.INDEX_BYTES * data.MAX_BATCH_ROWS))},
    "check": {"step": Field(INDEX, REQUIRED),
              "kind": Field(Text(20, CHECK_KINDS), REQUIRED)},  # and its kind's fields
    # A run continued after a crash: steps go on at ``step`` from the committed post-state
    # ``state`` of step ``after``; the steps between, whose segment never committed its end,
    # are discarded (docs/jax.md, "Resuming a run").
    "resume": {"step": Field(INDEX, REQUIRED), "after": Field(INDEX, REQUIRED),
               "state": Field(DIGEST, REQUIRED)},
    "final": {"steps": Field(INDEX, REQUIRED), "status": Field(Text(20), REQUIRED),
              "discontinuities": Field(ListOf(INDEX)), "final_state": Field(DIGEST),
              "final_state_leaves": Field(PIECES), "final_params": Field(DIGEST),
              "seed": Field(Bytes(None))},
}
# The fields a check record of each kind carries beyond "step" and "kind".
CHECK_FIELDS: dict[str, dict[str, Field]] = {
    "update": {"first": Field(INDEX, REQUIRED),  # the first step of the opened segment
               "pre_state_blobs": Field(DIGESTS, REQUIRED),
               "batch_blobs": Field(ListOf(DIGESTS), REQUIRED),  # per step of the segment
               "pre_state_pieces": Field(PIECES), "post_state_blobs": Field(DIGESTS),
               "result": Field(Map()),
               # per step of the segment, per dataset leaf, per row: its dataset audit path
               "data_paths": Field(ListOf(ListOf(ListOf(ListOf(DIGEST, 64)))))},
    "state": {"post_state_blobs": Field(DIGESTS, REQUIRED)},
    # [leaf, Merkle row, its number of leading-axis rows, its bytes inline (``probe_entry``),
    # inclusion proof]
    "probe": {"batch_roots": Field(DIGESTS, REQUIRED),
              "probes": Field(ListOf(Row((INDEX, INDEX, ROW_COUNT, PROBED_BYTES,
                                          ListOf(DIGEST, 64)))), REQUIRED),
              # per probe, per data row it opens: its audit path in the dataset tree
              "data_paths": Field(ListOf(ListOf(ListOf(DIGEST, 64))))},
    "start": {"pre_state_pieces": Field(PIECES, REQUIRED)},
}


def discarded_steps(after: int, step: int) -> range:
  """The steps a ``resume`` record (``after``, ``step``) discards: those after the
  committed state it resumes from and before the step it resumes at (an open segment),
  e.g. ``discarded_steps(4, 7)`` is ``range(5, 7)``."""
  return range(after + 1, step)


def probe_entry(leaf: int, row: int, merkle_row, row_group: int, proof: list) -> list:
  """The probe entry that opens Merkle row ``row`` of batch leaf ``leaf``: its bytes (bytes
  or a uint8 view), its ``row_group`` leading-axis rows joined, inline as one byte string,
  or as chunks when wider than a record's byte strings may be, with its inclusion ``proof``.
  Example: ``probe_entry(1, 0, b"abcd", 2, [])`` is ``[1, 0, 2, b"abcd", []]``."""
  data = bytes(memoryview(merkle_row).cast("B"))
  if len(data) > MAX_STRING_BYTES:
    data = [data[i:i + MAX_STRING_BYTES] for i in range(0, len(data), MAX_STRING_BYTES)]
  return [leaf, row, row_group, data, proof]


def probed_bytes(entry: list) -> bytes:
  """A probe entry's Merkle row (schema-checked), joined from its chunks."""
  data = entry[3]
  return data if isinstance(data, bytes) else b"".join(data)


def _probed_size(entry: list) -> int:
  """The bytes of a probe entry's Merkle row (schema-checked), without joining them."""
  data = entry[3]
  return len(data) if isinstance(data, bytes) else sum(map(len, data))


def counted_rows(rows: int, nbytes: int) -> int:
  """The data rows that ``rows`` rows of ``nbytes`` bytes in all count as (quotas, reports):
  no more than one per byte, so rows of no bytes count none and a count costs what its
  bytes cost. Example: ``counted_rows(2**20, 0)`` is 0."""
  return min(rows, nbytes)


def opened_row_count(entry: list) -> int:
  """The data rows a probe entry (checked by ``check_record``) opens, as quotas count them
  (``counted_rows``). Example: ``opened_row_count([1, 0, 2, b"", []])`` is 0."""
  return counted_rows(entry[2], _probed_size(entry))


def probed_rows(entry: list) -> list[bytes]:
  """The leading-axis rows a probe entry (checked by ``check_record``) opens; the inverse
  of ``probe_entry``. Rows of no bytes open nothing (``counted_rows``): an entry without
  bytes has none. Example: ``probed_rows([1, 0, 2, b"abcd", []])`` is ``[b"ab", b"cd"]``."""
  data, count = probed_bytes(entry), entry[2]
  if not data:
    return []
  width = len(data) // count
  return [data[i * width:(i + 1) * width] for i in range(count)]


def probe_entries(record: dict) -> list:
  """The ``probes`` entries of a probe check record (checked by ``check_record``); of any
  other record, none."""
  is_probe = (record.get("type"), record.get("kind")) == ("check", "probe")
  return record["probes"] if is_probe else []


def check_probe_size(layouts, ratio: float, path_depth: int = 0) -> None:
  """Raises ``Invalid`` unless the probe record of a step with batch ``layouts`` (its
  ``zkdv.digest.LeafLayout``s) at probe ratio ``ratio`` stays within a record's bounds:
  every row a step's probes open travels in that one record, with its dataset audit path
  of ``path_depth`` digests where a dataset is declared.

  Example: ``check_probe_size(program.batch_layouts, 0.01)``.
  """
  rows = nbytes = entries = 0
  for layout in layouts:
    count = challenge.probe_count(layout, ratio)
    entries += count
    rows += count * layout.row_group
    nbytes += count * (layout.nbytes // max(layout.rows, 1))
  # per data row its dataset path's items; per entry its own items, proof and chunks
  items = (rows * (path_depth + 1 if path_depth else 0) + entries * (9 + 64)
           + nbytes // MAX_STRING_BYTES)
  nbytes += rows * 34 * path_depth
  if items > MAX_RECORD_ITEMS or nbytes > MAX_RECORD_BYTES // 2:
    # At 1/32 and below a probed step opens a 32nd of each leaf whatever the ratio.
    smallest = ratio * challenge.PROBE_GROUPS <= 1
    raise Invalid(f"at probe ratio {ratio}, a step's probes would open {rows} rows "
                  f"({nbytes} bytes, {items} CBOR items with their proofs), more than one "
                  f"record holds ({MAX_RECORD_ITEMS} items, {MAX_RECORD_BYTES // 2} bytes "
                  "of rows): " + ("no probe ratio above 0 fits: a probed step opens a "
                                  f"{challenge.PROBE_GROUPS}th of each batch leaf's rows at "
                                  "least; take smaller batches, or probe_ratio 0."
                                  if smallest else
                                  "choose a smaller probe_ratio."))


def check_data(record: dict, where: str) -> None:
  """The rules across a ``data`` record's fields: leaf layouts that parse, of known dtypes,
  none a PRNG key, each of ``rows`` rows, and a batch no larger than the dataset (what
  ``zkdv.data.Declaration.from_record`` takes)."""
  programs.parse_layouts(record["layout"], f"{where}.layout")
  try:
    data.Declaration.from_record(record)
  except ValueError as e:
    raise Invalid(f"{where}: {e}.") from None


def check_probes(record: dict, where: str) -> None:
  """The rules across a probe entry's items: its bytes split evenly into its rows, and
  chunks are cut as ``probe_entry`` cuts them (each of ``MAX_STRING_BYTES`` but the last),
  so a Merkle row has one encoding."""
  for n, entry in enumerate(record["probes"]):
    count, data = entry[2], entry[3]
    if not isinstance(data, bytes) and not (
        all(len(c) == MAX_STRING_BYTES for c in data[:-1]) and data[-1]):
      raise Invalid(f"{where}.probes[{n}][3]: chunks of {MAX_STRING_BYTES} bytes each but "
                    f"the last (1 to {MAX_STRING_BYTES}), got chunks of "
                    f"{[len(c) for c in data][:8]} bytes.")
    size = _probed_size(entry)
    if size % count:
      raise Invalid(f"{where}.probes[{n}]: {size} bytes do not split into {count} rows of "
                    "one width.")


def check_blobs(record: dict, where: str) -> None:
  """The blobs a record names: at most ``MAX_RECORD_BLOBS``, and an update check's
  ``batch_blobs`` one list per step of the segment it opens (``first`` .. ``step``)."""
  if record.get("kind") == "update":
    if record["first"] > record["step"]:
      raise Invalid(f"{where}.first: the segment's first step, at most its last "
                    f"({record['step']}), got {record['first']}.")
    steps = record["step"] - record["first"] + 1
    if len(record["batch_blobs"]) != steps:
      raise Invalid(f"{where}.batch_blobs: one list of blobs per step of the segment "
                    f"{record['first']}..{record['step']} ({steps}), got "
                    f"{len(record['batch_blobs'])}.")
  named = sum(len(record.get(f, ())) for f in ("pre_state_blobs", "post_state_blobs",
                                                "input_blobs"))
  named += sum(map(len, record.get("batch_blobs", ())))
  if named > MAX_RECORD_BLOBS:
    raise Invalid(f"{where}: names {named} blobs, more than a record may "
                  f"({MAX_RECORD_BLOBS}).")


def _init_rules(record: dict, where: str) -> None:
  programs.check_init(record, where)
  check_blobs(record, where)


# The rules across a record's fields, applied once each field matches (``zkdv.programs``),
# by record type, and by check kind.
ACROSS_FIELDS = {"program": programs.check_program, "init": _init_rules,
                 "data": check_data, ("check", "probe"): check_probes,
                 ("check", "update"): check_blobs, ("check", "state"): check_blobs}

RUN_FIELDS = ("run_name", "tags", "run_config")


def _plain(value, at: str):
  """A user's config value as plain CBOR data: tuples as lists, NumPy scalars as numbers."""
  if isinstance(value, dict):
    return {k: _plain(v, f"{at}.{k}") for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v, f"{at}[{n}]") for n, v in enumerate(value)]
  if hasattr(value, "item") and getattr(value, "shape", None) == ():  # a NumPy/JAX scalar
    return value.item()
  return value


def run_fields(run_name: str | None = None, tags=(), run_config: dict | None = None) -> dict:
  """The root's declared run fields, checked; raises ``Invalid`` (a ``ValueError``) naming
  the first field that is wrong. Example::

    run_fields("lr-3e-4", ["sweep:1"], {"lr": 3e-4})  # {"run_name": ..., "tags": ..., ...}
  """
  fields = {"run_name": run_name, "tags": _plain(list(tags), "tags"),
            "run_config": _plain(dict(run_config), "run_config") if run_config else None}
  fields = {k: v for k, v in fields.items() if v not in (None, [])}
  check_fields(fields, {k: RECORD_FIELDS["root"][k] for k in RUN_FIELDS}, "run")
  return fields


def check_format(root: dict, where: str) -> None:
  """Raises ``Invalid`` naming ``format_version`` unless the root is of the format this zkdv
  reads; checked before anything else, as no other field means anything otherwise."""
  field = RECORD_FIELDS["root"]["format_version"]
  check_fields({"format_version": root.get("format_version")} if "format_version" in root
               else {}, {"format_version": field}, f"{where} (root)")


def fields_of(record: dict) -> dict[str, Field]:
  """The fields a record of ``record``'s type (and check kind) lists, ``type`` and ``prev``
  included; {} for a type no record kind has."""
  kind = record.get("type")
  if kind not in RECORD_FIELDS:
    return {}
  fields = {"type": RECORD_TYPE, **RECORD_FIELDS[kind]}
  if kind == "check":
    fields.update(CHECK_FIELDS.get(record.get("kind"), {}))
  if kind != "root":
    fields["prev"] = PREV
  return fields


def check_record(record, where: str) -> str:
  """Checks a decoded record against its kind's fields; returns its type.

  Raises ``Invalid`` naming the first field that is missing or does not match, and
  ``UnknownField`` (an ``Invalid``) when every listed field matches but others are there.
  """
  if not isinstance(record, dict):
    raise Invalid(f"{where}: a record map, got {describe(record)}.")
  if "type" not in record:
    raise Invalid(f"{where}: the field 'type' is missing.")
  RECORD_TYPE.spec.check(record["type"], f"{where}.type")
  kind = record["type"]
  where = f"{where} ({kind})"
  if kind == "check":  # its kind first, which names the rest of its fields
    common = RECORD_FIELDS["check"]
    check_fields({k: v for k, v in record.items() if k in common}, common, where)
  unknown = None
  try:
    check_fields(record, fields_of(record), where, strict=True)
  except UnknownField as e:  # every listed field matched: the rules across them apply
    unknown = e
  across = ACROSS_FIELDS.get((kind, record["kind"]) if kind == "check" else kind)
  if across is not None:
    across(record, where)
  if unknown is not None:
    raise unknown
  return kind
