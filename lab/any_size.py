"""Kernels for any size against kernels for one size, through the public op: per suite layer,
the forward and a training step (forward + backward), interleaved in one process
(``TVM_DEFORM_SIZES`` switched between calls), in seven runs; default schedules on both sides
(``TVM_DEFORM_TUNED=0``), so that what is measured is the cost of the generality.

    .venv/bin/python lab/any_size.py > docs/results/<cpu>/any-size.md
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

os.environ["TVM_DEFORM_TUNED"] = "0"

import torch  # noqa: E402

from tvm_deform import deform_conv2d  # noqa: E402
from tvm_deform.runtime import targets  # noqa: E402
from tvm_deform.runtime.inputs import conv_kwargs, random_inputs  # noqa: E402
from tvm_deform.tools.suite import load_suite  # noqa: E402

RUNS = 7


def timed(call, seconds: float = 0.2) -> float:
    """Median seconds of ``call()`` over about ``seconds`` (at least 3 calls)."""
    call()
    times = []
    deadline = time.perf_counter() + seconds
    while len(times) < 3 or time.perf_counter() < deadline:
        begin = time.perf_counter()
        call()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def calls(shape):
    args = random_inputs(shape)
    tensors = [args[name] for name in ("input", "offset", "weight", "bias")]
    kwargs = conv_kwargs(shape) | {"mask": args["mask"]}

    def forward():
        with torch.no_grad():
            return deform_conv2d(*tensors, **kwargs)

    leaves = [t.clone().requires_grad_() if t is not None else None for t in tensors]
    mask = args["mask"].clone().requires_grad_()

    def step():
        out = deform_conv2d(*leaves, **(conv_kwargs(shape) | {"mask": mask}))
        out.backward(torch.ones_like(out))

    return forward, step


def main() -> int:
    suite = load_suite()
    names = sys.argv[1:] or list(suite)
    print(
        f"# Kernels for any size against kernels for one size ({targets.host_cpu()}, "
        f"{torch.get_num_threads()} threads)\n"
    )
    print("`.venv/bin/python lab/any_size.py`: ratio = any size / one size, the median of "
          f"{RUNS} interleaved runs' ratios; default schedules on both sides.\n")  # fmt: skip
    print("| layer | forward, one size ms | forward ratio | step, one size ms | step ratio |")
    print("|---|---:|---:|---:|---:|")
    ratios = {"forward": [], "step": []}
    for name in names:
        shape = suite[name]
        forward, step = calls(shape)
        times = {(kind, sizes): [] for kind in ("forward", "step") for sizes in ("any", "static")}
        for _ in range(RUNS):
            for sizes in ("any", "static"):
                os.environ["TVM_DEFORM_SIZES"] = sizes
                times[("forward", sizes)].append(timed(forward))
                times[("step", sizes)].append(timed(step))
        row = [name]
        for kind in ("forward", "step"):
            static = statistics.median(times[(kind, "static")])
            # The ratio of each run's neighbouring timings, then their median: the machine's
            # drift between runs cancels out.
            pairs = zip(times[(kind, "any")], times[(kind, "static")], strict=True)
            ratio = statistics.median(a / s for a, s in pairs)
            ratios[kind].append(ratio)
            row += [f"{static * 1e3:.3f}", f"{ratio:.2f}"]
        print("| " + " | ".join(row) + " |", flush=True)
    for kind, values in ratios.items():
        mean = math.exp(sum(map(math.log, values)) / len(values))
        print(f"\n{kind}: geometric mean ratio {mean:.3f}, worst {max(values):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
