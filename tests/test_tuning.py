"""MetaSchedule tuning: smoke tune and resume, tuned dispatch, log fallbacks, shipped records."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torchvision.ops
import tvm
import tvm_ffi
from conftest import assert_close
from reference import deform_conv2d_reference
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from tvm_deform import deform_conv2d, schedules
from tvm_deform.ir import definition
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import calls, dispatch, kernels, records, targets
from tvm_deform.runtime.inputs import conv_kwargs, random_inputs
from tvm_deform.tools.merge import merge_logs
from tvm_deform.tools.suite import load_suite
from tvm_deform.tools.tuning import (
    KEEP_PER_WORKLOAD,
    SIZES_NOTE,
    convergence_table,
    count_records,
    local_builder,
    trial_history,
    tune,
)

TINY = ConvShape(1, 8, 10, 10, 8, 3, 3, pad_h=1, pad_w=1, has_bias=True)


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_lookups", "per_size_kernels")]


@pytest.fixture
def per_size_kernels(monkeypatch):
    """The kernels of one size, which the tuning records and the timing of other machines'
    records are about (the kernels for any size take no records)."""
    monkeypatch.setenv("TVM_DEFORM_SIZES", "static")


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A smoke tune of a tiny workload (a few trials), then a second run resuming from it."""
    root = tmp_path_factory.mktemp("tune")
    work, out = root / "work", root / "logs"
    first = tune({"tiny": TINY}, 3, work, logs_dir=out, progress=lambda *_: None)
    second = tune({"tiny": TINY}, 2, work, logs_dir=out, progress=lambda *_: None)
    return first[0], second[0], work, out


@pytest.fixture(scope="module")
def tuned_backward(tmp_path_factory):
    """A smoke tune of the tiny workload's backward kernel (a few trials)."""
    root = tmp_path_factory.mktemp("tune-backward")
    work, out = root / "work", root / "logs"
    (result,) = tune(
        {"tiny": TINY}, 3, work, logs_dir=out, progress=lambda *_: None, ops=("backward",)
    )
    return result, work, out


def check_gradients_against_torchvision(shape: ConvShape) -> None:
    inputs = random_inputs(shape)
    kwargs = conv_kwargs(shape)
    names = [
        name for name in ("input", "offset", "weight", "bias", "mask") if inputs[name] is not None
    ]
    grads = []
    for fn in (deform_conv2d, torchvision.ops.deform_conv2d):
        leaves = {name: inputs[name].clone().requires_grad_() for name in names}
        out = fn(**(inputs | leaves), **kwargs)
        grads.append(torch.autograd.grad(out, list(leaves.values()), torch.ones_like(out)))
    for name, ours, theirs in zip(names, *grads, strict=True):
        assert_close(ours, theirs, 2e-5, f"grad_{name}")


def check_against_reference(shape: ConvShape) -> None:
    inputs = random_inputs(shape)
    args = (inputs["input"], inputs["offset"], inputs["weight"], inputs["bias"])
    kwargs = conv_kwargs(shape) | dict(mask=inputs["mask"])
    assert_close(deform_conv2d(*args, **kwargs), deform_conv2d_reference(*args, **kwargs), 1e-6)


def test_candidates_build_on_threads_here_each_with_its_artifact_or_error(monkeypatch):
    """The tuning's builder builds a batch in this process, with no pool of worker processes
    (TVM's LocalBuilder starts one for every batch): each candidate gets its artifact, or the
    error its build raised, in the batch's order."""
    from tvm.s_tir.meta_schedule.builder import local_builder as tvm_local_builder
    from tvm.script import tirx as T

    from tvm_deform.tools.tuning import _builds_left_behind

    def no_pool(*args, **kwargs):
        raise AssertionError("a pool of worker processes was started")

    monkeypatch.setattr(tvm_local_builder, "PopenPoolExecutor", no_pool)

    @T.prim_func
    def thread_bound(a: T.Buffer((4,), "float32")):  # no GPU threads in an LLVM build
        for i in T.thread_binding(4, thread="threadIdx.x"):
            a[i] = T.float32(1)

    target = targets.host_target()
    good = kernels.default_schedule(TINY, target, "forward").mod
    batch = [good, tvm.IRModule({"main": thread_bound}), good]
    built = local_builder().build([ms.builder.BuilderInput(mod, target) for mod in batch])
    assert [r.error_msg is None for r in built] == [True, False, True]
    assert all(Path(r.artifact_path).is_file() for r in (built[0], built[2]))
    assert built[0].artifact_path != built[2].artifact_path
    assert built[1].artifact_path is None and built[1].error_msg.startswith("InternalError")
    assert not _builds_left_behind()  # the batch's threads have ended


def test_targets_with_llvm_options_build_one_at_a_time(monkeypatch):
    """LLVM's command-line options (a target's ``cl-opt``) belong to the process: candidates
    for such a target build one after another, others side by side."""
    from tvm_deform.tools import tuning

    threads = set()
    build_candidate = tuning.build_candidate

    def build(mod, target, params):
        threads.add(threading.get_ident())
        time.sleep(0.3)  # long enough for a second thread to take the next candidate
        return build_candidate(mod, target, params)

    monkeypatch.setattr(tuning, "build_candidate", build)
    mod = kernels.default_schedule(TINY, targets.host_target(), "forward").mod
    for options, expected in (([], 2), (["-unroll-threshold:int=100"], 1)):
        target = Target({**targets.host_target().export(), "cl-opt": options})
        threads.clear()
        built = tuning.CandidateBuilder(workers=2).build([ms.builder.BuilderInput(mod, target)] * 4)
        assert all(r.error_msg is None for r in built)
        assert len(threads) == expected, options


