"""Quotas per owner: what one owner's tokens may hold on the server.

* ``stored_bytes``: records, chunks, the upload streams' last acknowledgements (one a
  client id) and blobs of the owner's proofs and benchmarks (a blob
  counted once per owner however many hold it; a discarded proof's blobs too, as they stay
  on disk), the records of its measurements, and
  ``OPENED_ROW_BYTES`` for each batch row their probes opened, counted as the records
  arrive: the digests the worker indexes once a proof is closed
  (``dvbench.contamination.probed_digests``) are at most a row digest and half an example
  digest per opened row (an example has rows in two leaves or more);
* slots per hour: ``attempts.check_slot_rate`` (``--max-slots-per-hour``); shown here;
* ``open_proofs``: the owner's proofs still ``receiving``;
* ``experiments``: the owner's experiments.

A refusal is a typed ``Refusal`` (403) naming the quota, the owner's usage and limit and
the ``dvbench serve`` flag that raises it, e.g.
``{"error": "...", "quota": "open_proofs", "used": 32, "limit": 32,
"flag": "--quota-open-proofs"}``. ``dvbench usage OWNER`` prints an owner's usage.

Stored bytes are summed from the database and the blob store at most every
``STORED_BYTES_TTL`` seconds per owner; the bytes admitted since are added to the sum,
so an owner overshoots by at most what one request carries, and by the probe digests its
requests charged since the last sum.

Example::

  keeper = QuotaKeeper(store, blobs, Quotas(open_proofs=4))  # Quotas: ``limits``
  keeper.check_open_proofs("alice")  # Refusal when alice has 4 proofs receiving
  keeper.check_storage("alice", incoming=len(body))
  keeper.usage("alice")  # {"stored_bytes": ..., "slots_last_hour": ..., ...}
"""

import threading
import time

import sqlalchemy as sa

from dvbench.server.limits import QUOTA_FLAGS as FLAGS
from dvbench.server.limits import Quotas
from dvbench.server.refusals import Refusal
from dvbench.server.schema import (benchmark_blobs, chunks, experiments, measurements,
                                   owner_blobs, owners, proof_blobs, proofs, records, slots,
                                   streams)
from dvbench.server.store_custody import BODY_SIZE

STORED_BYTES_TTL = 10.0
DIGEST_ROW_BYTES = 160  # a stored probe digest: proof id, hex digest, index entries
OPENED_ROW_BYTES = DIGEST_ROW_BYTES * 3 // 2  # a row digest, half an example digest
QUOTAS_SETTING = "quotas"  # the serving quotas, for ``dvbench usage``
USAGE_OF = {"stored_bytes": "stored_bytes", "slots_per_hour": "slots_last_hour",
            "open_proofs": "open_proofs", "experiments": "experiments"}


def usage(store, blob_size, owner: str) -> dict[str, int]:
  """What ``owner`` holds: ``stored_bytes``, ``slots_last_hour``, ``open_proofs``,
  ``experiments`` (``blob_size(digest)``: bytes of a stored blob, 0 if gone)."""
  of_owner = (owners.c.name == owner)
  exp = sa.select(experiments.c.id).join(owners, owners.c.id == experiments.c.owner_id).where(
      of_owner)
  owned = sa.select(proofs.c.id).where(proofs.c.experiment_id.in_(exp))
  with store.engine.connect() as conn:
    counts = {
        "experiments": conn.execute(sa.select(sa.func.count()).select_from(
            exp.subquery())).scalar(),
        "open_proofs": conn.execute(sa.select(sa.func.count()).where(
            proofs.c.experiment_id.in_(exp) & (proofs.c.state == "receiving"))).scalar(),
        "slots_last_hour": conn.execute(sa.select(sa.func.count()).where(
            slots.c.experiment_id.in_(exp) & (slots.c.created_at > time.time() - 3600))
                                        ).scalar()}
    held = sum(int(conn.execute(sa.select(sa.func.coalesce(sa.func.sum(size), 0)).where(
        t.c.proof_id.in_(owned))).scalar())  # PostgreSQL sums a bigint as a Decimal
               for t, size in ((records, BODY_SIZE), (chunks, sa.func.length(chunks.c.data)),
                               (streams, sa.func.length(streams.c.last_ack))))
    held += conn.execute(sa.select(sa.func.coalesce(sa.func.sum(sa.func.length(
        measurements.c.record)), 0)).where(measurements.c.experiment_id.in_(exp))).scalar()
    digests = set(conn.execute(sa.select(proof_blobs.c.digest).where(
        proof_blobs.c.proof_id.in_(owned)).distinct()).scalars())
    digests.update(conn.execute(sa.select(benchmark_blobs.c.digest).where(
        benchmark_blobs.c.benchmark.startswith(f"{owner}/", autoescape=True))).scalars())
    digests.update(conn.execute(sa.select(owner_blobs.c.digest).where(
        owner_blobs.c.owner == owner)).scalars())
    opened = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(proofs.c.probed_rows), 0))
                          .where(proofs.c.experiment_id.in_(exp))).scalar()
  return {"stored_bytes": held + sum(blob_size(d) for d in digests)
          + OPENED_ROW_BYTES * opened, **counts}


class QuotaKeeper:
  """Checks ``Quotas`` before a write (see the module docstring)."""

  def __init__(self, store, blobs, quotas: Quotas):
    self.store, self.blobs, self.quotas = store, blobs, quotas
    self._lock = threading.Lock()
    self._stored: dict[str, tuple[float, int]] = {}  # owner -> (summed at, bytes)

  def usage(self, owner: str) -> dict[str, int]:
    return usage(self.store, self.blobs.size, owner)

  def check_experiments(self, owner: str) -> None:
    self._check(owner, "experiments", self.usage(owner)["experiments"])

  def check_open_proofs(self, owner: str) -> None:
    self._check(owner, "open_proofs", self.usage(owner)["open_proofs"])

  def check_storage(self, owner: str, incoming: int) -> None:
    """Refuses ``incoming`` more bytes beyond the owner's ``stored_bytes``; else counts them."""
    with self._lock:
      summed_at, held = self._stored.get(owner, (0.0, 0))
    if time.monotonic() - summed_at > STORED_BYTES_TTL:
      summed_at, held = time.monotonic(), self.usage(owner)["stored_bytes"]
    self._check(owner, "stored_bytes", held, incoming)
    with self._lock:
      self._stored[owner] = (summed_at, held + incoming)

  def _check(self, owner: str, quota: str, used: int, incoming: int = 1) -> None:
    limit = getattr(self.quotas, quota)
    if used + incoming <= limit:
      return
    what = {"stored_bytes": f"store {used + incoming} bytes",
            "open_proofs": "have another proof receiving",
            "experiments": "create another experiment"}[quota]
    raise Refusal(403,
                  f"quota {quota} of owner '{owner}': it would {what}, over its limit of "
                  f"{limit} (used: {used}); the server's operator raises it with "
                  f"'dvbench serve {FLAGS[quota]}'; 'dvbench usage {owner}' shows the usage.",
                  quota=quota, used=used, limit=limit, flag=FLAGS[quota])
