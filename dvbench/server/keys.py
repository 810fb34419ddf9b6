"""The server's Ed25519 signing key: ``DATA/server_key.pem``, created on first start (0600).

Example::

  key = load_or_create(pathlib.Path("dvbench-data"))
  print(receipt.public_key_bytes(key).hex())
"""

import os
import pathlib

from cryptography.hazmat.primitives.asymmetric import ed25519

from zkdv import receipt

KEY_FILE = "server_key.pem"


def load_or_create(data: pathlib.Path) -> ed25519.Ed25519PrivateKey:
  """The key in ``data``; a new one is written there (owner-only) when none exists."""
  path = pathlib.Path(data) / KEY_FILE
  path.parent.mkdir(parents=True, exist_ok=True)
  try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  except FileExistsError:
    return receipt.load_private_key_pem(path.read_bytes())
  key = receipt.new_signing_key()
  with os.fdopen(fd, "wb") as f:
    f.write(receipt.private_key_pem(key))
    f.flush()
    os.fsync(f.fileno())
  return key
