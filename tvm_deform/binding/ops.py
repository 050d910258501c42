"""The torch binding: the ``tvm_deform::deform_conv2d`` custom op and its autograd, the
``tvm_deform::deform_conv2d_backward`` custom op, device dispatch (CPU and CUDA), and the public
function."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from typing import NamedTuple

import torch

from tvm_deform import env
from tvm_deform.binding.validation import ArgumentError, as_pair, check_arguments
from tvm_deform.ir import definition
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import background
from tvm_deform.runtime.calls import device_target, is_channels_last, run_backward, run_forward

# run_forward, run_backward and device_target live in the runtime (one calling path for the ops,
# the measured dispatch and the benchmarks) and are re-exported here for the callers that run a
# chosen kernel through the op's argument layout.
__all__ = ["deform_conv2d", "device_target", "run_backward", "run_forward"]

# torch runs a custom op's implementation inside ``torch._compile._disable_dynamo``, which
# imports ``torch._dynamo`` (about 1.1 s on a 2-core Zen 4) at the first call of any custom op.
# It is not imported here: eager calls skip the op (see :func:`_eager_route`) and never need
# it, so only a process whose calls go through the op (autocast, tracing, compiling, the
# profiler, TorchScript, modes, functorch transforms, forward-mode AD) pays for it, once, at
# its first such call; ``torchvision.ops`` imports it anyway.


def _op_shape(input, offset, weight, bias, mask, *params: int) -> ConvShape:
    """:func:`check_arguments` for the ops' flat geometry arguments (stride_h, stride_w, pad_h,
    pad_w, dilation_h, dilation_w)."""
    stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w = params
    return check_arguments(
        input,
        offset,
        weight,
        bias,
        mask,
        (stride_h, stride_w),
        (pad_h, pad_w),
        (dilation_h, dilation_w),
    )


#: The forward takes its tensors in any layout (it copies what its kernels cannot read in place),
#: so inductor need not copy them to the layout eager mode had: a model that inductor runs in
#: channels_last hands the op its NHWC input, which the CPU kernel samples in place, instead of
#: a transposed copy (up to 0.5 ms a layer in an R50-DCNv2 at 320x320 on a 2-core Zen 5).
#: Tags on custom ops need torch 2.5 or later.
_FORWARD_TAGS = (
    {"tags": (torch.Tag.flexible_layout,)}
    if "tags" in inspect.signature(torch.library.custom_op).parameters
    else {}
)


@torch.library.custom_op("tvm_deform::deform_conv2d", mutates_args=(), **_FORWARD_TAGS)
def _deform_conv2d(
    input: torch.Tensor,
    offset: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    stride_h: int,
    stride_w: int,
    pad_h: int,
    pad_w: int,
    dilation_h: int,
    dilation_w: int,
    offset_grad_rule: str = "torchvision",
) -> torch.Tensor:
    geometry = (stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w)
    return _forward(input, offset, weight, bias, mask, *geometry, offset_grad_rule=offset_grad_rule)


def _forward(
    input, offset, weight, bias, mask, *params: int, offset_grad_rule: str = "torchvision"
) -> torch.Tensor:
    """The op's CPU/CUDA implementation: check the arguments, run the kernel."""
    _checked_rule(offset_grad_rule)
    shape = _op_shape(input, offset, weight, bias, mask, *params)
    if input.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"tvm_deform.deform_conv2d has no kernel for {input.device.type} tensors "
            "(CPU and CUDA only)"
        )
    return run_forward(shape, input, offset, weight, bias, mask)