SLOW_BUILD = """
from tvm.s_tir import meta_schedule as ms
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels, targets
from tvm_deform.tools import tuning

shape = ConvShape(1, 8, 10, 10, 8, 3, 3, pad_h=1, pad_w=1, has_bias=True)
target = targets.host_target()
slow, good = (kernels.default_schedule(shape, target, "forward").mod for _ in range(2))
build = tuning.build_candidate


def build_slowly(mod, target, params):  # builds until the process ends
    while mod.same_as(slow):
        build(mod, target, params)
    return build(mod, target, params)


def a_batch():
    tuning.build_candidate = build_slowly
    batch = [ms.builder.BuilderInput(mod, target) for mod in (slow, good, good, good)]
    built = tuning.CandidateBuilder(workers=2, timeout=10).build(batch)
    print(([result.error_msg or "built" for result in built], tuning._builds_left_behind()))


tuning._in_own_process_group(a_batch, ())
"""


def test_a_build_past_the_time_limit_is_that_candidates_error_and_the_task_ends_cleanly():
    """A candidate whose build runs past the builder's time limit is reported as a timeout
    while the batch's other candidates build on; the task's process then exits normally,
    without waiting for that build (exiting under it would abort the process: a crash to
    the tuning, which would run the task again)."""
    import ast
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", SLOW_BUILD], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results, left_behind = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert results[0].startswith("TimeoutError") and results[1:] == ["built"] * 3, results
    assert left_behind  # the batch came back while the slow build ran on


def test_smoke_tune_runs_and_resumes(tuned):
    first, second, work, out = tuned
    assert first.trials >= 1 and first.best_ms is not None
    assert second.trials > first.trials  # the second run added to the same database
    key = targets.hardware_key(targets.host_target())
    manifest = json.loads((out / key / "manifest.json").read_text())
    assert manifest["tvm_version"] == tvm.__version__
    assert manifest["sizes"] == SIZES_NOTE  # what the records serve: their exact shapes
    assert manifest["workloads"]["tiny"]["handwritten"]["trials"] == second.trials
    pruned = count_records(out / key / "handwritten", TINY)
    assert 1 <= pruned <= 3
    assert count_records(work / key / "handwritten", TINY) == second.trials


def test_default_schedule_is_measured_and_wins_when_faster(tuned, tmp_path, monkeypatch):
    *_, out = tuned
    key = targets.hardware_key(targets.host_target())
    assert count_records(out / key / records.DEFAULT_SPACE, TINY) >= 1
    manifest = json.loads((out / key / "manifest.json").read_text())
    assert manifest["workloads"]["tiny"][records.DEFAULT_SPACE]["best_ms"] > 0
    # Give the default schedule a measurement faster than every tuned record: dispatch must
    # then use the default schedule.
    shutil.copytree(out, tmp_path / "logs")
    (tmp_path / "logs" / key / records.LOGS_DECISIONS).unlink()  # the tuner's rule alone
    default_dir = tmp_path / "logs" / key / records.DEFAULT_SPACE
    records.unpack_database(default_dir)  # edited in place below
    db = ms.database.JSONDatabase(work_dir=str(default_dir), allow_missing=False)
    (record,) = db.get_top_k(db.commit_workload(records.workload_module(TINY)), 1)
    db.commit_tuning_record(
        ms.database.TuningRecord(
            record.trace, record.workload, [1e-9], record.target, record.args_info
        )
    )
    monkeypatch.setenv("TVM_DEFORM_LOGS", str(tmp_path / "logs"))
    spaces = {r.space for r in records.find_records(TINY, targets.host_target(), key)}
    assert spaces == {"handwritten", records.DEFAULT_SPACE}
    assert kernels.resolve(TINY, targets.host_target()) is None
    check_against_reference(TINY)


def choose_the_tuned_record(
    out: Path, tmp_path: Path, monkeypatch, op: str = "forward"
) -> records.TunedRecord:
    """Logs in ``tmp_path`` copied from ``out`` whose decision through the op chose the tuned
    record of ``TINY``'s ``op`` (20% faster than the default), in use, with kernels for any
    size. The best record of the tuned space is made the first design space with other
    choices than the rules' own (:func:`schedules.other_choices`), so that the test does not
    depend on which of the smoke tune's few trials came out best."""
    target = targets.host_target()
    key = targets.hardware_key(target)
    shutil.copytree(out, tmp_path / "logs")
    handwritten = tmp_path / "logs" / key / "handwritten"
    records.unpack_database(handwritten)  # edited in place below
    db = ms.database.JSONDatabase(work_dir=str(handwritten), allow_missing=False)
    mod = records.workload_module(TINY, op)
    trace = schedules.other_choices(mod, schedules.design_spaces(op, mod["main"], target)[0])
    arguments = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
    db.commit_tuning_record(
        ms.database.TuningRecord(trace, db.commit_workload(mod), [1e-9], target, arguments)
    )
    own = records.find_records(TINY, target, key, roots=[tmp_path / "logs"], op=op)
    options = dispatch.own_options(own)
    workload = "tiny" if op == "forward" else f"tiny:{op}"
    decision = {"workload": workload, "choice": "handwritten",
                "median_ms": {"default": 1.0, "handwritten": 0.8}}  # fmt: skip
    (tmp_path / "logs" / key / records.LOGS_DECISIONS).write_text(
        json.dumps({dispatch._logs_key(TINY, op, options): decision})
    )
    monkeypatch.setenv("TVM_DEFORM_LOGS", str(tmp_path / "logs"))
    monkeypatch.delenv("TVM_DEFORM_SIZES", raising=False)  # kernels for any size
    records.forget_databases()
    chosen = kernels.resolve(TINY, target, op=op)
    assert chosen is not None and chosen.space == "handwritten"
    assert str(chosen.record.trace) == str(trace)
    assert TINY in records.tuned_shapes(target, op)
    return chosen


