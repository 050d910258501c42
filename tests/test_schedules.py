"""The CPU schedule structures, each checked against torchvision on random layers: the
column tile with pixel-vectorised or channels-last sampling, the output-channel structure, the
inline (depthwise) structure, every rule's design space, and which structure
the default picks."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import sys

import pytest
import torch
import torchvision.ops
import tvm
from conftest import assert_close
from inputs import CONFIGS, DEPTHWISE_CONFIGS, WIDE_CONFIGS, make_inputs, shape_of
from tvm import s_tir
from tvm_deform.schedules import apply_default, design_spaces
from tvm_deform.schedules.common import tensor_intrinsics
from tvm_deform.schedules.cpu import (
    TRANSPOSE_BLOCK,
    Layer,
    OutputChannelCPU,
    apply_inline_structure,
    apply_output_channel_structure,
    apply_split_output_structure,
    apply_structure,
    largest_divisor,
)

from tvm_deform import schedules
from tvm_deform.binding.ops import run_forward
from tvm_deform.ir import definition
from tvm_deform.ir.definition import ConvShape
from tvm_deform.ir.script import pseudo_frames_answered_at_once
from tvm_deform.runtime import targets
from tvm_deform.tools.suite import load_suite

TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def check(sch: s_tir.Schedule, cfg: dict, dtype: torch.dtype = torch.float32) -> None:
    """Compile ``sch`` for this CPU and compare its output with torchvision's (computed in
    float64 from the same, rounded, inputs)."""
    kernel = tvm.compile(sch.mod, target=targets.host_target())["deform_conv2d"]
    args = make_inputs(cfg, dtype)
    ours = run_forward(
        shape_of(cfg, dtype),
        args["input"],
        args["offset"],
        args["weight"],
        args["bias"],
        args["mask"],
        kernel,
    )
    upcast = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    expected = torchvision.ops.deform_conv2d(**upcast)
    assert_close(ours, expected, TOLERANCE[dtype])


def schedule(cfg: dict, dtype: torch.dtype = torch.float32) -> s_tir.Schedule:
    return s_tir.Schedule(definition.forward(shape_of(cfg, dtype)))


def column_tile(sch: s_tir.Schedule, channels_last: bool, tile: int = 16, block: int = 4):
    layer = Layer.of(sch)
    tile = tile if layer.pixels % tile == 0 else layer.pixels
    block = largest_divisor(layer.out_channels, block)
    apply_structure(sch, [None, tile], [None, block], channels_last=channels_last)
    return sch


@pytest.mark.parametrize("channels_last", [False, True], ids=["pixels", "channels_last"])
@pytest.mark.parametrize("cfg", CONFIGS + WIDE_CONFIGS, ids=lambda cfg: None)
def test_column_tile_structure_matches_torchvision(cfg, channels_last):
    check(column_tile(schedule(cfg), channels_last), cfg)


def test_channels_last_with_the_blocked_input_copy():
    # 16 channels and 16 columns: the NHWC copy runs in square blocks (TRANSPOSE_BLOCK).
    cfg = WIDE_CONFIGS[0] | dict(c=16, w=16, h=11, offset_groups=2)
    assert cfg["c"] % TRANSPOSE_BLOCK == 0 and cfg["w"] % TRANSPOSE_BLOCK == 0
    check(column_tile(schedule(cfg), channels_last=True), cfg)
    depthwise = cfg | dict(o=16, groups=16)
    check(inline(schedule(depthwise)), depthwise)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cfg", WIDE_CONFIGS[:3], ids=lambda cfg: None)
def test_channels_last_half_precision(cfg, dtype):
    check(column_tile(schedule(cfg, dtype), channels_last=True), cfg, dtype)


def output_channels(sch: s_tir.Schedule, tile: int = 16, pixels: int = 4, vector: int = 8):
    layer = Layer.of(sch)
    tile = tile if layer.pixels % tile == 0 else layer.pixels
    vector = largest_divisor(layer.out_per_group, vector)
    apply_output_channel_structure(
        sch, [None, tile], [None, largest_divisor(tile, pixels)], [None, vector]
    )
    return sch


@pytest.mark.parametrize("cfg", CONFIGS[:8] + WIDE_CONFIGS, ids=lambda cfg: None)
def test_output_channel_structure_matches_torchvision(cfg):
    check(output_channels(schedule(cfg)), cfg)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_output_channel_structure_half_precision(dtype):
    check(output_channels(schedule(WIDE_CONFIGS[1], dtype)), WIDE_CONFIGS[1], dtype)


#: a layer the default schedules with the output-channel structure: two weight groups of 16
#: output channels, two offset groups, 576 output pixels (padded to 640)
OUTPUT_CHANNEL_LAYER = (
    WIDE_CONFIGS[0]
    | dict(n=1, c=32, h=24, w=24, o=32, kh=3, kw=3, stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    | dict(groups=2, offset_groups=2, use_mask=True, use_bias=True)
)


def test_default_output_channel_structure_matches_torchvision():
    sch = apply_default(
        "forward", definition.forward(shape_of(OUTPUT_CHANNEL_LAYER)), targets.host_target()
    )
    assert "weight_global" in blocks(sch)
    check(sch, OUTPUT_CHANNEL_LAYER)


def split_output(cfg: dict, lanes: int = 8) -> s_tir.Schedule:
    """The split-output structure on ``cfg``'s PrimFunc with its pixels padded to a multiple of
    ``lanes`` (fewer lanes where a map of at most ``lanes`` pixels is not padded at all)."""
    sch = s_tir.Schedule(definition.forward(shape_of(cfg), pixel_quantum=lanes))
    layer = Layer.of(sch)
    lanes = largest_divisor(layer.pixels, lanes)
    parts = largest_divisor(layer.out_channels, 2)
    apply_split_output_structure(
        sch,
        lanes,
        out_block=largest_divisor(layer.out_channels // parts, 4),
        block_vectors=largest_divisor(layer.pixels // lanes, 3),
        k_channels=largest_divisor(layer.in_per_group, 4),
        parts=parts,
    )
    return sch


@pytest.mark.parametrize("cfg", CONFIGS[:8] + WIDE_CONFIGS, ids=lambda cfg: None)
def test_split_output_structure_matches_torchvision(cfg):
    check(split_output(cfg), cfg)


@pytest.mark.slow
def test_split_output_structure_pads_less():
    # A 10x10 map: 112 pixels for a quantum of 16 (a vector of float32 on AVX-512), not 128.
    shape = ConvShape(1, 16, 10, 10, 16, 3, 3, pad_h=1, pad_w=1)
    assert Layer.of(s_tir.Schedule(definition.forward(shape))).pixels == 128
    assert Layer.of(s_tir.Schedule(definition.forward(shape, pixel_quantum=16))).pixels == 112
    cfg = dict(n=1, c=16, h=10, w=10, o=16, kh=3, kw=3, stride=(1, 1), padding=(1, 1))
    cfg |= dict(dilation=(1, 1), groups=1, offset_groups=1, use_mask=True, use_bias=True)
    check(split_output(cfg, lanes=16), cfg)


def inline(sch: s_tir.Schedule, pixels: int = 8, channels: int = 16) -> s_tir.Schedule:
    layer = Layer.of(sch)
    assert layer.samples_used_once
    pixels = pixels if layer.pixels % pixels == 0 else layer.pixels
    channels = largest_divisor(layer.channels_per_offset_group, channels)
    apply_inline_structure(sch, [None, pixels], [None, channels])
    return sch


@pytest.mark.parametrize("cfg", DEPTHWISE_CONFIGS, ids=lambda cfg: None)
def test_inline_structure_matches_torchvision(cfg):
    check(inline(schedule(cfg)), cfg)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_inline_structure_half_precision(dtype):
    check(inline(schedule(DEPTHWISE_CONFIGS[0], dtype)), DEPTHWISE_CONFIGS[0], dtype)


def test_inline_channel_block_may_straddle_offset_groups():
    # Still correct when one vector of channels spans two offset groups (then the geometry is
    # gathered per lane): the default never picks such a block, a hand-made schedule may.
    cfg = next(c for c in DEPTHWISE_CONFIGS if c["offset_groups"] == 2 and c["c"] >= 4)
    sch = schedule(cfg)
    apply_inline_structure(sch, [None, Layer.of(sch).pixels], [None, cfg["c"]])
    check(sch, cfg)


@pytest.mark.parametrize(
    "cfg", [WIDE_CONFIGS[0], WIDE_CONFIGS[1], DEPTHWISE_CONFIGS[3], CONFIGS[5]], ids=lambda c: None
)
def test_every_handwritten_design_space_matches_torchvision(cfg):
    spaces = design_spaces("forward", schedule(cfg).mod["main"], targets.host_target())
    layer = Layer.of(schedule(cfg))
    assert len(spaces) == 1 + (layer.channels_per_offset_group >= 2) + layer.samples_used_once
    for space in spaces:
        check(space, cfg)


def test_output_channel_design_space_matches_torchvision():
    spaces = design_spaces(
        "forward", schedule(OUTPUT_CHANNEL_LAYER).mod["main"], targets.host_target()
    )
    with_packed_weight = [space for space in spaces if "weight_global" in blocks(space)]
    assert len(spaces) == 3 and len(with_packed_weight) == 1
    check(with_packed_weight[0], OUTPUT_CHANNEL_LAYER)


def blocks(sch: s_tir.Schedule) -> set[str]:
    """The names among the definition's stages and the NHWC copy that ``sch`` still has."""
    names = {"data_global", "weight_global", "columns", "conv", "output"}
    present = set()
    for name in names:
        try:
            sch.get_sblock(name)
        except Exception:  # noqa: BLE001 - an inlined or absent block raises
            continue
        present.add(name)
    return present


