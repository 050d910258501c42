"""The lab's scripts (``lab/``, not installed): the GPU run's, rehearsed on the CPU (the
session's checking, timing and tuning steps, and the check that what a device call carries
fits), and the schedule A/B's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gpu_session
import pytest

from tvm_deform.runtime import hardware
from tvm_deform.tools.suite import load_suite

#: the whole module is slow (many kernels, whole models or subprocesses): `pytest -m "not slow"`
#: leaves it out of the quick loop; CI runs it
pytestmark = pytest.mark.slow

SUITE = load_suite()


def test_gpu_session_steps_run_on_the_cpu(tmp_path):
    """The GPU session script's checking and timing steps, run on the CPU so that a GPU call
    does not find their bugs first."""

    from tvm_deform.ir.definition import ConvShape
    from tvm_deform.runtime import targets
    from tvm_deform.tools import rounds

    # A round of two tuning candidates of a small layer, built here for this CPU.
    layer = {"small": ConvShape(1, 8, 6, 6, 8, 3, 3, pad_h=1, pad_w=1)}
    rounds.propose(layer, targets.host_target(), tmp_path / "work", tmp_path / "round", 2)
    argv = ["--out", str(tmp_path), "--device", "cpu", "--checks", "2", "--quick"]
    argv += ["--model", "--model-size", "64", "--round", str(tmp_path / "round")]
    code = gpu_session.main(argv)
    results = json.loads((tmp_path / "gpu_results.json").read_text())
    assert code == 0, results
    assert results["first_kernel"]["value"]["passed"]
    # 2 suite layers and 2 check configurations, built in parallel processes
    assert results["build"]["ok"] and results["build"]["value"]["kernels"] == 4
    assert all(c["passed"] for c in results["check"]["value"])
    assert all(c["same_bits_twice"] for c in results["gradients"]["value"])
    timed = [r for r in results["time"]["value"] if r["implementation"] == "tvm_deform default"]
    assert timed and all(r["split_parts"] == 1 for r in timed)  # a CUDA rule
    assert results["gradients"]["ok"]
    large = results["large_batch"]["value"]
    assert results["large_batch"]["ok"] and large["forward_images"] > 65535
    carried = results["carried_records"]["value"]  # derived for any size, at two sizes
    assert [r["op"] for r in carried] == ["forward"] * 2 + ["backward"] * 2
    assert results["carried_records"]["ok"] and not any(r["fell_back"] for r in carried)
    assert "time_so_far" not in results
    table = (tmp_path / "gpu_results.md").read_text()
    assert "demo_64x56x56" in table and "speed-up over torchvision" in table
    backward = {(r["layer"], r["implementation"]): r for r in results["time_backward"]["value"]}
    for layer in ("seed", "demo_64x56x56"):
        assert backward[layer, "torchvision"]["median_ms"] > 0
        assert backward[layer, "conv2d (dense)"]["median_ms"] > 0
        assert backward[layer, gpu_session.PUBLIC_OP]["error"] < 1e-5
    assert "Geometric mean of torchvision / ours" in (tmp_path / "gpu_backward.md").read_text()
    costs = {(r["layer"], r["implementation"]) for r in results["host_cost"]["value"]}
    assert ("seed", gpu_session.PUBLIC_OP) in costs and ("seed", "torchvision") in costs
    profiled = {(r["layer"], r["implementation"]) for r in results["profile"]["value"]}
    assert profiled == {("demo_64x56x56", "torchvision"), ("demo_64x56x56", gpu_session.PUBLIC_OP)}
    assert all(r["us_per_step"] > 0 for r in results["profile"]["value"])
    assert "| demo_64x56x56 |" in (tmp_path / "gpu_profile.md").read_text()
    model = {r["implementation"]: r for r in results["model"]["value"]}
    assert model["torch + tvm_deform"]["error"] < 1e-5 and model["torch + torchvision"]["median_ms"]
    assert results["round"]["value"]["timed"] == 2
    assert len((tmp_path / "round_results.jsonl").read_text().splitlines()) == 2


def test_gpu_session_exits_non_zero_when_a_check_fails(tmp_path, monkeypatch):

    failing = [{"shape": {}, "dtype": "float32", "error": 1.0, "passed": False}]
    monkeypatch.setattr(gpu_session, "check_correctness", lambda device, count: failing)
    monkeypatch.setattr(gpu_session, "build_kernels", lambda shapes, device: {})
    code = gpu_session.main(["--out", str(tmp_path), "--device", "cpu", "--checks", "1", "--quick"])
    results = json.loads((tmp_path / "gpu_results.json").read_text())
    assert code == 1
    assert results["check"]["ok"] is False
    assert results["time"]["ok"] is True  # the later steps still ran


def test_gpu_session_times_the_defaults_before_tuning(tmp_path, monkeypatch):
    # The tuning's length is the least certain: torchvision, the default kernels and conv2d are
    # timed before it, the tuned kernels after it, and the table holds both.

    calls = []

    def time_layers(layers, device, dtypes, on_row, tuned=False):
        calls.append("time tuned" if tuned else "time")
        labels = ["tvm_deform tuned"] if tuned else ["torchvision", "tvm_deform default"]
        rows = [
            {"layer": "seed", "dtype": "float32", "implementation": label, "error": 0.0}
            | {"median_ms": 1.0 if label == "tvm_deform tuned" else 2.0}
            for label in labels
        ]
        for row in rows:
            on_row(row)
        return rows

    def tune_suite(layers, trials, seconds, work, device):
        calls.append("tune")
        assert list(layers)[0] != "seed"  # the largest layers first
        return {}

    monkeypatch.setattr(gpu_session, "time_layers", time_layers)
    monkeypatch.setattr(gpu_session, "tune_suite", tune_suite)
    monkeypatch.setattr(gpu_session, "_pack_logs", lambda logs, archive: [])
    monkeypatch.setattr(gpu_session, "first_kernel", lambda device: {"passed": True})
    monkeypatch.setattr(gpu_session, "build_kernels", lambda shapes, device: {})
    monkeypatch.setattr(gpu_session, "check_correctness", lambda device, count: [])
    monkeypatch.setattr(gpu_session, "check_gradients", lambda device: [])
    argv = ["--out", str(tmp_path), "--device", "cpu", "--quick", "--trials", "1"]
    assert gpu_session.main(argv) == 0
    assert calls == ["time", "tune", "time tuned"]
    results = json.loads((tmp_path / "gpu_results.json").read_text())
    assert results["tune"]["ok"] and results["time_tuned"]["ok"]
    assert "time_so_far" not in results
    table = (tmp_path / "gpu_results.md").read_text()
    assert "| seed | float32 | 2.000 | 2.000 | 1.000 |" in table and "2.00x" in table


def test_gpu_session_table_survives_a_call_killed_while_tuning(tmp_path, monkeypatch):
    # A device call that runs out of time is killed: the table of the rows timed before the
    # tuning must already be on disk.

    def time_layers(layers, device, dtypes, on_row, tuned=False):
        row = {"layer": "seed", "dtype": "float32", "implementation": "torchvision"}
        on_row(row | {"error": 0.0, "median_ms": 2.0})
        on_row(row | {"implementation": "tvm_deform default", "error": 0.0, "median_ms": 1.0})
        return []

    def killed(*args):
        raise KeyboardInterrupt  # stands for the kill: nothing after it runs

    monkeypatch.setattr(gpu_session, "time_layers", time_layers)
    monkeypatch.setattr(gpu_session, "tune_suite", killed)
    monkeypatch.setattr(gpu_session, "first_kernel", lambda device: {"passed": True})
    monkeypatch.setattr(gpu_session, "build_kernels", lambda shapes, device: {})
    monkeypatch.setattr(gpu_session, "check_correctness", lambda device, count: [])
    monkeypatch.setattr(gpu_session, "check_gradients", lambda device: [])
    argv = ["--out", str(tmp_path), "--device", "cpu", "--quick", "--trials", "1"]
    with pytest.raises(KeyboardInterrupt):
        gpu_session.main(argv)
    table = (tmp_path / "gpu_results.md").read_text()
    assert "| seed | float32 | 2.000 | 1.000 |" in table and "2.00x" in table


def test_gpu_session_keeps_timing_when_an_implementation_fails(monkeypatch):
    # As torchvision's CUDA op in bfloat16: the row records the failure, the others are timed.

    def no_kernel(*args, **kwargs):
        raise RuntimeError("no kernel for this dtype")

    monkeypatch.setattr(gpu_session, "_our_kernel", no_kernel)
    seen = []
    rows = gpu_session.time_layers(
        {"seed": SUITE["seed"]}, "cpu", runs=3, on_row=lambda row: seen.append(row)
    )
    assert seen == rows
    by_name = {row["implementation"]: row for row in rows}
    assert by_name["tvm_deform default"]["median_ms"] is None
    assert "no kernel" in by_name["tvm_deform default"]["failure"]
    assert by_name["torchvision"]["median_ms"] > 0 and by_name["conv2d (dense)"]["median_ms"] > 0
    table = gpu_session.markdown(rows)
    assert "| seed | float32 |" in table and " - |" in table
    assert gpu_session.speedup_over_torchvision(rows) is None


def test_gpu_session_times_the_schedules_dispatch_does_not_pick(monkeypatch):
    # Beside our kernels, the session times the public op as users call it; on a GPU the fused
    # structure and the kernel for the layer's size alone (also built at ptxas's own
    # register-usage level); where tensor cores take a layer, the tensor-core schedule (all
    # stood for here by the CPU's default kernel). Each has a column of its own, which the
    # speed-up over torchvision leaves out.
    from tvm_deform.runtime import kernels

    def cpu_kernel(shape, target):
        return kernels.get_kernel(shape, target, tuned=False)

    monkeypatch.setattr(gpu_session.schedules, "split_parts", lambda shape, target: 4)
    monkeypatch.setattr(gpu_session.schedules, "tensor_cores_take", lambda *args, **options: True)
    monkeypatch.setattr(gpu_session, "compares_structures", lambda target: True)
    monkeypatch.setattr(gpu_session, "_fused_kernel", cpu_kernel)
    monkeypatch.setattr(gpu_session, "_one_size_kernel", cpu_kernel)
    monkeypatch.setattr(gpu_session, "_pipelined_kernel", cpu_kernel)
    monkeypatch.setattr(gpu_session, "_tensor_core_kernel", cpu_kernel)
    monkeypatch.setattr(gpu_session, "_tensor_core_any_size_kernel", cpu_kernel)
    monkeypatch.setattr(gpu_session, "times_wide_tile", lambda shape, target: True)
    monkeypatch.setattr(gpu_session, "times_register_level", lambda shape, target: True)
    monkeypatch.setattr(gpu_session, "_wide_tile_kernel", cpu_kernel)
    rows = gpu_session.time_layers({"seed": SUITE["seed"]}, "cpu", runs=3)
    by_name = {r["implementation"]: r for r in rows}
    assert by_name["tvm_deform default"]["split_parts"] == 4
    header, _, line = gpu_session.markdown(rows).splitlines()
    columns = (
        (gpu_session.PUBLIC_OP, 6),
        (gpu_session.FUSED, 7),
        (gpu_session.ONE_SIZE, 8),
        (gpu_session.FUSED_AT_LEVEL, 9),
        (gpu_session.ONE_SIZE_AT_LEVEL, 10),
        (gpu_session.WIDE, 11),
        (gpu_session.PIPELINED, 12),
        (gpu_session.TENSOR_CORES, 13),
        (gpu_session.TENSOR_CORES_ANY_SIZE, 14),
    )
    for label, column in columns:
        assert by_name[label]["median_ms"] > 0 and by_name[label]["error"] < 1e-6
        assert line.split("|")[column].strip() == f"{by_name[label]['median_ms']:.3f}"
    assert [header.split("|")[c].strip() for c in range(6, 16)] == [
        "public op ms",
        "fused ms",
        "one size ms",
        "fused, ptxas level 5 ms",
        "one size, ptxas level 5 ms",
        "wide tile ms",
        "pipelined ms",
        "tensor cores ms",
        "tensor cores, any size ms",
        "conv2d ms",
    ]
    ours = by_name["tvm_deform default"]["median_ms"]
    expected = by_name["torchvision"]["median_ms"] / ours
    assert gpu_session.speedup_over_torchvision(rows) == pytest.approx(expected)


def test_gpu_session_builds_the_extra_schedules_before_timing(monkeypatch):
    # Compiled in the parallel build step, not one at a time inside the timing: once the
    # build step has run, timing every schedule compiles nothing.
    import tvm

    from tvm_deform import schedules
    from tvm_deform.ir import definition
    from tvm_deform.runtime import kernels

    levels = []  # ptxas's register-usage level each was built at

    def cpu_kernel(shape, target):  # stands for the fused, one-size, wide and tensor-core ones
        levels.append(os.environ.get("TVM_CUDA_PTXAS_REG_LEVEL"))
        func = definition.forward(shape)
        return kernels.load_scheduled(
            shape, target, "extra", lambda: schedules.apply_default("forward", func, target)
        )

    monkeypatch.setenv("TVM_DEFORM_TUNED", "0")
    monkeypatch.delenv("TVM_CUDA_PTXAS_REG_LEVEL", raising=False)
    monkeypatch.setattr(gpu_session.schedules, "tensor_cores_take", lambda *args, **options: True)
    monkeypatch.setattr(gpu_session, "compares_structures", lambda target: True)
    monkeypatch.setattr(gpu_session, "_fused_kernel", cpu_kernel)
    monkeypatch.setattr(gpu_session, "_one_size_kernel", cpu_kernel)
    monkeypatch.setattr(gpu_session, "_pipelined_kernel", cpu_kernel)
    monkeypatch.setattr(gpu_session, "_tensor_core_kernel", cpu_kernel)
    monkeypatch.setattr(gpu_session, "_tensor_core_any_size_kernel", cpu_kernel)
    monkeypatch.setattr(gpu_session, "times_wide_tile", lambda shape, target: True)
    monkeypatch.setattr(gpu_session, "times_register_level", lambda shape, target: True)
    monkeypatch.setattr(gpu_session, "_wide_tile_kernel", cpu_kernel)
    kernels.clear_memory_cache()
    gpu_session._build_one(SUITE["seed"], "cpu")
    # The fused structure and the kernel for one size, at ptxas's own level too.
    assert levels.count(str(gpu_session.PTXAS_LEVEL)) == 2 and None in levels
    assert "TVM_CUDA_PTXAS_REG_LEVEL" not in os.environ
    kernels.clear_memory_cache()  # the timing process finds them in the disk cache

    def no_compile(*args, **kwargs):
        raise AssertionError("a kernel was compiled while timing")

    monkeypatch.setattr(tvm, "compile", no_compile)
    rows = gpu_session.time_layers({"seed": SUITE["seed"]}, "cpu", runs=3)
    by_name = {r["implementation"]: r for r in rows}
    for label in (
        "tvm_deform default",
        gpu_session.FUSED,
        gpu_session.FUSED_AT_LEVEL,
        gpu_session.ONE_SIZE_AT_LEVEL,
        gpu_session.WIDE,
        gpu_session.PIPELINED,
        gpu_session.TENSOR_CORES,
        gpu_session.TENSOR_CORES_ANY_SIZE,
    ):
        assert by_name[label]["median_ms"] > 0 and by_name[label]["error"] < 1e-6, label


def test_every_device_call_fits(tmp_path):
    # What a GPU session carries: the working tree in every call, one part of TVM's packed
    # install per call, and a round of tuning candidates beside it.
    root = Path(__file__).resolve().parent.parent
    script = ["bash", str(root / "lab" / "check_carry_sizes.sh")]
    assert subprocess.run(script, capture_output=True, cwd=root).returncode == 0

    def part(mib: int) -> str:
        path = tmp_path / f"site.tar.xz.part-{mib}"
        with open(path, "wb") as file:
            file.truncate(mib * 1024 * 1024)
        return str(path)

    result = subprocess.run([*script, part(41)], capture_output=True, text=True, cwd=root)
    assert result.returncode == 1 and "a part may carry at most 40 MiB" in result.stdout
    round_dir = tmp_path / "round"
    round_dir.mkdir()
    (round_dir / "candidates.bin").write_bytes(bytes(22 * 1024 * 1024))
    run = {"cwd": root, "capture_output": True, "text": True}
    assert subprocess.run([*script, part(34)], **run).returncode == 0
    env = {**os.environ, "ROUND": str(round_dir)}
    with_round = subprocess.run([*script, part(38)], env=env, **run)
    assert with_round.returncode == 1 and "a call may carry at most 60 MiB" in with_round.stdout


def test_schedule_ab_compares_a_commits_functions_call_by_call():
    """``lab/schedule_ab.py`` builds both sides' kernels and times them alternately: the
    committed backward schedule against the tree's (the same code in a clean checkout) gives
    one row per layer, and the same bits."""
    root = Path(__file__).resolve().parents[1]
    command = [
        *(sys.executable, "lab/schedule_ab.py", "--commit", "HEAD", "--gradients", "all"),
        *("--function", "BackwardCPU.apply", "--layers", "seed,demo_64x56x56", "--pairs", "2"),
    ]
    run = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith(("| seed", "| demo"))]
    assert len(rows) == 2
    assert all(row.split("|")[-2].strip() == "0.0e+00" for row in rows), rows


def test_schedule_ab_compares_a_commits_definition_on_a_suite_file(tmp_path):
    """A definition module's TVMScript function (which its parser reads back from a source
    file) of the committed tree against the working tree's, on a layer of a suite file, both
    compiled for AVX2 where this CPU runs AVX2 code."""
    root = Path(__file__).resolve().parents[1]
    suite = tmp_path / "layers.json"
    layer = dict(batch=1, in_channels=32, height=8, width=9, out_channels=32, kernel_h=3)
    layer |= dict(kernel_w=3, pad_h=1, pad_w=1, weight_groups=32)
    suite.write_text(json.dumps({"small_depthwise": layer}))
    command = [
        *(sys.executable, "lab/schedule_ab.py", "--commit", "HEAD", "--gradients", "input"),
        *("--module", "tvm_deform/ir/definition.py", "--function", "_grad_input_blocks"),
        *("--suite", str(suite), "--layers", "small_depthwise", "--pairs", "2"),
    ]
    cpu = hardware.detect()
    avx2 = cpu.machine == "x86_64" and "avx2" in cpu.flags
    command += ["--avx2"] if avx2 else []
    run = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert ("compiled for AVX2 (x86-64-v3)" in run.stdout.splitlines()[0]) == avx2
    rows = [line for line in run.stdout.splitlines() if line.startswith("| small_depthwise")]
    assert len(rows) == 1
    assert rows[0].split("|")[-2].strip() == "0.0e+00", rows


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_sass_reads_the_gemm_loop_of_each_variant(tmp_path):
    """``lab/cuda_sass.py`` builds a layer's kernels for sm_90 and reads their machine code:
    the GEMM's hottest loop is mostly FFMA, with the default's 4 x 4 block and the wide one's
    8 x 8 (16 and 64 accumulators: twice the multiply-adds per operand read from shared
    memory); on tensor cores it multiplies with HMMA, loads its fragments with LDSM and fills
    shared memory with LDGSTS (cp.async), no plain global load in the loop."""
    import cuda_sass

    try:
        cuda_sass.find_cuobjdump(None)
    except SystemExit:
        pytest.skip("no cuobjdump")
    rows = {}
    for variant in ("default", "wide", "tensor-cores"):
        out = tmp_path / f"{variant}.md"
        argv = ["--workload", "r50dcn320_c4_256x20x20", "--variant", variant, "--out", str(out)]
        assert cuda_sass.main(argv) == 0
        rows[variant] = {
            line.split("|")[2].strip(): [cell.strip() for cell in line.split("|")[3:-1]]
            for line in out.read_text().splitlines()
            if line.startswith("| r50dcn320")
        }
    per_operand = {}
    for variant in ("default", "wide"):
        gemm = rows[variant]["deform_conv2d_kernel_1"]
        ffma, share = int(gemm[2]), int(gemm[-1].rstrip("%"))
        loads, vectors = (int(n) for n in gemm[4].replace("(", "").replace(")", "").split())
        assert ffma >= 64 and share >= 50, (variant, gemm)
        per_operand[variant] = ffma / (loads - vectors + 4 * vectors)  # 16-byte loads: 4
    assert per_operand["wide"] >= 1.5 * per_operand["default"], per_operand
    gemm = rows["tensor-cores"]["deform_conv2d_kernel_1"]
    hmma, ldsm, global_loads, ldgsts = int(gemm[3]), int(gemm[5]), gemm[6], int(gemm[7])
    assert hmma >= 8 and ldsm > 0 and ldgsts > 0 and global_loads == "0 (0)", gemm


def test_the_session_times_the_wide_tile_on_float32_gpu_layers_it_takes():
    import dataclasses

    from tvm_deform.runtime import targets

    gpu, cpu = targets.cuda_target("sm_90", 132), targets.host_target()
    demo = SUITE["demo_64x56x56"]
    assert gpu_session.times_wide_tile(demo, gpu)
    assert not gpu_session.times_wide_tile(dataclasses.replace(demo, dtype="float16"), gpu)
    assert not gpu_session.times_wide_tile(SUITE["depthwise_128x56x56"], gpu)
    assert not gpu_session.times_wide_tile(demo, cpu)


def test_the_session_times_float32_gpu_kernels_at_ptxas_own_register_level(monkeypatch):
    """The fused structure and the default's kernel for one size are also built at ptxas's
    own register-usage level (float32, on a GPU), for that build alone."""
    import dataclasses

    from tvm_deform.runtime import targets

    gpu, cpu = targets.cuda_target("sm_90", 132), targets.host_target()
    demo = SUITE["demo_64x56x56"]
    assert gpu_session.times_register_level(demo, gpu)
    assert not gpu_session.times_register_level(dataclasses.replace(demo, dtype="float16"), gpu)
    assert not gpu_session.times_register_level(demo, cpu)
    for before in ("7", None):
        if before is None:
            monkeypatch.delenv("TVM_CUDA_PTXAS_REG_LEVEL")
        else:
            monkeypatch.setenv("TVM_CUDA_PTXAS_REG_LEVEL", before)
        seen = gpu_session._at_ptxas_level(
            lambda shape, target: targets.compile_settings(target), demo, gpu
        )
        assert f"ptxas level {gpu_session.PTXAS_LEVEL}," in seen
        assert os.environ.get("TVM_CUDA_PTXAS_REG_LEVEL") == before


def test_per_call_times_every_route(capsys):
    import per_call

    assert per_call.main(["--rounds", "1", "--calls", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 9 and all(float(row.split("|")[2]) > 0 for row in rows[1:])
