"""Backward kernels compiled ahead, on a thread of their own (build and dispatch layer).

In a training step every forward call comes before the first backward call. A layer's first
forward call under autograd therefore starts compiling (or loading) the backward kernels its
backward will ask for, on one background thread, while the forward goes on: from an empty kernel
cache, the backward kernels of R50-DCNv2 took about 11 s to compile one after the other in its
first step, and with the forward's calls starting them the step took 9.1-9.6 s instead of
14.4-14.6 s (Intel Xeon ``emeraldrapids``, 2 cores, three runs each, ``lab/first_step.py``). The
backward takes the kernels through the usual lookup
(:func:`tvm_deform.runtime.kernels.get_backward`), which waits for a compile the thread has
started and compiles what the thread has not reached yet itself.

Only CPU kernels for any size are prepared so: their choice involves no timing (a measured
dispatch on a thread would disturb, and be disturbed by, the forward). On a GPU the backward
compiles its kernels when it runs, as before: preparing them on a thread has not been tried on a
GPU machine. ``TVM_DEFORM_PREPARE_BACKWARD=0`` turns it off. At exit the thread finishes the
compile it is running, if any, and drops the rest.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
from collections.abc import Callable

from tvm.target import Target

from tvm_deform import env
from tvm_deform.ir import definition
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels

__all__ = ["prepare_backward", "wait"]

log = logging.getLogger(__name__)


class _Worker:
    """One daemon thread that runs jobs in order. At interpreter exit it finishes the job it is
    running and drops the queued ones (a daemon thread stopped inside the compiler could crash
    the exit)."""

    def __init__(self) -> None:
        self._jobs: collections.deque[Callable[[], object]] = collections.deque()
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self._stopping = False

    def submit(self, job: Callable[[], object]) -> None:
        with self._condition:
            if self._stopping:
                return
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="tvm_deform backward preparation", daemon=True
                )
                self._thread.start()
            self._condition.notify_all()

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._jobs and not self._stopping:
                    self._condition.wait()
                if self._stopping:
                    return
                job = self._jobs.popleft()
                self._running = True
            try:
                job()
            except Exception:  # noqa: BLE001 - the backward itself compiles again and raises
                log.debug("preparing backward kernels failed", exc_info=True)
            finally:
                with self._condition:
                    self._running = False
                    self._condition.notify_all()

    def wait(self) -> None:
        """Until no job is queued or running."""
        with self._condition:
            while self._jobs or self._running:
                self._condition.wait()

    def stop(self) -> None:
        """Drop the queued jobs and wait for the running one to end."""
        with self._condition:
            self._stopping = True
            self._jobs.clear()
            self._condition.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()


_worker = _Worker()
#: (layer, gradients, target) already handed to the worker
_prepared: set[tuple] = set()
_lock = threading.Lock()


def prepare_backward(shape: ConvShape, target: Target, gradients: definition.Gradients) -> None:
    """Start compiling or loading the backward kernels of ``shape`` that compute ``gradients``
    on the background thread, unless they are prepared already or are not CPU kernels for any
    size (see the module docstring). Returns at once."""
    wanted = gradients.input or gradients.sampling or gradients.weight
    if target.kind.name != "llvm" or not wanted or not env.prepare_backward_enabled():
        return
    key = (shape, gradients, str(target), os.environ.get("TVM_DEFORM_SIZES"))
    with _lock:
        if key in _prepared:
            return
        _prepared.add(key)
    tuned = env.tuned_enabled()
    every = gradients == definition.ALL_GRADIENTS
    if shape.batch == 0 or not kernels.any_size(shape, target, tuned and every, op="backward"):
        return
    # tuned=None, as the backward's own call: TVM_DEFORM_TUNED is part of the memoised key.
    _worker.submit(lambda: kernels.get_backward(shape, target, None, gradients))


def wait() -> None:
    """Wait until the background thread has nothing queued or running (for tests and
    benchmarks that must not overlap with it)."""
    _worker.wait()


def _stop() -> None:
    _worker.stop()


def _after_fork_in_child() -> None:
    # The thread is not in the child: start afresh.
    global _worker, _lock
    _worker = _Worker()
    _lock = threading.Lock()
    _prepared.clear()


atexit.register(_stop)
os.register_at_fork(after_in_child=_after_fork_in_child)
