"""MetaSchedule tuning (tools layer): the workload suite, tuning runs and the pruned logs.

Layout of a tuning directory (the work directory, or the shipped ``tuning_logs``)::

    <root>/<hardware key>/<space>/database_workload.json
    <root>/<hardware key>/<space>/database_tuning_record.json
    <root>/<hardware key>/manifest.json

In the pruned logs the workload file is gzipped (``database_workload.json.gz``, see
:func:`tvm_deform.runtime.records.open_database`); the work directory keeps MetaSchedule's own
files.

One database per hardware key and per design space: MetaSchedule's database ignores the target
when it answers a query, so databases of different machines are never merged, and keeping the
spaces apart lets the dispatcher and ``tvm-deform info`` say which space a record came from.

A tuning run resumes from the work directory's database (the evolutionary search starts from its
best records) and adds ``trials`` more; each task runs in a child process that is retried once if
it crashes (MetaSchedule has been seen to segfault while setting up), records already written
survive.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import json
import logging
import multiprocessing
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterable
from pathlib import Path

import tvm
import tvm_ffi
from tvm import s_tir
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder.local_builder import default_export
from tvm.target import Target

from tvm_deform import __version__
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels, targets
from tvm_deform.runtime.records import (
    DEFAULT_SPACE,
    MIN_TUNED_GAIN,
    OPS,
    best_in,
    candidate_keys,
    find_records,
    forget_databases,
    is_database,
    log_roots,
    open_database,
    pack_database,
    read_workloads,
    record_ms,
    workload_module,
)
from tvm_deform.schedules import design_spaces
from tvm_deform.schedules.common import tensor_intrinsics, vector_bytes
from tvm_deform.tools.fleet import Fleet

#: design spaces: name -> how MetaSchedule generates it
SPACES = ("handwritten", "generic")


def spaces_for(op: str) -> tuple[str, ...]:
    """The design spaces ``op`` is tuned in, on every target kind. MetaSchedule's generic space
    is not offered for the backward kernel, whose nine stages (two GEMMs, gathers and an
    rfactor-ed reduction) its rules do not schedule sensibly."""
    return SPACES if op == "forward" else ("handwritten",)


class RuleSpaces:
    """The "handwritten" design spaces of ``op`` on ``target``: those of every schedule rule
    that takes the workload (:func:`tvm_deform.schedules.design_spaces`). Use as
    ``ms.space_generator.ScheduleFn(RuleSpaces(op, target))``."""

    def __init__(self, op: str, target: Target):
        self.op = op
        self.target = target

    def __call__(self, sch: s_tir.Schedule) -> list[s_tir.Schedule]:
        return design_spaces(self.op, sch.mod["main"], self.target)


#: records kept per workload and space when the logs are pruned
KEEP_PER_WORKLOAD = 3
#: what the runtime does with a key's records, written into its manifest (the records are of
#: static shapes; see :func:`tvm_deform.runtime.kernels.any_size`)
SIZES_NOTE = (
    "static kernels for exactly the tuned shapes: on a machine of this hardware key, a call of "
    f"a shape these logs hold, whose chosen record ran at least {MIN_TUNED_GAIN:.0%} faster "
    "than the default schedule when tuned, runs a kernel compiled for that size with that "
    "record; every other shape runs the default schedule's kernel for any size. Machines of "
    "other keys use these records only where they compile a kernel per size "
    "(TVM_DEFORM_SIZES=static, or a call past 2^31 elements), timing them against the default "
    "at a shape's first use."
)


def database(directory: Path) -> ms.database.JSONDatabase:
    directory.mkdir(parents=True, exist_ok=True)
    return ms.database.JSONDatabase(work_dir=str(directory), allow_missing=True)


def _space_generator(space: str, op: str = "forward", target: Target | None = None):
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    if space == "handwritten":
        return ms.space_generator.ScheduleFn(RuleSpaces(op, target or targets.host_target()))
    if space == "generic":
        return "post-order-apply"
    raise ValueError(f"unknown design space {space!r}; expected one of {SPACES}")


def build_candidate(mod: tvm.IRModule, target: Target, _params: dict | None) -> tvm.runtime.Module:
    """MetaSchedule's default build, less its import of every TensorIR intrinsic library
    (``tvm.s_tir.tensor_intrin``: over 30 s in a process that has not imported it). A candidate
    arrives scheduled, tensorized or not, so lowering it needs none of them. It is compiled as
    the op compiles its kernels (:func:`~tvm_deform.runtime.targets.compiling`)."""
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    with targets.compiling(target) as target:
        return tvm.tirx.build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target)


#: the name of :class:`CandidateBuilder`'s threads
BUILDER_THREAD = "candidate-builder"


@derived_object
class CandidateBuilder(ms.builder.PyBuilder):
    """Builds a batch of MetaSchedule's candidates on threads of this process, as many at once
    as it has cores (calls into TVM's compiler release the GIL), each with
    :func:`build_candidate`, exported as TVM's default builder exports them. TVM's own
    LocalBuilder starts a new pool of worker processes for every batch, each importing TVM,
    torch and this package first: about 6 s a batch on a 2-core AMD Zen 4, more than building a
    batch of small kernels takes.

    A build that takes longer than ``timeout`` seconds (as TVM's builder allows, 5 minutes) is
    reported as that candidate's error; its thread is left to finish on its own (a thread
    cannot be stopped), another takes its place, and the task's process leaves without waiting
    for it. Targets that set LLVM's command-line options (``cl-opt``, the process's) build one
    at a time. The tuning runs each task in a process of its own: a build that crashes ends its
    task, not the tuning."""

    def __init__(self, workers: int | None = None, timeout: float = 300.0) -> None:
        self.workers = workers or os.cpu_count() or 1
        self.timeout = timeout

    def build(self, build_inputs: list[ms.builder.BuilderInput]) -> list[ms.builder.BuilderResult]:
        results: list[ms.builder.BuilderResult | None] = [None] * len(build_inputs)
        started: dict[int, float] = {}
        building: dict[threading.Thread, int] = {}  # each thread's candidate
        given_up: set[int] = set()
        todo = iter(range(len(build_inputs)))
        changed = threading.Condition()

        def work() -> None:
            while True:
                with changed:
                    index = next(todo, None)
                    if index is None:
                        return
                    started[index] = time.monotonic()
                    building[threading.current_thread()] = index
                result = _build_and_export(build_inputs[index])
                with changed:
                    if results[index] is not None:  # given up on: another thread took its place
                        return
                    results[index] = result
                    changed.notify_all()

        def add_worker() -> None:
            # A daemon thread: one still building when the process exits does not hold it up.
            thread = threading.Thread(target=work, name=BUILDER_THREAD, daemon=True)
            thread.start()
            threads.append(thread)

        threads: list[threading.Thread] = []

        workers = self.workers
        if any(_llvm_options(item.target) for item in build_inputs):
            workers = 1  # LLVM's command-line options are the process's: one build at a time
        for _ in range(min(workers, len(build_inputs))):
            add_worker()
        with changed:
            while any(result is None for result in results):
                now = time.monotonic()
                running = {i: t for i, t in started.items() if results[i] is None}
                for index, since in running.items():
                    if now - since > self.timeout:
                        message = f"TimeoutError: the build took over {self.timeout:g} s"
                        results[index] = ms.builder.BuilderResult(None, message)
                        given_up.add(index)
                        add_worker()
                waits = [since + self.timeout - now for since in running.values()]
                changed.wait(max(0.01, min(waits, default=self.timeout)))
            left = [t for t in threads if building.get(t) not in given_up]
        for thread in left:  # each has nothing left to build
            thread.join()
        return results


def _llvm_options(target: Target) -> bool:
    """Whether ``target`` or its host gives LLVM command-line options (``cl-opt``)."""
    return any(t is not None and t.attrs.get("cl-opt") for t in (target, target.host))


def _build_and_export(item: ms.builder.BuilderInput) -> ms.builder.BuilderResult:
    """One candidate built with :func:`build_candidate` and exported, or the error that stopped
    it."""
    try:
        if item.params:
            raise ValueError("a candidate with parameters")
        module = build_candidate(item.mod, item.target, None)
        return ms.builder.BuilderResult(default_export(module), None)
    except BaseException as error:  # noqa: BLE001 - reported as the candidate's build error
        return ms.builder.BuilderResult(None, f"{type(error).__name__}: {error}")


def local_builder() -> ms.builder.Builder:
    """Builds candidates here, one thread per core."""
    return CandidateBuilder()


def runner_for(fleet: Fleet | None) -> ms.runner.Runner:
    """Measures candidates on this machine, or on every server of ``fleet`` at once."""
    return ms.runner.LocalRunner(timeout_sec=120) if fleet is None else fleet.runner()


def label(name: str, op: str) -> str:
    """How a (workload, op) task is named in progress lines and the manifest."""
    return name if op == "forward" else f"{name}:{op}"


@dataclasses.dataclass(frozen=True)
class TaskResult:
    workload: str
    space: str
    trials: int
    best_ms: float | None
    gflops: float | None


def _tune_task(
    name: str,
    shape: ConvShape,
    space: str,
    target_json: str,
    trials: int,
    directory: str,
    op: str = "forward",
    fleet: Fleet | None = None,
) -> None:
    """One (workload, op, space) tuning run; runs in a child process."""
    target = Target(json.loads(target_json))
    mod = workload_module(shape, op)
    db = database(Path(directory))
    tensor_intrinsics()  # tune_tir imports them too: here the fast way first
    per_iter = min(16, trials)
    ms.tune_tir(
        mod,
        target,
        work_dir=str(Path(directory) / "runs" / label(name, op)),
        max_trials_global=trials,
        num_trials_per_iter=per_iter,
        builder=local_builder(),
        runner=runner_for(fleet),
        database=db,
        space=_space_generator(space, op, target),
        # The hand-written space has few points: a small population suffices.
        strategy=ms.search_strategy.EvolutionarySearch(
            population_size=128 if space == "handwritten" else 256,
            init_min_unmeasured=16,
            genetic_num_iters=2,
        ),
        num_tuning_cores=os.cpu_count() or 1,
    )


def _measure_task(
    items: list[tuple[ConvShape, str, str, str | None]],
    target_json: str,
    fleet: Fleet | None = None,
    times_path: str | None = None,
) -> None:
    """Measure each ``(shape, op, directory, source)`` with the builder and runner the tuning
    uses (one batch, so the builder's set-up is paid once) and commit the time to the database
    at ``directory``. ``source`` is another machine's database directory, whose best record of
    the kernel is measured, or None for the kernel's default schedule. Runs in a child process.
    A schedule whose build or run fails is reported and skipped. With ``times_path``, the
    measured milliseconds of each item (None where it failed) are written there as JSON."""
    target = Target(json.loads(target_json))
    schedules = []
    for shape, op, _, source in items:
        if source is None:
            schedules.append(kernels.default_schedule(shape, target, op))
            continue
        mod = workload_module(shape, op)
        sch = tvm.s_tir.Schedule(mod)
        best_in(Path(source), mod).trace.apply_to_schedule(sch, remove_postproc=False)
        schedules.append(sch)
    built = local_builder().build([ms.builder.BuilderInput(sch.mod, target) for sch in schedules])
    infos = [ms.arg_info.ArgInfo.from_prim_func(sch.mod["main"]) for sch in schedules]
    runner = runner_for(fleet)
    device = "cpu" if target.kind.name == "llvm" else target.kind.name
    inputs, measured = [], []
    for index, result in enumerate(built):
        if result.error_msg:
            print(f"building a schedule failed: {result.error_msg}", flush=True)
            continue
        inputs.append(ms.runner.RunnerInput(result.artifact_path, device, infos[index]))
        measured.append(index)
    times: list[float | None] = [None] * len(items)
    for index, future in zip(measured, runner.run(inputs), strict=True):
        result = future.result()
        if result.error_msg:
            print(f"running a schedule failed: {result.error_msg}", flush=True)
            continue
        secs = [float(s) for s in result.run_secs]
        times[index] = sum(secs) / len(secs) * 1e3
        shape, op, directory, _ = items[index]
        db = database(Path(directory))
        workload = db.commit_workload(workload_module(shape, op))
        db.commit_tuning_record(
            ms.database.TuningRecord(
                schedules[index].trace, workload, result.run_secs, target, infos[index]
            )
        )
    if times_path is not None:
        Path(times_path).write_text(json.dumps(times))


def records(
    directory: Path, shape: ConvShape, op: str = "forward"
) -> list[ms.database.TuningRecord]:
    """Every valid record of ``shape``'s ``op`` in the database at ``directory``, fastest
    first (read afresh: the files change while tuning)."""
    if not is_database(directory):
        return []
    db = open_database(directory)
    mod = workload_module(shape, op)
    if not db.has_workload(mod):
        return []
    return list(db.get_top_k(db.commit_workload(mod), 1_000_000))


def trial_history(directory: Path, shape: ConvShape, op: str = "forward") -> list[float]:
    """The measured time (ms) of every record of ``shape``'s ``op`` in the database at
    ``directory``, in the order they were measured (a failed candidate is ``inf``). A database
    seeded by a transfer tune starts with the other machines' records."""
    text = read_workloads(directory)
    if text is None:
        return []
    mod = workload_module(shape, op)
    index = None
    for number, line in enumerate(text.splitlines()):
        workload = ms.database.Workload.from_json(json.loads(line))
        if tvm_ffi.structural_equal(workload.mod, mod):
            index = number
            break
    if index is None:
        return []
    history = []
    for line in (directory / "database_tuning_record.json").read_text().splitlines():
        workload_index, record = json.loads(line)
        if workload_index == index:
            secs = [float(s) for s in record[1] or []]
            history.append(sum(secs) / len(secs) * 1e3 if secs else float("inf"))
    return history


def convergence_table(
    work_dir: str | os.PathLike,
    workloads: dict[str, ConvShape],
    target: Target,
    space: str = "handwritten",
    op: str = "forward",
) -> str:
    """Per workload, the best time found after 1, 2, 4, ... trials (the first being a transfer
    tune's seed, when it had one), and after how many trials the best came within 2% of the
    final one: where more tuning stopped paying."""
    directory = Path(work_dir) / targets.hardware_key(target) / space
    default_dir = Path(work_dir) / targets.hardware_key(target) / DEFAULT_SPACE
    histories = {name: trial_history(directory, shape, op) for name, shape in workloads.items()}
    longest = max((len(h) for h in histories.values()), default=0)
    marks = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n <= longest]
    if longest not in marks:
        marks.append(longest)
    lines = [
        "| workload | default ms | "
        + " | ".join(f"best after {n}" for n in marks)
        + " | within 2% of the best after |",
        "|---|---:|" + "---:|" * len(marks) + "---:|",
    ]
    for name, history in histories.items():
        if not history:
            continue
        best = [min(history[: i + 1]) for i in range(len(history))]
        defaults = [r for r in records(default_dir, workloads[name], op)]
        default = f"{record_ms(defaults[0]):.3f}" if defaults else "-"
        cells = [f"{best[min(n, len(best)) - 1]:.3f}" for n in marks]
        settled = next(i + 1 for i, b in enumerate(best) if b <= best[-1] * 1.02)
        lines.append(f"| {name} | {default} | " + " | ".join(cells) + f" | {settled} |")
    return "\n".join(lines) + "\n"


