"""How the kernels are scheduled (installed as ``tvm_deform.schedules``): one module per target
family and kernel (:mod:`.cpu`, :mod:`.cpu_backward`, :mod:`.cuda`, :mod:`.cuda_backward`), what
they share (:mod:`.common`), and the registry below, which says which rules schedule which
kernel on which kind of target.

A rule is an object with ``apply(func, target) -> Schedule | None``; None means "not a PrimFunc
I schedule". The rules of a (kernel, target kind) are tried in order and the first schedule
wins, as TVM's dlight does with its rule lists."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target
from tvm_deform.schedules.cpu import DefaultCPU
from tvm_deform.schedules.cpu_backward import DefaultCPUBackward, DefaultCPUGradInput
from tvm_deform.schedules.cuda import DefaultCUDA
from tvm_deform.schedules.cuda_backward import DefaultCUDABackward, DefaultCUDAGradInput

#: (kernel, target kind) -> the default rules, in the order they are tried. The kernels are
#: those of :mod:`tvm_deform.ir.definition`: "forward", "backward" (every gradient but the
#: input's) and "grad_input" (the input's scatter).
DEFAULT_RULES = {
    ("forward", "llvm"): (DefaultCPU,),
    ("forward", "cuda"): (DefaultCUDA,),
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
