"""One thread pool: the parallel loops of our CPU kernels run on torch's intra-op threads.

A kernel library exported by TVM starts its parallel loops through a function-pointer variable,
``__TVMBackendParallelLaunch``, that TVM's loader points at TVM's own thread pool when it loads
the library. Inside a torch program that makes two pools on the same cores: torch's OpenMP
workers keep spinning for a while after each torch op, TVM's workers after each of our calls,
and each slows the other (a DCN call between two torch convs took about twice its time alone).

:func:`attach` points that variable of a loaded kernel library at a small C++ launcher
(``launcher.cc``) that runs the tasks through ``at::parallel_for``. Then:

- ``torch.set_num_threads`` governs our kernels too, and TVM's pool is never started;
- a call from inside a torch parallel region runs its tasks inline, as ATen's own ops do;
- several Python threads may call at once (each ``at::parallel_for`` is independent).

The launcher is compiled once per torch installation (about a second) with the C++ compiler
that TVM uses to export kernels (``CXX``, default ``g++``), linked against the OpenMP runtime
torch itself loaded, and kept in the kernel cache directory. Without a compiler, or with
``TVM_DEFORM_LAUNCHER=0``, the kernels keep TVM's pool; the former is warned about once and
``tvm-deform info`` says which pool runs the kernels.

Only kernel libraries loaded from a file can be attached: TVM's in-memory modules resolve the
launch function inside TVM. The kernel cache therefore always loads kernels from files.
TVM's workspace allocator (``__TVMBackendAllocWorkspace``) is kept: it is a per-thread pool that
is safe to call from any thread.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from tvm_deform import env
from tvm_deform.runtime import diskcache

SOURCE = Path(__file__).with_name("launcher.cc")

#: the variables TVM's loader fills in a kernel library: we replace the launch pointer only, and
#: leave a library that also uses TVM's barrier on TVM's pool (our launcher has no barrier)
LAUNCH_SYMBOL = "__TVMBackendParallelLaunch"
BARRIER_SYMBOL = "__TVMBackendParallelBarrier"


class Launcher:
    """The loaded launcher library."""

    def __init__(self, path: Path):
        self.path = path
        self.library = ctypes.CDLL(str(path))
        self.address = ctypes.cast(self.library.tvm_deform_parallel_launch, ctypes.c_void_p).value
        self.library.tvm_deform_launcher_threads.restype = ctypes.c_int

    def threads(self) -> int:
        """The task count a launch with ``num_task`` 0 gets (torch's thread count)."""
        return int(self.library.tvm_deform_launcher_threads())


#: why the launcher is not in use, when it is not (for ``tvm-deform info``)
unavailable_reason: str | None = None
_lock = threading.Lock()


def enabled() -> bool:
    """True when kernels are to run on torch's threads (``TVM_DEFORM_LAUNCHER``, default on)
    and the launcher could be built."""
    return env.launcher_enabled() and get() is not None


def prepare() -> None:
    """Start building the launcher on a thread of its own when it is wanted and not built yet,
    so that a first call's kernel compiles meanwhile (the build takes about a second)."""
    if env.launcher_enabled() and _get.cache_info().currsize == 0 and not _lock.locked():
        threading.Thread(target=get, name="tvm_deform launcher build", daemon=True).start()


def get() -> Launcher | None:
    """The launcher, built on first use; None (with one warning) when it cannot be built."""
    with _lock:
        return _get()


@functools.cache
def _get() -> Launcher | None:
    global unavailable_reason
    try:
        return Launcher(_build())
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        unavailable_reason = str(error)
        warnings.warn(
            "tvm_deform: the kernels run on TVM's own thread pool, beside torch's, which slows "
            f"both when they alternate; the launcher on torch's threads could not be built: "
            f"{error}",
            RuntimeWarning,
            stacklevel=4,
        )
        return None


def _torch_openmp_runtime() -> str | None:
    """The OpenMP runtime library this process loaded for torch (None if none is loaded)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        name = os.path.basename(path)
        if name.startswith(("libgomp", "libiomp5", "libomp")) and ".so" in name:
            return path
    bundled = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    return str(bundled) if bundled.exists() else None


def _compile_commands(output: Path) -> list[list[str]]:
    """The compile and the link command of the launcher library."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH; set CXX)")
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    openmp = "OpenMP" in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]
    obj = output.with_suffix(".o")
    compile_ = [compiler, "-O2", "-std=c++17", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    # ATen's header-only parallel_for runs serially unless compiled with OpenMP.
    compile_ += ["-fopenmp"] if openmp else []
    compile_ += [f"-I{torch_dir / 'include'}", "-c", str(SOURCE), "-o", str(obj)]
    link = [compiler, "-shared", str(obj), "-o", str(output), f"-L{torch_dir / 'lib'}"]
    link += [f"-Wl,-rpath,{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10"]
    if openmp:
        runtime = _torch_openmp_runtime()
        if runtime is None:
            raise RuntimeError("torch uses OpenMP but its OpenMP runtime library was not found")
        # Linked by path, not with -fopenmp (the system's libgomp): one OpenMP runtime.
        link.append(runtime)
    return [compile_, link]


def _build() -> Path:
    return build_library(SOURCE, _compile_commands)


def build_library(source_path: Path, commands: Callable[[Path], list[list[str]]]) -> Path:
    """The shared library built from the C++ file ``source_path`` by ``commands(output)``, once
    per source and torch installation, kept in the kernel cache directory."""
    source = source_path.read_bytes()
    torch_dir = str(Path(torch.__file__).parent)
    key = "\n".join((torch.__version__, torch_dir, os.environ.get("CXX", "")))
    digest = hashlib.sha256(source + key.encode()).hexdigest()[:16]
    # Beside the kernels, in a folder of its own (the kernel files are the cache's top level).
    directory = diskcache.subdirectory("launcher") or Path(tempfile.mkdtemp())
    path = directory / f"{source_path.stem}-{digest}.so"
    if diskcache.verified(path):
        return path
    directory.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
    os.close(handle)
    try:
        for command in commands(Path(temporary)):
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                raise RuntimeError(f"building {source_path.name} failed:\n{result.stderr[-2000:]}")
        os.replace(temporary, path)
        diskcache.seal(path)
    finally:
        for leftover in (temporary, str(Path(temporary).with_suffix(".o"))):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return path


def attach(library_path: str | os.PathLike) -> bool:
    """Point the parallel launch of the kernel library at ``library_path`` (already loaded by
    TVM from that file) at the launcher. Returns False, changing nothing, when the launcher is
    off or unavailable or the library uses TVM's barrier; True also for a library without
    parallel loops (nothing to redirect)."""
    launcher = get() if env.launcher_enabled() else None
    if launcher is None:
        return False
    # dlopen of a file already loaded returns the same handle, hence TVM's copy of the variable.
    library = ctypes.CDLL(str(library_path))
    if has_symbol(library, BARRIER_SYMBOL):
        return False
    if has_symbol(library, LAUNCH_SYMBOL):
        ctypes.c_void_p.in_dll(library, LAUNCH_SYMBOL).value = launcher.address
    return True


def launch_target(library_path: str | os.PathLike) -> int | None:
    """The address the library's launch variable holds now (for tests)."""
    library = ctypes.CDLL(str(library_path))
    if not has_symbol(library, LAUNCH_SYMBOL):
        return None
    return ctypes.c_void_p.in_dll(library, LAUNCH_SYMBOL).value


def has_symbol(library: ctypes.CDLL, name: str) -> bool:
    try:
        getattr(library, name)
    except AttributeError:
        return False
    return True
