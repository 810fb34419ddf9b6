"""Strict schemas of what a prover sends: every envelope and record field, typed and bounded.

Each record kind lists its fields in ``RECORD_FIELDS`` (one table: add a field or a kind
there; ``CHECK_REQUIRES`` adds what each check kind carries). A listed field must have its
type and bounds; a required one (the verifier's required fields) must be present.
Fields a kind does not list are the verifier's to judge (it reports them), but they too are
bounded: text keys, strings of at most ``MAX_TEXT`` characters (the decoder bounds depth,
item count and byte strings). Everything is checked before any database work, and a
refusal names the field, e.g. ``record 0 (step).index: an integer in [0, 2**40), got an
integer of 65 bits``.

Example::

  record = decode(raw, "record 0", canonical=True)
  check_record(record, "record 0")      # raises Invalid naming the first wrong field
  check_fields(envelope, ENVELOPE_FIELDS[envelope["kind"]], "envelope")
"""

import dataclasses
import math

from zkdv import challenge
from zkdv import errors
from zkdv import metrics
from zkdv import transcript

MAX_INDEX = 1 << 40  # step indices, counts and positions stay below this
MAX_LIST = 1 << 20
MAX_TEXT = 64 * 1024
MAX_CHUNKS = 65536
CHECK_KINDS = (*challenge.ANSWER_KINDS, "start")  # "start": the attested start's link


class Invalid(ValueError):
  """A field that does not match its schema; ``str()`` names the field and the rule."""


def describe(value) -> str:
  """A bounded description of a prover's value for an error message."""
  if isinstance(value, bool) or value is None:
    return repr(value)
  if isinstance(value, int):
    return repr(value) if abs(value) < 10**12 else f"an integer of {value.bit_length()} bits"
  if isinstance(value, float):
    return repr(value)
  if isinstance(value, (str, bytes)):
    return f"{type(value).__name__} of length {len(value)}"
  return f"a {type(value).__name__}"


class Spec:
  """What one value must be."""

  def check(self, value, where: str) -> None:
    raise NotImplementedError

  def fail(self, value, where: str, rule: str):
    raise Invalid(f"{where}: {rule}, got {describe(value)}.")


@dataclasses.dataclass(frozen=True)
class Int(Spec):
  low: int = 0
  high: int = MAX_INDEX  # exclusive

  def check(self, value, where):
    if not isinstance(value, int) or isinstance(value, bool) or not (
        self.low <= value < self.high):
      self.fail(value, where, f"an integer in [{self.low}, {_power(self.high)})")


@dataclasses.dataclass(frozen=True)
class Float(Spec):
  """A finite float (NaN and infinities are refused)."""

  low: float = -math.inf
  high: float = math.inf
  meaning: str = ""  # what the number is, e.g. "the fraction of batches opened"

  def check(self, value, where):
    if not isinstance(value, float) or not math.isfinite(value) or not (
        self.low <= value <= self.high):
      self.fail(value, where, f"{self.meaning}{', ' if self.meaning else ''}a finite float "
                f"in [{self.low:g}, {self.high:g}]")


@dataclasses.dataclass(frozen=True)
class Bytes(Spec):
  size: int | None = 32  # exact; None: any length up to max_size
  max_size: int = 64

  def check(self, value, where):
    if not isinstance(value, bytes):
      self.fail(value, where, "a byte string")
    if self.size is not None and len(value) != self.size:
      self.fail(value, where, f"{self.size} bytes")
    if len(value) > self.max_size:
      self.fail(value, where, f"at most {self.max_size} bytes")


@dataclasses.dataclass(frozen=True)
class Text(Spec):
  max_len: int = 400
  choices: tuple[str, ...] = ()
  min_len: int = 0

  def check(self, value, where):
    if not isinstance(value, str) or not self.min_len <= len(value) <= self.max_len:
      self.fail(value, where, f"a string of {self.min_len}-{self.max_len} characters")
    if "\x00" in value:  # PostgreSQL text cannot hold it
      raise Invalid(f"{where}: a string without NUL characters.")
    if self.choices and value not in self.choices:
      raise Invalid(f"{where}: one of {list(self.choices)}, got {value[:40]!r}.")


@dataclasses.dataclass(frozen=True)
class Optional(Spec):
  inner: Spec

  def check(self, value, where):
    if value is not None:
      self.inner.check(value, where)


@dataclasses.dataclass(frozen=True)
class Either(Spec):
  """A value matching ``first`` or, failing that, ``second`` (a field's two shapes)."""

  first: Spec
  second: Spec
  rule: str

  def check(self, value, where):
    try:
      self.first.check(value, where)
    except Invalid:
      try:
        self.second.check(value, where)
      except Invalid:
        self.fail(value, where, self.rule)


@dataclasses.dataclass(frozen=True)
class Bool(Spec):

  def check(self, value, where):
    if not isinstance(value, bool):
      self.fail(value, where, "true or false")


