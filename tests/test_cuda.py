"""The CUDA target: builds checked without a GPU, the schedule emulated on the CPU, and the
GPU tests that run where torch sees one."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess

import pytest
import torch
import torchvision.ops
import tvm
from conftest import assert_close
from inputs import CONFIGS, make_inputs, shape_of
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms
from tvm_deform.schedules.cuda import (
    STATIC_SHARED_MEMORY,
    OnePassCUDA,
    PipelinedCUDA,
    SampleOnceCUDA,
    SplitReductionCUDA,
    WideTileCUDA,
)
from tvm_deform.schedules.cuda_tensor_core import (
    SampleOnceTensorCoreCUDA,
    TensorCoreCUDA,
    _Gemm,
)

from tvm_deform import deform_conv2d, schedules
from tvm_deform.binding.ops import run_forward
from tvm_deform.ir import definition
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels, records, targets
from tvm_deform.runtime.inputs import conv_kwargs, random_inputs
from tvm_deform.tools import cuda_build
from tvm_deform.tools.cli import main
from tvm_deform.tools.suite import load_suite

SUITE = load_suite()
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible")


def test_cuda_target_and_hardware_key():
    target = targets.cuda_target("sm_90")
    assert target.kind.name == "cuda" and str(target.attrs["arch"]) == "sm_90"
    assert int(target.attrs["max_shared_memory_per_block"]) == 49152
    assert target.host.kind.name == "llvm"
    assert targets.hardware_key(target) == "cuda/sm_90"
    with pytest.raises(ValueError, match="sm_90"):
        targets.cuda_target("hopper")


def test_ptxas_reports_are_read_per_kernel():
    report = "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads; Used {}"
    built = cuda_build.CudaBuild(
        "sm_90",
        b"",
        {
            "gemm": report.format("72 registers, used 1 barriers, 6912 bytes smem"),
            "sample": report.format("20 registers, used 0 barriers"),
            "spilling": "16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads; "
            "Used 255 registers, used 0 barriers",
        },
    )
    usage = built.usage()
    assert usage["gemm"] == cuda_build.KernelUsage(72, 6912, 0, 0, 0)
    assert usage["sample"] == cuda_build.KernelUsage(20, 0, 0, 0, 0)
    assert usage["spilling"] == cuda_build.KernelUsage(255, 0, 16, 8, 4)
    assert list(built.spills()) == ["spilling"]


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", list(SUITE))
def test_suite_builds_to_machine_code(name, arch):
    source = cuda_build.cuda_source(SUITE[name], arch)
    declared = set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source))
    # The sampling kernel and the GEMM, and the sum of its parts where the reduction is split.
    split = schedules.split_parts(SUITE[name], targets.cuda_target(arch)) > 1
    suffixes = ("", "_1") + (("_2",) if split else ())
    built = cuda_build.nvcc_build(source, arch)
    assert set(built.kernels) == declared
    assert built.machine_arch == int(arch.removeprefix("sm_"))
    assert set(built.kernels) == {f"deform_conv2d_kernel{s}" for s in suffixes}
    for kernel in built.kernels:
        assert kernel.encode() in built.cubin
    gemm = built.kernels["deform_conv2d_kernel_1"]
    # The GEMM stages its chunks of columns in shared memory and synchronises on them.
    assert "1 barriers" in gemm and "bytes smem" in gemm, gemm
    assert not built.spills()


@needs_nvcc
@pytest.mark.parametrize("level", [None, "5"])
def test_offline_build_makes_the_machine_code_tvm_compiles(level, monkeypatch):
    """The offline build (what the static checks read and the tuning rounds time) gives nvcc
    the options of TVM's own nvcc compile: the same cubin, byte for byte, at TVM's
    register-usage level and at another one set in the environment."""
    from tvm.support import nvcc

    monkeypatch.delenv("TVM_CUDA_NVCC_NO_FAST_MATH", raising=False)
    monkeypatch.delenv("TVM_CUDA_PTXAS_EXTRA_OPTS", raising=False)
    if level is None:
        monkeypatch.delenv("TVM_CUDA_PTXAS_REG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("TVM_CUDA_PTXAS_REG_LEVEL", level)
    source = cuda_build.cuda_source(SUITE["demo_64x56x56"], "sm_90")
    with targets.cuda_target("sm_90"):
        compiled = bytes(nvcc.compile_cuda(source, "cubin", arch="sm_90", compiler="nvcc"))
    assert cuda_build.nvcc_build(source, "sm_90").cubin == compiled
    assert f"--register-usage-level={level or 10}" in " ".join(targets.nvcc_options())


@needs_nvcc
@pytest.mark.parametrize("chosen", [None, "nvrtc"])
def test_kernels_compile_with_nvcc_where_it_is_installed(chosen, monkeypatch):
    """Importing the package makes nvcc TVM's CUDA compiler where it is installed (the offline
    builds' and the GPU runs' compiler), unless the user chose one."""
    import importlib

    from tvm_deform import env

    if chosen:
        monkeypatch.setenv("TVM_CUDA_COMPILE_MODE", chosen)
    else:
        monkeypatch.delenv("TVM_CUDA_COMPILE_MODE", raising=False)
    importlib.reload(env)  # what importing the package runs first
    assert os.environ["TVM_CUDA_COMPILE_MODE"] == (chosen or "nvcc")


def test_kernels_built_with_other_compile_settings_are_other_cache_entries(monkeypatch):
    """A CUDA kernel built at another register-usage level, without fast math or by the other
    compiler is another entry of the kernel cache and another timed decision (a setting left
    at its default is the same one); CPU kernels' keys do not change."""
    from tvm_deform.runtime import dispatch

    layer, gpu, cpu = SUITE["demo_64x56x56"], targets.cuda_target("sm_90"), targets.host_target()
    for name in targets.CUDA_COMPILE_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TVM_CUDA_COMPILE_MODE", "nvcc")
    before = [kernels.cache_path(layer, t) for t in (gpu, cpu)]
    decided = dispatch._digest(layer, gpu, "forward", {})
    monkeypatch.setenv("TVM_CUDA_PTXAS_REG_LEVEL", "10")  # TVM's default
    assert kernels.cache_path(layer, gpu) == before[0]
    paths = {}
    for name, value in (
        ("TVM_CUDA_PTXAS_REG_LEVEL", "5"),
        ("TVM_CUDA_NVCC_NO_FAST_MATH", "1"),
        ("TVM_CUDA_COMPILE_MODE", "NVRTC"),
    ):
        monkeypatch.setenv(name, value)
        paths[name] = kernels.cache_path(layer, gpu)
        assert kernels.cache_path(layer, cpu) == before[1]
    assert dispatch._digest(layer, gpu, "forward", {}) != decided
    assert len({*paths.values(), before[0]}) == 4


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_for_any_size_build_to_machine_code(arch):
    """Every suite layer's CUDA kernels for any size (one per size class) build with nvcc:
    at most three kernels, none spilling or keeping a stack frame in local memory, the GEMM's
    shared memory static and within the budget."""
    import concurrent.futures

    target = targets.cuda_target(arch)

    def build(layer):
        sources = cuda_build.any_size_sources(layer[1], arch)
        return [(layer[0], p, s, cuda_build.nvcc_build(s, arch)) for p, s in sources.items()]

    # Two layers at a time: TVM's compiler releases the GIL, and nvcc runs as a process.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        built_layers = list(pool.map(build, SUITE.items()))
    for name, pixels, source, built in (b for layer in built_layers for b in layer):
        assert 2 <= len(built.kernels) <= 3, (name, pixels, list(built.kernels))
        assert not built.spills(), (name, pixels)
        smem = built.usage()["deform_conv2d_kernel_1"].shared
        assert 0 < smem <= SampleOnceCUDA().budget(target), (name, pixels)
        # The sizes are the kernels' arguments, not constants.
        assert re.search(r"int h, int n, int w\)", source), (name, pixels)


@needs_nvcc
def test_every_forward_structure_for_any_size_builds_to_machine_code():
    """Each CUDA forward rule's own schedule for any size (one per size class), the fused
    structures' too, builds with nvcc for sm_90 without spills, its shared memory within the
    rule's budget (of each stage, for a pipelined one): a 64-channel layer (the one-pass
    structures), the 512-channel 10x10 one (the split ones) and one of 16 outputs in four
    groups. (With the output-channel tiles fused into the pixel tiles' axis, TVM could not
    bound a tile's group for any size and the fused structures staged every channel's
    columns: 148 KiB.)"""
    import concurrent.futures

    target = targets.cuda_target("sm_90", 132)
    layers = [SUITE["demo_64x56x56"], SUITE["r50dcn320_c5_512x10x10"], FEW_OUTPUTS[2]]
    jobs = []
    for layer in layers:
        for pixels in schedules.pixel_classes(layer, target):
            func = schedules._any_size_definition(layer.any_size(), target, "NCHW", pixels)
            for rule in schedules.rules_for("forward", target):
                sch = rule.apply(func, target)
                if sch is not None:
                    # A pipelined rule's budget is each of its stages' buffers'.
                    budget = rule.stages * rule.budget(target)
                    jobs.append((repr(rule), layer, pixels, budget, sch))
    assert {job[0] for job in jobs} >= {"OnePassCUDA", "SplitReductionCUDA", "SampleOnceCUDA"}

    def build(job):
        source = cuda_build.cuda_source(job[1], "sm_90", schedule=job[4])
        return job, cuda_build.nvcc_build(source, "sm_90")

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for (name, layer, pixels, budget, _), built in pool.map(build, jobs):
            assert not built.spills(), (name, layer, pixels, built.kernels)
            smem = max(u.shared for u in built.usage().values())
            assert 0 < smem <= budget, (name, layer, pixels, smem)


def test_shared_memory_stays_within_the_budget():
    target = targets.cuda_target("sm_90")
    for name, shape in SUITE.items():
        func = definition.forward(shape)
        assert OnePassCUDA().apply(func, target) is not None
        for rule in (OnePassCUDA(), SplitReductionCUDA(), SampleOnceCUDA()):
            budget = rule.budget(target)
            assert budget == 40 * 1024  # 5/6 of the 48 KiB the target declares
            sch = s_tir.Schedule(func)
            assert rule.shared_bytes(sch, *rule.out_tile(sch, budget)) <= budget, name


