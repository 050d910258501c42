"""Schedule functions of another commit against this tree's, in one process, call by call:
both kernels of each suite layer named are built (the commit's functions from ``--module`` put
in place of this tree's, and of the ``tvm_deform.schedules`` names that re-export them, the
kernel cache off), then calls through the public ``deform_conv2d`` alternate between them
(which goes first alternating too), timing the backward (the gradients ``--gradients`` asks
autograd for) or the forward. Each pair of neighbouring calls gives a ratio, and the median of
the ratios is the result: the speed of a shared machine drifts by 10-30% within seconds,
which hides a change of a few percent in one stage of a kernel between whole runs, and even
between rounds that alternate (``lab/training_ab.py``).

A function is named as in its module, or ``Class.method``; the commit's runs with the commit's
module around it (the helpers it calls are the commit's), so ``BackwardCPU.apply`` compares
the whole default backward schedule of the two.

    .venv/bin/python lab/schedule_ab.py --commit 6ab536e \
        --function _sampling_grad_along_channels --gradients sampling \
        --layers demo_64x56x56,dla34_64x128x128 --pairs 200
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import types

os.environ["TVM_DEFORM_CACHE"] = "0"  # the cache's key does not see a swapped function
os.environ["TVM_DEFORM_PREPARE_BACKWARD"] = "0"  # no compile in a thread beside the swaps

import torch  # noqa: E402

from tvm_deform import deform_conv2d  # noqa: E402
from tvm_deform import schedules as schedule_package  # noqa: E402
from tvm_deform.runtime import kernels, targets  # noqa: E402
from tvm_deform.runtime.inputs import conv_kwargs, random_inputs  # noqa: E402
from tvm_deform.tools.suite import load_suite  # noqa: E402

LEAVES = ("input", "offset", "mask", "weight", "bias")
#: which leaves need a gradient, by ``--gradients``
ASKED = {
    "all": set(LEAVES),
    "input": {"input"},
    "sampling": {"offset", "mask"},
    "weight": {"weight", "bias"},
}
SIDES = ("tree", "commit")


def module_at(commit: str, path: str) -> types.ModuleType:
    """The module at ``path`` (a file of the repository) as it is at ``commit``."""
    source = subprocess.run(
        ["git", "show", f"{commit}:{path}"], capture_output=True, text=True, check=True
    ).stdout
    name = f"_schedule_ab_{commit}"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up
    # in a file: TVMScript parses a function from its source, which it reads back from there
    copy = (
        pathlib.Path(tempfile.mkdtemp(prefix="schedule_ab_"))
        / f"{commit}_{pathlib.Path(path).name}"
    )
    copy.write_text(source)
    module.__file__ = str(copy)
    exec(compile(source, str(copy), "exec"), module.__dict__)
    return module


class Sides:
    """The kernels of both sides: :meth:`use` picks the side whose kernels the op gets from
    ``kernels.get_kernel`` and ``kernels.get_backward``; each side's are built at its first
    request, with its functions in place."""

    def __init__(self, module: types.ModuleType, old: types.ModuleType, names: list[str]):
        self.module = module
        self.functions = {
            "tree": {name: _lookup(module, name) for name in names},
            "commit": {name: _lookup(old, name) for name in names},
        }
        self.reexported = [
            name for name in names if getattr(schedule_package, name, None) is _lookup(module, name)
        ]
        self.side = "tree"
        self.built: dict[tuple, object] = {}
        for name in ("get_kernel", "get_backward"):
            setattr(kernels, name, self._held(name, getattr(kernels, name)))

    def use(self, side: str) -> None:
        self.side = side

    def _held(self, name: str, get):
        def held(*args, **kwargs):
            key = (self.side, name, args, tuple(sorted(kwargs.items())))
            if key not in self.built:
                self._put_in_place(self.side)
                self.built[key] = get(*args, **kwargs)
                self._put_in_place("tree")
            return self.built[key]

        return held

    def _put_in_place(self, side: str) -> None:
        for name, function in self.functions[side].items():
            owner, _, attribute = name.rpartition(".")
            setattr(_lookup(self.module, owner) if owner else self.module, attribute, function)
            if name in self.reexported:
                setattr(schedule_package, name, function)
        kernels.clear_memory_cache()


def _lookup(namespace, name: str):
    """``name`` in ``namespace``, dotted names (a class's method) followed."""
    for part in name.split("."):
        namespace = getattr(namespace, part)
    return namespace


def layer_call(name: str, gradients: str, suite: str | None = None):
    """A function that runs the layer ``name`` of the suite (the shipped one, or the JSON file
    ``suite``) forward (and backward) once, returning the seconds of the part timed and what
    it computed."""
    shape = load_suite(suite)[name]
    args = random_inputs(shape)
    kwargs = conv_kwargs(shape)
    asked = ASKED.get(gradients, set())
    torch.manual_seed(1)
    grad_output = torch.randn(shape.batch, shape.out_channels, shape.out_h, shape.out_w)

    def call() -> tuple[float, list[torch.Tensor]]:
        leaves = {
            key: None if value is None else value.detach().requires_grad_(key in asked)
            for key, value in args.items()
            if key in LEAVES
        }
        begin = time.perf_counter()
        out = deform_conv2d(
            leaves["input"], leaves["offset"], leaves["weight"], leaves["bias"],
            mask=leaves["mask"], **kwargs,
        )  # fmt: skip
        if not asked:
            return time.perf_counter() - begin, [out]
        begin = time.perf_counter()
        out.backward(grad_output)
        elapsed = time.perf_counter() - begin
        return elapsed, [leaves[k].grad for k in LEAVES if k in asked and leaves[k] is not None]

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", required=True)
    parser.add_argument("--module", default="schedules/cpu_backward.py")
    parser.add_argument(
        "--function", action="append", required=True, help="a name, or Class.method; repeatable"
    )
    parser.add_argument("--gradients", choices=[*ASKED, "forward"], default="all")
    parser.add_argument("--layers", required=True, help="suite layer names, comma-separated")
    parser.add_argument("--suite", help="a JSON file of layers in the suite's format")
    parser.add_argument(
        "--avx2",
        action="store_true",
        help="compile both sides for AVX2 (x86-64-v3): that code path's speed on this CPU",
    )
    parser.add_argument("--pairs", type=int, default=200, help="pairs of calls per layer")
    options = parser.parse_args()
    if options.avx2:
        avx2 = targets.avx2_target()
        targets.host_target = lambda: avx2  # every kernel the op builds, both sides

    dotted = options.module.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    # schedules/ is the package tvm_deform.schedules; tvm_deform/ir/... is itself
    package = dotted if dotted.startswith("tvm_deform.") else f"tvm_deform.{dotted}"
    module = importlib.import_module(package)
    sides = Sides(module, module_at(options.commit, options.module), options.function)
    compiled = ", compiled for AVX2 (x86-64-v3)" if options.avx2 else ""
    print(
        f"CPU {targets.host_cpu()}{compiled}, {torch.get_num_threads()} threads; "
        f"{options.gradients}; "
        f"{options.pairs} pairs of calls a layer, alternating; functions of {options.module} "
        f"at {options.commit}: {', '.join(options.function)}\n"
    )
    print(
        "| layer | at commit, median ms | this tree, median ms | tree / commit, median of "
        "pairs | pairs tree faster | max diff |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name in options.layers.split(","):
        call = layer_call(name, options.gradients, options.suite)
        computed = {}
        for side in SIDES:  # built, and warm
            sides.use(side)
            for _ in range(3):
                _, computed[side] = call()
        times = {side: [] for side in SIDES}
        for pair in range(options.pairs):
            for side in SIDES if pair % 2 == 0 else SIDES[::-1]:
                sides.use(side)
                times[side].append(call()[0])
        ratios = [new / old for new, old in zip(times["tree"], times["commit"], strict=True)]
        wins = sum(ratio < 1 for ratio in ratios)
        diff = max(
            (a - b).abs().max().item()
            for a, b in zip(computed["commit"], computed["tree"], strict=True)
        )
        print(
            f"| {name} | {statistics.median(times['commit']) * 1e3:.3f} "
            f"| {statistics.median(times['tree']) * 1e3:.3f} | {statistics.median(ratios):.3f} "
            f"| {wins} of {options.pairs} | {diff:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
