"""One definition of each record kind: the server and the verifier accept and refuse alike.

Every record kind of an honest transcript (and an attested start's ``init`` and ``start``
check) is mutated field by field (a wrong type, a value out of bounds, a missing field, an
extra field), then judged by the server's ingest (``custody.parse_record``: decoding and
schema, before any database work) and by the verifier's reading of a transcript holding it
(``structure.read``). Both must accept or both refuse, naming the field.
"""

import dataclasses
import functools
import re
from unittest import mock

import cbor2
import numpy as np

from absl.testing import absltest
from absl.testing import parameterized
from starlette.exceptions import HTTPException

from dvbench.server import custody
from tests.verify_test import good_transcript, records_of
from zkdv import fields
from zkdv import programs
from zkdv import records
from zkdv import transcript
from zkdv.digest import LeafLayout
from zkdv.verify import structure
from zkdv.verify.report import Report

EXTRA = "zz_extra"


def out_of_bounds(spec):
  """A value of the right type that ``spec`` refuses: past a bound, or not a choice."""
  if isinstance(spec, fields.Int):
    return spec.high
  if isinstance(spec, fields.Bytes):
    return bytes((spec.size if spec.size is not None else spec.max_size) + 1)
  if isinstance(spec, fields.Text):
    return "not one of them" if spec.choices else "x" * (spec.max_len + 1)
  if isinstance(spec, fields.ListOf):
    return [out_of_bounds(spec.item)]
  if isinstance(spec, fields.Row):
    return [out_of_bounds(spec.items[0]), *(None for _ in spec.items[1:])]
  if isinstance(spec, (fields.Optional,)):
    return out_of_bounds(spec.inner)
  if isinstance(spec, fields.Either):
    return out_of_bounds(spec.first)
  if isinstance(spec, (fields.Map, fields.Free)):
    return {"text": "x" * (fields.MAX_TEXT + 1)}
  if isinstance(spec, records.FormatVersion):
    return transcript.FORMAT_VERSION + 1
  if isinstance(spec, records.StepMetrics):
    return {"no spaces allowed": 1}
  if isinstance(spec, records.Tag):
    return "x" * 65
  if isinstance(spec, records.RunConfig):
    return {str(n): n for n in range(spec.MAX_ENTRIES + 1)}
  raise AssertionError(f"no out-of-bounds value for {spec!r}")


@functools.cache
def honest_records() -> tuple:
  """An honest transcript's records with an attested start's init and start check added
  (chained anew: the verifier reads them in order)."""
  recs = [dict(r) for r in records_of(good_transcript())]
  digest = bytes(range(32))
  layout = {"path": "[0]", "dtype": "uint32", "shape": [2]}
  init = {"type": "init", "program_id": digest, "input_layout": [layout],
          "input_blobs": [digest], "output_layout": [layout], "outputs": [digest],
          "platforms": ["cpu"], "function": "init",
          "base_layout": [{**layout, "path": "['w']"}], "base_checkpoint": digest}
  start = {"type": "check", "step": 0, "kind": "start", "pre_state_pieces": [[digest]]}
  step0 = next(n for n, r in enumerate(recs) if r["type"] == "step")
  recs = [recs[0], init, *recs[1:step0 + 1], start, *recs[step0 + 1:]]
  return tuple(recs)


def chained(recs) -> list[transcript.ParsedRecord]:
  parsed, prev, offset = [], None, 0
  for record in recs:
    record = {k: v for k, v in record.items() if k != "prev"}
    if prev is not None:
      record["prev"] = prev
    raw = transcript.encode_record(record)
    parsed.append(transcript.ParsedRecord(record, raw, offset))
    prev, offset = transcript.record_id(raw), offset + len(raw)
  return parsed


def position_of(kind: str, check_kind: str | None = None) -> int:
  return next(n for n, r in enumerate(honest_records()) if r["type"] == kind
              and (check_kind is None or r["kind"] == check_kind))


def server_judges(record: dict, n: int) -> str | None:
  """The server's refusal of record ``n`` (400, its message), or None when it takes it."""
  try:
    custody.parse_record(transcript.encode_record(record), n)
  except HTTPException as e:
    assert e.status_code == 400, e
    return e.detail
  return None


def verifier_judges(recs: list[dict], n: int) -> str | None:
  """The verifier's finding that record ``n`` of ``recs`` is malformed, or None (its
  format is a finding of its own: no other record is read then)."""
  report = Report(path="in memory")
  contents = transcript.TranscriptContents(chained(recs), None)
  structure.read(contents, good_transcript(), report)
  found = [f.message for f in report.findings
           if f.code in ("schema", "format_version") and f.where == f"record {n}"]
  return found[0] if found else None


