"""Parsing TVMScript without Python's slow path through ``inspect``.

Every ``@T.prim_func`` calls ``inspect.stack()``, which asks ``inspect.getmodule`` for the module
of each frame on the stack. For a frame of a pseudo-file (an import's ``<frozen
importlib._bootstrap>``, the parser's own ``<ast>`` code, ``python -c``'s ``<string>``, a
notebook's cells) no module has that file, and ``getmodule`` finds that out by scanning every
loaded module, at every call: thousands with TVM and torch loaded. TVM's tensor intrinsic
libraries, a few hundred functions parsed at import, took 25-35 s that way (3 s without); the
input gradient's PrimFunc, 70-200 ms a build (measured on a 2-core Intel Xeon, ``emeraldrapids``).

While :func:`pseudo_frames_answered_at_once` is active, such a frame is answered at once, with
the answer the scan gives (None): ``getmodule`` is unchanged for every other object and file."""

from __future__ import annotations

import contextlib
import inspect
import threading
import types
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_original = inspect.getmodule


def _getmodule(obj, _filename=None):
    pseudo = _filename is not None and _filename.startswith("<") and _filename.endswith(">")
    if pseudo and isinstance(obj, types.FrameType):
        return None
    return _original(obj, _filename)


@contextlib.contextmanager
def pseudo_frames_answered_at_once() -> Iterator[None]:
    """While active (in any thread, nested or not), ``inspect.getmodule`` answers a frame of a
    pseudo-file without scanning the loaded modules; afterwards it is what it was, unless
    something else replaced it meanwhile."""
    global _depth, _original
    with _lock:
        if _depth == 0:
            _original = inspect.getmodule
            inspect.getmodule = _getmodule
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and inspect.getmodule is _getmodule:
                inspect.getmodule = _original
