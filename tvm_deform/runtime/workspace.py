"""CUDA workspaces from torch's caching allocator.

A kernel library exported by TVM allocates the scratch buffers its CUDA kernels share (the
sampling geometry, written by one kernel and read by the next) through two function-pointer
variables, ``__TVMBackendAllocWorkspace`` and ``__TVMBackendFreeWorkspace``, which TVM's loader
points at TVM's per-thread workspace pool. That pool is ordered on no stream, frees and
re-allocates (synchronising the device) when a larger call comes, and breaks CUDA graph capture.

:func:`attach` points those variables of a loaded CUDA kernel library at two small C++ functions
(``workspace.cc``) that take CUDA workspaces from torch's caching allocator on the current
stream of their device, as torch's own ops do: stream-ordered, reused without synchronising,
and served from the capture's private pool while a CUDA graph is captured. Workspaces of other
devices (none, in our kernels) still go to TVM's functions.

The library is compiled once per torch installation with the C++ compiler (``CXX``), torch's
headers and the CUDA runtime headers (from the ``nvidia`` wheels torch depends on and
``CUDA_HOME``), and linked against torch's ``libc10_cuda``. Where torch has no CUDA, or nothing
can build it, CUDA kernels keep TVM's pool (with one warning), and ``tvm-deform info`` says so.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import torch

from tvm_deform.runtime import launcher

SOURCE = Path(__file__).with_name("workspace.cc")
ALLOC_SYMBOL = "__TVMBackendAllocWorkspace"
FREE_SYMBOL = "__TVMBackendFreeWorkspace"

#: why torch's allocator is not in use for CUDA workspaces, when it is not
unavailable_reason: str | None = None
_lock = threading.Lock()


class Allocator:
    """The loaded workspace library."""

    def __init__(self, path: Path):
        self.path = path
        self.library = ctypes.CDLL(str(path))
        self.alloc = ctypes.cast(self.library.tvm_deform_alloc_workspace, ctypes.c_void_p).value
        self.free = ctypes.cast(self.library.tvm_deform_free_workspace, ctypes.c_void_p).value
        self.fallback_set = False


def get() -> Allocator | None:
    """The workspace library, built on first use; None (with one warning) when it cannot be."""
    with _lock:
        return _get()


@functools.cache
def _get() -> Allocator | None:
    global unavailable_reason
    try:
        if torch.version.cuda is None:
            raise RuntimeError("this torch has no CUDA")
        return Allocator(launcher.build_library(SOURCE, _compile_commands))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        unavailable_reason = str(error)
        warnings.warn(
            "tvm_deform: CUDA kernels take their workspaces from TVM's pool (not stream-"
            f"ordered, not usable under CUDA graph capture): {error}",
            RuntimeWarning,
            stacklevel=4,
        )
        return None


def cuda_include_dirs() -> list[Path]:
    """The folders holding CUDA runtime headers: the ``nvidia`` wheels' include folders, then
    ``CUDA_HOME``'s (or ``CUDA_PATH``'s, or ``/usr/local/cuda``'s); all are searched, as the
    wheels lack some headers (``crt/``) that the toolkit has."""
    candidates = []
    try:
        import nvidia

        for root in nvidia.__path__:
            candidates += sorted(Path(root).glob("*/include"))
    except ImportError:
        pass
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidates.append(Path(home) / "include")
    return [d for d in candidates if (d / "cuda_runtime_api.h").exists()]


def _compile_commands(output: Path) -> list[list[str]]:
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH; set CXX)")
    includes = cuda_include_dirs()
    if not includes:
        raise RuntimeError("no CUDA runtime headers (cuda_runtime_api.h) found")
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    obj = output.with_suffix(".o")
    compile_ = [compiler, "-O2", "-std=c++20", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    compile_ += [f"-I{torch_dir / 'include'}", *(f"-I{d}" for d in includes), "-c", str(SOURCE)]
    compile_ += ["-o", str(obj)]
    link = [compiler, "-shared", str(obj), "-o", str(output), f"-L{torch_dir / 'lib'}"]
    link += [f"-Wl,-rpath,{torch_dir / 'lib'}", "-lc10_cuda", "-lc10"]
    return [compile_, link]


def attach(library_path: str | os.PathLike) -> bool:
    """Point the workspace functions of the CUDA kernel library at ``library_path`` (already
    loaded by TVM from that file) at torch's caching allocator. Returns whether its
    workspaces now come from torch (True also for a library that allocates none)."""
    allocator = get()
    if allocator is None:
        return False
    library = ctypes.CDLL(str(library_path))
    if not launcher.has_symbol(library, ALLOC_SYMBOL):
        return True
    alloc = ctypes.c_void_p.in_dll(library, ALLOC_SYMBOL)
    free = ctypes.c_void_p.in_dll(library, FREE_SYMBOL)
    with _lock:
        if not allocator.fallback_set and alloc.value not in (None, allocator.alloc):
            # TVM's own functions (the same in every library TVM loads), for other devices.
            allocator.library.tvm_deform_workspace_fallback(
                ctypes.c_void_p(alloc.value), ctypes.c_void_p(free.value)
            )
            allocator.fallback_set = True
    alloc.value = allocator.alloc
    free.value = allocator.free
    return True


def workspace_functions(library_path: str | os.PathLike) -> tuple[int | None, int | None]:
    """The addresses the library's workspace variables hold now (for tests)."""
    library = ctypes.CDLL(str(library_path))
    if not launcher.has_symbol(library, ALLOC_SYMBOL):
        return None, None
    return (
        ctypes.c_void_p.in_dll(library, ALLOC_SYMBOL).value,
        ctypes.c_void_p.in_dll(library, FREE_SYMBOL).value,
    )
