"""Offline CUDA builds: the CUDA source of a kernel and its nvcc build with the machine code
checked, for machines without a GPU (the CLI's ``build`` command and the tests)."""

from __future__ import annotations

import dataclasses
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

# TVM's thread variables are set by tvm_deform.env, which the package's __init__ imports before
# any module that imports TVM.
from tvm_deform import schedules
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import records
from tvm_deform.runtime.kernels import compile_kernel, compile_schedule
from tvm_deform.runtime.targets import cuda_target, nvcc_options

if TYPE_CHECKING:
    from tvm import s_tir


def cuda_source(
    shape: ConvShape,
    arch: str,
    record: records.TunedRecord | None = None,
    schedule: s_tir.Schedule | None = None,
) -> str:
    """The CUDA C source of ``shape``'s forward kernels for ``arch`` (default schedule,
    ``record``'s, or ``schedule``), as TVM generates it; needs no GPU."""
    # Built without the CUDA runtime, the device module keeps its source (format "cuda").
    target = cuda_target(arch)
    if schedule is not None:
        built = compile_schedule(schedule, target)
    else:
        built = compile_kernel(shape, target, record)
    sources = [m.inspect_source("cuda") for m in built.mod.imports if m.kind == "cuda"]
    if not any(sources):
        raise RuntimeError(f"TVM produced no CUDA source for {shape} on {arch}")
    return "\n".join(sources)


def any_size_sources(shape: ConvShape, arch: str) -> dict[int, str]:
    """The CUDA C sources of the forward kernels for any size of ``shape``'s layer on ``arch``
    (batch, height and width symbolic), one per size class: the class's fewest pixels -> its
    source (see :func:`tvm_deform.schedules.pixel_classes`)."""
    target = cuda_target(arch)
    return {
        pixels: cuda_source(
            shape, arch, schedule=schedules.forward_schedule(shape, target, min_pixels=pixels)
        )
        for pixels in schedules.pixel_classes(shape, target)
    }


@dataclasses.dataclass(frozen=True)
class KernelUsage:
    """What ptxas reported of one kernel's resources (0 where it reported nothing)."""

    registers: int
    #: bytes of static shared memory
    shared: int
    #: bytes of the stack frame in local memory
    stack: int
    #: bytes of registers spilled to local memory
    spill_stores: int
    spill_loads: int

    @classmethod
    def from_report(cls, line: str) -> KernelUsage:
        """Read a kernel's resource line (see :attr:`CudaBuild.kernels`)."""
        import re

        def number(pattern: str) -> int:
            found = re.search(pattern, line)
            return int(found.group(1)) if found else 0

        return cls(
            registers=number(r"Used (\d+) registers"),
            shared=number(r"(\d+) bytes smem"),
            stack=number(r"(\d+) bytes stack frame"),
            spill_stores=number(r"(\d+) bytes spill stores"),
            spill_loads=number(r"(\d+) bytes spill loads"),
        )

    @property
    def uses_local_memory(self) -> bool:
        """Whether the kernel spills registers or keeps a stack frame in local memory."""
        return bool(self.stack or self.spill_stores or self.spill_loads)


@dataclasses.dataclass(frozen=True)
class CudaBuild:
    """Machine code built by nvcc from a generated CUDA source, and what ptxas reported."""

    arch: str
    cubin: bytes
    #: kernel name -> ptxas's resource lines ("0 bytes stack frame, 0 bytes spill stores, 0
    #: bytes spill loads; Used 40 registers, used 1 barriers, ...")
    kernels: dict[str, str]

    def usage(self) -> dict[str, KernelUsage]:
        """Each kernel's resources, as ptxas reported them."""
        return {name: KernelUsage.from_report(line) for name, line in self.kernels.items()}

    def spills(self) -> dict[str, str]:
        """The kernels that spill registers to local memory or keep a stack frame there, with
        their resource lines (empty when none does)."""
        usage = self.usage()
        return {name: line for name, line in self.kernels.items() if usage[name].uses_local_memory}

    @property
    def machine_arch(self) -> int:
        """The SM version the cubin's machine code is for, from its ELF header (90 for sm_90)."""
        if self.cubin[:4] != b"\x7fELF":
            raise ValueError("not an ELF cubin")
        (flags,) = struct.unpack_from("<I", self.cubin, 48)
        return (flags >> 8) & 0xFF


def nvcc_build(source: str, arch: str, nvcc: str = "nvcc") -> CudaBuild:
    """Compile ``source`` for ``arch`` with the installed nvcc into a cubin, with the options
    the runtime's compile uses (:func:`~tvm_deform.runtime.targets.nvcc_options`: fast math,
    ptxas's register-usage level), keeping ptxas's per-kernel report. Raises RuntimeError with
    nvcc's messages when it fails."""
    import re
    import subprocess

    with tempfile.TemporaryDirectory() as directory:
        cu, cubin = Path(directory) / "kernels.cu", Path(directory) / "kernels.cubin"
        cu.write_text(source)
        result = subprocess.run(
            [nvcc, "--cubin", f"-arch={arch}", *nvcc_options(), "-o", str(cubin), str(cu)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(f"nvcc failed for {arch}:\n{result.stderr}")
        kernels, frames, current = {}, {}, None
        for line in result.stderr.splitlines():
            entry = re.search(r"Compiling entry function '(\w+)' for '(\w+)'", line)
            if entry:
                current = entry.group(1)
            elif current and "bytes stack frame" in line:
                frames[current] = line.strip()
            elif current and "Used" in line:
                used = line.split(":", 1)[1].strip()
                kernels[current] = f"{frames[current]}; {used}" if current in frames else used
        return CudaBuild(arch, cubin.read_bytes(), kernels)


def nvcc_ptx(source: str, arch: str, nvcc: str = "nvcc") -> str:
    """The PTX that nvcc makes of ``source`` for ``arch`` (the runtime's options, as
    :func:`nvcc_build`): what the kernels ask of the hardware, tensor-core instructions
    (``wmma.mma.sync``) included. Raises RuntimeError with nvcc's messages when it fails."""
    import subprocess

    with tempfile.TemporaryDirectory() as directory:
        cu, ptx = Path(directory) / "kernels.cu", Path(directory) / "kernels.ptx"
        cu.write_text(source)
        result = subprocess.run(
            [nvcc, "--ptx", f"-arch={arch}", *nvcc_options(), "-o", str(ptx), str(cu)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(f"nvcc failed for {arch}:\n{result.stderr}")
        return ptx.read_text()
