"""mmcv-style modules. :class:`ModulatedDeformConv2dPack` learns its own offsets and mask like
mmcv's
module of that name (same parameter names, so an mmcv state dict loads).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from tvm_deform.binding.modules import DeformConv2d
from tvm_deform.binding.ops import deform_conv2d_with_offset_grad_rule


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
