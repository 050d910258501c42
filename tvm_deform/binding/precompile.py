"""Ahead-of-time compiling: every kernel a model's ``deform_conv2d`` calls will need, compiled
before its first image, in parallel processes (for a deployment, or before a training job).

The model runs once on fake tensors (``FakeTensorMode``: shapes only, nothing computed), which
tells every layer's shape; each kernel is then compiled into the disk cache by a pool of worker
processes, one per core. Last, each layer goes through the usual lookup in this process, which
loads the kernels and, where this machine has no tuning logs of its own, times the compatible
machines' records against the default (see :mod:`tvm_deform.runtime.dispatch`): that timing is
left out of the workers, which would disturb each other's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tvm_deform.binding import ops
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import diskcache, kernels, targets

__all__ = ["layers_of", "precompile"]


def layers_of(model: torch.nn.Module, *example_inputs: object) -> list[ops.Call]:
    """The calls of :func:`tvm_deform.deform_conv2d` that ``model(*example_inputs)`` makes,
    found by running it on fake tensors of the inputs' shapes (nothing is computed), each call
    once; with the gradients a training step would ask of each (run it under
    ``torch.no_grad()`` for inference)."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, ops.recording() as calls:
        fakes = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
        model(*fakes)
    return list(dict.fromkeys(calls))


def precompile(
    model: torch.nn.Module,
    *example_inputs: object,
    backward: bool = False,
    workers: int | None = None,
) -> list[ConvShape]:
    """Compile every kernel ``model(*example_inputs)`` needs (and, with ``backward``, its
    training step's backward kernels) before the first real call; returns the layers.

    Works on CPU and CUDA inputs; uses ``workers`` processes (default: the cores this process
    may use). Needs the disk cache (see :mod:`tvm_deform.runtime.diskcache`): without it each
    process compiles for itself, and only this one's kernels are kept.

    Examples::
        >>> import torch
        >>> from tvm_deform import DeformConv2d
        >>> from tvm_deform import precompile
        >>> class Layer(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.offset = torch.nn.Conv2d(4, 18, 3, padding=1)
        ...         self.conv = DeformConv2d(4, 4, 3, padding=1)
        ...     def forward(self, x):
        ...         return self.conv(x, self.offset(x))
        >>> [s.height for s in precompile(Layer(), torch.rand(1, 4, 9, 11), workers=1)]
        [9]
    """
    calls = layers_of(model, *example_inputs)
    jobs = []
    for call in calls:
        target = ops.device_target(call.device)
        jobs.append((call.shape, target, "forward", call.layout))
        if backward:
            trained = dataclasses.replace(call.shape, offset_grad_rule=call.offset_grad_rule)
            jobs.append((trained, target, "backward", call.gradients))
    count = workers or len(os.sched_getaffinity(0))
    if count > 1 and len(jobs) > 1 and diskcache.root() is not None:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(count, mp_context=context) as pool:
            list(pool.map(_compile, [(*job[:1], _spec(job[1]), *job[2:]) for job in jobs]))
    for shape, target, op, variant in jobs:
        if op == "forward":
            kernels.get_kernel(shape, target, layout=variant)
        else:
            kernels.get_backward(shape, target, gradients=variant)
    return [call.shape for call in calls]


def _spec(target) -> tuple:
    """What a worker needs to make ``target`` again (a target is not sent between processes)."""
    if target.kind.name == "cuda":
        facts = targets.facts(target)
        l2 = target.attrs.get("l2_cache_size_bytes")
        return ("cuda", str(target.attrs["arch"]), facts.get("multiprocessors"), l2 and int(l2))
    return ("llvm",)


def _compile(job: Sequence) -> None:
    shape, spec, op, variant = job
    target = targets.cuda_target(*spec[1:]) if spec[0] == "cuda" else targets.host_target()
    if op == "forward":
        kernels.compile_candidates(shape, target, op, layout=variant)
    else:
        kernels.compile_candidates(shape, target, op, gradients=variant)
