"""Reading a check's opened blobs, with read-ahead of the next check's.

A state blob is checked against its name (its leaf digest), from which the
state digest is assembled; a batch blob is checked only through the row Merkle
tree its step committed, so each opened byte is hashed once. With read-ahead,
a thread reads and hashes the next check's blobs while the current one
replays; it pays where the machine has cores XLA does not already use, so by
default it is on above two cores (``read_ahead=None``).

Example::

  reader = BlobReader(folder, read_ahead=True)
  reader.prefetch(wanted_blobs(next_check, program))
  array = reader.read(digest, "float32", (784, 1024))
  reader.close()
"""

import concurrent.futures
import os

from zkdv import transcript
from zkdv.verify.policy import DIGEST_BYTES


def default_read_ahead() -> bool:
  return (os.cpu_count() or 1) > 2


class BlobReader:
  """Opened blobs of one transcript, read now or from the read-ahead thread."""

  def __init__(self, folder, read_ahead: bool | None = None):
    self._folder = folder
    self.read_ahead = default_read_ahead() if read_ahead is None else read_ahead
    self._pool = (concurrent.futures.ThreadPoolExecutor(1, "zkdv-read-ahead")
                  if self.read_ahead else None)
    self._pending: dict[tuple, concurrent.futures.Future] = {}

  def prefetch(self, wanted: list[tuple]) -> None:
    """Starts reading ``(digest, dtype, shape, check_name)`` blobs; what was started
    before and is not wanted now is dropped (one check ahead at most)."""
    if self._pool is None:
      return
    self._pending = {key: self._pending.get(key) or self._pool.submit(self._read, *key)
                     for key in wanted}

  def read(self, digest: bytes, dtype: str, shape, check_name: bool = True):
    """The blob as an array, its size and (with ``check_name``) its hash checked; raises
    as ``zkdv.transcript.read_blob`` does."""
    key = (digest, dtype, tuple(shape), check_name)
    future = self._pending.pop(key, None) if isinstance(digest, bytes) else None
    if future is not None:
      return future.result()
    return self._read(*key)

  def check(self, digest: bytes, dtype: str, shape) -> None:
    """Checks the blob's size and that it hashes to its name without reading it; raises
    as ``zkdv.transcript.check_blob`` does."""
    return transcript.check_blob(self._folder, digest, dtype, tuple(shape))

  def _read(self, digest, dtype, shape, check_name):
    return transcript.read_blob(self._folder, digest, dtype, shape, check_name=check_name)

  def close(self) -> None:
    self._pending = {}
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)


def _blob_keys(blobs, layouts, check_name: bool) -> list[tuple]:
  """Keys for well-formed blob lists; anything else is left to the checker to report."""
  if not isinstance(blobs, list) or len(blobs) != len(layouts):
    return []
  return [(b, l.dtype, tuple(l.shape), check_name) for b, l in zip(blobs, layouts)
          if isinstance(b, bytes) and len(b) == DIGEST_BYTES]


def wanted_blobs(check, program) -> list[tuple]:
  """The blobs ``check`` opens: its start or pre-state and its batches (an update
  check), the post-state (a state check, or an equivalent program's update)."""
  fields, kind = check.fields, check.kind
  wanted = []
  if kind == "update":
    wanted += _blob_keys(fields.get("pre_state_blobs"), program.state, True)
    batches = fields.get("batch_blobs")  # a list per step of the segment
    if isinstance(batches, list):
      for step_blobs in batches:
        wanted += _blob_keys(step_blobs, program.batch, False)
  if kind == "state" or (kind == "update" and not program.exact):
    wanted += _blob_keys(fields.get("post_state_blobs"), program.post, True)
  return wanted
