"""``tvm-deform compare``: schedule performance side by side, as a table, a data file and a plot.

Method (also in the README): every implementation runs on the same random inputs (offsets
``2 * N(0, 1)``, masks ``U[0, 1)``) in one process and is checked against torchvision's output in
the same run. The timing runs in three interleaved rounds (every implementation in each round, at
least 4 runs and 0.1 s each, 2 runs for torchvision); a row reports the median of the rounds'
medians and of their 20th/80th percentiles. ``tvm_deform`` is the public op as users call it;
"between conv2d" rows call each run right after a dense conv2d of the layer. The machine's peak
is measured in the same run as the fastest of 8 large dense float32 GEMMs (torch.mm, 3072^3) at
the same thread count, not taken from a datasheet; oneDNN's dense conv2d can exceed it.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tvm_deform import __version__
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import dispatch, records, targets
from tvm_deform.runtime.inputs import TOLERANCE
from tvm_deform.tools.bench import BETWEEN, DISPATCHED, Row, compare_layer
from tvm_deform.tools.peers import PEERS

#: a relative error (norm-wise, against torchvision) above this fails the correctness column


def measure_peak_gflops(size: int = 3072, runs: int = 8) -> float:
    """The float32 GEMM rate of this machine at torch's thread count, in GFLOP/s: the fastest
    of ``runs`` products of two ``size`` x ``size`` matrices (torch.mm) after a warm-up."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)
    best = min(_seconds(lambda: torch.mm(a, b)) for _ in range(runs))
    return 2 * size**3 / best / 1e9


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def environment() -> dict[str, object]:
    """The columns every row repeats: hardware, versions, threads, date."""
    import tvm

    return {
        "hardware_key": targets.hardware_key(targets.host_target()),
        "cpu": targets.host_cpu(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "tvm_deform": __version__,
        "tvm": tvm.__version__,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def own_logs_line() -> str:
    """Whether this machine has tuning logs of its own, in words."""
    target = targets.host_target()
    key = targets.hardware_key(target)
    if any((root / key).is_dir() for root in records.log_roots()):
        return f"tuning logs of this machine's own: {key}"
    return (
        f"no tuning logs of this machine's own ({key}): other machines' records are timed "
        "here against the default schedule at a shape's first use"
    )


def rows_for_layer(
    name: str, shape: ConvShape, measured: list[Row], peak_gflops: float, env: dict
) -> list[dict[str, object]]:
    """Long-format records of one layer's measurements, with the derived columns."""
    by_name = {row.implementation: row for row in measured}
    tv = by_name["torchvision"].timing.median_ms
    dense = by_name["conv2d (dense)"].timing.median_ms
    records = []
    for row in measured:
        median = row.timing.median_ms
        gflops = shape.gemm_flops / (median * 1e-3) / 1e9
        records.append(
            {
                "workload": name,
                "implementation": row.implementation,
                "median_ms": median,
                "p20_ms": row.timing.p20_ms,
                "p80_ms": row.timing.p80_ms,
                "runs": row.timing.runs,
                "gflops": gflops,
                "peak_fraction": gflops / peak_gflops,
                "speedup_vs_torchvision": tv / median,
                "ratio_to_conv2d": median / dense,
                "rel_error_vs_torchvision": row.error,
                "correct": None if row.error is None else row.error <= TOLERANCE[shape.dtype],
                "shape": json.dumps(dataclasses.asdict(shape), sort_keys=True),
                "peak_gflops": peak_gflops,
                **env,
            }
        )
    return records


def run(
    workloads: dict[str, ConvShape],
    peers: Sequence[str] = (),
    other_logs: str | os.PathLike | None = None,
    progress: Callable[[str], None] = print,
) -> tuple[list[dict[str, object]], bool]:
    """Measure every workload; returns (records, complete). Ctrl-C stops after what was measured
    so far (``complete`` is then False) instead of losing it."""
    env = environment()
    records: list[dict[str, object]] = []
    try:
        peak = measure_peak_gflops()
        progress(f"machine peak (dense float32 GEMM, {env['threads']} threads): {peak:.0f} GFLOP/s")
        progress(own_logs_line())
        for index, (name, shape) in enumerate(workloads.items(), start=1):
            progress(f"[{index}/{len(workloads)}] {name}")
            measured = compare_layer(name, shape, peers, other_logs)
            # After the timing: the first call made any decision that was still to be made.
            target = targets.host_target()
            progress(f"  deform_conv2d runs here: {dispatch.describe(shape, target)}")
            records += rows_for_layer(name, shape, measured, peak, env)
    except KeyboardInterrupt:
        progress("interrupted: writing what was measured so far")
        return records, False
    return records, True


def write_csv(records: list[dict[str, object]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]) if records else ["workload"])
        writer.writeheader()
        writer.writerows(records)


def write_json(records: list[dict[str, object]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1) + "\n")


def markdown_table(records: list[dict[str, object]]) -> str:
    """One line per (workload, implementation): the table the README shows."""
    lines = [
        "| workload | implementation | median ms | p20-p80 ms | GFLOP/s | % of peak "
        "| speed-up vs torchvision | x dense conv2d | rel. error | correct |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        error = (
            "-" if r["rel_error_vs_torchvision"] is None else f"{r['rel_error_vs_torchvision']:.1e}"
        )
        correct = {None: "-", True: "yes", False: "**NO**"}[r["correct"]]
        lines.append(
            f"| {r['workload']} | {r['implementation']} | {r['median_ms']:.2f} "
            f"| {r['p20_ms']:.2f}-{r['p80_ms']:.2f} | {r['gflops']:.0f} "
            f"| {100 * r['peak_fraction']:.0f}% | {r['speedup_vs_torchvision']:.1f}x "
            f"| {r['ratio_to_conv2d']:.2f} | {error} | {correct} |"
        )
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, object]], path: Path) -> None:
    """Bar chart of the speed-up over torchvision per workload and implementation, with the
    dense conv2d ceiling drawn as a marker. Needs matplotlib (the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "the plot needs matplotlib: pip install 'tvm_deform[plot]' (or pass --no-plot)"
        ) from None
    workloads = list(dict.fromkeys(str(r["workload"]) for r in records))
    names = [
        n
        for n in dict.fromkeys(str(r["implementation"]) for r in records)
        if n not in ("torchvision", "conv2d (dense)")
    ]
    value = {(r["workload"], r["implementation"]): r["speedup_vs_torchvision"] for r in records}
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(workloads)), 5))
    for i, name in enumerate(names):
        xs = [w + (i - (len(names) - 1) / 2) * width for w in range(len(workloads))]
        ys = [value.get((w, name), math.nan) for w in workloads]
        ax.bar(xs, ys, width, label=name)
    ceiling = [value.get((w, "conv2d (dense)"), math.nan) for w in workloads]
    ax.scatter(
        range(len(workloads)),
        ceiling,
        marker="_",
        s=900,
        color="black",
        zorder=3,
        label="dense conv2d (ceiling)",
    )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("speed-up over torchvision (log)")
    ax.set_xticks(range(len(workloads)), workloads, rotation=30, ha="right")
    threads = records[0]["threads"] if records else "?"
    ax.set_title(f"deform_conv2d on {records[0]['cpu'] if records else '?'}, {threads} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_table(records: list[dict[str, object]]) -> str:
    """One line per workload: every implementation's median time, then, for ``tvm_deform`` as
    users call it (the schedule dispatch picks here), its speed-up over torchvision, its ratio to
    dense conv2d, GFLOP/s and its time between conv2d calls over its time alone; and the largest
    relative error of any implementation against torchvision."""
    implementations = sorted(
        dict.fromkeys(str(r["implementation"]) for r in records), key=_column_rank
    )
    workloads = list(dict.fromkeys(str(r["workload"]) for r in records))
    by = {(r["workload"], r["implementation"]): r for r in records}
    lines = [
        "| workload | "
        + " | ".join(f"{name} ms" for name in implementations)
        + " | tvm_deform vs torchvision | x dense conv2d | GFLOP/s | between / alone "
        "| max rel. error |",
        "|---" * (len(implementations) + 6) + "|",
    ]
    for workload in workloads:
        ours = by[(workload, DISPATCHED)]
        between = by.get((workload, DISPATCHED + BETWEEN))
        errors = [
            by[(workload, name)]["rel_error_vs_torchvision"]
            for name in implementations
            if (workload, name) in by
            and by[(workload, name)]["rel_error_vs_torchvision"] is not None
        ]
        cells = [
            f"{by[(workload, name)]['median_ms']:.2f}" if (workload, name) in by else "-"
            for name in implementations
        ]
        cells += [
            f"{ours['speedup_vs_torchvision']:.1f}x",
            f"{ours['ratio_to_conv2d']:.2f}",
            f"{ours['gflops']:.0f}",
            "-" if between is None else f"{between['median_ms'] / ours['median_ms']:.2f}",
            f"{max(errors):.1e}",
        ]
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: the width of a terminal the brief table must fit, unwrapped
TERMINAL_COLUMNS = 100


def brief_table(records: list[dict[str, object]]) -> str:
    """One aligned line per workload with the few columns a newcomer reads: ``tvm_deform`` as
    users call it, torchvision, the fastest peer, dense conv2d, our speed-up over torchvision
    and whether every implementation matched torchvision. At most ``TERMINAL_COLUMNS`` wide
    (the full tables go to files)."""
    peers = set(PEERS)
    by = {(r["workload"], r["implementation"]): r for r in records}
    header = ["workload", "ours ms", "torchvision", "best peer ms", "dense ms", "speed-up", "ok"]
    rows = []
    for workload in dict.fromkeys(str(r["workload"]) for r in records):
        ours = by[(workload, DISPATCHED)]
        peer = min(
            (r for r in records if r["workload"] == workload and r["implementation"] in peers),
            key=lambda r: r["median_ms"],
            default=None,
        )
        correct = [r["correct"] for r in records if r["workload"] == workload]

        def ms(row: dict | None) -> str:
            return "-" if row is None else f"{row['median_ms']:.2f}"

        rows.append(
            [
                workload,
                ms(ours),
                ms(by.get((workload, "torchvision"))),
                "-" if peer is None else f"{ms(peer)} {str(peer['implementation'])[:8]}",
                ms(by.get((workload, "conv2d (dense)"))),
                f"{ours['speedup_vs_torchvision']:.1f}x",
                "NO" if False in correct else "yes",
            ]
        )
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))])

    text = [line(header), *(line(r) for r in rows)]
    return "\n".join(text) + "\n"


def _column_rank(name: str) -> tuple[int, str]:
    """torchvision, then our op as called, then each schedule, then the peers, then dense
    conv2d last."""
    if name == "torchvision":
        return (0, "")
    if name.startswith(DISPATCHED + " ") or name == DISPATCHED:
        if name.startswith(DISPATCHED + " default") or name.startswith(DISPATCHED + " tuned"):
            return (2, "" if name == "tvm_deform default" else name)
        return (1, name)
    if name.startswith("conv2d"):
        return (4, "")
    return (3, name)