#: layers with few output channels, or few per group: the first four staged 57 to 145 KiB
#: of shared memory with the default's tile of 32 output channels (past the 48 KiB a kernel
#: may declare), which reached groups past the last or a second group, TVM staging every
#: channel between the groups' chunks; then a tile past 2 outputs of 4 channels, a group of
#: 24 outputs (no tile of 32 divides it), and two groups of 64 (a tile within one)
FEW_OUTPUTS = [
    ConvShape(1, 32, 59, 31, 16, 3, 3, pad_h=1, pad_w=1, offset_groups=2),
    ConvShape(1, 32, 59, 31, 1, 3, 3, pad_h=1, pad_w=1),
    ConvShape(2, 64, 36, 23, 16, 3, 3, 2, 2, 1, 1, weight_groups=4, offset_groups=4),
    ConvShape(1, 32, 35, 30, 32, 3, 4, 1, 2, 1, 2, weight_groups=2, offset_groups=4),
    ConvShape(1, 4, 20, 20, 2, 3, 3, pad_h=1, pad_w=1),
    ConvShape(1, 32, 40, 40, 24, 3, 3, pad_h=1, pad_w=1),
    ConvShape(1, 64, 30, 30, 128, 3, 3, pad_h=1, pad_w=1, weight_groups=2),
]


@needs_nvcc
@pytest.mark.parametrize(
    "shape",
    FEW_OUTPUTS,
    ids=["16", "1", "16_4groups", "32_2groups", "2_of_4ch", "24", "128_2groups"],
)
def test_few_output_channels_stage_within_the_shared_memory_budget(shape):
    """The default CUDA forward (one size and any size) of layers with few output channels
    (per group) builds with nvcc, its staged chunks within the rule's estimate, which is
    within the budget (40 KiB of the 48 a kernel may declare)."""
    from tvm_deform.runtime import kernels

    target = targets.cuda_target("sm_90")
    rule = SampleOnceCUDA()
    sch = s_tir.Schedule(definition.forward(shape))
    estimate = rule.shared_bytes(sch, *rule.out_tile(sch, rule.budget(target)))
    assert estimate <= rule.budget(target)
    layer = shape.any_size()
    for sch in (
        kernels.default_schedule(shape, target, "forward"),
        schedules.forward_schedule(
            layer, target, "NCHW", schedules.pixel_classes(layer, target)[0]
        ),
    ):
        built = kernels.compile_schedule(sch, target)
        source = "\n".join(m.inspect_source("cuda") for m in built.mod.imports if m.kind == "cuda")
        machine = cuda_build.nvcc_build(source, "sm_90")
        staged = max(u.shared for u in machine.usage().values())
        # TVM aligns each staged buffer's start: a few bytes past the estimate
        assert 0 < staged <= estimate + 256, (staged, estimate)


@pytest.mark.parametrize("shape", FEW_OUTPUTS[:4:2], ids=["16", "16_4groups"])
def test_emulated_cuda_schedule_with_few_output_channels_matches_torchvision(shape):
    inputs = random_inputs(shape)
    ours = run_forward(shape, **inputs, kernel=emulated_kernel(shape, SampleOnceCUDA(emulate=True)))
    assert_close(ours, torchvision.ops.deform_conv2d(**inputs, **conv_kwargs(shape)), 1e-5)


def emulated_kernel(shape: ConvShape, rule=None):
    """A CUDA schedule's loop structure (``rule``, default ``OnePassCUDA``) compiled for this
    CPU (no thread bindings, shared buffers in global memory)."""
    rule = rule or OnePassCUDA(emulate=True)
    sch = rule.apply(definition.forward(shape), targets.host_target())
    return tvm.compile(sch.mod, target=targets.host_target())["deform_conv2d"]


def test_small_maps_with_many_channels_get_their_reduction_split():
    # Parts until the layer has enough thread blocks; a layer with enough tiles is not split.
    rule = SplitReductionCUDA()
    target = targets.cuda_target("sm_90")
    parts = {}
    for name in ("r50dcn320_c5_512x10x10", "r50_c5_512x25x42", "r50_c3_128x100x168", "seed"):
        sch = s_tir.Schedule(definition.forward(SUITE[name]))
        tiles = rule.tiles(sch, *rule.out_tile(sch, rule.budget(target)))
        parts[name] = rule.choose_parts(sch, *rule.out_tile(sch, rule.budget(target)))
        assert tiles * parts[name] >= rule.enough_blocks or parts[name] in (1, rule.max_parts)
    assert parts == {
        "r50dcn320_c5_512x10x10": 16,  # 16 x 2 tiles
        "r50_c5_512x25x42": 2,  # 16 x 17 tiles
        "r50_c3_128x100x168": 1,  # 1052 tiles
        "seed": 1,  # 3 channels: no part would hold a chunk
    }
    assert rule.apply(definition.forward(SUITE["r50_c3_128x100x168"]), target) is None
    assert (
        schedules.forward_schedule(SUITE["r50dcn320_c5_512x10x10"], target)
        .mod.script()
        .count("conv_rf")
    )


def test_a_kernel_of_a_given_schedule_runs_as_the_op_would(tmp_path, monkeypatch):
    # What the GPU session times beside the default: here the one-pass CUDA structure,
    # emulated on the CPU, through the disk cache and the op's own call path.
    from tvm_deform.runtime import kernels

    monkeypatch.setenv("TVM_DEFORM_CACHE_DIR", str(tmp_path))
    shape, _ = SPLIT_LAYERS[0]
    target = targets.host_target()
    kernel = kernels.load_scheduled(
        shape,
        target,
        "one-pass-emulated",
        lambda: OnePassCUDA(emulate=True).apply(definition.forward(shape), target),
    )
    assert len(list(tmp_path.glob("deform_conv2d-*.so"))) == 1
    inputs = random_inputs(shape)
    ours = run_forward(shape, **inputs, kernel=kernel)
    assert_close(ours, torchvision.ops.deform_conv2d(**inputs, **conv_kwargs(shape)), 1e-6)


#: layers for the split reduction: grouped, offset groups, batch 2, stride and dilation, no
#: mask, and parts of 5 channels (chunks of one channel)
SPLIT_LAYERS = [
    (ConvShape(1, 64, 6, 7, 48, 3, 3, pad_h=1, pad_w=1, has_bias=True), 4),
    (ConvShape(2, 32, 5, 5, 40, 3, 3, pad_h=1, pad_w=1, weight_groups=2, offset_groups=2), 2),
    (ConvShape(1, 16, 9, 8, 8, 3, 3, stride_h=2, dilation_w=2, pad_h=1, has_mask=False), 8),
    (ConvShape(1, 10, 5, 6, 12, 3, 3, pad_h=1, pad_w=1, has_bias=True), 2),
]


@pytest.mark.parametrize("shape, parts", SPLIT_LAYERS, ids=[f"split{i}" for i in range(4)])
def test_emulated_split_reduction_matches_torchvision(shape, parts):
    inputs = random_inputs(shape)
    kernel = emulated_kernel(shape, SplitReductionCUDA(parts, emulate=True))
    ours = run_forward(shape, **inputs, kernel=kernel)
    assert_close(ours, torchvision.ops.deform_conv2d(**inputs, **conv_kwargs(shape)), 1e-6)
    # The parts are summed in a fixed order: the same bits on a second run.
    assert torch.equal(ours, run_forward(shape, **inputs, kernel=kernel))


@pytest.mark.parametrize("cfg", CONFIGS[:10], ids=[f"cfg{i}" for i in range(10)])
def test_emulated_cuda_schedule_matches_torchvision(cfg):
    args = make_inputs(cfg, torch.float32)
    out_h = torchvision.ops.deform_conv2d(**args).shape[2]
    out_w = torchvision.ops.deform_conv2d(**args).shape[3]
    shape = shape_of(cfg)
    assert (shape.out_h, shape.out_w) == (out_h, out_w)
    ours = run_forward(
        shape,
        args["input"],
        args["offset"],
        args["weight"],
        args["bias"],
        args["mask"],
        emulated_kernel(shape),
    )
    assert_close(ours, torchvision.ops.deform_conv2d(**args), 1e-6)


def test_emulated_cuda_schedule_on_a_depthwise_suite_layer():
    shape = ConvShape(1, 32, 14, 14, 32, 3, 3, pad_h=1, pad_w=1, weight_groups=32)
    cfg = dict(
        n=1,
        c=32,
        h=14,
        w=14,
        o=32,
        kh=3,
        kw=3,
        stride=(1, 1),
        padding=(1, 1),
        dilation=(1, 1),
        groups=32,
        offset_groups=1,
        use_mask=True,
        use_bias=False,
    )
    args = make_inputs(cfg, torch.float32)
    ours = run_forward(
        shape,
        args["input"],
        args["offset"],
        args["weight"],
        None,
        args["mask"],
        emulated_kernel(shape),
    )
    assert_close(ours, torchvision.ops.deform_conv2d(**args), 1e-6)


def emulated_any_size_kernel(shape: ConvShape, parts: int | None = None):
    """``SampleOnceCUDA``'s kernel for every size of ``shape``'s layer (its pixels padded to
    ``PIXEL_QUANTUM``, the offset and mask read as the call has them), compiled for this CPU
    without the thread bindings, called as the op calls a CUDA kernel for any size."""
    func = definition.forward(shape, sizes="symbolic", staged_inputs=False)
    sch = SampleOnceCUDA(parts, emulate=True).apply(func, targets.host_target())
    built = tvm.compile(sch.mod, target=targets.host_target())
    return built["deform_conv2d"]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"cfg{i}" for i in range(len(CONFIGS))])
def test_emulated_sample_once_schedule_matches_torchvision(cfg):
    """The default CUDA forward's structure (the sampling kernel and the GEMM), per size and
    for any size, without the thread bindings, run on the CPU: against torchvision, and
    against torchvision in float64 on the same inputs."""
    shape = shape_of(cfg)
    args = make_inputs(cfg, torch.float32)
    expected = torchvision.ops.deform_conv2d(**args)
    exact = torchvision.ops.deform_conv2d(**_upcast(args, torch.float64))
    arguments = [args[n] for n in ("input", "offset", "weight", "bias", "mask")]
    static = emulated_kernel(shape, SampleOnceCUDA(emulate=True))
    for kernel in (static, emulated_any_size_kernel(shape)):
        ours = run_forward(shape, *arguments, kernel)
        assert_close(ours, expected, 1e-6)
        assert_as_exact_as_torchvision(ours, expected, exact)


