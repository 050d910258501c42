"""CPU schedules of the deformable convolution (LLVM targets).

Three rules (:class:`tvm_deform.schedules.rule.Rule`), one per structure, each giving the default
schedule (used for any shape that has no tuning record) and the MetaSchedule design space (the
same structure with its tile sizes as sampled choices that the search draws and scores):
:class:`InlineCPU`, :class:`OutputChannelCPU` and :class:`ColumnTileCPU`, tried in that order by
the default. The column-tile structure:

- the parallel loop is outermost and runs over (batch, tile of output pixels);
- under it, the sampling geometry of the tile is computed once per offset group, then the tile of
  sampled columns (every input channel and kernel tap, ``tile`` pixels) is filled, so it is hot in
  cache when the GEMM reads it;
- the GEMM accumulates an ``(out_block x tile)`` register block, vectorised along the pixels
  (contiguous in the NCHW output) and unrolled along output channels, and the bias/cast epilogue
  is written from that block.

Two refinements make the gathers cheap (they, not the GEMM, dominate at small channel counts):

- **channels-last sampling**: the input is first copied into an NHWC buffer, so the four corners
  of one sample point are four contiguous vectors of channels. The columns are then sampled
  vectorised along the channels (one geometry value broadcast to the whole vector) instead of
  with one gather instruction per corner and pixel vector.
- **inline sampling** (depthwise-like layers, where each sampled column feeds exactly one output):
  no column tile at all; the convolution reads its samples straight from the NHWC input, and its
  register block is vectorised along the channels.

Channels-last sampling writes one vector of channels per (tap, pixel); where the GEMM reads the
tile along the pixels, those are strided stores (one scalar store per channel, measured as about
a fifth of the demo layer's time on a Zen 5). The **output-channel structure** keeps the tile in
that order instead, ``[pixel, tap, channel]``: the GEMM's register block is vectorised along the
output channels and unrolled along a few pixels, each column value is a broadcast, and the weight
is repacked once per call to ``[channel, tap, output channel]`` so that its vectors are
contiguous. The repacking costs one pass over the weight, so the default uses the structure where
the weight is small and the output map large (the 64- and 128-channel layers).

The **split-output structure** (:func:`apply_split_output_structure`) is for small maps with many
channels, which the pixel tiles pad the most; it is not used by the default or the design spaces
yet.
"""

from __future__ import annotations

import dataclasses

from tvm import s_tir, tirx
from tvm.target import Target
from tvm_deform.schedules.common import (
    GEOMETRY,
    geometry_blocks,
    is_deform_conv,
    lanes,
    largest_divisor,
    parallel_tiles,
    vector_registers,
)
from tvm_deform.schedules.rule import Choices, Rule

from tvm_deform.ir.definition import PIXEL_QUANTUM, ConvShape, padded_pixels


def pixel_classes(shape: ConvShape, target: Target) -> tuple[int, ...]:
    """The pixel counts from which the default forward of ``shape``'s layer changes structure,
    ascending, the first 1: a kernel for any size (``definition.forward(..., sizes="symbolic",
    min_pixels=...)``) is built per class, and a call takes the largest class its padded
    pixels reach. Only the output-channel structure depends on the map's size."""
    small = _default_rule(shape, target, 1)
    large = _default_rule(shape, target, OUTPUT_CHANNEL_MIN_PIXELS)
    return (1,) if small is large else (1, OUTPUT_CHANNEL_MIN_PIXELS)


def pixel_quantum(shape: ConvShape, target: Target, min_pixels: int) -> int:
    """The pixel tile of the default forward of ``shape``'s layer for maps of at least
    ``min_pixels`` pixels: a kernel for any size pads its pixel axis to a multiple of it (one
    tile at most is wasted, not a whole ``PIXEL_QUANTUM``)."""
    vector = lanes(target, shape.accumulator_dtype)
    return _default_rule(shape, target, min_pixels).default_tile(vector)


def _default_rule(shape: ConvShape, target: Target, min_pixels: int) -> ForwardCPU:
    """The CPU forward rule the default gives ``shape``'s layer on maps of ``min_pixels``."""
    layer = dataclasses.replace(Layer.of_shape(shape), min_pixels=min_pixels)
    vector = lanes(target, shape.accumulator_dtype)
    registers = vector_registers(target)
    return next(r for r in FORWARD_RULES if r.takes(layer, vector, False, registers))


