"""Export: ONNX (dynamo exporter, standard DeformConv), torch.export, AOTInductor."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torchvision.ops
from conftest import assert_close

from tvm_deform import deform_conv2d
from tvm_deform.binding.export import export_onnx


class Block(torch.nn.Module):
    """A DCNv2 block as detectors write it: a conv predicts offsets and mask, then the
    deformable conv, with weight and offset groups."""

    def __init__(self, op, mask: bool = True, bias: bool = True):
        super().__init__()
        self.op, self.mask = op, mask
        self.offset_conv = torch.nn.Conv2d(
            6, 3 * 2 * 9, 3, stride=(1, 2), padding=1
        )  # offset, mask
        self.weight = torch.nn.Parameter(torch.randn(4, 3, 3, 3) * 0.2)  # 2 weight groups
        self.bias = torch.nn.Parameter(torch.randn(4)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        predicted = self.offset_conv(x)
        offset = predicted[:, :36] * 2
        mask = torch.sigmoid(predicted[:, 36:]) if self.mask else None
        return self.op(
            x, offset, self.weight, self.bias, stride=(1, 2), padding=1, dilation=(1, 1), mask=mask
        )


def blocks(mask: bool, bias: bool) -> tuple[Block, Block]:
    torch.manual_seed(0)
    ours = Block(deform_conv2d, mask, bias).eval()
    theirs = Block(torchvision.ops.deform_conv2d, mask, bias).eval()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


EXAMPLE = torch.randn(2, 6, 9, 10, generator=torch.Generator().manual_seed(1))


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("onnxscript", "onnxruntime")),
    reason="needs the export extra (onnxscript, onnxruntime)",
)
@pytest.mark.parametrize("mask, bias", [(True, True), (False, False)], ids=["dcnv2", "dcnv1"])
def test_onnx_export_is_a_standard_deformconv_that_onnxruntime_runs(tmp_path, mask, bias):
    import onnx
    import onnxruntime

    ours, theirs = blocks(mask, bias)
    path = tmp_path / "block.onnx"
    export_onnx(ours, (EXAMPLE,), f=str(path))
    model = onnx.load(str(path))
    (node,) = [n for n in model.graph.node if n.op_type == "DeformConv"]
    assert node.domain == ""  # the standard operator, not a custom domain
    assert {o.domain: o.version for o in model.opset_import}[""] >= 19
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attributes["group"] == 2 and attributes["offset_group"] == 2
    assert list(attributes["strides"]) == [1, 2]
    assert not any(
        "tvm_deform" in n.op_type or n.domain.startswith("tvm") for n in model.graph.node
    )
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (result,) = session.run(None, {session.get_inputs()[0].name: EXAMPLE.numpy()})
    with torch.no_grad():
        assert_close(torch.from_numpy(result), theirs(EXAMPLE), 1e-5, "onnxruntime")


def test_torch_export_records_one_node_and_runs():
    ours, theirs = blocks(True, True)
    program = torch.export.export(ours, (EXAMPLE,))
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.tvm_deform.deform_conv2d.default) == 1
    with torch.no_grad():
        assert torch.equal(program.module()(EXAMPLE), ours(EXAMPLE))
        assert_close(program.module()(EXAMPLE), theirs(EXAMPLE), 1e-5, "torch.export")


@pytest.mark.slow
def test_aot_inductor_package_runs_in_this_process(tmp_path):
    ours, theirs = blocks(True, True)
    program = torch.export.export(ours, (EXAMPLE,))
    package = torch._inductor.aoti_compile_and_package(
        program, package_path=str(tmp_path / "block.pt2")
    )
    runner = torch._inductor.aoti_load_package(package)
    with torch.no_grad():
        assert_close(runner(EXAMPLE), theirs(EXAMPLE), 1e-5, "AOTInductor")
