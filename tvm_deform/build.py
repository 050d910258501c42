"""Build and dispatch: targets, workload keys, compilation and the kernel caches.

A kernel is compiled the first time a shape is seen, exported as a shared library into the
on-disk cache so the next process loads it instead of compiling, loaded from that file (so that
its parallel loops can run on torch's threads, see :mod:`tvm_deform.launcher`) and kept in memory
for the process. The disk cache key covers the workload, the target, the TVM and package
versions, the thread pool and a digest of the definition and schedule sources, so a change to
any of them misses the cache instead of loading a stale kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import os
import shutil
import struct
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

# TVM's thread variables are set by tvm_deform.env, which the package's __init__ imports before
# any module that imports TVM.
import tvm
from tvm import s_tir
from tvm.target import Target, codegen

from . import __version__, definition, env, hardware, launcher, logs
from .definition import ConvShape
from .schedules.cpu import DefaultCPU
from .schedules.cpu_backward import DefaultCPUBackward, DefaultCPUGradInput
from .schedules.cuda import DefaultCUDA

Kernel = Callable[..., None]


class BackwardKernels(NamedTuple):
    """The two compiled backward kernels of one shape, run in this order."""

    #: ``deform_conv2d_backward``: every gradient asked for but the input's, and the workspaces
    gradients: Kernel
    #: ``deform_conv2d_grad_input``: the input's gradient, from those workspaces (None when the
    #: input's gradient is not asked for)
    grad_input: Kernel | None


@functools.cache
def host_cpu() -> str:
    """The LLVM name of this machine's CPU, e.g. ``znver4``."""
    return str(codegen.llvm_get_system_cpu())


@functools.cache
def host_target() -> Target:
    """The LLVM target of this machine.

    ``mcpu`` is LLVM's name of the CPU; ``mattr`` turns AVX-512 off when the CPU's own flags
    lack it although that CPU model has it (see :mod:`tvm_deform.hardware`); ``mtriple`` is the
    host's (the TVM wheel's own default triple is its build machine's and makes LLVM reject
    ``-mcpu=native``); ``num-cores`` is the number of cores this process may use, which
    MetaSchedule needs.
    """
    cpu = hardware.detect()
    attrs = {"kind": "llvm", "mcpu": host_cpu(), "mtriple": hardware.triple(cpu.machine)}
    if cpu.machine == "x86_64" and cpu.isa != "avx512":
        if codegen.target_has_features("avx512f", Target(attrs)):
            attrs["mattr"] = ["-avx512f"]
    return Target({**attrs, "num-cores": cpu.cores})


def cpu_target(cpu: hardware.CPU) -> Target:
    """An LLVM target for a CPU known only by its flags (another machine's, for
    cross-compiling): its architecture's generic model at the CPU's vector ISA."""
    mcpu, mattr = hardware.generic_llvm_cpu(cpu)
    attrs = {"kind": "llvm", "mcpu": mcpu, "mtriple": hardware.triple(cpu.machine, "Linux")}
    return Target({**attrs, **({"mattr": mattr} if mattr else {}), "num-cores": cpu.cores})


#: what every CUDA target of ours declares besides its ``arch``: the limits that hold on every
#: NVIDIA GPU since Volta (MetaSchedule and the schedule's tile choice read them)
CUDA_LIMITS = {
    "max_threads_per_block": 1024,
    "max_shared_memory_per_block": 49152,
    "thread_warp_size": 32,
}


def cuda_target(arch: str) -> Target:
    """The CUDA target of an NVIDIA GPU architecture such as ``sm_90``, with this machine's
    LLVM target as its host."""
    if not (arch.startswith("sm_") and arch[3:].rstrip("a").isdigit()):
        raise ValueError(f"a CUDA architecture looks like 'sm_90', got {arch!r}")
    return Target({"kind": "cuda", "arch": arch, **CUDA_LIMITS, "host": host_target()})


def hardware_key(target: Target) -> str:
    """Directory name of ``target``'s tuning logs, e.g. ``llvm/znver4`` or ``cuda/sm_90``."""
    attrs = target.attrs
    kind = target.kind.name
    if kind == "llvm":
        masked = "-avx512f" in [str(a) for a in attrs.get("mattr", [])]
        return f"llvm/{attrs.get('mcpu', 'generic')}" + ("-noavx512" if masked else "")
    if kind == "cuda":
        return f"cuda/{attrs.get('arch', 'unknown')}"
    return kind


