"""Time what the input's layout and autograd's ``needs_input_grad`` change, through the public
``deform_conv2d``, in interleaved rounds on the same inputs:

- forward of a ``channels_last`` input (read in place by the NHWC kernel) against the same input
  made contiguous first (what the op did before) and against an NCHW input;
- forward + backward with every gradient, with the weight frozen (a frozen layer inside a
  network that still trains what comes before it), and with only the weight's gradient (the
  input and the offset branch frozen).

    .venv/bin/python lab/layouts_and_gradients.py > docs/results/<cpu>/layouts-and-gradients.md
"""

from __future__ import annotations

import statistics

import torch

from tvm_deform import deform_conv2d
from tvm_deform.runtime import targets
from tvm_deform.runtime.inputs import conv_kwargs, random_inputs
from tvm_deform.tools.bench import measure
from tvm_deform.tools.suite import load_suite

LAYERS = ("demo_64x56x56", "r50_c3_128x100x168", "r50_c4_256x50x84")
ROUNDS = 3


def median_of_rounds(calls: dict, runs: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, fn in calls.items():
            times[name].append(measure(fn, 1, runs, 0.2).median_ms)
    return {name: statistics.median(values) for name, values in times.items()}


def forward_calls(shape) -> dict:
    args = random_inputs(shape)
    x, offset, weight, bias, mask = (args[k] for k in ("input", "offset", "weight", "bias", "mask"))
    kwargs = conv_kwargs(shape) | dict(mask=mask)
    nhwc = x.contiguous(memory_format=torch.channels_last)
    return {
        "channels_last, read in place": lambda: deform_conv2d(nhwc, offset, weight, bias, **kwargs),
        "channels_last, made contiguous first": lambda: deform_conv2d(
            nhwc.contiguous(), offset, weight, bias, **kwargs
        ),
        "NCHW input": lambda: deform_conv2d(x, offset, weight, bias, **kwargs),
    }


def training_calls(shape) -> dict:
    args = random_inputs(shape)
    kwargs = conv_kwargs(shape)
    names = ("input", "offset", "weight", "bias", "mask")

    def step(required: set[str]):
        leaves = {
            n: args[n].detach().requires_grad_(n in required) for n in names if args[n] is not None
        }

        def run():
            out = deform_conv2d(
                leaves["input"],
                leaves["offset"],
                leaves["weight"],
                leaves.get("bias"),
                mask=leaves["mask"],
                **kwargs,
            )
            out.backward(torch.ones_like(out))
            for leaf in leaves.values():
                leaf.grad = None

        return run

    return {
        "every gradient": step(set(names)),
        "weight frozen": step({"input", "offset", "mask"}),
        "only the weight's": step({"weight", "bias"}),
    }


def table(title: str, layers: dict, make_calls, runs: int) -> None:
    print(f"\n{title}\n")
    rows = {name: median_of_rounds(make_calls(shape), runs) for name, shape in layers.items()}
    columns = list(next(iter(rows.values())))
    print("| layer | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for name, times in rows.items():
        base = times[columns[0]]
        cells = [
            f"{times[c]:.2f}" + ("" if c == columns[0] else f" ({times[c] / base:.2f}x)")
            for c in columns
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    suite = load_suite()
    layers = {name: suite[name] for name in LAYERS}
    print(
        f"CPU {targets.host_cpu()}, {torch.get_num_threads()} threads; median ms of {ROUNDS} "
        "interleaved rounds; in brackets: the time over the first column's"
    )
    table("Forward, by the input's layout:", layers, forward_calls, 10)
    table("Forward + backward, by the gradients autograd asks for:", layers, training_calls, 3)


if __name__ == "__main__":
    main()
