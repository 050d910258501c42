"""Forward results against the float64 reference and against torchvision."""

from __future__ import annotations

import pytest
import torch
import torchvision.ops
from conftest import assert_close
from inputs import CONFIGS, make_inputs, shape_of
from reference import deform_conv2d_reference
from tvm_deform.schedules import apply_default

import tvm_deform
from tvm_deform import DeformConv2d, deform_conv2d
from tvm_deform.ir import definition
from tvm_deform.runtime import kernels, targets


def seed_inputs():
    data = torch.arange(150, dtype=torch.float32).reshape(2, 3, 5, 5)
    weight = torch.ones(5, 3, 3, 3)
    offset = torch.ones(2, 18, 3, 3)
    mask = torch.full((2, 9, 3, 3), 2.0)
    return data, offset, weight, mask


def test_seed_case_matches_torchvision_exactly():
    data, offset, weight, mask = seed_inputs()
    ours = deform_conv2d(data, offset, weight, mask=mask)
    theirs = torchvision.ops.deform_conv2d(data, offset, weight, mask=mask)
    assert torch.equal(ours, theirs)
    assert ours[1, 0, 2, 1].item() == 4338.0
    assert ours[1, 4, 0, 1].item() == 6102.0
    assert ours[0, 2].tolist() == [[1998, 2052, 1386], [2268, 2322, 1566], [1602, 1638, 1104]]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"cfg{i}" for i in range(len(CONFIGS))])
def test_random_configs_float64_match_reference(cfg):
    args = make_inputs(cfg, torch.float64)
    assert_close(deform_conv2d(**args), deform_conv2d_reference(**args), 1e-12, "float64")


@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"cfg{i}" for i in range(len(CONFIGS))])
def test_random_configs_float32_match_torchvision(cfg):
    args = make_inputs(cfg, torch.float32)
    ours = deform_conv2d(**args)
    assert ours.dtype == torch.float32
    assert_close(ours, torchvision.ops.deform_conv2d(**args), 1e-6, "vs torchvision")
    assert_close(ours, deform_conv2d_reference(**args), 1e-6, "vs float64 reference")


def test_realistic_layer_float32_matches_torchvision():
    cfg = dict(
        n=1,
        c=64,
        h=20,
        w=24,
        o=32,
        kh=3,
        kw=3,
        stride=(1, 1),
        padding=(1, 1),
        dilation=(1, 1),
        groups=1,
        offset_groups=1,
        use_mask=True,
        use_bias=True,
    )
    args = make_inputs(cfg, torch.float32)
    assert_close(deform_conv2d(**args), torchvision.ops.deform_conv2d(**args), 1e-6)


@pytest.mark.parametrize(
    "dtype, rtol", [(torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)], ids=["fp16", "bf16"]
)
@pytest.mark.parametrize("cfg", CONFIGS[:6], ids=[f"cfg{i}" for i in range(6)])
def test_half_precision_matches_upcast_reference(cfg, dtype, rtol):
    args = make_inputs(cfg, dtype)
    ours = deform_conv2d(**args)
    assert ours.dtype == dtype
    # The reference sees exactly the rounded inputs, so what remains is the output rounding
    # (half an ulp) plus float32 accumulation: far below what a float16 accumulator would give.
    assert_close(ours, deform_conv2d_reference(**args), rtol, str(dtype))


@pytest.mark.slow
def test_half_precision_accumulates_in_float32():
    # 4096 products of 1 + 2**-10 (exact in float16). Summed in float32, every partial sum is
    # exact and the total, 4100, is a float16 number. A float16 accumulator falls behind once
    # its spacing exceeds 2 (from 2048 on, each addition rounds to the nearer multiple of 2,
    # then of 4), and ends below 4100.
    data = torch.full((1, 4096, 1, 1), 1.0, dtype=torch.float16)
    weight = torch.full((1, 4096, 1, 1), 1.0 + 2.0**-10, dtype=torch.float16)
    offset = torch.zeros(1, 2, 1, 1, dtype=torch.float16)
    out = deform_conv2d(data, offset, weight)
    assert out.item() == 4100.0
    in_float16 = torch.zeros((), dtype=torch.float16)
    for value in (data.flatten() * weight.flatten()).tolist():
        in_float16 += value
    assert in_float16.item() < 4100.0


