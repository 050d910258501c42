"""CUDA schedules of the deformable convolution (the forward kernel).

``OnePassCUDA`` is the default schedule (the CPU structure, on a GPU):

- the sampling geometry (clamped rows and columns, corner coefficients) is computed by its own
  small kernels, one thread per (n, group, tap, corner, pixel), written once per offset group;
- the GEMM runs one thread block per (batch, up to 32 output channels, 64 pixels) tile; each of
  its threads accumulates a 4 x 4 register block (output channels x pixels, contiguous, so the
  write-back of a thread covers exactly its own outputs); a grouped layer gets a thinner tile
  on the output channels, so that its staged columns fit in shared memory;
- the reduction over (input channel, tap) goes in chunks of whole channels (about 32 pairs):
  for each chunk the threads sample its slice of the columns (four loads and four FMAs per
  value, from the geometry) straight into shared memory, next to the chunk of the weight it
  multiplies, so the sampled image never round-trips through global memory;
- the bias/cast epilogue is written from the registers.

``emulate=True`` applies the same loop structure without the thread bindings and with the
shared buffers in global memory, which an LLVM target can compile and run: the tests use it to
check on a CPU-only machine that the tiling, the staged columns and the epilogue compute the
right numbers (a GPU run is still what checks the bindings themselves).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target
from tvm_deform.schedules.common import (
    GEOMETRY,
    asynchronous_copies,
    facts,
    geometry_blocks,
    is_deform_conv,
    largest_divisor,
    pipeline_copies,
)
from tvm_deform.schedules.rule import Choices, Rule

#: a thread block's shared memory on every NVIDIA GPU since Volta without opting in to more
STATIC_SHARED_MEMORY = 48 * 1024


def shared_budget(target: Target, share: float) -> int:
    """Bytes of shared memory a schedule stages per thread block: ``share`` of ``target``'s
    ``max_shared_memory_per_block`` (48 KiB when the target does not say, as for the LLVM
    target of an emulated run)."""
    limit = target.attrs.get("max_shared_memory_per_block") if target.kind.name == "cuda" else None
    return int((int(limit) if limit is not None else STATIC_SHARED_MEMORY) * share)


class OnePassCUDA(Rule):
    """The one-pass CUDA schedule of the forward PrimFunc (see the module docstring). Its
    space samples the register block's rows along the output channels, among the tiles of
    ``out_tiles`` with the default's threads whose staged columns fit in shared memory. Not
    the default (``SampleOnceCUDA`` is): each output-channel tile samples its columns again;
    a design space, where a layer with few output channels may still be faster fused."""

    kernel = "forward"
    target_kind = "cuda"
    default = False

    #: threads along the pixels, and the register block's pixels per thread
    threads_p, regs_p = 16, 4
    #: (threads, registers) along the output channels, the first whose staged columns fit
    #: the shared-memory budget: a grouped layer stages a column slice per group in the tile, so a
    #: depthwise layer needs a thinner tile than a dense one
    out_tiles = ((8, 4), (8, 2), (8, 1), (4, 1), (2, 1), (1, 1))
    #: register rows a design space samples beside those of ``out_tiles``: a taller block
    #: reads fewer operands from shared memory per multiply-add (8 x 8 outputs: 16 reads for
    #: 64), for the registers it holds
    space_rows = (8,)
    #: the share of a thread block's shared memory (the target's
    #: ``max_shared_memory_per_block``) the staged columns and weights may take: 40 KiB of 48
    shared_share = 5 / 6
    #: (input channel, tap) pairs per shared-memory chunk of the reduction, at most: a chunk
    #: holds whole channels (every tap), so that its extent does not vary from chunk to chunk
    chunk = 32
    #: threads per block of the elementwise geometry kernels
    geometry_threads = 256
    #: chunks of the reduction whose shared-memory copies are in flight at once (1: each
    #: chunk is copied, then multiplied)
    stages = 1

    def __init__(self, emulate: bool = False):
        self.emulate = emulate

    def apply(
        self, func: tirx.PrimFunc, target: Target, tunable: bool = False
    ) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        if not is_deform_conv(sch):
            return None
        budget = self.budget(target)
        threads_o, regs_o = self.out_tile(sch, budget)
        regs_o = self.choose_rows(sch, threads_o, regs_o, budget, Choices(sch, tunable))
        for name in GEOMETRY:
            self.elementwise(sch, sch.get_sblock(name))
        self._gemm(sch, threads_o, regs_o)
        return sch

    def budget(self, target: Target) -> int:
        """Bytes of shared memory this rule stages per thread block on ``target``."""
        return shared_budget(target, self.shared_share)

    def choose_rows(
        self, sch: s_tir.Schedule, threads_o: int, regs_o: int, budget: int, choose: Choices
    ):
        """The register block's rows along the output channels: ``regs_o``, or in a space a
        sampled choice among the tiles with ``threads_o`` threads and ``space_rows`` within
        ``budget``."""
        rows = [r for t, r in self.out_tiles if t == threads_o] + list(self.space_rows)
        # One row is left out unless it is the default's: the output's unit loop vanishes from
        # reverse_compute_at's loops, and a trace sampled otherwise no longer replays.
        return choose(
            rows,
            regs_o,
            lambda r: (r > 1 or r == regs_o) and self.fits(sch, threads_o, r, budget),
        )

    def shared_bytes(self, sch: s_tir.Schedule, threads_o: int, regs_o: int) -> int:
        """Shared memory one thread block stages with this output tile (an upper bound);
        ``sch`` holds the unscheduled forward PrimFunc."""
        conv = sch.get(sch.get_sblock("conv"))
        _, outputs, _, weight_in, taps = (v.dom.extent for v in conv.iter_vars)
        outputs, weight_in, taps = int(outputs), int(weight_in), int(taps)
        columns = sch.get(sch.get_sblock("columns")).writes[0].source
        channels = int(columns.shape[1])
        elem = columns.dtype.bits // 8
        out_per_group = outputs // (channels // weight_in)
        tile_o = threads_o * regs_o
        per_chunk = self._channels_per_chunk(weight_in, taps)
        # TVM stages one box of channels for the groups the tile's output channels may
        # reach (``o // per_group``), the chunk of each and every channel between them:
        # ``tile / per_group`` groups where one divides the other, else one more, also past
        # the last group (TVM does not know the predicate of a ragged last tile).
        aligned = tile_o % out_per_group == 0 or out_per_group % tile_o == 0
        groups = max(1, tile_o // out_per_group) if aligned else -(-tile_o // out_per_group) + 1
        staged_channels = min(channels, (groups - 1) * weight_in + per_chunk)
        staged = staged_channels * taps * self.threads_p * self.regs_p
        return (staged + tile_o * per_chunk * taps) * elem

    def fits(self, sch: s_tir.Schedule, threads_o: int, regs_o: int, budget: int) -> bool:
        """Whether the output tile of ``threads_o x regs_o`` channels stages at most ``budget``
        bytes of shared memory for the unscheduled PrimFunc in ``sch``."""
        return self.shared_bytes(sch, threads_o, regs_o) <= budget

    def _channels_per_chunk(self, weight_in: int, taps: int) -> int:
        return max(1, min(weight_in, self.chunk // taps))

    def out_tile(self, sch: s_tir.Schedule, budget: int) -> tuple[int, int]:
        """(threads, registers) along the output channels for the unscheduled PrimFunc in
        ``sch``: the first of ``out_tiles`` within ``budget`` bytes of shared memory."""
        for threads_o, regs_o in self.out_tiles:
            if self.fits(sch, threads_o, regs_o, budget):
                return threads_o, regs_o
        return self.out_tiles[-1]

    def _bind(self, sch: s_tir.Schedule, loop, thread: str) -> None:
        if not self.emulate:
            sch.bind(loop, thread)

    @property
    def _shared(self) -> str:
        return "global" if self.emulate else "shared"

    def elementwise(self, sch: s_tir.Schedule, block) -> None:
        """Bind an elementwise block (a geometry kernel): its loops fused, one thread each."""
        fused = sch.fuse(*sch.get_loops(block))
        blocks, threads = sch.split(fused, [None, self.geometry_threads])
        self._bind(sch, blocks, "blockIdx.x")
        self._bind(sch, threads, "threadIdx.x")

    def _bind_tile(self, sch: s_tir.Schedule, part: list, n, o_outer, p_outer) -> None:
        """Bind the loops over a GEMM's output tiles (and the parts of a split reduction) to
        the thread blocks: the pixel tiles along ``blockIdx.x``, the output-channel tiles
        (with the parts) along ``y``, the images along ``z`` (the runtime launches at most
        65535 images at once). With symbolic sizes (a kernel for any size) no index then
        divides by the pixel tiles' count: one fused axis gave the channel tile's group as
        ``x % (2 * t) // (2 * t)`` (``t`` the pixel tiles' count), zero, but not to TVM,
        which does not know ``t`` to be positive; it staged every input channel's columns
        for each chunk (148 KiB of shared memory, past the 48 KiB a kernel may declare)."""
        if part:
            sch.reorder(*part, o_outer, n)
            o_outer = sch.fuse(*part, o_outer)
        self._bind(sch, p_outer, "blockIdx.x")
        self._bind(sch, o_outer, "blockIdx.y")
        self._bind(sch, n, "blockIdx.z")

    def _stage_columns(self, sch: s_tir.Schedule, conv, columns, r_outer):
        """Stage the chunk of the columns the GEMM ``conv`` multiplies in shared memory at
        ``r_outer`` and return the block that fills it: here ``columns`` itself, sampled
        straight into shared memory (its scope is set first: compute_at sizes a shared buffer
        for the whole thread block)."""
        sch.set_scope(columns, 0, self._shared)
        sch.compute_at(columns, r_outer)
        return columns

    def _cooperative(
        self, sch: s_tir.Schedule, block, depth: int, threads_o, threads_p=None
    ) -> None:
        """Spread ``block``'s loops below the first ``depth`` (a shared-memory fill) over the
        thread block's threads. A fill of one element (one channel, a 1x1 kernel) has no loop
        there: every thread writes that same value."""
        loops = sch.get_loops(block)[depth:]
        if not loops:
            return
        fused = sch.fuse(*loops)
        threads_p = self.threads_p if threads_p is None else threads_p
        _, ty, tx = sch.split(fused, [None, threads_o, threads_p])
        self._bind(sch, ty, "threadIdx.y")
        self._bind(sch, tx, "threadIdx.x")

    def _gemm(
        self,
        sch: s_tir.Schedule,
        threads_o,
        regs_o,
        block: str = "conv",
        pixel_tile: tuple | None = None,
        chunk=None,
        asynchronous: bool = False,
    ) -> None:
        """Tile the GEMM ``block``: ``conv`` itself, whose epilogue then runs from the
        registers, or the partial sums of a split reduction (``conv_rf``, with the part as its
        fourth loop), each part a thread block of its own, written back from the registers.
        ``pixel_tile`` (threads, registers along the pixels) and ``chunk`` (input channels per
        shared-memory chunk) default to the rule's; any tile size may be a sampled choice.
        With :attr:`stages` above 1 and ``asynchronous`` (``cp.async``), the chunks' copies
        are pipelined: the fills must be copies, not the sampling itself."""
        conv = sch.get_sblock(block)
        columns = sch.get_sblock("columns")
        output = sch.get_sblock("output")
        weight_index = next(
            i for i, region in enumerate(sch.get(conv).reads) if region.source.name == "weight"
        )
        acc = sch.cache_write(conv, 0, "local")
        n, o, p, *part, rc, rk = sch.get_loops(conv)
        weight_in, taps = (int(sch.get(loop).extent) for loop in (rc, rk))
        # Each thread's register block is contiguous, so the write-back of one thread covers
        # exactly its own outputs (a strided block made it cover its neighbours' too).
        o_outer, o_thread, o_reg = sch.split(o, [None, threads_o, regs_o])
        threads_p, regs_p = pixel_tile or (self.threads_p, self.regs_p)
        p_outer, p_thread, p_reg = sch.split(p, [None, threads_p, regs_p])
        chunk = self._channels_per_chunk(weight_in, taps) if chunk is None else chunk
        r_outer, r_inner = sch.split(rc, [None, chunk])
        sch.reorder(
            *part, n, o_outer, p_outer, o_thread, p_thread, r_outer, r_inner, rk, o_reg, p_reg
        )
        self._bind_tile(sch, part, n, o_outer, p_outer)
        self._bind(sch, o_thread, "threadIdx.y")
        self._bind(sch, p_thread, "threadIdx.x")
        if part:
            sch.reverse_compute_at(acc, p_thread)
            written = acc
        else:
            sch.compute_inline(acc)
            sch.reverse_compute_at(output, p_thread)
            written = output
        # Each thread writes its register block back in unrolled loops: from loops left to
        # ptxas, which it may not unroll, the accumulators' index is not a constant and their
        # array goes to local memory (a 32-byte stack frame and spills in PipelinedCUDA's
        # GEMM for any size of a 64-channel layer).
        thread = sch.get(p_thread)
        below = sch.get_loops(written)
        depth = next(i for i, loop in enumerate(below) if sch.get(loop).same_as(thread))
        for loop in below[depth + 1 :]:
            sch.unroll(loop)

        # The chunk's weights and sampled columns, filled by all threads of the block.
        weight = sch.cache_read(conv, weight_index, self._shared)
        sch.compute_at(weight, r_outer)
        columns = self._stage_columns(sch, conv, columns, r_outer)
        # Loops above the fill: the tile, the two thread loops and the chunk loop.
        chunk = sch.get(r_outer)
        depths = [
            1 + next(i for i, loop in enumerate(sch.get_loops(f)) if sch.get(loop).same_as(chunk))
            for f in (weight, columns)
        ]
        for fill, depth in zip((weight, columns), depths, strict=True):
            self._cooperative(sch, fill, depth, threads_o, threads_p)

        sch.unroll(o_reg)
        sch.unroll(p_reg)
        sch.decompose_reduction(conv, r_outer)
        if self.stages > 1 and asynchronous and not self.emulate:
            # The body of r_outer: the weights' copy, the columns' copy, the multiplication.
            pipeline_copies(sch, r_outer, self.stages)


class SplitReductionCUDA(OnePassCUDA):
    """``OnePassCUDA`` with the reduction over the input channels split into ``parts`` slices,
    each computed by thread blocks of its own, for layers whose output tiles alone would leave
    most of a GPU idle (many channels on a small map: the 512-channel 10x10 layer makes 32
    tiles). The partial sums go to a scratch buffer; a last kernel adds them in a fixed order,
    one thread per output, and applies the bias/cast epilogue, so the result is the same on
    every run. The sum's order differs from ``OnePassCUDA``'s, so the last bits can too.

    ``parts`` defaults to :meth:`choose_parts`. ``apply`` returns None where the split does not
    apply (one part, or channels that ``parts`` does not divide). Its space samples the parts
    (powers of two that divide the channels per group into slices of at least
    ``min_part_channels``) and the rows as ``OnePassCUDA``'s does; it is offered wherever a
    split into two parts is possible."""

    #: thread blocks per multiprocessor a layer should have before its reduction is split no
    #: further, so that each has warps to switch to while others wait on the sampling's
    #: scattered loads
    blocks_per_multiprocessor = 4
    #: the same in blocks, for a target that does not say how many multiprocessors its GPU has
    #: (about four per SM on an H100 or H200, 132 SMs)
    enough_blocks = 512
    #: the most slices a reduction is split into
    max_parts = 16
    #: the fewest input channels (per group) a slice holds, so that each block still has a
    #: reduction long enough to pay for the round trip of its partial sums through memory
    min_part_channels = 16

    def __init__(self, parts: int | None = None, emulate: bool = False):
        super().__init__(emulate)
        self.parts = parts

    def _channels_per_chunk(self, weight_in: int, taps: int) -> int:
        # A divisor of the channels: with a remainder, the shared-memory regions of a chunk
        # are not narrowed to its part (TVM staged the whole weight of the tile).
        most = max(1, min(weight_in, self.chunk // taps))
        return next(c for c in range(most, 0, -1) if weight_in % c == 0)

    def tiles(
        self, sch: s_tir.Schedule, threads_o: int, regs_o: int, pixels: int | None = None
    ) -> int:
        """Thread blocks of ``OnePassCUDA``'s GEMM for the unscheduled PrimFunc in ``sch``: at
        its size, or for one image of ``pixels`` pixels; for a PrimFunc for any size, at the
        fewest pixels it is built for (its ``min_pixels``), one image."""
        n, outputs, extent, *_ = (v.dom.extent for v in sch.get(sch.get_sblock("conv")).iter_vars)
        if pixels is None and not isinstance(extent, tirx.IntImm):
            pixels = int(sch.mod["main"].attrs["min_pixels"])
        if pixels is not None:
            n, extent = 1, pixels
        n, outputs, pixels = int(n), int(outputs), int(extent)
        per_block_o, per_block_p = threads_o * regs_o, self.threads_p * self.regs_p
        return n * -(-outputs // per_block_o) * -(-pixels // per_block_p)

    def blocks_wanted(self, target: Target) -> int:
        """Thread blocks that fill ``target``'s GPU: ``blocks_per_multiprocessor`` per
        multiprocessor where the target says how many it has, else ``enough_blocks``."""
        multiprocessors = facts(target).get("multiprocessors")
        if multiprocessors:
            return self.blocks_per_multiprocessor * multiprocessors
        return self.enough_blocks

    def choose_parts(
        self,
        sch: s_tir.Schedule,
        threads_o: int,
        regs_o: int,
        blocks: int | None = None,
        pixels: int | None = None,
    ) -> int:
        """The fewest parts (a power of two dividing the input channels per group, at most
        ``max_parts``, each of at least ``min_part_channels``) that give ``blocks`` thread
        blocks (default ``enough_blocks``); ``pixels`` as in :meth:`tiles`."""
        conv = sch.get(sch.get_sblock("conv"))
        weight_in = int(conv.iter_vars[3].dom.extent)
        tiles, parts = self.tiles(sch, threads_o, regs_o, pixels), 1
        while (
            tiles * parts < (blocks or self.enough_blocks)
            and parts * 2 <= self.max_parts
            and weight_in % (parts * 2) == 0
            and weight_in // (parts * 2) >= self.min_part_channels
        ):
            parts *= 2
        return parts

    def split_parts(self, func: tirx.PrimFunc, target: Target) -> int:
        """The parts this rule splits ``func``'s reduction into; 1 where it does not apply."""
        return self._plan(s_tir.Schedule(func), target)[0]

    def _plan(self, sch: s_tir.Schedule, target: Target) -> tuple[int, int, int]:
        """(parts, threads, registers along the output channels) for the unscheduled PrimFunc
        in ``sch``; 1 part where the rule does not apply."""
        if not is_deform_conv(sch):
            return 1, 0, 0
        threads_o, regs_o = self.out_tile(sch, self.budget(target))
        blocks = self.blocks_wanted(target)
        parts = self.parts or self.choose_parts(sch, threads_o, regs_o, blocks)
        _, _, _, rc, _ = sch.get_loops(sch.get_sblock("conv"))
        if parts <= 1 or int(sch.get(rc).extent) % parts:
            parts = 1
        return parts, threads_o, regs_o

    def apply(
        self, func: tirx.PrimFunc, target: Target, tunable: bool = False
    ) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        budget = self.budget(target)
        parts, threads_o, regs_o = self._plan(sch, target)
        if tunable and is_deform_conv(sch):
            candidates = self.part_candidates(sch)
            if candidates:
                choose = Choices(sch, True)
                parts = choose(candidates, parts, lambda p: p > 1)
                regs_o = self.choose_rows(sch, threads_o, regs_o, budget, choose)
        if isinstance(parts, int) and parts == 1:
            return None
        for name in GEOMETRY:
            self.elementwise(sch, sch.get_sblock(name))
        self._split(sch, parts)
        self._gemm(sch, threads_o, regs_o, block="conv_rf")
        self._sum_parts(sch)
        return sch

    def part_candidates(self, sch: s_tir.Schedule) -> list[int]:
        """The parts a space samples for the unscheduled PrimFunc in ``sch``: powers of two up
        to ``max_parts`` that divide the input channels per group into slices of at least
        ``min_part_channels``."""
        weight_in = int(sch.get(sch.get_loops(sch.get_sblock("conv"))[3]).extent)
        return [
            p
            for p in (2**i for i in range(1, self.max_parts.bit_length()))
            if p <= self.max_parts
            and weight_in % p == 0
            and weight_in // p >= self.min_part_channels
        ]

    def _split(self, sch: s_tir.Schedule, parts) -> None:
        """Split the GEMM's reduction over the input channels into ``parts`` (``rfactor``:
        the partial sums in ``conv_rf``)."""
        _, _, _, rc, _ = sch.get_loops(sch.get_sblock("conv"))
        part, _ = sch.split(rc, [parts, None])
        sch.rfactor(part, factor_axis=0)

    def _sum_parts(self, sch: s_tir.Schedule) -> None:
        """The sum of the parts and the epilogue: one thread per output, the parts in order,
        the images along ``blockIdx.y``. (With the images fused into the thread blocks too,
        ``compute_at`` gives the sum indices that MetaSchedule's ``RewriteReductionBlock``
        does not take for affine: it rejected every split schedule of a layer of more than
        one image.)"""
        output = sch.get_sblock("output")
        images, *rest = sch.get_loops(output)
        blocks, threads = sch.split(sch.fuse(*rest), [None, self.geometry_threads])
        self._bind(sch, images, "blockIdx.y")
        self._bind(sch, blocks, "blockIdx.x")
        self._bind(sch, threads, "threadIdx.x")
        sch.compute_at(sch.get_sblock("conv"), threads)


