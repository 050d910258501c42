"""Build every suite layer's CUDA backward (every gradient) with its default schedule, per size
and for any size, without a GPU: how long TVM takes to compile it to CUDA source, and what nvcc
makes of it (kernels, registers, shared memory, spills). A Markdown table on stdout.

    .venv/bin/python lab/cuda_backward_build.py [--arch sm_90] \
        > docs/results/<cpu>/cuda-backward-build.md
"""

from __future__ import annotations

import argparse
import re
import time

import tvm

from tvm_deform import schedules
from tvm_deform.ir import definition
from tvm_deform.runtime import targets
from tvm_deform.tools import cuda_build
from tvm_deform.tools.suite import load_suite


def build(shape: definition.ConvShape, arch: str, sizes: str) -> dict:
    """Compile the gradients kernel of ``shape`` (``sizes`` as for
    :func:`definition.backward`) for ``arch``; its compile time and nvcc's report."""
    target = targets.cuda_target(arch)
    began = time.perf_counter()
    if sizes == "symbolic":
        quantum = schedules.backward_pixel_quantum(shape, target)
        func = definition.backward(shape, definition.ALL_GRADIENTS, sizes, quantum, False)
    else:
        func = definition.backward(shape)
    sch = schedules.apply_default("backward", func, target)
    symbol = "deform_conv2d_backward"
    module = tvm.IRModule({symbol: sch.mod["main"].with_attr("global_symbol", symbol)})
    built = tvm.compile(module, target=target)
    seconds = time.perf_counter() - began
    source = "\n".join(m.inspect_source("cuda") for m in built.mod.imports if m.kind == "cuda")
    machine = cuda_build.nvcc_build(source, arch)
    report = "\n".join(machine.kernels.values())
    return {
        "seconds": seconds,
        "kernels": len(machine.kernels),
        "shared": [int(m) for m in re.findall(r"(\d+) bytes smem", report)],
        "registers": max(int(m) for m in re.findall(r"Used (\d+) registers", report)),
        "spills": bool(machine.spills()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="sm_90")
    args = parser.parse_args()
    print(f"CUDA backward, {args.arch}, default schedules, TVM {tvm.__version__}\n")
    print("| layer | sizes | compile s | kernels | registers (most) | shared bytes | spills |")
    print("|---|---|---:|---:|---:|---|---|")
    for name, shape in load_suite().items():
        for sizes in ("static", "symbolic"):
            layer = shape if sizes == "static" else shape.any_size()
            row = build(layer, args.arch, sizes)
            shared = ", ".join(str(s) for s in row["shared"]) or "-"
            print(
                f"| {name} | {'one size' if sizes == 'static' else 'any size'} "
                f"| {row['seconds']:.2f} | {row['kernels']} | {row['registers']} | {shared} "
                f"| {'yes' if row['spills'] else 'no'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
