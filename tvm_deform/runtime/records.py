"""Tuning-log lookup (build and dispatch layer): which tuned schedule, if any, a shape gets.

The fallback chain, first match wins:

1. the user's log directory (``TVM_DEFORM_LOGS``), then the shipped ``tuning_logs``;
2. in each, the exact hardware key (``llvm/znver4``): the fastest record over the design spaces
   found there, unless the default schedule's own measurement there (``DEFAULT_SPACE``) is
   faster; these were measured on this kind of machine, so their decision is taken;
3. no logs of this machine's own: the best record of each compatible hardware key (same target
   kind, architecture and vector ISA, from its manifest, see :mod:`tvm_deform.runtime.hardware`)
   is a candidate, timed on this machine against the default schedule by
   :mod:`tvm_deform.runtime.dispatch`;
   another machine's decision is never taken as if measured here;
4. no record: the default schedule.

A missing or corrupt log directory is skipped with a warning, never an exception.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import gzip
import hashlib
import json
import shutil
import tempfile
import warnings
from importlib import resources
from pathlib import Path

import tvm
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from tvm_deform import env
from tvm_deform.ir import definition
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import diskcache

#: the database (beside the design spaces') that holds the default schedule's own measurement,
#: taken at tune time with the same builder and runner: a tuned record is used only if it beat it
DEFAULT_SPACE = "default"

#: the kernels that are tuned: the forward, and the backward's gather/GEMM kernel (the input's
#: gradient, ``grad_input``, runs its default schedule)
OPS = ("forward", "backward")
#: the file beside a hardware key's design spaces that holds the choices timed through the op
#: at tuning time (see :func:`tvm_deform.runtime.dispatch.decide_for_logs`)
LOGS_DECISIONS = "decisions.json"
#: how much less time than the default schedule a shape's tuned record must have taken, when
#: it was tuned, for the shape to run a kernel of its exact size instead of the one for any
#: size (see :func:`tuned_shapes`). Below it, compiling that kernel at the shape's first call
#: (about half a second a layer on a CPU) costs more than the record saves: the kernels for any
#: size run within a few percent of the default's kernels of one size.
MIN_TUNED_GAIN = 0.05


def workload_module(shape: ConvShape, op: str = "forward") -> tvm.IRModule:
    """The module MetaSchedule tunes and the lookup queries for ``shape``'s ``op``."""
    if op == "forward":
        return tvm.IRModule({"main": definition.forward(shape)})
    if op == "backward":
        return tvm.IRModule({"main": definition.backward(shape)})
    raise ValueError(f"unknown op {op!r}; expected one of {OPS}")


def shipped_logs_dir() -> Path:
    """The tuning logs installed with the package (``tuning_logs/`` in the repository)."""
    return Path(str(resources.files("tvm_deform.tuning_logs")))


def log_roots() -> list[Path]:
    """Where tuning logs are looked up, first match first: the user's, then the shipped ones."""
    return [env.user_logs_dir(), shipped_logs_dir()]


@dataclasses.dataclass(frozen=True)
class TunedRecord:
    """The best tuning record found for a shape, and where it came from."""

    directory: Path
    hardware_key: str
    space: str
    run_ms: float | None
    record: ms.database.TuningRecord

    @property
    def identity(self) -> str:
        """Names the schedule (for kernel cache keys): its space and trace."""
        return f"{self.space}:{self.record.trace}"


#: MetaSchedule's files of a database directory. The logs keep the workload file gzipped
#: (``PACKED_WORKLOADS``): it holds every tuned PrimFunc in full, 17x smaller packed, and most of
#: the repository's size otherwise.
WORKLOADS = "database_workload.json"
TUNING_RECORDS = "database_tuning_record.json"
PACKED_WORKLOADS = WORKLOADS + ".gz"


def is_database(directory: Path) -> bool:
    """Whether ``directory`` holds a database, packed or not."""
    return (directory / WORKLOADS).exists() or (directory / PACKED_WORKLOADS).exists()


def databases(root: Path) -> list[Path]:
    """The database directories of a log tree laid out ``<kind>/<key>/<space>/``."""
    found = {
        p.parent for pattern in (WORKLOADS, PACKED_WORKLOADS) for p in root.glob(f"*/*/*/{pattern}")
    }
    return sorted(found)


