"""Tuning on a fleet (tools layer): this machine builds, devices registered with TVM's RPC
tracker measure.

The engine is TVM's own: ``python -m tvm.exec.rpc_tracker`` schedules sessions among the
servers registered under a device key, and MetaSchedule's ``RPCRunner`` asks it for one session
per candidate, with one worker per server so that every server measures at once. A server that
dies is dropped by the tracker; the candidate it was measuring comes back as a failed run and
the next ones go to the servers left.

A device is one of these servers:

- ``tvm-deform serve --tracker HOST:PORT --key KEY`` (TVM's server, plus a function that
  reports the device's target, detected there from its CPU flags as ``tvm-deform info`` does);
- or TVM's plain ``python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY``, whose target
  is then read from LLVM's view of its CPU (``target.llvm_get_system_cpu`` and the triple) over
  RPC; ``--target`` overrides either.

Candidates travel as TVM's object tar: the device links them with its own compiler (``cc``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tvm import rpc
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

#: the global function a ``tvm-deform serve`` device answers its target with
DEVICE_FUNCTION = "tvm_deform.device"
#: seconds one candidate's measurement may take on a device (session, upload, link and runs)
SESSION_TIMEOUT_SEC = 120


@dataclasses.dataclass(frozen=True)
class Fleet:
    """The devices registered under ``key`` with the RPC tracker at ``host:port``."""

    host: str
    port: int
    key: str
    session_timeout_sec: int = SESSION_TIMEOUT_SEC

    @classmethod
    def parse(cls, address: str, key: str) -> Fleet:
        """``Fleet.parse("127.0.0.1:9190", "rack")``."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"an RPC tracker address looks like HOST:PORT, got {address!r}")
        if not key:
            raise ValueError("a device key is needed to pick the tracker's servers")
        return cls(host, int(port), key)

    def __str__(self) -> str:
        return f"{self.key}@{self.host}:{self.port}"

    def rpc_config(self) -> ms.runner.RPCConfig:
        return ms.runner.RPCConfig(
            tracker_host=self.host,
            tracker_port=self.port,
            tracker_key=self.key,
            session_timeout_sec=self.session_timeout_sec,
        )

    def servers(self) -> int:
        """How many servers are registered under the key now (free or busy)."""
        summary = rpc.connect_tracker(self.host, self.port).summary()
        # A server's entry in the summary is keyed "server:<device key>".
        return sum(1 for s in summary["server_info"] if s.get("key") == f"server:{self.key}")

    def wait_for(self, servers: int, timeout: float = 120.0) -> None:
        """Block until the tracker answers and at least ``servers`` servers are registered
        under the key."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.servers() >= servers:
                    return
            except (ConnectionError, OSError, RuntimeError):
                pass  # the tracker is still starting
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {servers} server(s) registered as {self}")
            time.sleep(0.2)

    def runner(self) -> ms.runner.RPCRunner:
        """MetaSchedule's runner with one worker per registered server."""
        workers = self.servers()
        if workers == 0:
            raise RuntimeError(f"no server is registered as {self}")
        return ms.runner.RPCRunner(rpc_config=self.rpc_config(), max_workers=workers)

    def device(self) -> tuple[Target, str]:
        """One device's target and a description of its CPU, asked over RPC."""
        session = rpc.connect_tracker(self.host, self.port).request(
            self.key, session_timeout=self.session_timeout_sec
        )
        try:
            reply = json.loads(session.get_function(DEVICE_FUNCTION)())
            return Target(json.loads(reply["target"])), reply["cpu"]
        except (AttributeError, RuntimeError, ValueError):
            pass  # a plain TVM server: ask its LLVM
        from tvm_deform.runtime import hardware

        cpu = str(session.get_function("target.llvm_get_system_cpu")())
        reported = str(session.get_function("target.llvm_get_system_triple")())
        # The TVM wheel's LLVM reports its build machine's triple (e.g. x86_64-conda-linux-gnu):
        # keep its architecture and system, as the host target does.
        system = "Darwin" if "darwin" in reported else "Linux"
        triple = hardware.triple(reported.split("-")[0], system)
        cores = int(session.get_function("runtime.NumThreads")())
        attrs = {"kind": "llvm", "mcpu": cpu, "mtriple": triple, "num-cores": cores}
        return Target(attrs), f"{cpu} ({triple}), as its LLVM sees it"


