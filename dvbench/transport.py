"""The wire format between the client and the server, and its safe decoding.

Each request to ``/api/v1/proofs/{id}/stream`` carries one CBOR envelope::

  {"client_id": str, "seq": int,  # 0, 1, 2, ... per client_id
   "kind": "records", "records": [encoded record, ...]}
  {"client_id": ..., "seq": ..., "kind": "chunk",
   "record_id": bytes, "index": int, "count": int, "data": bytes}
  {"client_id": ..., "seq": ..., "kind": "close", "final_record_id": bytes,
   "record_count": int}

and is acknowledged with JSON ``{"seq": n, ...}``; an ack that stored (or saw
again) step records carries ``"challenges"`` (``docs/protocol.md``). Records
larger than ``CHUNK_BYTES`` travel as chunks; resending an envelope is harmless.

Everything a prover sends is decoded with ``decode_safely``, and only after its
token was checked, off the server's event loop: definite lengths, no tags (so no
shared references, sets, regular expressions or other rich objects), bounded depth,
item count and string lengths; a record's deterministic encoding is checked in the same
walk, never by encoding it again. ``dvbench.server.validation`` then checks each field.

Example::

  envelope = decode_safely(body)
  record = decode_safely(raw, canonical=True)
"""

import io
import math
import struct

import cbor2
import numpy as np

from zkdv import records
from zkdv.transcript import record_id  # pylint: disable=unused-import  # re-exported

CHUNK_BYTES = 256 * 1024
BATCH_BYTES = 4 * 1024 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_DEPTH = 16
MAX_ITEMS = records.MAX_RECORD_ITEMS
MAX_STRING = MAX_BODY_BYTES  # bytes and text strings of an envelope
MAX_RECORD_STRING = records.MAX_STRING_BYTES  # bytes and text strings inside a record
MAX_RECORD_BYTES = records.MAX_RECORD_BYTES  # a record reassembled from chunks
MAX_BLOBS = 4096  # blobs in one POST /api/v1/proofs/{id}/blobs
SMALL_BLOB_BYTES = 64 * 1024  # blobs this small travel together, one request per envelope
ENVELOPE_KINDS = ("records", "chunk", "close")
BLOB_FIELDS = ("blob", "pre_state_blobs", "batch_blobs", "post_state_blobs", "input_blobs")
# An init record names its program blob by the program's id.
_SIMPLE_VALUES = {20, 21, 22}  # false, true, null
_FLOAT_SIZES = {25: 2, 26: 4, 27: 8}
_ARGUMENT_SIZES = {24: 1, 25: 2, 26: 4, 27: 8}


class UnsafeCbor(ValueError):
  """Bytes that are not one well-formed, tag-free, bounded CBOR item."""


def encode(envelope: dict) -> bytes:
  return cbor2.dumps(envelope, canonical=True)


_SCALAR, _STRING, _CONTAINER, _REFUSED = range(4)  # what a head starts
_RUN_ITEMS = 8  # an array this long is first tried as a run of items of one shape


def _head(byte: int) -> tuple[int, int, int]:
  """(what, major type, size) of an item whose head starts with ``byte``: what is
  ``_SCALAR`` (size: the head's length), ``_STRING`` or ``_CONTAINER`` (size: the bytes of
  its argument after the initial byte; info < 24: none, the argument is ``byte & 31``) or
  ``_REFUSED`` (size: unused)."""
  major, info = byte >> 5, byte & 31
  if major == 7:
    if info in _SIMPLE_VALUES or info in _FLOAT_SIZES:
      return _SCALAR, major, 1 + _FLOAT_SIZES.get(info, 0)
    return _REFUSED, major, 0
  if major == 6 or (info >= 24 and info not in _ARGUMENT_SIZES):
    return _REFUSED, major, 0
  size = _ARGUMENT_SIZES.get(info, 0)
  if major in (0, 1):
    return _SCALAR, major, 1 + size
  return (_STRING if major in (2, 3) else _CONTAINER), major, size