def count_records(directory: Path, shape: ConvShape, op: str = "forward") -> int:
    return len(records(directory, shape, op))


def tune(
    workloads: dict[str, ConvShape],
    trials: int,
    work_dir: str | os.PathLike,
    spaces: Iterable[str] = ("handwritten",),
    target: Target | None = None,
    logs_dir: str | os.PathLike | None = None,
    progress=print,
    ops: Iterable[str] = ("forward",),
    measure_default: bool = True,
    transfer: bool = True,
    fleet: Fleet | None = None,
    time_limit: float | None = None,
) -> list[TaskResult]:
    """Tune every workload's ``ops`` kernels in every space for ``trials`` more trials,
    resuming from ``work_dir`` (``trials=0`` tunes nothing); then, if ``logs_dir`` is given,
    write the pruned logs there.

    With ``time_limit`` (seconds), the measuring and the search stop when it has passed: the
    task running then is stopped with every process it started, the tasks after it are
    skipped, and the records committed so far are kept (and written to ``logs_dir``).

    Before the search, one batch measures on this machine, with the tuning's own builder and
    runner: with ``measure_default``, each kernel's default schedule (into the ``default``
    database, so that dispatch uses a tuned record only where it beat the default; not again
    where the work directory holds a time of the same default schedule); with
    ``transfer``, where the work directory has no record of a kernel in a space yet, the best
    record of that space in the logs of this hardware key and of each compatible one (other
    machines'), into that space's database. The search then starts from them, and its result
    is never slower than what the logs held, as measured here.

    With ``fleet``, candidates are built here and measured on the fleet's servers, all at once;
    the logs go under the hardware key of ``target``, else of the target a device reports.
    Choosing between tuned records and the default by timing through the op is then left to
    dispatch on the device (it needs torch there)."""
    cpu = None
    if fleet is not None:
        detected, cpu = fleet.device()
        target = target or detected
        progress(f"measuring on {fleet.servers()} server(s) of {fleet}: {cpu}")
    target = target or targets.host_target()
    key = targets.hardware_key(target)
    results = []
    context = multiprocessing.get_context("spawn")
    ops = list(ops)
    tasks = [(name, op) for name in workloads for op in ops]
    spaces = list(spaces)
    for space in spaces:
        for op in ops:
            _space_generator(space, op, target)  # reject an unknown space or op before any work
    started = time.monotonic()
    deadline = None if time_limit is None else started + time_limit
    batch = _first_measurements(
        workloads, tasks, spaces, target, Path(work_dir), measure_default, transfer
    )
    if batch:
        progress(f"measuring {len(batch)} schedule(s) here first (default, other machines' best)")
        items = [item[1:] for item in batch]
        with tempfile.TemporaryDirectory() as scratch:
            times_path = Path(scratch) / "times.json"
            _run_in_child(
                context,
                _measure_task,
                (items, str(target), fleet, str(times_path)),
                "measuring",
                progress,
                deadline,
                [item[2] for item in items],
            )
            times = json.loads(times_path.read_text()) if times_path.exists() else []
        for index, (name, _, op, directory, source) in enumerate(batch):
            what = "default schedule" if source is None else f"from {source}"
            time_ms = times[index] if index < len(times) else None
            time_here = "no measurement" if time_ms is None else f"{time_ms:.3f} ms"
            progress(f"[{label(name, op)} / {Path(directory).name}] {what}: {time_here} here")
    runs = [
        (name, op, space)
        for name, op in tasks
        for space in spaces
        if space in spaces_for(op) and trials > 0
    ]
    tuning_started = time.monotonic()
    for done, (name, op, space) in enumerate(runs):
        shape = workloads[name]
        task = label(name, op)
        directory = Path(work_dir) / key / space
        if deadline is not None and time.monotonic() >= deadline:
            progress(f"[{task} / {space}] skipped: the time limit has passed")
            continue
        before = count_records(directory, shape, op)
        progress(
            f"[{task} / {space}] tuning {trials} trials ({before} already done); "
            + _clock(started, tuning_started, done, len(runs))
        )
        _run_in_child(
            context,
            _tune_task,
            (name, shape, space, str(target), trials, str(directory), op, fleet),
            f"[{task} / {space}] tuning",
            progress,
            deadline,
            [directory],
        )
        found = records(directory, shape, op)
        best_ms = record_ms(found[0]) if found else None
        result = TaskResult(
            task,
            space,
            len(found),
            best_ms,
            # The backward kernel does two GEMMs of the forward's size.
            None
            if best_ms is None
            else shape.gemm_flops * (2 if op == "backward" else 1) / best_ms / 1e6,
        )
        results.append(result)
        best = (
            "no valid record"
            if best_ms is None
            else (f"best {result.best_ms:.3f} ms, {result.gflops:.0f} GFLOP/s")
        )
        progress(f"[{task} / {space}] {result.trials} trials in the database, {best}")
    progress(f"done in {_minutes(time.monotonic() - started)}")
    if logs_dir is not None:
        kept = [*spaces, DEFAULT_SPACE] if measure_default else spaces
        write_pruned_logs(work_dir, logs_dir, workloads, kept, target, ops, cpu)
        if fleet is None and key == targets.hardware_key(targets.host_target()):
            decide_through_the_op(workloads, tasks, target, Path(logs_dir), progress)
    return results


