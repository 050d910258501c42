"""One GPU session in one call (tools layer): check, build, time, time a tuning round, write
results.

Run on a machine with an NVIDIA GPU, offline, by ``lab/gpu_session.sh`` (which unpacks TVM
from the parts ``lab/pack_gpu_wheels.sh`` made), or directly where TVM is installed::

    python lab/gpu_session.py --out OUT [--model] [--round ROUND] [--round-seconds 180]

Steps, each recorded in ``OUT/gpu_results.json`` as soon as it ends, pass or fail, so that a
call cut short keeps what was done; the exit code is non-zero if any step failed:

1. environment: GPU, compute capability, versions;
2. first kernel: the demo layer's default kernel builds, runs and matches torchvision (about a
   minute); if it does not, the session stops here;
3. build: every kernel the later steps run (the suite and the checks' configurations, in each
   dtype, with the fused, one-size, wide-tile, pipelined and tensor-core kernels the timing
   adds where they apply, and the backward's in float32), compiled in parallel processes into
   the kernel cache;
4. check: random configurations against torchvision's CUDA ``deform_conv2d`` (float32, and
   float16/bfloat16 against float32 on the upcast inputs), the five gradients of a few against
   torchvision's and repeated to the bit, a forward of 70000 images and a backward of 7300
   (more than one launch's grid holds: they run in chunks), a CUDA-graph capture on a side
   stream (fails if a kernel leaves torch's current stream or the host synchronises), and a
   tuned record's choices carried over to the kernels for any size of the demo layer, forward
   and backward (and each fused structure's forward), against torchvision at two other sizes
   (``check_carried_records``: the tuning logs a round brings are run so);
5. time: per workload and dtype, the median of CUDA-event timings of torchvision (where it has
   a kernel: not bfloat16), our default kernel (for any size) and tuned kernels (through their
   handles), the public ``deform_conv2d`` as users call it, the fused structure (the columns
   sampled per output tile), the default's kernel for the layer's size alone (both also built
   at ptxas's own register-usage level, 5, in float32: TVM builds at 10), the wide tile
   (``WideTileCUDA``, 8 x 8 register blocks) of float32 layers it takes, the default's
   structure with its copies pipelined (``PipelinedCUDA``), the tensor-core
   schedule of float16 and bfloat16 layers it takes (its kernel for this size, and the one for
   any size of the layer in this size's class), and cuDNN's dense
   ``conv2d``; each row is written as it is timed, and ``OUT/gpu_results.md`` holds the table;
6. backward: per workload in float32, the backward alone (every gradient) of the public op,
   of torchvision's and of cuDNN's dense ``conv2d``, medians of CUDA-event timings, our
   gradients checked against torchvision's;
7. host cost: the CPU time of one call of ours and of torchvision's, unsynchronised, and on a
   GPU that of the device and stream contexts around our launch alone;
8. profile: where a training step's time goes, kernel by kernel, on a few suite layers
   (``PROFILED``, float32): the device time of each kernel a forward and backward of ours and
   of torchvision's launch (``torch.profiler``'s CUDA activity, which records every kernel the
   process launches, TVM's included), into ``OUT/gpu_profile.md``; on a CPU, the operators'
   own times;
9. model (``--model``): R50-DCNv2 at batch 2, 640x640, in float32 and float16, with
   torchvision's op, ours and dense convs in place;
10. round (``--round``): a round of tuning candidates built elsewhere (``tvm-deform
   tune-round``) timed with ``lab/time_round.py`` within ``--round-seconds``, into
   ``OUT/round_results.jsonl`` for ``tvm-deform tune-ingest``;
11. tune (``--trials``): MetaSchedule's online tuning here, in the generic CUDA space, within
    ``--tune-seconds`` (needs TVM's builder and xgboost on this machine; the rounds are the
    way that fits a short GPU window).

A step that would start after ``--deadline`` seconds is skipped (recorded as such), so that the
call ends before the machine's limit on one command (``--call-limit``). The same functions run
on the CPU (``--device cpu``), which is how the tests rehearse them on machines without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import subprocess
import sys
import tarfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tvm_deform import __version__, deform_conv2d, schedules
from tvm_deform.ir import definition
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels
from tvm_deform.runtime.inputs import TOLERANCE, conv_kwargs, random_inputs, random_shape
from tvm_deform.tools.bench import geometric_mean, measure, relative_error
from tvm_deform.tools.suite import load_suite

#: the labels of the rows that time a kernel dispatch does not pick, to tell whether it
#: should: the fused structure (the columns sampled per output tile in shared memory,
#: ``SplitReductionCUDA`` or ``OnePassCUDA``), the default's kernel for this size alone (what
#: a kernel for any size costs), and the tensor-core schedule of half-precision layers (not
#: counted as ours in the speed-ups)
FUSED = "fused (OnePassCUDA)"
ONE_SIZE = "one size (static kernel)"
TENSOR_CORES = "tensor cores (SampleOnceTensorCoreCUDA)"
TENSOR_CORES_ANY_SIZE = "tensor cores, any size (SampleOnceTensorCoreCUDA)"
WIDE = "wide tile (WideTileCUDA)"
PIPELINED = "pipelined (PipelinedCUDA)"
#: ptxas's own register-usage level (its default), against the 10 of TVM's compile, which every
#: other kernel is built at: the fused structure and the default's kernel for one size built
#: at it, to tell which level the package should build at (on sm_90, ptxas gives the split
#: fused GEMM of the float32 layers 168 registers at 10, at most 56 at 5; the default's GEMM of
#: the 64-channel demo layer 80 and 71)
PTXAS_LEVEL = 5
FUSED_AT_LEVEL = f"fused, ptxas level {PTXAS_LEVEL}"
ONE_SIZE_AT_LEVEL = f"one size, ptxas level {PTXAS_LEVEL}"
#: our kernels that dispatch may run, timed through their handles: the speed-ups take the best
KERNELS = ("tvm_deform default", "tvm_deform tuned")
#: the label of the rows that time the public ``deform_conv2d``, as users call it (argument
#: checks, kernel lookup and the choice among tuned records included)
PUBLIC_OP = "tvm_deform public op"
#: the suite layers whose kernels the session profiles: the 128-channel detection map, the
#: 512-channel 10x10 map (few output tiles, a long reduction) and the 64-channel demo layer
PROFILED = ("r50_c3_128x100x168", "r50dcn320_c5_512x10x10", "demo_64x56x56")


def _inputs(shape: ConvShape, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    inputs = random_inputs(dataclasses.replace(shape, dtype="float32"), seed=seed)
    moved = {
        k: v.to(device=device, dtype=dtype) if v is not None else None for k, v in inputs.items()
    }
    return moved | conv_kwargs(shape)


def check_shapes(count: int = 24, seed: int = 0) -> list[ConvShape]:
    """The random configurations :func:`check_correctness` runs (float32)."""
    rng = random.Random(seed)
    return [
        random_shape(
            rng, (1, 1, 2, 4), channels_per_group=8, extra_size=40, batch=4, mask_probability=0.8
        )
        for _ in range(count)
    ]


def session_dtypes(device: str) -> list[torch.dtype]:
    """The dtypes a session checks and times on ``device``."""
    return [torch.float32] + ([torch.float16, torch.bfloat16] if device == "cuda" else [])


def check_correctness(device: str, count: int = 24, seed: int = 0) -> list[dict]:
    """Our op against torchvision's on ``device`` for ``count`` random configurations, in
    float32 and, on CUDA, float16 and bfloat16 (against float32 on the upcast inputs)."""
    import torchvision.ops

    results = []
    for index, shape in enumerate(check_shapes(count, seed)):
        for dtype in session_dtypes(device):
            args = _inputs(shape, device, dtype, seed=index)
            ours = deform_conv2d(**args)
            upcast = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
            expected = torchvision.ops.deform_conv2d(**upcast)
            error = relative_error(ours, expected)
            results.append(
                {
                    "shape": dataclasses.asdict(shape),
                    "dtype": str(dtype).removeprefix("torch."),
                    "error": error,
                    "passed": error <= TOLERANCE[str(dtype).removeprefix("torch.")],
                }
            )
    return results


def check_gradients(device: str, count: int = 4, seed: int = 1) -> list[dict]:
    """The five gradients of our op against torchvision's on ``device`` for ``count`` random
    float32 configurations, and whether two runs of ours give the same bits."""
    import torchvision.ops

    names = ("input", "offset", "weight", "bias", "mask")
    results = []
    for index, shape in enumerate(check_shapes(count, seed)):
        args = _inputs(shape, device, torch.float32, seed=index)
        present = [n for n in names if args[n] is not None]
        runs = [
            _gradients(fn, args, present)
            for fn in (deform_conv2d, deform_conv2d, torchvision.ops.deform_conv2d)
        ]
        errors = {
            n: relative_error(a, c) for n, a, c in zip(present, runs[0], runs[2], strict=True)
        }
        repeat = all(torch.equal(a, b) for a, b in zip(runs[0], runs[1], strict=True))
        results.append(
            {
                "shape": dataclasses.asdict(shape),
                "errors": errors,
                "same_bits_twice": repeat,
                "passed": repeat and max(errors.values()) <= 2e-5,
            }
        )
    return results


def _gradients(fn: Callable, args: dict, names: Sequence[str]) -> tuple[torch.Tensor, ...]:
    """The gradients of ``fn(**args)`` (an op with ``deform_conv2d``'s signature), summed over
    its output, with respect to the arguments ``names``."""
    leaves = {n: args[n].detach().clone().requires_grad_() for n in names}
    out = fn(**(args | leaves))
    return torch.autograd.grad(out, list(leaves.values()), torch.ones_like(out))


def check_large_batch(device: str) -> dict:
    """Our op against torchvision's (float32) on a forward of more images than a CUDA grid
    axis holds (65535) and on a backward of more (image, tap) pairs of a 3x3 layer than it
    holds (65535 / 9): on a GPU they run in chunks of images (``calls.images_per_call``)."""
    import torchvision.ops

    shape = ConvShape(70_000, 2, 5, 5, 2, 3, 3, pad_h=1, pad_w=1)
    args = _inputs(shape, device, torch.float32)
    forward = relative_error(deform_conv2d(**args), torchvision.ops.deform_conv2d(**args))
    small = dataclasses.replace(shape, batch=7_300)
    args = _inputs(small, device, torch.float32, seed=1)
    names = ("input", "offset", "weight", "mask")
    runs = [_gradients(fn, args, names) for fn in (deform_conv2d, torchvision.ops.deform_conv2d)]
    errors = {n: relative_error(a, b) for n, a, b in zip(names, *runs, strict=True)}
    return {
        "forward_images": shape.batch,
        "forward_error": forward,
        "backward_images": small.batch,
        "backward_errors": errors,
        "passed": max(forward, *errors.values()) <= 2e-5,
    }


def check_carried_records(device: str, name: str = "demo_64x56x56") -> list[dict]:
    """A tuned record carried over to the kernels for any size of its layer, as dispatch
    carries this machine's logs' records (``schedules.derive``: the rule's design space for
    any size, with the record's choices), on ``device``: for the forward and the backward of
    ``name``, the first design space's schedule of the layer's own size with every choice
    moved one candidate from the rule's own, derived for any size and run at two other sizes
    against torchvision's op (float32); on a GPU also a forward record of each fused
    structure (``FUSED_SPACES``). The emulated tests check such kernels' arithmetic on a CPU,
    not their thread bindings; a record that does not derive fails the step."""
    import torchvision.ops

    from tvm_deform.runtime import calls

    shape = load_suite()[name]
    target = _target(device)
    layer = shape.any_size()
    sizes = [
        dataclasses.replace(shape, batch=2, height=h, width=w) for h, w in ((53, 61), (60, 47))
    ]
    rows = []
    cases = [("forward", None), ("backward", None)]
    if target.kind.name == "cuda":
        cases += [("forward", space) for space in FUSED_SPACES]
    for op, space in cases:
        record = _moved_record(shape, target, op, space)
        fell_back: list[str] = []
        if op == "backward":
            quantum = schedules.backward_pixel_quantum(shape, target)
            module = kernels.compile_backward(layer, target, record, quantum=quantum)
            compiled = kernels._backward_kernels(module, layer, target, definition.ALL_GRADIENTS)
            compiled = compiled._replace(quantum=quantum, any_size=True)
        for size in sizes:
            args = _inputs(size, device, torch.float32, seed=len(rows))
            tensors = [args[n] for n in ("input", "offset", "weight", "bias", "mask")]
            expected = torchvision.ops.deform_conv2d(**args)
            if op == "forward":
                size_class = kernels._size_class(size, schedules.pixel_classes(size, target))
                kernel = kernels._any_size_class(
                    layer, target, "NCHW", size_class, record, fell_back.append
                )
                ours = calls.run_forward(size, *tensors, kernel=kernel)
                errors = {"output": relative_error(ours, expected)}
            else:
                grad_output = torch.randn_like(expected)
                input, offset, weight, _, mask = tensors
                ours = calls.run_backward(size, grad_output, input, offset, weight, mask, compiled)
                present = [
                    n for n in ("input", "offset", "mask", "weight", "bias") if args[n] is not None
                ]
                leaves = {n: args[n].detach().clone().requires_grad_() for n in present}
                out = torchvision.ops.deform_conv2d(**(args | leaves))
                theirs = torch.autograd.grad(out, list(leaves.values()), grad_output)
                order = ("input", "offset", "mask", "weight", "bias")
                errors = {
                    n: relative_error(ours[order.index(n)], value)
                    for n, value in zip(present, theirs, strict=True)
                }
            rows.append(
                {
                    "op": op,
                    "space": space or "first",
                    "size": f"{size.batch}x{size.height}x{size.width}",
                    "errors": errors,
                    "fell_back": fell_back,
                    "passed": not fell_back and max(errors.values()) <= 2e-5,
                }
            )
    return rows


#: the fused structures' rules, whose records the GPU session carries over to the kernels for
#: any size beside the first design space's (their output-channel tiles bound apart from the
#: pixel tiles, so that TVM bounds the staged columns for any size)
FUSED_SPACES = ("OnePassCUDA", "SplitReductionCUDA")


def _moved_record(shape: ConvShape, target, op: str, rule: str | None = None):
    """A record of ``shape``'s ``op``: its first design space on ``target`` (of the rule named
    ``rule``, where given) with every sampled choice moved one candidate back from the rule's
    own (or to the last)."""
    from tvm.s_tir import meta_schedule as ms

    from tvm_deform.runtime import records

    mod = records.workload_module(shape, op)
    spaces = schedules.named_design_spaces(op, mod["main"], target)
    space = next((sch for name, sch in spaces if rule in (None, name)), None)
    if space is None:
        raise ValueError(f"{rule or 'no rule'} has no design space of {op} for {shape}")
    trace = schedules.other_choices(mod, space)
    tuning = ms.database.TuningRecord(trace, ms.database.Workload(mod), [1e-3], target)
    key = f"{target.kind.name}/moved"
    return records.TunedRecord(Path("."), key, "handwritten", 1.0, tuning)


def first_kernel(device: str) -> dict:
    """The quick check a session starts with: the demo layer's default kernel builds, runs on
    ``device`` and matches torchvision's op there (float32)."""
    import torchvision.ops

    shape = load_suite()["demo_64x56x56"]
    args = _inputs(shape, device, torch.float32)
    began = time.monotonic()
    ours = deform_conv2d(**args)
    if device == "cuda":
        torch.cuda.synchronize()
    error = relative_error(ours, torchvision.ops.deform_conv2d(**args))
    return {
        "seconds": round(time.monotonic() - began, 2),
        "error": error,
        "passed": error <= TOLERANCE["float32"],
    }


def check_stream_capture(shape: ConvShape) -> bool:
    """Capture the op in a CUDA graph on a side stream and replay it: the capture fails if a
    kernel runs on another stream or the host synchronises; the replay must equal a plain
    call."""
    args = _inputs(shape, "cuda", torch.float32)
    expected = deform_conv2d(**args)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        deform_conv2d(**args)
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            captured = deform_conv2d(**args)
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(captured, expected))


