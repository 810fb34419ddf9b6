"""The server's signed word on a server-challenged proof (``docs/protocol.md`` §7).

A receipt publishes the proof's challenge key K, so it is issued only once no
more records are taken: at close when a challenge went unanswered, or after
the workers' replay. Self-challenged proofs get none (the server chose nothing).

Example::

  issue(store, signing_key, proof_id, verdict="verified", checks=3)
"""

import json
import time

from cryptography.hazmat.primitives.asymmetric import ed25519

from dvbench.server import attempts as attempts_lib
from zkdv import receipt


def fields(proof: dict, challenger: dict, records: list[bytes], server_key: bytes,
           verdict: str, checks: int, standing: dict | None = None,
           attempts: dict | None = None) -> dict:
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
          "standing": standing or {"state": proof["state"], "shortfalls": [],
                                   "label": proof["state"]},
          "attempts": attempts, "issued_at": time.time()}


def issue(store, signing_key: ed25519.Ed25519PrivateKey, proof_id: str, verdict: str,
          checks: int, conn=None, standing=None) -> bytes | None:
  """Signs and stores the receipt of ``proof_id``; None for a self-challenged proof.
  ``standing``: the ``zkdv.verify.claims.Standing`` the server's verification earned."""
  challenger = store.challenger(proof_id)
  if challenger is None or challenger["kind"] != "dvbench":
    return None
  proof = store.proof(proof_id)
  policy = json.loads(challenger["policy"])
  counted = attempts_lib.describe(attempts_lib.owner_attempts(
      store, proof["experiment"].split("/")[0]), policy["update_check_probability"])
  body = fields(proof, challenger, store.record_ids(proof_id),
                receipt.public_key_bytes(signing_key), verdict, checks,
                standing.to_json() if standing is not None else None,
                {k: v for k, v in counted.items() if k != "summary"})
  signed = receipt.sign(body, signing_key)
  store.put_receipt(proof_id, verdict, signed, conn)
  return signed
