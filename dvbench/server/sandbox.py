"""The verifier child's confinement: least privilege for code that runs an uploaded program.

A child that runs an uploaded program gets, before ``exec``:

* ``PR_SET_PDEATHSIG`` (SIGKILL): it dies with the worker that started it;
* rlimits: address space, CPU time, no core files;
* ``network namespace``: ``unshare(CLONE_NEWNET)`` (inside a new user namespace when the
  server is not root) with only its own loopback up (a multi-process replay's gloo
  collectives use it): no TCP, UDP or abstract unix socket reaches anything outside;
* ``mount namespace``: a private root holding only the interpreter, the packages, the
  system's libraries and its job folder (``sandbox_mounts``); the data folder, the
  database, the signing key, other proofs' work and ``/etc/shadow`` are not there;
* ``unprivileged user``: as root, uid and gid ``SANDBOX_UID`` (65534, ``nobody``; set
  ``DVBENCH_SANDBOX_UID`` to choose another) with no supplementary groups and an empty
  capability bounding set; otherwise the server's own uid. Either way ``no_new_privs``, no
  capabilities after ``exec``, and an environment without the server's (``child_env``);
* ``landlock`` (Linux 5.13+): no file may be created, written, removed or renamed outside
  its scratch folder and ``/dev/shm``, and it cannot ptrace anything outside;
* ``landlock scopes`` (Landlock ABI 6, Linux 6.12+): no signal and no abstract unix socket
  reaches a process outside;
* ``seccomp``: ``socket(AF_UNIX)`` and ``io_uring_setup`` are refused, so no unix socket
  reaches one by its path (e.g. a PostgreSQL server's).

``probe()`` finds, once per process, which of these the kernel grants (and why not); a
worker refuses to start while one is missing (``landlock scopes`` excepted: used where the
kernel has them) unless the operator allowed a weak sandbox (``dvbench serve
--allow-weak-sandbox``); ``/health`` and the logs name what is missing.
A protection found available is required: if applying it fails later, the child does not
start (fail closed). ``DVBENCH_SANDBOX_WITHOUT=seccomp,landlock`` treats the named
protections as missing (for a kernel where one misbehaves).

Example::

  isolation = available()  # e.g. ("network namespace", "mount namespace", ...)
  subprocess.run(command, env=child_env(folder), preexec_fn=confine(
      work, folder, 1 << 30, 60, isolation, hidden=[data_folder]))
"""

import ctypes
import fcntl
import functools
import os
import platform
import resource
import shutil
import signal
import socket
import struct
import tempfile

from dvbench.server import sandbox_mounts

NETWORK = "network namespace"
FILES = "mount namespace"
USER = "unprivileged user"
LANDLOCK = "landlock"
SCOPES = "landlock scopes"
SECCOMP = "seccomp"
PROTECTIONS = (NETWORK, FILES, USER, LANDLOCK, SCOPES, SECCOMP)
OPTIONAL = (SCOPES,)  # used where the kernel has them; missing, they are reported, not refused
WITHOUT_ENV = "DVBENCH_SANDBOX_WITHOUT"  # comma-separated protections to treat as missing
UID_ENV = "DVBENCH_SANDBOX_UID"
SANDBOX_UID = 65534
STAGING = ".root"  # in the job folder: where the child's root is assembled

_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_SECCOMP = 1, 24, 22
_PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWNET = 0x20000, 0x10000000, 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
# Landlock filesystem rights that change the filesystem (ABI 1), then REFER (2), TRUNCATE (3).
_WRITE_FILE = 1 << 1
_WRITES_ABI1 = _WRITE_FILE | sum(1 << bit for bit in range(4, 13))  # remove_*, make_*
_REFER, _TRUNCATE = 1 << 13, 1 << 14
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1, 2  # ABI 6
_O_PATH = getattr(os, "O_PATH", 0o10000000)
# seccomp: (audit arch, socket, io_uring_setup) per machine.
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 41, 425), "aarch64": (0xC00000B7, 198, 425)}
_SECCOMP_MODE_FILTER = 2
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _PathBeneath(ctypes.Structure):
  _pack_ = 1
  _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _SockFilter(ctypes.Structure):
  _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
              ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
  _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def _check(result: int, what: str) -> int:
  if result < 0:
    raise OSError(ctypes.get_errno(), f"{what} failed: {os.strerror(ctypes.get_errno())}")
  return result


