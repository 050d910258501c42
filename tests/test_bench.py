"""The benchmark helpers and commands (method and output, no timing assertions)."""

from __future__ import annotations

import time

import pytest
import torch

from tvm_deform.ir.definition import ConvShape
from tvm_deform.tools.bench import compare_layer, measure, relative_error
from tvm_deform.tools.cli import main
from tvm_deform.tools.peers import available_peers

TINY = ConvShape(1, 4, 9, 9, 4, 3, 3, pad_h=1, pad_w=1, has_bias=True)


def test_measure_reports_ordered_quantiles():
    timing = measure(lambda: sum(range(1000)), warmup=1, min_runs=7, min_seconds=0.0)
    assert timing.runs >= 7
    assert 0 < timing.p20_ms <= timing.median_ms <= timing.p80_ms


def test_measure_between_times_only_the_call_after_the_other():
    calls = []
    timing = measure(lambda: calls.append("fn"), before=lambda: calls.append("before"))
    assert timing.runs >= 10
    assert calls[:4] == ["before", "fn", "before", "fn"] and calls.count("fn") == calls.count(
        "before"
    )


@pytest.mark.slow
def test_compare_layer_checks_every_implementation_against_torchvision():
    rows = {row.implementation: row for row in compare_layer("tiny", TINY, available_peers())}
    expected = {"torchvision", "tvm_deform", "tvm_deform (between conv2d)", "tvm_deform default"}
    assert expected | {"conv2d (dense)"} <= set(rows)
    assert set(available_peers()) <= set(rows)
    assert {f"{peer} (between conv2d)" for peer in available_peers()} <= set(rows)
    for name, row in rows.items():
        assert row.timing.median_ms > 0
        if name == "conv2d (dense)":
            assert row.error is None  # a different operation: timed, not compared
        else:
            assert row.error < 1e-6, name


def test_relative_error():
    import torch

    assert relative_error(torch.ones(4), torch.ones(4)) == 0.0
    assert relative_error(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])) == pytest.approx(1.0)


@pytest.mark.slow
@pytest.mark.parametrize("command", [["info"], ["diagnose"]])
def test_commands_run(command, capsys):
    assert main(command) == 0
    out = capsys.readouterr().out
    assert ("hardware key" in out) if command == ["info"] else ("4336" in out)


def test_info_names_compatible_logs_newer_than_the_own(tmp_path, monkeypatch, capsys):
    import json

    from tvm_deform.runtime import targets

    target = targets.host_target()
    own, other = targets.hardware_key(target), "llvm/elsewhere"
    for key, date in ((own, "2000-01-01"), (other, "2000-02-01")):
        (tmp_path / key).mkdir(parents=True)
        manifest = {"target": str(target), "isa": targets.target_isa(target), "date": date}
        (tmp_path / key / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setenv("TVM_DEFORM_LOGS", str(tmp_path))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path}: {own} (2000-01-01), {other} (2000-02-01)" in out
    (hint,) = [line for line in out.splitlines() if "newer than this machine's own logs" in line]
    assert other in hint.split(":")[0]  # the shipped logs of other keys may be named beside it


def test_the_size_stream_times_the_dcn_calls_apart():
    from torch import nn

    from tvm_deform.tools import bench_sizes
    from tvm_deform.tools.bench_model import DCNv2

    model = nn.Sequential(DCNv2(nn.Conv2d(4, 4, 3, padding=1), "tvm_deform"), nn.ReLU())
    x = torch.rand(1, 4, 7, 9)
    with torch.inference_mode():
        expected = model(x)
        spent = bench_sizes._time_deform_calls(model)
        assert spent == [0.0]
        start = time.perf_counter()
        out = model(x)
        whole = time.perf_counter() - start
    assert torch.equal(out, expected)
    assert 0 < spent[0] <= whole


def test_the_size_stream_is_detection_like_and_summarised_from_its_data():
    from tvm_deform.tools import bench_sizes

    sizes = bench_sizes.stream_sizes()
    assert len(sizes) == 20 and all(h % 32 == 0 and w % 32 == 0 for h, w in sizes)
    assert all(min(h, w) == bench_sizes.SHORT_SIDE for h, w in sizes)
    times = ("first_ms", "warm_ms", "first_deform_ms", "warm_deform_ms", "since_start_ms")
    rows = [
        {"height": h, "width": w} | dict(zip(times, values, strict=True))
        for h, w, values in (
            (320, 448, (300.0, 100.0, 230.0, 30.0, 500.0)),
            (320, 448, (100.0, 100.0, 30.0, 30.0, 900.0)),
            (480, 320, (110.0, 100.0, 32.0, 30.0, 1e3)),
        )
    ]
    (record,) = bench_sizes.summary({"ours": rows})
    assert record["new sizes"] == 2 and record["total s"] == pytest.approx(0.51)
    assert record["first image s"] == 0.5 and record["first image overhead"] == "+200%"
    # after the first image: one new size, +10% (the repeated 320x448 is not new), of which
    # 2 ms of the warm forward's 100 in the DCN calls
    assert record["new size overhead (median)"] == "+10%"
    assert record["new size overhead (worst)"] == "+10%"
    assert record["of it in the DCN calls (median)"] == "+2%"
    assert record["of it in the DCN calls (worst)"] == "+2%"
    (first, *_) = bench_sizes.per_image({"ours": rows})
    assert first["size"] == "320x448" and first["ours first ms"] == 300.0
