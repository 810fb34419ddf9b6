"""The local content-addressed blob store ``DIR/<hex BLAKE3>``.

Example::

  blobs = BlobStore("data/blobs")
  upload = blobs.upload(digest)         # a blob arriving in parts, never whole in memory
  upload.write(part); upload.commit()   # False when the parts do not hash to digest
  blobs.link_into(folder, [digest])     # a verifier's private copy of a proof's blobs
"""

import os
import pathlib
import re
import shutil
import time
import uuid

import blake3

from zkdv.digest import hash_threads

_HEX = re.compile(r"[0-9a-f]{64}")


def hexdigest(data: bytes) -> str:
  return blake3.blake3(data, max_threads=hash_threads(len(data))).hexdigest()


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

  def size(self, digest: str) -> int:
    """Bytes of blob ``digest`` (0 when it is not stored)."""
    try:
      return self.path(digest).stat().st_size
    except FileNotFoundError:
      return 0

  def upload(self, digest: str) -> "BlobUpload":
    """A blob of ``digest`` to write in parts (``BlobUpload``)."""
    return BlobUpload(self.path(digest))

  def put_many(self, blobs: list[tuple[str, bytes]]) -> None:
    """Stores small blobs whose bytes were checked against their names: all written, then
    fsynced back to back, renamed, and the folder fsynced once (an ``upload`` each would
    sync the folder each time)."""
    written = []
    try:
      for digest, data in blobs:
        path = self.path(digest)
        if path.exists():
          continue
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444), "wb") as f:
          f.write(data)
        written.append((tmp, path))
      for tmp, _ in written:
        _fsync(tmp)
      for tmp, path in written:
        os.replace(tmp, path)
      if written:
        _fsync(self.folder)
    finally:
      for tmp, _ in written:
        tmp.unlink(missing_ok=True)

  def remove_stale_parts(self, older_than: float) -> int:
    """Removes the temporary files of uploads that stopped over ``older_than`` seconds
    ago (a server killed mid-upload leaves them); returns how many."""
    removed = 0
    for part in self.folder.glob(".*.part"):
      try:
        if time.time() - part.stat().st_mtime > older_than:
          part.unlink()
          removed += 1
      except FileNotFoundError:  # its upload finished meanwhile
        pass
    return removed

  def link_into(self, folder: pathlib.Path, digests) -> None:
    """Hard links (copies across file systems) ``digests`` into ``folder``: only those."""
    folder.mkdir(parents=True, exist_ok=True)
    for digest in digests:
      try:
        os.link(self.path(digest), folder / digest)
      except OSError:
        shutil.copyfile(self.path(digest), folder / digest)


class BlobUpload:
  """A blob written in parts to its own temporary file beside the store, hashed as it
  arrives; ``commit`` fsyncs it and renames it to its digest (and fsyncs the folder).

  Concurrent writers of one blob each rename a whole copy: the final name never holds a
  part. Call ``discard`` when the upload fails (it is a no-op after ``commit``).
  """

  def __init__(self, path: pathlib.Path):
    self.path = path
    self._tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
    self._file = open(os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444), "wb")
    self._hash = blake3.blake3(max_threads=blake3.blake3.AUTO)

  def write(self, data: bytes) -> None:
    self._hash.update(data)
    self._file.write(data)

  def commit(self) -> bool:
    """True once the blob is stored under its digest; False (nothing kept) when the
    bytes written do not hash to it."""
    try:
      if self._hash.hexdigest() != self.path.name:
        return False
      if self.path.exists():  # the same bytes, stored before
        return True
      self._file.flush()
      os.fsync(self._file.fileno())
      self._file.close()
      os.replace(self._tmp, self.path)
      _fsync(self.path.parent)
      return True
    finally:
      self.discard()

  def discard(self) -> None:
    self._file.close()
    self._tmp.unlink(missing_ok=True)


def _fsync(path: pathlib.Path) -> None:
  """Flushes a file's or a folder's contents to disk."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
