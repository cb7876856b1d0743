"""`fadiag baseline save RUN.jsonl -o FILE` and `fadiag baseline show FILE`."""

from __future__ import annotations

import argparse
import sys

from ..errors import BaselineError, RunLogError
from ..export.jsonl import read_run
from ..rules import baseline
from . import _args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("baseline", help="save or show a regression baseline",
                       description="Per-site median forward/backward seconds, keyed by site, shape, "
                                   "dtype and device, with the impl that ran, for "
                                   "rules.regression.baseline_file.")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    save = verbs.add_parser("save", help="build a baseline from a run's JSONL log")
    save.add_argument("run", type=_args.existing_file,
                      help="a fadiag-rank<R>.jsonl file (or .jsonl.gz)")
    save.add_argument("-o", "--output", type=_args.output_file, required=True,
                      help="baseline file to write (JSON)")
    save.add_argument("--skip", type=_args.integer(0), default=10,
                      help="warm-up steps to leave out (default 10)")
    save.add_argument("--device", help="device name to key by (default: the run's)")
    show = verbs.add_parser("show", help="print a baseline file")
    show.add_argument("file", type=_args.existing_file, help="a baseline file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        if args.verb == "save":
            r = read_run(args.run)
            device = args.device or str(r.meta.get("device", "cpu"))
            b = baseline.build(r.steps, device, args.skip)
            baseline.save(b, args.output)
            print(f"wrote {args.output}: {len(b.entries)} sites from {b.steps} steps on {device}")
            return 0
        b = baseline.load(args.file)
    except (BaselineError, RunLogError) as e:
        print(f"fadiag baseline: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the arguments were checked; a read or write can still fail
        print(f"fadiag baseline: {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"device: {b.device}   steps: {b.steps}")
    for key, entry in sorted(b.entries.items()):
        fwd, bwd = entry["forward_seconds"], entry["backward_seconds"]
        print(f"{key}  {entry.get('impl', '?')}  fwd {fwd * 1e3:.3f} ms  bwd {bwd * 1e3:.3f} ms  "
              f"ratio {bwd / fwd if fwd else 0:.2f}")
    return 0
