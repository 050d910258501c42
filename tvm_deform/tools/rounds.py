"""Tuning in rounds (tools layer): candidates searched and built on one machine, timed on
another, learned from here.

A GPU may be lent for minutes at a time, without TVM on it and with little room to bring files.
So a round of tuning is split in three steps, each a command:

1. :func:`propose` (here, no GPU needed): for each workload and op (the forward, the
   backward's gradients kernel), the seeds not measured yet (the default schedule and each
   rule's own schedule, see :func:`_seeds`), then MetaSchedule's evolutionary search proposes
   new candidates from the design spaces up to ``count``, ranked by the cost model of the
   earlier rounds (an XGBoost model, saved in the work directory, whose
   ``num_warmup_samples`` is one round so that it ranks from the second round on). Each
   candidate is built: for a CUDA target, its
   kernels into a cubin with nvcc, with the launch plan the host code would run (each
   kernel's arguments, grid, block and shared memory, and the scratch buffers); for an LLVM
   target (the rehearsal on a CPU), into a shared library. The round directory holds
   ``round.json`` and the built files; the same packed as ``<directory>.tar.xz`` (see
   :func:`pack`) is what travels.
2. ``lab/time_round.py`` (on the measuring machine, with CuPy for CUDA and no TVM; with TVM's
   runtime for an LLVM round): times every candidate, writes one JSON line per candidate as it
   goes, within a deadline.
3. :func:`ingest` (here): the times become MetaSchedule tuning records in the work directory's
   databases (``<work>/<hardware key>/handwritten``, and ``default`` for the default
   schedule's), and the cost model learns from them and is
   saved for the next round. ``tvm-deform tune-report`` and the pruned logs read that database
   as they read an online tuning run's.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import json
import os
import re
import tarfile
import time
import warnings
import zlib
from collections.abc import Iterable
from pathlib import Path

import tvm
import tvm_ffi
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels, targets
from tvm_deform.runtime.kernels import compile_schedule
from tvm_deform.runtime.records import DEFAULT_SPACE, workload_module
from tvm_deform.schedules import named_design_spaces
from tvm_deform.schedules.common import tensor_intrinsics
from tvm_deform.tools import cuda_build
from tvm_deform.tools.tuning import RuleSpaces, database, label

#: the round's description in a round directory
ROUND_FILE = "round.json"
#: the design space the rounds search, and the database they write to
SPACE = "handwritten"
#: the databases a round's times go to: the searched space's, and the default schedule's
SPACES = (SPACE, DEFAULT_SPACE)
#: the cost model's file in the work directory, beside the databases
MODEL_FILE = "cost_model.tar"


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch of a CUDA candidate: the kernel, its arguments (the names of buffers,
    or integers), and its launch configuration."""

    kernel: str
    args: list[str | int]
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int = 0


def launch_plan(sch: s_tir.Schedule, target: Target) -> tuple[list[Launch], dict[str, dict]]:
    """The kernel launches the host code of ``sch``'s CUDA kernels makes, in order, and the
    scratch buffers they use (name -> ``{"elements", "dtype"}``); the argument names are those
    of the PrimFunc's parameters (``data``, ``offset``, ...) or of the scratch buffers. Read
    from TVM's host function after its lowering pipeline; needs static sizes."""
    from tvm.tirx.build import split_host_device_mods

    mod = tvm.tirx.transform.BindTarget(target.with_host(target.host))(sch.mod)
    pipeline, _, _ = tvm.tirx.get_default_tir_pipeline(target)
    host, _ = split_host_device_mods(pipeline(mod))
    return _parse_host(host.script())


_PARAM = re.compile(r"^(\w+) = T\.decl_buffer\(.*tvm_struct_get\((\w+)_handle, 0, 1,")
_ALLOC = re.compile(r"^(\w+) = T\.alloc_buffer\(\(([\d, ]+)\)(?:, \"(\w+)\")?")
_VIEW = re.compile(r"^(\w+) = (\w+)\.view\(")
_ALIAS = re.compile(r"^(\w+) = T\.decl_buffer\(.*data=(\w+)\.data\)")
_LAUNCH = re.compile(r'^T\.call_ffi_kernel\("(\w+)", (.*), launch_params=\[(.*?)\]')


