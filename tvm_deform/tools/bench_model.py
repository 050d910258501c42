"""Whole-model benchmark (tools layer): ResNet-50 with DCNv2 in stages c3-c5, as mmdetection's
``r50`` DCNv2 backbone lays it out, run by torch with torchvision's op, with ours, and with a
dense conv2d in place of each DCN (the ceiling), and with a dense conv2d in place whose offset
convs still run (the floor: the model with a DCN kernel as fast as the runtime's dense conv);
eager and under ``torch.compile``; and by ONNX Runtime and OpenVINO on the whole model. Every
row is checked against torch + torchvision.

The backbone: torchvision's ``resnet50`` (random init, eval mode) whose 3x3 conv in every
bottleneck of ``layer2``-``layer4`` becomes a DCNv2 layer. Its offsets and mask come from a 3x3
conv beside it on the same input (27 channels: 18 offsets, then 9 mask logits through a
sigmoid), with the conv's stride, as mmdetection's ``ModulatedDeformConv2dPack`` does. The
offset conv is initialised at random (not zero, as mmdetection does, which would make every
sample a regular grid point) with a scale that gives offsets of a few pixels.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from tvm_deform.ir.definition import ConvShape
from tvm_deform.tools.bench import ROUNDS, Timing, combine, measure, relative_error

#: what takes each DCN layer's place: torchvision's op, ours, a dense conv2d (the ceiling), or a
#: dense conv2d whose offset branch still runs (the floor of any DCN kernel in that runtime)
IMPLEMENTATIONS = ("torchvision", "tvm_deform", "dense", "dense_with_offsets")
#: the model table's row of each implementation (a row without "dense" is checked for errors)
LABELS = {
    "torchvision": "torch + torchvision",
    "tvm_deform": "torch + tvm_deform",
    "dense": "torch + dense conv2d in place",
    "dense_with_offsets": "torch + dense conv2d in place, offset convs kept",
}
#: the label suffix of a peer's row on the dense variant
DENSE = ", dense conv2d in place"


def _deform_function(implementation: str) -> Callable[..., torch.Tensor]:
    if implementation == "torchvision":
        import torchvision.ops

        return torchvision.ops.deform_conv2d
    from tvm_deform.binding.ops import deform_conv2d

    return deform_conv2d


class DCNv2(nn.Module):
    """A 3x3 DCNv2 layer with its offset/mask conv, in place of ``conv`` (whose weight, stride,
    padding and dilation it keeps). ``implementation`` picks torchvision's op, ours,
    ``"dense"``: the plain conv, no offsets (the ceiling), or ``"dense_with_offsets"``: the
    offsets and mask computed as for a DCN, then the plain conv (what a DCN layer would cost
    if its kernel ran as fast as the runtime's dense conv)."""

    def __init__(self, conv: nn.Conv2d, implementation: str, offset_std: float = 0.02):
        super().__init__()
        self.implementation = implementation
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.weight = conv.weight
        taps = conv.kernel_size[0] * conv.kernel_size[1]
        self.offset_conv = nn.Conv2d(
            conv.in_channels,
            3 * taps,
            conv.kernel_size,
            conv.stride,
            conv.padding,
            conv.dilation,
            bias=True,
        )
        nn.init.normal_(self.offset_conv.weight, std=offset_std)
        nn.init.zeros_(self.offset_conv.bias)
        self.taps = taps
        dense = implementation.startswith("dense")
        self.deform = None if dense else _deform_function(implementation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.implementation == "dense":
            return self._dense(x)
        out = self.offset_conv(x)
        offset, mask = out[:, : 2 * self.taps], out[:, 2 * self.taps :].sigmoid()
        if self.deform is None:
            # A term that adds zero keeps the offset branch from being removed as dead code.
            return self._dense(x) + 0.0 * (offset.sum() + mask.sum())
        return self.deform(
            x,
            offset,
            self.weight,
            None,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            mask=mask,
        )

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.conv2d(x, self.weight, None, self.stride, self.padding, self.dilation)

    def shape(self, x: torch.Tensor) -> ConvShape:
        """The deformable convolution this layer runs on input ``x``."""
        n, c, h, w = x.shape
        return ConvShape(
            n,
            c,
            h,
            w,
            self.weight.shape[0],
            self.weight.shape[2],
            self.weight.shape[3],
            stride_h=self.stride[0],
            stride_w=self.stride[1],
            pad_h=self.padding[0],
            pad_w=self.padding[1],
            dilation_h=self.dilation[0],
            dilation_w=self.dilation[1],
        )


def r50_dcnv2(implementation: str, seed: int = 0) -> nn.Module:
    """ResNet-50 (torchvision's, random init, eval mode, without its classifier head) with DCNv2
    in c3-c5. The same ``seed`` gives the same weights for every implementation."""
    import torchvision

    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    torch.manual_seed(seed)
    model = torchvision.models.resnet50(weights=None)
    model.fc = nn.Identity()
    for stage in (model.layer2, model.layer3, model.layer4):
        for block in stage:
            # Created for every implementation, so that the random streams stay aligned.
            block.conv2 = DCNv2(block.conv2, implementation)
    return model.eval()


def dcn_layers(model: nn.Module) -> dict[str, DCNv2]:
    return {name: m for name, m in model.named_modules() if isinstance(m, DCNv2)}


# ONNX export: torchvision registers no ONNX symbolic for its op; this one emits the standard
# DeformConv (opset 19). Its inputs are X, W, offset, B, mask; torchvision's op takes (input,
# weight, offset, mask, bias, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups,
# offset_groups, use_mask).
def _deform_conv_symbolic(g, input, weight, offset, mask, bias, *params):
    from torch.onnx import symbolic_helper

    values = [symbolic_helper._get_const(p, "i", "") for p in params]
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups, offset_groups, use_mask = values
    kernel = symbolic_helper._get_tensor_sizes(weight)[2:]
    inputs = [input, weight, offset, bias] + ([mask] if use_mask else [])
    return g.op(
        "DeformConv",
        *inputs,
        dilations_i=[dil_h, dil_w],
        group_i=groups,
        offset_group_i=offset_groups,
        kernel_shape_i=kernel,
        pads_i=[pad_h, pad_w, pad_h, pad_w],
        strides_i=[stride_h, stride_w],
    )


def onnx_model(model: nn.Module, example: torch.Tensor) -> bytes:
    """``model`` (the torchvision variant) exported to ONNX (opset 19, DeformConv)."""
    import io

    import torch.onnx

    torch.onnx.register_custom_op_symbolic("torchvision::deform_conv2d", _deform_conv_symbolic, 19)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (example,), buffer, opset_version=19, dynamo=False)
    return buffer.getvalue()


def onnxruntime_runner(model: nn.Module, example: torch.Tensor, threads: int):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(
        onnx_model(model, example), options, providers=["CPUExecutionProvider"]
    )
    name = session.get_inputs()[0].name
    return lambda x: torch.from_numpy(session.run(None, {name: x.numpy()})[0])


def _openvino_compiled(
    model: nn.Module, example: torch.Tensor, threads: int, profile: bool = False
):
    import openvino

    from tvm_deform.tools.peers import openvino_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = openvino.convert_model(model, example_input=example)
    config = openvino_config(threads) | ({"PERF_COUNT": True} if profile else {})
    return openvino.Core().compile_model(converted, "CPU", config)


def openvino_runner(model: nn.Module, example: torch.Tensor, threads: int):
    import numpy as np

    compiled = _openvino_compiled(model, example, threads)
    request = compiled.create_infer_request()
    return lambda x: torch.from_numpy(np.asarray(request.infer([x.numpy()])[compiled.output(0)]))


def openvino_layer_times(size: int = 320, batch: int = 1, runs: int = 10) -> dict[str, float]:
    """OpenVINO's own time for each DCN layer inside its whole model (the torchvision variant,
    converted as ``openvino_runner`` does): the median over ``runs`` forwards of its per-layer
    counters (``PERF_COUNT``), in ms, by the layer's module name (``layer2.0.conv2``). Each is
    its ``DeformableConvolution`` kernel alone, as our in-model time is our op's call."""
    model = r50_dcnv2("torchvision")
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))
    compiled = _openvino_compiled(model, x, torch.get_num_threads(), profile=True)
    request = compiled.create_infer_request()
    times: dict[str, list[float]] = {}
    for run in range(runs + 1):  # the first is a warm-up
        request.infer([x.numpy()])
        for node in request.profiling_info:
            layer = re.search(r"layer\d+\.\d+\.conv2", node.node_name)
            if run and node.node_type == "DeformableConvolution" and layer:
                times.setdefault(layer.group(), []).append(node.real_time.total_seconds() * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


@dataclasses.dataclass(frozen=True)
class ModelRow:
    implementation: str
    timing: Timing | None
    error: float | None  # against torch + torchvision (eager)
    note: str = ""


def run(
    size: int = 320,
    batch: int = 1,
    compiled: bool = True,
    peers: tuple[str, ...] = ("onnxruntime", "openvino"),
    runs: int = 10,
    log: Callable[[str], None] = print,
    compiled_calls: dict[str, Callable[[], torch.Tensor]] | None = None,
) -> list[ModelRow]:
    """Time the backbone on a random ``batch x 3 x size x size`` input every way (see the
    module docstring): at least ``runs`` runs a row, in interleaved rounds; a row's time is the
    median of its rounds' medians. ``compiled_calls``, when given, receives each
    implementation's compiled forward, for :func:`compiled_layer_times` to profile without
    compiling the model again."""
    threads = torch.get_num_threads()
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))
    models = {name: r50_dcnv2(name) for name in IMPLEMENTATIONS}
    rows: list[ModelRow] = []
    with torch.inference_mode():
        expected = models["torchvision"](x)
        candidates: dict[str, Callable[[], torch.Tensor]] = {
            LABELS[name]: lambda m=models[name]: m(x) for name in IMPLEMENTATIONS
        }
    if compiled:
        for name in IMPLEMENTATIONS:
            call = _compiled(models[name], x)
            candidates[f"{LABELS[name]}, torch.compile"] = call
            if compiled_calls is not None:
                compiled_calls[name] = call
    # Each peer also runs the dense variant, so that what the DCN layers cost each runtime can
    # be told apart from how fast it runs the rest of the network.
    for peer in peers:
        for name, label in (("torchvision", f"{peer} (whole model)"), ("dense", peer + DENSE)):
            try:
                runner = {"onnxruntime": onnxruntime_runner, "openvino": openvino_runner}[peer](
                    models[name], x, threads
                )
            except Exception as error:  # noqa: BLE001 - a peer that cannot run is reported
                note = f"failed: {type(error).__name__}: {error}"
                rows.append(ModelRow(label, None, None, note))
                continue
            candidates[label] = lambda r=runner: r(x)
    errors = {}
    for label, fn in candidates.items():
        with torch.inference_mode():
            errors[label] = None if "dense" in label else relative_error(fn(), expected)
    # Interleaved rounds: every row is timed in each round, so that a slow stretch of a shared
    # machine does not fall on one row alone (and every row runs beside the same peers'
    # thread pools, which exist from here on).
    rounds: dict[str, list[Timing]] = {label: [] for label in candidates}
    per_round = max(2, -(-runs // ROUNDS))
    for round_ in range(ROUNDS):
        log(f"  round {round_ + 1} of {ROUNDS} ...")
        for label, fn in candidates.items():
            with torch.inference_mode():
                rounds[label].append(measure(fn, warmup=1, min_runs=per_round, min_seconds=0.3))
    rows += [ModelRow(label, combine(rounds[label]), errors[label]) for label in candidates]
    return rows


def _compiled(model: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    import torch._inductor.config as inductor_config

    compiled = torch.compile(model)

    def call() -> torch.Tensor:
        with torch.inference_mode():
            return compiled(x)

    # Compile now, outside the timing; freezing (weights as constants, conv+BN folded) for this
    # model only, not for the rest of the process.
    with inductor_config.patch(freezing=True):
        call()
    return call


@dataclasses.dataclass(frozen=True)
class LayerRow:
    name: str
    shape: ConvShape
    in_model_ms: float
    after_model_ms: float  # alone, once right after each forward (the same stretch of time)
    alone_ms: float  # alone, in a loop of its own (as the layer benchmarks time it)


def layers_in_model(size: int = 320, batch: int = 1, repeats: int = 10) -> list[LayerRow]:
    """Each DCN layer's time inside the model (tvm_deform variant, eager: the op's own time,
    between the model's torch ops) against the same layer alone on the same inputs: called once
    right after each forward, so that both see the same stretch of this shared machine, and in
    a loop of its own afterwards, as the layer benchmarks time it."""
    from tvm_deform.binding.ops import deform_conv2d

    model = r50_dcnv2("tvm_deform")
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))
    inside: dict[str, list[float]] = {}
    after: dict[str, list[float]] = {}
    captured: dict[str, tuple] = {}

    def timed_deform(name: str):
        def deform(*args, **kwargs):
            begin = time.perf_counter()
            out = deform_conv2d(*args, **kwargs)
            inside.setdefault(name, []).append(time.perf_counter() - begin)
            captured[name] = (args, kwargs)
            return out

        return deform

    layers = dcn_layers(model)
    for name, layer in layers.items():
        layer.deform = timed_deform(name)
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first forward and call of each are a warm-up
            model(x)
            for name in layers:
                args, kwargs = captured[name]
                begin = time.perf_counter()
                deform_conv2d(*args, **kwargs)
                after.setdefault(name, []).append(time.perf_counter() - begin)
        rows = []
        for name, layer in layers.items():
            args, kwargs = captured[name]
            alone = measure(lambda a=args, k=kwargs: deform_conv2d(*a, **k), min_runs=repeats)
            rows.append(
                LayerRow(
                    name,
                    layer.shape(args[0]),
                    statistics.median(inside[name][1:]) * 1e3,
                    statistics.median(after[name][1:]) * 1e3,
                    alone.median_ms,
                )
            )
    return rows


def markdown(records: list[dict[str, object]], digits: int = 2) -> str:
    """``records`` (dicts with the same keys, the columns) as a Markdown table: floats with
    ``digits`` decimals, None as an empty cell."""
    if not records:
        return ""
    columns = list(records[0])

    def cell(value: object) -> str:
        if value is None:
            return ""
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in records]
    return "\n".join(lines)


