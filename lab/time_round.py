"""Time a round of tuning candidates (see ``tvm_deform.tools.rounds``) on the machine that
measures them, and check each one's output against torchvision's (a backward candidate's:
its gradients of the offset, mask, weight and bias).

    python lab/time_round.py ROUND --out results.jsonl [--deadline 480] [--min-ms 20]

ROUND is the round's directory, or the same packed (``ROUND_DIR.tar.xz``, which ``tvm-deform
tune-round`` writes beside it and which is what travels: a fraction of the size).

A CUDA round runs on a GPU machine with torch, torchvision and CuPy, and without TVM or this
package: each candidate is a cubin that CuPy loads, launched as its launch plan says, its
scratch buffers allocated by torch. An LLVM round (the rehearsal on a CPU) runs each
candidate's shared library through TVM's runtime. One JSON line per candidate is appended to
``--out`` as soon as it is timed (``run_secs``: seconds per call of each repeat) or has failed
(``error``: a load or launch error, or an output that differs from torchvision's); a candidate
that would start after ``--deadline`` seconds is left untimed, and the script says how many.
Candidates already in ``--out`` are skipped, so that a call cut short can be run again. A
CUDA candidate that leaves the GPU's context unusable (an illegal address, say: every later
CUDA call would fail) is recorded with its error and the script starts itself again in a fresh
process, which goes on with the next candidate within the same deadline.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

#: how far a candidate's output may be from torchvision's (norm-relative), per dtype
TOLERANCE = {"float32": 1e-4, "float64": 1e-10, "float16": 5e-3, "bfloat16": 3e-2}
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
}


#: main's exit status when a candidate left the CUDA context unusable (the script then starts
#: itself again)
CONTEXT_LOST = 3
#: the environment variable that carries the first start's time (``time.time()``) to a restart
STARTED = "TIME_ROUND_STARTED"


#: the PrimFunc parameters that are inputs (random); every other one is an output or a
#: workspace (zeroed before each candidate runs)
INPUTS = ("data", "offset", "mask", "weight", "bias", "grad_output")


def inputs(workload: dict, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random arguments of the workload's PrimFunc (outputs and workspaces zeroed), as torch
    tensors. A padded ``grad_output`` (the backward's) is zero past the output's pixels."""
    generator = torch.Generator().manual_seed(seed)
    pixels = _out(workload["shape"], "h") * _out(workload["shape"], "w")
    found = {}
    for arg in workload["args"]:
        shape, dtype, name = arg["shape"], DTYPES[arg["dtype"]], arg["name"]
        value = torch.randn(shape, generator=generator, dtype=torch.float64)
        if name == "offset":
            value = value * 2.0
        elif name == "mask":
            value = torch.rand(shape, generator=generator, dtype=torch.float64)
        elif name == "grad_output":
            value[..., pixels:] = 0.0
        elif name not in INPUTS:
            value = torch.zeros(shape, dtype=torch.float64)
        found[name] = value.to(device=device, dtype=dtype)
    return found