@_deform_conv2d.register_fake
def _deform_conv2d_fake(
    input, offset, weight, bias, mask, *params, offset_grad_rule="torchvision"
) -> torch.Tensor:
    """The op's output, without computing it (its arguments as the op's: the six geometry
    integers, then the rule, which may come positionally too)."""
    geometry, rest = params[:6], params[6:]
    rule = _checked_rule(rest[0] if rest else offset_grad_rule)
    shape = _op_shape(input, offset, weight, bias, mask, *geometry)
    if _recording is not None:
        nhwc = input.device.type == "cpu" and is_channels_last(input)
        gradients = definition.Gradients(
            input=input.requires_grad,
            sampling=offset.requires_grad or (mask is not None and mask.requires_grad),
            weight=weight.requires_grad or (bias is not None and bias.requires_grad),
        )
        layout = "NHWC" if nhwc else "NCHW"
        _recording.append(Call(shape, layout, input.device, rule, gradients))
    return input.new_empty((shape.batch, shape.out_channels, shape.out_h, shape.out_w))


class Call(NamedTuple):
    """A call of the op, as :func:`recording` sees it: the layer, the input's layout, the
    device, the offset gradient's rule and the gradients a backward would compute."""

    shape: ConvShape
    layout: str
    device: torch.device
    offset_grad_rule: str
    gradients: definition.Gradients


#: the calls seen by the fake kernel while :func:`recording` is active
_recording: list[Call] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list[Call]]:
    """Collect the op's calls that run on fake tensors (``FakeTensorMode``, ``torch.export``)
    while active, without computing them."""
    global _recording
    previous, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = previous


@torch.library.custom_op("tvm_deform::deform_conv2d_backward", mutates_args=())
def _deform_conv2d_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    offset: torch.Tensor,
    weight: torch.Tensor,
    mask: torch.Tensor | None,
    has_bias: bool,
    stride_h: int,
    stride_w: int,
    pad_h: int,
    pad_w: int,
    dilation_h: int,
    dilation_w: int,
    offset_grad_rule: str = "torchvision",
    output_mask: list[bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (input, offset, mask, weight, bias), those that ``output_mask`` (five bools in
    that order; None: all) asks for; an absent mask or bias, or a gradient not asked for, gets
    an empty tensor (custom ops cannot return None)."""
    params = (stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, offset_grad_rule)
    return _backward_gradients(
        grad_output, input, offset, weight, mask, has_bias, params, output_mask
    )


def _backward_gradients(
    grad_output, input, offset, weight, mask, has_bias, params: tuple, output_mask
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward op's CPU/CUDA implementation; ``params``: the six geometry integers and
    the offset gradient's rule."""
    shape = _backward_shape(grad_output, input, offset, weight, mask, has_bias, params)
    if input.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"tvm_deform.deform_conv2d has no backward kernels for {input.device.type} tensors "
            "(CPU and CUDA only)"
        )
    grads = run_backward(
        shape, grad_output, input, offset, weight, mask, output_mask=_output_mask(output_mask)
    )
    return tuple(g if g is not None else input.new_empty(0) for g in grads)


def _output_mask(output_mask: list[bool] | None) -> tuple[bool, bool, bool, bool, bool]:
    if output_mask is None:
        return (True,) * 5
    if len(output_mask) != 5:
        raise ArgumentError(f"output_mask must hold 5 bools, got {list(output_mask)}")
    return tuple(bool(m) for m in output_mask)