def model_records(rows: list[ModelRow]) -> list[dict[str, object]]:
    """Per whole-model row: its median and spread, its speed-up over torch + torchvision, its
    ratio to the dense model, its error against torch + torchvision, or why it has no time."""
    base = {r.implementation: r for r in rows}
    tv = base.get("torch + torchvision")
    dense = base.get("torch + dense conv2d in place")
    records = []
    for row in rows:
        t = row.timing
        records.append(
            {
                "the whole model": row.implementation,
                "median ms": row.note if t is None else f"{t.median_ms:.1f}",
                "p20-p80": None if t is None else f"{t.p20_ms:.1f}-{t.p80_ms:.1f}",
                "vs torch + torchvision": (
                    f"{tv.timing.median_ms / t.median_ms:.2f}x" if t and tv and tv.timing else None
                ),
                "vs dense conv2d": (
                    f"{t.median_ms / dense.timing.median_ms:.2f}x"
                    if t and dense and dense.timing
                    else None
                ),
                "rel. error vs torchvision": None if row.error is None else f"{row.error:.1e}",
            }
        )
    return records


def model_table(rows: list[ModelRow]) -> str:
    return markdown(model_records(rows))


#: (row with the DCN layers, the same runtime's row with dense conv2d in place, what it is)
DCN_COST_PAIRS = (
    ("torch + torchvision", "torch + dense conv2d in place", "torch, torchvision's op"),
    ("torch + tvm_deform", "torch + dense conv2d in place", "torch, tvm_deform"),
    (
        "torch + tvm_deform, torch.compile",
        "torch + dense conv2d in place, torch.compile",
        "torch.compile, tvm_deform",
    ),
    (
        "torch + dense conv2d in place, offset convs kept, torch.compile",
        "torch + dense conv2d in place, torch.compile",
        "torch.compile, offset convs only (no DCN kernel)",
    ),
    ("onnxruntime (whole model)", "onnxruntime" + DENSE, "onnxruntime"),
    ("openvino (whole model)", "openvino" + DENSE, "openvino"),
)