class ForwardCPU(Rule):
    """What the CPU forward rules share: they take the forward PrimFunc of
    :mod:`tvm_deform.ir.definition`, read its :class:`Layer`, and ask :meth:`takes` whether the
    layer is theirs before :meth:`schedule` lays the structure out. The first question each
    asks its :class:`Choices` is the pixel tile, which a PrimFunc for any size fixes (its
    pixels padded to a multiple of it; see ``schedules.replayed_any_size_schedule``)."""

    kernel = "forward"
    target_kind = "llvm"

    def apply(
        self, func: tirx.PrimFunc, target: Target, tunable: bool = False
    ) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        if not is_deform_conv(sch):
            return None
        layer, vector, registers = Layer.of(sch), _lanes(sch, target), vector_registers(target)
        if not self.takes(layer, vector, tunable, registers):
            return None
        self.schedule(sch, layer, vector, registers, Choices(sch, tunable))
        return sch

    def takes(self, layer: Layer, vector: int, tunable: bool, registers: int) -> bool:
        """Whether the rule schedules ``layer`` (``vector`` lanes, ``registers`` vector
        registers); as a design space with ``tunable``."""
        raise NotImplementedError

    def default_tile(self, vector: int) -> int:
        """The default's pixel tile (a kernel for any size pads its pixels to a multiple)."""
        raise NotImplementedError

    def schedule(
        self, sch: s_tir.Schedule, layer: Layer, vector: int, registers: int, choose: Choices
    ) -> None:
        raise NotImplementedError


class InlineCPU(ForwardCPU):
    """The inline structure (module docstring), for depthwise-like layers: the default's and
    the space's. Sampled: the register block's pixels (4 to 32) and channels (4 to 32,
    dividing the channels per offset group)."""

    #: the default register block: pixels by vectors of channels (with 32 vector registers;
    #: one vector with 16). 8 x 2 ran the 128-channel 56x56 layer about 20% faster than 16 x 1
    #: on a Zen 5
    pixels = 8
    vectors = 2
    #: the space's candidates
    pixel_candidates = (4, 8, 16, 32)
    channel_candidates = (4, 8, 16, 32)

    def takes(self, layer: Layer, vector: int, tunable: bool, registers: int) -> bool:
        return layer.samples_used_once

    def default_tile(self, vector: int) -> int:
        return self.pixels

    def schedule(self, sch, layer, vector, registers, choose) -> None:
        per_group = layer.channels_per_offset_group
        vectors = self.vectors if registers >= 32 else 1
        apply_inline_structure(
            sch,
            [
                None,
                choose(
                    self.pixel_candidates,
                    layer.tile(self.pixels),
                    lambda t: layer.pixels % t == 0 and t < layer.pixels,
                ),
            ],
            [
                None,
                choose(
                    self.channel_candidates,
                    largest_divisor(per_group, vector * vectors),
                    lambda b: per_group % b == 0 and b < layer.out_channels,
                ),
            ],
        )


