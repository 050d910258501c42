"""CPU schedules of the backward kernels (LLVM targets).

Two rules (:class:`tvm_deform.schedules.rule.Rule`), one per backward PrimFunc of
:mod:`tvm_deform.ir.definition`:

- ``BackwardCPU`` for ``deform_conv2d_backward`` (every gradient but the input's). Each
  stage runs as its own parallel loop nest:

  - the geometry and derivative coefficients: parallel over (n, group, tap), vectorised along the
    pixels;
  - ``grad_columns``, a GEMM like the forward's: parallel over (batch, pixel tile), a register
    block of input channels x pixels. Where two or more vectors fill an offset group's
    channels (:func:`columns_fit_vectors`) it is written channels-last,
    ``[n, p, k * channels + c]``, each register block transposed as it is stored; else
    ``[n, c, k, p]``. A depthwise layer's (one output channel per input channel) is a
    product, streamed channels-last from channels-last copies of the output's gradient and
    the weight (:func:`_grad_columns_depthwise`);
  - ``sampling_grad``: parallel over (batch, pixel tile), the three terms (mask, y, x) inside
    the loop over the channels, so that each channel's four corners are read once for the
    three. From channels-last columns, vectorised along the channels: the corners are vector
    loads from an NHWC copy of the input, a vector of partial sums per term, its lanes added
    in halves at the end (:func:`_sampling_grad_along_channels`). Otherwise gathers,
    vectorised along the pixels, the channel reduction accumulated in a vector register per
    (group, tap, term);
  - ``weight_sum``, a GEMM that reduces over the pixels. Where a vector divides the input
    channels (and the weight is not grouped, or is depthwise), it is vectorised along the
    channels and its columns are sampled channels-last, as the forward's
    (:func:`_weight_sum_along_channels`, :func:`_weight_sum_depthwise`);
    otherwise ``rfactor`` keeps one partial sum per vector lane so that the long pixel
    reduction is vectorised, parallel over output channels, the partial sums added in a fixed
    order. Either way the result does not depend on the threads.

- ``GradInputCPU`` for ``deform_conv2d_grad_input``: the scatter, parallel over its blocks
  (an image plane, or the planes of a block of channels: :func:`grad_input_block`), which
  never share memory. From channels-last columns, a block reads each sample's column
  gradients as one vector.

No loop that reduces is ever split across threads, so every gradient is bit-identical from run to
run and independent of the thread count.
"""

from __future__ import annotations

import dataclasses

from tvm import s_tir, sym, tirx
from tvm.target import Target
from tvm_deform.schedules.common import lanes as vector_lanes
from tvm_deform.schedules.common import largest_divisor, parallel_tiles, vector_registers
from tvm_deform.schedules.cpu import TRANSPOSE_BLOCK, channels_last_input, transpose_in_blocks
from tvm_deform.schedules.rule import Choices, Rule

from tvm_deform.ir.definition import ConvShape


def _pixel_tile(pixels, lanes: int, vectors: int = 2) -> int:
    """A tile of the pixel axis that divides it (the definition pads it to do so; a symbolic
    axis to a multiple of its quantum, which the kernels for any size make a multiple of two or
    four vectors: :func:`tvm_deform.schedules.backward_pixel_quantum`)."""
    if not isinstance(pixels, int):
        return lanes * vectors
    tile = min(lanes * vectors, pixels)
    return tile if pixels % tile == 0 else pixels


def _elementwise(sch: s_tir.Schedule, block, lanes: int) -> None:
    """Parallel over every loop but the last, which is split and vectorised when it divides.
    A symbolic last loop is split when the PrimFunc's pixel quantum divides it, else left
    scalar."""
    loops = sch.get_loops(block)
    *outer, last = loops
    extent = sch.get(last).extent
    if not isinstance(extent, tirx.IntImm):
        if _divides_padded(sch, extent, lanes):
            last_outer, last_inner = sch.split(last, [None, lanes])
            outer.append(last_outer)
            sch.vectorize(last_inner)
        # The symbolic loops (batch, pixel tiles) outermost. In parallel: the pixel tiles alone
        # when there are some, else the batch fused with the static loops. A fused loop's
        # indices divide by the extents fused inside it: by a symbolic extent, an integer
        # division at run time (and expressions that took seconds to lower).
        symbolic = [loop for loop in outer if not isinstance(sch.get(loop).extent, tirx.IntImm)]
        static = [loop for loop in outer if isinstance(sch.get(loop).extent, tirx.IntImm)]
        if symbolic and static:
            sch.reorder(*symbolic, *static)
        parallel = symbolic[-1:] if len(symbolic) > 1 else symbolic + static
        if parallel:
            sch.parallel(sch.fuse(*parallel) if len(parallel) > 1 else parallel[0])
        return
    extent = int(extent)
    if extent % lanes == 0 and extent > lanes:
        last_outer, last_inner = sch.split(last, [None, lanes])
        outer.append(last_outer)
        sch.vectorize(last_inner)
    elif extent <= 4 * lanes:
        sch.vectorize(last)
    if outer:
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])