@dataclasses.dataclass(frozen=True)
class ListOf(Spec):
  item: Spec
  max_len: int = MAX_LIST
  min_len: int = 0

  def check(self, value, where):
    if not isinstance(value, list) or not self.min_len <= len(value) <= self.max_len:
      self.fail(value, where, f"a list of {self.min_len}-{self.max_len} items")
    for n, item in enumerate(value):
      self.item.check(item, f"{where}[{n}]")


@dataclasses.dataclass(frozen=True)
class Row(Spec):
  """A fixed-length list whose items have their own specs, e.g. a probe."""

  items: tuple[Spec, ...]

  def check(self, value, where):
    if not isinstance(value, list) or len(value) != len(self.items):
      self.fail(value, where, f"a list of {len(self.items)} items")
    for n, (spec, item) in enumerate(zip(self.items, value)):
      spec.check(item, f"{where}[{n}]")


class Free(Spec):
  """Any value the decoder accepted, with text map keys and bounded strings."""

  def check(self, value, where):
    stack = [(value, where)]
    while stack:
      item, at = stack.pop()
      if isinstance(item, str) and len(item) > MAX_TEXT:
        self.fail(item, at, f"a string of at most {MAX_TEXT} characters")
      elif isinstance(item, list):
        stack.extend((v, f"{at}[{n}]") for n, v in enumerate(item))
      elif isinstance(item, dict):
        for k, v in item.items():
          if not isinstance(k, str) or len(k) > 400:
            self.fail(k, at, "a map with string keys of at most 400 characters")
          stack.append((v, f"{at}.{k}"))


class FormatVersion(Spec):
  """The transcript format this server reads (``zkdv.transcript.check_format``)."""

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


@dataclasses.dataclass(frozen=True)
class Map(Spec):
  """A map (free-form inside, bounded by ``Free``)."""

  def check(self, value, where):
    if not isinstance(value, dict):
      self.fail(value, where, "a map")
    FREE.check(value, where)


FREE = Free()


def _power(n: int) -> str:
  return f"2**{n.bit_length() - 1}" if n > 1 << 20 and n & (n - 1) == 0 else str(n)


@dataclasses.dataclass(frozen=True)
class Field:
  spec: Spec
  required: bool = False


def check_fields(value, fields: dict[str, Field], where: str) -> None:
  """``value`` is a map whose listed fields match; unlisted ones are bounded (``Free``)."""
  if not isinstance(value, dict):
    raise Invalid(f"{where}: a map, got {describe(value)}.")
  for name, field in fields.items():
    if name not in value:
      if field.required:
        raise Invalid(f"{where}: the field {name!r} is missing.")
      continue
    field.spec.check(value[name], f"{where}.{name}")
  FREE.check({k: v for k, v in value.items() if k not in fields}, where)


# -- the fields of each record kind (docs/protocol.md) ------------------------------------

INDEX = Int()
DIGEST = Bytes()
DIGESTS = ListOf(DIGEST)
PIECES = ListOf(ListOf(Optional(DIGEST)))  # per leaf, the digest of each piece
LAYOUTS = ListOf(Map())
NAME = Text(400)
NAMES = ListOf(Text(400), 4096)
_REQ = True

