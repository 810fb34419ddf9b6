"""The wire format between the client and the server.

Each request to ``/api/v1/proofs/{id}/stream`` carries one CBOR envelope::

  {"client_id": str, "seq": int,  # 0, 1, 2, ... per client_id
   "kind": "records", "records": [encoded record, ...]}
  {"client_id": ..., "seq": ..., "kind": "chunk",
   "record_id": bytes, "index": int, "count": int, "data": bytes}
  {"client_id": ..., "seq": ..., "kind": "close", "final_record_id": bytes,
   "record_count": int}

and is acknowledged with JSON ``{"seq": n, ...}``. Records larger than
``CHUNK_BYTES`` travel as chunks; resending an envelope is harmless.
"""

import io

import blake3
import cbor2

CHUNK_BYTES = 256 * 1024
BATCH_BYTES = 1024 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
ENVELOPE_KINDS = ("records", "chunk", "close")
BLOB_FIELDS = ("blob", "pre_state_blobs", "batch_blobs", "post_state_blobs")


def encode(envelope: dict) -> bytes:
  return cbor2.dumps(envelope, canonical=True)


def record_id(raw: bytes) -> bytes:
  return blake3.blake3(raw).digest()


def blob_refs(record: dict) -> set[str]:
  """Hex digests of the blobs a record references."""
  refs = set()
  for field in BLOB_FIELDS:
    value = record.get(field)
    for d in value if isinstance(value, list) else [value]:
      if isinstance(d, bytes) and len(d) == 32:
        refs.add(d.hex())
  return refs | probe_blobs(record)


def probe_blobs(record: dict) -> set[str]:
  """Hex digests of a step record's data-probe rows (each row's BLAKE3)."""
  probes = record.get("probes") if record.get("type") == "step" else None
  return {p[2].hex() for p in probes or []
          if isinstance(p, list) and len(p) == 4 and isinstance(p[2], bytes)}


class RecordScanner:
  """Splits a growing CBOR sequence into complete records (raw bytes, map)."""

  def __init__(self):
    self._buffer = b""

  def feed(self, data: bytes) -> list[tuple[bytes, dict]]:
    self._buffer += data
    out = []
    stream = io.BytesIO(self._buffer)
    decoder = cbor2.CBORDecoder(stream)
    start = 0
    while start < len(self._buffer):
      try:
        record = decoder.decode()
      except (cbor2.CBORDecodeEOF, EOFError):
        break  # the writer has not finished this record yet
      end = stream.tell()
      out.append((self._buffer[start:end], record))
      start = end
    self._buffer = self._buffer[start:]
    return out

  @property
  def pending_bytes(self) -> int:
    return len(self._buffer)
