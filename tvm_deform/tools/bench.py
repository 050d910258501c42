"""Timing method shared by the demo and benchmarks (tools layer; no assertions here).

Method: call once to compile and warm up, then run until both a minimum count of runs and a
minimum time are reached, and report the median with the 20th and 80th percentiles. Inputs use
random offsets of a stated scale (never zeros, which would make the gathers regular).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime.inputs import conv_kwargs, random_inputs


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    runs: int

    def __str__(self) -> str:
        return f"{self.median_ms:8.3f} ms [{self.p20_ms:.3f}, {self.p80_ms:.3f}]"


def measure(
    fn: Callable[[], object],
    warmup: int = 2,
    min_runs: int = 10,
    min_seconds: float = 0.3,
    before: Callable[[], object] | None = None,
    cuda: bool = False,
) -> Timing:
    """Median and 20/80 percentiles of ``fn``'s time, after ``warmup`` calls: the wall clock,
    or with ``cuda`` CUDA events around each call on the current stream.

    With ``before`` (a torch op), each call of ``fn`` follows an untimed call of it, as a layer
    runs inside a model: whatever ``before`` leaves running (torch's OpenMP workers spin for a
    while after their region) meets ``fn``."""

    def call() -> float:
        if before is not None:
            before()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin

    for _ in range(warmup):
        call()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_seconds:
        times.append(call())
        if len(times) >= 1000:
            break
    times.sort()
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))] * 1e3  # noqa: E731
    return Timing(statistics.median(times) * 1e3, pick(0.2), pick(0.8), len(times))


@dataclasses.dataclass(frozen=True)
class Row:
    """One implementation timed on one layer; ``error`` is relative to torchvision."""

    layer: str
    implementation: str
    timing: Timing
    error: float | None


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``|actual - expected| / |expected|`` in float64 (Frobenius norms)."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-300))


#: the row of our op as users call it, and its suffix in the mode between torch ops
DISPATCHED = "tvm_deform"
BETWEEN = " (between conv2d)"


def compare_layer(
    name: str,
    shape: ConvShape,
    peers: Sequence[str] = (),
    other_logs: str | os.PathLike | None = None,
) -> list[Row]:
    """Time torchvision, tvm_deform, the named CPU ``peers`` and dense conv2d on ``shape``, side
    by side on the same random inputs, checking each against torchvision.

    ``tvm_deform`` is the public ``deform_conv2d`` as users call it (argument checks, dispatch
    and the kernel it picks); the ``tvm_deform default`` and ``tvm_deform tuned <space>`` rows
    run one schedule each (the default, each design space's best record in the logs, and in
    ``other_logs`` when given) through the same calling path. The rows marked "between conv2d"
    time the same calls, each made right after a dense conv2d of the layer (the blocked rows
    call back to back)."""
    import torchvision.ops

    from tvm_deform import deform_conv2d
    from tvm_deform.binding.ops import run_forward
    from tvm_deform.runtime import kernels, records, targets
    from tvm_deform.tools.peers import PEERS

    inputs = random_inputs(shape)
    kwargs = conv_kwargs(shape)
    x, offset, weight, bias, mask = (
        inputs[k] for k in ("input", "offset", "weight", "bias", "mask")
    )
    candidates: dict[str, Callable[[], torch.Tensor]] = {
        "torchvision": lambda: torchvision.ops.deform_conv2d(
            x, offset, weight, bias, mask=mask, **kwargs
        ),
        DISPATCHED: lambda: deform_conv2d(x, offset, weight, bias, mask=mask, **kwargs),
    }
    # The default schedule, and each design space's best tuned record for this shape.
    target = targets.host_target()
    key = targets.hardware_key(target)
    compiled = {"tvm_deform default": kernels.load_kernel(shape, target)}
    roots = [None] + ([Path(other_logs)] if other_logs is not None else [])
    for root in roots:
        found = records.find_records(shape, target, key, roots=None if root is None else [root])
        for record in found:
            if record.space == records.DEFAULT_SPACE:  # the default schedule, timed above
                continue
            where = "" if record.hardware_key == key else f" ({record.hardware_key})"
            where += "" if root is None else " (other logs)"
            compiled[f"tvm_deform tuned {record.space}{where}"] = kernels.load_kernel(
                shape, target, record
            )
    for label, kernel in compiled.items():
        candidates[label] = functools.partial(
            run_forward, shape, x, offset, weight, bias, mask, kernel
        )
    for peer in peers:
        run = PEERS[peer](shape, weight, bias, torch.get_num_threads())
        candidates[peer] = functools.partial(run, x, offset, mask)

    def dense() -> torch.Tensor:
        return torch.nn.functional.conv2d(x, weight, bias, groups=shape.weight_groups, **kwargs)

    candidates["conv2d (dense)"] = dense
    between = [DISPATCHED, *peers]
    # Interleaved rounds: every implementation is timed in each round, so that a slow stretch
    # of this shared machine does not fall on one implementation alone. torchvision is 10-30x
    # slower than the rest: fewer runs keep the total sane.
    timed = [(label, label, None) for label in candidates]
    timed += [(label + BETWEEN, label, dense) for label in between]
    with torch.no_grad():
        expected = candidates["torchvision"]()
        errors = {
            label: None if fn is dense else relative_error(fn(), expected)
            for label, fn in candidates.items()
        }
        rounds: dict[str, list[Timing]] = {row: [] for row, _, _ in timed}
        for _ in range(ROUNDS):
            for row, label, before in timed:
                runs = 2 if label == "torchvision" else 4
                timing = measure(candidates[label], 1, runs, 0.1, before)
                rounds[row].append(timing)
    return [Row(name, row, combine(rounds[row]), errors[label]) for row, label, _ in timed]


#: rounds of :func:`compare_layer`
ROUNDS = 3


def combine(timings: list[Timing]) -> Timing:
    """One timing from several rounds: the median of their medians and of their quantiles."""
    return Timing(
        statistics.median(t.median_ms for t in timings),
        statistics.median(t.p20_ms for t in timings),
        statistics.median(t.p80_ms for t in timings),
        sum(t.runs for t in timings),
    )


#: the inputs a training step differentiates (all of them, as in a DCN layer being fine-tuned)
DIFFERENTIABLE = ("input", "offset", "weight", "bias", "mask")


def compare_training_step(name: str, shape: ConvShape) -> list[Row]:
    """Time one forward + backward of torchvision, tvm_deform and dense conv2d on ``shape``
    (gradients for input, offset, weight, bias and mask, the same random ``grad_output``), and
    check each gradient against torchvision's: ``error`` is the largest norm-relative error
    over the gradients."""
    import torchvision.ops

    from tvm_deform import deform_conv2d

    inputs = random_inputs(shape)
    kwargs = conv_kwargs(shape)
    leaves = {
        key: inputs[key].clone().requires_grad_()
        for key in DIFFERENTIABLE
        if inputs[key] is not None
    }
    generator = torch.Generator().manual_seed(1)
    out_shape = (shape.batch, shape.out_channels, shape.out_h, shape.out_w)
    grad_output = torch.randn(out_shape, generator=generator).to(getattr(torch, shape.dtype))

    def step(fn: Callable[..., torch.Tensor]) -> Callable[[], tuple[torch.Tensor, ...]]:
        def run() -> tuple[torch.Tensor, ...]:
            out = fn(**(inputs | leaves), **kwargs)
            return torch.autograd.grad(out, tuple(leaves.values()), grad_output)

        return run

    dense_leaves = [leaves["input"], leaves["weight"]] + (
        [leaves["bias"]] if "bias" in leaves else []
    )

    def dense() -> tuple[torch.Tensor, ...]:
        out = torch.nn.functional.conv2d(
            leaves["input"],
            leaves["weight"],
            leaves.get("bias"),
            groups=shape.weight_groups,
            **kwargs,
        )
        return torch.autograd.grad(out, dense_leaves, grad_output)

    candidates = {
        "torchvision": step(torchvision.ops.deform_conv2d),
        "tvm_deform": step(deform_conv2d),
        "conv2d (dense)": dense,
    }
    expected = candidates["torchvision"]()
    rows = []
    for implementation, fn in candidates.items():
        error = None
        if implementation != "conv2d (dense)":
            error = max(relative_error(a, b) for a, b in zip(fn(), expected, strict=True))
        runs = 3 if implementation == "torchvision" else 10
        rows.append(Row(name, implementation, measure(fn, min_runs=runs), error))
    return rows


def training_table(rows: Sequence[Row]) -> str:
    """A markdown table of :func:`compare_training_step` rows: one line per layer."""
    lines = [
        "| layer | torchvision fwd+bwd ms | tvm_deform fwd+bwd ms | speed-up | conv2d fwd+bwd ms "
        "| tvm_deform / conv2d | max grad error vs torchvision |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    by_layer: dict[str, dict[str, Row]] = {}
    for row in rows:
        by_layer.setdefault(row.layer, {})[row.implementation] = row
    for layer, found in by_layer.items():
        theirs, ours = found["torchvision"], found["tvm_deform"]
        dense = found["conv2d (dense)"]
        lines.append(
            f"| {layer} | {theirs.timing.median_ms:.1f} | {ours.timing.median_ms:.1f} "
            f"| {theirs.timing.median_ms / ours.timing.median_ms:.1f}x "
            f"| {dense.timing.median_ms:.1f} "
            f"| {ours.timing.median_ms / dense.timing.median_ms:.1f}x | {ours.error:.1e} |"
        )
    return "\n".join(lines)


def geometric_mean(values: Sequence[float]) -> float:
    """The geometric mean of ``values`` (NaN when there are none)."""
    return math.prod(values) ** (1 / len(values)) if values else float("nan")


def geometric_mean_speedup(rows: Sequence[Row]) -> float:
    """Geometric mean over layers of torchvision's time over tvm_deform's."""
    by_layer: dict[str, dict[str, float]] = {}
    for row in rows:
        by_layer.setdefault(row.layer, {})[row.implementation] = row.timing.median_ms
    return geometric_mean([t["torchvision"] / t["tvm_deform"] for t in by_layer.values()])
