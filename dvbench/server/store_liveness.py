"""Queries of a proof's liveness: a client's heartbeat, a crashed run, a proof never used.

A mixin of ``db.Store``. A proof ``receiving`` records is alive while its client sends records
or heartbeats. One that falls silent for the server's ``--crash-after`` becomes ``crashed``
(it stopped before ``proof.finish()``; never verified) or, when it never sent a step, is
discarded: a proof that was only started (the tutorial's first, unconfigured proof) leaves
nothing behind. Its client discards it at once when it replaces or closes it.

Example::

  crashed, discarded = store.settle_silent_proofs(600)
"""

import time

import sqlalchemy as sa

from dvbench.server.schema import (blob_refs, challengers, challenges, checks, chunks,
                                   discarded_steps, experiments, owner_blobs, owners, probes,
                                   proof_blobs, proof_claims, proofs, receipts, records, streams)
from dvbench.server.store_custody import insert_ignoring

# Every table with rows of one proof (a proof with no step has no job, measurement or
# submission: those need a closed proof). Its slot stays taken, so its root cannot return.
_PROOF_ROWS = (records, streams, chunks, blob_refs, probes, checks, challenges, proof_blobs,
               receipts, proof_claims, challengers, discarded_steps)


def resume_hint(proof_id: str) -> str:
  """What a crashed proof's owner can do: resume it from the checkpoint of its last
  committed state (docs/jax.md, "Resuming a run")."""
  return (f"resume it from the checkpoint of its last committed state with "
          f"experiment.proof(resume={proof_id!r})")


def crashed_failure(silent_seconds: float, steps: int, proof_id: str, finished: bool) -> str:
  """Why a proof is ``crashed`` (``finished``: its final record is stored), e.g. 'nothing
  arrived for 2 s after 7 steps: ...'."""
  if finished:
    return (f"nothing arrived for {silent_seconds:g} s after its final record ({steps} "
            "steps): the run stopped before it closed the proof; close it with "
            "experiment.upload(FOLDER), FOLDER the run's transcript folder (its output_dir), "
            "which sends what the server lacks and closes it.")
  return (f"nothing arrived for {silent_seconds:g} s after {steps} steps: the run stopped "
          f"before proof.finish(), so it is never verified as it is; {resume_hint(proof_id)}.")


class LivenessQueries:
  """Heartbeats, crashed proofs and discarded ones."""

  def touch_proof(self, proof_id: str) -> str | None:
    """A heartbeat: the proof's client is alive. Returns the proof's state (None: no such
    proof); only a ``receiving`` proof is touched."""
    with self.engine.begin() as conn:
      state = conn.execute(sa.select(proofs.c.state).where(proofs.c.id == proof_id)).scalar()
      if state == "receiving":
        conn.execute(proofs.update().where(proofs.c.id == proof_id).values(
            updated_at=time.time()))
      return state

  def reopen_proof(self, proof_id: str) -> str | None:
    """A ``crashed`` (or still ``receiving``) proof takes records again, for its resumed
    run; None when done, else why not (it is finished)."""
    with self.engine.begin() as conn:
      state = conn.execute(sa.select(proofs.c.state).where(proofs.c.id == proof_id)).scalar()
      if state not in ("receiving", "crashed"):
        return (f"proof {proof_id} is {state}: only a proof that stopped before "
                "proof.finish() (receiving or crashed) is resumed")
      self.set_proof_state(proof_id, "receiving", None, conn)
      return None

  def discard_unstarted_proof(self, proof_id: str) -> str | None:
    """Deletes a ``receiving`` proof that holds no step; None when done, else why not."""
    with self.engine.begin() as conn:
      refused = self.discard_in(conn, proof_id)
    if refused is None:
      self._remove_bodies([proof_id])
    return refused

  def _remove_bodies(self, proof_ids: list[str]) -> None:
    """Deletes the records files of proofs whose deletion committed (before the commit, a
    failed transaction would keep rows without their bodies; a file a failed unlink leaves
    is overwritten by any later proof of that id, which writes from its start)."""
    for proof_id in proof_ids if self.bodies is not None else ():
      self.bodies.remove(proof_id)

  def discard_in(self, conn, proof_id: str) -> str | None:
    """``discard_unstarted_proof`` inside the transaction ``conn``, which leaves the
    proof's records file to its caller (``_remove_bodies`` once it committed)."""
    row = conn.execute(sa.select(proofs.c.state, proofs.c.steps).where(
        proofs.c.id == proof_id)).first()
    if row is None:
      return f"there is no proof {proof_id}"
    if row.state != "receiving" or row.steps:
      return (f"proof {proof_id} is {row.state} with {row.steps} steps; only a proof that "
              "never sent a step is discarded")
    # Its blobs stay on disk (another proof may hold them too): still its owner's bytes.
    owner = conn.execute(sa.select(owners.c.name).select_from(
        proofs.join(experiments).join(owners, owners.c.id == experiments.c.owner_id))
                         .where(proofs.c.id == proof_id)).scalar()
    digests = conn.execute(sa.select(proof_blobs.c.digest).where(
        proof_blobs.c.proof_id == proof_id)).scalars().all()
    if digests:
      conn.execute(insert_ignoring(conn, owner_blobs), [
          {"owner": owner, "digest": d} for d in sorted(digests)])
    for table in _PROOF_ROWS:
      conn.execute(table.delete().where(table.c.proof_id == proof_id))
    conn.execute(proofs.delete().where(proofs.c.id == proof_id))
    return None

  def settle_silent_proofs(self, silent_seconds: float) -> tuple[list[str], list[str]]:
    """Proofs ``receiving`` that heard nothing for ``silent_seconds``: those with steps
    become ``crashed``, those without are discarded. Returns (crashed ids, discarded ids)."""
    cutoff = time.time() - silent_seconds
    silent = (proofs.c.state == "receiving") & (proofs.c.updated_at < cutoff)
    crashed, discarded = [], []
    with self.engine.begin() as conn:
      for proof_id, steps in conn.execute(sa.select(proofs.c.id, proofs.c.steps).where(silent)):
        if steps:
          last = conn.execute(sa.select(records.c.kind).where(records.c.proof_id == proof_id)
                              .order_by(records.c.position.desc()).limit(1)).scalar()
          self.set_proof_state(proof_id, "crashed", crashed_failure(
              silent_seconds, steps, proof_id, finished=last == "final"), conn)
          crashed.append(proof_id)
        elif self.discard_in(conn, proof_id) is None:
          discarded.append(proof_id)
    self._remove_bodies(discarded)
    return crashed, discarded