def read_workloads(directory: Path) -> str | None:
    """The text of the workload file of the database at ``directory``, packed or not (None
    when there is none)."""
    directory = Path(directory)
    if (directory / WORKLOADS).exists():
        return (directory / WORKLOADS).read_text()
    if (directory / PACKED_WORKLOADS).exists():
        return gzip.decompress((directory / PACKED_WORKLOADS).read_bytes()).decode()
    return None


def open_database(directory: Path) -> ms.database.JSONDatabase:
    """The database at ``directory``. A packed one is read from an unpacked copy, kept per
    content digest in the kernel cache directory (``logs/<digest>``), or for this process only
    when the cache is off or not writable, so MetaSchedule reads it as usual; writes to it do
    not reach ``directory``."""
    directory = Path(directory)
    if (directory / WORKLOADS).exists():
        return ms.database.JSONDatabase(work_dir=str(directory), allow_missing=False)
    packed = (directory / PACKED_WORKLOADS).read_bytes()
    tuning = directory / TUNING_RECORDS
    tuning_bytes = tuning.read_bytes() if tuning.exists() else b""
    digest = hashlib.sha256(packed + b"\0" + tuning_bytes).hexdigest()[:20]
    copy = _unpacked_root() / digest
    if (copy / WORKLOADS).exists() and not diskcache.trusted(copy / WORKLOADS):
        shutil.rmtree(copy, ignore_errors=True)  # not ours: unpacked again
    if not (copy / WORKLOADS).exists():
        staging = Path(tempfile.mkdtemp(dir=copy.parent, prefix=f".{digest}."))
        (staging / WORKLOADS).write_bytes(gzip.decompress(packed))
        (staging / TUNING_RECORDS).write_bytes(tuning_bytes)
        try:
            staging.rename(copy)
        except OSError:  # another process unpacked it first
            shutil.rmtree(staging, ignore_errors=True)
    return ms.database.JSONDatabase(work_dir=str(copy), allow_missing=False)


def _unpacked_root() -> Path:
    """Where unpacked copies of packed databases go: the kernel cache's ``logs`` folder (see
    :mod:`tvm_deform.runtime.diskcache`), or, when the cache is off or cannot be used, a
    temporary folder removed at exit."""
    return diskcache.subdirectory("logs") or _process_scratch()


@functools.cache
def _process_scratch() -> Path:
    root = Path(tempfile.mkdtemp(prefix="tvm_deform_logs_"))
    atexit.register(shutil.rmtree, root, True)
    return root


def pack_database(directory: Path) -> None:
    """Gzip the workload file of the database at ``directory`` (reproducibly: no timestamp)."""
    plain = Path(directory) / WORKLOADS
    if plain.exists():
        data = gzip.compress(plain.read_bytes(), compresslevel=9, mtime=0)
        (plain.parent / PACKED_WORKLOADS).write_bytes(data)
        plain.unlink()


def unpack_database(directory: Path) -> None:
    """Undo :func:`pack_database` in place (to edit a packed database)."""
    packed = Path(directory) / PACKED_WORKLOADS
    if packed.exists():
        (packed.parent / WORKLOADS).write_bytes(gzip.decompress(packed.read_bytes()))
        packed.unlink()


@functools.cache
def _database(directory: str) -> ms.database.JSONDatabase | None:
    try:
        return open_database(Path(directory))
    except Exception as error:  # noqa: BLE001 - any unreadable database is skipped
        warnings.warn(
            f"ignoring unreadable tuning log {directory}: {error}", RuntimeWarning, stacklevel=4
        )
        return None


def _manifest(key_dir: Path) -> dict:
    return _read_json(key_dir / "manifest.json")


def logs_date(key_dir: Path) -> str | None:
    """The date (ISO) on which the logs of one hardware key were written, from their manifest."""
    return _manifest(key_dir).get("date")


def manifest_isa(manifest: dict) -> str | None:
    """The vector ISA a manifest's machine had (older manifests name only the vector width)."""
    if "isa" in manifest:
        return manifest["isa"]
    target = str(manifest.get("target", ""))
    if "x86_64" in target:
        return {512: "avx512", 256: "avx2"}.get(manifest.get("vector_bits"))
    return None