def workload_key(shape: ConvShape, target: Target) -> str:
    """A stable text naming one compiled kernel: every shape parameter, the dtype and target."""
    fields = dataclasses.asdict(shape)
    fields["target"] = json.loads(json.dumps(dict(target.attrs), default=str)) | {
        "kind": target.kind.name
    }
    return json.dumps(fields, sort_keys=True)


@functools.cache
def source_digest() -> str:
    """Digest of the sources that decide what a kernel computes and how it is scheduled."""
    digest = hashlib.sha256()
    for source in (definition, DefaultCPU, DefaultCPUBackward, DefaultCUDA):
        digest.update(Path(inspect.getfile(source)).read_bytes())
    return digest.hexdigest()[:16]


def cache_path(
    shape: ConvShape, target: Target, schedule: str = "default", op: str = "forward"
) -> Path:
    """Where the on-disk cache keeps the ``op`` ("forward" or "backward") kernel of ``shape``
    for ``target``, compiled with ``schedule`` ("default", or a tuned record's identity)."""
    # Kernels on TVM's pool and on torch's threads are separate files: a file loaded twice is one
    # library with one launch variable, which the two would otherwise fight over.
    pool = "torch" if target.kind.name == "llvm" and launcher.enabled() else "tvm"
    text = "\n".join(
        (
            workload_key(shape, target),
            schedule,
            tvm.__version__,
            __version__,
            source_digest(),
            f"pool {pool}",
        )
    )
    if op != "forward":
        text += f"\n{op}"
    name = hashlib.sha256(text.encode()).hexdigest()[:32]
    prefix = "deform_conv2d" if op == "forward" else f"deform_conv2d_{op}"
    return env.cache_dir() / f"{prefix}-{name}.so"


def resolve(
    shape: ConvShape, target: Target, tuned: bool | None = None, op: str = "forward"
) -> logs.TunedRecord | None:
    """The tuned record ``shape``'s ``op`` runs with on ``target``, or None for the default
    schedule. ``tuned=None`` follows ``TVM_DEFORM_TUNED``; False always means the default.

    The logs of ``target``'s own hardware key decide: by the choice timed through the op at
    tuning time when they hold one, else by the tuner's measurements. Without them,
    the records of compatible machines are timed here against the default schedule (once per
    shape; the decision is kept on disk, see :mod:`tvm_deform.dispatch`), unless
    ``TVM_DEFORM_MEASURE=0``, which then runs the default."""
    if not (env.tuned_enabled() if tuned is None else tuned):
        return None
    key = hardware_key(target)
    from . import dispatch  # times kernels through the op, which imports this module

    own = logs.own_records(shape, target, key, op)
    if own:
        return dispatch.choose_own(shape, op, own)
    candidates = logs.foreign_records(shape, target, key, op)
    if not candidates or not env.measure_enabled():
        return None
    return dispatch.pick(shape, target, op, candidates)


def target_isa(target: Target) -> str:
    """The vector ISA an LLVM ``target`` compiles for (avx512, avx2, avx, sse, sve, neon)."""
    triple = str(target.attrs.get("mtriple", "x86_64"))
    if triple.startswith(("aarch64", "arm64")):
        return "sve" if codegen.target_has_features("sve", target) else "neon"
    for feature, isa in (("avx512f", "avx512"), ("avx2", "avx2"), ("avx", "avx")):
        if codegen.target_has_features(feature, target):
            return isa
    return "sse"


def default_schedule(
    shape: ConvShape,
    target: Target,
    op: str = "forward",
    gradients: definition.Gradients = definition.ALL_GRADIENTS,
    layout: str = "NCHW",
) -> s_tir.Schedule:
    """``shape``'s ``op`` PrimFunc ("forward" with its input in ``layout``, or "backward": the
    gradients kernel, computing ``gradients``) under the default schedule of ``target``'s
    kind."""
    if op == "forward":
        if layout != "NCHW" and target.kind.name == "cuda":
            raise NotImplementedError(f"no CUDA schedule for {layout} input")
        rule = DefaultCUDA() if target.kind.name == "cuda" else DefaultCPU()
        func = definition.forward(shape, layout)
    elif op == "backward" and target.kind.name != "cuda":
        rule, func = DefaultCPUBackward(), definition.backward(shape, gradients)
    else:
        raise NotImplementedError(f"no default {op} schedule for {target.kind.name}")
    sch = rule.apply(func, target)
    if sch is None:
        raise RuntimeError(f"no {op} schedule applies to {shape}")
    return sch


