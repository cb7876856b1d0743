"""The eager SDPA wrapper as a builtin function (capture/_native/eager.cpp), known to dynamo.

Once the dispatcher tap times eager calls, the Python wrapper of SDPA is replaced by a builtin
whose steady call runs no Python frame; every other call it hands to the Python wrapper. Dynamo
must trace the builtin as the function it wraps: each is registered with
`torch.compiler.substitute_in_graph` (a polyfill that calls the original), at once where dynamo
is imported, else right after its import, before anything can be traced. Dynamo's registry keys
a builtin by id, so each is made once per wrapped function and kept for the process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable
from types import CodeType, ModuleType
from typing import Any

import torch

log = logging.getLogger("fadiag")

_DYNAMO = "torch._dynamo"
_lock = threading.Lock()
_made: dict[int, tuple[Any, Any]] = {}
"""id(original) -> (original, its builtin), for the process."""
_builtins: set[int] = set()
"""Their ids (each builtin lives as long as the process)."""
_waiting: list[tuple[Any, Any]] = []
"""(builtin, original) made before dynamo was imported: registered by the import hook."""
_on_failure: list[Callable[[], None]] = []
"""What to undo if a registration fails (an unregistered builtin would break dynamo's graph)."""
_failure: str | None = None
_frames: set[CodeType] = set()
"""Code of fadiag's that dynamo is told never to compile as a frame of its own (never_compiled)."""
_frames_waiting: list[tuple[CodeType, bool]] = []


def unavailable(ext: Any) -> str | None:
    """Why the builtin cannot be used with `ext` (the native extension), or None."""
    if not hasattr(ext, "eager_wrapper"):
        return "the native extension was built without it (Python < 3.11)"
    if not hasattr(torch.compiler, "substitute_in_graph"):
        return "this torch has no torch.compiler.substitute_in_graph"
    return _failure


def builtin(ext: Any, original: Any) -> Any:
    """The builtin wrapping `original` (made once; registered with dynamo now or at its import).

    Raises where dynamo refuses it; `unavailable` then says why, and no builtin is used again."""
    global _failure
    with _lock:
        made = _made.get(id(original))
        if made is not None:
            return made[1]
        fn = ext.eager_wrapper(original, torch.compiler)
        # Kept even if refused: dynamo's registry may hold its id already.
        _made[id(original)] = (original, fn)
        _builtins.add(id(fn))
        if _DYNAMO not in sys.modules:
            _waiting.append((fn, original))
            _hook_dynamo_import()
            return fn
    # Outside the lock: where another thread is importing dynamo, this waits for its import, and
    # that import's hook takes the lock.
    try:
        _register(fn, original)
    except Exception as e:
        _failure = _refused(e)
        raise
    return fn


def never_compiled(code: CodeType, *, callees: bool) -> None:
    """Dynamo never compiles a frame of `code` as its own, and with `callees` none of the frames it
    calls either; it still inlines `code` into a graph it traces. Now where dynamo is imported,
    else right after its import.

    A wrapper's first test, whether dynamo is tracing, folds to True in what dynamo compiles. A
    graph break inside the wrapped call (a Function calling a C++ extension dynamo cannot trace)
    leaves the call to run eagerly, and dynamo then compiles the wrapper's frame as its own: that
    frame would pass every call through unmeasured, with nothing said. Not compiled, it measures
    the call, which runs eagerly either way; the wrapped call's own frames are compiled as without
    fadiag. fadiag's bookkeeping (`callees`) is never compiled: dynamo would break graphs in it."""
    with _lock:
        if code in _frames:
            return
        _frames.add(code)
        if _DYNAMO not in sys.modules:
            _frames_waiting.append((code, callees))
            _hook_dynamo_import()
            return
    try:
        _skip_frames([(code, callees)])
    except Exception as e:  # a torch without these hooks: such a call passes through unmeasured
        log.debug("fadiag: wrapper frames left to dynamo (%s: %s)", type(e).__name__, e)


def _skip_frames(codes: list[tuple[CodeType, bool]]) -> None:
    from torch._dynamo import eval_frame

    strategy = getattr(eval_frame, "set_code_exec_strategy", None)
    if strategy is None:  # torch < 2.6: the frame alone
        for code, _ in codes:
            eval_frame.skip_code(code)
        return
    action = eval_frame.FrameAction
    for code, callees in codes:
        strategy(code, eval_frame.FrameExecStrategy(
            action.SKIP, action.SKIP if callees else action.DEFAULT))


def _refused(e: BaseException) -> str:
    return f"dynamo refused it ({type(e).__name__}: {e})"


def is_builtin(fn: Any) -> bool:
    return id(fn) in _builtins


def dynamo_frames() -> int:
    """Frames dynamo has compiled in this process (0 where it is not imported): the builtin is put
    in place only where this has not moved since attach, since compiled code guards on the
    function it traced, and a new one would recompile it."""
    dynamo = sys.modules.get(_DYNAMO)
    utils = getattr(dynamo, "utils", None)
    counters = getattr(utils, "counters", None)
    if counters is None:
        return 0
    return sum(counters.get("frames", {}).values())


def on_failure(undo: Callable[[], None]) -> Callable[[], None]:
    """Call `undo` if registering a builtin fails; returns a function that forgets it."""
    with _lock:
        _on_failure.append(undo)

    def forget() -> None:
        with _lock:
            if undo in _on_failure:
                _on_failure.remove(undo)

    return forget


def _register(fn: Any, original: Any) -> None:
    def traced(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    traced.__name__ = traced.__qualname__ = getattr(original, "__name__", "attention")
    torch.compiler.substitute_in_graph(fn, skip_signature_check=True)(traced)


def _register_waiting() -> None:
    global _failure
    with _lock:
        waiting, _waiting[:] = list(_waiting), []
    try:
        for fn, original in waiting:
            _register(fn, original)
    except Exception as e:  # every builtin goes: dynamo would break its graph at one
        _failure = _refused(e)
        log.warning("fadiag: the eager SDPA wrapper goes back to Python: %s", _failure)
        with _lock:
            undo, _on_failure[:] = list(_on_failure), []
        for u in undo:
            u()


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Finds torch._dynamo with the finders after it, and registers the waiting builtins once its
    module has run (a finder is consulted only for a module's first import)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _DYNAMO or self not in sys.meta_path:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any):
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        try:
            self.inner.exec_module(module)
        finally:
            module.__loader__ = self.inner
            if module.__spec__ is not None:
                module.__spec__.loader = self.inner
            _unhook_dynamo_import()
        _register_waiting()
        with _lock:
            codes, _frames_waiting[:] = list(_frames_waiting), []
        try:
            _skip_frames(codes)
        except Exception as e:  # dynamo's import goes on; a wrapper it compiles passes calls through
            log.warning("fadiag: dynamo compiles fadiag's wrapper frames (%s: %s): a call that "
                        "runs eagerly behind a graph break is not measured", type(e).__name__, e)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, …: the real loader's
        return getattr(self.inner, name)


_finder = _AfterDynamoImport()


# sys.meta_path is replaced, not changed in place: another thread's import may be walking it.
def _hook_dynamo_import() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path = [_finder, *sys.meta_path]


def _unhook_dynamo_import() -> None:
    sys.meta_path = [f for f in sys.meta_path if f is not _finder]