def mutations():
  """(name, record position, edit of the record, field named, refused) for every listed
  field of every record kind."""
  kinds = [("root", None), ("init", None), ("program", None), ("step", None),
           *(("check", k) for k in records.CHECK_KINDS), ("final", None)]
  cases = []
  for kind, check_kind in kinds:
    n = position_of(kind, check_kind)
    label = check_kind or kind
    honest = honest_records()[n]
    listed = records.fields_of(honest)
    cases.append((f"{label}_as_written", n, lambda r: None, None, False))
    cases.append((f"{label}_extra_field", n, lambda r: r.update({EXTRA: 1}), EXTRA, True))
    for name, field in listed.items():
      if name in ("type", "prev") or (kind == "check" and name == "kind"):
        continue  # which kind a record is, and its chain: tests of their own below
      cases.append((f"{label}_{name}_wrong_type", n,
                    lambda r, name=name: r.update({name: 0.5}), name, True))
      cases.append((f"{label}_{name}_out_of_bounds", n,
                    lambda r, name=name, spec=field.spec: r.update({name: out_of_bounds(spec)}),
                    name, True))
      if name in honest:  # an optional field, save the params of a TrainState's state
        cases.append((f"{label}_{name}_missing", n, lambda r, name=name: r.pop(name),
                      name, field.required or name == "params_leaves"))
  return [dict(testcase_name=c[0], position=c[1], edit=c[2], named=c[3], refused=c[4])
          for c in cases]


class ServerAndVerifierAgreeTest(parameterized.TestCase):

  @parameterized.named_parameters(*mutations())
  def test_a_mutated_record_is_judged_alike(self, position, edit, named, refused):
    recs = [dict(r) for r in honest_records()]
    record = recs[position]
    edit(record)
    server = server_judges(chained(recs)[position].record, position)
    verifier = verifier_judges(recs, position)
    self.assertEqual((server is not None, verifier is not None), (refused, refused),
                     f"server: {server}; verifier: {verifier}")
    if refused:
      for message in (server, verifier):
        self.assertIn(named, message)
        self.assertIn(f"record {position} ({record['type']})", message)

  @parameterized.parameters("zz", 7, None)
  def test_an_unknown_record_type_is_refused_alike(self, kind):
    recs = [dict(r) for r in honest_records()]
    recs[3]["type"] = kind
    for message in (server_judges(chained(recs)[3].record, 3), verifier_judges(recs, 3)):
      self.assertIn("record 3.type", message)

  def test_an_unknown_check_kind_is_refused_alike(self):
    recs = [dict(r) for r in honest_records()]
    n = position_of("check", "update")
    recs[n]["kind"] = "audit"
    for message in (server_judges(chained(recs)[n].record, n), verifier_judges(recs, n)):
      self.assertIn(f"record {n} (check).kind: one of ['update', 'state', 'probe', 'start']",
                    message)

  def test_a_record_without_prev_is_refused_by_both(self):
    recs = chained(honest_records())
    n = position_of("final")
    record = {k: v for k, v in recs[n].record.items() if k != "prev"}
    self.assertIn("'prev' is missing", server_judges(record, n))
    report = Report(path="in memory")
    edited = [*recs[:n], dataclasses.replace(recs[n], record=record,
                                             raw=transcript.encode_record(record))]
    structure.read(transcript.TranscriptContents(edited, None), good_transcript(), report)
    self.assertIn(("chain", f"record {n}"), [(f.code, f.where) for f in report.findings])

  def test_a_field_added_to_the_one_table_is_checked_by_both(self):
    n = position_of("step")
    step_fields = {**records.RECORD_FIELDS["step"], "note": fields.Field(fields.Text(8))}
    with mock.patch.dict(records.RECORD_FIELDS, {"step": step_fields}):
      for note, refused in (("short", False), ("far too long", True)):
        recs = [dict(r) for r in honest_records()]
        recs[n]["note"] = note
        server = server_judges(chained(recs)[n].record, n)
        verifier = verifier_judges(recs, n)
        self.assertEqual((server is not None, verifier is not None), (refused, refused))
        if refused:
          self.assertEqual(server, verifier)
          self.assertIn(f"record {n} (step).note: a string of 0-8 characters", server)


def _layout(record: dict, field: str, n: int, **changes) -> None:
  record[field] = [dict(l) for l in record[field]]
  record[field][n].update(changes)


