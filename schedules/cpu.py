"""CPU schedules of the deformable convolution (LLVM targets).

``DefaultCPU`` is the untuned schedule used for any shape that has no tuning record;
``HandwrittenSpace`` is the same structure with its tile sizes left to MetaSchedule (sampled
choices that its search draws and scores). The structure (design.md section 4):

- the parallel loop is outermost and runs over (batch, tile of output pixels);
- under it, the sampling geometry of the tile is computed once per offset group, then the tile of
  sampled columns (every input channel and kernel tap, ``tile`` pixels) is filled, so it is hot in
  cache when the GEMM reads it;
- the GEMM accumulates an ``(out_block x tile)`` register block, vectorised along the pixels
  (contiguous in the NCHW output) and unrolled along output channels, and the bias/cast epilogue
  is written from that block.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target, codegen

from tvm_deform.definition import PIXEL_QUANTUM


def vector_bytes(target: Target) -> int:
    """Bytes in one SIMD register of the LLVM ``target`` (16 when LLVM cannot tell)."""
    try:
        bits = int(codegen.llvm_get_vector_width(target))
    except Exception:  # noqa: BLE001 - not an LLVM target, or an LLVM without the query
        bits = 128
    return max(bits, 128) // 8


def lanes(target: Target, dtype: str) -> int:
    """Vector lanes of the float ``dtype`` on the LLVM ``target``."""
    return max(1, vector_bytes(target) * 8 // int(dtype.removeprefix("float")))


def largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def extents(sch: s_tir.Schedule, loops) -> list[int]:
    return [int(sch.get(loop).extent) for loop in loops]


def _loop_extents(sch: s_tir.Schedule, block) -> list[int]:
    return extents(sch, sch.get_loops(block))


class DefaultCPU:
    """The untuned CPU schedule: valid for every shape and dtype the definition produces.

    ``apply(func, target)`` returns a :class:`tvm.s_tir.Schedule`, or ``None`` when ``func`` is
    not a deformable convolution from :mod:`tvm_deform.definition`.
    """

    #: output channels held in registers at once (rows of the register block)
    out_block = 8
    #: vectors along the pixels in the register block (columns of the register block)
    vectors_per_tile = 2

    def apply(self, func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        if not is_deform_conv(sch):
            return None
        conv = sch.get_sblock("conv")
        acc_dtype = str(sch.get(conv).writes[0].source.dtype)
        vector = lanes(target, acc_dtype)
        _, out_channels, pixels, _, _ = _loop_extents(sch, conv)
        # The definition pads a pixel axis longer than PIXEL_QUANTUM to a multiple of it, so a
        # power-of-two tile up to the quantum divides it; a shorter axis may need one tile.
        tile = min(vector * self.vectors_per_tile, PIXEL_QUANTUM, pixels)
        if pixels % tile:
            tile = pixels
        apply_structure(sch, [None, tile], [None, largest_divisor(out_channels, self.out_block)])
        return sch


class HandwrittenSpace:
    """MetaSchedule design space with ``DefaultCPU``'s structure; the pixel tile (8 to
    ``PIXEL_QUANTUM`` pixels, dividing the padded pixel axis) and the register block's output
    channels (2 to 16, dividing the output channels) are sampled.

    The choices are ``sample_categorical`` over values that keep every loop longer than one: a
    unit loop disappears from the IR and changes how many loops a later ``get_loops`` returns,
    which breaks MetaSchedule's replay of mutated traces. Use as
    ``ms.space_generator.ScheduleFn(HandwrittenSpace())``.
    """

    pixel_tiles = (8, 16, 32, 64)
    out_blocks = (2, 3, 4, 6, 8, 12, 16)

    def __call__(self, sch: s_tir.Schedule) -> s_tir.Schedule:
        conv = sch.get_sblock("conv")
        _, out_channels, pixels, _, _ = _loop_extents(sch, conv)
        tiles = [t for t in self.pixel_tiles if pixels % t == 0 and t < pixels]
        blocks = [b for b in self.out_blocks if out_channels % b == 0]
        apply_structure(
            sch,
            [None, self._choose(sch, tiles, pixels)],
            [None, self._choose(sch, blocks, largest_divisor(out_channels, 16))],
        )
        return sch

    @staticmethod
    def _choose(sch: s_tir.Schedule, candidates: list[int], fallback: int):
        if len(candidates) <= 1:
            return candidates[0] if candidates else fallback
        return sch.sample_categorical(candidates, [1.0 / len(candidates)] * len(candidates))


def is_deform_conv(sch: s_tir.Schedule) -> bool:
    """Whether ``sch`` holds the forward PrimFunc of :mod:`tvm_deform.definition`."""
    try:
        for name in ("conv", "columns", "output", *GEOMETRY):
            sch.get_sblock(name)
    except Exception:  # noqa: BLE001 - a missing block raises
        return False
    return True


GEOMETRY = ("sample_coef", "sample_cols", "sample_rows")


def apply_structure(sch: s_tir.Schedule, pixel_factors: list, out_factors: list) -> None:
    """Schedule the forward PrimFunc in ``sch`` with the structure described in the module
    docstring; the factors split the pixel and output-channel axes (ints or sampled)."""
    conv = sch.get_sblock("conv")
    columns = sch.get_sblock("columns")
    output = sch.get_sblock("output")
    geometry = [sch.get_sblock(name) for name in GEOMETRY]

    # The register block is accumulated in a local buffer, which the output stage (bias, cast,
    # dropping the padding pixels) reads directly.
    acc = sch.cache_write(conv, 0, "local")
    n, o, p, rc, rk = sch.get_loops(conv)
    p_outer, p_inner = sch.split(p, pixel_factors)
    o_outer, o_inner = sch.split(o, out_factors)
    sch.reorder(n, p_outer, o_outer, rc, rk, o_inner, p_inner)
    outer = sch.fuse(n, p_outer)
    sch.parallel(outer)
    sch.compute_inline(acc)
    sch.reverse_compute_at(output, o_outer)

    # The columns of this pixel tile, then their geometry, just before the GEMM uses them.
    sch.compute_at(columns, outer)
    for block in geometry:
        sch.compute_at(block, outer)

    sch.unroll(o_inner)
    sch.vectorize(p_inner)
    sch.vectorize(sch.get_loops(output)[-1])
    sch.vectorize(sch.get_loops(columns)[-1])
    for block in geometry:
        sch.vectorize(sch.get_loops(block)[-1])
    # Last: the zero-fill is split off the reduction so that it, too, is vectorised.
    sch.decompose_reduction(conv, rc)
