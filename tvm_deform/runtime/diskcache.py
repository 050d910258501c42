"""The on-disk cache (build and dispatch layer): compiled kernels, the launcher libraries, the
dispatch decisions and the unpacked tuning databases, kept between processes in
``TVM_DEFORM_CACHE_DIR`` (default ``~/.cache/tvm_deform``).

A compiled kernel is code that runs as the user, so the cache is used only where nobody else can
have put a file there:

- the directory must belong to the user and be writable by nobody else; otherwise the op runs
  without the disk cache (one warning says why);
- every library is written to a temporary file and renamed into place, with a digest of its bytes
  beside it (``<name>.sha256``); a library whose digest does not match (truncated, or written by
  something else) or that another user can write to is removed and rebuilt, never loaded;
- two processes that need the same new kernel compile it once: the second waits on a lock file
  (``locks/<name>.lock``) and then loads what the first wrote.

The kernels' total size is bounded (``TVM_DEFORM_CACHE_LIMIT``, default 1 GiB): after each write
the least recently used kernels are removed until the rest fit (a load marks a kernel used).
``tvm-deform cache`` shows the cache and ``tvm-deform cache --clear`` empties it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import os
import shutil
import stat
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from tvm_deform import env

#: the suffix of a library's digest file
DIGEST = ".sha256"
#: the kernel libraries: the top level of the cache directory
KERNELS = "deform_conv2d*.so"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One cached kernel library."""

    path: Path
    size: int
    last_used: float


def root() -> Path | None:
    """The cache directory, created private to the user where missing; None when the cache is
    off (``TVM_DEFORM_CACHE=0``) or cannot be used safely (see the module docstring)."""
    if not env.cache_enabled():
        return None
    return _checked(env.cache_dir())


def subdirectory(name: str) -> Path | None:
    """``root()/name``, created private to the user; None where ``root()`` is."""
    base = root()
    if base is None:
        return None
    path = base / name
    try:
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        return None
    return path if trusted(path) else None


def _checked(directory: Path) -> Path | None:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        _warn_once(directory, f"cannot be created ({error})")
        return None
    if not trusted(directory):
        _warn_once(
            directory,
            "belongs to another user or others can write to it; compiled kernels are code, so "
            "the op runs without the disk cache (make it yours with mode 0700, or set "
            "TVM_DEFORM_CACHE_DIR)",
        )
        return None
    return directory


@functools.cache
def _warn_once(directory: Path, why: str) -> None:
    warnings.warn(f"kernel cache directory {directory} {why}", RuntimeWarning, stacklevel=4)


def trusted(path: Path) -> bool:
    """Whether ``path`` belongs to this user and nobody else can write to it."""
    try:
        info = path.stat()
    except OSError:
        return False
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def digest_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verified(path: Path) -> bool:
    """Whether the library at ``path`` is one this cache wrote, whole: it and its digest file
    are trusted and the digest matches. A library that fails is removed (it is rebuilt)."""
    if not path.exists():
        return False
    digest = path.with_name(path.name + DIGEST)
    try:
        good = trusted(path) and trusted(digest) and digest.read_text().strip() == digest_of(path)
    except OSError:
        good = False
    if not good:
        warnings.warn(
            f"rebuilding kernel cache entry {path}: not the file the cache wrote",
            RuntimeWarning,
            stacklevel=3,
        )
        remove(path)
    return good


def seal(path: Path) -> None:
    """Write the digest file of the library at ``path`` (atomically)."""
    write_atomically(path.with_name(path.name + DIGEST), digest_of(path).encode())


def store(path: Path, export: Callable[[str], None]) -> None:
    """``export(temporary)`` writes the library; it is sealed and renamed to ``path``, then the
    kernels are trimmed to the size limit."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=path.suffix + ".tmp")
    os.close(handle)
    try:
        export(temporary)
        os.chmod(temporary, 0o600)
        digest = digest_of(Path(temporary))
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    write_atomically(path.with_name(path.name + DIGEST), digest.encode())
    if path.parent == root():
        evict(limit_bytes(), keep=path)


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed into place."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def touch(path: Path) -> None:
    """Mark the library at ``path`` used now (for the least-recently-used eviction)."""
    with contextlib.suppress(OSError):
        os.utime(path)


def remove(path: Path) -> None:
    for leftover in (path, path.with_name(path.name + DIGEST)):
        with contextlib.suppress(OSError):
            leftover.unlink()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold the lock of the library at ``path`` (other processes and threads that take it wait):
    around looking it up, building and writing it, so that it is built once."""
    locks = path.parent / "locks"
    try:
        locks.mkdir(mode=0o700, exist_ok=True)
        handle = os.open(locks / (path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield  # no lock file: at worst two processes compile the same kernel
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)


def limit_bytes() -> int:
    """``TVM_DEFORM_CACHE_LIMIT``: the most bytes the cached kernels may take."""
    return env.cache_limit_bytes()


def entries() -> list[Entry]:
    """The cached kernel libraries, least recently used first."""
    base = env.cache_dir()
    found = []
    for path in base.glob(KERNELS) if base.is_dir() else ():
        try:
            info = path.stat()
        except OSError:
            continue
        found.append(Entry(path, info.st_size, info.st_mtime))
    return sorted(found, key=lambda e: e.last_used)


def evict(limit: int, keep: Path | None = None) -> list[Path]:
    """Remove the least recently used kernels until the rest take at most ``limit`` bytes
    (never ``keep``, the one just written); returns the removed ones."""
    found = entries()
    total = sum(e.size for e in found)
    removed = []
    for entry in found:
        if total <= limit:
            break
        if entry.path == keep:
            continue
        remove(entry.path)
        total -= entry.size
        removed.append(entry.path)
    return removed


def clear() -> int:
    """Remove everything in the cache directory; returns the bytes freed."""
    base = env.cache_dir()
    if not base.is_dir():
        return 0
    freed = sum(p.stat().st_size for p in base.rglob("*") if p.is_file())
    for child in base.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                child.unlink()
    return freed


def describe() -> str:
    """The cache in a few lines (``tvm-deform cache``)."""
    base = env.cache_dir()
    found = entries()
    total = sum(e.size for e in found)
    state = "on" if env.cache_enabled() else "off (TVM_DEFORM_CACHE=0)"
    if env.cache_enabled() and base.exists() and not trusted(base):
        state = "not used: another user owns it or others can write to it"
    lines = [
        f"kernel cache:  {base} ({state})",
        f"kernels:       {len(found)}, {total / 2**20:.1f} MiB of a "
        f"{limit_bytes() / 2**20:.0f} MiB limit (TVM_DEFORM_CACHE_LIMIT)",
    ]
    if found:
        newest = time.strftime("%Y-%m-%d %H:%M", time.localtime(found[-1].last_used))
        lines.append(f"last used:     {newest}")
    for name in ("launcher", "decisions", "logs"):
        folder = base / name
        if folder.is_dir():
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            lines.append(f"{name + ':':<14} {size / 2**20:.1f} MiB")
    return "\n".join(lines)
