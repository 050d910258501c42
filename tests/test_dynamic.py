"""Dynamic batch, height and width through the op: ``torch.compile(dynamic=True)`` traces it
once for every size, ``torch.export`` with dynamic dimensions records one node that runs at
other sizes; forward and backward against torchvision."""

from __future__ import annotations

import pytest
import torch
import torchvision.ops
from conftest import assert_close
from torch._dynamo.testing import CompileCounterWithBackend

from tvm_deform import deform_conv2d

#: sizes chosen so that no dimension is 0 or 1 (which torch specialises) and none equals a
#: channel count (which duck sizing would tie to it)
SIZES = [(2, 10, 7), (3, 13, 11), (4, 6, 15)]
CHANNELS = 4


def arguments(n: int, h: int, w: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(n * 100 + h * 10 + w)
    shapes = [(n, CHANNELS, h, w), (n, 18, h, w), (5, CHANNELS, 3, 3), (n, 9, h, w)]
    return [torch.rand(*s, generator=generator).requires_grad_() for s in shapes]


def layer(ours: bool):
    op = deform_conv2d if ours else torchvision.ops.deform_conv2d

    def run(x, offset, weight, mask):
        return op(x, offset, weight, padding=1, mask=mask).relu()

    return run


def check(run, n, h, w) -> None:
    args = arguments(n, h, w)
    out = run(*args)
    grads = torch.autograd.grad(out.square().sum(), args)
    copies = [a.detach().clone().requires_grad_() for a in args]
    expected = layer(ours=False)(*copies)
    expected_grads = torch.autograd.grad(expected.square().sum(), copies)
    assert_close(out.detach(), expected.detach(), 1e-6, "output")
    names = ("input", "offset", "weight", "mask")
    for name, ours, theirs in zip(names, grads, expected_grads, strict=True):
        assert_close(ours, theirs, 1e-5, name)


@pytest.mark.slow
def test_compile_dynamic_traces_once_for_every_size():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer(ours=True), backend=counter, dynamic=True, fullgraph=True)
    for n, h, w in SIZES:
        check(compiled, n, h, w)
    assert counter.frame_count == 1


def test_export_with_dynamic_sizes_runs_other_sizes_forward_and_backward():
    batch = torch.export.Dim("batch", min=2, max=64)
    height, width = (torch.export.Dim(name, min=2, max=1024) for name in ("height", "width"))
    dims = {0: batch, 2: height, 3: width}

    class Layer(torch.nn.Module):
        def forward(self, x, offset, weight, mask):
            return layer(ours=True)(x, offset, weight, mask)

    n, h, w = SIZES[0]
    program = torch.export.export(
        Layer(), tuple(arguments(n, h, w)), dynamic_shapes=(dims, dims, None, dims)
    )
    nodes = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert torch.ops.tvm_deform.deform_conv2d.default in nodes
    module = program.module()
    for n, h, w in SIZES[1:]:
        check(module, n, h, w)