def test_default_picks_the_structure_from_the_layer():
    target = targets.host_target()
    few = apply_default("forward", definition.forward(ConvShape(1, 3, 8, 8, 4, 3, 3)), target)
    many = apply_default("forward", definition.forward(ConvShape(1, 16, 8, 8, 4, 3, 3)), target)
    depthwise = ConvShape(1, 16, 8, 8, 16, 3, 3, weight_groups=16)
    multiplier = ConvShape(1, 16, 8, 8, 32, 3, 3, weight_groups=16)
    assert "data_global" not in blocks(few) and "columns" in blocks(few)
    assert {"data_global", "columns"} <= blocks(many)
    inline_blocks = blocks(apply_default("forward", definition.forward(depthwise), target))
    assert "data_global" in inline_blocks and "columns" not in inline_blocks
    assert "columns" in blocks(apply_default("forward", definition.forward(multiplier), target))
    # The output-channel structure where the weight is small and the map large; not for a
    # 512-channel weight, a small map, or output channels that do not fill a vector per group.
    packs = {
        shape: "weight_global"
        in blocks(apply_default("forward", definition.forward(shape), target))
        for shape in (
            ConvShape(1, 64, 32, 32, 64, 3, 3, pad_h=1, pad_w=1),
            ConvShape(1, 512, 32, 32, 512, 3, 3, pad_h=1, pad_w=1),
            ConvShape(1, 64, 16, 16, 64, 3, 3, pad_h=1, pad_w=1),
            ConvShape(1, 64, 32, 32, 64, 3, 3, pad_h=1, pad_w=1, weight_groups=16),
        )
    }
    assert list(packs.values()) == [True, False, False, False]


