"""Shared fixtures: every test starts and ends with fadiag detached."""

from __future__ import annotations

import logging

import pytest

import fadiag
from fadiag import session as session_mod


@pytest.fixture(autouse=True)
def _detached():
    fadiag.detach()
    session_mod._instrumented.clear()
    session_mod._LOGGED.clear()
    yield
    fadiag.detach()
    session_mod._instrumented.clear()
    logging.getLogger("fadiag").setLevel(logging.NOTSET)
