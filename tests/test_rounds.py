"""Tuning in rounds: proposed and built here, timed elsewhere, learned from here (rehearsed on
the CPU, the LLVM target standing in for the GPU), and a CUDA round's cubins and launch plans."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import pytest
import torch
from tvm.s_tir import meta_schedule as ms

from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels, targets
from tvm_deform.runtime.records import record_ms, tuned_gain
from tvm_deform.tools import rounds
from tvm_deform.tools.cli import main
from tvm_deform.tools.tuning import records

ROOT = Path(__file__).resolve().parents[1]
LAYER = ConvShape(1, 16, 10, 10, 32, 3, 3, pad_h=1, pad_w=1, has_bias=True)
COUNT = 6


def time_round(directory: Path, results: Path) -> None:
    """Time a round as the measuring machine does: ``lab/time_round.py`` in a process of its
    own."""
    command = [sys.executable, str(ROOT / "lab/time_round.py"), str(directory)]
    subprocess.run([*command, "--out", str(results), "--min-ms", "2"], check=True)


def candidates_of(round_file: Path) -> list[dict]:
    return json.loads(round_file.read_text())["workloads"]["layer"]["candidates"]


@pytest.mark.slow
def test_a_round_trip_on_the_cpu_learns_and_ranks_the_next_round(tmp_path):
    target = targets.host_target()
    work = tmp_path / "work"

    first = rounds.propose({"layer": LAYER}, target, work, tmp_path / "round1", COUNT, seed=1)
    described = json.loads(first.read_text())
    assert described["ranked_by_model"] is False
    built = [c for c in candidates_of(first) if "error" not in c]
    assert len(built) == COUNT
    assert all((tmp_path / "round1" / c["library"]).exists() for c in built)
    # What travels: the round packed beside its directory, timed as it is.
    packed = rounds.packed_path(tmp_path / "round1")
    assert packed == tmp_path / "round1.tar.xz" and packed.is_file()
    time_round(packed, tmp_path / "round1.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "round1.jsonl").read_text().splitlines()]
    assert len(lines) == COUNT and all(len(line["run_secs"]) == 3 for line in lines)
    # A second call (on the directory) skips what is already timed.
    time_round(tmp_path / "round1", tmp_path / "round1.jsonl")
    assert len((tmp_path / "round1.jsonl").read_text().splitlines()) == COUNT

    # The first round starts with its seeds: the default schedule, then each design space as
    # its rule generates it; the search fills the rest.
    entries = candidates_of(first)
    seeds = [c for c in entries if "seed" in c]
    assert seeds[0]["space"] == "default" and seeds[0]["seed"] == "default"
    assert len(seeds) >= 2 and entries[: len(seeds)] == seeds
    assert all(c["space"] == rounds.SPACE for c in seeds[1:])
    default_trace = str(kernels.default_schedule(LAYER, target).trace)
    assert str(_candidate(seeds[0]).sch.trace) == default_trace

    summary = rounds.ingest(first, tmp_path / "round1.jsonl", work)
    assert [(s.measured, s.failed) for s in summary] == [(COUNT, 0)]
    # The default's time goes to the default space's database (what a tuned record must
    # beat), the others' to the searched space's.
    key_dir = work / targets.hardware_key(target)
    (default,) = records(key_dir / "default", LAYER)
    assert str(default.trace) == default_trace
    assert len(records(key_dir / rounds.SPACE, LAYER)) == COUNT - 1
    assert (key_dir / rounds.MODEL_FILE).exists()

    second = rounds.propose({"layer": LAYER}, target, work, tmp_path / "round2", COUNT, seed=2)
    assert json.loads(second.read_text())["ranked_by_model"] is True
    proposed = candidates_of(second)
    assert not any("seed" in c for c in proposed)  # the first round measured them
    assert len(proposed) >= 2  # new ones, as many as the small space has left (up to COUNT)
    scores = [c["predicted"] for c in proposed]
    # Ranked by the model trained on the first round: its scores, best first, and the
    # model's own (the same again from the saved model; an untrained one answers at random).
    assert scores == sorted(scores, reverse=True)
    model = rounds.cost_model(work, target, COUNT)
    assert model.data_size == COUNT
    context = rounds._context(LAYER, target, 0)
    again = model.predict(context, [_candidate(c) for c in proposed])
    assert again.tolist() == pytest.approx(scores)
    # New candidates: none of the first round's is proposed again.
    assert not {c["trace"] for c in proposed} & {c["trace"] for c in candidates_of(first)}

    time_round(tmp_path / "round2", tmp_path / "round2.jsonl")
    logs = tmp_path / "logs"
    argv = ["tune-ingest", str(tmp_path / "round2"), str(tmp_path / "round2.jsonl")]
    assert main([*argv, "--work-dir", str(work), "--logs-dir", str(logs)]) == 0
    total = COUNT + len(proposed)
    assert rounds.cost_model(work, target, COUNT).data_size == total
    assert len(records(key_dir / rounds.SPACE, LAYER)) == total - 1
    # The pruned logs: the best few, under the hardware key, the measuring machine named, and
    # the default's time beside them, so that the dispatch knows what the records gained.
    key = targets.hardware_key(target)
    manifest = json.loads((logs / key / "manifest.json").read_text())
    assert manifest["cpu"] == lines[0]["device"]
    assert 1 <= len(records(logs / key / rounds.SPACE, LAYER)) <= 3
    spaces = manifest["workloads"]["layer"]
    assert spaces["default"]["best_ms"] == pytest.approx(record_ms(default), abs=1e-4)
    assert tuned_gain(spaces, None) is not None


def _candidate(entry: dict) -> ms.MeasureCandidate:
    from tvm_deform.runtime.records import workload_module

    return rounds.measure_candidate(entry, workload_module(LAYER))


def test_a_wrong_candidate_is_recorded_as_failed(tmp_path):
    # The measuring script checks each candidate's output against torchvision's: one that
    # computes something else gets an error line, not a time, and the ingest keeps it out of
    # the database (the cost model still learns that it failed).
    target = targets.host_target()
    work = tmp_path / "work"
    first = rounds.propose({"layer": LAYER}, target, work, tmp_path / "round", 2, seed=3)
    entries = candidates_of(first)
    # The second candidate's library replaced by one of a dilated layer: the same buffers
    # (the padding keeps the output 10x10), other numbers.
    dilated = ConvShape(1, 16, 10, 10, 32, 3, 3, pad_h=2, pad_w=2, dilation_h=2, dilation_w=2,
                        has_bias=True)  # fmt: skip
    rounds.propose({"layer": dilated}, target, tmp_path / "other_work", tmp_path / "other", 1)
    library = next((tmp_path / "other").glob("*.so"))
    shutil.copy(library, tmp_path / "round" / entries[1]["library"])
    time_round(tmp_path / "round", tmp_path / "results.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert "run_secs" in lines[0]
    assert "differs from torchvision" in lines[1]["error"]
    assert all("run_secs" in line for line in lines[2:])
    summary = rounds.ingest(first, tmp_path / "results.jsonl", work)
    assert [(s.measured, s.failed) for s in summary] == [(len(entries) - 1, 1)]
    # The default's time in its own database, the others' but the failed one in the space's.
    key_dir = work / targets.hardware_key(target)
    assert len(records(key_dir / "default", LAYER)) == 1
    assert len(records(key_dir / rounds.SPACE, LAYER)) == len(entries) - 2


def test_a_backward_round_checks_every_gradient_and_ships_its_records(tmp_path):
    # The backward's gradients kernel in a round: the measuring script checks the offset's,
    # mask's, weight's and bias's gradients against torchvision's (a candidate of another
    # layer fails), and the ingest's pruned logs hold the backward's records.
    target = targets.host_target()
    work = tmp_path / "work"
    argv = ["tune-round", "--shape", json.dumps(dataclasses.asdict(LAYER)), "--op", "backward"]
    argv += ["--count", "2", "--work-dir", str(work), "--out", str(tmp_path / "round")]
    assert main([*argv, "--seed", "4"]) == 0
    described = json.loads((tmp_path / "round" / rounds.ROUND_FILE).read_text())
    ((name, workload),) = described["workloads"].items()
    assert name.endswith(":backward") and workload["op"] == "backward"
    names = [a["name"] for a in workload["args"]]
    assert {"grad_output", "grad_offset", "grad_mask", "grad_weight", "grad_bias"} <= set(names)
    entries = workload["candidates"]
    assert entries[0]["seed"] == "default"  # then the backward rule's own schedules
    assert len(entries) >= 2 and all(e["function"] == "deform_conv2d_backward" for e in entries)
    dilated = ConvShape(1, 16, 10, 10, 32, 3, 3, pad_h=2, pad_w=2, dilation_h=2, dilation_w=2,
                        has_bias=True)  # fmt: skip
    rounds.propose({"x": dilated}, target, tmp_path / "w2", tmp_path / "other", 1, ops=["backward"])
    library = next((tmp_path / "other").glob("*.so"))
    shutil.copy(library, tmp_path / "round" / entries[1]["library"])
    time_round(tmp_path / "round", tmp_path / "results.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert "run_secs" in lines[0], lines[0]
    assert re.search(r"grad_\w+ differs from torchvision", lines[1]["error"])
    logs = tmp_path / "logs"
    argv = ["tune-ingest", str(tmp_path / "round"), str(tmp_path / "results.jsonl")]
    assert main([*argv, "--work-dir", str(work), "--logs-dir", str(logs)]) == 0
    key = targets.hardware_key(target)
    handwritten = records(logs / key / rounds.SPACE, LAYER, "backward")
    assert len(handwritten) == min(3, len(entries) - 2)  # not the default's, nor the failed one
    assert len(records(logs / key / "default", LAYER, "backward")) == 1
    assert not records(logs / key / rounds.SPACE, LAYER)  # no forward was proposed


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_a_cuda_round_holds_cubins_and_the_launches_that_run_them(tmp_path, capsys, monkeypatch):
    for name in targets.CUDA_COMPILE_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TVM_CUDA_COMPILE_MODE", "nvcc")  # as the package sets it with nvcc
    layer = ConvShape(1, 64, 10, 10, 64, 3, 3, pad_h=1, pad_w=1, has_bias=True)
    argv = ["tune-round", "--shape", json.dumps(dataclasses.asdict(layer))]
    argv += ["--arch", "sm_90", "--multiprocessors", "132", "--count", "4"]
    argv += ["--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "round")]
    assert main([*argv, "--op", "all"]) == 0
    assert "MiB" in capsys.readouterr().out
    described = json.loads((tmp_path / "round" / rounds.ROUND_FILE).read_text())
    assert described["kind"] == "cuda"
    forward, backward = described["workloads"].values()
    assert forward["shape"]["in_channels"] == layer.in_channels
    assert [a["name"] for a in forward["args"]] == [
        "data", "offset", "mask", "weight", "bias", "output",
    ]  # fmt: skip
    assert backward["op"] == "backward"
    # Seeds first: the default, then each rule's own schedule, the wide tile's and the
    # pipelined one's among them.
    seeds = [e["seed"] for e in forward["candidates"] if "seed" in e]
    assert seeds[0] == "default"
    assert {"SampleOnceCUDA", "WideTileCUDA", "PipelinedCUDA"} <= set(seeds)
    assert backward["candidates"][0]["seed"] == "default"
    for workload in (forward, backward):
        names = {a["name"] for a in workload["args"]}
        written = set()
        for entry in workload["candidates"]:
            assert "error" not in entry, entry.get("error")
            cubin = (tmp_path / "round" / entry["cubin"]).read_bytes()
            assert cubin[:4] == b"\x7fELF"
            for launch in entry["launches"]:
                assert launch["kernel"].encode() in cubin
                assert launch["kernel"] in entry["resources"]
                # Every buffer argument is a parameter or a scratch buffer of the plan.
                buffers = {a for a in launch["args"] if isinstance(a, str)}
                assert buffers <= names | set(entry["scratch"])
                written |= buffers
                threads = launch["block"][0] * launch["block"][1] * launch["block"][2]
                assert 1 <= threads <= 1024 and min(launch["grid"]) >= 1
        outputs = {n for n in names if n == "output" or n.startswith("grad_")}
        assert outputs <= written
    assert forward["candidates"][0]["launches"][-1]["args"].count("output") == 1
    # Times of kernels built at another register-usage level than kernels build here now
    # would be of other machine code: ingesting them warns.
    (tmp_path / "times.jsonl").write_text("")
    round_file, work = tmp_path / "round" / rounds.ROUND_FILE, tmp_path / "work"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rounds.ingest(round_file, tmp_path / "times.jsonl", work)
    monkeypatch.setenv("TVM_CUDA_PTXAS_REG_LEVEL", "5")
    with pytest.warns(RuntimeWarning, match="ptxas level 5"):
        rounds.ingest(round_file, tmp_path / "times.jsonl", work)


@pytest.mark.parametrize(
    "shape, op",
    [
        (ConvShape(2, 64, 28, 28, 64, 3, 3, pad_h=1, pad_w=1), "forward"),
        (ConvShape(1, 512, 10, 10, 512, 3, 3, pad_h=1, pad_w=1), "backward"),
    ],
    ids=["forward_of_two_images", "backward_of_512_channels"],
)
def test_every_cuda_design_space_passes_metaschedules_postprocessors(shape, op):
    """The split reductions' spaces included (the forward's of a layer of two images, the
    weight gradient's of a 512-channel layer): ``RewriteReductionBlock`` takes the kernel that
    adds the parts, so the search can explore them, and each is a seed of a first round."""
    target = targets.cuda_target("sm_90", 132)
    context = rounds._context(shape, target, 0, op)
    spaces = rounds.named_design_spaces(op, context.mod["main"], target)
    assert len(spaces) >= 2  # one pass, and split
    postprocs = context.space_generator.postprocs
    assert all(rounds._postprocessed(sch.copy(), postprocs) for _, sch in spaces)
    seeds = rounds._seeds(context, shape, target, op, set())
    assert [(s.space, s.name) for s in seeds][0] == (rounds.DEFAULT_SPACE, "default")
    assert len(seeds) >= len(spaces)  # the default can be one of the spaces as generated


def test_a_space_that_a_postprocessor_raises_on_is_rejected():
    class Raises:
        def apply(self, sch):
            raise RuntimeError("ScheduleError: not a reduction block")

    class Takes:
        def apply(self, sch):
            return True

    assert rounds._postprocessed(None, [Takes()])
    assert not rounds._postprocessed(None, [Takes(), Raises()])


def test_the_measuring_script_launches_a_cuda_plan_as_written(tmp_path, monkeypatch):
    """``lab/time_round.py``'s CUDA path, with CuPy replaced by a recorder (no GPU here): each
    kernel of the plan is looked up in the cubin and launched in order with the plan's grid,
    block, shared memory and arguments (the round's tensors, its scratch buffers, int32
    sizes)."""
    monkeypatch.syspath_prepend(str(ROOT / "lab"))
    import time_round as script

    launched = []

    class Function:
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args, shared_mem=0):
            launched.append((self.name, grid, block, args, shared_mem))

    class RawModule:
        def __init__(self, path):
            assert Path(path).name == "c.cubin"

        def get_function(self, name):
            return Function(name)

    fake = types.SimpleNamespace(RawModule=RawModule, int32=int, asarray=lambda tensor: tensor)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    args = {"data": torch.zeros(2), "output": torch.zeros(3)}
    entry = {
        "cubin": "c.cubin",
        "scratch": {"columns": {"elements": 5, "dtype": "float32"}},
        "launches": [
            {"kernel": "k", "args": ["columns", "data"], "grid": [2, 3, 1], "block": [64, 4, 1],
             "shared_bytes": 0},
            {"kernel": "k_1", "args": ["columns", "output", 7], "grid": [9, 1, 1],
             "block": [256, 1, 1], "shared_bytes": 1024},
        ],
    }  # fmt: skip
    candidate = script.CudaCandidate(tmp_path, entry, dict(args))
    candidate()
    assert [(n, g, b, s) for n, g, b, _, s in launched] == [
        ("k", (2, 3, 1), (64, 4, 1), 0),
        ("k_1", (9, 1, 1), (256, 1, 1), 1024),
    ]
    columns, data = launched[0][3]
    assert data is args["data"] and columns.numel() == 5
    assert launched[1][3][0] is columns and launched[1][3][1] is args["output"]
    assert launched[1][3][2] == 7


def test_the_measuring_script_stops_where_a_candidate_breaks_the_cuda_context(
    tmp_path, monkeypatch
):
    """A candidate that leaves the CUDA context unusable is recorded with its error and ends
    the run with ``CONTEXT_LOST`` (the script then starts itself again); the next run goes on
    with the candidates after it, within a deadline counted from the first start."""
    monkeypatch.syspath_prepend(str(ROOT / "lab"))
    import time_round as script

    shape = dict(batch=1, in_channels=2, height=5, width=5, out_channels=3, kernel_h=3)
    shape |= dict(kernel_w=3, stride_h=1, stride_w=1, pad_h=1, pad_w=1, dilation_h=1)
    shape |= dict(dilation_w=1, weight_groups=1, offset_groups=1, dtype="float32")
    sizes = {"data": [1, 2, 5, 5], "offset": [1, 18, 5, 5], "mask": [1, 9, 5, 5]}
    sizes |= {"weight": [3, 2, 3, 3], "output": [1, 3, 25]}
    args = [{"name": n, "shape": s, "dtype": "float32"} for n, s in sizes.items()]
    candidates = [{"id": "a"}, {"id": "b"}, {"id": "c"}]
    workload = {"shape": shape, "args": args, "candidates": candidates}
    round_dir = tmp_path / "round"
    round_dir.mkdir()
    (round_dir / "round.json").write_text(
        json.dumps({"kind": "llvm", "workloads": {"seed": workload}})
    )

    class Candidate:
        """Writes torchvision's output, except candidate "b", which fails."""

        def __init__(self, directory, entry, values):
            self.entry, self.values = entry, values

        def __call__(self):
            if self.entry["id"] == "b":
                raise RuntimeError("an illegal memory access was encountered")
            self.values["output"].copy_(script.reference(workload, self.values)["output"])

        def seconds(self, number):
            return 1e-3

        def synchronize(self):
            pass

    monkeypatch.setattr(script, "LibraryCandidate", Candidate)
    monkeypatch.setattr(script, "context_lost", lambda cuda: True)
    out = tmp_path / "results.jsonl"
    command = [str(round_dir), "--out", str(out), "--deadline", "60"]

    def lines(path):
        return [json.loads(line) for line in path.read_text().splitlines()]

    assert script.main(command) == script.CONTEXT_LOST
    first = lines(out)
    assert [line["id"] for line in first] == ["a", "b"]
    assert "run_secs" in first[0] and "illegal memory access" in first[1]["error"]
    monkeypatch.setattr(script, "context_lost", lambda cuda: False)
    assert script.main(command) == 0
    second = lines(out)
    assert [line["id"] for line in second] == ["a", "b", "c"] and "run_secs" in second[2]
    # A restart past the deadline of the first start times nothing more.
    monkeypatch.setenv(script.STARTED, repr(time.time() - 120))
    late = tmp_path / "late.jsonl"
    assert script.main([str(round_dir), "--out", str(late), "--deadline", "60"]) == 0
    assert not late.exists() or not late.read_text().strip()
