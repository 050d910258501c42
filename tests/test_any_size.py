"""Kernels for any size (CPU): one kernel per layer serves every batch, height and width; after
a model's first image nothing compiles, forward or backward; sizes no suite names (odd sizes,
1x1 maps, batch 0, a large batch) match torchvision and the per-size kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torchvision.ops
import tvm
from conftest import assert_close

from tvm_deform import DeformConv2d, deform_conv2d
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels, targets


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("TVM_DEFORM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TVM_DEFORM_SIZES", raising=False)
    kernels.clear_memory_cache()
    yield monkeypatch
    kernels.clear_memory_cache()


class Model(torch.nn.Module):
    """Two DCNv2 layers: 64 channels (whose structure changes at 512 output pixels, so it has
    two kernels for any size) and a strided 64-to-32 one with two offset groups."""

    def __init__(self):
        super().__init__()
        self.offset1 = torch.nn.Conv2d(64, 27, 3, padding=1)
        self.dcn1 = DeformConv2d(64, 64, 3, padding=1)
        self.offset2 = torch.nn.Conv2d(64, 54, 3, stride=2, padding=1)
        self.dcn2 = DeformConv2d(64, 32, 3, stride=2, padding=1)

    def forward(self, x):
        dy_dx, mask = self.offset1(x).split([18, 9], dim=1)
        x = self.dcn1(x, dy_dx, mask.sigmoid()).relu()
        dy_dx, mask = self.offset2(x).split([36, 18], dim=1)
        return self.dcn2(x, dy_dx, mask.sigmoid())


@pytest.mark.slow
def test_after_the_first_image_no_size_compiles_forward_or_backward(fresh):
    torch.manual_seed(0)
    model = Model()
    layer = ConvShape(1, 64, 12, 12, 64, 3, 3, pad_h=1, pad_w=1)
    from tvm_deform import schedules

    assert len(schedules.pixel_classes(layer, targets.host_target())) == 2
    model(torch.randn(1, 64, 12, 12)).sum().backward()  # the first image: 144 pixels

    def no_compile(*args, **kwargs):
        raise AssertionError("a kernel was compiled after the first image")

    fresh.setattr(tvm, "compile", no_compile)
    for size in [(2, 31, 30), (1, 17, 9), (3, 1, 1), (1, 40, 23)]:  # 930 pixels cross 512
        model.zero_grad()
        model(torch.randn(size[0], 64, *size[1:])).square().sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize(
    "n, h, w",
    [(1, 1, 1), (0, 7, 9), (17, 5, 6), (2, 37, 3), (1, 3, 41)],
    ids=["1x1", "batch0", "batch17", "tall", "wide"],
)
def test_sizes_no_suite_names_match_torchvision_and_the_per_size_kernels(fresh, n, h, w):
    generator = torch.Generator().manual_seed(n * 1000 + h * 10 + w)
    x = torch.randn(n, 8, h, w, generator=generator)
    offset = 2 * torch.randn(n, 2 * 2 * 9, h, w, generator=generator)
    mask = torch.rand(n, 2 * 9, h, w, generator=generator)
    weight = torch.randn(6, 4, 3, 3, generator=generator)  # two weight groups
    bias = torch.randn(6, generator=generator)
    results = {}
    for sizes in ("any", "static"):
        fresh.setenv("TVM_DEFORM_SIZES", sizes)
        leaves = [t.clone().requires_grad_() for t in (x, offset, weight, mask, bias)]
        out = deform_conv2d(*leaves[:3], leaves[4], padding=1, mask=leaves[3])
        grads = torch.autograd.grad(out.square().sum(), leaves) if n else ()
        results[sizes] = (out.detach(), *grads)
    # The same computation in the same order, up to the vector code's contractions.
    for ours, theirs in zip(*results.values(), strict=True):
        assert_close(ours, theirs, 1e-6)
    if n:
        expected = torchvision.ops.deform_conv2d(x, offset, weight, bias, padding=1, mask=mask)
        assert_close(results["any"][0], expected, 1e-6)


@pytest.mark.parametrize("channels, width", [(32, 13), (24, 7)], ids=["16-lane", "8-lane"])
def test_an_input_width_no_block_divides_matches_torchvision(fresh, channels, width):
    # The input is copied to NHWC a block of columns at a time; the row's last block is cut.
    generator = torch.Generator().manual_seed(channels + width)
    x = torch.randn(2, channels, 6, width, generator=generator)
    offset = 2 * torch.randn(2, 18, 6, width, generator=generator)
    mask = torch.rand(2, 9, 6, width, generator=generator)
    weight = torch.randn(8, channels, 3, 3, generator=generator)
    out = deform_conv2d(x, offset, weight, padding=1, mask=mask)
    expected = torchvision.ops.deform_conv2d(x, offset, weight, padding=1, mask=mask)
    assert_close(out, expected, 1e-5)


def test_a_tuned_shape_leaves_the_kernel_for_any_size_only_for_a_real_gain(tmp_path, monkeypatch):
    """This machine's logs hold records of three shapes: one that ran 20% faster than the
    default schedule when timed through the op at tuning time, one 2% faster, and one with no
    decision whose tuner times show 10%. Only the 20% and 10% shapes run a kernel of their own
    size: for 2%, compiling that kernel at the shape's first call would cost more than it
    saves."""
    import json

    from tvm_deform.runtime import records

    target = targets.host_target()
    key_dir = tmp_path / "logs" / targets.hardware_key(target)
    key_dir.mkdir(parents=True)
    shapes = {
        name: ConvShape(1, 24, 13, side, 24, 3, 3, pad_h=1, pad_w=1)
        for name, side in (("fast", 11), ("close", 12), ("undecided", 13))
    }

    def spaces(shape, default_ms, tuned_ms):
        entry = {"shape": dataclasses.asdict(shape)}
        return {
            "default": entry | {"best_ms": default_ms},
            "handwritten": entry | {"best_ms": tuned_ms},
        }

    manifest = {"workloads": {
        "fast": spaces(shapes["fast"], 1.0, 0.9),
        "close": spaces(shapes["close"], 1.0, 0.7),  # the tuner's times, overruled below
        "undecided": spaces(shapes["undecided"], 1.0, 0.9),
    }}  # fmt: skip
    decisions = {
        "a": {"workload": "fast", "choice": "handwritten",
              "median_ms": {"default": 1.0, "handwritten": 0.8}},
        "b": {"workload": "close", "choice": "handwritten",
              "median_ms": {"default": 1.0, "handwritten": 0.98}},
    }  # fmt: skip
    (key_dir / "manifest.json").write_text(json.dumps(manifest))
    (key_dir / records.LOGS_DECISIONS).write_text(json.dumps(decisions))
    monkeypatch.setenv("TVM_DEFORM_LOGS", str(tmp_path / "logs"))
    monkeypatch.delenv("TVM_DEFORM_SIZES", raising=False)
    records.forget_databases()
    tuned = records.tuned_shapes(target)
    assert {name for name, shape in shapes.items() if shape in tuned} == {"fast", "undecided"}
    assert not kernels.any_size(shapes["fast"], target, True)
    assert kernels.any_size(shapes["close"], target, True)
    assert kernels.any_size(shapes["fast"], target, False)  # TVM_DEFORM_TUNED=0
    assert not records.tuned_shapes(target, "backward") & set(shapes.values())
    records.forget_databases()
