"""Typed, bounded fields of what a prover or client sends: specs and the check of a map.

A ``Spec`` says what one value must be (``Int``, ``Bytes``, ``Text``, ``ListOf``, ...);
``check_fields`` checks a map's listed ``Field``s and bounds the rest (``Free``). A refusal
is an ``Invalid`` whose message names the field and the rule, and never prints a huge value,
e.g. ``record 0 (step).index: an integer in [0, 2**40), got an integer of 65 bits.``

Example::

  check_fields({"n": 3}, {"n": Field(Int(0, 10), required=True)}, "body")  # passes
  Int(0, 10).check(11, "body.n")  # raises Invalid("body.n: an integer in [0, 10), got 11.")
"""

import dataclasses
import math

MAX_INDEX = 1 << 40  # step indices, counts and positions stay below this
MAX_LIST = 1 << 20
MAX_TEXT = 64 * 1024


class Invalid(ValueError):
  """A field that does not match its schema; ``str()`` names the field and the rule."""


class UnknownField(Invalid):
  """A field its map's kind does not list (every listed field matched)."""


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

  def accepts_all(self, values: list) -> bool:
    """Whether every one of ``values`` passes ``check``, where a quick test can tell; False
    when it cannot (each is checked then)."""
    del values
    return False

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

  def accepts_all(self, values):
    if not values:
      return True
    if set(map(type, values)) != {bytes}:
      return False
    lengths = set(map(len, values))
    if self.size is not None:
      return lengths == {self.size} and self.size <= self.max_size
    return max(lengths) <= self.max_size


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

  def accepts_all(self, values):
    return self.first.accepts_all(values)


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
    item = self.item
    if item.accepts_all(value):  # e.g. a list of digests, or of a probe's rows
      return
    for n, entry in enumerate(value):
      try:
        item.check(entry, where)
      except Invalid as e:
        raise _at_item(e, where, n) from None


@dataclasses.dataclass(frozen=True)
class Row(Spec):
  """A fixed-length list whose items have their own specs, e.g. a probe."""

  items: tuple[Spec, ...]

  def check(self, value, where):
    if not isinstance(value, list) or len(value) != len(self.items):
      self.fail(value, where, f"a list of {len(self.items)} items")
    for n, (spec, entry) in enumerate(zip(self.items, value)):
      try:
        spec.check(entry, where)
      except Invalid as e:
        raise _at_item(e, where, n) from None


def _at_item(error: Invalid, where: str, n: int) -> Invalid:
  """``error``, raised by checking item ``n`` of a list at ``where`` as if it were at
  ``where``, naming the item's own path ``where[n]`` (an item's path is formatted only for
  the item that fails: valid lists format none).

  Example: ``_at_item(Invalid("x: 4 bytes, got ..."), "x", 2)`` says "x[2]: 4 bytes, ...".
  """
  message = str(error)
  rest = message[len(where):] if message.startswith(where) else f": {message}"
  return type(error)(f"{where}[{n}]{rest}")


class Free(Spec):
  """Any value the decoder accepted, with text map keys and bounded strings."""

  def check(self, value, where):
    stack = [(value, None)]  # (item, its trail: (parent's trail, index or key))
    while stack:
      item, trail = stack.pop()
      if isinstance(item, str) and len(item) > MAX_TEXT:
        self.fail(item, _trail_path(where, trail), f"a string of at most {MAX_TEXT} characters")
      elif isinstance(item, list):
        stack.extend((v, (trail, n)) for n, v in enumerate(item))
      elif isinstance(item, dict):
        for k, v in item.items():
          if not isinstance(k, str) or len(k) > 400:
            self.fail(k, _trail_path(where, trail),
                      "a map with string keys of at most 400 characters")
          stack.append((v, (trail, k)))


def _trail_path(where: str, trail) -> str:
  """The path of a trail of list indices and map keys below ``where``, e.g. ``x.a[2]``
  (built only for an error: a valid value's walk formats nothing)."""
  steps = []
  while trail is not None:
    trail, step = trail
    steps.append(f"[{step}]" if isinstance(step, int) else f".{step}")
  return where + "".join(reversed(steps))


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


def check_fields(value, fields: dict[str, Field], where: str, strict: bool = False) -> None:
  """``value`` is a map whose listed fields match; unlisted ones are bounded (``Free``) or,
  with ``strict``, refused (``UnknownField``, raised once every listed field matched)."""
  if not isinstance(value, dict):
    raise Invalid(f"{where}: a map, got {describe(value)}.")
  for name, field in fields.items():
    if name not in value:
      if field.required:
        raise Invalid(f"{where}: the field {name!r} is missing.")
      continue
    field.spec.check(value[name], f"{where}.{name}")
  unlisted = {k: v for k, v in value.items() if k not in fields}
  FREE.check(unlisted, where)
  if strict and unlisted:
    raise UnknownField(f"{where}: unknown fields {sorted(str(k)[:40] for k in unlisted)[:8]}; "
                       f"it has {sorted(fields)}.")