class OutputChannelCPU(ForwardCPU):
    """The output-channel structure (module docstring). The default takes the layers of
    :meth:`Layer.suits_output_channel_vectors`; the space takes any layer with at least 2
    channels per offset group, a map of at least two of the largest tiles and a weight of at
    most 4 x ``PACKED_WEIGHT_MAX`` elements. Sampled: the column tile (16 to 64 pixels), the
    register block's pixels (4 or 8) and its vector of output channels (8 to 64, dividing the
    output channels per group)."""

    #: the default: pixels per column tile, and pixels of the register block (with 32 vector
    #: registers; 4 with 16) by two vectors of output channels
    tile = 32
    block_pixels = 8
    #: the space's candidates
    tile_candidates = (16, 32, 64)
    block_pixel_candidates = (4, 8)
    vector_candidates = (8, 16, 32, 64)

    def takes(self, layer: Layer, vector: int, tunable: bool, registers: int) -> bool:
        if not tunable:
            return layer.suits_output_channel_vectors(vector, registers)
        return (
            layer.channels_per_offset_group >= 2
            and layer.min_pixels >= 2 * max(self.tile_candidates)
            and layer.out_channels * layer.in_per_group * layer.taps <= 4 * PACKED_WEIGHT_MAX
            and any(self._vector_fits(layer, b) for b in self.vector_candidates)
        )

    def default_tile(self, vector: int) -> int:
        return self.tile

    @staticmethod
    def _vector_fits(layer: Layer, block: int) -> bool:
        return layer.out_per_group % block == 0 and block < layer.out_channels

    def schedule(self, sch, layer, vector, registers, choose) -> None:
        default_tile = layer.tile(self.tile)
        tile = choose(
            self.tile_candidates,
            default_tile,
            lambda t: layer.pixels % t == 0 and t < layer.pixels,
        )
        block = largest_divisor(default_tile, self.block_pixels if registers >= 32 else 4)
        apply_output_channel_structure(
            sch,
            [None, tile],
            [None, choose(self.block_pixel_candidates, block)],
            [
                None,
                choose(
                    self.vector_candidates,
                    largest_divisor(layer.out_per_group, vector * 2),
                    lambda b: self._vector_fits(layer, b),
                ),
            ],
        )


class ColumnTileCPU(ForwardCPU):
    """The column-tile structure (module docstring), with pixel-vectorised sampling or, where a
    layer has ``CHANNELS_LAST_MIN`` channels per offset group, channels-last sampling: the
    default for every layer the other rules leave. As a space it is two design spaces (a
    structure is not a sampled choice, since a trace replays its instructions whatever the
    decisions): pixel-vectorised sampling, and channels-last sampling where a vector of
    channels per offset group is at least 2 wide. Sampled: the pixel tile (8 to
    ``PIXEL_QUANTUM`` pixels, dividing the padded pixel axis) and the register block's output
    channels (2 to 16, dividing the output channels)."""

    #: output channels held in registers at once (rows of the register block), with 32 vector
    #: registers (AVX-512, NEON) and with 16 (AVX2): 8 x 2 accumulators spill on AVX2, where
    #: the demo layer ran 1.6x slower than with 6 or 4 rows (AVX2 code measured on a Zen 5)
    out_block = 8
    out_block_16_registers = 6
    #: vectors along the pixels in the register block (columns of the register block)
    vectors_per_tile = 2
    #: the space's candidates
    tile_candidates = (8, 16, 32, 64)
    out_block_candidates = (2, 3, 4, 6, 8, 12, 16)

    def takes(self, layer: Layer, vector: int, tunable: bool, registers: int) -> bool:
        return True

    def default_tile(self, vector: int) -> int:
        return vector * self.vectors_per_tile

    def apply(self, func, target, tunable=False):
        """As :meth:`ForwardCPU.apply`; with ``tunable``, a list of its design spaces."""
        if not tunable:
            return super().apply(func, target)
        if not is_deform_conv(s_tir.Schedule(func)):
            return []
        spread = Layer.of(s_tir.Schedule(func)).channels_per_offset_group >= 2
        spaces = []
        for channels_last in (False, True) if spread else (False,):
            sch = s_tir.Schedule(func)
            layer, vector, registers = Layer.of(sch), _lanes(sch, target), vector_registers(target)
            self.schedule(sch, layer, vector, registers, Choices(sch, True), channels_last)
            spaces.append(sch)
        return spaces

    def schedule(self, sch, layer, vector, registers, choose, channels_last=None) -> None:
        if channels_last is None:
            channels_last = layer.channels_per_offset_group >= CHANNELS_LAST_MIN
        out_block = self.out_block if registers >= 32 else self.out_block_16_registers
        apply_structure(
            sch,
            [
                None,
                choose(
                    self.tile_candidates,
                    layer.tile(vector * self.vectors_per_tile),
                    lambda t: layer.pixels % t == 0 and t < layer.pixels,
                ),
            ],
            [
                None,
                choose(
                    self.out_block_candidates,
                    largest_divisor(layer.out_channels, out_block),
                    lambda b: layer.out_channels % b == 0,
                ),
            ],
            channels_last=channels_last,
        )