class SampleOnceCUDA(SplitReductionCUDA):
    """The sample-once CUDA schedule of the forward PrimFunc, the default: two kernels, as
    torchvision's im2col and GEMM, each sampled value computed once, and a third that adds
    the parts of a split reduction.

    - The sampling kernel writes the columns to global memory (``[n, channel, tap, pixel]``,
      the im2col matrix). A thread takes one (image, offset group, tap, pixel) and a run of up
      to ``channels_per_thread`` channels of the group: it computes the geometry once, in
      registers (the four corners' clamped rows and columns and coefficients), and then
      samples each channel with four loads and four multiply-adds. Neighbouring threads take
      neighbouring pixels, so that the offset, mask and column accesses are coalesced.
    - The GEMM kernel is ``OnePassCUDA``'s, its chunks of columns copied from global memory
      into shared memory instead of sampled there: a thread block per (image, output-channel
      tile, pixel tile), the pixel tiles along ``blockIdx.x`` and the others along ``y`` and
      ``z``, so that with symbolic sizes (a kernel for any size) no index divides by the tile
      count. The bias/cast epilogue is written from its registers.
    - Where the output tiles alone would leave most of the GPU idle, the reduction is split
      into ``parts`` as ``SplitReductionCUDA`` splits it, each part a thread block of its
      own, and a third kernel adds the parts in a fixed order and applies the epilogue.
      ``parts`` defaults to ``choose_parts`` at the PrimFunc's size (at the fewest pixels a
      kernel for any size is built for: see :meth:`pixel_classes`).

    The sampled columns are a workspace of the PrimFunc, which TVM's runtime takes from the
    device's workspace allocator (torch's caching allocator, see ``runtime.workspace``).
    Its two design spaces (one pass, and split into sampled parts) sample every tile size of
    both kernels."""

    default = True
    #: pixels a thread block of the sampling kernel covers (one thread each)
    sample_pixels = 64
    #: (tap, channel run) pairs per sampling block, beside its pixels
    sample_rows = 4
    #: channels a sampling thread runs through with one geometry, at most
    channels_per_thread = 8

    def apply(
        self, func: tirx.PrimFunc, target: Target, tunable: bool = False
    ) -> s_tir.Schedule | list[s_tir.Schedule] | None:
        """The default schedule; as a design space, two: the reduction in one pass, and split
        into a sampled number of parts (where the channels can be split)."""
        sch = s_tir.Schedule(func)
        if not is_deform_conv(sch):
            return None
        parts = self._plan(sch, target)[0]
        weight_in = int(sch.get(sch.get_loops(sch.get_sblock("conv"))[3]).extent)
        if not tunable:
            if weight_in % parts:
                return None  # a part holds whole channels
            return self._schedule(sch, target, parts, False)
        spaces = [self._schedule(s_tir.Schedule(func), target, 1, True)]
        splits = self.part_candidates(sch)
        if splits:
            sampled = Choices(sch, True)(splits, parts)
            spaces.append(self._schedule(sch, target, sampled, True))
        return spaces

    def _schedule(self, sch: s_tir.Schedule, target: Target, parts, tunable: bool):
        """Lay out the kernels in ``sch`` with the reduction in ``parts`` (an int, or a
        sampled choice of at least 2); in a design space, every tile size a sampled choice
        starting at the default's (sizes that break a limit of the GPU, MetaSchedule's
        ``VerifyGPUCode`` rejects)."""
        budget = self.budget(target)
        _, threads_o, regs_o = self._plan(sch, target)
        choose = Choices(sch, tunable)
        conv = sch.get(sch.get_sblock("conv"))
        weight_in, taps = int(conv.iter_vars[3].dom.extent), int(conv.iter_vars[4].dom.extent)
        default_chunk = self._channels_per_chunk(weight_in, taps)
        rows = self.choose_rows(sch, threads_o, regs_o, budget, choose)
        threads = choose(
            (4, 8, 16),
            threads_o,
            lambda t: t * self.threads_p <= 1024 and self.fits(sch, t, regs_o, budget),
        )
        pixel_tile = (
            choose((8, 16, 32), self.threads_p, lambda t: t * threads_o <= 1024),
            choose((2, 4, 8), self.regs_p),
        )
        one_pass = isinstance(parts, int) and parts == 1
        # A chunk of a split reduction stays the default's: it must divide a part. Sizes of
        # one are left out (a unit loop vanishes from compute_at's loops and breaks the replay
        # of a trace sampled otherwise), unless they are the default's.
        chunk = choose(
            [c for c in range(2, weight_in) if weight_in % c == 0 and c * taps <= 64],
            default_chunk,
            lambda c: one_pass or c == default_chunk,
        )
        self.sampling(sch, choose)
        asynchronous = asynchronous_copies(target)
        if one_pass:
            self._gemm(
                sch, threads, rows, pixel_tile=pixel_tile, chunk=chunk, asynchronous=asynchronous
            )
            return sch
        self._split(sch, parts)
        self._gemm(
            sch, threads, rows, block="conv_rf", pixel_tile=pixel_tile, asynchronous=asynchronous
        )
        self._sum_parts(sch)
        return sch

    def pixel_classes(self, func: tirx.PrimFunc, target: Target) -> tuple[int, ...]:
        """The pixel counts (of one image, padded to ``PIXEL_QUANTUM``) from which the default
        splits the reduction of ``func``'s layer into fewer parts on ``target``, ascending,
        the first 1: a kernel for any size is built per class, with the parts
        ``choose_parts`` gives at the class's fewest pixels. At most three: the most parts,
        at most 4, and none."""
        sch = s_tir.Schedule(func)
        if not is_deform_conv(sch) or self.parts:
            return (1,)
        threads_o, regs_o = self.out_tile(sch, self.budget(target))
        outputs = int(sch.get(sch.get_sblock("conv")).iter_vars[1].dom.extent)
        out_tiles = -(-outputs // (threads_o * regs_o))
        wanted = self.blocks_wanted(target)
        tile = self.threads_p * self.regs_p
        classes, parts = [1], [self.choose_parts(sch, threads_o, regs_o, wanted, 1)]
        for blocks in (wanted // 4, wanted):
            pixels = tile * -(-blocks // out_tiles)
            split = self.choose_parts(sch, threads_o, regs_o, wanted, pixels)
            if pixels > classes[-1] and split != parts[-1]:
                classes.append(pixels)
                parts.append(split)
        return tuple(classes)

    def _plan(self, sch: s_tir.Schedule, target: Target) -> tuple[int, int, int]:
        threads_o, regs_o = self.out_tile(sch, self.budget(target))
        if self.parts:
            return self.parts, threads_o, regs_o
        parts = self.choose_parts(sch, threads_o, regs_o, self.blocks_wanted(target))
        return parts, threads_o, regs_o

    def sampling(self, sch: s_tir.Schedule, choose: Choices) -> None:
        """The sampling kernel (see the class docstring); ``choose`` answers its sizes."""
        columns = sch.get_sblock("columns")
        geometry = geometry_blocks(sch)
        if len(geometry) > len(GEOMETRY):
            sch.compute_inline(geometry[-1])  # a pixel's window corner: a division, inlined
        n, c, k, p = sch.get_loops(columns)
        channels = int(sch.get(c).extent)
        groups = int(sch.get(sch.get_loops(geometry[0])[1]).extent)
        per_group = channels // groups
        run = choose(
            [d for d in range(2, min(per_group, 17)) if per_group % d == 0],
            largest_divisor(per_group, self.channels_per_thread),
        )
        g, c_run, c_inner = sch.split(c, [groups, None, run])
        p_outer, p_thread = sch.split(p, [None, choose((32, 64, 128), self.sample_pixels)])
        sch.reorder(n, p_outer, g, k, c_run, p_thread, c_inner)
        rows = sch.fuse(g, k, c_run)
        row_outer, row_thread = sch.split(rows, [None, choose((2, 4, 8), self.sample_rows)])
        sch.reorder(n, p_outer, row_outer, row_thread, p_thread)
        self._bind(sch, p_outer, "blockIdx.x")
        self._bind(sch, row_outer, "blockIdx.y")
        self._bind(sch, n, "blockIdx.z")
        self._bind(sch, row_thread, "threadIdx.y")
        self._bind(sch, p_thread, "threadIdx.x")
        depth = len(sch.get_loops(columns)) - 1  # the loops above a thread's channel run
        for block in geometry[: len(GEOMETRY)]:
            sch.set_scope(block, 0, "local")
            sch.compute_at(block, p_thread)
            for loop in sch.get_loops(block)[depth:]:
                sch.unroll(loop)
        sch.unroll(c_inner)

    def _stage_columns(self, sch: s_tir.Schedule, conv, columns, r_outer):
        index = next(
            i for i, region in enumerate(sch.get(conv).reads) if region.source.name == "columns"
        )
        staged = sch.cache_read(conv, index, self._shared)
        sch.compute_at(staged, r_outer)
        return staged

    def fits(self, sch: s_tir.Schedule, threads_o: int, regs_o: int, budget: int) -> bool:
        """Also: the output tile divides the output channels of a group, or they divide it.
        TVM bounds the staged columns of a tile by its channels' groups (``o // per_group``),
        without the predicate of a ragged last tile: a tile of 32 over 24 channels staged the
        columns of two groups, every channel of an ungrouped layer."""
        per_group, tile = outputs_per_group(sch), threads_o * regs_o
        aligned = per_group % tile == 0 or tile % per_group == 0
        return aligned and super().fits(sch, threads_o, regs_o, budget)


def outputs_per_group(sch: s_tir.Schedule) -> int:
    """The output channels of a weight group of the unscheduled forward PrimFunc in ``sch``."""
    conv = sch.get(sch.get_sblock("conv"))
    outputs, weight_in = int(conv.iter_vars[1].dom.extent), int(conv.iter_vars[3].dom.extent)
    channels = int(sch.get(sch.get_sblock("columns")).writes[0].source.shape[1])
    return outputs // (channels // weight_in)


class WideTileCUDA(SampleOnceCUDA):
    """``SampleOnceCUDA``'s structure with the GEMM's register block of the classic SGEMM
    kernels: 8 output channels by 8 pixels a thread (64 accumulators), 16 x 8 threads, tiles
    of 128 output channels by 64 pixels (8 x 8 threads, 64 channels, where a group has fewer
    than 128). Per step of the reduction a thread multiplies 64 times for 16 operands read
    from shared memory, where the default's 4 x 4 block multiplies 16 times for 8; it has a
    quarter of the default's thread blocks (half, with 64-channel tiles) and a quarter of its
    warps to hide latency with. Not a default rule (no GPU has timed it): a design space, whose
    schedule as generated each first tuning round measures beside the default's."""

    default = False
    threads_p, regs_p = 8, 8
    out_tiles = ((16, 8), (8, 8))

    def fits(self, sch: s_tir.Schedule, threads_o: int, regs_o: int, budget: int) -> bool:
        """Also: the output tile holds no more channels than a group has."""
        tile = threads_o * regs_o
        return tile <= outputs_per_group(sch) and super().fits(sch, threads_o, regs_o, budget)

    def apply(
        self, func: tirx.PrimFunc, target: Target, tunable: bool = False
    ) -> s_tir.Schedule | list[s_tir.Schedule] | None:
        """As ``SampleOnceCUDA``'s, for layers with a group of at least 64 output channels."""
        sch = s_tir.Schedule(func)
        if not is_deform_conv(sch):
            return None
        if not any(self.fits(sch, t, r, self.budget(target)) for t, r in self.out_tiles):
            return None
        return super().apply(func, target, tunable)


class PipelinedCUDA(SampleOnceCUDA):
    """``SampleOnceCUDA`` with its GEMM's shared-memory copies pipelined two chunks deep on
    sm_80 and later: while the threads multiply one chunk of the weight and the columns, the
    next chunk's copies are in flight (``cp.async``, which waits for nothing until the chunk
    is needed). Each chunk's buffers are doubled, so each takes half the default's share of
    shared memory (the tiles chosen for that budget). The same sums in the same order as the
    default's. Before sm_80 (no ``cp.async``: a copy issued ahead stalls its thread) the
    default's structure in those tiles, unpipelined. Not a default rule (no GPU has timed it):
    a design space, whose schedule as generated each first tuning round measures beside the
    default's, and a column of the GPU session."""

    default = False
    stages = 2
    shared_share = SampleOnceCUDA.shared_share / 2
