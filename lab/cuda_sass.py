"""The machine code of the CUDA forward's kernels, read without a GPU: for each suite layer,
the kernels a call of its size runs (the default schedule, a kernel for any size, or a
schedule variant), built by nvcc for ``--arch`` and disassembled with ``cuobjdump -sass``.

Per kernel it reports ptxas's registers and shared memory, and the instruction mix of its
hottest loop (the innermost loop holding the most ``FFMA``): multiply-adds, shared and global
loads and stores (in parentheses, those of 8 or 16 bytes), barriers, and the share of the loop's
instructions that are multiply-adds, an upper bound on how busy it keeps the FMA pipes (each
SM issues one instruction per scheduler and cycle). A static view: it says nothing of latency,
occupancy's effect or memory traffic, which only a GPU run measures.

Needs nvcc, and ``cuobjdump`` on ``PATH`` or the copy Triton ships (``--cuobjdump`` names
another)::

    .venv/bin/python lab/cuda_sass.py [--arch sm_90] [--workload NAME ...] [--out FILE]
        [--variant default|wide|tensor-cores]

``--variant wide`` builds the GEMM of ``WideTileCUDA`` (an 8 x 8 register block a thread)
instead of the default's (4 x 4); ``--variant tensor-cores`` the layer in float16 on tensor
cores (``schedules.tensor_core_schedule``, the kernels of its own size), whose hottest loop is
the one with the most ``HMMA``, and whose shared-memory fills are ``LDGSTS`` (``cp.async``)
and fragment loads ``LDSM`` (``ldmatrix``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tvm_deform.schedules.cuda import WideTileCUDA

from tvm_deform import schedules
from tvm_deform.ir.definition import ConvShape, padded_pixels
from tvm_deform.runtime.targets import cuda_target
from tvm_deform.tools.cuda_build import cuda_source, nvcc_build
from tvm_deform.tools.suite import load_suite

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")
_FUNCTION = re.compile(r"Function : (\S+)")
_TARGET = re.compile(r"0x([0-9a-f]+)")


def find_cuobjdump(given: str | None) -> str:
    if given:
        return given
    found = shutil.which("cuobjdump")
    if found:
        return found
    triton = importlib.util.find_spec("triton")
    if triton is not None and triton.origin:
        bundled = Path(triton.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.exists():
            return str(bundled)
    raise SystemExit("no cuobjdump: put one on PATH or pass --cuobjdump")


def disassemble(cubin: bytes, cuobjdump: str) -> dict[str, list[tuple[int, str, str]]]:
    """kernel name -> its instructions as (address, opcode, operands)."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "kernels.cubin"
        path.write_bytes(cubin)
        text = subprocess.run(
            [cuobjdump, "-sass", str(path)], capture_output=True, text=True, check=True
        ).stdout
    kernels: dict[str, list[tuple[int, str, str]]] = {}
    current = None
    for line in text.splitlines():
        if match := _FUNCTION.search(line):
            current = kernels.setdefault(match.group(1), [])
        elif current is not None and (match := _INSTRUCTION.search(line)):
            current.append((int(match.group(1), 16), match.group(2), match.group(3)))
    return kernels


def hottest_loop(code: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The body of the innermost loop (a backward branch's range) with the most multiply-adds
    (FFMA, or HMMA on tensor cores); the whole kernel when it has no loop with one."""
    loops = []
    for address, opcode, operands in code:
        if opcode.startswith("BRA") and (target := _TARGET.search(operands)):
            start = int(target.group(1), 16)
            if start < address:
                loops.append((start, address))
    best, best_key = code, None
    for start, end in loops:
        body = [i for i in code if start <= i[0] <= end]
        ffma = sum(1 for i in body if i[1].startswith(("FFMA", "HMMA")))
        key = (ffma, -len(body))
        if ffma and (best_key is None or key > best_key):
            best, best_key = body, key
    return best


def mix(body: list[tuple[int, str, str]]) -> dict[str, int]:
    counts: collections.Counter[str] = collections.Counter()
    for _, opcode, _ in body:
        base = opcode.split(".")[0]
        wide = ".128" in opcode or ".64" in opcode
        if base in ("LDS", "LDG", "STS", "STG"):
            counts[base + (".v" if wide else "")] += 1
        elif base in ("FFMA", "BAR", "HMMA", "LDSM", "LDGSTS"):
            counts[base] += 1
        counts["all"] += 1
    return dict(counts)


def sources(shape: ConvShape, arch: str, variant: str) -> str:
    """The CUDA source of the kernels a call of ``shape`` runs on ``arch``."""
    target = cuda_target(arch)
    classes = schedules.pixel_classes(shape, target)
    pixels = padded_pixels(shape.out_h * shape.out_w)
    min_pixels = max(c for c in classes if pixels >= c)
    if variant == "default":
        sch = schedules.forward_schedule(shape, target, min_pixels=min_pixels)
    elif variant == "tensor-cores":
        shape = dataclasses.replace(shape, dtype="float16")
        sch = schedules.tensor_core_schedule(shape, target)
        if sch is None:
            raise ValueError("tensor cores do not take the layer")
    else:
        func = schedules._any_size_definition(shape.any_size(), target, min_pixels=min_pixels)
        sch = WideTileCUDA().apply(func, target)
        if sch is None:
            raise ValueError("the wide tile does not apply")
    return cuda_source(shape, arch, schedule=sch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--workload", action="append", help="suite layers (default: all)")
    parser.add_argument("--variant", choices=("default", "wide", "tensor-cores"), default="default")
    parser.add_argument("--cuobjdump")
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = parser.parse_args(argv)
    cuobjdump = find_cuobjdump(args.cuobjdump)
    suite = load_suite()
    names = args.workload or list(suite)
    lines = [
        f"`lab/cuda_sass.py --arch {args.arch} --variant {args.variant}`: the hottest loop of "
        "each kernel (FFMA share: multiply-adds over all its instructions)",
        "",
        "| layer | kernel | registers | shared bytes | loop: FFMA | HMMA | LDS (vector) | LDSM "
        "| LDG (vector) | LDGSTS | STS (vector) | BAR | all | FFMA share |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for name in names:
        shape = suite[name]
        try:
            source = sources(shape, args.arch, args.variant)
        except ValueError as error:
            row = f"| {name} | {error} | | | | | | | | | | | | |"
            lines.append(row)
            print(row, flush=True)
            continue
        built = nvcc_build(source, args.arch)
        usage = built.usage()
        for kernel, code in sorted(disassemble(built.cubin, cuobjdump).items()):
            registers = usage[kernel].registers if kernel in usage else "?"
            shared = usage[kernel].shared if kernel in usage else 0
            counts = mix(hottest_loop(code))
            share = counts.get("FFMA", 0) / max(1, counts["all"])
            row = (
                f"| {name} | {kernel} | {registers} | {shared} | {counts.get('FFMA', 0)} "
                f"| {counts.get('HMMA', 0)} "
                f"| {counts.get('LDS', 0) + counts.get('LDS.v', 0)} ({counts.get('LDS.v', 0)}) "
                f"| {counts.get('LDSM', 0)} "
                f"| {counts.get('LDG', 0) + counts.get('LDG.v', 0)} ({counts.get('LDG.v', 0)}) "
                f"| {counts.get('LDGSTS', 0)} "
                f"| {counts.get('STS', 0) + counts.get('STS.v', 0)} ({counts.get('STS.v', 0)}) "
                f"| {counts.get('BAR', 0)} | {counts['all']} | {share:.0%} |"
            )
            lines.append(row)
            print(row, flush=True)
        if built.spills():
            print(f"  spills: {built.spills()}", file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
