"""The command line as a whole: where each command's code lives."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from fadiag import cli

PACKAGE = Path(cli.__file__).parent.parent  # fadiag/, the package that holds cli/


LIBRARY = {"baseline": "the regression rule's baseline files, which the session reads and writes"}
"""Top-level modules named like a command that are not the command's code but the library's."""


@pytest.mark.parametrize("command", cli.COMMANDS)
def test_each_command_lives_in_one_place_under_fadiag_cli(command: str) -> None:
    module = importlib.import_module(f"fadiag.cli.{command}")
    assert callable(module.add_parser) and callable(module.run)
    # no second home for it at the top of the package (fadiag/bench.py beside cli/bench)
    assert command in LIBRARY or not (PACKAGE / f"{command}.py").exists()
