"""Drop-in behaviour beyond the numbers: torchvision's exception types and check order, FX
tracing and feature extraction, TorchScript (cases ported from torchvision's TestDeformConv)."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

from tvm_deform import DeformConv2d, deform_conv2d


def layer_inputs(dtype=torch.float64, batch: int = 10):
    """torchvision's test_wrong_sizes set-up: 6 -> 2 channels, a 3x2 kernel, 2 groups, offset
    groups 3, stride (2, 1), padding (1, 0), dilation (2, 1); float64 tensors."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(batch, 6, 5, 4, generator=g, dtype=dtype)
    offset = torch.randn(batch, 3 * 2 * 3 * 2, 2, 3, generator=g, dtype=dtype)
    mask = torch.rand(batch, 3 * 3 * 2, 2, 3, generator=g, dtype=dtype)
    layer = DeformConv2d(6, 2, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1), groups=2)
    return x, offset, mask, layer


def test_wrong_sizes_raise_runtime_error_before_the_dtype_check():
    # The layer is float32 and the tensors float64, as in torchvision's test: the sizes are
    # reported first.
    x, offset, mask, layer = layer_inputs()
    with pytest.raises(RuntimeError, match="the shape of the offset"):
        layer(x, torch.rand_like(offset[:, :2]))
    with pytest.raises(RuntimeError, match=r"mask.shape\[1\] is not valid"):
        layer(x, offset, torch.rand_like(mask[:, :2]))


def test_errors_are_both_ours_and_runtime_errors():
    x, offset, mask, layer = layer_inputs(torch.float32)
    with pytest.raises(ValueError) as caught:
        layer(x, offset[:, :2])
    assert isinstance(caught.value, RuntimeError)
    with pytest.raises(TypeError) as caught:
        layer(x.double(), offset, mask)
    assert isinstance(caught.value, RuntimeError)


