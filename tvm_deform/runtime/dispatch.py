"""Measured dispatch (build and dispatch layer): on a machine without tuning logs of its own,
which schedule a shape runs is decided by timing, here, the default schedule against the best
record of each compatible machine's logs.

Another machine's choice between its tuned records and its default schedule says little about
this one (on a Zen 1, the record a Zen 4 had rejected ran 1.7x faster than the default it had
kept). So at a shape's first use the candidates are compiled (through the kernel cache) and run
through the op's own calling path on random inputs of the shape, in interleaved rounds, and
the median decides. The decision is written to ``<kernel cache>/decisions/<hardware key>.json``
so that later processes take it without timing; it names the candidates it chose among, the
package and TVM versions and the schedule sources, and a change to any of them times again.

The timing is short: each candidate runs about ``BUDGET_SECONDS / candidates`` (at least
``MIN_RUNS`` runs), so the first call of a shape takes a second or two more than compiling.
``TVM_DEFORM_MEASURE=0`` turns it off (the default schedule runs); ``tvm-deform tune`` writes
logs of this machine's own, which then decide without timing.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import itertools
import json
import os
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from tvm.target import Target

from tvm_deform import __version__, env, schedules
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import diskcache, kernels, records, targets
from tvm_deform.runtime.inputs import random_inputs

#: total seconds of timing per shape and op, shared by the candidates
BUDGET_SECONDS = 1.0
#: the same at tuning time, where the decision is written into the logs (see decide_for_logs)
LOGS_BUDGET_SECONDS = 4.0
#: runs per candidate at least, whatever the budget
MIN_RUNS = 3

_lock = threading.Lock()


def decisions_path(target: Target) -> Path | None:
    """The file of this machine's decisions in the kernel cache; None without a usable cache."""
    folder = diskcache.subdirectory("decisions")
    if folder is None:
        return None
    return folder / (targets.hardware_key(target).replace("/", "_") + ".json")