def _parse_host(script: str) -> tuple[list[Launch], dict[str, dict]]:
    owner: dict[str, str] = {}
    scratch: dict[str, dict] = {}
    launches = []
    for line in (raw.strip() for raw in script.splitlines()):
        if match := _PARAM.match(line):
            owner[match.group(1)] = match.group(2)
        elif match := _ALLOC.match(line):
            elements = 1
            for extent in match.group(2).split(","):
                elements *= int(extent) if extent.strip() else 1
            owner[match.group(1)] = match.group(1)
            scratch[match.group(1)] = {"elements": elements, "dtype": match.group(3) or "float32"}
        elif (match := _VIEW.match(line)) or (match := _ALIAS.match(line)):
            owner[match.group(1)] = owner[match.group(2)]
        elif match := _LAUNCH.match(line):
            names = [p.strip().strip('"') for p in match.group(3).split(",")]
            values = [v.strip() for v in match.group(2).split(",")]
            dims = {"blockIdx": [1, 1, 1], "threadIdx": [1, 1, 1]}
            shared = 0
            for name, value in zip(names, values[len(values) - len(names) :], strict=True):
                if name.startswith(("blockIdx.", "threadIdx.")):
                    kind, axis = name.split(".")
                    dims[kind]["xyz".index(axis)] = int(value)
                elif "dyn_shared" in name:
                    shared = int(value)
                else:
                    raise ValueError(f"unknown launch parameter {name!r}")
            args: list[str | int] = []
            for value in values[: len(values) - len(names)]:
                if value.endswith(".data"):
                    args.append(owner[value.removesuffix(".data")])
                else:
                    args.append(int(value))  # a static size, as an int32 argument
            launches.append(
                Launch(
                    match.group(1),
                    args,
                    tuple(dims["blockIdx"]),
                    tuple(dims["threadIdx"]),
                    shared,
                )
            )
    if not launches:
        raise ValueError("no kernel launch in the host function")
    return launches, scratch


def cost_model(work_dir: Path, target: Target, round_size: int) -> ms.cost_model.XGBModel:
    """The cost model of the earlier rounds on ``target`` (a new one before the first),
    trained from ``round_size`` measurements on."""
    model = ms.cost_model.XGBModel(num_warmup_samples=round_size, num_tuning_cores=os.cpu_count())
    path = _model_path(work_dir, target)
    if path.exists():
        with warnings.catch_warnings():  # XGBoost's note on the file's format
            warnings.simplefilter("ignore", UserWarning)
            model.load(str(path))
    return model


def _model_path(work_dir: Path, target: Target) -> Path:
    return Path(work_dir) / targets.hardware_key(target) / MODEL_FILE


def _context(shape: ConvShape, target: Target, seed: int, op: str = "forward") -> ms.TuneContext:
    tensor_intrinsics()  # TuneContext imports them too: here the fast way first
    return _new_context(shape, target, seed, op)


def _new_context(shape: ConvShape, target: Target, seed: int, op: str) -> ms.TuneContext:
    return ms.TuneContext(
        mod=workload_module(shape, op),
        target=target,
        # The spaces are the rules' own: MetaSchedule's schedule rules are not used (the CUDA
        # ones would need the tensor intrinsics registered), its checks and mutators are.
        space_generator=ms.space_generator.ScheduleFn(
            RuleSpaces(op, target),
            sch_rules=[],
            postprocs=ms.postproc.Postproc.create(target.kind.name),
            mutator_probs=ms.mutator.Mutator.create(target.kind.name),
        ),
        search_strategy=ms.search_strategy.EvolutionarySearch(
            population_size=64, init_min_unmeasured=16, genetic_num_iters=2
        ),
        task_name="deform_conv2d",
        num_threads=os.cpu_count() or 1,
        rand_state=seed,
    ).clone()


