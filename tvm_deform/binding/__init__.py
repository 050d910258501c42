"""The torch binding: the custom ops and their autograd (:mod:`.ops`), argument checks
(:mod:`.validation`), ``DeformConv2d`` (:mod:`.modules`) and export (:mod:`.export`)."""
