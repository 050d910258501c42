"""The CUDA forward on tensor cores, for float16 and bfloat16 layers.

``TensorCoreCUDA`` schedules the forward PrimFunc whose columns are rounded to the layer's dtype
(``definition.forward(shape, column_dtype=shape.dtype)``), so that the GEMM is exactly a tensor
core's multiply-add: float16 x float16 (or bfloat16 x bfloat16) products accumulated in
float32.

- The sampling geometry is computed by its own small kernels, as in the default schedule.
- The GEMM is put in matrix form, ``C[o, j] += A[o, k] * B[j, k]`` with ``j = (n, pixel)`` and
  ``k = (input channel, tap)`` (``transform_block_layout`` and ``reindex``), and tiled into
  16 x 16 x 16 WMMA fragments: each thread block computes a tile of ``warps x fragments``
  fragments along each of the two output axes, and each warp a ``fragments x fragments`` block
  of it.
- For each chunk of the reduction, the block fills shared memory with the chunk of the weight
  and with the sampled columns, sampled straight into shared memory (the sampling is inlined
  into the fill, so the sampled image never round-trips through global memory); the warps load
  their fragments from there and multiply them with WMMA (PTX ``wmma.mma.sync``).
- The accumulators go through shared memory to the output stage (bias, cast to float16,
  dropping the padding pixels).

The rule applies to ungrouped layers whose output channels, padded pixels and reduction
(``in_channels x taps``) are multiples of 16 (and whose padded pixels are a power of two or a
multiple of ``PIXEL_QUANTUM``, which leaves out 48-pixel maps), on sm_70 and later for float16
and sm_80 and later for bfloat16.

It is not the forward's default: on an H200 it was slower than the CUDA-core schedule on 11 of
the 14 suite layers it takes, its tiles of up to 64x64 outputs leaving most of the GPU idle on
the smaller maps, each output tile sampling its columns again.

``SampleOnceTensorCoreCUDA`` multiplies the columns the default's sampling kernel writes once,
with a GEMM of its own (pipelined 16-byte copies, tiles per image, at one size or for any size;
see the class). ``schedules.tensor_core_schedule`` applies it; it is not the default either
(no GPU has timed it).

``emulate=True`` applies the same tiling without the thread bindings, the fragments and the
tensorization, with the shared buffers in global memory, which an LLVM target can compile and
run: the tests use it to check on a CPU the matrix form, the tiling, the sampling inlined into
the fill and the epilogue. ``tensorize`` itself checks that each tensorized block computes what
the WMMA intrinsic computes (TVM compares the block with the intrinsic's description), so the
emulated run checks the numbers the tensorized kernel computes, short of the hardware.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target
from tvm_deform.schedules.common import (
    GEOMETRY,
    asynchronous_copies,
    facts,
    is_deform_conv,
    largest_divisor,
    pipeline_copies,
    tensor_intrinsics,
)
from tvm_deform.schedules.cuda import OnePassCUDA, SampleOnceCUDA
from tvm_deform.schedules.rule import Choices, Rule

from tvm_deform.ir.definition import PIXEL_QUANTUM, padded_pixels

#: the side of a WMMA fragment (m16n16k16)
FRAGMENT = 16
#: the dtypes this rule puts on tensor cores -> the oldest compute capability with their WMMA
MIN_ARCH = {"float16": 70, "bfloat16": 80}


class TensorCoreCUDA(Rule):
    """The tensor-core CUDA schedule of a half-precision forward PrimFunc (module docstring).

    ``apply(func, target)`` returns None where the rule does not apply. Not tried for the
    default schedule; its space is its own tiling, unsampled."""

    kernel = "forward"
    target_kind = "cuda"
    default = False

    #: warps along each output axis of a thread block, at most
    warps = 2
    #: fragments along each output axis of a warp, at most
    fragments = 2
    #: fragments along the reduction per shared-memory chunk, at most
    chunk_fragments = 2
    #: threads of a warp
    warp_size = 32

    def __init__(self, emulate: bool = False):
        self.emulate = emulate

    def takes(self, func: tirx.PrimFunc, target: Target) -> bool:
        """Whether :meth:`apply` schedules ``func`` (without scheduling it)."""
        return self._gemm(s_tir.Schedule(func), target) is not None

    def apply(
        self, func: tirx.PrimFunc, target: Target, tunable: bool = False
    ) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        gemm = self._gemm(sch, target)
        if gemm is None:
            return None
        self._sampling(sch)
        self._schedule_gemm(sch, gemm, target)
        OnePassCUDA(self.emulate).elementwise(sch, sch.get_sblock("output"))  # the epilogue
        return sch

    def _sampling(self, sch: s_tir.Schedule) -> None:
        """The kernels before the GEMM: the geometry's, elementwise (the columns are sampled
        into the GEMM's fill, see :meth:`_columns`)."""
        elementwise = OnePassCUDA(self.emulate).elementwise
        for name in GEOMETRY:
            elementwise(sch, sch.get_sblock(name))

    def _gemm(self, sch: s_tir.Schedule, target: Target) -> _Gemm | None:
        gemm = _Gemm.of(sch) if is_deform_conv(sch) else None
        if gemm is None or not self._supported(target, gemm.dtype):
            return None
        if gemm.pixels % PIXEL_QUANTUM and gemm.pixels & (gemm.pixels - 1):
            # e.g. 48-pixel maps: TVM failed to place the column fill of a 48-pixel map, whose
            # fragments of (image, pixel) straddle images; the others of that kind are left
            # out with it.
            return None
        return gemm

    def _supported(self, target: Target, dtype: str) -> bool:
        if self.emulate:
            return True
        if target.kind.name != "cuda":
            return False
        arch = str(target.attrs.get("arch", ""))
        return (
            arch.startswith("sm_") and int(arch.removeprefix("sm_").rstrip("a")) >= MIN_ARCH[dtype]
        )

    def _scope(self, scope: str) -> str:
        return "global" if self.emulate else scope

    def _bind(self, sch: s_tir.Schedule, loop, thread: str) -> None:
        if not self.emulate:
            sch.bind(loop, thread)

    def _schedule_gemm(self, sch: s_tir.Schedule, gemm: _Gemm, target: Target) -> None:
        conv = sch.get_sblock("conv")
        # C[o, j] += A[o, k] * B[j, k], with j = (n, pixel), k = (input channel, tap).
        pixels, taps = gemm.pixels, gemm.taps
        sch.transform_block_layout(
            conv, lambda n, o, p, rc, rk: (o, n * pixels + p, rc * taps + rk)
        )
        weight_copy = sch.reindex(conv, ("read", 0))
        column_copy = sch.reindex(conv, ("read", 1))
        result_copy = sch.reindex(conv, ("write", 0))

        warps_i, frags_i = _split_fragments(gemm.rows // FRAGMENT, self.warps, self.fragments)
        warps_j, frags_j = _split_fragments(gemm.cols // FRAGMENT, self.warps, self.fragments)
        chunk = largest_divisor(gemm.depth // FRAGMENT, self.chunk_fragments)
        warps = warps_i * warps_j
        inner = conv
        outer, warp, k_chunk, k_reg = self._tile_fragments(
            sch, conv, (warps_i, frags_i, warps_j, frags_j), chunk
        )

        # The chunk's weights and sampled columns, filled by every thread of the block.
        # The operands in static shared memory, the float32 accumulators (below) in dynamic
        # shared memory: TVM reuses one allocation for buffers of the same scope whose lifetimes
        # do not overlap, and a float16 fill sharing the accumulators' allocation then fails to
        # lower (the fragments' pointers must keep their buffer's dtype).
        shared = self._scope("shared")
        fills = []
        for index, copy in ((0, weight_copy), (1, column_copy)):
            fill = sch.cache_read(outer, index, shared)
            sch.compute_at(fill, k_chunk)
            sch.compute_inline(copy)
            fills.append(fill)
        self._columns(sch)
        for fill, along_pixels in zip(fills, (False, True), strict=True):
            outer_loop, inner_loop = sch.get_loops(fill)[-2:]
            if along_pixels:
                # Neighbouring threads sample neighbouring pixels (coalesced geometry reads).
                sch.reorder(inner_loop, outer_loop)
                outer_loop, inner_loop = inner_loop, outer_loop
            fused = sch.fuse(outer_loop, inner_loop)
            _, thread_y, thread_x = sch.split(fused, [None, warps, self.warp_size])
            self._bind(sch, thread_y, "threadIdx.y")
            self._bind(sch, thread_x, "threadIdx.x")

        # The accumulators go through shared memory to the output stage.
        staged = sch.cache_write(outer, 0, self._scope("shared.dyn"))
        if not self.emulate:
            fragments = self._wmma_fragments(sch, outer, warp, k_reg)
        sch.reverse_compute_at(staged, warp)
        sch.reverse_compute_inline(result_copy)
        self._store(sch, staged)
        init = sch.decompose_reduction(outer, k_chunk)
        if self.emulate:
            return

        self._tensorize(sch, wmma_intrinsics(gemm.dtype), fragments, init, inner)

    def _wmma_fragments(self, sch: s_tir.Schedule, outer, warp, k_reg) -> tuple:
        """The WMMA fragments of the blockized GEMM ``outer``: A's and B's, loaded at each
        fragment of a chunk (``k_reg``), and the accumulators, stored once a warp's
        reduction ends (``warp``)."""
        fragment_a = sch.cache_read(outer, 0, "wmma.matrix_a")
        fragment_b = sch.cache_read(outer, 1, "wmma.matrix_b")
        sch.compute_at(fragment_a, k_reg)
        sch.compute_at(fragment_b, k_reg)
        accumulator = sch.cache_write(outer, 0, "wmma.accumulator")
        sch.reverse_compute_at(accumulator, warp)
        return fragment_a, fragment_b, accumulator

    def _tensorize(self, sch: s_tir.Schedule, intrinsics: dict, fragments, init, inner) -> None:
        """Tensorize the fragments' loads and store, the accumulators' initialisation
        (``init``) and the multiply-add (``inner``) with ``intrinsics``."""
        fragment_a, fragment_b, accumulator = fragments
        for fragment, name in ((fragment_a, "load_a"), (fragment_b, "load_b")):
            self._tensorize_2d(sch, fragment, intrinsics[name])
        self._tensorize_2d(sch, accumulator, intrinsics["store"])
        sch.tensorize(sch.get_loops(sch.get_child_blocks(init)[0])[-2], intrinsics["init"])
        sch.tensorize(sch.get_loops(inner)[-3], intrinsics["compute"])

    def _tile_fragments(self, sch: s_tir.Schedule, conv, tiling: tuple, chunk: int) -> tuple:
        """Tile the GEMM block ``conv``, whose last three loops are the output channels, the
        pixels and the reduction (any loops above them, e.g. the images, join the thread
        blocks): 16 x 16 x 16 fragments, blockized (``conv`` becomes their inner block);
        ``tiling`` = (warps, fragments a warp) along the channels, then the pixels; ``chunk``
        fragments of the reduction per shared-memory chunk. Returns the blockized block, the
        warp loop, the chunk loop and the loop over a chunk's fragments."""
        warps_i, frags_i, warps_j, frags_j = tiling
        *above, i, j, k = sch.get_loops(conv)
        i, i_frag = sch.split(i, [None, FRAGMENT])
        j, j_frag = sch.split(j, [None, FRAGMENT])
        k, k_frag = sch.split(k, [None, FRAGMENT])
        sch.reorder(i, j, k, i_frag, j_frag, k_frag)
        outer = sch.blockize(i_frag)
        i_block, i_warp, i_reg = sch.split(i, [None, warps_i, frags_i])
        j_block, j_warp, j_reg = sch.split(j, [None, warps_j, frags_j])
        k_chunk, k_reg = sch.split(k, [None, chunk])
        sch.reorder(*above, i_block, j_block, i_warp, j_warp, k_chunk, k_reg, i_reg, j_reg)
        tile = sch.fuse(*above, i_block, j_block)
        warp = sch.fuse(i_warp, j_warp)
        self._bind(sch, tile, "blockIdx.x")
        self._bind(sch, warp, "threadIdx.y")
        return outer, warp, k_chunk, k_reg

    def _columns(self, sch: s_tir.Schedule) -> None:
        """Place the sampled columns: inlined into the GEMM's fill (sampled straight into
        shared memory for each chunk)."""
        sch.compute_inline(sch.get_sblock("columns"))

    def _tensorize_2d(self, sch: s_tir.Schedule, block, intrinsic: str) -> None:
        i, j = sch.get_loops(block)[-2:]
        i_outer, i_inner = sch.split(i, [None, FRAGMENT])
        j_outer, j_inner = sch.split(j, [None, FRAGMENT])
        sch.reorder(i_outer, j_outer, i_inner, j_inner)
        sch.tensorize(i_inner, intrinsic)

    def _store(self, sch: s_tir.Schedule, staged) -> None:
        """The copy of the accumulators from shared memory to the conv buffer, spread over the
        warp's threads; the output stage (bias, cast, unpadding) is its own kernel."""
        loops = sch.get_loops(staged)[-2:]
        fused = sch.fuse(*loops)
        _, thread_x = sch.split(fused, [None, self.warp_size])
        self._bind(sch, thread_x, "threadIdx.x")


class SampleOnceTensorCoreCUDA(TensorCoreCUDA):
    """The tensor-core GEMM on the sample-once structure: the columns, in the layer's float16
    or bfloat16, written once by ``SampleOnceCUDA``'s sampling kernel; a GEMM kernel that
    copies chunks of the weight and of the columns into shared memory and multiplies them with
    WMMA; the output stage as the third kernel. Not a default rule (no GPU has timed it); the
    GPU session times it (``tensor_core_schedule``). Takes the ungrouped layers whose output
    channels, reduction and padded pixels are multiples of 16, at one size or for any size
    (the pixels padded to ``PIXEL_QUANTUM``), on the architectures ``TensorCoreCUDA`` names.

    ``C[n, o, p] += A[o, k] * B[n, k, p]``, ``k = (input channel, tap)``: tiles of one image's
    pixels, so that no tile straddles images and the extents need not be known.

    - The columns' chunk sits in shared memory as ``[reduction, pixel]``, the pixels
      contiguous as in the columns, and the weight's as ``[output channel, reduction]``, as
      in the weight: each thread copies 16 bytes at a time (8 values), and each row is
      padded to an odd multiple of 16 bytes so that the fragments' loads (``ldmatrix``, 8
      rows of 16 bytes at once) meet no bank conflicts.
    - On sm_80 and later the copies are asynchronous (``cp.async``) and pipelined over
      :attr:`stages` chunks (TVM's software pipeline; fewer where their buffers would pass
      :attr:`shared_limit`, or where the reduction has fewer chunks), the next chunks loading
      while the tensor cores multiply the current one; before, each chunk is copied, then
      multiplied.
    - The accumulators go from the fragments straight to the float32 sums in global memory
      (``[image, output channel, pixel]``), which the output stage reads.
    - The thread block's tile is the largest of :attr:`tilings` that divides the GEMM and
      still gives each multiprocessor a block (the target's count of them, else
      :attr:`multiprocessors`), else the one that gives the most blocks; for any size, at the
      fewest pixels of the size class (:meth:`pixel_classes`), of tiles that divide the
      padding's quantum.
    """

    #: (warps, fragments a warp) along the output channels, then along the pixels, largest
    #: tile first: 64 x 128, 128 x 64 (a tile for any size is at most 64 pixels wide), 64 x 64,
    #: 32 x 64, 32 x 32, 16 x 32 and 16 x 16 outputs
    tilings = (
        ((2, 2), (2, 4)),
        ((2, 4), (2, 2)),
        ((2, 2), (2, 2)),
        ((1, 2), (2, 2)),
        ((1, 2), (1, 2)),
        ((1, 1), (1, 2)),
        ((1, 1), (1, 1)),
    )
    #: multiprocessors, for a target that does not say how many its GPU has
    multiprocessors = 128
    #: chunks of the reduction in flight (shared-memory buffers of each operand)
    stages = 3
    #: values a thread copies at once (16 bytes of float16 or bfloat16)
    vector = 8
    #: the most static shared memory a thread block takes, in bytes
    shared_limit = 48 * 1024

    def _sampling(self, sch: s_tir.Schedule) -> None:
        """``SampleOnceCUDA``'s sampling kernel, its default sizes."""
        SampleOnceCUDA(emulate=self.emulate).sampling(sch, Choices(sch, False))

    def _gemm(self, sch: s_tir.Schedule, target: Target) -> _Gemm | None:
        """The GEMM, at one size or for any size (its tiles never straddle images)."""
        gemm = _Gemm.of(sch, any_size=True) if is_deform_conv(sch) else None
        return gemm if gemm is not None and self._supported(target, gemm.dtype) else None

    def tiling(self, gemm: _Gemm, target: Target) -> tuple[int, int, int, int]:
        """(warps, fragments a warp) along the output channels and along the pixels of the
        thread block's tile for ``gemm`` on ``target`` (class docstring)."""
        wanted = facts(target).get("multiprocessors", self.multiprocessors)
        rows, step = gemm.rows // FRAGMENT, gemm.pixel_step // FRAGMENT
        pixels = -(-gemm.least_pixels // FRAGMENT)
        fitting = [
            (wi, fi, wj, fj)
            for (wi, fi), (wj, fj) in self.tilings
            if rows % (wi * fi) == 0 and step % (wj * fj) == 0
        ]

        def blocks(tiling: tuple[int, int, int, int]) -> int:
            wi, fi, wj, fj = tiling
            return gemm.batch * rows // (wi * fi) * -(-pixels // (wj * fj))

        return next((t for t in fitting if blocks(t) >= wanted), max(fitting, key=blocks))

    def pixel_classes(self, func: tirx.PrimFunc, target: Target) -> tuple[int, ...]:
        """The pixel counts of one image from which :meth:`tiling` picks another tile for
        ``func``'s layer, a PrimFunc for any size, on ``target``: ascending, the first 1; a
        kernel for any size is built per class, tiled for the class's fewest pixels (a call's
        padded count picks the last class at or below it). ``(1,)`` where the rule does not
        take the layer."""
        gemm = self._gemm(s_tir.Schedule(func), target)
        if gemm is None:
            return (1,)
        wanted = facts(target).get("multiprocessors", self.multiprocessors)
        rows = gemm.rows // FRAGMENT
        # where each tile first gives every multiprocessor a block, at one image
        thresholds = sorted(
            {
                FRAGMENT * wj * fj * -(-wanted // (rows // (wi * fi)))
                for (wi, fi), (wj, fj) in self.tilings
                if rows % (wi * fi) == 0
            }
        )
        classes, tiles = [1], [self.tiling(gemm.at_least(1), target)]
        for pixels in thresholds:
            tile = self.tiling(gemm.at_least(pixels), target)
            if pixels > classes[-1] and tile != tiles[-1]:
                classes.append(pixels)
                tiles.append(tile)
        return tuple(classes)

    def _pipeline_stages(self, tile_rows: int, tile_cols: int, depth: int) -> int:
        """The most chunks in flight, up to :attr:`stages`, whose buffers fit
        :attr:`shared_limit` (two bytes a value)."""
        padded = (depth + 8) * tile_rows + (tile_cols + 8) * depth  # rows padded by 8 values
        return max(1, min(self.stages, self.shared_limit // (2 * padded)))

    def _schedule_gemm(self, sch: s_tir.Schedule, gemm: _Gemm, target: Target) -> None:
        conv = sch.get_sblock("conv")
        # C[n, o, p] += A[o, k] * B[n, k, p], with k = (input channel, tap): an image's tiles
        # of pixels, the sums laid out as the definition has them, the columns' copy as B.
        taps = gemm.taps
        sch.transform_block_layout(conv, lambda n, o, p, rc, rk: (n, o, p, rc * taps + rk))
        weight_copy = sch.reindex(conv, ("read", 0))
        column_copy = sch.reindex(conv, ("read", 1))
        sch.transform_layout(conv, ("read", 1), lambda n, p, k: (n, k, p))

        warps_i, frags_i, warps_j, frags_j = self.tiling(gemm, target)
        chunk = largest_divisor(gemm.depth // FRAGMENT, self.chunk_fragments)
        warps = warps_i * warps_j
        inner = conv
        outer, warp, k_chunk, k_reg = self._tile_fragments(
            sch, conv, (warps_i, frags_i, warps_j, frags_j), chunk
        )

        # Each chunk's weights and columns, copied by every thread of the block, 16 bytes
        # at a time (with every tiling, the block's threads x 8 values divide both chunks).
        for index, copy in ((0, weight_copy), (1, column_copy)):
            fill = sch.cache_read(outer, index, self._scope("shared"))
            sch.compute_at(fill, k_chunk)
            sch.compute_inline(copy)
            vectors, vector = sch.split(sch.fuse(*sch.get_loops(fill)[-2:]), [None, self.vector])
            _, thread_y, thread_x = sch.split(vectors, [None, warps, self.warp_size])
            sch.vectorize(vector)
            self._bind(sch, thread_y, "threadIdx.y")
            self._bind(sch, thread_x, "threadIdx.x")
            if not self.emulate:
                # rows of an odd number of 16 bytes: 8 rows that ldmatrix reads at once
                # start in 8 different 16-byte banks' groups
                rank = len(sch.get(fill).writes[0].source.shape)
                sch.storage_align(fill, 0, axis=rank - 2, factor=16, offset=8)

        if not self.emulate:
            fragments = self._wmma_fragments(sch, outer, warp, k_reg)
        init = sch.decompose_reduction(outer, k_chunk)
        if self.emulate:
            return  # the pipeline changes when values are copied, not which

        # Without cp.async (before sm_80) a copy issued ahead stalls its thread until the load
        # arrives: no overlap to gain, only buffers. No more stages than chunks either.
        if asynchronous_copies(target):
            stages = self._pipeline_stages(
                warps_i * frags_i * FRAGMENT, warps_j * frags_j * FRAGMENT, chunk * FRAGMENT
            )
            stages = min(stages, gemm.depth // (chunk * FRAGMENT))
            if stages > 1:
                # The body of k_chunk: the weights' copy, the columns' copy, the multiplication.
                pipeline_copies(sch, k_chunk, stages)
        intrinsics = wmma_intrinsics(gemm.dtype, trans_b=False, store_scope="global")
        self._tensorize(sch, intrinsics, fragments, init, inner)


class _Gemm:
    """The GEMM of a forward PrimFunc as a tensor-core matrix product: ``rows`` output
    channels, ``cols`` = batch x padded pixels, ``depth`` = input channels x taps.

    For a PrimFunc for any size, ``cols`` and ``pixels`` are expressions; ``batch`` is then 1
    and ``least_pixels`` the padded pixels of the fewest its size class takes (its
    ``min_pixels``), else the image's own. ``pixel_step``: what an image's padded pixels are
    known to be a multiple of (its count, or the padding's quantum)."""

    def __init__(
        self,
        rows: int,
        cols,
        depth: int,
        pixels,
        taps: int,
        dtype: str,
        batch: int = 1,
        least_pixels: int | None = None,
        pixel_step: int | None = None,
    ):
        self.rows, self.cols, self.depth = rows, cols, depth
        self.pixels, self.taps, self.dtype = pixels, taps, dtype
        self.batch = batch
        self.least_pixels = pixels if least_pixels is None else least_pixels
        self.pixel_step = pixels if pixel_step is None else pixel_step

    @classmethod
    def of(cls, sch: s_tir.Schedule, any_size: bool = False) -> _Gemm | None:
        """The GEMM of the PrimFunc in ``sch``, or None where tensor cores do not take it: a
        PrimFunc for any size (unless ``any_size``), not the definition whose columns are
        rounded to a half dtype, grouped, or extents that are not multiples of a fragment."""
        conv = sch.get(sch.get_sblock("conv"))
        weight = next(r.source for r in conv.reads if r.source.name == "weight")
        columns = sch.get(sch.get_sblock("columns")).writes[0].source
        batch, out_channels, pixels = conv.writes[0].source.shape
        weight_in, taps = int(weight.shape[1]), int(weight.shape[2])
        dtype = str(weight.dtype)
        if dtype not in MIN_ARCH or str(columns.dtype) != dtype:
            return None  # not the definition with rounded columns
        if weight_in != int(columns.shape[1]):
            return None  # grouped: the columns' index depends on the output channel
        rows, depth = int(out_channels), weight_in * taps
        if isinstance(pixels, tirx.IntImm):
            batch, pixels = int(batch), int(pixels)
            gemm = cls(rows, batch * pixels, depth, pixels, taps, dtype, batch)
        elif any_size:
            attrs = sch.mod["main"].attrs
            quantum = int(attrs["pixel_quantum"])
            least = padded_pixels(int(attrs["min_pixels"]), quantum, always=True)
            gemm = cls(rows, batch * pixels, depth, pixels, taps, dtype, 1, least, quantum)
        else:
            return None
        if any(extent % FRAGMENT for extent in (gemm.rows, gemm.depth, gemm.pixel_step)):
            return None
        return gemm

    def at_least(self, pixels: int) -> _Gemm:
        """This GEMM for any size, at one image of at least ``pixels`` pixels (padded)."""
        least = padded_pixels(pixels, self.pixel_step, always=True)
        return _Gemm(
            self.rows, self.cols, self.depth, self.pixels, self.taps, self.dtype, 1, least,
            self.pixel_step,
        )  # fmt: skip


def _split_fragments(count: int, warps: int, fragments: int) -> tuple[int, int]:
    """(warps, fragments per warp) along an axis of ``count`` fragments: as many fragments per
    warp as divide, then as many warps."""
    per_warp = largest_divisor(count, fragments)
    return largest_divisor(count // per_warp, warps), per_warp


def wmma_intrinsics(
    dtype: str, trans_b: bool = True, store_scope: str = "shared.dyn"
) -> dict[str, str]:
    """The names of the m16n16k16 WMMA tensor intrinsics for ``dtype`` inputs and float32
    accumulators: fragments loaded from static shared memory, B as ``[pixel, reduction]``
    (``trans_b``) or ``[reduction, pixel]``, stored to ``store_scope``. TVM registers the
    float16 ones; the bfloat16 ones are registered here from TVM's own generators, on first
    use."""
    cuda = tensor_intrinsics().cuda

    if dtype == "float16":
        return cuda.get_wmma_intrin_group(
            load_scope="shared",
            store_scope=store_scope,
            in_dtype="float16",
            out_dtype="float32",
            trans_b=trans_b,
        )
    trans = "_trans" if trans_b else ""
    names = {
        "init": cuda.WMMA_FILL_16x16x16_F32_INTRIN,
        "store": f"wmma_store_16x16x16_f32_{store_scope.replace('.', '_')}",
        "load_a": "tvm_deform_wmma_load_16x16x16_bf16_a_shared",
        "load_b": f"tvm_deform_wmma_load_16x16x16_bf16_b{trans}_shared",
        "compute": f"tvm_deform_wmma_sync_16x16x16_bf16bf16f32{trans}",
    }
    generators = {
        "load_a": lambda: cuda.get_wmma_load_intrin(16, 16, 16, dtype, "shared", False, False),
        "load_b": lambda: cuda.get_wmma_load_intrin(16, 16, 16, dtype, "shared", True, trans_b),
        "compute": lambda: cuda.get_wmma_sync_intrin(16, 16, 16, dtype, "float32", trans_b),
    }
    for role, generate in generators.items():
        if s_tir.TensorIntrin.get(names[role], allow_missing=True) is None:
            s_tir.TensorIntrin.register(names[role], *generate())
    return names
