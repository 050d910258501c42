"""Tuned records carried over to the kernels for any size, against the default schedule's
kernels for any size: for each suite layer that this machine's own logs hold a tuned forward
record of (the best of the tuned space, whether or not the logs chose it), the record on the
PrimFunc for any size of the size class of its tuned size (derived: its rule's design space
there with the record's choices; or, for a record of another design space, its steps
replayed), and the default's kernel of that class, called by turns at the tuned size and at
sizes of the same class around it; the median of the ratios of neighbouring calls (record /
default) over ``--calls`` pairs. A record that does not carry over or build is reported as
such. ``TVM_DEFORM_LOGS=DIR`` reads the records of a tuning run there; ``--steps`` replays
every record's steps, derived or not (the way records carried over before they were derived;
give it a kernel cache of its own, ``TVM_DEFORM_CACHE_DIR``, as the kernels share a name).

    .venv/bin/python lab/replayed_records.py [--layers NAME ...] [--calls 41] [--steps]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from tvm_deform import schedules
from tvm_deform.runtime import calls, kernels, records, targets
from tvm_deform.runtime.inputs import random_inputs
from tvm_deform.tools.suite import load_suite

#: the sizes timed beside the tuned one, as factors of its height and width
SCALES = ((1.0, 1.0), (0.9, 1.1), (1.15, 0.85))


def ratio(shape, replayed, default, pairs: int) -> tuple[float, float, float]:
    """(replayed ms, default ms, median ratio of neighbouring calls)."""
    args = random_inputs(shape)
    tensors = [args[name] for name in ("input", "offset", "weight", "bias", "mask")]
    with torch.no_grad():
        times = {"replayed": [], "default": []}
        for kernel in (replayed, default):
            calls.run_forward(shape, *tensors, kernel=kernel)  # warm up
        for _ in range(pairs):
            for name, kernel in (("replayed", replayed), ("default", default)):
                begin = time.perf_counter()
                calls.run_forward(shape, *tensors, kernel=kernel)
                times[name].append(time.perf_counter() - begin)
    ratios = [r / d for r, d in zip(times["replayed"], times["default"], strict=True)]
    return (
        statistics.median(times["replayed"]) * 1e3,
        statistics.median(times["default"]) * 1e3,
        statistics.median(ratios),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", nargs="*", help="suite layers (default: all)")
    parser.add_argument("--calls", type=int, default=41, help="pairs of calls per size")
    parser.add_argument("--steps", action="store_true", help="replay steps, derive none")
    args = parser.parse_args(argv)
    if args.steps:  # no record matches a design space: every one has its steps replayed
        schedules._match = lambda *args: None
    target = targets.host_target()
    key = targets.hardware_key(target)
    suite = load_suite()
    print(f"Hardware key {key}; {torch.get_num_threads()} threads; {args.calls} pairs a size.\n")
    print("| layer | space | size | carried over | record ms | default ms | record / default |")
    print("|---|---|---|---|---:|---:|---:|")
    for name in args.layers or list(suite):
        shape = suite[name]
        tuned = [r for r in records.own_records(shape, target, key) if r.space != "default"]
        if not tuned:
            continue
        best = min(tuned, key=lambda r: r.run_ms or float("inf"))
        classes = schedules.pixel_classes(shape, target)
        size_class = kernels._size_class(shape, classes)
        layer = shape.any_size()
        tuned_func = best.record.workload.mod["main"]
        trace = best.record.trace
        sch = schedules.replayed_any_size_schedule(layer, target, size_class, tuned_func, trace)
        if sch is None:
            print(f"| {name} | {best.space} | | does not carry over | | | |")
            continue
        func = schedules._any_size_definition(layer, target, "NCHW", size_class)
        derived = schedules.derive("forward", func, target, tuned_func, trace) is not None
        how = "derived" if derived else "steps replayed"
        try:
            kernels.compile_schedule(sch, target)
        except Exception as error:  # noqa: BLE001 - reported, the next layer goes on
            print(f"| {name} | {best.space} | | {how}: does not build: {str(error)[:60]} | | | |")
            continue
        # Both loaded as dispatch loads them (from the kernel cache, on torch's threads): a
        # module straight from the compiler runs on TVM's own thread pool, which fights
        # torch's.
        replayed = kernels._any_size_class(layer, target, "NCHW", size_class, best)
        default = kernels._any_size_class(layer, target, "NCHW", size_class)
        for scale_h, scale_w in SCALES:
            size = dataclasses.replace(
                shape,
                height=max(1, round(shape.height * scale_h)),
                width=max(1, round(shape.width * scale_w)),
            )
            if kernels._size_class(size, classes) != size_class:
                continue
            ms_r, ms_d, r = ratio(size, replayed, default, args.calls)
            print(
                f"| {name} | {best.space} | {size.height}x{size.width} | {how} | {ms_r:.3f} | "
                f"{ms_d:.3f} | {r:.3f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
