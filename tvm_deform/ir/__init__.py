"""The definition layer: what the deformable convolution computes (:mod:`.definition`), as TE
and TensorIR, with no schedule."""