def _upcast(args: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def assert_as_exact_as_torchvision(ours, theirs, exact, name: str = "") -> None:
    """``ours`` no further from the float64 result ``exact`` than twice torchvision's float32
    result ``theirs`` is (float32 rounding grows with the reduction's length)."""
    error = (ours.double() - exact).norm() / exact.norm()
    bound = (theirs.double() - exact).norm() / exact.norm()
    assert error <= 2 * bound + 1e-7, f"{name}: {error:.3g} from float64, torchvision {bound:.3g}"


#: sizes no suite layer has, for one layer's kernel for any size: odd maps, 1x1 maps, an empty
#: batch, a batch of 5, and maps of less than one GEMM tile (64 pixels) and of many
ANY_SIZES = [(1, 13, 17), (2, 1, 1), (1, 8, 8), (1, 5, 13), (0, 9, 9), (5, 11, 6), (1, 40, 37)]


@pytest.mark.parametrize("parts", [1, 2], ids=["one_pass", "split"])
def test_one_emulated_cuda_kernel_takes_every_size(parts):
    layer = ConvShape(0, 32, 0, 0, 48, 3, 3, 2, 1, 2, 1, 2, 1, offset_groups=2, has_bias=True)
    kernel = emulated_any_size_kernel(layer, parts)
    for batch, height, width in ANY_SIZES:
        shape = dataclasses.replace(layer, batch=batch, height=height, width=width)
        inputs = random_inputs(shape)
        ours = run_forward(shape, **inputs, kernel=kernel)
        expected = torchvision.ops.deform_conv2d(**inputs, **conv_kwargs(shape))
        exact = torchvision.ops.deform_conv2d(
            **_upcast(inputs, torch.float64), **conv_kwargs(shape)
        )
        assert ours.shape == expected.shape
        where = f"{batch}x{height}x{width}"
        assert_close(ours, expected, 1e-6, where)
        if batch:
            assert_as_exact_as_torchvision(ours, expected, exact, where)
        # The parts are added in a fixed order: the same bits again.
        assert torch.equal(ours, run_forward(shape, **inputs, kernel=kernel))


def test_half_precision_sample_once_matches_the_upcast_reference():
    """float16 and bfloat16 layers on the default CUDA structure for any size, emulated:
    within rounding of torchvision's float64 result on the upcast inputs (torchvision's CPU op
    has no half-precision kernel)."""
    for dtype in (torch.float16, torch.bfloat16):
        layer = ConvShape(0, 16, 0, 0, 32, 3, 3, pad_h=1, pad_w=1, has_bias=True)
        layer = dataclasses.replace(layer, dtype=str(dtype).removeprefix("torch."))
        kernel = emulated_any_size_kernel(layer, 1)
        for batch, height, width in ((1, 9, 7), (2, 12, 12)):
            shape = dataclasses.replace(layer, batch=batch, height=height, width=width)
            inputs = random_inputs(shape)
            ours = run_forward(shape, **inputs, kernel=kernel)
            upcast = {k: v.double() if v is not None else None for k, v in inputs.items()}
            expected = torchvision.ops.deform_conv2d(**upcast, **conv_kwargs(shape))
            assert ours.dtype == dtype
            assert_close(ours.double(), expected, HALF_TOLERANCE[dtype])


def random_points(func, rule, target, count: int) -> list[s_tir.Schedule]:
    """``count`` points of each of ``rule``'s design spaces of ``func``, their sampled tile
    sizes drawn at random (the traces replayed without their decisions)."""
    from tvm.s_tir.schedule import Trace

    points = []
    for space in rule.apply(func, target, tunable=True):
        for seed in range(1, count + 1):
            sch = s_tir.Schedule(func, seed=seed)
            Trace(space.trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
            points.append(sch)
    return points


def test_random_points_of_the_sample_once_spaces_match_torchvision():
    """What a tuning round may propose computes torchvision's numbers: random tile sizes of
    both design spaces (one pass and split), emulated on the CPU."""
    shape = ConvShape(1, 32, 11, 9, 48, 3, 3, pad_h=1, pad_w=1, offset_groups=2, has_bias=True)
    inputs = random_inputs(shape)
    expected = torchvision.ops.deform_conv2d(**inputs, **conv_kwargs(shape))
    host = targets.host_target()
    points = random_points(definition.forward(shape), SampleOnceCUDA(emulate=True), host, 6)
    decided = {tuple(int(v) for v in p.trace.decisions.values()) for p in points}
    assert len(decided) > 6
    for sch in points:
        kernel = tvm.compile(sch.mod, target=host)["deform_conv2d"]
        assert_close(run_forward(shape, **inputs, kernel=kernel), expected, 1e-6)


#: layers the wide tile takes: 64 and 128 output channels a group, two offset groups, a
#: stride, a batch, a ragged map and a bias
WIDE_LAYERS = (
    ConvShape(1, 32, 11, 9, 64, 3, 3, pad_h=1, pad_w=1, offset_groups=2, has_bias=True),
    ConvShape(2, 64, 13, 7, 128, 3, 3, stride_h=2, pad_h=1, pad_w=1),
    ConvShape(1, 64, 9, 10, 256, 3, 3, pad_h=1, pad_w=1, weight_groups=2, has_bias=True),
)


@pytest.mark.parametrize("rule", [WideTileCUDA, PipelinedCUDA], ids=["wide", "pipelined"])
@pytest.mark.parametrize("shape", WIDE_LAYERS, ids=["64", "128", "grouped"])
def test_emulated_wide_tile_and_pipelined_schedules_match_torchvision(shape, rule):
    """``WideTileCUDA`` (8 x 8 register blocks) and ``PipelinedCUDA`` (the default's
    structure, half its shared memory a chunk), per size and for any size, without the thread
    bindings (and the pipeline), run on the CPU."""
    inputs = random_inputs(shape)
    expected = torchvision.ops.deform_conv2d(**inputs, **conv_kwargs(shape))
    host = targets.host_target()
    symbolic = definition.forward(shape, sizes="symbolic", staged_inputs=False)
    for func in (definition.forward(shape), symbolic):
        sch = rule(emulate=True).apply(func, host)
        kernel = tvm.compile(sch.mod, target=host)["deform_conv2d"]
        assert_close(run_forward(shape, **inputs, kernel=kernel), expected, 1e-6)


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])
def test_the_pipelined_schedule_copies_asynchronously_from_sm_80(arch):
    """``PipelinedCUDA``'s kernels, for one size and any size (one split, one not), build
    without spills; from sm_80 its GEMM copies each chunk with cp.async (4 bytes a copy) and
    waits for all but the newest chunk's copies; before sm_80, plain copies. The default's
    GEMM copies as before: no cp.async."""
    target = targets.cuda_target(arch, 132)
    for name in ("demo_64x56x56", "r50dcn320_c5_512x10x10"):
        for func in (
            definition.forward(SUITE[name]),
            schedules._any_size_definition(SUITE[name].any_size(), target),
        ):
            sch = PipelinedCUDA().apply(func, target)
            source = cuda_build.cuda_source(SUITE[name], arch, schedule=sch)
            assert not cuda_build.nvcc_build(source, arch).spills(), name
            ptx = cuda_build.nvcc_ptx(source, arch)
            copies = set(re.findall(r"cp\.async\.\w+\.shared\.global[^;]*, (\d+);", ptx))
            if arch == "sm_75":
                assert not copies
            else:
                assert copies == {"4"} and "cp.async.wait_group 0;" in ptx, (name, copies)
    default = cuda_build.cuda_source(SUITE["demo_64x56x56"], "sm_90")
    assert "cp_async" not in default


def test_the_wide_tile_takes_layers_with_64_output_channels_a_group():
    target = targets.cuda_target("sm_90", 132)
    taken = {n for n, s in SUITE.items() if WideTileCUDA().apply(definition.forward(s), target)}
    assert taken == set(SUITE) - {"seed", "depthwise_128x56x56"}
    sch = s_tir.Schedule(definition.forward(SUITE["r50_c3_128x100x168"]))
    assert WideTileCUDA().out_tile(sch, WideTileCUDA().budget(target)) == (16, 8)
    sch = s_tir.Schedule(definition.forward(SUITE["demo_64x56x56"]))
    assert WideTileCUDA().out_tile(sch, WideTileCUDA().budget(target)) == (8, 8)


@needs_nvcc
def test_the_wide_tile_builds_for_the_gpu_without_spills():
    target = targets.cuda_target("sm_90", 132)
    for name in ("demo_64x56x56", "r50dcn320_c5_512x10x10"):
        func = schedules._any_size_definition(SUITE[name].any_size(), target)
        source = cuda_build.cuda_source(
            SUITE[name], "sm_90", schedule=WideTileCUDA().apply(func, target)
        )
        built = cuda_build.nvcc_build(source, "sm_90")
        assert 2 <= len(built.kernels) <= 3 and not built.spills(), name
        # 64 accumulators a thread, and no more registers than a thread may have.
        assert 64 < built.usage()["deform_conv2d_kernel_1"].registers <= 255, name


@needs_nvcc
def test_random_points_of_the_sample_once_spaces_build_for_the_gpu():
    target = targets.cuda_target("sm_90", 132)
    shape = SUITE["r50dcn320_c4_256x20x20"]
    for sch in random_points(definition.forward(shape), SampleOnceCUDA(), target, 3):
        built = cuda_build.nvcc_build(cuda_build.cuda_source(shape, "sm_90", schedule=sch), "sm_90")
        assert 2 <= len(built.kernels) <= 3 and not built.spills()


#: what torch may do in a call of ours without launching a kernel on a GPU: allocate, view
LAUNCH_FREE_OPS = {
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::new_empty",
    "aten::view",
    "aten::reshape",
    "aten::_unsafe_view",
    "aten::as_strided",
    "aten::alias",
    "aten::detach",
    "aten::lift_fresh",
}


@needs_nvcc
@pytest.mark.parametrize("name", ["r50dcn320_c5_512x10x10", "r50dcn320_c3_128x40x40"])
def test_a_cuda_call_launches_at_most_three_kernels(name, monkeypatch):
    """The kernels one forward call of the public op launches on a GPU: the CUDA module's own
    (the sampling kernel, the GEMM, and the sum of the parts of a split reduction), each
    launched once, and none of torch's: the call pads, transposes and zeroes nothing. The
    call is made on the CPU, through the op's own path, with the CUDA kernel's structure
    emulated; torch's profiler lists what torch did in it."""
    from tvm_deform.runtime import kernels

    layer = SUITE[name].any_size()
    shape = dataclasses.replace(layer, batch=2, height=23, width=31)
    target = targets.cuda_target("sm_90", 132)
    pixels = kernels._size_class(shape, schedules.pixel_classes(shape, target))
    sch = schedules.forward_schedule(shape, target, min_pixels=pixels)
    with target:
        built = tvm.compile(sch.mod, target=target)
    source = "\n".join(m.inspect_source("cuda") for m in built.mod.imports if m.kind == "cuda")
    ours = set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source))
    assert 2 <= len(ours) <= 3
    # Each kernel has one launch site: the host function (LLVM IR) looks up its handle once.
    host = built.mod.inspect_source("ll")
    for kernel in ours:
        sites = re.findall(rf"load ptr, ptr @\.tvm_func\.{kernel},", host)
        assert len(sites) == 1, kernel

    parts = schedules.split_parts(shape, target)
    emulated = emulated_any_size_kernel(layer, parts)
    monkeypatch.setattr(kernels, "get_kernel", lambda *args, **kwargs: emulated)
    inputs = random_inputs(shape)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        output = deform_conv2d(**inputs, **conv_kwargs(shape))
    torch_ops = {event.name for event in profile.events() if event.name.startswith("aten::")}
    assert "aten::view" in torch_ops  # the profiler sees inside the op
    assert torch_ops <= LAUNCH_FREE_OPS, torch_ops - LAUNCH_FREE_OPS
    expected = torchvision.ops.deform_conv2d(**inputs, **conv_kwargs(shape))
    assert_close(output, expected, 1e-6)


