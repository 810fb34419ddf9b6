"""Strict schemas of the envelopes a client streams (``dvbench.transport``).

Each envelope kind lists its fields in ``ENVELOPE_FIELDS``; an envelope carries exactly
its kind's fields, each typed and bounded (``zkdv.fields``). The records inside are
checked by ``zkdv.records.check_record``, the one definition the verifier uses too.
Everything is checked before any database work, and a refusal names the field, e.g.
``envelope.seq: an integer in [0, 9007199254740992), got -1.``

Example::

  envelope = check_envelope(decode(body, "the envelope"))  # raises Invalid naming a field
"""

from zkdv.fields import MAX_INDEX, Bytes, Field, Int, Invalid, ListOf, Text, check_fields, describe
from zkdv.records import DIGEST

MAX_CHUNKS = 65536
_REQ = True

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