def test_the_output_channel_structure_takes_smaller_weights_with_16_registers():
    # With AVX2's 16 vector registers its register block is smaller: the default keeps it for
    # 64 to 64 channels and leaves 128 output channels to the column tile.
    avx2 = targets.avx2_target()
    small = ConvShape(1, 64, 32, 32, 64, 3, 3, pad_h=1, pad_w=1)
    wider = ConvShape(1, 128, 32, 32, 128, 3, 3, pad_h=1, pad_w=1)
    for shape, packs in ((small, True), (wider, False)):
        func = definition.forward(shape)
        assert ("weight_global" in blocks(apply_default("forward", func, avx2))) == packs
        assert Layer.of_shape(shape).suits_output_channel_vectors(8, registers=16) == packs
        assert Layer.of_shape(shape).suits_output_channel_vectors(8, registers=32)


@pytest.mark.slow
@pytest.mark.parametrize("target_name", ["host", "sm_90"])
@pytest.mark.parametrize("kernel", ["forward", "backward"])
def test_each_suite_layers_default_is_a_point_of_its_rules_space(kernel, target_name):
    # A rule's space starts at the default's values (Choices), so the default is one point of
    # it exactly when one of the rule's spaces, as returned, is the default schedule.
    target = targets.host_target() if target_name == "host" else targets.cuda_target("sm_90")
    for name, shape in load_suite().items():
        func = definition.forward(shape) if kernel == "forward" else definition.backward(shape)
        rule = next(
            r for r in schedules.rules_for(kernel, target) if r.default and r.apply(func, target)
        )
        default = rule.apply(func, target).mod.script()
        spaces = rule.apply(func, target, tunable=True)
        spaces = spaces if isinstance(spaces, list) else [spaces]
        assert any(space.mod.script() == default for space in spaces), (name, rule)
        assert all(space.trace is not None for space in spaces)