#: layers the tensor-core rule takes (ungrouped; output channels, padded pixels and
#: in_channels x taps multiples of 16): batch 2 with offset groups and a bias, a strided one,
#: a 1x3 DCNv1 layer with 3 offset groups, and 3 images of 16 pixels (tiles of one fragment)
TENSOR_CORE_CONFIGS = [
    dict(n=2, c=32, h=9, w=9, o=32, kh=3, kw=3, stride=(1, 1), padding=(1, 1),
         dilation=(1, 1), groups=1, offset_groups=2, use_mask=True, use_bias=True),
    dict(n=1, c=16, h=20, w=20, o=48, kh=3, kw=3, stride=(2, 2), padding=(1, 1),
         dilation=(1, 1), groups=1, offset_groups=1, use_mask=True, use_bias=False),
    dict(n=3, c=48, h=8, w=24, o=16, kh=1, kw=3, stride=(1, 1), padding=(0, 1),
         dilation=(1, 1), groups=1, offset_groups=3, use_mask=False, use_bias=True),
    dict(n=3, c=64, h=5, w=4, o=16, kh=2, kw=3, stride=(1, 1), padding=(0, 1),
         dilation=(1, 1), groups=1, offset_groups=4, use_mask=True, use_bias=True),
]  # fmt: skip
HALF_TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.mark.parametrize("rule", [TensorCoreCUDA, SampleOnceTensorCoreCUDA])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "cfg", TENSOR_CORE_CONFIGS, ids=["batch2", "strided", "dcnv1_1x3", "odd_fragments"]
)
def test_emulated_tensor_core_schedule_matches_torchvision(cfg, dtype, rule):
    """The tensor-core schedules' structure (matrix form, fragment tiling, the columns
    sampled into the shared-memory fill or by a sampling kernel of their own, epilogue),
    without the bindings and the WMMA instructions, run on the CPU against torchvision on the
    same rounded inputs, computed in float32 and in float64."""
    shape = shape_of(cfg, dtype)
    func = definition.forward(shape, column_dtype=shape.dtype)
    sch = rule(emulate=True).apply(func, targets.host_target())
    assert sch is not None, "the rule must take this layer"
    kernel = tvm.compile(sch.mod, target=targets.host_target())["deform_conv2d"]
    args = make_inputs(cfg, dtype)
    ours = run_forward(
        shape, args["input"], args["offset"], args["weight"], args["bias"], args["mask"], kernel
    )
    assert ours.dtype == dtype
    for reference in (torch.float32, torch.float64):
        upcast = _upcast(args, reference)
        assert_close(ours, torchvision.ops.deform_conv2d(**upcast), HALF_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("min_pixels", [1, 256, 1024], ids=["16x32", "32x64", "128x64"])
def test_one_emulated_tensor_core_kernel_takes_every_size(dtype, min_pixels):
    """The tensor-core GEMM's kernel for any size (its tiles in three size classes on 16
    multiprocessors: 16 x 32 outputs of one warp, 32 x 64 of two, 128 x 64 of four), emulated
    on the CPU: within rounding of torchvision's float64 result on the same rounded inputs, at
    sizes no suite layer has (odd maps, 1x1 maps, an empty batch, a batch of 3, maps of less
    than one tile and of many)."""
    name = str(dtype).removeprefix("torch.")
    layer = ConvShape(
        0, 32, 0, 0, 128, 3, 3, pad_h=1, pad_w=1, offset_groups=2, has_mask=True, has_bias=True,
        dtype=name,
    )  # fmt: skip
    target = targets.cuda_target("sm_90", 16)
    func = schedules._tensor_core_definition(layer, target, "NCHW", min_pixels)
    rule = SampleOnceTensorCoreCUDA(emulate=True)
    tiling = rule.tiling(_Gemm.of(s_tir.Schedule(func), any_size=True), target)
    tile = {1: (16, 32), 256: (32, 64), 1024: (128, 64)}[min_pixels]
    assert (16 * tiling[0] * tiling[1], 16 * tiling[2] * tiling[3]) == tile
    sch = rule.apply(func, target)
    kernel = tvm.compile(sch.mod, target=targets.host_target())["deform_conv2d"]
    for batch, height, width in [(1, 13, 17), (2, 1, 1), (0, 9, 9), (3, 11, 6), (1, 30, 37)]:
        shape = dataclasses.replace(layer, batch=batch, height=height, width=width)
        inputs = random_inputs(shape)
        ours = run_forward(shape, **inputs, kernel=kernel)
        upcast = {k: v.double() if v is not None else None for k, v in inputs.items()}
        expected = torchvision.ops.deform_conv2d(**upcast, **conv_kwargs(shape))
        assert ours.shape == expected.shape and ours.dtype == dtype
        assert_close(ours, expected, HALF_TOLERANCE[dtype], f"{batch}x{height}x{width}")


def test_tensor_core_size_classes_follow_the_tile():
    """The tensor-core kernels for any size change tile where a larger one first gives each
    multiprocessor a block: the 128-channel layer on 132 multiprocessors from 544 pixels
    (16 x 32 tiles: 8 x 17 of them at 544), 1056 (32 x 32), 2112 (32 x 64), 4224 (64 x 64) and
    8448 (128 x 64); the smallest maps, 16 x 16 tiles."""
    shape = dataclasses.replace(SUITE["r50_c3_128x100x168"], dtype="float16")
    target = targets.cuda_target("sm_90", 132)
    classes = (1, 544, 1056, 2112, 4224, 8448)
    assert schedules.tensor_core_pixel_classes(shape, target) == classes
    assert schedules.tensor_core_pixel_classes(SUITE["r50_c3_128x100x168"], target) == (1,)


@pytest.mark.slow
def test_tensor_core_rule_takes_half_layers_and_leaves_the_rest():
    demo = SUITE["demo_64x56x56"]
    sm_90, sm_75 = targets.cuda_target("sm_90"), targets.cuda_target("sm_75")

    def on_tensor_cores(shape: ConvShape, target) -> bool:
        sch = schedules.tensor_core_schedule(shape, target)
        scheduled = sch is not None and "wmma" in sch.mod.script()
        assert schedules.tensor_cores_take(shape, target) == scheduled
        return scheduled

    for dtype in ("float16", "bfloat16"):
        half = dataclasses.replace(demo, dtype=dtype)
        assert on_tensor_cores(half, sm_90)
        # Not the default: the default schedule computes on the CUDA cores.
        assert "wmma" not in schedules.forward_schedule(half, sm_90).mod.script()
        # grouped, and a reduction (3 channels x 9 taps) that is not a multiple of 16
        assert not on_tensor_cores(
            dataclasses.replace(SUITE["depthwise_128x56x56"], dtype=dtype), sm_90
        )
        assert not on_tensor_cores(dataclasses.replace(SUITE["seed"], dtype=dtype), sm_90)
        # A 7x7 map (49 pixels, not a whole number of fragments): no kernel for its own size,
        # kernels for any size of its layer (the pixels padded)
        small = ConvShape(2, 64, 7, 7, 64, 3, 3, pad_h=1, pad_w=1, dtype=dtype)
        assert not on_tensor_cores(small, sm_90)
        assert schedules.tensor_cores_take(small, sm_90, any_size=True)
        assert "wmma" in schedules.tensor_core_schedule(small, sm_90, min_pixels=1).mod.script()
        assert not schedules.tensor_cores_take(SUITE["seed"], sm_90, any_size=True)
    # float16 WMMA exists from sm_70, bfloat16 from sm_80
    assert on_tensor_cores(dataclasses.replace(demo, dtype="float16"), sm_75)
    assert not on_tensor_cores(dataclasses.replace(demo, dtype="bfloat16"), sm_75)
    # float32 stays float32 (no TF32), and a CPU target never sees the rule
    assert not on_tensor_cores(demo, sm_90)
    assert (
        TensorCoreCUDA().apply(
            definition.forward(dataclasses.replace(demo, dtype="float16"), column_dtype="float16"),
            targets.host_target(),
        )
        is None
    )


@pytest.mark.parametrize(
    "shape, on_tensor_cores",
    [
        # one fragment of output channels and of reduction, 2 images of 32 pixels
        (ConvShape(2, 16, 4, 8, 16, 1, 1, dtype="bfloat16"), True),
        # a 1x1 kernel (one tap), three reduction fragments (chunks of one fragment)
        (ConvShape(1, 48, 8, 8, 80, 1, 1, dtype="float16"), True),
        # 3 images of 16 pixels (an odd number of fragments), offset groups, mask and bias
        (ConvShape(3, 64, 5, 4, 16, 2, 3, pad_w=1, offset_groups=4, has_mask=True,
                   has_bias=True, dtype="float16"), True),
        # a map of 24 pixels (not a whole fragment): left to the default schedule; one of 48
        # (three fragments, tiles of one image's pixels)
        (ConvShape(2, 64, 9, 11, 16, 2, 3, 1, 3, 0, 1, 1, 2, offset_groups=4, has_mask=True,
                   has_bias=True, dtype="float16"), False),
        (ConvShape(1, 32, 4, 12, 32, 1, 1, dtype="float16"), True),
    ],
    ids=["one_fragment", "one_tap", "odd_fragments", "24_pixels", "48_pixels"],
)  # fmt: skip
def test_small_half_layers_compile_for_cuda(shape, on_tensor_cores):
    """Small layers, where tiles of one fragment and unit loops appear, compile for sm_80 with
    the schedule that takes them (a random sweep of such layers once found two that did not),
    as the op compiles them (asynchronous copies on); a reduction of one or two chunks is not
    pipelined deeper than its chunks."""
    target = targets.cuda_target("sm_80")
    sch = schedules.tensor_core_schedule(shape, target) or schedules.forward_schedule(shape, target)
    built = kernels.compile_schedule(sch, target)
    source = "\n".join(m.inspect_source("cuda") for m in built.mod.imports if m.kind == "cuda")
    assert ("wmma::mma_sync" in source) == on_tensor_cores
    if on_tensor_cores:
        fragments = shape.in_channels * shape.taps // 16
        chunks = fragments // (2 if fragments % 2 == 0 else 1)  # chunks of 2 fragments, or 1
        assert ("cp_async" in source) == (chunks > 1), chunks


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensor_core_kernels_build_to_mma_instructions(arch, dtype):
    """A half-precision suite layer's CUDA kernels build with nvcc without spills; the GEMM's
    PTX multiplies on tensor cores (m16n16k16 WMMA, float32 accumulators, B as [reduction,
    pixel]: "row.row") and copies its chunks into shared memory asynchronously (cp.async,
    16 bytes a copy), pipelined over three chunks."""
    shape = dataclasses.replace(SUITE["r50dcn320_c4_256x20x20"], dtype=dtype)
    sch = schedules.tensor_core_schedule(shape, targets.cuda_target(arch))
    source = cuda_build.cuda_source(shape, arch, schedule=sch)
    built = cuda_build.nvcc_build(source, arch)
    assert built.machine_arch == int(arch.removeprefix("sm_"))
    assert not built.spills()
    ptx = cuda_build.nvcc_ptx(source, arch)
    inputs = "f16" if dtype == "float16" else "bf16"
    mma = set(re.findall(r"wmma\.mma\.sync\.aligned\.[\w.]+", ptx))
    # PTX names the float16 form by its accumulators only (".f32.f32"), bfloat16 in full.
    expected = "f32.f32" if dtype == "float16" else f"f32.{inputs}.{inputs}.f32"
    assert mma and all(m.startswith("wmma.mma.sync.aligned.row.row.m16n16k16.") for m in mma)
    assert all(m.endswith(expected) for m in mma), mma
    copies = set(re.findall(r"cp\.async\.[\w.]+ \[[^]]+\], \[[^]]+\], (\d+)", ptx))
    assert copies == {"16"}, copies
    # three chunks in flight: the main loop waits for all but the two newest chunks' copies
    assert "cp.async.wait_group 2;" in ptx


def test_emulated_tensor_cores_on_maps_of_48_pixels():
    """Two images of 48 pixels (three fragments each: the tiles stay within an image),
    emulated: within rounding of torchvision's float64 result on the same inputs."""
    shape = ConvShape(2, 32, 6, 8, 32, 3, 3, pad_h=1, pad_w=1, has_mask=True, dtype="float16")
    func = definition.forward(shape, column_dtype="float16")
    sch = SampleOnceTensorCoreCUDA(emulate=True).apply(func, targets.host_target())
    kernel = tvm.compile(sch.mod, target=targets.host_target())["deform_conv2d"]
    inputs = random_inputs(shape)
    ours = run_forward(shape, **inputs, kernel=kernel)
    upcast = {k: v.double() if v is not None else None for k, v in inputs.items()}
    expected = torchvision.ops.deform_conv2d(**upcast, **conv_kwargs(shape))
    assert_close(ours, expected, HALF_TOLERANCE[torch.float16])


@needs_nvcc
def test_tensor_core_kernels_for_any_size_build_without_spills():
    """The half-precision kernels for any size of a suite layer on tensor cores, in its
    smallest and largest size class, build with nvcc for sm_90 without spills, with
    asynchronous copies and WMMA."""
    shape = dataclasses.replace(SUITE["r50_c3_128x100x168"], dtype="bfloat16")
    target = targets.cuda_target("sm_90", 132)
    classes = schedules.tensor_core_pixel_classes(shape, target)
    for min_pixels in (classes[0], classes[-1]):
        sch = schedules.tensor_core_schedule(shape, target, min_pixels=min_pixels)
        source = cuda_build.cuda_source(shape.any_size(), "sm_90", schedule=sch)
        built = cuda_build.nvcc_build(source, "sm_90")
        assert not built.spills(), (min_pixels, built.kernels)
        ptx = cuda_build.nvcc_ptx(source, "sm_90")
        assert "cp.async.cg.shared.global" in ptx and "wmma.mma.sync" in ptx, min_pixels


def test_kernels_compile_in_the_callers_pass_context_with_async_copies():
    """``targets.compiling`` adds the async-copy option to the pass context a CUDA kernel
    compiles in and keeps the caller's options; the default kernels' code is the same with or
    without it (only copies a schedule pipelines asynchronously change)."""
    target = targets.cuda_target("sm_90")
    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):
        with targets.compiling(target):
            config = tvm.transform.PassContext.current().config
    assert config["tirx.use_async_copy"] and config["tirx.disable_cse_tir"]
    sch = schedules.forward_schedule(SUITE["demo_64x56x56"], target)
    with target:
        plain = tvm.compile(sch.mod, target=target)

    def source(built):
        return "\n".join(m.inspect_source("cuda") for m in built.mod.imports if m.kind == "cuda")

    assert source(plain) == source(kernels.compile_schedule(sch, target))


