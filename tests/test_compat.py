"""NPU calling convention, layout converters, mmcv-style modules, precision diagnosis."""

from __future__ import annotations

import pytest
import torch
import torchvision.ops
from conftest import assert_close
from reference import bilinear
from test_forward import CONFIGS, make_inputs, seed_inputs

from tvm_deform import deform_conv2d
from tvm_deform.compat import (
    ModulatedDeformConv2d,
    ModulatedDeformConv2dPack,
    from_npu_offset,
    npu_deformable_conv2d,
    sampled_image,
    to_npu_offset,
)
from tvm_deform.compat.precision import diagnose, reduced_precision_deform_conv2d, round_mantissa


def test_npu_layout_is_mmcvs_index_select():
    dg, taps = 2, 9
    offset = torch.randn(1, 2 * dg * taps, 3, 4)
    mask = torch.rand(1, dg * taps, 3, 4)
    split = 2 * dg * taps
    sort_index = list(range(split))
    order = torch.tensor(sort_index[1::2] + sort_index[::2])  # mmcv's _calculate_sort_index
    expected = torch.cat([offset.index_select(1, order), mask], dim=1)
    packed = to_npu_offset(offset, mask)
    assert torch.equal(packed, expected)
    # channel j is the x offset of (group, tap) j, channel dg * taps + j its y offset
    assert torch.equal(packed[:, 3], offset[:, 2 * 3 + 1])
    assert torch.equal(packed[:, dg * taps + 3], offset[:, 2 * 3])


@pytest.mark.parametrize("dg", [1, 3])
def test_layout_round_trips(dg):
    offset = torch.randn(2, 2 * dg * 6, 5, 4)
    mask = torch.rand(2, dg * 6, 5, 4)
    back_offset, back_mask = from_npu_offset(to_npu_offset(offset, mask))
    assert torch.equal(back_offset, offset) and torch.equal(back_mask, mask)
    packed = torch.randn(2, 3 * dg * 6, 5, 4)
    assert torch.equal(to_npu_offset(*from_npu_offset(packed)), packed)


def test_seed_script_through_the_npu_adapter_gives_torchvision_exactly():
    data, offset, weight, mask = seed_inputs()
    offset_all = torch.cat([offset, mask], dim=1)  # the seed script's input, as written
    output, offset_out = npu_deformable_conv2d(
        data,
        weight,
        offset_all,
        None,
        kernel_size=[3, 3],
        stride=[1, 1, 1, 1],
        padding=[0, 0, 0, 0],
    )
    assert torch.equal(output, torchvision.ops.deform_conv2d(data, offset, weight, mask=mask))
    assert output[1, 0, 2, 1].item() == 4338.0
    assert offset_out.shape == (2, 3, 9, 9)


@pytest.mark.parametrize("seed", range(6))
def test_random_configs_through_the_adapter_match_torchvision(seed):
    cfg = CONFIGS[seed] | dict(use_mask=True)
    args = make_inputs(cfg, torch.float32, seed=seed)
    packed = to_npu_offset(args["offset"], args["mask"])
    sh, sw = args["stride"]
    ph, pw = args["padding"]
    dh, dw = args["dilation"]
    output, offset_out = npu_deformable_conv2d(
        args["input"],
        args["weight"],
        packed,
        args["bias"],
        kernel_size=[cfg["kh"], cfg["kw"]],
        stride=[1, 1, sh, sw],
        padding=[ph, ph, pw, pw],
        dilation=[1, 1, dh, dw],
        groups=cfg["groups"],
        deformable_groups=cfg["offset_groups"],
    )
    assert_close(output, torchvision.ops.deform_conv2d(**args), 1e-6)
    assert_close(offset_out, independent_sampled_image(args, cfg), 1e-6)


