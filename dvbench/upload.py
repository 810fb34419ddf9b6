"""Tailing a live transcript and sending it: records, chunks, blobs, close.

The uploader is a background thread: training never waits on the network,
only, at the rolling window, on the server's challenges, which acknowledgements
carry (``on_challenge``). Blobs are uploaded for the proof by a second thread,
beside the envelopes (the server needs them by the close, not to challenge):
small ones (small state leaves) together, one request per envelope, large ones each
skipped when the server already holds it for the proof. A live run's writer hands each
record over as it writes it (``written``): the file is read back only for what was written
before (a resumed run) or while the hand-off was full (``HANDED_BYTES``).

Example::

  uploader = Uploader(http, "alice/run", transcript_folder)
  uploader.start()
  ...
  uploader.finish(timeout=120)
"""

import collections
import pathlib
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures

from zkdv.transcript import BLOBS_DIR
from zkdv.transcript import RECORDS_FILE
from zkdv.transcript import read_transcript

from dvbench import errors
from dvbench import transport
from dvbench.console import logger

# The records a live writer hands over (``Uploader.written``) wait in memory up to this
# many bytes; past it (a server that stopped answering) they are read back from the file.
HANDED_BYTES = 8 * 1024 * 1024


def uploaded_already(http, folder: pathlib.Path) -> str | None:
  """The proof id of ``folder``'s transcript when the server has closed that proof with
  every record the folder holds (sending it again would change nothing); else None. A
  ``crashed`` proof holding every record of the folder, its final one included (its run
  died between the final record and the close), is reopened, so the upload closes it; one
  that lacks records is left to ``experiment.proof(resume=...)``."""
  try:
    contents = read_transcript(folder)
  except (OSError, ValueError):
    return None  # the uploader reports what is wrong with the folder
  if not contents.records or contents.torn_tail is not None:
    return None
  proof_id = contents.records[0].record_id.hex()
  status = http.request("GET", f"/api/v1/proofs/{proof_id}", ok=(200, 404))
  if status.status_code != 200:
    return None
  proof = status.json()
  holds_all = proof.get("records") == len(contents.records)
  if proof.get("state") == "crashed":
    if holds_all and contents.records[-1].record.get("type") == "final":
      reopen(http, proof_id)
    return None
  closed = proof.get("state") not in ("receiving", None)
  return proof_id if closed and holds_all else None


def reopen(http, proof_id: str) -> None:
  """Reopens a ``crashed`` proof (its owner's token), saying so."""
  http.request("POST", f"/api/v1/proofs/{proof_id}/resume")
  logger.warning("dvbench: proof %s was crashed (nothing reached the server for a while); it "
                 "is reopened.", proof_id)


def _to_send(raw: bytes, record: dict) -> tuple[bytes, bool, set[str]]:
  """What the uploader keeps of a record: its bytes, whether it is the final record, and
  the blobs it names."""
  return raw, record.get("type") == "final", transport.blob_refs(record)


