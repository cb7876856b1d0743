"""The JSONL run log: one line per resolved step and per flag, size-rotated; and its reader.

Lines are ``{"type": "run"|"step"|"flag", ...}``. `read_run()` turns a file (or a rank's rotated
files) back into StepReports and Flags for `fadiag report` and `fadiag baseline save`; it reads
gzip-compressed logs too (``.jsonl.gz``, or rotated files compressed as ``.jsonl.1.gz``).
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..errors import RunLogError
from ..steps.records import Flag, StepReport
from .sinks import Sink


class JsonlSink(Sink):
    """Appends to ``<dir>/fadiag-rank<R>.jsonl``; past ``max_bytes`` rotates to ``.1`` … ``.<backups>``."""

    def __init__(self, directory: str | os.PathLike[str], rank: int, meta: dict[str, Any],
                 max_bytes: int = 64 << 20, backups: int = 3):
        self.path = Path(directory) / f"fadiag-rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._max_bytes = max_bytes
        self._backups = backups
        self._meta = {"type": "run", **meta}
        self._file: IO[str] | None = None
        self._open()

    def _open(self) -> None:
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the sink
        if self._file.tell() == 0:
            try:
                self._write_line(self._meta)
            except OSError:
                self._file.close()
                self._file = None
                raise

    def _write_line(self, obj: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(obj, separators=(",", ":"), allow_nan=False, default=str) + "\n")
        self._file.flush()

    def _write(self, obj: dict[str, Any]) -> None:
        if self._file is None:
            self._open()
        self._write_line(obj)
        assert self._file is not None
        if self._file.tell() >= self._max_bytes:
            self._rotate()

    def _rotate(self) -> None:
        assert self._file is not None
        self._file.close()
        self._file = None
        for i in range(self._backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                src.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self._backups > 0:
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink()
        self._open()  # the new file starts with the run line, so each file reads on its own

    def emit(self, report: StepReport) -> None:
        self._write({"type": "step", **_finite(report.to_dict())})

    def flag(self, flag: Flag) -> None:
        self._write({"type": "flag", **_finite(flag.to_dict())})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/inf: write them as null rather than fail the line."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
            out[k] = None
        elif isinstance(v, dict):
            out[k] = _finite(v)
        elif isinstance(v, list):
            out[k] = [_finite(x) if isinstance(x, dict) else x for x in v]
        else:
            out[k] = v
    return out


@dataclass
class Run:
    """What a run log holds."""

    meta: dict[str, Any] = field(default_factory=dict)
    steps: list[StepReport] = field(default_factory=list)
    flags: list[Flag] = field(default_factory=list)
    bad_lines: int = 0


def read_run(path: str | os.PathLike[str]) -> Run:
    """Read a run log, oldest rotated file first; lines that do not parse are counted, not fatal.

    Raises RunLogError for a file that is neither text nor gzip (e.g. a binary file given by
    mistake), naming the file.
    """
    path = Path(path)
    files = sorted(path.parent.glob(path.name + ".*"), key=lambda p: -_suffix_num(p))
    files = [f for f in files if _suffix_num(f) > 0] + [path]
    run = Run()
    for f in files:
        if not f.exists():
            continue
        for line in _lines(f):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
                kind = obj.pop("type")
                if kind == "run":
                    run.meta = obj
                elif kind == "step":
                    run.steps.append(StepReport.from_dict(obj))
                elif kind == "flag":
                    run.flags.append(Flag.from_dict(obj))
            except (ValueError, KeyError, TypeError, AttributeError):
                run.bad_lines += 1
    if not files[-1].exists() and len(files) == 1:
        raise FileNotFoundError(path)
    return run


def _lines(path: Path) -> Iterator[str]:
    """The text lines of a plain or gzip-compressed file (told apart by gzip's magic bytes)."""
    with open(path, "rb") as raw:
        compressed = raw.read(2) == b"\x1f\x8b"
    try:
        with (gzip.open(path, "rt", encoding="utf-8") if compressed
              else open(path, encoding="utf-8")) as fh:
            yield from fh
    except UnicodeDecodeError as e:
        what = "its decompressed content is not UTF-8 text" if compressed else "it is not UTF-8 text"
        raise RunLogError(f"{path} is not a fadiag run log: {what} (byte "
                          f"{e.object[e.start]:#04x}); expected JSON lines (fadiag-rank<R>.jsonl) "
                          "or gzip-compressed JSON lines (.jsonl.gz)") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise RunLogError(f"{path} is not a readable gzip file ({e}); expected JSON lines "
                          "(fadiag-rank<R>.jsonl) or gzip-compressed JSON lines (.jsonl.gz)") from None


def _suffix_num(p: Path) -> int:
    """N of a rotated file ``X.N`` or ``X.N.gz``; 0 for anything else."""
    tail = p.name.removesuffix(".gz").rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else 0