def independent_sampled_image(args, cfg) -> torch.Tensor:
    """offset_out computed sample by sample with the reference's bilinear rule."""
    x, offset, mask = args["input"].double(), args["offset"].double(), args["mask"].double()
    n, c = x.shape[:2]
    kh, kw = cfg["kh"], cfg["kw"]
    out_h, out_w = offset.shape[2:]
    dg = cfg["offset_groups"]
    per_group = c // dg
    out = torch.zeros(n, c, out_h * kh, out_w * kw, dtype=torch.float64)
    oy = torch.arange(out_h).view(-1, 1) * args["stride"][0] - args["padding"][0]
    ox = torch.arange(out_w).view(1, -1) * args["stride"][1] - args["padding"][1]
    for b in range(n):
        for g in range(dg):
            for i in range(kh):
                for j in range(kw):
                    k = i * kw + j
                    y = oy + i * args["dilation"][0] + offset[b, g * 2 * kh * kw + 2 * k]
                    xx = ox + j * args["dilation"][1] + offset[b, g * 2 * kh * kw + 2 * k + 1]
                    channels = slice(g * per_group, (g + 1) * per_group)
                    sample = bilinear(x[b, channels], y, xx) * mask[b, g * kh * kw + k]
                    out[b, channels, i::kh, j::kw] = sample
    return out


def test_sampled_image_of_integer_offsets_is_exact():
    data, offset, _, mask = seed_inputs()
    image = sampled_image(data, offset, (3, 3), mask=mask)
    # tap (i, j) of output (oy, ox) reads pixel (oy + i + 1, ox + j + 1), times mask 2
    assert image[1, 2, 0 * 3 + 1, 1 * 3 + 0].item() == 2 * data[1, 2, 0 + 1 + 1, 1 + 0 + 1]
    assert image[0, 0, 2 * 3 + 2, 2 * 3 + 2].item() == 0.0  # (5, 5): outside the 5x5 image


@pytest.mark.slow
def test_unmodulated_ignores_the_mask_channels():
    data, offset, weight, _ = seed_inputs()
    packed = torch.cat([offset, torch.full((2, 9, 3, 3), 7.0)], dim=1)
    output, _ = npu_deformable_conv2d(
        data, weight, packed, None, [3, 3], [1, 1, 1, 1], [0, 0, 0, 0], modulated=False
    )
    assert torch.equal(output, torchvision.ops.deform_conv2d(data, offset, weight))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(padding=[1, 0, 1, 1]), "asymmetric padding"),
        (dict(padding=[1, 1, 1]), "padding must be"),
        (dict(stride=[1, 1]), "stride must have 4 elements"),
        (dict(stride=[2, 1, 1, 1]), "stride must be 1 along N and C"),
        (dict(kernel_size=[3, 2]), "does not match the weight"),
        (dict(groups=3), "groups=3"),
        (dict(deformable_groups=2), "3 \\* deformable_groups"),
    ],
)
def test_adapter_errors(change, message):
    data, offset, weight, mask = seed_inputs()
    kwargs = dict(
        input=data,
        weight=weight,
        offset=torch.cat([offset, mask], 1),
        bias=None,
        kernel_size=[3, 3],
        stride=[1, 1, 1, 1],
        padding=[0, 0, 0, 0],
    )
    with pytest.raises(ValueError, match=message):
        npu_deformable_conv2d(**(kwargs | change))


def test_pack_module_learns_offsets_and_starts_as_a_plain_conv():
    torch.manual_seed(0)
    layer = ModulatedDeformConv2dPack(4, 6, 3, padding=1, deform_groups=2)
    assert layer.conv_offset.out_channels == 2 * 3 * 9
    x = torch.randn(2, 4, 7, 7)
    # zero-initialised offsets and mask logits: offsets 0, mask sigmoid(0) = 0.5
    expected = 0.5 * torch.nn.functional.conv2d(x, layer.weight, padding=1)
    expected += layer.bias.view(1, -1, 1, 1)
    with torch.no_grad():
        assert_close(layer(x), expected, 1e-6)
        # with learned (random) offset-conv weights it is torchvision's op on the split output
        torch.nn.init.normal_(layer.conv_offset.weight, std=0.1)
        out = layer.conv_offset(x)
        o1, o2, m = torch.chunk(out, 3, dim=1)
        ref = torchvision.ops.deform_conv2d(
            x, torch.cat([o1, o2], 1), layer.weight, layer.bias, padding=1, mask=m.sigmoid()
        )
        assert_close(layer(x), ref, 1e-6)