#: the CPU forward rules in the order the default tries them (``tvm_deform.schedules.RULES``
#: holds the same instances)
FORWARD_RULES: tuple[ForwardCPU, ...] = (InlineCPU(), OutputChannelCPU(), ColumnTileCPU())


def _lanes(sch: s_tir.Schedule, target: Target) -> int:
    """Vector lanes of the forward's accumulator dtype on ``target``."""
    return lanes(target, str(sch.get(sch.get_sblock("conv")).writes[0].source.dtype))


def _dividing_tile(pixels, wanted: int, quantum: int = PIXEL_QUANTUM) -> int:
    """A pixel tile of at most ``wanted`` that divides the padded pixel axis: the definition pads
    an axis longer than the quantum to a multiple of it, so a power-of-two tile up to the
    quantum divides it; a shorter axis may need one tile. A symbolic axis (any size) is always
    a multiple of the quantum."""
    if not isinstance(pixels, int):
        return min(wanted, quantum)
    tile = min(wanted, quantum, pixels)
    return tile if pixels % tile == 0 else pixels


#: channels per offset group from which channels-last sampling is used by default: below it a
#: vector of channels is mostly empty (on the 3-channel seed layer the channels-last kernel took
#: 15 us against 11 us; the threshold itself has not been searched)
CHANNELS_LAST_MIN = 8

#: channels-last sampling vectorises along the channels in blocks of at most this many (four
#: 512-bit vectors of float32), looping over the blocks. A 256- or 512-channel axis vectorised
#: whole made every operation of the gather 16-32 vector registers wide: on the R50-DCNv2 c4 and
#: c5 layers LLVM took 0.2-0.3 s longer to compile the kernel (0.5-0.7 s against 0.7-0.9 s), and
#: it ran no faster (measured on an Intel Xeon, ``emeraldrapids``)
CHANNEL_BLOCK = 64


#: the output-channel structure repacks the weight at every call, and streams the whole packed
#: weight through the cache once per column tile: measured on a Zen 5 (1 MiB L2), it ran
#: 1.06-1.43x faster than the pixel structure on the 64- and 128-channel layers (weights of up
#: to 128 x 128 x 9 elements) and 1.7-3x slower on the 256- and 512-channel ones
PACKED_WEIGHT_MAX = 128 * 128 * 9
#: the same with 16 vector registers (AVX2), where the register block is 4 pixels by 2 vectors
#: of output channels: compiled for AVX2 and run on a Zen 4, the column-tile structure ran the
#: layers of 128 output channels in 0.85-0.97x the output-channel structure's time (three
#: runs), and those of 64 input and 64 output channels in 1.02-1.14x
PACKED_WEIGHT_MAX_16_REGISTERS = 64 * 64 * 9
#: and below this many output pixels the repacking is not paid back (an estimate: the copy of
#: one weight element costs about as much as 32 of the GEMM's multiply-adds)
OUTPUT_CHANNEL_MIN_PIXELS = 512


