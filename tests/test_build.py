"""Build and dispatch: kernel caches, thread count, CPU affinity, targets."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import tvm

from tvm_deform import deform_conv2d
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels, targets

SHAPE = ConvShape(1, 3, 7, 6, 2, 3, 3, pad_h=1, pad_w=1, has_bias=True)


def call(shape: ConvShape = SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return deform_conv2d(
        torch.randn(shape.batch, shape.in_channels, shape.height, shape.width, generator=g),
        torch.randn(shape.batch, 18, shape.out_h, shape.out_w, generator=g),
        torch.randn(shape.out_channels, shape.in_channels, 3, 3, generator=g),
        torch.randn(shape.out_channels, generator=g),
        padding=1,
        mask=torch.rand(shape.batch, 9, shape.out_h, shape.out_w, generator=g),
    )


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TVM_DEFORM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TVM_DEFORM_CACHE", raising=False)
    kernels.clear_memory_cache()
    yield tmp_path
    kernels.clear_memory_cache()


def test_disk_cache_is_written_then_reused(cache_dir, monkeypatch):
    expected = call()
    entries = list(cache_dir.glob("*.so"))
    assert len(entries) == 1
    kernels.clear_memory_cache()

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled although the disk cache holds the kernel")

    monkeypatch.setattr(kernels, "compile_kernel", no_compile)
    assert torch.equal(call(), expected)


FILL_CACHE = textwrap.dedent(
    """
    import torch, tvm_deform
    out = tvm_deform.deform_conv2d(
        torch.ones(1, 2, 9, 9), torch.full((1, 18, 7, 7), 0.5), torch.ones(3, 2, 3, 3))
    print(float(out.sum()))
    """
)


@pytest.mark.slow
def test_corrupt_cache_entry_is_rebuilt(cache_dir):
    # Another process writes the entry: a library this process has loaded stays mapped (and
    # dlopen finds it again by its path), so only a fresh reader sees a corrupt file.
    env = dict(os.environ, TVM_DEFORM_CACHE_DIR=str(cache_dir))
    filled = subprocess.run(
        [sys.executable, "-c", FILL_CACHE], env=env, capture_output=True, text=True, check=True
    )
    (entry,) = cache_dir.glob("*.so")
    entry.write_bytes(b"not a shared library")
    with pytest.warns(RuntimeWarning, match="rebuilding kernel cache entry"):
        result = deform_conv2d(
            torch.ones(1, 2, 9, 9), torch.full((1, 18, 7, 7), 0.5), torch.ones(3, 2, 3, 3)
        )
    assert float(result.sum()) == float(filled.stdout)
    assert entry.stat().st_size > 100


def test_cache_can_be_turned_off(cache_dir, monkeypatch):
    monkeypatch.setenv("TVM_DEFORM_CACHE", "0")
    call()
    assert list(cache_dir.iterdir()) == []


def test_cache_key_separates_shapes_and_dtypes():
    target = targets.host_target()
    paths = {
        kernels.cache_path(SHAPE, target),
        kernels.cache_path(ConvShape(**{**SHAPE.__dict__, "dtype": "float64"}), target),
        kernels.cache_path(ConvShape(**{**SHAPE.__dict__, "stride_w": 2}), target),
        kernels.cache_path(ConvShape(**{**SHAPE.__dict__, "has_mask": False}), target),
    }
    assert len(paths) == 4


@pytest.mark.slow
def test_two_processes_fill_the_cache_at_once(tmp_path):
    script = FILL_CACHE
    env = dict(os.environ, TVM_DEFORM_CACHE_DIR=str(tmp_path))
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outputs[0] == outputs[1]
    assert len(list(tmp_path.glob("*.so"))) == 1
    assert list(tmp_path.glob("*.tmp")) == []


def test_tvm_pool_follows_torch_thread_count(monkeypatch):
    """With the launcher off, TVM's own pool is given torch's thread count at every call."""
    monkeypatch.setenv("TVM_DEFORM_LAUNCHER", "0")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        call()
        assert tvm.runtime.num_threads() == 1
        torch.set_num_threads(max(2, before))
        call()
        assert tvm.runtime.num_threads() == min(max(2, before), os.cpu_count())
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(os.cpu_count() < 2, reason="needs a pool of two threads to tell apart")
def test_tvm_pool_is_configured_in_every_calling_thread(monkeypatch):
    """TVM's pool is per calling thread: a count set in one thread says nothing of another's."""
    monkeypatch.setenv("TVM_DEFORM_LAUNCHER", "0")
    before = torch.get_num_threads()
    seen = []

    def run_in_thread():
        call()
        seen.append(tvm.runtime.num_threads())

    try:
        torch.set_num_threads(1)
        call()  # this thread's pool: 1
        thread = threading.Thread(target=run_in_thread)
        thread.start()
        thread.join(timeout=120)
        assert seen == [1]
    finally:
        torch.set_num_threads(before)


def test_python_threads_calling_at_once_get_the_right_values(cache_dir):
    shapes = [SHAPE, ConvShape(2, 3, 9, 8, 2, 3, 3, pad_h=1, pad_w=1, has_bias=True)]
    expected = {shape: call(shape) for shape in shapes}
    kernels.clear_memory_cache()
    results: list[tuple[ConvShape, torch.Tensor]] = []

    def worker(shape: ConvShape) -> None:
        for _ in range(3):
            results.append((shape, call(shape)))

    threads = [threading.Thread(target=worker, args=(shapes[i % 2],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(results) == 12
    for shape, result in results:
        assert torch.equal(result, expected[shape])


def test_a_compile_does_not_block_other_layers(cache_dir, monkeypatch):
    slow = ConvShape(1, 3, 11, 10, 5, 3, 3, pad_h=1, pad_w=1, has_bias=True)
    call()  # SHAPE is loaded
    release, started = threading.Event(), threading.Event()
    forward_schedule = kernels.schedules.forward_schedule

    def blocked_schedule(shape, *rest):
        if shape == slow.any_size():
            started.set()
            release.wait(timeout=120)
        return forward_schedule(shape, *rest)

    monkeypatch.setattr(kernels.schedules, "forward_schedule", blocked_schedule)
    other = ConvShape(1, 3, 8, 8, 4, 3, 3, pad_h=1, pad_w=1, has_bias=True)
    thread = threading.Thread(target=call, args=(slow,))
    thread.start()
    try:
        assert started.wait(timeout=120)
        # While ``slow`` compiles: a loaded shape and another new shape both go through.
        call()
        call(other)
        assert thread.is_alive()
    finally:
        release.set()
        thread.join(timeout=120)
    assert not thread.is_alive()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
def test_calls_leave_cpu_affinity_alone():
    before = os.sched_getaffinity(0)
    call(ConvShape(2, 3, 30, 30, 2, 3, 3, pad_h=1, pad_w=1, has_bias=True))
    assert os.sched_getaffinity(0) == before


def test_host_target_names_the_cpu():
    target = targets.host_target()
    assert target.kind.name == "llvm"
    assert target.attrs["mcpu"] == targets.host_cpu()
    assert targets.hardware_key(target) == f"llvm/{targets.host_cpu()}"
    # The cores this process may run on (taskset, a cgroup cpuset), not the machine's.
    assert int(target.attrs["num-cores"]) == len(os.sched_getaffinity(0))


def test_workload_key_lists_every_parameter():
    key = targets.workload_key(SHAPE, targets.host_target())
    for field in SHAPE.__dataclass_fields__:
        assert f'"{field}"' in key
    assert '"mcpu"' in key


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A plain (non-editable) wheel of the repository."""
    out = tmp_path_factory.mktemp("wheel")
    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(out), str(root)],
        check=True,
        cwd=out,
    )
    (built,) = out.glob("tvm_deform-*.whl")
    return built