def die_with_parent(parent_pid: int) -> None:
  """SIGKILL this process when its parent dies (and exit now if it already did)."""
  _check(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
  if os.getppid() != parent_pid:
    os._exit(1)


def sandbox_ids() -> tuple[int, int]:
  """(uid, gid) of the child when the server runs as root: ``DVBENCH_SANDBOX_UID`` or 65534."""
  uid = int(os.environ.get(UID_ENV, SANDBOX_UID))
  if uid <= 0:
    raise ValueError(f"{UID_ENV} must name an unprivileged uid, not {uid}.")
  return uid, uid


def child_env(scratch) -> dict[str, str]:
  """The child's environment: only what finds Python and configures JAX, never the
  server's (no database URL, no tokens). E.g. ``{"PATH": ..., "HOME": scratch, ...}``."""
  keep = ("PATH", "PYTHONPATH", "LANG", "TZ")
  prefixes = ("LC_", "JAX_", "XLA_", "CUDA_", "NVIDIA_", "TF_CPP_")
  env = {k: v for k, v in os.environ.items() if k in keep or k.startswith(prefixes)}
  return {**env, "TMPDIR": os.fspath(scratch), "HOME": os.fspath(scratch)}


def _write(path: str, text: str) -> None:
  with open(path, "w", encoding="ascii") as f:
    f.write(text)


def _unshare(flags: int) -> None:
  """New namespaces; as non-root inside a new user namespace mapping only us."""
  if os.geteuid() == 0:
    _check(_libc.unshare(flags), "unshare")
    return
  uid, gid = os.geteuid(), os.getegid()
  _check(_libc.unshare(_CLONE_NEWUSER | flags), "unshare(CLONE_NEWUSER)")
  _write("/proc/self/setgroups", "deny")
  _write("/proc/self/uid_map", f"{uid} {uid} 1")
  _write("/proc/self/gid_map", f"{gid} {gid} 1")


def _loopback_up() -> None:
  """Brings up the new namespace's own ``lo``: a multi-process replay talks over loopback
  (gloo), which reaches nothing outside the namespace."""
  request = struct.Struct("16sH14x")
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    flags = request.unpack(fcntl.ioctl(s, _SIOCGIFFLAGS, request.pack(b"lo", 0)))[1]
    fcntl.ioctl(s, _SIOCSIFFLAGS, request.pack(b"lo", flags | _IFF_UP))


def _drop_privileges() -> None:
  """As root: an empty bounding set, no ambient capabilities, the sandbox's uid and gid
  (which clears every capability), no supplementary groups. Otherwise nothing to drop:
  ``exec`` of a non-root process leaves it none."""
  if os.geteuid() != 0:
    return
  with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as f:
    last = int(f.read())
  for cap in range(last + 1):
    _check(_libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"prctl(PR_CAPBSET_DROP, {cap})")
  _check(_libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0),
         "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
  uid, gid = sandbox_ids()
  os.setgroups([])
  os.setresgid(gid, gid, gid)
  os.setresuid(uid, uid, uid)


def _no_new_privs() -> None:
  _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def landlock_abi() -> int:
  """The kernel's Landlock ABI version; negative when it has none."""
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


def _landlock(folders: list[str], scoped: bool) -> None:
  """Every filesystem change is refused except beneath ``folders`` (and writing existing
  files beneath /dev); with ``scoped``, signals and abstract unix sockets stay inside."""
  abi = _check(landlock_abi(), "landlock_create_ruleset(version)")
  writes = _WRITES_ABI1 | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
  if scoped and abi < 6:
    raise OSError(0, f"landlock scopes need Landlock ABI 6; this kernel has {abi}")
  # struct landlock_ruleset_attr: handled_access_fs, handled_access_net (4), scoped (6).
  attr = struct.pack("<QQQ", writes, 0, _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL)
  size = 24 if scoped else 8
  buffer = ctypes.create_string_buffer(attr[:size], size)
  ruleset = _check(_libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, buffer, ctypes.c_size_t(size),
                                 ctypes.c_uint32(0)), "landlock_create_ruleset")
  try:
    for folder in folders:
      _allow(ruleset, folder, writes)
    _allow(ruleset, "/dev", _WRITE_FILE | (_TRUNCATE if abi >= 3 else 0))
    _no_new_privs()
    _check(_libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset),
                         ctypes.c_uint32(0)), "landlock_restrict_self")
  finally:
    os.close(ruleset)


