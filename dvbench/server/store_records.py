"""Queries that read a proof's stored records back: pages of them, a transcript in parts,
their ids and bytes, inline or from the proof's records file (``record_bodies``).

A mixin of ``db.Store``. Example::

  for part in store.transcript_parts(proof_id):
    ...  # at most RECORD_PAGE_BYTES, or a part of one larger record
"""

import sqlalchemy as sa

from dvbench.server.schema import records
from dvbench.server.store_custody import BODY, BODY_SIZE, RECORD_PAGE_BYTES, RECORD_PAGE_ROWS


class RecordReads:
  """Reads of stored records (``self.engine``, ``self.bodies``: ``db.Store``'s)."""

  def record_page(self, proof_id: str, after: int = -1,
                  page_bytes: int = RECORD_PAGE_BYTES) -> list[tuple[int, bytes]]:
    """``(position, bytes)`` of a proof's records after position ``after``, in order, up to
    ``page_bytes`` in all (one record at least); [] past the last. A transcript is read a
    page at a time, never whole (it may be gigabytes).

    Example: ``store.record_page(proof_id)[0][0] == 0``.
    """
    of_proof = (records.c.proof_id == proof_id) & (records.c.position > after)
    with self.engine.connect() as conn:
      sizes = conn.execute(sa.select(records.c.position, BODY_SIZE)
                           .where(of_proof).order_by(records.c.position)
                           .limit(RECORD_PAGE_ROWS)).all()
      if not sizes:
        return []
      last, total = sizes[0][0], 0
      for position, size in sizes:
        if total and total + size > page_bytes:
          break
        last, total = position, total + size
      return [(r[0], self.body(proof_id, *r[1:])) for r in conn.execute(
          sa.select(records.c.position, *BODY)
          .where(of_proof & (records.c.position <= last)).order_by(records.c.position))]

  def transcript_parts(self, proof_id: str, part_bytes: int = RECORD_PAGE_BYTES):
    """A proof's records' bytes in order, in parts of at most ``part_bytes`` or one
    record: records joined a page at a time (``record_page``), and a record kept in the
    records file that is larger than a part read from it in parts (StoredRecordDamaged
    after its last part when it differs, which cuts a stream short). A reader holds a part,
    never a whole large record."""
    after = -1
    while True:
      with self.engine.connect() as conn:
        head = conn.execute(sa.select(records.c.position, records.c.record_id,
                                      records.c.body_offset, records.c.body_size)
                            .where((records.c.proof_id == proof_id)
                                   & (records.c.position > after))
                            .order_by(records.c.position).limit(1)).first()
      if head is None:
        return
      position, rid, offset, size = head
      if offset is not None and size > part_bytes:
        yield from self.bodies.read_parts(proof_id, rid, offset, size, part_bytes)
        after = position
        continue
      page = self.record_page(proof_id, after, part_bytes)
      yield b"".join(data for _, data in page)
      after = page[-1][0]

  def record_pages(self, proof_id: str):
    """A proof's records, ``record_page`` after page, in order."""
    after = -1
    while page := self.record_page(proof_id, after):
      after = page[-1][0]
      yield page

  def record_data(self, proof_id: str):
    """A proof's records' bytes, in order, read a page at a time (``record_pages``)."""
    for page in self.record_pages(proof_id):
      for _, data in page:
        yield data

  def record_ids(self, proof_id: str) -> list[bytes]:
    with self.engine.connect() as conn:
      return [r[0] for r in conn.execute(sa.select(records.c.record_id).where(
          records.c.proof_id == proof_id).order_by(records.c.position))]

  def body(self, proof_id: str, record_id: bytes, data: bytes, offset: int | None,
           size: int | None) -> bytes:
    """A stored record's bytes from its ``BODY`` columns: inline, or read from its proof's
    records file (``record_bodies``)."""
    if offset is None:
      return data
    if self.bodies is None:
      raise RuntimeError(f"record {record_id.hex()} of proof {proof_id} is kept in a records "
                         "file, and this database has no records folder: open it through "
                         "its SQLite file (sqlite:///PATH/dvbench.db).")
    return self.bodies.read(proof_id, record_id, offset, size)
