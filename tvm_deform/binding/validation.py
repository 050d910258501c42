"""Checks of the arguments of ``deform_conv2d``, run before any kernel.

Every failure names the argument and what was expected. The checks only read shapes, dtypes and
devices, so they also run on fake tensors under ``torch.compile``.

Drop-in behaviour: torchvision raises ``RuntimeError`` for bad sizes (its C++ checks), we raise
``ValueError``/``TypeError``; :class:`ArgumentError` and :class:`ArgumentTypeError` are both, so
``except RuntimeError`` and ``except ValueError`` (or ``TypeError``) both catch them. The checks
run in torchvision's order (ranks, then sizes, then dtypes and devices), and the messages for the
offset's and the mask's channel counts start with torchvision's words.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from tvm_deform.ir.definition import ConvShape

#: torch dtype -> the dtype name of the TensorIR definition
DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}

Pair = tuple[int, int]


class ArgumentError(ValueError, RuntimeError):
    """A bad argument value or shape: a ``ValueError``, and the ``RuntimeError`` torchvision
    raises for it."""


class ArgumentTypeError(TypeError, RuntimeError):
    """A bad argument type or dtype: a ``TypeError``, and a ``RuntimeError`` as torchvision's."""


def as_pair(value: int | Sequence[int], name: str) -> Pair:
    """``value`` as an ``(h, w)`` pair: an int is used for both axes."""
    if type(value) is tuple and len(value) == 2 and type(value[0]) is type(value[1]) is int:
        return value  # the common case, first (this runs at every call)
    if isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, torch.SymInt):
        return (value, value)
    try:
        items = tuple(value)
    except TypeError:
        raise ArgumentTypeError(f"{name} must be an int or a pair of ints, got {value!r}") from None
    if len(items) != 2 or not all(
        isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool) for v in items
    ):
        raise ArgumentTypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    return (items[0], items[1])