def _seccomp_program() -> list[tuple[int, int, int, int]]:
  """BPF: refuse socket(AF_UNIX, ...), io_uring_setup, x32 and foreign-architecture calls."""
  if platform.machine() not in _SECCOMP_ARCH:
    raise OSError(0, f"seccomp: no filter for {platform.machine()}")
  arch, nr_socket, nr_io_uring = _SECCOMP_ARCH[platform.machine()]
  ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
  deny = _RET_ERRNO | 13  # EACCES
  return [(ld, 0, 0, 4),  # seccomp_data.arch
          (jeq, 1, 0, arch), (ret, 0, 0, deny),
          (ld, 0, 0, 0),  # seccomp_data.nr
          (jge, 5, 0, 0x40000000),  # x32 system calls
          (jeq, 4, 0, nr_io_uring),
          (jeq, 1, 0, nr_socket), (ret, 0, 0, _RET_ALLOW),
          (ld, 0, 0, 16),  # seccomp_data.args[0], low 32 bits: the socket's family
          (jeq, 0, 1, socket.AF_UNIX), (ret, 0, 0, deny), (ret, 0, 0, _RET_ALLOW)]


def _seccomp() -> None:
  program = _seccomp_program()
  filters = (_SockFilter * len(program))(*[_SockFilter(*p) for p in program])
  fprog = _SockFprog(len(program), filters)
  _no_new_privs()
  _check(_libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0),
         "prctl(PR_SET_SECCOMP)")


def prepare(work, scratch) -> None:
  """In the worker, before the child starts: the staging folder, and (as root) the job
  folder traversable and the scratch folder owned by the sandbox's user."""
  os.makedirs(os.path.join(work, STAGING), exist_ok=True)
  if os.geteuid() == 0:
    os.chmod(work, 0o711)
    uid, gid = sandbox_ids()
    os.chown(scratch, uid, gid)


def confine(work, scratch, memory_bytes: int, cpu_seconds: int, isolation: tuple[str, ...],
            hidden=()):
  """A ``preexec_fn`` applying the limits and the protections in ``isolation`` to a child
  working in ``scratch`` (inside the job folder ``work``; both absolute paths). Folders in
  ``hidden`` stay out of its view even beneath a folder it must read."""
  parent, work, scratch = os.getpid(), os.fspath(work), os.fspath(scratch)
  mounts = sandbox_mounts.plan(work, scratch, hidden) if FILES in isolation else ()
  namespaces = (_CLONE_NEWNET if NETWORK in isolation else 0) | (
      _CLONE_NEWNS if FILES in isolation else 0)

  def apply():
    die_with_parent(parent)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    # SIGXCPU at the soft limit; the hard limit is a backstop.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 5))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if namespaces:
      _unshare(namespaces)
    if NETWORK in isolation:
      _loopback_up()
    if FILES in isolation:
      sandbox_mounts.enter(mounts, os.path.join(work, STAGING))
    os.chdir(scratch)
    if USER in isolation:
      _drop_privileges()
    _no_new_privs()
    if LANDLOCK in isolation:
      _landlock([scratch] + (["/dev/shm"] if FILES in isolation else []), SCOPES in isolation)
    if SECCOMP in isolation:
      _seccomp()
  return apply


