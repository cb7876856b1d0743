"""Shared fixtures: every test starts and ends with fadiag detached."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from hypothesis import settings

import fadiag
from fadiag import session as session_mod
from fadiag.export import log as log_sink

# The property tests (tests/test_config.py) draw the same examples every run: a suite that must
# not flake cannot fail on an input it happens to find on an unrelated commit. HYPOTHESIS_PROFILE=
# explore draws new ones, to look for bad inputs on purpose (a find becomes an @example).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(autouse=True)
def _detached():
    fadiag.detach()
    session_mod._instrumented.clear()
    log_sink._LOGGED.clear()
    yield
    fadiag.detach()
    session_mod._instrumented.clear()
    logging.getLogger("fadiag").setLevel(logging.NOTSET)


@pytest.fixture(scope="session", autouse=True)
def _native_extension():
    """Build (or load) the native extension once, so that the dispatcher tap's default (`auto`)
    installs it at attach() in every test, as it does in a process where it is already built."""
    from fadiag.capture import native

    if all(native.toolchain().values()):
        native.load("cuda" if torch.cuda.is_available() else "cpu")
