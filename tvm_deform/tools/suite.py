"""The workload suite: the layers people run, named, in ``suite.json`` (tuned, benchmarked and
listed by ``tvm-deform info``). Users can pass a file of their own in the same format."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

from tvm_deform.ir.definition import ConvShape

#: the two layers ``--quick`` runs
QUICK = ("demo_64x56x56", "r50_c5_512x25x42")


def load_suite(path: str | os.PathLike | None = None) -> dict[str, ConvShape]:
    """``{name: ConvShape}`` from a JSON file of ``{name: {field: value}}`` (ConvShape's field
    names; missing ones take their defaults). Default: the shipped suite."""
    if path is None:
        text = resources.files("tvm_deform.tools").joinpath("suite.json").read_text()
    else:
        text = Path(path).read_text()
    return {name: ConvShape(**fields) for name, fields in json.loads(text).items()}
