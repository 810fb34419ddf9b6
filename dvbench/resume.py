"""Resuming a DVBench proof after a crash: what the server stored of it, as a transcript.

A run that stopped before ``finish()`` (preempted, killed) leaves its proof ``receiving``
or ``crashed`` on the server. ``experiment.proof(resume=PROOF_ID)`` reopens it, reads the
stored records and the challenges the server sent for them, and writes them into the
new run's transcript folder; ``zkdv.jax`` then goes on from the last committed state
(``zkdv.jax.resume``) and the uploader from the last stored record.

Example::

  stored = reopen(experiment, proof_id, folder)
  stored.challenge(7)  # the challenge the server derived for step 7
"""

import dataclasses
import pathlib

import blake3

from zkdv import transcript
from zkdv import errors as zkdv_errors

from dvbench import errors
from dvbench import transport


@dataclasses.dataclass(frozen=True)
class StoredProof:
  """A proof as the server holds it: its records (written into ``folder``), the step
  challenges it derived, and its heartbeat interval."""

  proof_id: str
  folder: pathlib.Path
  records: int
  steps: int
  size: int
  challenges: dict
  heartbeat_seconds: float | None
  max_body_bytes: int | None = None  # the server's largest request body, where it says
  unsent_blobs: tuple = ()  # blobs its records name that the server lacks and folder holds

  def challenge(self, step: int) -> bytes:
    """Step ``step``'s challenge as the server derived it after storing the step."""
    try:
      return self.challenges[step]
    except KeyError:
      raise errors.ApiError(502, f"the server sent no challenge for stored step {step} of "
                            f"proof {self.proof_id}; is it a DVBench server of this "
                            "version?") from None


def _holds(path: pathlib.Path, digest: str) -> bool:
  """Whether ``path`` is a file whose BLAKE3 is ``digest`` (hex): a copy worth sending."""
  try:
    if not path.is_file():
      return False
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if path.stat().st_size:  # an empty file cannot be mapped
      hasher.update_mmap(str(path))
    return hasher.hexdigest() == digest
  except (OSError, ValueError):
    return False


def reopen(experiment, proof_id: str, folder: pathlib.Path) -> StoredProof:
  """Reopens ``proof_id`` on the server and writes its stored records into ``folder``.

  Raises ApiError when the proof is not this experiment's or is finished; ProofStateError
  when it holds its final record (its run ended: ``experiment.upload`` closes it), and when
  a blob its records name never reached the server (the run died before uploading it) and
  ``folder`` holds no intact copy of it: the proof can never be closed. One the folder
  holds (the crashed run's own ``output_dir``) is sent again.
  """
  http = experiment.client.http
  if not isinstance(proof_id, str) or len(proof_id) != 64:
    raise ValueError(f"resume= takes a proof id (64 hex digits), got {proof_id!r}.")
  path = f"/api/v1/proofs/{proof_id}"
  info = http.request("GET", path).json()
  if info.get("experiment") != experiment.name:
    raise errors.ApiError(409, f"proof {proof_id} belongs to experiment "
                          f"{info.get('experiment')!r}, not {experiment.name!r}; resume it "
                          "from its own experiment.")
  data = http.request("GET", f"{path}/transcript").content
  challenges = {}
  for row in http.listing(f"{path}/challenges"):
    try:
      challenges[row["step"]] = bytes.fromhex(row["challenge"])
    except (KeyError, TypeError, ValueError):
      raise errors.ApiError(502, f"the server sent a malformed challenge {row!r:.100}; is it "
                            "a DVBench server of this version?") from None
  folder = pathlib.Path(folder)
  (folder / transcript.BLOBS_DIR).mkdir(parents=True, exist_ok=True)
  transcript.write_atomically(folder / transcript.RECORDS_FILE, data)
  contents = transcript.read_transcript(folder)
  named = set()
  for parsed in contents.records:
    named |= transport.blob_refs(parsed.record)
  unfinished = info.get("state") in ("receiving", "crashed")  # else the server says why not
  if unfinished and any(p.record.get("type") == "final" for p in contents.records):
    raise zkdv_errors.ProofStateError(
        f"proof {proof_id} holds its final record: its run ended and only its close is "
        f"missing. Send what the server lacks and close it with experiment.upload(FOLDER) "
        "of the folder the run wrote (its output_dir); a finished run is not resumed.")
  info = http.request("POST", f"{path}/resume").json()
  missing = sorted(named - set(http.listing(f"{path}/blobs")))
  lost = [d for d in missing if not _holds(folder / transcript.BLOBS_DIR / d, d)]
  if lost:
    raise zkdv_errors.ProofStateError(
        f"the server never received blob {lost[0]} (and {len(lost) - 1} more) that "
        f"proof {proof_id}'s stored records name, and {folder / transcript.BLOBS_DIR} holds "
        "no intact copy: the run stopped before uploading it. Resume into the output_dir of "
        "the run that wrote it (its blobs are kept there), or start a new proof (save "
        "checkpoints after proof.wait_for_commitments(), which waits for the upload).")
  heartbeat = info.get("heartbeat_seconds")
  steps = sum(p.record.get("type") == "step" for p in contents.records)
  return StoredProof(proof_id, folder, len(contents.records), steps, len(data), challenges,
                     float(heartbeat) if isinstance(heartbeat, (int, float)) else None,
                     info.get("max_body_bytes"), tuple(missing))