# (rule, field named, edit of the honest program or init record): one bad record per rule
# of zkdv.programs (and of an init's layouts).
PROGRAM_RULE_BREAKS = (
    ("a layout of an unknown dtype", "state_layout[0]",
     lambda r: _layout(r, "state_layout", 0, dtype="float33")),
    ("a layout without a path", "batch_layout[0]",
     lambda r: r.update(batch_layout=[{"dtype": "float32", "shape": [5, 3]}])),
    ("a layout of 2**40 elements", "state_layout[0].shape",
     lambda r: _layout(r, "state_layout", 0, shape=[1 << 20, 1 << 20])),
    ("row groups only in batches", "state_layout",
     lambda r: _layout(r, "state_layout", 0, row_group=3)),
    ("batch row groups", "batch_layout[0]",
     lambda r: _layout(r, "batch_layout", 0, row_group=5)),
    ("few empty batch rows", "batch_layout[0]",
     lambda r: _layout(r, "batch_layout", 0, shape=[(1 << 16) + 1, 0])),
    ("shard pieces that tile their leaf", "state_layout[0].pieces",
     lambda r: _layout(r, "state_layout", 0, pieces=[[[0, 1]]])),
    ("post-state laid out as the state", "post_state_layout",
     lambda r: r.update(post_state_layout=[{**r["state_layout"][0], "shape": [4]},
                                           r["state_layout"][1]])),
    ("inputs match the layouts", "inputs",
     lambda r: r.update(inputs=["state", "batch", "batch"])),
    ("params are state leaves", "params_leaves", lambda r: r.update(params_leaves=[0, 2])),
    ("a TrainState's params are params", "params_leaves",
     lambda r: r.update(params_leaves=[1])),
    ("an output per state leaf", "post_state_outputs",
     lambda r: r.update(post_state_outputs=[0])),
    ("distinct metric outputs", "metric_outputs",
     lambda r: r.update(metric_outputs=[["loss", 2], ["loss", 3]])),
    ("a metric output that is a post-state output", "metric_outputs",
     lambda r: r.update(metric_outputs=[["loss", 1]])),
    ("a metric name zkdv.metrics refuses", "metric_outputs",
     lambda r: r.update(metric_outputs=[["no spaces", 2]])),
    ("init: a blob per input leaf", "input_blobs", lambda r: r.update(input_blobs=[])),
    ("init: a digest per output leaf", "outputs",
     lambda r: r.update(outputs=[*r["outputs"], r["outputs"][0]])),
    ("init: a layout of an unknown dtype", "input_layout[0]",
     lambda r: _layout(r, "input_layout", 0, dtype="uint33")),
    ("init: a base checkpoint layout of an unknown dtype", "base_layout[0]",
     lambda r: r.update(base_layout=[{**r["input_layout"][0], "dtype": "uint33"}],
                        base_checkpoint=r["outputs"][0])),
)


class ProgramRulesTest(parameterized.TestCase):
  """The rules across a program's fields (``zkdv.programs``) are the server's and the
  verifier's alike: a program record breaking one is refused by both, naming its field."""

  def test_honest_program_and_init_records_are_taken_by_both(self):
    recs = [dict(r) for r in honest_records()]
    for n in (position_of("program"), position_of("init")):
      self.assertIsNone(server_judges(chained(recs)[n].record, n))
      self.assertIsNone(verifier_judges(recs, n))

  def test_every_rule_is_broken_below(self):
    broken = {rule for rule, _, _ in PROGRAM_RULE_BREAKS}
    self.assertLessEqual(set(programs.PROGRAM_RULES), broken)

  @parameterized.named_parameters(
      (rule.replace(" ", "_").replace(":", "").replace("*", ""), rule, field, edit)
      for rule, field, edit in PROGRAM_RULE_BREAKS)
  def test_a_program_breaking_a_rule_is_refused_by_both(self, rule, field, edit):
    n = position_of("init" if rule.startswith("init") else "program")
    recs = [dict(r) for r in honest_records()]
    edit(recs[n])
    server = server_judges(chained(recs)[n].record, n)
    verifier = verifier_judges(recs, n)
    self.assertIsNotNone(server, rule)
    self.assertEqual(server, verifier)
    self.assertIn(f"record {n} ({recs[n]['type']}).{field}: ", server)


class FreeMapTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("long_string", {"a": [1, {"b": "x" * (fields.MAX_TEXT + 1)}]},
       "metrics.a[1].b: a string of at most"),
      ("long_key", {"a": [{"k" * 401: 1}]}, "metrics.a[0]: a map with string keys"),
      ("key_not_text", {"a": {"b": {3: 1}}}, "metrics.a.b: a map with string keys"))
  def test_what_is_wrong_is_named_by_its_path(self, value, named):
    with self.assertRaisesRegex(fields.Invalid, re.escape(named)):
      fields.FREE.check(value, "metrics")

  def test_a_valid_value_passes(self):
    fields.FREE.check({"a": [1, 2.0, b"x", None, {"b": "y" * fields.MAX_TEXT}]}, "metrics")


class NestedPathTest(parameterized.TestCase):
  """A list's items are checked without formatting their paths; the one that fails is
  named by its full path all the same."""

  @parameterized.named_parameters(
      ("list_item", fields.ListOf(fields.ListOf(fields.Int(0, 10))), [[1], [2, 3, 11]],
       "body.x[1][2]: an integer in [0, 10), got 11."),
      ("row_item", fields.ListOf(fields.Row((fields.Int(), fields.Bytes(4)))),
       [[0, b"abcd"], [1, b"abc"]], "body.x[1][1]: 4 bytes, got bytes of length 3."),
      ("either_item", fields.ListOf(records.PROBED_BYTES), [b"ab", [b"a", b"b"], [b"a"]],
       "body.x[2]: a Merkle row's bytes, or a list of chunks"))
  def test_the_failing_item_is_named_by_its_path(self, spec, value, named):
    with self.assertRaisesRegex(fields.Invalid, "^" + re.escape(named)):
      spec.check(value, "body.x")

  @parameterized.parameters(
      ([b"a" * 32] * 3, True), ([b"a" * 32, b"a" * 31], False), ([b"a" * 32, "a" * 32], False),
      ([b"a" * 32, bytearray(32)], False), ([], True))
  def test_a_quick_pass_over_a_list_agrees_with_its_checks(self, values, all_pass):
    for spec in (fields.Bytes(32), fields.Either(fields.Bytes(32), fields.Int(), "either")):
      self.assertEqual(spec.accepts_all(values), all_pass)
      passed = True
      for value in values:
        try:
          spec.check(value, "x")
        except fields.Invalid:
          passed = False
      self.assertEqual(passed, all_pass)
    self.assertFalse(fields.Int().accepts_all([1]))  # no quick test: each is checked

  def test_each_item_is_checked_once_even_the_one_that_fails(self):
    checked = []

    class Counted(fields.Int):
      def check(self, value, where):
        checked.append(value)
        super().check(value, where)

    nested = fields.ListOf(fields.ListOf(fields.ListOf(Counted(0, 10))))
    value = [[[1] * 50, [2] * 50], [[3] * 50 + [11]]]  # a re-check per level would count more
    with self.assertRaisesRegex(fields.Invalid, r"^body\.x\[1\]\[0\]\[50\]: an integer"):
      nested.check(value, "body.x")
    self.assertLen(checked, 151)

  def test_a_probe_check_whose_unlisted_field_is_unbounded_is_refused(self):
    record = {"type": "check", "kind": "probe", "step": 0, "prev": bytes(32),
              "batch_roots": [bytes(32)], "probes": [[0, 0, 1, b"row", []]],
              "zz_extra": {"a": "x" * (fields.MAX_TEXT + 1)}}
    with self.assertRaisesRegex(fields.Invalid, r"r \(check\)\.zz_extra\.a: a string of"):
      records.check_record(record, "r")
    del record["zz_extra"]
    self.assertEqual(records.check_record(record, "r"), "check")