def decide_through_the_op(
    workloads: dict[str, ConvShape],
    tasks: list[tuple[str, str]],
    target: Target,
    logs_dir: Path,
    progress,
) -> None:
    """For each kernel, time the default and the best record of each space of the pruned logs
    through the op, and write the winner beside them (see ``dispatch.decide_for_logs``)."""
    from tvm_deform.runtime import dispatch

    key = targets.hardware_key(target)
    for name, op in tasks:
        shape = workloads[name]
        own = [
            r
            for r in find_records(shape, target, key, roots=[logs_dir], op=op)
            if r.hardware_key == key
        ]
        if not any(r.space != DEFAULT_SPACE for r in own):
            continue
        entry = dispatch.decide_for_logs(logs_dir / key, label(name, op), shape, target, op, own)
        times = ", ".join(f"{n} {ms:.3f} ms" for n, ms in entry["median_ms"].items())
        progress(f"[{label(name, op)}] through the op: {entry['choice']} ({times})")


def _first_measurements(
    workloads: dict[str, ConvShape],
    tasks: list[tuple[str, str]],
    spaces: list[str],
    target: Target,
    work_dir: Path,
    measure_default: bool,
    transfer: bool,
) -> list[tuple[str, ConvShape, str, str, str | None]]:
    """The ``(name, *item)`` of each item of :func:`_measure_task` a tuning run starts with
    (see :func:`tune`)."""
    key = targets.hardware_key(target)
    batch = []
    for name, op in tasks:
        shape = workloads[name]
        default_dir = work_dir / key / DEFAULT_SPACE
        if measure_default and not _default_measured(default_dir, shape, target, op):
            batch.append((name, shape, op, str(default_dir), None))
        if not transfer:
            continue
        mod = workload_module(shape, op)
        for space in (s for s in spaces if s in spaces_for(op)):
            if count_records(work_dir / key / space, shape, op):
                continue  # resuming: the search starts from this machine's own records
            for root in log_roots():
                # This machine's own logs too: a run without the work directory they came
                # from starts from them rather than from nothing.
                for other in candidate_keys(root, target, key):
                    source = root / other / space
                    if best_in(source, mod) is not None:
                        batch.append((name, shape, op, str(work_dir / key / space), str(source)))
    return batch


