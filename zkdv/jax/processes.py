"""The processes of one run, for multi-process JAX (``jax.distributed``).

Every process runs the same steps and commits the pieces of state and the
batch rows it addresses. Their digests (and the bytes of probed rows) travel
to process 0 through the coordination service's key-value store, not through
XLA collectives, so the commit threads never race the training step's own
collectives. Process 0 alone writes the transcript. In a single-process run
the group has one member and every exchange is the identity.

Example::

  group = ProcessGroup.current()
  seed = group.share("seed", sampling.new_seed)   # the same bytes everywhere
  merged = group.gather("step-3", cbor2.dumps(local_digests))  # process 0: all of them
"""

import itertools
from collections.abc import Callable

import cbor2
import jax

from zkdv import errors
from zkdv.jax import _compat

_proofs_started = itertools.count()  # the same sequence in every process of a run


class ProcessGroup:
  """The processes of a run, as seen from one of them.

  Attributes:
    index: this process's index (``jax.process_index()``).
    count: the number of processes (``jax.process_count()``).
    timeout_s: how long process 0 waits for another process's message.
  """

  def __init__(self, client, index: int, count: int, timeout_s: float = 600.0):
    self._client = client
    self.index = index
    self.count = count
    self.timeout_s = timeout_s
    self._prefix = None

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

  def open_run(self, make_run: Callable[[], dict]) -> dict:
    """The run's shared values (``make_run()`` on process 0), the same on every process.

    Every process of a run must start its proofs in the same order.
    """
    if not self.multi:
      return make_run()
    key = f"zkdv/start/{next(_proofs_started)}"
    if self.is_writer:
      run = make_run()
      self._client.key_value_set_bytes(key, cbor2.dumps(run))
    else:
      run = cbor2.loads(self._get(key, "the start of the proof"))
    self._prefix = f"zkdv/run/{run['run_id'].hex()}"
    return run

  def gather(self, topic: str, local):
    """Every process's ``local`` value in process order, on process 0; None elsewhere.

    ``local`` is any CBOR-encodable value. Call it in the same order on every process.
    """
    if not self.multi:
      return [local]
    if not self.is_writer:
      self._client.key_value_set_bytes(f"{self._prefix}/{topic}/{self.index}",
                                       cbor2.dumps(local))
      return None
    values = [local]
    for index in range(1, self.count):
      key = f"{self._prefix}/{topic}/{index}"
      values.append(cbor2.loads(self._get(key, f"{topic} from process {index}")))
      self._client.key_value_delete(key)
    return values

  def _get(self, key: str, what: str) -> bytes:
    try:
      return self._client.blocking_key_value_get_bytes(key, int(self.timeout_s * 1000))
    except Exception as e:  # the coordination service raises its own runtime errors
      raise errors.CommitmentError(
          f"process {self.index} waited {self.timeout_s:.0f} s for {what} and got "
          f"nothing ({type(e).__name__}: {e}). Every process of a multi-process run "
          "must call the same proof.jit steps in the same order; a process that "
          "stopped or diverged leaves the others waiting.") from e


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
