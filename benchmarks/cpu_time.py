"""CPU time by part of a live run: the training process's threads and the server's processes.

A step's wall time on two shared cores moves by ±5 % between rounds, as much as what the
live path's probes cost; the CPU each part spends does not move with it. Read from
``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds on a CPU), so a block of a few hundred
steps resolves a microsecond a step.

Example::

  meter = CpuMeter(server_pid=server.process.pid)
  before = meter.read()
  ...  # a block of steps
  per_step = {part: s / steps for part, s in meter.since(before).items()}
  # {"training thread": 0.00018, "commit thread": 0.00041, ..., "server: ingestion": 0.00026}
"""

import collections
import os
import threading

# the parts, in the order a table shows them
PARTS = ("training thread", "commit thread", "uploader", "XLA", "other threads",
         "server: web", "server: ingestion", "server: other")
_THREADS = {"MainThread": "training thread", "zkdv-commit": "commit thread",
            "dvbench-upload": "uploader", "dvbench-blobs": "uploader"}


def _thread_seconds(pid: int) -> dict[int, tuple[str, float]]:
  """tid -> (its name in the kernel, its seconds on a CPU) of each live thread of ``pid``."""
  out = {}
  try:
    tids = os.listdir(f"/proc/{pid}/task")
  except FileNotFoundError:
    return out
  for tid in tids:
    try:
      with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        ns = int(f.read().split()[0])
      with open(f"/proc/{pid}/task/{tid}/comm") as f:
        out[int(tid)] = (f.read().strip(), ns / 1e9)
    except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile: its time is lost
      pass
  return out


def _server_part(pid: int) -> str:
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      command = f.read().replace(b"\0", b" ")
  except FileNotFoundError:
    return "server: other"
  if b"multiprocessing.spawn" in command:
    return "server: ingestion"
  if b"dvbench.cli serve" in command:
    return "server: web"
  return "server: other"


class CpuMeter:
  """Seconds on a CPU of this process's threads, by part (``PARTS``), and of the processes
  in the session of ``server_pid`` (a ``LocalServer``'s), by process."""

  def __init__(self, server_pid: int | None = None):
    self.server_pid = server_pid

  def read(self) -> dict[tuple, float]:
    """(pid, tid, part) -> seconds, for every thread now alive."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid, (comm, seconds) in _thread_seconds(os.getpid()).items():
      part = _THREADS.get(names.get(tid, ""))
      if part is None:
        part = "XLA" if comm.startswith("tf_") else "other threads"
      out[os.getpid(), tid, part] = seconds
    for pid in self._server_pids():
      part = _server_part(pid)
      for tid, (_, seconds) in _thread_seconds(pid).items():
        out[pid, tid, part] = seconds
    return out

  def since(self, before: dict[tuple, float]) -> dict[str, float]:
    """Seconds by part spent since ``before`` (a ``read()``); a thread that started since
    counts whole, one that ended since is lost (a block's own threads outlive it)."""
    spent = collections.Counter({part: 0.0 for part in PARTS})
    for key, seconds in self.read().items():
      spent[key[2]] += seconds - before.get(key, 0.0)
    return dict(spent)

  def _server_pids(self) -> list[int]:
    if self.server_pid is None:
      return []
    pids = []
    for entry in os.listdir("/proc"):
      if entry.isdigit():
        try:
          if os.getsid(int(entry)) == self.server_pid:
            pids.append(int(entry))
        except (ProcessLookupError, PermissionError):
          pass
    return pids