#: suite layers whose design spaces the question test below compares at one size and any size
QUESTION_LAYERS = ("seed", "r50dcn320_c4_256x20x20", "depthwise_128x56x56", "stride2_64to128x56x56")


@pytest.mark.slow
@pytest.mark.parametrize("target_name", ["host", "sm_90"])
@pytest.mark.parametrize("kernel", ["forward", "backward"])
def test_a_rule_asks_the_same_questions_at_one_size_and_for_any_size(kernel, target_name):
    """A tuned record's choices carry over to the kernels for any size of its layer
    (``schedules.derive``) because a rule asks its questions in the same order at every size:
    each rule's design spaces of a PrimFunc for any size ask as many questions as those of the
    PrimFunc of one size (the candidates may differ where they depend on the pixels: the
    CPU's pixel tile is the size class's quantum). The CPU's output-channel structure takes no
    PrimFunc for any size as a space (its records are replayed step by step)."""
    from tvm_deform.schedules.rule import answers_given

    target = targets.host_target() if target_name == "host" else targets.cuda_target("sm_90")
    suite = load_suite()
    compared = set()
    for name in QUESTION_LAYERS:
        shape = suite[name]
        if kernel == "forward":
            size_class = min(schedules.pixel_classes(shape, target))
            one = definition.forward(shape)
            any_size = schedules._any_size_definition(shape.any_size(), target, "NCHW", size_class)
        else:
            quantum = schedules.backward_pixel_quantum(shape, target)
            one = definition.backward(shape)
            any_size = definition.backward(
                shape.any_size(), sizes="symbolic", pixel_quantum=quantum,
                staged_inputs=target_name == "host",
            )  # fmt: skip
        for rule in schedules.rules_for(kernel, target):
            if isinstance(rule, OutputChannelCPU):
                continue
            asked = []
            for func in (one, any_size):
                with answers_given() as answers:
                    spaces = rule.apply(func, target, tunable=True)
                spaces = spaces if isinstance(spaces, list) else [spaces] if spaces else []
                asked.append([answers(space) for space in spaces])
                for space in spaces:  # every sampled choice went through Choices
                    assert schedules._every_sample_answers(space, answers(space)), (name, rule)
            if not asked[0] or not any(asked[0]):
                # no space of this layer, or one that asks nothing at its own size (the seed's
                # CUDA backward: no tile divides its pixels), which has nothing to carry over
                continue
            assert [len(a) for a in asked[0]] == [len(a) for a in asked[1]], (name, rule)
            compared.add(name)
    assert len(compared) >= len(QUESTION_LAYERS) - 1  # the seed's CUDA backward asks nothing