def chosen_values(sch: s_tir.Schedule) -> list[int]:
    """The values ``sch``'s sampled choices took, in order."""
    return [
        int(inst.attrs[0][int(sch.trace.decisions[inst])])
        for inst in sch.trace.insts
        if inst.kind.name == "SampleCategorical"
    ]


def test_a_tuned_size_gives_its_record_to_the_kernels_for_any_size_near_it(
    tuned, tmp_path, monkeypatch
):
    """Where this machine's own logs chose a tuned record for a size of a layer, the kernel for
    any size of that size's class replays the record: a call of another size runs it (not the
    default schedule) and computes the reference's numbers."""
    *_, out = tuned
    chosen = choose_the_tuned_record(out, tmp_path, monkeypatch)
    target = targets.host_target()
    layer = TINY.any_size()
    classes = schedules.pixel_classes(TINY, target)
    assert classes == (1,)  # one class: every size of the layer runs the record
    found = kernels.class_records(TINY, target)
    assert {c: (s, r.identity) for c, (s, r) in found.items()} == {1: (TINY, chosen.identity)}
    # Ahead of time (precompile's workers), both kernels compile, untimed; the record's is
    # derived, not its steps replayed.
    monkeypatch.setattr(dispatch, "replay_wins", lambda *args: pytest.fail("timed ahead"))
    replay = schedules.replay
    monkeypatch.setattr(schedules, "replay", lambda *args: pytest.fail("not derived"))
    kernels.compile_candidates(dataclasses.replace(TINY, height=9), target, "forward")
    assert kernels.cache_path(layer, target, chosen.identity, "forward_any_size_1").is_file()
    timed = []  # the replay runs where it wins timed against the default (tested below)
    monkeypatch.setattr(dispatch, "replay_wins", lambda *args: timed.append(args) or True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # replayed and built: no fallback to the default
        replayed = kernels._any_size_class(layer, target, "NCHW", 1, chosen)
    default = kernels._any_size_class(layer, target, "NCHW", 1)
    assert replayed is not default
    for size in ((2, 9, 13), (1, 1, 1), (3, 17, 5)):
        near = dataclasses.replace(TINY, batch=size[0], height=size[1], width=size[2])
        assert kernels.any_size(near, target, True)
        assert kernels.get_kernel(near, target) is replayed
        check_against_reference(near)
    assert [(a[0], a[2], a[3].identity) for a in timed] == [(TINY, "forward", chosen.identity)]
    assert dispatch.describe(near, target) == (
        "one kernel for every size of the layer; maps of 1+ pixels: handwritten replayed or "
        "the default, timed against each other at first use"
    )
    # TVM_DEFORM_TUNED=0: the default schedule
    assert kernels.get_kernel(dataclasses.replace(TINY, height=9), target, tuned=False) is default
    # The kernel is derived: the rule's schedule for any size, with the record's choices
    # where they hold for any size (the CPU's pixel tile is the size class's quantum).
    tuned_func = definition.forward(TINY)
    derived = schedules.replayed_any_size_schedule(TINY, target, 1, tuned_func, chosen.record.trace)
    func = schedules._any_size_definition(layer, target, "NCHW", 1)
    assert schedules.derive("forward", func, target, tuned_func, chosen.record.trace) is not None
    values = chosen_values(derived)
    tuned_values = chosen_values(records.tuned_schedule(TINY, chosen))
    assert values  # the questions after the pixel tile, with the record's answers
    assert values == tuned_values[-len(values) :]
    # the record's pixel tile (16), which the padding's quantum fixes for any size
    assert tuned_values[0] == 16 != schedules.any_size_quantum(TINY, target, 1)
    assert int(derived.mod["main"].attrs["pixel_quantum"]) == 16
    space = schedules.design_spaces("forward", func, target)[0]  # the record's, as generated
    assert chosen_values(space) != values  # not the rule's own choices
    # A trace that names blocks the forward does not have does not replay: None, not an error.
    monkeypatch.setattr(schedules, "replay", replay)
    backward = schedules.apply_default("backward", definition.backward(TINY), target)
    assert schedules.replayed_any_size_schedule(TINY, target, 1, tuned_func, backward.trace) is None


def test_a_tuned_backward_size_gives_its_record_to_the_backward_for_any_size(
    tuned_backward, tmp_path, monkeypatch
):
    """The backward's kernel of every gradient for any size of a layer replays the record the
    logs chose for a size of it: a training step of other sizes runs it and gives
    torchvision's gradients; a backward leaving gradients out runs its default schedule."""
    *_, out = tuned_backward
    chosen = choose_the_tuned_record(out, tmp_path, monkeypatch, "backward")
    target = targets.host_target()
    size, record = kernels.backward_record(TINY, target)
    assert (size, record.identity) == (TINY, chosen.identity)
    every, some = definition.ALL_GRADIENTS, definition.Gradients(False, True, True)
    layer = TINY.any_size()
    # Ahead of time (precompile's workers), both kernels compile, untimed; the record's is
    # derived, not its steps replayed.
    monkeypatch.setattr(dispatch, "replay_wins", lambda *args: pytest.fail("timed ahead"))
    monkeypatch.setattr(schedules, "replay", lambda *args: pytest.fail("not derived"))
    kernels.compile_candidates(dataclasses.replace(TINY, height=9), target, "backward")
    assert kernels.cache_path(layer, target, chosen.identity, "backward_any_size").is_file()
    monkeypatch.setattr(dispatch, "replay_wins", lambda *args: args[2] == "backward")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # replayed and built: no fallback to the default
        replayed = kernels._any_size_backward(layer, target, every, True)
    assert replayed is not kernels._any_size_backward(layer, target, every)
    # Derived: the rule's schedule for any size with the record's choices where they hold
    # there (the column gradient's and sampling's pixel tiles are the quantum's).
    quantum = schedules.backward_pixel_quantum(TINY, target)
    func = definition.backward(layer, every, "symbolic", quantum)
    tuned_func = definition.backward(TINY)
    derived = schedules.derive("backward", func, target, tuned_func, chosen.record.trace)
    values = chosen_values(records.tuned_schedule(TINY, chosen, "backward"))
    assert chosen_values(derived) == [values[0], values[-1]]
    for size in ((2, 9, 13), (1, 3, 4)):
        near = dataclasses.replace(TINY, batch=size[0], height=size[1], width=size[2])
        assert kernels.get_backward(near, target) is replayed
        assert kernels.get_backward(near, target, gradients=some) is kernels._any_size_backward(
            layer, target, some
        )
        check_gradients_against_torchvision(near)


@pytest.mark.parametrize("slower", ["replayed", "default", "failing"])
def test_a_replayed_record_runs_only_where_it_is_faster_here(tuned, tmp_path, monkeypatch, slower):
    """The replayed record's kernels for any size and the default's are timed at the tuned
    size through the op's calling path; the faster runs, and the decision is kept on disk for
    later processes. A replayed kernel that fails when it runs loses, with a warning.
    ``TVM_DEFORM_MEASURE=0``: the default, untimed."""
    *_, out = tuned
    chosen = choose_the_tuned_record(out, tmp_path, monkeypatch)
    monkeypatch.setenv("TVM_DEFORM_CACHE_DIR", str(tmp_path / "cache"))  # no decisions yet
    target = targets.host_target()
    kernel = kernels._any_size_class(TINY.any_size(), target, "NCHW", 1)

    def slowed(*args):
        time.sleep(0.005)  # the kernel itself takes microseconds
        return kernel(*args)

    def failing(*args):
        raise RuntimeError("CUDA: too many resources requested for launch")

    replayed, default = {
        "replayed": (slowed, kernel), "default": (kernel, slowed), "failing": (failing, kernel)
    }[slower]  # fmt: skip
    monkeypatch.setenv("TVM_DEFORM_MEASURE", "0")
    assert not dispatch.replay_wins(TINY, target, "forward", chosen, replayed, default)
    monkeypatch.delenv("TVM_DEFORM_MEASURE")
    if slower == "failing":
        with pytest.warns(RuntimeWarning, match="failed when run"):
            wins = dispatch.replay_wins(TINY, target, "forward", chosen, replayed, default)
    else:
        wins = dispatch.replay_wins(TINY, target, "forward", chosen, replayed, default)
    assert wins == (slower == "default")
    stored = dispatch.stored_replay_decision(TINY, target, "forward", chosen)
    assert stored["choice"] == ("replayed" if wins else "default")
    if slower == "failing":
        assert stored["reason"].startswith("failed when run")
    else:
        assert stored["median_ms"][slower] > 5
    # The decision on disk answers later, untimed (a process that has kept its kernels).
    monkeypatch.setattr(dispatch, "_median_ms", lambda *args: pytest.fail("timed again"))
    dispatch._failed.clear()
    assert dispatch.replay_wins(TINY, target, "forward", chosen, replayed, default) == wins
    near = dataclasses.replace(TINY, height=9)  # TINY itself runs its kernel for one size
    said = dispatch.describe(near, target)
    if slower == "failing":
        assert "default schedule (handwritten replayed failed when run" in said
    else:
        what = "handwritten replayed" if wins else "default schedule"
        assert f"{what}: timed here at its tuned size" in said


@pytest.mark.parametrize("failure", ["replay", "build"])
def test_a_tuned_record_that_fails_for_any_size_leaves_the_default(
    tuned, tmp_path, monkeypatch, caplog, failure
):
    """A chosen record whose trace does not replay on the PrimFunc for any size (said in the
    log), or whose replay does not build (e.g. a local buffer of a symbolic size: a warning),
    gives way to the default schedule in its class, not to an error at the call."""
    *_, out = tuned
    chosen = choose_the_tuned_record(out, tmp_path, monkeypatch)
    monkeypatch.setenv("TVM_DEFORM_CACHE", "0")  # compiled here, not loaded
    target = targets.host_target()
    replay, compile_schedule = schedules.replayed_any_size_schedule, kernels.compile_schedule
    replayed = []

    def replay_or_not(*args):
        replayed.append(replay(*args) if failure == "build" else None)
        return replayed[-1]

    def failing(sch, target):
        if any(sch is r for r in replayed):
            raise RuntimeError("Can only handle constant size stack allocation for now")
        return compile_schedule(sch, target)

    monkeypatch.setattr(schedules, "replayed_any_size_schedule", replay_or_not)
    monkeypatch.setattr(kernels, "compile_schedule", failing)
    noted = functools.partial(dispatch.replay_failed, TINY, target, "forward", chosen)
    if failure == "build":
        with pytest.warns(RuntimeWarning, match="failed"):
            kernel = kernels._any_size_class(TINY.any_size(), target, "NCHW", 1, chosen, noted)
    else:  # a record of another structure: said in the log, as the compiles are
        with caplog.at_level(logging.INFO, logger=kernels.log.name):
            kernel = kernels._any_size_class(TINY.any_size(), target, "NCHW", 1, chosen, noted)
        assert "does not replay" in caplog.text
    assert replayed  # the record was tried
    # It is not timed against the default: its kernel is the default's.
    monkeypatch.setattr(dispatch, "_median_ms", lambda *args: pytest.fail("timed"))
    assert not dispatch.replay_wins(TINY, target, "forward", chosen, kernel, kernel)
    dispatch._failed.clear()
    near = dataclasses.replace(TINY, batch=2, height=9, width=13)
    inputs = random_inputs(near)
    args = [inputs[k] for k in ("input", "offset", "weight", "bias", "mask")]
    reference = deform_conv2d_reference(*args[:4], **conv_kwargs(near), mask=args[4])
    assert_close(calls.run_forward(near, *args, kernel=kernel), reference, 1e-6)


def test_a_tune_without_its_work_directory_starts_from_the_logs(tuned, tmp_path, monkeypatch):
    # The logs of this machine (as shipped, or from an earlier run whose work directory is
    # gone) seed the new search, so that it starts from their best record, not from nothing.
    *_, out = tuned
    key = targets.hardware_key(targets.host_target())
    monkeypatch.setenv("TVM_DEFORM_LOGS", str(out))
    work = tmp_path / "work"
    lines = []
    tune({"tiny": TINY}, 0, work, progress=lines.append, measure_default=False)
    seeded = records.best_in(work / key / "handwritten", records.workload_module(TINY))
    shipped = records.best_in(out / key / "handwritten", records.workload_module(TINY))
    assert seeded is not None
    assert tvm_ffi.structural_equal(seeded.trace.as_json(), shipped.trace.as_json())
    # The progress gives each source's own time here, not the best of the database so far.
    source = out / key / "handwritten"
    assert f"[tiny / handwritten] from {source}: {records.record_ms(seeded):.3f} ms here" in lines


def test_a_time_limit_stops_the_tuning(tmp_path):
    # A limit that has passed before the first measurement ends: the measuring is stopped, the
    # search skipped, and tune() returns with nothing tuned.
    lines = []
    results = tune({"tiny": TINY}, 8, tmp_path / "work", progress=lines.append, time_limit=0)
    assert results == []
    assert "measuring: stopped at the time limit" in lines
    assert "[tiny / handwritten] skipped: the time limit has passed" in lines


def test_a_child_stopped_at_its_deadline_takes_its_processes_and_torn_line_with_it(tmp_path):
    import multiprocessing
    import subprocess
    import time

    from tvm_deform.tools.tuning import _run_in_child

    # The child starts a process of its own, writes a line and a half to a database file and
    # waits, as a tuning task stopped while its runner's workers run and it commits a record.
    script = (
        f"cd {tmp_path}; sleep 60 & echo $! > pid; "
        'printf \'["a whole line"]\\n["half a li\' > database_tuning_record.json; wait'
    )
    lines = []
    began = time.monotonic()
    # The spawned child imports the package before it runs the script: about 5 s on a
    # loaded 2-core machine, which a 5 s deadline sometimes cut short.
    finished = _run_in_child(
        multiprocessing.get_context("spawn"),
        subprocess.run,
        (["bash", "-c", script],),
        "sleeping",
        lines.append,
        deadline=began + 20,
        databases=[tmp_path],
    )
    assert not finished and lines == ["sleeping: stopped at the time limit"]
    assert time.monotonic() - began < 40
    assert (tmp_path / "database_tuning_record.json").read_text() == '["a whole line"]\n'
    # The grandchild was killed with its parent's process group: gone, or a zombie left to init.
    stat = Path(f"/proc/{(tmp_path / 'pid').read_text().strip()}/stat")
    time.sleep(0.5)
    assert not stat.exists() or stat.read_text().split(")")[1].split()[0] == "Z"


def without_default(out, tmp_path):
    """A copy of the logs at ``out`` without the default schedule's measurements, so that the
    tuned records are dispatched whatever the smoke tune's few trials found."""
    copy = tmp_path / "logs"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / targets.hardware_key(targets.host_target()) / records.DEFAULT_SPACE)
    (copy / targets.hardware_key(targets.host_target()) / records.LOGS_DECISIONS).unlink()
    return copy


