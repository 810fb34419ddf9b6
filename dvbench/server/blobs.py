"""The local content-addressed blob store ``DIR/<hex BLAKE3>``.

Example::

  blobs = BlobStore("data/blobs")
  blobs.put(digest, data)               # False when data does not hash to digest
  blobs.link_into(folder, [digest])     # a verifier's private copy of a proof's blobs
"""

import os
import pathlib
import re
import shutil

import blake3

from zkdv.transcript import write_atomically

_HEX = re.compile(r"[0-9a-f]{64}")


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
    """Stores ``data`` (read-only) under ``digest``; False when it does not hash to it.

    Each write goes through its own temporary file, fsynced, then renamed (and the folder
    fsynced): concurrent writers of one blob each rename a whole copy, and the final name
    never holds a part.
    """
    path = self.path(digest)
    if hexdigest(data) != digest:
      return False
    if not path.exists():
      write_atomically(path, data, mode=0o444)
      folder = os.open(self.folder, os.O_RDONLY)
      try:
        os.fsync(folder)
      finally:
        os.close(folder)
    return True

  def link_into(self, folder: pathlib.Path, digests) -> None:
    """Hard links (copies across file systems) ``digests`` into ``folder``: only those."""
    folder.mkdir(parents=True, exist_ok=True)
    for digest in digests:
      try:
        os.link(self.path(digest), folder / digest)
      except OSError:
        shutil.copyfile(self.path(digest), folder / digest)
