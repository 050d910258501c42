"""What the schedules share: the target's vector width and registers, loop extents, and how to
recognise the forward PrimFunc of :mod:`tvm_deform.ir.definition`."""

from __future__ import annotations

import functools
import importlib
import sys
import types

from tvm import s_tir, tirx
from tvm.target import Target, codegen

from tvm_deform.ir.script import pseudo_frames_answered_at_once


def tensor_intrinsics() -> types.ModuleType:
    """TVM's tensor intrinsic libraries (``tvm.s_tir.tensor_intrin``), imported: importing them
    registers the intrinsics that tensorizing schedules name, and MetaSchedule's ``TuneContext``
    imports them whatever its space. Here they import in about 3 s, not 25-35 s (see
    :mod:`tvm_deform.ir.script`)."""
    name = "tvm.s_tir.tensor_intrin"
    if name in sys.modules:
        return sys.modules[name]
    with pseudo_frames_answered_at_once():
        return importlib.import_module(name)


@functools.lru_cache(maxsize=64)  # per target object: asking LLVM takes 0.2 ms
def vector_bytes(target: Target) -> int:
    """Bytes in one SIMD register of the LLVM ``target``, from its instruction-set features
    (LLVM's own ``llvm_get_vector_width`` answers 512 bits for every x86 target): 64 with
    AVX-512, 32 with AVX, else 16 (SSE, NEON, and SVE scheduled as NEON)."""
    if target.kind.name != "llvm":
        return 16
    if not str(target.attrs.get("mtriple", "x86_64")).startswith(("x86_64", "i686", "i386")):
        return 16
    for feature, size in (("avx512f", 64), ("avx", 32)):
        if codegen.target_has_features(feature, target):
            return size
    return 16


def vector_registers(target: Target) -> int:
    """SIMD registers of the LLVM ``target``: 32 with AVX-512 and on aarch64, 16 with AVX/SSE."""
    return 32 if vector_bytes(target) == 64 or _is_arm(target) else 16


def _is_arm(target: Target) -> bool:
    return str(target.attrs.get("mtriple", "")).startswith(("aarch64", "arm"))


def lanes(target: Target, dtype: str) -> int:
    """Vector lanes of the float ``dtype`` on the LLVM ``target``."""
    return max(1, vector_bytes(target) * 8 // int(dtype.removeprefix("float")))


def facts(target: Target) -> dict[str, int]:
    """The hardware facts ``target`` carries as ``name=value`` entries of its keys (a CPU's
    cache sizes, a GPU's multiprocessor count; see ``tvm_deform.runtime.targets.with_facts``,
    which a schedule, a lower layer, does not import)."""
    found = {}
    for key in target.keys:
        name, sep, value = str(key).partition("=")
        if sep and value.isdigit():
            found[name] = int(value)
    return found


def largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def extents(sch: s_tir.Schedule, loops) -> list[int]:
    return [int(sch.get(loop).extent) for loop in loops]


def is_deform_conv(sch: s_tir.Schedule) -> bool:
    """Whether ``sch`` holds the forward PrimFunc of :mod:`tvm_deform.ir.definition`."""
    try:
        for name in ("conv", "columns", "output", *GEOMETRY):
            sch.get_sblock(name)
    except Exception:  # noqa: BLE001 - a missing block raises
        return False
    return True


GEOMETRY = ("sample_coef", "sample_cols", "sample_rows")
#: the stages of a symbolic PrimFunc that the geometry reads: each pixel's window corner, and
#: the offset and mask padded to the pixel quantum (``definition.pixel_stage``; not in a GPU's
#: PrimFunc, which reads them at a clamped index)
GEOMETRY_INPUTS = ("pixel_base", "offset_pixels", "mask_pixels")


def geometry_blocks(sch: s_tir.Schedule) -> list:
    """The geometry stages of the forward in ``sch``, consumers first: the three of
    ``GEOMETRY``, then those of ``GEOMETRY_INPUTS`` that the PrimFunc holds (a symbolic one)."""
    blocks = [sch.get_sblock(name) for name in GEOMETRY]
    for name in GEOMETRY_INPUTS:
        try:
            blocks.append(sch.get_sblock(name))
        except Exception:  # noqa: BLE001 - a static PrimFunc has no such stage
            pass
    return blocks


def parallel_tiles(sch: s_tir.Schedule, batch, tiles, images_inside: bool = False):
    """Run the loops over the batch and the pixel tiles (``tiles`` inside ``batch``) in parallel
    and return the loop under which a tile of one image is computed: the two fused. When the
    tile count is symbolic (a kernel for any size), the tiles run in parallel under a serial
    batch loop; or, with ``images_inside``, the (tile, image) pairs in one parallel loop, images
    fastest, so that a map of one tile still spreads its batch over the threads (the 5x5
    ``seed`` layer's forward kernel: 5.8 against 8.8 us a call at batch 2, on a 2-core Intel
    Xeon ``emeraldrapids``). That loop divides by the batch size to find its tile and image in
    its indices, which cost the larger layers 1-3% on the same CPU: the forward takes it, the
    backward (whose training step measured slower with it) does not. TVM cannot prove a
    symbolic extent positive: a
    loop fused with one divides by it in every index, and the stores of a tile are tested at
    run time (vectorised ones scalarised)."""
    if isinstance(sch.get(tiles).extent, tirx.IntImm):
        fused = sch.fuse(batch, tiles)
        sch.parallel(fused)
        return fused
    if not images_inside:
        sch.parallel(tiles)
        return tiles
    sch.reorder(tiles, batch)
    fused = sch.fuse(tiles, batch)
    sch.parallel(fused)
    return fused


def asynchronous_copies(target: Target) -> bool:
    """Whether ``target`` copies global to shared memory asynchronously (``cp.async``: CUDA
    from sm_80)."""
    if target.kind.name != "cuda":
        return False
    arch = str(target.attrs.get("arch", ""))
    return arch.startswith("sm_") and int(arch.removeprefix("sm_").rstrip("a")) >= 80


def pipeline_copies(sch: s_tir.Schedule, loop, stages: int) -> None:
    """Pipeline ``loop``, whose body is two shared-memory fills then the computation that
    reads them, over ``stages`` iterations (TVM's software pipeline: the fills of the next
    ``stages - 1`` iterations run ahead of the computation, each in buffers of its own), the
    fills asynchronous (``cp.async``, where TVM's ``tirx.use_async_copy`` is on: see
    :func:`asynchronous_copies` for the targets that have it)."""
    sch.annotate(loop, "software_pipeline_stage", [0, 0, stages - 1])
    sch.annotate(loop, "software_pipeline_order", [0, 1, 2])
    sch.annotate(loop, "software_pipeline_async_stages", [0])