# Sample points along one axis exercising every branch of the bilinear rule.
EDGE_POINTS = [-2.0, -1.0, -0.999, -0.5, -1e-6, 0.0, 0.25, 2.5, 3.0, 3.5, 3.999, 4.0, 4.5, 7.0]


@pytest.mark.parametrize("axis", ["y", "x", "both"])
def test_boundary_points_match_reference_and_torchvision(axis):
    h = w = 4
    n_points = len(EDGE_POINTS)
    data = torch.randn(1, 2, h, w, dtype=torch.float64)
    weight = torch.randn(3, 2, 1, 1, dtype=torch.float64)
    # 1x1 kernel, no padding, output 4x4: put one sample point per output pixel.
    offset = torch.zeros(1, 2, h, w, dtype=torch.float64)
    coords = torch.tensor(EDGE_POINTS, dtype=torch.float64)
    grid = torch.arange(h * w, dtype=torch.float64).view(h, w)
    for index in range(h * w):
        oy, ox = divmod(index, w)
        point = coords[index % n_points]
        other = coords[(index * 5 + 3) % n_points]
        dy = (point if axis in ("y", "both") else float(oy)) - oy
        dx = (point if axis == "x" else other if axis == "both" else float(ox)) - ox
        offset[0, 0, oy, ox] = dy
        offset[0, 1, oy, ox] = dx
    del grid
    mask = torch.rand(1, 1, h, w, dtype=torch.float64)
    ours = deform_conv2d(data, offset, weight, mask=mask)
    assert_close(ours, deform_conv2d_reference(data, offset, weight, mask=mask), 1e-12)
    assert_close(ours, torchvision.ops.deform_conv2d(data, offset, weight, mask=mask), 1e-12)


def test_point_between_minus_one_and_zero_takes_part_of_row_zero():
    data = torch.ones(1, 1, 3, 3, dtype=torch.float64)
    weight = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    offset = torch.zeros(1, 2, 3, 3, dtype=torch.float64)
    offset[0, 0, 0, 1] = -0.5  # y = -0.5 at output (0, 1): half of row 0
    offset[0, 0, 1, 1] = -2.0  # y = -1 exactly: zero
    out = deform_conv2d(data, offset, weight)
    assert out[0, 0, 0, 1].item() == pytest.approx(0.5)
    assert out[0, 0, 1, 1].item() == 0.0
    assert out[0, 0, 2, 2].item() == 1.0


def test_huge_and_non_finite_offsets_are_zero_not_garbage():
    data = torch.randn(1, 2, 5, 5)
    weight = torch.randn(2, 2, 1, 1)
    offset = torch.zeros(1, 2, 5, 5)
    offset[0, 0, 0, 0] = 1e30
    offset[0, 1, 1, 1] = -1e30
    offset[0, 0, 2, 2] = float("inf")
    offset[0, 0, 3, 3] = float("nan")
    out = deform_conv2d(data, offset, weight)
    for y, x in ((0, 0), (1, 1), (2, 2), (3, 3)):
        assert torch.equal(out[0, :, y, x], torch.zeros(2))
    assert_close(
        out[0, :, 4, 4], torch.einsum("oc,c->o", weight[:, :, 0, 0], data[0, :, 4, 4]), 1e-6
    )


def test_integer_offsets_equal_shifted_conv():
    data = torch.randn(2, 4, 9, 9, dtype=torch.float64)
    weight = torch.randn(6, 4, 3, 3, dtype=torch.float64)
    offset = torch.zeros(2, 18, 7, 7, dtype=torch.float64)
    offset[:, 0::2] = 1.0  # every tap moved one row down
    shifted = torch.nn.functional.pad(data[:, :, 1:], (0, 0, 0, 1))
    assert_close(
        deform_conv2d(data, offset, weight),
        torch.nn.functional.conv2d(shifted, weight),
        1e-12,
    )


