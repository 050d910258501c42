"""Gradients: against torchvision's, finite differences, determinism, autograd integration."""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch
import torchvision.ops
from conftest import assert_close
from inputs import CONFIGS, DEPTHWISE_CONFIGS, WIDE_CONFIGS, make_inputs, shape_of
from tvm_deform.schedules import cpu_backward
from tvm_deform.schedules.common import lanes as vector_lanes

from tvm_deform import DeformConv2d, deform_conv2d, schedules
from tvm_deform.ir import definition
from tvm_deform.ir.definition import ConvShape, Gradients
from tvm_deform.runtime import calls, dispatch, hardware, kernels, records, targets

#: the whole module is slow (many kernels, whole models or subprocesses): `pytest -m "not slow"`
#: leaves it out of the quick loop; CI runs it
pytestmark = pytest.mark.slow

DIFFERENTIABLE = ("input", "offset", "weight", "bias", "mask")


def gradients(fn, args: dict, grad_output: torch.Tensor | None = None, seed: int = 1):
    """(output, {name: gradient}) of ``fn(**args)`` for a random (or the given) grad_output."""
    leaves = {
        name: args[name].detach().clone().requires_grad_()
        for name in DIFFERENTIABLE
        if args[name] is not None
    }
    output = fn(**(args | leaves))
    if grad_output is None:
        g = torch.Generator().manual_seed(seed)
        grad_output = torch.randn(output.shape, generator=g, dtype=torch.float64)
    output.backward(grad_output.to(output.dtype))
    return output, {name: leaf.grad for name, leaf in leaves.items()}


def assert_gradients_close(ours: dict, theirs: dict, rtol: float, label: str = "") -> None:
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name] is not None, f"no gradient for {name}"
        assert ours[name].dtype == theirs[name].dtype, f"{label} grad_{name} dtype"
        assert_close(ours[name], theirs[name], rtol, f"{label} grad_{name}")


@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"cfg{i}" for i in range(len(CONFIGS))])
def test_float32_gradients_match_torchvision(cfg):
    args32 = make_inputs(cfg, torch.float32)
    args64 = make_inputs(cfg, torch.float64)
    _, ours = gradients(deform_conv2d, args32)
    _, exact = gradients(torchvision.ops.deform_conv2d, args64)
    _, theirs = gradients(torchvision.ops.deform_conv2d, args32)
    assert_gradients_close(ours, theirs, 2e-5, "vs torchvision float32")
    for name in ours:
        assert_close(ours[name], exact[name], 5e-6, f"grad_{name} vs torchvision float64")


@pytest.mark.parametrize("cfg", CONFIGS[:8], ids=[f"cfg{i}" for i in range(8)])
def test_float64_gradients_match_torchvision(cfg):
    args = make_inputs(cfg, torch.float64)
    _, ours = gradients(deform_conv2d, args)
    _, theirs = gradients(torchvision.ops.deform_conv2d, args)
    assert_gradients_close(ours, theirs, 1e-12)


GRADCHECK_CONFIGS = [
    dict(n=1, c=2, h=5, w=4, o=2, kh=3, kw=3, stride=(1, 1), padding=(1, 1), dilation=(1, 1)),
    dict(n=2, c=4, h=6, w=5, o=2, kh=2, kw=3, stride=(2, 1), padding=(0, 1), dilation=(1, 2)),
    dict(n=1, c=6, h=5, w=5, o=3, kh=3, kw=1, stride=(1, 2), padding=(2, 0), dilation=(2, 1)),
]


@pytest.mark.parametrize("groups, offset_groups", [(1, 1), (2, 2)], ids=["g1", "g2og2"])
@pytest.mark.parametrize("cfg", GRADCHECK_CONFIGS, ids=["3x3", "strided", "dilated"])
@pytest.mark.parametrize("use_mask", [True, False], ids=["mask", "nomask"])
def test_gradcheck_float64(cfg, groups, offset_groups, use_mask):
    cfg = cfg | dict(groups=groups, offset_groups=offset_groups, use_mask=use_mask, use_bias=True)
    if cfg["c"] % (groups * offset_groups) or cfg["o"] % groups:
        cfg["c"], cfg["o"] = 4, 2
    args = make_inputs(cfg, torch.float64)
    names = [name for name in DIFFERENTIABLE if args[name] is not None]
    tensors = tuple(args[name].clone().requires_grad_() for name in names)

    def fn(*tensors):
        return deform_conv2d(**(args | dict(zip(names, tensors, strict=True))))

    assert torch.autograd.gradcheck(fn, tensors, eps=1e-6, atol=1e-7, rtol=1e-5)


