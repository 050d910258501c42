"""The definition layer: what modulated deformable convolution computes, with no schedule.

The compute is written in TE and turned into a TensorIR PrimFunc. It is split into stages so that
a schedule can place each one where it pays:

1. sampling geometry, per (n, offset group, kernel tap k, output pixel p): the two clamped rows
   (``sample_rows``), the two clamped columns (``sample_cols``) and the four corner coefficients
   (``sample_coef``, bilinear weight x mask, zero for a corner outside the image). It does not
   depend on the channel, so it is computed once per offset group and reused by every channel.
2. ``columns[n, c, k, p]``: the sampled, masked image (the im2col matrix of the deformed conv),
   four loads and four multiply-adds per element, no branches; in the accumulator dtype, or
   rounded to a float16/bfloat16 layer's own dtype for tensor cores (``forward``'s
   ``column_dtype``).
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

The backward is two PrimFuncs over the same geometry (:func:`backward`, :func:`grad_input`):
every gradient but the input's is a gather or an ordered reduction and so a TE compute; the
input's gradient is a scatter, written in TVMScript as one block per image plane, so that no two
blocks write the same memory and no atomics are needed (deterministic gradients). For a GPU,
:func:`grad_input_tiles` computes the same sums as a gather, one block per tile of a plane.

The sampling rule is torchvision's: a point is zero when ``y <= -1``,
``y >= H``, ``x <= -1`` or ``x >= W``; otherwise the four corners around it are weighted
bilinearly and a corner outside the image counts as zero.
"""

from __future__ import annotations

import dataclasses
import math

from tvm import te, tirx
from tvm.script import tirx as T

from tvm_deform.ir.script import pseudo_frames_answered_at_once

#: dtypes the kernels accept; the value is the dtype the kernel accumulates in.
ACCUMULATOR_DTYPE = {
    "float32": "float32",
    "float64": "float64",
    "float16": "float32",
    "bfloat16": "float32",
}


#: stages before the output run over the pixels padded to a multiple of this
PIXEL_QUANTUM = 64


#: the most elements a buffer indexed in int32 may have
INT32_MAX = 2**31 - 1


def _elements(tensor: te.Tensor) -> int:
    count = 1
    for extent in tensor.shape:
        count *= int(extent)
    return count


def _largest_buffer(tensors: list[te.Tensor]) -> int:
    """The element count of the largest tensor in the TE graph that produces ``tensors``."""
    largest, seen, stack = 0, set(), list(tensors)
    while stack:
        tensor = stack.pop()
        if tensor.op.name in seen:
            continue
        seen.add(tensor.op.name)
        largest = max(largest, _elements(tensor))
        stack.extend(tensor.op.input_tensors)
    return largest


def _prim_func(tensors: list[te.Tensor], symbol: str) -> tirx.PrimFunc:
    """The PrimFunc of ``tensors``, indexed in int32 (fast, and what the tuning records hold)
    unless a buffer of the graph has more elements than int32 can index; then in int64. A
    symbolic PrimFunc is indexed in int32: calls whose buffers pass 2^31 elements take a
    static kernel instead."""
    symbolic_sizes = any(not isinstance(e, tirx.IntImm) for t in tensors for e in t.shape)
    big = not symbolic_sizes and _largest_buffer(tensors) > INT32_MAX
    func = te.create_prim_func(tensors, index_dtype_override="int64" if big else None)
    return func.with_attr("global_symbol", symbol)


