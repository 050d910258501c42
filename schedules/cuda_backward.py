"""CUDA schedules of the backward kernels (deterministic: no atomics, no split reductions).

- ``BackwardCUDA`` for ``deform_conv2d_backward`` (every gradient but the input's): each
  stage of the PrimFunc (geometry, the column gradient, the derivative coefficients and the
  sampling gradients, the recomputed columns, the weight and bias gradients) runs as a kernel
  of its own with one thread per output element; every reduction (over the output channels for
  the column gradient, over a group's channels for the sampling gradients, over the pixels for
  the weight's) runs inside its thread in a fixed order. Stages that are not arguments of the
  PrimFunc live in scratch memory, which comes from torch's caching allocator (see
  :mod:`tvm_deform.runtime.workspace`).
- ``GradInputCUDA`` for ``deform_conv2d_grad_input``, the scatter: one thread per (n, c)
  image plane, accumulating into a plane of its own in local memory (the definition's
  ``plane_scope="local"``) in the definition's order, then writing it out. Planes never share
  memory, so no atomics are needed and the gradient is the same bits on every run.

The results are therefore those of the CPU kernels' order of summation within each reduction,
and the same from run to run. These are first schedules, for correctness: one thread per
element or plane leaves most of a large GPU idle on small layers. ``emulate=True`` applies the
same structure without the thread bindings, so that an LLVM target can run it: the tests check
on the CPU that it computes torchvision's gradients.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target
from tvm_deform.schedules.rule import Rule


class BackwardCUDA(Rule):
    """The CUDA schedule of the gradients kernel (see the module docstring). Its space is the
    default alone: one thread per element has nothing to tune."""

    kernel = "backward"
    target_kind = "cuda"

    #: threads per block of every stage
    threads = 256

    def __init__(self, emulate: bool = False):
        self.emulate = emulate

    def apply(
        self, func: tirx.PrimFunc, target: Target, tunable: bool = False
    ) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        names = {sch.get(block).name_hint for block in blocks}
        if "sample_coef" not in names or "conv" in names:
            return None  # not the gradients kernel of the definition
        for block in blocks:
            thread_per_element(sch, block, self.threads, self.emulate)
        return sch


class GradInputCUDA(Rule):
    """The CUDA schedule of the input's gradient: one thread per image plane. Its space is the
    default alone."""

    kernel = "grad_input"
    target_kind = "cuda"

    #: threads per block (planes per block)
    threads = 32

    def __init__(self, emulate: bool = False):
        self.emulate = emulate

    def apply(
        self, func: tirx.PrimFunc, target: Target, tunable: bool = False
    ) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        try:
            block = sch.get_sblock("grad_input")
        except Exception:  # noqa: BLE001 - not the scatter PrimFunc
            return None
        thread_per_element(sch, block, self.threads, self.emulate)
        return sch


def thread_per_element(sch: s_tir.Schedule, block, threads: int, emulate: bool) -> None:
    """Fuse ``block``'s spatial loops (the outer ones, one per data-parallel iterator) and spread
    them over thread blocks of ``threads`` threads; its reduction loops stay inside each
    thread. With ``emulate``, the loops are split alike but not bound."""
    spatial = sum(1 for v in sch.get(block).iter_vars if v.iter_type == tirx.IterVar.DataPar)
    loops = sch.get_loops(block)[:spatial]
    if not loops:
        return
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    outer, inner = sch.split(fused, [None, threads])
    if not emulate:
        sch.bind(outer, "blockIdx.x")
        sch.bind(inner, "threadIdx.x")
