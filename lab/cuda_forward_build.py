"""Build every forward rule's own CUDA schedule of every suite layer, for its size and for any
size (one kernel per size class), without a GPU: what nvcc makes of each (kernels, registers,
shared memory, stack frames, spills), or why it does not build. The fused and sample-once
structures, the wide tile, the pipelined copies and the tensor-core GEMM, each where its rule
takes the layer: the kernels a tuning round's seeds and the GPU session's columns build. A
Markdown table on stdout.

    .venv/bin/python lab/cuda_forward_build.py [--arch sm_90] [--dtype float32 float16] \
        > docs/results/sm90/cuda-forward-build-<commit>.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses

import tvm

from tvm_deform import schedules
from tvm_deform.ir import definition
from tvm_deform.runtime import targets
from tvm_deform.tools import cuda_build
from tvm_deform.tools.suite import load_suite


def schedules_of(name: str, shape: definition.ConvShape, target) -> list[tuple]:
    """(layer, sizes, rule, schedule) of every rule that takes ``shape``'s forward on
    ``target``: for its size, and for any size of its layer in each size class (the
    tensor-core GEMM's on its own PrimFunc and classes)."""
    funcs = [("one size", definition.forward(shape))]
    layer = shape.any_size()
    for pixels in schedules.pixel_classes(shape, target):
        func = schedules._any_size_definition(layer, target, "NCHW", pixels)
        funcs.append((f"any size from {pixels} px", func))
    found = []
    for sizes, func in funcs:
        for rule in schedules.rules_for("forward", target):
            sch = rule.apply(func, target)
            if sch is not None:
                found.append((name, sizes, repr(rule), sch))
    # The tensor-core GEMM multiplies columns rounded to the layer's half dtype: a PrimFunc of
    # its own, and size classes of its own.
    tensor_cores = [("one size", None)]
    if schedules.tensor_cores_take(shape, target, any_size=True):
        classes = schedules.tensor_core_pixel_classes(shape, target)
        tensor_cores += [(f"any size from {pixels} px", pixels) for pixels in classes]
    for sizes, pixels in tensor_cores:
        sch = schedules.tensor_core_schedule(shape, target, min_pixels=pixels)
        if sch is not None:
            found.append((name, sizes, "SampleOnceTensorCoreCUDA", sch))
    return found


def build(shape: definition.ConvShape, arch: str, sch) -> dict:
    """nvcc's report of ``sch``'s kernels for ``arch``, or the error that stopped the build."""
    try:
        source = cuda_build.cuda_source(shape, arch, schedule=sch)
        machine = cuda_build.nvcc_build(source, arch)
    except RuntimeError as error:
        lines = [line for line in str(error).splitlines() if "error" in line.lower()]
        return {"error": (lines or str(error).splitlines() or ["?"])[0].strip()}
    usage = machine.usage().values()
    return {
        "kernels": len(usage),
        "registers": max(u.registers for u in usage),
        "shared": max(u.shared for u in usage),
        "stack": max(u.stack for u in usage),
        "spills": sum(u.spill_stores for u in usage),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--dtype", nargs="+", default=["float32"])
    args = parser.parse_args()
    target = targets.cuda_target(args.arch)
    print(f"CUDA forward, {args.arch}, every rule's own schedule, TVM {tvm.__version__}\n")
    print(
        "| layer | dtype | sizes | rule | kernels | registers (most) | shared bytes (most) "
        "| stack frame bytes (most) | spill bytes |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    jobs = []
    for name, suite_shape in load_suite().items():
        for dtype in args.dtype:
            shape = dataclasses.replace(suite_shape, dtype=dtype)
            jobs += [(shape, dtype, *found) for found in schedules_of(name, shape, target)]
    # Two at a time: TVM's compiler releases the GIL, and nvcc runs as a process.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        rows = pool.map(lambda job: build(job[0], args.arch, job[5]), jobs)
        for (_, dtype, name, sizes, rule, _), row in zip(jobs, rows, strict=True):
            if "error" in row:
                print(f"| {name} | {dtype} | {sizes} | {rule} | does not build: {row['error']} |")
                continue
            print(
                f"| {name} | {dtype} | {sizes} | {rule} | {row['kernels']} | {row['registers']} "
                f"| {row['shared']} | {row['stack']} | {row['spills']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
