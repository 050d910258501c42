"""Kernels: compilation, the kernel caches and the per-thread settings of the CPU thread pool.

A kernel is compiled the first time a shape is seen, exported as a shared library into the
on-disk cache so the next process loads it instead of compiling, loaded from that file (so that
its parallel loops can run on torch's threads, see :mod:`tvm_deform.runtime.launcher`) and kept in
memory
for the process. The disk cache key covers the workload, the target, the TVM and package
versions, the thread pool and a digest of the definition and schedule sources, so a change to
any of them misses the cache instead of loading a stale kernel.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import importlib
import inspect
import json
import logging
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

# TVM's thread variables are set by tvm_deform.env, which the package's __init__ imports before
# any module that imports TVM.
import tvm
from tvm import s_tir
from tvm.target import Target

from tvm_deform import __version__, env, schedules
from tvm_deform.ir import definition
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import diskcache, hardware, launcher, records, workspace
from tvm_deform.runtime.targets import (
    CUDA_COMPILE_CONFIG,
    compile_settings,
    compiling,
    hardware_key,
    host_target,
    workload_key,
)

Kernel = Callable[..., None]

#: compiles are logged at INFO (the ``tvm-deform`` commands show them, as progress): a first
#: call of a new layer takes seconds
log = logging.getLogger(__name__)


class BackwardKernels(NamedTuple):
    """The two compiled backward kernels of one shape, run in this order."""

    #: ``deform_conv2d_backward``: every gradient asked for but the input's, and the workspaces
    gradients: Kernel
    #: ``deform_conv2d_grad_input``: the input's gradient, from those workspaces (None when the
    #: input's gradient is not asked for)
    grad_input: Kernel | None
    #: how the kernels pad the pixels of their workspaces (see
    #: :func:`tvm_deform.ir.definition.backward_buffer_shapes`): to this quantum, and always
    #: (kernels for any size) or only past one quantum
    quantum: int = definition.PIXEL_QUANTUM
    any_size: bool = False
    #: whether the column gradient workspace is laid out ``[n, p, k * channels + c]`` rather
    #: than ``[n, c, k, p]`` (see :func:`tvm_deform.schedules.channels_last_columns`)
    channels_last_columns: bool = False


@functools.cache
def source_digest() -> str:
    """Digest of the sources that decide what a kernel computes and how it is scheduled, and
    of the options it compiles with."""
    digest = hashlib.sha256()
    for package in (definition, schedules):
        for source in sorted(Path(inspect.getfile(package)).parent.glob("*.py")):
            digest.update(source.read_bytes())
    digest.update(repr(sorted(CUDA_COMPILE_CONFIG.items())).encode())
    return digest.hexdigest()[:16]


def cache_path(
    shape: ConvShape, target: Target, schedule: str = "default", op: str = "forward"
) -> Path:
    """Where the on-disk cache keeps the ``op`` ("forward" or "backward") kernel of ``shape``
    for ``target``, compiled with ``schedule`` ("default", or a tuned record's identity)."""
    # Kernels on TVM's pool and on torch's threads are separate files: a file loaded twice is one
    # library with one launch variable, which the two would otherwise fight over. The setting
    # names the file (a process whose launcher cannot be built runs them all on TVM's pool), so
    # that the launcher can build while the first kernel compiles.
    pool = "torch" if target.kind.name == "llvm" and env.launcher_enabled() else "tvm"
    text = "\n".join(
        (
            workload_key(shape, target),
            schedule,
            tvm.__version__,
            __version__,
            source_digest(),
            f"pool {pool}",
        )
    )
    settings = compile_settings(target)  # on CUDA: ptxas's register level, fast math
    if settings:
        text += f"\n{settings}"
    if op != "forward":
        text += f"\n{op}"
    name = hashlib.sha256(text.encode()).hexdigest()[:32]
    prefix = "deform_conv2d" if op == "forward" else f"deform_conv2d_{op}"
    return env.cache_dir() / f"{prefix}-{name}.so"


def resolve(
    shape: ConvShape, target: Target, tuned: bool | None = None, op: str = "forward"
) -> records.TunedRecord | None:
    """The tuned record ``shape``'s ``op`` runs with on ``target``, or None for the default
    schedule. ``tuned=None`` follows ``TVM_DEFORM_TUNED``; False always means the default.

    The logs of ``target``'s own hardware key decide: by the choice timed through the op at
    tuning time when they hold one, else by the tuner's measurements. Without them,
    the records of compatible machines are timed here against the default schedule (once per
    shape; the decision is kept on disk, see :mod:`tvm_deform.runtime.dispatch`), unless
    ``TVM_DEFORM_MEASURE=0``, which then runs the default."""
    if not (env.tuned_enabled() if tuned is None else tuned):
        return None
    key = hardware_key(target)
    from tvm_deform.runtime import (
        dispatch,  # times kernels through the op, which imports this module
    )

    own = records.own_records(shape, target, key, op)
    if own:
        chosen = dispatch.choose_own(shape, op, own)
        return chosen if _replays_this_layout(shape, target, op, chosen) else None
    candidates = records.foreign_records(shape, target, key, op)
    candidates = [r for r in candidates if _replays_this_layout(shape, target, op, r)]
    if not candidates or not env.measure_enabled():
        return None
    return dispatch.pick(shape, target, op, candidates)


def candidates(
    shape: ConvShape, target: Target, op: str = "forward"
) -> list[records.TunedRecord | None]:
    """Every schedule :func:`resolve` may give ``shape``'s ``op`` on ``target`` (None: the
    default), without timing any: the one this machine's own logs choose, or the default and
    each compatible machine's best record, which the first use times here."""
    if not env.tuned_enabled():
        return [None]
    key = hardware_key(target)
    from tvm_deform.runtime import dispatch

    own = records.own_records(shape, target, key, op)
    if own:
        chosen = dispatch.choose_own(shape, op, own)
        return [chosen if _replays_this_layout(shape, target, op, chosen) else None]
    if not env.measure_enabled():
        return [None]
    found = records.foreign_records(shape, target, key, op)
    return [None, *(r for r in found if _replays_this_layout(shape, target, op, r))]


def _replays_this_layout(
    shape: ConvShape, target: Target, op: str, record: records.TunedRecord | None
) -> bool:
    """Whether ``record`` (None: the default) may run ``shape``'s ``op`` on ``target``: a
    backward record tuned before the CPU's column gradient went channels-last replays the
    other layout (see :func:`compile_backward`), and is passed over."""
    if record is None or op != "backward":
        return True
    sch = records.tuned_schedule(shape, record, "backward")
    return _columns_channels_last(sch.mod["main"]) == schedules.channels_last_columns(shape, target)


def compile_candidates(
    shape: ConvShape,
    target: Target,
    op: str,
    layout: str = "NCHW",
    gradients: definition.Gradients = definition.ALL_GRADIENTS,
) -> None:
    """Compile into the disk cache every kernel a first call of ``shape``'s ``op`` ("forward"
    with its input in ``layout``, or "backward" computing ``gradients``) may run (see
    :func:`candidates`); for ahead-of-time compiling in parallel processes, which leaves the
    timing among them to the first use."""
    # Kernels for any size: the default's, and those replaying a tuned record, untimed (the
    # first use times them against each other, see class_records).
    tuned = env.tuned_enabled()
    if op == "forward" and any_size(shape, target, tuned, layout):
        _any_size_kernel(shape, target, layout)
        if tuned and layout == "NCHW":
            from tvm_deform.runtime import dispatch  # times kernels, imports this module

            for c, (size, record) in class_records(shape, target).items():
                noted = functools.partial(dispatch.replay_failed, size, target, op, record)
                _any_size_class(shape.any_size(), target, layout, c, record, noted)
        return
    if op == "forward" and layout != "NCHW":
        load_kernel(shape, target, None, layout)
        return
    every = gradients == definition.ALL_GRADIENTS
    if op == "backward" and any_size(shape, target, tuned and every, op=op):
        _any_size_backward(shape, target, gradients, tuned, decide=False)
        return
    if op == "backward" and not every:
        load_backward(shape, target, None, gradients)
        return
    for record in candidates(shape, target, op):
        if op == "forward":
            load_kernel(shape, target, record)
        else:
            load_backward(shape, target, record)


def default_schedule(
    shape: ConvShape,
    target: Target,
    op: str = "forward",
    gradients: definition.Gradients = definition.ALL_GRADIENTS,
    layout: str = "NCHW",
) -> s_tir.Schedule:
    """``shape``'s ``op`` PrimFunc ("forward" with its input in ``layout``, or "backward": the
    gradients kernel, computing ``gradients``) under the default schedule of ``target``'s
    kind."""
    if op == "forward":
        if layout != "NCHW" and target.kind.name == "cuda":
            raise NotImplementedError(f"no CUDA schedule for {layout} input")
        return schedules.forward_schedule(shape, target, layout)
    if op == "backward":
        func = definition.backward(shape, gradients)
    else:
        raise NotImplementedError(f"no {op} kernel")
    return schedules.apply_default(op, func, target)


def compile_kernel(
    shape: ConvShape,
    target: Target,
    record: records.TunedRecord | None = None,
    layout: str = "NCHW",
) -> tvm.runtime.Module:
    """Compile the forward kernel of ``shape`` for ``target`` and an input in ``layout``: with
    ``record``'s tuned schedule when given (records are of NCHW kernels), else with the
    default schedule."""
    if record is not None:
        if layout != "NCHW":
            raise ValueError("tuned records are of kernels that take an NCHW input")
        sch = records.tuned_schedule(shape, record)
    else:
        sch = default_schedule(shape, target, layout=layout)
    return compile_schedule(sch, target)


def compile_schedule(sch: s_tir.Schedule, target: Target) -> tvm.runtime.Module:
    """Compile the kernel ``sch`` holds for ``target``."""
    if target.kind.name == "cuda":
        # Registers TVM's CUDA compiler callback (NVRTC, or nvcc with TVM_CUDA_COMPILE_MODE).
        importlib.import_module("tvm.support.nvcc")
    with compiling(target) as target:
        return tvm.compile(sch.mod, target=target)


def compile_backward(
    shape: ConvShape,
    target: Target,
    record: records.TunedRecord | None = None,
    gradients: definition.Gradients = definition.ALL_GRADIENTS,
    quantum: int | None = None,
) -> tvm.runtime.Module:
    """Compile the backward kernels of ``shape`` for ``target`` that compute ``gradients``
    into one module: the gradients kernel with ``record``'s tuned schedule when given (records
    are of the kernel computing all gradients), else the default one; the input's gradient
    kernel, when the input's gradient is asked for, with its default schedule. With
    ``quantum``, the kernels for any size of ``shape``'s layer, their pixels padded to it."""
    sizes = "static" if quantum is None else "symbolic"
    quantum = quantum or definition.PIXEL_QUANTUM
    channels_last = _channels_last_columns(shape, target, gradients)
    # A GPU thread reads its pixel's offset and mask at a clamped index; a CPU's tiles read
    # them through stages padded to the quantum.
    staged = target.kind.name == "llvm"
    if record is not None:
        if gradients != definition.ALL_GRADIENTS:
            raise ValueError("tuned records are of the backward of every gradient")
        if sizes == "static":
            sch = records.tuned_schedule(shape, record, "backward")
        else:
            func = definition.backward(shape, gradients, sizes, quantum, staged_inputs=staged)
            tuned = record.record.workload.mod["main"]
            sch = schedules.replayed("backward", func, target, tuned, record.record.trace)
            if sch is None:
                raise ReplayError(f"{_record_name(record)} does not replay for any size")
        if _columns_channels_last(sch.mod["main"]) != channels_last:
            if sizes != "static":  # the caller falls back to the default, with a warning
                raise ValueError(f"{_record_name(record)} lays out the column gradient otherwise")
            warnings.warn(
                f"{_record_name(record)} of {shape} lays out the column gradient as an older "
                "version of tvm_deform did; the default schedule runs instead",
                RuntimeWarning,
                stacklevel=2,
            )
            sch = default_schedule(shape, target, "backward", gradients)
    elif sizes == "static":
        sch = default_schedule(shape, target, "backward", gradients)
    else:
        func = definition.backward(shape, gradients, sizes, quantum, staged_inputs=staged)
        sch = schedules.apply_default("backward", func, target)
    functions = {
        "deform_conv2d_backward": sch.mod["main"].with_attr(
            "global_symbol", "deform_conv2d_backward"
        )
    }
    cuda = target.kind.name == "cuda"
    if gradients.input:
        func = schedules.grad_input_definition(shape, target, sizes, quantum)
        functions["deform_conv2d_grad_input"] = schedules.apply_default(
            "grad_input", func, target
        ).mod["main"]
    if cuda:
        # Registers TVM's CUDA compiler callback (NVRTC, or nvcc with TVM_CUDA_COMPILE_MODE).
        importlib.import_module("tvm.support.nvcc")
    with compiling(target) as target:
        return tvm.compile(tvm.IRModule(functions), target=target)


def _columns_channels_last(func: tvm.tirx.PrimFunc) -> bool:
    """Whether the scheduled backward ``func`` takes its column gradient channels-last (the
    three dimensions of ``[n, p, k * channels + c]``)."""
    return any(str(p.name) == "grad_columns" and len(p.shape) == 3 for p in func.params)


def _load_cached(path: Path) -> tvm.runtime.Module | None:
    """The library at ``path`` if the cache wrote it whole (see :mod:`.diskcache`), loaded."""
    if not diskcache.verified(path):
        return None
    try:
        module = tvm.runtime.load_module(str(path))
    except Exception as error:  # noqa: BLE001 - any unreadable entry is rebuilt
        warnings.warn(f"rebuilding corrupt kernel cache entry {path}: {error}", stacklevel=3)
        diskcache.remove(path)
        return None
    diskcache.touch(path)
    return module


def _store_cached(module: tvm.runtime.Module, path: Path) -> None:
    """Write ``module`` to ``path`` atomically, sealed with its digest."""
    try:
        diskcache.store(path, module.export_library)
    except Exception as error:  # noqa: BLE001 - a cache that cannot be written is not fatal
        warnings.warn(f"could not write kernel cache entry {path}: {error}", stacklevel=3)


_memory: dict[tuple, Kernel | BackwardKernels] = {}


#: guards ``_memory`` and ``_loading``; held only for dictionary updates, never while compiling
_lock = threading.Lock()


#: one lock per kernel being loaded: threads that need the same new kernel wait for one compile,
#: threads that need other kernels do not wait at all
_loading: dict[tuple, threading.Lock] = {}


def get_kernel(
    shape: ConvShape,
    target: Target | None = None,
    tuned: bool | None = None,
    layout: str = "NCHW",
) -> Kernel:
    """The compiled forward kernel of ``shape`` for an input in ``layout``: from memory, from
    disk, or freshly compiled. An NCHW kernel runs with the tuned schedule the logs hold for it,
    else the default one (``tuned`` as in :func:`resolve`); an NHWC kernel (channels_last input,
    CPU) runs its default schedule, which samples the input in place."""
    target = target or host_target()

    def load() -> Kernel:
        # ``TVM_DEFORM_TUNED`` is part of the memoised key (not read at every call).
        use_tuned = env.tuned_enabled() if tuned is None else tuned
        if target.kind.name == "llvm":
            launcher.prepare()  # built meanwhile, if this call compiles
        if any_size(shape, target, use_tuned, layout):
            return _any_size_kernel(shape, target, layout, use_tuned)
        op = "forward" if layout == "NCHW" else f"forward_{layout.lower()}"
        key = _index_key(op, shape, target, use_tuned and layout == "NCHW")
        module = _from_index(key)
        if module is not None:
            return module["deform_conv2d"]
        record = resolve(shape, target, use_tuned) if layout == "NCHW" else None
        kernel = load_kernel(shape, target, record, layout)
        _add_to_index(key, cache_path(shape, target, _schedule_name(record), op))
        return kernel

    return _memoised(("forward", shape, layout, _target_text(target), tuned), load)


def any_size(
    shape: ConvShape, target: Target, tuned: bool, layout: str = "NCHW", op: str = "forward"
) -> bool:
    """Whether ``shape``'s ``op`` ("forward" or "backward") runs kernels compiled for every
    size of its layer (batch, height and width symbolic), not for its own size: on CPUs, and
    on GPUs for an NCHW input, unless ``TVM_DEFORM_SIZES=static``, the call's buffers pass
    2^31 elements (int32 indices), or this machine's own tuning logs hold a record of exactly
    this shape that ran at least ``records.MIN_TUNED_GAIN`` faster than the default when tuned
    (``tuned``; see :func:`records.tuned_shapes`). Other
    machines' records do not count: timing them here at a size's first use takes seconds,
    which a stream of sizes would pay again and again (``TVM_DEFORM_SIZES=static`` times
    them, as before)."""
    kind = target.kind.name
    return (
        env.sizes() == "any"
        and (kind == "llvm" or (kind == "cuda" and layout == "NCHW"))
        and shape.largest_forward_buffer() <= definition.INT32_MAX
        and not (tuned and layout == "NCHW" and shape in records.tuned_shapes(target, op))
    )


def _any_size_kernel(shape: ConvShape, target: Target, layout: str, tuned: bool = False) -> Kernel:
    """The kernel of ``shape``'s layer for every size, in the variant for ``shape``'s map size
    (see :func:`tvm_deform.schedules.pixel_classes`), memoised by the layer: a call of a new
    size finds it in memory. A layer's first call loads the kernels of all its size classes,
    so that no later size compiles. With ``tuned``, a class that holds a size this machine's
    own logs tuned runs that record's schedule where it is faster (see
    :func:`class_records`)."""
    classes = schedules.pixel_classes(shape, target)
    layer = shape.any_size()

    def load() -> dict[int, Kernel]:
        # The classes compile at once, each on a thread of its own (TVM's compiler and LLVM
        # release the GIL), as many at a time as this process has cores.
        workers = min(len(classes), hardware.detect().cores)
        if workers == 1:
            found = {c: _any_size_class(layer, target, layout, c) for c in classes}
        else:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                built = pool.map(lambda c: _any_size_class(layer, target, layout, c), classes)
                found = dict(zip(classes, built, strict=True))
        if tuned and layout == "NCHW":
            from tvm_deform.runtime import dispatch  # times kernels, imports this module

            for c, (size, record) in class_records(shape, target, classes).items():
                noted = functools.partial(dispatch.replay_failed, size, target, "forward", record)
                replayed = _any_size_class(layer, target, layout, c, record, noted)
                if dispatch.replay_wins(size, target, "forward", record, replayed, found[c]):
                    found[c] = replayed
        return found

    found = _memoised(("forward_classes", layer, layout, _target_text(target), tuned), load)
    return found[_size_class(shape, classes)]


def class_records(
    shape: ConvShape, target: Target, classes: tuple[int, ...] | None = None
) -> dict[int, tuple[ConvShape, records.TunedRecord]]:
    """The tuned records that the forward kernels for any size of ``shape``'s layer may run, by
    size class (of ``classes``, default the layer's), each with the size it was tuned at: in a
    class that holds a size of the layer whose exact shape this machine's own logs hold a
    record of that ran at least ``records.MIN_TUNED_GAIN`` faster than the default
    (:func:`records.tuned_shapes`), the record they choose for it (as :func:`resolve` does
    from them; of the size with the most pixels where a class holds several). It is replayed
    on the PrimFunc for any size (:func:`tvm_deform.schedules.replayed_any_size_schedule`:
    its rule applied there with its choices, or its steps replayed), and the class runs it
    where it is faster than the default's kernel at the tuned size, timed here at the layer's
    first use (:func:`tvm_deform.runtime.dispatch.replay_wins`, kept on disk): tuning a layer
    at one size can then speed up the sizes near it too, not the tuned size alone (which runs
    its kernel for one size, see :func:`any_size`)."""
    classes = classes or schedules.pixel_classes(shape, target)
    found = {}
    for size in _tuned_sizes(shape, target, "forward"):
        record = _own_choice(size, target, "forward")
        if record is not None:
            found[_size_class(size, classes)] = (size, record)
    return found


def _tuned_sizes(shape: ConvShape, target: Target, op: str) -> list[ConvShape]:
    """The sizes of ``shape``'s layer whose ``op`` this machine's own logs tuned to at least
    ``records.MIN_TUNED_GAIN`` faster than the default, fewest pixels first."""
    layer = shape.any_size()
    return sorted(
        (s for s in records.tuned_shapes(target, op) if s.any_size() == layer),
        key=lambda s: (s.out_h * s.out_w, s.batch, s.height, s.width),
    )


def _own_choice(shape: ConvShape, target: Target, op: str) -> records.TunedRecord | None:
    """The record this machine's own logs choose for ``shape``'s ``op`` (as :func:`resolve`
    does, never timing another machine's records), or None for the default."""
    own = records.own_records(shape, target, hardware_key(target), op)
    if not own:
        return None
    from tvm_deform.runtime import dispatch  # times kernels, imports this module

    chosen = dispatch.choose_own(shape, op, own)
    return chosen if _replays_this_layout(shape, target, op, chosen) else None


def _size_class(shape: ConvShape, classes: tuple[int, ...]) -> int:
    """The size class (of ``classes``) whose kernel a call of ``shape`` runs."""
    pixels = definition.padded_pixels(shape.out_h * shape.out_w)
    return max(c for c in classes if pixels >= c)


def any_size_path(shape: ConvShape, target: Target, layout: str = "NCHW") -> Path:
    """The file in the disk cache of the kernel for any size that a call of ``shape`` runs with
    the default schedule."""
    chosen = _size_class(shape, schedules.pixel_classes(shape, target))
    return cache_path(shape.any_size(), target, "default", _any_size_op(layout, chosen))


def _any_size_op(layout: str, min_pixels: int) -> str:
    return f"forward_any_size_{min_pixels}" + ("" if layout == "NCHW" else f"_{layout.lower()}")


def _any_size_class(
    layer: ConvShape,
    target: Target,
    layout: str,
    min_pixels: int,
    record: records.TunedRecord | None = None,
    fell_back: Callable[[str], None] = lambda reason: None,
) -> Kernel:
    """The kernel for any size of ``layer`` in the size class from ``min_pixels``: the default
    schedule, or ``record``'s replayed; the default where the record does not replay or build
    (kept in the disk cache under the record's name, so that a later process does not try
    again; ``fell_back`` is told why)."""
    op = _any_size_op(layout, min_pixels)
    what = _describe(layer, target, op, "default")

    def compile_module() -> tvm.runtime.Module:
        if record is not None:
            trace, tuned = record.record.trace, record.record.workload.mod["main"]
            try:
                replayed = schedules.replayed_any_size_schedule(
                    layer, target, min_pixels, tuned, trace
                )
                if replayed is not None:
                    return compile_schedule(replayed, target)
                log.info("%s does not replay on the %s: default schedule", record.space, what)
                fell_back("does not replay")
            except Exception as error:  # noqa: BLE001 - any failure: the default's kernel
                _replay_failed(record, what, error)
                fell_back(f"failed: {error}")
        default = schedules.forward_schedule(layer, target, layout, min_pixels)
        return compile_schedule(default, target)

    schedule = _schedule_name(record)

    def load() -> Kernel:
        how = _describe(layer, target, op, "default" if record is None else record.space)
        return _load_module(cache_path(layer, target, schedule, op), compile_module, how)[
            "deform_conv2d"
        ]

    return _memoised(("forward", layer, layout, min_pixels, _target_text(target), schedule), load)


class ReplayError(ValueError):
    """A tuned record does not replay on a PrimFunc for any size: it cannot be derived there
    (:func:`tvm_deform.schedules.derive`: of no design space of the rules, or its rule offers
    no such space of that PrimFunc) and its steps do not apply there (its stages differ, or a
    step's condition does not hold there)."""


def _replay_failed(record: records.TunedRecord, what: str, error: Exception) -> None:
    warnings.warn(
        f"the tuned record ({record.space}) of a size of the layer, replayed on the {what}, "
        f"failed ({error}): default schedule",
        RuntimeWarning,
        stacklevel=3,
    )


@functools.lru_cache(maxsize=64)
def _target_text(target: Target) -> str:
    """``str(target)``, once per target object (a few microseconds a call otherwise)."""
    return str(target)


def load_kernel(
    shape: ConvShape,
    target: Target,
    record: records.TunedRecord | None = None,
    layout: str = "NCHW",
) -> Kernel:
    """The forward kernel of ``shape`` for an input in ``layout``, with ``record``'s schedule
    (None: the default), through the disk cache, not memoised (benchmarks use it to run
    schedules dispatch would not pick)."""
    schedule = _schedule_name(record)
    op = "forward" if layout == "NCHW" else f"forward_{layout.lower()}"
    module = _load_module(
        cache_path(shape, target, schedule, op=op),
        lambda: compile_kernel(shape, target, record, layout),
        _describe(shape, target, op, _record_name(record)),
    )
    return module["deform_conv2d"]


def load_scheduled(
    shape: ConvShape, target: Target, name: str, schedule: Callable[[], s_tir.Schedule]
) -> Kernel:
    """The forward kernel of ``shape`` with the schedule ``schedule()`` makes, through the disk
    cache under ``name`` (benchmarks use it to time a rule that dispatch would not pick)."""
    module = _load_module(
        cache_path(shape, target, name),
        lambda: compile_schedule(schedule(), target),
        _describe(shape, target, "forward", name),
    )
    return module["deform_conv2d"]


def get_backward(
    shape: ConvShape,
    target: Target | None = None,
    tuned: bool | None = None,
    gradients: definition.Gradients = definition.ALL_GRADIENTS,
) -> BackwardKernels:
    """The compiled backward kernels of ``shape`` that compute ``gradients``, looked up and
    cached like :func:`get_kernel`'s. The kernel computing all of them runs with the tuned
    schedule the logs hold for it if any; one that leaves gradients out runs its default
    schedule (it skips whole stages, which is worth more than a tuned schedule of them)."""
    target = target or host_target()

    def load() -> BackwardKernels:
        use_tuned = env.tuned_enabled() if tuned is None else tuned  # as in get_kernel
        if target.kind.name == "llvm":
            launcher.prepare()  # built meanwhile, if this call compiles
        every = gradients == definition.ALL_GRADIENTS
        if any_size(shape, target, use_tuned and every, op="backward"):
            return _any_size_backward(shape, target, gradients, use_tuned)
        op = "backward" if every else f"backward_{gradients.name}"
        key = _index_key(op, shape, target, use_tuned and every)
        module = _from_index(key)
        if module is not None:
            return _backward_kernels(module, shape, target, gradients)
        record = resolve(shape, target, use_tuned, "backward") if every else None
        found = load_backward(shape, target, record, gradients)
        _add_to_index(key, cache_path(shape, target, _schedule_name(record), op))
        return found

    return _memoised(("backward", shape, gradients, _target_text(target), tuned), load)


def _any_size_backward(
    shape: ConvShape,
    target: Target,
    gradients: definition.Gradients,
    tuned: bool = False,
    decide: bool = True,
) -> BackwardKernels:
    """The backward kernels of ``shape``'s layer for every size, memoised by the layer. With
    ``tuned``, the kernel of every gradient runs the record this machine's own logs chose for
    a size of the layer (:func:`backward_record`), replayed for any size, where it is faster
    than the default's (timed at the first use; the default where it does not replay or
    build). ``decide=False`` compiles both and answers the default's, untimed."""
    quantum = schedules.backward_pixel_quantum(shape, target)
    layer = shape.any_size()
    op = "backward_any_size" + (
        "" if gradients == definition.ALL_GRADIENTS else f"_{gradients.name}"
    )
    what = _describe(layer, target, op, "default")

    def compile_module(
        record: records.TunedRecord | None, fell_back: Callable[[str], None]
    ) -> tvm.runtime.Module:
        if record is not None:
            try:
                return compile_backward(layer, target, record, gradients, quantum)
            except ReplayError:  # a record of another design space
                log.info("%s does not replay on the %s: default schedule", record.space, what)
                fell_back("does not replay")
            except Exception as error:  # noqa: BLE001 - any failure: the default's kernels
                _replay_failed(record, what, error)
                fell_back(f"failed: {error}")
        return compile_backward(layer, target, None, gradients, quantum)

    def load(
        record: records.TunedRecord | None, fell_back: Callable[[str], None] = lambda _: None
    ) -> BackwardKernels:
        how = _describe(layer, target, op, "default" if record is None else record.space)
        path = cache_path(layer, target, _schedule_name(record), op)
        module = _load_module(path, lambda: compile_module(record, fell_back), how)
        return _backward_kernels(module, layer, target, gradients)._replace(
            quantum=quantum, any_size=True
        )

    def chosen() -> BackwardKernels:
        default = _memoised(
            ("backward", layer, gradients, _target_text(target), "any"), lambda: load(None)
        )
        every = gradients == definition.ALL_GRADIENTS
        size, record = backward_record(shape, target) if tuned and every else (None, None)
        if record is None:
            return default
        from tvm_deform.runtime import dispatch  # times kernels, imports this module

        noted = functools.partial(dispatch.replay_failed, size, target, "backward", record)
        replayed = load(record, noted)
        if not decide:
            return default
        wins = dispatch.replay_wins(size, target, "backward", record, replayed, default)
        return replayed if wins else default

    if not decide:
        return chosen()
    return _memoised(("backward", layer, gradients, _target_text(target), "any", tuned), chosen)


def backward_record(
    shape: ConvShape, target: Target
) -> tuple[ConvShape, records.TunedRecord] | tuple[None, None]:
    """The tuned record that the backward kernel of every gradient for any size of ``shape``'s
    layer may run, with the size it was tuned at: the record this machine's own logs choose
    (as :func:`resolve` does from them) for a size of the layer that they tuned to at least
    ``records.MIN_TUNED_GAIN`` faster than the default (:func:`records.tuned_shapes`), of the
    one with the most pixels where they tuned several; ``(None, None)`` where they tuned none.
    (The backward's kernels for any size have no size classes.) It runs where it is faster
    than the default at that size, as the forward's do (:func:`class_records`)."""
    for size in reversed(_tuned_sizes(shape, target, "backward")):
        record = _own_choice(size, target, "backward")
        if record is not None:
            return size, record
    return None, None


def load_backward(
    shape: ConvShape,
    target: Target,
    record: records.TunedRecord | None = None,
    gradients: definition.Gradients = definition.ALL_GRADIENTS,
) -> BackwardKernels:
    """The backward kernels of ``shape`` computing ``gradients``, with ``record``'s schedule for
    the gradients kernel (None: the default), through the disk cache, not memoised."""
    schedule = _schedule_name(record)
    op = "backward" if gradients == definition.ALL_GRADIENTS else f"backward_{gradients.name}"
    module = _load_module(
        cache_path(shape, target, schedule, op=op),
        lambda: compile_backward(shape, target, record, gradients),
        _describe(shape, target, op, _record_name(record)),
    )
    return _backward_kernels(module, shape, target, gradients)


def _backward_kernels(
    module: tvm.runtime.Module,
    shape: ConvShape,
    target: Target,
    gradients: definition.Gradients,
) -> BackwardKernels:
    input_kernel = module["deform_conv2d_grad_input"] if gradients.input else None
    channels_last = _channels_last_columns(shape, target, gradients)
    return BackwardKernels(
        module["deform_conv2d_backward"],
        input_kernel,
        channels_last_columns=channels_last,
    )


def _channels_last_columns(
    shape: ConvShape, target: Target, gradients: definition.Gradients
) -> bool:
    """Whether the backward kernels of ``shape`` computing ``gradients`` take a channels-last
    column gradient (see :func:`tvm_deform.schedules.channels_last_columns`); a backward
    without a column gradient takes none."""
    return gradients.needs_grad_columns and schedules.channels_last_columns(shape, target)


def _record_name(record: records.TunedRecord | None) -> str:
    """A schedule in words: "default", or where a tuned record comes from."""
    return "default" if record is None else f"{record.hardware_key}/{record.space} record"


def _schedule_name(record: records.TunedRecord | None) -> str:
    """The schedule's name in the kernel cache: "default", or the tuned record's identity."""
    return "default" if record is None else record.identity


#: the kernel index, ``index.json`` in the cache directory: what a call asked for (the op, the
#: layer, the target, the tuning settings and a fingerprint of the logs) -> the kernel file it
#: was given. A new process finds a kernel it has compiled before through it, without resolving
#: the schedule again (which builds the PrimFunc and opens the tuning databases)
INDEX = "index.json"
_index: dict[str, str] = {}


def _index_key(op: str, shape: ConvShape, target: Target, tuned: bool) -> str:
    text = "\n".join(
        (
            op,
            cache_path(shape, target, "default", op).name,  # layer, target, versions, pool
            f"tuned {tuned} measure {env.measure_enabled()}",
            records.logs_fingerprint() if tuned else "",
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _from_index(key: str) -> tvm.runtime.Module | None:
    """The kernel library the index names for ``key``, loaded, if it is still in the cache."""
    base = diskcache.root()
    if base is None:
        return None
    name = _index.get(key) or _read_index(base).get(key)
    if name is None:
        return None
    path = base / name
    with diskcache.locked(path):
        module = _load_cached(path)
    if module is None:
        return None
    _use(path, module)
    return module


def _read_index(base: Path) -> dict[str, str]:
    path = base / INDEX
    try:
        found = json.loads(path.read_text()) if diskcache.trusted(path) else {}
    except (OSError, ValueError):
        found = {}
    _index.update(found)
    return found


def _add_to_index(key: str, path: Path) -> None:
    base = diskcache.root()
    if base is None or not path.exists():
        return
    _index[key] = path.name
    try:
        with diskcache.locked(base / INDEX):
            entries = _read_index(base) | {key: path.name}
            live = {k: n for k, n in entries.items() if (base / n).exists()}
            diskcache.write_atomically(base / INDEX, json.dumps(live, indent=0).encode())
    except OSError:
        pass  # an index that cannot be written costs the next process a lookup


#: set once a CPU kernel runs on TVM's own thread pool (launcher off or unavailable, or a kernel
#: that could not be loaded from a file): only then does TVM's pool need a thread count
_tvm_pool_in_use = False


def _describe(shape: ConvShape, target: Target, op: str, schedule: str) -> str:
    """A kernel in words, for the progress messages."""
    s = shape
    size = "any size" if s.height == 0 else f"{s.batch}x{s.in_channels}x{s.height}x{s.width}"
    layer = (
        f"{size}, {s.in_channels} -> {s.out_channels} channels, "
        f"{s.kernel_h}x{s.kernel_w} kernel, {s.dtype}"
    )
    where = hardware_key(target)
    how = "" if schedule == "default" else f", {schedule}"
    return f"the {op} kernel of {layer} for {where}{how}"


def _load_module(
    path: Path, compile_module: Callable[[], tvm.runtime.Module], what: str = ""
) -> tvm.runtime.Module:
    """The kernel library at ``path`` in the disk cache, else ``compile_module()`` exported there
    (or to a private file when the cache is off or cannot be written), loaded from its file with
    its parallel loops attached to torch's threads."""
    global _tvm_pool_in_use
    if diskcache.root() is None:
        module, attached = _load_private(_compile(compile_module, what or path.name), path.name)
    else:
        with diskcache.locked(path):  # one process compiles, the others wait and load it
            module = _load_cached(path)
            if module is None:
                built = _compile(compile_module, what or path.name)
                _store_cached(built, path)
                module = _load_cached(path)
        if module is not None:
            _use(path, module)
            return module
        module, attached = _load_private(built, path.name)
    if not attached:
        _tvm_pool_in_use = True
    return module


def _use(path: Path, module: tvm.runtime.Module) -> None:
    """Attach the library ``module`` loaded from ``path`` (see :func:`_attach`)."""
    global _tvm_pool_in_use
    if not _attach(path, module):
        _tvm_pool_in_use = True


def _compile(compile_module: Callable[[], tvm.runtime.Module], what: str) -> tvm.runtime.Module:
    began = time.perf_counter()
    built = compile_module()
    log.info("compiled %s in %.1f s", what, time.perf_counter() - began)
    return built


def _attach(path: Path, module: tvm.runtime.Module) -> bool:
    """Attach the kernel library at ``path`` (loaded as ``module``): its CUDA workspaces to
    torch's caching allocator (see :mod:`tvm_deform.runtime.workspace`), its parallel loops to
    torch's threads; returns whether the latter took."""
    if any(imported.kind == "cuda" for imported in module.imports):
        workspace.attach(path)
    return launcher.attach(path)


def _load_private(built: tvm.runtime.Module, name: str) -> tuple[tvm.runtime.Module, bool]:
    """``built`` exported to a temporary file, loaded from it and attached to the launcher
    (the file is removed once loaded), and whether it was attached; ``built`` itself, on TVM's
    pool, if it cannot be exported (no compiler to link it)."""
    directory = Path(tempfile.mkdtemp(prefix="tvm_deform-"))
    path = directory / name
    try:
        try:
            built.export_library(str(path))
            module = tvm.runtime.load_module(str(path))
        except Exception as error:  # noqa: BLE001 - e.g. no compiler to link the library
            warnings.warn(
                f"kernel {name} could not be exported ({error}); it runs from memory, on TVM's "
                "thread pool",
                RuntimeWarning,
                stacklevel=4,
            )
            return built, False
        # Attached while the file exists: dlopen finds the loaded library by its path.
        return module, _attach(path, module)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


#: the environment variables whose values are part of every memoised kernel's key
MEMOISED_SETTINGS = (
    "TVM_DEFORM_LOGS",
    "XDG_DATA_HOME",
    "TVM_DEFORM_SIZES",
    "TVM_DEFORM_LAUNCHER",
    "TVM_DEFORM_MEASURE",
    "TVM_DEFORM_TUNED",
)
_settings = env.Snapshot(*MEMOISED_SETTINGS)


def _memoised(key: tuple, load: Callable):
    """``load()``, once per ``key`` and per log, size, pool, timing and tuning settings
    (:data:`MEMOISED_SETTINGS`, part of the key, so that changing them mid-process takes
    effect)."""
    # The settings as the environment spells them: ``env.user_logs_dir()`` builds a path
    # (15 us), too much for every call. TVM's CUDA compile settings are not among them: a
    # change to those mid-process holds for kernels not loaded yet.
    key = (*key, *_settings.values())
    found = _memory.get(key)
    if found is not None:
        return found
    with _lock:
        key_lock = _loading.setdefault(key, threading.Lock())
    with key_lock:
        found = _memory.get(key)
        if found is None:
            found = load()
            with _lock:
                _memory[key] = found
                _loading.pop(key, None)
    return found


def clear_memory_cache() -> None:
    """Forget the kernels compiled or loaded by this process (the disk cache stays)."""
    with _lock:
        _memory.clear()


#: TVM's thread pool is per calling thread, and so is the count it was last given
_threads = threading.local()


def configure_threads(count: int) -> None:
    """Make the calling thread's TVM CPU thread pool use ``count`` threads: a no-op when already
    so, or when no kernel runs on TVM's pool (kernels attached to the launcher use torch's
    threads and thread count)."""
    if _tvm_pool_in_use and count != getattr(_threads, "count", 0):
        # Mode 1 ("big cores") with an explicit count: use ``count`` workers of the pool.
        tvm.get_global_func("runtime.config_threadpool")(1, count)
        _threads.count = count