def time_layers(
    layers: dict[str, ConvShape],
    device: str,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    runs: int = 20,
    on_row: Callable[[dict], None] = lambda row: None,
    tuned: bool = False,
) -> list[dict]:
    """Per layer and dtype: torchvision, our kernel (default schedule, through its handle), the
    public op and dense conv2d, timed side by side on the same inputs (and on a GPU the fused
    structure, the default's kernel for the layer's size alone and, in float32, the wide
    tile's; for half-precision layers that tensor cores take, the tensor-core schedule), or
    with ``tuned`` our tuned kernel alone (where the logs have one); ``on_row`` gets each row
    as soon as it is timed. Errors are checked against torchvision in float32 on the upcast
    inputs (its CUDA kernel has no bfloat16). An implementation that fails (torchvision in a
    dtype it lacks) gets a row with its error instead of a time; the others still run."""
    import torchvision.ops

    target = _target(device)
    rows = []
    for name, shape in layers.items():
        for dtype in dtypes:
            dtype_name = str(dtype).removeprefix("torch.")
            typed = dataclasses.replace(shape, dtype=dtype_name)
            args = _inputs(shape, device, dtype)
            kwargs = conv_kwargs(shape)
            upcast = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
            expected = torchvision.ops.deform_conv2d(**upcast)
            # label -> a function that returns the call to time (building our kernels first,
            # so that a failure to build is that row's result, and compiling is not timed)
            variants: dict[str, Callable[[], Callable[[], torch.Tensor]]] = {}
            if tuned:
                if kernels.resolve(typed, target) is not None:
                    variants["tvm_deform tuned"] = lambda typed=typed, args=args: _our_kernel(
                        typed, target, tuned=True, args=args
                    )
            else:
                variants["torchvision"] = lambda args=args: (
                    lambda: torchvision.ops.deform_conv2d(**args)
                )
                variants["tvm_deform default"] = lambda typed=typed, args=args: _our_kernel(
                    typed, target, tuned=False, args=args
                )
                if compares_structures(target):
                    variants[FUSED] = lambda typed=typed, args=args: _runner(
                        typed, _fused_kernel(typed, target), args
                    )
                    variants[ONE_SIZE] = lambda typed=typed, args=args: _runner(
                        typed, _one_size_kernel(typed, target), args
                    )
                if times_register_level(typed, target):
                    variants[FUSED_AT_LEVEL] = lambda typed=typed, args=args: _runner(
                        typed, _at_ptxas_level(_fused_kernel, typed, target), args
                    )
                    variants[ONE_SIZE_AT_LEVEL] = lambda typed=typed, args=args: _runner(
                        typed, _at_ptxas_level(_one_size_kernel, typed, target), args
                    )
                if times_wide_tile(typed, target):
                    variants[WIDE] = lambda typed=typed, args=args: _runner(
                        typed, _wide_tile_kernel(typed, target), args
                    )
                if compares_structures(target):
                    variants[PIPELINED] = lambda typed=typed, args=args: _runner(
                        typed, _pipelined_kernel(typed, target), args
                    )
                if schedules.tensor_cores_take(typed, target):
                    variants[TENSOR_CORES] = lambda typed=typed, args=args: _runner(
                        typed, _tensor_core_kernel(typed, target), args
                    )
                if schedules.tensor_cores_take(typed, target, any_size=True):
                    variants[TENSOR_CORES_ANY_SIZE] = lambda typed=typed, args=args: _runner(
                        typed, _tensor_core_any_size_kernel(typed, target), args
                    )
                variants[PUBLIC_OP] = lambda args=args: lambda: deform_conv2d(**args)
                variants["conv2d (dense)"] = lambda args=args, kwargs=kwargs, shape=shape: (
                    lambda: torch.nn.functional.conv2d(
                        args["input"],
                        args["weight"],
                        args["bias"],
                        groups=shape.weight_groups,
                        **kwargs,
                    )
                )
            if not variants:
                continue
            with torch.no_grad():
                for label, make in variants.items():
                    row = {"layer": name, "dtype": dtype_name, "implementation": label}
                    if label == "tvm_deform default":
                        row["split_parts"] = schedules.split_parts(typed, target)
                    try:
                        fn = make()
                        dense = label.startswith("conv2d")
                        row["error"] = None if dense else relative_error(fn(), expected)
                        row["median_ms"] = measure(
                            fn, warmup=3, min_runs=runs, min_seconds=0, cuda=device == "cuda"
                        ).median_ms
                    except Exception as error:  # noqa: BLE001 - a missing kernel is a result
                        row |= {"median_ms": None, "failure": repr(error)[:300]}
                    rows.append(row)
                    on_row(row)
    return rows


