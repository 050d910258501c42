"""Training steps on a stream of input sizes: R50-DCNv2 (forward + backward, batch 1) at each
distinct size of ``tvm-deform bench-sizes``' stream, the first step at a size against the median
of two more, for tvm_deform from a warm kernel cache and for torchvision. Each first takes a step
at a size outside the stream (tvm_deform's kernels for any size compile or load there), so that
every size of the stream is new. A new size's overhead is the first step over the warm one.

    .venv/bin/python lab/step_sizes.py > docs/results/<cpu>/step-sizes.md
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from tvm_deform.runtime import targets
from tvm_deform.tools.bench_model import r50_dcnv2
from tvm_deform.tools.bench_sizes import stream_sizes

WARM_STEPS = 2
#: the size of the step taken before the stream: in no image of it
WARM_UP = (384, 384)


def step(model: torch.nn.Module, x: torch.Tensor) -> float:
    begin = time.perf_counter()
    model(x).square().mean().backward()
    return time.perf_counter() - begin


def overheads(implementation: str) -> list[tuple[tuple[int, int], float, float]]:
    """Per distinct size: (size, first step s, warm step s)."""
    model = r50_dcnv2(implementation)
    sizes = list(dict.fromkeys(stream_sizes()))
    assert WARM_UP not in sizes
    generator = torch.Generator().manual_seed(0)
    inputs = {size: torch.randn(1, 3, *size, generator=generator) for size in sizes}
    step(model, torch.randn(1, 3, *WARM_UP, generator=generator))
    rows = []
    for size in sizes:
        first = step(model, inputs[size])
        warm = statistics.median(step(model, inputs[size]) for _ in range(WARM_STEPS))
        rows.append((size, first, warm))
    return rows


def main() -> int:
    print(
        f"# Training steps at new sizes ({targets.host_cpu()}, {torch.get_num_threads()} threads)\n"
    )
    print("`.venv/bin/python lab/step_sizes.py`: R50-DCNv2, batch 1, forward + backward; new "
          f"size = first step over the median of {WARM_STEPS} more at that size.\n")  # fmt: skip
    print("| implementation | warm step ms (median) | new size: median | worst |")
    print("|---|---:|---:|---:|")
    for implementation in ("torchvision", "tvm_deform"):
        rows = overheads(implementation)
        extra = [first / warm - 1 for _, first, warm in rows]
        warm = statistics.median(w for *_, w in rows)
        print(f"| {implementation} | {warm * 1e3:.0f} | {statistics.median(extra):+.0%} | "
              f"{max(extra):+.0%} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
