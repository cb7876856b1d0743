"""How the resolver schedules its work: each pass waits for backward windows, within bounds."""

from __future__ import annotations

import threading
import time
import types

import pytest

from fadiag.steps import resolver as resolver_mod
from fadiag.steps.resolver import Resolver


class WindowTimer:
    """A native timer as the resolver sees it: a backward window that opens when told to."""

    kind = "cuda"

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.waits = 0

    def pool_size(self) -> int:
        return 1

    def window(self) -> bool:
        return self.opened.is_set()

    def wait_window(self, seconds: float) -> bool:
        self.waits += 1
        return self.opened.wait(seconds)

    def wake_window(self) -> None:
        pass


def resolver_with(timer: WindowTimer) -> tuple[Resolver, list[object]]:
    r = Resolver(rank=0, history=10, open_calls=list, on_report=lambda report: None,
                 on_tick=lambda age: None, on_error=lambda where, e: None,
                 native_timers=lambda: [timer])
    resolved: list[object] = []

    def resolve(step: object) -> bool:
        resolved.append(step)
        return True

    r._try_resolve = resolve  # type: ignore[method-assign]
    return r, resolved


def test_a_step_older_than_the_defer_bound_still_waits_for_a_window(monkeypatch):
    # With a wake every 0.5 s the oldest pending step closed ~0.5 s ago: the wait is bounded from
    # when it starts, so it still waits, here for a window that opens meanwhile (the bound is
    # wide: a busy machine may start the opener late).
    monkeypatch.setattr(resolver_mod, "_DEFER_S", 30.0)
    timer = WindowTimer()
    r, resolved = resolver_with(timer)
    old = types.SimpleNamespace(closed=time.monotonic() - 10.0)
    r._pending.append(old)
    opener = threading.Timer(0.05, timer.opened.set)
    opener.start()
    try:
        r._resolve_pending()
    finally:
        opener.cancel()
    assert resolved == [old] and timer.waits >= 1 and timer.window()


def test_a_pass_whose_wait_gave_up_resolves_the_rest_without_waiting_again(monkeypatch):
    # No window comes (evaluation, the end of training): one bounded wait, then every pending step
    # is resolved in order, not one wait of _DEFER_S each.
    monkeypatch.setattr(resolver_mod, "_DEFER_S", 0.01)
    timer = WindowTimer()
    r, resolved = resolver_with(timer)
    r._pending.extend(["step 1", "step 2", "step 3"])
    r._resolve_pending()
    assert resolved == ["step 1", "step 2", "step 3"]
    assert not r._pending
    waits = timer.waits
    r._pending.extend(["step 4"])  # the next pass waits again
    r._resolve_pending()
    assert resolved[-1] == "step 4" and timer.waits > waits


def test_while_a_window_is_open_a_pass_resolves_every_pending_step_and_answers_flush():
    timer = WindowTimer()
    timer.opened.set()
    r, resolved = resolver_with(timer)
    flushed = threading.Event()
    r._pending.extend(["step 1", "step 2", flushed, "step 3"])
    r._resolve_pending()
    assert resolved == ["step 1", "step 2", "step 3"] and flushed.is_set()
    assert timer.waits == 0  # the window was open at each step: nothing waited


@pytest.mark.parametrize("ask", ["flush", "stop"])
def test_flush_and_stop_end_a_wait_for_a_window(ask, monkeypatch):
    monkeypatch.setattr(resolver_mod, "_DEFER_S", 60.0)
    timer = WindowTimer()
    r, _ = resolver_with(timer)
    (r._hurry if ask == "flush" else r._stop).set()
    assert not r._await_window()  # at once, with no window: not after _DEFER_S
    assert timer.waits == 0