_HEADS = [_head(byte) for byte in range(256)]  # one table lookup a head
# The length of an item whose head alone says it (0: look at _HEADS): of scalars, and of
# scalars and strings shorter than 24 bytes.
_SCALAR_LENGTHS = [size if what == _SCALAR else 0 for what, _, size in _HEADS]
_SHORT_LENGTHS = [1 + (byte & 31) if what == _STRING and byte & 31 < 24 else length
                  for byte, ((what, _, _), length) in enumerate(zip(_HEADS, _SCALAR_LENGTHS))]
# The same where a deterministic encoding needs no look past the head: integers below 24,
# false, true and null (and short strings).
_CANONICAL_LENGTHS = [1 if length == 1 else 0 for length in _SCALAR_LENGTHS]
_CANONICAL_SHORT_LENGTHS = [1 if scalar == 1 else short if scalar == 0 else 0
                            for scalar, short in zip(_SCALAR_LENGTHS, _SHORT_LENGTHS)]
_LEAST_ARGUMENT = {1: 24, 2: 1 << 8, 4: 1 << 16, 8: 1 << 32}  # shortest heads (RFC 8949 §4.2.1)
_FLOAT_FORMATS = {3: ">e", 5: ">f", 9: ">d"}  # a float item's length -> its struct format


def _refusal(data: bytes, at: int) -> str:
  major, info = data[at] >> 5, data[at] & 31
  if major == 7:
    return f"byte {at}: simple value {info} is not accepted."
  if major == 6:
    return f"byte {at}: CBOR tags are not accepted."
  return f"byte {at}: indefinite lengths and reserved values are not accepted."


def _cut_short(data: bytes, head: int) -> str:
  """Names the item whose head is at ``head`` and whose bytes end past the data."""
  if _HEADS[data[head]][0] == _STRING:
    return f"byte {head + 1}: a string of {data[head] & 31} bytes is cut short."
  return f"byte {head}: the item is cut short."


def _run_end(data: bytes, at: int, count: int, max_string: int, canonical: bool) -> int | None:
  """Where an array's ``count`` items starting at ``at`` end when they all share the
  first one's head (scalars, or strings of one length, e.g. a probe's rows or an audit
  path's digests), compared as strided slices; None when they do not, when they are
  containers, or, with ``canonical``, when one is not in its deterministic form.
  """
  what, major, size = _HEADS[data[at]]
  if what == _SCALAR:
    head, length = 1, size
  elif what == _STRING:
    head = 1 + size
    value = int.from_bytes(data[at + 1:at + head], "big") if size else data[at] & 31
    if value > max_string or (canonical and size and value < _LEAST_ARGUMENT[size]):
      return None
    length = head + value
  else:
    return None
  end = at + count * length
  if end > len(data):
    return None
  for k in range(head):
    if data[at + k:end:length] != data[at + k:at + k + 1] * count:
      return None
  if canonical and what == _SCALAR and length > 1 and not _canonical_scalars(
      data, at, count, major, length):
    return None  # the item-by-item walk names the first one
  return end


def _canonical_scalars(data: bytes, at: int, count: int, major: int, length: int) -> bool:
  """Whether ``count`` scalars of one head at ``at`` (integers with an argument, or floats
  of one width) are each in their deterministic form, as ``_check_canonical_scalar``
  decides one at a time."""
  payload = np.frombuffer(data, np.uint8, count * length, at).reshape(count, length)[:, 1:]
  if major != 7:
    return bool(payload.copy().view(f">u{length - 1}").min() >= _LEAST_ARGUMENT[length - 1])
  if length == 3:  # half precision: NaN only as 7e 00
    bits = payload.copy().view(">u2").astype(np.uint32)
    nan = ((bits & 0x7c00) == 0x7c00) & ((bits & 0x3ff) != 0)
    return bool(np.all(~nan | (bits == 0x7e00)))
  values = payload.copy().view(">f4" if length == 5 else ">f8").astype(np.float64)
  narrower = np.float16 if length == 5 else np.float32
  with np.errstate(over="ignore", invalid="ignore"):
    return bool(np.all(np.isfinite(values) & (values.astype(narrower) != values)))


