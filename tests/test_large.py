"""Tensors past int32's range: the kernels index in int64 exactly when a buffer needs it. And
a GPU call whose sampled columns would be large runs its batch in chunks of images."""

from __future__ import annotations

import dataclasses
import re

import psutil
import pytest
import torch
import torchvision.ops
from conftest import assert_close

from tvm_deform import deform_conv2d
from tvm_deform.ir import definition
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels, targets
from tvm_deform.tools import cuda_build

#: the whole module is slow (many kernels, whole models or subprocesses): `pytest -m "not slow"`
#: leaves it out of the quick loop; CI runs it
pytestmark = pytest.mark.slow

#: the smallest square side whose plane passes 2**31 - 1 elements; a stride of 331 puts the
#: last output row on the last image row (46340 = 140 * 331)
SIDE = 46341
LARGE = ConvShape(1, 1, SIDE, SIDE, 1, 1, 1, stride_h=331, stride_w=331, dtype="float16")


def index_dtypes(func) -> dict[str, int]:
    """How many loops and shapes of ``func``'s TVMScript are int32 and how many int64."""
    text = func.script()
    int32 = len(re.findall(r"range\(\d+\)|T\.grid\(\d|Buffer\(\(\d", text))
    return {"int32": int32, "int64": text.count("T.int64(")}


def test_small_shapes_keep_int32_indexing():
    shape = ConvShape(2, 8, 20, 20, 8, 3, 3, pad_h=1, pad_w=1)
    for func in (definition.forward(shape), definition.backward(shape)):
        assert index_dtypes(func)["int64"] == 0
        assert index_dtypes(func)["int32"] > 0
    assert index_dtypes(definition.grad_input(shape))["int64"] == 0


@pytest.mark.parametrize(
    "shape, which",
    [
        (LARGE, "input"),
        # The backward's [N, C * K, P] buffers pass int32 at a realistic detector size.
        (ConvShape(16, 256, 200, 336, 256, 3, 3, pad_h=1, pad_w=1), "workspaces"),
    ],
    ids=["input", "backward-workspaces"],
)
def test_buffers_past_int32_are_indexed_in_int64(shape, which):
    funcs = [definition.forward(shape), definition.backward(shape), definition.grad_input(shape)]
    if which == "workspaces":
        assert max(map(lambda s: torch.Size(s).numel(), shape.buffer_shapes().values())) < 2**31
        funcs = funcs[1:]
    for func in funcs:
        dtypes = index_dtypes(func)
        assert dtypes["int32"] == 0 and dtypes["int64"] > 0
    # The default schedules apply to them and compile, CPU and CUDA (the GPU's input gradient
    # is a gather of its own: definition.grad_input_tiles).
    kernels.compile_kernel(LARGE, targets.host_target())
    assert "int64_t" in cuda_build.cuda_source(LARGE, "sm_90")
    backward = kernels.compile_backward(shape, targets.cuda_target("sm_90"))
    gather = [m.inspect_source("cuda") for m in backward.mod.imports if m.kind == "cuda"]
    assert "int64_t" in "".join(gather)


