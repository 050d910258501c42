"""Meeting users where they come from: the NPU calling convention and mmcv-style modules.

The NPU calling convention. The accelerator's ``npu_deformable_conv2d`` takes one ``offset`` tensor
``[N, 3 * dg * kh * kw, out_h, out_w]`` holding all x offsets, then all y offsets, then all masks,
each block ordered by (offset group, tap) like torchvision's. torchvision interleaves instead:
channel ``g * 2K + 2k`` is dy and ``g * 2K + 2k + 1`` is dx, and the mask is a separate tensor.
mmcv builds the NPU tensor with ``offset.index_select(1, odd_channels + even_channels)`` followed
by ``cat([..., mask])``; :func:`to_npu_offset` and :func:`from_npu_offset` do the same and back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tvm_deform.binding.ops import deform_conv2d
from tvm_deform.binding.validation import as_pair


def _npu_order(offset_groups: int, taps: int, device: torch.device) -> torch.Tensor:
    """torchvision channel indices in NPU order: every x (odd) channel, then every y (even)."""
    channels = torch.arange(2 * offset_groups * taps, device=device)
    return torch.cat([channels[1::2], channels[0::2]])


def to_npu_offset(offset: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """torchvision ``offset`` ``[N, 2*dg*K, H, W]`` and ``mask`` ``[N, dg*K, H, W]`` -> the NPU's
    packed ``[N, 3*dg*K, H, W]`` (x offsets, y offsets, masks). A missing mask packs as ones."""
    if offset.dim() != 4 or offset.shape[1] % 2:
        raise ValueError(f"offset must be [N, 2 * dg * kh * kw, H, W], got {tuple(offset.shape)}")
    half = offset.shape[1] // 2
    if mask is None:
        mask = offset.new_ones((offset.shape[0], half, *offset.shape[2:]))
    if mask.shape != (offset.shape[0], half, *offset.shape[2:]):
        raise ValueError(
            f"mask must be [N, {half}, {offset.shape[2]}, {offset.shape[3]}] to go with offset "
            f"{tuple(offset.shape)}, got {tuple(mask.shape)}"
        )
    order = _npu_order(1, half, offset.device)
    return torch.cat([offset.index_select(1, order), mask], dim=1)


def from_npu_offset(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The NPU's packed ``[N, 3*dg*K, H, W]`` -> torchvision's ``(offset, mask)``."""
    if packed.dim() != 4 or packed.shape[1] % 3:
        raise ValueError(
            f"packed offset must be [N, 3 * dg * kh * kw, H, W], got {tuple(packed.shape)}"
        )
    third = packed.shape[1] // 3
    x, y, mask = packed[:, :third], packed[:, third : 2 * third], packed[:, 2 * third :]
    offset = torch.stack([y, x], dim=2).flatten(1, 2)
    return offset, mask.contiguous()


