"""Random arguments of a layer (build and dispatch layer), for the measured dispatch
(:mod:`tvm_deform.runtime.dispatch`), the benchmarks and the tests: normal input, weight and
bias, offsets of a stated scale (never zeros, which would make every sample a grid point and the
gathers regular), mask in [0, 1)."""

from __future__ import annotations

import random

import torch

from tvm_deform.ir.definition import ConvShape

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


#: the relative error (norm of the difference over the norm of the reference) within which a
#: kernel's output counts as correct against the reference, by dtype: what the benchmarks and
#: the GPU session check
TOLERANCE = {"float32": 1e-5, "float64": 1e-10, "float16": 5e-3, "bfloat16": 3e-2}


def random_shape(
    rng: random.Random,
    weight_groups: tuple[int, ...] = (1, 1, 2, 3),
    channels_per_group: int = 3,
    extra_size: int = 8,
    batch: int = 3,
    mask_probability: float = 0.7,
) -> ConvShape:
    """A random layer exercising every parameter of the op: kernel size 1-4, stride and
    dilation 1-3, padding 0-2 per axis, ``weight_groups`` drawn from the tuple, 1 or 2 offset
    groups, up to ``channels_per_group`` channels per group, an image up to ``extra_size``
    larger than the kernel's span, 1 to ``batch`` images, a mask with ``mask_probability``
    and a bias with probability one half. The tests draw their configurations from it with the
    defaults; the GPU session draws larger ones."""
    groups = rng.choice(weight_groups)
    offset_groups = rng.choice([1, 1, 2])
    kh, kw = rng.randint(1, 4), rng.randint(1, 4)
    stride = (rng.randint(1, 3), rng.randint(1, 3))
    padding = (rng.randint(0, 2), rng.randint(0, 2))
    dilation = (rng.randint(1, 3), rng.randint(1, 3))
    c = groups * offset_groups * rng.randint(1, channels_per_group)
    o = groups * rng.randint(1, channels_per_group)
    h = max(dilation[0] * (kh - 1) + 1 - 2 * padding[0], 1) + rng.randint(0, extra_size)
    w = max(dilation[1] * (kw - 1) + 1 - 2 * padding[1], 1) + rng.randint(0, extra_size)
    return ConvShape(
        rng.randint(1, batch),
        c,
        h,
        w,
        o,
        kh,
        kw,
        *stride,
        *padding,
        *dilation,
        weight_groups=groups,
        offset_groups=offset_groups,
        has_mask=rng.random() < mask_probability,
        has_bias=rng.random() < 0.5,
    )