def test_tensor_core_pipeline_is_synchronous_before_sm_80():
    """On sm_75 (no cp.async) the float16 GEMM's copies are plain loads and stores."""
    shape = dataclasses.replace(SUITE["r50dcn320_c4_256x20x20"], dtype="float16")
    target = targets.cuda_target("sm_75")
    sch = schedules.tensor_core_schedule(shape, target)
    source = cuda_build.cuda_source(shape, "sm_75", schedule=sch)
    assert "wmma::mma_sync" in source and "cp_async" not in source


@pytest.mark.parametrize(
    "name, multiprocessors, tile",
    [
        # 256 x 448 outputs (400 pixels, padded): 64 x 128 does not divide the 28 pixel
        # fragments; 28 tiles of 64 x 64, 56 of 32 x 64 and 112 of 32 x 32 are too few for 132
        # multiprocessors, 224 of 16 x 32 enough; 112 are enough for 96
        ("r50dcn320_c4_s2_256x40x40", 132, (16, 32)),
        ("r50dcn320_c4_s2_256x40x40", 96, (32, 32)),
        # 256 x 4224: 132 tiles of 64 x 128
        ("r50_c4_256x50x84", 132, (64, 128)),
        # 512 x 128 outputs (100 pixels, padded): never enough, the most blocks (16 x 16)
        ("r50dcn320_c5_512x10x10", 132, (16, 16)),
        # 128 x 16832: 64 x 128 does not divide the 1052 pixel fragments; 128 x 64 does
        ("r50_c3_128x100x168", 132, (128, 64)),
    ],
)
def test_tensor_core_tile_fills_the_gpu(name, multiprocessors, tile):
    """The pipelined GEMM's thread-block tile (output channels x pixels): the largest that
    divides the GEMM and gives each multiprocessor a block, else the one with most blocks."""
    shape = dataclasses.replace(SUITE[name], dtype="float16")
    target = targets.cuda_target("sm_90", multiprocessors=multiprocessors)
    func = definition.forward(shape, column_dtype="float16")
    gemm = _Gemm.of(s_tir.Schedule(func))
    warps_i, frags_i, warps_j, frags_j = SampleOnceTensorCoreCUDA().tiling(gemm, target)
    assert (16 * warps_i * frags_i, 16 * warps_j * frags_j) == tile


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_layers_default_to_the_cuda_cores(dtype):
    """A half-precision layer's default kernels (here split into 16 parts) build for sm_90
    without spills and multiply on the CUDA cores; emulated on the CPU, the split matches
    torchvision on the upcast inputs."""
    shape = dataclasses.replace(SUITE["r50dcn320_c5_512x10x10"], dtype=dtype)
    assert schedules.split_parts(shape, targets.cuda_target("sm_90")) == 16
    source = cuda_build.cuda_source(shape, "sm_90")
    built = cuda_build.nvcc_build(source, "sm_90")
    assert all("spill" not in line or "0 bytes spill" in line for line in built.kernels.values())
    assert "mma" not in cuda_build.nvcc_ptx(source, "sm_90")
    small = ConvShape(1, 64, 6, 7, 48, 3, 3, pad_h=1, pad_w=1, has_bias=True, dtype=dtype)
    inputs = random_inputs(small)
    kernel = emulated_kernel(small, SplitReductionCUDA(4, emulate=True))
    ours = run_forward(small, **inputs, kernel=kernel)
    upcast = {k: v.float() if v is not None else None for k, v in inputs.items()}
    expected = torchvision.ops.deform_conv2d(**upcast, **conv_kwargs(small))
    assert ours.dtype == getattr(torch, dtype)
    assert_close(ours, expected, HALF_TOLERANCE[getattr(torch, dtype)])


@needs_nvcc
def test_float32_cuda_kernels_use_no_tensor_cores():
    ptx = cuda_build.nvcc_ptx(cuda_build.cuda_source(SUITE["demo_64x56x56"], "sm_90"), "sm_90")
    assert "wmma" not in ptx and "mma.sync" not in ptx


def test_build_command_writes_sources(tmp_path, capsys):
    assert main(["build", "--workload", "seed", "--arch", "sm_90", "--out", str(tmp_path)]) == 0
    source = (tmp_path / "seed-sm_90.cu").read_text()
    assert "__global__" in source
    if NVCC is not None:
        assert (tmp_path / "seed-sm_90.cubin").read_bytes()[:4] == b"\x7fELF"
        assert "registers" in capsys.readouterr().out


# On a GPU (skipped elsewhere).


@needs_gpu
@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"cfg{i}" for i in range(len(CONFIGS))])
def test_cuda_matches_torchvision_cuda(cfg):
    args = {
        k: v.cuda() if isinstance(v, torch.Tensor) else v
        for k, v in make_inputs(cfg, torch.float32).items()
    }
    assert_close(deform_conv2d(**args), torchvision.ops.deform_conv2d(**args), 2e-6)


@needs_gpu
def test_cuda_runs_on_the_current_stream_without_synchronising():
    from gpu_session import check_stream_capture

    # Capturing a CUDA graph fails if a kernel is launched on another stream or if the host
    # synchronises; replaying it on the side stream must give a plain call's result.
    assert check_stream_capture(SUITE["demo_64x56x56"])


@needs_gpu
def test_cuda_errors_are_clear():
    args = make_inputs(CONFIGS[1], torch.float32)
    with pytest.raises(ValueError, match="device"):
        deform_conv2d(args["input"].cuda(), args["offset"], args["weight"])


@needs_gpu
@pytest.mark.parametrize("cfg", CONFIGS[:6], ids=[f"cfg{i}" for i in range(6)])
def test_cuda_gradients_match_torchvision_and_repeat_exactly(cfg):
    args = make_inputs(cfg, torch.float32)
    names = [n for n in ("input", "offset", "weight", "bias", "mask") if args[n] is not None]
    results = []
    for fn in (deform_conv2d, deform_conv2d, torchvision.ops.deform_conv2d):
        leaves = {n: args[n].cuda().requires_grad_() for n in names}
        out = fn(**(args | leaves))
        results.append(torch.autograd.grad(out, list(leaves.values()), torch.ones_like(out)))
    first, second, theirs = results
    for name, a, b, c in zip(names, first, second, theirs, strict=True):
        assert torch.equal(a, b), f"grad_{name} differs between two runs"
        assert_close(a.cpu(), c.cpu(), 2e-5, f"grad_{name}")