def padded_pixels(pixels, quantum: int = PIXEL_QUANTUM, always: bool = False):
    """The pixel count the inner stages run over: unchanged up to one quantum, else the next
    multiple of it; for a symbolic count (a PrimExpr), or with ``always`` (the count a kernel
    for any size pads a call's pixels to), always the next multiple."""
    if not isinstance(pixels, int):
        return (pixels + (quantum - 1)) // quantum * quantum
    if pixels <= quantum and not always:
        return pixels
    return -(-pixels // quantum) * quantum


def pixel_stage(tensor: te.Tensor, quantum: int, name: str, fill=None) -> te.Tensor:
    """The stage ``name``: ``tensor`` (``[n, channels, pixels]``, the pixels symbolic) with its
    pixels padded to a multiple of ``quantum``, the padding holding the last pixel (``fill``
    None) or ``fill``. A kernel for any size reads the offset, the mask and the output's
    gradient through such a stage, as the call has them (no copy before the call).

    The test is per block of ``quantum`` pixels: a block inside the map is read as it is, and
    only the last block clamps each index. Vectorised along a block, the test is one branch
    (the same for every lane) around a contiguous load; a clamped index in every read made
    each vector load a gather (measured: up to a fifth of a layer's time)."""
    batch, channels, pixels = tensor.shape

    def read(n, c, p):
        inside = (p // quantum + 1) * quantum <= pixels
        last = tensor[n, c, te.min(p, pixels - 1)]
        if fill is not None:
            last = tirx.Select(p < pixels, last, tirx.const(fill, tensor.dtype))
        return te.if_then_else(inside, tensor[n, c, p], last)

    return te.compute((batch, channels, padded_pixels(pixels, quantum)), read, name=name)


def _value(number, dtype: str):
    """``number`` (an int, or a symbolic size) as a ``dtype`` expression."""
    return tirx.const(number, dtype) if isinstance(number, int) else number.astype(dtype)


def symbolic(shape: ConvShape) -> ConvShape:
    """``shape`` with its batch, height and width as TIR variables (``n``, ``h``, ``w``): its
    output size and pixel count become expressions of them, and a PrimFunc defined on it takes
    every size, its variables bound from its input's shape at each call."""
    return dataclasses.replace(
        shape,
        batch=tirx.Var("n", "int32"),
        height=tirx.Var("h", "int32"),
        width=tirx.Var("w", "int32"),
    )


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
    #: the offset gradient of a sample point exactly at -1 (y or x): "torchvision" takes its
    #: right-hand derivative (row or column 0), as torchvision's backward does; "mmcv" gives 0,
    #: as mmcv's kernel does (it treats -1 as outside). Only the backward depends on it.
    offset_grad_rule: str = "torchvision"

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

    def any_size(self) -> ConvShape:
        """The layer of this shape, its batch, height and width left out (0): what a kernel
        for every size (``forward(..., sizes="symbolic")``) is defined and keyed by."""
        return dataclasses.replace(self, batch=0, height=0, width=0)

    def largest_forward_buffer(self) -> int:
        """Elements of the forward's largest buffer, intermediate ones included (the sampled
        columns): a kernel indexed in int32 takes calls up to ``INT32_MAX``."""
        pixels = padded_pixels(self.out_h * self.out_w)
        return self.batch * max(
            self.in_channels * self.height * self.width,
            self.in_channels * self.taps * pixels,
            self.out_channels * pixels,
            3 * self.offset_groups * self.taps * pixels,
        )

    def buffer_shapes(self, layout: str = "NCHW") -> dict[str, tuple[int, ...]]:
        """Shapes of the PrimFunc's buffers, in argument order (absent optional ones left out);
        ``layout`` is the input's (see :func:`forward`)."""
        pixels = self.out_h * self.out_w
        data = (self.batch, self.in_channels, self.height, self.width)
        if layout == "NHWC":
            data = (self.batch, self.height, self.width, self.in_channels)
        shapes = {
            "data": data,
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


class _Sampling:
    """The sampling geometry of ``shape`` as TE expressions over the offset and mask tensors,
    shared by the forward and backward definitions."""

    def __init__(
        self,
        shape: ConvShape,
        offset: te.Tensor,
        mask: te.Tensor | None,
        quantum: int = PIXEL_QUANTUM,
        staged_inputs: bool = True,
    ):
        self.shape = shape
        self.offset = offset
        self.mask = mask
        self.acc = shape.accumulator_dtype
        self.pixels = shape.out_h * shape.out_w
        self.padded = padded_pixels(self.pixels, quantum)
        # A symbolic shape's offset and mask come as the call has them: read through stages
        # padded to the quantum (see :func:`pixel_stage`), or at a clamped index.
        self.staged = staged_inputs and not isinstance(self.pixels, int)
        if self.staged:
            self.offset = pixel_stage(offset, quantum, "offset_pixels")
            if mask is not None:
                self.mask = pixel_stage(mask, quantum, "mask_pixels")
        # With a symbolic output width, ``p // out_w`` is an integer division per sample point,
        # which no vector unit has (it made the forward twice as slow): the window's corner of
        # each pixel is computed once, in a stage of its own, and the geometry reads it.
        self.pixel_base = None
        if not isinstance(shape.out_w, int):
            self.pixel_base = te.compute(
                (2, self.padded),
                lambda axis, p: te.if_then_else(
                    axis == 0,
                    (self.source(p) // shape.out_w) * shape.stride_h - shape.pad_h,
                    (self.source(p) % shape.out_w) * shape.stride_w - shape.pad_w,
                ),
                name="pixel_base",
            )

    def source(self, p):
        """The real pixel a (possibly padding) pixel index stands for: the last one."""
        if isinstance(self.pixels, int) and self.padded == self.pixels:
            return p
        return te.min(p, self.pixels - 1)

    def input_pixel(self, p):
        """The pixel index the offset and mask are read at: a padding pixel at the last real
        one, unless they are read through their padded stages (``staged_inputs``)."""
        return p if self.staged else self.source(p)

    def point(self, n, g, k, p, axis):
        """(coordinate, clamped floor, image size) of the sample point along ``axis`` (0: y,
        1: x)."""
        shape, acc = self.shape, self.acc
        window = self.pixel_base[axis, p] if self.pixel_base is not None else None
        offset = self.offset[n, g * 2 * shape.taps + 2 * k + axis, self.input_pixel(p)]
        p = self.source(p)
        if window is not None:
            if axis == 0:
                base, size = window + (k // shape.kernel_w) * shape.dilation_h, shape.height
            else:
                base, size = window + (k % shape.kernel_w) * shape.dilation_w, shape.width
        elif axis == 0:
            base = (
                (p // shape.out_w) * shape.stride_h
                - shape.pad_h
                + (k // shape.kernel_w) * (shape.dilation_h)
            )
            size = shape.height
        else:
            base = (
                (p % shape.out_w) * shape.stride_w
                - shape.pad_w
                + (k % shape.kernel_w) * (shape.dilation_w)
            )
            size = shape.width
        coord = base.astype(acc) + offset.astype(acc)
        # Clamping before the int conversion keeps huge or non-finite offsets from overflowing
        # the index; a clamped point is outside (-1, size) and gets a zero coefficient anyway.
        limited = te.min(te.max(coord, tirx.const(-1, acc)), _value(size, acc))
        return coord, te.floor(limited).astype("int32"), size

    def clamped_index(self, n, g, k, r, p, axis):
        _, low, size = self.point(n, g, k, p, axis)
        # r = 0: the low neighbour, r = 1: the high one; both kept inside the image so the
        # loads never leave the buffer (an outside corner's coefficient is zero).
        neighbour = te.if_then_else(r == 0, low, low + 1)
        return te.min(te.max(neighbour, 0), size - 1)

    def corner(self, n, g, k, q, p):
        """What every coefficient of corner ``q`` (row ``q // 2``, column ``q % 2``) needs: the
        two coordinates, the two bilinear weights, and whether the corner is in the image."""
        acc, h_, w_ = self.acc, self.shape.height, self.shape.width
        y, y_low, _ = self.point(n, g, k, p, 0)
        x, x_low, _ = self.point(n, g, k, p, 1)
        one = tirx.const(1, acc)
        frac_y = y - y_low.astype(acc)
        frac_x = x - x_low.astype(acc)
        row, col = q // 2, q % 2
        row_index = y_low + row
        col_index = x_low + col
        weight_y = te.if_then_else(row == 0, one - frac_y, frac_y)
        weight_x = te.if_then_else(col == 0, one - frac_x, frac_x)
        in_image = [row_index >= 0, row_index <= h_ - 1, col_index >= 0, col_index <= w_ - 1]
        return y, x, weight_y, weight_x, in_image

    def masked(self, value, n, g, k, p):
        if self.mask is None:
            return value
        return self.mask[n, g * self.shape.taps + k, self.input_pixel(p)].astype(self.acc) * value

    def inside(self, y, x, in_image, closed: bool = False):
        """The sample point's outer test and the corner's own: the forward's open one
        (``-1 < y < H``), or the closed one at -1 (``-1 <= y < H``) of the offset gradient."""
        acc, h_, w_ = self.acc, self.shape.height, self.shape.width
        low = tirx.const(-1, acc)
        return tirx.all(
            y >= low if closed else y > low,
            y < _value(h_, acc),
            x >= low if closed else x > low,
            x < _value(w_, acc),
            *in_image,
        )

    def corner_coefficient(self, n, g, k, q, p, select: bool = False):
        """The forward coefficient of corner ``q``: bilinear weight x mask, 0 outside.

        ``select``: a ``Select``, which evaluates both sides (every load in them is in bounds:
        the pixel index is clamped) and which TVM vectorises; ``if_then_else`` with a
        per-pixel condition makes TVM scalarise the whole vectorised loop. The forward uses
        ``Select``; the backward keeps ``if_then_else`` so that its shipped tuning records,
        which match the definition structurally, stay valid until it is re-tuned.
        """
        y, x, weight_y, weight_x, in_image = self.corner(n, g, k, q, p)
        value = self.masked(weight_y * weight_x, n, g, k, p)
        inside = self.inside(y, x, in_image)
        if select:
            return tirx.Select(inside, value, tirx.const(0, self.acc))
        return te.if_then_else(inside, value, tirx.const(0, self.acc))

    def derivative_coefficient(self, n, g, k, axis, q, p):
        """d(sample x mask) / d(coordinate ``axis``) as a coefficient of corner ``q``.

        torchvision's ``get_coordinate_weight``: it has no outer test, only the per-corner one,
        so a point exactly at -1 still has the derivative of its right-hand side (row or column
        0); beyond that every corner is outside and the coefficient is 0. With the shape's
        ``offset_grad_rule`` "mmcv", the open test of the forward applies (0 at -1), as in
        mmcv's ``dmcn_get_coordinate_weight``.
        """
        y, x, weight_y, weight_x, in_image = self.corner(n, g, k, q, p)
        one = tirx.const(1, self.acc)
        if axis == 0:
            value = te.if_then_else(q // 2 == 0, -one, one) * weight_x
        else:
            value = te.if_then_else(q % 2 == 0, -one, one) * weight_y
        value = self.masked(value, n, g, k, p)
        closed = self.shape.offset_grad_rule == "torchvision"
        inside = self.inside(y, x, in_image, closed=closed)
        return te.if_then_else(inside, value, tirx.const(0, self.acc))

    def unmasked_coefficient(self, n, g, k, q, p):
        """The bilinear weight of corner ``q`` without the mask (d output / d mask)."""
        y, x, weight_y, weight_x, in_image = self.corner(n, g, k, q, p)
        inside = self.inside(y, x, in_image)
        return te.if_then_else(inside, weight_y * weight_x, tirx.const(0, self.acc))

    def geometry(self, select: bool = False) -> tuple[te.Tensor, te.Tensor, te.Tensor]:
        """The stages ``sample_rows``, ``sample_cols`` and ``sample_coef`` (``select``: see
        :meth:`corner_coefficient`)."""
        shape = self.shape
        size = (shape.batch, shape.offset_groups, shape.taps)
        sample_rows = te.compute(
            (*size, 2, self.padded),
            lambda n, g, k, r, p: self.clamped_index(n, g, k, r, p, 0),
            name="sample_rows",
        )
        sample_cols = te.compute(
            (*size, 2, self.padded),
            lambda n, g, k, r, p: self.clamped_index(n, g, k, r, p, 1),
            name="sample_cols",
        )
        sample_coef = te.compute(
            (*size, 4, self.padded),
            lambda n, g, k, q, p: self.corner_coefficient(n, g, k, q, p, select),
            name="sample_coef",
        )
        return sample_rows, sample_cols, sample_coef


def _columns(
    shape: ConvShape,
    data: te.Tensor,
    geometry,
    padded: int,
    layout: str = "NCHW",
    dtype: str | None = None,
) -> te.Tensor:
    """``columns[n, c, k, p]``: the sampled, masked image (the deformed im2col matrix), from
    ``data`` in ``layout``; computed in the accumulator dtype and, with ``dtype``, rounded to
    it."""
    sample_rows, sample_cols, sample_coef = geometry
    acc = shape.accumulator_dtype
    channels_per_offset_group = shape.in_channels // shape.offset_groups

    def column(n, c, k, p):
        g = c // channels_per_offset_group
        total = tirx.const(0, acc)
        for q in range(4):
            row = sample_rows[n, g, k, q // 2, p]
            col = sample_cols[n, g, k, q % 2, p]
            value = data[n, row, col, c] if layout == "NHWC" else data[n, c, row, col]
            total = total + sample_coef[n, g, k, q, p] * value.astype(acc)
        return total if dtype is None else total.astype(dtype)

    return te.compute((shape.batch, shape.in_channels, shape.taps, padded), column, name="columns")


def _placeholders(shape: ConvShape, layout: str = "NCHW"):
    """The input placeholders."""
    dtype = shape.dtype
    shapes = shape.buffer_shapes(layout)
    data = te.placeholder(shapes["data"], dtype, name="data")
    offset = te.placeholder(shapes["offset"], dtype, name="offset")
    mask = te.placeholder(shapes["mask"], dtype, name="mask") if shape.has_mask else None
    weight = te.placeholder(shapes["weight"], dtype, name="weight")
    bias = te.placeholder(shapes["bias"], dtype, name="bias") if shape.has_bias else None
    return data, offset, mask, weight, bias


#: the input layouts the forward is defined for: torch's default (contiguous) and channels_last
LAYOUTS = ("NCHW", "NHWC")


def forward_tensors(
    shape: ConvShape,
    layout: str = "NCHW",
    column_dtype: str | None = None,
    pixel_quantum: int = PIXEL_QUANTUM,
    staged_inputs: bool = True,
) -> list[te.Tensor]:
    """The TE tensors of the forward op: the inputs (the input in ``layout``) followed by the
    output. ``column_dtype``, ``pixel_quantum`` and ``staged_inputs``: see :func:`forward`."""
    dtype, acc = shape.dtype, shape.accumulator_dtype
    pixels = shape.out_h * shape.out_w
    padded = padded_pixels(pixels, pixel_quantum)
    weight_in = shape.in_channels // shape.weight_groups
    out_per_group = shape.out_channels // shape.weight_groups

    data, offset, mask, weight, bias = _placeholders(shape, layout)
    sampling = _Sampling(shape, offset, mask, pixel_quantum, staged_inputs)
    columns = _columns(shape, data, sampling.geometry(select=True), padded, layout, column_dtype)

    def column(n, o, rc, rk, p):
        value = columns[n, (o // out_per_group) * weight_in + rc, rk, p]
        return value if column_dtype is None else value.astype(acc)

    rc = te.reduce_axis((0, weight_in), name="rc")
    rk = te.reduce_axis((0, shape.taps), name="rk")
    conv = te.compute(
        (shape.batch, shape.out_channels, padded),
        lambda n, o, p: te.sum(
            weight[o, rc, rk].astype(acc) * column(n, o, rc, rk, p),
            axis=[rc, rk],
        ),
        name="conv",
    )

    def epilogue(n, o, p):
        value = conv[n, o, p]
        if bias is not None:
            value = value + bias[o].astype(acc)
        return value.astype(dtype)

    result = te.compute((shape.batch, shape.out_channels, pixels), epilogue, name="output")

    inputs = [t for t in (data, offset, mask, weight, bias) if t is not None]
    return [*inputs, result]


def forward(
    shape: ConvShape,
    layout: str = "NCHW",
    column_dtype: str | None = None,
    pixel_quantum: int = PIXEL_QUANTUM,
    sizes: str = "static",
    min_pixels: int = 0,
    staged_inputs: bool = True,
) -> tirx.PrimFunc:
    """The forward PrimFunc of ``shape``, unscheduled, named ``deform_conv2d``.

    Arguments, in order: data, offset, mask (if ``has_mask``), weight, bias (if ``has_bias``),
    output; shapes as :meth:`ConvShape.buffer_shapes` gives them. ``layout`` is the input's:
    "NCHW", or "NHWC" (a ``channels_last`` torch tensor, read in place); the PrimFunc then
    carries the attribute ``data_layout`` so that a schedule knows its channels are contiguous.
    The output is NCHW either way.

    ``column_dtype`` rounds the sampled columns to that dtype before the GEMM, which still
    multiplies and accumulates in the accumulator dtype: a float16 or bfloat16 layer's columns
    in its own dtype, as torchvision's CUDA kernel keeps them, is what a tensor core's float16 x
    float16 -> float32 multiply-add takes. None (the default) keeps them in the accumulator
    dtype.

    ``pixel_quantum`` is the multiple the pixel axis of the stages before the output is padded
    to. Every kernel the package builds uses ``PIXEL_QUANTUM``; a smaller one wastes less on
    small maps (a 10x10 map is padded to 112 pixels with 16, to 128 with 64), for schedules
    that do not need tiles of up to 64 pixels (``schedules.cpu.apply_split_output_structure``).

    ``sizes="symbolic"`` gives the PrimFunc for every size of ``shape``'s layer (batch, height
    and width as variables), its pixel axis always padded to ``pixel_quantum``, and
    ``min_pixels`` is what its schedule may assume of the pixel count. It takes the offset and
    mask as the call has them. With ``staged_inputs`` (the CPU's kernels) it reads them through
    the stages ``offset_pixels`` and ``mask_pixels``, padded to the quantum (see
    :func:`pixel_stage`), which a schedule computes per pixel tile; without (the GPU's, one
    pixel per thread), each read clamps its pixel index.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if sizes not in SIZES:
        raise ValueError(f"sizes must be one of {SIZES}, got {sizes!r}")
    if sizes == "symbolic":
        shape = symbolic(shape)
    tensors = forward_tensors(shape, layout, column_dtype, pixel_quantum, staged_inputs)
    func = _prim_func(tensors, "deform_conv2d")
    if sizes == "symbolic":
        # What a schedule may assume of the sizes it cannot see: the pixel axis is a multiple
        # of the quantum, and (the call-time variant) at least ``min_pixels`` long.
        func = func.with_attr("pixel_quantum", pixel_quantum)
        func = func.with_attr("min_pixels", max(min_pixels, 1))
    return func.with_attr("data_layout", layout) if layout != "NCHW" else func


#: the kinds of PrimFunc the definition gives: "static" (every size fixed: a kernel per input
#: size) or "symbolic" (batch, height and width as variables: one kernel for every size)
SIZES = ("static", "symbolic")


@dataclasses.dataclass(frozen=True)
class Gradients:
    """Which gradients a backward computes (what autograd asks for): the input's, the sampling
    gradients (offset and mask, one reduction), and the weight's and bias's (one pass over the
    output gradient). :data:`ALL_GRADIENTS` is the backward that the tuning logs hold records of;
    the other combinations leave stages out of the PrimFunc and run their default schedules."""

    input: bool = True
    sampling: bool = True
    weight: bool = True

    @property
    def name(self) -> str:
        """``"all"``, or the parts joined by ``+`` (``"none"`` if empty)."""
        if self == ALL_GRADIENTS:
            return "all"
        parts = [f.name for f in dataclasses.fields(self) if getattr(self, f.name)]
        return "+".join(parts) or "none"

    @property
    def needs_grad_columns(self) -> bool:
        """The column gradient feeds the input's and the sampling gradients."""
        return self.input or self.sampling


ALL_GRADIENTS = Gradients()


def backward_buffer_shapes(
    shape: ConvShape,
    gradients: Gradients = ALL_GRADIENTS,
    quantum: int = PIXEL_QUANTUM,
    any_size: bool = False,
) -> dict[str, tuple[int, ...]]:
    """Shapes of the buffers the backward kernels add to :meth:`ConvShape.buffer_shapes`, for
    the ``gradients`` asked for, their pixels padded to ``quantum`` (always, for the kernels
    for any size: ``any_size``).

    ``grad_output`` is padded to the padded pixel count (with zeros) by the caller, except for
    the kernels for any size (and a symbolic ``shape``), which take it as the call has it; the
    ``grad_columns`` and ``sample_*`` buffers are workspaces that the first backward kernel
    writes and the second reads.
    """
    forward_shapes = shape.buffer_shapes()
    pixels = shape.out_h * shape.out_w
    any_size = any_size or not isinstance(pixels, int)
    padded = padded_pixels(pixels, quantum, always=any_size)
    geometry = (shape.batch, shape.offset_groups, shape.taps)
    shapes = {"grad_output": (shape.batch, shape.out_channels, pixels if any_size else padded)}
    if gradients.needs_grad_columns:
        shapes["grad_columns"] = (shape.batch, shape.in_channels, shape.taps, padded)
    shapes |= {
        "sample_rows": (*geometry, 2, padded),
        "sample_cols": (*geometry, 2, padded),
        "sample_coef": (*geometry, 4, padded),
    }
    if gradients.sampling:
        shapes["grad_offset"] = forward_shapes["offset"]
        if shape.has_mask:
            shapes["grad_mask"] = forward_shapes["mask"]
    if gradients.weight:
        shapes["grad_weight"] = forward_shapes["weight"]
        if shape.has_bias:
            shapes["grad_bias"] = forward_shapes["bias"]
    if gradients.input:
        shapes["grad_input"] = forward_shapes["data"]
    return shapes


def backward_tensors(
    shape: ConvShape,
    gradients: Gradients = ALL_GRADIENTS,
    quantum: int = PIXEL_QUANTUM,
    staged_inputs: bool = True,
) -> list[te.Tensor]:
    """The TE tensors of the first backward kernel: inputs, then workspaces and gradients, of
    the stages that ``gradients`` needs.

    Every gradient except the input's is a gather or an ordered reduction, so it is a plain TE
    compute (torchvision's ``_deform_conv2d_backward`` formulas):

    - ``grad_columns[n, c, k, p] = sum_o weight[o, c, k] * grad_output[n, o, p]`` (within the
      weight group), the gradient of the sampled columns;
    - ``sampling_grad[n, g, k, t, p]``: per offset group, the sum over its channels of
      ``grad_columns`` times, for ``t`` = mask, y, x, the derivative of the sample with respect
      to the mask (the unmasked bilinear sample) and to the two coordinates (times the mask).
      The derivatives are taken per channel from its four corner values, as torchvision does, so
      no large sums cancel;
    - ``grad_offset`` and ``grad_mask`` are views of it in the offset and mask layouts;
    - ``grad_weight[o, c, k] = sum_{n, p} grad_output[n, o, p] * columns[n, c, k, p]`` with the
      forward's columns recomputed, and ``grad_bias[o] = sum_{n, p} grad_output[n, o, p]``.

    The input's gradient is a scatter (each sample adds into four input pixels), which TE cannot
    express; :func:`grad_input` does it from the workspaces this kernel writes.
    """
    shapes = backward_buffer_shapes(shape, gradients, quantum)
    data, offset, mask, weight, bias = _placeholders(shape)
    grad_output = te.placeholder(shapes["grad_output"], shape.dtype, name="grad_output")
    sampling = _Sampling(shape, offset, mask, quantum, staged_inputs)
    geometry = sampling.geometry()
    # The gradient of a padding pixel is zero: it adds nothing to the reductions over pixels.
    gradient = grad_output
    if not isinstance(sampling.pixels, int):
        gradient = pixel_stage(grad_output, quantum, "grad_output_pixels", fill=0)
    inputs = [t for t in (data, offset, mask, weight, grad_output) if t is not None]
    outputs = [*geometry]
    if gradients.needs_grad_columns:
        grad_columns = _grad_columns(shape, weight, gradient, shapes["grad_columns"])
        outputs.insert(0, grad_columns)
        if gradients.sampling:
            outputs += _sampling_gradients(shape, data, sampling, geometry, grad_columns)
    if gradients.weight:
        has_bias = bias is not None
        outputs += _weight_gradients(shape, data, gradient, geometry, sampling, has_bias)
    return [*inputs, *outputs]


def _grad_columns(
    shape: ConvShape, weight: te.Tensor, grad_output: te.Tensor, size: tuple
) -> te.Tensor:
    acc = shape.accumulator_dtype
    weight_in = shape.in_channels // shape.weight_groups
    out_per_group = shape.out_channels // shape.weight_groups

    ro = te.reduce_axis((0, out_per_group), name="ro")
    return te.compute(
        size,
        lambda n, c, k, p: te.sum(
            weight[(c // weight_in) * out_per_group + ro, c % weight_in, k].astype(acc)
            * grad_output[n, (c // weight_in) * out_per_group + ro, p].astype(acc),
            axis=ro,
        ),
        name="grad_columns",
    )


def _sampling_gradients(
    shape: ConvShape, data: te.Tensor, sampling: _Sampling, geometry, grad_columns: te.Tensor
) -> list[te.Tensor]:
    """``grad_offset`` and, with a mask, ``grad_mask``."""
    dtype, acc = shape.dtype, shape.accumulator_dtype
    n_, taps = shape.batch, shape.taps
    padded = sampling.padded
    groups = shape.offset_groups
    channels_per_offset_group = shape.in_channels // groups
    shapes = shape.buffer_shapes()
    sample_rows, sample_cols, _ = geometry
    mask = sampling.mask

    # The derivatives taken per channel: t = 0 is the mask's (absent without a mask), 1 and 2
    # the y and x coordinates'.
    first_term = 0 if mask is not None else 1

    def coefficient(n, g, k, t, q, p):
        kind = t + first_term
        return te.if_then_else(
            kind == 0,
            sampling.unmasked_coefficient(n, g, k, q, p),
            te.if_then_else(
                kind == 1,
                sampling.derivative_coefficient(n, g, k, 0, q, p),
                sampling.derivative_coefficient(n, g, k, 1, q, p),
            ),
        )

    terms = 3 - first_term
    grad_coef = te.compute((n_, groups, taps, terms, 4, padded), coefficient, name="grad_coef")

    rc = te.reduce_axis((0, channels_per_offset_group), name="rc")

    def sampling_term(n, g, k, t, p):
        c = g * channels_per_offset_group + rc
        derivative = tirx.const(0, acc)
        for q in range(4):
            row = sample_rows[n, g, k, q // 2, p]
            col = sample_cols[n, g, k, q % 2, p]
            derivative = derivative + grad_coef[n, g, k, t, q, p] * data[n, c, row, col].astype(acc)
        return te.sum(grad_columns[n, c, k, p] * derivative, axis=rc)

    sampling_grad = te.compute(
        (n_, groups, taps, terms, padded), sampling_term, name="sampling_grad"
    )
    grad_offset = te.compute(
        shapes["offset"],
        lambda n, ch, p: sampling_grad[
            n, ch // (2 * taps), (ch % (2 * taps)) // 2, ch % 2 + 1 - first_term, p
        ].astype(dtype),
        name="grad_offset",
    )
    grad_mask = None
    if mask is not None:
        grad_mask = te.compute(
            shapes["mask"],
            lambda n, ch, p: sampling_grad[n, ch // taps, ch % taps, 0, p].astype(dtype),
            name="grad_mask",
        )
    return [t for t in (grad_offset, grad_mask) if t is not None]


def _weight_gradients(
    shape: ConvShape,
    data: te.Tensor,
    grad_output: te.Tensor,
    geometry,
    sampling: _Sampling,
    has_bias: bool,
) -> list[te.Tensor]:
    """``grad_weight`` and, with a bias, ``grad_bias``."""
    dtype, acc = shape.dtype, shape.accumulator_dtype
    n_ = shape.batch
    padded = sampling.padded
    weight_in = shape.in_channels // shape.weight_groups
    out_per_group = shape.out_channels // shape.weight_groups
    shapes = {"grad_weight": shape.buffer_shapes()["weight"], "grad_bias": (shape.out_channels,)}

    columns = _columns(shape, data, geometry, padded)
    wn = te.reduce_axis((0, n_), name="wn")
    wp = te.reduce_axis((0, padded), name="wp")
    weight_sum = te.compute(
        shapes["grad_weight"],
        lambda o, c, k: te.sum(
            grad_output[wn, o, wp].astype(acc)
            * columns[wn, (o // out_per_group) * weight_in + c, k, wp],
            axis=[wn, wp],
        ),
        name="weight_sum",
    )
    grad_weight = te.compute(
        shapes["grad_weight"],
        lambda o, c, k: weight_sum[o, c, k].astype(dtype),
        name="grad_weight",
    )
    grad_bias = None
    if has_bias:
        bn = te.reduce_axis((0, n_), name="bn")
        bp = te.reduce_axis((0, padded), name="bp")
        bias_sum = te.compute(
            shapes["grad_bias"],
            lambda o: te.sum(grad_output[bn, o, bp].astype(acc), axis=[bn, bp]),
            name="bias_sum",
        )
        grad_bias = te.compute(
            shapes["grad_bias"], lambda o: bias_sum[o].astype(dtype), name="grad_bias"
        )

    return [t for t in (grad_weight, grad_bias) if t is not None]


def backward(
    shape: ConvShape,
    gradients: Gradients = ALL_GRADIENTS,
    sizes: str = "static",
    pixel_quantum: int = PIXEL_QUANTUM,
    staged_inputs: bool = True,
) -> tirx.PrimFunc:
    """The first backward PrimFunc of ``shape``, unscheduled, named ``deform_conv2d_backward``.

    Arguments, in order: data, offset, mask (if ``has_mask``), weight, grad_output, then the
    workspaces grad_columns, sample_rows, sample_cols, sample_coef, then grad_offset, grad_mask
    (if ``has_mask``), grad_weight, grad_bias (if ``has_bias``); shapes as
    :func:`backward_buffer_shapes` gives them. Buffers of the stages ``gradients`` does not need
    are left out (``grad_columns`` when neither the input's nor the sampling gradients are asked
    for).

    ``sizes="symbolic"``: batch, height and width as variables (a kernel for every size), its
    pixels padded to a multiple of ``pixel_quantum`` always, as for :func:`forward`. It takes
    the offset, the mask and the output's gradient as the call has them and pads the gradient
    in the stage ``grad_output_pixels`` (its padding zero; see :func:`pixel_stage`). The offset
    and mask, as for :func:`forward`: with ``staged_inputs`` (the CPU's kernels) through the
    stages ``offset_pixels`` and ``mask_pixels``, without (the GPU's) at a clamped index.
    """
    if sizes == "symbolic":
        shape = symbolic(shape)
    tensors = backward_tensors(shape, gradients, pixel_quantum, staged_inputs)
    func = _prim_func(tensors, "deform_conv2d_backward")
    if sizes == "symbolic":
        func = func.with_attr("pixel_quantum", pixel_quantum)
    return func


def grad_input(
    shape: ConvShape,
    sizes: str = "static",
    pixel_quantum: int = PIXEL_QUANTUM,
    channel_block: int = 1,
    channels_last_columns: bool = False,
) -> tirx.PrimFunc:
    """The second backward PrimFunc, ``deform_conv2d_grad_input``: the input's gradient.

    Each (n, c) image plane is filled by one block, which adds every sample's gradient
    (``grad_columns`` times the corner coefficient) into the four input pixels it was sampled
    from, in a fixed order (tap, then pixel, then corner), into a plane held in the accumulator
    dtype, a buffer of the block's own. (A GPU takes :func:`grad_input_tiles`, the same sums
    spread over tiles of the plane.)
    Planes never share memory, so a schedule can run the blocks in parallel without
    atomics and the result is bit-identical from run to run.

    With ``channel_block`` > 1, each block fills the planes of
    that many channels of one offset group at once, laid out ``[y, x, channel]``: the channels
    are the innermost loop (vectorised), and each sample's corners, coefficients and column
    gradients are read once for the block. Every element is still added to in the same order.
    With ``channels_last_columns`` as well, it reads the column gradient laid out
    ``[n, p, k * channels + c]`` (a CPU schedule of :func:`backward` writes it so), each
    sample's block of column gradients one contiguous vector.

    Arguments: grad_columns, sample_rows, sample_cols, sample_coef (written by
    :func:`backward`), grad_input. ``sizes`` and ``pixel_quantum`` as for :func:`backward`.
    """
    if channel_block > 1 and (shape.in_channels // shape.offset_groups) % channel_block:
        raise ValueError(
            f"a channel block of {channel_block} needs offset groups of a multiple of its "
            f"channels, got {shape.in_channels // shape.offset_groups} channels a group"
        )
    if channels_last_columns and channel_block == 1:
        raise ValueError("channels-last column gradients are read in blocks of channels")
    with pseudo_frames_answered_at_once():  # its TVMScript parses without inspect's scans
        if channel_block > 1:
            func = _grad_input_blocks(
                shape, sizes, pixel_quantum, channel_block, channels_last_columns
            )
        else:
            func = _grad_input(shape, sizes, pixel_quantum)
    if sizes == "symbolic":
        func = func.with_attr("pixel_quantum", pixel_quantum)
    return func


#: (rows, columns) of the input plane one thread block of :func:`grad_input_tiles` gathers
GRAD_INPUT_TILE = (8, 8)
#: output pixels along a row whose sample corners share one bounding box in
#: :func:`grad_input_tiles`
GRAD_INPUT_SEGMENT = 8


def grad_input_lanes(shape: ConvShape) -> int:
    """The lanes (channels) of a block of :func:`grad_input_tiles`: an offset group's channels
    split into the fewest runs of at most 32 (a warp)."""
    per_group = shape.in_channels // shape.offset_groups
    runs = -(-per_group // 32)
    return -(-per_group // runs)


def grad_input_tiles(
    shape: ConvShape,
    sizes: str = "static",
    pixel_quantum: int = PIXEL_QUANTUM,
    *,
    lanes: int | None = None,
) -> tirx.PrimFunc:
    """The input's gradient as a gather over tiles of the input plane (for a GPU): the sums of
    :func:`grad_input`, the same terms in the same order, so the same bits (while the column
    gradients are finite: see below).

    :func:`grad_input`'s scatter runs a whole plane in one block; on a GPU that is one thread
    per (image, channel), each adding every sample of its plane in turn. Here the plane is cut
    into tiles of :data:`GRAD_INPUT_TILE`, each filled by a block of its own, so that the work
    spreads over images x channels x tiles:

    1. ``segment_boxes[n, g, k, oy, s]``: the rows and columns (min, max) that the corners with
       a nonzero coefficient of tap ``k`` reach from the output pixels ``s`` of row ``oy`` (in
       segments of :data:`GRAD_INPUT_SEGMENT` pixels); ``row_boxes[n, g, k, oy]``, their union
       over the row. An empty box has its minimum above its maximum.
    2. ``gather``: one block per (image, offset group, run of ``lanes`` of its channels,
       tile), with a buffer of the tile's sums for each lane (``[pixel, lane]``: a GPU
       schedule puts it in shared memory). Each lane (a channel) goes through the taps and
       output rows whose box meets the tile, their segments that meet it, and adds each
       corner that lands in the tile, in the order of the scatter (tap, pixel, corner), then
       writes the tile out.
       A block's lanes read the same samples; a last run's lanes past the group's channels
       repeat its last channel without writing it.

    A corner with a zero coefficient is skipped: the scatter adds its zero, which changes no
    sum, unless the column gradient is infinite or NaN, where the scatter makes a NaN of a
    pixel the sample does not reach (torchvision skips such corners too).

    The PrimFunc's arguments are :func:`grad_input`'s, and so are ``sizes`` and
    ``pixel_quantum``. ``lanes``: the threads of a block (default :func:`grad_input_lanes`),
    whose sums, in the accumulator dtype, must fit the 48 KiB of static shared memory.
    """
    if lanes is None:
        lanes = grad_input_lanes(shape)
    tile_bytes = (
        GRAD_INPUT_TILE[0] * GRAD_INPUT_TILE[1] * (8 if shape.accumulator_dtype == "float64" else 4)
    )
    if not 1 <= lanes or lanes * tile_bytes > 48 * 1024:
        raise ValueError(
            f"a block of the gather takes 1 to {48 * 1024 // tile_bytes} lanes, got {lanes}"
        )
    with pseudo_frames_answered_at_once():
        func = _grad_input_tiles(shape, sizes, pixel_quantum, lanes)
    if sizes == "symbolic":
        func = func.with_attr("pixel_quantum", pixel_quantum)
    return func


def _grad_input_tiles(
    shape: ConvShape, sizes: str, pixel_quantum: int, lanes: int
) -> tirx.PrimFunc:
    dtype, acc = shape.dtype, shape.accumulator_dtype
    extents = _grad_input_extents(shape, sizes, pixel_quantum)
    n_, c_, h_, w_, taps, pixels, per_group = extents[:7]
    columns_shape, rows_shape, coef_shape, input_shape = extents[7:]
    sized = dataclasses.replace(shape, batch=n_, height=h_, width=w_)
    oh_, ow_ = sized.out_h, sized.out_w
    groups = shape.offset_groups
    (th, tw), seg = GRAD_INPUT_TILE, GRAD_INPUT_SEGMENT
    segments = (ow_ + seg - 1) // seg
    runs = (per_group + lanes - 1) // lanes
    tiles_y, tiles_x = (h_ + th - 1) // th, (w_ + tw - 1) // tw
    empty = (2**30, -1)  # (minimum, maximum) of an empty box
    zero = tirx.const(0, acc)

    # Plain functions, called while the TVMScript below is parsed (a name assigned in
    # TVMScript would be a one-element buffer).
    def first(oy, s):
        # The first output pixel of segment s of row oy.
        return oy * ow_ + s * seg

    def run(g, r):
        # The first channel of run r of offset group g (of the next group, past its last run).
        return g * per_group + T.min(r * lanes, per_group)

    def channel(g, r, lane):
        # The channel of a lane of run r of offset group g; the lanes past the group's last
        # channel repeat it (and do not write it).
        return g * per_group + T.min(r * lanes + lane, per_group - 1)

    def meets(box, index, ty, tx):
        # Whether the box at index (without its last axis) reaches tile (ty, tx).
        return tirx.all(
            box[(*index, 1)] >= ty * th,
            box[(*index, 0)] < ty * th + th,
            box[(*index, 3)] >= tx * tw,
            box[(*index, 2)] < tx * tw + tw,
        )

    def offsets(rows, cols, sample, ty, tx):
        # The (row, column) corner q of sample (image, group, tap, q, pixel) lands at in
        # tile (ty, tx).
        image, group, k, q, p = sample
        return rows[image, group, k, q // 2, p] - ty * th, cols[image, group, k, q % 2, p] - tx * tw

    def lands(rows, cols, coef, sample, ty, tx):
        # Whether corner q of the sample adds into tile (ty, tx).
        y, x = offsets(rows, cols, sample, ty, tx)
        return tirx.all(coef[sample] != zero, 0 <= y, y < th, 0 <= x, x < tw)

    def place(rows, cols, sample, ty, tx):
        # Where corner q of the sample lands in tile (ty, tx).
        y, x = offsets(rows, cols, sample, ty, tx)
        return y * tw + x

    @T.prim_func(s_tir=True)
    def func(
        grad_columns: T.Buffer(columns_shape, acc),
        sample_rows: T.Buffer(rows_shape, "int32"),
        sample_cols: T.Buffer(rows_shape, "int32"),
        sample_coef: T.Buffer(coef_shape, acc),
        grad_input: T.Buffer(input_shape, dtype),
    ):
        T.func_attr({"global_symbol": "deform_conv2d_grad_input", "tirx.noalias": True})
        segment_boxes = T.alloc_buffer((n_, groups, taps, oh_, segments, 4), "int32")
        row_boxes = T.alloc_buffer((n_, groups, taps, oh_, 4), "int32")
        for n, g, k, oy, s in T.grid(n_, groups, taps, oh_, segments):
            with T.sblock("segment_boxes"):
                vn, vg, vk, vy, vs = T.axis.remap("SSSSS", [n, g, k, oy, s])
                T.reads(
                    sample_rows[vn, vg, vk, 0:2, vy * ow_ : vy * ow_ + ow_],
                    sample_cols[vn, vg, vk, 0:2, vy * ow_ : vy * ow_ + ow_],
                    sample_coef[vn, vg, vk, 0:4, vy * ow_ : vy * ow_ + ow_],
                )
                T.writes(segment_boxes[vn, vg, vk, vy, vs, 0:4])
                box = T.sblock_alloc_buffer((4,), "int32", scope="local")
                for i in T.unroll(4):
                    box[i] = T.if_then_else(i % 2 == 0, empty[0], empty[1])
                for x in range(seg):
                    if vs * seg + x < ow_:
                        for q in T.unroll(4):
                            if sample_coef[vn, vg, vk, q, first(vy, vs) + x] != zero:
                                box[0] = T.min(
                                    box[0], sample_rows[vn, vg, vk, q // 2, first(vy, vs) + x]
                                )
                                box[1] = T.max(
                                    box[1], sample_rows[vn, vg, vk, q // 2, first(vy, vs) + x]
                                )
                                box[2] = T.min(
                                    box[2], sample_cols[vn, vg, vk, q % 2, first(vy, vs) + x]
                                )
                                box[3] = T.max(
                                    box[3], sample_cols[vn, vg, vk, q % 2, first(vy, vs) + x]
                                )
                for i in T.unroll(4):
                    segment_boxes[vn, vg, vk, vy, vs, i] = box[i]
        for n, g, k, oy in T.grid(n_, groups, taps, oh_):
            with T.sblock("row_boxes"):
                vn, vg, vk, vy = T.axis.remap("SSSS", [n, g, k, oy])
                T.reads(segment_boxes[vn, vg, vk, vy, 0:segments, 0:4])
                T.writes(row_boxes[vn, vg, vk, vy, 0:4])
                box = T.sblock_alloc_buffer((4,), "int32", scope="local")
                for i in T.unroll(4):
                    box[i] = T.if_then_else(i % 2 == 0, empty[0], empty[1])
                for s in range(segments):
                    for i in T.unroll(4):
                        box[i] = T.if_then_else(
                            i % 2 == 0,
                            T.min(box[i], segment_boxes[vn, vg, vk, vy, s, i]),
                            T.max(box[i], segment_boxes[vn, vg, vk, vy, s, i]),
                        )
                for i in T.unroll(4):
                    row_boxes[vn, vg, vk, vy, i] = box[i]
        for n, g, r, ty, tx in T.grid(n_, groups, runs, tiles_y, tiles_x):
            with T.sblock("gather"):
                vn, vg, vr, vty, vtx = T.axis.remap("SSSSS", [n, g, r, ty, tx])
                T.reads(
                    row_boxes[vn, vg, 0:taps, 0:oh_, 0:4],
                    segment_boxes[vn, vg, 0:taps, 0:oh_, 0:segments, 0:4],
                    sample_rows[vn, vg, 0:taps, 0:2, 0:pixels],
                    sample_cols[vn, vg, 0:taps, 0:2, 0:pixels],
                    sample_coef[vn, vg, 0:taps, 0:4, 0:pixels],
                    grad_columns[vn, run(vg, vr) : run(vg, vr + 1), 0:taps, 0:pixels],
                )
                T.writes(
                    grad_input[
                        vn,
                        run(vg, vr) : run(vg, vr + 1),
                        vty * th : vty * th + th,
                        vtx * tw : vtx * tw + tw,
                    ]
                )
                sums = T.sblock_alloc_buffer((th * tw, lanes), acc)
                for lane in range(lanes):
                    with T.sblock("gather_lane"):
                        vl = T.axis.spatial(lanes, lane)
                        T.reads(
                            row_boxes[vn, vg, 0:taps, 0:oh_, 0:4],
                            segment_boxes[vn, vg, 0:taps, 0:oh_, 0:segments, 0:4],
                            sample_rows[vn, vg, 0:taps, 0:2, 0:pixels],
                            sample_cols[vn, vg, 0:taps, 0:2, 0:pixels],
                            sample_coef[vn, vg, 0:taps, 0:4, 0:pixels],
                            grad_columns[vn, channel(vg, vr, vl), 0:taps, 0:pixels],
                        )
                        T.writes(
                            sums[0 : th * tw, vl],
                            grad_input[
                                vn,
                                channel(vg, vr, vl),
                                vty * th : vty * th + th,
                                vtx * tw : vtx * tw + tw,
                            ],
                        )
                        # Each lane reads and writes its own sums only: no barrier is needed
                        # (TVM's barrier planner, which cannot tell, skips this region).
                        with T.attr(0, "hand_threaded", 0):
                            for i in range(th * tw):
                                sums[i, vl] = zero
                            for k, oy in T.grid(taps, oh_):
                                if meets(row_boxes, (vn, vg, k, oy), vty, vtx):
                                    for s in range(segments):
                                        if meets(segment_boxes, (vn, vg, k, oy, s), vty, vtx):
                                            for x in range(seg):
                                                if s * seg + x < ow_:
                                                    p = T.bind(first(oy, s) + x)
                                                    for q in T.unroll(4):
                                                        if lands(
                                                            sample_rows,
                                                            sample_cols,
                                                            sample_coef,
                                                            (vn, vg, k, q, p),
                                                            vty,
                                                            vtx,
                                                        ):
                                                            at = T.bind(
                                                                place(
                                                                    sample_rows,
                                                                    sample_cols,
                                                                    (vn, vg, k, q, p),
                                                                    vty,
                                                                    vtx,
                                                                )
                                                            )
                                                            sums[at, vl] += (
                                                                sample_coef[vn, vg, k, q, p]
                                                                * grad_columns[
                                                                    vn, channel(vg, vr, vl), k, p
                                                                ]
                                                            )
                            for i in range(th * tw):
                                if (
                                    vr * lanes + vl < per_group
                                    and vty * th + i // tw < h_
                                    and vtx * tw + i % tw < w_
                                ):
                                    grad_input[
                                        vn,
                                        channel(vg, vr, vl),
                                        vty * th + i // tw,
                                        vtx * tw + i % tw,
                                    ] = T.cast(sums[i, vl], dtype)

    return func


def _grad_input_extents(shape: ConvShape, sizes: str, pixel_quantum: int) -> tuple:
    """The extents of :func:`grad_input`'s PrimFunc (batch, channels, height, width, taps,
    pixels, channels an offset group) and the shapes of its buffers (grad_columns,
    sample_rows and sample_cols, sample_coef, grad_input): symbolic with ``sizes``, in int32;
    else in int64 when a buffer passes int32's range, as :func:`_prim_func` does."""
    if sizes == "symbolic":
        shape = symbolic(shape)
        size = lambda v: v  # noqa: E731 - sizes and expressions as they are, in int32
    else:
        shapes = backward_buffer_shapes(shape, quantum=pixel_quantum)
        largest = max(math.prod(s) for s in shapes.values())
        size = (lambda v: tirx.IntImm("int64", v)) if largest > INT32_MAX else int
    shapes = backward_buffer_shapes(shape, quantum=pixel_quantum)
    extents = (
        shape.batch,
        shape.in_channels,
        shape.height,
        shape.width,
        shape.taps,
        shape.out_h * shape.out_w,
        shape.in_channels // shape.offset_groups,
    )
    names = ("grad_columns", "sample_rows", "sample_coef", "grad_input")
    return (*map(size, extents), *(tuple(map(size, shapes[name])) for name in names))


def _grad_input_blocks(
    shape: ConvShape, sizes: str, pixel_quantum: int, block: int, channels_last: bool
) -> tirx.PrimFunc:
    """:func:`grad_input` with a plane per ``block`` channels, ``[y, x, channel]``, reading
    the column gradient ``[n, c, k, p]``, or ``[n, p, k * channels + c]`` when
    ``channels_last``."""
    dtype, acc = shape.dtype, shape.accumulator_dtype
    extents = _grad_input_extents(shape, sizes, pixel_quantum)
    n_, c_, h_, w_, taps, pixels, per_group = extents[:7]
    columns_shape, rows_shape, coef_shape, input_shape = extents[7:]
    blocks = c_ // block
    if channels_last:
        columns_shape = (columns_shape[0], columns_shape[3], columns_shape[2] * columns_shape[1])

    # Plain functions, called while the TVMScript below is parsed: the layout's load and the
    # region a block reads.
    def column_gradient(columns, image, channel, k, p):
        if channels_last:
            return columns[image, p, k * c_ + channel]
        return columns[image, channel, k, p]

    def columns_read(columns, image, first):
        if channels_last:
            return columns[image, 0:pixels, 0 : taps * c_]
        return columns[image, first : first + block, 0:taps, 0:pixels]

    @T.prim_func(s_tir=True)
    def func(
        grad_columns: T.Buffer(columns_shape, acc),
        sample_rows: T.Buffer(rows_shape, "int32"),
        sample_cols: T.Buffer(rows_shape, "int32"),
        sample_coef: T.Buffer(coef_shape, acc),
        grad_input: T.Buffer(input_shape, dtype),
    ):
        T.func_attr({"global_symbol": "deform_conv2d_grad_input", "tirx.noalias": True})
        for n, b in T.grid(n_, blocks):
            with T.sblock("grad_input"):
                vn, vb = T.axis.remap("SS", [n, b])
                T.reads(
                    columns_read(grad_columns, vn, vb * block),
                    sample_rows[vn, vb * block // per_group, 0:taps, 0:2, 0:pixels],
                    sample_cols[vn, vb * block // per_group, 0:taps, 0:2, 0:pixels],
                    sample_coef[vn, vb * block // per_group, 0:taps, 0:4, 0:pixels],
                )
                T.writes(grad_input[vn, vb * block : vb * block + block, 0:h_, 0:w_])
                plane = T.sblock_alloc_buffer((h_, w_, block), acc)
                column = T.sblock_alloc_buffer((block,), acc)
                for y, x in T.grid(h_, w_):
                    for i in T.vectorized(block):
                        plane[y, x, i] = T.cast(0, acc)
                # Each sample's column gradients (one per channel of the block) are read once
                # for its four corners; the corners' indices are written out, not named (see
                # :func:`_grad_input`).
                for k, p in T.grid(taps, pixels):
                    for i in T.vectorized(block):
                        column[i] = column_gradient(grad_columns, vn, vb * block + i, k, p)
                    for q in T.unroll(4):
                        for i in T.vectorized(block):
                            plane[
                                sample_rows[vn, vb * block // per_group, k, q // 2, p],
                                sample_cols[vn, vb * block // per_group, k, q % 2, p],
                                i,
                            ] = (
                                plane[
                                    sample_rows[vn, vb * block // per_group, k, q // 2, p],
                                    sample_cols[vn, vb * block // per_group, k, q % 2, p],
                                    i,
                                ]
                                + sample_coef[vn, vb * block // per_group, k, q, p] * column[i]
                            )
                for i, y, x in T.grid(block, h_, w_):
                    grad_input[vn, vb * block + i, y, x] = T.cast(plane[y, x, i], dtype)

    return func


def _grad_input(shape: ConvShape, sizes: str, pixel_quantum: int) -> tirx.PrimFunc:
    dtype, acc = shape.dtype, shape.accumulator_dtype
    extents = _grad_input_extents(shape, sizes, pixel_quantum)
    n_, c_, h_, w_, taps, pixels, per_group = extents[:7]
    # Plain names: the TVMScript parser treats a string inside an annotation as a variable name.
    columns_shape, rows_shape, coef_shape, input_shape = extents[7:]

    @T.macro
    def scatter(plane, image, channel, gradient, rows, cols, coefs, result):
        # In the block of one image plane: the plane zeroed, every sample's gradient added into
        # its four corners in a fixed order, the plane cast into the input's gradient.
        for y, x in T.grid(h_, w_):
            plane[y, x] = T.cast(0, acc)
        # The corner's indices are written out, not named: TVMScript makes a name assigned in a
        # loop a one-element buffer, which a CPU kernel allocates per plane and reloads after
        # every store into the plane.
        for k, p in T.grid(taps, pixels):
            for q in T.unroll(4):
                plane[
                    rows[image, channel // per_group, k, q // 2, p],
                    cols[image, channel // per_group, k, q % 2, p],
                ] = (
                    plane[
                        rows[image, channel // per_group, k, q // 2, p],
                        cols[image, channel // per_group, k, q % 2, p],
                    ]
                    + coefs[image, channel // per_group, k, q, p] * gradient[image, channel, k, p]
                )
        for y, x in T.grid(h_, w_):
            result[image, channel, y, x] = T.cast(plane[y, x], dtype)

    @T.macro
    def reads(image, channel, gradient, rows, cols, coefs):
        # What the block of one image plane reads.
        T.reads(
            gradient[image, channel, 0:taps, 0:pixels],
            rows[image, channel // per_group, 0:taps, 0:2, 0:pixels],
            cols[image, channel // per_group, 0:taps, 0:2, 0:pixels],
            coefs[image, channel // per_group, 0:taps, 0:4, 0:pixels],
        )

    @T.prim_func(s_tir=True)
    def func(
        grad_columns: T.Buffer(columns_shape, acc),
        sample_rows: T.Buffer(rows_shape, "int32"),
        sample_cols: T.Buffer(rows_shape, "int32"),
        sample_coef: T.Buffer(coef_shape, acc),
        grad_input: T.Buffer(input_shape, dtype),
    ):
        T.func_attr({"global_symbol": "deform_conv2d_grad_input", "tirx.noalias": True})
        for n, c in T.grid(n_, c_):
            with T.sblock("grad_input"):
                vn, vc = T.axis.remap("SS", [n, c])
                reads(vn, vc, grad_columns, sample_rows, sample_cols, sample_coef)
                T.writes(grad_input[vn, vc, 0:h_, 0:w_])
                plane = T.sblock_alloc_buffer((h_, w_), acc)
                scatter(
                    plane,
                    vn,
                    vc,
                    grad_columns,
                    sample_rows,
                    sample_cols,
                    sample_coef,
                    grad_input,
                )

    return func
