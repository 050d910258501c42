"""The CPU peers a user would pick instead of us, for benchmarks: ONNX Runtime's ``DeformConv``
(opset 19) and OpenVINO (the torchvision graph converted with the weight as a constant).

Both are optional (``pip install 'tvm_deform[peers]'``); :func:`available_peers` lists the ones
that import. Each builder returns a callable taking (input, offset, mask) and returning a tensor.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable

import numpy as np
import torch

from tvm_deform.ir.definition import ConvShape

PeerFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def available_peers() -> list[str]:
    names = []
    if importlib.util.find_spec("onnxruntime") and importlib.util.find_spec("onnx"):
        names.append("onnxruntime")
    if importlib.util.find_spec("openvino"):
        names.append("openvino")
    return names


def onnxruntime_peer(
    shape: ConvShape, weight: torch.Tensor, bias: torch.Tensor | None, threads: int
) -> PeerFn:
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    float_type = {"float32": TensorProto.FLOAT, "float64": TensorProto.DOUBLE}[shape.dtype]
    inputs = ["input", "weight", "offset", "bias" if bias is not None else ""]
    inputs.append("mask" if shape.has_mask else "")
    while not inputs[-1]:
        inputs.pop()  # trailing optional inputs are left out, inner ones named ""
    node = helper.make_node(
        "DeformConv",
        inputs=inputs,
        outputs=["output"],
        dilations=[shape.dilation_h, shape.dilation_w],
        group=shape.weight_groups,
        offset_group=shape.offset_groups,
        kernel_shape=[shape.kernel_h, shape.kernel_w],
        pads=[shape.pad_h, shape.pad_w, shape.pad_h, shape.pad_w],
        strides=[shape.stride_h, shape.stride_w],
    )
    initializers = [numpy_helper.from_array(weight.numpy(), "weight")]
    if bias is not None:
        initializers.append(numpy_helper.from_array(bias.numpy(), "bias"))
    dims = (shape.batch, shape.out_h, shape.out_w)
    graph_inputs = [
        helper.make_tensor_value_info(
            "input", float_type, [shape.batch, shape.in_channels, shape.height, shape.width]
        ),
        helper.make_tensor_value_info(
            "offset", float_type, [dims[0], 2 * shape.offset_groups * shape.taps, *dims[1:]]
        ),
    ]
    if shape.has_mask:
        graph_inputs.append(
            helper.make_tensor_value_info(
                "mask", float_type, [dims[0], shape.offset_groups * shape.taps, *dims[1:]]
            )
        )
    graph = helper.make_graph(
        [node],
        "deform_conv2d",
        graph_inputs,
        [helper.make_tensor_value_info("output", float_type, None)],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(
        model.SerializeToString(),
        options,
        providers=["CPUExecutionProvider"],
    )

    def run(input: torch.Tensor, offset: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        feed = {"input": input.numpy(), "offset": offset.numpy()}
        if mask is not None:
            feed["mask"] = mask.numpy()
        return torch.from_numpy(session.run(None, feed)[0])

    return run


def openvino_peer(
    shape: ConvShape, weight: torch.Tensor, bias: torch.Tensor | None, threads: int
) -> PeerFn:
    import openvino
    import torchvision.ops

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
            self.bias = None if bias is None else torch.nn.Parameter(bias.clone(), False)

        def forward(self, input, offset, mask=None):
            return torchvision.ops.deform_conv2d(
                input,
                offset,
                self.weight,
                self.bias,
                stride=(shape.stride_h, shape.stride_w),
                padding=(shape.pad_h, shape.pad_w),
                dilation=(shape.dilation_h, shape.dilation_w),
                mask=mask,
            )

    dtype = getattr(torch, shape.dtype)
    example = [
        torch.zeros(shape.batch, shape.in_channels, shape.height, shape.width, dtype=dtype),
        torch.zeros(
            shape.batch,
            2 * shape.offset_groups * shape.taps,
            shape.out_h,
            shape.out_w,
            dtype=dtype,
        ),
    ]
    if shape.has_mask:
        example.append(
            torch.zeros(
                shape.batch,
                shape.offset_groups * shape.taps,
                shape.out_h,
                shape.out_w,
                dtype=dtype,
            )
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the converter's own torch.jit deprecation warnings
        model = openvino.convert_model(Layer().eval(), example_input=tuple(example))
    core = openvino.Core()
    compiled = core.compile_model(model, "CPU", openvino_config(threads))
    request = compiled.create_infer_request()

    def run(input: torch.Tensor, offset: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        feed = [input.numpy(), offset.numpy()] + ([mask.numpy()] if mask is not None else [])
        result = request.infer(feed)
        return torch.from_numpy(np.asarray(result[compiled.output(0)]))

    return run


def openvino_config(threads: int) -> dict:
    """OpenVINO's CPU plugin computes in bfloat16 by default on CPUs that have it (AVX-512 BF16,
    AMX): float32 is asked for, so that it is compared at the precision we compute in."""
    return {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"}


PEERS = {"onnxruntime": onnxruntime_peer, "openvino": openvino_peer}
