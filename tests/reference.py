"""A float64 reference written from torchvision's semantics (see the README), for tests.

Deliberately plain: every sample point is computed with explicit corner checks, no clamping
tricks, so that it shares no code or shortcuts with the TensorIR definition.
"""

from __future__ import annotations

import torch


def bilinear(image: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Sample ``image`` [C, H, W] at points ``y``, ``x`` (same shape S): returns [C, *S]."""
    channels, height, width = image.shape
    inside = (y > -1) & (y < height) & (x > -1) & (x < width)
    y0, x0 = torch.floor(y), torch.floor(x)
    ly, lx = y - y0, x - x0
    total = torch.zeros((channels, *y.shape), dtype=torch.float64)
    for dy, wy in ((0, 1 - ly), (1, ly)):
        for dx, wx in ((0, 1 - lx), (1, lx)):
            yy, xx = y0 + dy, x0 + dx
            valid = inside & (yy >= 0) & (yy <= height - 1) & (xx >= 0) & (xx <= width - 1)
            yi = yy.clamp(0, height - 1).long()
            xi = xx.clamp(0, width - 1).long()
            corner = image[:, yi, xi] * (wy * wx * valid)
            total += corner
    return total


def deform_conv2d_reference(
    input: torch.Tensor,
    offset: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: tuple[int, int] = (1, 1),
    padding: tuple[int, int] = (0, 0),
    dilation: tuple[int, int] = (1, 1),
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """torchvision's ``deform_conv2d`` in float64, computed from the contract."""
    input, offset, weight = input.double(), offset.double(), weight.double()
    n, c, h, w = input.shape
    o, c_per_group, kh, kw = weight.shape
    groups = c // c_per_group
    taps = kh * kw
    offset_groups = offset.shape[1] // (2 * taps)
    out_h, out_w = offset.shape[2], offset.shape[3]
    oy = torch.arange(out_h, dtype=torch.float64).view(-1, 1) * stride[0] - padding[0]
    ox = torch.arange(out_w, dtype=torch.float64).view(1, -1) * stride[1] - padding[1]
    channels_per_offset_group = c // offset_groups
    columns = torch.zeros((n, c, taps, out_h, out_w), dtype=torch.float64)
    for b in range(n):
        for g in range(offset_groups):
            image = input[b, g * channels_per_offset_group : (g + 1) * channels_per_offset_group]
            for i in range(kh):
                for j in range(kw):
                    k = i * kw + j
                    y = oy + i * dilation[0] + offset[b, g * 2 * taps + 2 * k]
                    x = ox + j * dilation[1] + offset[b, g * 2 * taps + 2 * k + 1]
                    sample = bilinear(image, y, x)
                    if mask is not None:
                        sample = sample * mask[b, g * taps + k].double()
                    columns[
                        b, g * channels_per_offset_group : (g + 1) * channels_per_offset_group, k
                    ] = sample
    out_per_group = o // groups
    output = torch.empty((n, o, out_h, out_w), dtype=torch.float64)
    for g in range(groups):
        cols = columns[:, g * c_per_group : (g + 1) * c_per_group].reshape(n, -1, out_h * out_w)
        wts = weight[g * out_per_group : (g + 1) * out_per_group].reshape(out_per_group, -1)
        output[:, g * out_per_group : (g + 1) * out_per_group] = torch.einsum(
            "ok,nkp->nop", wts, cols
        ).view(n, out_per_group, out_h, out_w)
    if bias is not None:
        output += bias.double().view(1, -1, 1, 1)
    return output
