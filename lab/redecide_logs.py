"""Time again, through the op, the choice between the default schedule and the tuned records of
this machine's own logs, and rewrite its decisions (``decisions.json``): after a change to a
default schedule, the decisions taken against the old one are stale. Nothing is tuned and the
records are left as they are; only the suite workloads that have records of this machine are
timed (about 4 s each, plus compiling).

    .venv/bin/python lab/redecide_logs.py --op backward --logs-dir tuning_logs
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tvm_deform.runtime import targets
from tvm_deform.tools import tuning
from tvm_deform.tools.suite import load_suite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", choices=("forward", "backward"), default="backward")
    parser.add_argument("--logs-dir", type=Path, required=True, help="the logs' root directory")
    parser.add_argument("--workload", action="append", help="only this suite workload")
    args = parser.parse_args()
    workloads = load_suite()
    if args.workload:
        workloads = {name: workloads[name] for name in args.workload}
    target = targets.host_target()
    print(f"{targets.hardware_key(target)}: {target}")
    tasks = [(name, args.op) for name in workloads]
    tuning.decide_through_the_op(workloads, tasks, target, args.logs_dir, print)


if __name__ == "__main__":
    main()
