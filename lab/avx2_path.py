"""Time the default schedule compiled for AVX2 (x86-64-v3) and for this CPU, side by side on this
machine, with a dense conv2d of each layer: the AVX2 code path's speed where no AVX2-only CPU is at
hand (not a real AVX2 CPU's speed; the conv2d is torch's kernel for this CPU).

    .venv/bin/python lab/avx2_path.py > docs/results/<cpu>/avx2-path.md
"""

from __future__ import annotations

import functools
import statistics

import torch

from tvm_deform.binding.ops import run_forward
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels, targets
from tvm_deform.runtime.inputs import conv_kwargs, random_inputs
from tvm_deform.tools.bench import measure
from tvm_deform.tools.suite import load_suite

SUITE_LAYERS = (
    "demo_64x56x56",
    "r50_c4_256x50x84",
    "dla34_64x128x128",
    "r50dcn320_c3_128x40x40",
    "r50dcn320_c5_s2_512x20x20",
    "depthwise_128x56x56",
)


def time_layer(shape: ConvShape, targets: dict) -> dict[str, float]:
    """Median ms of the default schedule for each target and of dense conv2d, in interleaved
    rounds, after checking that the kernels agree."""
    args = random_inputs(shape)
    x, o, w, b, m = (args[k] for k in ("input", "offset", "weight", "bias", "mask"))
    calls = {
        key: functools.partial(run_forward, shape, x, o, w, b, m, kernels.load_kernel(shape, t))
        for key, t in targets.items()
    }
    if not torch.allclose(calls["host"](), calls["avx2"](), atol=1e-4):
        raise SystemExit(f"{shape}: the AVX2 kernel disagrees with this CPU's")
    calls["dense"] = functools.partial(
        torch.nn.functional.conv2d, x, w, b, groups=shape.weight_groups, **conv_kwargs(shape)
    )
    times: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(3):
        for key, fn in calls.items():
            times[key].append(measure(fn, min_runs=10).median_ms)
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    suite = load_suite()
    layers = {name: suite[name] for name in SUITE_LAYERS}
    layers["c96_n2_40x48"] = ConvShape(2, 96, 40, 48, 96, 3, 3, pad_h=1, pad_w=1)
    layers["c192_n1_30x30"] = ConvShape(1, 192, 30, 30, 192, 3, 3, pad_h=1, pad_w=1)
    compiled_for = {"host": targets.host_target(), "avx2": targets.avx2_target()}
    print(
        f"CPU {targets.host_cpu()}, {torch.get_num_threads()} threads; default schedule, median ms"
    )
    print("| layer | this CPU's target | AVX2 (x86-64-v3) | conv2d | AVX2 / this CPU |")
    print("|---|---:|---:|---:|---:|")
    for name, shape in layers.items():
        ms = time_layer(shape, compiled_for)
        print(
            f"| {name} | {ms['host']:.2f} | {ms['avx2']:.2f} | {ms['dense']:.2f} "
            f"| {ms['avx2'] / ms['host']:.2f} |"
        )


if __name__ == "__main__":
    main()