def test_tuned_record_is_dispatched_and_correct(tuned, tmp_path, monkeypatch):
    *_, out = tuned
    monkeypatch.setenv("TVM_DEFORM_LOGS", str(without_default(out, tmp_path)))
    record = kernels.resolve(TINY, targets.host_target())
    assert record is not None and record.space == "handwritten"
    assert record.hardware_key == targets.hardware_key(targets.host_target())
    check_against_reference(TINY)
    monkeypatch.setenv("TVM_DEFORM_TUNED", "0")
    assert kernels.resolve(TINY, targets.host_target()) is None
    check_against_reference(TINY)


def test_backward_smoke_tune_is_dispatched_and_correct(tuned_backward, tmp_path, monkeypatch):
    result, work, out = tuned_backward
    assert result.workload == "tiny:backward" and result.best_ms is not None
    key = targets.hardware_key(targets.host_target())
    manifest = json.loads((out / key / "manifest.json").read_text())
    assert manifest["workloads"]["tiny:backward"]["handwritten"]["trials"] == result.trials
    assert count_records(out / key / "handwritten", TINY, "backward") >= 1
    assert count_records(out / key / "handwritten", TINY) == 0  # the forward was not tuned
    assert count_records(out / key / records.DEFAULT_SPACE, TINY, "backward") == 1
    monkeypatch.setenv("TVM_DEFORM_LOGS", str(without_default(out, tmp_path)))
    record = kernels.resolve(TINY, targets.host_target(), op="backward")
    assert record is not None and record.space == "handwritten"
    check_gradients_against_torchvision(TINY)