def _our_kernel(shape: ConvShape, target, tuned: bool, args: dict) -> Callable[[], torch.Tensor]:
    return _runner(shape, kernels.get_kernel(shape, target, tuned=tuned), args)


def compares_structures(target) -> bool:
    """Whether the session times the fused structure and the kernel for one size beside the
    default: on a GPU (the CPU's default is another rule)."""
    return target.kind.name == "cuda"


def _fused_kernel(shape: ConvShape, target) -> kernels.Kernel:
    """The layer under the fused structure (the default before the sample-once one): its
    reduction split where ``SplitReductionCUDA`` splits it, else ``OnePassCUDA``'s one pass."""
    from tvm_deform.schedules.cuda import OnePassCUDA, SplitReductionCUDA

    def schedule():
        func = definition.forward(shape)
        return SplitReductionCUDA().apply(func, target) or OnePassCUDA().apply(func, target)

    return kernels.load_scheduled(shape, target, "fused", schedule)


def _one_size_kernel(shape: ConvShape, target) -> kernels.Kernel:
    """The default schedule's kernel for this layer's size alone (dispatch runs the one for any
    size): the timing that tells what generality costs."""
    return kernels.load_kernel(shape, target)


def times_register_level(shape: ConvShape, target) -> bool:
    """Whether the session times the fused structure and the default's kernel for one size
    built at ptxas's register-usage level :data:`PTXAS_LEVEL` too: float32 layers on a GPU."""
    return compares_structures(target) and shape.dtype == "float32"