def boundary_offsets(h: int, w: int, out_h: int, out_w: int, taps: int) -> torch.Tensor:
    """Offsets that put sample points exactly on the corners of the contract: at -1, between -1
    and 0, on 0, on H - 1, between H - 1 and H, on H, beyond, and at random positions."""
    special_y = [-1.0, -0.5, 0.0, h - 1.0, h - 0.5, float(h), h + 0.5, -1.5, 0.25, 2.0]
    special_x = [0.5, -1.0, w - 0.5, -0.25, float(w), 1.0, w - 1.0, -2.0, 0.75, 1.5]
    offset = torch.zeros(1, 2 * taps, out_h, out_w, dtype=torch.float64)
    index = 0
    for k in range(taps):
        i, j = divmod(k, 3)
        for oy in range(out_h):
            for ox in range(out_w):
                # Sample point = oy - 1 + i + dy with padding 1 and a 3x3 kernel.
                target_y = special_y[index % len(special_y)]
                target_x = special_x[(index // 3) % len(special_x)]
                offset[0, 2 * k, oy, ox] = target_y - (oy - 1 + i)
                offset[0, 2 * k + 1, oy, ox] = target_x - (ox - 1 + j)
                index += 1
    return offset


def test_boundary_points_match_torchvision():
    h, w = 4, 5
    cfg = dict(
        n=1,
        c=3,
        h=h,
        w=w,
        o=2,
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
    args = make_inputs(cfg, torch.float64)
    args["offset"] = boundary_offsets(h, w, h, w, 9)
    _, ours = gradients(deform_conv2d, args)
    _, theirs = gradients(torchvision.ops.deform_conv2d, args)
    assert_gradients_close(ours, theirs, 1e-12)
    # torchvision's grad_offset has no outer test: a point exactly at y = -1 (x inside) gets
    # the derivative of its right-hand side, which is not zero. Ours must do the same.
    y = torch.arange(h).view(1, h, 1) - 1 + torch.arange(3).repeat_interleave(3).view(9, 1, 1)
    at_minus_one = (args["offset"][0, 0::2] + y) == -1.0
    j = torch.arange(3).repeat(3).view(9, 1, 1)
    x = args["offset"][0, 1::2] + torch.arange(w).view(1, 1, w) - 1 + j
    inside_x = (x > -1) & (x < w - 1)
    chosen = at_minus_one & inside_x
    assert chosen.any()
    assert (ours["offset"][0, 0::2][chosen] != 0).any()


def test_zero_offsets_give_conv2d_gradients():
    cfg = CONFIGS[0] | dict(use_mask=False, use_bias=True, groups=1, offset_groups=1)
    args = make_inputs(cfg, torch.float64)
    args["offset"] = torch.zeros_like(args["offset"])
    out, ours = gradients(deform_conv2d, args)
    leaves = {name: args[name].clone().requires_grad_() for name in ("input", "weight", "bias")}
    conv = torch.nn.functional.conv2d(
        leaves["input"],
        leaves["weight"],
        leaves["bias"],
        args["stride"],
        args["padding"],
        args["dilation"],
    )
    g = torch.Generator().manual_seed(1)
    conv.backward(torch.randn(out.shape, generator=g, dtype=torch.float64))
    for name, leaf in leaves.items():
        assert_close(ours[name], leaf.grad, 1e-12, f"grad_{name}")


@pytest.mark.parametrize(
    "dtype, rtol", [(torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)], ids=["fp16", "bf16"]
)
@pytest.mark.parametrize(
    "cfg",
    CONFIGS[:4] + WIDE_CONFIGS[:3],
    ids=[f"cfg{i}" for i in range(4)] + ["wide0", "wide1", "wide2"],
)
def test_half_precision_gradients_match_upcast_torchvision(cfg, dtype, rtol):
    args = make_inputs(cfg, dtype)
    upcast = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    g = torch.Generator().manual_seed(1)
    out_shape = deform_conv2d(**args).shape
    grad_output = torch.randn(out_shape, generator=g, dtype=torch.float64).to(dtype)
    _, ours = gradients(deform_conv2d, args, grad_output)
    _, theirs = gradients(torchvision.ops.deform_conv2d, upcast, grad_output.double())
    for name in ours:
        assert ours[name].dtype == dtype
        assert_close(ours[name], theirs[name], rtol, f"{dtype} grad_{name}")


def test_gradients_are_bit_identical_across_runs_and_thread_counts():
    cfg = dict(
        n=2,
        c=16,
        h=12,
        w=11,
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
    args = make_inputs(cfg, torch.float32, offset_scale=3.0)
    _, first = gradients(deform_conv2d, args)
    threads = torch.get_num_threads()
    try:
        runs = []
        for count in (threads, 1, threads):
            torch.set_num_threads(count)
            runs.append(gradients(deform_conv2d, args)[1])
    finally:
        torch.set_num_threads(threads)
    for run in runs:
        for name in first:
            assert torch.equal(run[name], first[name]), name


def test_opcheck_with_autograd():
    args = make_inputs(CONFIGS[1] | dict(use_mask=True, use_bias=True), torch.float64)
    for mask, bias in ((args["mask"], args["bias"]), (None, None)):
        leaves = [
            t.clone().requires_grad_() if t is not None else None
            for t in (args["input"], args["offset"], args["weight"], bias, mask)
        ]
        torch.library.opcheck(
            torch.ops.tvm_deform.deform_conv2d.default,
            (*leaves, *args["stride"], *args["padding"], *args["dilation"]),
        )


def test_opcheck_backward_op():
    args = make_inputs(CONFIGS[3] | dict(use_mask=True, use_bias=True), torch.float32)
    out = deform_conv2d(**args)
    torch.library.opcheck(
        torch.ops.tvm_deform.deform_conv2d_backward.default,
        (
            torch.randn_like(out),
            args["input"],
            args["offset"],
            args["weight"],
            args["mask"],
            True,
            *args["stride"],
            *args["padding"],
            *args["dilation"],
        ),
    )


def test_backward_op_checks_grad_output():
    args = make_inputs(CONFIGS[3] | dict(use_mask=False, use_bias=False), torch.float32)
    with pytest.raises(ValueError, match="grad_output"):
        torch.ops.tvm_deform.deform_conv2d_backward(
            torch.zeros(1, 1, 1, 1),
            args["input"],
            args["offset"],
            args["weight"],
            None,
            False,
            *args["stride"],
            *args["padding"],
            *args["dilation"],
        )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_backward(backend):
    args = make_inputs(CONFIGS[2] | dict(use_mask=True, use_bias=True), torch.float32)
    compiled = torch.compile(deform_conv2d, fullgraph=True, backend=backend)
    out_c, compiled_grads = gradients(compiled, args)
    out_e, eager_grads = gradients(deform_conv2d, args)
    assert torch.equal(out_c, out_e)
    for name in eager_grads:
        assert torch.equal(compiled_grads[name], eager_grads[name]), name


# Subsets of the differentiable arguments that require gradients, covering every kernel variant.
REQUIRED = [
    ("weight",),
    ("bias",),
    ("input",),
    ("offset",),
    ("mask", "weight"),
    ("input", "offset", "mask"),
    ("input", "weight", "bias"),
]


@pytest.mark.parametrize("required", REQUIRED, ids=["+".join(r) for r in REQUIRED])
def test_backward_computes_only_the_gradients_asked_for(required, monkeypatch):
    args = make_inputs(CONFIGS[0] | dict(use_mask=True, use_bias=True), torch.float32)
    _, full = gradients(deform_conv2d, args)
    asked = []
    get_backward = kernels.get_backward

    def spy(shape, *rest, gradients, **kwargs):
        asked.append(gradients)
        return get_backward(shape, *rest, gradients=gradients, **kwargs)

    monkeypatch.setattr(kernels, "get_backward", spy)
    leaves = {name: args[name].detach().clone().requires_grad_(name in required) for name in full}
    output = deform_conv2d(**(args | leaves))
    g = torch.Generator().manual_seed(1)
    output.backward(torch.randn(output.shape, generator=g, dtype=torch.float64).float())
    assert asked == [
        Gradients(
            input="input" in required,
            sampling="offset" in required or "mask" in required,
            weight="weight" in required or "bias" in required,
        )
    ]
    for name, leaf in leaves.items():
        if name in required:
            assert torch.equal(leaf.grad, full[name]), name
        else:
            assert leaf.grad is None, name


class TinyDetector(torch.nn.Module):
    """A conv predicting offsets and mask, then a deformable conv: a DCNv2 block."""

    def __init__(self, deform: torch.nn.Module):
        super().__init__()
        self.offset_mask = torch.nn.Conv2d(4, 27, 3, padding=1)
        self.deform = deform

    def forward(self, x):
        offset_mask = self.offset_mask(x)
        offset, mask = offset_mask[:, :18], torch.sigmoid(offset_mask[:, 18:])
        return self.deform(x, offset, mask)


def test_training_steps_track_torchvision():
    torch.manual_seed(0)
    ours = TinyDetector(DeformConv2d(4, 6, 3, padding=1, bias=True))
    theirs = TinyDetector(torchvision.ops.DeformConv2d(4, 6, 3, padding=1, bias=True))
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 4, 9, 10)
    target = torch.randn(2, 6, 9, 10)
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    for _ in range(5):
        for model, optimiser in zip((ours, theirs), optimisers, strict=True):
            optimiser.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            optimiser.step()
    for (name, a), (_, b) in zip(
        ours.state_dict().items(), theirs.state_dict().items(), strict=True
    ):
        assert_close(a, b, 1e-5, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cfg", WIDE_CONFIGS, ids=lambda cfg: None)
def test_wide_layers_gradients_match_torchvision(cfg, dtype):
    """Layers wide enough for the CPU's vectors of channels: the weight's gradient vectorised
    along the channels, the input's scatter in blocks of channels."""
    shape = shape_of(cfg, dtype)
    assert schedules.grad_input_channel_block(shape, targets.host_target()) > 1
    _, ours = gradients(deform_conv2d, make_inputs(cfg, dtype))
    _, exact = gradients(torchvision.ops.deform_conv2d, make_inputs(cfg, torch.float64))
    for name in ours:
        assert_close(ours[name], exact[name], 5e-6 if dtype == torch.float32 else 1e-12, name)


def _two_vector_layers() -> list[dict]:
    """Dense layers whose weight gradient takes two vectors of channels a task on this CPU
    (``cpu_backward._weight_vectors``): offset groups of two vectors of channels per core, in
    one offset group and in two."""
    target = targets.host_target()
    per_group = 2 * vector_lanes(target, "float32") * int(target.attrs["num-cores"])
    return [
        WIDE_CONFIGS[1] | dict(c=per_group, offset_groups=1),
        WIDE_CONFIGS[5] | dict(c=2 * per_group, offset_groups=2),
    ]


def test_weight_gradient_tasks_take_two_vectors_of_one_offset_group_where_cores_allow():
    assert cpu_backward._weight_vectors(64, 16, 2) == 2
    assert cpu_backward._weight_vectors(128, 16, 2) == 2
    assert cpu_backward._weight_vectors(64, 16, 4) == 1  # two tasks for four cores
    assert cpu_backward._weight_vectors(16, 16, 2) == 1  # one vector an offset group
    assert cpu_backward._weight_vectors(48, 16, 1) == 1  # three vectors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cfg", _two_vector_layers(), ids=["one_group", "two_groups"])
def test_weight_gradient_two_vectors_a_task_matches_torchvision(cfg, dtype):
    shape = shape_of(cfg, dtype)
    target = targets.host_target()
    per_group = shape.in_channels // shape.offset_groups
    lanes = vector_lanes(target, shape.accumulator_dtype)
    assert cpu_backward._weight_vectors(per_group, lanes, int(target.attrs["num-cores"])) == 2
    _, ours = gradients(deform_conv2d, make_inputs(cfg, dtype))
    _, exact = gradients(torchvision.ops.deform_conv2d, make_inputs(cfg, torch.float64))
    for name in ours:
        assert_close(ours[name], exact[name], 5e-6 if dtype == torch.float32 else 1e-12, name)


#: depthwise layers: random ones, and two whose channels fill vectors (the weight's gradient
#: vectorised along the channels; the first with channels-last column gradients too)
DEPTHWISE_BACKWARD = DEPTHWISE_CONFIGS[:4] + [
    DEPTHWISE_CONFIGS[0] | dict(c=64, o=64, groups=64, offset_groups=1),
    DEPTHWISE_CONFIGS[1] | dict(c=32, o=32, groups=32, offset_groups=2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cfg", DEPTHWISE_BACKWARD, ids=lambda cfg: None)
def test_depthwise_layers_gradients_match_torchvision(cfg, dtype):
    _, ours = gradients(deform_conv2d, make_inputs(cfg, dtype))
    _, exact = gradients(torchvision.ops.deform_conv2d, make_inputs(cfg, torch.float64))
    for name in ours:
        assert_close(ours[name], exact[name], 5e-6 if dtype == torch.float32 else 1e-12, name)


def test_depthwise_weight_gradient_tasks_take_up_to_four_vectors_where_cores_allow():
    rule = cpu_backward._depthwise_weight_vectors
    assert rule(128, 128, 16, 2) == 4
    assert rule(512, 512, 16, 2) == 4
    assert rule(64, 64, 16, 2) == 2  # four vectors would leave a core idle
    assert rule(128, 32, 16, 2) == 2  # two vectors an offset group
    assert rule(64, 16, 16, 2) == 1  # one vector an offset group
    assert rule(128, 128, 16, 16) == 1  # eight tasks of one vector for sixteen cores
    assert rule(48, 48, 16, 1) == 1  # three vectors


def _depthwise_vector_layers() -> list[dict]:
    """Depthwise layers whose weight gradient takes four, and two, vectors of channels a task
    on this CPU in float32 (``cpu_backward._depthwise_weight_vectors``), the first with
    blocks of four vectors in the input's scatter too (``cpu_backward.grad_input_block``); a
    3x3 and a 5x5 kernel, with a mask and without."""
    target = targets.host_target()
    per_core = vector_lanes(target, "float32") * int(target.attrs["num-cores"])
    base = dict(n=2, h=9, w=11, stride=(1, 1), dilation=(1, 1), use_bias=True)
    four, two = 4 * per_core, 2 * per_core
    return [
        base
        | dict(c=four, o=four, groups=four, offset_groups=1, use_mask=True)
        | dict(kh=3, kw=3, padding=(1, 1)),
        base
        | dict(c=two, o=two, groups=two, offset_groups=1, use_mask=False)
        | dict(kh=5, kw=5, padding=(2, 2)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cfg", _depthwise_vector_layers(), ids=["four", "two"])
def test_depthwise_weight_gradient_in_vectors_a_task_matches_torchvision(cfg, dtype):
    shape = shape_of(cfg, dtype)
    target = targets.host_target()
    lanes = vector_lanes(target, shape.accumulator_dtype)
    cores = int(target.attrs["num-cores"])
    if dtype == torch.float32:
        expected = 4 if cfg["kh"] == 3 else 2
        rule = cpu_backward._depthwise_weight_vectors
        assert rule(shape.in_channels, shape.in_channels, lanes, cores) == expected
        # the input's scatter fills four vectors of channels a block where each core gets one
        block = cpu_backward.grad_input_block(shape, target)
        assert block == (4 * lanes if expected == 4 else lanes)
    _, ours = gradients(deform_conv2d, make_inputs(cfg, dtype))
    _, exact = gradients(torchvision.ops.deform_conv2d, make_inputs(cfg, torch.float64))
    for name in ours:
        assert_close(ours[name], exact[name], 5e-6 if dtype == torch.float32 else 1e-12, name)


@pytest.mark.parametrize("block", [4, 8, 16])
def test_the_input_scatter_in_blocks_of_channels_gives_the_same_bits(block):
    """Blocks of channels add every sample into the input's gradient in the same order as a
    plane per channel: the same bits, for any size and one size."""
    shape = ConvShape(2, 32, 9, 13, 8, 3, 3, pad_h=1, pad_w=1, offset_groups=2)
    target = targets.host_target()
    g = torch.Generator().manual_seed(0)
    for sizes in ("static", "symbolic"):
        quantum = 16
        buffers = definition.backward_buffer_shapes(shape, quantum=quantum, any_size=True)
        pixels = buffers["grad_columns"][-1]
        rows_shape, coef_shape = buffers["sample_rows"], buffers["sample_coef"]
        args = [
            torch.randn(buffers["grad_columns"], generator=g),
            torch.randint(0, shape.height, rows_shape, generator=g, dtype=torch.int32),
            torch.randint(0, shape.width, rows_shape, generator=g, dtype=torch.int32),
            torch.randn(coef_shape, generator=g),
        ]
        # the column gradient laid out [n, p, k * channels + c], as the CPU's backward writes it
        n, c, k, p = buffers["grad_columns"]
        channels_last = args[0].permute(0, 3, 2, 1).contiguous().view(n, p, k * c)
        results = []
        for channel_block, layout in ((1, False), (block, False), (block, True)):
            func = definition.grad_input(shape, sizes, quantum, channel_block, layout)
            sch = schedules.apply_default("grad_input", func, target)
            kernel = kernels.compile_schedule(sch, target)["deform_conv2d_grad_input"]
            result = torch.empty(shape.batch, shape.in_channels, shape.height, shape.width)
            kernel(channels_last if layout else args[0], *args[1:], result)
            results.append(result)
        assert pixels % quantum == 0
        assert torch.equal(results[0], results[1]), sizes
        assert torch.equal(results[0], results[2]), sizes
    with pytest.raises(ValueError, match="channel block"):
        definition.grad_input(shape, channel_block=32)
    with pytest.raises(ValueError, match="blocks of channels"):
        definition.grad_input(shape, channel_block=1, channels_last_columns=True)


def test_the_column_gradient_is_channels_last_where_vectors_divide_an_offset_group():
    """The CPU's backward lays its column gradient out channels-last where vectors divide each
    offset group's channels, two or more of them (some of the wide and depthwise layers the
    tests compare with torchvision take that path), never on a GPU; the kernels say so to the
    caller."""
    host = targets.host_target()
    lanes = schedules.lanes(host, "float32")
    wide = [shape_of(cfg, torch.float32) for cfg in WIDE_CONFIGS + DEPTHWISE_BACKWARD]
    taking = [s for s in wide if schedules.channels_last_columns(s, host)]
    assert taking and lanes >= 4
    assert all((s.in_channels // s.offset_groups) % lanes == 0 for s in taking)
    assert all(s.in_channels // s.offset_groups >= 2 * lanes for s in taking)
    seed = ConvShape(2, 3, 5, 5, 5, 3, 3)
    assert not schedules.channels_last_columns(seed, host)
    assert not schedules.channels_last_columns(taking[0], targets.cuda_target("sm_90", 132))
    assert kernels.get_backward(taking[0], host).channels_last_columns
    weight_only = Gradients(input=False, sampling=False, weight=True)
    assert not kernels.get_backward(taking[0], host, gradients=weight_only).channels_last_columns


def test_a_tuned_record_with_the_older_column_layout_gives_way_to_the_default(monkeypatch):
    """A backward record tuned before the column gradient went channels-last replays a
    schedule whose workspace the caller would lay out wrongly: the lookup passes it over, and
    compiling it runs the default instead, with a warning."""
    from tvm.s_tir import meta_schedule as ms

    host = targets.host_target()
    wide = (shape_of(cfg, torch.float32) for cfg in WIDE_CONFIGS)
    shape = next(s for s in wide if schedules.channels_last_columns(s, host))
    with monkeypatch.context() as patch:
        patch.setattr(cpu_backward, "columns_along_channels", lambda sch, lanes: False)
        old = schedules.apply_default("backward", definition.backward(shape), host)
    workload = ms.database.Workload(records.workload_module(shape, "backward"))
    tuning = ms.database.TuningRecord(old.trace, workload, [1e-3], host, None)
    record = records.TunedRecord(Path("."), "llvm/test", "test", 1.0, tuning)
    with pytest.warns(RuntimeWarning, match="older version"):
        module = kernels.compile_backward(shape, host, record)
    assert module["deform_conv2d_backward"] is not None
    # The lookup passes it over before: this machine's own record, or another machine's.
    monkeypatch.setattr(records, "own_records", lambda *args: [record])
    monkeypatch.setattr(dispatch, "choose_own", lambda shape, op, own: own[0])
    assert kernels.resolve(shape, host, tuned=True, op="backward") is None
    assert kernels.candidates(shape, host, op="backward") == [None]
    monkeypatch.setattr(records, "own_records", lambda *args: [])
    monkeypatch.setattr(records, "foreign_records", lambda *args: [record])
    monkeypatch.setenv("TVM_DEFORM_MEASURE", "1")
    assert kernels.candidates(shape, host, op="backward") == [None]


def test_cpu_workspaces_are_kept_for_the_next_call():
    cpu = torch.device("cpu")
    specs = [((3, 5), torch.int32), ((2, 7, 3), torch.float64), ((11,), torch.float32)]
    first = calls.scratch(cpu, specs)
    assert [(tuple(t.shape), t.dtype) for t in first] == [(s, d) for s, d in specs]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in first)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    assert all(t.data_ptr() % 64 == 0 for t in first)
    again = calls.scratch(cpu, specs[:2])
    assert [t.data_ptr() for t in again] == [t.data_ptr() for t in first[:2]]
    other = []
    thread = threading.Thread(target=lambda: other.extend(calls.scratch(cpu, specs)))
    thread.start()
    thread.join()
    assert other[0].data_ptr() != first[0].data_ptr()


@pytest.mark.skipif(
    hardware.detect().machine != "x86_64" or "avx2" not in hardware.detect().flags,
    reason="AVX2 code needs an x86-64 CPU with AVX2",
)
def test_avx2_code_gradients_match_torchvision(monkeypatch, tmp_path):
    """The kernels an AVX2-only CPU gets (16 vector registers, 8 lanes: smaller register
    blocks), compiled for ``x86-64-v3`` and run here: a dense layer with channels-last
    column gradients and two vectors a weight-gradient task, a depthwise layer, and a map of
    576 pixels with 128 output channels (its forward the column tile on AVX2, the
    output-channel structure with 32 registers)."""
    avx2 = targets.avx2_target()
    monkeypatch.setattr(targets, "host_target", lambda: avx2)
    monkeypatch.setenv("TVM_DEFORM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TVM_DEFORM_TUNED", "0")
    kernels.clear_memory_cache()
    try:
        base = dict(n=2, h=9, w=10, stride=(1, 1), dilation=(1, 1), use_mask=True)
        base |= dict(use_bias=True, kh=3, kw=3, padding=(1, 1))
        layers = [
            base | dict(c=32, o=24, groups=1, offset_groups=1),
            base | dict(c=32, o=32, groups=32, offset_groups=1),
            base | dict(n=1, c=64, o=128, h=24, w=24, groups=1, offset_groups=1),
        ]
        for cfg in layers:
            _, ours = gradients(deform_conv2d, make_inputs(cfg, torch.float32))
            _, exact = gradients(torchvision.ops.deform_conv2d, make_inputs(cfg, torch.float64))
            for name in ours:
                assert_close(ours[name], exact[name], 5e-6, name)
        # and they were AVX2 code: no 512-bit register in any kernel (where objdump is here)
        built = list(tmp_path.rglob("deform_conv2d_*.so"))
        assert any("backward" in so.name for so in built)
        if shutil.which("objdump"):
            for so in built:
                code = subprocess.run(["objdump", "-d", so], capture_output=True, text=True)
                assert "%ymm" in code.stdout and "%zmm" not in code.stdout, so.name
    finally:
        kernels.clear_memory_cache()
