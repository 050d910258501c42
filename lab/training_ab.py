"""Training steps of two commits, alternated: each call times, through the public
``deform_conv2d``, a training step (forward and every gradient) of each suite layer, and
R50-DCNv2's training steps (batch 1) at three image sizes, with the ``tvm_deform`` it imports,
and appends one JSON line labelled ``--label``; ``--summary`` compares the labels' medians.
Alternate the two commits in separate processes, the earlier one from a git worktree put
first on ``PYTHONPATH`` (its ``schedules`` folder linked into its package, as the editable
install maps it):

    git worktree add /tmp/before <commit>
    ln -s ../schedules /tmp/before/tvm_deform/schedules
    for round in 1 2 3 4 5 6 7 8; do
        PYTHONPATH=/tmp/before .venv/bin/python lab/training_ab.py --label before --out ab.jsonl
        .venv/bin/python lab/training_ab.py --label after --out ab.jsonl
    done
    .venv/bin/python lab/training_ab.py --summary ab.jsonl > docs/results/<cpu>/<name>.md
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from tvm_deform import __file__ as package_file
from tvm_deform import deform_conv2d
from tvm_deform.runtime import targets
from tvm_deform.runtime.inputs import conv_kwargs, random_inputs
from tvm_deform.tools.bench import measure
from tvm_deform.tools.bench_model import r50_dcnv2
from tvm_deform.tools.suite import load_suite

#: R50-DCNv2's image sizes (height, width)
MODEL_SIZES = ((480, 640), (512, 512), (640, 384))
LABELS = ("before", "after")


def layer_steps() -> dict[str, float]:
    """Median ms of a training step of each suite layer."""
    found = {}
    for name, shape in load_suite().items():
        args = random_inputs(shape)
        leaves = {
            key: None if value is None else value.detach().clone().requires_grad_()
            for key, value in args.items()
            if key in ("input", "offset", "weight", "bias", "mask")
        }
        kwargs = conv_kwargs(shape)

        def step(leaves=leaves, kwargs=kwargs):
            out = deform_conv2d(
                leaves["input"], leaves["offset"], leaves["weight"], leaves["bias"],
                mask=leaves["mask"], **kwargs,
            )  # fmt: skip
            out.backward(torch.ones_like(out))

        step()
        found[name] = measure(step, 1, 10, 0.3).median_ms
    return found


def model_steps() -> dict[str, float]:
    """Median ms of three R50-DCNv2 training steps at each size, after one."""
    model = r50_dcnv2("tvm_deform")
    found = {}
    for height, width in MODEL_SIZES:
        x = torch.randn(1, 3, height, width)

        def step(x=x) -> float:
            begin = time.perf_counter()
            model(x).square().mean().backward()
            return time.perf_counter() - begin

        step()
        found[f"R50-DCNv2 {height}x{width}"] = statistics.median(step() for _ in range(3)) * 1e3
    return found


def summary(path: Path) -> str:
    runs: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        runs.setdefault(entry["label"], []).append(entry)
    before, after = (runs[label] for label in LABELS)
    rounds = min(len(before), len(after))
    lines = [
        f"{rounds} rounds; CPU {before[0]['cpu']}, {before[0]['threads']} threads; median ms",
        "",
        "| workload | before | after | after / before | rounds after faster |",
        "|---|---:|---:|---:|---:|",
    ]
    ratios = []
    for name in before[0]["times"]:
        old = [run["times"][name] for run in before[:rounds]]
        new = [run["times"][name] for run in after[:rounds]]
        ratio = statistics.median(new) / statistics.median(old)
        ratios.append(ratio)
        wins = sum(b < a for a, b in zip(old, new, strict=True))
        lines.append(
            f"| {name} | {statistics.median(old):.2f} | {statistics.median(new):.2f} "
            f"| {ratio:.2f} | {wins} of {rounds} |"
        )
    mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    lines += ["", f"geometric mean after / before: {mean:.3f}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", choices=LABELS)
    parser.add_argument("--out", type=Path, help="JSON lines, appended")
    parser.add_argument("--summary", type=Path, help="print the comparison of a finished run")
    options = parser.parse_args()
    if options.summary:
        print(summary(options.summary))
        return
    if not (options.label and options.out):
        parser.error("--label and --out, or --summary")
    times = layer_steps() | model_steps()
    entry = {
        "label": options.label,
        "package": str(Path(package_file).parent),
        "cpu": targets.host_cpu(),
        "threads": torch.get_num_threads(),
        "times": times,
    }
    with options.out.open("a") as out:
        out.write(json.dumps(entry) + "\n")


if __name__ == "__main__":
    main()
