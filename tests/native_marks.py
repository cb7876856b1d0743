"""Skip marks for tests that need the native extension built here (and the tap in it)."""

from __future__ import annotations

import os
import sysconfig

import pytest

from fadiag.capture import native
from fadiag.capture.tap import supported as tap_supported


def toolchain() -> bool:
    """A C++ compiler, ninja and the Python headers: what building the extension needs."""
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    return headers and all(native.toolchain().values())


NEEDS_NATIVE = pytest.mark.skipif(not toolchain(),
                                  reason="needs a C++ compiler, ninja and the Python headers")
NEEDS_TAP = [NEEDS_NATIVE,
             pytest.mark.skipif(tap_supported() is not None, reason="the tap needs torch >= 2.9")]