def reference(workload: dict, args: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What torchvision computes for the arguments (in float32 for half dtypes), by the name
    of the PrimFunc's buffer that holds it: the forward's output, or the backward's gradients
    of the offset, mask, weight and bias."""
    import torchvision.ops

    shape = workload["shape"]
    batch, out_h, out_w = shape["batch"], _out(shape, "h"), _out(shape, "w")
    kh, kw = shape["kernel_h"], shape["kernel_w"]
    wide = (
        (lambda t: t.float())
        if args["data"].dtype in (torch.float16, torch.bfloat16)
        else (lambda t: t)
    )
    backward = workload.get("op", "forward") == "backward"
    leaves = {
        "offset": wide(args["offset"]).reshape(batch, -1, out_h, out_w),
        "weight": wide(args["weight"]).reshape(shape["out_channels"], -1, kh, kw),
    }
    if "mask" in args:
        leaves["mask"] = wide(args["mask"]).reshape(batch, -1, out_h, out_w)
    if "bias" in args:
        leaves["bias"] = wide(args["bias"])
    elif backward and "grad_bias" in args:  # the backward takes no bias: its value is no matter
        leaves["bias"] = wide(torch.zeros_like(args["grad_bias"]))
    if backward:
        leaves = {name: value.detach().requires_grad_() for name, value in leaves.items()}
    result = torchvision.ops.deform_conv2d(
        wide(args["data"]),
        leaves["offset"],
        leaves["weight"],
        leaves.get("bias"),
        (shape["stride_h"], shape["stride_w"]),
        (shape["pad_h"], shape["pad_w"]),
        (shape["dilation_h"], shape["dilation_w"]),
        leaves.get("mask"),
    )
    if not backward:
        return {"output": result.reshape(batch, shape["out_channels"], out_h * out_w)}
    grad = wide(args["grad_output"])[..., : out_h * out_w].reshape(result.shape)
    result.backward(grad)
    return {
        f"grad_{name}": value.grad.reshape(args[f"grad_{name}"].shape)
        for name, value in leaves.items()
        if f"grad_{name}" in args
    }


def _out(shape: dict, axis: str) -> int:
    size, pad = shape["height" if axis == "h" else "width"], shape[f"pad_{axis}"]
    kernel, dilation = shape[f"kernel_{axis}"], shape[f"dilation_{axis}"]
    return (size + 2 * pad - (dilation * (kernel - 1) + 1)) // shape[f"stride_{axis}"] + 1


class CudaCandidate:
    """A CUDA candidate: its cubin loaded by CuPy, its launch plan run on torch's tensors."""

    def __init__(self, directory: Path, entry: dict, args: dict[str, torch.Tensor]):
        import cupy

        self.cupy = cupy
        module = cupy.RawModule(path=str(directory / entry["cubin"]))
        buffers = {name: cupy.asarray(tensor) for name, tensor in args.items()}
        for name, scratch in entry["scratch"].items():
            dtype = DTYPES[scratch["dtype"]]
            tensor = torch.empty(scratch["elements"], dtype=dtype, device=args["data"].device)
            buffers[name] = cupy.asarray(tensor)
            args[f"scratch:{name}"] = tensor  # kept alive as long as the candidate
        self.launches = []
        for launch in entry["launches"]:
            function = module.get_function(launch["kernel"])
            if launch["shared_bytes"] > 48 * 1024:
                function.max_dynamic_shared_size_bytes = launch["shared_bytes"]
            values = tuple(
                buffers[a] if isinstance(a, str) else cupy.int32(a) for a in launch["args"]
            )
            self.launches.append(
                (function, tuple(launch["grid"]), tuple(launch["block"]), values,
                 launch["shared_bytes"])
            )  # fmt: skip

    def __call__(self) -> None:
        for function, grid, block, values, shared in self.launches:
            function(grid, block, values, shared_mem=shared)

    def seconds(self, number: int) -> float:
        """Seconds per call over ``number`` calls back to back (CUDA events)."""
        start, end = self.cupy.cuda.Event(), self.cupy.cuda.Event()
        start.record()
        for _ in range(number):
            self()
        end.record()
        end.synchronize()
        return self.cupy.cuda.get_elapsed_time(start, end) / 1e3 / number

    def synchronize(self) -> None:
        self.cupy.cuda.Device().synchronize()


class LibraryCandidate:
    """An LLVM candidate: its shared library run through TVM's runtime on CPU tensors."""

    def __init__(self, directory: Path, entry: dict, args: dict[str, torch.Tensor]):
        import tvm

        module = tvm.runtime.load_module(str(directory / entry["library"]))
        self.function = module[entry.get("function", "deform_conv2d")]
        # A workspace the candidate lays out otherwise (the same elements) is viewed so.
        shapes = entry.get("shapes", {})
        self.values = [
            value.view(shapes[name])
            if list(shapes.get(name, value.shape)) != list(value.shape)
            else value
            for name, value in args.items()
        ]

    def __call__(self) -> None:
        self.function(*self.values)

    def seconds(self, number: int) -> float:
        started = time.perf_counter()
        for _ in range(number):
            self()
        return (time.perf_counter() - started) / number

    def synchronize(self) -> None:
        pass


def time_candidate(candidate, min_ms: float, repeats: int) -> list[float]:
    """Seconds per call, ``repeats`` times, each over enough calls to last ``min_ms``."""
    candidate()
    candidate.synchronize()
    once = candidate.seconds(1)
    number = max(1, math.ceil(min_ms / 1e3 / max(once, 1e-7)))
    return [candidate.seconds(number) for _ in range(repeats)]


def context_lost(cuda: bool) -> bool:
    """Whether the CUDA context is unusable (a sticky error: every CUDA call now fails)."""
    if not cuda:
        return False
    try:
        torch.cuda.synchronize()
    except RuntimeError:
        return True
    return False


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-300))


