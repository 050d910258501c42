"""Meeting users where they come from: the NPU calling convention (:mod:`.npu`), mmcv-style
modules (:mod:`.mmcv`) and the precision diagnosis (:mod:`.precision`)."""

from tvm_deform.compat.mmcv import ModulatedDeformConv2d, ModulatedDeformConv2dPack
from tvm_deform.compat.npu import (
    from_npu_offset,
    npu_deformable_conv2d,
    sampled_image,
    to_npu_offset,
)

__all__ = [
    "ModulatedDeformConv2d",
    "ModulatedDeformConv2dPack",
    "from_npu_offset",
    "npu_deformable_conv2d",
    "sampled_image",
    "to_npu_offset",
]
