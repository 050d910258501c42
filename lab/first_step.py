"""A training job's first step from an empty kernel cache: R50-DCNv2 (forward + backward, batch 1,
320x448), each run a new process with an empty ``TVM_DEFORM_CACHE_DIR`` (``import`` not
counted), with the backward's kernels compiled ahead while the forward runs (the default) and
without (``TVM_DEFORM_PREPARE_BACKWARD=0``), the two in turn, three runs each; then the median
of three warm steps in the same process.

    .venv/bin/python lab/first_step.py > docs/results/<cpu>/first-step.md
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

RUNS = 3
SIZE = (320, 448)
WARM_STEPS = 3

CHILD = """
import json, statistics, time, torch
from tvm_deform.tools.bench_model import r50_dcnv2
model = r50_dcnv2("tvm_deform").train()
x = torch.randn(1, 3, {h}, {w})
def step():
    begin = time.perf_counter()
    model(x).square().mean().backward()
    return time.perf_counter() - begin
first = step()
warm = statistics.median(step() for _ in range({warm}))
print(json.dumps({{"first_s": first, "warm_s": warm}}))
"""


def run(prepare: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="tvm_deform-first-step-") as cache:
        env = os.environ | {
            "TVM_DEFORM_CACHE_DIR": cache,
            "TVM_DEFORM_PREPARE_BACKWARD": "1" if prepare else "0",
        }
        code = CHILD.format(h=SIZE[0], w=SIZE[1], warm=WARM_STEPS)
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    import torch

    from tvm_deform.runtime import targets

    rows = {True: [], False: []}
    for _ in range(RUNS):
        for prepare in (True, False):
            rows[prepare].append(run(prepare))
    print(f"# A first training step from an empty cache ({targets.host_cpu()}, "
          f"{torch.get_num_threads()} threads)\n")  # fmt: skip
    print(f"`.venv/bin/python lab/first_step.py`: R50-DCNv2, batch 1, {SIZE[0]}x{SIZE[1]}, "
          f"forward + backward; {RUNS} runs of each, in turn, each a new process.\n")  # fmt: skip
    print("| backward kernels | first step s (each run) | median | warm step s (median) |")
    print("|---|---|---:|---:|")
    for prepare, label in ((True, "compiled ahead (default)"), (False, "compiled at the backward")):
        firsts = [r["first_s"] for r in rows[prepare]]
        warm = statistics.median(r["warm_s"] for r in rows[prepare])
        each = ", ".join(f"{s:.1f}" for s in firsts)
        print(f"| {label} | {each} | {statistics.median(firsts):.1f} | {warm:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
