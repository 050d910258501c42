"""Backward kernels compiled ahead: a layer's first forward under autograd starts compiling the
kernels its backward will ask for, on a thread of their own, and only then."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torchvision.ops
import tvm
from conftest import assert_close
from torch._subclasses.fake_tensor import FakeTensorMode

from tvm_deform import deform_conv2d
from tvm_deform.binding import ops
from tvm_deform.runtime import background, kernels

NAMES = ("input", "offset", "weight", "bias", "mask")


@pytest.fixture
def preparing(tmp_path, monkeypatch):
    """Backward preparation on, an empty kernel cache, nothing in memory or asked for yet; the
    thread idle before the test ends."""
    monkeypatch.setenv("TVM_DEFORM_PREPARE_BACKWARD", "1")
    monkeypatch.setenv("TVM_DEFORM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TVM_DEFORM_SIZES", raising=False)
    monkeypatch.setattr(ops, "_backward_prepared", set())
    monkeypatch.setattr(background, "_prepared", set())
    kernels.clear_memory_cache()
    yield monkeypatch
    background.wait()
    kernels.clear_memory_cache()


def _inputs(channels: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    tensors = (
        torch.rand(2, channels, 9, 11),
        2 * torch.randn(2, 18, 9, 11),
        torch.rand(channels, channels, 3, 3),
        torch.rand(channels),
        torch.rand(2, 9, 9, 11),
    )
    return [t.requires_grad_() for t in tensors]


def _submitted(monkeypatch) -> list:
    """The jobs handed to the background thread from now on (not run)."""
    jobs = []
    monkeypatch.setattr(background._worker, "submit", jobs.append)
    return jobs


def test_the_backward_finds_its_kernels_compiled_by_the_forward(preparing):
    tensors = _inputs(5)
    input, offset, weight, bias, mask = tensors
    out = deform_conv2d(input, offset, weight, bias, padding=1, mask=mask)
    background.wait()

    def no_compile(*args, **kwargs):
        raise AssertionError("the backward compiled a kernel")

    preparing.setattr(tvm, "compile", no_compile)
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    expected = torchvision.ops.deform_conv2d(*leaves[:4], padding=1, mask=leaves[4])
    expected.backward(grad)
    for name, ours, theirs in zip(NAMES, tensors, leaves, strict=True):
        assert_close(ours.grad, theirs.grad, 1e-5, name)


def test_the_gradients_asked_for_are_the_ones_prepared(preparing):
    jobs = _submitted(preparing)
    input, offset, weight, bias, mask = _inputs(6)
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    deform_conv2d(input, offset, weight, bias, padding=1, mask=mask)
    deform_conv2d(input, offset, weight, bias, padding=1, mask=mask)  # the same call: once
    ((shape, gradients, _, _),) = background._prepared
    assert len(jobs) == 1 and shape.in_channels == 6 and shape.offset_grad_rule == "torchvision"
    assert (gradients.input, gradients.sampling, gradients.weight) == (True, True, False)


def test_nothing_is_prepared_without_a_backward_to_come(preparing):
    jobs = _submitted(preparing)
    tensors = _inputs(7)
    with torch.no_grad():
        deform_conv2d(*tensors[:4], padding=1, mask=tensors[4])
    with torch.inference_mode():
        deform_conv2d(*tensors[:4], padding=1, mask=tensors[4])
    deform_conv2d(*(t.detach() for t in tensors[:4]), padding=1, mask=tensors[4].detach())
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(t) for t in tensors]
        deform_conv2d(*fakes[:4], padding=1, mask=fakes[4])
    preparing.setenv("TVM_DEFORM_PREPARE_BACKWARD", "0")
    deform_conv2d(*tensors[:4], padding=1, mask=tensors[4])
    assert jobs == [] and background._prepared == set()


def test_a_process_that_exits_during_a_compile_exits_cleanly(tmp_path):
    code = (
        "import torch; from tvm_deform import deform_conv2d; "
        "x = torch.rand(1, 3, 8, 8, requires_grad=True); "
        "deform_conv2d(x, torch.randn(1, 18, 8, 8), torch.rand(3, 3, 3, 3), padding=1, "
        "mask=torch.rand(1, 9, 8, 8)); print('done')"
    )
    env = {"TVM_DEFORM_CACHE_DIR": str(tmp_path / "cache"), "TVM_DEFORM_PREPARE_BACKWARD": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("done")