@pytest.mark.parametrize(
    "stride, padding, dilation, groups", [((1, 1), (1, 1), (1, 1), 1), ((2, 1), (0, 2), (1, 2), 2)]
)
def test_zero_offsets_without_mask_equal_conv2d(stride, padding, dilation, groups):
    data = torch.randn(2, 4, 11, 10, dtype=torch.float64)
    weight = torch.randn(6, 4 // groups, 3, 2, dtype=torch.float64)
    bias = torch.randn(6, dtype=torch.float64)
    expected = torch.nn.functional.conv2d(data, weight, bias, stride, padding, dilation, groups)
    offset = torch.zeros(2, 12, *expected.shape[2:], dtype=torch.float64)
    ours = deform_conv2d(data, offset, weight, bias, stride, padding, dilation)
    assert_close(ours, expected, 1e-12)


def test_ints_and_pairs_are_the_same():
    args = make_inputs(
        CONFIGS[0] | dict(stride=(2, 2), padding=(1, 1), dilation=(1, 1)), torch.float32
    )
    pairs = deform_conv2d(**args)
    ints = deform_conv2d(**(args | dict(stride=2, padding=1, dilation=1)))
    assert torch.equal(pairs, ints)


def test_empty_batch_returns_empty_output():
    data = torch.zeros(0, 3, 5, 5)
    out = deform_conv2d(data, torch.zeros(0, 18, 3, 3), torch.ones(4, 3, 3, 3))
    assert out.shape == (0, 4, 3, 3)
    assert torch.equal(
        out, torchvision.ops.deform_conv2d(data, torch.zeros(0, 18, 3, 3), torch.ones(4, 3, 3, 3))
    )


def test_non_contiguous_inputs():
    args = make_inputs(CONFIGS[3], torch.float32)
    strided = {
        k: (
            v.transpose(-1, -2).contiguous().transpose(-1, -2)
            if isinstance(v, torch.Tensor) and v.dim() == 4
            else v
        )
        for k, v in args.items()
    }
    assert not strided["input"].is_contiguous() or strided["input"].shape[-1] == 1
    assert torch.equal(deform_conv2d(**strided), deform_conv2d(**args))


def test_module_is_a_drop_in_for_torchvision():
    torch.manual_seed(3)
    ours = DeformConv2d(4, 6, 3, stride=1, padding=1, dilation=1, groups=2, bias=True)
    torch.manual_seed(3)
    theirs = torchvision.ops.DeformConv2d(4, 6, 3, stride=1, padding=1, dilation=1, groups=2)
    assert torch.equal(ours.weight, theirs.weight) and torch.equal(ours.bias, theirs.bias)
    ours.load_state_dict(theirs.state_dict())
    assert repr(ours).replace("tvm_deform.", "") == repr(theirs)
    x = torch.randn(2, 4, 8, 8)
    offset = torch.randn(2, 18, 8, 8)
    mask = torch.rand(2, 9, 8, 8)
    with torch.no_grad():
        assert_close(ours(x, offset, mask), theirs(x, offset, mask), 1e-6)
        assert_close(ours(x, offset), theirs(x, offset), 1e-6)


def test_module_without_bias():
    layer = DeformConv2d(3, 5, (3, 1), bias=False)
    assert layer.bias is None
    out = layer(torch.randn(1, 3, 6, 6), torch.zeros(1, 6, 4, 6))
    assert out.shape == (1, 5, 4, 6)


@pytest.mark.slow
def test_opcheck():
    args = make_inputs(CONFIGS[1] | dict(use_mask=True, use_bias=True), torch.float32)
    for mask, bias in ((args["mask"], args["bias"]), (None, None)):
        torch.library.opcheck(
            torch.ops.tvm_deform.deform_conv2d.default,
            (
                args["input"],
                args["offset"],
                args["weight"],
                bias,
                mask,
                *args["stride"],
                *args["padding"],
                *args["dilation"],
            ),
        )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    args = make_inputs(CONFIGS[2] | dict(use_mask=True, use_bias=True), torch.float32)
    compiled = torch.compile(deform_conv2d, fullgraph=True, backend=backend)
    assert torch.equal(compiled(**args), deform_conv2d(**args))


def kernel_layouts(monkeypatch) -> list[str]:
    """The input layout of every forward kernel looked up from now on, in order."""
    layouts = []
    get_kernel = kernels.get_kernel

    def spy(shape, target=None, tuned=None, layout="NCHW"):
        layouts.append(layout)
        return get_kernel(shape, target, tuned, layout)

    monkeypatch.setattr(kernels, "get_kernel", spy)
    return layouts


class _ConvThenDeform(torch.nn.Module):
    """A conv, then a DCN layer whose offsets and mask come from a conv beside it: the layout of
    the DCN's input is inductor's to choose."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.stem = torch.nn.Conv2d(4, 16, 3, padding=1)
        self.offsets = torch.nn.Conv2d(16, 27, 3, padding=1)
        self.weight = torch.nn.Parameter(torch.randn(8, 16, 3, 3, generator=generator) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x).relu()
        out = self.offsets(y)
        return deform_conv2d(y, out[:, :18], self.weight, padding=1, mask=out[:, 18:].sigmoid())


@pytest.mark.slow
def test_inductor_passes_its_channels_last_layout_in(monkeypatch):
    """The op takes any layout (``flexible_layout``): where inductor runs a model in
    channels_last, the op reads the DCN input in place with its NHWC kernel instead of inductor
    first copying the input to NCHW."""
    assert torch.Tag.flexible_layout in torch.ops.tvm_deform.deform_conv2d.default.tags
    import torch._inductor.config as inductor_config

    model = _ConvThenDeform().eval()
    x = torch.randn(1, 4, 12, 12)
    layouts = kernel_layouts(monkeypatch)
    with torch.inference_mode():
        expected = model(x)
        assert layouts == ["NCHW"]
        patch = dict(freezing=True, force_layout_optimization=True)
        with inductor_config.patch(patch):
            compiled = torch.compile(model, backend="inductor")(x)
    assert layouts[1:] == ["NHWC"]
    assert_close(compiled, expected, 1e-5, "inductor, channels_last")


def test_compiled_channels_last_model_copies_no_weight_per_call():
    """A channels_last model compiled with freezing: the op's weight reaches it NCHW-contiguous
    as a constant folded at compile time, not copied at every call."""
    import torch._inductor.config as inductor_config

    model = _ConvThenDeform().eval().to(memory_format=torch.channels_last)
    assert not model.weight.is_contiguous()
    x = torch.randn(1, 4, 12, 12).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        expected = model(x)
        with inductor_config.patch(freezing=True):
            compiled = torch.compile(model, backend="inductor")
            assert_close(compiled(x), expected, 1e-5, "inductor, channels_last model")
        with torch.profiler.profile(record_shapes=True) as profile:
            compiled(x)
    copies = [e.input_shapes for e in profile.events() if e.name in ("aten::copy_", "aten::clone")]
    assert list(model.weight.shape) not in [shape for shapes in copies for shape in shapes]


def test_public_api():
    assert tvm_deform.deform_conv2d is deform_conv2d
    assert "mask" in deform_conv2d.__doc__


WIDE = dict(
    n=2,
    c=16,
    h=9,
    w=8,
    o=8,
    kh=3,
    kw=3,
    stride=(1, 1),
    padding=(1, 1),
    dilation=(1, 1),
    groups=1,
    offset_groups=2,
    use_mask=True,
    use_bias=True,
)


# (configuration, whether its NCHW kernel samples along the channels from an NHWC copy)
CHANNELS_LAST_CASES = [
    (CONFIGS[0] | dict(c=2, offset_groups=1, groups=1), False),
    (WIDE, True),
    (WIDE | dict(o=16, groups=16), True),  # depthwise: the inline structure
]


@pytest.mark.parametrize(
    "cfg, nchw_copies", CHANNELS_LAST_CASES, ids=["narrow", "wide", "depthwise"]
)
def test_channels_last_input_is_sampled_in_place(cfg, nchw_copies, monkeypatch):
    args = make_inputs(cfg, torch.float32)
    expected = torchvision.ops.deform_conv2d(**args)
    layouts = kernel_layouts(monkeypatch)
    channels_last = args["input"].contiguous(memory_format=torch.channels_last)
    assert not channels_last.is_contiguous()
    ours = deform_conv2d(**(args | dict(input=channels_last)))
    assert layouts == ["NHWC"]
    assert ours.is_contiguous()
    assert_close(ours, expected, 2e-6, "channels_last")
    # Where the schedule samples along the channels, the NCHW kernel first copies the input to
    # NHWC; the NHWC kernel reads it where it is.
    shape = shape_of(cfg)
    scripts = {
        layout: apply_default(
            "forward", definition.forward(shape, layout), targets.host_target()
        ).mod.script()
        for layout in ("NCHW", "NHWC")
    }
    assert ("data_global" in scripts["NCHW"]) == nchw_copies
    assert "data_global" not in scripts["NHWC"]