def candidate_keys(root: Path, target: Target, hardware_key: str) -> list[str]:
    """The hardware keys to look at under ``root``: the exact one, then compatible ones (same
    target kind, architecture and vector ISA)."""
    from tvm_deform.runtime.targets import target_isa

    keys = [hardware_key]
    kind_dir = root / target.kind.name
    if target.kind.name == "llvm" and kind_dir.is_dir():
        isa = target_isa(target)
        arch = str(target.attrs.get("mtriple", "")).split("-")[0]
        for other in sorted(kind_dir.iterdir()):
            key = f"{target.kind.name}/{other.name}"
            manifest = _manifest(other)
            same_arch = arch in str(manifest.get("target", ""))
            if key != hardware_key and same_arch and manifest_isa(manifest) == isa:
                keys.append(key)
    return keys


def record_ms(record: ms.database.TuningRecord) -> float | None:
    """A record's measured run time in milliseconds (mean of its runs), if it has one."""
    secs = [float(s) for s in (record.run_secs or [])]
    return sum(secs) / len(secs) * 1e3 if secs else None


def best_in(directory: Path, mod: tvm.IRModule) -> ms.database.TuningRecord | None:
    """The fastest record of ``mod`` in the database at ``directory``, if any."""
    if not is_database(directory):
        return None
    db = _database(str(directory))
    if db is None or not db.has_workload(mod):
        return None
    records = db.get_top_k(db.commit_workload(mod), 1)
    return records[0] if records else None


def find_records(
    shape: ConvShape,
    target: Target,
    hardware_key: str,
    roots: list[Path] | None = None,
    op: str = "forward",
) -> list[TunedRecord]:
    """The best record of each design space at the first (log root, hardware key) of the
    fallback chain that has any for ``shape``'s ``op``; empty when none has. ``roots``
    replaces the usual log roots (to look at one directory alone)."""
    mod = workload_module(shape, op)
    for root in log_roots() if roots is None else roots:
        if not root.is_dir():
            if root != shipped_logs_dir() and env.user_logs_explicit():
                warnings.warn(
                    f"tuning log directory {root} does not exist", RuntimeWarning, stacklevel=3
                )
            continue
        for key in candidate_keys(root, target, hardware_key):
            key_dir = root / key
            if not key_dir.is_dir():
                continue
            found = []
            for space_dir in sorted(p for p in key_dir.iterdir() if p.is_dir()):
                record = best_in(space_dir, mod)
                if record is not None:
                    found.append(
                        TunedRecord(space_dir, key, space_dir.name, record_ms(record), record)
                    )
            if found:
                return found
    return []


def fastest(found: list[TunedRecord]) -> TunedRecord | None:
    """The fastest of one hardware key's records by their tuning-time measurement; None when
    that is the default schedule's own."""
    if not found:
        return None
    best = min(found, key=lambda r: float("inf") if r.run_ms is None else r.run_ms)
    return None if best.space == DEFAULT_SPACE else best


def own_records(
    shape: ConvShape, target: Target, hardware_key: str, op: str = "forward"
) -> list[TunedRecord]:
    """The records (one per design space, the default's measurement included) that the logs of
    ``hardware_key`` itself hold for ``shape``'s ``op``, from the first log root that has any."""
    for root in log_roots():
        found = find_records(shape, target, hardware_key, roots=[root], op=op)
        if found and found[0].hardware_key == hardware_key:
            return found
    return []


def foreign_records(
    shape: ConvShape, target: Target, hardware_key: str, op: str = "forward"
) -> list[TunedRecord]:
    """The best tuned record (over the design spaces, the default's measurement left out) of
    each compatible hardware key other than ``hardware_key``, in every log root: the candidates
    to time on this machine."""
    mod = workload_module(shape, op)
    found = []
    for root in log_roots():
        if not root.is_dir():
            continue
        for key in candidate_keys(root, target, hardware_key)[1:]:
            records = []
            for space_dir in sorted(p for p in (root / key).iterdir() if p.is_dir()):
                record = best_in(space_dir, mod) if space_dir.name != DEFAULT_SPACE else None
                if record is not None:
                    records.append(
                        TunedRecord(space_dir, key, space_dir.name, record_ms(record), record)
                    )
            if records:
                found.append(min(records, key=lambda r: r.run_ms or float("inf")))
    return found


