"""The processes of one run, for multi-process JAX (``jax.distributed``).

Every process runs the same steps and commits the pieces of state and the
batch rows it addresses. Their digests (and the bytes of probed rows) travel
to process 0 through the coordination service's key-value store, not through
XLA collectives, so the commit threads never race the training step's own
collectives. Process 0 alone writes the transcript. In a single-process run
the group has one member and every exchange is the identity.

Example::

  group = ProcessGroup.current()
  run = group.open_run(lambda: {"run_id": os.urandom(16), "seed": challenge.new_key()})
  every = group.gather("3/state", local_digests)  # process 0: all of them; others: None
"""

import itertools
import time
from collections.abc import Callable

import cbor2
import jax

from zkdv import errors
from zkdv.jax import _compat

_proofs_started = itertools.count()  # the same sequence in every process of a run
_POLL_MS = 1000  # how often a waiting process looks for a failure report


class ProcessGroup:
  """The processes of a run, as seen from one of them.

  Attributes:
    index: this process's index (``jax.process_index()``).
    count: the number of processes (``jax.process_count()``).
    timeout_s: how long a process waits for another's message before it gives up.
  """

  def __init__(self, client, index: int, count: int, timeout_s: float = 600.0):
    self._client = client
    self.index = index
    self.count = count
    self.timeout_s = timeout_s
    self._prefix = None  # the run's keys, once open_run has shared its id
    self._start_key = None

  @classmethod
  def current(cls) -> "ProcessGroup":
    count = jax.process_count()
    return cls(_compat.distributed_client() if count > 1 else None,
               jax.process_index(), count)

  @property
  def is_writer(self) -> bool:
    """Whether this process writes the transcript (process 0)."""
    return self.index == 0

  @property
  def multi(self) -> bool:
    return self.count > 1

  def open_run(self, make_run: Callable[[], dict], resuming: bool = False) -> dict:
    """The run's shared values (``make_run()`` on process 0), the same on every process.

    ``make_run()`` must return a dict with a random ``run_id`` (bytes). Every
    process of a run must start its proofs in the same order, each saying whether it
    ``resuming`` one: process 0 compares them before ``make_run()`` (which may take a
    server's proof slot) and refuses a start they differ on. What process 0 raises, the
    others raise quoting it (a ``zkdv.errors`` error as the same one; any other as
    ProofStateError).
    """
    if not self.multi:
      return make_run()
    key = self._start_key = f"zkdv/start/{next(_proofs_started)}"
    if self.is_writer:
      try:
        self._check_resuming(key, resuming)
        run = make_run()
      except Exception as e:
        kind = type(e).__name__ if isinstance(e, errors.ZKDVError) else "ProofStateError"
        self._client.key_value_set_bytes(key, cbor2.dumps(
            {"error": kind, "said": f"{type(e).__name__}: {e}"}))
        raise
      self._client.key_value_set_bytes(key, cbor2.dumps(run))
    else:
      self._client.key_value_set_bytes(f"{key}/resuming/{self.index}", cbor2.dumps(resuming))
      run = cbor2.loads(self._get(key, "the start of the proof", source=None))
      if "error" in run:
        raise _error_named(run["error"], f"process 0 could not start the proof: {run['said']}")
    self._prefix = f"zkdv/run/{run['run_id'].hex()}"
    return run

  def _check_resuming(self, key: str, resuming: bool) -> None:
    """ProofStateError naming the processes whose ``resume=`` differs from process 0's."""
    differ = [i for i in range(1, self.count) if cbor2.loads(self._get(
        f"{key}/resuming/{i}", f"whether process {i} resumes", source=i)) != resuming]
    if differ:
      one = len(differ) == 1
      raise errors.ProofStateError(
          f"process 0 {'resumes a proof' if resuming else 'starts a new proof'} while "
          f"process{'' if one else 'es'} {', '.join(map(str, differ))} "
          f"{'start' + 's' * one + ' a new one' if resuming else 'resume' + 's' * one + ' one'}"
          ": pass the same resume= on every process.")

  def close_run(self) -> None:
    """Deletes the run's start message (process 0, once every process has sent steps)."""
    if self.multi and self.is_writer:
      self._client.key_value_delete(self._start_key)

  def gather(self, topic: str, local):
    """Every process's ``local`` value in process order, on process 0; None elsewhere.

    ``local`` is any CBOR-encodable value. Call it in the same order on every
    process. Once process 0 has failed, the others stop sending.
    """
    if not self.multi:
      return [local]
    if not self.is_writer:
      if self.failure(0) is None:
        self._client.key_value_set_bytes(f"{self._prefix}/{topic}/{self.index}",
                                         cbor2.dumps(local))
      return None
    values = [local]
    for index in range(1, self.count):
      key = f"{self._prefix}/{topic}/{index}"
      values.append(cbor2.loads(self._get(key, f"{topic} from process {index}", source=index)))
      self._client.key_value_delete(key)
    return values

  def broadcast(self, topic: str, value=None):
    """Process 0's ``value``, on every process."""
    if not self.multi:
      return value
    key = f"{self._prefix}/{topic}"
    if self.is_writer:
      self._client.key_value_set_bytes(key, cbor2.dumps(value))
      return value
    return cbor2.loads(self._get(key, f"{topic} from process 0", source=0, patient=True))

  def agree(self, topic: str, decide: Callable[[], object]):
    """``decide()``, run on process 0, and its value (CBOR-encodable) on every process.
    What it raises is raised on process 0, and on the others as the same ZKDVError with
    process 0's message (any other exception as a CommitmentError quoting it).

    Example::

      fields = group.agree("resume/plan", lambda: catch_up.shared())
    """
    if not self.multi:
      return decide()
    if not self.is_writer:
      outcome = self.broadcast(topic)
      if "error" in outcome:
        raise _error_named(outcome["error"], outcome["message"])
      return outcome["value"]
    try:
      value = decide()
    except Exception as e:  # any failure: the others wait for this topic without a deadline
      said = e if isinstance(e, errors.ZKDVError) else errors.CommitmentError(
          f"process 0 failed: {type(e).__name__}: {e}")
      self.broadcast(topic, {"error": type(said).__name__, "message": str(said)})
      raise
    self.broadcast(topic, {"value": value})
    return value

  def delete(self, topic: str) -> None:
    """Deletes process 0's ``broadcast`` of ``topic`` (once every process has read it)."""
    if self.multi:
      self._client.key_value_delete(f"{self._prefix}/{topic}")

  def agree_on_outcome(self, error, path, committed_steps: int):
    """Process 0's failure, raised on every process of a multi-process run.

    Returns ``error``, or on another process the CommitmentError that quotes
    process 0's failure to complete the transcript at ``path``.
    """
    if not self.multi:
      return error
    reported = self.broadcast("finish", None if error is None else
                              f"{type(error).__name__}: {error}")
    if committed_steps:  # every process has read the start message by now
      self.close_run()
    if error is None and reported is not None:
      error = errors.CommitmentError(
          f"process 0 could not complete the transcript at {path}: {reported}")
    return error

  def report_failure(self, message: str) -> None:
    """Tells the other processes that this one stopped committing, and why."""
    if self.multi and self._prefix is not None:
      self._client.key_value_set_bytes(f"{self._prefix}/failed/{self.index}",
                                       message.encode())

  def failure(self, index: int) -> str | None:
    """What process ``index`` reported when it stopped committing, or None."""
    try:
      return self._client.key_value_try_get_bytes(
          f"{self._prefix}/failed/{index}").decode(errors="replace")
    except jax.errors.JaxRuntimeError:  # NOT_FOUND: no failure reported
      return None

  def _get(self, key: str, what: str, source: int | None, patient: bool = False) -> bytes:
    """Waits for ``key``, giving up early if process ``source`` reports a failure
    (and, unless ``patient``, after ``timeout_s``)."""
    deadline = time.monotonic() + self.timeout_s
    while True:
      try:
        return self._client.blocking_key_value_get_bytes(key, _POLL_MS)
      except jax.errors.JaxRuntimeError as e:
        if "DEADLINE_EXCEEDED" not in str(e):  # the coordination service itself failed
          raise errors.CommitmentError(
              f"process {self.index} lost the coordination service while waiting for "
              f"{what}: {e}") from e
        reason = None if source is None else self.failure(source)
        if reason is not None:
          raise errors.CommitmentError(
              f"process {source} stopped committing, so {what} never came: "
              f"{reason}") from e
        if not patient and time.monotonic() > deadline:
          raise errors.CommitmentError(
              f"process {self.index} waited {self.timeout_s:.0f} s for {what} and got "
              f"nothing ({type(e).__name__}: {e}). Every process of a multi-process run "
              "must call the same proof.jit steps in the same order; a process that "
              "stopped or diverged leaves the others waiting.") from e


