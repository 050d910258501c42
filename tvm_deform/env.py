"""Every environment variable the package reads, declared in one place.

Import this module before TVM: it sets two of TVM's own variables (unless the user set them) that
must be in place before TVM's CPU thread pool starts, and a third that chooses TVM's CUDA compiler.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

#: TVM's thread pool (used only when the launcher on torch's threads is off or unavailable, see
#: ``launcher``) is created with ``TVM_NUM_THREADS`` workers, capped by default at half the
#: logical cores (one thread on a 2-core machine). We let it hold every core and choose how many
#: it uses per call (torch's thread count, see ``kernels.configure_threads``).
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))
#: By default TVM pins its workers and the calling thread to cores; the calling thread is torch's
#: main thread, whose own workers then inherit a one-core affinity and slow every torch op after
#: our first call. ``TVM_BIND_THREADS=0`` turns the pinning off.
os.environ.setdefault("TVM_BIND_THREADS", "0")
#: TVM compiles CUDA kernels with NVRTC unless ``TVM_CUDA_COMPILE_MODE=nvcc``, and the two make
#: other machine code of the same source (on sm_90 the demo layer's default GEMM takes 96
#: registers with NVRTC, 80 with nvcc). Where nvcc is installed the kernels compile with it, as
#: the offline builds (``tvm-deform build``, the tuning rounds' candidates) and the GPU runs that
#: checked and timed the kernels do.
if "TVM_CUDA_COMPILE_MODE" not in os.environ and shutil.which("nvcc"):
    os.environ["TVM_CUDA_COMPILE_MODE"] = "nvcc"


class Snapshot:
    """Reads a fixed set of variables as often as a per-call cache key needs them: their values
    as the environment holds them, as a tuple (None for an unset one), changing whenever one
    of them is set or unset through ``os.environ``. On CPython it reads the mapping behind
    ``os.environ`` directly (about 0.3 us for six names on a 2-core Zen 4, where
    ``os.environ.get`` encodes each name and decodes each value, 0.7 us a name); the values
    are then bytes, not str."""

    def __init__(self, *names: str):
        self.names = names
        #: (the os.environ it reads, its mapping's ``get`` or None, the encoded names), set in
        #: one assignment: threads may read it while another binds it
        self._bound: tuple | None = None

    def values(self) -> tuple:
        environ = os.environ
        bound = self._bound
        if bound is None or bound[0] is not environ:  # first use, or os.environ replaced
            bound = self._bound = self._bind(environ)
        _, get, keys = bound
        if get is None:
            return tuple([environ.get(name) for name in self.names])
        return tuple(map(get, keys))

    def _bind(self, environ) -> tuple:
        if type(environ) is getattr(os, "_Environ", None) and isinstance(environ._data, dict):
            return environ, environ._data.get, tuple(map(environ.encodekey, self.names))
        return environ, None, ()  # another mapping, or another Python: through its ``get``


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def cache_enabled() -> bool:
    """``TVM_DEFORM_CACHE=0`` turns the on-disk kernel cache off (the in-memory one stays)."""
    return _flag("TVM_DEFORM_CACHE", True)


def cache_dir() -> Path:
    """``TVM_DEFORM_CACHE_DIR``: where compiled kernels are kept.

    Default: ``$XDG_CACHE_HOME/tvm_deform`` (``~/.cache/tvm_deform``).
    """
    explicit = os.environ.get("TVM_DEFORM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tvm_deform"


#: the default of ``TVM_DEFORM_CACHE_LIMIT``
CACHE_LIMIT_DEFAULT = 1 << 30


def cache_limit_bytes() -> int:
    """``TVM_DEFORM_CACHE_LIMIT``: the most bytes the cached kernels may take (least recently
    used ones are removed beyond it), in bytes or with a K, M or G suffix. Default 1G."""
    value = os.environ.get("TVM_DEFORM_CACHE_LIMIT", "").strip().upper().removesuffix("B")
    if not value:
        return CACHE_LIMIT_DEFAULT
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(value[-1], 1)
    number = value[:-1] if scale != 1 else value
    try:
        return max(0, int(float(number) * scale))
    except ValueError:
        raise ValueError(
            f"TVM_DEFORM_CACHE_LIMIT must be a size such as 500M or 2G, got {value!r}"
        ) from None


def sizes() -> str:
    """``TVM_DEFORM_SIZES``: "any" (default) runs a layer on kernels compiled for every input
    size (with the exceptions ``runtime.kernels.any_size`` names); "static" compiles kernels
    per input size (the path to measure what the generality costs, or to rule it out)."""
    value = os.environ.get("TVM_DEFORM_SIZES", "any").strip().lower() or "any"
    if value not in ("any", "static"):
        raise ValueError(f"TVM_DEFORM_SIZES must be 'any' or 'static', got {value!r}")
    return value


def tuned_enabled() -> bool:
    """``TVM_DEFORM_TUNED=0`` ignores every tuning log: default schedules only (comparisons)."""
    return _flag("TVM_DEFORM_TUNED", True)


def launcher_enabled() -> bool:
    """``TVM_DEFORM_LAUNCHER=0`` runs the CPU kernels on TVM's own thread pool instead of
    torch's intra-op threads (see :mod:`tvm_deform.runtime.launcher`)."""
    return _flag("TVM_DEFORM_LAUNCHER", True)