def _not_canonical(at: int, why: str) -> UnsafeCbor:
  return UnsafeCbor(f"byte {at}: not deterministically encoded (RFC 8949 §4.2): {why}.")


def _fits(value: float, fmt: str) -> bool:
  """Whether ``value`` survives a round trip through the struct float format ``fmt``."""
  try:
    return struct.unpack(fmt, struct.pack(fmt, value))[0] == value
  except OverflowError:
    return False


def _check_canonical_scalar(data: bytes, at: int, major: int, length: int) -> None:
  """Raises unless the scalar at ``at`` (``length`` bytes, head included) is in its
  deterministic form: an integer in its shortest head, a float in the shortest of
  half, single and double precision that holds it exactly (NaN as ``f9 7e 00``)."""
  if major != 7:
    if int.from_bytes(data[at + 1:at + length], "big") < _LEAST_ARGUMENT[length - 1]:
      raise _not_canonical(at, "an integer in a longer head than it needs")
    return
  value = struct.unpack(_FLOAT_FORMATS[length], data[at + 1:at + length])[0]
  if math.isnan(value):
    if data[at:at + length] != b"\xf9\x7e\x00":
      raise _not_canonical(at, "NaN other than f9 7e 00")
  elif length > 3 and (math.isinf(value) or _fits(value, ">e")):
    raise _not_canonical(at, "a float that half precision holds exactly")
  elif length == 9 and _fits(value, ">f"):
    raise _not_canonical(at, "a float that single precision holds exactly")


def _check_key(data: bytes, at: int, length: int, previous: bytes) -> bytes:
  """The encoded map key at ``at``, a string or an integer (``false``, ``1.0`` and ``1``
  would be one key once decoded), which must sort after ``previous`` (shorter first,
  then bytewise: RFC 8949 §4.2.3's length-first order, which ``cbor2`` writes)."""
  if data[at] >> 5 == 7:
    raise _not_canonical(at, "a map key that is not a string or an integer")
  key = data[at:at + length]
  if (len(key), key) <= (len(previous), previous):
    raise _not_canonical(at, "map keys out of order or repeated")
  return key


