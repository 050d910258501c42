"""Timing method shared by the demo and benchmarks (tools layer; no assertions here).

Method: call once to compile and warm up, then run until both a minimum count of runs and a
minimum time are reached, and report the median with the 20th and 80th percentiles. Inputs use
random offsets of a stated scale (never zeros, which would make the gathers regular).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from .definition import ConvShape


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    runs: int

    def __str__(self) -> str:
        return f"{self.median_ms:8.3f} ms [{self.p20_ms:.3f}, {self.p80_ms:.3f}]"


def measure(
    fn: Callable[[], object], warmup: int = 2, min_runs: int = 10, min_seconds: float = 0.3
) -> Timing:
    """Median and 20/80 percentiles of ``fn``'s wall time, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_seconds:
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
        if len(times) >= 1000:
            break
    times.sort()
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))] * 1e3  # noqa: E731
    return Timing(statistics.median(times) * 1e3, pick(0.2), pick(0.8), len(times))


def random_inputs(
    shape: ConvShape, offset_scale: float = 2.0, seed: int = 0
) -> dict[str, torch.Tensor | None]:
    """Random arguments for ``shape``: normal input/weight/bias, offsets ``scale * N(0, 1)``,
    mask uniform in [0, 1)."""
    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, shape.dtype)

    def normal(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=generator, dtype=torch.float64) * scale).to(dtype)

    n, oh, ow = shape.batch, shape.out_h, shape.out_w
    taps = shape.taps
    return {
        "input": normal(n, shape.in_channels, shape.height, shape.width),
        "offset": normal(n, 2 * shape.offset_groups * taps, oh, ow, scale=offset_scale),
        "weight": normal(
            shape.out_channels,
            shape.in_channels // shape.weight_groups,
            shape.kernel_h,
            shape.kernel_w,
        ),
        "bias": normal(shape.out_channels) if shape.has_bias else None,
        "mask": (
            torch.rand(n, shape.offset_groups * taps, oh, ow, generator=generator).to(dtype)
            if shape.has_mask
            else None
        ),
    }


def conv_kwargs(shape: ConvShape) -> dict[str, tuple[int, int]]:
    return {
        "stride": (shape.stride_h, shape.stride_w),
        "padding": (shape.pad_h, shape.pad_w),
        "dilation": (shape.dilation_h, shape.dilation_w),
    }