def measure_enabled() -> bool:
    """``TVM_DEFORM_MEASURE=0``: never time candidate schedules at a shape's first use; without
    tuning logs of this machine's own, the default schedule runs (see
    :mod:`tvm_deform.runtime.dispatch`)."""
    return _flag("TVM_DEFORM_MEASURE", True)


def prepare_backward_enabled() -> bool:
    """``TVM_DEFORM_PREPARE_BACKWARD=0``: a layer's first forward under autograd does not start
    compiling its backward kernels on a thread of their own; they compile when the backward
    runs (see :mod:`tvm_deform.runtime.background`)."""
    return _flag("TVM_DEFORM_PREPARE_BACKWARD", True)


def user_logs_dir() -> Path:
    """``TVM_DEFORM_LOGS``: the user's tuning-log directory (laid out like ``tuning_logs/``),
    searched before the shipped logs; ``tvm-deform tune`` writes there.

    Default: ``$XDG_DATA_HOME/tvm_deform/tuning_logs`` (``~/.local/share/tvm_deform/...``), so
    that tuning never writes into the installed package.
    """
    explicit = os.environ.get("TVM_DEFORM_LOGS")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "tvm_deform" / "tuning_logs"


def user_logs_explicit() -> bool:
    """Whether ``TVM_DEFORM_LOGS`` names the user's log directory (a missing one is then worth a
    warning; the default directory is simply absent until the first tuning run)."""
    return bool(os.environ.get("TVM_DEFORM_LOGS"))


#: name -> one-line description, printed by ``tvm-deform info``
VARIABLES = {
    "TVM_DEFORM_CACHE": "0 turns the on-disk kernel cache off",
    "TVM_DEFORM_CACHE_DIR": "directory of the on-disk kernel cache",
    "TVM_DEFORM_CACHE_LIMIT": "most the cached kernels may take (e.g. 500M, 2G; default 1G)",
    "TVM_DEFORM_LAUNCHER": "0 runs CPU kernels on TVM's thread pool, not torch's threads",
    "TVM_DEFORM_MEASURE": "0: no timing of other machines' records here (default schedule)",
    "TVM_DEFORM_PREPARE_BACKWARD": "0: the backward's CPU kernels compile when it runs, not ahead",
    "TVM_DEFORM_LOGS": "tuning-log directory: `tune` writes there, lookups search it first",
    "TVM_DEFORM_SIZES": "static: a CPU kernel per input size, not one for every size",
    "TVM_DEFORM_TUNED": "0 ignores all tuning logs (default schedules only)",
    "TVM_NUM_THREADS": "size of TVM's CPU thread pool (set to all cores by tvm_deform)",
    "TVM_BIND_THREADS": "1 lets TVM pin threads to cores (tvm_deform sets 0)",
    "TVM_CUDA_COMPILE_MODE": "TVM's CUDA compiler, nvcc or nvrtc (tvm_deform sets nvcc if found)",
}


def variables_markdown() -> str:
    """The table of :data:`VARIABLES` as Markdown (``docs/guide/environment.md`` holds it)."""
    rows = [f"| `{name}` | {text} |" for name, text in VARIABLES.items()]
    return "\n".join(["| variable | what it does |", "|---|---|", *rows]) + "\n"
