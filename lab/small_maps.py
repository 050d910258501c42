"""Time the split-output structure (``schedules.cpu.apply_split_output_structure``, the pixel axis
padded to a multiple of one vector) against the default schedule on the small-map layers of the
R50-DCNv2 model, where the default's pixel tiles pad a 10x10 map to 128 pixels; with the input
NCHW and channels-last (as ``torch.compile`` passes it), and beside torch's dense conv2d of the
same layer. A measurement of a structure that the package does not use; every kernel is checked
against torchvision first. Both kernels are loaded through the kernel cache, so both run their
parallel loops on torch's threads, as the op's kernels do (a module compiled in memory would run
them on TVM's own pool).

    .venv/bin/python lab/small_maps.py > docs/results/<cpu>/small-maps.md
"""

from __future__ import annotations

import functools
import statistics

import torch
import torchvision.ops
import tvm
from tvm import s_tir
from tvm_deform.schedules.common import lanes, largest_divisor, vector_registers
from tvm_deform.schedules.cpu import Layer, apply_split_output_structure

from tvm_deform.binding.ops import run_forward
from tvm_deform.ir import definition
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels, targets
from tvm_deform.runtime.inputs import conv_kwargs, random_inputs
from tvm_deform.tools.bench import measure, relative_error
from tvm_deform.tools.suite import load_suite

SUITE_LAYERS = (
    "r50dcn320_c4_s2_256x40x40",
    "r50dcn320_c4_256x20x20",
    "r50dcn320_c5_s2_512x20x20",
    "r50dcn320_c5_512x10x10",
)
ROUNDS = 5


def split_output_kernel(shape: ConvShape, target: tvm.target.Target, layout: str):
    """The forward kernel of ``shape`` for an input in ``layout`` with the split-output
    structure, its pixels padded to a multiple of one vector; the factors as this script
    chooses them for ``target``."""

    def schedule() -> s_tir.Schedule:
        vector = lanes(target, shape.accumulator_dtype)
        sch = s_tir.Schedule(definition.forward(shape, layout, pixel_quantum=vector))
        layer = Layer.of(sch)
        wide = vector_registers(target) >= 32
        # out_block x block_vectors accumulators: 4 x 7 = 28 of 32 registers, or 2 x 3 of 16.
        out_block = largest_divisor(layer.out_channels // 2, 4 if wide else 2)
        block_vectors = largest_divisor(layer.pixels // vector, 7 if wide else 3)
        k_channels = largest_divisor(layer.in_per_group, 64)
        apply_split_output_structure(sch, vector, out_block, block_vectors, k_channels)
        return sch

    return kernels.load_scheduled(shape, target, f"split-output-{layout}", schedule)


def time_layer(shape: ConvShape, target: tvm.target.Target) -> dict[str, float]:
    """Median ms of each implementation, in interleaved rounds, after checking ours against
    torchvision."""
    args = random_inputs(shape)
    x, o, w, b, m = (args[k] for k in ("input", "offset", "weight", "bias", "mask"))
    kw = conv_kwargs(shape)
    nhwc = x.permute(0, 2, 3, 1).contiguous()  # what an NHWC kernel takes: an NHWC array
    calls = {}
    for layout, data in (("NCHW", x), ("NHWC", nhwc)):
        for name, kernel in (
            ("default", kernels.load_kernel(shape, target, layout=layout)),
            ("split output", split_output_kernel(shape, target, layout)),
        ):
            calls[f"{name}, {layout}"] = functools.partial(
                run_forward, shape, data, o, w, b, m, kernel
            )
    expected = torchvision.ops.deform_conv2d(x, o, w, b, mask=m, **kw)
    for name, call in calls.items():
        if relative_error(call(), expected) > 1e-5:
            raise SystemExit(f"{shape}: {name} is off torchvision")
    calls["conv2d"] = functools.partial(
        torch.nn.functional.conv2d, x, w, b, stride=kw["stride"], padding=kw["padding"]
    )
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            times[name].append(measure(call, min_runs=10).median_ms)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    suite = load_suite()
    target = targets.host_target()
    print(
        f"CPU {targets.host_cpu()}, {torch.get_num_threads()} threads; median ms of {ROUNDS} "
        "interleaved rounds; the default schedule (not tuned records)"
    )
    print(
        "| layer | pixels (padded: default, split) | default | split output | split / default "
        "| default, NHWC | split output, NHWC | split / default | conv2d |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in SUITE_LAYERS:
        shape = suite[name]
        pixels = shape.out_h * shape.out_w
        vector = lanes(target, shape.accumulator_dtype)
        ms = time_layer(shape, target)
        print(
            f"| {name} | {pixels} ({definition.padded_pixels(pixels)}, "
            f"{definition.padded_pixels(pixels, vector)}) | "
            + " | ".join(
                f"{ms[f'default, {layout}']:.2f} | {ms[f'split output, {layout}']:.2f} "
                f"| {ms[f'split output, {layout}'] / ms[f'default, {layout}']:.2f}"
                for layout in ("NCHW", "NHWC")
            )
            + f" | {ms['conv2d']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
