"""Merging tuning logs (tools layer): logs from several machines or people into one tree that
dispatch reads like the shipped logs.

Per hardware key and design space, the records of every source are pooled per workload, the
same schedule measured twice keeps its faster time, and the ``KEEP_PER_WORKLOAD`` fastest
survive. The manifests are merged per workload and space (the entry with the best time wins and
names the tree it came from), and ``merged_from`` lists the source trees. Decisions timed
through the op (``decisions.json``) are kept: each names the records it chose among, so one
whose candidates changed in the merge is simply not used, and dispatch falls back to the
tuner's times.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime.records import (
    databases,
    forget_databases,
    is_database,
    open_database,
    pack_database,
    record_ms,
    workload_module,
)
from tvm_deform.tools.tuning import KEEP_PER_WORKLOAD, database

#: a measurement at or above this (milliseconds) is MetaSchedule's mark of a failed run
FAILED_MS = 1e9


def hardware_keys(root: Path) -> list[str]:
    """The hardware keys (``llvm/znver4``, ``cuda/sm_90``) a log tree holds."""
    return sorted({space.parent.relative_to(root).as_posix() for space in databases(root)})


def _spaces(key_dir: Path) -> list[str]:
    return sorted(d.name for d in key_dir.glob("*") if is_database(d))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _merge_space(
    sources: list[Path], key: str, space: str, out_dir: Path, keep: int
) -> dict[str, int]:
    """Write the merged database of one key and space into ``out_dir``; return, per workload
    (structural hash of its module), the best time and the source tree it came from."""
    pooled: dict[int, dict[str, tuple[float, ms.database.TuningRecord, str]]] = {}
    modules: dict[int, tvm.IRModule] = {}
    for source in sources:
        directory = source / key / space
        if not is_database(directory):
            continue
        db = open_database(directory)
        for record in db.get_all_tuning_records():
            run_ms = record_ms(record)
            if run_ms is None or run_ms >= FAILED_MS:
                continue
            workload = tvm_ffi.structural_hash(record.workload.mod)
            modules.setdefault(workload, record.workload.mod)
            schedules = pooled.setdefault(workload, {})
            trace = str(record.trace)
            if trace not in schedules or run_ms < schedules[trace][0]:
                schedules[trace] = (run_ms, record, str(source))
    out_db = database(out_dir)
    best: dict[int, tuple[float, str]] = {}
    for workload, schedules in pooled.items():
        kept = sorted(schedules.values(), key=lambda item: item[0])[:keep]
        committed = out_db.commit_workload(modules[workload])
        for _, record, _ in kept:
            out_db.commit_tuning_record(
                ms.database.TuningRecord(
                    record.trace, committed, record.run_secs, record.target, record.args_info
                )
            )
        best[workload] = (kept[0][0], kept[0][2])
    pack_database(out_dir)
    return best


def _workload_hash(name: str, entry: dict) -> int | None:
    """The structural hash of the module a manifest entry (``name``, with its shape) is of."""
    op = name.rpartition(":")[2] if ":" in name else "forward"
    try:
        return tvm_ffi.structural_hash(workload_module(ConvShape(**entry["shape"]), op))
    except (KeyError, TypeError, ValueError):
        return None


def _merge_manifests(
    sources: list[Path], key: str, best: dict[str, dict[int, tuple[float, str]]]
) -> dict:
    """One manifest for ``key``: each workload and space's entry carries the merged best time
    (``best``: space -> workload hash -> (ms, source)), the tree it came from, and the trials of
    every source together; the machine fields are the first source's."""
    merged: dict = {}
    workloads: dict = {}
    for source in sources:
        manifest = _read_json(source / key / "manifest.json")
        if not manifest:
            continue
        for field, value in manifest.items():
            if field not in ("workloads", "merged_from"):
                merged.setdefault(field, value)
        for name, spaces in manifest.get("workloads", {}).items():
            for space, entry in spaces.items():
                current = workloads.setdefault(name, {}).setdefault(space, dict(entry, trials=0))
                current["trials"] += entry.get("trials") or 0
    for name, spaces in workloads.items():
        for space, entry in spaces.items():
            found = best.get(space, {}).get(_workload_hash(name, entry))
            if found is not None:
                entry.update(best_ms=round(found[0], 4), **{"from": found[1]})
    merged["workloads"] = workloads
    merged["merged_from"] = [str(s) for s in sources if (s / key).is_dir()]
    return merged


def merge_logs(
    sources: Sequence[str | os.PathLike], out: str | os.PathLike, keep: int = KEEP_PER_WORKLOAD
) -> list[str]:
    """Merge the log trees ``sources`` into ``out`` (whose own logs, if any, are merged too);
    return one line per hardware key and space saying what came from where."""
    out = Path(out)
    trees = [Path(s) for s in sources]
    if out.is_dir() and out.resolve() not in {t.resolve() for t in trees}:
        trees.insert(0, out)
    missing = [str(t) for t in trees if not t.is_dir()]
    if missing:
        raise FileNotFoundError(f"no such log director(ies): {missing}")
    report = []
    keys = sorted({key for tree in trees for key in hardware_keys(tree)})
    for key in keys:
        key_out = out / key
        staging = out / f".{key.replace('/', '_')}.merging"
        shutil.rmtree(staging, ignore_errors=True)
        spaces = sorted({space for tree in trees for space in _spaces(tree / key)})
        best = {}
        for space in spaces:
            best[space] = _merge_space(trees, key, space, staging / space, keep)
            best_from: dict[str, int] = {}
            for _, source in best[space].values():
                best_from[source] = best_from.get(source, 0) + 1
            sources_said = ", ".join(f"{n} from {src}" for src, n in sorted(best_from.items()))
            report.append(
                f"{key}/{space}: best record of {sum(best_from.values())} "
                f"workload(s): {sources_said}"
            )
        manifest = _merge_manifests(trees, key, best)
        (staging / "manifest.json").write_text(
            json.dumps(manifest, indent=2, sort_keys=True) + "\n"
        )
        decisions: dict = {}
        for tree in trees:
            decisions |= _read_json(tree / key / "decisions.json")
        if decisions:
            (staging / "decisions.json").write_text(
                json.dumps(decisions, indent=1, sort_keys=True) + "\n"
            )
        key_out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(key_out, ignore_errors=True)
        os.replace(staging, key_out)
    forget_databases()  # databases read from the replaced directories are stale now
    return report