def _at_ptxas_level(kernel: Callable, shape: ConvShape, target) -> kernels.Kernel:
    """``kernel(shape, target)`` built (or found in the kernel cache, whose key holds the
    level) at ptxas's register-usage level :data:`PTXAS_LEVEL`."""
    import os

    before = os.environ.get("TVM_CUDA_PTXAS_REG_LEVEL")
    os.environ["TVM_CUDA_PTXAS_REG_LEVEL"] = str(PTXAS_LEVEL)
    try:
        return kernel(shape, target)
    finally:
        if before is None:
            os.environ.pop("TVM_CUDA_PTXAS_REG_LEVEL", None)
        else:
            os.environ["TVM_CUDA_PTXAS_REG_LEVEL"] = before


def times_wide_tile(shape: ConvShape, target) -> bool:
    """Whether the session times ``WideTileCUDA`` (8 x 8 register blocks) beside the default:
    float32 layers on a GPU that it takes; the timing that tells whether it should be the
    default (its kernel for this size alone, to compare with the default's, ``ONE_SIZE``)."""
    from tvm_deform.schedules.cuda import WideTileCUDA

    if not compares_structures(target) or shape.dtype != "float32":
        return False
    try:
        return WideTileCUDA().apply(definition.forward(shape), target) is not None
    except Exception:  # noqa: BLE001 - timed anyway: the failure becomes the row's result
        return True


def _wide_tile_kernel(shape: ConvShape, target) -> kernels.Kernel:
    from tvm_deform.schedules.cuda import WideTileCUDA

    return kernels.load_scheduled(
        shape, target, "wide-tile", lambda: WideTileCUDA().apply(definition.forward(shape), target)
    )


def _pipelined_kernel(shape: ConvShape, target) -> kernels.Kernel:
    """``PipelinedCUDA`` (the default's structure, its copies pipelined two chunks deep): its
    kernel for this size alone, to compare with the default's (``ONE_SIZE``)."""
    from tvm_deform.schedules.cuda import PipelinedCUDA

    return kernels.load_scheduled(
        shape, target, "pipelined", lambda: PipelinedCUDA().apply(definition.forward(shape), target)
    )


def _tensor_core_kernel(shape: ConvShape, target) -> kernels.Kernel:
    """The half-precision layer on tensor cores: the timing that tells whether they should be
    the default again."""
    return kernels.load_scheduled(
        shape, target, "tensor-cores", lambda: schedules.tensor_core_schedule(shape, target)
    )


def _tensor_core_any_size_kernel(shape: ConvShape, target) -> kernels.Kernel:
    """The tensor-core kernel for any size of the layer, in the size class of ``shape``'s
    map: what dispatch would run if tensor cores were the half-precision default."""
    classes = schedules.tensor_core_pixel_classes(shape, target)
    pixels = definition.padded_pixels(shape.out_h * shape.out_w, always=True)
    chosen = max(c for c in classes if pixels >= c)
    layer = shape.any_size()
    return kernels.load_scheduled(
        layer,
        target,
        f"tensor-cores-any-size-{chosen}",
        lambda: schedules.tensor_core_schedule(layer, target, min_pixels=chosen),
    )


def _runner(shape: ConvShape, kernel, args: dict) -> Callable[[], torch.Tensor]:
    """A call of ``kernel`` on ``args``."""
    from tvm_deform.binding.ops import run_forward

    return lambda: run_forward(
        shape, args["input"], args["offset"], args["weight"], args["bias"], args["mask"], kernel
    )