def test_corrupt_log_directory_falls_back_with_a_warning(tmp_path, monkeypatch):
    space = tmp_path / targets.hardware_key(targets.host_target()) / "handwritten"
    space.mkdir(parents=True)
    (space / "database_workload.json").write_text("{ not json")
    (space / "database_tuning_record.json").write_text("[1, 2")
    monkeypatch.setenv("TVM_DEFORM_LOGS", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="ignoring unreadable tuning log"):
        assert kernels.resolve(TINY, targets.host_target()) is None
    check_against_reference(TINY)


def test_missing_log_directory_falls_back_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("TVM_DEFORM_LOGS", str(tmp_path / "nowhere"))
    with pytest.warns(RuntimeWarning, match="does not exist"):
        assert kernels.resolve(TINY, targets.host_target()) is None


def test_logs_keep_their_workloads_packed(tuned):
    # The pruned logs hold the workload file gzipped; read through records.open_database they
    # give the same records as the work directory they were pruned from.
    _, second, work, out = tuned
    key = targets.hardware_key(targets.host_target())
    logs = out / key / "handwritten"
    assert (logs / records.PACKED_WORKLOADS).exists()
    assert not (logs / records.WORKLOADS).exists()
    assert all((d / records.PACKED_WORKLOADS).exists() for d in records.databases(out))
    kept = [str(r.trace) for r in records.open_database(logs).get_all_tuning_records()]
    work_db = ms.database.JSONDatabase(work_dir=str(work / key / "handwritten"))
    assert set(kept) <= {str(r.trace) for r in work_db.get_all_tuning_records()}
    assert count_records(logs, TINY) == len(kept) >= 1