def test_random_points_of_the_spaces_for_any_size_match_torchvision():
    """A tuned record carried over to the kernels for any size of its layer runs its rule's
    design space of the PrimFunc for any size at the record's choices (``schedules.derive``):
    two random points of each space of every CPU forward rule that takes a size class from 128
    pixels, its pixels padded to the default's tile and to a smaller one (a record's tile),
    run at three sizes of the class, give torchvision's numbers."""
    from tvm.s_tir.schedule import Trace

    from tvm_deform.runtime.inputs import conv_kwargs, random_inputs

    target = targets.host_target()
    layer = ConvShape(0, 16, 0, 0, 32, 3, 3, pad_h=1, pad_w=1, has_bias=True)
    names = ("input", "offset", "weight", "bias", "mask")
    for quantum in (None, 16):
        func = schedules._any_size_definition(layer, target, "NCHW", 128, quantum)
        spaces = schedules.named_design_spaces("forward", func, target)
        assert {name for name, _ in spaces} >= {"OutputChannelCPU", "ColumnTileCPU"}
        for (_, space), seed in itertools.product(spaces, (1, 2)):
            sch = s_tir.Schedule(func, seed=seed)
            Trace(space.trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
            kernel = tvm.compile(sch.mod, target=target)["deform_conv2d"]
            for batch, height, width in ((1, 12, 12), (2, 9, 16), (1, 13, 20)):
                shape = dataclasses.replace(layer, batch=batch, height=height, width=width)
                inputs = random_inputs(shape)
                ours = run_forward(shape, *(inputs[n] for n in names), kernel)
                upcast = {n: inputs[n].double() for n in names}
                expected = torchvision.ops.deform_conv2d(**upcast, **conv_kwargs(shape))
                assert_close(ours, expected, TOLERANCE[torch.float32])


def test_the_space_is_wider_than_the_default():
    # The output-channel structure is the default only from 512 pixels on; its space is
    # offered from 128, so a tuned win on a smaller map stays reachable.
    target = targets.host_target()
    shape = ConvShape(1, 64, 16, 16, 64, 3, 3, pad_h=1, pad_w=1)
    func = definition.forward(shape)
    rule = OutputChannelCPU()
    assert rule.apply(func, target) is None
    assert rule.apply(func, target, tunable=True) is not None
    assert any("weight_global" in blocks(s) for s in design_spaces("forward", func, target))


def test_tensor_intrinsics_are_registered_and_inspect_is_restored():
    getmodule = inspect.getmodule
    intrinsics = tensor_intrinsics()
    assert inspect.getmodule is getmodule
    assert s_tir.TensorIntrin.get(intrinsics.cuda.WMMA_FILL_16x16x16_F32_INTRIN) is not None


def test_frames_of_pseudo_files_keep_their_answer_from_inspect():
    # While TVMScript parses, inspect answers a frame of a pseudo-file (an import's, or code
    # compiled from an AST) at once; the answer is the one it gives after its scan.
    frame = eval(compile("sys._getframe()", "<ast>", "eval"), {"sys": sys})
    function = eval(compile("lambda: None", "<ast>", "eval"))
    expected = [inspect.getmodule(frame, "<ast>"), inspect.getmodule(function, "<ast>")]
    getmodule = inspect.getmodule
    with pseudo_frames_answered_at_once():
        with pseudo_frames_answered_at_once():  # nested (or on another thread): one patch
            assert inspect.getmodule(frame, "<ast>") is expected[0] is None
        assert inspect.getmodule is not getmodule
        assert inspect.getmodule(function, "<ast>") is expected[1] is sys.modules[__name__]
        assert inspect.getmodule(test_the_space_is_wider_than_the_default) is sys.modules[__name__]
    assert inspect.getmodule is getmodule


#: backward layers of every CPU structure: depthwise with channels-last columns (its column
#: gradient streamed), depthwise with one vector of channels, dense with channels-last
#: columns, four offset groups of one vector each (the pixel layout), a channel multiplier
BACKWARD_SPACE_LAYERS = [
    ConvShape(1, 128, 12, 12, 128, 3, 3, pad_h=1, pad_w=1, weight_groups=128),
    ConvShape(2, 16, 9, 7, 16, 3, 3, pad_h=1, pad_w=1, weight_groups=16),
    ConvShape(1, 64, 10, 10, 32, 3, 3, pad_h=1, pad_w=1),
    ConvShape(1, 64, 10, 10, 64, 3, 3, pad_h=1, pad_w=1, offset_groups=4),
    ConvShape(1, 32, 8, 8, 64, 3, 3, pad_h=1, pad_w=1, weight_groups=32),
]


@pytest.mark.parametrize("shape", BACKWARD_SPACE_LAYERS, ids=lambda s: None)
@pytest.mark.parametrize("asked", ["all", "input", "weight"])
def test_cpu_backward_spaces_replay_from_their_simplified_traces(shape, asked):
    """MetaSchedule keeps a candidate as its simplified trace and replays it on the PrimFunc:
    a block that an instruction names but no kept instruction defines cannot be replayed."""
    gradients = {
        "all": definition.ALL_GRADIENTS,
        "input": definition.Gradients(input=True, sampling=False, weight=False),
        "weight": definition.Gradients(input=False, sampling=False, weight=True),
    }[asked]
    target = targets.host_target()
    func = definition.backward(shape, gradients)
    rule = next(r for r in schedules.rules_for("backward", target) if r.default)
    spaces = rule.apply(func, target, tunable=True)
    for space in spaces if isinstance(spaces, list) else [spaces]:
        replayed = s_tir.Schedule(func)
        trace = space.trace.simplified(remove_postproc=True)
        trace.apply_to_schedule(replayed, remove_postproc=False)
        tvm.ir.assert_structural_equal(replayed.mod, space.mod)