def unpack(path: Path, directory: Path) -> Path:
    """The round packed at ``path`` (a tar), unpacked into ``directory``: its round's
    directory."""
    with tarfile.open(path) as archive:
        archive.extractall(
            directory, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {})
        )
    (found,) = [p for p in directory.iterdir() if p.is_dir()]
    return found


def main(argv: list[str] | None = None) -> int:
    """Time the round (see the module docstring); the exit status: 0, or ``CONTEXT_LOST``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "round", type=Path, help="the round: its directory (round.json and builds), or packed"
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, appended")
    parser.add_argument("--deadline", type=float, default=480.0, help="seconds, then stop")
    parser.add_argument("--min-ms", type=float, default=20.0, help="milliseconds per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args(argv)
    if options.round.is_dir():
        return _time_round(options, options.round)
    with tempfile.TemporaryDirectory(prefix="round-") as directory:
        return _time_round(options, unpack(options.round, Path(directory)))


def _time_round(options: argparse.Namespace, round_dir: Path) -> int:
    # A restart (see the module docstring) counts the deadline from the first start.
    started = float(os.environ.get(STARTED, time.time()))
    description = json.loads((round_dir / "round.json").read_text())
    cuda = description["kind"] == "cuda"
    device = "cuda" if cuda else "cpu"
    done = set()
    if options.out.exists():
        for line in options.out.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                done.add((entry["workload"], entry["id"]))
    untimed = 0
    machine = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    with options.out.open("a") as out:
        for name, workload in description["workloads"].items():
            if all((name, e["id"]) in done or "error" in e for e in workload["candidates"]):
                continue
            args = inputs(workload, device)
            expected = reference(workload, args)
            zeroed = [args[a["name"]] for a in workload["args"] if a["name"] not in INPUTS]
            tolerance = TOLERANCE[workload["shape"]["dtype"]]
            for entry in workload["candidates"]:
                if (name, entry["id"]) in done or "error" in entry:
                    continue
                if time.time() - started > options.deadline:
                    untimed += 1
                    continue
                line = {"workload": name, "id": entry["id"], "device": machine}
                try:
                    for tensor in zeroed:
                        tensor.zero_()
                    kind = CudaCandidate if cuda else LibraryCandidate
                    candidate = kind(round_dir, entry, dict(args))
                    candidate()
                    candidate.synchronize()
                    for buffer, value in expected.items():
                        error = relative_error(args[buffer], value)
                        if not error <= tolerance:
                            raise ValueError(f"{buffer} differs from torchvision's: {error:.3g}")
                    line["run_secs"] = time_candidate(candidate, options.min_ms, options.repeats)
                except Exception as failure:  # noqa: BLE001 - recorded, the next one runs
                    line["error"] = f"{type(failure).__name__}: {failure}"[:500]
                out.write(json.dumps(line) + "\n")
                out.flush()
                if "error" in line and context_lost(cuda):
                    print(f"{name} {entry['id']} left the CUDA context unusable", flush=True)
                    return CONTEXT_LOST
    total = sum(len(w["candidates"]) for w in description["workloads"].values())
    print(
        f"timed {total - untimed} of {total} candidates in {time.time() - started:.0f} s"
        + (f"; {untimed} left untimed at the deadline" if untimed else ""),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault(STARTED, repr(time.time()))
    status = main()
    if status == CONTEXT_LOST:  # a fresh process, a fresh context: go on where this one stopped
        os.execv(sys.executable, [sys.executable, *sys.argv])
    sys.exit(status)