def compile_kernel(
    shape: ConvShape,
    target: Target,
    record: logs.TunedRecord | None = None,
    layout: str = "NCHW",
) -> tvm.runtime.Module:
    """Compile the forward kernel of ``shape`` for ``target`` and an input in ``layout``: with
    ``record``'s tuned schedule when given (records are of NCHW kernels), else with the
    default schedule."""
    if record is not None:
        if layout != "NCHW":
            raise ValueError("tuned records are of kernels that take an NCHW input")
        sch = logs.tuned_schedule(shape, record)
    else:
        sch = default_schedule(shape, target, layout=layout)
    if target.kind.name == "cuda":
        # Registers TVM's CUDA compiler callback (NVRTC, or nvcc with TVM_CUDA_COMPILE_MODE).
        importlib.import_module("tvm.support.nvcc")
    with target:
        return tvm.compile(sch.mod, target=target)


def cuda_source(shape: ConvShape, arch: str, record: logs.TunedRecord | None = None) -> str:
    """The CUDA C source of ``shape``'s forward kernels for ``arch`` (default schedule, or
    ``record``'s), as TVM generates it; needs no GPU."""
    # Built without the CUDA runtime, the device module keeps its source (format "cuda").
    built = compile_kernel(shape, cuda_target(arch), record)
    sources = [m.inspect_source("cuda") for m in built.mod.imports if m.kind == "cuda"]
    if not any(sources):
        raise RuntimeError(f"TVM produced no CUDA source for {shape} on {arch}")
    return "\n".join(sources)


@dataclasses.dataclass(frozen=True)
class CudaBuild:
    """Machine code built by nvcc from a generated CUDA source, and what ptxas reported."""

    arch: str
    cubin: bytes
    #: kernel name -> ptxas's resource line ("Used 40 registers, used 1 barriers, ...")
    kernels: dict[str, str]

    @property
    def machine_arch(self) -> int:
        """The SM version the cubin's machine code is for, from its ELF header (90 for sm_90)."""
        if self.cubin[:4] != b"\x7fELF":
            raise ValueError("not an ELF cubin")
        (flags,) = struct.unpack_from("<I", self.cubin, 48)
        return (flags >> 8) & 0xFF