def shipped_databases():
    root = records.shipped_logs_dir()
    return records.databases(root)


@pytest.mark.parametrize("directory", shipped_databases(), ids=lambda p: str(p.parent.name))
def test_every_shipped_record_matches_a_suite_workload(directory):
    suite = {
        (name, op): records.workload_module(shape, op)
        for name, shape in load_suite().items()
        for op in records.OPS
    }
    stored = records.open_database(directory).get_all_tuning_records()
    assert stored, f"{directory} holds no records"
    for record in stored:
        assert any(tvm_ffi.structural_equal(record.workload.mod, mod) for mod in suite.values()), (
            f"a record in {directory} matches no suite workload of the current definition"
        )


def test_shipped_records_give_correct_kernels():
    """Every shipped record that a suite workload may run with on this machine (its own logs'
    choice, or each compatible machine's best, which the first use times against the default)
    gives a kernel that matches torchvision, forward and backward."""
    target = targets.host_target()
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, shape in load_suite().items():
            inputs = random_inputs(shape)
            x, offset, weight, bias, mask = (
                inputs[k] for k in ("input", "offset", "weight", "bias", "mask")
            )
            kwargs = conv_kwargs(shape) | dict(mask=mask)
            expected = torchvision.ops.deform_conv2d(x, offset, weight, bias, **kwargs)
            for record in filter(None, kernels.candidates(shape, target)):
                kernel = kernels.load_kernel(shape, target, record)
                ours = calls.run_forward(shape, x, offset, weight, bias, mask, kernel)
                assert_close(ours, expected, 2e-6, f"{name} with {record.hardware_key}")
                checked += 1
            backward = [r for r in kernels.candidates(shape, target, "backward") if r]
            if backward:
                check_backward_records(shape, target, backward)
                checked += len(backward)
    if not checked:
        pytest.skip(f"no shipped tuning logs for {targets.hardware_key(target)}")


