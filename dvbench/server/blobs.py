"""The local content-addressed blob store: ``DIR/<hex BLAKE3>``."""

import os
import pathlib
import re

import blake3

_HEX = re.compile(r"[0-9a-f]{64}")


class BlobStore:
  """Blobs named by the BLAKE3 of their bytes; a wrong name is refused."""

  def __init__(self, folder: str | os.PathLike):
    self.folder = pathlib.Path(folder)
    self.folder.mkdir(parents=True, exist_ok=True)

  @staticmethod
  def valid_name(digest: str) -> bool:
    return bool(_HEX.fullmatch(digest))

  def path(self, digest: str) -> pathlib.Path:
    if not self.valid_name(digest):
      raise ValueError(f"{digest!r} is not a blob digest (64 lowercase hex digits).")
    return self.folder / digest

  def has(self, digest: str) -> bool:
    return self.path(digest).exists()

  def put(self, digest: str, data: bytes) -> bool:
    """Stores ``data`` under ``digest``; False when it does not hash to it."""
    path = self.path(digest)
    if blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest() != digest:
      return False
    if not path.exists():
      tmp = path.with_name(f".{digest}.{os.getpid()}.tmp")
      tmp.write_bytes(data)
      os.replace(tmp, path)
    return True
