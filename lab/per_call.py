"""The host cost of one call of the public ``deform_conv2d`` on a tiny layer (the seed case,
2x3x5x5, where the kernel takes a few microseconds), against torchvision's op: without
autograd, the forward under autograd (ours, and ours through the ``tvm_deform::deform_conv2d``
custom op, the route eager calls took before they skipped its layers of Python), and a
training step (forward, ``sum``, backward). Interleaved rounds of back-to-back calls; the
median per call, in microseconds::

    .venv/bin/python lab/per_call.py [--rounds 15] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torchvision.ops

import tvm_deform


def per_call(fn: Callable[[], object], calls: int) -> float:
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - began) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    input, offset = torch.randn(2, 3, 5, 5), torch.randn(2, 18, 5, 5)
    weight, mask = torch.randn(4, 3, 3, 3), torch.rand(2, 9, 5, 5)
    leaves = [t.requires_grad_() for t in (input, offset, weight, mask)]

    def ours():
        return tvm_deform.deform_conv2d(input, offset, weight, padding=1, mask=mask)

    def custom_op():
        return torch.ops.tvm_deform.deform_conv2d(
            input, offset, weight, None, mask, 1, 1, 1, 1, 1, 1
        )

    def torchvision_op():
        return torchvision.ops.deform_conv2d(input, offset, weight, padding=1, mask=mask)

    def step(forward):
        return lambda: forward().sum().backward()

    calls = {
        "ours, no autograd": ours,
        "torchvision, no autograd": torchvision_op,
        "ours, forward under autograd": ours,
        "through the custom op, forward under autograd": custom_op,
        "torchvision, forward under autograd": torchvision_op,
        "ours, training step": step(ours),
        "through the custom op, training step": step(custom_op),
        "torchvision, training step": step(torchvision_op),
    }
    times: dict[str, list[float]] = {label: [] for label in calls}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for label, fn in calls.items():
            with torch.set_grad_enabled("no autograd" not in label):
                elapsed = per_call(fn, args.calls)
            if round_:
                times[label].append(elapsed)
    assert all(t.grad is not None for t in leaves)
    print(f"| call (2x3x5x5, float32, {torch.get_num_threads()} threads) | median us a call |")
    print("|---|---:|")
    for label, values in times.items():
        print(f"| {label} | {statistics.median(values):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