@dataclasses.dataclass(frozen=True)
class Layer:
    """What the schedules need to know of the layer, read from the forward PrimFunc's buffers."""

    out_channels: int
    #: the padded pixel axis: an int, or an expression of the sizes in a symbolic PrimFunc
    #: (see :func:`tvm_deform.ir.definition.forward`'s ``sizes``)
    pixels: object
    in_channels: int
    in_per_group: int  # input channels per weight group
    offset_groups: int
    taps: int
    #: the pixel axis is a multiple of this (symbolic PrimFuncs), and at least this long
    quantum: int = PIXEL_QUANTUM
    min_pixels: int = 1

    @classmethod
    def of(cls, sch: s_tir.Schedule) -> Layer:
        conv = sch.get(sch.get_sblock("conv"))
        weight = next(r.source for r in conv.reads if r.source.name == "weight")
        columns = sch.get(sch.get_sblock("columns")).writes[0].source
        coef = sch.get(sch.get_sblock("sample_coef")).writes[0].source
        _, out_channels, pixels = conv.writes[0].source.shape
        attrs = sch.mod["main"].attrs
        symbolic = attrs is not None and "pixel_quantum" in attrs
        return cls(
            out_channels=int(out_channels),
            pixels=pixels if symbolic else int(pixels),
            in_channels=int(columns.shape[1]),
            in_per_group=int(weight.shape[1]),
            offset_groups=int(coef.shape[1]),
            taps=int(columns.shape[2]),
            quantum=int(attrs["pixel_quantum"]) if symbolic else PIXEL_QUANTUM,
            min_pixels=int(attrs["min_pixels"]) if symbolic else int(pixels),
        )

    @classmethod
    def of_shape(cls, shape: ConvShape) -> Layer:
        """The layer of ``shape``'s forward PrimFunc, without building it (its padded pixels
        as the definition pads them)."""
        pixels = padded_pixels(shape.out_h * shape.out_w)
        return cls(
            out_channels=shape.out_channels,
            pixels=pixels,
            in_channels=shape.in_channels,
            in_per_group=shape.in_channels // shape.weight_groups,
            offset_groups=shape.offset_groups,
            taps=shape.taps,
            min_pixels=pixels,
        )

    def tile(self, wanted: int) -> int:
        """A pixel tile of at most ``wanted`` that divides the padded pixel axis."""
        return _dividing_tile(self.pixels, wanted, self.quantum)

    @property
    def channels_per_offset_group(self) -> int:
        return self.in_channels // self.offset_groups

    @property
    def out_per_group(self) -> int:
        return self.out_channels // (self.in_channels // self.in_per_group)

    def suits_output_channel_vectors(self, vector: int, registers: int) -> bool:
        """Whether the default schedules this layer with the output-channel structure: the
        channels-last sampling applies, a vector of output channels stays in one weight group,
        the weight is small enough to repack at every call (``PACKED_WEIGHT_MAX``, or
        ``PACKED_WEIGHT_MAX_16_REGISTERS`` on a target of 16 vector registers) and the map
        large enough to pay for it (``OUTPUT_CHANNEL_MIN_PIXELS``)."""
        largest = PACKED_WEIGHT_MAX if registers >= 32 else PACKED_WEIGHT_MAX_16_REGISTERS
        return (
            self.channels_per_offset_group >= CHANNELS_LAST_MIN
            and self.out_per_group % vector == 0
            and self.out_channels * self.in_per_group * self.taps <= largest
            and self.min_pixels >= OUTPUT_CHANNEL_MIN_PIXELS
        )

    @property
    def samples_used_once(self) -> bool:
        """Whether every sampled column feeds exactly one output channel (depthwise layers):
        one input and one output channel per weight group."""
        groups = self.in_channels // self.in_per_group
        return self.in_per_group == 1 and self.out_channels == groups


def apply_output_channel_structure(
    sch: s_tir.Schedule, tile_factors: list, pixel_factors: list, out_factors: list
) -> None:
    """Schedule the forward PrimFunc in ``sch`` with the output-channel structure of the module
    docstring. ``tile_factors`` split the pixels into the parallel column tiles,
    ``pixel_factors`` a tile into the register block's pixels (unrolled) and ``out_factors`` the
    output channels into its vector of output channels; ints or sampled."""
    layer = Layer.of(sch)
    conv = sch.get_sblock("conv")
    columns = sch.get_sblock("columns")
    geometry = geometry_blocks(sch)
    channels_last_input(sch, columns)
    _pack_weight(sch, conv)
    sch.transform_layout(columns, ("write", 0), lambda n, c, k, p: (n, p, k, c))

    acc = sch.cache_write(conv, 0, "local")
    sch.transform_layout(conv, ("write", 0), lambda n, o, p: (n, p, o))
    n, o, p, rc, rk = sch.get_loops(conv)
    p_outer, p_tile = sch.split(p, tile_factors)
    tile = int(sch.get(p_tile).extent)
    p_mid, p_inner = sch.split(p_tile, pixel_factors)
    o_outer, o_inner = sch.split(o, out_factors)
    sch.reorder(n, p_outer, o_outer, p_mid, rc, rk, p_inner, o_inner)
    outer = parallel_tiles(sch, n, p_outer, images_inside=True)
    sch.compute_inline(acc)
    sch.unroll(p_inner)
    sch.vectorize(o_inner)
    # The output stage copies the block out along the pixels (contiguous in NCHW).
    output = sch.get_sblock("output")
    sch.reverse_compute_at(output, p_mid)
    *_, out_channel, out_pixel = sch.get_loops(output)
    # With a symbolic pixel count each store is tested against it (the last tile is cut), and
    # TVM scalarises the vector: unrolled, hundreds of branches, which doubled the kernel's
    # compile time and gained nothing (measured).
    if isinstance(sch.get(outer).extent, tirx.IntImm):
        sch.unroll(out_channel)
    sch.vectorize(out_pixel)

    sch.compute_at(columns, outer)
    for block in geometry:
        sch.compute_at(block, outer)
        sch.vectorize(sch.get_loops(block)[-1])
    _vectorise_along_channels(sch, columns, layer, tile, pixel_first=True)
    sch.decompose_reduction(conv, rc)