def propose(
    workloads: dict[str, ConvShape],
    target: Target,
    work_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    count: int,
    seed: int = 0,
    ops: Iterable[str] = ("forward",),
    progress=print,
) -> Path:
    """Write a round of ``count`` new candidates per workload and op of ``ops`` ("forward",
    "backward": the gradients kernel; see the module docstring), or of its seeds where they
    are more, to ``out_dir`` and return the path of its ``round.json``, whose workloads are
    named as :func:`.tuning.label` names them. A seed's entry says which it is (``seed``)
    and the database its time goes to (``space``)."""
    work_dir, out_dir = Path(work_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = targets.hardware_key(target)
    db = database(work_dir / key / SPACE)
    model = cost_model(work_dir, target, count)
    trained = model.data_size >= model.num_warmup_samples and model.booster is not None
    description = {
        "target": json.loads(str(target)),
        "kind": target.kind.name,
        "hardware_key": key,
        # how its kernels compiled (by nvcc, whatever the environment's compiler): the machine
        # code depends on it, and ingest checks it against how kernels compile there
        "compile_settings": targets.cuda_compile_settings("nvcc")
        if target.kind.name == "cuda"
        else "",
        "ranked_by_model": trained,
        "workloads": {},
    }
    for (name, shape), op in ((item, op) for item in workloads.items() for op in ops):
        started = time.monotonic()
        context = _context(shape, target, seed, op)
        strategy = context.search_strategy
        strategy.pre_tuning(
            max_trials=count,
            num_trials_per_iter=count,
            design_spaces=context.generate_design_space(),
            database=db,
            cost_model=model,
        )
        # Measured in either database (a rule's own schedule may be the default's), then the
        # seeds: the search's candidates are new to both.
        seen = set().union(*(_measured(database(work_dir / key / s), shape, op) for s in SPACES))
        seeds = _seeds(context, shape, target, op, seen)
        searched = _new(strategy.generate_measure_candidates() or [], seen)
        strategy.post_tuning()
        searched = searched[: max(0, count - len(seeds))]
        candidates = [seed.candidate for seed in seeds] + searched
        scores = list(model.predict(context, candidates)) if trained and candidates else []
        search_end = time.monotonic()
        stem = name if op == "forward" else f"{name}-{op}"
        entries = _build_all(stem, candidates, target, out_dir)
        for entry, first in zip(entries, seeds, strict=False):
            entry.update(space=first.space, seed=first.name)
        for entry, score in zip(entries, scores, strict=False):
            entry["predicted"] = float(score)
        description["workloads"][label(name, op)] = {
            "name": name,
            "op": op,
            "shape": dataclasses.asdict(shape),
            "args": _args(shape, op),
            "candidates": entries,
        }
        built = sum(1 for e in entries if "error" not in e)
        progress(
            f"[{label(name, op)}] {len(seeds)} seeds and {len(searched)} candidates "
            + ("ranked by the cost model" if trained else "at random (no model yet)")
            + f" in {search_end - started:.1f} s, {built} built in "
            f"{time.monotonic() - search_end:.1f} s"
        )
    path = out_dir / ROUND_FILE
    path.write_text(json.dumps(description, indent=1))
    pack(out_dir)
    return path


def packed_path(out_dir: str | os.PathLike) -> Path:
    """Where :func:`pack` writes the round at ``out_dir``: ``<out_dir>.tar.xz``."""
    out_dir = Path(out_dir)
    return out_dir.with_name(out_dir.name + ".tar.xz")


def pack(out_dir: str | os.PathLike) -> Path:
    """The round at ``out_dir`` as one xz-compressed tar beside it (its path returned),
    which ``lab/time_round.py`` reads as it reads the directory. Candidates of one layer share
    most of their machine code, so a round packs small: a backward round of the suite took
    24 MiB as files and 0.5 MiB packed, where a GPU machine takes a few tens of MiB a call."""
    out_dir = Path(out_dir)
    path = packed_path(out_dir)
    described = json.loads((out_dir / ROUND_FILE).read_text())
    # The round's own files only: a directory used before may hold an older round's.
    names = [ROUND_FILE] + [
        entry[kind]
        for workload in described["workloads"].values()
        for entry in workload["candidates"]
        for kind in ("cubin", "library")
        if kind in entry
    ]
    with tarfile.open(path, "w:xz", preset=6) as archive:
        for name in names:
            archive.add(out_dir / name, arcname=f"{out_dir.name}/{name}")
    return path


@dataclasses.dataclass(frozen=True)
class Seed:
    """A candidate a round measures before the search's: its database's space, and what it
    is (the default schedule, or the rule whose own schedule it is)."""

    space: str
    name: str
    candidate: ms.MeasureCandidate


def _seeds(
    context: ms.TuneContext, shape: ConvShape, target: Target, op: str, seen: set
) -> list[Seed]:
    """The round's seeds whose modules' structural hashes are not in ``seen`` (to which they
    are added): the default schedule (space ``default``: its time is what a tuned record must
    beat to be run, see ``records.tuned_gain``), and each design space as its rule generates
    it (the rule's own tile sizes, the starting points a person chose; MetaSchedule's first
    search samples at random)."""
    found = [(DEFAULT_SPACE, "default", kernels.default_schedule(shape, target, op))]
    for name, space in named_design_spaces(op, context.mod["main"], target):
        sch = space.copy()
        sch.enter_postproc()  # the postprocessors' steps marked, as MetaSchedule's search does
        if _postprocessed(sch, context.space_generator.postprocs):
            found.append((SPACE, name, sch))
    seeds = []
    for space, name, sch in found:
        candidate = ms.MeasureCandidate(sch, ms.arg_info.ArgInfo.from_prim_func(sch.mod["main"]))
        if _new([candidate], seen):
            seeds.append(Seed(space, name, candidate))
    return seeds


def _postprocessed(sch: s_tir.Schedule, postprocs: list) -> bool:
    """Whether every one of ``postprocs`` takes ``sch`` (applying them to it). One that raises
    rejects it, as MetaSchedule's search drops a schedule a postprocessor raises on (its
    ``RewriteReductionBlock`` raises on a reduction block whose indices it does not take for
    affine)."""
    try:
        return all(postproc.apply(sch) for postproc in postprocs)
    except RuntimeError:  # tvm's ScheduleError
        return False


def _measured(db: ms.database.Database, shape: ConvShape, op: str) -> set:
    """The structural hashes of the scheduled modules ``db`` holds records of for ``shape``'s
    ``op``."""
    mod = workload_module(shape, op)
    if not db.has_workload(mod):
        return set()
    return {
        tvm_ffi.structural_hash(record.as_measure_candidate().sch.mod)
        for record in db.get_all_tuning_records()
        if tvm_ffi.structural_equal(record.workload.mod, mod)
    }


def _new(candidates: list, seen: set) -> list:
    """``candidates`` whose modules' structural hashes are not in ``seen`` (measured ones, or
    earlier in the round: the search proposes a measured one again once a small space has
    few left); those kept are added to it."""
    fresh = []
    for candidate in candidates:
        key = tvm_ffi.structural_hash(candidate.sch.mod)
        if key not in seen:
            seen.add(key)
            fresh.append(candidate)
    return fresh


def _args(shape: ConvShape, op: str) -> list[dict]:
    """The PrimFunc's parameters, in order: name, shape and dtype."""
    func = workload_module(shape, op)["main"]
    return [
        {"name": str(param.name), "shape": [int(d) for d in info.shape], "dtype": str(info.dtype)}
        for param, info in zip(func.params, ms.arg_info.ArgInfo.from_prim_func(func), strict=True)
    ]


def _build_all(name: str, candidates: list, target: Target, out_dir: Path) -> list[dict]:
    """Build each candidate into ``out_dir`` (on as many threads as there are cores: TVM's
    compiler and nvcc release the GIL) and describe it for the round file."""

    def build(index: int) -> dict:
        candidate = candidates[index]
        trace = tvm.ir.save_json(candidate.sch.trace.as_json(remove_postproc=False))
        infos = [tvm.ir.save_json(info.as_json()) for info in candidate.args_info]
        entry: dict = {
            "id": index,
            # TVM's own JSON of the trace and of the arguments' list, packed (see _pack)
            "trace": _pack(trace),
            "args_info": _pack(json.dumps(infos)),
        }
        stem = f"{name}-{index:04d}"
        try:
            entry.update(export_candidate(candidate.sch, target, out_dir, stem))
        except Exception as error:  # noqa: BLE001 - a candidate that does not build is left out
            entry["error"] = f"{type(error).__name__}: {error}"[:2000]
        return entry

    workers = os.cpu_count() or 1
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(build, range(len(candidates))))