def _divides_padded(sch: s_tir.Schedule, extent, lanes: int) -> bool:
    """Whether ``lanes`` divides the symbolic ``extent``: an axis padded to the PrimFunc's pixel
    quantum (a multiple of ``lanes``) does; the unpadded pixels of the offset and mask do not."""
    attrs = sch.mod["main"].attrs
    quantum = int(attrs["pixel_quantum"]) if attrs is not None and "pixel_quantum" in attrs else 0
    if not quantum or quantum % lanes:
        return False
    analyzer = sym.Analyzer()
    return analyzer.can_prove_equal(tirx.floormod(extent, quantum), 0)


def _vectorize_pixels(sch: s_tir.Schedule, p_inner, write_back, tile) -> None:
    """Vectorise a register block's pixel loop and its write-back. A tile of one pixel is left
    alone: its unit loop is gone from the write-back, whose last loop is then another axis."""
    if not isinstance(tile, int) or tile > 1:
        sch.vectorize(p_inner)
        sch.vectorize(sch.get_loops(write_back)[-1])


def _block(sch: s_tir.Schedule, name: str):
    """The block ``name`` of ``sch``, or None when the PrimFunc has no such stage."""
    try:
        return sch.get_sblock(name)
    except Exception:  # noqa: BLE001 - a missing block raises
        return None


#: the stages of which :func:`tvm_deform.ir.definition.backward` holds at least one (the others
#: are left out when their gradients are not asked for)
BACKWARD_STAGES = ("grad_columns", "sampling_grad", "weight_sum")


def is_backward(sch: s_tir.Schedule) -> bool:
    """Whether ``sch`` holds one of :func:`tvm_deform.ir.definition.backward`'s PrimFuncs."""
    return any(_block(sch, name) is not None for name in BACKWARD_STAGES)


@dataclasses.dataclass(frozen=True)
class BackwardChoices:
    """The tile sizes of the backward structure; each an int, or a sampled choice (an
    ``ExprRV`` of :meth:`s_tir.Schedule.sample_categorical`) in a design space."""

    #: input channels per register block of the ``grad_columns`` GEMM
    channel_block: object
    #: pixels per tile of the ``grad_columns`` GEMM
    columns_tile: object
    #: pixels per tile of the ``sampling_grad`` gathers
    sampling_tile: object
    #: output channels per register block of ``weight_sum`` (each holding every tap)
    weight_block: object
    #: vectors of input channels per parallel task of ``weight_sum`` along the channels, or of
    #: a depthwise layer's channels (an int, not sampled: the register block's output channels
    #: are chosen for it)
    weight_vectors: int = 1


