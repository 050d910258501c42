"""The ``tvm-deform`` command (also ``python -m tvm_deform``): demo, bench, bench-backward,
bench-model, compare, diagnose, info, tune, tune-round, tune-ingest, tune-report, build."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tvm.target import Target

from tvm_deform import __version__, env
from tvm_deform.binding.ops import deform_conv2d
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels, targets
from tvm_deform.runtime.records import OPS
from tvm_deform.tools import cuda_build
from tvm_deform.tools.peers import available_peers
from tvm_deform.tools.suite import QUICK, load_suite
from tvm_deform.tools.tuning import SPACES


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
    shape = load_suite()["demo_64x56x56"]
    print(
        f"Layer N=1 C=O=64 56x56 3x3 pad 1, random offsets (scale 2), "
        f"{torch.get_num_threads()} threads:"
    )
    print_summary({"demo_64x56x56": shape}, available_peers(), Path(args.out), "demo")
    return 0


def print_summary(layers: dict[str, ConvShape], peers: Sequence[str], out: Path, name: str) -> None:
    """Measure ``layers`` (see :func:`tvm_deform.tools.compare.run`), print the brief table and
    write the full ones to ``out/<name>.md`` and ``out/<name>-summary.md``."""
    from tvm_deform.tools import compare

    records, _ = compare.run(layers, peers)
    print(compare.brief_table(records))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(compare.markdown_table(records))
    (out / f"{name}-summary.md").write_text(compare.summary_table(records))
    print(f"full tables: {out / name}.md, {out / name}-summary.md")


def run_bench(args: argparse.Namespace) -> int:
    _torchvision()
    workloads = _chosen_workloads(args)
    print(
        f"tvm_deform {__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"CPU {targets.host_cpu()}; median of >= 10 runs; random offsets N(0, 2^2), mask U[0, 1)"
    )
    peers = [] if args.no_peers else available_peers()
    print_summary(workloads, peers, Path(args.out), "bench")
    return 0


def run_bench_backward(args: argparse.Namespace) -> int:
    from tvm_deform.tools.bench import (
        compare_training_step,
        geometric_mean_speedup,
        training_table,
    )

    _torchvision()
    workloads = _chosen_workloads(args)
    print(
        f"tvm_deform {__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"CPU {targets.host_cpu()}; forward + backward (gradients of input, offset, weight, bias "
        "and mask); median of >= 10 runs (3 for torchvision); random offsets N(0, 2^2)"
    )
    rows = []
    for name, shape in workloads.items():
        print(f"  {name} ...", flush=True)
        rows += compare_training_step(name, shape)
    print(training_table(rows))
    print(f"geometric mean speed-up over torchvision: {geometric_mean_speedup(rows):.1f}x")
    return 0


def run_bench_model(args: argparse.Namespace) -> int:
    from tvm_deform.tools import bench_model

    _torchvision()
    peers = () if args.no_peers else tuple(available_peers())
    print(
        f"R50-DCNv2 (DCN in c3-c5), input {args.batch}x3x{args.size}x{args.size}, inference, "
        f"{torch.get_num_threads()} threads, CPU {targets.host_cpu()}; >= {args.runs} runs a row "
        f"in {bench_model.ROUNDS} interleaved rounds, the median of the rounds' medians; every "
        "row checked against torch + torchvision"
    )
    compiled_calls: dict = {}
    rows = bench_model.run(
        args.size,
        args.batch,
        compiled=not args.no_compile,
        peers=peers,
        runs=args.runs,
        compiled_calls=compiled_calls,
    )
    table = bench_model.model_table(rows)
    print(table)
    print()
    print("what the DCN layers (with their offset convs) add to each runtime")
    costs = bench_model.dcn_cost_table(rows)
    print(costs)
    print()
    print(
        "each DCN layer of the tvm_deform model: inside the model (eager) against alone, right "
        "after each forward and in a loop of its own"
        + (
            "; inside the compiled model, and the dense conv at its place in the compiled dense "
            "model (torch's profiler)"
            if not args.no_compile
            else ""
        )
        + (
            "; and OpenVINO's DCN kernel inside its own model (its per-layer counters)"
            if "openvino" in peers
            else ""
        )
    )
    compiled_ms = dense_ms = None
    if not args.no_compile:
        compiled_ms, dense_ms = (
            bench_model.compiled_layer_times(implementation=name, call=compiled_calls[name])
            for name in ("tvm_deform", "dense")
        )
    openvino_ms = None
    if "openvino" in peers:
        try:
            openvino_ms = bench_model.openvino_layer_times(args.size, args.batch)
        except Exception as error:  # noqa: BLE001 - the table goes without OpenVINO's columns
            print(f"OpenVINO's per-layer times failed: {type(error).__name__}: {error}")
    layer_records = bench_model.layer_records(
        bench_model.layers_in_model(args.size, args.batch), compiled_ms, openvino_ms, dense_ms
    )
    layers = bench_model.markdown(layer_records)
    print(layers)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench-model.md").write_text("\n\n".join([table, costs, layers]) + "\n")
        data = {
            "model": bench_model.model_records(rows),
            "dcn_costs": bench_model.dcn_costs(rows),
            "layers": layer_records,
        }
        (out / "bench-model.json").write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {out / 'bench-model.md'} and {out / 'bench-model.json'}")
    failed = [r for r in rows if r.error is not None and r.error > 1e-4]
    for row in failed:
        print(f"{row.implementation}: relative error {row.error:.1e} against torch + torchvision")
    return 1 if failed else 0


def run_bench_sizes(args: argparse.Namespace) -> int:
    from tvm_deform.tools import bench_model, bench_sizes

    _torchvision()
    print(
        f"R50-DCNv2 (DCN in c3-c5), a stream of {len(bench_sizes.IMAGES)} images resized to a "
        f"short side of {bench_sizes.SHORT_SIDE} and padded to {bench_sizes.STRIDE}, inference, "
        f"batch 1, {torch.get_num_threads()} threads, CPU {targets.host_cpu()}; each stream a new "
        "process (import not counted), tvm_deform's cold one from an empty kernel cache"
    )
    streams = bench_sizes.run()
    table = bench_model.markdown(bench_sizes.summary(streams))
    images = bench_model.markdown(bench_sizes.per_image(streams), digits=0)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-sizes.md").write_text(table + "\n\n" + images + "\n")
    (out / "bench-sizes.json").write_text(json.dumps(streams, indent=1) + "\n")
    print(f"per image: {out / 'bench-sizes.md'}; raw: {out / 'bench-sizes.json'}")
    return 0


def run_diagnose(args: argparse.Namespace) -> int:
    from tvm_deform.compat.precision import diagnose

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


def run_compare(args: argparse.Namespace) -> int:
    from tvm_deform.tools import compare

    _torchvision()
    workloads = _chosen_workloads(args)
    peers = [] if args.no_peers else available_peers()
    records, complete = compare.run(workloads, peers, args.other_logs)
    out = Path(args.out)
    table = compare.markdown_table(records)
    summary = compare.summary_table(records) if records else ""
    print()
    if records:
        print(compare.brief_table(records))
    compare.write_csv(records, out / "compare.csv")
    compare.write_json(records, out / "compare.json")
    (out / "compare.md").write_text(table)
    (out / "compare-summary.md").write_text(summary)
    written = ["compare.csv", "compare.json", "compare.md", "compare-summary.md"]
    if not args.no_plot and records:
        try:
            compare.plot(records, out / "compare.png")
            written.append("compare.png")
        except RuntimeError as error:
            print(error)
    print(f"wrote {', '.join(written)} to {out}/")
    failed = [r for r in records if r["correct"] is False]
    if failed:
        print(f"{len(failed)} result(s) failed the correctness check")
    return 0 if complete and not failed else 1


def run_info(args: argparse.Namespace) -> int:
    import tvm

    from tvm_deform.runtime import dispatch, hardware, launcher, records, workspace

    cpu = hardware.detect()
    target = targets.host_target()
    key = targets.hardware_key(target)
    print(f"tvm_deform {__version__}  (TVM {tvm.__version__}, torch {torch.__version__})")
    print(f"CPU:           {cpu.model} ({cpu.machine}), {cpu.cores} cores for this process")
    print(f"vector ISA:    {cpu.isa}, {cpu.vector_bits}-bit vectors ({cpu.reason})")
    caches = ", ".join(f"{name} {size // 1024} KiB" for name, size in cpu.caches.items())
    print(f"caches:        {caches or 'unknown'}")
    print(f"LLVM CPU:      {targets.host_cpu()}")
    print(f"host target:   {target}")
    print(f"hardware key:  {key}")
    if launcher.enabled():
        pool = f"torch's intra-op threads (launcher {launcher.get().path})"
    elif not env.launcher_enabled():
        pool = "TVM's own pool (TVM_DEFORM_LAUNCHER=0)"
    else:
        pool = f"TVM's own pool: the launcher could not be built ({launcher.unavailable_reason})"
    print(f"thread pool:   {pool}")
    if torch.version.cuda is not None:
        allocator = workspace.get()
        if allocator is not None:
            print(f"CUDA scratch:  torch's caching allocator (shim {allocator.path})")
        else:
            print(f"CUDA scratch:  TVM's workspace pool ({workspace.unavailable_reason})")
        print(f"CUDA compile:  {targets.cuda_compile_settings()}")
    print(f"threads:       {torch.get_num_threads()} (torch.get_num_threads)")
    cache = env.cache_dir()
    print(f"kernel cache:  {cache} ({'on' if env.cache_enabled() else 'off'})")
    tuned = "on" if env.tuned_enabled() else "off (TVM_DEFORM_TUNED=0)"
    print(f"tuning logs:   {tuned}")
    dates: dict[str, str] = {}  # hardware key -> date of its logs in the first root holding them
    for root in records.log_roots():
        keys = [k for k in records.candidate_keys(root, target, key) if (root / k).is_dir()]
        here = {k: records.logs_date(root / k) or "" for k in keys}
        for k, date in here.items():
            dates.setdefault(k, date)
        shown = ", ".join(f"{k} ({date or 'undated'})" for k, date in here.items())
        print(f"  {root}: {shown or 'nothing for this machine'}")
    if key not in dates:
        print(
            f"  no logs of this machine's own ({key}): records of compatible machines are timed "
            "here against the default at a shape's first use (`tvm-deform tune` writes own logs)"
        )
    else:
        newer = sorted(k for k, date in dates.items() if k != key and date > dates[key])
        if newer:
            print(
                f"  {', '.join(newer)}: newer than this machine's own logs, whose choices dispatch "
                "keeps; `tvm-deform tune --trials 0 --work-dir NEW_DIR` times their records here "
                "and keeps what wins"
            )
    print("environment variables (value here, or unset):")
    for name, description in env.VARIABLES.items():
        value = os.environ.get(name)
        setting = f"{name}={value}" if value is not None else f"{name} unset"
        print(f"  {setting:<28} {description}")
    print()
    print("what deform_conv2d runs for each suite workload here:")
    for name, shape in load_suite(args.suite).items():
        for op in records.OPS:
            print(f"  {name:<28} {op:<9} {dispatch.describe(shape, target, op)}")
    return 0


def run_tune(args: argparse.Namespace) -> int:
    from tvm_deform.tools.fleet import Fleet
    from tvm_deform.tools.tuning import tune

    workloads = _chosen_workloads(args)
    spaces = SPACES if args.space == "all" else (args.space,)
    ops = OPS if args.op == "all" else (args.op,)
    if bool(args.rpc) != bool(args.device_key):
        raise SystemExit("--rpc and --device-key go together")
    fleet = Fleet.parse(args.rpc, args.device_key) if args.rpc else None
    target = Target(json.loads(args.target)) if args.target else None
    if fleet is None and target is None:
        target = targets.host_target()
    # With a fleet and no --target, tune() asks a device for its target.
    machine = targets.hardware_key(target) if target is not None else f"the devices of {fleet}"
    logs_dir = None if args.no_write_logs else (args.logs_dir or str(env.user_logs_dir()))
    print(
        f"tuning {len(workloads)} workload(s) x {len(ops)} op(s) x {len(spaces)} space(s), "
        f"{args.trials} trials each, for {machine}; work directory {args.work_dir}"
    )
    tune(
        workloads,
        args.trials,
        args.work_dir,
        spaces,
        target,
        logs_dir,
        ops=ops,
        transfer=not args.no_transfer,
        fleet=fleet,
        time_limit=None if args.time_limit is None else args.time_limit * 60,
    )
    if logs_dir is not None:
        print(f"pruned logs written under {logs_dir}")
    return 0


def run_tune_round(args: argparse.Namespace) -> int:
    from tvm_deform.tools import rounds

    workloads = _chosen_workloads(args)
    if args.arch:
        target = targets.cuda_target(args.arch, args.multiprocessors)
    elif args.multiprocessors:
        raise SystemExit("--multiprocessors goes with --arch")
    else:
        target = targets.host_target()
    ops = OPS if args.op == "all" else (args.op,)
    path = rounds.propose(workloads, target, args.work_dir, args.out, args.count, args.seed, ops)
    size = sum(f.stat().st_size for f in Path(args.out).iterdir() if f.is_file())
    packed = rounds.packed_path(args.out)
    print(
        f"{path}: {size / 2**20:.1f} MiB, packed in {packed} ({packed.stat().st_size / 2**20:.1f}"
        f" MiB); time it with lab/time_round.py {packed}"
    )
    return 0


def run_tune_ingest(args: argparse.Namespace) -> int:
    from tvm_deform.tools import rounds
    from tvm_deform.tools.tuning import write_pruned_logs

    round_file = Path(args.round) / rounds.ROUND_FILE
    summary = rounds.ingest(round_file, args.results, args.work_dir)
    if args.logs_dir:
        described = json.loads(round_file.read_text())
        entries = described["workloads"]
        workloads = {w.get("name", n): ConvShape(**w["shape"]) for n, w in entries.items()}
        ops = sorted({w.get("op", "forward") for w in entries.values()}, key=OPS.index)
        device = next((s.device for s in summary if s.device), None)
        target = Target(described["target"])
        write_pruned_logs(
            args.work_dir, args.logs_dir, workloads, rounds.SPACES, target, ops, cpu=device
        )
        print(f"pruned logs of {targets.hardware_key(target)} written to {args.logs_dir}")
    return 0


def run_tune_report(args: argparse.Namespace) -> int:
    from tvm_deform.tools.tuning import convergence_table

    workloads = _chosen_workloads(args)
    target = targets.host_target()

    print(
        "best time (ms, MetaSchedule's runner) against trials spent, "
        f"{targets.hardware_key(target)}"
        f", {args.space} space, {args.op}; work directory {args.work_dir}"
    )
    print(convergence_table(args.work_dir, workloads, target, args.space, args.op))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from tvm_deform.tools.fleet import serve

    serve(args.tracker, args.key, args.host, args.port, args.port_end)
    return 0


def run_logs(args: argparse.Namespace) -> int:
    from tvm_deform.tools.merge import merge_logs

    for line in merge_logs(args.dirs, args.out):
        print(line)
    print(f"merged logs written to {args.out}")
    return 0


def run_build(args: argparse.Namespace) -> int:
    workloads = _chosen_workloads(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.target:
        return _build_cpu(workloads, Target(json.loads(args.target)), out)
    return _build_cuda(workloads, args.arch, out)


def _build_cpu(workloads: dict[str, ConvShape], target: Target, out: Path) -> int:
    """Compile each workload's forward and backward kernels for an LLVM ``target`` (any
    architecture: no linking) and write their object files."""
    if target.kind.name != "llvm":
        raise SystemExit(f"--target builds LLVM (CPU) targets; got {target.kind.name}")
    key = targets.hardware_key(target).replace("/", "_")
    for name, shape in workloads.items():
        built = {
            "forward": kernels.compile_kernel(shape, target),
            "backward": kernels.compile_backward(shape, target),
        }
        for op, executable in built.items():
            path = out / f"{name}-{op}-{key}.o"
            executable.mod.write_to_file(str(path))
            print(f"{path}: {path.stat().st_size} bytes")
    return 0


def _build_cuda(workloads: dict[str, ConvShape], arches: list[str], out: Path) -> int:
    import shutil

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("nvcc not found: writing the CUDA sources only")
    for name, shape in workloads.items():
        for arch in arches:
            source = cuda_build.cuda_source(shape, arch)
            path = out / f"{name}-{arch}.cu"
            path.write_text(source)
            print(f"{path}: {len(source.splitlines())} lines")
            if nvcc is None:
                continue
            built = cuda_build.nvcc_build(source, arch, nvcc)
            (out / f"{name}-{arch}.cubin").write_bytes(built.cubin)
            for kernel, resources in built.kernels.items():
                print(f"  {kernel:<28} {resources}")
    return 0


def _chosen_workloads(args: argparse.Namespace) -> dict[str, ConvShape]:
    """The suite (``--suite``), narrowed by ``--workload`` names, or the one ``--shape``, or
    (``--quick``, when neither is given) its ``QUICK`` layers; a command without one of these
    options takes it as not given."""
    workloads = load_suite(args.suite)
    shape, names = getattr(args, "shape", None), getattr(args, "workload", None)
    if shape:
        return {"shape": ConvShape(**json.loads(shape))}
    if names:
        unknown = sorted(set(names) - set(workloads))
        if unknown:
            raise SystemExit(f"unknown workload(s) {unknown}; the suite has {sorted(workloads)}")
        return {name: workloads[name] for name in names}
    if getattr(args, "quick", False):
        return {name: workloads[name] for name in QUICK if name in workloads}
    return workloads


def _parent(*options: str) -> argparse.ArgumentParser:
    """A parent parser with the named shared options, each declared once here."""
    parent = argparse.ArgumentParser(add_help=False)
    declared = {
        "suite": lambda: parent.add_argument(
            "--suite", help="a suite JSON file instead of the shipped one"
        ),
        "workload": lambda: parent.add_argument(
            "--workload", action="append", help="only this suite workload (repeatable)"
        ),
        "shape": lambda: parent.add_argument(
            "--shape",
            help='one layer as JSON (ConvShape fields), e.g. \'{"batch": 1, "in_channels": 64, '
            '"height": 56, "width": 56, "out_channels": 64, "kernel_h": 3, "kernel_w": 3, '
            '"pad_h": 1, "pad_w": 1}\'',
        ),
        "quick": lambda: parent.add_argument(
            "--quick", action="store_true", help="two layers only, about a minute"
        ),
        "no-peers": lambda: parent.add_argument(
            "--no-peers", action="store_true", help="leave out ONNX Runtime and OpenVINO"
        ),
        "out": lambda: parent.add_argument(
            "--out", default="results", help="directory for the full tables (default: results)"
        ),
    }
    for option in options:
        declared[option]()
    return parent


def build_parser() -> argparse.ArgumentParser:
    """The ``tvm-deform`` command line."""
    parser = argparse.ArgumentParser(prog="tvm-deform", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "demo",
        parents=[_parent("out")],
        help="the seed case and a realistic layer against torchvision",
    )
    sub.add_parser(
        "bench",
        parents=[_parent("quick", "suite", "workload", "shape", "no-peers", "out")],
        help="time layers against torchvision, the peers and dense conv2d",
    )
    sub.add_parser(
        "bench-backward",
        parents=[_parent("quick", "suite", "workload", "shape")],
        help="time forward + backward against torchvision and dense conv2d",
    )
    model = sub.add_parser(
        "bench-model",
        parents=[_parent("no-peers", "out")],
        help="R50-DCNv2: torch + torchvision / tvm_deform / dense, ORT, OpenVINO",
    )
    model.add_argument("--size", type=int, default=320, help="input height and width")
    model.add_argument("--batch", type=int, default=1)
    model.add_argument("--runs", type=int, default=10, help="timed runs per row, at least")
    model.add_argument("--no-compile", action="store_true", help="leave out torch.compile rows")
    sub.add_parser(
        "bench-sizes",
        parents=[_parent("out")],
        help="R50-DCNv2 on 20 detection-style sizes, cold and warm cache, against torchvision",
    )
    sub.add_parser(
        "info",
        parents=[_parent("suite")],
        help="target, hardware key, logs, and what each workload runs",
    )
    tune = sub.add_parser(
        "tune",
        parents=[_parent("suite", "workload", "shape")],
        help="tune workloads with MetaSchedule (resumable)",
    )
    tune.add_argument(
        "--trials",
        type=int,
        default=32,
        help="more trials per workload/space (0: only measure the default schedules)",
    )
    tune.add_argument("--space", choices=("handwritten", "generic", "all"), default="all")
    tune.add_argument(
        "--op",
        choices=("forward", "backward", "all"),
        default="forward",
        help="which kernel to tune (backward: the gradients kernel)",
    )
    tune.add_argument("--target", help="a target as JSON (default: this machine)")
    tune.add_argument("--work-dir", default="work/tune", help="full tuning databases (resumed)")
    tune.add_argument(
        "--logs-dir",
        help="where pruned logs go (default: TVM_DEFORM_LOGS, else the per-user directory that "
        "lookups also read; the repository's tuning_logs/ to update the shipped logs)",
    )
    tune.add_argument("--no-write-logs", action="store_true", help="keep results in work dir")
    tune.add_argument("--rpc", metavar="HOST:PORT", help="measure on an RPC tracker's servers")
    tune.add_argument("--device-key", help="the servers' key at the tracker (with --rpc)")
    tune.add_argument(
        "--no-transfer",
        action="store_true",
        help="do not start from the records of other machines' logs (same ISA)",
    )
    tune.add_argument(
        "--time-limit",
        type=float,
        metavar="MINUTES",
        help="stop measuring and searching after this long, keeping what was found",
    )
    round_ = sub.add_parser(
        "tune-round",
        parents=[_parent("suite", "workload", "shape")],
        help="propose and build a round of candidates to time elsewhere (lab/time_round.py)",
    )
    round_.add_argument("--count", type=int, default=32, help="candidates per workload and op")
    round_.add_argument(
        "--op",
        choices=("forward", "backward", "all"),
        default="forward",
        help="the kernels proposed: the forward's, the backward's gradients kernel, or both",
    )
    round_.add_argument("--arch", help="a CUDA arch (sm_90); default: this machine's CPU")
    round_.add_argument(
        "--multiprocessors", type=int, help="the GPU's multiprocessors (132 on an H100 SXM)"
    )
    round_.add_argument("--work-dir", default="work/tune", help="databases and cost model")
    round_.add_argument(
        "--out",
        required=True,
        help="the round's directory (packed beside it as OUT.tar.xz, what travels)",
    )
    round_.add_argument("--seed", type=int, default=0)
    ingest = sub.add_parser(
        "tune-ingest", help="commit a round's times (lab/time_round.py's output) and learn"
    )
    ingest.add_argument("round", help="the round's directory")
    ingest.add_argument("results", help="the JSON lines lab/time_round.py wrote")
    ingest.add_argument("--work-dir", default="work/tune", help="databases and cost model")
    ingest.add_argument(
        "--logs-dir", help="then write the round's workloads' pruned logs there (tuning_logs/)"
    )
    report = sub.add_parser(
        "tune-report",
        parents=[_parent("suite", "workload", "shape")],
        help="best time against trials spent, from the tuning work directory",
    )
    report.add_argument("--work-dir", default="work/tune")
    report.add_argument("--space", choices=("handwritten", "generic"), default="handwritten")
    report.add_argument("--op", choices=("forward", "backward"), default="forward")
    cmp = sub.add_parser(
        "compare",
        parents=[_parent("quick", "suite", "workload", "shape", "no-peers", "out")],
        help="schedules vs torchvision, peers and dense conv2d",
    )
    cmp.add_argument("--other-logs", help="a second tuning-log directory to compare against")
    cmp.add_argument("--no-plot", action="store_true", help="skip the PNG")
    build = sub.add_parser(
        "build",
        parents=[_parent("suite", "workload", "shape")],
        help="write workloads' CUDA source and nvcc's cubin, or (--target) CPU object files",
    )
    build.add_argument("--target", help="an LLVM target as JSON: write its object files instead")
    build.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"], help="CUDA archs")
    build.add_argument("--out", default="build/cuda", help="directory for the .cu and .cubin")
    sub.add_parser(
        "diagnose", help="the seed bug: the layer in float32 next to its float16 computation"
    )
    serve = sub.add_parser("serve", help="an RPC server for `tune --rpc` (a device of a fleet)")
    serve.add_argument("--tracker", required=True, metavar="HOST:PORT")
    serve.add_argument("--key", required=True, help="the device key it registers under")
    serve.add_argument("--host", default="0.0.0.0", help="address to listen on")
    serve.add_argument("--port", type=int, default=9090, help="first port to try")
    serve.add_argument("--port-end", type=int, default=9199, help="last port to try")
    cache = sub.add_parser("cache", help="show the kernel cache, or empty it (--clear)")
    cache.add_argument("--clear", action="store_true", help="remove everything in it")
    logs = sub.add_parser("logs", help="tuning-log trees: merge")
    logs_sub = logs.add_subparsers(dest="logs_command", required=True)
    merge = logs_sub.add_parser("merge", help="merge log trees, keeping the best records")
    merge.add_argument("dirs", nargs="+", help="log trees laid out like tuning_logs/")
    merge.add_argument("--out", required=True, help="the merged tree (its own logs are kept)")
    return parser


def run_cache(args: argparse.Namespace) -> int:
    from tvm_deform.runtime import diskcache

    if args.clear:
        freed = diskcache.clear()
        print(f"removed {freed / 2**20:.1f} MiB from {env.cache_dir()}")
    print(diskcache.describe())
    return 0


def _show_progress() -> None:
    """The package's progress messages (kernel compiles, which take seconds) on stderr, apart
    from the tables on stdout."""
    logger = logging.getLogger("tvm_deform")
    if not any(getattr(h, "tvm_deform_progress", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("  %(message)s"))
        handler.tvm_deform_progress = True
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    _show_progress()
    args = parser.parse_args(argv)
    handlers = {
        "demo": run_demo,
        "bench": run_bench,
        "bench-backward": run_bench_backward,
        "bench-model": run_bench_model,
        "bench-sizes": run_bench_sizes,
        "info": run_info,
        "diagnose": run_diagnose,
        "tune": run_tune,
        "tune-round": run_tune_round,
        "tune-ingest": run_tune_ingest,
        "tune-report": run_tune_report,
        "compare": run_compare,
        "build": run_build,
        "serve": run_serve,
        "logs": run_logs,
        "cache": run_cache,
    }
    handler = handlers[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
