"""The commands' rich Console: a reader that goes away (`fadiag bench | head`) ends the command
the way it ends every other command, quietly with status 141, not with rich's own status 1."""

from __future__ import annotations

import rich.console


class Console(rich.console.Console):
    """rich's Console, except that a broken pipe reaches `fadiag.cli.main` as BrokenPipeError."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError
