"""A stream of input sizes, as a detector sees them (tools layer): R50-DCNv2 on 20 images of
detection-style sizes (a keep-ratio resize to a short side of 320, padded to a multiple of 32),
against torch + torchvision, from a cold kernel cache and from a warm one.

Each run is a process of its own (``import`` is not counted): it builds the model, then for
each image times the first forward at that size and then the median of a few more at the same
size (the warm time). A new size's overhead is the first forward over the warm one, counted
after the first image (whose overhead, a new process's first forward, is shown apart). The
DCN layers' calls of the op are timed apart too: the part of a new size's overhead spent in
them, against the part spent in the rest of the model (torch's dense convs set up each new
shape too). The cold run starts from an empty kernel cache (``TVM_DEFORM_CACHE_DIR``, nothing
prebuilt); the warm run is a new process on the cache the cold run left.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

#: (height, width) of the images before the resize: COCO-like aspect ratios
IMAGES = [
    (480, 640), (640, 427), (427, 640), (500, 375), (375, 500), (640, 480), (612, 612),
    (480, 640), (360, 640), (640, 360), (424, 640), (640, 512), (333, 500), (500, 333),
    (480, 640), (640, 480), (400, 600), (600, 400), (428, 640), (640, 425),
]  # fmt: skip
#: the resize's short side and the padding multiple
SHORT_SIDE, STRIDE = 320, 32
#: warm forwards timed after each first one
WARM_RUNS = 3


def stream_sizes() -> list[tuple[int, int]]:
    """The (height, width) of each image of the stream after the resize and the padding."""
    sizes = []
    for height, width in IMAGES:
        scale = SHORT_SIDE / min(height, width)
        h, w = round(height * scale), round(width * scale)
        sizes.append((-(-h // STRIDE) * STRIDE, -(-w // STRIDE) * STRIDE))
    return sizes


def run_stream(implementation: str) -> list[dict[str, float]]:
    """Time the stream in this process: per image, its size, the first forward and the warm
    one (milliseconds), the time spent in the DCN layers' calls of the op during each, and when
    its first forward ended, counted from before the model was built (after the imports)."""
    import torch

    from tvm_deform.tools.bench_model import r50_dcnv2

    began = time.perf_counter()
    model = r50_dcnv2(implementation)
    in_deform = _time_deform_calls(model)
    generator = torch.Generator().manual_seed(0)
    rows = []

    def forward(x: torch.Tensor) -> tuple[float, float]:
        in_deform[0] = 0.0
        start = time.perf_counter()
        model(x)
        return (time.perf_counter() - start) * 1e3, in_deform[0] * 1e3

    with torch.inference_mode():
        for height, width in stream_sizes():
            x = torch.randn(1, 3, height, width, generator=generator)
            first, first_deform = forward(x)
            since_start = time.perf_counter() - began
            warm = [forward(x) for _ in range(WARM_RUNS)]
            rows.append(
                {
                    "height": height,
                    "width": width,
                    "first_ms": first,
                    "warm_ms": statistics.median(total for total, _ in warm),
                    "first_deform_ms": first_deform,
                    "warm_deform_ms": statistics.median(part for _, part in warm),
                    "since_start_ms": since_start * 1e3,
                }
            )
    return rows


def _time_deform_calls(model) -> list[float]:
    """Make every DCN layer of ``model`` add the seconds its call of the op takes to the one
    element of the list returned."""
    from tvm_deform.tools.bench_model import DCNv2

    spent = [0.0]

    def timed(call: Callable[..., object]) -> Callable[..., object]:
        def run(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        return run

    for module in model.modules():
        if isinstance(module, DCNv2) and module.deform is not None:
            module.deform = timed(module.deform)
    return spent


def _child(implementation: str, cache_dir: Path) -> list[dict[str, float]]:
    env = os.environ | {"TVM_DEFORM_CACHE_DIR": str(cache_dir)}
    code = (
        "import json, sys; from tvm_deform.tools.bench_sizes import run_stream; "
        "print(json.dumps(run_stream(sys.argv[1])))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, implementation],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"the {implementation} stream failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run(progress=print) -> dict[str, list[dict[str, float]]]:
    """The three streams: torch + torchvision, torch + tvm_deform from a cold cache, and from
    the warm cache it left, each in a new process."""
    with tempfile.TemporaryDirectory(prefix="tvm_deform-bench-sizes-") as cache:
        streams = {}
        for label, implementation in (
            ("torchvision", "torchvision"),
            ("tvm_deform, cold cache", "tvm_deform"),
            ("tvm_deform, warm cache", "tvm_deform"),
        ):
            progress(f"{label} ...")
            streams[label] = _child(implementation, Path(cache))
    return streams


def summary(streams: dict[str, list[dict[str, float]]]) -> list[dict[str, object]]:
    """Per stream: the stream's total time (first forwards only, as a detector meets them),
    the time to the first image's result and that image's overhead over its warm forward (a
    new process's first forward: kernels compiled or loaded), and a new size's overhead over
    the warm forward after the first image (median and worst, over the images whose size is
    new to the stream), with the part of it spent in the DCN layers' calls of the op."""
    records = []
    for label, rows in streams.items():
        seen = {(rows[0]["height"], rows[0]["width"])}
        overheads, in_deform = [], []
        for row in rows[1:]:
            size = (row["height"], row["width"])
            if size not in seen:
                overheads.append(row["first_ms"] / row["warm_ms"] - 1)
                extra = row["first_deform_ms"] - row["warm_deform_ms"]
                in_deform.append(extra / row["warm_ms"])
                seen.add(size)
        first = rows[0]["first_ms"] / rows[0]["warm_ms"] - 1
        records.append(
            {
                "stream": label,
                "images": len(rows),
                "new sizes": len(seen),
                "total s": sum(r["first_ms"] for r in rows) / 1e3,
                "first image s": rows[0]["since_start_ms"] / 1e3,
                "first image overhead": f"{100 * first:+.0f}%",
                "warm forward ms (median)": statistics.median(r["warm_ms"] for r in rows),
                "new size overhead (median)": _percent(overheads, statistics.median),
                "new size overhead (worst)": _percent(overheads, max),
                "of it in the DCN calls (median)": _percent(in_deform, statistics.median),
                "of it in the DCN calls (worst)": _percent(in_deform, max),
            }
        )
    return records


def _percent(overheads: list[float], statistic) -> str:
    return f"{100 * statistic(overheads):+.0f}%" if overheads else "-"


def per_image(streams: dict[str, list[dict[str, float]]]) -> list[dict[str, object]]:
    """One row per image: its size and each stream's first and warm forward."""
    labels = list(streams)
    records = []
    for index, row in enumerate(streams[labels[0]]):
        record: dict[str, object] = {"image": index + 1, "size": f"{row['height']}x{row['width']}"}
        for label in labels:
            other = streams[label][index]
            record[f"{label} first ms"] = other["first_ms"]
            record[f"{label} warm ms"] = other["warm_ms"]
        records.append(record)
    return records