#: every file a wheel may hold: the package's modules (schedules included), the suite, the
#: launcher sources, the pruned tuning logs and the wheel's metadata; no lab, tests or docs
WHEEL_ALLOW_LIST = [
    r"tvm_deform/([a-z_]+/)*[a-z_0-9]+\.py",
    r"tvm_deform/tools/suite\.json",
    r"tvm_deform/runtime/(launcher|workspace)\.cc",
    r"tvm_deform/tuning_logs/README\.md",
    r"tvm_deform/tuning_logs/(llvm|cuda)/[\w.-]+/(manifest|decisions)\.json",
    r"tvm_deform/tuning_logs/(llvm|cuda)/[\w.-]+/\w+/database_tuning_record\.json",
    r"tvm_deform/tuning_logs/(llvm|cuda)/[\w.-]+/\w+/database_workload\.json\.gz",
    r"tvm_deform-[\w.]+\.dist-info/(METADATA|RECORD|WHEEL|entry_points\.txt|top_level\.txt)",
    r"tvm_deform-[\w.]+\.dist-info/licenses/LICENSE",
]


def test_wheel_holds_the_package_and_only_allowed_files(wheel):
    """A plain wheel holds the schedules and the tuning logs, not only an editable install, and
    nothing else: no lab scripts, tests or docs."""
    import re
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    strays = [n for n in names if not any(re.fullmatch(p, n) for p in WHEEL_ALLOW_LIST)]
    assert not strays, f"files outside the wheel's allow-list: {strays}"
    for schedule in ("cpu.py", "cpu_backward.py", "cuda.py", "rule.py"):
        assert f"tvm_deform/schedules/{schedule}" in names
    for space in ("handwritten", "generic", "default"):
        assert f"tvm_deform/tuning_logs/llvm/znver4/{space}/database_tuning_record.json" in names
        assert f"tvm_deform/tuning_logs/llvm/znver4/{space}/database_workload.json.gz" in names
    for layer in ("ir", "runtime", "binding", "compat", "tools"):
        assert f"tvm_deform/{layer}/__init__.py" in names
    assert "tvm_deform/ir/definition.py" in names
    assert "tvm_deform/runtime/launcher.cc" in names
    assert "tvm_deform/runtime/workspace.cc" in names
    assert "tvm_deform/tools/suite.json" in names
    assert not [n for n in names if "gpu_session" in n or n.startswith("lab/")]


