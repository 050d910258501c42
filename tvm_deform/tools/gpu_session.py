"""One GPU session in one call (tools layer): build, check, tune, time, write results.

Run on a machine with an NVIDIA GPU, offline, by ``tools/gpu_session.sh`` (which installs TVM
from wheels brought along), or directly where TVM is installed::

    python -m tvm_deform.tools.gpu_session --out OUT [--trials 32] [--tune-seconds 300]

Steps, each recorded in ``OUT/gpu_results.json`` whether it passes or fails, so that one call
yields everything it can:

1. environment: GPU, compute capability, driver-visible versions;
2. build: the default CUDA kernel of every suite workload (compile seconds);
3. check: random configurations of every parameter against torchvision's CUDA
   ``deform_conv2d`` (float32, and float16/bfloat16 against float32 on the upcast inputs), and
   a CUDA-graph capture on a side stream (fails if a kernel leaves torch's current stream or
   the host synchronises);
4. tune: the suite in MetaSchedule's generic CUDA space, ``--trials`` each, until
   ``--tune-seconds`` have passed; the pruned logs go to ``OUT/tuning_logs_cuda.tar.gz``
   (``cuda/<arch>/...``, to be checked into ``tuning_logs/``);
5. time: per workload, the median of CUDA-event timings of torchvision, our default and tuned
   kernels and cuDNN's dense ``conv2d`` of the same shape, float32, float16 and bfloat16;
   ``OUT/gpu_results.md`` holds the table.

The same functions run on the CPU (``--device cpu``), which is how the tests exercise them on
machines without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tarfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tvm_deform import __version__, deform_conv2d
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels, targets
from tvm_deform.tools.bench import geometric_mean, measure, relative_error
from tvm_deform.tools.inputs import TOLERANCE, conv_kwargs, random_inputs, random_shape
from tvm_deform.tools.suite import load_suite

#: norm-relative error allowed against torchvision, per dtype (float32 against float32,
#: half precision against float32 on the upcast inputs)


def _inputs(shape: ConvShape, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    inputs = random_inputs(dataclasses.replace(shape, dtype="float32"), seed=seed)
    moved = {
        k: v.to(device=device, dtype=dtype) if v is not None else None for k, v in inputs.items()
    }
    return moved | conv_kwargs(shape)


def check_correctness(device: str, count: int = 24, seed: int = 0) -> list[dict]:
    """Our op against torchvision's on ``device`` for ``count`` random configurations, in
    float32 and, on CUDA, float16 and bfloat16 (against float32 on the upcast inputs)."""
    import torchvision.ops

    rng = random.Random(seed)
    dtypes = [torch.float32] + ([torch.float16, torch.bfloat16] if device == "cuda" else [])
    results = []
    for index in range(count):
        shape = random_shape(
            rng, (1, 1, 2, 4), channels_per_group=8, extra_size=40, batch=4, mask_probability=0.8
        )
        for dtype in dtypes:
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
) -> list[dict]:
    """Per layer and dtype: torchvision, our kernel (default schedule, and the tuned one when
    the logs have it) and dense conv2d, timed side by side on the same inputs."""
    import torchvision.ops

    target = targets.cuda_target(_arch()) if device == "cuda" else targets.host_target()
    rows = []
    for name, shape in layers.items():
        for dtype in dtypes:
            dtype_name = str(dtype).removeprefix("torch.")
            typed = dataclasses.replace(shape, dtype=dtype_name)
            args = _inputs(shape, device, dtype)
            kwargs = conv_kwargs(shape)
            variants: dict[str, Callable[[], torch.Tensor]] = {
                "torchvision": lambda args=args: torchvision.ops.deform_conv2d(**args),
                "tvm_deform default": _our_kernel(typed, target, tuned=False, args=args),
            }
            if kernels.resolve(typed, target) is not None:
                variants["tvm_deform tuned"] = _our_kernel(typed, target, tuned=True, args=args)
            variants["conv2d (dense)"] = lambda args=args, kwargs=kwargs, shape=shape: (
                torch.nn.functional.conv2d(
                    args["input"],
                    args["weight"],
                    args["bias"],
                    groups=shape.weight_groups,
                    **kwargs,
                )
            )
            expected = variants["torchvision"]()
            with torch.no_grad():
                for label, fn in variants.items():
                    error = None if label.startswith("conv2d") else relative_error(fn(), expected)
                    rows.append(
                        {
                            "layer": name,
                            "dtype": dtype_name,
                            "implementation": label,
                            "median_ms": measure(
                                fn, warmup=3, min_runs=runs, min_seconds=0, cuda=device == "cuda"
                            ).median_ms,
                            "error": error,
                        }
                    )
    return rows


def _our_kernel(shape: ConvShape, target, tuned: bool, args: dict) -> Callable[[], torch.Tensor]:
    from tvm_deform.binding.ops import run_forward

    kernel = kernels.get_kernel(shape, target, tuned=tuned)
    return lambda: run_forward(
        shape, args["input"], args["offset"], args["weight"], args["bias"], args["mask"], kernel
    )


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def markdown(rows: list[dict]) -> str:
    """One line per (layer, dtype): times, our speed-up over torchvision, ratio to conv2d."""
    lines = [
        "| layer | dtype | torchvision ms | ours default ms | ours tuned ms | conv2d ms "
        "| speed-up (best) | best / conv2d | error |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    grouped: dict[tuple[str, str], dict[str, dict]] = {}
    for row in rows:
        grouped.setdefault((row["layer"], row["dtype"]), {})[row["implementation"]] = row
    for (layer, dtype), found in grouped.items():
        theirs = found["torchvision"]["median_ms"]
        default = found["tvm_deform default"]
        tuned = found.get("tvm_deform tuned")
        best = min([default] + ([tuned] if tuned else []), key=lambda r: r["median_ms"])
        dense = found["conv2d (dense)"]["median_ms"]
        tuned_ms = f"{tuned['median_ms']:.3f}" if tuned else "-"
        lines.append(
            f"| {layer} | {dtype} | {theirs:.3f} | {default['median_ms']:.3f} | {tuned_ms} "
            f"| {dense:.3f} | {theirs / best['median_ms']:.2f}x "
            f"| {best['median_ms'] / dense:.2f}x | {best['error']:.1e} |"
        )
    return "\n".join(lines)


def speedup_over_torchvision(rows: list[dict], dtype: str = "float32") -> float:
    """Geometric mean over layers of torchvision's time over our best kernel's, in ``dtype``."""
    grouped: dict[str, dict[str, float]] = {}
    for row in rows:
        if row["dtype"] == dtype:
            grouped.setdefault(row["layer"], {})[row["implementation"]] = row["median_ms"]
    return geometric_mean(
        [
            t["torchvision"] / min(v for k, v in t.items() if k.startswith("tvm_deform"))
            for t in grouped.values()
            if "torchvision" in t
        ]
    )


def tune_suite(layers: dict[str, ConvShape], trials: int, seconds: float, work: Path) -> dict:
    """Tune ``layers`` for this GPU in the generic space until ``seconds`` have passed;
    returns the per-task results and writes the pruned logs under ``work / "logs"``."""
    from tvm_deform.tools.tuning import tune

    target = targets.cuda_target(_arch())
    started, done = time.monotonic(), {}
    for name, shape in layers.items():
        if time.monotonic() - started > seconds:
            done[name] = "skipped: out of tuning time"
            continue
        (result,) = tune(
            {name: shape},
            trials,
            work / "work",
            spaces=("generic",),
            target=target,
            logs_dir=work / "logs",
        )
        done[name] = dataclasses.asdict(result)
    return done


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tvm_deform.tools.gpu_session", description=__doc__
    )
    parser.add_argument("--out", required=True, help="directory for the results and logs")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--trials", type=int, default=32, help="tuning trials per workload")
    parser.add_argument("--tune-seconds", type=float, default=300, help="tuning time budget")
    parser.add_argument("--checks", type=int, default=24, help="random configurations")
    parser.add_argument("--quick", action="store_true", help="two suite layers only")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suite = load_suite()
    if args.quick:
        suite = {k: suite[k] for k in ("seed", "demo_64x56x56")}
    results: dict[str, object] = {"tvm_deform": __version__, "torch": torch.__version__}
    path = out / "gpu_results.json"

    def step(name: str, fn: Callable[[], object]) -> object:
        began = time.monotonic()
        print(f"== {name}", flush=True)
        try:
            value = fn()
            results[name] = {"ok": True, "seconds": time.monotonic() - began, "value": value}
        except Exception as error:  # noqa: BLE001 - every step is recorded, pass or fail
            traceback.print_exc()
            results[name] = {"ok": False, "seconds": time.monotonic() - began, "error": repr(error)}
            value = None
        path.write_text(json.dumps(results, indent=1, default=str))
        return value

    cuda = args.device == "cuda"
    step("environment", lambda: _environment(cuda))
    step("build", lambda: _build_all(suite, cuda))
    checks = step("check", lambda: check_correctness(args.device, args.checks))
    if checks:
        failed = [c for c in checks if not c["passed"]]
        print(f"   {len(checks) - len(failed)}/{len(checks)} checks passed")
    if cuda:
        step("stream", lambda: check_stream_capture(suite["demo_64x56x56"]))
        if args.trials > 0:
            work = Path("/tmp/tvm_deform_gpu")
            step("tune", lambda: tune_suite(suite, args.trials, args.tune_seconds, work))
            step("pack_logs", lambda: _pack_logs(work / "logs", out / "tuning_logs_cuda.tar.gz"))
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if cuda else (torch.float32,)
    rows = step("time", lambda: time_layers(suite, args.device, dtypes))
    if rows:
        table = markdown(rows)
        speedup = speedup_over_torchvision(rows)
        (out / "gpu_results.md").write_text(
            f"{table}\n\nfloat32 geometric-mean speed-up over torchvision: {speedup:.2f}x\n"
        )
        print(table)
    return 0 if all(r.get("ok") for r in results.values() if isinstance(r, dict)) else 1


def _environment(cuda: bool) -> dict:
    import tvm

    info = {"tvm": tvm.__version__, "python": sys.version.split()[0]}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "arch": _arch(), "sms": props.multi_processor_count}
    return info


def _build_all(layers: dict[str, ConvShape], cuda: bool) -> dict:
    target = targets.cuda_target(_arch()) if cuda else targets.host_target()
    seconds = {}
    for name, shape in layers.items():
        began = time.monotonic()
        kernels.get_kernel(shape, target, tuned=False)
        seconds[name] = round(time.monotonic() - began, 2)
    return seconds


def _pack_logs(logs: Path, archive: Path) -> list[str]:
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(logs, arcname=".")
    return sorted(str(p.relative_to(logs)) for p in logs.rglob("*") if p.is_file())


if __name__ == "__main__":
    sys.exit(main())