def emulated_backward(
    layer: ConvShape,
    sizes: str = "static",
    quantum: int | None = None,
    gradients: s_tir.Schedule | None = None,
):
    """The CUDA backward rules' schedules of ``layer`` (``sizes`` as for
    :func:`definition.backward`; for any size, the offset and mask read at a clamped pixel
    index, as on a GPU; the input's gradient gathered by tiles), compiled for this CPU
    without the thread bindings: (the gradients kernel's schedule, the kernels as the op
    calls them). ``gradients``: that schedule, if not the default's."""
    from tvm_deform.schedules.cuda_backward import BackwardCUDA, GradInputCUDA

    from tvm_deform.runtime.kernels import BackwardKernels

    host, any_size = targets.host_target(), sizes == "symbolic"
    quantum = quantum or definition.PIXEL_QUANTUM
    func = definition.backward(layer, definition.ALL_GRADIENTS, sizes, quantum, not any_size)
    gradients = gradients or BackwardCUDA(emulate=True).apply(func, host)
    func = definition.grad_input_tiles(layer, sizes, quantum)
    scatter = GradInputCUDA(emulate=True).apply(func, host)
    symbol = "deform_conv2d_backward"
    module = tvm.IRModule(
        {
            symbol: gradients.mod["main"].with_attr("global_symbol", symbol),
            "deform_conv2d_grad_input": scatter.mod["main"],
        }
    )
    built = tvm.compile(module, target=host)
    kernels = BackwardKernels(built[symbol], built["deform_conv2d_grad_input"], quantum, any_size)
    return gradients, kernels