def export_candidate(sch: s_tir.Schedule, target: Target, out_dir: Path, stem: str) -> dict:
    """Build ``sch`` for ``target`` into ``out_dir``: a cubin and its launch plan (CUDA) or a
    shared library (LLVM); return what the round file says of it."""
    if target.kind.name == "cuda":
        launches, scratch = launch_plan(sch, target)
        source = "\n".join(
            m.inspect_source("cuda")
            for m in compile_schedule(sch, target).mod.imports
            if m.kind == "cuda"
        )
        arch = str(target.attrs["arch"])
        built = cuda_build.nvcc_build(source, arch)
        if built.spills():
            raise RuntimeError(f"kernels spill to local memory: {built.spills()}")
        (out_dir / f"{stem}.cubin").write_bytes(built.cubin)
        return {
            "cubin": f"{stem}.cubin",
            "launches": [dataclasses.asdict(launch) for launch in launches],
            "scratch": scratch,
            "resources": built.kernels,
        }
    library = out_dir / f"{stem}.so"
    compile_schedule(sch, target).export_library(str(library))
    func = sch.mod["main"]
    return {
        "library": library.name,
        "function": str(func.attrs["global_symbol"]),
        # A schedule may lay out a workspace otherwise than the workload (the CPU backward's
        # column gradient): the shape of each of the candidate's own parameters.
        "shapes": {str(param.name): [int(d) for d in param.shape] for param in func.params},
    }