def _target(device: str):
    """The target of ``device``'s kernels, as the op makes it (a GPU's with its multiprocessor
    count and L2 size)."""
    from tvm_deform.runtime.calls import device_target

    return device_target(torch.device(device))


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def markdown(rows: list[dict]) -> str:
    """One line per (layer, dtype): times, our speed-up over torchvision, ratio to conv2d ("-"
    where an implementation has no time: torchvision in a dtype it lacks, or a failure)."""
    lines = [
        "| layer | dtype | torchvision ms | ours default ms | ours tuned ms | public op ms "
        f"| fused ms | one size ms | {FUSED_AT_LEVEL} ms | {ONE_SIZE_AT_LEVEL} ms | wide tile ms "
        "| pipelined ms | tensor cores ms | tensor cores, any size ms | conv2d ms "
        "| speed-up (best) | best / conv2d | error |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    grouped: dict[tuple[str, str], dict[str, dict]] = {}
    for row in rows:
        if row.get("median_ms") is not None:
            grouped.setdefault((row["layer"], row["dtype"]), {})[row["implementation"]] = row
    for (layer, dtype), found in grouped.items():
        ours = [found[k] for k in KERNELS if k in found]
        best = min(ours, key=lambda r: r["median_ms"]) if ours else None
        error = f"{best['error']:.1e}" if best else "-"
        lines.append(
            f"| {layer} | {dtype} | {_ms(found, 'torchvision')} "
            f"| {_ms(found, 'tvm_deform default')} | {_ms(found, 'tvm_deform tuned')} "
            f"| {_ms(found, PUBLIC_OP)} | {_ms(found, FUSED)} | {_ms(found, ONE_SIZE)} "
            f"| {_ms(found, FUSED_AT_LEVEL)} | {_ms(found, ONE_SIZE_AT_LEVEL)} "
            f"| {_ms(found, WIDE)} | {_ms(found, PIPELINED)} | {_ms(found, TENSOR_CORES)} "
            f"| {_ms(found, TENSOR_CORES_ANY_SIZE)} | {_ms(found, 'conv2d (dense)')} "
            f"| {_ratio(found, 'torchvision', best)} "
            f"| {_ratio(found, 'conv2d (dense)', best, inverse=True)} | {error} |"
        )
    return "\n".join(lines)


def backward_markdown(rows: list[dict]) -> str:
    """The backward's table: one line per layer, and the geometric mean of torchvision's time
    over ours."""
    lines = [
        "| layer | torchvision ms | public op ms | conv2d ms | torchvision / ours | error |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    grouped: dict[str, dict[str, dict]] = {}
    for row in rows:
        if row.get("median_ms") is not None:
            grouped.setdefault(row["layer"], {})[row["implementation"]] = row
    ratios = []
    for layer, found in grouped.items():
        ours = found.get(PUBLIC_OP)
        error = f"{ours['error']:.1e}" if ours and ours.get("error") is not None else "-"
        if ours and "torchvision" in found:
            ratios.append(found["torchvision"]["median_ms"] / ours["median_ms"])
        lines.append(
            f"| {layer} | {_ms(found, 'torchvision')} | {_ms(found, PUBLIC_OP)} "
            f"| {_ms(found, 'conv2d (dense)')} | {_ratio(found, 'torchvision', ours)} | {error} |"
        )
    if ratios:
        lines.append(f"\nGeometric mean of torchvision / ours: {geometric_mean(ratios):.2f}x")
    return "\n".join(lines)


def _ms(found: dict[str, dict], label: str) -> str:
    return f"{found[label]['median_ms']:.3f}" if label in found else "-"


def _ratio(found: dict[str, dict], label: str, best: dict | None, inverse: bool = False) -> str:
    """``label``'s time over ``best``'s (or the inverse), or "-" when either is missing."""
    if best is None or label not in found:
        return "-"
    value = found[label]["median_ms"] / best["median_ms"]
    return f"{1 / value if inverse else value:.2f}x"


def speedup_over_torchvision(rows: list[dict], dtype: str = "float32") -> float | None:
    """Geometric mean over layers of torchvision's time over our best kernel's, in ``dtype``
    (None when no layer has both)."""
    grouped: dict[str, dict[str, float]] = {}
    for row in rows:
        if row["dtype"] == dtype and row.get("median_ms") is not None:
            grouped.setdefault(row["layer"], {})[row["implementation"]] = row["median_ms"]
    ratios = [
        t["torchvision"] / min(v for k, v in t.items() if k in KERNELS)
        for t in grouped.values()
        if "torchvision" in t and any(k in KERNELS for k in t)
    ]
    return geometric_mean(ratios) if ratios else None


def time_backward(layers: dict[str, ConvShape], device: str, runs: int = 10) -> list[dict]:
    """Per layer, in float32: the backward alone (every gradient, through autograd, the
    forward's graph kept) of the public op, of torchvision's and of cuDNN's dense ``conv2d``
    (input, weight and bias gradients), medians of CUDA-event timings on the same inputs; our
    gradients are checked against torchvision's (the largest relative error of the five)."""
    import torchvision.ops

    names = ("input", "offset", "weight", "bias", "mask")
    rows = []
    for name, shape in layers.items():
        args = _inputs(shape, device, torch.float32)
        present = [n for n in names if args[n] is not None]

        def dense(input, offset, weight, bias, mask, groups=shape.weight_groups, **kwargs):
            return torch.nn.functional.conv2d(input, weight, bias, groups=groups, **kwargs)

        calls = {
            "torchvision": torchvision.ops.deform_conv2d,
            PUBLIC_OP: deform_conv2d,
            "conv2d (dense)": dense,
        }
        theirs = None
        for label, fn in calls.items():
            row = {"layer": name, "dtype": "float32", "implementation": label}
            try:
                leaves = {n: args[n].detach().clone().requires_grad_() for n in present}
                sampled = label != "conv2d (dense)"  # a dense conv has no offset nor mask
                used = [leaves[n] for n in present if sampled or n not in ("offset", "mask")]
                out = fn(**(args | leaves))
                grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
                grad = grad.to(out)
                grads = torch.autograd.grad(out, used, grad, retain_graph=True)
                if label == "torchvision":
                    theirs = grads
                elif label == PUBLIC_OP and theirs is not None:
                    pairs = zip(grads, theirs, strict=True)
                    row["error"] = max(relative_error(a, b) for a, b in pairs)
                row["median_ms"] = measure(
                    lambda out=out, used=used, grad=grad: torch.autograd.grad(
                        out, used, grad, retain_graph=True
                    ),
                    warmup=3,
                    min_runs=runs,
                    min_seconds=0,
                    cuda=device == "cuda",
                ).median_ms
            except Exception as error:  # noqa: BLE001 - a failure is a result
                row |= {"median_ms": None, "failure": repr(error)[:300]}
            rows.append(row)
    return rows


def host_cost(device: str, layers: Sequence[str] = ("seed", "demo_64x56x56"), calls: int = 200):
    """The CPU time one call takes on the host (``time.thread_time``, no synchronisation
    inside the timed calls) of the public op and of torchvision's, per layer: the launch and
    bookkeeping cost a GPU user pays on every call however fast the kernels are. On a GPU,
    also the part of ours that a CPU call does not have: entering and leaving the device and
    stream contexts around the kernels' launch."""
    import torchvision.ops

    suite, rows = load_suite(), []
    for name in layers:
        args = _inputs(suite[name], device, torch.float32)
        calls_of = {
            "torchvision": lambda args=args: torchvision.ops.deform_conv2d(**args),
            PUBLIC_OP: lambda args=args: deform_conv2d(**args),
        }
        for label, call in calls_of.items():
            host_us = _host_us(call, device, calls)
            rows.append({"layer": name, "implementation": label, "host_us": host_us})
    if device == "cuda":
        import tvm_ffi

        gpu = torch.device("cuda", torch.cuda.current_device())

        def contexts():
            with torch.cuda.device(gpu), tvm_ffi.use_torch_stream():
                pass

        row = {"layer": "-", "implementation": "device and stream contexts alone"}
        try:
            row["host_us"] = _host_us(contexts, device, calls)
        except Exception as error:  # noqa: BLE001 - a failure is a result
            row |= {"host_us": None, "failure": repr(error)[:300]}
        rows.append(row)
    return rows


def _host_us(call: Callable[[], object], device: str, calls: int) -> float:
    """Microseconds of the host's CPU time a call of ``call`` takes (after 10 warm-up calls,
    without synchronising between the timed calls)."""
    with torch.no_grad():
        for _ in range(10):
            call()
        _synchronize(device)
        began = time.thread_time()
        for _ in range(calls):
            call()
        spent = time.thread_time() - began
        _synchronize(device)
    return spent / calls * 1e6


def profile_kernels(
    layers: dict[str, ConvShape], device: str, steps: int = 3, top: int = 12
) -> list[dict]:
    """Per layer, in float32: the ``top`` kernels by device time of ``steps`` training steps
    of one layer (forward and every gradient) of the public op and of torchvision's, each
    kernel's launches and device time per step (on a CPU, the operators' own CPU time). A
    breakdown of the timings of ``time_layers`` and ``time_backward``: which kernel of ours
    costs what, against which of theirs."""
    import torchvision.ops
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    rows = []
    for name, shape in layers.items():
        args = _inputs(shape, device, torch.float32)
        names = ("input", "offset", "weight", "bias", "mask")
        present = [n for n in names if args[n] is not None]
        calls = (("torchvision", torchvision.ops.deform_conv2d), (PUBLIC_OP, deform_conv2d))
        for label, fn in calls:
            leaves = {n: args[n].detach().clone().requires_grad_() for n in present}

            def training_step(fn=fn, call_args=args | leaves, leaves=leaves):
                out = fn(**call_args)
                torch.autograd.grad(out, list(leaves.values()), torch.ones_like(out))

            training_step()  # compiles and warms up outside the profile
            _synchronize(device)
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    training_step()
                _synchronize(device)
            rows += _kernel_rows(prof, device, steps, top, {"layer": name, "implementation": label})
    return rows


def _kernel_rows(prof, device: str, steps: int, top: int, row: dict) -> list[dict]:
    """The ``top`` entries of ``prof`` by device time (kernels on a GPU, operators' own time on
    a CPU), per step."""
    found = []
    for event in prof.key_averages():
        if device == "cuda":
            spent = event.self_device_time_total if event.device_type.name == "CUDA" else 0
        else:
            spent = event.self_cpu_time_total
        if spent > 0:
            found.append((spent, event.count, event.key))
    found.sort(reverse=True)
    return [
        row | {"kernel": key[:120], "launches": count / steps, "us_per_step": spent / steps}
        for spent, count, key in found[:top]
    ]


def profile_markdown(rows: list[dict]) -> str:
    """The profile step's rows as a table, a layer and implementation at a time."""
    lines = [
        "| layer | implementation | kernel | launches a step | us a step |",
        "|---|---|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layer']} | {r['implementation']} | `{r['kernel']}` | {r['launches']:g} "
            f"| {r['us_per_step']:.1f} |"
        )
    return "\n".join(lines)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_model(
    device: str,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float16),
    batch: int = 2,
    size: int = 640,
    runs: int = 10,
) -> list[dict]:
    """R50-DCNv2 (``tvm_deform.tools.bench_model``) on a ``batch x 3 x size x size`` input per
    dtype: torch with torchvision's op, with ours, and with dense convs in place (the ceiling);
    medians of CUDA-event timings, ours checked against torchvision's output."""
    from tvm_deform.tools.bench_model import LABELS, r50_dcnv2

    rows = []
    image = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))
    for dtype in dtypes:
        x = image.to(device=device, dtype=dtype)
        outputs = {}
        for name in ("torchvision", "tvm_deform", "dense"):
            row = {"model": f"r50_dcnv2 {batch}x{size}x{size}", "dtype": str(dtype)[6:]}
            row["implementation"] = LABELS[name]
            try:
                model = r50_dcnv2(name).to(device=device, dtype=dtype)
                with torch.inference_mode():
                    outputs[name] = model(x)
                    timing = measure(
                        lambda model=model, x=x: model(x), warmup=2, min_runs=runs, min_seconds=0,
                        cuda=device == "cuda",
                    )  # fmt: skip
                row["median_ms"] = timing.median_ms
                if name == "tvm_deform" and "torchvision" in outputs:
                    row["error"] = relative_error(outputs[name], outputs["torchvision"])
            except Exception as error:  # noqa: BLE001 - a failure is a result
                row |= {"median_ms": None, "failure": repr(error)[:300]}
            rows.append(row)
    return rows


