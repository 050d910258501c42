"""Seconds to import a module in a new process that has already imported torch (the time a
user's script pays for it), printed to two decimals::

    .venv/bin/python lab/import_time.py tvm_deform
    .venv/bin/python lab/import_time.py torchvision.ops
"""

from __future__ import annotations

import sys
import time

import torch  # noqa: F401  (imported first: its time is not counted)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    began = time.perf_counter()
    __import__(args[0])
    print(f"{time.perf_counter() - began:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
