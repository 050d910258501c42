"""The definition layer: what modulated deformable convolution computes, with no schedule.

The compute is written in TE and turned into a TensorIR PrimFunc. It is split into stages so that
a schedule can place each one where it pays:

1. sampling geometry, per (n, offset group, kernel tap k, output pixel p): the two clamped rows
   (``sample_rows``), the two clamped columns (``sample_cols``) and the four corner coefficients
   (``sample_coef``, bilinear weight x mask, zero for a corner outside the image). It does not
   depend on the channel, so it is computed once per offset group and reused by every channel.
2. ``columns[n, c, k, p]``: the sampled, masked image (the im2col matrix of the deformed conv),
   four loads and four multiply-adds per element, no branches.
3. ``conv``: the GEMM of the weight with the columns, accumulated in float32 (float64 for float64).
4. ``output``: bias and the cast back to the input dtype.

The stages 1-3 run over the pixel axis padded to a multiple of ``PIXEL_QUANTUM`` (the padding
pixels repeat the last real one and are dropped by ``output``), so that a schedule can tile the
pixels by any power of two up to the quantum without a ragged tail: a ragged tail puts a
predicate in the innermost loop, which TVM then cannot vectorise at all (measured: 20x slower).

Output pixels are flattened (``p = oy * out_w + ox``): the offset, mask and output buffers are
declared as ``[N, channels, out_h * out_w]``, which is a free view of the contiguous NCHW torch
tensors, and gives the GEMM one long contiguous axis to vectorise even when ``out_w`` is small.
The weight is declared as ``[O, C / groups, kh * kw]`` for the same reason.

The sampling rule is torchvision's (design.md section 3): a point is zero when ``y <= -1``,
``y >= H``, ``x <= -1`` or ``x >= W``; otherwise the four corners around it are weighted
bilinearly and a corner outside the image counts as zero.
"""

from __future__ import annotations

import dataclasses

from tvm import te, tirx

#: dtypes the kernels accept; the value is the dtype the kernel accumulates in.
ACCUMULATOR_DTYPE = {
    "float32": "float32",
    "float64": "float64",
    "float16": "float32",
    "bfloat16": "float32",
}


#: stages before the output run over the pixels padded to a multiple of this
PIXEL_QUANTUM = 64