def _check_tensor(value: object, name: str, rank: int, layout: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != rank:
        raise ArgumentError(
            f"{name} must be a {rank}-D tensor {layout}, got shape {tuple(value.shape)}"
        )
    return value


#: the shapes that arguments with a given signature (see :func:`_signature`) were found to
#: describe; a call with a known signature skips the checks (about 10 us of a 50 us call)
_checked: dict[tuple, ConvShape] = {}
#: the most signatures kept (the dict is emptied when full)
CHECKED_MAX = 4096


def check_arguments(
    input: torch.Tensor,
    offset: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    stride: Pair,
    padding: Pair,
    dilation: Pair,
) -> ConvShape:
    """Validate the arguments of ``deform_conv2d`` and return the shape they describe.

    The checks read only what :func:`_signature` collects, so arguments with the signature of
    arguments that passed are not checked again; failures are never remembered."""
    key = _signature((input, offset, weight, bias, mask), stride, padding, dilation)
    try:
        shape = _checked.get(key) if key is not None else None
    except TypeError:  # unhashable: a SymInt size or stride (checked every time)
        key = shape = None
    if shape is None:
        shape = _check_arguments(input, offset, weight, bias, mask, stride, padding, dilation)
        if key is not None:
            if len(_checked) >= CHECKED_MAX:
                _checked.clear()
            _checked[key] = shape
    return shape


def _signature(tensors: tuple, stride: Pair, padding: Pair, dilation: Pair) -> tuple | None:
    """Everything the checks read: each tensor's type, shape, dtype and device (None for an
    absent one) and the geometry; None where an argument is not a tensor. (A symbolic size
    makes the key unhashable: such calls are checked every time.)"""
    if not all(t is None or isinstance(t, torch.Tensor) for t in tensors):
        return None
    return (
        *(None if t is None else (type(t), t.shape, t.dtype, t.device) for t in tensors),
        stride,
        padding,
        dilation,
    )


def _check_arguments(
    input: torch.Tensor,
    offset: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    stride: Pair,
    padding: Pair,
    dilation: Pair,
) -> ConvShape:
    _check_tensor(input, "input", 4, "[N, C_in, H, W]")
    _check_tensor(offset, "offset", 4, "[N, 2 * offset_groups * kh * kw, out_h, out_w]")
    _check_tensor(weight, "weight", 4, "[C_out, C_in / groups, kh, kw]")
    if bias is not None:
        _check_tensor(bias, "bias", 1, "[C_out]")
    if mask is not None:
        _check_tensor(mask, "mask", 4, "[N, offset_groups * kh * kw, out_h, out_w]")
    tensors = {"input": input, "offset": offset, "weight": weight, "bias": bias, "mask": mask}
    present = {name: t for name, t in tensors.items() if t is not None}

    for name, pair in (("stride", stride), ("dilation", dilation)):
        if pair[0] <= 0 or pair[1] <= 0:
            raise ArgumentError(f"{name} must be positive, got {tuple(pair)}")
    if padding[0] < 0 or padding[1] < 0:
        raise ArgumentError(f"padding must be non-negative, got {tuple(padding)}")

    batch, in_channels, height, width = input.shape
    out_channels, weight_in, kernel_h, kernel_w = weight.shape
    taps = kernel_h * kernel_w
    if weight_in == 0 or kernel_h == 0 or kernel_w == 0 or out_channels == 0:
        raise ArgumentError(f"weight must have no zero-sized dimension, got {tuple(weight.shape)}")
    if in_channels % weight_in != 0:
        raise ArgumentError(
            f"input has {in_channels} channels, not a multiple of weight.shape[1] = {weight_in} "
            "(groups = input channels / weight.shape[1])"
        )
    groups = in_channels // weight_in
    if out_channels % groups != 0:
        raise ArgumentError(
            f"weight.shape[0] = {out_channels} output channels do not divide into {groups} groups"
        )
    if offset.shape[1] == 0 or offset.shape[1] % (2 * taps) != 0:
        raise ArgumentError(
            "the shape of the offset tensor at dimension 1 is not valid: "
            f"offset must have 2 * offset_groups * kh * kw channels, a positive multiple of "
            f"{2 * taps} for a {kernel_h}x{kernel_w} kernel, got {offset.shape[1]}"
        )
    offset_groups = offset.shape[1] // (2 * taps)
    if in_channels % offset_groups != 0:
        raise ArgumentError(
            f"input has {in_channels} channels, which do not divide into the "
            f"{offset_groups} offset groups that offset's {offset.shape[1]} channels imply"
        )

    shape = ConvShape(
        batch=batch,
        in_channels=in_channels,
        height=height,
        width=width,
        out_channels=out_channels,
        kernel_h=kernel_h,
        kernel_w=kernel_w,
        stride_h=stride[0],
        stride_w=stride[1],
        pad_h=padding[0],
        pad_w=padding[1],
        dilation_h=dilation[0],
        dilation_w=dilation[1],
        weight_groups=groups,
        offset_groups=offset_groups,
        has_mask=mask is not None,
        has_bias=bias is not None,
        # The dtype is checked after the sizes (torchvision's order); set at the end.
    )
    if shape.out_h <= 0 or shape.out_w <= 0:
        raise ArgumentError(
            f"the output would be empty ({shape.out_h}x{shape.out_w}): the dilated "
            f"{kernel_h}x{kernel_w} kernel is larger than the padded {height}x{width} input"
        )
    expected = (batch, shape.out_h, shape.out_w)
    if (offset.shape[0], offset.shape[2], offset.shape[3]) != expected:
        raise ArgumentError(
            f"offset must have shape [N, {offset.shape[1]}, out_h, out_w] = "
            f"[{batch}, {offset.shape[1]}, {shape.out_h}, {shape.out_w}], "
            f"got {tuple(offset.shape)}"
        )
    if mask is not None:
        want = (batch, offset_groups * taps, shape.out_h, shape.out_w)
        if mask.shape[1] != want[1]:
            raise ArgumentError(
                f"mask.shape[1] is not valid: mask must have offset_groups * kh * kw = {want[1]} "
                f"channels ({offset_groups} offset groups, a {kernel_h}x{kernel_w} kernel), "
                f"got shape {tuple(mask.shape)}"
            )
        if tuple(mask.shape) != want:
            raise ArgumentError(
                f"mask must have shape [N, offset_groups * kh * kw, out_h, out_w] = {list(want)}, "
                f"got {tuple(mask.shape)}"
            )
    if bias is not None and bias.shape[0] != out_channels:
        raise ArgumentError(f"bias must have shape [{out_channels}], got {tuple(bias.shape)}")
    for name, tensor in present.items():
        if tensor.dtype not in DTYPES:
            raise ArgumentTypeError(
                f"{name} must be float32, float64, float16 or bfloat16, got {tensor.dtype}"
            )
    for name, tensor in present.items():
        if tensor.dtype != input.dtype:
            raise ArgumentTypeError(
                f"{name} has dtype {tensor.dtype} but input has {input.dtype}: "
                "all tensors must have the same dtype"
            )
        if tensor.device != input.device:
            raise ArgumentError(
                f"{name} is on {tensor.device} but input is on {input.device}: "
                "all tensors must be on the same device"
            )
    return dataclasses.replace(shape, dtype=DTYPES[input.dtype])
