"""The on-disk kernel cache: bounded with least-recently-used eviction, one compile for two
processes, not used where others can write, truncated or foreign files rebuilt, the command."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
from conftest import assert_close
from reference import deform_conv2d_reference

from tvm_deform import deform_conv2d, env
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import diskcache, kernels, targets
from tvm_deform.runtime.inputs import conv_kwargs, random_inputs
from tvm_deform.tools.cli import main

#: small layers that compile in well under a second each
SHAPES = [ConvShape(1, 4, 6, 6, 4, 3, 3, pad_h=1, pad_w=1, has_bias=b) for b in (False, True)]
SHAPES.append(ConvShape(1, 4, 6, 7, 4, 3, 3, pad_h=1, pad_w=1))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty private cache directory, and no kernel remembered in memory."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("TVM_DEFORM_CACHE_DIR", str(directory))
    monkeypatch.setenv("TVM_DEFORM_TUNED", "0")
    # A kernel per size, so that each of SHAPES has a file of its own.
    monkeypatch.setenv("TVM_DEFORM_SIZES", "static")
    kernels.clear_memory_cache()
    yield directory
    kernels.clear_memory_cache()


def check(shape: ConvShape) -> None:
    """The op on ``shape`` against the float64 reference."""
    args = random_inputs(shape)
    tensors = [args[name] for name in ("input", "offset", "weight", "bias")]
    kwargs = conv_kwargs(shape) | {"mask": args["mask"]}
    assert_close(
        deform_conv2d(*tensors, **kwargs), deform_conv2d_reference(*tensors, **kwargs), 1e-6
    )


def kernel_file(shape: ConvShape) -> Path:
    return kernels.cache_path(shape, targets.host_target())


@pytest.mark.parametrize(
    "setting",
    [
        "TVM_DEFORM_LOGS",
        "XDG_DATA_HOME",
        "TVM_DEFORM_SIZES",
        "TVM_DEFORM_LAUNCHER",
        "TVM_DEFORM_MEASURE",
        "TVM_DEFORM_TUNED",
    ],
)
def test_a_kernel_in_memory_is_loaded_again_when_a_setting_changes(setting, monkeypatch):
    """A kernel remembered in memory under one value of a setting that chooses kernels (the
    logs, the sizes, the thread pool, timing records, tuning) is not what the process runs
    after the setting changes: it is loaded again, and again remembered."""
    loads = []
    key = ("test", setting)
    monkeypatch.setenv(setting, "0")
    try:
        for value in ("0", "0", "1", "1", "0"):
            monkeypatch.setenv(setting, value)
            kernels._memoised(key, lambda value=value: loads.append(value) or len(loads))
    finally:
        kernels.clear_memory_cache()
    assert loads == ["0", "1"]


def test_a_snapshot_follows_the_environment(monkeypatch):
    """The values a memoised key holds change whenever a variable is set, changed or unset
    through ``os.environ``, and equal for equal settings; with ``os.environ`` replaced by
    another mapping, they are read from that one."""
    snapshot = env.Snapshot("TVM_DEFORM_TEST_A", "TVM_DEFORM_TEST_B")
    monkeypatch.delenv("TVM_DEFORM_TEST_A", raising=False)
    monkeypatch.delenv("TVM_DEFORM_TEST_B", raising=False)
    unset = snapshot.values()
    assert unset == (None, None)
    monkeypatch.setenv("TVM_DEFORM_TEST_B", "1")
    one = snapshot.values()
    monkeypatch.setenv("TVM_DEFORM_TEST_B", "2")
    two = snapshot.values()
    assert len({unset, one, two}) == 3 and one[0] is None
    monkeypatch.setenv("TVM_DEFORM_TEST_B", "1")
    assert snapshot.values() == one
    monkeypatch.delenv("TVM_DEFORM_TEST_B")
    assert snapshot.values() == unset
    monkeypatch.setattr(os, "environ", {"TVM_DEFORM_TEST_A": "x"})
    assert snapshot.values() == ("x", None)


def test_kernels_are_sealed_with_their_digest(cache_dir):
    check(SHAPES[0])
    path = kernel_file(SHAPES[0])
    assert path.is_file() and diskcache.verified(path)
    assert (path.parent / (path.name + diskcache.DIGEST)).read_text() == diskcache.digest_of(path)
    assert not path.stat().st_mode & 0o077  # private to the user


def test_the_size_limit_evicts_the_least_recently_used(cache_dir, monkeypatch):
    check(SHAPES[2])
    third = kernel_file(SHAPES[2])
    third_size = third.stat().st_size
    diskcache.remove(third)
    kernels.clear_memory_cache()
    for shape in SHAPES[:2]:
        check(shape)
    first, second = (kernel_file(s) for s in SHAPES[:2])
    old = time.time() - 100
    os.utime(second, (old, old))  # the second is now the least recently used
    kernels.clear_memory_cache()
    check(SHAPES[0])  # a load marks the first used
    # Room for two of the three: the third's write must evict one.
    limit = first.stat().st_size + max(second.stat().st_size, third_size)
    monkeypatch.setenv("TVM_DEFORM_CACHE_LIMIT", str(limit))
    check(SHAPES[2])  # its write takes the cache over the limit
    assert first.exists() and kernel_file(SHAPES[2]).exists()
    assert not second.exists() and not (second.parent / (second.name + diskcache.DIGEST)).exists()
    assert sum(e.size for e in diskcache.entries()) <= limit


def test_a_truncated_or_foreign_kernel_is_rebuilt_not_loaded(cache_dir):
    check(SHAPES[0])
    path = kernel_file(SHAPES[0])
    whole = path.read_bytes()
    for damaged in (whole[:1000], b"\x7fELF not a kernel of ours"):
        # A new file in its place (the loaded library's mapping keeps the old one's pages).
        replacement = path.with_name("replacement")
        replacement.write_bytes(damaged)
        os.replace(replacement, path)
        kernels.clear_memory_cache()
        with pytest.warns(RuntimeWarning, match="rebuilding kernel cache entry"):
            check(SHAPES[0])
        assert diskcache.verified(path)


def test_a_directory_others_can_write_to_is_not_used(cache_dir):
    cache_dir.mkdir(mode=0o777)
    os.chmod(cache_dir, 0o777)
    diskcache._warn_once.cache_clear()
    with pytest.warns(RuntimeWarning, match="others can write to it"):
        check(SHAPES[0])
    assert not list(cache_dir.iterdir())  # nothing written there, the op still ran
    kernels.clear_memory_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, not one a kernel
        check(SHAPES[1])


@pytest.mark.slow
def test_two_processes_compiling_one_kernel_leave_one_good_file(cache_dir, tmp_path):
    # Both start together (they wait for a file); the lock lets one compile while the other
    # waits, then loads what the first wrote.
    go = tmp_path / "go"
    script = textwrap.dedent(f"""
        import logging, sys, time
        from pathlib import Path
        import torch
        from tvm_deform import deform_conv2d
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        torch.manual_seed(0)
        x = torch.rand(1, 5, 9, 9)
        offset, weight = torch.rand(1, 18, 9, 9), torch.rand(3, 5, 3, 3)
        while not Path({str(go)!r}).exists():
            time.sleep(0.01)
        out = deform_conv2d(x, offset, weight, padding=1)
        print("sum", float(out.double().sum()))
    """)
    env = os.environ | {"TVM_DEFORM_CACHE_DIR": str(cache_dir), "TVM_DEFORM_TUNED": "0"}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    time.sleep(3)  # both imported and waiting
    go.touch()
    results = [run.communicate(timeout=300) for run in runs]
    assert all(run.returncode == 0 for run in runs), results
    compiled = [err.count("compiled the ") for _, err in results]
    assert sorted(compiled) == [0, 1], results  # one compiled, the other loaded its file
    sums = {out.split("sum")[-1].strip() for out, _ in results}
    assert len(sums) == 1
    files = list(cache_dir.glob(diskcache.KERNELS))
    assert len(files) == 1 and diskcache.verified(files[0])


def test_the_cache_command_shows_and_clears(cache_dir, capsys):
    check(SHAPES[0])
    assert main(["cache"]) == 0
    shown = capsys.readouterr().out
    assert str(cache_dir) in shown and "kernels:       1," in shown
    assert main(["cache", "--clear"]) == 0
    assert "removed" in capsys.readouterr().out
    assert not diskcache.entries()
    kernels.clear_memory_cache()
    check(SHAPES[0])  # and the op still runs, compiling again
    assert len(diskcache.entries()) == 1


WARM_START = """
import sys, time
import torch
from tvm_deform import deform_conv2d
from tvm_deform.ir import definition
from tvm_deform.runtime import records