def check_backward_records(shape: ConvShape, target, backward: list[records.TunedRecord]) -> None:
    inputs = random_inputs(shape)
    names = ("input", "offset", "mask", "weight", "bias")
    leaves = {k: inputs[k].clone().requires_grad_() for k in names if inputs[k] is not None}
    out = torchvision.ops.deform_conv2d(**(inputs | leaves), **conv_kwargs(shape))
    grad_output = torch.randn_like(out)
    grads = torch.autograd.grad(out, list(leaves.values()), grad_output)
    expected = dict(zip(leaves, grads, strict=True))
    x, offset, weight, mask = (inputs[k] for k in ("input", "offset", "weight", "mask"))
    for record in backward:
        compiled = kernels.load_backward(shape, target, record)
        ours = calls.run_backward(shape, grad_output, x, offset, weight, mask, compiled)
        for key, grad in zip(names, ours, strict=True):
            if key in expected:
                assert_close(grad, expected[key], 2e-5, f"grad_{key} with {record.hardware_key}")


def test_suite_has_the_layers_users_run():
    suite = load_suite()
    assert len(suite) >= 10
    assert suite["seed"] == ConvShape(2, 3, 5, 5, 5, 3, 3)
    assert any(s.offset_groups == 4 for s in suite.values())
    assert any(s.batch == 8 for s in suite.values())
    assert any(s.stride_h == 2 for s in suite.values())
    assert any(s.weight_groups > 1 for s in suite.values())
    assert torch.tensor([s.in_channels for s in suite.values()]).max() == 512


def foreign_logs(out, tmp_path, isa: str | None = None):
    """The smoke tune's logs (default schedule's measurement included) moved under another
    machine's hardware key, whose manifest says it had ``isa`` (default: this machine's)."""
    target = targets.host_target()
    copy = tmp_path / "logs"
    shutil.copytree(out / targets.hardware_key(target), copy / "llvm" / "elsewhere")
    path = copy / "llvm" / "elsewhere" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(hardware_key="llvm/elsewhere", isa=isa or targets.target_isa(target))
    path.write_text(json.dumps(manifest))
    return copy


@pytest.fixture
def counted_measure(monkeypatch):
    """Counts the timings dispatch runs (and runs them)."""
    calls = []
    measure = dispatch.measure

    def counted(shape, target, op, options):
        calls.append(sorted(options))
        return measure(shape, target, op, options)

    monkeypatch.setattr(dispatch, "measure", counted)
    return calls


def test_other_machines_records_are_timed_here_and_the_decision_kept(
    tuned, tmp_path, monkeypatch, counted_measure
):
    *_, out = tuned
    target = targets.host_target()
    monkeypatch.setenv("TVM_DEFORM_LOGS", str(foreign_logs(out, tmp_path)))
    monkeypatch.setenv("TVM_DEFORM_CACHE_DIR", str(tmp_path / "cache"))
    # The foreign logs hold their default schedule's measurement too: it is not trusted here.
    record = kernels.resolve(TINY, target)
    assert counted_measure == [["default", "llvm/elsewhere/handwritten"]]
    (entry,) = dispatch.read_decisions(target).values()
    assert entry["choice"] == dispatch.option_name(record)
    assert set(entry["median_ms"]) == {"default", "llvm/elsewhere/handwritten"}
    check_against_reference(TINY)
    # Another process (here: a fresh lookup) takes the decision from disk, without timing.
    kernels.clear_memory_cache()
    again = kernels.resolve(TINY, target)
    assert dispatch.option_name(again) == entry["choice"] and len(counted_measure) == 1
    # The file decides: flip the choice and the lookup follows it.
    flipped = "default" if entry["choice"] != "default" else "llvm/elsewhere/handwritten"
    path = dispatch.decisions_path(target)
    path.write_text(path.read_text().replace(f'"{entry["choice"]}"', f'"{flipped}"', 1))
    assert dispatch.option_name(kernels.resolve(TINY, target)) == flipped
    assert len(counted_measure) == 1


def test_measuring_can_be_turned_off(tuned, tmp_path, monkeypatch, counted_measure):
    *_, out = tuned
    monkeypatch.setenv("TVM_DEFORM_LOGS", str(foreign_logs(out, tmp_path)))
    monkeypatch.setenv("TVM_DEFORM_MEASURE", "0")
    assert kernels.resolve(TINY, targets.host_target()) is None
    assert counted_measure == []


def test_records_of_another_isa_are_not_candidates(tuned, tmp_path, monkeypatch, counted_measure):
    *_, out = tuned
    other = "avx2" if targets.target_isa(targets.host_target()) != "avx2" else "avx512"
    monkeypatch.setenv("TVM_DEFORM_LOGS", str(foreign_logs(out, tmp_path, isa=other)))
    assert records.foreign_records(TINY, targets.host_target(), "llvm/here") == []
    assert kernels.resolve(TINY, targets.host_target()) is None
    assert counted_measure == []


def test_own_logs_decide_without_timing(tuned, tmp_path, monkeypatch, counted_measure):
    *_, out = tuned
    logs_dir = foreign_logs(out, tmp_path)
    shutil.copytree(out, logs_dir, dirs_exist_ok=True)  # this machine's own key beside it
    monkeypatch.setenv("TVM_DEFORM_LOGS", str(logs_dir))
    target = targets.host_target()
    record = kernels.resolve(TINY, target)
    # The choice written at tuning time (timed through the op) decides; the foreign records
    # beside it are neither timed nor chosen.
    own = records.own_records(TINY, target, targets.hardware_key(target))
    decision = dispatch.own_decision(TINY, "forward", own)
    assert decision is not None
    expected = dispatch.own_options(own)[decision["choice"]]
    assert dispatch.option_name(record) == dispatch.option_name(expected)
    assert "elsewhere" not in dispatch.option_name(record)
    assert counted_measure == []