def _pack(text: str) -> str:
    """``text`` compressed (zlib, then base64): TVM's JSON of a trace is five times smaller so,
    and the round file travels."""
    return base64.b64encode(zlib.compress(text.encode(), 9)).decode("ascii")


def _unpack(text: str) -> str:
    return zlib.decompress(base64.b64decode(text)).decode()


def measure_candidate(entry: dict, mod: tvm.IRModule) -> ms.MeasureCandidate:
    """The candidate a round file's ``entry`` describes: its trace replayed on ``mod`` (the
    workload's unscheduled module), with its arguments' descriptions."""
    sch = s_tir.Schedule(mod)
    trace = tvm.ir.load_json(_unpack(entry["trace"]))
    tvm.s_tir.schedule.Trace.apply_json_to_schedule(trace, sch)
    infos = json.loads(_unpack(entry["args_info"]))
    return ms.MeasureCandidate(
        sch, [ms.arg_info.ArgInfo.from_json(tvm.ir.load_json(a)) for a in infos]
    )


@dataclasses.dataclass(frozen=True)
class Ingested:
    """What :func:`ingest` did for one workload."""

    workload: str
    measured: int
    failed: int
    best_ms: float | None
    #: the machine that timed it, as the measuring script named it (the GPU's name)
    device: str | None = None


def ingest(
    round_file: str | os.PathLike,
    results_file: str | os.PathLike,
    work_dir: str | os.PathLike,
    progress=print,
) -> list[Ingested]:
    """Commit the times of a round (``results_file``, the JSON lines ``lab/time_round.py``
    wrote) as tuning records to the work directory's database, train the cost model on them
    and save it (see the module docstring). A candidate that failed to build or run is
    recorded for the cost model with no time (MetaSchedule's convention), not in the
    database."""
    round_file, work_dir = Path(round_file), Path(work_dir)
    description = json.loads(round_file.read_text())
    target = Target(description["target"])
    built_with, here = description.get("compile_settings", ""), targets.compile_settings(target)
    if built_with != here:
        warnings.warn(
            f"the round was built with {built_with or 'nvcc -O3 alone (an older round)'}, where "
            f"kernels compile here with {here}: its times are of other machine code than "
            "the records' kernels will be",
            RuntimeWarning,
            stacklevel=2,
        )
    times: dict[tuple[str, int], list[float] | None] = {}
    devices: dict[str, str] = {}
    for line in Path(results_file).read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            times[(entry["workload"], int(entry["id"]))] = entry.get("run_secs")
            devices[entry["workload"]] = entry.get("device")
    dbs = {space: database(work_dir / description["hardware_key"] / space) for space in SPACES}
    first = next(iter(description["workloads"].values()), {"candidates": []})
    model = cost_model(work_dir, target, max(1, len(first["candidates"])))
    summary = []
    for name, workload in description["workloads"].items():
        shape, op = ConvShape(**workload["shape"]), workload.get("op", "forward")
        mod = workload_module(shape, op)
        context = _context(shape, target, 0, op)
        committed: dict = {}  # the workload in each database a time goes to
        candidates, results, best, failed = [], [], None, 0
        for entry in workload["candidates"]:
            secs = times.get((name, entry["id"]))
            if "error" not in entry and (name, entry["id"]) not in times:
                continue  # not timed (the deadline passed): neither good nor bad
            candidate = measure_candidate(entry, mod)
            candidates.append(candidate)
            if not secs:
                failed += 1
                results.append(ms.runner.RunnerResult(None, "failed to build or run"))
                continue
            run_secs = [tvm.runtime.convert(float(s)) for s in secs]
            results.append(ms.runner.RunnerResult(run_secs, None))
            space = entry.get("space", SPACE)
            if space not in committed:
                committed[space] = dbs[space].commit_workload(mod)
            dbs[space].commit_tuning_record(
                ms.database.TuningRecord(
                    candidate.sch.trace, committed[space], run_secs, target, candidate.args_info
                )
            )
            ms_value = sorted(secs)[len(secs) // 2] * 1e3
            best = ms_value if best is None else min(best, ms_value)
        if candidates:
            model.update(context, candidates, results)
        summary.append(Ingested(name, len(candidates) - failed, failed, best, devices.get(name)))
        progress(
            f"[{name}] {len(candidates) - failed} timed, {failed} failed"
            + (f", best {best:.4f} ms" if best is not None else "")
        )
    path = _model_path(work_dir, target)
    path.parent.mkdir(parents=True, exist_ok=True)
    if model.booster is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            model.save(str(path))
    return summary