class Backbone(nn.Module):
    """A DCNv2 block as detection backbones write it: offsets and mask from a conv beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Conv2d(4, 27, 3, padding=1)
        self.dcn = DeformConv2d(4, 6, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.offset(x)
        return self.dcn(x, out[:, :18], out[:, 18:].sigmoid()).relu()


def test_fx_symbolic_trace():
    model = Backbone()
    x = torch.randn(2, 4, 7, 7)
    traced = torch.fx.symbolic_trace(model)
    ops = [n.target for n in traced.graph.nodes if n.op == "call_function"]
    assert torch.ops.tvm_deform.deform_conv2d.default in ops or (
        torch.ops.tvm_deform.deform_conv2d in ops
    )
    assert torch.equal(traced(x), model(x))


def test_fx_feature_extraction():
    from torchvision.models.feature_extraction import (
        create_feature_extractor,
        get_graph_node_names,
    )

    model = Backbone()
    x = torch.randn(2, 4, 7, 7)
    train, evaluation = get_graph_node_names(model)
    assert "relu" in evaluation
    (dcn,) = [name for name in evaluation if name.startswith("dcn")][-1:]
    features = create_feature_extractor(model, {dcn: "dcn", "relu": "out"})(x)
    assert torch.equal(features["out"], model(x))
    assert torch.equal(features["dcn"].relu(), model(x))


def scripted(obj):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script is deprecated
        return torch.jit.script(obj)


def test_torchscript_module_and_its_saved_copy():
    x, offset, mask, _ = layer_inputs(torch.float32)
    layer = DeformConv2d(6, 2, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1), groups=2)
    script = scripted(layer)
    assert torch.equal(script(x, offset, mask), layer(x, offset, mask))
    assert torch.equal(script(x, offset), layer(x, offset))
    buffer = io.BytesIO()
    torch.jit.save(script, buffer)
    buffer.seek(0)
    assert torch.equal(torch.jit.load(buffer)(x, offset, mask), layer(x, offset, mask))
    with pytest.raises(RuntimeError, match="the shape of the offset"):
        script(x, offset[:, :2])


def call(x: torch.Tensor, offset: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return deform_conv2d(x, offset, weight, stride=(2, 1), padding=[1, 0], dilation=(2, 1))


def call_int_pairs(x: torch.Tensor, offset: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return deform_conv2d(x, offset, weight, padding=1)


def test_torchscript_function():
    x, offset, mask, layer = layer_inputs(torch.float32)
    weight = layer.weight.detach()
    assert torch.equal(scripted(call)(x, offset, weight), call(x, offset, weight))
    y = torch.randn(1, 6, 5, 5)
    offset2 = torch.randn(1, 3 * 2 * 3 * 2, 5, 6)
    assert torch.equal(
        scripted(call_int_pairs)(y, offset2, weight), call_int_pairs(y, offset2, weight)
    )


@pytest.mark.slow
def test_autocast_computes_in_float32_and_returns_the_input_dtype():
    import torchvision.ops

    x, w = torch.randn(1, 4, 7, 7), torch.randn(5, 4, 3, 3)
    conv = nn.Conv2d(4, 27, 3, padding=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = conv(x)
        offset, mask = out[:, :18], out[:, 18:].sigmoid()
        ours = deform_conv2d(x, offset, w, padding=1, mask=mask)
    assert offset.dtype == torch.bfloat16 and ours.dtype == torch.float32
    theirs = torchvision.ops.deform_conv2d(x, offset.float(), w, padding=1, mask=mask.float())
    assert (ours - theirs).abs().max() < 1e-5
    low = x.bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = deform_conv2d(low, offset, w, padding=1, mask=mask)
    assert result.dtype == torch.bfloat16
    result.float().sum().backward()
    assert low.grad is not None and low.grad.dtype == torch.bfloat16


def test_plain_calls_skip_the_dispatcher_with_the_same_result():
    from tvm_deform.binding import ops

    x, offset, mask, layer = layer_inputs(torch.float32, batch=2)
    weight, bias = layer.weight.detach(), layer.bias.detach()
    args = (x, offset, weight, bias, mask)
    assert ops._eager_route(args) == "direct"
    direct = deform_conv2d(x, offset, weight, bias, (2, 1), (1, 0), (2, 1), mask)
    through = torch.ops.tvm_deform.deform_conv2d(*args, 2, 1, 1, 0, 2, 1)
    assert torch.equal(direct, through)


def test_calls_that_need_the_dispatcher_go_through_it():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.profiler import profile

    from tvm_deform.binding import ops

    x, offset, mask, layer = layer_inputs(torch.float32, batch=2)
    args = (x, offset, layer.weight, layer.bias, mask)
    # autograd must record the op: the eager autograd path does, as the op would
    assert ops._eager_route(args) == "autograd"
    with torch.autograd.forward_ad.dual_level():
        assert ops._eager_route(args) is None  # forward-mode AD goes through the op
    with torch.no_grad():
        assert ops._eager_route(args) == "direct"  # an nn.Parameter is a plain tensor
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert ops._eager_route(args) is None
        with FakeTensorMode():
            assert ops._eager_route(args) is None
        meta = tuple(t.to("meta") for t in args)
        assert ops._eager_route(meta) is None
        in_vmap = torch.func.vmap(lambda t: torch.tensor(ops._eager_route((t,)) is not None))(x)
        assert not in_vmap.any()
        with profile() as prof:
            deform_conv2d(x, offset, layer.weight, layer.bias, (2, 1), (1, 0), (2, 1), mask)
        assert "tvm_deform::deform_conv2d" in {event.name for event in prof.events()}

        weight, bias = layer.weight.detach(), layer.bias.detach()

        def call(x, offset, mask):
            return deform_conv2d(x, offset, weight, bias, (2, 1), (1, 0), (2, 1), mask)

        traced = torch.jit.trace(call, (x, offset, mask), check_trace=False)
        assert "tvm_deform::deform_conv2d" in str(traced.graph)
    out = deform_conv2d(x, offset, layer.weight, layer.bias, (2, 1), (1, 0), (2, 1), mask)
    assert out.grad_fn is not None


@pytest.mark.parametrize("rule", ["torchvision", "mmcv"])
def test_the_eager_autograd_path_gives_the_ops_numbers_and_gradients(rule):
    """An eager call that autograd records skips the custom op's layers (``_EagerAutograd``):
    the same output and the same bits of every gradient as through the op, only the
    gradients asked for, none differentiable again."""
    from tvm_deform.binding import ops
    from tvm_deform.binding.ops import deform_conv2d_with_offset_grad_rule

    x, offset, mask, layer = layer_inputs(torch.float32, batch=2)
    # Offsets that put samples exactly at -1, where the two rules' offset gradients differ.
    offset = offset.round().detach()
    geometry = ((2, 1), (1, 0), (2, 1))
    leaves = [t.detach().requires_grad_() for t in (x, offset, layer.weight, layer.bias, mask)]
    eager = deform_conv2d_with_offset_grad_rule(*leaves[:4], *geometry, leaves[4], rule)
    assert type(eager.grad_fn).__name__ == "_EagerAutogradBackward"
    grad = torch.randn_like(eager)
    eager_grads = torch.autograd.grad(eager, leaves, grad)
    again = [t.detach().requires_grad_() for t in leaves]
    flat = (2, 1, 1, 0, 2, 1)
    through = torch.ops.tvm_deform.deform_conv2d(*again, *flat, rule)
    assert type(through.grad_fn).__name__ != "_EagerAutogradBackward"
    assert torch.equal(eager, through)
    for ours, op in zip(eager_grads, torch.autograd.grad(through, again, grad), strict=True):
        assert torch.equal(ours, op)
    # Only what is asked for: a frozen weight and bias get no gradient.
    frozen = [t.detach() for t in leaves]
    frozen[0].requires_grad_()
    out = deform_conv2d_with_offset_grad_rule(*frozen[:4], *geometry, frozen[4], rule)
    out.backward(grad)
    assert torch.equal(frozen[0].grad, eager_grads[0]) and frozen[2].grad is None
    # Not differentiable twice, as through the op: with create_graph the gradients carry the
    # backward op's node, which raises, not silently nothing (a zero second derivative).
    first = deform_conv2d_with_offset_grad_rule(*leaves[:4], *geometry, leaves[4], rule)
    (input_grad,) = torch.autograd.grad(first, leaves[0], grad, create_graph=True)
    assert input_grad.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        torch.autograd.grad(input_grad.pow(2).sum(), leaves[2])
    assert ops._eager_route(tuple(leaves)) == "autograd"
    # Inside another op's implementation (below autograd) nothing is recorded, as through it.
    with torch._C._AutoDispatchBelowAutograd():
        assert ops._eager_route(tuple(leaves)) == "direct"
        inner = deform_conv2d_with_offset_grad_rule(*leaves[:4], *geometry, leaves[4], rule)
        assert inner.grad_fn is None and torch.equal(inner, eager)


def test_eager_calls_leave_torchs_compiler_stack_unimported():
    """Importing the package and eager calls, with and without autograd, do not import
    ``torch._dynamo`` (about a second); a call through the op (here under autocast) still
    works."""
    code = textwrap.dedent(
        """
        import sys
        import torch
        import tvm_deform
        loaded = lambda: "torch._dynamo" in sys.modules
        states = [loaded()]
        x, w = torch.rand(1, 3, 6, 6), torch.rand(4, 3, 3, 3, requires_grad=True)
        offset, mask = torch.randn(1, 18, 6, 6), torch.rand(1, 9, 6, 6)
        with torch.no_grad():
            tvm_deform.deform_conv2d(x, offset, w, padding=1, mask=mask)
        tvm_deform.deform_conv2d(x, offset, w, padding=1, mask=mask).sum().backward()
        states.append(loaded())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = tvm_deform.deform_conv2d(x, offset, w, padding=1, mask=mask)
        print(states, out.dtype, w.grad is not None)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[False, False] torch.float32 True"


def test_forward_mode_ad_raises_instead_of_dropping_tangents():
    """The op has no forward-mode rule: a dual tensor with a tangent raises (torchvision's op
    returns a zero or missing tangent); tensors without one still run under a dual level."""
    x, offset, mask, layer = layer_inputs(torch.float32, batch=2)
    with torch.autograd.forward_ad.dual_level():
        expected = layer(x, offset, mask)
        dual = torch.autograd.forward_ad.make_dual(offset, torch.ones_like(offset))
        with pytest.raises(NotImplementedError, match="offset is a dual tensor"):
            layer(x, dual, mask)
    with pytest.raises(NotImplementedError, match="no forward-mode AD"):
        torch.func.jvp(lambda t: layer(t, offset, mask), (x,), (torch.ones_like(x),))
    with torch.no_grad():
        torch.testing.assert_close(layer(x, offset, mask), expected)