def _pack_weight(sch: s_tir.Schedule, conv) -> None:
    """Make ``conv`` read the weight from a copy laid out ``[channel, tap, output channel]``,
    filled in parallel before everything else."""
    reads = [str(region.source.name) for region in sch.get(conv).reads]
    packed = sch.cache_read(conv, reads.index("weight"), "global")
    sch.transform_layout(packed, ("write", 0), lambda o, c, k: (c, k, o))
    o, c, k = sch.get_loops(packed)
    sch.reorder(c, k, o)
    sch.parallel(sch.fuse(c, k))


def apply_split_output_structure(
    sch: s_tir.Schedule,
    lanes: int,
    out_block: int,
    block_vectors: int,
    k_channels: int,
    parts: int = 2,
) -> None:
    """Schedule the forward PrimFunc in ``sch`` for a small map with many channels, where the
    other structures' pixel tiles waste the most on padding (a 10x10 map is padded to 128
    pixels for them). The columns of the whole map are sampled first, channels-last and in
    parallel; then the GEMM runs in parallel over ``parts`` slices of the output channels,
    blocked along the reduction by ``k_channels`` input channels (one block of columns stays in
    cache while every output block of the slice uses it), with an ``out_block`` x
    ``block_vectors`` register block of vectors of ``lanes`` pixels. It needs no pixel tile, so
    the PrimFunc may pad its pixels to a multiple of ``lanes`` only
    (``definition.forward(..., pixel_quantum=lanes)``). The factors must divide their axes.

    Not used by the default or the design spaces yet: ``lab/small_maps.py`` times it against
    the default."""
    layer = Layer.of(sch)
    conv = sch.get_sblock("conv")
    columns = sch.get_sblock("columns")
    output = sch.get_sblock("output")
    for name in GEOMETRY:
        block = sch.get_sblock(name)
        *outer, inner = sch.get_loops(block)
        if outer:
            sch.parallel(sch.fuse(*outer))
        sch.vectorize(inner)
    channels_last_input(sch, columns)
    _vectorise_along_channels(sch, columns, layer, layer.pixels)
    *outer, _ = sch.get_loops(columns)
    sch.parallel(sch.fuse(*outer))

    n, o, p, rc, rk = sch.get_loops(conv)
    o_part, o_mid, o_inner = sch.split(o, [parts, None, out_block])
    p_block, p_vector, p_lane = sch.split(p, [None, block_vectors, lanes])
    rc_outer, rc_inner = sch.split(rc, [None, k_channels])
    sch.reorder(n, o_part, rc_outer, o_mid, p_block, rc_inner, rk, p_vector, o_inner, p_lane)
    sch.parallel(sch.fuse(n, o_part))
    sch.unroll(p_vector)
    sch.unroll(o_inner)
    sch.vectorize(p_lane)
    sch.decompose_reduction(conv, rc_outer)
    *outer, _ = sch.get_loops(output)
    sch.parallel(sch.fuse(*outer))


