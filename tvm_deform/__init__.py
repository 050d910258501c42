"""tvm_deform: modulated deformable convolution (DCNv2) compiled by Apache TVM for PyTorch.

``from tvm_deform import deform_conv2d, DeformConv2d`` is a drop-in for torchvision's.
"""

__version__ = "0.1.0"

from tvm_deform import env  # noqa: E402,F401 - must run before TVM is imported
from tvm_deform.binding.export import export_onnx, onnx_translation_table  # noqa: E402
from tvm_deform.binding.modules import DeformConv2d  # noqa: E402
from tvm_deform.binding.ops import deform_conv2d  # noqa: E402
from tvm_deform.binding.precompile import precompile  # noqa: E402

__all__ = [
    "DeformConv2d",
    "__version__",
    "deform_conv2d",
    "export_onnx",
    "onnx_translation_table",
    "precompile",
]