def dcn_costs(rows: list[ModelRow]) -> list[dict[str, object]]:
    """What the DCN layers (each with its offset conv and sigmoid) add to each runtime: its
    time with them minus its time with a dense conv2d in their place."""
    times = {r.implementation: r.timing.median_ms for r in rows if r.timing is not None}
    return [
        {
            "runtime": name,
            "with DCN ms": times[with_dcn],
            "dense conv2d in place ms": times[dense],
            "what the DCN layers add ms": times[with_dcn] - times[dense],
        }
        for with_dcn, dense, name in DCN_COST_PAIRS
        if with_dcn in times and dense in times
    ]


def dcn_cost_table(rows: list[ModelRow]) -> str:
    return markdown(dcn_costs(rows), digits=1)


def layer_records(
    rows: list[LayerRow],
    compiled_ms: dict[str, float] | None = None,
    openvino_ms: dict[str, float] | None = None,
    dense_ms: dict[str, float] | None = None,
) -> list[dict[str, object]]:
    """Per DCN layer of the tvm_deform model: its time inside the model (eager) against alone,
    right after each forward and in a loop of its own. ``compiled_ms``
    (:func:`compiled_layer_times`) adds our op's time inside the compiled model; ``dense_ms``
    (the same, ``"dense"``) the dense conv at the layer's place in the compiled dense model,
    and ours against it; ``openvino_ms`` (:func:`openvino_layer_times`) OpenVINO's DCN kernel
    inside its own model, and ours against it (compiled when given, else eager). A time that
    was not measured is None."""
    ours_vs = "compiled" if compiled_ms is not None else "eager"
    records = []
    for r in rows:
        s = r.shape
        record: dict[str, object] = {
            "DCN layer": r.name,
            "input": f"{s.in_channels}x{s.height}x{s.width} stride {s.stride_h}",
            "out": f"{s.out_channels}x{s.out_h}x{s.out_w}",
            "in the model ms": r.in_model_ms,
            "alone, after each forward ms": r.after_model_ms,
            "in the model / after": r.in_model_ms / r.after_model_ms,
            "alone, in a loop ms": r.alone_ms,
            "in the model / in a loop": r.in_model_ms / r.alone_ms,
        }
        ours: float | None = r.in_model_ms
        if compiled_ms is not None:
            ours = compiled_ms.get(r.name)
            record["in the compiled model ms"] = ours
        for peer, label in ((dense_ms, "dense conv2d there, compiled"), (openvino_ms, None)):
            if peer is None:
                continue
            theirs = peer.get(r.name)
            name, short = (label, "dense") if label else ("OpenVINO's, in its model", "OpenVINO's")
            record[f"{name} ms"] = theirs
            record[f"ours ({ours_vs}) / {short}"] = ours / theirs if theirs and ours else None
        records.append(record)
    return records


