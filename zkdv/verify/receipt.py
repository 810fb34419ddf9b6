"""The challenge key of a dvbench transcript: from its signed receipt, or given.

``DIR/receipt.cbor`` is opened with the server's public key
(``zkdv.receipt.open_receipt``) and must bind to this transcript: its
transcript id, server, owner, experiment, nonce, policy, record count and last
record are the root's and the file's, and ``BLAKE3(K)`` is the root's key
commitment. The server's own worker passes ``K`` directly (``challenge_key``):
that re-derives the challenges, but only a receipt shows who chose them, so a key
given by hand leaves the ``chain`` binding and ``challenges`` claims unverified.
After verification, ``compare_verdicts`` says whether the receipt agrees.

Example::

  ctx.keys = challenge_key(ctx, server_key=bytes.fromhex(hex_key), challenge_key=None)
"""

from zkdv import challenge
from zkdv import errors
from zkdv import receipt as receipt_lib
from zkdv.verify.context import KeySource, Verification
from zkdv.verify.report import UNVERIFIABLE, VERIFIED, INVALID

_VERDICTS = (VERIFIED, INVALID, UNVERIFIABLE)


def _root_field(name):
  return lambda fields, ctx: fields.get(name) == ctx.model.root["challenger"][name]


# Each receipt field and how it must match this transcript.
BINDING_RULES = (
    ("format", lambda f, ctx: f.get("format") == receipt_lib.RECEIPT_FORMAT),
    ("proof_id", lambda f, ctx: f.get("proof_id") == ctx.model.transcript_id.hex()),
    ("transcript_id", lambda f, ctx: f.get("transcript_id") == ctx.model.transcript_id),
    ("server_key", _root_field("server_key")),
    ("owner", _root_field("owner")),
    ("experiment", _root_field("experiment")),
    ("nonce", _root_field("nonce")),
    ("policy", _root_field("policy")),
    ("challenge_key", lambda f, ctx: isinstance(f.get("challenge_key"), bytes)
     and challenge.key_commitment(f["challenge_key"])
     == ctx.model.root["challenger"]["key_commitment"]),
    ("records", lambda f, ctx: f.get("records") == ctx.model.records),
    ("last_record_id", lambda f, ctx: f.get("last_record_id") == ctx.model.last_record_id),
    ("verdict", lambda f, ctx: f.get("verdict") in _VERDICTS),
)


def challenge_key(ctx: Verification, *, server_key: bytes | None,
                  challenge_key: bytes | None) -> KeySource:  # pylint: disable=redefined-outer-name
  """Where the key ``K`` of a dvbench transcript comes from, with findings for bad ones."""
  challenger, report = ctx.challenger, ctx.report
  if challenger is None or challenger.kind != "dvbench":
    if server_key is not None or challenge_key is not None:
      report.notes.append("a server key or challenge key was given, but the transcript is "
                          "not challenged by dvbench; it was ignored.")
    return KeySource(missing="not a dvbench transcript")
  if server_key is not None and server_key != challenger.fields["server_key"]:
    report.fail("server_key", "record 0 (challenger)",
                f"the root names server key {challenger.fields['server_key'].hex()[:16]}…, "
                f"not the given {server_key.hex()[:16]}…: another server challenged it.")
    return KeySource(missing="another server's transcript")
  if challenge_key is not None:
    if challenge.key_commitment(challenge_key) != challenger.fields["key_commitment"]:
      report.fail("challenge_key", "record 0 (challenger)", "the given challenge key does "
                  "not match the root's key commitment.")
      return KeySource(missing="the challenge key does not match")
    return KeySource(challenge_key, "challenge key")
  return _from_receipt(ctx, server_key)


def _from_receipt(ctx: Verification, server_key: bytes | None) -> KeySource:
  path = ctx.model.folder / receipt_lib.RECEIPT_FILE
  if not path.is_file():
    return KeySource(missing="no receipt/key")
  if server_key is None:
    ctx.report.notes.append(f"{path} was not checked: pass --server-key.")
    return KeySource(missing="receipt present; pass --server-key to check it")
  where = str(path)
  try:
    fields = receipt_lib.open_receipt(path.read_bytes(), server_key)
  except (OSError, errors.ReceiptError) as e:
    ctx.report.fail("receipt", where, str(e))
    return KeySource(missing="the receipt does not verify")
  unbound = [name for name, holds in BINDING_RULES if not holds(fields, ctx)]
  if unbound:
    ctx.report.fail("receipt", where, f"the receipt does not bind to this transcript: "
                    f"{', '.join(unbound)} differ.")
    return KeySource(missing="the receipt belongs to another transcript")
  ctx.report.receipt = {"server_key": server_key.hex(), "verdict": fields["verdict"],
                        "checks": fields.get("checks"), "issued_at": fields.get("issued_at"),
                        "standing": fields.get("standing"), "attempts": fields.get("attempts"),
                        "agrees": None}
  return KeySource(fields["challenge_key"], "receipt")


def compare_verdicts(ctx: Verification) -> None:
  """Records whether this verifier reaches the receipt's verdict (a finding if not)."""
  receipt = ctx.report.receipt
  if receipt is None:
    return
  ours = ctx.report.verdict
  receipt["agrees"] = ours == receipt["verdict"]
  if not receipt["agrees"]:
    ctx.report.fail("receipt_verdict", "receipt", f"the server's receipt says "
                    f"{receipt['verdict']!r}; this verifier finds {ours!r}.", UNVERIFIABLE)
