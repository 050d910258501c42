"""Bad input gets a clear error naming the argument, before any kernel runs."""

from __future__ import annotations

import pytest
import torch

from tvm_deform import DeformConv2d, deform_conv2d


def good():
    return dict(
        input=torch.randn(2, 4, 6, 6),
        offset=torch.randn(2, 18, 4, 4),
        weight=torch.randn(3, 4, 3, 3),
        bias=torch.randn(3),
        mask=torch.rand(2, 9, 4, 4),
    )


def test_good_arguments_run():
    assert deform_conv2d(**good()).shape == (2, 3, 4, 4)


CASES = [
    ("input rank", dict(input=torch.randn(4, 6, 6)), ValueError, "input must be a 4-D"),
    ("offset rank", dict(offset=torch.randn(2, 18, 16)), ValueError, "offset must be a 4-D"),
    ("weight rank", dict(weight=torch.randn(3, 4, 9)), ValueError, "weight must be a 4-D"),
    ("mask rank", dict(mask=torch.rand(2, 9, 16)), ValueError, "mask must be a 4-D"),
    ("bias rank", dict(bias=torch.randn(3, 1)), ValueError, "bias must be a 1-D"),
    ("not a tensor", dict(input=[[1.0]]), TypeError, "input must be a torch.Tensor"),
    (
        "groups",
        dict(weight=torch.randn(3, 3, 3, 3)),
        ValueError,
        "not a multiple of weight.shape",
    ),
    (
        "out channels per group",
        dict(weight=torch.randn(3, 2, 3, 3), bias=torch.randn(3)),
        ValueError,
        "do not divide into 2 groups",
    ),
    ("offset channels", dict(offset=torch.randn(2, 17, 4, 4)), ValueError, "multiple of 18"),
    (
        "offset groups",
        dict(offset=torch.randn(2, 54, 4, 4), mask=torch.rand(2, 27, 4, 4)),
        ValueError,
        "3 offset groups",
    ),
    (
        "mask channels",
        dict(mask=torch.rand(2, 8, 4, 4)),
        ValueError,
        r"mask.shape\[1\] is not valid",
    ),
    ("offset size", dict(offset=torch.randn(2, 18, 5, 4)), ValueError, "offset must have shape"),
    ("mask size", dict(mask=torch.rand(2, 9, 4, 3)), ValueError, "mask must have shape"),
    ("offset batch", dict(offset=torch.randn(1, 18, 4, 4)), ValueError, "offset must have shape"),
    ("bias size", dict(bias=torch.randn(4)), ValueError, "bias must have shape"),
    (
        "empty output",
        dict(input=torch.randn(2, 4, 2, 2), offset=torch.randn(2, 18, 1, 1)),
        ValueError,
        "output would be empty",
    ),
    ("stride", dict(stride=0), ValueError, "stride must be positive"),
    ("stride pair", dict(stride=(1, -1)), ValueError, "stride must be positive"),
    ("dilation", dict(dilation=(0, 1)), ValueError, "dilation must be positive"),
    ("padding", dict(padding=-1), ValueError, "padding must be non-negative"),
    ("stride type", dict(stride=1.5), TypeError, "stride must be an int or a pair"),
    ("padding length", dict(padding=(1, 1, 1)), TypeError, "padding must be an int or a pair"),
    ("dilation bool", dict(dilation=True), TypeError, "dilation must be an int or a pair"),
    (
        "integer input",
        dict(
            input=torch.ones(2, 4, 6, 6, dtype=torch.int32),
            offset=torch.zeros(2, 18, 4, 4, dtype=torch.int32),
            weight=torch.ones(3, 4, 3, 3, dtype=torch.int32),
            bias=None,
            mask=None,
        ),
        TypeError,
        "input must be float32",
    ),
    (
        "mixed dtypes",
        dict(weight=torch.randn(3, 4, 3, 3, dtype=torch.float64)),
        TypeError,
        "weight has dtype torch.float64",
    ),
    ("mixed mask dtype", dict(mask=torch.rand(2, 9, 4, 4).half()), TypeError, "mask has dtype"),
    ("zero-size kernel", dict(weight=torch.randn(3, 4, 0, 3)), ValueError, "zero-sized"),
]


@pytest.mark.parametrize("name, change, error, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(name, change, error, message):
    with pytest.raises(error, match=message):
        deform_conv2d(**(good() | change))


def test_tensors_on_different_devices():
    args = good()
    args["weight"] = args["weight"].to("meta")
    with pytest.raises(ValueError, match="weight is on meta but input is on cpu"):
        deform_conv2d(**args)


def test_arguments_that_passed_once_still_fail_when_they_change():
    # Calls whose tensors have the shapes, dtypes and devices of a call that passed skip the
    # checks; anything the checks read that differs is checked again.
    args = good()
    deform_conv2d(**args)
    with pytest.raises(TypeError, match="all tensors must have the same dtype"):
        deform_conv2d(**(args | dict(mask=args["mask"].double())))
    with pytest.raises(ValueError, match="weight is on meta"):
        deform_conv2d(**(args | dict(weight=args["weight"].to("meta"))))
    with pytest.raises(ValueError, match="the output would be empty"):
        deform_conv2d(**args, padding=0, dilation=3)
    assert deform_conv2d(**args).shape == (2, 3, 4, 4)


def test_custom_op_validates_too():
    args = good()
    with pytest.raises(ValueError, match="offset must have shape"):
        torch.ops.tvm_deform.deform_conv2d(
            args["input"], torch.randn(2, 18, 3, 3), args["weight"], None, None, 1, 1, 0, 0, 1, 1
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(in_channels=5, out_channels=4, kernel_size=3, groups=2), "in_channels"),
        (dict(in_channels=4, out_channels=5, kernel_size=3, groups=2), "out_channels"),
        (dict(in_channels=4, out_channels=4, kernel_size=3, groups=0), "groups"),
    ],
)
def test_module_constructor_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DeformConv2d(**kwargs)
