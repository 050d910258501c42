"""The launcher: CPU kernels run their parallel loops on torch's intra-op threads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from tvm_deform import deform_conv2d
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels, launcher, targets

#: the whole module is slow (many kernels, whole models or subprocesses): `pytest -m "not slow"`
#: leaves it out of the quick loop; CI runs it
pytestmark = pytest.mark.slow

# Big enough for several parallel tasks (pixel tiles), small enough to compile in seconds.
SHAPE = ConvShape(2, 16, 12, 13, 24, 3, 3, pad_h=1, pad_w=1, has_bias=True)


def inputs(seed: int = 0, grad: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    s = SHAPE
    tensors = {
        "input": torch.randn(s.batch, s.in_channels, s.height, s.width, generator=g),
        "offset": 2 * torch.randn(s.batch, 18, s.out_h, s.out_w, generator=g),
        "weight": torch.randn(s.out_channels, s.in_channels, 3, 3, generator=g),
        "bias": torch.randn(s.out_channels, generator=g),
        "mask": torch.rand(s.batch, 9, s.out_h, s.out_w, generator=g),
    }
    return {k: v.requires_grad_(grad) for k, v in tensors.items()}


def forward_and_grads(seed: int = 0) -> list[torch.Tensor]:
    args = inputs(seed, grad=True)
    out = deform_conv2d(padding=1, **args)
    grads = torch.autograd.grad(out, list(args.values()), torch.ones_like(out))
    return [out.detach(), *grads]


@pytest.fixture
def pool(monkeypatch):
    """Set the pool (``"torch"``: the launcher, ``"tvm"``: TVM's own) for one test."""

    def use(name: str) -> None:
        monkeypatch.setenv("TVM_DEFORM_LAUNCHER", "1" if name == "torch" else "0")

    monkeypatch.setenv("TVM_DEFORM_TUNED", "0")
    yield use
    torch.set_num_threads(os.cpu_count() or 1)


def test_launcher_is_built_and_attached(pool):
    pool("torch")
    assert launcher.enabled(), launcher.unavailable_reason
    deform_conv2d(padding=1, **inputs())
    path = kernels.any_size_path(SHAPE, targets.host_target())
    assert path.exists()
    assert launcher.launch_target(path) == launcher.get().address


def test_tvm_pool_when_turned_off(pool):
    pool("tvm")
    deform_conv2d(padding=1, **inputs())
    path = kernels.any_size_path(SHAPE, targets.host_target())
    assert path.exists()
    assert launcher.launch_target(path) not in (None, launcher.get().address)
    pool("torch")
    assert kernels.any_size_path(SHAPE, targets.host_target()) != path  # one file per pool


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_same_results_on_both_pools_at_any_thread_count(pool, threads):
    torch.set_num_threads(threads)
    pool("torch")
    assert launcher.get().threads() == threads
    ours = forward_and_grads()
    pool("tvm")
    theirs = forward_and_grads()
    for name, a, b in zip(("output", *inputs()), ours, theirs, strict=True):
        assert torch.equal(a, b), name


def test_two_python_threads_at_once(pool):
    pool("torch")
    expected = {seed: forward_and_grads(seed) for seed in range(4)}
    failures: list[str] = []

    def work(seeds: list[int]) -> None:
        for _ in range(5):
            for seed in seeds:
                got = forward_and_grads(seed)
                if not all(torch.equal(a, b) for a, b in zip(got, expected[seed], strict=True)):
                    failures.append(f"seed {seed}")

    workers = [
        threading.Thread(target=work, args=([0, 1],)),
        threading.Thread(target=work, args=([2, 3],)),
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert failures == []


# Counts the process's threads after torch's pool is up, then after our kernels ran: TVM's pool
# would add its workers, the launcher adds none.
#: the process's threads before and after three calls; the Python threads tvm_deform starts
#: (the launcher's build, which may still be ending when the calls return) are joined first,
#: so that what is counted is native threads: a thread pool
THREAD_COUNT = textwrap.dedent(
    """
    import os, threading, torch, tvm_deform
    torch.set_num_threads(2)
    x = torch.randn(1, 8, 20, 20)
    torch.nn.functional.conv2d(x, torch.randn(8, 8, 3, 3))
    before = len(os.listdir("/proc/self/task"))
    for _ in range(3):
        tvm_deform.deform_conv2d(
            x, torch.randn(1, 18, 18, 18), torch.randn(8, 8, 3, 3), mask=torch.rand(1, 9, 18, 18)
        )
    for thread in threading.enumerate():
        if thread.name == "tvm_deform launcher build":
            thread.join()
    print(before, len(os.listdir("/proc/self/task")))
    """
)


def run_python(code: str, tmp_path, **environment: str) -> subprocess.CompletedProcess:
    env = os.environ | {"TVM_DEFORM_CACHE_DIR": str(tmp_path), **environment}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr
    return result


def test_no_second_pool_is_started(tmp_path):
    result = run_python(THREAD_COUNT, tmp_path, TVM_DEFORM_LAUNCHER="1")
    before, after = map(int, result.stdout.split())
    assert after == before, result.stderr
    result = run_python(THREAD_COUNT, tmp_path, TVM_DEFORM_LAUNCHER="0")
    before, after = map(int, result.stdout.split())
    assert after > before, "TVM's pool started no thread: the test no longer tells the two apart"


def test_without_a_compiler_falls_back_with_one_warning(tmp_path):
    code = textwrap.dedent(
        """
        import warnings, torch, torchvision, tvm_deform
        from tvm_deform.runtime import launcher
        warnings.simplefilter("always")
        x, o, w = torch.randn(1, 4, 9, 9), torch.randn(1, 18, 7, 7), torch.randn(5, 4, 3, 3)
        with warnings.catch_warnings(record=True) as caught:
            ours = tvm_deform.deform_conv2d(x, o, w)
            tvm_deform.deform_conv2d(x, o, w)
        theirs = torchvision.ops.deform_conv2d(x, o, w)
        pool = [str(c.message) for c in caught if "TVM's own thread pool" in str(c.message)]
        print(len(pool), launcher.enabled(), float((ours - theirs).abs().max()))
        """
    )
    result = run_python(code, tmp_path, CXX="/nonexistent/c++", CC="/nonexistent/cc")
    warnings, enabled, error = result.stdout.split()
    assert (warnings, enabled) == ("1", "False"), result.stderr
    assert float(error) < 1e-5
