"""The whole-model benchmark's model and export (correctness only, no timing assertions)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tvm_deform.ir.definition import ConvShape
from tvm_deform.tools import bench_model
from tvm_deform.tools.bench import Timing
from tvm_deform.tools.cli import main
from tvm_deform.tools.suite import load_suite

#: the whole module is slow (many kernels, whole models or subprocesses): `pytest -m "not slow"`
#: leaves it out of the quick loop; CI runs it
pytestmark = pytest.mark.slow


def dcn_input_shapes(size: int) -> dict[str, tuple[int, ...]]:
    """The input shape of every DCN layer of the backbone at ``size`` (dense variant: quick)."""
    model = bench_model.r50_dcnv2("dense")
    shapes = {}
    for name, layer in bench_model.dcn_layers(model).items():
        layer.register_forward_pre_hook(lambda m, a, n=name: shapes.__setitem__(n, a[0].shape))
    with torch.inference_mode():
        model(torch.zeros(1, 3, size, size))
    return shapes


def test_backbone_has_dcn_in_c3_to_c5_with_strided_first_blocks():
    model = bench_model.r50_dcnv2("dense")
    layers = bench_model.dcn_layers(model)
    assert len(layers) == 4 + 6 + 3
    strided = [name for name, layer in layers.items() if layer.stride == (2, 2)]
    assert strided == ["layer2.0.conv2", "layer3.0.conv2", "layer4.0.conv2"]


def test_suite_holds_the_model_layers_at_320():
    suite = {s for name, s in load_suite().items() if name.startswith("r50dcn320_")}
    layers = bench_model.dcn_layers(bench_model.r50_dcnv2("dense"))
    model = {layers[n].shape(torch.empty(shape)) for n, shape in dcn_input_shapes(320).items()}
    assert model == suite


def test_tvm_deform_backbone_matches_torchvision():
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = bench_model.r50_dcnv2("tvm_deform")(x)
        theirs = bench_model.r50_dcnv2("torchvision")(x)
    assert bench_model.relative_error(ours, theirs) < 1e-5


@pytest.mark.skipif(not importlib.util.find_spec("onnxruntime"), reason="needs onnxruntime")
def test_onnx_export_maps_torchvision_op_to_deform_conv():
    import onnx

    model = bench_model.r50_dcnv2("torchvision")
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    graph = onnx.load_from_string(bench_model.onnx_model(model, x)).graph
    assert sum(node.op_type == "DeformConv" for node in graph.node) == 13
    run = bench_model.onnxruntime_runner(model, x, torch.get_num_threads())
    with torch.inference_mode():
        assert bench_model.relative_error(run(x), model(x)) < 1e-5


def test_layers_in_model_time_every_dcn_layer():
    rows = bench_model.layers_in_model(size=64, repeats=2)
    assert len(rows) == 13
    assert all(r.in_model_ms > 0 and r.after_model_ms > 0 and r.alone_ms > 0 for r in rows)


def test_bench_model_command(tmp_path):
    argv = ["bench-model", "--size", "32", "--runs", "1", "--no-compile", "--no-peers"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench-model.json").read_text())
    models = {r["the whole model"]: r for r in data["model"]}
    for row in ("torch + torchvision", "torch + tvm_deform", "torch + dense conv2d in place"):
        assert float(models[row]["median ms"]) > 0
    assert models["torch + tvm_deform"]["vs torch + torchvision"].endswith("x")
    assert len(data["layers"]) == 13
    assert (tmp_path / "bench-model.md").exists()


def test_bench_model_command_profiles_the_models_it_compiled(tmp_path, monkeypatch):
    compiles = []
    compile_model = bench_model._compiled
    monkeypatch.setattr(
        bench_model, "_compiled", lambda *a: compiles.append(1) or compile_model(*a)
    )
    argv = ["bench-model", "--size", "32", "--runs", "1", "--no-peers", "--out", str(tmp_path)]
    assert main(argv) == 0
    data = json.loads((tmp_path / "bench-model.json").read_text())
    models = {r["the whole model"] for r in data["model"]}
    assert "torch + dense conv2d in place, offset convs kept, torch.compile" in models
    layer = data["layers"][0]
    assert layer["dense conv2d there, compiled ms"] > 0
    assert layer["ours (compiled) / dense"] == pytest.approx(
        layer["in the compiled model ms"] / layer["dense conv2d there, compiled ms"]
    )
    assert len(compiles) == len(bench_model.IMPLEMENTATIONS)  # each model compiled once


def test_dcn_cost_table_subtracts_each_runtimes_dense_row():
    timing = lambda ms: Timing(ms, ms, ms, 1)  # noqa: E731
    rows = [
        bench_model.ModelRow("torch + tvm_deform", timing(120.0), 1e-6),
        bench_model.ModelRow("torch + dense conv2d in place", timing(100.0), None),
        bench_model.ModelRow("onnxruntime (whole model)", timing(90.0), 1e-6),
        bench_model.ModelRow("onnxruntime" + bench_model.DENSE, timing(70.5), None),
        bench_model.ModelRow("openvino (whole model)", None, None, "failed: ..."),
    ]
    costs = {r["runtime"]: r for r in bench_model.dcn_costs(rows)}
    assert set(costs) == {"torch, tvm_deform", "onnxruntime"}  # the runtimes with both rows
    assert costs["torch, tvm_deform"]["with DCN ms"] == 120.0
    assert costs["torch, tvm_deform"]["what the DCN layers add ms"] == pytest.approx(20.0)
    assert costs["onnxruntime"]["dense conv2d in place ms"] == 70.5
    assert costs["onnxruntime"]["what the DCN layers add ms"] == pytest.approx(19.5)


@pytest.mark.skipif(not importlib.util.find_spec("onnxruntime"), reason="needs onnxruntime")
def test_peers_also_run_the_dense_variant():
    rows = bench_model.run(size=32, compiled=False, peers=("onnxruntime",), runs=2, log=print)
    by_name = {r.implementation: r for r in rows}
    assert by_name["onnxruntime (whole model)"].timing is not None
    assert by_name["onnxruntime (whole model)"].error < 1e-4
    assert by_name["onnxruntime" + bench_model.DENSE].timing is not None


@pytest.mark.skipif(not importlib.util.find_spec("openvino"), reason="needs openvino")
def test_openvino_layer_times_name_every_dcn_layer():
    times = bench_model.openvino_layer_times(size=64, runs=1)
    assert set(times) == set(bench_model.dcn_layers(bench_model.r50_dcnv2("dense")))
    assert all(ms > 0 for ms in times.values())


def test_layer_table_compares_each_layer_with_openvinos():
    shape = ConvShape(1, 128, 8, 8, 128, 3, 3, pad_h=1, pad_w=1)
    rows = [
        bench_model.LayerRow("layer2.1.conv2", shape, 3.0, 2.5, 2.0),
        bench_model.LayerRow("layer2.2.conv2", shape, 3.0, 2.5, 2.0),
    ]
    records = bench_model.layer_records(rows, openvino_ms={"layer2.1.conv2": 2.0})
    assert records[0]["OpenVINO's, in its model ms"] == 2.0
    assert records[0]["ours (eager) / OpenVINO's"] == pytest.approx(1.5)
    assert records[1]["ours (eager) / OpenVINO's"] is None  # a layer OpenVINO did not report
    assert not any("OpenVINO" in column for column in bench_model.layer_records(rows)[0])
    compiled = {"layer2.1.conv2": 2.4, "layer2.2.conv2": 2.5}
    records = bench_model.layer_records(rows, compiled, {"layer2.1.conv2": 2.0})
    assert records[0]["in the compiled model ms"] == 2.4
    assert records[0]["ours (compiled) / OpenVINO's"] == pytest.approx(1.2)
    records = bench_model.layer_records(
        rows, compiled, {"layer2.1.conv2": 2.0}, {"layer2.2.conv2": 2.0}
    )
    assert records[0]["dense conv2d there, compiled ms"] is None
    assert records[0]["ours (compiled) / OpenVINO's"] == pytest.approx(1.2)
    assert records[1]["ours (compiled) / dense"] == pytest.approx(1.25)
    assert records[1]["OpenVINO's, in its model ms"] is None
    # The Markdown has one cell per column on every line.
    lines = bench_model.markdown(records).splitlines()
    assert len({line.count("|") for line in lines}) == 1 and len(lines) == 4


@pytest.mark.parametrize("implementation", ["tvm_deform", "dense"])
def test_compiled_layer_times_name_every_dcn_layer(implementation):
    times = bench_model.compiled_layer_times(size=32, runs=2, implementation=implementation)
    assert set(times) == set(bench_model.dcn_layers(bench_model.r50_dcnv2("dense")))
    assert all(ms > 0 for ms in times.values())


def test_floor_variant_runs_the_offset_branch_and_gives_the_dense_output():
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    floor = bench_model.r50_dcnv2("dense_with_offsets")
    ran = []
    for layer in bench_model.dcn_layers(floor).values():
        layer.offset_conv.register_forward_hook(lambda *_: ran.append(1))
    with torch.inference_mode():
        assert torch.equal(floor(x), bench_model.r50_dcnv2("dense")(x))
    assert len(ran) == 13