def describe_device() -> str:
    """This machine's target and CPU, as JSON (what a ``tvm-deform serve`` device answers)."""
    from tvm_deform.runtime import hardware, targets

    cpu = hardware.detect()
    return json.dumps(
        {
            "target": str(targets.host_target()),
            "cpu": f"{cpu.model} ({cpu.isa}, {cpu.cores} cores)",
        }
    )


def _register_device_function() -> None:
    import tvm_ffi

    tvm_ffi.register_global_func(DEVICE_FUNCTION, describe_device, override=True)


def serve(
    tracker: str, key: str, host: str = "0.0.0.0", port: int = 9090, port_end: int = 9199
) -> None:
    """Run an RPC server registered under ``key`` with ``tracker`` until killed."""
    fleet = Fleet.parse(tracker, key)
    server = rpc.Server(
        host,
        port,
        port_end,
        key=key,
        tracker_addr=(fleet.host, fleet.port),
        server_init_callback=_register_device_function,
    )
    print(f"serving as {fleet} on port {server.port}", flush=True)
    server.proc.join()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


@dataclasses.dataclass
class LocalFleet:
    """A tracker and servers started on this machine (for tests and throughput runs)."""

    fleet: Fleet
    tracker: subprocess.Popen
    servers: list[subprocess.Popen]
    log_dir: Path

    def server_log(self, index: int) -> str:
        return (self.log_dir / f"server{index}.log").read_text()

    def kill_server(self, index: int) -> None:
        stop(self.servers[index])


def stop(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """Kill ``process`` and everything in its session (the server's own workers), waiting at
    most ``timeout`` seconds."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout)


@contextlib.contextmanager
def local_fleet(
    servers: int,
    log_dir: Path,
    key: str = "local",
    cores: Sequence[Sequence[int]] | None = None,
) -> Iterator[LocalFleet]:
    """Start a tracker and ``servers`` ``tvm-deform serve`` servers on 127.0.0.1, wait until
    all are registered, and stop them all on exit. ``cores[i]``, if given, pins server ``i`` to
    those cores, with a TVM thread pool of that size (a device of that many cores)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    host = "127.0.0.1"
    port = free_port(host)
    started: list[subprocess.Popen] = []

    def start(command: list[str], log: str, env: dict | None = None) -> subprocess.Popen:
        with open(log_dir / log, "w") as output:
            process = subprocess.Popen(
                command,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        started.append(process)
        return process

    try:
        tracker = start(
            [sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", host]
            + ["--port", str(port), "--port-end", str(port + 1)],
            "tracker.log",
        )
        fleet = Fleet(host, port, key)
        fleet.wait_for(0)  # the tracker answers (servers started earlier would retry for 5 s)
        processes = []
        for index in range(servers):
            command = [sys.executable, "-m", "tvm_deform.tools.cli", "serve"]
            command += ["--tracker", f"{host}:{port}", "--key", key, "--host", host]
            server_port = free_port(host)
            command += ["--port", str(server_port), "--port-end", str(server_port + 1)]
            env = None
            if cores is not None:
                pinned = [str(c) for c in cores[index]]
                command = ["taskset", "-c", ",".join(pinned), *command]
                env = {"TVM_NUM_THREADS": str(len(pinned))}
            processes.append(start(command, f"server{index}.log", env))
        fleet.wait_for(servers)
        yield LocalFleet(fleet, tracker, processes, log_dir)
    finally:
        for process in reversed(started):
            stop(process)
