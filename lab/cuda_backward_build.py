"""Build every suite layer's CUDA backward (every gradient) with its default schedules, per
size and for any size, as the op compiles it (``kernels.compile_backward``: the gradients
kernel and the input's gradient, gathered by tiles), without a GPU: how long TVM takes to
compile it to CUDA source, and what nvcc makes of it (kernels, registers, shared memory,
stack frames, spills). A Markdown table on stdout.

    .venv/bin/python lab/cuda_backward_build.py [--arch sm_90] \
        > docs/results/sm90/cuda-backward-build-<commit>.md
"""

from __future__ import annotations

import argparse
import time

import tvm

from tvm_deform import schedules
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels, targets
from tvm_deform.tools import cuda_build
from tvm_deform.tools.suite import load_suite


def build(shape: ConvShape, arch: str, any_size: bool) -> dict:
    """Compile the backward kernels of ``shape`` (for any size of its layer with
    ``any_size``) for ``arch``; the compile time and nvcc's report."""
    target = targets.cuda_target(arch)
    quantum = schedules.backward_pixel_quantum(shape, target) if any_size else None
    began = time.perf_counter()
    built = kernels.compile_backward(
        shape.any_size() if any_size else shape, target, None, quantum=quantum
    )
    seconds = time.perf_counter() - began
    source = "\n".join(m.inspect_source("cuda") for m in built.mod.imports if m.kind == "cuda")
    machine = cuda_build.nvcc_build(source, arch)
    usage = machine.usage().values()
    return {
        "seconds": seconds,
        "kernels": len(usage),
        "shared": [u.shared for u in usage if u.shared],
        "registers": max(u.registers for u in usage),
        "spills": any(u.spill_stores for u in usage),
        "stack": max(u.stack for u in usage),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="sm_90")
    args = parser.parse_args()
    print(f"CUDA backward, {args.arch}, default schedules, TVM {tvm.__version__}\n")
    print(
        "| layer | sizes | compile s | kernels | registers (most) | shared bytes "
        "| stack frame bytes (most) | spills |"
    )
    print("|---|---|---:|---:|---:|---|---:|---|")
    for name, shape in load_suite().items():
        for any_size in (False, True):
            row = build(shape, args.arch, any_size)
            shared = ", ".join(str(s) for s in row["shared"]) or "-"
            print(
                f"| {name} | {'any size' if any_size else 'one size'} "
                f"| {row['seconds']:.2f} | {row['kernels']} | {row['registers']} | {shared} "
                f"| {row['stack']} | {'yes' if row['spills'] else 'no'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