def tuned_schedule(shape: ConvShape, record: TunedRecord, op: str = "forward") -> s_tir.Schedule:
    """``shape``'s ``op`` PrimFunc with ``record``'s trace applied (postprocessing included)."""
    sch = s_tir.Schedule(workload_module(shape, op))
    record.record.trace.apply_to_schedule(sch, remove_postproc=False)
    return sch


def forget_databases() -> None:
    """Drop the databases read so far (after the log files changed)."""
    _database.cache_clear()
    _fingerprint.cache_clear()
    _tuned_shapes.cache_clear()


def tuned_shapes(target: Target, op: str = "forward") -> frozenset[ConvShape]:
    """The shapes whose ``op`` the logs of ``target``'s own hardware key hold a record of that
    ran at least :data:`MIN_TUNED_GAIN` faster than the default schedule when they were tuned:
    the shapes for which a kernel of their exact size, tuned on this kind of machine, is worth
    compiling at their first call instead of running the one for any size. Read from the
    manifests and decisions (no database is opened); see :func:`tuned_gain`."""
    from tvm_deform.runtime.targets import hardware_key

    roots = tuple(str(root) for root in log_roots())
    return _tuned_shapes(roots, hardware_key(target), op)


@functools.cache
def _tuned_shapes(roots: tuple[str, ...], key: str, op: str) -> frozenset:
    shapes = set()
    for root in map(Path, roots):
        if not root.is_dir():
            continue
        chosen = {entry.get("workload"): entry for entry in logs_decisions(root / key).values()}
        for name, spaces in _manifest(root / key).get("workloads", {}).items():
            if (op == "backward") != name.endswith(":backward"):
                continue
            gain = tuned_gain(spaces, chosen.get(name))
            if gain is not None and gain < MIN_TUNED_GAIN:
                continue
            for entry in spaces.values():
                if isinstance(entry, dict) and "shape" in entry:
                    try:
                        shapes.add(ConvShape(**entry["shape"]))
                    except TypeError:
                        continue  # a manifest of another version's fields
    return frozenset(shapes)


def tuned_gain(spaces: dict, decision: dict | None) -> float | None:
    """How much faster than the default schedule a workload's chosen record ran when it was
    tuned (0.1: 10% less time; 0 where the default was chosen), from its decision timed
    through the op (``decision``, an entry of ``decisions.json``) or else from the tuner's
    best times per design space in the manifest (``spaces``); None where the default was not
    measured."""
    if decision is not None:
        times, choice = decision.get("median_ms", {}), decision.get("choice")
    else:
        times = {
            space: entry["best_ms"]
            for space, entry in spaces.items()
            if isinstance(entry, dict) and entry.get("best_ms")
        }
        choice = min(times, key=times.__getitem__, default=None)
    if not times.get(DEFAULT_SPACE) or choice not in times:
        return None
    return 1.0 - times[choice] / times[DEFAULT_SPACE]


def logs_decisions(key_dir: Path) -> dict:
    """The decisions timed through the op at tuning time that one hardware key's logs hold (see
    :func:`tvm_deform.runtime.dispatch.decide_for_logs`); empty without them."""
    return _read_json(key_dir / LOGS_DECISIONS)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def logs_fingerprint() -> str:
    """A digest of every log file the lookups may read (path, size, modification time): the
    kernel index (:mod:`tvm_deform.runtime.kernels`) keys its entries by it, so that new or
    changed logs resolve the schedules again. Files are listed, not read."""
    return _fingerprint(tuple(str(root) for root in log_roots()))


@functools.cache
def _fingerprint(roots: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for root in roots:
        digest.update(root.encode() + b"\0")
        for path in sorted(Path(root).rglob("*")) if Path(root).is_dir() else ():
            if path.is_file():
                info = path.stat()
                digest.update(f"{path}:{info.st_size}:{info.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:20]