def apply_structure(
    sch: s_tir.Schedule, pixel_factors: list, out_factors: list, channels_last: bool = False
) -> None:
    """Schedule the forward PrimFunc in ``sch`` with the column-tile structure described in the
    module docstring; the factors split the pixel and output-channel axes (ints or sampled).
    ``channels_last``: sample the columns from an NHWC copy of the input, vectorised along the
    channels."""
    layer = Layer.of(sch)
    conv = sch.get_sblock("conv")
    columns = sch.get_sblock("columns")
    output = sch.get_sblock("output")
    geometry = geometry_blocks(sch)
    if channels_last:
        channels_last_input(sch, columns)

    outer, p_inner, reduction = _register_block(sch, pixel_factors, out_factors, "pixels")

    # The columns of this pixel tile, then their geometry, just before the GEMM uses them.
    sch.compute_at(columns, outer)
    for block in geometry:
        sch.compute_at(block, outer)

    sch.vectorize(sch.get_loops(output)[-1])
    if channels_last:
        _vectorise_along_channels(sch, columns, layer, int(sch.get(p_inner).extent))
    else:
        sch.vectorize(sch.get_loops(columns)[-1])
    for block in geometry:
        sch.vectorize(sch.get_loops(block)[-1])
    # Last: the zero-fill is split off the reduction so that it, too, is vectorised.
    sch.decompose_reduction(conv, reduction)


def _vectorise_along_channels(
    sch: s_tir.Schedule, columns, layer: Layer, tile: int, pixel_first: bool = False
) -> None:
    """Reorder the column tile's loops (channel, tap, pixel) to (offset group, tap, pixel,
    channel of the group), or with ``pixel_first`` to (pixel, tap, offset group, channel of the
    group), and vectorise the last: the geometry is one value per vector of channels. A long
    channel axis is vectorised in blocks (:data:`CHANNEL_BLOCK`), the loop over the blocks
    innermost but one."""
    # compute_at made one loop per axis longer than one, in this order.
    axes = [
        name
        for name, extent in (("channel", layer.in_channels), ("tap", layer.taps), ("pixel", tile))
        if extent > 1
    ]
    loops = dict(zip(axes, sch.get_loops(columns)[-len(axes) :], strict=True)) if axes else {}
    names = ("pixel", "tap") if pixel_first else ("tap", "pixel")
    order = [loops[name] for name in names if name in loops]
    channel = loops.get("channel")
    if channel is None:
        if order:
            sch.vectorize(order[-1])
        return
    if 1 < layer.offset_groups < layer.in_channels:
        group, channel = sch.split(channel, [layer.offset_groups, None])
        order.insert(len(order) if pixel_first else 0, group)
    block = _channel_block(int(sch.get(channel).extent))
    if block is not None:
        channel_block, channel = sch.split(channel, [None, block])
        order.append(channel_block)
    if order:
        sch.reorder(*order, channel)
    sch.vectorize(channel)


def _channel_block(channels: int) -> int | None:
    """The block of a vectorised channel axis of ``channels`` (see :data:`CHANNEL_BLOCK`), or
    None to vectorise it whole: a short axis, or one no power-of-two block of 16 or more
    divides."""
    if channels <= CHANNEL_BLOCK:
        return None
    return next((b for b in (CHANNEL_BLOCK, 32, 16) if channels % b == 0), None)


def input_is_channels_last(sch: s_tir.Schedule) -> bool:
    """Whether the PrimFunc's input is declared NHWC (a channels_last torch tensor)."""
    attrs = sch.mod["main"].attrs
    return attrs is not None and str(attrs.get("data_layout", "NCHW")) == "NHWC"


def channels_last_input(sch: s_tir.Schedule, consumer, *others) -> None:
    """Make ``consumer`` (and ``others``) read the input from one NHWC copy (stage
    ``data_global``), filled in parallel over the image rows before everything else; nothing to
    do when the input is NHWC already."""
    if input_is_channels_last(sch):
        return
    reads = [str(region.source.name) for region in sch.get(consumer).reads]
    consumers = [consumer, *others] if others else None
    copy = sch.cache_read(consumer, reads.index("data"), "global", consumer_blocks=consumers)
    sch.transform_layout(copy, ("write", 0), lambda n, c, y, x: (n, y, x, c))
    n, c, y, x = sch.get_loops(copy)
    channels, width = (sch.get(loop).extent for loop in (c, x))
    sch.reorder(n, y, c, x)
    sch.parallel(sch.fuse(n, y))
    # (A symbolic width is not known to divide: its rows are copied without the blocks.)
    blocks = all(
        isinstance(e, tirx.IntImm) and int(e) % TRANSPOSE_BLOCK == 0 for e in (channels, width)
    )
    if not isinstance(width, tirx.IntImm):
        # A symbolic width: square blocks too, their columns unrolled (the last block is cut at
        # the row's end) and each column's channels one vector; LLVM then reads the block's
        # rows as vectors, where one column at a time is a gather. Blocks of 4 columns by 16
        # channels took 9% longer on a 64-channel 128x128 layer (Zen 4).
        if int(channels) % TRANSPOSE_BLOCK == 0:
            x_outer, x_inner = sch.split(x, [None, TRANSPOSE_BLOCK])
            c_outer, c_inner = sch.split(c, [None, TRANSPOSE_BLOCK])
            sch.reorder(x_outer, c_outer, x_inner, c_inner)
            sch.unroll(x_inner)
            sch.vectorize(c_inner)
    elif blocks:
        transpose_in_blocks(sch, c, x)