RECORD_FIELDS: dict[str, dict[str, Field]] = {
    "root": {"format_version": Field(FormatVersion(), _REQ), "prover": Field(NAME, _REQ),
             "name": Field(Text(MAX_TEXT), _REQ), "versions": Field(Map(), _REQ),
             "platform": Field(NAME, _REQ), "config": Field(Map(), _REQ),
             "challenger": Field(FREE),  # checked where it is bound (routes_proofs)
             "device_kinds": Field(NAMES),
             "processes": Field(Int(1, 1 << 20))},
    "program": {"program_id": Field(DIGEST, _REQ), "number": Field(INDEX, _REQ),
                "blob": Field(DIGEST, _REQ), "mode": Field(Text(20), _REQ),
                "state_layout": Field(LAYOUTS, _REQ), "batch_layout": Field(LAYOUTS, _REQ),
                "inputs": Field(NAMES, _REQ), "post_state_outputs": Field(ListOf(INDEX), _REQ),
                "platforms": Field(NAMES, _REQ), "function": Field(Text(MAX_TEXT)),
                "params_leaves": Field(ListOf(INDEX)), "nr_devices": Field(Int(1, 1 << 24)),
                "processes": Field(Int(1, 1 << 20)), "post_state_layout": Field(LAYOUTS),
                # [metric name, output index]; the verifier checks names and indices
                "metric_outputs": Field(ListOf(Row((Text(metrics.MAX_NAME_LENGTH), INDEX)),
                                               metrics.MAX_METRICS))},
    "init": {"program_id": Field(DIGEST, _REQ), "input_layout": Field(LAYOUTS, _REQ),
             "input_blobs": Field(DIGESTS, _REQ), "output_layout": Field(LAYOUTS, _REQ),
             "outputs": Field(DIGESTS, _REQ), "platforms": Field(NAMES, _REQ),
             "function": Field(Text(MAX_TEXT))},
    # The states are committed at segment boundaries only.
    "step": {"index": Field(INDEX, _REQ), "program": Field(INDEX, _REQ),
             "pre_state": Field(DIGEST), "batch": Field(DIGEST, _REQ),
             "post_state": Field(DIGEST), "metrics": Field(StepMetrics())},
    "check": {"step": Field(INDEX, _REQ), "kind": Field(Text(20, CHECK_KINDS), _REQ),
              "first": Field(INDEX),  # the first step of the opened segment
              "pre_state_blobs": Field(DIGESTS),
              "batch_blobs": Field(ListOf(DIGESTS)),  # per step of the segment
              "post_state_blobs": Field(DIGESTS), "result": Field(Map()),
              "pre_state_pieces": Field(PIECES), "batch_roots": Field(DIGESTS),
              # [leaf, row, the row's blob digest (a group's: one per row), its
              # Merkle inclusion proof]
              "probes": Field(ListOf(Row((INDEX, INDEX, Either(DIGEST, DIGESTS,
                                                               "a digest or a list of them"),
                                          ListOf(DIGEST, 64)))))},
    "final": {"steps": Field(INDEX, _REQ), "status": Field(Text(20), _REQ),
              "discontinuities": Field(ListOf(INDEX)), "final_state": Field(DIGEST),
              "final_state_leaves": Field(PIECES), "final_params": Field(DIGEST),
              "seed": Field(Bytes(None))},
}
# The fields a check record of each kind must carry, beyond "step" and "kind".
CHECK_REQUIRES = {"update": ("first", "pre_state_blobs", "batch_blobs"),
                  "state": ("post_state_blobs",), "probe": ("batch_roots", "probes"),
                  "start": ("pre_state_pieces",)}
PREV = Field(DIGEST, _REQ)  # every record but the root chains to the one before
RECORD_TYPE = Text(20)


def check_record(record, where: str) -> str:
  """Checks a decoded record against its kind's fields; returns its type.

  A type the table does not list (a newer record kind) is bounded and left to the verifier.
  """
  if not isinstance(record, dict):
    raise Invalid(f"{where}: a record map, got {describe(record)}.")
  if "type" not in record:
    raise Invalid(f"{where}: the field 'type' is missing.")
  RECORD_TYPE.check(record["type"], f"{where}.type")
  kind = record["type"]
  fields = RECORD_FIELDS.get(kind, {})
  if kind != "root":
    fields = {**fields, "prev": PREV}
  check_fields(record, fields, f"{where} ({kind})")
  missing = [f for f in CHECK_REQUIRES.get(record["kind"], ()) if f not in record] if (
      kind == "check") else []
  if missing:
    raise Invalid(f"{where} (check): a check of kind {record['kind']!r} carries "
                  f"{missing[0]!r}.")
  return kind


# -- envelopes (dvbench.transport) ----------------------------------------------------------

_COMMON = {"client_id": Field(Text(64, min_len=1), _REQ), "seq": Field(Int(0, 1 << 53), _REQ),
           "kind": Field(Text(20, ("records", "chunk", "close")), _REQ)}
ENVELOPE_FIELDS: dict[str, dict[str, Field]] = {
    "records": {**_COMMON, "records": Field(ListOf(Bytes(None, 1 << 30)), _REQ)},
    "chunk": {**_COMMON, "record_id": Field(DIGEST, _REQ), "index": Field(Int(0, MAX_CHUNKS), _REQ),
              "count": Field(Int(1, MAX_CHUNKS + 1), _REQ),
              "data": Field(Bytes(None, 1 << 30), _REQ)},
    "close": {**_COMMON, "final_record_id": Field(DIGEST, _REQ),
              "record_count": Field(Int(1, MAX_INDEX), _REQ)},
}


def check_envelope(envelope) -> dict:
  """The envelope, each of its kind's fields checked, and no other fields."""
  if not isinstance(envelope, dict):
    raise Invalid(f"envelope: a CBOR map, got {describe(envelope)}.")
  kind = envelope.get("kind")
  _COMMON["kind"].spec.check(kind, "envelope.kind")
  fields = ENVELOPE_FIELDS[kind]
  unknown = sorted(str(k)[:40] for k in envelope if k not in fields)
  if unknown:
    raise Invalid(f"envelope: unknown fields {unknown}; a {kind} envelope has "
                  f"{sorted(fields)}.")
  check_fields(envelope, fields, "envelope")
  if kind == "chunk" and envelope["index"] >= envelope["count"]:
    raise Invalid(f"envelope.index: below count ({envelope['count']}), got "
                  f"{envelope['index']}.")
  return envelope
