"""The public API's docstring examples run as written (doctests)."""

from __future__ import annotations

import doctest

import pytest

import tvm_deform
from tvm_deform.binding import export, modules, ops, precompile


@pytest.mark.parametrize(
    "obj",
    [ops.deform_conv2d, modules.DeformConv2d, export.export_onnx, precompile.precompile],
    ids=lambda obj: obj.__name__,
)
def test_docstring_examples_run(obj):
    finder = doctest.DocTestFinder(recurse=False)
    (test,) = finder.find(obj, obj.__name__, globs={"tvm_deform": tvm_deform})
    assert test.examples, f"{obj.__name__} has no examples"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    result = runner.run(test)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"
