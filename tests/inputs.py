"""Random configurations and inputs shared by the forward and backward tests."""

from __future__ import annotations

import random

import torch

from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime.inputs import random_shape


def random_config(rng: random.Random) -> dict:
    """A random configuration (as a dict of the tests' names) of the package's own generator."""
    shape = random_shape(rng)
    return dict(
        n=shape.batch,
        c=shape.in_channels,
        h=shape.height,
        w=shape.width,
        o=shape.out_channels,
        kh=shape.kernel_h,
        kw=shape.kernel_w,
        stride=(shape.stride_h, shape.stride_w),
        padding=(shape.pad_h, shape.pad_w),
        dilation=(shape.dilation_h, shape.dilation_w),
        groups=shape.weight_groups,
        offset_groups=shape.offset_groups,
        use_mask=shape.has_mask,
        use_bias=shape.has_bias,
    )


def make_inputs(cfg: dict, dtype: torch.dtype, offset_scale: float = 2.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out_h = (cfg["h"] + 2 * cfg["padding"][0] - (cfg["dilation"][0] * (cfg["kh"] - 1) + 1)) // (
        cfg["stride"][0]
    ) + 1
    out_w = (cfg["w"] + 2 * cfg["padding"][1] - (cfg["dilation"][1] * (cfg["kw"] - 1) + 1)) // (
        cfg["stride"][1]
    ) + 1
    taps = cfg["kh"] * cfg["kw"]
    og = cfg["offset_groups"]

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    return dict(
        input=rand(cfg["n"], cfg["c"], cfg["h"], cfg["w"]),
        offset=rand(cfg["n"], 2 * og * taps, out_h, out_w, scale=offset_scale),
        weight=rand(cfg["o"], cfg["c"] // cfg["groups"], cfg["kh"], cfg["kw"]),
        bias=rand(cfg["o"]) if cfg["use_bias"] else None,
        mask=(
            torch.rand(cfg["n"], og * taps, out_h, out_w, generator=g, dtype=torch.float64).to(
                dtype
            )
            if cfg["use_mask"]
            else None
        ),
        stride=cfg["stride"],
        padding=cfg["padding"],
        dilation=cfg["dilation"],
    )


CONFIGS = [random_config(random.Random(seed)) for seed in range(16)]


def shape_of(cfg: dict, dtype: torch.dtype = torch.float32) -> ConvShape:
    """The ConvShape of a configuration."""
    return ConvShape(
        cfg["n"],
        cfg["c"],
        cfg["h"],
        cfg["w"],
        cfg["o"],
        cfg["kh"],
        cfg["kw"],
        *cfg["stride"],
        *cfg["padding"],
        *cfg["dilation"],
        weight_groups=cfg["groups"],
        offset_groups=cfg["offset_groups"],
        has_mask=cfg["use_mask"],
        has_bias=cfg["use_bias"],
        dtype=str(dtype).removeprefix("torch."),
    )


def depthwise_config(rng: random.Random) -> dict:
    """A random configuration in which every input channel is its own weight group with one
    output channel (the layers the inline CPU structure is for)."""
    cfg = random_config(rng)
    channels = cfg["offset_groups"] * rng.choice([1, 3, 8, 16, 20])
    return cfg | dict(c=channels, o=channels, groups=channels)


#: wider random layers (16 to 96 channels, 8 to 96 per offset group), so that vectors of channels
#: fill up
WIDE_CONFIGS = [
    random_config(random.Random(100 + seed))
    | dict(c=16 * (1 + seed % 3) * (1 + seed % 2), o=8 * (1 + seed % 3), groups=1)
    for seed in range(6)
]
DEPTHWISE_CONFIGS = [depthwise_config(random.Random(200 + seed)) for seed in range(8)]