def bilinear_samples(data: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """torchvision's sampling rule at points (y, x) of the one-channel image ``data``, in
    float64, gathering only the four corners of each point (int64 indices)."""
    height, width = data.shape[-2:]
    flat = data.reshape(-1)
    inside = (y > -1) & (y < height) & (x > -1) & (x < width)
    y0, x0 = torch.floor(y), torch.floor(x)
    total = torch.zeros_like(y)
    for dy in (0, 1):
        for dx in (0, 1):
            row, col = y0 + dy, x0 + dx
            weight = (1 - (y - row).abs()) * (1 - (x - col).abs())
            valid = inside & (row >= 0) & (row < height) & (col >= 0) & (col < width)
            index = (row.clamp(0, height - 1) * width + col.clamp(0, width - 1)).long()
            total += torch.where(valid, weight * flat[index].double(), 0.0)
    return total


def reference_1x1(data, offset, weight, bias, mask, stride: int) -> torch.Tensor:
    """A one-channel 1x1 deformable conv by :func:`bilinear_samples`."""
    out_h, out_w = offset.shape[-2:]
    oy = torch.arange(out_h, dtype=torch.float64).view(-1, 1) * stride
    ox = torch.arange(out_w, dtype=torch.float64).view(1, -1) * stride
    samples = bilinear_samples(data, oy + offset[0, 0].double(), ox + offset[0, 1].double())
    return (weight.double().item() * mask[0, 0].double() * samples + bias.double().item())[
        None, None
    ]


def large_inputs(shape: ConvShape, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    rows = torch.cos(torch.arange(shape.height, dtype=torch.float32) * 0.01)
    cols = torch.sin(torch.arange(shape.width, dtype=torch.float32) * 0.013) * 0.5
    data = torch.empty(1, 1, shape.height, shape.width, dtype=dtype)
    torch.add(rows.to(dtype)[:, None], cols.to(dtype)[None, :], out=data[0, 0])
    offset = ((torch.rand(1, 2, shape.out_h, shape.out_w, generator=g) - 0.5) * 6).to(dtype)
    mask = torch.rand(1, 1, shape.out_h, shape.out_w, generator=g).to(dtype)
    weight = torch.tensor([[[[0.75]]]], dtype=dtype)
    bias = torch.tensor([0.25], dtype=dtype)
    return data, offset, weight, bias, mask


def test_reference_of_the_large_run_agrees_with_torchvision():
    shape = ConvShape(1, 1, 40, 37, 1, 1, 1, stride_h=3, stride_w=3)
    data, offset, weight, bias, mask = large_inputs(shape, torch.float64)
    expected = torchvision.ops.deform_conv2d(data, offset, weight, bias, stride=3, mask=mask)
    assert_close(reference_1x1(data, offset, weight, bias, mask, 3), expected, 1e-12)


@pytest.mark.skipif(
    psutil.virtual_memory().available < 8 * 2**30, reason="needs 8 GiB of free memory"
)
def test_input_past_int32_elements_gives_correct_values():
    data, offset, weight, bias, mask = large_inputs(LARGE, torch.float16)
    assert data.numel() > 2**31 - 1
    # The last output pixel samples beyond element 2**31 - 1.
    last = (LARGE.out_h - 1) * LARGE.stride_h * SIDE + (LARGE.out_w - 1) * LARGE.stride_w
    assert last > 2**31 - 1
    ours = deform_conv2d(data, offset, weight, bias, stride=331, mask=mask)
    expected = reference_1x1(data, offset, weight, bias, mask, 331)
    assert_close(ours, expected, 2e-3, "float16 input of 2.1e9 elements")


def test_a_gpu_call_whose_columns_pass_the_budget_takes_chunks_of_images():
    """A GPU kernel for any size samples the whole batch's columns into a workspace: past
    ``COLUMN_BYTES`` the call takes as many images as fit, at least one; a CPU call, or a
    batch that fits, takes every image."""
    from tvm_deform.runtime import calls

    c3 = ConvShape(8, 128, 800 // 8, 1336 // 8, 128, 3, 3, pad_h=1, pad_w=1)
    per_image = 128 * 9 * c3.out_h * c3.out_w * 4  # about 77 MB
    gpu = targets.cuda_target("sm_90")
    assert calls.images_per_call(c3, gpu) == calls.COLUMN_BYTES // per_image == 6
    assert calls.images_per_call(c3, gpu, "backward") == 6
    assert calls.images_per_call(c3, targets.host_target()) == 8
    # an image's columns alone pass the budget (829 MB)
    wide = ConvShape(2, 256, 300, 300, 256, 3, 3, pad_h=1, pad_w=1)
    assert calls.images_per_call(wide, gpu) == 1
    small = ConvShape(8, 64, 56, 56, 64, 3, 3, pad_h=1, pad_w=1)
    assert calls.images_per_call(small, gpu) == 8


@pytest.mark.parametrize("sizes", ["any", "static"])
def test_a_gpu_call_takes_at_most_the_grids_images(monkeypatch, sizes):
    """CUDA kernels run the images along a grid axis of at most 65535 blocks (the backward's
    column gradient, its (image, tap) pairs): a larger batch runs in chunks of that many,
    whether its kernels are for any size or for its own, fewer where kernels for any size
    would pass the columns' budget; a CPU call takes every image."""
    from tvm_deform.runtime import calls

    monkeypatch.setenv("TVM_DEFORM_SIZES", sizes)
    gpu = targets.cuda_target("sm_90")
    small = ConvShape(70_000, 4, 5, 5, 4, 3, 3, pad_h=1, pad_w=1)  # 3.6 KB of columns each
    assert calls.images_per_call(small, gpu) == calls.GRID_IMAGES == 65535
    assert calls.images_per_call(small, gpu, "backward") == 65535 // 9
    assert calls.images_per_call(dataclasses.replace(small, batch=65535), gpu) == 65535
    assert calls.images_per_call(small, targets.host_target()) == 70_000
    larger = ConvShape(70_000, 16, 8, 8, 16, 3, 3, pad_h=1, pad_w=1)  # 36.9 KB each
    per_image = 16 * 9 * 64 * 4
    fit = calls.COLUMN_BYTES // per_image if sizes == "any" else 65535
    assert calls.images_per_call(larger, gpu) == fit
    assert calls.images_per_call(larger, gpu, "backward") == 65535 // 9  # within the budget
    # The whole batch passes 2^31 elements (a kernel for its own size), a chunk of the grid's
    # images does not: the chunk runs kernels for any size, within the budget.
    wide = ConvShape(66_000, 512, 8, 8, 8, 1, 1)  # 32768 column elements an image
    assert wide.largest_forward_buffer() > definition.INT32_MAX
    fit = calls.COLUMN_BYTES // (512 * 64 * 4) if sizes == "any" else 65535
    assert calls.images_per_call(wide, gpu) == fit


def test_a_batch_run_in_chunks_of_images_gives_the_whole_batchs_output(monkeypatch):
    """The chunk loop, on the CPU: a batch of 5 in calls of 2, 2 and 1 images gives the
    same output as one call, bit for bit."""
    from tvm_deform.runtime import calls, inputs

    shape = ConvShape(5, 8, 9, 7, 6, 3, 3, pad_h=1, pad_w=1, has_bias=True)
    args = inputs.random_inputs(shape)
    whole = deform_conv2d(**args, **inputs.conv_kwargs(shape))
    seen = []

    def two_at_a_time(shape, target):
        seen.append(shape.batch)
        return 2

    monkeypatch.setattr(calls, "images_per_call", two_at_a_time)
    launches = []
    launch = calls._launch
    monkeypatch.setattr(
        calls, "_launch", lambda part, *a: launches.append(part.batch) or launch(part, *a)
    )
    chunked = deform_conv2d(**args, **inputs.conv_kwargs(shape))
    assert seen == [5] and launches == [2, 2, 1]
    assert torch.equal(chunked, whole)


@pytest.mark.parametrize("sizes", ["any", "static"])
def test_a_backward_run_in_chunks_of_images_gives_the_whole_batchs_gradients(monkeypatch, sizes):
    """The backward's chunk loop, on the CPU: a batch of 5 in calls of 2, 2 and 1 images gives
    the whole batch's input, offset and mask gradients bit for bit; the weight's and bias's,
    the chunks' sums added in order, agree within rounding and are the same bits on every
    run. With kernels for one size each chunk runs kernels for its own."""
    from tvm_deform.runtime import calls, inputs

    monkeypatch.setenv("TVM_DEFORM_SIZES", sizes)

    shape = ConvShape(5, 8, 9, 7, 6, 3, 3, pad_h=1, pad_w=1, has_bias=True)
    args = inputs.random_inputs(shape)
    grad_output = torch.randn(shape.batch, shape.out_channels, shape.out_h, shape.out_w)

    def gradients() -> dict[str, torch.Tensor]:
        leaves = {name: value.clone().requires_grad_() for name, value in args.items()}
        deform_conv2d(**leaves, **inputs.conv_kwargs(shape)).backward(grad_output)
        return {name: value.grad for name, value in leaves.items()}

    whole = gradients()
    asked = []

    def two_at_a_time(shape, target, op="forward", tuned=None):
        asked.append((shape.batch, op))
        return 2 if op == "backward" else shape.batch

    monkeypatch.setattr(calls, "images_per_call", two_at_a_time)
    launches = []
    launch = calls._run_backward_kernels
    monkeypatch.setattr(
        calls,
        "_run_backward_kernels",
        lambda part, *a: launches.append(part.batch) or launch(part, *a),
    )
    chunked, again = gradients(), gradients()
    assert (5, "backward") in asked
    assert launches == [2, 2, 1] * 2
    for name in ("input", "offset", "mask"):
        assert torch.equal(chunked[name], whole[name]), name
    for name in ("weight", "bias"):
        assert_close(chunked[name], whole[name], 1e-6, name)
        assert torch.equal(chunked[name], again[name]), name
