"""Precision diagnosis: compute a layer the reduced-precision way, next to the float32 result.

The seed report's accelerator printed 4336 where the exact answer is 4338. Every one of the 18
distinct values it printed is torchvision's exact value rounded to float16 (a 10-bit mantissa:
4338 -> 4336, 6102 -> 6104, 6318 -> 6320, 4266 -> 4264, 4302 -> 4304; values below 4096 are
exact): its default fp32 convolution mode computed with float16 data.

:func:`reduced_precision_deform_conv2d` reproduces such modes with this package's kernels:

- ``"io"``: inputs rounded to a ``mantissa_bits`` format, products accumulated in float32, the
  output rounded again (what accelerators' "allow fp32 to fp16" conv modes do; reproduces the
  seed report bit for bit with ``mantissa_bits=10``);
- ``"accumulate"``: as ``"io"``, but the sampled values and every partial sum of the GEMM are
  rounded too (a reduced-precision accumulator: the drift grows with the reduction length).

:func:`diagnose` puts either next to the float32 result and reports the difference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import torch

from tvm_deform.binding.ops import deform_conv2d
from tvm_deform.binding.validation import as_pair
from tvm_deform.compat import sampled_image

Mode = Literal["io", "accumulate"]


def round_mantissa(value: torch.Tensor, bits: int) -> torch.Tensor:
    """``value`` rounded to nearest-even with ``bits`` explicit mantissa bits (float16 has 10,
    bfloat16 7), keeping float32's exponent range."""
    if not 0 <= bits <= 23:
        raise ValueError(f"mantissa bits must be in [0, 23], got {bits}")
    mantissa, exponent = torch.frexp(value.float())
    scale = float(2 ** (bits + 1))  # frexp's mantissa is in [0.5, 1): one more bit before it
    return torch.ldexp(torch.round(mantissa * scale) / scale, exponent.float()).to(value.dtype)


def reduced_precision_deform_conv2d(
    input: torch.Tensor,
    offset: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | Sequence[int] = (1, 1),
    padding: int | Sequence[int] = (0, 0),
    dilation: int | Sequence[int] = (1, 1),
    mask: torch.Tensor | None = None,
    mantissa_bits: int = 10,
    mode: Mode = "io",
) -> torch.Tensor:
    """``deform_conv2d`` computed the reduced-precision way (see the module docstring)."""
    if mode not in ("io", "accumulate"):
        raise ValueError(f"mode must be 'io' or 'accumulate', got {mode!r}")
    r = lambda t: None if t is None else round_mantissa(t.float(), mantissa_bits)  # noqa: E731
    x, off, w, b, m = r(input), r(offset), r(weight), r(bias), r(mask)
    geometry = dict(
        stride=as_pair(stride, "stride"),
        padding=as_pair(padding, "padding"),
        dilation=as_pair(dilation, "dilation"),
    )
    if mode == "io":
        return r(deform_conv2d(x, off, w, b, mask=m, **geometry))

    kh, kw = w.shape[2:]
    samples = r(sampled_image(x, off, (kh, kw), mask=m, **geometry))  # [N, C, Ho*kh, Wo*kw]
    n, c = samples.shape[:2]
    out_h, out_w = samples.shape[2] // kh, samples.shape[3] // kw
    columns = samples.view(n, c, out_h, kh, out_w, kw).permute(0, 1, 3, 5, 2, 4)
    columns = columns.reshape(n, c * kh * kw, out_h * out_w)
    out_channels, per_group = w.shape[0], w.shape[1]
    groups = c // per_group
    out_per_group = out_channels // groups
    total = torch.zeros(n, out_channels, out_h * out_w)
    flat_w = w.reshape(out_channels, per_group * kh * kw)
    for g in range(groups):
        rows = slice(g * out_per_group, (g + 1) * out_per_group)
        cols = columns[:, g * per_group * kh * kw : (g + 1) * per_group * kh * kw]
        acc = total[:, rows]
        for j in range(cols.shape[1]):  # one rounded partial sum per reduction step
            acc = r(acc + r(flat_w[rows, j].view(1, -1, 1) * cols[:, j : j + 1]))
        total[:, rows] = acc
    if b is not None:
        total = r(total + b.view(1, -1, 1))
    return total.view(n, out_channels, out_h, out_w)


@dataclasses.dataclass
class Diagnosis:
    """A float32 result next to its reduced-precision twin."""

    float32: torch.Tensor
    reduced: torch.Tensor
    mantissa_bits: int
    mode: str

    @property
    def max_abs_difference(self) -> float:
        return float((self.reduced.double() - self.float32.double()).abs().max())

    @property
    def relative_difference(self) -> float:
        """``|reduced - float32| / |float32|`` (Frobenius norms)."""
        reference = self.float32.double()
        diff = self.reduced.double() - reference
        return float(diff.norm() / reference.norm().clamp_min(1e-300))

    @property
    def equals_rounded_float32(self) -> bool:
        """Whether every reduced value is the float32 value rounded to the reduced format."""
        return bool(torch.equal(self.reduced, round_mantissa(self.float32, self.mantissa_bits)))

    def summary(self) -> str:
        differs = int((self.reduced != self.float32).sum())
        return (
            f"{self.mode} mode, {self.mantissa_bits}-bit mantissa: {differs} of "
            f"{self.float32.numel()} values differ from float32; max |difference| "
            f"{self.max_abs_difference:g}, relative (norm) {self.relative_difference:.2e}; "
            f"every value equals the float32 one rounded to {self.mantissa_bits} bits: "
            f"{self.equals_rounded_float32}"
        )


def diagnose(
    input: torch.Tensor,
    offset: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | Sequence[int] = (1, 1),
    padding: int | Sequence[int] = (0, 0),
    dilation: int | Sequence[int] = (1, 1),
    mask: torch.Tensor | None = None,
    mantissa_bits: int = 10,
    mode: Mode = "io",
) -> Diagnosis:
    """Compute the layer in float32 and the reduced-precision way; see :class:`Diagnosis`."""
    args = (input.float(), offset.float(), weight.float(), None if bias is None else bias.float())
    kwargs = dict(stride=stride, padding=padding, dilation=dilation)
    mask32 = None if mask is None else mask.float()
    exact = deform_conv2d(*args, mask=mask32, **kwargs)
    reduced = reduced_precision_deform_conv2d(
        *args, mask=mask32, mantissa_bits=mantissa_bits, mode=mode, **kwargs
    )
    return Diagnosis(exact, reduced, mantissa_bits, mode)