def _default_measured(directory: Path, shape: ConvShape, target: Target, op: str) -> bool:
    """Whether the database at ``directory`` holds a time of ``shape``'s ``op``'s default
    schedule as it is now (a resumed run measures it again only if it has changed)."""
    trace = str(kernels.default_schedule(shape, target, op).trace)
    return any(str(r.trace) == trace for r in records(directory, shape, op))


def _run_in_child(
    context,
    function,
    args: tuple,
    what: str,
    progress,
    deadline: float | None = None,
    databases: Iterable[Path] = (),
) -> bool:
    """Run ``function(*args)`` in a child process, retried once if it crashes (MetaSchedule has
    been seen to segfault while setting up; records already written survive). At ``deadline``
    (a ``time.monotonic()`` value) the child is killed with every process it started (the
    runner's workers), a partial line it was writing to one of ``databases`` is cut off, and
    False is returned."""
    for attempt in range(2):
        process = context.Process(target=_in_own_process_group, args=(function, args))
        process.start()
        try:
            process.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except BaseException:
            # Ctrl-C reaches this process only (the child has a group of its own): take the
            # child's group down with it.
            _stop(process, databases)
            raise
        if process.exitcode is None:
            _stop(process, databases)
            progress(f"{what}: stopped at the time limit")
            return False
        if process.exitcode == 0:
            return True
        progress(
            f"{what}: process exited with {process.exitcode}; "
            + ("retrying" if attempt == 0 else "giving up on this task")
        )
    return True


