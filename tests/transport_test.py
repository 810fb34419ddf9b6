"""The safe decoding of what a prover sends: every head the walk refuses, named; every value
a canonical encoder writes, accepted and decoded as written."""

import random
import re
import struct
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import cbor2

from dvbench import transport

VALUES = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, -1, -24, -25,
          -(2**64), 0.5, 1.5e300, float(2**-20), True, False, None,
          b"", b"x" * 23, b"x" * 24, b"x" * 255, b"x" * 256, b"x" * 70000, "", "é" * 30,
          [], [[[]]], [b"abcd"] * 300, {"a": [1, {"b": b"c"}]}, {"k" * 24: None, "": 0},
          {"probes": [[0, 1, [b"\x00" * 3136] * 8, [b"\x01" * 32] * 5]]},
          [0.5 + n for n in range(9)], list(range(30)), [b"ab", b"cd"] * 8 + [b"e"],
          [[0]] * 9, [bytes([n]) * 4 for n in range(256)]]
# A probe-like record: runs of same-shape items (rows, digests) among other items.
RUNS = cbor2.dumps({"probes": [[0, 1, [bytes([n]) * 5 for n in range(9)],
                                [bytes([n]) * 32 for n in range(8)]],
                               [1, 0, [bytes([n]) * 2 for n in range(10)], []]],
                    "scores": [0.25 * n for n in range(8)], "steps": [7] * 12},
                   canonical=True)


def _random_value(rng: random.Random, depth: int = 0):
  """A value of every kind a record may hold, nested, with maps of string, byte string
  and integer keys."""
  kind = rng.randrange(11 if depth < 3 else 7)
  if kind == 0:
    return rng.choice([0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1,
                       rng.randrange(-2**64, 2**64)])
  if kind == 1:
    return rng.choice([0.0, -0.0, 1.5, 65504.0, 2.0**-24, 0.1, 1e300, float("inf"),
                       float("nan"), struct.unpack(">f", rng.randbytes(4))[0],
                       struct.unpack(">e", rng.randbytes(2))[0],
                       struct.unpack(">d", rng.randbytes(8))[0]])
  if kind == 2:
    return rng.randbytes(rng.choice([0, 3, 23, 24, 300]))
  if kind == 3:
    return "".join(rng.choice("aé€😀") for _ in range(rng.choice([0, 5, 30])))
  if kind in (4, 5, 6):
    return rng.choice([True, False, None])
  if kind in (7, 8):
    return [_random_value(rng, depth + 1) for _ in range(rng.choice([0, 2, 9]))]
  if kind == 9:  # a run: scalars of one head, but for the odd one
    fmt, size = rng.choice([(">e", 2), (">f", 4), (">d", 8)])
    run = [struct.unpack(fmt, rng.randbytes(size))[0] for _ in range(9)]
    if rng.randrange(2):
      run = [rng.randrange(256, 65536) for _ in range(9)]
    run[rng.randrange(9)] = rng.choice([run[0], 1.5, 300, float("nan")])
    return run
  return {rng.choice([rng.randrange(-300, 300), rng.randbytes(rng.randrange(3)),
                      "k" * rng.randrange(30)]): _random_value(rng, depth + 1)
          for _ in range(rng.randrange(6))}


def _non_canonical_variants(data: bytes) -> list[bytes]:
  """Encodings of the same values in longer heads or wider floats, and with two map
  entries swapped: each head widened in turn."""
  variants = []
  for at, byte in enumerate(data[:200]):
    major, info = byte >> 5, byte & 31
    if major in (0, 1, 2, 3, 4, 5) and info < 24:
      variants.append(data[:at] + bytes([major << 5 | 24, info]) + data[at + 1:])
    if major in (0, 1, 2, 3, 4, 5) and info == 24:
      variants.append(data[:at] + bytes([major << 5 | 25, 0]) + data[at + 1:])
    if byte == 0xf9 and at + 3 <= len(data):
      value = struct.unpack(">e", data[at + 1:at + 3])[0]
      variants.append(data[:at] + b"\xfa" + struct.pack(">f", value) + data[at + 3:])
      variants.append(data[:at] + b"\xf9" + bytes([data[at + 1] ^ 1, data[at + 2]])
                      + data[at + 3:])
    if byte == 0xfa and at + 5 <= len(data):
      value = struct.unpack(">f", data[at + 1:at + 5])[0]
      variants.append(data[:at] + b"\xfb" + struct.pack(">d", value) + data[at + 5:])
  return variants


def _keys_are_strings_or_integers(item) -> bool:
  if isinstance(item, list):
    return all(map(_keys_are_strings_or_integers, item))
  if isinstance(item, dict):
    return all(type(k) in (str, bytes, int) and _keys_are_strings_or_integers(v)
               for k, v in item.items())
  return True


def _reference(data: bytes) -> str:
  """Accepted or refused as canonical by decoding and encoding again, and comparing (map
  keys other than strings and integers refused)."""
  try:
    item = transport.decode_safely(data)
  except transport.UnsafeCbor:
    return "refused"
  same = cbor2.dumps(item, canonical=True) == data
  return "accepted" if same and _keys_are_strings_or_integers(item) else "refused"


