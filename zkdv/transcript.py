"""The transcript: a hash-chained CBOR sequence of records plus a blob folder.

``records.cborl`` holds RFC 8949 §4.2 deterministically encoded maps, one after
another (RFC 8742). ``record_id = BLAKE3(encoded bytes)``; every record but the
first carries ``prev``; the first record's id is the transcript id. Arrays are
stored as blobs in ``blobs/``, named by the hex BLAKE3 of their bytes.

Example::

  writer = TranscriptWriter(folder)
  writer.append({"type": "root", ...})
  contents = read_transcript(folder)
  assert contents.torn_tail is None
"""

import dataclasses
import os
import pathlib
import re
import uuid
from collections.abc import Callable

import blake3
import cbor2
import numpy as np

from zkdv import errors
from zkdv.digest import hash_threads
from zkdv.digest import numpy_dtype

FORMAT_VERSION = 10  # the one format this zkdv reads and writes (docs/protocol.md)
PROVER = "whitebox-jax"
RECORDS_FILE = "records.cborl"
BLOBS_DIR = "blobs"
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


def check_format(version) -> None:
  """Raises UnsupportedFormatError unless ``version`` is ``FORMAT_VERSION``.

  Example: ``check_format(2)`` raises "transcript format 2 is no longer supported; this
  zkdv reads format 10; re-run the training with this zkdv ...".
  """
  if isinstance(version, int) and not isinstance(version, bool) and version == FORMAT_VERSION:
    return
  rewrite = (f"re-run the training with this zkdv to write a format {FORMAT_VERSION} "
             "transcript")
  if isinstance(version, int) and not isinstance(version, bool) and 0 < version < FORMAT_VERSION:
    raise errors.UnsupportedFormatError(
        f"transcript format {version} is no longer supported; this zkdv reads format "
        f"{FORMAT_VERSION}; {rewrite}.")
  shown = version if isinstance(version, int) and abs(version) < 1 << 32 else (
      f"{type(version).__name__} {str(version)[:40]!r}")
  raise errors.UnsupportedFormatError(
      f"transcript format {shown} is not supported; this zkdv reads format "
      f"{FORMAT_VERSION}; verify it with the zkdv that wrote it, or {rewrite}.")


def encode_record(record: dict) -> bytes:
  return cbor2.dumps(record, canonical=True)


def record_id(encoded: bytes) -> bytes:
  return blake3.blake3(encoded).digest()


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


class TranscriptWriter:
  """Appends records (flushed one by one) and content-addressed blobs."""

  def __init__(self, folder: str | os.PathLike):
    self.folder = pathlib.Path(folder)
    (self.folder / BLOBS_DIR).mkdir(parents=True, exist_ok=True)
    try:
      self._file = open(self.folder / RECORDS_FILE, "xb")
    except FileExistsError:
      raise errors.ProofStateError(
          f"{self.folder / RECORDS_FILE} already exists; a transcript is never "
          "overwritten. Choose another output_dir.") from None
    self._prev: bytes | None = None
    self.transcript_id: bytes | None = None
    self.size = 0  # the bytes of records written: where the next record starts
    # Called after each record is written with (its end offset, its bytes, the record):
    # an uploader takes it from memory instead of reading the file back.
    self.on_append: Callable[[int, bytes, dict], None] | None = None
    self._stored: set[bytes] = set()  # blobs written here (not looked up again)

  @classmethod
  def reopen(cls, folder: str | os.PathLike) -> tuple["TranscriptWriter", "TranscriptContents"]:
    """A writer that appends to the unfinished transcript in ``folder``, and its contents.

    A torn last record (the writer died mid-write) is cut off first: it was never part
    of the chain. Raises ProofStateError for a folder without records.
    """
    folder = pathlib.Path(folder)
    try:
      contents = read_transcript(folder)
    except FileNotFoundError:
      raise errors.ProofStateError(f"{folder} holds no transcript to resume.") from None
    if not contents.records:
      raise errors.ProofStateError(f"{folder / RECORDS_FILE} holds no complete record to "
                                   "resume from; start a new proof.")
    writer = cls.__new__(cls)
    writer.folder = folder
    writer._file = open(folder / RECORDS_FILE, "r+b")
    if contents.torn_tail is not None:
      writer._file.truncate(contents.torn_tail.offset)
      os.fsync(writer._file.fileno())
    writer.size = writer._file.seek(0, os.SEEK_END)
    writer._prev = contents.records[-1].record_id
    writer.transcript_id = contents.records[0].record_id
    writer.on_append = None
    writer._stored = set()  # pylint: disable=protected-access
    return writer, dataclasses.replace(contents, torn_tail=None)

  def append(self, record: dict, *, durable: bool = False) -> bytes:
    """Chains, encodes and writes ``record``; returns its id."""
    if self._prev is not None:
      record = {**record, "prev": self._prev}
    encoded = encode_record(record)
    self._file.write(encoded)
    self._file.flush()
    if durable:
      os.fsync(self._file.fileno())
    self.size += len(encoded)
    self._prev = record_id(encoded)
    if self.transcript_id is None:
      self.transcript_id = self._prev
    if self.on_append is not None:
      self.on_append(self.size, encoded, record)
    return self._prev

  def put_blob(self, data: np.ndarray | bytes, digest: bytes | None = None) -> bytes:
    """Stores ``data`` (bytes or a uint8 view) once, durably; returns its digest
    (``digest``: the BLAKE3 of ``data`` where the caller computed it, as a committed
    leaf's, not hashed again)."""
    if digest is None:
      digest = blake3.blake3(data, max_threads=hash_threads(memoryview(data).nbytes)).digest()
    if digest in self._stored:
      return digest
    path = self.folder / BLOBS_DIR / digest.hex()
    if not path.exists():
      write_atomically(path, data)
    self._stored.add(digest)
    return digest

  def sync(self) -> None:
    os.fsync(self._file.fileno())

  def close(self) -> None:
    if not self._file.closed:
      self.sync()
      self._file.close()


