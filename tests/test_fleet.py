"""Tuning on a fleet, on loopback: a tracker and two ``tvm-deform serve`` servers on 127.0.0.1,
candidates built here and measured on both; a server killed mid-run; cross-compiled builds."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time

import pytest
from conftest import assert_close
from reference import deform_conv2d_reference

from tvm_deform import deform_conv2d
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import dispatch, kernels, records, targets
from tvm_deform.runtime.inputs import conv_kwargs, random_inputs
from tvm_deform.tools.fleet import Fleet, local_fleet
from tvm_deform.tools.tuning import trial_history, tune

SHAPE = ConvShape(1, 16, 12, 12, 16, 3, 3, pad_h=1, pad_w=1, has_bias=True)
TRIALS = 6


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_lookups")]


@pytest.fixture(scope="module")
def fleet_run(tmp_path_factory):
    """Tune SHAPE for a few trials through a tracker and two servers; the processes are
    stopped before the tests look at the results."""
    root = tmp_path_factory.mktemp("fleet")
    lines: list[str] = []
    begin = time.monotonic()
    with local_fleet(2, root / "processes") as started:
        results = tune(
            {"small": SHAPE},
            TRIALS,
            root / "work",
            ["handwritten"],
            logs_dir=root / "logs",
            progress=lambda line: lines.append(f"{time.monotonic() - begin:.1f} {line}"),
            transfer=False,
            fleet=started.fleet,
        )
        measured = [started.server_log(i).count("load_module") for i in range(2)]
    processes = [started.tracker, *started.servers]
    return results, measured, root, lines, processes


def test_both_servers_measured(fleet_run):
    _, measured, *_ = fleet_run
    assert all(count > 0 for count in measured), measured


def test_records_land_under_the_devices_key(fleet_run):
    (result,), _, root, lines, _ = fleet_run
    key = targets.hardware_key(targets.host_target())  # loopback: the device is this machine
    history = trial_history(root / "work" / key / "handwritten", SHAPE)
    assert len(history) >= result.trials > 0
    manifest = json.loads((root / "logs" / key / "manifest.json").read_text())
    assert manifest["workloads"]["small"]["handwritten"]["best_ms"] > 0
    assert "cores" in manifest["cpu"]  # the device described itself over RPC
    assert any("2 server(s)" in line for line in lines)
    # The choice between records and default is left to dispatch on the device.
    assert not (root / "logs" / key / records.LOGS_DECISIONS).exists()


def test_dispatch_uses_the_fleets_records(fleet_run, monkeypatch):
    *_, root, _, _ = fleet_run
    monkeypatch.setenv("TVM_DEFORM_LOGS", str(root / "logs"))
    target = targets.host_target()
    own = records.own_records(SHAPE, target, targets.hardware_key(target))
    assert {r.space for r in own} == {"handwritten", "default"}
    assert all(r.directory.is_relative_to(root / "logs") for r in own)
    assert kernels.resolve(SHAPE, target) == dispatch.choose_own(SHAPE, "forward", own)
    inputs = random_inputs(SHAPE)
    args = (inputs["input"], inputs["offset"], inputs["weight"], inputs["bias"])
    kwargs = conv_kwargs(SHAPE) | dict(mask=inputs["mask"])
    expected = deform_conv2d_reference(*args, **kwargs)
    assert_close(deform_conv2d(*args, **kwargs), expected, 1e-6)


def test_every_process_is_stopped(fleet_run):
    *_, processes = fleet_run
    assert all(p.returncode is not None for p in processes)


def test_a_server_killed_mid_run_loses_nothing(tmp_path):
    work = tmp_path / "work"
    key = targets.hardware_key(targets.host_target())
    done: list = []
    with local_fleet(2, tmp_path / "processes") as started:

        def run():
            done.append(
                tune(
                    {"small": SHAPE},
                    TRIALS,
                    work,
                    ["handwritten"],
                    progress=lambda *_: None,
                    measure_default=False,
                    transfer=False,
                    fleet=started.fleet,
                )
            )

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 300
        while "load_module" not in started.server_log(0) and time.monotonic() < deadline:
            time.sleep(0.05)
        started.kill_server(0)  # while it measures its first candidate
        killed_at = started.server_log(1).count("load_module")
        thread.join(timeout=600)
        assert not thread.is_alive()
        after = started.server_log(1).count("load_module")
    (result,) = done[0]
    history = trial_history(work / key / "handwritten", SHAPE)
    # Every candidate has its record (the one measured on the dead server as a failed run),
    # and the survivor measured the rest.
    assert len(history) == TRIALS
    assert result.trials >= TRIALS - 1
    assert after > killed_at


def test_fleet_address_is_checked():
    with pytest.raises(ValueError, match="HOST:PORT"):
        Fleet.parse("localhost", "rack")
    with pytest.raises(ValueError, match="device key"):
        Fleet.parse("localhost:9190", "")


def test_build_writes_object_files_for_another_architecture(tmp_path):
    target = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-v2", "num-cores": 4}
    shape = json.dumps(dataclasses.asdict(SHAPE))
    command = [sys.executable, "-m", "tvm_deform.tools.cli", "build", "--target"]
    command += [json.dumps(target), "--shape", shape]
    subprocess.run(command + ["--out", str(tmp_path)], check=True, capture_output=True)
    objects = sorted(tmp_path.glob("*.o"))
    assert [p.name for p in objects] == [
        "shape-backward-llvm_neoverse-v2.o",
        "shape-forward-llvm_neoverse-v2.o",
    ]
    for path in objects:
        header = path.read_bytes()[:20]
        assert header[:4] == b"\x7fELF"
        assert int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64