def nvcc_build(source: str, arch: str, nvcc: str = "nvcc") -> CudaBuild:
    """Compile ``source`` for ``arch`` with the installed nvcc into a cubin (``-O3``), keeping
    ptxas's per-kernel report. Raises RuntimeError with nvcc's messages when it fails."""
    import re
    import subprocess

    with tempfile.TemporaryDirectory() as directory:
        cu, cubin = Path(directory) / "kernels.cu", Path(directory) / "kernels.cubin"
        cu.write_text(source)
        result = subprocess.run(
            [nvcc, "--cubin", f"-arch={arch}", "-O3", "-Xptxas=-v", "-o", str(cubin), str(cu)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(f"nvcc failed for {arch}:\n{result.stderr}")
        kernels, current = {}, None
        for line in result.stderr.splitlines():
            entry = re.search(r"Compiling entry function '(\w+)' for '(\w+)'", line)
            if entry:
                current = entry.group(1)
            elif current and "Used" in line:
                kernels[current] = line.split(":", 1)[1].strip()
        return CudaBuild(arch, cubin.read_bytes(), kernels)


def compile_backward(
    shape: ConvShape,
    target: Target,
    record: logs.TunedRecord | None = None,
    gradients: definition.Gradients = definition.ALL_GRADIENTS,
) -> tvm.runtime.Module:
    """Compile the backward kernels of ``shape`` for ``target`` that compute ``gradients``
    into one module: the gradients kernel with ``record``'s tuned schedule when given (records
    are of the kernel computing all gradients), else the default one; the input's scatter
    kernel, when the input's gradient is asked for, with its default schedule."""
    if record is not None:
        if gradients != definition.ALL_GRADIENTS:
            raise ValueError("tuned records are of the backward that computes every gradient")
        sch = logs.tuned_schedule(shape, record, "backward")
    else:
        sch = default_schedule(shape, target, "backward", gradients)
    functions = {
        "deform_conv2d_backward": sch.mod["main"].with_attr(
            "global_symbol", "deform_conv2d_backward"
        )
    }
    if gradients.input:
        scatter = DefaultCPUGradInput().apply(definition.grad_input(shape), target)
        if scatter is None:
            raise RuntimeError(f"no backward schedule applies to {shape}")
        functions["deform_conv2d_grad_input"] = scatter.mod["main"]
    return tvm.compile(tvm.IRModule(functions), target=target)


def _load_cached(path: Path) -> tvm.runtime.Module | None:
    if not path.exists():
        return None
    try:
        return tvm.runtime.load_module(str(path))
    except Exception as error:  # noqa: BLE001 - any unreadable entry is rebuilt
        warnings.warn(f"rebuilding corrupt kernel cache entry {path}: {error}", stacklevel=3)
        path.unlink(missing_ok=True)
        return None


def _store_cached(module: tvm.runtime.Module, path: Path) -> None:
    """Write ``module`` to ``path`` atomically: concurrent writers each rename a whole file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
        os.close(handle)
        try:
            module.export_library(temporary)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    except Exception as error:  # noqa: BLE001 - a cache that cannot be written is not fatal
        warnings.warn(f"could not write kernel cache entry {path}: {error}", stacklevel=3)


_memory: dict[tuple, Kernel | BackwardKernels] = {}
#: guards ``_memory`` and ``_loading``; held only for dictionary updates, never while compiling
_lock = threading.Lock()
#: one lock per kernel being loaded: threads that need the same new kernel wait for one compile,
#: threads that need other kernels do not wait at all
_loading: dict[tuple, threading.Lock] = {}


def get_kernel(
    shape: ConvShape,
    target: Target | None = None,
    tuned: bool | None = None,
    layout: str = "NCHW",
) -> Kernel:
    """The compiled forward kernel of ``shape`` for an input in ``layout``: from memory, from
    disk, or freshly compiled. An NCHW kernel runs with the tuned schedule the logs hold for it,
    else the default one (``tuned`` as in :func:`resolve`); an NHWC kernel (channels_last input,
    CPU) runs its default schedule, which samples the input in place."""
    target = target or host_target()
    tuned = env.tuned_enabled() if tuned is None else tuned

    def load() -> Kernel:
        if layout != "NCHW":
            return load_kernel(shape, target, None, layout)
        return load_kernel(shape, target, resolve(shape, target, tuned))

    # The log and pool settings are part of the key, so changing them mid-process takes effect.
    key = (
        "forward",
        shape,
        layout,
        str(target),
        tuned,
        env.user_logs_dir(),
        env.launcher_enabled(),
    )
    return _memoised(key, load)


def load_kernel(
    shape: ConvShape,
    target: Target,
    record: logs.TunedRecord | None = None,
    layout: str = "NCHW",
) -> Kernel:
    """The forward kernel of ``shape`` for an input in ``layout``, with ``record``'s schedule
    (None: the default), through the disk cache, not memoised (benchmarks use it to run
    schedules dispatch would not pick)."""
    schedule = "default" if record is None else record.identity
    op = "forward" if layout == "NCHW" else f"forward_{layout.lower()}"
    module = _load_module(
        cache_path(shape, target, schedule, op=op),
        lambda: compile_kernel(shape, target, record, layout),
    )
    return module["deform_conv2d"]


def get_backward(
    shape: ConvShape,
    target: Target | None = None,
    tuned: bool | None = None,
    gradients: definition.Gradients = definition.ALL_GRADIENTS,
) -> BackwardKernels:
    """The compiled backward kernels of ``shape`` that compute ``gradients``, looked up and
    cached like :func:`get_kernel`'s. The kernel computing all of them runs with the tuned
    schedule the logs hold for it if any; one that leaves gradients out runs its default
    schedule (it skips whole stages, which is worth more than a tuned schedule of them)."""
    target = target or host_target()
    tuned = env.tuned_enabled() if tuned is None else tuned

    def load() -> BackwardKernels:
        if gradients != definition.ALL_GRADIENTS:
            return load_backward(shape, target, None, gradients)
        return load_backward(shape, target, resolve(shape, target, tuned, "backward"))

    key = (
        "backward",
        shape,
        gradients,
        str(target),
        tuned,
        env.user_logs_dir(),
        env.launcher_enabled(),
    )
    return _memoised(key, load)


def load_backward(
    shape: ConvShape,
    target: Target,
    record: logs.TunedRecord | None = None,
    gradients: definition.Gradients = definition.ALL_GRADIENTS,
) -> BackwardKernels:
    """The backward kernels of ``shape`` computing ``gradients``, with ``record``'s schedule for
    the gradients kernel (None: the default), through the disk cache, not memoised."""
    schedule = "default" if record is None else record.identity
    op = "backward" if gradients == definition.ALL_GRADIENTS else f"backward_{gradients.name}"
    module = _load_module(
        cache_path(shape, target, schedule, op=op),
        lambda: compile_backward(shape, target, record, gradients),
    )
    scatter = module["deform_conv2d_grad_input"] if gradients.input else None
    return BackwardKernels(module["deform_conv2d_backward"], scatter)


#: set once a CPU kernel runs on TVM's own thread pool (launcher off or unavailable, or a kernel
#: that could not be loaded from a file): only then does TVM's pool need a thread count
_tvm_pool_in_use = False


def _load_module(
    path: Path, compile_module: Callable[[], tvm.runtime.Module]
) -> tvm.runtime.Module:
    """The kernel library at ``path`` in the disk cache, else ``compile_module()`` exported there
    (or to a private file when the cache is off or cannot be written), loaded from its file with
    its parallel loops attached to torch's threads."""
    global _tvm_pool_in_use
    module = _load_cached(path) if env.cache_enabled() else None
    if module is not None:
        attached = launcher.attach(path)
    else:
        built = compile_module()
        if env.cache_enabled():
            _store_cached(built, path)
            module = _load_cached(path)
        if module is not None:
            attached = launcher.attach(path)
        else:
            module, attached = _load_private(built, path.name)
    if not attached:
        _tvm_pool_in_use = True
    return module


def _load_private(built: tvm.runtime.Module, name: str) -> tuple[tvm.runtime.Module, bool]:
    """``built`` exported to a temporary file, loaded from it and attached to the launcher
    (the file is removed once loaded), and whether it was attached; ``built`` itself, on TVM's
    pool, if it cannot be exported (no compiler to link it)."""
    directory = Path(tempfile.mkdtemp(prefix="tvm_deform-"))
    path = directory / name
    try:
        try:
            built.export_library(str(path))
            module = tvm.runtime.load_module(str(path))
        except Exception as error:  # noqa: BLE001 - e.g. no compiler to link the library
            warnings.warn(
                f"kernel {name} could not be exported ({error}); it runs from memory, on TVM's "
                "thread pool",
                RuntimeWarning,
                stacklevel=4,
            )
            return built, False
        # Attached while the file exists: dlopen finds the loaded library by its path.
        return module, launcher.attach(path)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _memoised(key: tuple, load: Callable):
    found = _memory.get(key)
    if found is not None:
        return found
    with _lock:
        key_lock = _loading.setdefault(key, threading.Lock())
    with key_lock:
        found = _memory.get(key)
        if found is None:
            found = load()
            with _lock:
                _memory[key] = found
                _loading.pop(key, None)
    return found


def clear_memory_cache() -> None:
    """Forget the kernels compiled or loaded by this process (the disk cache stays)."""
    with _lock:
        _memory.clear()


#: TVM's thread pool is per calling thread, and so is the count it was last given
_threads = threading.local()


def configure_threads(count: int) -> None:
    """Make the calling thread's TVM CPU thread pool use ``count`` threads: a no-op when already
    so, or when no kernel runs on TVM's pool (kernels attached to the launcher use torch's
    threads and thread count)."""
    if _tvm_pool_in_use and count != getattr(_threads, "count", 0):
        # Mode 1 ("big cores") with an explicit count: use ``count`` workers of the pool.
        tvm.get_global_func("runtime.config_threadpool")(1, count)
        _threads.count = count
