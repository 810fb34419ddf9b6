"""The verifier child's confinement: what Linux offers an unprivileged process, nothing more.

A child that runs an uploaded program gets, before ``exec``:

* ``PR_SET_PDEATHSIG`` (SIGKILL): it dies with the worker that started it;
* rlimits: address space, CPU time, no core files;
* a fresh network namespace (``unshare(CLONE_NEWNET)``, inside a new user namespace when
  not root): no interface but its own loopback (a multi-process replay's gloo collectives
  talk over it), so no socket reaches anything outside;
* Landlock (Linux 5.13+): no file may be created, written, removed or renamed outside its
  own folder (existing device files such as /dev/null may still be opened for writing).

``available()`` probes, once per process, which of these the kernel grants; a worker logs
the result and the server reports it in ``/health``. A mechanism found available is then
required: if applying it fails later, the child does not start (fail closed).

Example::

  isolation = available()  # e.g. ("network namespace", "landlock")
  subprocess.run(command, preexec_fn=confine(folder, 1 << 30, 60, isolation))
"""

import ctypes
import fcntl
import functools
import os
import resource
import signal
import socket
import struct

NETWORK = "network namespace"
LANDLOCK = "landlock"

_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
# Landlock filesystem rights that change the filesystem (ABI 1), then REFER (2), TRUNCATE (3).
_WRITE_FILE = 1 << 1
_WRITES_ABI1 = _WRITE_FILE | sum(1 << bit for bit in range(4, 13))  # remove_*, make_*
_REFER, _TRUNCATE = 1 << 13, 1 << 14
_O_PATH = getattr(os, "O_PATH", 0o10000000)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _PathBeneath(ctypes.Structure):
  _pack_ = 1
  _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _check(result: int, what: str) -> int:
  if result < 0:
    raise OSError(ctypes.get_errno(), f"{what} failed: {os.strerror(ctypes.get_errno())}")
  return result


def die_with_parent(parent_pid: int) -> None:
  """SIGKILL this process when its parent dies (and exit now if it already did)."""
  _check(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
  if os.getppid() != parent_pid:
    os._exit(1)


def _write(path: str, text: str) -> None:
  with open(path, "w", encoding="ascii") as f:
    f.write(text)


def _isolate_network() -> None:
  """A new network namespace with only its own loopback; as non-root inside a user namespace
  mapping only us."""
  if os.geteuid() == 0:
    _check(_libc.unshare(_CLONE_NEWNET), "unshare(CLONE_NEWNET)")
  else:
    uid, gid = os.geteuid(), os.getegid()
    _check(_libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET), "unshare(CLONE_NEWUSER|CLONE_NEWNET)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
  _loopback_up()


def _loopback_up() -> None:
  """Brings up the new namespace's own ``lo``: a multi-process replay talks over loopback
  (gloo), which reaches nothing outside the namespace."""
  request = struct.Struct("16sH14x")
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    flags = request.unpack(fcntl.ioctl(s, _SIOCGIFFLAGS, request.pack(b"lo", 0)))[1]
    fcntl.ioctl(s, _SIOCSIFFLAGS, request.pack(b"lo", flags | _IFF_UP))


def _landlock_abi() -> int:
  return _libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                       ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION))


def _allow(ruleset: int, path: str, access: int) -> None:
  fd = os.open(path, _O_PATH | os.O_CLOEXEC)
  try:
    rule = _PathBeneath(access, fd)
    _check(_libc.syscall(_SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset),
                         ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH), ctypes.byref(rule),
                         ctypes.c_uint32(0)), f"landlock_add_rule({path})")
  finally:
    os.close(fd)


def _restrict_writes(folder: str) -> None:
  """Landlock: every filesystem change is refused except beneath ``folder``."""
  abi = _check(_landlock_abi(), "landlock_create_ruleset(version)")
  writes = _WRITES_ABI1 | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
  handled = ctypes.c_uint64(writes)
  ruleset = _check(_libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(handled),
                                 ctypes.c_size_t(8), ctypes.c_uint32(0)),
                   "landlock_create_ruleset")
  try:
    _allow(ruleset, folder, writes)
    _allow(ruleset, "/dev", _WRITE_FILE | (_TRUNCATE if abi >= 3 else 0))
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(_libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset),
                         ctypes.c_uint32(0)), "landlock_restrict_self")
  finally:
    os.close(ruleset)


def confine(folder, memory_bytes: int, cpu_seconds: int, isolation: tuple[str, ...]):
  """A ``preexec_fn`` applying the limits and the mechanisms in ``isolation``."""
  parent, folder = os.getpid(), os.fspath(folder)

  def apply():
    die_with_parent(parent)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    # SIGXCPU at the soft limit; the hard limit is a backstop.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 5))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if NETWORK in isolation:
      _isolate_network()
    if LANDLOCK in isolation:
      _restrict_writes(folder)
  return apply


@functools.cache
def available() -> tuple[str, ...]:
  """The mechanisms this kernel grants, probed in a forked child (cached per process)."""
  found = []
  for name, probe in ((NETWORK, _isolate_network), (LANDLOCK, lambda: _restrict_writes("/"))):
    pid = os.fork()
    if pid == 0:  # the child only makes system calls, then exits
      try:
        probe()
        os._exit(0)
      except BaseException:  # pylint: disable=broad-except
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
      found.append(name)
  return tuple(found)


def describe(isolation: tuple[str, ...]) -> str:
  """One line for logs and /health, e.g. 'network namespace, landlock, rlimits'."""
  return ", ".join([*isolation, "rlimits (memory, CPU time), dies with its worker"])
