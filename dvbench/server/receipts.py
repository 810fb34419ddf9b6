"""The server's signed word on a server-challenged proof (``docs/protocol.md`` §7).

A receipt publishes the proof's challenge key K, so it is issued only once no
more records are taken: at close when a challenge went unanswered, or after
the workers' replay. Self-challenged proofs get none (the server chose nothing).

No worker ever holds the signing key, whether ``dvbench serve`` started it or it runs on
its own (``dvbench worker``): a worker stores its verdict on a server-challenged proof as
pending (``Store.complete_proof_job``), and the server process publishes
it together with the receipt it signs (``publish_pending``, on the supervisor's beat).

Example::

  issue(store, signing_key, proof_id, verdict="verified", checks=3)
  publish_pending(store, signing_key)  # in the server: ["<proof id>", ...]
"""

import json
import logging
import time

from cryptography.hazmat.primitives.asymmetric import ed25519

from dvbench.server import attempts as attempts_lib
from dvbench.server import labels
from zkdv import receipt


def fields(proof: dict, challenger: dict, records: list[bytes], server_key: bytes,
           verdict: str, checks: int, standing: dict, attempts: dict | None = None) -> dict:
  """The RECEIPT map of a proof whose stored record ids are ``records``: besides the
  verifier's verdict, the state it earns with every claim that keeps it from verified
  (``zkdv.verify.claims.Standing``), and its owner's attempts (``attempts.describe``)."""
  return {"format": receipt.RECEIPT_FORMAT, "proof_id": proof["id"],
          "transcript_id": bytes.fromhex(proof["id"]), "server_key": server_key,
          "owner": proof["experiment"].split("/")[0], "experiment": proof["experiment"],
          "nonce": bytes.fromhex(challenger["nonce"]),
          "challenge_key": challenger["challenge_key"],
          "policy": json.loads(challenger["policy"]), "records": len(records),
          "last_record_id": records[-1], "verdict": verdict, "checks": checks,
          "standing": standing,
          "attempts": attempts, "issued_at": time.time()}


def issue(store, signing_key: ed25519.Ed25519PrivateKey, proof_id: str, verdict: str,
          checks: int, conn=None, standing=None) -> bytes | None:
  """Signs and stores the receipt of ``proof_id``; None for a self-challenged proof. The
  state it carries, with every claim that keeps it from verified, is ``standing`` (given
  inside the transaction that sets it) or else the one stored: a worker asking for a
  signature cannot choose it."""
  challenger = store.challenger(proof_id)
  if challenger is None or challenger["kind"] != "dvbench":
    return None
  proof = store.proof(proof_id)
  if standing is None:
    standing = labels.stored_standing(proof["state"], store.proof_claims(proof_id))
  policy = json.loads(challenger["policy"])
  counted = attempts_lib.describe(attempts_lib.owner_attempts(
      store, proof["experiment"].split("/")[0], conn), policy["update_check_probability"])
  body = fields(proof, challenger, store.record_ids(proof_id),
                receipt.public_key_bytes(signing_key), verdict, checks,
                standing.to_json(),
                {k: v for k, v in counted.items() if k != "summary"})
  signed = receipt.sign(body, signing_key)
  store.put_receipt(proof_id, verdict, signed, conn)
  return signed


logger = logging.getLogger("dvbench.receipts")


def publish_pending(store, signing_key: ed25519.Ed25519PrivateKey) -> list[str]:
  """In the server process: publishes the verdicts workers left in ``pending_verdicts``,
  each in one transaction with the receipt it signs; returns the proof ids published.

  The receipt carries the stored state and claims (``issue``): a worker chose neither
  the key nor what is signed.
  """
  published = []
  for row in store.pending_verdicts():
    proof_id = row["proof_id"]
    try:
      with store.engine.begin() as conn:
        if not store.take_pending_verdict(proof_id, conn):
          continue
        store.set_proof_state(proof_id, row["state"], row["failure"], conn=conn)
        standing = labels.stored_standing(row["state"], store.proof_claims(proof_id))
        issue(store, signing_key, proof_id, row["verdict"], row["checks"], conn, standing)
    except Exception:  # pylint: disable=broad-except  # kept pending: tried again next beat
      logger.exception("publishing the verdict of proof %s failed", proof_id)
      continue
    logger.info("proof %s is %s; its receipt is signed", proof_id, row["state"])
    published.append(proof_id)
  return published