def time_round(round_dir: Path, out: Path, seconds: float) -> dict:
    """Time a round of tuning candidates (``tvm-deform tune-round``, carried to this machine)
    with ``lab/time_round.py`` within ``seconds``, in a process of its own (a candidate that
    breaks the CUDA context costs neither this session's context nor the rest of the round:
    the script starts itself again); the JSON lines go to ``out``."""
    script = Path(__file__).resolve().parent / "time_round.py"
    command = [sys.executable, str(script), str(round_dir), "--out", str(out)]
    finished = subprocess.run([*command, "--deadline", str(max(0.0, seconds))], check=False)
    text = out.read_text() if out.exists() else ""
    lines = [json.loads(x) for x in text.splitlines() if x.strip()]
    return {
        "timed": sum("run_secs" in x for x in lines),
        "failed": sum("error" in x for x in lines),
        "exit_status": finished.returncode,
        "results": str(out),
    }


def tuning_order(layers: dict[str, ConvShape]) -> dict[str, ConvShape]:
    """The layers by decreasing arithmetic: when the tuning time runs out, the layers it left
    out are the ones where a schedule matters least."""
    return dict(sorted(layers.items(), key=lambda item: -item[1].gemm_flops))


def tune_suite(
    layers: dict[str, ConvShape], trials: int, seconds: float, work: Path, device: str = "cuda"
) -> dict:
    """Tune ``layers`` for this GPU (or this CPU) in the generic space, one after another,
    until ``seconds`` have passed (the layer being tuned then is stopped, keeping the records
    it has); returns the per-task results and writes the pruned logs under ``work / "logs"``."""
    from tvm_deform.tools.tuning import tune

    target = _target(device)
    started, done = time.monotonic(), {}
    for name, shape in layers.items():
        left = seconds - (time.monotonic() - started)
        if left <= 0:
            done[name] = "skipped: out of tuning time"
            continue
        results = tune(
            {name: shape},
            trials,
            work / "work",
            spaces=("generic",),
            target=target,
            logs_dir=work / "logs",
            time_limit=left,
        )
        done[name] = dataclasses.asdict(results[0]) if results else "skipped: out of tuning time"
    return done


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python lab/gpu_session.py", description=__doc__)
    parser.add_argument("--out", required=True, help="directory for the results and logs")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument(
        "--trials",
        type=int,
        default=None,
        help="MetaSchedule trials per workload measured here (default 0: tuning goes in "
        "rounds, --round)",
    )
    parser.add_argument("--tune-seconds", type=float, default=240, help="tuning time budget")
    parser.add_argument(
        "--round",
        type=Path,
        help="a round of tuning candidates to time (tvm-deform tune-round's directory, or packed)",
    )
    parser.add_argument(
        "--round-seconds", type=float, default=180, help="time budget of the round's timing"
    )
    parser.add_argument(
        "--model", action="store_true", help="also time R50-DCNv2 (--model-size, batch 2)"
    )
    parser.add_argument("--model-size", type=int, default=640, help="the model's input side")
    parser.add_argument("--checks", type=int, default=12, help="random configurations")
    parser.add_argument("--quick", action="store_true", help="two suite layers only")
    parser.add_argument(
        "--call-limit",
        type=float,
        default=600,
        help="seconds the machine allows one command (the run stops its steps before it)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds after which the remaining steps are skipped (default: a minute under "
        "--call-limit)",
    )
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    trials = args.trials if args.trials is not None else 0
    if args.deadline is None:
        args.deadline = args.call_limit - 60

    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suite = load_suite()
    if args.quick:
        suite = {k: suite[k] for k in ("seed", "demo_64x56x56")}
    results: dict[str, object] = {"tvm_deform": __version__, "torch": torch.__version__}
    path = out / "gpu_results.json"

    def step(name: str, fn: Callable[[], object], passed=lambda value: True) -> object:
        """Run one step and write every result so far (a call cut short keeps them)."""
        began = time.monotonic()
        if began - started > args.deadline:
            results[name] = {"ok": False, "skipped": "past the deadline"}
            path.write_text(json.dumps(results, indent=1, default=str))
            return None
        print(f"== {name}", flush=True)
        try:
            value = fn()
            ok = bool(passed(value))
            results[name] = {"ok": ok, "seconds": time.monotonic() - began, "value": value}
        except Exception as error:  # noqa: BLE001 - every step is recorded, pass or fail
            traceback.print_exc()
            results[name] = {"ok": False, "seconds": time.monotonic() - began, "error": repr(error)}
            value = None
        path.write_text(json.dumps(results, indent=1, default=str))
        return value

    if cuda:
        # float32 stays float32 on both sides of every comparison: no TF32 in cuDNN's conv2d
        # (on by default) nor in cuBLAS, which torchvision's CUDA op multiplies with.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    step("environment", lambda: _environment(cuda))
    # The quick check first: without a kernel that runs and matches, nothing else is worth the
    # device's time.
    first = step("first_kernel", lambda: first_kernel(args.device), lambda v: v["passed"])
    if not first or not first["passed"]:
        return 1
    step(
        "build", lambda: build_kernels(session_shapes(suite, args.device, args.checks), args.device)
    )
    checks = step(
        "check",
        lambda: check_correctness(args.device, args.checks),
        lambda value: all(c["passed"] for c in value),
    )
    if checks:
        failed = [c for c in checks if not c["passed"]]
        print(f"   {len(checks) - len(failed)}/{len(checks)} checks passed")
    step(
        "gradients",
        lambda: check_gradients(args.device),
        lambda value: all(c["passed"] for c in value),
    )
    step("large_batch", lambda: check_large_batch(args.device), lambda v: v["passed"])
    if cuda:
        step("stream", lambda: check_stream_capture(suite["demo_64x56x56"]), lambda v: v is True)
    step(
        "carried_records",
        lambda: check_carried_records(args.device),
        lambda value: all(row["passed"] for row in value),
    )
    partial: list[dict] = []

    def timed(row: dict) -> None:
        partial.append(row)
        results["time_so_far"] = partial
        path.write_text(json.dumps(results, indent=1, default=str))
        _write_table(partial, out / "gpu_results.md")

    # torchvision, our default kernels and conv2d first, before the tuning, whose length is
    # the least certain: the comparison that matters most lands whatever the tuning does.
    rows = step(
        "time",
        lambda: time_layers(suite, args.device, session_dtypes(args.device), on_row=timed),
        lambda rows: all(
            r["median_ms"] is not None or r["implementation"] == "torchvision" for r in rows
        ),
    )
    backward_rows = step(
        "time_backward",
        lambda: time_backward(suite, args.device, runs=10 if cuda else 3),
        lambda rows: all(r["median_ms"] is not None for r in rows),
    )
    if backward_rows:
        (out / "gpu_backward.md").write_text(backward_markdown(backward_rows) + "\n")
    step("host_cost", lambda: host_cost(args.device, calls=200 if cuda else 20))
    profiled = {name: suite[name] for name in PROFILED if name in suite}
    profile_rows = step("profile", lambda: profile_kernels(profiled, args.device))
    if profile_rows:
        (out / "gpu_profile.md").write_text(profile_markdown(profile_rows) + "\n")
    if args.model:
        dtypes = session_dtypes(args.device)[:2]  # float32 and float16 on a GPU
        step("model", lambda: time_model(args.device, dtypes, size=args.model_size, runs=5))
    if args.round is not None:
        budget = min(args.round_seconds, args.deadline - (time.monotonic() - started))
        step("round", lambda: time_round(args.round, out / "round_results.jsonl", budget))
    if trials > 0:
        work = Path("/tmp/tvm_deform_gpu")
        # The tuning stops in time to leave the tuned kernels' timing about two minutes
        # before the deadline (it builds them first).
        budget = min(args.tune_seconds, args.deadline - (time.monotonic() - started) - 120)
        step("tune", lambda: tune_suite(tuning_order(suite), trials, budget, work, args.device))
        step("pack_logs", lambda: _pack_logs(work / "logs", out / "tuning_logs_cuda.tar.gz"))
        _use_logs(work / "logs")
        tuned_rows = step(
            "time_tuned",
            lambda: time_layers(suite, args.device, (torch.float32,), on_row=timed, tuned=True),
            lambda rows: all(r["median_ms"] is not None for r in rows),
        )
        rows = tuned_rows if rows is not None else None
    if rows is not None:  # every timing step ended: their rows are in their own entries
        results.pop("time_so_far", None)
        path.write_text(json.dumps(results, indent=1, default=str))
    if partial:
        print(markdown(partial))
    return 0 if all(r.get("ok") for r in results.values() if isinstance(r, dict)) else 1