def _probe_files() -> None:
  folder = tempfile.mkdtemp(prefix="dvbench-probe-")
  try:
    pid = os.fork()
    if pid == 0:
      try:
        _unshare(_CLONE_NEWNS)
        sandbox_mounts.enter((), folder)
        os._exit(0)
      except BaseException:  # pylint: disable=broad-except
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
      raise OSError(0, "a private mount namespace could not be made")
  finally:
    shutil.rmtree(folder, ignore_errors=True)


def _probe_seccomp() -> None:
  _seccomp()
  try:
    socket.socket(socket.AF_UNIX).close()
  except PermissionError:
    return
  raise OSError(0, "the seccomp filter did not refuse a unix socket")


def _probe_scopes() -> None:
  abi = landlock_abi()
  if abi < 6:
    raise OSError(0, f"Landlock ABI {abi} (6 needed, Linux 6.12+)")
  _landlock(["/"], scoped=True)


_PROBES = {
    NETWORK: lambda: (_unshare(_CLONE_NEWNET), _loopback_up()),
    FILES: _probe_files,
    USER: _drop_privileges,
    LANDLOCK: lambda: _landlock(["/"], scoped=False),
    SCOPES: _probe_scopes,
    SECCOMP: _probe_seccomp,
}


def _run_probe(probe) -> str | None:
  """None when ``probe`` succeeds in a forked child, else why it failed."""
  read, write = os.pipe()
  pid = os.fork()
  if pid == 0:  # the child only makes system calls, then exits
    os.close(read)
    try:
      probe()
      os._exit(0)
    except BaseException as e:  # pylint: disable=broad-except
      os.write(write, str(e).encode()[:500] or type(e).__name__.encode())
      os._exit(1)
  os.close(write)
  with os.fdopen(read, "rb") as f:
    why = f.read().decode(errors="replace")
  _, status = os.waitpid(pid, 0)
  return None if os.waitstatus_to_exitcode(status) == 0 else (why or "refused")


@functools.cache
def probe() -> dict[str, str | None]:
  """{protection: None when the kernel grants it, else why not}, probed in forked
  children once per process; ``DVBENCH_SANDBOX_WITHOUT`` marks protections missing."""
  without = {n.strip() for n in os.environ.get(WITHOUT_ENV, "").split(",") if n.strip()}
  unknown = without - set(PROTECTIONS)
  if unknown:
    raise ValueError(f"{WITHOUT_ENV} names unknown protections {sorted(unknown)}; "
                     f"known: {', '.join(PROTECTIONS)}.")
  found = {name: f"disabled by {WITHOUT_ENV}" if name in without else _run_probe(_PROBES[name])
           for name in PROTECTIONS}
  if os.geteuid() == 0 and found[FILES] is not None and found[USER] is None:
    # Without its own root the sandbox's uid may not reach the interpreter (e.g. under
    # /root) nor the job folder: the child would not start at all.
    found[USER] = f"needs the {FILES}"
  return found


def available() -> tuple[str, ...]:
  """The protections this kernel grants, e.g. ``(NETWORK, FILES, USER, LANDLOCK, ...)``."""
  return tuple(name for name, why in probe().items() if why is None)


def missing() -> dict[str, str]:
  """{protection: why} of those the kernel does not grant; empty on a full sandbox."""
  return {name: why for name, why in probe().items() if why is not None}


def weak(gaps: dict[str, str]) -> bool:
  """Whether ``gaps`` (from ``missing``) leave out a protection that is not ``OPTIONAL``."""
  return any(name not in OPTIONAL for name in gaps)


def describe(isolation: tuple[str, ...]) -> str:
  """One line for logs and /health, e.g. 'network namespace, landlock, rlimits'."""
  return ", ".join([*isolation, "rlimits (memory, CPU time), dies with its worker"])


def weakness(gaps: dict[str, str]) -> str:
  """What a log line says of missing protections, e.g. 'seccomp (disabled by ...)'."""
  return "; ".join(f"{name} ({why})" for name, why in gaps.items())