def test_trial_history_and_convergence_table(tuned):
    _, second, work, _ = tuned
    key = targets.hardware_key(targets.host_target())
    history = trial_history(work / key / "handwritten", TINY)
    assert len(history) >= second.trials  # failed candidates are in the history too
    assert min(history) == pytest.approx(second.best_ms)
    table = convergence_table(work, {"tiny": TINY}, targets.host_target())
    (line,) = [x for x in table.splitlines() if x.startswith("| tiny |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert float(cells[-2]) == pytest.approx(min(history), abs=1e-3)  # best after all trials
    assert 1 <= int(cells[-1]) <= len(history)


def test_tuning_writes_a_choice_timed_through_the_op(tuned, tmp_path, monkeypatch, counted_measure):
    *_, out = tuned
    key = targets.hardware_key(targets.host_target())
    decisions = json.loads((out / key / records.LOGS_DECISIONS).read_text())
    (entry,) = [e for e in decisions.values() if e["workload"] == "tiny"]  # the latest only
    assert set(entry["median_ms"]) == {"default", "handwritten"}
    # The times are stored rounded, so two close candidates may tie in the file.
    assert entry["median_ms"][entry["choice"]] == min(entry["median_ms"].values())
    # Dispatch takes that choice without timing, and follows the file when it changes.
    copy = tmp_path / "logs"
    shutil.copytree(out, copy)
    monkeypatch.setenv("TVM_DEFORM_LOGS", str(copy))
    record = kernels.resolve(TINY, targets.host_target())
    assert (record is None) == (entry["choice"] == "default")
    flipped = "default" if entry["choice"] != "default" else "handwritten"
    path = copy / key / records.LOGS_DECISIONS
    path.write_text(
        path.read_text().replace(f'"choice": "{entry["choice"]}"', f'"choice": "{flipped}"')
    )
    record = kernels.resolve(TINY, targets.host_target())
    assert (record is None) == (flipped == "default")
    assert counted_measure == []


def scaled_copy(out, destination, factor: float):
    """The smoke tune's logs with every measured time multiplied by ``factor`` (another
    machine of the same key that measured the same schedules faster or slower)."""
    key = targets.hardware_key(targets.host_target())
    shutil.copytree(out, destination)
    for space_dir in (destination / key).iterdir():
        if not records.is_database(space_dir):
            continue
        stored = records.open_database(space_dir).get_all_tuning_records()
        for name in (records.PACKED_WORKLOADS, records.TUNING_RECORDS):
            (space_dir / name).unlink()
        db = ms.database.JSONDatabase(work_dir=str(space_dir), allow_missing=True)
        for record in stored:
            db.commit_tuning_record(
                ms.database.TuningRecord(
                    record.trace,
                    db.commit_workload(record.workload.mod),
                    [float(s) * factor for s in record.run_secs],
                    record.target,
                    record.args_info,
                )
            )
    (destination / key / records.LOGS_DECISIONS).unlink(missing_ok=True)
    return destination


def test_merged_logs_keep_the_best_records_and_say_where_from(tuned, tmp_path, monkeypatch):
    *_, out = tuned
    key = targets.hardware_key(targets.host_target())
    faster = scaled_copy(out, tmp_path / "faster", 0.1)
    slower = scaled_copy(out, tmp_path / "slower", 10.0)
    merged = tmp_path / "merged"
    report = merge_logs([slower, out, faster], merged)
    assert any(line.startswith(f"{key}/handwritten:") and str(faster) in line for line in report)
    for space in ("handwritten", "default"):
        best = records.best_in(merged / key / space, records.workload_module(TINY))
        expected = records.best_in(faster / key / space, records.workload_module(TINY))
        assert records.record_ms(best) == pytest.approx(records.record_ms(expected))
        assert count_records(merged / key / space, TINY) <= KEEP_PER_WORKLOAD
    manifest = json.loads((merged / key / "manifest.json").read_text())
    assert manifest["workloads"]["tiny"]["handwritten"]["from"] == str(faster)
    assert sorted(manifest["merged_from"]) == sorted(map(str, [slower, out, faster]))
    # Dispatch reads the merged tree like any logs: its own records, with the faster times.
    monkeypatch.setenv("TVM_DEFORM_LOGS", str(merged))
    target = targets.host_target()
    own = records.own_records(TINY, target, key)
    assert {r.directory.parent for r in own} == {merged / key}
    assert kernels.resolve(TINY, target) == dispatch.choose_own(TINY, "forward", own)
    check_against_reference(TINY)


def test_merge_keeps_the_trees_own_logs_and_rejects_missing_sources(tuned, tmp_path):
    *_, out = tuned
    key = targets.hardware_key(targets.host_target())
    merged = tmp_path / "merged"
    shutil.copytree(out, merged)
    other = scaled_copy(out, tmp_path / "other", 2.0)
    merge_logs([other], merged)
    best = records.best_in(merged / key / "handwritten", records.workload_module(TINY))
    own_best = records.best_in(out / key / "handwritten", records.workload_module(TINY))
    assert records.record_ms(best) == pytest.approx(records.record_ms(own_best))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        merge_logs([tmp_path / "nowhere"], merged)