def _write_table(rows: list[dict], path: Path) -> None:
    """The timing rows so far as a markdown table, with the float32 speed-up over torchvision
    (rewritten after each row, so that a call cut short keeps the table)."""
    speedup = speedup_over_torchvision(rows)
    summary = "-" if speedup is None else f"{speedup:.2f}x"
    path.write_text(
        f"{markdown(rows)}\n\nfloat32 geometric-mean speed-up over torchvision: {summary}\n"
    )


def _use_logs(logs: Path) -> None:
    """Make dispatch read the tuning logs at ``logs`` from now on."""
    import os

    from tvm_deform.runtime import records

    if logs.is_dir():
        os.environ["TVM_DEFORM_LOGS"] = str(logs)
        records.forget_databases()
        kernels.clear_memory_cache()


def _environment(cuda: bool) -> dict:
    import tvm

    import tvm_deform

    info = {
        "tvm": tvm.__version__,
        "python": sys.version.split()[0],
        # where the installed packages were imported from (the wheels' install, on a GPU)
        "tvm_path": str(Path(tvm.__file__).parent),
        "tvm_deform_path": str(Path(tvm_deform.__file__).parent),
    }
    if cuda:
        # False when TVM could not load its CUDA runtime (libtvm_runtime_cuda.so and the
        # libcudart it needs): every kernel would fail to run.
        info["tvm_cuda"] = tvm.runtime.enabled("cuda")
        info["tf32"] = {
            "cudnn": torch.backends.cudnn.allow_tf32,
            "matmul": torch.backends.cuda.matmul.allow_tf32,
        }
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "arch": _arch(), "sms": props.multi_processor_count}
    return info


