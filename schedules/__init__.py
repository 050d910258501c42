"""How the kernels are scheduled (installed as ``tvm_deform.schedules``): one module per target
family and kernel (:mod:`.cpu`, :mod:`.cpu_backward`, :mod:`.cuda`, :mod:`.cuda_backward`,
:mod:`.cuda_tensor_core`), what they share (:mod:`.common`), and the registry below, which says
which rules schedule which kernel on which kind of target.

A rule is an object with ``apply(func, target) -> Schedule | None``; None means "not a PrimFunc
I schedule". The rules of a (kernel, target kind) are tried in order and the first schedule
wins, as TVM's dlight does with its rule lists. :func:`forward_schedule` is the forward's default
schedule; :func:`tensor_core_schedule` puts a half-precision layer on tensor cores
(:mod:`.cuda_tensor_core`), which is not the default."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target
from tvm_deform.schedules.cpu import DefaultCPU
from tvm_deform.schedules.cpu_backward import DefaultCPUBackward, DefaultCPUGradInput
from tvm_deform.schedules.cuda import DefaultCUDA, SplitReductionCUDA
from tvm_deform.schedules.cuda_backward import DefaultCUDABackward, DefaultCUDAGradInput
from tvm_deform.schedules.cuda_tensor_core import MIN_ARCH as TENSOR_CORE_MIN_ARCH
from tvm_deform.schedules.cuda_tensor_core import TensorCoreCUDA

from tvm_deform.ir import definition
from tvm_deform.ir.definition import ConvShape

#: (kernel, target kind) -> the default rules, in the order they are tried. The kernels are
#: those of :mod:`tvm_deform.ir.definition`: "forward", "backward" (every gradient but the
#: input's) and "grad_input" (the input's scatter).
DEFAULT_RULES = {
    ("forward", "llvm"): (DefaultCPU,),
    # A layer with too few output tiles to fill a GPU gets its reduction split over blocks.
    ("forward", "cuda"): (SplitReductionCUDA, DefaultCUDA),
    ("backward", "llvm"): (DefaultCPUBackward,),
    ("grad_input", "llvm"): (DefaultCPUGradInput,),
    ("backward", "cuda"): (DefaultCUDABackward,),
    ("grad_input", "cuda"): (DefaultCUDAGradInput,),
}


def apply_default(kernel: str, func: tirx.PrimFunc, target: Target) -> s_tir.Schedule:
    """``func`` (the PrimFunc of ``kernel``) under the first default rule for ``target``'s kind
    that applies."""
    rules = DEFAULT_RULES.get((kernel, target.kind.name))
    if rules is None:
        raise NotImplementedError(f"no default {kernel} schedule for {target.kind.name}")
    for rule in rules:
        sch = rule().apply(func, target)
        if sch is not None:
            return sch
    raise RuntimeError(f"no {kernel} schedule applies to this {target.kind.name} PrimFunc")


def forward_schedule(shape: ConvShape, target: Target, layout: str = "NCHW") -> s_tir.Schedule:
    """The default schedule of ``shape``'s forward for ``target``: the first default rule of
    the definition. float16 and bfloat16 layers compute on the CUDA cores too (columns and
    sums in float32): on an H200 the tensor-core schedule (:func:`tensor_core_schedule`) was
    slower than the CUDA-core one on 11 of the 14 suite layers it takes, so it is not the
    default."""
    return apply_default("forward", definition.forward(shape, layout), target)


def tensor_core_schedule(
    shape: ConvShape, target: Target, layout: str = "NCHW"
) -> s_tir.Schedule | None:
    """``shape``'s forward on tensor cores (:class:`.cuda_tensor_core.TensorCoreCUDA`, on the
    definition whose sampled columns are rounded to the layer's float16 or bfloat16, which a
    tensor core multiplies; float32 accumulation), or None where the rule does not take the
    layer. float32 never runs on tensor cores (no TF32)."""
    func = _tensor_core_definition(shape, target, layout)
    return None if func is None else TensorCoreCUDA().apply(func, target)


def tensor_cores_take(shape: ConvShape, target: Target, layout: str = "NCHW") -> bool:
    """Whether :func:`tensor_core_schedule` has a schedule for ``shape`` on ``target``."""
    func = _tensor_core_definition(shape, target, layout)
    return func is not None and TensorCoreCUDA().takes(func, target)


def split_parts(shape: ConvShape, target: Target, layout: str = "NCHW") -> int:
    """Into how many parts :func:`forward_schedule` splits ``shape``'s reduction over thread
    blocks (:class:`.cuda.SplitReductionCUDA`); 1 where it does not."""
    if target.kind.name != "cuda":
        return 1
    return SplitReductionCUDA().split_parts(definition.forward(shape, layout))


def _tensor_core_definition(shape: ConvShape, target: Target, layout: str) -> tirx.PrimFunc | None:
    """The definition the tensor-core rule is tried on (columns in the layer's half dtype), or
    None where it is never tried: not CUDA, or a dtype tensor cores do not take."""
    if target.kind.name != "cuda" or shape.dtype not in TENSOR_CORE_MIN_ARCH:
        return None
    return definition.forward(shape, layout, column_dtype=shape.dtype)