def _check_structure(data: bytes, max_depth: int, max_items: int, max_string: int,
                     canonical: bool = False) -> None:
  """Walks the heads of one CBOR item without building it (raises UnsafeCbor); with
  ``canonical``, refuses any encoding but the deterministic one ``cbor2`` writes
  (``canonical=True``): shortest heads and floats, map keys (strings or integers)
  in order, once each.

  Each container's items are counted when it opens, so a head that announces more than
  ``max_items`` is refused before anything it announces is read. An array whose items
  share one head is stepped over at once (``_run_end``).
  """
  end, at, items, left, outer = len(data), 0, 1, 1, []  # left: items to read at this level
  keys, outer_keys = None, []  # in a map: the last key's encoding (b"": none yet)
  if canonical:
    fixed_lengths = _CANONICAL_SHORT_LENGTHS if max_string >= 23 else _CANONICAL_LENGTHS
  else:
    fixed_lengths = _SHORT_LENGTHS if max_string >= 23 else _SCALAR_LENGTHS
  while True:
    if not left:
      if not outer:
        break
      left, keys = outer.pop(), outer_keys.pop()
      continue
    left -= 1
    if at >= end:
      raise UnsafeCbor(f"byte {at}: the item is cut short.")
    is_key = keys is not None and left % 2
    fixed = fixed_lengths[data[at]]
    if fixed:  # a scalar, or a string shorter than 24 bytes
      at += fixed
      if at > end:
        raise UnsafeCbor(_cut_short(data, at - fixed))
      if is_key:
        keys = _check_key(data, at - fixed, fixed, keys)
      continue
    what, major, size = _HEADS[data[at]]
    if what == _REFUSED:
      raise UnsafeCbor(_refusal(data, at))
    if what == _SCALAR:  # canonical: an integer with an argument, or a float
      if at + size > end:
        raise UnsafeCbor(f"byte {at}: the item is cut short.")
      _check_canonical_scalar(data, at, major, size)
      if is_key:
        keys = _check_key(data, at, size, keys)
      at += size
      continue
    head = at
    if size:
      if at + 1 + size > end:
        raise UnsafeCbor(f"byte {at}: the item is cut short.")
      value = int.from_bytes(data[at + 1:at + 1 + size], "big")
      if canonical and value < _LEAST_ARGUMENT[size]:
        raise _not_canonical(at, "a length in a longer head than it needs")
    else:
      value = data[at] & 31
    at += 1 + size
    if what == _STRING:
      if value > max_string:
        raise UnsafeCbor(f"byte {at}: a string of {value} bytes; the limit is {max_string}.")
      at += value
      if at > end:
        raise UnsafeCbor(f"byte {at - value}: a string of {value} bytes is cut short.")
      if is_key:
        keys = _check_key(data, head, at - head, keys)
      continue
    if is_key:
      raise _not_canonical(head, "a map key that is not a string or an integer")
    if len(outer) >= max_depth:
      raise UnsafeCbor(f"byte {at}: nested deeper than {max_depth} levels.")
    count = value * (2 if major == 5 else 1)
    items += count
    if items > max_items:
      raise UnsafeCbor(f"more than {max_items} items.")
    if major == 4 and count >= _RUN_ITEMS and at < end:
      run_end = _run_end(data, at, count, max_string, canonical)
      if run_end is not None:
        at = run_end
        continue
    outer.append(left)
    outer_keys.append(keys)
    left, keys = count, (b"" if canonical and major == 5 else None)
  if at != end:
    raise UnsafeCbor(f"{end - at} bytes follow the item.")


def decode_safely(data: bytes, *, canonical: bool = False, max_depth: int = MAX_DEPTH,
                  max_items: int = MAX_ITEMS, max_string: int = MAX_STRING):
  """The one CBOR item in ``data``; with ``canonical``, it must be encoded deterministically
  (as ``cbor2.dumps(item, canonical=True)`` writes it).

  Raises UnsafeCbor naming what is wrong, e.g.
  ``decode_safely(b"\\xc1\\x00")`` -> "byte 0: CBOR tags are not accepted."
  """
  if not isinstance(data, bytes):
    raise UnsafeCbor("expected a byte string.")
  _check_structure(data, max_depth, max_items, max_string, canonical)
  try:
    return cbor2.loads(data)
  except (cbor2.CBORDecodeError, ValueError, TypeError, RecursionError) as e:
    raise UnsafeCbor(f"not valid CBOR: {e}") from None


def blob_refs(record: dict) -> set[str]:
  """Hex digests of the blobs a record references."""
  refs = set()
  fields = BLOB_FIELDS + (("program_id",) if record.get("type") == "init" else ())
  for field in fields:
    value = record.get(field)
    values = value if isinstance(value, list) else [value]
    if field == "batch_blobs":  # one list per step of the segment
      values = [d for v in values for d in (v if isinstance(v, list) else [v])]
    for d in values:
      if isinstance(d, bytes) and len(d) == 32:
        refs.add(d.hex())
  return refs


class RecordScanner:
  """Splits a growing CBOR sequence into complete records (raw bytes, map)."""

  def __init__(self):
    self._buffer = b""

  def feed(self, data: bytes) -> list[tuple[bytes, dict]]:
    self._buffer += data
    out = []
    stream = io.BytesIO(self._buffer)
    decoder = cbor2.CBORDecoder(stream)
    start = 0
    while start < len(self._buffer):
      try:
        record = decoder.decode()
      except (cbor2.CBORDecodeEOF, EOFError):
        break  # the writer has not finished this record yet
      end = stream.tell()
      out.append((self._buffer[start:end], record))
      start = end
    self._buffer = self._buffer[start:]
    return out

  @property
  def pending_bytes(self) -> int:
    return len(self._buffer)