class BackwardCPU(Rule):
    """The CPU schedule of ``deform_conv2d_backward`` (see the module docstring), default and
    space. Sampled: the channel block (2 to 16), the two pixel tiles (1 to 4 vectors) and the
    ``weight_sum`` block (1 to 8 output channels, at most 32 vector registers); only values
    that divide their axis and leave every loop longer than one are offered (see
    :class:`tvm_deform.schedules.rule.Choices`)."""

    kernel = "backward"
    target_kind = "llvm"

    #: input channels held in registers at once in the ``grad_columns`` GEMM (its register
    #: block's rows, by two vectors of pixels), with 32 vector registers (AVX-512) and with 16
    #: (AVX2): 8 rows spilled there, and the input's gradient of the 64- to 512-channel layers
    #: took 0.62-0.83x its time with 4 (AVX2 code run on a Zen 4)
    channel_block = 8
    channel_block_16_registers = 4
    #: vector registers the ``weight_sum`` register block may use (taps x output channels), of
    #: 32 and of 16: with 24 of 16 it spilled, and the weight's gradient took 0.86-1.00x its
    #: time with 12 (AVX2 code run on a Zen 4)
    register_vectors = 24
    register_vectors_16_registers = 12
    #: the space's candidates
    channel_block_candidates = (2, 4, 8, 16)
    tile_vectors = (1, 2, 4)
    weight_block_candidates = (1, 2, 3, 4, 6, 8)

    def apply(
        self, func: tirx.PrimFunc, target: Target, tunable: bool = False
    ) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        if not is_backward(sch):
            return None
        choose = Choices(sch, tunable)
        lanes = backward_lanes(sch, target)
        wide = vector_registers(target) >= 32
        rows = self.channel_block if wide else self.channel_block_16_registers
        registers = self.register_vectors if wide else self.register_vectors_16_registers
        channels, pixels, outputs, taps = backward_extents(sch)
        tiles = [lanes * v for v in self.tile_vectors]
        # taps per weight_sum register block: every tap, or along the channels a few of them,
        # times the vectors of channels a task takes
        along_channels = _weight_tile_along_channels(sch, lanes) is not None
        cores = int(target.attrs.get("num-cores", 1))
        per_group = channels // _offset_groups(sch)
        weight_vectors = 1
        if along_channels:
            weight_vectors = _weight_vectors(per_group, lanes, cores)
        elif _weight_tile_depthwise(sch, lanes) is not None:
            weight_vectors = _depthwise_weight_vectors(channels, per_group, lanes, cores)
        block_taps = taps if not along_channels else _tap_block(taps) * weight_vectors

        def tile_fits(tile: int) -> bool:
            return pixels % tile == 0 and tile < pixels

        choices = BackwardChoices(
            channel_block=choose(
                self.channel_block_candidates,
                largest_divisor(channels, rows),
                lambda b: channels % b == 0 and b < channels,
            ),
            columns_tile=choose(tiles, _pixel_tile(pixels, lanes, vectors=2), tile_fits),
            sampling_tile=choose(tiles[:2], _pixel_tile(pixels, lanes, vectors=1), tile_fits),
            weight_block=choose(
                self.weight_block_candidates,
                largest_divisor(outputs, max(1, registers // block_taps)),
                lambda b: outputs % b == 0 and b * block_taps <= 32,
            ),
            weight_vectors=weight_vectors,
        )
        apply_backward_structure(sch, lanes, choices)
        return sch


def backward_extents(sch: s_tir.Schedule) -> tuple[int, int, int, int]:
    """(input channels, padded pixels, output channels, taps) of the backward PrimFunc (output
    channels 1 when it has no ``weight_sum``, which alone uses them)."""
    columns = _block(sch, "grad_columns")
    if columns is None:
        columns = sch.get_sblock("columns")
    _, channels, taps, pixels = (sch.get(loop).extent for loop in sch.get_loops(columns)[:4])
    pixels = int(pixels) if isinstance(pixels, tirx.IntImm) else pixels
    weight_sum = _block(sch, "weight_sum")
    outputs = int(sch.get(sch.get_loops(weight_sum)[0]).extent) if weight_sum is not None else 1
    return int(channels), pixels, outputs, int(taps)


def backward_lanes(sch: s_tir.Schedule, target: Target) -> int:
    """Vector lanes of the accumulator dtype on ``target``."""
    acc = str(sch.get(sch.get_sblock("sample_coef")).writes[0].source.dtype)
    return vector_lanes(target, acc)


def apply_backward_structure(sch: s_tir.Schedule, lanes: int, choices: BackwardChoices) -> None:
    """Schedule the backward PrimFunc in ``sch`` with the structure of the module docstring;
    the stages it does not hold are skipped."""
    along_channels = columns_along_channels(sch, lanes)
    sampling = _block(sch, "sampling_grad")
    columns = None
    if _weight_tile_along_channels(sch, lanes) or _weight_tile_depthwise(sch, lanes):
        columns = sch.get_sblock("columns")
    # One NHWC copy of the input for the stages that sample it along the channels. Each block
    # is then passed on to its own schedule: a block that only cache_read's list of consumers
    # names is dropped from a simplified trace, which MetaSchedule then fails to replay.
    readers = [b for b in (sampling if along_channels else None, columns) if b is not None]
    if readers:
        channels_last_input(sch, *readers)
    # A depthwise layer's stages that read the output's gradient along the channels share one
    # channels-last copy of it (the blocks passed on, as above).
    depthwise_columns = _block(sch, "grad_columns") is not None and along_channels
    depthwise_columns = depthwise_columns and _depthwise_columns(sch)
    gradient_readers = {
        name: sch.get_sblock(name)
        for name, reads in (
            ("grad_columns", depthwise_columns),
            ("weight_sum", _weight_tile_depthwise(sch, lanes) is not None),
        )
        if reads
    }
    if gradient_readers:
        _channels_last_gradient(sch, *gradient_readers.values())
    if _block(sch, "grad_columns") is not None:
        if depthwise_columns:
            _grad_columns_depthwise(
                sch, gradient_readers["grad_columns"], lanes, choices.columns_tile
            )
        else:
            _grad_columns(sch, choices.channel_block, choices.columns_tile, along_channels)
    if sampling is not None:
        if along_channels:
            _sampling_grad_along_channels(sch, sampling, lanes, choices.sampling_tile)
        else:
            _sampling_grad(sch, choices.sampling_tile)
    scheduled = set()
    if _block(sch, "weight_sum") is not None:
        scheduled |= _weight_sum(sch, lanes, choices, columns, gradient_readers.get("weight_sum"))
    stages = ("offset_pixels", "mask_pixels", "grad_output_pixels")  # a symbolic PrimFunc's
    for name in (*stages, "sample_rows", "sample_cols", "sample_coef", "grad_coef", "columns"):
        block = _block(sch, name) if name not in scheduled else None
        if block is not None:
            _elementwise(sch, block, lanes)
    for name in ("grad_offset", "grad_mask", "grad_weight", "bias_sum", "grad_bias"):
        block = _block(sch, name)
        if block is None:
            continue
        if name == "bias_sum":
            sch.parallel(sch.get_loops(block)[0])
        else:
            _elementwise(sch, block, lanes)


def _grad_columns(sch: s_tir.Schedule, rows, tile, channels_last: bool) -> None:
    """``grad_columns``, a GEMM: parallel over (image, tile of pixels), a register block of
    ``rows`` input channels x the tile's pixels (a vector or a few), each weight a broadcast.
    ``channels_last``: the workspace laid out ``[image, pixel, tap x channel]`` (see
    :func:`columns_along_channels`), the register block written back transposed, each pixel's
    ``rows`` channels one vector store (the same GEMM: the other way round, vectorised along
    the channels, it took up to 1.5x as long on 512 channels, measured on a Zen 4)."""
    block = sch.get_sblock("grad_columns")
    n, c, k, p, ro = sch.get_loops(block)
    channels = int(sch.get(c).extent)
    acc = sch.cache_write(block, 0, "local")
    p_outer, p_inner = sch.split(p, [None, tile])
    c_outer, c_inner = sch.split(c, [None, rows])
    sch.reorder(n, p_outer, c_outer, k, ro, c_inner, p_inner)
    parallel_tiles(sch, n, p_outer)
    sch.unroll(c_inner)
    if channels_last:
        sch.transform_layout(acc, ("write", 0), lambda n, c, k, p: (n, p, k * channels + c))
        sch.reverse_compute_at(acc, k, preserve_unit_loops=True)
        channel, _, pixel = sch.get_loops(acc)[-3:]
        sch.reorder(pixel, channel)
        sch.unroll(pixel)
        sch.vectorize(channel)
        sch.vectorize(p_inner)
    else:
        sch.reverse_compute_at(acc, k)
        _vectorize_pixels(sch, p_inner, acc, tile)
    sch.decompose_reduction(block, ro)


def _depthwise_columns(sch: s_tir.Schedule) -> bool:
    """Whether ``grad_columns`` sums over one output channel per input channel (a depthwise
    layer): each column gradient a product of a weight and an output gradient."""
    block = sch.get_sblock("grad_columns")
    ro = sch.get_loops(block)[-1]
    weight = next(r.source for r in sch.get(block).reads if r.source.name == "weight")
    return int(sch.get(ro).extent) == 1 and int(weight.shape[1]) == 1


def _grad_columns_depthwise(sch: s_tir.Schedule, block, lanes: int, tile) -> None:
    """A depthwise layer's ``grad_columns`` channels-last, ``[image, pixel, tap x channel]``:
    each a product of the weight (copied ``[tap, channel]``) and the output gradient (the
    channels-last copy the weight's gradient shares, :func:`_channels_last_gradient`),
    vectorised along the channels, parallel over (image, tile of pixels): a stream of vector
    stores (``block``: the ``grad_columns`` block). As a GEMM of one output channel,
    transposing its register blocks as it stored them, it took about a fifth of the depthwise
    backward's time; streamed, the input's gradient of depthwise layers took 0.78-0.81x its
    time (2-core Zen 4). The sum over its one output channel starts from zero, so the bits
    are the GEMM's."""
    n, c, k, p, ro = sch.get_loops(block)
    channels = int(sch.get(c).extent)
    reads = [str(region.source.name) for region in sch.get(block).reads]
    weight = sch.cache_read(block, reads.index("weight"), "global")
    sch.transform_layout(weight, ("write", 0), lambda o, i, k: (k, i, o))
    sch.transform_layout(block, ("write", 0), lambda n, c, k, p: (n, p, k * channels + c))
    p_outer, p_inner = sch.split(p, [None, tile])
    c_outer, c_inner = sch.split(c, [None, lanes])
    sch.reorder(n, p_outer, p_inner, k, c_outer, ro, c_inner)
    parallel_tiles(sch, n, p_outer)
    sch.vectorize(c_inner)
    sch.decompose_reduction(block, ro)


def columns_fit_vectors(channels: int, offset_groups: int, lanes: int) -> bool:
    """Whether the column gradient of a layer of ``channels`` input channels is laid out
    channels-last, ``[image, pixel, tap x channel]`` (see :func:`_grad_columns`): where
    vectors of at least 4 lanes divide the channels of every offset group, and there are two
    or more of them, so that the sampling gradient sums the channels in vectors and the
    input's scatter reads them in blocks. With one vector a group, the sum of its lanes at
    every pixel costs as much as the vectors save: the sampling gradient of 4 offset groups
    of 16 channels took 1.06x as long so (Zen 4)."""
    per_group = channels // offset_groups
    return lanes >= 4 and per_group % lanes == 0 and per_group >= 2 * lanes


def columns_along_channels(sch: s_tir.Schedule, lanes: int) -> bool:
    """Whether the backward PrimFunc in ``sch`` gets its column gradient channels-last: it
    computes one (the input's or the sampling gradients are asked for), not laid out so yet,
    and :func:`columns_fit_vectors`."""
    block = _block(sch, "grad_columns")
    if block is None or len(sch.get(block).writes[0].source.shape) != 4:
        return False
    channels = int(sch.get(sch.get_loops(block)[1]).extent)
    return columns_fit_vectors(channels, _offset_groups(sch), lanes)


def _offset_groups(sch: s_tir.Schedule) -> int:
    """The offset groups of the backward PrimFunc in ``sch``."""
    return int(sch.get(sch.get_sblock("sample_rows")).writes[0].source.shape[1])


def _sampling_grad_along_channels(sch: s_tir.Schedule, block, lanes: int, tile) -> None:
    """``sampling_grad`` vectorised along the channels, from the channels-last column gradient
    and the input's NHWC copy: each corner one vector load of channels, its coefficients
    broadcasts. Parallel over (image, tile of pixels); per (pixel, group, tap), a vector of
    partial sums per term (``rfactor`` over the vector's lanes: lane ``l`` sums the channels
    ``l, l + lanes, ...`` in order), then its lanes added in halves
    (:func:`_sum_lanes_in_halves`). The order is fixed."""
    *_, rc = sch.get_loops(block)
    _, lane = sch.split(rc, [None, lanes])
    partial = sch.rfactor(lane, 0)
    sch.set_scope(partial, 0, "local")
    sch.transform_layout(partial, ("write", 0), lambda l, n, g, k, t, p: (n, g, k, t, p, l))
    halves = _sum_lanes_in_halves(sch, block, lanes)
    n, g, k, t, p, rc_outer, lane = sch.get_loops(partial)
    p_outer, p_inner = sch.split(p, [None, tile])
    sch.reorder(n, p_outer, p_inner, g, k, rc_outer, t, lane)
    parallel_tiles(sch, n, p_outer)
    sch.unroll(t)
    sch.vectorize(lane)
    sch.decompose_reduction(partial, rc_outer)
    for half in halves:
        sch.reverse_compute_at(half, k, preserve_unit_loops=True)
        lane, which_half, *_, t, _ = sch.get_loops(half)[-7:]
        sch.reorder(t, which_half, lane)
        sch.unroll(t)
        sch.unroll(which_half)
        sch.vectorize(lane)
        sch.decompose_reduction(half, which_half)
    sch.reverse_compute_at(block, k, preserve_unit_loops=True)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, k, preserve_unit_loops=True)


def _sum_lanes_in_halves(sch: s_tir.Schedule, block, lanes: int) -> list:
    """Rewrite ``block``, a sum over the last loop's ``lanes`` partial sums, as a sequence of
    halvings: ``rfactor`` splits off a stage that adds the upper half of the vector to the
    lower half (in ``lanes / 2`` lanes), then again on what is left, until one lane remains:
    log2(lanes) vector adds in place of a chain of ``lanes`` scalar adds, each extracting a
    lane (the offset's and mask's gradients of the 64-channel layers took 0.94-0.97x their
    time so, Zen 4). Returns the halving stages, first to last, not yet placed."""
    halves = []
    width = lanes
    while width > 1:
        width //= 2
        lane = sch.get_loops(block)[-1]
        _, lower_lanes = sch.split(lane, [2, width])
        half = sch.rfactor(lower_lanes, 0)
        sch.set_scope(half, 0, "local")
        sch.transform_layout(half, ("write", 0), lambda l, n, g, k, t, p: (n, g, k, t, p, l))
        halves.append(half)
    return halves


def _sampling_grad(sch: s_tir.Schedule, tile) -> None:
    block = sch.get_sblock("sampling_grad")
    n, g, k, t, p, rc = sch.get_loops(block)
    acc = sch.cache_write(block, 0, "local")
    p_outer, p_inner = sch.split(p, [None, tile])
    sch.reorder(n, p_outer, g, k, rc, t, p_inner)
    parallel_tiles(sch, n, p_outer)
    sch.reverse_compute_at(acc, k)
    sch.unroll(t)
    _vectorize_pixels(sch, p_inner, acc, tile)
    sch.decompose_reduction(block, rc)


def _weight_sum(
    sch: s_tir.Schedule, lanes: int, choices: BackwardChoices, columns, depthwise_block=None
) -> set[str]:
    """Schedule ``weight_sum`` (and with it, along the channels, the block ``columns``, None
    otherwise; ``depthwise_block``: the ``weight_sum`` block of a depthwise layer, which reads
    the output's gradient channels-last); return the names of the other stages it
    scheduled."""
    tile = _weight_tile_along_channels(sch, lanes)
    if tile is not None:
        _weight_sum_along_channels(
            sch, lanes, tile, choices.weight_block, choices.weight_vectors, columns
        )
        return {"columns"}
    tile = _weight_tile_depthwise(sch, lanes)
    if tile is not None:
        _weight_sum_depthwise(sch, depthwise_block, lanes, tile, choices.weight_vectors, columns)
        return {"columns"}
    block = sch.get_sblock("weight_sum")
    o, c, k, wn, wp = sch.get_loops(block)
    pixels = sch.get(wp).extent
    if not isinstance(pixels, tirx.IntImm):
        pixels = lanes * 2 if _divides_padded(sch, pixels, lanes) else 1  # any size
    if int(pixels) % lanes or int(pixels) <= lanes:
        sch.parallel(o)
        return set()
    wp_outer, wp_inner = sch.split(wp, [None, lanes])
    partial = sch.rfactor(wp_inner, 0)
    # partial[lane, o, c, k]: a vector of partial sums per weight element. Each thread takes
    # one input channel, whose columns (taps x pixels) stay in cache while every output
    # channel passes over them; the register block is (a few output channels) x (every tap)
    # x (one vector of pixels), so each loaded vector feeds several FMAs.
    po, pc, pk, pn, pp, lane = sch.get_loops(partial)
    po_outer, po_inner = sch.split(po, [None, choices.weight_block])
    sch.reorder(pc, po_outer, pn, pp, po_inner, pk, lane)
    sch.parallel(pc)
    local = sch.cache_write(partial, 0, "local")
    # Lanes innermost in the register block, so that each lane vector is contiguous.
    sch.transform_layout(partial, ("write", 0), lambda l, o, c, k: (o, c, k, l))
    sch.reverse_compute_at(local, po_outer)
    sch.unroll(po_inner)
    sch.unroll(pk)
    sch.vectorize(lane)
    sch.decompose_reduction(partial, pn)
    # The lanes are then added in order by the original block, once per weight element,
    # right after the register block is complete.
    sch.reverse_compute_at(block, po_outer)
    return set()


def _tap_block(taps: int) -> int:
    """Taps per register block of ``weight_sum`` along the channels."""
    return largest_divisor(taps, 3)


def _weight_tile_depthwise(sch: s_tir.Schedule, lanes: int) -> int | None:
    """The pixel tile of a depthwise ``weight_sum`` along its channels (see
    :func:`_weight_sum_depthwise`), or None where that structure does not apply: not one
    input and one output channel per weight group, channels that no vector divides, or a
    symbolic pixel count not known to divide into tiles."""
    block = _block(sch, "weight_sum")
    if block is None:
        return None
    o, c, _, _, wp = sch.get_loops(block)
    outputs, per_group = int(sch.get(o).extent), int(sch.get(c).extent)
    columns = sch.get_sblock("columns")
    if per_group != 1 or outputs != int(sch.get(sch.get_loops(columns)[1]).extent):
        return None
    return _pixel_tile_of_weight_sum(sch, wp, outputs, lanes)


def _pixel_tile_of_weight_sum(sch: s_tir.Schedule, wp, channels: int, lanes: int) -> int | None:
    """The tile of the pixel loop ``wp`` of ``weight_sum`` along ``channels`` channels, up to
    four vectors of pixels: None where no vector divides the channels or a symbolic pixel
    count is not known to divide into tiles of two vectors or more."""
    if channels % lanes:
        return None
    pixels = sch.get(wp).extent
    if isinstance(pixels, tirx.IntImm):
        return largest_divisor(int(pixels), 4 * lanes)
    return next((t for t in (4 * lanes, 2 * lanes) if _divides_padded(sch, pixels, t)), None)


def dense_weight_along_channels(shape: ConvShape, lanes: int) -> bool:
    """Whether the default schedule sums the gradient of ``shape``'s weight along its input
    channels as a GEMM in tiles of pixels (:func:`_weight_sum_along_channels`): where the
    weight is not grouped and vectors of ``lanes`` divide the channels."""
    return shape.weight_groups == 1 and shape.in_channels % lanes == 0


def _weight_tile_along_channels(sch: s_tir.Schedule, lanes: int) -> int | None:
    """The pixel tile of ``weight_sum`` along the input channels (see
    :func:`_weight_sum_along_channels`), or None where that structure does not apply: grouped
    weights, channels that no vector divides, or a symbolic pixel count not known to divide
    into tiles."""
    block = _block(sch, "weight_sum")
    if block is None:
        return None
    _, c, _, _, wp = sch.get_loops(block)
    channels = int(sch.get(c).extent)
    columns = sch.get_sblock("columns")
    if channels != int(sch.get(sch.get_loops(columns)[1]).extent):
        return None
    return _pixel_tile_of_weight_sum(sch, wp, channels, lanes)


def _weight_vectors(per_group: int, lanes: int, cores: int) -> int:
    """Vectors of input channels per parallel task of :func:`_weight_sum_along_channels`, of
    an offset group of ``per_group`` channels: two where they lie in one offset group and
    still leave a task for every core, else one. A tile's columns are then sampled two
    vectors at a time, each sample's corner addresses computed once for both, and the
    register block takes half as many output channels (a training step of a dense 64-channel
    layer at 128x128 took 0.91x its time so, of the R50 layers 0.94-0.98x, on a 2-core Zen
    4; four vectors, with two output channels a block, made the weight gradient 1.3-1.5x
    slower; two vectors across offset groups sampled their columns one element at a
    time)."""
    vectors = per_group // lanes
    return 2 if vectors % 2 == 0 and vectors // 2 >= cores else 1


def _weight_sum_along_channels(
    sch: s_tir.Schedule, lanes: int, tile: int, outputs_per_block, vectors: int, columns
) -> None:
    """``weight_sum`` as a GEMM vectorised along the input channels, its columns sampled
    channels-last in tiles of ``tile`` pixels, as the forward samples them:

    - the input is copied to NHWC once; the columns of a tile of pixels are laid out
      ``[pixel, tap, channel]`` and sampled ``vectors`` vectors of channels per (pixel, tap),
      the geometry a broadcast;
    - parallel over groups of ``vectors`` vectors of input channels; under it, per image and
      tile of pixels, the tile's columns of the group, then a register block of
      (``outputs_per_block`` output channels) x (a few taps) x (``vectors`` vectors of
      channels) accumulated over the tile's pixels, each column vector feeding every output
      channel of the block;
    - each tile's sums start from zero in the register block (``rfactor`` over the tiles) and
      are added into the sums of the whole reduction, kept ``[output channel, tap, channel]``,
      right after the block (while they are in registers; a pass over all of a tile's sums
      after the tile cost a training step of a 512-channel layer 5-8%, measured on a Zen 4): a
      sum runs over a tile's pixels, then over the tiles, not over every pixel in one chain
      (a float32 weight gradient of a batch of 8 at 28x28 was 1.7x further from float64 in
      one chain than torchvision's; blocked, level with it). The order is fixed: the result
      does not depend on the threads.
    """
    block = sch.get_sblock("weight_sum")
    sch.transform_layout(columns, ("write", 0), lambda n, c, k, p: (n, p, k, c))
    sch.transform_layout(block, ("write", 0), lambda o, c, k: (o, k, c))
    taps = int(sch.get(sch.get_loops(block)[2]).extent)
    partial = _sums_per_tile(sch, block, tile)
    o, c, k, tiles, wp_inner = sch.get_loops(partial)
    c_outer, c_vectors, c_inner = sch.split(c, [None, vectors, lanes])
    o_outer, o_inner = sch.split(o, [None, outputs_per_block])
    k_outer, k_inner = sch.split(k, [None, _tap_block(taps)])
    sch.reorder(c_outer, tiles, o_outer, k_outer, wp_inner, o_inner, k_inner, c_vectors, c_inner)
    sch.parallel(c_outer)
    sch.unroll(o_inner)
    sch.unroll(k_inner)
    sch.unroll(c_vectors)
    sch.vectorize(c_inner)
    sch.decompose_reduction(partial, wp_inner)
    # Unit loops kept, here and for the columns: a design space's trace must make the same
    # loops whatever the sampled block (a replayed trace checks how many loops each
    # instruction returns).
    sch.reverse_compute_at(block, k_outer, preserve_unit_loops=True)
    *_, output, channel, tap = sch.get_loops(block)
    sch.reorder(output, tap, channel)
    sch.vectorize(channel)
    sch.decompose_reduction(block, tiles)
    _columns_per_tile(sch, columns, tiles)


def _sums_per_tile(sch: s_tir.Schedule, block, tile: int):
    """Split ``weight_sum``'s reduction over (image, pixel) into tiles of ``tile`` pixels and
    return the ``rfactor`` block of each tile's sums (loops: its three axes, the tiles, the
    tile's pixels); ``block`` then adds them over the tiles."""
    *_, wn, wp = sch.get_loops(block)
    wp_outer, _ = sch.split(wp, [None, tile])
    return sch.rfactor(sch.fuse(wn, wp_outer), 0)


def _columns_per_tile(sch: s_tir.Schedule, columns, tiles) -> None:
    """Sample the (channels-last) columns of each tile under the loop ``tiles``: per pixel
    and tap, the channels of the enclosing task, vectorised."""
    sch.compute_at(columns, tiles, preserve_unit_loops=True)
    *_, channel, tap, pixel = sch.get_loops(columns)
    sch.reorder(pixel, tap, channel)
    sch.vectorize(channel)


def _depthwise_weight_vectors(channels: int, per_group: int, lanes: int, cores: int) -> int:
    """Vectors of channels per parallel task of :func:`_weight_sum_depthwise`: the most, up to
    four, that lie in one offset group of ``per_group`` channels and still leave a task for
    every core. Each sample's corner addresses are computed once for all of a task's
    vectors: on a 2-core Zen 4, the depthwise weight gradient took 0.77-0.83x its time with
    two vectors a task and 0.62-0.75x with four (3x3 to 7x7 kernels, 128 to 512 channels),
    though four vectors of every tap spill the register block; eight gained nothing over
    four."""
    vectors = 4
    while vectors > 1 and (per_group % (vectors * lanes) or channels // (vectors * lanes) < cores):
        vectors //= 2
    return vectors


def _weight_sum_depthwise(
    sch: s_tir.Schedule, block, lanes: int, tile: int, vectors: int, columns
) -> None:
    """A depthwise ``weight_sum`` (one input and one output channel per group: each weight
    element a dot product of one channel's output gradient with its columns) vectorised along
    the channels, as :func:`_weight_sum_along_channels` is: the columns of a tile of pixels
    sampled channels-last from the NHWC copy of the input, ``vectors`` vectors of channels
    per (pixel, tap); the output gradient read from its channels-last copy
    (:func:`_channels_last_gradient`, for ``block``, the ``weight_sum`` block); parallel over
    groups of ``vectors`` vectors of channels, a register block of every tap x ``vectors``
    vectors per tile, its sums added into the whole sums (kept ``[tap, channel]``) after the
    tile, in a fixed order."""
    sch.transform_layout(columns, ("write", 0), lambda n, c, k, p: (n, p, k, c))
    sch.transform_layout(block, ("write", 0), lambda o, c, k: (c, k, o))
    partial = _sums_per_tile(sch, block, tile)
    o, c, k, tiles, wp_inner = sch.get_loops(partial)
    o_outer, o_vectors, o_inner = sch.split(o, [None, vectors, lanes])
    sch.reorder(o_outer, tiles, c, wp_inner, k, o_vectors, o_inner)
    sch.parallel(o_outer)
    sch.unroll(k)
    sch.unroll(o_vectors)
    sch.vectorize(o_inner)
    sch.decompose_reduction(partial, wp_inner)
    sch.reverse_compute_at(block, c, preserve_unit_loops=True)
    *_, output, channel, tap = sch.get_loops(block)
    sch.reorder(channel, tap, output)
    sch.vectorize(output)
    sch.decompose_reduction(block, tiles)
    _columns_per_tile(sch, columns, tiles)


def _channels_last_gradient(sch: s_tir.Schedule, consumer, *others) -> None:
    """Make ``consumer`` (and ``others``) read the output's gradient from one copy laid out
    ``[n, pixel, channel]`` (:func:`_channels_last_copy`)."""
    reads = [str(region.source.name) for region in sch.get(consumer).reads]
    gradient = next(i for i, name in enumerate(reads) if name.startswith("grad_output"))
    consumers = [consumer, *others]
    copy = sch.cache_read(consumer, gradient, "global", consumer_blocks=consumers)
    sch.transform_layout(copy, ("write", 0), lambda n, o, p: (n, p, o))
    _channels_last_copy(sch, copy)


def _channels_last_copy(sch: s_tir.Schedule, copy) -> None:
    """Schedule the copy ``copy`` of an ``[n, channel, pixel]`` buffer into ``[n, pixel,
    channel]``: in square blocks (:func:`tvm_deform.schedules.cpu.transpose_in_blocks`),
    parallel over the images and rows of blocks. Where the block does not divide both axes
    (a symbolic pixel count divides when its quantum does), the pixels are the inner loop,
    not vectorised, parallel over the images."""
    n, channel, pixel = sch.get_loops(copy)
    channels, pixels = (sch.get(loop).extent for loop in (channel, pixel))
    if int(channels) % TRANSPOSE_BLOCK or not (
        int(pixels) % TRANSPOSE_BLOCK == 0
        if isinstance(pixels, tirx.IntImm)
        else _divides_padded(sch, pixels, TRANSPOSE_BLOCK)
    ):
        sch.parallel(n)
        return
    rows = transpose_in_blocks(sch, channel, pixel)
    if isinstance(sch.get(rows).extent, tirx.IntImm):
        sch.parallel(sch.fuse(n, rows))
    else:
        sch.parallel(rows)


def grad_input_block(shape: ConvShape, target: Target) -> int:
    """The channels a block of the input's scatter fills at once on ``target``: the most, up
    to a vector of the accumulator, that divide an offset group's channels (a power of two),
    fewer (down to 4) while the blocks of one image would leave some of the target's cores
    idle; 1 where no such block divides the group. A depthwise layer's blocks are four
    vectors where they divide the group and every core still gets a block: each sample's
    corner addresses are then computed once for four vectors (on a 2-core Zen 4 the input's
    gradient of depthwise layers of 128 to 512 channels took 0.85-0.94x its time, maps of
    14x14 to 100x168; blocks of two vectors, on 64 channels, took 1.06x, and on dense layers
    wider blocks were 0.96-1.04x)."""
    per_group = shape.in_channels // shape.offset_groups
    cores = int(target.attrs.get("num-cores", 1))
    block = vector_lanes(target, shape.accumulator_dtype)
    depthwise = shape.weight_groups == shape.in_channels == shape.out_channels
    if depthwise and per_group % (4 * block) == 0 and shape.in_channels // (4 * block) >= cores:
        return 4 * block
    while block > 1 and per_group % block:
        block //= 2
    while block > 4 and shape.in_channels // block < cores:
        block //= 2
    return block if block >= 4 else 1


class GradInputCPU(Rule):
    """The CPU schedule of ``deform_conv2d_grad_input``: parallel over its blocks (image
    planes, or blocks of channels). It has nothing to tune: its space is the default alone."""

    kernel = "grad_input"
    target_kind = "llvm"

    def apply(
        self, func: tirx.PrimFunc, target: Target, tunable: bool = False
    ) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        block = _block(sch, "grad_input")
        if block is None:  # not the grad_input PrimFunc
            return None
        n, c = sch.get_loops(block)[:2]
        sch.parallel(sch.fuse(n, c))
        return sch
