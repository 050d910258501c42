"""Targets: this machine's CPU and CUDA targets, the hardware key that names a machine's tuning
logs, and the workload key that names one compiled kernel."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from collections.abc import Iterator

# TVM's thread variables are set by tvm_deform.env, which the package's __init__ imports before
# any module that imports TVM.
import tvm
from tvm.target import Target, codegen

from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import hardware
from tvm_deform.schedules.common import facts

__all__ = ["facts", "with_facts"]


@functools.cache
def host_cpu() -> str:
    """The LLVM name of this machine's CPU, e.g. ``znver4``."""
    return str(codegen.llvm_get_system_cpu())


@functools.cache
def host_target() -> Target:
    """The LLVM target of this machine.

    ``mcpu`` is LLVM's name of the CPU; ``mattr`` turns AVX-512 off when the CPU's own flags
    lack it although that CPU model has it (see :mod:`tvm_deform.runtime.hardware`); ``mtriple``
    is the
    host's (the TVM wheel's own default triple is its build machine's and makes LLVM reject
    ``-mcpu=native``); ``num-cores`` is the number of cores this process may use, which
    MetaSchedule needs.
    """
    cpu = hardware.detect()
    attrs = {"kind": "llvm", "mcpu": host_cpu(), "mtriple": hardware.triple(cpu.machine)}
    if cpu.machine == "x86_64" and cpu.isa != "avx512":
        if codegen.target_has_features("avx512f", Target(attrs)):
            attrs["mattr"] = ["-avx512f"]
    caches = {level.lower(): size for level, size in cpu.caches.items()}
    return Target({**attrs, "num-cores": cpu.cores, "keys": with_facts(["cpu"], caches)})


#: LLVM's optimisation level for CPU kernels: 2, where TVM's default is 3. The schedules have
#: already unrolled and vectorised the loops; on the suite layers measured (a 2-core Intel Xeon,
#: ``emeraldrapids``) the kernels ran as fast, with bit-identical results, and compiled 10-15%
#: sooner.
CPU_OPT_LEVEL = 2


@functools.lru_cache(maxsize=64)
def codegen_target(target: Target) -> Target:
    """``target`` as kernels are compiled for it: an LLVM target at :data:`CPU_OPT_LEVEL`
    unless it names a level of its own; any other target as it is."""
    if target.kind.name != "llvm" or "opt-level" in target.attrs:
        return target
    return Target({**target.export(), "opt-level": CPU_OPT_LEVEL})


#: the options of TVM's lowering that CUDA kernels compile with: the copies a schedule
#: pipelines asynchronously become ``cp.async`` (sm_80 and later; a schedule marks them only
#: there); no other kernel's code changes
CUDA_COMPILE_CONFIG = {"tirx.use_async_copy": True}


#: the environment variables that change the machine code TVM's CUDA compile callback
#: (``tvm.support.nvcc``) makes of a kernel's source: the compiler (NVRTC, TVM's default, or
#: nvcc, which :mod:`tvm_deform.env` sets where it is installed: they make other machine code),
#: ptxas's register-usage level (TVM's default 10, where ptxas's own is 5) and other ptxas
#: options, and fast math (always with NVRTC; with nvcc unless turned off)
CUDA_COMPILE_SETTINGS = (
    "TVM_CUDA_COMPILE_MODE",
    "TVM_CUDA_PTXAS_REG_LEVEL",
    "TVM_CUDA_PTXAS_EXTRA_OPTS",
    "TVM_CUDA_NVCC_NO_FAST_MATH",
    "TVM_CUDA_NVRTC_EXTRA_OPTS",
)


def cuda_compile_settings(compiler: str | None = None) -> str:
    """How TVM compiles a CUDA kernel with the environment's :data:`CUDA_COMPILE_SETTINGS` now,
    in words, each with its effect (an unset variable and its default alike), e.g.
    ``"compiler nvcc, ptxas level 10, ptxas options none, fast math on"``; ``compiler`` names
    the compiler instead of ``TVM_CUDA_COMPILE_MODE``."""
    environ = os.environ
    compiler = compiler or (environ.get("TVM_CUDA_COMPILE_MODE") or "nvrtc").lower()
    settings = [
        f"compiler {compiler}",
        f"ptxas level {environ.get('TVM_CUDA_PTXAS_REG_LEVEL') or 10}",
        f"ptxas options {environ.get('TVM_CUDA_PTXAS_EXTRA_OPTS') or 'none'}",
    ]
    if compiler == "nvcc":  # (TVM reads the variable as set when it is not empty)
        settings.append(f"fast math {'off' if environ.get('TVM_CUDA_NVCC_NO_FAST_MATH') else 'on'}")
    else:
        settings.append(f"NVRTC options {environ.get('TVM_CUDA_NVRTC_EXTRA_OPTS') or 'none'}")
    return ", ".join(settings)


def compile_settings(target: Target) -> str:
    """:func:`cuda_compile_settings` for a CUDA ``target``, empty for any other: part of a
    compiled kernel's identity, so that a kernel built at another register-usage level, or by
    the other compiler, is not taken for this one."""
    return cuda_compile_settings() if target.kind.name == "cuda" else ""