def build_kernels(shapes: list[ConvShape], device: str, workers: int | None = None) -> dict:
    """Compile the default kernels of ``shapes`` for ``device`` into the kernel cache, in
    ``workers`` processes at once (default: one per core, at most 16): nvcc runs one compile a
    process, and the later steps then load every kernel from the disk cache."""
    import concurrent.futures
    import multiprocessing
    import os

    workers = workers or min(16, os.cpu_count() or 1)
    context = multiprocessing.get_context("spawn")
    began, failures = time.monotonic(), {}
    unique = list(dict.fromkeys(shapes))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = {pool.submit(_build_one, shape, device): shape for shape in unique}
        for future in concurrent.futures.as_completed(futures):
            error = future.exception()
            if error is not None:
                failures[str(futures[future])] = repr(error)[:300]
    if failures:
        raise RuntimeError(f"{len(failures)} of {len(unique)} kernels did not build: {failures}")
    return {"kernels": len(unique), "workers": workers, "seconds": time.monotonic() - began}


def _build_one(shape: ConvShape, device: str) -> None:
    """The default kernel of ``shape``, the other schedules :func:`time_layers` times beside
    it (fused, one size, wide tile, tensor cores) where they apply, and in float32 the
    backward kernels that :func:`check_gradients` and :func:`time_backward` run."""
    target = _target(device)
    kernels.get_kernel(shape, target, tuned=False)
    if shape.dtype == "float32":
        kernels.get_backward(shape, target, tuned=False)
    if compares_structures(target):
        _fused_kernel(shape, target)
        _one_size_kernel(shape, target)
        with contextlib.suppress(Exception):
            _pipelined_kernel(shape, target)
    if times_register_level(shape, target):
        _at_ptxas_level(_fused_kernel, shape, target)
        _at_ptxas_level(_one_size_kernel, shape, target)
    if times_wide_tile(shape, target):
        # A design space that does not build is the timing row's result, not the session's end.
        with contextlib.suppress(Exception):
            _wide_tile_kernel(shape, target)
    # As the wide tile: a failure to build is the timing row's result.
    if schedules.tensor_cores_take(shape, target):
        with contextlib.suppress(Exception):
            _tensor_core_kernel(shape, target)
    if schedules.tensor_cores_take(shape, target, any_size=True):
        with contextlib.suppress(Exception):
            _tensor_core_any_size_kernel(shape, target)


def session_shapes(suite: dict[str, ConvShape], device: str, checks: int) -> list[ConvShape]:
    """Every kernel a session runs: the suite's and the checks' configurations, in each of the
    session's dtypes."""
    dtypes = [str(d).removeprefix("torch.") for d in session_dtypes(device)]
    return [
        dataclasses.replace(shape, dtype=dtype)
        for shape in [*suite.values(), *check_shapes(checks)]
        for dtype in dtypes
    ]


def _pack_logs(logs: Path, archive: Path) -> list[str]:
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(logs, arcname=".")
    return sorted(str(p.relative_to(logs)) for p in logs.rglob("*") if p.is_file())


if __name__ == "__main__":
    sys.exit(main())
