"""The verifier child's view of the filesystem: a private mount namespace holding only what
Python and JAX need, read-only, and its job folder (its scratch folder writable).

``plan(work, scratch, hidden)`` is computed in the worker before the child forks (it reads
``sys.path`` and the filesystem); ``enter(plan, root)`` runs in the child, after
``unshare(CLONE_NEWNS)``: a tmpfs becomes the new root, the planned paths are bind-mounted
at their own absolute paths, then ``pivot_root`` detaches the old root. Everything else —
the data folder with the database, the signing key and other proofs' work, ``/etc/shadow``,
``/home``, ``/var/run`` and its sockets — is not there. A folder in ``hidden`` that lies
beneath a bound folder is covered with an empty read-only tmpfs (e.g. ``--data`` inside
the checkout that ``PYTHONPATH`` names).

Example::

  mounts = plan(work, work / "scratch", hidden=[data_folder])
  # in the child, after unshare(CLONE_NEWNS):
  enter(mounts, work / ".root")
"""

import ctypes
import dataclasses
import functools
import os
import pathlib
import platform
import sys

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_ST_RELATIME = 4096
_MNT_DETACH = 2
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(platform.machine())

# Files of /etc that the dynamic loader, Python and JAX read; nothing else of /etc is seen.
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf", "hosts",
        "passwd", "group", "host.conf", "gai.conf")
_DEVICES = ("null", "zero", "full", "random", "urandom")  # plus /dev/nvidia* where present


@dataclasses.dataclass(frozen=True)
class Mount:
  """One entry of the child's filesystem: ``kind`` is "ro" (a read-only bind mount of
  ``path`` and what is mounted beneath it), "job" (the job folder, read-only, alone), "rw"
  (the scratch folder), "dev" (a device node, bound as is), "mask" (an empty read-only tmpfs),
  "tmpfs" (a small writable one, e.g. /dev/shm), "proc", or "link" (a symlink to
  ``target``)."""

  path: str
  kind: str
  target: str = ""


def _check(result: int, what: str) -> int:
  if result < 0:
    errno = ctypes.get_errno()
    raise OSError(errno, f"{what} failed: {os.strerror(errno)}")
  return result


def _mount(source, target, fstype, flags: int, data=None) -> None:
  _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                     ctypes.c_ulong(flags), data and data.encode()), f"mount({target})")


def _python_paths() -> list[str]:
  """Folders the interpreter loads from: its prefixes, and ``sys.path`` (each outside the
  prefixes reduced to its packages and modules, so a checkout's other folders stay out)."""
  prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                            sys.base_exec_prefix)}
  paths = set(prefixes)
  here = os.path.realpath(os.getcwd())
  for entry in sys.path:
    real = os.path.realpath(entry) if entry else here
    if real == here or not os.path.isdir(real):
      continue  # the worker's own folder is not the child's
    if os.path.basename(real) in ("site-packages", "dist-packages") or any(
        real == p or real.startswith(p + os.sep) for p in prefixes):
      paths.add(real)  # installed packages: namespace packages and metadata included
      continue
    for child in os.scandir(real):
      if child.name.startswith(".") or child.name == "__pycache__":
        continue
      if (child.is_dir() and os.path.isfile(os.path.join(child.path, "__init__.py"))) or (
          child.is_file() and child.name.endswith((".py", ".so", ".pth"))):
        paths.add(os.path.realpath(child.path))
  for package in ("zkdv", "dvbench"):  # found through an import hook (editable install)
    paths.add(os.path.realpath(os.path.dirname(sys.modules[package].__file__))
              if package in sys.modules else "")
  paths.discard("")
  return sorted(paths)