def random_geometry(shape: ConvShape, any_size: bool, seed: int):
    """Workspaces for the input's gradient of ``shape`` as the backward kernel writes them:
    random sample corners (inside or up to two pixels outside the image, clamped, their
    coefficients zero outside), random coefficients and column gradients."""
    g = torch.Generator().manual_seed(seed)
    shapes = definition.backward_buffer_shapes(shape, any_size=any_size)
    pixels = shape.out_h * shape.out_w
    rows = torch.zeros(shapes["sample_rows"], dtype=torch.int32)
    cols = torch.zeros_like(rows)
    coef = torch.zeros(shapes["sample_coef"])
    coef[..., :pixels] = torch.rand(coef[..., :pixels].shape, generator=g)
    for buffer, size, axis in (
        (rows, shape.height, lambda q: q // 2),
        (cols, shape.width, lambda q: q % 2),
    ):
        first = torch.randint(-2, size + 1, (*rows.shape[:3], pixels), generator=g)
        for corner in range(2):
            buffer[..., corner, :pixels] = (first + corner).clamp(0, size - 1)
            outside = (first + corner < 0) | (first + corner >= size)
            for q in (q for q in range(4) if axis(q) == corner):
                coef[..., q, :pixels][outside] = 0
    columns = torch.randn(shapes["grad_columns"], generator=g)
    return columns, rows, cols, coef


#: layers for the input's gather: two runs of 32 lanes; 37 channels in two runs of 19 lanes,
#: the last lane of the last run repeating a channel; a channel per offset group (one lane);
#: a strided, dilated 5x3 kernel of two offset groups
GATHER_LAYERS = [
    ConvShape(2, 64, 13, 21, 8, 3, 3, pad_h=1, pad_w=1),
    ConvShape(1, 37, 11, 9, 8, 3, 1, stride_h=2, pad_h=1),
    ConvShape(2, 4, 17, 6, 4, 3, 3, pad_h=1, pad_w=1, offset_groups=4),
    ConvShape(1, 16, 23, 30, 8, 5, 3, 2, 1, 2, 1, 2, 1, offset_groups=2),
]


@pytest.mark.parametrize("sizes", ["static", "symbolic"])
def test_the_gpus_input_gather_gives_the_scatters_bits(sizes):
    """The GPU's input gradient, gathered by tiles of the plane (``grad_input_tiles`` as the
    CUDA rule schedules it, emulated), is bit for bit the scatter's (``grad_input``, a plane
    at a time in the order tap, pixel, corner), from the same workspaces: random corners,
    some clamped with a zero coefficient, landing anywhere in the plane."""
    from tvm_deform.schedules.cuda_backward import GradInputCUDA

    host = targets.host_target()
    for seed, shape in enumerate(GATHER_LAYERS):
        layer = shape.any_size() if sizes == "symbolic" else shape
        gather = GradInputCUDA(emulate=True).apply(definition.grad_input_tiles(layer, sizes), host)
        scatter = definition.grad_input(layer, sizes)
        workspaces = random_geometry(shape, sizes == "symbolic", seed)
        results = []
        for func in (gather.mod["main"], scatter):
            result = torch.full((shape.batch, shape.in_channels, shape.height, shape.width), 7.0)
            tvm.compile(tvm.IRModule({"main": func}), target=host)(
                *map(tvm.runtime.from_dlpack, (*workspaces, result))
            )
            results.append(result)
        assert results[1].abs().sum() > 0
        assert torch.equal(*results), shape


def test_the_gathers_lanes_fit_shared_memory():
    """A block of the gather runs an offset group's channels in the fewest runs of at most 32
    lanes, and takes no more lanes than their sums fit 48 KiB of shared memory."""
    shape = GATHER_LAYERS[0]
    assert definition.grad_input_lanes(shape) == 32
    assert definition.grad_input_lanes(dataclasses.replace(shape, in_channels=37)) == 19
    assert definition.grad_input_lanes(GATHER_LAYERS[2]) == 1
    definition.grad_input_tiles(shape, lanes=192)
    for dtype, lanes in (("float32", 193), ("float64", 97), ("float32", 0)):
        with pytest.raises(ValueError, match="lanes"):
            definition.grad_input_tiles(dataclasses.replace(shape, dtype=dtype), lanes=lanes)


@pytest.mark.parametrize("cfg", CONFIGS[:8], ids=[f"cfg{i}" for i in range(8)])
def test_emulated_cuda_backward_matches_torchvision(cfg):
    """The CUDA backward schedules' structure, without the thread bindings, run on the CPU:
    every gradient against torchvision's."""
    from tvm_deform.binding.ops import run_backward

    shape = shape_of(cfg)
    compiled = emulated_backward(shape)[1]
    args = make_inputs(cfg, torch.float32)
    grad_output = torch.randn(torchvision.ops.deform_conv2d(**args).shape, dtype=torch.float32)
    ours = run_backward(
        shape,
        grad_output,
        args["input"],
        args["offset"],
        args["weight"],
        args["mask"],
        compiled,
    )
    names = ["input", "offset", "weight", "bias", "mask"]
    leaves = {n: args[n].clone().requires_grad_() for n in names if args[n] is not None}
    out = torchvision.ops.deform_conv2d(**(args | leaves))
    grads = torch.autograd.grad(out, list(leaves.values()), grad_output)
    theirs = dict(zip(leaves, grads, strict=True))
    for name, value in zip(["input", "offset", "mask", "weight", "bias"], ours, strict=True):
        if name in theirs:
            assert_close(value, theirs[name], 2e-5, f"grad_{name}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_emulated_cuda_backward_for_any_size_matches_torchvision(dtype):
    """The CUDA backward kernels for any size (the input's gradient gathered by tiles),
    without the thread bindings, run on the CPU at sizes no suite names: every
    gradient against torchvision's in float64 on the same (upcast) inputs, in float32 also
    against torchvision's own, and the same bits twice. Of the half types, bfloat16 only:
    float16 goes through the same casts (the CPU's backward tests both)."""
    from tvm_deform.binding.ops import run_backward

    layer = ConvShape(0, 16, 0, 0, 24, 3, 3, 2, 1, 1, 1, 1, 2, offset_groups=2, has_bias=True)
    layer = dataclasses.replace(layer, dtype=dtype)
    quantum = schedules.backward_pixel_quantum(layer, targets.cuda_target("sm_90"))
    compiled = emulated_backward(layer, "symbolic", quantum)[1]
    tolerance = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}[dtype]
    for batch, height, width in ((1, 7, 9), (2, 12, 5), (3, 1, 3)):
        shape = dataclasses.replace(layer, batch=batch, height=height, width=width)
        inputs = random_inputs(shape)
        grad_output = torch.randn(shape.batch, shape.out_channels, shape.out_h, shape.out_w)
        grad_output = grad_output.to(getattr(torch, dtype))
        arguments = [inputs[n] for n in ("input", "offset", "weight", "mask")]
        ours = run_backward(shape, grad_output, *arguments, compiled)
        again = run_backward(shape, grad_output, *arguments, compiled)
        references = [torch.float64] + ([torch.float32] if dtype == "float32" else [])
        for reference in references:
            names = ["input", "offset", "weight", "bias", "mask"]
            leaves = {n: inputs[n].to(reference).requires_grad_() for n in names}
            out = torchvision.ops.deform_conv2d(**leaves, **conv_kwargs(shape))
            grads = torch.autograd.grad(out, list(leaves.values()), grad_output.to(reference))
            theirs = dict(zip(leaves, grads, strict=True))
            order = ["input", "offset", "mask", "weight", "bias"]
            for name, value, repeat in zip(order, ours, again, strict=True):
                assert value.dtype == getattr(torch, dtype)
                assert torch.equal(value, repeat), name
                where = f"grad_{name} at {batch}x{height}x{width} against {reference}"
                assert_close(value, theirs[name], tolerance, where)


@pytest.mark.parametrize("sizes", ["static", "symbolic"])
def test_emulated_cuda_backward_gemms_at_full_tiles_match_float64(sizes):
    """The backward's two GEMMs at the default's full tiles (8x4 rows by 16x4 columns, 64
    channels), the weight's reduction split into parts over the pixels, without the thread
    bindings on the CPU: the gradients against torchvision's in float64 on the same inputs, and
    the same bits twice."""
    shape = ConvShape(1, 64, 32, 32, 64, 3, 3, 1, 1, 1, 1, 1, 1, has_bias=True)
    quantum = schedules.backward_pixel_quantum(shape, targets.cuda_target("sm_90"))
    layer = shape if sizes == "static" else shape.any_size()
    gradients, compiled = emulated_backward(layer, sizes, quantum)
    names = {
        gradients.get(b).name_hint for b in gradients.get_child_blocks(gradients.get_sblock("root"))
    }
    assert "weight_sum_rf_update" in names  # split: 18 tiles of the weight's GEMM
    assert {"grad_columns_update", "weight_global", "columns_global"} <= names  # staged
    assert_gradients_match_float64(shape, compiled)


def assert_gradients_match_float64(shape: ConvShape, compiled) -> None:
    """The backward kernels ``compiled`` on random inputs of ``shape``: every gradient
    against torchvision's in float64 on the same inputs, and the same bits twice."""
    from tvm_deform.binding.ops import run_backward

    inputs = random_inputs(shape)
    grad_output = torch.randn(shape.batch, shape.out_channels, shape.out_h, shape.out_w)
    arguments = [inputs[n] for n in ("input", "offset", "weight", "mask")]
    ours = run_backward(shape, grad_output, *arguments, compiled)
    again = run_backward(shape, grad_output, *arguments, compiled)
    names = ["input", "offset", "weight", "bias", "mask"]
    leaves = {n: inputs[n].double().requires_grad_() for n in names if inputs[n] is not None}
    out = torchvision.ops.deform_conv2d(**leaves, **conv_kwargs(shape))
    grads = torch.autograd.grad(out, list(leaves.values()), grad_output.double())
    theirs = dict(zip(leaves, grads, strict=True))
    where = f"{shape.batch}x{shape.height}x{shape.width}"
    order = ["input", "offset", "mask", "weight", "bias"]
    for name, value, repeat in zip(order, ours, again, strict=True):
        if name in theirs:
            assert torch.equal(value, repeat), name
            assert_close(value, theirs[name], 2e-5, f"grad_{name} at {where}")


#: layers of stride 2 whose weight gradient for any size is split into parts: the split's
#: tail made TVM's buffer compaction raise when it built them (a bound past int32)
STRIDED_SPLIT_LAYERS = [
    ConvShape(0, 2, 0, 0, 2, 3, 3, 1, 2, 0, 2, offset_groups=2, has_mask=False),
    ConvShape(0, 12, 0, 0, 4, 5, 3, 2, 2, 3, 2, 3, 2, 2, 4, has_bias=True),
]


@needs_nvcc
@pytest.mark.parametrize("layer", STRIDED_SPLIT_LAYERS, ids=["2ch", "12ch_grouped"])
def test_cuda_backward_for_any_size_of_strided_layers_builds(layer):
    from tvm_deform.runtime import kernels

    target = targets.cuda_target("sm_90")
    quantum = schedules.backward_pixel_quantum(layer, target)
    built = kernels.compile_backward(layer, target, None, quantum=quantum)
    source = "\n".join(m.inspect_source("cuda") for m in built.mod.imports if m.kind == "cuda")
    assert "weight_sum_rf" in source  # the split reduction
    assert "atomic" not in source


def test_emulated_cuda_backward_for_any_size_of_a_strided_layer_matches_float64():
    """A grouped stride-2 layer's CUDA backward for any size, its weight gradient split into
    parts that each take every few chunks of pixels, without the thread bindings on the CPU:
    every gradient against torchvision's in float64 on the same inputs, at sizes whose pixels
    fill no whole quantum and several, the same bits twice."""
    layer = STRIDED_SPLIT_LAYERS[1]
    quantum = schedules.backward_pixel_quantum(layer, targets.cuda_target("sm_90"))
    gradients, compiled = emulated_backward(layer, "symbolic", quantum)
    assert "weight_sum_rf" in gradients.mod.script()
    for batch, height, width in ((1, 9, 7), (2, 23, 30)):
        shape = dataclasses.replace(layer, batch=batch, height=height, width=width)
        assert_gradients_match_float64(shape, compiled)


def torchvision_gradients(shape: ConvShape, inputs: dict, grad_output, dtype=None) -> dict:
    """torchvision's gradients of every input of ``inputs`` but the data, in ``dtype``."""
    inputs = {n: None if v is None else v.detach().to(dtype, copy=True) for n, v in inputs.items()}
    names = ["offset", "weight", "bias", "mask"]
    leaves = {n: inputs[n].requires_grad_() for n in names if inputs[n] is not None}
    out = torchvision.ops.deform_conv2d(**(inputs | leaves), **conv_kwargs(shape))
    grads = torch.autograd.grad(out, list(leaves.values()), grad_output.to(out.dtype))
    return dict(zip(leaves, grads, strict=True))


def test_random_points_of_the_cuda_backward_spaces_match_torchvision():
    """What a tuning round may propose for the backward computes torchvision's gradients:
    random tiles, chunks and parts of both design spaces (the weight's reduction in one pass
    and split), emulated on the CPU, the same bits twice."""
    from tvm_deform.schedules.cuda_backward import BackwardCUDA

    from tvm_deform.binding.ops import run_backward

    shape = ConvShape(1, 32, 9, 9, 32, 3, 3, pad_h=1, pad_w=1, offset_groups=2, has_bias=True)
    func = definition.backward(shape)  # 81 pixels, padded to 128
    points = random_points(func, BackwardCUDA(emulate=True), targets.host_target(), 3)
    assert len(points) == 6  # two spaces, three points each
    decided = {
        (i // 3, *(int(v) for v in p.trace.decisions.values())) for i, p in enumerate(points)
    }
    assert len(decided) == 6
    inputs = random_inputs(shape)
    grad_output = torch.randn(shape.batch, shape.out_channels, shape.out_h, shape.out_w)
    theirs = torchvision_gradients(shape, inputs, grad_output, torch.float64)
    arguments = [inputs[n] for n in ("input", "offset", "weight", "mask")]
    for sch in points:
        compiled = emulated_backward(shape, gradients=sch)[1]
        ours = run_backward(shape, grad_output, *arguments, compiled)
        assert all(map(torch.equal, ours, run_backward(shape, grad_output, *arguments, compiled)))
        for name, value in zip(["input", "offset", "mask", "weight", "bias"], ours, strict=True):
            if name in theirs:
                assert_close(value, theirs[name], 2e-5, f"grad_{name}")


def test_random_points_of_the_cuda_backward_spaces_for_any_size_match_torchvision():
    """A tuned backward record carried over to the kernels for any size of its layer runs its
    rule's design space of the PrimFunc for any size at the record's choices
    (``schedules.derive``): random tiles, chunks and parts of both spaces there (the weight's
    reduction in one pass, and split into a sampled count of parts with a chunk that each
    count divides), emulated on the CPU at three sizes, give torchvision's gradients."""
    from tvm_deform.schedules.cuda_backward import BackwardCUDA

    from tvm_deform.binding.ops import run_backward

    layer = ConvShape(0, 32, 0, 0, 32, 3, 3, pad_h=1, pad_w=1, offset_groups=2, has_bias=True)
    quantum = schedules.backward_pixel_quantum(layer, targets.cuda_target("sm_90"))
    func = definition.backward(layer, definition.ALL_GRADIENTS, "symbolic", quantum, False)
    points = random_points(func, BackwardCUDA(emulate=True), targets.host_target(), 2)
    assert len(points) == 4  # two spaces, two points each
    for sch in points:
        compiled = emulated_backward(layer, "symbolic", quantum, gradients=sch)[1]
        # maps of one quantum of pixels and of three (the split's parts across them)
        for batch, height, width in ((1, 7, 9), (3, 1, 3), (2, 12, 13)):
            shape = dataclasses.replace(layer, batch=batch, height=height, width=width)
            inputs = random_inputs(shape)
            grad_output = torch.randn(shape.batch, shape.out_channels, shape.out_h, shape.out_w)
            theirs = torchvision_gradients(shape, inputs, grad_output, torch.float64)
            arguments = [inputs[n] for n in ("input", "offset", "weight", "mask")]
            ours = run_backward(shape, grad_output, *arguments, compiled)
            order = ["input", "offset", "mask", "weight", "bias"]
            where = f"at {batch}x{height}x{width}"
            for name, value in zip(order, ours, strict=True):
                if name in theirs:
                    assert_close(value, theirs[name], 2e-5, f"grad_{name} {where}")


@needs_nvcc
def test_random_points_of_the_cuda_backward_spaces_build_for_the_gpu():
    """Random points of both backward spaces of a suite layer build with nvcc: no spills, no
    atomics, both GEMMs staged in shared memory within the budget."""
    from tvm_deform.schedules.cuda_backward import BackwardCUDA

    from tvm_deform.runtime.kernels import compile_schedule

    target = targets.cuda_target("sm_90", 132)
    shape = SUITE["r50dcn320_c4_256x20x20"]
    for sch in random_points(definition.backward(shape), BackwardCUDA(), target, 2):
        module = compile_schedule(sch, target)
        source = "\n".join(m.inspect_source("cuda") for m in module.mod.imports)
        assert "atomic" not in source
        built = cuda_build.nvcc_build(source, "sm_90")
        assert not built.spills()
        staged = [u.shared for u in built.usage().values() if u.shared]
        assert len(staged) == 2 and max(staged) <= STATIC_SHARED_MEMORY


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_backward_for_any_size_builds_without_atomics(arch):
    from tvm_deform.runtime import kernels

    layer = SUITE["demo_64x56x56"].any_size()
    target = targets.cuda_target(arch)
    quantum = schedules.backward_pixel_quantum(layer, target)
    built = kernels.compile_backward(layer, target, None, quantum=quantum)
    source = "\n".join(m.inspect_source("cuda") for m in built.mod.imports if m.kind == "cuda")
    assert "atomic" not in source
    machine = cuda_build.nvcc_build(source, arch)
    assert "deform_conv2d_grad_input_kernel" in machine.kernels
    assert not machine.spills()
    assert kernels.any_size(SUITE["demo_64x56x56"], target, False, op="backward")


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_suite_layers_backward_for_any_size_builds_to_machine_code(arch):
    """Every suite layer's CUDA backward kernels for any size build with nvcc: no spills, no
    stack frame, no atomics; the two GEMMs (column and weight gradients) stage their chunks in
    shared memory within the budget, except where a group's channels are too few to tile (the
    seed and depthwise layers); the input's gather keeps one tile of sums a lane there."""
    import concurrent.futures

    from tvm_deform.runtime import kernels

    target = targets.cuda_target(arch)

    def build(layer):
        name, shape = layer
        quantum = schedules.backward_pixel_quantum(shape, target)
        built = kernels.compile_backward(shape.any_size(), target, None, quantum=quantum)
        source = "\n".join(m.inspect_source("cuda") for m in built.mod.imports if m.kind == "cuda")
        return name, source, cuda_build.nvcc_build(source, arch)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        built_layers = list(pool.map(build, SUITE.items()))
    for name, source, built in built_layers:
        assert "atomic" not in source, name
        assert not built.spills(), name
        staged = {kernel: usage.shared for kernel, usage in built.usage().items()}
        gemms = [b for k, b in staged.items() if k.startswith("deform_conv2d_backward") and b]
        if name == "seed" or name.startswith("depthwise"):  # 3 and 1 channels per group
            assert not gemms, name
        else:
            assert len(gemms) == 2 and max(gemms) <= STATIC_SHARED_MEMORY, (name, staged)
        tile = definition.GRAD_INPUT_TILE[0] * definition.GRAD_INPUT_TILE[1] * 4
        gather = [b for k, b in staged.items() if k.startswith("deform_conv2d_grad_input") and b]
        assert gather == [tile * definition.grad_input_lanes(SUITE[name])], (name, staged)
        assert len(built.kernels) <= 16, (name, list(built.kernels))


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_backward_builds_without_atomics(arch):
    """The backward kernels of a suite layer (every gradient) build for ``arch`` with nvcc,
    and nothing in them adds atomically (the gradients are the same bits on every run)."""
    from tvm_deform.runtime import kernels

    built = kernels.compile_backward(SUITE["demo_64x56x56"], targets.cuda_target(arch))
    source = "\n".join(m.inspect_source("cuda") for m in built.mod.imports if m.kind == "cuda")
    assert "atomic" not in source
    machine = cuda_build.nvcc_build(source, arch)
    assert machine.machine_arch == int(arch.removeprefix("sm_"))
    assert "deform_conv2d_grad_input_kernel" in machine.kernels
    assert len(machine.kernels) >= 10  # one kernel per stage of the gradients PrimFunc
    assert not machine.spills()  # nor a stack frame


@needs_nvcc
def test_cuda_backward_of_a_large_batch_builds_in_int64_without_a_stack_frame():
    """A detector-size batch passes int32, so its backward runs kernels for its own size,
    indexed in int64: they build with nvcc, and the input's gather keeps no stack frame (a
    thread's plane of 200x336, 269 KB, once was one, which the GPU reserves for each of its
    threads)."""
    from tvm_deform.runtime import kernels

    shape = ConvShape(16, 256, 200, 336, 256, 3, 3, pad_h=1, pad_w=1)
    target = targets.cuda_target("sm_90")
    assert not kernels.any_size(shape, target, False, op="backward")
    built = kernels.compile_backward(shape, target)
    source = "\n".join(m.inspect_source("cuda") for m in built.mod.imports if m.kind == "cuda")
    machine = cuda_build.nvcc_build(source, "sm_90")
    assert "deform_conv2d_grad_input_kernel" in machine.kernels
    assert not machine.spills()


@needs_nvcc
def test_generic_cuda_design_space_builds():
    """MetaSchedule's generic space for a CUDA target (what ``tvm-deform tune`` searches on a
    GPU) generates schedules of our PrimFunc that TVM and nvcc build, without a GPU."""
    target = targets.cuda_target("sm_90")
    mod = records.workload_module(SUITE["seed"])
    context = ms.TuneContext(
        mod=mod, target=target, space_generator="post-order-apply", num_threads=1
    )
    spaces = context.generate_design_space()
    assert spaces
    sch = s_tir.Schedule(mod)
    spaces[0].trace.apply_to_schedule(sch, remove_postproc=True)
    with target:
        built = tvm.compile(sch.mod, target=target)
    source = built.mod.imports[0].inspect_source("cuda")
    assert cuda_build.nvcc_build(source, "sm_90").kernels


@needs_nvcc
def test_cuda_kernel_workspaces_come_from_torchs_allocator(tmp_path):
    """A CUDA kernel library allocates its scratch buffers (the sampling geometry between its
    kernels) through TVM's workspace functions; once attached they are torch's caching
    allocator's (stream-ordered, usable under graph capture). Without a GPU the library is
    opened with ctypes (TVM's loader needs a CUDA driver), which is enough to check the
    redirection; a GPU run checks the allocations themselves."""
    import ctypes

    from tvm_deform.runtime import kernels, workspace

    if torch.version.cuda is None:
        pytest.skip("this torch has no CUDA")
    allocator = workspace.get()
    assert allocator is not None, workspace.unavailable_reason
    built = kernels.compile_kernel(SUITE["demo_64x56x56"], targets.cuda_target("sm_90"))
    path = tmp_path / "demo.so"
    built.export_library(str(path))
    assert (
        "TVMBackendAllocWorkspace"
        in subprocess.run(["nm", "-D", str(path)], capture_output=True, text=True).stdout
    )
    ctypes.CDLL(str(path))
    assert workspace.attach(path)
    assert workspace.workspace_functions(path) == (allocator.alloc, allocator.free)


def test_the_split_is_sized_by_the_gpus_multiprocessors():
    # The multiprocessor count is a fact of the target (it enters the workload key): a small
    # GPU needs fewer thread blocks, so its reductions are split into fewer parts.
    rule = SplitReductionCUDA()
    func = definition.forward(SUITE["r50dcn320_c5_512x10x10"])
    small, large = targets.cuda_target("sm_90", 8), targets.cuda_target("sm_90", 132)
    assert rule.blocks_wanted(small) == 32 and rule.blocks_wanted(large) == 528
    assert rule.blocks_wanted(targets.cuda_target("sm_90")) == rule.enough_blocks
    assert rule.split_parts(func, small) == 1 < rule.split_parts(func, large)
    assert targets.workload_key(SUITE["seed"], small) != targets.workload_key(SUITE["seed"], large)


def test_a_misaligned_weight_is_copied_for_the_gpu():
    """The tensor-core GEMM copies the weight 16 bytes at a time: a weight whose data does not
    start at a multiple of 16 bytes (a view one value into a larger tensor) reaches a CUDA
    kernel as an aligned copy, an aligned one as itself."""
    from tvm_deform.runtime.calls import CUDA_WEIGHT_ALIGNMENT, aligned

    whole = torch.arange(1 + 4 * 16, dtype=torch.float16)
    view = whole[1:].view(4, 16)
    assert view.data_ptr() % CUDA_WEIGHT_ALIGNMENT
    copy = aligned(view, CUDA_WEIGHT_ALIGNMENT)
    assert copy.data_ptr() % CUDA_WEIGHT_ALIGNMENT == 0 and torch.equal(copy, view)
    assert aligned(whole, CUDA_WEIGHT_ALIGNMENT) is whole


@pytest.mark.parametrize("chunk", [1, 2], ids=["chunk16", "chunk32"])
def test_tensor_core_copies_divide_among_the_threads(chunk):
    """Every tiling's chunks of the weight and of the columns divide into the thread block's
    threads x 8 values: the 16-byte copies need no predicate (a predicated vector copy does
    not build)."""
    for (wi, fi), (wj, fj) in SampleOnceTensorCoreCUDA.tilings:
        threads = wi * wj * SampleOnceTensorCoreCUDA.warp_size * SampleOnceTensorCoreCUDA.vector
        depth = chunk * 16
        assert (wi * fi * 16 * depth) % threads == 0 and (depth * wj * fj * 16) % threads == 0


@needs_nvcc
@pytest.mark.slow
def test_a_cuda_rounds_candidates_carry_over_to_the_kernels_for_any_size(tmp_path):
    """A CUDA record the logs choose serves the kernels for any size of its size class
    (``kernels.class_records``). The candidates of a round, as their traces are committed,
    carried over to the layer's PrimFunc for any size (sizes symbolic) in the class of their
    size: each is derived (its rule's design space for any size, with the candidate's
    choices; the default schedule's steps are replayed), and every seed (the sample-once
    structures' spaces, one pass and split, and the fused ones') and searched ones build with
    nvcc for sm_90. (A searched candidate may keep a local buffer of a symbolic size: such a
    build fails, and dispatch runs the default schedule in that class instead.) The
    backward's candidates are derived too, and build."""
    from tvm_deform.tools import rounds

    layer = ConvShape(1, 64, 20, 20, 64, 3, 3, pad_h=1, pad_w=1, has_bias=True)
    argv = ["tune-round", "--shape", json.dumps(dataclasses.asdict(layer)), "--op", "all"]
    argv += ["--arch", "sm_90", "--multiprocessors", "132", "--count", "12"]
    argv += ["--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "round")]
    assert main(argv) == 0  # the seeds (each design space's own schedule), then at random
    described = json.loads((tmp_path / "round" / rounds.ROUND_FILE).read_text())
    workload, backward = described["workloads"].values()
    target = targets.cuda_target("sm_90", 132)
    mod = records.workload_module(layer)
    size_class = kernels._size_class(layer, schedules.pixel_classes(layer, target))
    func = schedules._any_size_definition(layer, target, "NCHW", size_class)
    built = []
    for entry in workload["candidates"]:
        assert "error" not in entry, entry.get("error")
        trace = rounds.measure_candidate(entry, mod).sch.trace
        name = entry.get("seed", "searched")
        sch = schedules.derive("forward", func, target, mod["main"], trace)
        if name == "default":  # not of a design space (no choices): its steps replayed
            sch = schedules.replay(func, trace)
        assert sch is not None, name
        try:
            source = cuda_build.cuda_source(layer, "sm_90", schedule=sch)
            machine = cuda_build.nvcc_build(source, "sm_90")
        except RuntimeError:
            machine = None
        else:  # the sizes are the kernels' arguments
            assert all(re.search(rf"\bint {size}\b", source) for size in "hnw")
        built.append((name, machine))
    seeds = [name for name, _ in built if name != "searched"]
    # The default, two spaces of each sample-once structure, one of each fused one.
    assert sorted(seeds) == sorted(
        ["default", "OnePassCUDA", "SplitReductionCUDA"]
        + 2 * ["SampleOnceCUDA", "WideTileCUDA", "PipelinedCUDA"]
    )
    assert all(machine and not machine.spills() for name, machine in built if name in seeds)
    # The search's candidates (not the same from run to run) are derived too (asserted
    # above); whether each builds depends on its tiles.
    assert sum(name == "searched" for name, _ in built) >= 1

    # The backward's: derived for any size (its trace alone would not replay there: the
    # PrimFunc for any size has stages the one of one size has not, the output gradient's
    # pixels and the pixels' base), and built.
    mod = records.workload_module(layer, "backward")
    quantum = schedules.backward_pixel_quantum(layer, target)
    spaces = [entry for entry in backward["candidates"] if entry.get("seed") != "default"]
    assert [entry.get("seed") for entry in spaces[:3]] == ["BackwardCUDA", "BackwardCUDA", None]
    for entry in spaces[:3]:  # the two spaces' seeds and a searched one
        trace = rounds.measure_candidate(entry, mod).sch.trace
        tuning = ms.database.TuningRecord(trace, ms.database.Workload(mod), [1e-3], target)
        record = records.TunedRecord(tmp_path, "cuda/sm_90", "handwritten", 1.0, tuning)
        symbolic = definition.backward(
            layer.any_size(), sizes="symbolic", pixel_quantum=quantum, staged_inputs=False
        )
        assert schedules.replay(symbolic, trace) is None
        module = kernels.compile_backward(layer.any_size(), target, record, quantum=quantum)
        source = "\n".join(m.inspect_source("cuda") for m in module.mod.imports)
        assert cuda_build.nvcc_build(source, "sm_90")