def _canonical_outcome(data: bytes) -> str:
  try:
    transport.decode_safely(data, canonical=True)
  except transport.UnsafeCbor:
    return "refused"
  return "accepted"


def _outcome(data: bytes) -> str:
  try:
    transport.decode_safely(data, max_string=40)
  except transport.UnsafeCbor as e:
    return str(e)
  return "accepted"


class DecodeSafelyTest(parameterized.TestCase):

  @parameterized.parameters((v,) for v in VALUES)
  def test_what_a_canonical_encoder_writes_decodes_as_written(self, value):
    data = cbor2.dumps(value, canonical=True)
    decoded = transport.decode_safely(data, canonical=True)
    self.assertEqual(decoded, value)
    self.assertEqual(type(decoded), type(value))
    self.assertEqual(cbor2.dumps(decoded, canonical=True), data)

  @parameterized.named_parameters(
      ("tag", b"\xc1\x00", "byte 0: CBOR tags are not accepted."),
      ("nested_tag", b"\x82\x00\xd8\x1c\x00", "byte 2: CBOR tags are not accepted."),
      ("indefinite_array", b"\x9f\x00\xff", "byte 0: indefinite lengths and reserved"),
      ("indefinite_bytes", b"\x81\x5f\x41a\xff", "byte 1: indefinite lengths and reserved"),
      ("reserved_info", b"\x1c", "byte 0: indefinite lengths and reserved"),
      ("simple_value", b"\x82\xf5\xe0", "byte 2: simple value 0 is not accepted."),
      ("undefined", b"\xf7", "byte 0: simple value 23 is not accepted."),
      ("one_byte_simple", b"\xf8\x20", "byte 0: simple value 24 is not accepted."),
      ("argument_cut", b"\x82\x1b\x00\x00", "byte 1: the item is cut short."),
      ("short_string_cut_at_the_end", b"\x65abc", "byte 1: a string of 5 bytes is cut short."),
      ("string_length_cut", b"\x59\x01", "byte 0: the item is cut short."),
      ("short_string_cut", b"\x81\x44ab", "byte 2: a string of 4 bytes is cut short."),
      ("string_cut", b"\x58\x20" + b"x" * 31, "byte 2: a string of 32 bytes is cut short."),
      ("float_cut", b"\xfb\x00\x00", "byte 0: the item is cut short."),
      ("array_cut", b"\x83\x00\x00", "byte 3: the item is cut short."),
      ("map_cut", b"\xa1\x00", "byte 2: the item is cut short."),
      ("empty", b"", "byte 0: the item is cut short."),
      ("trailing", b"\x00\x00", "1 bytes follow the item."),
      ("too_deep", b"\x81" * 17 + b"\x00", "byte 17: nested deeper than 16 levels."),
      ("too_many_announced", b"\x9a" + (1 << 20).to_bytes(4, "big"),
       f"more than {transport.MAX_ITEMS} items."),
      ("map_counts_twice", b"\xba" + (1 << 19).to_bytes(4, "big"),
       f"more than {transport.MAX_ITEMS} items."),
  )
  def test_a_refused_head_is_named(self, data, message):
    with self.assertRaisesRegex(transport.UnsafeCbor, "^" + re.escape(message)):
      transport.decode_safely(data)

  @parameterized.named_parameters(
      ("last_item_cut", b"\x88" + b"\x41a" * 7 + b"\x41",
       "byte 16: a string of 1 bytes is cut short."),
      ("run_past_the_end", b"\x89" + b"\x41a" * 8, "byte 17: the item is cut short."),
      ("a_tag_among_them", b"\x88" + b"\x41a" * 6 + b"\xc1\x00" + b"\x41a",
       "byte 13: CBOR tags are not accepted."),
      ("strings_over_the_limit", b"\x88" + (b"\x58\x29" + b"x" * 41) * 8,
       "byte 3: a string of 41 bytes; the limit is 40."),
      ("too_many_in_a_run", b"\x9a" + (1 << 20).to_bytes(4, "big") + b"\x00" * (1 << 20),
       f"more than {transport.MAX_ITEMS} items."),
  )
  def test_a_run_of_items_is_refused_as_each_item_would_be(self, data, message):
    with self.assertRaisesRegex(transport.UnsafeCbor, "^" + re.escape(message)):
      transport.decode_safely(data, max_string=40)

  def test_runs_stepped_over_at_once_decide_as_the_item_by_item_walk(self):
    """Every one-byte change of a record with runs is accepted or refused, with the same
    message, whether runs are stepped over at once or item by item."""
    changed = [RUNS[:i] + bytes([v]) + RUNS[i + 1:] for i in range(len(RUNS))
               for v in {0x00, 0x18, 0x41, 0x58, 0x88, 0xc1, 0xff, (RUNS[i] + 1) % 256}]
    changed += [RUNS[:i] for i in range(len(RUNS))]
    with_runs = [_outcome(data) for data in changed]
    with mock.patch.object(transport, "_RUN_ITEMS", 1 << 30):
      item_by_item = [_outcome(data) for data in changed]
    self.assertEqual(with_runs, item_by_item)
    self.assertGreater(with_runs.count("accepted"), 50)
    self.assertGreater(len(set(with_runs)), 20)

  def test_the_canonical_walk_decides_as_encoding_again_and_comparing(self):
    """Random values, their canonical encodings, each head widened, floats widened,
    NaN payloads changed, every one-byte change and cut: the walk accepts exactly what
    a decoder that encodes again and compares accepts."""
    rng = random.Random(20261206)
    cases = []
    for _ in range(300):
      data = cbor2.dumps(_random_value(rng), canonical=True)
      cases.append(data)
      cases += _non_canonical_variants(data)
      at = rng.randrange(len(data))
      cases.append(data[:at] + bytes([rng.randrange(256)]) + data[at + 1:])
      cases.append(data[:at])
    cases += [cbor2.dumps(v) for v in ({"b": 1, "a": 2}, {"aa": 1, "b": 2}, {2: 0, 1: 0},
                                       [1.5] * 9, [2**40] * 9, [b"x" * 30] * 9)]
    double = b"\xfb" + struct.pack(">d", 0.1)
    cases += [b"\x89" + double * 8 + b"\xfb" + struct.pack(">d", 0.5), b"\x89" + double * 9,
              b"\x89" + b"\xf9\x7e\x00" * 8 + b"\xf9\x7e\x01", b"\x89" + b"\xf9\x7e\x00" * 9,
              b"\x89" + b"\x19\x01\x00" * 8 + b"\x19\x00\x05",
              b"\x89" + b"\xfa\x7f\x80\x00\x00" * 9]
    cases += [b"\xa2\x61a\x00\x61a\x01", b"\xa2\x01\x00\xf5\x00", b"\xa1\xf9\x3c\x00\x00",
              b"\xa1\x81\x00\x00", b"\x89" + b"\x18\x05" * 9, b"\x89" + b"\x58\x01x" * 9]
    walked = [_canonical_outcome(data) for data in cases]
    differ = [(data.hex(), w) for data, w in zip(cases, walked) if w != _reference(data)]
    self.assertEqual(differ[:3], [])
    self.assertGreater(walked.count("accepted"), 300)
    self.assertGreater(walked.count("refused"), 1000)

  @parameterized.named_parameters(
      ("long_integer", b"\x18\x05", "byte 0: not deterministically encoded (RFC 8949 §4.2): "
       "an integer in a longer head than it needs."),
      ("long_length", b"\x58\x01x", "byte 0: not deterministically encoded (RFC 8949 §4.2): "
       "a length in a longer head than it needs."),
      ("wide_float", b"\xfa\x3f\xc0\x00\x00", "byte 0: not deterministically encoded "
       "(RFC 8949 §4.2): a float that half precision holds exactly."),
      ("double_of_a_single", b"\xfb" + struct.pack(">d", 0.1015625 + 2**-20),
       "a float that single precision holds exactly."),
      ("nan_payload", b"\xf9\x7e\x01", "NaN other than f9 7e 00."),
      ("keys_out_of_order", b"\xa2\x61b\x00\x61a\x00", "byte 4: not deterministically "
       "encoded (RFC 8949 §4.2): map keys out of order or repeated."),
      ("repeated_key", b"\xa2\x61a\x00\x61a\x01", "map keys out of order or repeated."),
      ("bool_key", b"\xa1\xf5\x00", "a map key that is not a string or an integer."),
      ("array_key", b"\xa1\x81\x00\x00", "a map key that is not a string or an integer."),
      ("in_a_run", b"\x89" + b"\x18\x05" * 9, "byte 1: not deterministically encoded"),
  )
  def test_a_non_canonical_encoding_is_named(self, data, message):
    with self.assertRaisesRegex(transport.UnsafeCbor, re.escape(message)):
      transport.decode_safely(data, canonical=True)
    transport.decode_safely(data)  # well-formed all the same

  def test_items_count_across_levels(self):
    ok = cbor2.dumps([[0] * 3] * 3)  # 1 + 3 + 9 items
    transport.decode_safely(ok, max_items=13)
    with self.assertRaisesRegex(transport.UnsafeCbor, "more than 12 items"):
      transport.decode_safely(ok, max_items=12)

  def test_strings_over_the_limit_are_refused_before_they_are_read(self):
    transport.decode_safely(cbor2.dumps([b"x" * 10, "y" * 10]), max_string=10)
    for value in (b"x" * 11, "y" * 11):
      with self.assertRaisesRegex(transport.UnsafeCbor, "a string of 11 bytes; the limit is 10"):
        transport.decode_safely(cbor2.dumps([value]), max_string=10)

  def test_depth_at_the_limit_is_accepted(self):
    transport.decode_safely(b"\x81" * 16 + b"\x00")

  def test_a_non_canonical_encoding_is_refused_when_asked(self):
    long_form = b"\x18\x05"  # 5 in two bytes
    self.assertEqual(transport.decode_safely(long_form), 5)
    with self.assertRaisesRegex(transport.UnsafeCbor, "not deterministically encoded"):
      transport.decode_safely(long_form, canonical=True)


if __name__ == "__main__":
  absltest.main()
