"""CUDA graph replays counted for the dispatcher tap (capture/tap.py).

The tap sees a graph's attention ops once, while the graph is captured, and takes no marks then;
each replay runs them again unseen. So captures and replays are watched: a graph's captured calls
are counted once per replay (the tap's `cuda_graph` reason), and while a capture is under way the
Python wrappers take no marks (`tap.capturing`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .patcher import Patcher


def watch_cuda_graphs(tap: Any, patcher: Patcher, captured: Callable[[], int]) -> None:
    """Patch torch.cuda.CUDAGraph's capture and replay for `tap` (its `capturing` flag and
    `cuda_graph_calls` count); `captured()`: the tap's calls seen in captures (cumulative).
    `patcher.restore()` undoes it."""
    graph_class = getattr(torch.cuda, "CUDAGraph", None)
    if graph_class is None or not torch.cuda.is_available():
        return
    calls: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
    start = [0]
    begin, end, replay = (getattr(graph_class, n) for n in ("capture_begin", "capture_end",
                                                             "replay"))

    def capture_begin(graph: Any, *args: Any, **kwargs: Any) -> Any:
        tap.capturing = True
        start[0] = captured()
        return begin(graph, *args, **kwargs)

    def capture_end(graph: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return end(graph, *args, **kwargs)
        finally:
            tap.capturing = False
            n = captured() - start[0]
            if n:
                calls[graph] = n

    def graph_replay(graph: Any, *args: Any, **kwargs: Any) -> Any:
        tap.cuda_graph_calls += calls.get(graph, 0)
        return replay(graph, *args, **kwargs)

    patcher.replace(graph_class, "capture_begin", capture_begin)
    patcher.replace(graph_class, "capture_end", capture_end)
    patcher.replace(graph_class, "replay", graph_replay)