class Uploader(threading.Thread):

  def __init__(self, http, experiment: str, folder: pathlib.Path, poll_seconds: float = 0.05,
               coalesce_seconds: float = 0.05,
               batch_bytes: int = transport.BATCH_BYTES,
               chunk_bytes: int = transport.CHUNK_BYTES,
               on_challenge: Callable[[int, bytes], None] | None = None,
               on_failure: Callable[[str], None] | None = None,
               retry_seconds: float | None = None,
               while_retrying: Callable[[], str] | None = None):
    super().__init__(name="dvbench-upload", daemon=True)
    self.on_challenge, self.on_failure = on_challenge, on_failure
    self.while_retrying = while_retrying  # what goes on while the server is unreachable
    self.retry_seconds = retry_seconds
    self.http, self.experiment, self.folder = http, experiment, pathlib.Path(folder)
    self.poll_seconds = poll_seconds
    self.coalesce_seconds = coalesce_seconds
    self.batch_bytes = batch_bytes
    self.chunk_bytes = chunk_bytes
    self.client_id = uuid.uuid4().hex
    self.proof_id: str | None = None
    self.sent_records = 0
    self.error: BaseException | None = None
    self._seq = 0
    self._offset = 0
    self._scanner = transport.RecordScanner()
    self._sent_blobs: set[str] = set()  # sent or queued
    self._blob_queue: queue.SimpleQueue = queue.SimpleQueue()  # (future, digests) or None
    self._reopen_lock = threading.Lock()  # one thread reopens a crashed proof
    self._blob_thread = threading.Thread(target=self._send_queued_blobs, daemon=True,
                                         name="dvbench-blobs")
    self._blob_uploads: list[futures.Future] = []
    self._closing = threading.Event()
    self._stopped = threading.Event()
    self._wake = threading.Event()
    self._hurry = threading.Event()
    self._require_final = True
    self._final_id: bytes | None = None
    self._last_id: bytes | None = None
    self.heartbeat_seconds: float | None = None  # the server's, once the proof exists
    self._last_contact = time.monotonic()
    self._flushes: list[tuple[int, threading.Event]] = []  # (file offset, sent by then)
    self._flush_lock = threading.Lock()
    self._handed: collections.deque = collections.deque()  # (end, raw, is final, blob refs)
    self._handed_bytes = 0
    self._handed_lock = threading.Lock()

  def continue_proof(self, proof_id: str, offset: int, records: int,
                     heartbeat_seconds: float | None, max_body_bytes: object = None) -> None:
    """Before ``start()``: the proof exists and holds the first ``records`` records, the
    folder's first ``offset`` bytes (a resumed run, ``dvbench.resume``)."""
    self.proof_id, self._offset, self.sent_records = proof_id, offset, records
    self.heartbeat_seconds = heartbeat_seconds
    self._fit_envelopes(max_body_bytes)

  def send_blobs(self, digests) -> None:
    """Before ``start()``: sends blobs of the folder that records the server stored already
    name (a resumed run's, which the crashed one never sent: ``dvbench.resume``)."""
    self._upload_blobs(set(digests))

  def _fit_envelopes(self, max_body_bytes: object) -> None:
    """Envelopes of at most half the server's largest request body (``max_body_bytes``,
    as the server sends it: ignored unless a positive integer), so that a server run with
    a small ``--max-body-mb`` takes them."""
    if isinstance(max_body_bytes, int) and not isinstance(max_body_bytes, bool) \
        and max_body_bytes > 0:
      self.batch_bytes = min(self.batch_bytes, max(1, max_body_bytes // 2))

  # -- the training thread's side ----------------------------------------------

  def finish(self, timeout: float, require_final: bool = True) -> None:
    """Sends everything left, closes the stream and waits for the server."""
    self._require_final = require_final
    self._closing.set()
    self.hurry()
    self.join(timeout)
    if self.is_alive():
      raise errors.UploadError(
          f"uploading {self.folder} to DVBench did not finish within {timeout:.0f} s; the "
          f"transcript is intact there: upload it with experiment.upload(path).")
    if self.error is not None:
      e = self.error
      hint = (f" The transcript is intact in {self.folder}; once the cause is fixed, send it "
              f"with experiment.upload({str(self.folder)!r}).")
      if isinstance(e, errors.ApiError):
        raise errors.ApiError(e.status, f"{e.message.rstrip('.')}.{hint}") from e
      if isinstance(e, errors.DVBenchError):
        raise type(e)(f"{e}{hint}") from e
      raise errors.UploadError(f"uploading {self.folder} failed: {e!r}.{hint}") from e

  def flush(self, timeout: float) -> None:
    """Blocks until every record written so far and every blob they name is stored by the
    server (a checkpoint taken then is a state a resumed run finds there)."""
    try:
      target = (self.folder / RECORDS_FILE).stat().st_size
    except FileNotFoundError:
      return
    sent = threading.Event()
    with self._flush_lock:
      self._flushes.append((target, sent))
    self.hurry()
    deadline = time.monotonic() + timeout
    while not sent.wait(0.5):
      if self.error is not None or not self.is_alive():
        raise errors.UploadError(f"uploading {self.folder} stopped: {self.error!r}")
      if time.monotonic() > deadline:
        raise errors.UploadError(f"the records of {self.folder} were not all stored by the "
                                 f"server within {timeout:.0f} s.")

  def stop(self) -> None:
    """Stops without closing the proof (for an abandoned, unfinished proof)."""
    self._stopped.set()
    self._closing.set()
    self.hurry()
    self.join(5.0)

  def written(self, end: int, raw: bytes, record: dict) -> None:
    """The writer's hand-off (``TranscriptWriter.on_append``): the record ``raw``, which
    ends at file offset ``end``, is kept (up to ``HANDED_BYTES``) to be sent without
    reading the file back and decoding it again; then ``wake``."""
    with self._handed_lock:
      if self._handed_bytes + len(raw) <= HANDED_BYTES:
        self._handed.append((end, *_to_send(raw, record)))
        self._handed_bytes += len(raw)
    self.wake()

  def wake(self) -> None:
    """Looks for new records (the transcript just grew): now, or, within
    ``coalesce_seconds`` of the last envelope, once that time is up."""
    self._wake.set()

  def hurry(self) -> None:
    """Sends what is written now, without waiting to coalesce (training waits for the
    decisions it carries back, or the run flushes or ends)."""
    self._hurry.set()
    self._wake.set()

  # -- the thread ----------------------------------------------------------------

  def run(self) -> None:
    try:
      while not self._stopped.is_set():
        closing = self._closing.is_set()  # read before the file: nothing is missed
        progressed = self._send_new()
        self._settle_flushes()  # a flush waits for what it asked for, not for coalescing
        if closing and not progressed:
          break
        if progressed and not closing:  # what the next moments write shares an envelope
          self._hurry.wait(self.coalesce_seconds)
          self._hurry.clear()
        elif not progressed:
          self._heartbeat()
          self._wake.wait(self.poll_seconds)
          self._wake.clear()
      if self._stopped.is_set():
        return
      self._raise_blob_failure(wait=True)  # the server closes a proof with all its blobs
      if self._final_id is not None:
        self._envelope({"kind": "close", "final_record_id": self._final_id,
                        "record_count": self.sent_records})
      elif self._require_final:
        raise errors.UploadError(f"{self.folder} has no final record to close the proof with.")
    except BaseException as e:  # reported by finish()
      self.error = e
      if self.on_failure is not None:
        self.on_failure(f"uploading to DVBench failed: {e}")
    finally:
      self._blob_queue.put(None)

  def _send_new(self) -> bool:
    found = self._take_handed()
    if not found:
      try:
        with open(self.folder / RECORDS_FILE, "rb") as f:
          f.seek(self._offset)
          data = f.read()
      except FileNotFoundError:
        return False
      self._offset += len(data)
      found = [_to_send(raw, record) for raw, record in self._scanner.feed(data)]
      if not found:
        return bool(data)
    batch, size, blobs = [], 0, set()  # an envelope's records and the blobs they name
    for raw, final, refs in found:
      if self.proof_id is None:
        self._create_proof(raw)
        continue
      if final:
        self._final_id = transport.record_id(raw)
      if len(raw) > self.chunk_bytes or size + len(raw) > self.batch_bytes:
        self._flush(batch, blobs)
        batch, size, blobs = [], 0, set()
      if len(raw) > self.chunk_bytes:
        self._upload_blobs(refs)
        self._send_chunks(raw)
        continue
      batch.append(raw)
      blobs |= refs
      size += len(raw)
    self._flush(batch, blobs)
    return True

  def _take_handed(self) -> list[tuple[bytes, bool, set[str]]]:
    """The handed-over records that go on from where the file was read; none when the
    file must be read first (records written before the hand-off, a record read in part,
    or records past ``HANDED_BYTES``). Those the file read already are dropped."""
    found = []
    with self._handed_lock:
      while self._handed:
        end, raw, final, refs = self._handed[0]
        goes_on = end - len(raw) == self._offset and not self._scanner.pending_bytes
        if end > self._offset and not goes_on:
          break
        self._handed.popleft()
        self._handed_bytes -= len(raw)
        if goes_on:
          found.append((raw, final, refs))
          self._offset = end
    return found

  def _settle_flushes(self) -> None:
    """Answers the ``flush`` calls whose records are all sent, once their blobs are."""
    with self._flush_lock:
      done = [f for f in self._flushes if f[0] <= self._offset]
      if not done:
        return
      self._flushes = [f for f in self._flushes if f[0] > self._offset]
    self._raise_blob_failure(wait=True)
    for _, sent in done:
      sent.set()

  def _request(self, method: str, path: str, **kwargs):
    response = self.http.request(method, path, retry_seconds=self.retry_seconds,
                                 while_retrying=self.while_retrying, **kwargs)
    self._last_contact = time.monotonic()
    return response

  def _heartbeat(self) -> None:
    """Tells the server the run is alive while it sends nothing (a long step), so that
    the proof is not taken for crashed."""
    if (self.proof_id is None or self.heartbeat_seconds is None
        or time.monotonic() - self._last_contact < self.heartbeat_seconds):
      return
    self._reopening(lambda: self._request("POST", f"/api/v1/proofs/{self.proof_id}/alive",
                                          ok=(204,)))

  def _reopening(self, send: Callable[[], object]):
    """``send()``, sent once more if the server took the proof for crashed meanwhile (the
    run fell silent past its ``--crash-after``: a suspended machine, a long stall) and it
    was reopened: this process holds the whole chain, so the run goes on."""
    try:
      return send()
    except errors.ApiError as e:
      if e.status != 409 or not self._reopened(e):
        raise
    return send()

  def _reopened(self, refusal: errors.ApiError) -> bool:
    """Whether the proof takes records again after ``refusal`` (409): reopened here if the
    server holds it ``crashed``, or by the other thread (blobs travel on their own) after
    refusing this request as crashed."""
    with self._reopen_lock:
      state = self.http.request("GET", f"/api/v1/proofs/{self.proof_id}").json().get("state")
      if state == "crashed":
        reopen(self.http, self.proof_id)
        return True
      return state == "receiving" and " is crashed;" in refusal.message

  def _create_proof(self, root: bytes) -> None:
    owner, name = self.experiment.split("/")
    response = self._request("POST", f"/api/v1/experiments/{owner}/{name}/proofs",
                             content=root, headers={"content-type": "application/cbor"})
    answer = response.json()
    heartbeat = answer.get("heartbeat_seconds")
    if isinstance(heartbeat, (int, float)) and not isinstance(heartbeat, bool):
      self.heartbeat_seconds = min(max(float(heartbeat), 0.5), 30.0)
    self._fit_envelopes(answer.get("max_body_bytes"))
    self.proof_id = answer["id"]
    self.sent_records = 1
    logger.info("%s proof %s started; its page: %s/proofs/%s", self.experiment, self.proof_id,
                self.http.url, self.proof_id)

  def _flush(self, batch: list[bytes], blobs: set[str]) -> None:
    """Queues the blobs the records name and sends the records in one envelope."""
    self._upload_blobs(blobs)
    if batch:
      self._envelope({"kind": "records", "records": batch})
      self.sent_records += len(batch)

  def _send_chunks(self, raw: bytes) -> None:
    rid, step = transport.record_id(raw), self.chunk_bytes
    count = (len(raw) + step - 1) // step
    for i in range(count):
      self._envelope({"kind": "chunk", "record_id": rid, "index": i, "count": count,
                      "data": raw[i * step:(i + 1) * step]})
    self.sent_records += 1

  def _envelope(self, body: dict) -> dict:
    """Sends ``body`` under the next seq, taken before it is sent: its retries resend these
    exact bytes, and no other envelope of this client ever carries that seq (the server
    refuses one that does)."""
    body = {**body, "client_id": self.client_id, "seq": self._seq}
    self._seq += 1
    encoded = transport.encode(body)
    try:
      ack = self._reopening(lambda: self._request(
          "POST", f"/api/v1/proofs/{self.proof_id}/stream", content=encoded,
          headers={"content-type": "application/cbor"})).json()
    except errors.ApiError:
      self._raise_blob_failure(wait=True)  # a refused blob (the proof is invalid) says why
      raise
    self._deliver_challenges(ack)
    return ack

  def _deliver_challenges(self, ack) -> None:
    """Hands the step challenges an acknowledgement carries to ``on_challenge``."""
    if self.on_challenge is None or not isinstance(ack, dict):
      return
    for entry in ack.get("challenges") or []:
      try:
        step, value = entry["step"], bytes.fromhex(entry["challenge"])
      except (KeyError, TypeError, ValueError):
        raise errors.UploadError(f"the server sent a malformed challenge {entry!r:.100}; "
                                 "is it a DVBench server of this version?") from None
      if isinstance(step, int) and not isinstance(step, bool):
        self.on_challenge(step, value)

  def _upload_blobs(self, digests: set[str]) -> None:
    """Queues the blobs not sent yet for the blob thread (the server needs them by the
    close, not to challenge: records go on meanwhile); raises a failed upload's error."""
    new = sorted(digests - self._sent_blobs)
    if new:
      self._sent_blobs.update(new)
      upload = futures.Future()
      if not self._blob_thread.is_alive():
        self._blob_thread.start()
      self._blob_queue.put((upload, new))
      self._blob_uploads.append(upload)
    self._raise_blob_failure(wait=False)

  def _send_queued_blobs(self) -> None:
    """The blob thread (a daemon, like this one: a server that stopped answering does not
    hold the interpreter's exit)."""
    while (item := self._blob_queue.get()) is not None:
      upload, digests = item
      try:
        self._send_blobs(digests)
        upload.set_result(None)
      except BaseException as e:  # raised on the uploader thread by _raise_blob_failure
        upload.set_exception(e)

  def _raise_blob_failure(self, wait: bool) -> None:
    """Raises the error of a finished blob upload (with ``wait``, of any, once all ran)."""
    pending = []
    for upload in self._blob_uploads:
      if wait or upload.done():
        upload.result()
      else:
        pending.append(upload)
    self._blob_uploads = pending

  def _send_blobs(self, digests: list[str]) -> None:
    """Small blobs (small state leaves) together in requests of up to ``batch_bytes``, large
    ones one by one (each skipped if the server holds it)."""
    small, size = [], 0
    for digest in digests:
      path = self.folder / BLOBS_DIR / digest
      if path.stat().st_size > transport.SMALL_BLOB_BYTES:
        self._reopening(lambda d=digest, p=path: self.http.put_blob(
            self.proof_id, d, p.read_bytes, retry_seconds=self.retry_seconds,
            while_retrying=self.while_retrying))
        self._last_contact = time.monotonic()
        continue
      data = path.read_bytes()
      if small and (size + len(data) > self.batch_bytes or len(small) == transport.MAX_BLOBS):
        self._post_blobs(small)
        small, size = [], 0
      small.append((digest, data))
      size += len(data)
    if small:
      self._post_blobs(small)

  def _post_blobs(self, blobs: list[tuple[str, bytes]]) -> None:
    self._reopening(lambda: self.http.post_blobs(
        self.proof_id, blobs, retry_seconds=self.retry_seconds,
        while_retrying=self.while_retrying))
    self._last_contact = time.monotonic()
