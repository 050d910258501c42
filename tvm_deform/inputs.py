"""Random arguments of a layer, shared by the benchmarks, the tests and the measured dispatch
(:mod:`tvm_deform.dispatch`): normal input, weight and bias, offsets of a stated scale (never
zeros, which would make every sample a grid point and the gathers regular), mask in [0, 1)."""

from __future__ import annotations

import torch

from .definition import ConvShape

__all__ = ["conv_kwargs", "random_inputs"]


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