@_deform_conv2d_backward.register_fake
def _deform_conv2d_backward_fake(
    grad_output,
    input,
    offset,
    weight,
    mask,
    has_bias,
    *params,
    offset_grad_rule="torchvision",
    output_mask=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients' shapes, without computing them (arguments as the backward op's: the six
    geometry integers, then the rule and the output mask, which may come positionally too)."""
    geometry, rest = params[:6], params[6:]
    offset_grad_rule = rest[0] if rest else offset_grad_rule
    output_mask = rest[1] if len(rest) > 1 else output_mask
    shape = _backward_shape(
        grad_output, input, offset, weight, mask, has_bias, (*geometry, offset_grad_rule)
    )
    wants = _output_mask(output_mask)
    contiguous = torch.contiguous_format
    like = (input, offset, mask, weight)
    grads = [
        torch.empty_like(t, memory_format=contiguous) if want and t is not None else None
        for t, want in zip(like, wants[:4], strict=True)
    ]
    grads.append(weight.new_empty(shape.out_channels) if has_bias and wants[4] else None)
    return tuple(g if g is not None else input.new_empty(0) for g in grads)


def _backward_shape(grad_output, input, offset, weight, mask, has_bias, params) -> ConvShape:
    stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, offset_grad_rule = params
    bias = weight.new_empty(weight.shape[0]) if has_bias else None
    shape = _op_shape(
        input, offset, weight, bias, mask, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w
    )
    expected = (shape.batch, shape.out_channels, shape.out_h, shape.out_w)
    if tuple(grad_output.shape) != expected or grad_output.dtype != input.dtype:
        raise ValueError(
            f"grad_output must be {input.dtype} of shape {list(expected)}, got "
            f"{grad_output.dtype} of shape {list(grad_output.shape)}"
        )
    return dataclasses.replace(shape, offset_grad_rule=_checked_rule(offset_grad_rule))


#: the boundary rules of the offset gradient (see ``ConvShape.offset_grad_rule``)
OFFSET_GRAD_RULES = ("torchvision", "mmcv")


def _checked_rule(rule: str) -> str:
    if rule not in OFFSET_GRAD_RULES:
        raise ArgumentError(f"offset_grad_rule must be one of {OFFSET_GRAD_RULES}, got {rule!r}")
    return rule


def _setup_context(ctx, inputs, output) -> None:
    input, offset, weight, bias, mask, *params = inputs
    ctx.save_for_backward(input, offset, weight, mask)
    ctx.has_bias = bias is not None
    ctx.params = params
    # A backward will follow: start its CPU kernels compiling now (a layer's first call).
    cpu = type(input) is torch.Tensor and input.device.type == "cpu"
    if cpu and env.prepare_backward_enabled():
        _prepare_backward(ctx.needs_input_grad[:5], input, offset, weight, bias, mask, params)


#: the calls whose backward kernels :func:`_prepare_backward` has asked for, by what makes their
#: shape (cheaper to look up than the shape, which takes microseconds to build)
_backward_prepared: set[tuple] = set()


def _prepare_backward(needs_input_grad, input, offset, weight, bias, mask, params) -> None:
    """Have the backward kernels that this call's backward will ask for compiled ahead (see
    :mod:`tvm_deform.runtime.background`), once per shape and gradients."""
    key = (
        input.shape,
        offset.shape,
        weight.shape,
        None if mask is None else mask.shape,
        bias is None,
        input.dtype,
        *params,
        *needs_input_grad,
    )
    if key in _backward_prepared:
        return
    _backward_prepared.add(key)
    needs_input, needs_offset, needs_weight, needs_bias, needs_mask = needs_input_grad
    gradients = definition.Gradients(
        input=needs_input, sampling=needs_offset or needs_mask, weight=needs_weight or needs_bias
    )
    shape = _op_shape(input, offset, weight, bias, mask, *params[:6])
    shape = dataclasses.replace(shape, offset_grad_rule=_checked_rule(params[6]))
    background.prepare_backward(shape, device_target(input.device), gradients)


def _backward(ctx, grad_output, direct: bool = False):
    """The gradients of the forward's arguments: through the backward op, or ``direct``ly by
    its implementation (the eager path of :class:`_EagerAutograd`)."""
    input, offset, weight, mask = ctx.saved_tensors
    # ctx.needs_input_grad follows the forward's arguments: input, offset, weight, bias, mask.
    needs_input, needs_offset, needs_weight, needs_bias, needs_mask = ctx.needs_input_grad[:5]
    output_mask = [needs_input, needs_offset, needs_mask, needs_weight, needs_bias]
    arguments = (grad_output, input, offset, weight, mask, ctx.has_bias)
    if direct:
        grads = _backward_gradients(*arguments, tuple(ctx.params), output_mask)
    else:
        grads = torch.ops.tvm_deform.deform_conv2d_backward(
            *arguments, *ctx.params, output_mask=output_mask
        )
    grad_input, grad_offset, grad_mask, grad_weight, grad_bias = grads
    return (
        grad_input if needs_input else None,
        grad_offset if needs_offset else None,
        grad_weight if needs_weight else None,
        grad_bias if needs_bias else None,
        grad_mask if needs_mask else None,
        *([None] * len(ctx.params)),
    )


_deform_conv2d.register_autograd(_backward, setup_context=_setup_context)


class _EagerAutograd(torch.autograd.Function):
    """The op's forward and autograd as the custom op runs them (the same implementation,
    context and gradients), for an eager call on plain tensors that autograd records and
    nothing else watches (see :func:`_eager_route`): without the custom op's layers of
    Python, about 50 us a forward (a tiny layer's whole time, and host time on a GPU). Its
    backward computes the gradients directly where nothing records or watches it; otherwise
    (``create_graph``, compiled autograd, the profiler) it calls the backward op, as the
    custom op's autograd does, so that differentiating the gradients again raises (the
    backward op has no autograd) instead of treating them as constants."""

    @staticmethod
    def forward(ctx, input, offset, weight, bias, mask, geometry, rule):
        output = _forward(input, offset, weight, bias, mask, *geometry, offset_grad_rule=rule)
        _setup_context(ctx, (input, offset, weight, bias, mask, *geometry, rule), output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        direct = not (
            torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or torch.autograd.profiler._is_profiler_enabled
        )
        return (*_backward(ctx, grad_output, direct=direct)[:5], None, None)


def _autocast_rule(device_type: str):
    """torchvision's autocast rule: inside an autocast region the op computes in float32 (a
    reduced-precision deformable conv is what this package exists to avoid) and returns the
    input's dtype."""

    def run(input, offset, weight, bias, mask, *params):
        with torch.autocast(device_type, enabled=False):
            out = torch.ops.tvm_deform.deform_conv2d(
                *(None if t is None else t.float() for t in (input, offset, weight, bias, mask)),
                *params,
            )
        return out.to(input.dtype)

    return run