def test_pack_module_loads_an_mmcv_state_dict():
    layer = ModulatedDeformConv2dPack(4, 4, 3, padding=1)
    # mmcv's keys; an old (version < 2) checkpoint calls the offset conv conv_offset_mask
    state = {
        "weight": torch.randn(4, 4, 3, 3),
        "bias": torch.randn(4),
        "conv_offset_mask.weight": torch.randn(27, 4, 3, 3),
        "conv_offset_mask.bias": torch.randn(27),
    }
    layer.load_state_dict(state)
    assert torch.equal(layer.conv_offset.bias, state["conv_offset_mask.bias"])
    assert set(layer.state_dict()) == {"weight", "bias", "conv_offset.weight", "conv_offset.bias"}


def test_modulated_module_matches_function():
    layer = ModulatedDeformConv2d(4, 2, (3, 1), padding=(1, 0), bias=False)
    x = torch.randn(1, 4, 5, 5)
    offset = torch.randn(1, 6, 5, 5)
    mask = torch.rand(1, 3, 5, 5)
    with torch.no_grad():
        assert torch.equal(
            layer(x, offset, mask), deform_conv2d(x, offset, layer.weight, None, 1, (1, 0), 1, mask)
        )


def test_round_mantissa_is_float16_rounding():
    values = torch.randn(10000) * 1000
    assert torch.equal(round_mantissa(values, 10), values.half().float())
    assert torch.equal(round_mantissa(values, 7), values.bfloat16().float())


def test_diagnosis_reproduces_the_seed_report():
    data, offset, weight, mask = seed_inputs()
    report = diagnose(data, offset, weight, mask=mask, mantissa_bits=10, mode="io")
    assert report.float32[1, 0, 2, 1].item() == 4338.0
    assert report.reduced[1, 0, 2, 1].item() == 4336.0
    assert report.equals_rounded_float32
    npu = {
        6048: 6048,
        6102: 6104,
        4086: 4086,
        6318: 6320,
        6372: 6372,
        4266: 4264,
        4302: 4304,
        4338: 4336,
        2904: 2904,
    }
    for exact, printed in npu.items():
        where = report.float32 == exact
        assert where.any()
        assert (report.reduced[where] == printed).all()


@pytest.mark.slow
def test_accumulating_in_reduced_precision_drifts_more():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 32, 8, 8, generator=g)
    offset = 2 * torch.randn(1, 18, 8, 8, generator=g)
    weight = torch.randn(16, 32, 3, 3, generator=g) / 17
    io = diagnose(x, offset, weight, padding=1, mode="io")
    acc = diagnose(x, offset, weight, padding=1, mode="accumulate")
    assert 1e-5 < io.relative_difference < acc.relative_difference
    full = reduced_precision_deform_conv2d(x, offset, weight, padding=1, mantissa_bits=23)
    assert_close(full, io.float32, 1e-6)


