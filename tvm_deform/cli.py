"""The ``tvm-deform`` command (also ``python -m tvm_deform``): demo, bench, diagnose, info."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch

from . import __version__, build, env
from .bench import compare_layer
from .definition import ConvShape
from .ops import deform_conv2d
from .peers import available_peers

#: layers timed by ``tvm-deform bench``: name -> shape (3x3, padding 1, with mask, no bias)
BENCH_LAYERS = {
    "demo 64x56x56": ConvShape(1, 64, 56, 56, 64, 3, 3, pad_h=1, pad_w=1),
    "dla34 64x128x128": ConvShape(1, 64, 128, 128, 64, 3, 3, pad_h=1, pad_w=1),
    "r50 c3 128x100x168": ConvShape(1, 128, 100, 168, 128, 3, 3, pad_h=1, pad_w=1),
    "r50 c4 256x50x84": ConvShape(1, 256, 50, 84, 256, 3, 3, pad_h=1, pad_w=1),
    "r50 c5 512x25x42": ConvShape(1, 512, 25, 42, 512, 3, 3, pad_h=1, pad_w=1),
}
QUICK_LAYERS = ("demo 64x56x56", "r50 c5 512x25x42")


def _torchvision():
    try:
        import torchvision.ops
    except Exception as error:  # noqa: BLE001 - any import failure means "not usable"
        raise SystemExit(
            f"this command compares against torchvision, which could not be imported ({error}); "
            "install the test extra: pip install 'tvm_deform[test]'"
        ) from None
    return torchvision.ops


def seed_case() -> tuple[torch.Tensor, ...]:
    """The seed report's inputs: 2x3x5x5 arange input, ones weight 5x3x3x3, offsets 1, masks 2."""
    data = torch.arange(150, dtype=torch.float32).reshape(2, 3, 5, 5)
    weight = torch.ones(5, 3, 3, 3)
    offset = torch.ones(2, 18, 3, 3)
    mask = torch.full((2, 9, 3, 3), 2.0)
    return data, offset, weight, mask


def run_demo(args: argparse.Namespace) -> int:
    tv = _torchvision()
    data, offset, weight, mask = seed_case()
    ours = deform_conv2d(data, offset, weight, mask=mask)
    theirs = tv.deform_conv2d(data, offset, weight, mask=mask)
    print("Seed case (2x3x5x5 arange input, weight ones, offsets 1.0, masks 2.0):")
    print(ours[1, 0])
    print(
        f"  output[1, 0, 2, 1]: tvm_deform {ours[1, 0, 2, 1].item():.0f}, "
        f"torchvision {theirs[1, 0, 2, 1].item():.0f} (the accelerator printed 4336)"
    )
    print(f"  identical to torchvision: {bool(torch.equal(ours, theirs))}")
    print()
    shape = BENCH_LAYERS["demo 64x56x56"]
    print(
        f"Layer N=1 C=O=64 56x56 3x3 pad 1, random offsets (scale 2), "
        f"{torch.get_num_threads()} threads:"
    )
    print_table({"demo 64x56x56": shape}, available_peers())
    return 0


def print_table(layers: dict[str, ConvShape], peers: Sequence[str]) -> None:
    """Time every layer (see :func:`tvm_deform.bench.compare_layer`) and print a markdown
    table: median times, tvm_deform's ratios to torchvision and to dense conv2d, GFLOP/s,
    and the largest relative error of any implementation against torchvision."""
    names = ["torchvision", "tvm_deform", *peers, "conv2d (dense)"]
    print(
        "| layer | " + " | ".join(f"{n} ms" for n in names) + " | speed-up vs torchvision "
        "| x dense conv2d | GFLOP/s | max rel. error |"
    )
    print("|---" * (len(names) + 5) + "|")
    for layer, shape in layers.items():
        rows = {row.implementation: row for row in compare_layer(layer, shape, peers)}
        ms = {name: rows[name].timing.median_ms for name in names}
        errors = [row.error for row in rows.values() if row.error is not None]
        gflops = shape.gemm_flops / (ms["tvm_deform"] * 1e-3) / 1e9
        cells = [f"{ms[name]:.2f}" for name in names]
        cells += [
            f"{ms['torchvision'] / ms['tvm_deform']:.1f}x",
            f"{ms['tvm_deform'] / ms['conv2d (dense)']:.2f}",
            f"{gflops:.0f}",
            f"{max(errors):.1e}",
        ]
        print(f"| {layer} | " + " | ".join(cells) + " |", flush=True)


def run_bench(args: argparse.Namespace) -> int:
    _torchvision()
    names = QUICK_LAYERS if args.quick else tuple(BENCH_LAYERS)
    print(
        f"tvm_deform {__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"CPU {build.host_cpu()}; median of >= 10 runs; random offsets N(0, 2^2), mask U[0, 1)"
    )
    peers = [] if args.no_peers else available_peers()
    print_table({name: BENCH_LAYERS[name] for name in names}, peers)
    return 0


def run_diagnose(args: argparse.Namespace) -> int:
    from .precision import diagnose

    data, offset, weight, mask = seed_case()
    print("Seed case, float32 against the same layer computed with float16 data (10-bit mantissa)")
    print("and float32 accumulation, as the accelerator's default conv mode did:")
    report = diagnose(data, offset, weight, mask=mask, mantissa_bits=10, mode="io")
    print(f"  output[1, 0]  float32:\n{report.float32[1, 0]}")
    print(f"  output[1, 0]  reduced:\n{report.reduced[1, 0]}")
    print(f"  {report.summary()}")
    print()
    generator = torch.Generator().manual_seed(0)
    data = torch.randn(1, 64, 20, 20, generator=generator)
    offset = 2 * torch.randn(1, 18, 20, 20, generator=generator)
    weight = torch.randn(64, 64, 3, 3, generator=generator) / 24
    mask = torch.rand(1, 9, 20, 20, generator=generator)
    print("Random layer C=O=64 20x20 3x3 pad 1:")
    for mode in ("io", "accumulate"):
        report = diagnose(data, offset, weight, padding=1, mask=mask, mode=mode)
        print(f"  {report.summary()}")
    return 0


def run_info(args: argparse.Namespace) -> int:
    import tvm

    target = build.host_target()
    print(f"tvm_deform {__version__}  (TVM {tvm.__version__}, torch {torch.__version__})")
    print(f"host target:   {target}")
    print(f"hardware key:  {build.hardware_key(target)}")
    print(f"threads:       {torch.get_num_threads()} (torch.get_num_threads)")
    cache = env.cache_dir()
    state = "on" if env.cache_enabled() else "off"
    print(f"kernel cache:  {cache} ({state})")
    for name, description in env.VARIABLES.items():
        print(f"  {name}={os.environ.get(name, '')!s:<12} {description}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tvm-deform", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="the seed case and a realistic layer against torchvision")
    bench = sub.add_parser("bench", help="time layers against torchvision and dense conv2d")
    bench.add_argument("--quick", action="store_true", help="two layers only")
    bench.add_argument(
        "--no-peers", action="store_true", help="leave out ONNX Runtime and OpenVINO"
    )
    sub.add_parser("info", help="target, hardware key, cache and environment")
    sub.add_parser(
        "diagnose", help="the seed bug: the layer in float32 next to its float16 computation"
    )
    args = parser.parse_args(argv)
    handlers = {"demo": run_demo, "bench": run_bench, "info": run_info, "diagnose": run_diagnose}
    handler = handlers[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