def _error_named(name: str, message: str) -> errors.ZKDVError:
  """Process 0's ``zkdv.errors`` error ``name`` with its ``message``, to raise elsewhere."""
  kind = getattr(errors, name, None)
  if not (isinstance(kind, type) and issubclass(kind, errors.ZKDVError)):
    kind = errors.CommitmentError
  error = kind.__new__(kind)
  Exception.__init__(error, message)  # the message as process 0 said it, not prefixed again
  return error


def merge(per_process: list, what: str) -> list:
  """Each process's partial ``[leaf][piece]`` digests merged into whole ones.

  A digest is None where a process does not hold that piece; the first
  process that holds it gives it. Raises CommitmentError naming a piece no
  process holds.
  """
  if len(per_process) == 1 and not any(d is None for leaf in per_process[0] for d in leaf):
    return per_process[0]
  merged = []
  for leaf, pieces in enumerate(zip(*per_process, strict=True)):
    row = [next((c for c in candidates if c is not None), None)
           for candidates in zip(*pieces, strict=True)]
    if None in row:
      raise errors.CommitmentError(
          f"no process committed part {row.index(None)} of {what} leaf {leaf}: it is "
          "not where the program's layout places it. Give proof.jit out_shardings "
          "equal to the state's in_shardings, and shard batches along their rows.")
    merged.append(row)
  return merged