def test_pack_module_under_autocast_follows_mmcv():
    """The offset conv returns bfloat16 under autocast; as in mmcv, the offset's dtype decides:
    input, weight and mask are cast to it, and so is the output."""
    torch.manual_seed(0)
    layer = ModulatedDeformConv2dPack(4, 6, 3, padding=1)
    torch.nn.init.normal_(layer.conv_offset.weight, std=0.3)
    x = torch.randn(2, 4, 7, 7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        raw = layer.conv_offset(x)
    assert raw.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    o1, o2, mask = torch.chunk(raw, 3, dim=1)
    expected = torchvision.ops.deform_conv2d(
        x.bfloat16().float(),
        torch.cat((o1, o2), dim=1).float(),
        layer.weight.bfloat16().float(),
        layer.bias.bfloat16().float(),
        padding=1,
        mask=torch.sigmoid(mask).float(),
    )
    assert_close(out.detach().float(), expected, rtol=1e-2, name="autocast output")


def test_mmcv_api_details():
    with pytest.warns(DeprecationWarning, match="deformable_groups"):
        layer = ModulatedDeformConv2d(4, 4, 3, deformable_groups=2)
    assert layer.deform_groups == 2
    assert layer.transposed is False and layer.output_padding == (0,)


# mmcv's own fixed expectations (tests/test_ops/test_modulated_deform_conv.py in mmcv): a 2x2
# pack layer with padding 1, weight 1, on a 3x3 input; its zero-initialised offset conv makes
# the border taps sample exactly at y = -1 or x = -1.
MMCV_INPUT = [[[[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]]]
MMCV_OUTPUT = [
    [[[0.5, 1.5, 2.5, 1.5], [1.0, 3.0, 5.0, 3.0], [1.0, 3.0, 5.0, 3.0], [0.5, 1.5, 2.5, 1.5]]]
]
MMCV_INPUT_GRAD = [[[[2.0, 2.0, 2.0], [2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]]]
MMCV_WEIGHT_GRAD = [[[[9.0, 9.0], [9.0, 9.0]]]]
MMCV_OFFSET_WEIGHT_GRAD = [
    [[[-7.0, -4.0], [0.0, 0.0]]],
    [[[-9.0, 7.5], [-6.0, 5.0]]],
    [[[-4.0, -7.0], [0.0, 0.0]]],
    [[[-7.5, -9.0], [-5.0, -6.0]]],
    [[[-7.0, -4.0], [-7.0, -4.0]]],
    [[[-6.0, 5.0], [-9.0, 7.5]]],
    [[[-4.0, -7.0], [-4.0, -7.0]]],
    [[[-5.0, -6.0], [-7.5, -9.0]]],
    [[[10.5, 6.0], [7.0, 4.0]]],
    [[[6.0, 10.5], [4.0, 7.0]]],
    [[[7.0, 4.0], [10.5, 6.0]]],
    [[[4.0, 7.0], [6.0, 10.5]]],
]
MMCV_OFFSET_BIAS_GRAD = [-3.0, -1.5, -3.0, -1.5, -3.0, -1.5, -3.0, -1.5, 4.5, 4.5, 4.5, 4.5]


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype, autocast",
    [
        (torch.float64, None),
        (torch.float32, None),
        (torch.float16, None),
        (torch.float32, torch.bfloat16),  # mmcv's AMP case, as a CPU autocast region
    ],
)
def test_pack_module_gives_mmcvs_fixed_gradients(dtype, autocast):
    x = torch.tensor(MMCV_INPUT, dtype=dtype, requires_grad=True)
    layer = ModulatedDeformConv2dPack(1, 1, (2, 2), stride=1, padding=1, bias=False)
    layer.weight.data.fill_(1.0)
    layer.to(dtype)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = layer(x)
    out.float().sum().backward()
    expect = {
        "output": (out, MMCV_OUTPUT),
        "input grad": (x.grad, MMCV_INPUT_GRAD),
        "weight grad": (layer.weight.grad, MMCV_WEIGHT_GRAD),
        "offset conv weight grad": (layer.conv_offset.weight.grad, MMCV_OFFSET_WEIGHT_GRAD),
        "offset conv bias grad": (layer.conv_offset.bias.grad, MMCV_OFFSET_BIAS_GRAD),
    }
    for name, (got, want) in expect.items():
        got = got.detach().double()
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-2), name


@pytest.mark.slow
def test_offset_grad_rule_differs_only_at_minus_one():
    """torchvision's rule (the plain op) keeps the right-hand derivative at exactly -1, mmcv's
    gives 0 there; elsewhere, and in the forward, the two agree."""
    from tvm_deform.binding.ops import deform_conv2d_with_offset_grad_rule

    x = torch.arange(9.0).reshape(1, 1, 3, 3)
    weight = torch.ones(1, 1, 2, 2)
    grads = {}
    for rule in ("torchvision", "mmcv"):
        offset = torch.zeros(1, 8, 4, 4, requires_grad=True)
        out = deform_conv2d_with_offset_grad_rule(x, offset, weight, None, 1, 1, 1, None, rule)
        out.sum().backward()
        grads[rule] = (out.detach(), offset.grad)
    assert torch.equal(grads["torchvision"][0], grads["mmcv"][0])
    differs = grads["torchvision"][1] != grads["mmcv"][1]
    assert differs.any()
    # Only the border taps (points at -1 with padding 1) differ.
    assert not differs[..., 1:3, 1:3].any()
    with pytest.raises(ValueError, match="offset_grad_rule"):
        deform_conv2d_with_offset_grad_rule(x, offset, weight, None, 1, 1, 1, None, "other")