def layer_table(
    rows: list[LayerRow],
    compiled_ms: dict[str, float] | None = None,
    openvino_ms: dict[str, float] | None = None,
    dense_ms: dict[str, float] | None = None,
) -> str:
    """:func:`layer_records` as a Markdown table."""
    return markdown(layer_records(rows, compiled_ms, openvino_ms, dense_ms))


def compiled_layer_times(
    size: int = 320,
    batch: int = 1,
    runs: int = 10,
    implementation: str = "tvm_deform",
    call: Callable[[], torch.Tensor] | None = None,
) -> dict[str, float]:
    """The time of each DCN layer inside the model compiled as the benchmark compiles it
    (``torch.compile``, ``freezing=True``): the median over ``runs`` forwards of its op's
    events in torch's profiler, by the layer's module name. With ``"tvm_deform"`` the op is
    ours (the compiled graph calls it once per layer, in the layers' order); with ``"dense"``
    it is the dense 3x3 conv at the layer's place: the last 3x3 convs of each forward (c3-c5
    come after the dense c2), whatever kernel torch picked for them. ``call``: that model's
    compiled forward on the benchmark's input, as :func:`run` hands it out (compiled here when
    not given)."""
    from torch.profiler import ProfilerActivity, profile

    if implementation not in ("tvm_deform", "dense"):
        raise ValueError(f"implementation must be 'tvm_deform' or 'dense', got {implementation!r}")
    model = r50_dcnv2(implementation)
    if call is None:
        x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))
        call = _compiled(model, x)
    call()  # a warm-up
    dense = implementation == "dense"
    with profile(activities=[ProfilerActivity.CPU], record_shapes=dense) as profiled:
        for _ in range(runs):
            call()
    calls = sorted(
        (e for e in profiled.events() if _is_layer_call(e, dense)),
        key=lambda e: e.time_range.start,
    )
    names = list(dcn_layers(model))
    per_forward, rest = divmod(len(calls), runs)
    if rest or per_forward < len(names) or (not dense and per_forward != len(names)):
        raise RuntimeError(f"{len(calls)} op calls in {runs} forwards of {len(names)} layers")
    first = per_forward - len(names)
    return {
        name: statistics.median(
            e.time_range.elapsed_us() / 1e3 for e in calls[first + i :: per_forward]
        )
        for i, name in enumerate(names)
    }


def _is_layer_call(event, dense: bool) -> bool:
    """Whether a profiler event is a DCN layer's call: our op, or (``dense``) a conv whose
    weight is 3x3 and is not an offset conv's (27 output channels)."""
    if not dense:
        return event.name == "tvm_deform::deform_conv2d"
    if "conv" not in event.name or len(event.input_shapes) < 2:
        return False
    parent = event.cpu_parent
    while parent is not None:  # the outermost conv event only (aten's convs nest)
        if "conv" in parent.name:
            return False
        parent = parent.cpu_parent
    weight = event.input_shapes[1]
    return len(weight) == 4 and weight[2:] == [3, 3] and weight[0] != 3 * 9