def padded_pixels(pixels: int) -> int:
    """The pixel count the inner stages run over (unchanged up to one quantum)."""
    if pixels <= PIXEL_QUANTUM:
        return pixels
    return -(-pixels // PIXEL_QUANTUM) * PIXEL_QUANTUM


@dataclasses.dataclass(frozen=True)
class ConvShape:
    """Every parameter that fixes the shape of one deformable convolution.

    ``weight_groups`` and ``offset_groups`` follow torchvision: ``in_channels // weight.shape[1]``
    and ``offset.shape[1] // (2 * kernel_h * kernel_w)``.
    """

    batch: int
    in_channels: int
    height: int
    width: int
    out_channels: int
    kernel_h: int
    kernel_w: int
    stride_h: int = 1
    stride_w: int = 1
    pad_h: int = 0
    pad_w: int = 0
    dilation_h: int = 1
    dilation_w: int = 1
    weight_groups: int = 1
    offset_groups: int = 1
    has_mask: bool = True
    has_bias: bool = False
    dtype: str = "float32"

    @property
    def out_h(self) -> int:
        span = self.dilation_h * (self.kernel_h - 1) + 1
        return (self.height + 2 * self.pad_h - span) // self.stride_h + 1

    @property
    def out_w(self) -> int:
        span = self.dilation_w * (self.kernel_w - 1) + 1
        return (self.width + 2 * self.pad_w - span) // self.stride_w + 1

    @property
    def taps(self) -> int:
        return self.kernel_h * self.kernel_w

    @property
    def accumulator_dtype(self) -> str:
        return ACCUMULATOR_DTYPE[self.dtype]

    @property
    def gemm_flops(self) -> int:
        """FLOPs of the GEMM part, ``2 * N * O * (C / groups) * K * out_h * out_w``."""
        return (
            2
            * self.batch
            * self.out_channels
            * (self.in_channels // self.weight_groups)
            * self.taps
            * self.out_h
            * self.out_w
        )

    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the PrimFunc's buffers, in argument order (absent optional ones left out)."""
        pixels = self.out_h * self.out_w
        shapes = {
            "data": (self.batch, self.in_channels, self.height, self.width),
            "offset": (self.batch, 2 * self.offset_groups * self.taps, pixels),
        }
        if self.has_mask:
            shapes["mask"] = (self.batch, self.offset_groups * self.taps, pixels)
        shapes["weight"] = (
            self.out_channels,
            self.in_channels // self.weight_groups,
            self.taps,
        )
        if self.has_bias:
            shapes["bias"] = (self.out_channels,)
        shapes["output"] = (self.batch, self.out_channels, pixels)
        return shapes


def forward_tensors(shape: ConvShape) -> list[te.Tensor]:
    """The TE tensors of the forward op: the inputs followed by the output."""
    dtype, acc = shape.dtype, shape.accumulator_dtype
    n_, c_, h_, w_ = shape.batch, shape.in_channels, shape.height, shape.width
    taps, out_w = shape.taps, shape.out_w
    pixels = shape.out_h * out_w
    padded = padded_pixels(pixels)
    groups = shape.offset_groups
    channels_per_offset_group = c_ // groups
    weight_in = c_ // shape.weight_groups
    out_per_group = shape.out_channels // shape.weight_groups
    shapes = shape.buffer_shapes()

    data = te.placeholder(shapes["data"], dtype, name="data")
    offset = te.placeholder(shapes["offset"], dtype, name="offset")
    mask = te.placeholder(shapes["mask"], dtype, name="mask") if shape.has_mask else None
    weight = te.placeholder(shapes["weight"], dtype, name="weight")
    bias = te.placeholder(shapes["bias"], dtype, name="bias") if shape.has_bias else None

    def source(p):
        """The real pixel a (possibly padding) pixel index reads its offset and mask from."""
        return te.min(p, pixels - 1) if padded != pixels else p

    def sample_point(n, g, k, p, axis):
        """(coordinate, clamped floor) of the sample point along ``axis`` (0: y, 1: x)."""
        p = source(p)
        if axis == 0:
            base = (
                (p // out_w) * shape.stride_h
                - shape.pad_h
                + (k // shape.kernel_w) * (shape.dilation_h)
            )
            size = h_
        else:
            base = (
                (p % out_w) * shape.stride_w
                - shape.pad_w
                + (k % shape.kernel_w) * (shape.dilation_w)
            )
            size = w_
        coord = base.astype(acc) + offset[n, g * 2 * taps + 2 * k + axis, p].astype(acc)
        # Clamping before the int conversion keeps huge or non-finite offsets from overflowing
        # the index; a clamped point is outside (-1, size) and gets a zero coefficient anyway.
        limited = te.min(te.max(coord, tirx.const(-1, acc)), tirx.const(size, acc))
        return coord, te.floor(limited).astype("int32"), size

    def clamped_index(n, g, k, r, p, axis):
        _, low, size = sample_point(n, g, k, p, axis)
        # r = 0: the low neighbour, r = 1: the high one; both kept inside the image so the
        # loads never leave the buffer (an outside corner's coefficient is zero).
        neighbour = te.if_then_else(r == 0, low, low + 1)
        return te.min(te.max(neighbour, 0), size - 1)

    sample_rows = te.compute(
        (n_, groups, taps, 2, padded),
        lambda n, g, k, r, p: clamped_index(n, g, k, r, p, 0),
        name="sample_rows",
    )
    sample_cols = te.compute(
        (n_, groups, taps, 2, padded),
        lambda n, g, k, r, p: clamped_index(n, g, k, r, p, 1),
        name="sample_cols",
    )

    def corner_coefficient(n, g, k, q, p):
        y, y_low, _ = sample_point(n, g, k, p, 0)
        x, x_low, _ = sample_point(n, g, k, p, 1)
        one, zero = tirx.const(1, acc), tirx.const(0, acc)
        frac_y = y - y_low.astype(acc)
        frac_x = x - x_low.astype(acc)
        row, col = q // 2, q % 2
        row_index = y_low + row
        col_index = x_low + col
        weight_y = te.if_then_else(row == 0, one - frac_y, frac_y)
        weight_x = te.if_then_else(col == 0, one - frac_x, frac_x)
        inside = tirx.all(
            y > tirx.const(-1, acc),
            y < tirx.const(h_, acc),
            x > tirx.const(-1, acc),
            x < tirx.const(w_, acc),
            row_index >= 0,
            row_index <= h_ - 1,
            col_index >= 0,
            col_index <= w_ - 1,
        )
        value = weight_y * weight_x
        if mask is not None:
            value = mask[n, g * taps + k, source(p)].astype(acc) * value
        return te.if_then_else(inside, value, zero)

    sample_coef = te.compute((n_, groups, taps, 4, padded), corner_coefficient, name="sample_coef")

    def column(n, c, k, p):
        g = c // channels_per_offset_group
        total = tirx.const(0, acc)
        for q in range(4):
            row = sample_rows[n, g, k, q // 2, p]
            col = sample_cols[n, g, k, q % 2, p]
            total = total + sample_coef[n, g, k, q, p] * data[n, c, row, col].astype(acc)
        return total

    columns = te.compute((n_, c_, taps, padded), column, name="columns")

    rc = te.reduce_axis((0, weight_in), name="rc")
    rk = te.reduce_axis((0, taps), name="rk")
    conv = te.compute(
        (n_, shape.out_channels, padded),
        lambda n, o, p: te.sum(
            weight[o, rc, rk].astype(acc)
            * columns[n, (o // out_per_group) * weight_in + rc, rk, p],
            axis=[rc, rk],
        ),
        name="conv",
    )

    def epilogue(n, o, p):
        value = conv[n, o, p]
        if bias is not None:
            value = value + bias[o].astype(acc)
        return value.astype(dtype)

    result = te.compute((n_, shape.out_channels, pixels), epilogue, name="output")

    inputs = [t for t in (data, offset, mask, weight, bias) if t is not None]
    return [*inputs, result]


def forward(shape: ConvShape) -> tirx.PrimFunc:
    """The forward PrimFunc of ``shape``, unscheduled, named ``deform_conv2d``.

    Arguments, in order: data, offset, mask (if ``has_mask``), weight, bias (if ``has_bias``),
    output; shapes as :meth:`ConvShape.buffer_shapes` gives them.
    """
    func = te.create_prim_func(forward_tensors(shape))
    return func.with_attr("global_symbol", "deform_conv2d")
