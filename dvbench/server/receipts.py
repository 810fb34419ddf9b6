"""The server's signed word on a server-challenged proof (``docs/protocol.md`` §7).

A receipt publishes the proof's challenge key K, so it is issued only once no
more records are taken: at close when a challenge went unanswered, or after
the workers' replay. Self-challenged proofs get none (the server chose nothing).

Workers started by ``dvbench serve`` never hold the signing key: each asks the server
process over a socket pair (``RemoteSigner`` in the worker, ``serve_signing`` on a
thread of the server). A worker run on its own (``dvbench worker``) signs with the key in
its ``--data`` folder (``LocalSigner``).

Example::

  issue(store, signing_key, proof_id, verdict="verified", checks=3)
  RemoteSigner(fd).issue(proof_id, "verified", 3)  # in a worker of dvbench serve
"""

import json
import logging
import re
import socket
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
      store, proof["experiment"].split("/")[0]), policy["update_check_probability"])
  body = fields(proof, challenger, store.record_ids(proof_id),
                receipt.public_key_bytes(signing_key), verdict, checks,
                standing.to_json(),
                {k: v for k, v in counted.items() if k != "summary"})
  signed = receipt.sign(body, signing_key)
  store.put_receipt(proof_id, verdict, signed, conn)
  return signed


logger = logging.getLogger("dvbench.receipts")
_PROOF_ID = re.compile(r"[0-9a-f]{64}")
_REPLY_SECONDS = 120.0


class LocalSigner:
  """Signs in this process, e.g. ``LocalSigner(store, key).issue(proof_id, "verified", 3)``."""

  def __init__(self, store, signing_key: ed25519.Ed25519PrivateKey):
    self.store, self.signing_key = store, signing_key

  def issue(self, proof_id: str, verdict: str, checks: int) -> None:
    issue(self.store, self.signing_key, proof_id, verdict, checks)


class RemoteSigner:
  """Asks the server process at the other end of the socket ``fd`` to sign; raises when it
  does not answer ``{"ok": true}`` (the job is then released and tried again)."""

  def __init__(self, fd: int):
    os_socket = socket.socket(fileno=fd)
    os_socket.set_inheritable(False)  # never passed on to a verifier child
    os_socket.settimeout(_REPLY_SECONDS)
    self._file = os_socket.makefile("rwb")

  def issue(self, proof_id: str, verdict: str, checks: int) -> None:
    request = {"proof_id": proof_id, "verdict": verdict, "checks": checks}
    self._file.write(json.dumps(request).encode() + b"\n")
    self._file.flush()
    line = self._file.readline()
    reply = json.loads(line) if line else {"error": "the server closed the channel"}
    if reply.get("ok") is not True:
      raise RuntimeError(f"the server did not sign the receipt of {proof_id}: "
                         f"{reply.get('error')}")


def _signed(store, signing_key, request) -> dict:
  proof_id, verdict, checks = (request.get(k) for k in ("proof_id", "verdict", "checks"))
  if not (isinstance(proof_id, str) and _PROOF_ID.fullmatch(proof_id)
          and isinstance(verdict, str) and 0 < len(verdict) <= 20
          and isinstance(checks, int) and checks >= 0):
    return {"error": "a request is {proof_id: 64 hex digits, verdict, checks >= 0}"}
  issue(store, signing_key, proof_id, verdict, checks)
  return {"ok": True}


def serve_signing(connection: socket.socket, store, signing_key, who: str) -> None:
  """In the server: signs the receipts worker ``who`` asks for, one JSON line each, until
  it closes its end (it exits)."""
  with connection, connection.makefile("rwb") as f:
    for line in f:
      try:
        reply = _signed(store, signing_key, json.loads(line))
      except Exception as e:  # pylint: disable=broad-except  # e.g. the database is down
        logger.exception("signing a receipt for worker %s failed", who)
        reply = {"error": type(e).__name__}
      try:
        f.write(json.dumps(reply).encode() + b"\n")
        f.flush()
      except OSError:
        return