_autocast_library = torch.library.Library("tvm_deform", "IMPL")
for _device, _key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
    _autocast_library.impl("deform_conv2d", _autocast_rule(_device), _key)


def deform_conv2d(
    input: torch.Tensor,
    offset: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | tuple[int, int] | list[int] = (1, 1),
    padding: int | tuple[int, int] | list[int] = (0, 0),
    dilation: int | tuple[int, int] | list[int] = (1, 1),
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Modulated deformable 2-D convolution (DCNv2), a drop-in for torchvision's.

    Same signature and same numbers as :func:`torchvision.ops.deform_conv2d`, computed by a
    kernel that TVM compiled from this package's TensorIR definition (compiled on the first call
    of each shape, then cached in memory and on disk).

    Args:
        input: ``[N, C_in, H, W]``.
        offset: ``[N, 2 * offset_groups * kh * kw, out_h, out_w]``. Channel
            ``g * 2 * kh * kw + 2 * k`` is the y offset of kernel tap ``k = i * kw + j`` in offset
            group ``g``, the next channel its x offset. Input channel ``c`` belongs to offset
            group ``c // (C_in // offset_groups)``.
        weight: ``[C_out, C_in / groups, kh, kw]``; ``groups = C_in // weight.shape[1]``.
        bias: ``[C_out]`` or ``None``.
        stride: int or ``(stride_h, stride_w)``, positive.
        padding: int or ``(pad_h, pad_w)``, zero padding on both sides, non-negative.
        dilation: int or ``(dilation_h, dilation_w)``, positive.
        mask: ``[N, offset_groups * kh * kw, out_h, out_w]`` modulation scalars, or ``None``
            for DCNv1 (every mask value 1).

    Returns:
        ``[N, C_out, out_h, out_w]`` with ``out_h = (H + 2 * pad_h - (dilation_h * (kh - 1) + 1))
        // stride_h + 1`` (likewise ``out_w``), in the input's dtype.

    A sample point ``y = oy * stride_h - pad_h + i * dilation_h + dy`` (likewise x) is zero when
    ``y <= -1``, ``y >= H``, ``x <= -1`` or ``x >= W``; otherwise it is the bilinear blend of its
    four neighbours, a neighbour outside the image counting as zero. float16 and bfloat16
    accumulate in float32; float64 stays float64.

    Raises:
        TypeError: a non-tensor, a non-float dtype, or tensors of different dtypes.
        ValueError: a wrong rank or shape, channels that do not divide into the groups, an empty
            output, a non-positive stride or dilation, a negative padding, or tensors on
            different devices.
        NotImplementedError: tensors on a device without kernels (other than CPU and CUDA).

    The ``TypeError`` and ``ValueError`` are also ``RuntimeError`` (as torchvision raises), and
    the sizes are checked before the dtypes, in torchvision's order. Works under ``torch.fx``
    symbolic tracing (one graph node) and ``torch.jit.script`` (the op is called directly; its
    errors then arrive as TorchScript's ``RuntimeError``).

    Examples::
        >>> import torch
        >>> from tvm_deform import deform_conv2d
        >>> input = torch.rand(4, 3, 10, 10)
        >>> kh, kw = 3, 3
        >>> weight = torch.rand(5, 3, kh, kw)
        >>> # offset and mask should have the same spatial size as the output
        >>> # of the convolution. In this case, for an input of 10, stride of 1
        >>> # and kernel size of 3, without padding, the output size is 8
        >>> offset = torch.rand(4, 2 * kh * kw, 8, 8)
        >>> mask = torch.rand(4, kh * kw, 8, 8)
        >>> out = deform_conv2d(input, offset, weight, mask=mask)
        >>> print(out.shape)
        torch.Size([4, 5, 8, 8])

        The seed case that started the project: the exact answer is 4338, and an accelerator
        that computed in float16 printed 4336.

        >>> data = torch.arange(150, dtype=torch.float32).reshape(2, 3, 5, 5)
        >>> ones = torch.ones(2, 18, 3, 3)
        >>> out = deform_conv2d(data, ones, torch.ones(5, 3, 3, 3), mask=2 * ones[:, :9])
        >>> out[1, 0, 2, 1].item()
        4338.0
    """
    if not torch.jit.is_scripting():
        return _checked_call(input, offset, weight, bias, stride, padding, dilation, mask)
    # TorchScript: the pairs as given; the op checks its arguments when it runs.
    stride_h, stride_w = _pair(stride)
    pad_h, pad_w = _pair(padding)
    dilation_h, dilation_w = _pair(dilation)
    return torch.ops.tvm_deform.deform_conv2d(
        input, offset, weight, bias, mask, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w
    )


def _pair(value: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    if isinstance(value, list):
        return value[0], value[1]
    return value


@torch.jit.unused
def _checked_call(
    input, offset, weight, bias, stride, padding, dilation, mask, offset_grad_rule="torchvision"
) -> torch.Tensor:
    """The eager path of :func:`deform_conv2d`. The op checks its arguments before any kernel
    runs (a second check here cost 20 us a call); non-tensor arguments are reported here, where
    the message can name them. Under symbolic tracing (``torch.fx``, e.g. torchvision's feature
    extraction) the tensors are proxies and the op is recorded as one graph node."""
    geometry = (
        *as_pair(stride, "stride"),
        *as_pair(padding, "padding"),
        *as_pair(dilation, "dilation"),
    )
    tensors = (input, offset, weight, bias, mask)
    for tensor in tensors:
        if tensor is not None and not isinstance(tensor, (torch.Tensor, torch.fx.Proxy)):
            _op_shape(*tensors, *geometry)  # raises, naming the argument
    if torch.compiler.is_compiling():
        # The kernels read the weight NCHW-contiguous; the op would copy a channels_last one at
        # every call. Copied here, in the traced graph, the copy of a frozen weight is folded
        # into a constant by inductor's freezing (a channels_last R50-DCNv2 ran 1.15x slower
        # compiled than the same model NCHW, copying 45 MB of weights a forward).
        weight = weight.contiguous()
        tensors = (input, offset, weight, bias, mask)
    route = _eager_route(tensors)
    if route == "direct":
        return _forward(*tensors, *geometry, offset_grad_rule=offset_grad_rule)
    if route == "autograd":
        return _EagerAutograd.apply(*tensors, geometry, offset_grad_rule)
    if torch.autograd.forward_ad._current_level >= 0:
        _check_no_tangents(tensors)
    return torch.ops.tvm_deform.deform_conv2d(*tensors, *geometry, offset_grad_rule)


def _check_no_tangents(tensors: tuple) -> None:
    """Forward-mode AD has no rule for the op: torch would drop the tangents of dual tensors
    without a word (it does so for torchvision's op), leaving the output's tangent unset."""
    names = ("input", "offset", "weight", "bias", "mask")
    for name, tensor in zip(names, tensors, strict=True):
        if (
            isinstance(tensor, torch.Tensor)
            and torch.autograd.forward_ad.unpack_dual(tensor).tangent is not None
        ):
            raise NotImplementedError(
                f"tvm_deform.deform_conv2d has no forward-mode AD: {name} is a dual tensor "
                "with a tangent (use reverse mode, backward() or torch.autograd.grad)"
            )


#: the tensor types whose calls may skip the dispatcher (not subclasses, fakes or proxies)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _eager_route(tensors: tuple) -> str | None:
    """How an eager call may skip torch's dispatcher, whose custom-op layers of Python cost
    about 8 us a call without autograd (measured on a 2-core Zen 5: a quarter of a tiny
    layer's time) and about 50 us with it (92 against 42 us a forward of the seed layer on a
    2-core Zen 4, ``lab/per_call.py``): "direct" when the dispatcher would
    do nothing but run the op's CPU/CUDA implementation (autograd records nothing), which the
    call then runs; "autograd" when it would only add the op's autograd, which
    :class:`_EagerAutograd` adds the same way; None otherwise, through the op. Either holds
    for plain CPU or CUDA tensors when autocast is off and nothing watches or transforms ops:
    no torch.compile or jit tracing, no function or dispatch mode (fake tensors), no functorch
    transform (vmap, grad), no forward-mode AD, no profiler (which should see the op)."""
    input = tensors[0]
    if type(input) not in _PLAIN_TENSORS or input.device.type not in ("cpu", "cuda"):
        return None
    if any(t is not None and type(t) not in _PLAIN_TENSORS for t in tensors):
        return None
    if (
        torch.is_autocast_enabled(input.device.type)
        or torch.compiler.is_compiling()
        or torch._C._get_tracing_state() is not None
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch.autograd.profiler._is_profiler_enabled
        or torch.autograd.forward_ad._current_level >= 0  # dual tensors may carry tangents
    ):
        return None
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in tensors):
        return "direct"
    if torch._C._dispatch_tls_local_exclude_set().has(torch._C.DispatchKey.AutogradFunctionality):
        return "direct"  # inside another op's implementation, where autograd records nothing
    return "autograd"


def deform_conv2d_with_offset_grad_rule(
    input: torch.Tensor,
    offset: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: int | tuple[int, int],
    padding: int | tuple[int, int],
    dilation: int | tuple[int, int],
    mask: torch.Tensor | None,
    offset_grad_rule: str,
) -> torch.Tensor:
    """:func:`deform_conv2d` with the boundary rule of the offset gradient chosen: "torchvision"
    (what :func:`deform_conv2d` does) or "mmcv" (a sample point exactly at -1 gets a zero offset
    gradient, as in mmcv; its modules in :mod:`tvm_deform.compat` use it). The forward result is
    the same for both."""
    _checked_rule(offset_grad_rule)
    return _checked_call(
        input, offset, weight, bias, stride, padding, dilation, mask, offset_grad_rule
    )
