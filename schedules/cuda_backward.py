"""CUDA schedules of the backward kernels (deterministic: no atomics).

- ``BackwardCUDA`` for ``deform_conv2d_backward`` (every gradient but the input's). Its two
  matrix products run as tiled GEMMs, as torchvision hands them to cuBLAS:

  - the column gradient (``grad_columns[n, c, k, p]``, a sum over a group's output channels
    of the weight times the output's gradient): a thread block per (image and tap, tile of
    input channels, tile of pixels);
  - the weight's gradient (``weight_sum[o, c, k]``, a sum over the images and pixels of the
    output's gradient times the recomputed columns): a thread block per (tap, tile of output
    channels, tile of input channels), its cast to the weight's dtype written from the
    registers.

  Each thread accumulates a register block of 4 x 4 outputs; the reduction goes in chunks that
  the block's threads first copy to shared memory (both operands). Where the weight's tiles
  alone would leave most of the GPU idle, its reduction over the pixels is split into parts,
  each summed by thread blocks of their own, and a last kernel adds the parts in a fixed
  order. Every sum (or part) is taken by one thread in the definition's order, so the result
  is the same bits on every run. A GEMM whose tile would straddle two weight groups (a grouped
  layer with fewer channels per group than a tile; a depthwise layer has no product to tile)
  keeps one thread per element.

  The other stages (geometry, the sampling gradients, the recomputed columns, the bias's
  gradient) run as kernels of their own with one thread per output element; their reductions
  (over a group's channels for the sampling gradients, over the pixels for the bias's) run
  inside the thread in a fixed order. A sampling gradient's thread takes all three terms of
  its (image, offset group, tap, pixel) (the mask's and the two coordinates'), reading each
  channel's four corners once for them, and computes their derivative coefficients in
  registers. Stages that are not arguments of the PrimFunc live in scratch memory, which comes
  from torch's caching allocator (see :mod:`tvm_deform.runtime.workspace`).
- ``GradInputCUDA`` for ``deform_conv2d_grad_input`` as a gather
  (``definition.grad_input_tiles``): a thread block per (image, run of channels, 8x8 tile of
  the input plane), a thread per channel summing the tile's pixels in shared memory. Each
  thread adds the samples that land in its tile in the scatter's order and no two threads
  write the same sum, so no atomics are needed and the gradient is the same bits on every run
  (and, for finite column gradients, the scatter's bits).

``emulate=True`` applies the same structure without the thread bindings and with the shared
buffers in global memory, so that an LLVM target can run it: the tests check on the CPU that it
computes torchvision's gradients.
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.s_tir.schedule import LoopRV
from tvm.target import Target
from tvm_deform.schedules.common import largest_divisor
from tvm_deform.schedules.cuda import SplitReductionCUDA
from tvm_deform.schedules.rule import Choices, Rule

#: the most thread blocks along a grid's ``y`` (and ``z``) axis
GRID_Y = 65535


class BackwardCUDA(Rule):
    """The CUDA schedule of the gradients kernel (see the module docstring)."""

    kernel = "backward"
    target_kind = "cuda"

    #: threads per block of the stages with one thread per element
    threads = 256
    #: (threads, registers) along a GEMM tile's rows (input channels of the column gradient,
    #: output channels of the weight's), the first whose tile divides a weight group's rows
    row_tiles = ((8, 4), (8, 2), (4, 2), (2, 2), (2, 1))
    #: the same along its columns (pixels of the column gradient, input channels of the
    #: weight's); pixels are padded to a multiple of every tile here
    column_tiles = ((16, 4), (16, 2), (8, 2), (4, 2), (2, 2), (2, 1))
    #: reduction steps per shared-memory chunk, at most: a divisor of the reduction's extent
    #: (over the pixels, of their padded count, or of the quantum it is a multiple of)
    chunk = 16
    #: what a design space samples: threads and registers along a tile's axis, chunk sizes
    tile_threads, tile_registers, chunk_options = (4, 8, 16), (2, 4), (8, 16, 32)
    #: the most parts the weight gradient's reduction over the pixels is split into, and the
    #: fewest pixels a part holds where the pixel count is known
    max_parts, min_part_pixels = 16, 256

    def __init__(self, emulate: bool = False):
        self.emulate = emulate

    def apply(
        self, func: tirx.PrimFunc, target: Target, tunable: bool = False
    ) -> s_tir.Schedule | list[s_tir.Schedule] | None:
        """The default schedule; as a design space, two: the weight's reduction in one pass,
        and split into a sampled number of parts (where its chunks can be split). Both sample
        the GEMMs' tiles, and the column gradient's chunk, among sizes that divide their
        extents (for any size, the pixels' quantum), starting at the default's; the weight
        gradient's chunk is sampled in one pass, and fixed where split (one that every sampled
        count of parts divides)."""
        sch = s_tir.Schedule(func)
        names = _names(sch)
        if "sample_coef" not in names or "conv" in names:
            return None  # not the gradients kernel of the definition
        if not tunable:
            return self._schedule(sch, target, Choices(sch, False))
        spaces = [self._schedule(sch, target, Choices(sch, True), parts=1)]
        split = s_tir.Schedule(func)
        if "weight_sum" in names and self._weight_tiles(split) and self._part_candidates(split):
            spaces.append(self._schedule(split, target, Choices(split, True), parts="sampled"))
        return spaces

    def _schedule(
        self, sch: s_tir.Schedule, target: Target, choose: Choices, parts: int | str | None = None
    ) -> s_tir.Schedule:
        """Lay out every stage of ``sch``; ``parts`` of the weight's reduction: None for
        :meth:`parts`' choice, an int, or ``"sampled"`` (a sampled choice of at least 2)."""
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        names = _names(sch)
        tiled = set()
        if "grad_columns" in names and self._column_gradient(sch, choose):
            tiled.add("grad_columns")
        if "weight_sum" in names and self._weight_gradient(sch, target, choose, parts):
            tiled |= {"weight_sum", "grad_weight"}
        if "sampling_grad" in names:
            self._sampling_gradient(sch)
            tiled |= {"sampling_grad", "grad_coef"}
        for block, name in zip(blocks, names, strict=True):
            if name not in tiled:
                thread_per_element(sch, block, self.threads, self.emulate)
        return sch

    def _sampling_gradient(self, sch: s_tir.Schedule) -> None:
        """One thread per (image, offset group, tap, pixel) computes every term of its
        sampling gradient (the mask's and the two coordinates'), so that the four corners of
        each channel it runs through are read once for all of them; the derivative
        coefficients are computed in the thread, in registers."""
        block = sch.get_sblock("sampling_grad")
        n, g, k, t, p, rc = sch.get_loops(block)
        # Threads that divide the loops they spread over: a thread past the end would compute
        # its coefficients from out-of-bounds reads (compute_at does not carry the
        # consumer's predicate to them).
        extents = [sch.get(loop).extent for loop in (n, g, k, p)]
        if all(isinstance(extent, tirx.IntImm) for extent in extents):
            threads = largest_divisor(math.prod(int(e) for e in extents), self.threads)
        else:
            threads = largest_divisor(_pixel_multiple(sch, p), self.threads)
        sch.reorder(n, g, k, p, rc, t)
        thread = spread(sch, [n, g, k, p], threads, self.emulate)
        sums = sch.cache_write(block, 0, "local")
        sch.reverse_compute_at(sums, thread)
        coefficients = sch.get_sblock("grad_coef")
        sch.set_scope(coefficients, 0, "local")
        sch.compute_at(coefficients, thread)
        thread_var = sch.get(thread).loop_var
        loops = sch.get_loops(coefficients)
        depth = 1 + next(i for i, x in enumerate(loops) if sch.get(x).loop_var.same_as(thread_var))
        for loop in loops[depth:]:
            sch.unroll(loop)
        sch.unroll(t)
        sch.decompose_reduction(block, rc)

    def _column_gradient(self, sch: s_tir.Schedule, choose: Choices) -> bool:
        """Tile ``grad_columns``: rows a group's input channels, columns the pixels, the
        reduction a group's output channels. False (untouched) where a tile of rows would
        straddle two groups, or no tile of columns divides the padded pixels."""
        weight_in, out_per_group = _groups(sch)
        block = sch.get_sblock("grad_columns")
        n, c, k, p, ro = sch.get_loops(block)
        rows = self._tile(choose, self.row_tiles, weight_in)
        columns = self._tile(choose, self.column_tiles, _pixel_multiple(sch, p))
        if rows is None or columns is None:
            return False
        sch.reorder(n, k, c, p, ro)
        chunks = sch.split(ro, [None, self._chunk(choose, out_per_group)])
        gemm_tiles(sch, block, [n, k], c, p, chunks, rows, columns, self.emulate)
        return True

    def _weight_gradient(
        self, sch: s_tir.Schedule, target: Target, choose: Choices, parts: int | str | None
    ) -> bool:
        """Tile ``weight_sum``: rows a group's output channels, columns its input channels,
        the reduction the images and pixels (in chunks that divide the padded pixels), split
        into ``parts`` (see :meth:`_schedule`) over the chunks where the tiles alone would
        leave most of the GPU idle. Without a split, ``grad_weight`` (the cast) is written
        from the registers; with one, the partial sums go to scratch memory and a last kernel
        adds them in order and casts, one thread per weight. False (untouched) where a tile of
        rows would straddle two groups, or a group has too few input channels for a tile of
        columns."""
        weight_in, out_per_group = _groups(sch)
        defaults = self._weight_tiles(sch)
        if defaults is None:
            return False
        rows = self._tile(choose, self.row_tiles, out_per_group)
        columns = self._tile(choose, self.column_tiles, weight_in)
        block = sch.get_sblock("weight_sum")
        o, c, k, n, p = sch.get_loops(block)
        pixels = _pixel_multiple(sch, p)
        known = isinstance(sch.get(p).extent, tirx.IntImm)
        if parts is None or parts == "sampled":
            tiles = int(sch.get(k).extent) * int(sch.get(o).extent) // math.prod(defaults[0])
            tiles *= weight_in // math.prod(defaults[1])
            if known:
                chunk = largest_divisor(pixels, self.chunk)
                default = self.parts(tiles, pixels // chunk, chunk, target)
            else:
                default = self.parts(tiles, pixels, 1, target, any_size=True)
            if parts is None:
                parts = default
            else:
                parts = choose(self._part_candidates(sch), default, lambda value: value > 1)
        one_pass = isinstance(parts, int) and parts == 1
        if one_pass:
            chunk = self._chunk(choose, pixels)
        elif known:
            chunk = largest_divisor(pixels, self.chunk)  # the default's: its parts divide it
        else:
            # For any size, a chunk of which the quantum holds a multiple of ``parts``: each
            # part takes every parts-th chunk, and the split has no tail (one, over the
            # symbolic pixel count, made TVM's buffer compaction compute a bound past int32
            # and raise on some strided layers). Where the parts are sampled, a chunk that
            # every count the space samples keeps so.
            most = parts if isinstance(parts, int) else max(self._part_candidates(sch))
            if pixels % most:
                raise ValueError(f"{most} parts do not divide the pixel quantum {pixels}")
            chunk = largest_divisor(pixels // most, self.chunk)
        chunks, p = sch.split(p, [None, chunk])
        if one_pass:
            sch.reorder(k, o, c, n, chunks, p)
            consumer = sch.get_sblock("grad_weight")
            gemm_tiles(sch, block, [k], o, c, [n, chunks, p], rows, columns, self.emulate, consumer)
            return True
        if known:
            part, chunks = sch.split(chunks, [parts, None])
            sch.reorder(part, n)
        else:
            chunks, part = sch.split(chunks, [None, parts])
            sch.reorder(part, n, chunks)
        partial = sch.rfactor(part, factor_axis=0)
        o, c, k, part, n, chunks, p = sch.get_loops(partial)
        sch.reorder(part, k, o, c, n, chunks, p)
        gemm_tiles(sch, partial, [part, k], o, c, [n, chunks, p], rows, columns, self.emulate)
        # The sum of the parts, one thread per weight, the output channels along blockIdx.y
        # (fused into the thread blocks too, they give the sum indices that MetaSchedule's
        # RewriteReductionBlock does not take for affine: it rejected every split schedule).
        outputs, *weights = sch.get_loops(sch.get_sblock("grad_weight"))
        thread = spread(sch, weights, self.threads, self.emulate)
        _binder(sch, self.emulate)(outputs, "blockIdx.y")
        sch.compute_at(block, thread)
        return True

    def _weight_tiles(self, sch: s_tir.Schedule):
        """The default's (rows, columns) tiles of the weight gradient's GEMM, each (threads,
        registers); None where it is not tiled."""
        weight_in, out_per_group = _groups(sch)
        rows, columns = _tile(self.row_tiles, out_per_group), _tile(self.column_tiles, weight_in)
        return None if rows is None or columns is None else (rows, columns)

    def _tile(self, choose: Choices, tiles: tuple[tuple[int, int], ...], extent: int):
        """A GEMM tile (threads, registers) along an axis of ``extent``: untuned the first of
        ``tiles`` that divides it (None where none does); in a design space, sampled among
        powers of two of which every pairing divides ``extent``, so that no tile needs a
        predicate."""
        default = _tile(tiles, extent)
        if default is None:
            return None
        threads, registers = default
        thread_options = [t for t in self.tile_threads if extent % (t * registers) == 0]
        most = max([threads, *thread_options])
        register_options = [r for r in self.tile_registers if extent % (most * r) == 0]
        return choose(thread_options, threads), choose(register_options, registers)

    def _chunk(self, choose: Choices, extent: int):
        """The reduction steps per shared-memory chunk of a reduction of ``extent`` steps (or
        a multiple of it): the default's, or sampled among the divisors of ``extent``."""
        options = [c for c in self.chunk_options if extent % c == 0]
        return choose(options, largest_divisor(extent, self.chunk))

    def _part_candidates(self, sch: s_tir.Schedule) -> list[int]:
        """The parts a design space samples for the weight gradient of ``sch`` (unscheduled):
        powers of two from 2 to ``max_parts`` that divide an image's chunks of pixels (at the
        default's chunk), or for any size the pixels' quantum."""
        p = sch.get_loops(sch.get_sblock("weight_sum"))[-1]
        extent = sch.get(p).extent
        if isinstance(extent, tirx.IntImm):
            chunks = int(extent) // largest_divisor(int(extent), self.chunk)
        else:
            chunks = _pixel_multiple(sch, p)  # for any size, parts that divide the quantum
        return [2**i for i in range(1, self.max_parts.bit_length()) if chunks % 2**i == 0]

    def parts(
        self, tiles: int, chunks: int, chunk: int, target: Target, any_size: bool = False
    ) -> int:
        """The parts the weight gradient's reduction over ``chunks`` chunks of ``chunk``
        pixels is split into, for ``tiles`` thread blocks of its GEMM: the fewest (a power
        of two, at most ``max_parts``) that give the blocks that fill ``target``'s GPU, among
        those that divide an image's chunks into at least ``min_part_pixels`` pixels each;
        for a kernel for any size (``any_size``: ``chunks`` the pixel quantum, ``chunk``
        1), those that divide the quantum (see :meth:`_weight_gradient`)."""
        wanted = SplitReductionCUDA().blocks_wanted(target)
        parts = 1
        while tiles * parts < wanted and parts * 2 <= self.max_parts:
            per_part, remainder = divmod(chunks, parts * 2)
            if remainder or (not any_size and per_part * chunk < self.min_part_pixels):
                break
            parts *= 2
        return parts


def _names(sch: s_tir.Schedule) -> list[str]:
    """The names of the blocks at the root of ``sch``, in order."""
    return [sch.get(block).name_hint for block in sch.get_child_blocks(sch.get_sblock("root"))]


def _groups(sch: s_tir.Schedule) -> tuple[int, int]:
    """(input channels, output channels) per weight group of the backward PrimFunc in
    ``sch``."""
    buffers = {
        region.source.name: region.source
        for block in sch.get_child_blocks(sch.get_sblock("root"))
        for region in sch.get(block).reads
    }
    out_channels, weight_in, _ = (int(d) for d in buffers["weight"].shape)
    in_channels = int(buffers["data"].shape[1])
    return weight_in, out_channels // (in_channels // weight_in)


def _pixel_multiple(sch: s_tir.Schedule, pixels) -> int:
    """A number the padded pixel count (the extent of the loop ``pixels``) is a multiple of:
    itself where it is known, else the PrimFunc's quantum. A tile or chunk that divides it
    needs no predicate, which would leave TVM a shared-memory stage of symbolic size."""
    extent = sch.get(pixels).extent
    if isinstance(extent, tirx.IntImm):
        return int(extent)
    return int(sch.mod["main"].attrs["pixel_quantum"])


def _tile(tiles: tuple[tuple[int, int], ...], extent: int) -> tuple[int, int] | None:
    """The first (threads, registers) of ``tiles`` whose product divides ``extent``."""
    return next(((t, r) for t, r in tiles if extent % (t * r) == 0), None)


class GradInputCUDA(Rule):
    """The CUDA schedule of the input's gradient (``definition.grad_input_tiles``): the boxes
    one thread each; the gather a thread block per (image, run of channels, tile), a thread
    per channel (lane), the tile's sums in shared memory. Its space is the default alone."""

    kernel = "grad_input"
    target_kind = "cuda"

    #: threads per block of the boxes' stages
    threads = 256

    def __init__(self, emulate: bool = False):
        self.emulate = emulate

    def apply(
        self, func: tirx.PrimFunc, target: Target, tunable: bool = False
    ) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        if "gather" not in _names(sch):
            return None  # not the gather of definition.grad_input_tiles
        for name in ("segment_boxes", "row_boxes"):
            thread_per_element(sch, sch.get_sblock(name), self.threads, self.emulate)
        if not self.emulate:
            lane = sch.get_sblock("gather_lane")
            sch.set_scope(lane, 0, "shared")  # the tile's sums
            sch.bind(sch.fuse(*sch.get_loops(sch.get_sblock("gather"))), "blockIdx.x")
            sch.bind(sch.get_loops(lane)[0], "threadIdx.x")
        return sch


def thread_per_element(sch: s_tir.Schedule, block, threads: int, emulate: bool) -> None:
    """Spread ``block``'s spatial loops (the outer ones, one per data-parallel iterator) over
    thread blocks of ``threads`` threads, one element each (see :func:`spread`); its reduction
    loops stay inside each thread. With ``emulate``, the loops are split alike but not
    bound."""
    spatial = sum(1 for v in sch.get(block).iter_vars if v.iter_type == tirx.IterVar.DataPar)
    loops = sch.get_loops(block)[:spatial]
    if loops:
        spread(sch, loops, threads, emulate)


def spread(sch: s_tir.Schedule, loops: list, threads: int, emulate: bool) -> LoopRV:
    """Spread the nest of ``loops`` over thread blocks of ``threads`` threads and return the
    loop of the threads (``threadIdx.x``).

    The loops are fused into one, except in a kernel for any size whose last loop (the pixels)
    is the only symbolic one after the first (the images): there the pixels go along
    ``blockIdx.x`` and the threads, the static loops between along ``blockIdx.y`` and the first
    along ``blockIdx.z``, so that no index divides by a symbolic extent (which also makes
    TVM's lowering of such a kernel several times faster)."""
    bind = _binder(sch, emulate)
    extents = [sch.get(loop).extent for loop in loops]
    static = [isinstance(extent, tirx.IntImm) for extent in extents]
    rows = math.prod(int(extent) for extent in extents[1:-1] if isinstance(extent, tirx.IntImm))
    if len(loops) > 1 and not static[-1] and all(static[1:-1]) and rows <= GRID_Y:
        first, *middle, pixels = loops
        outer, inner = sch.split(pixels, [None, threads])
        bind(outer, "blockIdx.x")
        bind(inner, "threadIdx.x")
        if middle:
            bind(sch.fuse(*middle) if len(middle) > 1 else middle[0], "blockIdx.y")
        bind(first, "blockIdx.z")
        return inner
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    outer, inner = sch.split(fused, [None, threads])
    bind(outer, "blockIdx.x")
    bind(inner, "threadIdx.x")
    return inner


def gemm_tiles(
    sch: s_tir.Schedule,
    block,
    grid: list,
    rows,
    columns,
    reduction: list,
    row_tile: tuple[int, int],
    column_tile: tuple[int, int],
    emulate: bool,
    consumer=None,
) -> None:
    """Tile the GEMM ``block``, whose loops are ``grid`` (one thread block each, fused along
    ``blockIdx.z``), ``rows``, ``columns`` and the ``reduction`` loops, in that order; the
    last reduction loop runs through one chunk.

    A thread block covers ``row_tile`` (threads, registers) rows by ``column_tile`` columns;
    each thread accumulates its registers' block in local memory. For each chunk, the block's
    threads first copy the slices of both operands to shared memory, then multiply them. The
    accumulators are written back from the registers, through ``consumer`` (an elementwise
    block reading ``block``'s result, e.g. a cast) where given. With ``emulate``, the loops are
    laid out alike but not bound, and the shared buffers are global."""
    bind = _binder(sch, emulate)
    accumulator = sch.cache_write(block, 0, "local")
    (threads_y, regs_y), (threads_x, regs_x) = row_tile, column_tile
    row_outer, row_thread, row_reg = sch.split(rows, [None, threads_y, regs_y])
    column_outer, column_thread, column_reg = sch.split(columns, [None, threads_x, regs_x])
    *outer_reduction, chunk_outer, chunk_inner = reduction
    sch.reorder(
        *grid,
        row_outer,
        column_outer,
        row_thread,
        column_thread,
        *reduction,
        row_reg,
        column_reg,
    )
    bind(column_outer, "blockIdx.x")
    bind(row_outer, "blockIdx.y")
    if grid:
        bind(sch.fuse(*grid) if len(grid) > 1 else grid[0], "blockIdx.z")
    bind(row_thread, "threadIdx.y")
    bind(column_thread, "threadIdx.x")
    if consumer is None:
        sch.reverse_compute_at(accumulator, column_thread)
    else:
        sch.compute_inline(accumulator)
        sch.reverse_compute_at(consumer, column_thread)

    result = sch.get(block).writes[0].source
    reads = sch.get(block).reads
    operands = [i for i, region in enumerate(reads) if not region.source.same_as(result)]
    scope = "global" if emulate else "shared"
    fills = [sch.cache_read(block, i, scope, consumer_blocks=[block]) for i in operands]
    for fill in fills:
        sch.compute_at(fill, chunk_outer)
    chunk_var = sch.get(chunk_outer).loop_var
    for fill in fills:
        loops = sch.get_loops(fill)
        depth = 1 + next(
            i for i, loop in enumerate(loops) if sch.get(loop).loop_var.same_as(chunk_var)
        )
        if depth == len(loops):
            continue  # a slice of one element: every thread writes that same value
        _, y, x = sch.split(sch.fuse(*loops[depth:]), [None, threads_y, threads_x])
        bind(y, "threadIdx.y")
        bind(x, "threadIdx.x")
    sch.unroll(row_reg)
    sch.unroll(column_reg)
    sch.decompose_reduction(block, reduction[0])


def _binder(sch: s_tir.Schedule, emulate: bool):
    """``bind(loop, thread)``: binds on a GPU, does nothing in an emulated run."""

    def bind(loop, thread: str) -> None:
        if not emulate:
            sch.bind(loop, thread)

    return bind