class ProbedRowsTest(absltest.TestCase):
  """A probed Merkle row travels inline: its leading-axis rows' bytes joined in one byte
  string with their count, a row wider than a record's byte strings as chunks."""

  def test_rows_round_trip_and_wide_rows_are_chunked(self):
    group = bytes(range(12))
    entry = records.probe_entry(1, 5, group, 3, [bytes(32)])
    self.assertEqual(entry, [1, 5, 3, group, [bytes(32)]])
    self.assertEqual(records.probed_rows(entry), [group[0:4], group[4:8], group[8:12]])
    # rows of no bytes open nothing, however many the entry counts
    self.assertEqual(records.probed_rows(records.probe_entry(0, 0, b"", 1 << 20, [])), [])
    with mock.patch.object(records, "MAX_STRING_BYTES", 5):
      chunked = records.probe_entry(0, 0, group, 2, [])
    self.assertEqual(chunked[3], [group[0:5], group[5:10], group[10:12]])
    self.assertEqual(records.probed_bytes(chunked), group)
    self.assertEqual(records.probed_rows(chunked), [group[:6], group[6:]])

  def test_rows_of_a_uint8_view_are_bytes_with_their_zero_bytes(self):
    labels = np.array([0, 256, 7, 0], np.int32)  # rows ending in, and made of, zero bytes
    view = labels.view(np.uint8)[4:]  # a view that starts inside the buffer
    entry = records.probe_entry(0, 0, view, 3, [])
    self.assertIs(type(entry[3]), bytes)
    rows = records.probed_rows(entry)
    self.assertEqual(rows, [labels[1:2].tobytes(), labels[2:3].tobytes(), bytes(4)])
    self.assertEqual(cbor2.loads(transcript.encode_record({"e": entry}))["e"], entry)

  def test_rows_are_counted_against_quotas_at_most_one_a_byte(self):
    self.assertEqual(records.opened_row_count([0, 0, 3, bytes(12), []]), 3)
    self.assertEqual(records.opened_row_count([0, 0, 3, [bytes(1), bytes(1)], []]), 2)
    # a count the bytes do not carry costs nothing: rows of no bytes are all one digest
    self.assertEqual(records.opened_row_count([0, 0, 1 << 20, b"", []]), 0)
    self.assertEqual((records.counted_rows(5, 20), records.counted_rows(5, 3),
                      records.counted_rows(1 << 20, 0)), (5, 3, 0))

  def test_a_step_whose_probes_outgrow_a_record_is_refused(self):
    images = LeafLayout("x", "float32", (1024, 224, 224, 3))  # 588 KiB a row
    records.check_probe_size([images], 0.01)  # a probed step: 32 rows, 19 MB
    with self.assertRaisesRegex(records.Invalid, r"1024 rows \(616562688 bytes"):
      records.check_probe_size([images], 1.0)
    labels = LeafLayout("y", "uint8", (1 << 20,), row_group=16384)
    records.check_probe_size([labels], 1.0)  # 64 Merkle rows of 16 KiB: 64 byte strings
    with self.assertRaisesRegex(records.Invalid, "524288 rows"):  # each with a dataset path
      records.check_probe_size([labels], 0.5, path_depth=21)
    with self.assertRaisesRegex(records.Invalid, "choose a smaller probe_ratio"):
      records.check_probe_size([labels], 0.1, path_depth=60)
    # Below 1/32 a probed step opens a 32nd of each leaf whatever the ratio: none smaller fits.
    with self.assertRaisesRegex(records.Invalid, "no probe ratio above 0 fits"):
      records.check_probe_size([labels], 0.02, path_depth=60)

  def test_the_schema_takes_rows_and_chunk_lists_only(self):
    probe = {"type": "check", "step": 0, "kind": "probe", "batch_roots": [bytes(32)],
             "prev": bytes(32)}
    wide = bytes(records.MAX_STRING_BYTES)
    for count, data in ((1, b"row"), (2, [wide, b"re"]), (3, b""), (2, [wide, wide])):
      records.check_record({**probe, "probes": [[0, 0, count, data, []]]}, "record 1")
    for count, data, named in (
        (1, [], "probes[0][3]"), (1, [b"one chunk"], "probes[0][3]"),
        (1, wide + b"x", "probes[0][3]"), (1, 7, "probes[0][3]"), (1, [b"a"] * 257, "probes[0][3]"),
        (0, b"", "probes[0][2]"), (records.MAX_RECORD_ITEMS + 1, b"", "probes[0][2]"),
        (3, b"ab", "probes[0]: 2 bytes do not split into 3 rows"),
        # one encoding of a Merkle row: chunks only past MAX_STRING_BYTES, cut as written
        (1, [b"", wide], "probes[0][3]: chunks of 1048576 bytes each but the last"),
        (2, [b"a", b"b"], "probes[0][3]: chunks of 1048576 bytes each but the last"),
        (1, [wide, b""], "probes[0][3]: chunks of 1048576 bytes each but the last"),
        (2, [wide, b"r"], "probes[0]: 1048577 bytes do not split into 2 rows")):
      with self.assertRaisesRegex(records.Invalid, re.escape(f"(check).{named}")):
        records.check_record({**probe, "probes": [[0, 0, count, data, []]]}, "record 1")
    with self.assertRaisesRegex(records.Invalid, re.escape("(check).probes[0]: a list of 5")):
      records.check_record({**probe, "probes": [[0, 0, [b"row"], []]]}, "record 1")  # format 8


if __name__ == "__main__":
  absltest.main()
