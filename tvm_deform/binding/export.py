"""Export of models that call :func:`tvm_deform.deform_conv2d`.

- ONNX: ``torch.onnx.export(..., dynamo=True)`` with :func:`onnx_translation_table` (or
  :func:`export_onnx`, which passes it) writes each call as the standard ONNX ``DeformConv``
  (opset 19), which ONNX Runtime runs. Needs ``onnxscript`` (``pip install 'tvm_deform[export]'``).
- ``torch.export`` and AOTInductor need nothing from here: the op has a fake (meta) kernel, so
  ``torch.export.export`` records it as one node, ``torch.ops.tvm_deform.deform_conv2d``, and an
  AOTInductor package calls it back through torch's dispatcher in a process that imported
  ``tvm_deform``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tvm_deform.binding.validation import ArgumentError

#: the ONNX opset that introduced ``DeformConv``
DEFORM_CONV_OPSET = 19


def deform_conv2d_to_onnx(
    input,
    offset,
    weight,
    bias,
    mask,
    stride_h: int,
    stride_w: int,
    pad_h: int,
    pad_w: int,
    dilation_h: int,
    dilation_w: int,
    offset_grad_rule: str = "torchvision",
):
    """``tvm_deform::deform_conv2d`` as an ONNX ``DeformConv`` node (the offset gradient's
    boundary rule does not change the forward, so it is dropped). The groups are read from the
    channel counts, which must be static."""
    from onnxscript import opset19

    kernel_h, kernel_w = weight.shape[2], weight.shape[3]
    channels = (input.shape[1], weight.shape[1], offset.shape[1], kernel_h, kernel_w)
    if not all(isinstance(c, int) for c in channels):
        raise ArgumentError(
            "ONNX export of deform_conv2d needs static channel counts and kernel size, got "
            f"input channels {input.shape[1]}, weight {list(weight.shape)}, offset channels "
            f"{offset.shape[1]}"
        )
    return opset19.DeformConv(
        input,
        weight,
        offset,
        bias,
        mask,
        dilations=[dilation_h, dilation_w],
        group=input.shape[1] // weight.shape[1],
        kernel_shape=[kernel_h, kernel_w],
        offset_group=offset.shape[1] // (2 * kernel_h * kernel_w),
        pads=[pad_h, pad_w, pad_h, pad_w],
        strides=[stride_h, stride_w],
    )


def onnx_translation_table() -> dict[Any, Callable]:
    """The ``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True)``."""
    return {torch.ops.tvm_deform.deform_conv2d.default: deform_conv2d_to_onnx}


def export_onnx(model: torch.nn.Module, args: tuple, **kwargs: Any):
    """``torch.onnx.export(model, args, dynamo=True, opset_version=19, ...)`` with our op
    translated to ``DeformConv``; ``kwargs`` go to ``torch.onnx.export`` (``f=`` to write a
    file, ``dynamic_shapes=``, ...). Returns the ``ONNXProgram``.

    Examples::
        >>> import torch
        >>> from tvm_deform import DeformConv2d, export_onnx
        >>> class Layer(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.offset = torch.nn.Conv2d(8, 18, 3, padding=1)
        ...         self.conv = DeformConv2d(8, 8, 3, padding=1)
        ...     def forward(self, x):
        ...         return self.conv(x, self.offset(x))
        >>> program = export_onnx(Layer().eval(), (torch.rand(1, 8, 12, 12),), verbose=False)
        >>> [node.op_type for node in program.model_proto.graph.node][-1]
        'DeformConv'
    """
    table = onnx_translation_table() | kwargs.pop("custom_translation_table", {})
    opset = kwargs.pop("opset_version", DEFORM_CONV_OPSET)
    if opset < DEFORM_CONV_OPSET:
        raise ArgumentError(
            f"ONNX DeformConv needs opset {DEFORM_CONV_OPSET} or later, got {opset}"
        )
    return torch.onnx.export(
        model,
        args,
        dynamo=True,
        opset_version=opset,
        custom_translation_table=table,
        **kwargs,
    )