def sampled_image(
    input: torch.Tensor,
    offset: torch.Tensor,
    kernel_size: tuple[int, int],
    stride: tuple[int, int] = (1, 1),
    padding: tuple[int, int] = (0, 0),
    dilation: tuple[int, int] = (1, 1),
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sampled, mask-scaled image ``[N, C, out_h * kh, out_w * kw]`` (the NPU's
    ``offset_out``): element ``[n, c, oy * kh + i, ox * kw + j]`` is what tap ``(i, j)`` of output
    pixel ``(oy, ox)`` reads from channel ``c``.

    Computed with this package's kernel: a grouped deformable conv whose weight picks one tap
    per output channel (products with 1 and 0, so the samples come out exactly).
    """
    n, c = input.shape[:2]
    kh, kw = kernel_size
    taps = kh * kw
    pick = torch.eye(taps, dtype=input.dtype, device=input.device).view(taps, 1, kh, kw)
    weight = pick.repeat(c, 1, 1, 1)  # output channel c * taps + k picks tap k of channel c
    columns = deform_conv2d(input, offset, weight, None, stride, padding, dilation, mask)
    out_h, out_w = columns.shape[2:]
    columns = columns.view(n, c, kh, kw, out_h, out_w).permute(0, 1, 4, 2, 5, 3)
    return columns.reshape(n, c, out_h * kh, out_w * kw)


def _nchw_pair(values: Sequence[int], name: str) -> tuple[int, int]:
    values = tuple(values)
    if len(values) != 4:
        raise ValueError(f"{name} must have 4 elements in NCHW order, got {list(values)}")
    if values[0] != 1 or values[1] != 1:
        raise ValueError(f"{name} must be 1 along N and C, got {list(values)}")
    return values[2], values[3]


def npu_deformable_conv2d(
    input: torch.Tensor,
    weight: torch.Tensor,
    offset: torch.Tensor,
    bias: torch.Tensor | None,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int] = (1, 1, 1, 1),
    groups: int = 1,
    deformable_groups: int = 1,
    modulated: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The accelerator's ``npu_deformable_conv2d`` call, computed with this package's kernels.

    Args:
        input: ``[N, C_in, H, W]``.
        weight: ``[C_out, C_in / groups, kh, kw]``.
        offset: the packed ``[N, 3 * deformable_groups * kh * kw, out_h, out_w]`` tensor: all x
            offsets, all y offsets, all masks (see :func:`to_npu_offset`).
        bias: ``[C_out]`` or ``None``.
        kernel_size: ``[kh, kw]``; must match the weight.
        stride, dilation: 4 elements in NCHW order, ``[1, 1, h, w]``.
        padding: ``[top, bottom, left, right]``. Asymmetric padding is rejected (torchvision's
            contract pads both sides equally).
        groups, deformable_groups: checked against the weight and the offset channels.
        modulated: ``False`` ignores the mask channels (DCNv1, every mask 1).

    Returns:
        ``(output, offset_out)``: the convolution ``[N, C_out, out_h, out_w]`` and the sampled,
        mask-scaled image ``[N, C_in, out_h * kh, out_w * kw]``.
    """
    kh, kw = as_pair(tuple(kernel_size), "kernel_size")
    if weight.dim() != 4 or tuple(weight.shape[2:]) != (kh, kw):
        raise ValueError(
            f"kernel_size {[kh, kw]} does not match the weight's kernel "
            f"{list(weight.shape[2:]) if weight.dim() == 4 else tuple(weight.shape)}"
        )
    stride_hw = _nchw_pair(stride, "stride")
    dilation_hw = _nchw_pair(dilation, "dilation")
    padding = tuple(padding)
    if len(padding) != 4:
        raise ValueError(f"padding must be [top, bottom, left, right], got {list(padding)}")
    top, bottom, left, right = padding
    if top != bottom or left != right:
        raise ValueError(
            f"asymmetric padding {list(padding)} is not supported: top must equal bottom and "
            "left equal right (pad the input with torch.nn.functional.pad first)"
        )
    if input.dim() != 4 or weight.shape[1] == 0 or input.shape[1] // weight.shape[1] != groups:
        raise ValueError(
            f"groups={groups} does not match input channels {tuple(input.shape)[1:2]} / "
            f"weight.shape[1] {weight.shape[1]}"
        )
    if offset.dim() != 4 or offset.shape[1] != 3 * deformable_groups * kh * kw:
        raise ValueError(
            f"offset must have 3 * deformable_groups * kh * kw = {3 * deformable_groups * kh * kw}"
            f" channels (x offsets, y offsets, masks), got {tuple(offset.shape)}"
        )
    tv_offset, mask = from_npu_offset(offset)
    if not modulated:
        mask = None
    geometry = dict(stride=stride_hw, padding=(top, left), dilation=dilation_hw, mask=mask)
    output = deform_conv2d(input, tv_offset, weight, bias, **geometry)
    offset_out = sampled_image(input, tv_offset, (kh, kw), **geometry)
    return output, offset_out