def nvcc_options() -> list[str]:
    """The options TVM's CUDA compile callback gives nvcc (``TVM_CUDA_COMPILE_MODE=nvcc``, which
    :mod:`tvm_deform.env` sets where nvcc is installed), with the environment's settings now
    (:data:`CUDA_COMPILE_SETTINGS`): ``-O3``, fast math, and ptxas at register-usage level 10
    with ``-v`` (its report of each kernel's registers, shared memory and spills). An offline
    build with them makes the machine code TVM's nvcc compile makes; NVRTC makes other machine
    code of the same source."""
    # TVM's own list of ptxas options (a private function: kept in step by a test that compares
    # an offline build with TVM's compile).
    from tvm.support import nvcc

    fast_math = [] if os.environ.get("TVM_CUDA_NVCC_NO_FAST_MATH") else ["--use_fast_math"]
    return [
        "-O3",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT162_OPERATORS__",
        "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        *fast_math,
        f"--ptxas-options={','.join(nvcc._ptxas_option_flags())}",
    ]


@contextlib.contextmanager
def compiling(target: Target) -> Iterator[Target]:
    """The context a kernel for ``target`` compiles in: :func:`codegen_target`'s target
    entered, and on CUDA the current pass context with :data:`CUDA_COMPILE_CONFIG` added (its
    optimisation level, passes, instruments and other options kept). Yields the target to
    compile for."""
    target = codegen_target(target)
    if target.kind.name != "cuda":
        with target:
            yield target
        return
    current = tvm.transform.PassContext.current()
    context = tvm.transform.PassContext(
        opt_level=current.opt_level,
        required_pass=list(current.required_pass),
        disabled_pass=list(current.disabled_pass),
        instruments=list(current.instruments),
        config={**current.config, **CUDA_COMPILE_CONFIG},
    )
    with context, target:
        yield target


def with_facts(keys: list[str], values: dict[str, int]) -> list[str]:
    """``keys`` with the hardware facts ``values`` added as ``name=value`` entries.

    TVM's targets have no attribute for a CPU's cache sizes or a GPU's multiprocessor count,
    which the schedules may size their tiles and grids by: a target carries them as entries of
    its ``keys``, so that they enter :func:`workload_key` and the kernel cache's digest. Read
    them back with :func:`facts`."""
    return [*keys, *(f"{name}={value}" for name, value in sorted(values.items()))]


def cpu_target(cpu: hardware.CPU) -> Target:
    """An LLVM target for a CPU known only by its flags (another machine's, for
    cross-compiling): its architecture's generic model at the CPU's vector ISA."""
    mcpu, mattr = hardware.generic_llvm_cpu(cpu)
    attrs = {"kind": "llvm", "mcpu": mcpu, "mtriple": hardware.triple(cpu.machine, "Linux")}
    caches = {level.lower(): size for level, size in cpu.caches.items()}
    return Target(
        {
            **attrs,
            **({"mattr": mattr} if mattr else {}),
            "num-cores": cpu.cores,
            "keys": with_facts(["cpu"], caches),
        }
    )


def avx2_target() -> Target:
    """The LLVM target an AVX2-only x86-64 CPU of this machine's cores and caches gets
    (``x86-64-v3``: 8 float32 lanes, 16 vector registers): to build that code path here and,
    on a CPU with AVX2 or more, run it."""
    host = hardware.detect()
    flags = frozenset({"avx", "avx2", "fma"})
    return cpu_target(hardware.CPU("x86_64", "avx2", flags, host.cores, host.caches))


#: what every CUDA target of ours declares besides its ``arch``: the limits that hold on every
#: NVIDIA GPU since Volta (MetaSchedule and the schedule's tile choice read them)
CUDA_LIMITS = {
    "max_threads_per_block": 1024,
    "max_shared_memory_per_block": 49152,
    "thread_warp_size": 32,
}


def cuda_target(
    arch: str, multiprocessors: int | None = None, l2_cache_bytes: int | None = None
) -> Target:
    """The CUDA target of an NVIDIA GPU architecture such as ``sm_90``, with this machine's
    LLVM target as its host; a GPU's multiprocessor count and L2 cache size where known (a
    kernel built for the architecture alone runs on every GPU of it)."""
    if not (arch.startswith("sm_") and arch[3:].rstrip("a").isdigit()):
        raise ValueError(f"a CUDA architecture looks like 'sm_90', got {arch!r}")
    attrs = {"kind": "cuda", "arch": arch, **CUDA_LIMITS, "host": host_target()}
    if l2_cache_bytes:
        attrs["l2_cache_size_bytes"] = l2_cache_bytes
    known = {"multiprocessors": multiprocessors} if multiprocessors else {}
    return Target({**attrs, "keys": with_facts(["cuda", "gpu"], known)})


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
        "kind": target.kind.name,
        "keys": [str(key) for key in target.keys],
    }
    return json.dumps(fields, sort_keys=True)


def target_isa(target: Target) -> str:
    """The vector ISA an LLVM ``target`` compiles for (avx512, avx2, avx, sse, sve, neon)."""
    triple = str(target.attrs.get("mtriple", "x86_64"))
    if triple.startswith(("aarch64", "arm64")):
        return "sve" if codegen.target_has_features("sve", target) else "neon"
    for feature, isa in (("avx512f", "avx512"), ("avx2", "avx2"), ("avx", "avx")):
        if codegen.target_has_features(feature, target):
            return isa
    return "sse"
