"""An eager `torch.cuda.graph` capture with fadiag attached, on a CUDA GPU: does it survive?

torch.cuda.graph captures in "global" mode by default, where a timing event recorded or a stream
or event queried on any thread invalidates the capture. Three warm-up steps are measured, a step
whose marks wait behind a 0.5 s sleep is closed (so the resolver polls them from its thread while
the capture runs), then an SDPA call is captured (with a 1 s host sleep inside the capture) and
replayed. Prints one line: whether the capture succeeded, fadiag's errors and what it counted.

    python benchmarks/graph_capture.py [--marks tap|native|python] [--no-relax]

`--no-relax` leaves the resolver thread in the default capture mode (as before fadiag set it
relaxed: capture/timers.py relax_capture_mode), to show what that mode does to the capture.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fadiag  # noqa: E402
import fadiag.steps.resolver as resolver  # noqa: E402
from tests.models import capture_behind_a_pending_step  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--marks", choices=["tap", "native", "python"], default="tap")
    p.add_argument("--no-relax", action="store_true")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/graph_capture.py needs a CUDA device")
    if a.no_relax:
        resolver.relax_capture_mode = lambda: False
    session = fadiag.attach(port=0, native="off" if a.marks == "python" else "on",
                            tap="on" if a.marks == "tap" else "off")
    try:
        capture_behind_a_pending_step(session, replays=1)
        result = "capture ok"
    except Exception as e:
        result = f"capture FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    fadiag.step()
    flushed = session.flush(10)
    counted = {k: v for k, v in session.recorder.unmeasured_totals().items() if v}
    print(f"marks={a.marks} relax={int(not a.no_relax)}: {result}; errors={session.errors} "
          f"flush={flushed} unmeasured={counted}", flush=True)
    fadiag.detach()


if __name__ == "__main__":
    main()
