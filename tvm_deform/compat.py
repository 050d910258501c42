"""Meeting users where they come from: the NPU calling convention and mmcv-style modules.

**NPU layout.** The accelerator's ``npu_deformable_conv2d`` takes one ``offset`` tensor
``[N, 3 * dg * kh * kw, out_h, out_w]`` holding all x offsets, then all y offsets, then all masks,
each block ordered by (offset group, tap) like torchvision's. torchvision interleaves instead:
channel ``g * 2K + 2k`` is dy and ``g * 2K + 2k + 1`` is dx, and the mask is a separate tensor.
mmcv builds the NPU tensor with ``offset.index_select(1, odd_channels + even_channels)`` followed
by ``cat([..., mask])``; :func:`to_npu_offset` and :func:`from_npu_offset` do the same and back.

**mmcv modules.** :class:`ModulatedDeformConv2dPack` learns its own offsets and mask like mmcv's
module of that name (same parameter names, so an mmcv state dict loads).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from .modules import DeformConv2d
from .ops import deform_conv2d, deform_conv2d_with_offset_grad_rule
from .validation import as_pair

__all__ = [
    "ModulatedDeformConv2d",
    "ModulatedDeformConv2dPack",
    "from_npu_offset",
    "npu_deformable_conv2d",
    "sampled_image",
    "to_npu_offset",
]


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


class ModulatedDeformConv2d(DeformConv2d):
    """mmcv's ``ModulatedDeformConv2d``: ``forward(x, offset, mask)``, mmcv's constructor
    (``deform_groups``), parameter names and initialisation (uniform weight with bound
    ``1 / sqrt(C_in * kh * kw)``, zero bias)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        deform_groups: int = 1,
        bias: bool = True,
        *,
        deformable_groups: int | None = None,
    ) -> None:
        if deformable_groups is not None:
            # mmcv's deprecated name, still accepted there with a warning.
            warnings.warn(
                "deformable_groups is deprecated, use deform_groups",
                DeprecationWarning,
                stacklevel=2,
            )
            deform_groups = deformable_groups
        if deform_groups <= 0 or in_channels % deform_groups:
            raise ValueError(
                f"in_channels ({in_channels}) must be divisible by deform_groups ({deform_groups})"
            )
        self.deform_groups = deform_groups
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias
        )
        # Set by mmcv for compatibility with nn.Conv2d-like code (e.g. fuse_conv_bn).
        self.transposed = False
        self.output_padding = (0,)

    def reset_parameters(self) -> None:
        fan_in = self.in_channels * self.kernel_size[0] * self.kernel_size[1]
        bound = 1.0 / math.sqrt(fan_in)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def init_weights(self) -> None:
        """mmcv's name for :meth:`reset_parameters`."""
        self.reset_parameters()

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, offset: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """mmcv's layer: its rule for the offset gradient at -1 (zero; see
        ``ConvShape.offset_grad_rule``) and its rule for mixed precision: under autocast the
        offset conv returns float16 or bfloat16 while the input and the layer stay float32, so
        the offset's dtype decides and the rest is cast to it (the kernel still accumulates in
        float32)."""
        dtype = offset.dtype

        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(dtype)

        return deform_conv2d_with_offset_grad_rule(
            cast(x),
            offset,
            cast(self.weight),
            cast(self.bias),
            self.stride,
            self.padding,
            self.dilation,
            cast(mask),
            "mmcv",
        )


class ModulatedDeformConv2dPack(ModulatedDeformConv2d):
    """mmcv's ``ModulatedDeformConv2dPack``: a conv (``conv_offset``, zero-initialised) predicts
    ``3 * deform_groups * kh * kw`` channels from the input; the first two thirds are the offsets
    and the last third, through a sigmoid, the mask. A state dict saved from mmcv's module loads
    unchanged, including the old ``conv_offset_mask`` naming."""

    _version = 2

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conv_offset = nn.Conv2d(
            self.in_channels,
            self.deform_groups * 3 * self.kernel_size[0] * self.kernel_size[1],
            kernel_size=self.kernel_size,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            bias=True,
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "conv_offset"):  # not yet while the base constructor runs
            nn.init.zeros_(self.conv_offset.weight)
            nn.init.zeros_(self.conv_offset.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = self.conv_offset(x)
        o1, o2, mask = torch.chunk(out, 3, dim=1)
        offset = torch.cat((o1, o2), dim=1)
        return super().forward(x, offset, torch.sigmoid(mask))

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        version = local_metadata.get("version", None)
        if version is None or version < 2:
            # mmcv before version 2 called the offset conv ``conv_offset_mask``.
            for suffix in ("weight", "bias"):
                old = f"{prefix}conv_offset_mask.{suffix}"
                if old in state_dict and f"{prefix}conv_offset.{suffix}" not in state_dict:
                    state_dict[f"{prefix}conv_offset.{suffix}"] = state_dict.pop(old)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