def forbidden(*args, **kwargs):
    raise AssertionError("the warm path built a PrimFunc or opened a tuning database")

if sys.argv[1] == "warm":
    for name in ("forward", "backward", "grad_input"):
        setattr(definition, name, forbidden)
    records.open_database = forbidden
torch.manual_seed(0)
x = torch.rand(1, 8, 12, 12, requires_grad=True)
offset = torch.rand(1, 18, 12, 12, requires_grad=True)
weight = torch.rand(8, 8, 3, 3, requires_grad=True)
mask = torch.rand(1, 9, 12, 12, requires_grad=True)
begin = time.perf_counter()
out = deform_conv2d(x, offset, weight, padding=1, mask=mask)
out.sum().backward()
print("first call ms", (time.perf_counter() - begin) * 1e3)
print("sum", float(out.double().sum()), float(x.grad.double().sum()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("sizes", ["any", "static"])
def test_a_warm_process_finds_its_kernels_without_a_primfunc_or_a_database(cache_dir, sizes):
    # The first process compiles (with the shipped logs looked at); the second finds the same
    # kernels (the forward's for any size, or for this size through the index, and the
    # backward's through the index), with the definition and the databases made to raise.
    env = os.environ | {"TVM_DEFORM_CACHE_DIR": str(cache_dir), "TVM_DEFORM_SIZES": sizes}
    env.pop("TVM_DEFORM_TUNED", None)
    outputs = []
    for mode in ("cold", "warm"):
        run = subprocess.run(
            [sys.executable, "-c", WARM_START, mode], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr[-3000:]
        outputs.append(run.stdout.split("sum")[-1])
    assert outputs[0] == outputs[1]
    # Kernels for any size are found by their layer alone; per-size ones through the index.
    assert (cache_dir / "index.json").is_file() == (sizes == "static")
