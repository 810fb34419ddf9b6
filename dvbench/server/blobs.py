"""The local content-addressed blob store ``DIR/<hex BLAKE3>`` and the one atomic file write.

Example::

  blobs = BlobStore("data/blobs")
  blobs.put(digest, data)               # False when data does not hash to digest
  blobs.link_into(folder, [digest])     # a verifier's private copy of a proof's blobs
"""

import os
import pathlib
import re
import shutil
import uuid

import blake3

_HEX = re.compile(r"[0-9a-f]{64}")


def write_atomically(path: pathlib.Path, data: bytes, mode: int = 0o644) -> None:
  """Writes ``path`` through a uniquely named temporary file, fsynced, then renamed.

  Readers see the old file or the whole new one, never a part.
  """
  path = pathlib.Path(path)
  tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
  try:
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


def hexdigest(data: bytes) -> str:
  return blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()


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
    """Stores ``data`` (read-only) under ``digest``; False when it does not hash to it."""
    path = self.path(digest)
    if hexdigest(data) != digest:
      return False
    if not path.exists():
      write_atomically(path, data, mode=0o444)
    return True

  def link_into(self, folder: pathlib.Path, digests) -> None:
    """Hard links (copies across file systems) ``digests`` into ``folder``: only those."""
    folder.mkdir(parents=True, exist_ok=True)
    for digest in digests:
      try:
        os.link(self.path(digest), folder / digest)
      except OSError:
        shutil.copyfile(self.path(digest), folder / digest)