def _digest(shape: ConvShape, target: Target, op: str, options: dict) -> str:
    text = "\n".join(
        [
            targets.workload_key(shape, target),
            op,
            __version__,
            kernels.tvm.__version__,
            kernels.source_digest(),
            *filter(None, [targets.compile_settings(target)]),
            *sorted(f"{name}={'' if r is None else r.identity}" for name, r in options.items()),
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def read_decisions(target: Target) -> dict:
    path = decisions_path(target)
    if path is None or not diskcache.trusted(path):
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_decision(target: Target, digest: str, entry: dict) -> None:
    path = decisions_path(target)
    if path is None:
        return
    try:
        decisions = read_decisions(target) | {digest: entry}
        handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump(decisions, file, indent=1, sort_keys=True)
        os.replace(temporary, path)
    except OSError:
        pass  # a decision that cannot be kept is timed again next time


def option_name(record: records.TunedRecord | None) -> str:
    return "default" if record is None else f"{record.hardware_key}/{record.space}"


def _options(candidates: list[records.TunedRecord]) -> dict[str, records.TunedRecord | None]:
    return {"default": None} | {option_name(r): r for r in candidates}


def stored_decision(
    shape: ConvShape, target: Target, op: str, candidates: list[records.TunedRecord]
) -> dict | None:
    """The decision on disk among the default and ``candidates`` for ``shape``'s ``op``."""
    options = _options(candidates)
    if not env.cache_enabled():
        return None
    stored = read_decisions(target).get(_digest(shape, target, op, options))
    return stored if stored and stored.get("choice") in options else None


def pick(
    shape: ConvShape, target: Target, op: str, candidates: list[records.TunedRecord]
) -> records.TunedRecord | None:
    """The fastest here of the default schedule (None) and ``candidates`` for ``shape``'s
    ``op``: from the decision on disk, else timed now and written there."""
    options = _options(candidates)
    digest = _digest(shape, target, op, options)
    with _lock:
        stored = stored_decision(shape, target, op, candidates)
        if stored:
            return options[stored["choice"]]
        times = measure(shape, target, op, options)
        choice = min(times, key=times.__getitem__)
        if env.cache_enabled():
            entry = {
                "choice": choice,
                "median_ms": {name: round(ms, 4) for name, ms in times.items()},
                "op": op,
                "shape": targets.workload_key(shape, target),
                "date": datetime.date.today().isoformat(),
            }
            _write_decision(target, digest, entry)
    return options[choice]


def measure(
    shape: ConvShape,
    target: Target,
    op: str,
    options: dict[str, records.TunedRecord | None],
    budget: float = BUDGET_SECONDS,
) -> dict[str, float]:
    """Median milliseconds of each option's kernel(s) for ``shape``'s ``op`` on random inputs,
    called as the op calls them, in interleaved rounds for about ``budget`` seconds."""
    runs = {name: _runner(shape, target, op, record) for name, record in options.items()}
    return _median_ms(runs, budget)


def _median_ms(runs: dict[str, Callable[[], object]], budget: float) -> dict[str, float]:
    """Median milliseconds of each of ``runs`` (which return when their work is done), in
    interleaved rounds for about ``budget`` seconds, at least ``MIN_RUNS`` each."""
    for run in runs.values():
        run()  # warm up (and fault in the library's pages)
    times: dict[str, list[float]] = {name: [] for name in runs}
    deadline = time.perf_counter() + budget
    while min(len(t) for t in times.values()) < MIN_RUNS or time.perf_counter() < deadline:
        for name, run in runs.items():
            begin = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - begin)
        if min(len(t) for t in times.values()) >= 100:
            break
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def replay_wins(
    shape: ConvShape,
    target: Target,
    op: str,
    record: records.TunedRecord,
    replayed: object,
    default: object,
) -> bool:
    """Whether ``replayed`` (kernels for any size of ``shape``'s layer running ``record``'s
    trace, tuned at ``shape``) runs ``shape``'s ``op`` faster here than ``default`` (the
    default schedule's kernels of the same size class): from the decision on disk (or kept by
    :func:`replay_failed`), else timed now through the op's calling path (``BUDGET_SECONDS``)
    and written there. A trace tuned on one PrimFunc is not the same schedule on the PrimFunc
    for any size, whose stages and index arithmetic differ: on a Zen 4 the shipped CPU records
    ran 0.77-1.15x the default's time replayed, so one runs only where it wins here. A replayed
    kernel that fails when it runs loses (with a warning). ``TVM_DEFORM_MEASURE=0``: the
    default, untimed."""
    stored = stored_replay_decision(shape, target, op, record)
    if stored:
        return stored["choice"] == "replayed"
    if _replay_digest(shape, target, op, record) in _failed or not env.measure_enabled():
        return False
    with _lock:
        try:
            runs = {
                "replayed": _kernel_runner(shape, target, op, replayed),
                "default": _kernel_runner(shape, target, op, default),
            }
            times = _median_ms(runs, BUDGET_SECONDS)
        except Exception as error:  # noqa: BLE001 - a kernel that fails here runs nowhere
            warnings.warn(
                f"the tuned record ({record.space}) replayed for any size failed when run "
                f"({error}): default schedule",
                RuntimeWarning,
                stacklevel=2,
            )
            replay_failed(shape, target, op, record, f"failed when run: {error}")
            return False
        choice = min(times, key=times.__getitem__)
        median_ms = {name: round(ms, 4) for name, ms in times.items()}
        _keep_replay_decision(shape, target, op, record, choice, median_ms=median_ms)
    return choice == "replayed"


def replay_failed(
    shape: ConvShape, target: Target, op: str, record: records.TunedRecord, reason: str
) -> None:
    """Keep that ``record`` (tuned at ``shape``), replayed on ``shape``'s ``op`` for any size,
    does not run here (``reason``: it does not replay, build or run): :func:`replay_wins` then
    answers the default, untimed (its kernels for any size under the record's name are the
    default's)."""
    _failed.add(_replay_digest(shape, target, op, record))
    _keep_replay_decision(shape, target, op, record, "default", reason=reason)


#: the replays that did not run in this process (see :func:`replay_failed`)
_failed: set[str] = set()


def _replay_digest(shape: ConvShape, target: Target, op: str, record: records.TunedRecord) -> str:
    return _digest(shape, target, f"{op}_any_size", {"default": None, "replayed": record})


def _keep_replay_decision(
    shape: ConvShape,
    target: Target,
    op: str,
    record: records.TunedRecord,
    choice: str,
    **why: object,
) -> None:
    if env.cache_enabled():
        entry = {
            "choice": choice,
            **why,
            "op": f"{op} for any size, {record.space} replayed",
            "shape": targets.workload_key(shape, target),
            "date": datetime.date.today().isoformat(),
        }
        _write_decision(target, _replay_digest(shape, target, op, record), entry)


def stored_replay_decision(
    shape: ConvShape, target: Target, op: str, record: records.TunedRecord
) -> dict | None:
    """The decision on disk of :func:`replay_wins` for ``record`` tuned at ``shape``."""
    if not env.cache_enabled():
        return None
    stored = read_decisions(target).get(_replay_digest(shape, target, op, record))
    return stored if stored and stored.get("choice") in ("default", "replayed") else None


def _kernel_runner(
    shape: ConvShape, target: Target, op: str, kernel: object
) -> Callable[[], object]:
    """A call of ``shape``'s ``op`` through ``kernel`` (a forward kernel, or backward
    kernels) on random inputs on ``target``'s device, returning when it is done."""
    from tvm_deform.runtime import calls  # imports kernels, which imports this module

    cuda = target.kind.name == "cuda"
    device = "cuda" if cuda else "cpu"
    args = {k: v.to(device) if v is not None else None for k, v in random_inputs(shape).items()}
    x, offset, weight, bias, mask = (args[k] for k in ("input", "offset", "weight", "bias", "mask"))
    done = torch.cuda.synchronize if cuda else (lambda: None)
    if op == "forward":
        return lambda: (calls.run_forward(shape, x, offset, weight, bias, mask, kernel), done())
    grad_output = torch.randn(
        shape.batch, shape.out_channels, shape.out_h, shape.out_w, dtype=x.dtype, device=device
    )
    return lambda: (
        calls.run_backward(shape, grad_output, x, offset, weight, mask, kernel),
        done(),
    )


def _runner(
    shape: ConvShape, target: Target, op: str, record: records.TunedRecord | None
) -> Callable[[], object]:
    from tvm_deform.runtime import calls  # imports kernels, which imports this module

    args = random_inputs(shape)
    x, offset, weight, bias, mask = (args[k] for k in ("input", "offset", "weight", "bias", "mask"))
    if op == "forward":
        kernel = kernels.load_kernel(shape, target, record)
        return lambda: calls.run_forward(shape, x, offset, weight, bias, mask, kernel)
    backward_kernels = kernels.load_backward(shape, target, record)
    grad_output = torch.randn(
        shape.batch, shape.out_channels, shape.out_h, shape.out_w, dtype=x.dtype
    )
    return lambda: calls.run_backward(shape, grad_output, x, offset, weight, mask, backward_kernels)


def _logs_key(shape: ConvShape, op: str, options: dict[str, records.TunedRecord | None]) -> str:
    """Names a decision in a log directory: the shape, the op and the records chosen among (not
    the target or versions: the logs are for one hardware key, and records that still match
    the definition are still the same schedules)."""
    text = "\n".join(
        [
            json.dumps(dataclasses.asdict(shape), sort_keys=True),
            op,
            *sorted(f"{name}={'' if r is None else r.identity}" for name, r in options.items()),
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def own_options(own: list[records.TunedRecord]) -> dict[str, records.TunedRecord | None]:
    """The default schedule and the best record of each design space of one key's logs."""
    return {"default": None} | {r.space: r for r in own if r.space != records.DEFAULT_SPACE}


def choose_own(
    shape: ConvShape, op: str, own: list[records.TunedRecord]
) -> records.TunedRecord | None:
    """The schedule this machine's own logs choose for ``shape``'s ``op``: the decision written
    at tuning time by timing through the op (:func:`decide_for_logs`) when the logs hold one,
    else the fastest by the tuner's own measurements (:func:`records.fastest`)."""
    decision = own_decision(shape, op, own)
    return own_options(own)[decision["choice"]] if decision else records.fastest(own)


def own_decision(shape: ConvShape, op: str, own: list[records.TunedRecord]) -> dict | None:
    """The decision that this machine's own logs (``own``) hold for ``shape``'s ``op``, if it was
    made among the records they hold now."""
    options = own_options(own)
    decision = records.logs_decisions(own[0].directory.parent).get(_logs_key(shape, op, options))
    return decision if decision and decision.get("choice") in options else None


def decide_for_logs(
    key_dir: Path,
    label: str,
    shape: ConvShape,
    target: Target,
    op: str,
    own: list[records.TunedRecord],
) -> dict:
    """Time the default and each design space's best record of the logs at ``key_dir`` through
    the op (MetaSchedule's runner has its own inputs and process, and its choice between close
    candidates was often wrong), and write the winner into ``key_dir/decisions.json``."""
    options = own_options(own)
    times = measure(shape, target, op, options, LOGS_BUDGET_SECONDS)
    entry = {
        "workload": label,
        "choice": min(times, key=times.__getitem__),
        "median_ms": {name: round(ms, 4) for name, ms in times.items()},
    }
    # An earlier decision for the same workload was among other records: it is stale.
    kept = {k: e for k, e in records.logs_decisions(key_dir).items() if e.get("workload") != label}
    decisions = kept | {_logs_key(shape, op, options): entry}
    (key_dir / records.LOGS_DECISIONS).write_text(
        json.dumps(decisions, indent=1, sort_keys=True) + "\n"
    )
    return entry


def _replay_said(shape: ConvShape, target: Target, op: str, record: records.TunedRecord) -> str:
    """What :func:`replay_wins` decided for ``record`` tuned at ``shape``, in words."""
    stored = stored_replay_decision(shape, target, op, record)
    if not stored:
        return f"{record.space} replayed or the default, timed against each other at first use"
    if "reason" in stored:
        return f"default schedule ({record.space} replayed {stored['reason']})"
    times = ", ".join(f"{n} {ms:.3f} ms" for n, ms in stored["median_ms"].items())
    what = "default schedule" if stored["choice"] == "default" else f"{record.space} replayed"
    return f"{what}: timed here at its tuned size ({times})"


def describe(shape: ConvShape, target: Target, op: str = "forward") -> str:
    """What ``shape``'s ``op`` runs on ``target`` and why, in words, without timing anything
    (for ``tvm-deform info``)."""
    if kernels.any_size(shape, target, env.tuned_enabled(), op=op):
        tuned = env.tuned_enabled() and records.tuned_shapes(target, op)
        if tuned and op == "forward":
            bounds = (*schedules.pixel_classes(shape, target), None)
            found = kernels.class_records(shape, target)
            replays = [
                (f"maps of {low}-{high - 1} pixels" if high else f"maps of {low}+ pixels",
                 *found[low])
                for low, high in itertools.pairwise(bounds)
                if low in found
            ]  # fmt: skip
        elif tuned:
            size, record = kernels.backward_record(shape, target)
            replays = [("every size", size, record)] if record else []
        else:
            replays = []
        if not replays:
            return "default schedule, one kernel for every size of the layer"
        said = [
            f"{where}: {_replay_said(size, target, op, record)}" for where, size, record in replays
        ]
        return "one kernel for every size of the layer; " + "; ".join(said)
    if not env.tuned_enabled():
        return "default schedule (TVM_DEFORM_TUNED=0)"
    key = targets.hardware_key(target)
    own = records.own_records(shape, target, key, op)
    if own:
        decision = own_decision(shape, op, own)
        if decision:
            times = ", ".join(f"{n} {ms:.3f} ms" for n, ms in decision["median_ms"].items())
            what = "default schedule" if decision["choice"] == "default" else decision["choice"]
            return f"{what}: timed through the op when tuned here ({times})"
        best = records.fastest(own)
        times = ", ".join(f"{r.space} {r.run_ms:.3f} ms" for r in own if r.run_ms)
        if best is None:
            return f"default schedule: faster than the records when tuned here ({times})"
        return f"tuned here: {best.hardware_key} / {best.space} ({times})"
    candidates = records.foreign_records(shape, target, key, op)
    if not candidates:
        return "default schedule (no record for this shape)"
    names = ", ".join(option_name(r) for r in candidates)
    stored = stored_decision(shape, target, op, candidates)
    if stored:
        times = ", ".join(f"{n} {ms:.3f} ms" for n, ms in stored["median_ms"].items())
        choice = "default schedule" if stored["choice"] == "default" else stored["choice"]
        return f"{choice}: timed here against the others ({times})"
    if not env.measure_enabled():
        return f"default schedule (TVM_DEFORM_MEASURE=0: {names} not timed here)"
    return f"not decided yet: default vs {names}, timed here at first use"
