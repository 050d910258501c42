"""`tvm-deform compare`: report writers and method on tiny shapes (no timing assertions)."""

from __future__ import annotations

import csv
import json

import pytest

from tvm_deform.ir.definition import ConvShape
from tvm_deform.tools import compare
from tvm_deform.tools.bench import Row, Timing
from tvm_deform.tools.cli import main

TINY = ConvShape(1, 4, 9, 9, 4, 3, 3, pad_h=1, pad_w=1)


def fake_rows() -> list[Row]:
    t = lambda ms: Timing(ms, ms * 0.9, ms * 1.1, 10)  # noqa: E731
    return [
        Row("tiny", "torchvision", t(10.0), 0.0),
        Row("tiny", "tvm_deform", t(2.5), 3e-7),
        Row("tiny", "tvm_deform (between conv2d)", t(3.0), 3e-7),
        Row("tiny", "tvm_deform default", t(2.0), 3e-7),
        Row("tiny", "tvm_deform tuned handwritten", t(1.0), 2e-4),
        Row("tiny", "conv2d (dense)", t(0.5), None),
    ]


def test_derived_columns_and_writers(tmp_path):
    records = compare.rows_for_layer("tiny", TINY, fake_rows(), 100.0, {"threads": 2, "cpu": "x"})
    by = {r["implementation"]: r for r in records}
    assert by["tvm_deform default"]["speedup_vs_torchvision"] == pytest.approx(5.0)
    assert by["tvm_deform default"]["ratio_to_conv2d"] == pytest.approx(4.0)
    gflops = TINY.gemm_flops / 2e-3 / 1e9
    assert by["tvm_deform default"]["gflops"] == pytest.approx(gflops)
    assert by["tvm_deform default"]["peak_fraction"] == pytest.approx(gflops / 100.0)
    assert by["tvm_deform default"]["correct"] is True
    assert by["tvm_deform tuned handwritten"]["correct"] is False  # 2e-4 > float32 tolerance
    assert by["conv2d (dense)"]["correct"] is None

    compare.write_csv(records, tmp_path / "c.csv")
    compare.write_json(records, tmp_path / "c.json")
    with (tmp_path / "c.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["implementation"] for r in rows] == [r.implementation for r in fake_rows()]
    assert {"threads", "cpu", "median_ms", "p20_ms", "p80_ms"} <= set(rows[0])
    assert json.loads((tmp_path / "c.json").read_text())[3]["median_ms"] == 2.0
    table = compare.markdown_table(records)
    assert "| tiny | tvm_deform tuned handwritten | 1.00 |" in table
    assert "**NO**" in table


def test_summary_reports_the_op_as_called():
    """The summary's ratios are those of the public op (what dispatch runs here), not of the
    fastest schedule in the row, and it gives the slowdown between torch ops."""
    records = compare.rows_for_layer("tiny", TINY, fake_rows(), 100.0, {"threads": 2, "cpu": "x"})
    (line,) = [x for x in compare.summary_table(records).splitlines() if x.startswith("| tiny")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    header = compare.summary_table(records).splitlines()[0]
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[1:4] == ["torchvision ms", "tvm_deform ms", "tvm_deform (between conv2d) ms"]
    by = dict(zip(columns, cells, strict=True))
    assert by["tvm_deform vs torchvision"] == "4.0x"  # 10 / 2.5, not 10 / 1.0
    assert by["x dense conv2d"] == "5.00"
    assert by["between / alone"] == "1.20"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    records = compare.rows_for_layer("tiny", TINY, fake_rows(), 100.0, {"threads": 2, "cpu": "x"})
    compare.plot(records, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_run_measures_and_stops_cleanly_on_ctrl_c(monkeypatch):
    monkeypatch.setattr(compare, "measure_peak_gflops", lambda: 100.0)
    records, complete = compare.run({"tiny": TINY}, progress=lambda *_: None)
    assert complete and {r["implementation"] for r in records} >= {"torchvision", "conv2d (dense)"}
    assert all(r["correct"] in (True, None) for r in records)

    real = compare.compare_layer

    def interrupt_second(name, *args):
        if name == "second":
            raise KeyboardInterrupt
        return real(name, *args)

    monkeypatch.setattr(compare, "compare_layer", interrupt_second)
    records, complete = compare.run({"first": TINY, "second": TINY}, progress=lambda *_: None)
    assert not complete
    assert {r["workload"] for r in records} == {"first"}


def test_compare_command_writes_its_files(tmp_path, monkeypatch):
    monkeypatch.setattr(compare, "measure_peak_gflops", lambda: 100.0)
    suite = tmp_path / "suite.json"
    suite.write_text(
        json.dumps(
            {
                "tiny": {
                    "batch": 1,
                    "in_channels": 4,
                    "height": 9,
                    "width": 9,
                    "out_channels": 4,
                    "kernel_h": 3,
                    "kernel_w": 3,
                }
            }
        )
    )
    out = tmp_path / "out"
    argv = ["compare", "--suite", str(suite), "--no-peers", "--out", str(out)]
    assert main(argv) == 0
    names = {"compare.csv", "compare.json", "compare.md"}
    assert names <= {p.name for p in out.iterdir()}
