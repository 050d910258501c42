"""Hardware detection from the CPU's own flags, and the default schedules on each kind of CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from tvm.target import Target
from tvm_deform.schedules.common import vector_bytes

from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import hardware, kernels, targets

# Trimmed from real /proc/cpuinfo files: an AVX2-only Zen 1, an AVX-512 Zen 4, a Neoverse V2.
ZEN1 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model name\t: AMD EPYC 7551 32-Core Processor
flags\t\t: fpu vme de pse sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes avx f16c avx2 bmi2
processor\t: 1
model name\t: AMD EPYC 7551 32-Core Processor
flags\t\t: fpu vme de pse sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes avx f16c avx2 bmi2
"""
ZEN4 = """processor\t: 0
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse sse2 ssse3 fma sse4_2 avx f16c avx2 avx512f avx512dq avx512bw avx512vl
"""
NEOVERSE_V2 = """processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid sve sve2
CPU implementer\t: 0x41
CPU part\t: 0xd4f

processor\t: 1
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid sve sve2
CPU part\t: 0xd4f
"""
CORTEX_A72 = """processor\t: 0
Features\t: fp asimd evtstrm crc32 cpuid
CPU part\t: 0xd08
"""


@pytest.mark.parametrize(
    "text, machine, isa, bits, cores",
    [
        (ZEN1, "x86_64", "avx2", 256, 2),
        (ZEN4, "x86_64", "avx512", 512, 1),
        (NEOVERSE_V2, "aarch64", "sve", 128, 2),
        (CORTEX_A72, "aarch64", "neon", 128, 1),
        ("processor\t: 0\nflags\t: fpu sse sse2\n", "x86_64", "sse", 128, 1),
    ],
)
def test_cpuinfo_parsing(text, machine, isa, bits, cores):
    cpu = hardware.parse_cpuinfo(text, machine)
    assert (cpu.isa, cpu.vector_bits, cpu.cores) == (isa, bits, cores)
    assert cpu.reason


def test_zen1_model_and_flags():
    cpu = hardware.parse_cpuinfo(ZEN1, "x86_64")
    assert cpu.model == "AMD EPYC 7551 32-Core Processor"
    assert "avx512f" not in cpu.flags and "avx2" in cpu.flags


def test_this_host_agrees_with_proc_cpuinfo():
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if not text:
        pytest.skip("no /proc/cpuinfo")
    cpu = hardware.detect()
    flags = hardware.parse_cpuinfo(text, cpu.machine).flags
    assert cpu.flags == flags
    if cpu.machine == "x86_64":
        assert (cpu.vector_bits == 512) == ("avx512f" in flags)
        assert vector_bytes(targets.host_target()) * 8 == cpu.vector_bits


def test_masked_avx512_is_turned_off_and_named():
    # A CPU model with AVX-512 whose flags (a hypervisor) hide it.
    target = Target(
        {"kind": "llvm", "mcpu": "znver4", "mattr": ["-avx512f"], "mtriple": "x86_64-linux-gnu"}
    )
    assert vector_bytes(target) == 32
    assert targets.hardware_key(target) == "llvm/znver4-noavx512"
    plain = Target({"kind": "llvm", "mcpu": "znver4", "mtriple": "x86_64-linux-gnu"})
    assert vector_bytes(plain) == 64
    assert targets.hardware_key(plain) == "llvm/znver4"


def test_llvm_vector_width_query_is_not_used():
    """The reason for reading flags: LLVM's own answer ignores the target's ISA."""
    zen1 = Target({"kind": "llvm", "mcpu": "znver1", "mtriple": "x86_64-linux-gnu"})
    assert vector_bytes(zen1) == 32


SHAPES = [
    ConvShape(1, 12, 9, 10, 8, 3, 3, pad_h=1, pad_w=1, has_bias=True),
    ConvShape(1, 16, 9, 10, 16, 3, 3, pad_h=1, pad_w=1, weight_groups=16),
    # the output-channel structure (a small weight, 576 output pixels)
    ConvShape(1, 16, 24, 24, 32, 3, 3, pad_h=1, pad_w=1),
]
#: what the machine code of each kind of CPU must use: its own vector registers
REGISTERS = {"avx2": "ymm", "avx512": "zmm", "sve": "v0.4s", "neon": "v0.4s"}


@pytest.mark.parametrize(
    "text, machine",
    [(ZEN1, "x86_64"), (ZEN4, "x86_64"), (NEOVERSE_V2, "aarch64"), (CORTEX_A72, "aarch64")],
)
@pytest.mark.parametrize("shape", SHAPES, ids=["dense", "depthwise", "output_channels"])
def test_default_schedules_build_for_each_cpu(text, machine, shape):
    cpu = hardware.parse_cpuinfo(text, machine)
    target = targets.cpu_target(cpu)
    forward = kernels.compile_kernel(shape, target).mod.inspect_source("asm")
    kernels.compile_backward(shape, target)
    assert REGISTERS[cpu.isa] in forward
    if shape == SHAPES[2]:
        assert "weight_global" in kernels.default_schedule(shape, target).mod.script()
    if cpu.isa == "avx2":
        assert "zmm" not in forward  # no AVX-512 instruction on an AVX2-only CPU
