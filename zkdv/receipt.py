"""Signed receipts: the server's word on a proof, checkable by anyone.

At close, after its workers replayed every check, DVBench publishes the
proof's challenge key ``K`` in a receipt signed with its Ed25519 key
(``docs/protocol.md``). A receipt is the deterministic CBOR of
``{"receipt": fields, "signature": Ed25519(encoded fields)}``.

Example::

  key = new_signing_key()
  encoded = sign({"format": 1, "proof_id": "ab..", ...}, key)
  fields = open_receipt(encoded, public_key_bytes(key))
"""

import cbor2
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from zkdv import errors

RECEIPT_FORMAT = 1
RECEIPT_FILE = "receipt.cbor"
PUBLIC_KEY_BYTES = 32
_MAX_RECEIPT_BYTES = 1 << 16


def new_signing_key() -> ed25519.Ed25519PrivateKey:
  return ed25519.Ed25519PrivateKey.generate()


def public_key_bytes(key: ed25519.Ed25519PrivateKey) -> bytes:
  return key.public_key().public_bytes(serialization.Encoding.Raw,
                                       serialization.PublicFormat.Raw)


def private_key_pem(key: ed25519.Ed25519PrivateKey) -> bytes:
  return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                           serialization.NoEncryption())


def load_private_key_pem(data: bytes) -> ed25519.Ed25519PrivateKey:
  key = serialization.load_pem_private_key(data, password=None)
  if not isinstance(key, ed25519.Ed25519PrivateKey):
    raise ValueError("the server key is not an Ed25519 private key.")
  return key


def parse_public_key(text: str | bytes) -> bytes:
  """A 32-byte Ed25519 public key from raw bytes or 64 hex digits."""
  if isinstance(text, str):
    try:
      text = bytes.fromhex(text.strip())
    except ValueError:
      raise ValueError("a server key is 64 hex digits (see 'dvbench server-key').") from None
  if len(text) != PUBLIC_KEY_BYTES:
    raise ValueError(f"a server key has {PUBLIC_KEY_BYTES} bytes, got {len(text)}.")
  return bytes(text)


def sign(fields: dict, key: ed25519.Ed25519PrivateKey) -> bytes:
  """The encoded receipt: ``fields`` and the signature over their canonical CBOR."""
  body = cbor2.dumps(fields, canonical=True)
  return cbor2.dumps({"receipt": fields, "signature": key.sign(body)}, canonical=True)


def open_receipt(encoded: bytes, public_key: bytes) -> dict:
  """The receipt's fields, after checking its signature with ``public_key``.

  Raises ReceiptError naming what is wrong: not a receipt, a bad signature
  (altered, or signed by another server).
  """
  if not isinstance(encoded, bytes) or len(encoded) > _MAX_RECEIPT_BYTES:
    raise errors.ReceiptError("the receipt is missing or larger than 64 KiB.")
  try:
    outer = cbor2.loads(encoded)
  except Exception as e:  # pylint: disable=broad-except  # any decoding failure is a bad receipt
    raise errors.ReceiptError(f"the receipt is not CBOR: {type(e).__name__}: {e}") from None
  if (not isinstance(outer, dict) or set(outer) != {"receipt", "signature"}
      or not isinstance(outer["receipt"], dict) or not isinstance(outer["signature"], bytes)):
    raise errors.ReceiptError("the receipt must be a map of 'receipt' and 'signature'.")
  if cbor2.dumps(outer, canonical=True) != encoded:
    raise errors.ReceiptError("the receipt is not deterministically encoded.")
  try:
    ed25519.Ed25519PublicKey.from_public_bytes(parse_public_key(public_key)).verify(
        outer["signature"], cbor2.dumps(outer["receipt"], canonical=True))
  except (InvalidSignature, ValueError):
    raise errors.ReceiptError(
        "the receipt's signature does not verify with the given server key: it was "
        "altered, or signed by another server.") from None
  return outer["receipt"]
