"""The safe decoding of what a prover sends: every head the walk refuses, named; every value
a canonical encoder writes, accepted and decoded as written."""

import re
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
