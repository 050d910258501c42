"""``DeformConv2d``: the nn.Module drop-in for ``torchvision.ops.DeformConv2d``."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import init

from tvm_deform.binding.ops import deform_conv2d
from tvm_deform.binding.validation import as_pair

__all__ = ["DeformConv2d"]


class DeformConv2d(nn.Module):
    """Modulated deformable convolution layer; see :func:`tvm_deform.deform_conv2d`.

    Same constructor, parameters, initialisation and ``forward(input, offset, mask=None)`` as
    :class:`torchvision.ops.DeformConv2d`, so a state dict moves between the two unchanged and
    the same seed gives the same initial weights.

    Examples::
        >>> import torch
        >>> from torch import nn
        >>> from tvm_deform import DeformConv2d
        >>> # DCNv2 as in detectors: the offsets and masks come from a plain conv of the input
        >>> conv = DeformConv2d(16, 32, kernel_size=3, padding=1)
        >>> offsets_and_mask = nn.Conv2d(16, 3 * 3 * 3, kernel_size=3, padding=1)
        >>> x = torch.rand(2, 16, 20, 24)
        >>> dy_dx, mask = offsets_and_mask(x).split([18, 9], dim=1)
        >>> conv(x, dy_dx, mask.sigmoid()).shape
        torch.Size([2, 32, 20, 24])
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if groups <= 0:
            raise ValueError(f"groups must be positive, got {groups}")
        if in_channels % groups != 0:
            raise ValueError(f"in_channels ({in_channels}) must be divisible by groups ({groups})")
        if out_channels % groups != 0:
            raise ValueError(
                f"out_channels ({out_channels}) must be divisible by groups ({groups})"
            )
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = as_pair(kernel_size, "kernel_size")
        self.stride = as_pair(stride, "stride")
        self.padding = as_pair(padding, "padding")
        self.dilation = as_pair(dilation, "dilation")
        self.groups = groups
        self.weight = nn.Parameter(
            torch.empty(out_channels, in_channels // groups, *self.kernel_size)
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(out_channels))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torchvision's initialisation: Kaiming-uniform weight, uniform bias by fan-in."""
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in)
            init.uniform_(self.bias, -bound, bound)

    def forward(
        self, input: torch.Tensor, offset: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return deform_conv2d(
            input,
            offset,
            self.weight,
            self.bias,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            mask=mask,
        )

    def extra_repr(self) -> str:
        text = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}"
        text += f", stride={self.stride}"
        if self.padding != (0, 0):
            text += f", padding={self.padding}"
        if self.dilation != (1, 1):
            text += f", dilation={self.dilation}"
        if self.groups != 1:
            text += f", groups={self.groups}"
        if self.bias is None:
            text += ", bias=False"
        return text