def transpose_in_blocks(sch: s_tir.Schedule, channel, inner):
    """Schedule a copy that moves ``channel`` innermost (an NCHW input to NHWC, say) in square
    blocks of :data:`TRANSPOSE_BLOCK`, ``inner`` being the source's contiguous axis: each row
    of a block is read as one vector and LLVM transposes the block in registers; otherwise it
    picks gather or scatter instructions, which are slow (measured: about 13% of a depthwise
    layer). Both extents must divide by the block; returns the outer loop of ``inner``."""
    c_outer, c_inner = sch.split(channel, [None, TRANSPOSE_BLOCK])
    x_outer, x_inner = sch.split(inner, [None, TRANSPOSE_BLOCK])
    sch.reorder(x_outer, c_outer, c_inner, x_inner)
    sch.unroll(c_inner)
    sch.vectorize(x_inner)
    return x_outer


#: the side of the square blocks in which the input is copied to NHWC
TRANSPOSE_BLOCK = 8


def apply_inline_structure(sch: s_tir.Schedule, pixel_factors: list, channel_factors: list) -> None:
    """Schedule a depthwise-like forward PrimFunc (see :attr:`Layer.samples_used_once`) with the
    inline structure of the module docstring: the columns are inlined into the convolution,
    which reads an NHWC copy of the input and a copy of the weight with the channels last; its
    ``(pixels x channels)`` register block is vectorised along the channels. The factors split
    the pixel and channel axes."""
    conv = sch.get_sblock("conv")
    columns = sch.get_sblock("columns")
    geometry = geometry_blocks(sch)
    channels_last_input(sch, columns)
    _pack_weight(sch, conv)
    sch.compute_inline(columns)

    outer, _, reduction = _register_block(sch, pixel_factors, channel_factors, "channels")
    for block in geometry:
        sch.compute_at(block, outer)
        sch.vectorize(sch.get_loops(block)[-1])
    sch.decompose_reduction(conv, reduction)


def _register_block(sch: s_tir.Schedule, pixel_factors: list, out_factors: list, lanes_along: str):
    """Tile ``conv`` into the parallel loop over (batch, pixel tile) and, under the output-channel
    tiles and the reduction, an (output channels x pixels) register block: vectorised along the
    pixels and unrolled along the channels, or (``lanes_along="channels"``) the other way round.
    The block is accumulated in a local buffer that the output stage (bias, cast, dropping the
    padding pixels) reads directly. Returns the parallel loop, the block's pixel loop and the
    outer reduction loop."""
    conv = sch.get_sblock("conv")
    acc = sch.cache_write(conv, 0, "local")
    if lanes_along == "channels":
        # The vector lanes must be contiguous in the local buffer.
        sch.transform_layout(conv, ("write", 0), lambda n, o, p: (n, p, o))
    n, o, p, rc, rk = sch.get_loops(conv)
    p_outer, p_inner = sch.split(p, pixel_factors)
    o_outer, o_inner = sch.split(o, out_factors)
    unrolled, lanes = (p_inner, o_inner) if lanes_along == "channels" else (o_inner, p_inner)
    sch.reorder(n, p_outer, o_outer, rc, rk, unrolled, lanes)
    outer = parallel_tiles(sch, n, p_outer, images_inside=True)
    sch.compute_inline(acc)
    sch.reverse_compute_at(sch.get_sblock("output"), o_outer)
    sch.unroll(unrolled)
    sch.vectorize(lanes)
    return outer, p_inner, rc
