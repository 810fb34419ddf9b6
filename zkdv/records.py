"""The one definition of each transcript record kind: its fields, their types and bounds.

The server checks every record it ingests (``dvbench.server.custody``) and the verifier
every record it reads (``zkdv.verify.structure``) with ``check_record``: a field is
added, typed or bounded here and nowhere else (docs/protocol.md describes each). A
record must carry its kind's required fields, each listed field must match its spec,
and a field its kind does not list is refused (``UnknownField``). A refusal names the
field, e.g. ``record 1 (step).index: an integer in [0, 2**40), got -1.``

Example::

  check_record({"type": "step", "index": 0, "program": 0, "batch": bytes(32),
                "prev": bytes(32)}, "record 1")  # returns "step"
  fields_of({"type": "check", "kind": "state"})  # type, step, kind, post_state_blobs, prev
"""

from zkdv import challenge
from zkdv import errors
from zkdv import metrics
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


REQUIRED = True
INDEX = Int()
DIGEST = Bytes()
DIGESTS = ListOf(DIGEST)
PIECES = ListOf(ListOf(Optional(DIGEST)))  # per leaf, the digest of each piece
LAYOUTS = ListOf(Map())  # each checked by zkdv.digest.LeafLayout.from_record
NAME = Text(400)
NAMES = ListOf(NAME, 4096)
RECORD_TYPE = Field(Text(20, ("root", "init", "program", "step", "check", "resume", "final")),
                    REQUIRED)
PREV = Field(DIGEST, REQUIRED)  # every record but the root chains to the one before

RECORD_FIELDS: dict[str, dict[str, Field]] = {
    "root": {"format_version": Field(FormatVersion(), REQUIRED),
             "prover": Field(Text(400, (transcript.PROVER,)), REQUIRED),
             "name": Field(Text(MAX_TEXT), REQUIRED), "versions": Field(Map(), REQUIRED),
             "platform": Field(NAME, REQUIRED), "config": Field(Map(), REQUIRED),
             # its fields are checked where it is read (zkdv.verify.policy) or bound
             # (dvbench.server.routes_proofs)
             "challenger": Field(Map(), REQUIRED),
             "device_kinds": Field(NAMES), "processes": Field(Int(1, 1 << 20))},
    "init": {"program_id": Field(DIGEST, REQUIRED), "input_layout": Field(LAYOUTS, REQUIRED),
             "input_blobs": Field(DIGESTS, REQUIRED), "output_layout": Field(LAYOUTS, REQUIRED),
             "outputs": Field(DIGESTS, REQUIRED), "platforms": Field(NAMES, REQUIRED),
             "function": Field(Text(MAX_TEXT))},
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
                # [metric name, output index]; names and indices are checked when read
                "metric_outputs": Field(ListOf(Row((Text(metrics.MAX_NAME_LENGTH), INDEX)),
                                               metrics.MAX_METRICS))},
    # The states are committed where a segment starts (pre_state) and ends (post_state).
    "step": {"index": Field(INDEX, REQUIRED), "program": Field(INDEX, REQUIRED),
             "batch": Field(DIGEST, REQUIRED), "pre_state": Field(DIGEST),
             "post_state": Field(DIGEST), "metrics": Field(StepMetrics()),
             # the post-state's piece digests, per leaf: a resumed run names the leaf
             # its restored state differs in (``zkdv.jax.resume``)
             "post_state_leaves": Field(PIECES)},
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
               "result": Field(Map())},
    "state": {"post_state_blobs": Field(DIGESTS, REQUIRED)},
    # [leaf, Merkle row, its blob digest (a group of rows: one per row), inclusion proof]
    "probe": {"batch_roots": Field(DIGESTS, REQUIRED),
              "probes": Field(ListOf(Row((INDEX, INDEX, Either(DIGEST, DIGESTS,
                                                               "a digest or a list of them"),
                                          ListOf(DIGEST, 64)))), REQUIRED)},
    "start": {"pre_state_pieces": Field(PIECES, REQUIRED)},
}


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
  if kind == "check":
    check_fields(record, RECORD_FIELDS["check"], where)
  check_fields(record, fields_of(record), where, strict=True)
  return kind
