"""Large record bodies out of line: one append-only file per proof beside the database.

A probe record carries its opened batch rows (about 26 KB a step for the small MLP at
batch 256); written through SQLite, each byte went to the WAL and again to the database
at the next checkpoint, about a third of what a probe cost the ingestion process
(benchmarks/RESULTS.md). A body over ``OUT_OF_LINE_BYTES`` is written instead to
``records/<proof id>`` beside an SQLite database file, at the end its committed records
cover (``proofs.body_end``), inside the write transaction that stores its row
(``data = b""``, ``body_offset``, ``body_size``). Every write transaction holds the
database's write lock, so appends to one file never interleave; a transaction rolled back
(or a process killed) leaves bytes past ``body_end``, which the next append overwrites.
The bytes are flushed to the disk (``fdatasync``, and the folder once when the file is
made) before the transaction commits, so no stored row outlives its body, after a kill -9
or a power cut (a power cut may lose the last rows, as SQLite's WAL may, never a body
under a row: about 0.7 ms a transaction of 30 probe records on this machine). On
PostgreSQL (and an in-memory SQLite) every body stays in the database (PostgreSQL keeps
large values out of its table pages itself).

Every body read from a file is hashed against its record id, so a file damaged or lost
(a disk fault, a power cut before the kernel wrote it) is reported as the server's
fault (``StoredRecordDamaged``), never served as the prover's record.

Example::

  bodies = RecordBodies.beside(engine)         # None: every body stays inline
  offsets = bodies.write(proof_id, end, [b"..."])
  bodies.read(proof_id, record_id, offsets[0], 3)
"""

import itertools
import os
import pathlib

import blake3

OUT_OF_LINE_BYTES = 4096  # bodies larger than this leave the database (a step record: ~700)
_IOV_MAX = 512  # buffers a pwritev takes at most here (the kernel's limit: 1024)


class StoredRecordDamaged(RuntimeError):
  """A stored record's body no longer matches its id: a fault of the server's storage."""


class RecordBodies:
  """The records files of one database: ``folder/<proof id>``."""

  def __init__(self, folder: str | os.PathLike):
    self.folder = pathlib.Path(folder)

  @classmethod
  def beside(cls, engine) -> "RecordBodies | None":
    """The records folder beside ``engine``'s SQLite database file; None for any other
    database, whose bodies all stay inline."""
    database = engine.url.database if engine.dialect.name == "sqlite" else None
    if not database or database == ":memory:" or database.startswith("file:"):
      return None
    return cls(pathlib.Path(database).resolve().parent / "records")

  def path(self, proof_id: str) -> pathlib.Path:
    if len(proof_id) != 64 or not all(c in "0123456789abcdef" for c in proof_id):
      raise ValueError(f"{proof_id!r} is not a proof id (64 lowercase hex digits).")
    return self.folder / proof_id

  def write(self, proof_id: str, end: int, bodies: list[bytes]) -> list[int]:
    """Writes ``bodies`` one after another from byte ``end`` of the proof's file (the end
    its stored records cover); returns their offsets. Call inside the write transaction
    that stores their rows."""
    self.folder.mkdir(parents=True, exist_ok=True)
    path = self.path(proof_id)
    made = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    offsets = list(itertools.accumulate((len(b) for b in bodies), initial=end))[:-1]
    try:
      _write_at(fd, bodies, end)
      os.fdatasync(fd)
    finally:
      os.close(fd)
    if made:  # the file's name too, before a row points into it
      folder = os.open(self.folder, os.O_RDONLY)
      try:
        os.fsync(folder)
      finally:
        os.close(folder)
    return offsets

  def read(self, proof_id: str, record_id: bytes, offset: int, size: int) -> bytes:
    """The body of record ``record_id`` at ``offset``; raises StoredRecordDamaged when the
    file no longer holds it."""
    return b"".join(self.read_parts(proof_id, record_id, offset, size, size or 1))

  def read_parts(self, proof_id: str, record_id: bytes, offset: int, size: int,
                 part: int):
    """The body of record ``record_id`` at ``offset`` in parts of ``part`` bytes, hashed
    as they are read: StoredRecordDamaged after the last when the file no longer holds it.
    A reader holds a part, never the whole body."""
    hasher, done = blake3.blake3(), 0
    try:
      with open(self.path(proof_id), "rb") as f:
        f.seek(offset)
        while done < size and (data := f.read(min(part, size - done))):
          hasher.update(data)
          done += len(data)
          yield data
    except FileNotFoundError:
      pass
    if done != size or hasher.digest() != record_id:
      raise StoredRecordDamaged(
          f"record {record_id.hex()} of proof {proof_id} is damaged in the server's storage "
          f"({self.path(proof_id)}, {size} bytes at {offset}): a fault of this server, not "
          "of the prover; restore the records folder from a backup.")

  def remove(self, proof_id: str) -> None:
    """Deletes the proof's file (a discarded proof's)."""
    self.path(proof_id).unlink(missing_ok=True)


def _write_at(fd: int, bodies: list[bytes], at: int) -> None:
  """Writes ``bodies`` one after another from byte ``at`` of ``fd``: one ``pwritev`` for up
  to ``_IOV_MAX`` of them (half the CPU of a ``pwrite`` each: 6 against 13 µs a 26 KB
  probe record), resumed where a call stopped short."""
  views = [memoryview(b) for b in bodies if b]
  first = 0
  while first < len(views):
    written = os.pwritev(fd, views[first:first + _IOV_MAX], at)
    if not written:
      raise OSError(f"writing a record body wrote nothing at byte {at}")
    at += written
    while first < len(views) and written >= len(views[first]):
      written -= len(views[first])
      first += 1
    if written:
      views[first] = views[first][written:]
