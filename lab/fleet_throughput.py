"""Candidates per minute that a fleet measures: one server against two, on loopback.

Each server is a one-core device: pinned to its own core (``taskset``) with a one-thread TVM
pool, and the candidates are built for one core. Two numbers per fleet:

- the runner alone: the same ``CANDIDATES`` built schedules (records of a tuning run) handed
  to MetaSchedule's ``RPCRunner`` at once, timed until the last result is back;
- a whole tuning run (``tvm-deform tune --rpc``'s path): ``TRIALS`` trials of a fresh search,
  building here included, timed end to end.

    .venv/bin/python lab/fleet_throughput.py docs/results/<cpu>/fleet-throughput.md

(the table goes to that file: MetaSchedule's tuning children print their own progress on
stdout)

Needs as many cores as servers (the last fleet's servers take cores 0 and 1).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from tvm_deform.runtime import targets
from tvm_deform.runtime.records import workload_module
from tvm_deform.tools.fleet import local_fleet
from tvm_deform.tools.suite import load_suite
from tvm_deform.tools.tuning import local_builder, tune

WORKLOAD = "demo_64x56x56"
TRIALS = 16
CANDIDATES = 16


def one_core_target() -> Target:
    return Target(json.loads(str(targets.host_target())) | {"num-cores": 1})


def built_candidates(work: Path, target: Target) -> list[ms.runner.RunnerInput]:
    """Build up to ``CANDIDATES`` valid records of the tuning run at ``work``."""
    key = targets.hardware_key(target)
    mod = workload_module(load_suite()[WORKLOAD])
    db = ms.database.JSONDatabase(work_dir=str(work / key / "handwritten"))
    found = db.get_top_k(db.commit_workload(mod), CANDIDATES)
    schedules = []
    for record in found:
        sch = tvm.s_tir.Schedule(mod)
        record.trace.apply_to_schedule(sch, remove_postproc=False)
        schedules.append(sch)
    built = local_builder().build([ms.builder.BuilderInput(s.mod, target) for s in schedules])
    return [
        ms.runner.RunnerInput(
            b.artifact_path, "cpu", ms.arg_info.ArgInfo.from_prim_func(s.mod["main"])
        )
        for b, s in zip(built, schedules, strict=True)
        if b.error_msg is None
    ]


def time_runner(runner: ms.runner.RPCRunner, inputs: list[ms.runner.RunnerInput]) -> float:
    begin = time.perf_counter()
    results = [future.result() for future in runner.run(inputs)]
    elapsed = time.perf_counter() - begin
    failed = [r.error_msg for r in results if r.error_msg]
    if failed:
        raise RuntimeError(f"{len(failed)} candidate(s) failed: {failed[0]}")
    return elapsed


def main(out: Path) -> int:
    target = one_core_target()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        shape = load_suite()[WORKLOAD]
        inputs = None
        for servers in (1, 2):
            cores = [[index] for index in range(servers)]
            with local_fleet(servers, root / f"processes{servers}", cores=cores) as started:
                work = root / f"work{servers}"
                begin = time.perf_counter()
                (result,) = tune(
                    {WORKLOAD: shape},
                    TRIALS,
                    work,
                    ["handwritten"],
                    target=target,
                    progress=lambda line: print(line, file=sys.stderr),
                    measure_default=False,
                    transfer=False,
                    fleet=started.fleet,
                )
                tuning_seconds = time.perf_counter() - begin
                if inputs is None:
                    inputs = built_candidates(work, target)
                runner = started.fleet.runner()
                time_runner(runner, inputs[:servers])  # start the runner's workers
                runner_seconds = time_runner(runner, inputs)
            rows.append((servers, len(inputs), runner_seconds, result.trials, tuning_seconds))
    cpu = targets.hardware_key(targets.host_target())
    lines: list[str] = []
    say = lines.append
    say(f"Fleet throughput on loopback, {cpu}, workload {WORKLOAD}; each server a one-core")
    say("device (pinned, one TVM thread). `python lab/fleet_throughput.py`.")
    say("")
    say(
        "| servers | runner alone: candidates | s | per minute | whole tuning run: trials "
        "| s | per minute |"
    )
    say("|---:|---:|---:|---:|---:|---:|---:|")
    for servers, count, seconds, trials, tuning in rows:
        say(
            f"| {servers} | {count} | {seconds:.1f} | {count / seconds * 60:.0f} | {trials} "
            f"| {tuning:.0f} | {trials / tuning * 60:.1f} |"
        )
    one, two = rows
    say("")
    say(
        f"Two servers against one: runner {two[1] / two[2] / (one[1] / one[2]):.2f}x, "
        f"whole run {two[3] / two[4] / (one[3] / one[4]):.2f}x."
    )
    out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