def _stop(process, databases: Iterable[Path]) -> None:
    """Kill ``process`` (started by :func:`_run_in_child`) and every process of its group, then
    cut off a line it left half-written in ``databases``."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        # No group yet: the child has not reached setpgrp(), so it has started nothing.
        process.kill()
    process.join()
    for directory in databases:
        _drop_torn_lines(Path(directory))


def _in_own_process_group(function, args: tuple) -> None:
    """A child's entry point: ``function(*args)`` in a process group of its own, so that the
    parent can stop it together with the processes it starts."""
    os.setpgrp()
    try:
        function(*args)
    except BaseException:
        if not _builds_left_behind():
            raise
        traceback.print_exc()
        code = 1
    else:
        code = 0
    if _builds_left_behind():
        # A build given up on at its time limit still runs in TVM's compiler: tearing the
        # interpreter down under it aborts the process, which would read as a crash. Leave
        # without tearing down, every output flushed (databases are closed at each commit).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        ctypes.CDLL(None).fflush(None)
        os._exit(code)


def _builds_left_behind() -> bool:
    """Whether a thread of :class:`CandidateBuilder` is still building."""
    return any(t.name == BUILDER_THREAD and t.is_alive() for t in threading.enumerate())


def _drop_torn_lines(directory: Path) -> None:
    """Cut a database file of one JSON record per line back to its last whole line: a process
    killed while appending leaves a partial line, which would stop the database from loading."""
    if not directory.is_dir():
        return
    for path in directory.glob("*.json"):
        text = path.read_text()
        if text and not text.endswith("\n"):
            path.write_text(text[: text.rfind("\n") + 1])


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def _clock(started: float, tuning_started: float, done: int, total: int) -> str:
    """Elapsed time, and an estimate of the time left from the tuning tasks done so far."""
    now = time.monotonic()
    text = f"{_minutes(now - started)} elapsed"
    if done:
        left = (now - tuning_started) / done * (total - done)
        text += f", about {_minutes(left)} left"
    return text + f" (task {done + 1} of {total})"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_pruned_logs(
    work_dir: str | os.PathLike,
    logs_dir: str | os.PathLike,
    workloads: dict[str, ConvShape],
    spaces: Iterable[str],
    target: Target,
    ops: Iterable[str] = ("forward",),
    cpu: str | None = None,
) -> Path:
    """Copy the best ``KEEP_PER_WORKLOAD`` records per workload, op and space from
    ``work_dir`` into ``logs_dir/<hardware key>/<space>/`` and write the manifest. Records of
    other workloads or ops that are already in ``logs_dir`` are kept. ``cpu`` describes the
    machine that measured (default: this one's CPU model)."""
    ops = list(ops)
    key = targets.hardware_key(target)
    out_root = Path(logs_dir) / key
    manifest_path = out_root / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest.setdefault("workloads", {})
    for space in spaces:
        source = Path(work_dir) / key / space
        if not is_database(source):
            continue
        src_db = open_database(source)
        out_dir = out_root / space
        tmp_dir = out_root / f".{space}.tmp"
        shutil.rmtree(tmp_dir, ignore_errors=True)
        previous = open_database(out_dir) if is_database(out_dir) else None
        out_db = database(tmp_dir)
        kept_modules = []
        for (name, shape), op in ((item, op) for item in workloads.items() for op in ops):
            mod = workload_module(shape, op)
            kept_modules.append(mod)
            if not src_db.has_workload(mod):
                continue
            workload = out_db.commit_workload(mod)
            top = src_db.get_top_k(src_db.commit_workload(mod), KEEP_PER_WORKLOAD)
            for record in top:
                out_db.commit_tuning_record(
                    ms.database.TuningRecord(
                        record.trace, workload, record.run_secs, record.target, record.args_info
                    )
                )
            entry = manifest["workloads"].setdefault(label(name, op), {})
            best_ms = record_ms(top[0]) if top else None
            entry[space] = {
                "trials": count_records(source, shape, op),
                "best_ms": None if best_ms is None else round(best_ms, 4),
                "shape": dataclasses.asdict(shape),
            }
        if previous is not None:  # keep records of workloads outside this run
            for record in previous.get_all_tuning_records():
                if not any(tvm_ffi.structural_equal(record.workload.mod, m) for m in kept_modules):
                    out_db.commit_tuning_record(
                        ms.database.TuningRecord(
                            record.trace,
                            out_db.commit_workload(record.workload.mod),
                            record.run_secs,
                            record.target,
                            record.args_info,
                        )
                    )
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp_dir, out_dir)
        pack_database(out_dir)
    manifest.update(
        {
            "hardware_key": key,
            "target": str(target),
            "cpu": cpu or _cpu_model(),
            "vector_bits": vector_bytes(target) * 8,
            "isa": targets.target_isa(target),
            "tuning_threads": int(target.attrs.get("num-cores", os.cpu_count() or 1)),
            "tvm_version": tvm.__version__,
            "tvm_deform_version": __version__,
            "date": datetime.date.today().isoformat(),
            "kept_per_workload": KEEP_PER_WORKLOAD,
            "sizes": SIZES_NOTE,
        }
    )
    out_root.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    forget_databases()  # databases read from the replaced directories are stale now
    return out_root
