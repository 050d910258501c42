"""Ahead-of-time compiling: after ``precompile``, a model's forward and backward compile
nothing."""

from __future__ import annotations

import pytest
import torch
import torchvision.ops
import tvm
from conftest import assert_close

from tvm_deform import DeformConv2d, precompile
from tvm_deform.binding.precompile import layers_of
from tvm_deform.runtime import kernels


class TwoLayers(torch.nn.Module):
    """Two DCNv2 layers of different shapes, the second strided and channels_last-agnostic."""

    def __init__(self):
        super().__init__()
        self.offset1 = torch.nn.Conv2d(4, 27, 3, padding=1)
        self.dcn1 = DeformConv2d(4, 8, 3, padding=1)
        self.offset2 = torch.nn.Conv2d(8, 27, 3, stride=2, padding=1)
        self.dcn2 = DeformConv2d(8, 8, 3, stride=2, padding=1)

    def forward(self, x):
        dy_dx, mask = self.offset1(x).split([18, 9], dim=1)
        x = self.dcn1(x, dy_dx, mask.sigmoid()).relu()
        dy_dx, mask = self.offset2(x).split([18, 9], dim=1)
        return self.dcn2(x, dy_dx, mask.sigmoid())


def test_layers_of_finds_every_call_without_computing():
    model = TwoLayers()
    calls = layers_of(model, torch.rand(2, 4, 11, 13))
    assert [(c.shape.in_channels, c.shape.height, c.shape.stride_h) for c in calls] == [
        (4, 11, 1),
        (8, 11, 2),
    ]
    assert all(c.shape.batch == 2 and c.layout == "NCHW" for c in calls)


@pytest.mark.slow
def test_after_precompile_a_training_step_compiles_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("TVM_DEFORM_CACHE_DIR", str(tmp_path / "cache"))
    kernels.clear_memory_cache()
    torch.manual_seed(0)
    model, x = TwoLayers(), torch.rand(2, 4, 11, 13)
    shapes = precompile(model, x, backward=True, workers=2)
    assert len(shapes) == 2

    def no_compile(*args, **kwargs):
        raise AssertionError("a kernel was compiled after precompile")

    monkeypatch.setattr(tvm, "compile", no_compile)
    ours = model(x)
    ours.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for layer in (model.dcn1, model.dcn2):  # torchvision's op on the same parameters
        monkeypatch.setattr(layer, "forward", _torchvision_forward(layer))
    theirs = model(x)
    theirs.square().sum().backward()
    assert_close(ours, theirs, 1e-5)
    for mine, reference in zip(grads, [p.grad for p in model.parameters()], strict=True):
        assert_close(mine, reference, 1e-4)
    kernels.clear_memory_cache()


def _torchvision_forward(layer: DeformConv2d):
    def forward(x, offset, mask=None):
        return torchvision.ops.deform_conv2d(
            x, offset, layer.weight, layer.bias, layer.stride, layer.padding, layer.dilation, mask
        )

    return forward