@functools.cache
def _runtime() -> tuple[Mount, ...]:
  """What every child sees: the system's libraries, the interpreter, the packages."""
  mounts = []
  for name in sorted(os.listdir("/")):
    path = "/" + name
    if os.path.islink(path):
      mounts.append(Mount(path, "link", os.readlink(path)))  # e.g. /lib -> usr/lib
    elif name in ("usr", "lib", "lib32", "lib64", "bin", "sbin") and os.path.isdir(path):
      mounts.append(Mount(path, "ro"))
  mounts += [Mount(p, "ro") for p in _python_paths()]
  for name in _ETC:
    path = os.path.join("/etc", name)
    if os.path.exists(path):
      mounts.append(Mount(path, "ro"))
  devices = list(_DEVICES) + sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))
  mounts += [Mount("/dev/" + n, "dev") for n in devices if os.path.exists("/dev/" + n)]
  mounts += [Mount("/dev/shm", "tmpfs"), Mount("/proc", "proc"), Mount("/sys", "ro")]
  return tuple(mounts)


def plan(work, scratch, hidden=()) -> tuple[Mount, ...]:
  """The child's mounts: the runtime, ``work`` read-only with ``scratch`` writable, and a
  mask on each ``hidden`` folder that a bound folder would show. Paths must be absolute."""
  work, scratch = os.fspath(work), os.fspath(scratch)
  if not (os.path.isabs(work) and os.path.isabs(scratch)):
    raise ValueError(f"the child's folders must be absolute paths, not {work!r}")
  mounts = list(_runtime())
  bound = [m.path for m in mounts if m.kind == "ro"]
  for folder in map(os.path.realpath, hidden):
    if any(folder.startswith(b + os.sep) for b in bound):
      mounts.append(Mount(folder, "mask"))
  mounts += [Mount(work, "job"), Mount(scratch, "rw")]
  # Parents first: a mask or a job folder lands inside what is already mounted.
  return tuple(sorted(mounts, key=lambda m: len(pathlib.PurePath(m.path).parts)))


def _locked_flags(path: str) -> int:
  """Flags a bind of ``path`` keeps on remount (a user namespace may not clear them)."""
  f = os.statvfs(path).f_flag
  flags = f & (_MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_NOATIME | _MS_NODIRATIME)
  return flags | (_MS_RELATIME if f & _ST_RELATIME else 0)


def _place(target: str, directory: bool) -> None:
  if directory:
    os.makedirs(target, exist_ok=True)
  elif not os.path.lexists(target):
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))


def _apply(m: Mount, root: str, real_root: bool) -> str | None:
  """Mounts ``m`` under ``root``; returns the target of a tmpfs to make read-only later."""
  target = root + m.path
  if m.kind == "link":
    os.symlink(m.target, target)
    return None
  _place(target, m.kind in ("mask", "tmpfs", "proc") or os.path.isdir(m.path))
  if m.kind in ("mask", "tmpfs"):
    size = "64m" if m.kind == "tmpfs" else "1m"
    _mount("tmpfs", target, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
           f"mode={'1777' if m.kind == 'tmpfs' else '0755'},size={size}")
    return target if m.kind == "mask" else None
  if m.kind == "proc" and real_root:
    # A fresh /proc that shows the child only its own user's processes.
    _mount("proc", target, "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "hidepid=2")
    return None
  _mount(m.path, target, None, _MS_BIND | (_MS_REC if m.kind in ("proc", "ro") else 0))
  if m.kind in ("ro", "job", "rw"):
    readonly = 0 if m.kind == "rw" else _MS_RDONLY
    _mount(None, target, None, _MS_BIND | _MS_REMOUNT | _MS_NOSUID | _MS_NODEV | readonly
           | _locked_flags(m.path))
  return None


def enter(mounts: tuple[Mount, ...], root) -> None:
  """In the child (in a new mount namespace): makes ``mounts`` its whole filesystem, with
  ``root`` (an empty folder) as the staging point; the old root is detached."""
  if _SYS_PIVOT_ROOT is None:
    raise OSError(0, f"pivot_root: unknown system call number on {platform.machine()}")
  root = os.fspath(root)
  _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing propagates back to the host
  _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
  real_root = os.geteuid() == 0
  read_only = [root] + [t for t in (_apply(m, root, real_root) for m in mounts) if t]
  for target in reversed(read_only):
    _mount(None, target, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
  os.chdir(root)
  _check(_libc.syscall(_SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
  _check(_libc.umount2(b".", _MNT_DETACH), "umount2(old root)")
  os.chdir("/")