@pytest.mark.slow
def test_tune_on_an_installed_package_writes_nothing_under_site_packages(wheel, tmp_path):
    site, data = tmp_path / "site", tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
        + ["--target", str(site), str(wheel)],
        check=True,
    )
    before = {p: p.stat().st_mtime_ns for p in site.rglob("*")}
    env = {k: v for k, v in os.environ.items() if k != "TVM_DEFORM_LOGS"}
    env |= {
        "PYTHONPATH": str(site),
        "PYTHONDONTWRITEBYTECODE": "1",
        "XDG_DATA_HOME": str(data),
        "TVM_DEFORM_CACHE_DIR": str(tmp_path / "cache"),
    }
    shape = json.dumps(dataclasses.asdict(SHAPE))
    code = (
        "import tvm_deform, sys; assert 'site' in tvm_deform.__file__, tvm_deform.__file__; "
        "from tvm_deform.tools.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    subprocess.run(
        [sys.executable, "-c", code, "tune", "--shape", shape, "--trials", "0"]
        + ["--space", "handwritten", "--work-dir", str(tmp_path / "work")],
        check=True,
        cwd=tmp_path,
        env=env,
    )
    after = {p: p.stat().st_mtime_ns for p in site.rglob("*")}
    assert after == before, "tune wrote under the installed package"
    key = targets.hardware_key(targets.host_target())
    assert (data / "tvm_deform" / "tuning_logs" / key / "manifest.json").is_file()
