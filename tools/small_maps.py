"""Time the split-output structure (``schedules.cpu.apply_split_output_structure``, the pixel axis
padded to a multiple of one vector) against the default schedule on the small-map layers of the
R50-DCNv2 model, where the default's pixel tiles pad a 10x10 map to 128 pixels. A measurement of
a structure that the package does not use yet; every kernel is checked against torchvision.

    .venv/bin/python tools/small_maps.py > docs/small-maps-<cpu>.md
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
from tvm_deform.tools.bench import measure, relative_error
from tvm_deform.tools.inputs import conv_kwargs, random_inputs
from tvm_deform.tools.suite import load_suite

SUITE_LAYERS = (
    "r50dcn320_c4_s2_256x40x40",
    "r50dcn320_c4_256x20x20",
    "r50dcn320_c5_s2_512x20x20",
    "r50dcn320_c5_512x10x10",
)


def split_output_kernel(shape: ConvShape, target: tvm.target.Target):
    """The forward kernel of ``shape`` with the split-output structure, its pixels padded to a
    multiple of one vector; the factors as this script chooses them for ``target``."""
    vector = lanes(target, shape.dtype)
    sch = s_tir.Schedule(definition.forward(shape, pixel_quantum=vector))
    layer = Layer.of(sch)
    wide = vector_registers(target) >= 32
    # out_block x block_vectors accumulators: 4 x 7 = 28 of 32 registers, or 2 x 3 of 16.
    out_block = largest_divisor(layer.out_channels // 2, 4 if wide else 2)
    block_vectors = largest_divisor(layer.pixels // vector, 7 if wide else 3)
    k_channels = largest_divisor(layer.in_per_group, 64)
    apply_split_output_structure(sch, vector, out_block, block_vectors, k_channels)
    with target:
        return tvm.compile(sch.mod, target=target)["deform_conv2d"]


def time_layer(shape: ConvShape, target: tvm.target.Target) -> dict[str, float]:
    """Median ms of the default schedule and of the split-output structure, in interleaved
    rounds, after checking both against torchvision."""
    args = random_inputs(shape)
    x, o, w, b, m = (args[k] for k in ("input", "offset", "weight", "bias", "mask"))
    calls = {
        name: functools.partial(run_forward, shape, x, o, w, b, m, kernel)
        for name, kernel in (
            ("default", kernels.load_kernel(shape, target)),
            ("split output", split_output_kernel(shape, target)),
        )
    }
    expected = torchvision.ops.deform_conv2d(x, o, w, b, mask=m, **conv_kwargs(shape))
    for name, call in calls.items():
        error = relative_error(call(), expected)
        if error > 1e-5:
            raise SystemExit(f"{shape}: {name} is {error:.1e} off torchvision")
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(5):
        for name, call in calls.items():
            times[name].append(measure(call, min_runs=10).median_ms)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    suite = load_suite()
    target = targets.host_target()
    print(
        f"CPU {targets.host_cpu()}, {torch.get_num_threads()} threads; median ms of 5 "
        "interleaved rounds"
    )
    print("| layer | pixels | default (padded) | split output (padded) | split / default |")
    print("|---|---:|---:|---:|---:|")
    for name in SUITE_LAYERS:
        shape = suite[name]
        pixels = shape.out_h * shape.out_w
        ms = time_layer(shape, target)
        vector = lanes(target, shape.dtype)
        print(
            f"| {name} | {pixels} | {ms['default']:.2f} ({definition.padded_pixels(pixels)}) "
            f"| {ms['split output']:.2f} ({definition.padded_pixels(pixels, vector)}) "
            f"| {ms['split output'] / ms['default']:.2f} |"
        )


if __name__ == "__main__":
    main()
