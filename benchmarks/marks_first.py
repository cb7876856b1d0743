"""Build (or load) fadiag's native marks before a benchmark measures anything.

`fadiag.attach()` builds them in the background and measures with Python marks until the build
is done, so on a fresh machine a short benchmark would measure its first minute (or all of it)
without the dispatcher tap: compiled code unmeasured, no host-bound windows. Each GPU benchmark
that attaches calls `marks_first()` first (overhead.py and in_situ.py print it with their
results) and records what it says.
"""

from __future__ import annotations

import sys
from typing import TextIO

from fadiag.capture import native


def marks_first(kind: str = "cuda", file: TextIO | None = None) -> str:
    """Block until the native marks for `kind` are built; their status ("loaded", or why not),
    also printed to `file` (stderr by default: some scripts print their JSON to stdout)."""
    try:
        native.load(kind)
        status = native.status(kind)
    except Exception as e:  # FADIAG_NATIVE_DISABLE, no compiler: the benchmark runs on Python marks
        status = f"not loaded: {type(e).__name__}: {e}"
    print(f"native marks: {status}", file=sys.stderr if file is None else file, flush=True)
    return status