@dataclasses.dataclass(frozen=True)
class ParsedRecord:
  record: dict
  raw: bytes
  offset: int

  @property
  def record_id(self) -> bytes:
    return record_id(self.raw)


@dataclasses.dataclass(frozen=True)
class TornTail:
  offset: int
  nbytes: int
  reason: str


@dataclasses.dataclass(frozen=True)
class TranscriptContents:
  records: list[ParsedRecord]
  torn_tail: TornTail | None


def records_path(path: str | os.PathLike) -> pathlib.Path:
  path = pathlib.Path(path)
  return path / RECORDS_FILE if path.is_dir() else path


class RecordReader:
  """The complete records of a transcript, read from its file one at a time (every probed
  row is in the records, so a long run's may not fit in memory twice); ``torn_tail`` is
  known once they are read. Opening checks the file is there (OSError); reading raises
  TranscriptFormatError at an item that is not a CBOR record map.

  Example::

    reader = RecordReader(path)
    for parsed in reader.records:
      ...
    reader.torn_tail  # None, or the incomplete last record
  """

  def __init__(self, path: str | os.PathLike):
    self.path = records_path(path)
    self.size = self.path.stat().st_size
    self.torn_tail: TornTail | None = None

  @property
  def records(self):
    with open(self.path, "rb") as f:
      decoder = cbor2.CBORDecoder(f)
      while (offset := f.tell()) < self.size:
        try:
          record = decoder.decode()
        except (cbor2.CBORDecodeEOF, EOFError) as e:
          self.torn_tail = TornTail(offset, self.size - offset, str(e))
          return
        except (cbor2.CBORDecodeError, OverflowError, ValueError) as e:  # MemoryError propagates
          raise errors.TranscriptFormatError(
              f"item at byte {offset} is not valid CBOR: {e}") from None
        if not isinstance(record, dict):
          raise errors.TranscriptFormatError(
              f"item at byte {offset} is a {type(record).__name__}, not a record map.")
        end = f.tell()
        f.seek(offset)
        raw = f.read(end - offset)
        yield ParsedRecord(record, raw, offset)


def read_transcript(path: str | os.PathLike) -> TranscriptContents:
  """Every complete record of a transcript, in memory; a torn tail is reported, not raised.

  Raises TranscriptFormatError for a file that is not a CBOR sequence of maps.
  """
  reader = RecordReader(path)
  records = list(reader.records)
  return TranscriptContents(records, reader.torn_tail)


def blob_path(folder: str | os.PathLike, digest: bytes) -> pathlib.Path:
  name = digest.hex() if isinstance(digest, bytes) else str(digest)
  if not _HEX_DIGEST.fullmatch(name):
    raise errors.TranscriptFormatError(f"{name!r} is not a blob digest.")
  return pathlib.Path(folder) / BLOBS_DIR / name


def read_blob(folder: str | os.PathLike, digest: bytes, dtype: str,
              shape: tuple[int, ...], check_name: bool = True) -> np.ndarray:
  """The blob ``digest`` as an array, after checking its size and (unless the caller
  checks its bytes against another commitment) that it hashes to its name."""
  path = _sized_blob(folder, digest, dtype, shape)
  data = path.read_bytes()
  if check_name and blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest() != digest:
    raise errors.TranscriptFormatError(f"blob {digest.hex()} does not hash to its name.")
  return np.frombuffer(data, dtype=numpy_dtype(dtype)).reshape(shape)


def check_blob(folder: str | os.PathLike, digest: bytes, dtype: str,
               shape: tuple[int, ...]) -> None:
  """Raises as ``read_blob`` does unless the blob ``digest`` has its layout's size and
  hashes to its name; hashed where it lies (mapped, not read into memory: 4 ms for 48 MB
  against 24 ms to read and hash it here)."""
  path = _sized_blob(folder, digest, dtype, shape)
  hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
  if path.stat().st_size:  # an empty file cannot be mapped
    hasher.update_mmap(path)
  if hasher.digest() != digest:
    raise errors.TranscriptFormatError(f"blob {digest.hex()} does not hash to its name.")


def _sized_blob(folder, digest: bytes, dtype: str, shape) -> pathlib.Path:
  path = blob_path(folder, digest)
  expected = int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype).itemsize
  size = path.stat().st_size
  if size != expected:
    raise errors.TranscriptFormatError(
        f"blob {digest.hex()} holds {size} bytes; its layout {dtype}{list(shape)} "
        f"needs {expected}.")
  return path
