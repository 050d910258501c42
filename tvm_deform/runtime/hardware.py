"""Hardware detection (build and dispatch layer): what the CPU in front of us really offers.

LLVM names the host CPU (``znver5``) but is not trusted for the vector width: TVM's
``llvm_get_vector_width`` answers 512 bits for every x86 target, AVX2-only ones included, and a
virtual machine may hide instruction sets that its CPU model has. So the vector ISA is read from
the CPU's own feature flags (``/proc/cpuinfo``):

- x86-64: ``avx512f`` -> AVX-512, 512-bit vectors; ``avx2`` with ``fma`` -> AVX2, 256; ``avx`` ->
  256; otherwise SSE, 128.
- aarch64: ``sve`` -> SVE (scheduled as 128-bit NEON vectors: the SVE length is a run-time
  property); ``asimd`` -> NEON, 128.

When the flags lack AVX-512 while LLVM's CPU model has it (a hypervisor masking it), the host
target turns it off explicitly (``mattr=-avx512f``) and its hardware key says so.

The hardware key names the directory of a machine's tuning logs: ``llvm/<LLVM CPU name>``
(``llvm/znver4``), with ``-noavx512`` appended in the masked case; ``cuda/<arch>``. The
compatibility rule: another key's records are *candidates* on this machine when they are for the
same target kind, the same architecture and the same vector ISA (from their manifest). They are
never taken as measured here: :mod:`tvm_deform.runtime.dispatch` times them against the default
schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
from pathlib import Path

#: x86 flag -> (ISA name, vector bits), strongest first; each needs all of its flags
X86_LEVELS = (
    (("avx512f",), "avx512", 512),
    (("avx2", "fma"), "avx2", 256),
    (("avx",), "avx", 256),
)


@dataclasses.dataclass(frozen=True)
class CPU:
    """A CPU as ``/proc/cpuinfo`` and the system describe it."""

    machine: str  # "x86_64", "aarch64"
    model: str
    flags: frozenset[str]
    cores: int
    #: bytes per cache level ("L1d", "L2", "L3") of one core, where known
    caches: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def isa(self) -> str:
        """The widest float SIMD instruction set: avx512, avx2, avx, sse, sve, neon or scalar."""
        return self._vector[0]

    @property
    def vector_bits(self) -> int:
        """Bits of the SIMD registers the schedules plan for."""
        return self._vector[1]

    @property
    def reason(self) -> str:
        """Which flags decided :attr:`isa`, for ``tvm-deform info``."""
        return self._vector[2]

    @property
    def _vector(self) -> tuple[str, int, str]:
        if self.machine in ("x86_64", "amd64", "i686"):
            for needed, isa, bits in X86_LEVELS:
                if all(flag in self.flags for flag in needed):
                    return isa, bits, f"flags {' + '.join(needed)}"
            return "sse", 128, "no avx flag"
        if self.machine in ("aarch64", "arm64"):
            if "sve" in self.flags:
                return "sve", 128, "flag sve (scheduled as 128-bit vectors)"
            if "asimd" in self.flags:
                return "neon", 128, "flag asimd"
        return "scalar", 128, f"no known vector flag on {self.machine}"


def parse_cpuinfo(text: str, machine: str, cores: int | None = None) -> CPU:
    """A :class:`CPU` from the text of ``/proc/cpuinfo`` (x86 ``flags`` or arm ``Features``).
    ``cores`` defaults to the number of processors listed."""
    model, flags, processors = "", frozenset(), 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip().lower(), value.strip()
        if key == "processor":
            processors += 1
        elif key in ("model name", "cpu model") and not model:
            model = value
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
    if not model and "CPU part" in text:
        model = "arm (CPU part " + text.split("CPU part")[1].split(":")[1].split()[0] + ")"
    return CPU(machine, model or "unknown", flags, cores or max(processors, 1))


def _caches() -> dict[str, int]:
    found = {}
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction":
            continue
        name = f"L{level}" + ("d" if kind == "Data" else "")
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        found[name] = int(size.rstrip("KMG")) * scale
    return found


@functools.cache
def detect() -> CPU:
    """This machine's CPU. The core count is the CPUs this process may run on."""
    machine = platform.machine() or "x86_64"
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    cpu = parse_cpuinfo(text, machine, cores)
    if not text and machine in ("arm64", "aarch64"):
        # macOS on Apple silicon: no /proc/cpuinfo, NEON always there.
        cpu = dataclasses.replace(cpu, flags=frozenset({"asimd"}))
    return dataclasses.replace(cpu, caches=_caches())


def generic_llvm_cpu(cpu: CPU) -> tuple[str, list[str]]:
    """``(mcpu, mattr)`` of a target for a CPU described only by its flags (not this host's,
    whose LLVM name is known): the x86-64 micro-architecture level, or a generic aarch64."""
    if cpu.machine in ("aarch64", "arm64"):
        return "generic", ["+neon"] + (["+sve"] if cpu.isa == "sve" else [])
    level = {"avx512": "x86-64-v4", "avx2": "x86-64-v3", "avx": "x86-64-v2"}.get(cpu.isa)
    return level or "x86-64", []


def triple(machine: str, system: str | None = None) -> str:
    system = system or platform.system()
    suffix = {"Linux": "linux-gnu", "Darwin": "apple-darwin"}.get(system, "unknown")
    return f"{'aarch64' if machine == 'arm64' else machine}-{suffix}"
