"""Installing capture: the op table's Python wrappers, instrument()'d ops, HF transformers'
attention registry, and the dispatcher tap.

Every wrapper's body is the recorder's `wrap()`; the tap, once its extension is built or loaded,
is handed to the recorder, whose steps take in its calls, and SDPA's Python wrapper gives way to
a builtin (eager.py) whose steady call runs no Python. `restore()` and `uninstall_tap()` undo it
all; the session decides when.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..config import Config
from . import eager
from .attention_op import AttentionOp, first_tensor
from .device import available
from .ops import OPS, quick_sdpa, read_hf, reader_for_layout, resolve_target
from .patcher import Patcher
from .tap import Tap
from .tap import supported as tap_supported

log = logging.getLogger("fadiag")

HF_REGISTRY_MODULE = "transformers.modeling_utils"
"""Where HF keeps its attention registry: once it is imported, `wrap_transformers` can run (the
session looks for it in sys.modules at each step boundary until then)."""


class Interceptors:
    """What attach() patches and installs, and how to take it back.

    Example::

        capture = Interceptors(config, recorder, on_error)
        capture.install(instrumented=[])
        capture.start_tap()
        ...
        capture.restore()
        capture.uninstall_tap()
    """

    def __init__(self, config: Config, recorder: Any,
                 on_error: Callable[[str, BaseException], None]):
        self.config = config
        self.recorder = recorder
        self._on_error = on_error
        self._patcher = Patcher()
        self.hf_wrapped = False
        self.closed = False
        """Set first thing by the session's close(): a build finishing later installs nothing."""
        self.tap_status = "off" if config.tap == "off" else "not loaded"
        """The dispatcher tap: "installed", "loading", "off", "not loaded" or "unavailable: …"."""
        self.eager_wrapper = "python"
        """SDPA's eager wrapper: "native" (the builtin of eager.py) or "python" (with why, where
        the builtin was wanted and not used)."""
        self._sdpa: list[tuple[AttentionOp, Any, str, Any, Any]] = []
        """(op, owner, attribute, original, Python wrapper) for each SDPA function wrapped."""
        self._builtins: list[Any] = []
        self._ext: Any = None
        self._forget_undo: Callable[[], None] | None = None
        self._frames_at_attach = eager.dynamo_frames()

    def labels(self) -> dict[str, str]:
        """fadiag_capture_info's labels: the tap's state and the eager wrapper's kind, without
        their reasons (those are in the log and `fadiag doctor`)."""
        return {"tap": self.tap_status.partition(":")[0],
                "eager_wrapper": self.eager_wrapper.partition(" ")[0]}

    # ---- Python wrappers -------------------------------------------------------------------

    def install(self, instrumented: list[tuple[Any, str | None, str, int | None,
                                               int | str | None]]) -> None:
        """Wrap every enabled op of the table, each instrument()'d op, and HF's registry."""
        icfg = self.config.interceptors
        for op in OPS:
            if getattr(icfg, op.config_key):
                self._patch_op(op, import_missing=op.config_key != "sdpa")
                if op.install is not None:
                    op.install(self._patcher, self.recorder)
        for fn, name, layout, heads, causal_arg in instrumented:
            self.instrument(fn, name, layout, heads, causal_arg)
        self.wrap_transformers()

    def _patch_op(self, op: AttentionOp, import_missing: bool) -> None:
        done: set[int] = set()
        for target in op.targets:
            found = resolve_target(target, import_missing)
            if found is None:
                continue
            owner, attr = found
            original = getattr(owner, attr)
            if (getattr(original, "__wrapped_by_fadiag__", False) or eager.is_builtin(original)
                    or id(original) in done):
                continue
            inner = op.prepare(original) if op.prepare else original
            wrapper = self.recorder.wrap(inner, op)
            self._patcher.replace(owner, attr, wrapper)
            self._patcher.alias_builtin(original, wrapper)
            done.add(id(original))
            if self.config.interceptors.rebind_imported:
                self._patcher.rebind_everywhere(original, wrapper)
            if op.quick is quick_sdpa:
                self._sdpa.append((op, owner, attr, inner, wrapper))

    def instrument(self, fn: Any, name: str | None, layout: str, heads: int | None,
                   causal_arg: int | str | None = None) -> Any:
        """Wrap the user's own op (see `fadiag.instrument`); returns what replaces it."""
        impl = name or getattr(fn, "__name__", "custom")
        op = AttentionOp(name=f"instrument:{impl}", config_key="", targets=(),
                         read=reader_for_layout(layout, heads, fn, causal_arg), impl=impl,
                         output=first_tensor)
        if isinstance(fn, type) and issubclass(fn, torch.autograd.Function):
            base_apply = torch.autograd.Function.apply.__func__  # type: ignore[attr-defined]
            own = fn.__dict__.get("apply")
            inner = own.__func__ if isinstance(own, classmethod) else base_apply

            def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
                return inner(cls, *args, **kwargs)

            eager.never_compiled(apply.__code__, callees=False)  # as the wrapper (recorder.py)

            wrapped = self.recorder.wrap(apply, op)
            self._patcher.replace(fn, "apply", classmethod(wrapped))
            return fn
        wrapper = self.recorder.wrap(fn, op)
        self._patcher.rebind_everywhere(fn, wrapper)
        return wrapper

    def wrap_transformers(self) -> None:
        """Wrap HF's attention registry entries (except "sdpa", which reaches the patched SDPA)."""
        if self.hf_wrapped or not self.config.interceptors.transformers:
            return
        mu = sys.modules.get(HF_REGISTRY_MODULE)
        registry = getattr(mu, "ALL_ATTENTION_FUNCTIONS", None)
        if registry is None:
            return
        self.hf_wrapped = True
        store = getattr(registry, "_global_mapping", registry)
        for key in list(store):
            fn = store[key]
            if key == "sdpa" or getattr(fn, "__wrapped_by_fadiag__", False):
                continue
            # HF's flex entry runs torch.compile(flex_attention) (plain flex only inside a graph).
            impl = "flash_attn" if "flash" in key else "flex" if key == "flex_attention" else key
            op = AttentionOp(name=f"transformers:{key}", config_key="transformers", targets=(),
                             read=read_hf, impl=impl, output=first_tensor,
                             tap_times=impl == "flash_attn")
            self._patcher.replace_item(store, key, self.recorder.wrap(fn, op))

    def restore(self) -> None:
        """Put back every function and registry entry replaced, exactly."""
        self._patcher.restore()
        if self._forget_undo is not None:
            self._forget_undo()
            self._forget_undo = None
        self.recorder.use_builtins(None, [])
        for fn in self._builtins:  # a reference kept anywhere calls the original from now on
            self._ext.eager_bind(fn, None, None, None)
        self._builtins.clear()
        self._sdpa.clear()

    # ---- SDPA's builtin wrapper ------------------------------------------------------------

    def _use_builtins(self, ext: Any) -> None:
        """Put SDPA's builtin (eager.py) where its Python wrapper is, once the tap times calls.

        Not where dynamo compiled a frame since attach: that code is guarded on the Python
        wrapper, and a new function in its place would recompile it."""
        why = eager.unavailable(ext)
        if why is None and eager.dynamo_frames() != self._frames_at_attach:
            why = "torch.compile traced code with the Python wrapper first"
        if why is not None:
            self.eager_wrapper = f"python ({why})"
            log.info("fadiag: eager SDPA calls keep the Python wrapper (%s): each learned call "
                     "costs two Python frames more", why)
            return
        self._ext = ext
        rebind = self.config.interceptors.rebind_imported
        for op, owner, attr, original, wrapper in self._sdpa:
            fn = eager.builtin(ext, original)
            ext.eager_bind(fn, wrapper, self.recorder, op)
            self._builtins.append(fn)
            self._patcher.replace(owner, attr, fn)
            self._patcher.alias_builtin(original, fn)
            if rebind:
                self._patcher.rebind_everywhere(wrapper, fn)
        if self._builtins:
            self.eager_wrapper = "native"
            self._forget_undo = eager.on_failure(self._python_again)
            self.recorder.use_builtins(ext, self._builtins)

    def _python_again(self) -> None:
        """Dynamo refused the builtins: the Python wrappers go back in their place (a builtin
        dynamo does not know would break its graph)."""
        self.recorder.use_builtins(None, [])
        for _, owner, attr, _, wrapper in self._sdpa:
            if eager.is_builtin(getattr(owner, attr, None)):
                setattr(owner, attr, wrapper)
        if self.config.interceptors.rebind_imported:
            for fn, (_, _, _, _, wrapper) in zip(self._builtins, self._sdpa, strict=False):
                self._patcher.rebind_everywhere(fn, wrapper)
        self.eager_wrapper = f"python ({eager.unavailable(self._ext)})"

    # ---- the dispatcher tap ----------------------------------------------------------------

    def start_tap(self) -> None:
        """The dispatcher tap for attention no Python wrapper sees (tap.py), as `tap` says."""
        mode = self.config.tap
        if mode == "off":
            return
        why = tap_supported()
        if why is not None:
            self._tap_unavailable(why)
            return
        from . import native

        kind = "cuda" if available("cuda") else "cpu"  # the tap's ops: CPU and CUDA kernels
        # `auto` loads a fresh cached build here too (~0.1 s): installed at attach, the tap sees
        # the first step's compiled attention, which a tap installed at the first boundary misses
        # with nothing to tell it from a step without attention. Only a build goes to the
        # background.
        if mode == "on" or native.status(kind) == "not built" and native.fresh(kind):
            ext = native.load(kind)
            if ext is None:
                self._tap_unavailable(native.status(kind))
            else:
                self._install_tap(ext)
            return
        self.tap_status = "loading"
        attaching = threading.get_ident()

        def ready(ext: Any) -> None:
            if threading.get_ident() == attaching:  # already loaded: install now
                self._install_tap(ext)
            elif not self.closed:  # on the build thread: install on the training thread
                self.recorder.pending = lambda: self._install_late(ext)

        native.load_in_background(kind, ready)
        if native.status(kind).startswith("unavailable"):
            self._tap_unavailable(native.status(kind))
        elif self.tap_status == "loading":
            log.info("fadiag: building the native extension for %s in the background (its first use "
                     "with this torch and fadiag; a minute or more): attention in torch.compile'd "
                     "code is measured from the first step boundary after it", kind)

    def _install_late(self, ext: Any) -> None:
        """The tap built in the background, installed at a step boundary: say from which step,
        and warn where torch.compile'd code ran before it (its attention went unseen)."""
        self._install_tap(ext)
        if self.tap_status != "installed":
            return
        step = self.recorder.step_index
        if eager.dynamo_frames() != self._frames_at_attach:
            log.warning("fadiag: dispatcher tap installed at step %d; attention in torch.compile'd "
                        "code before it was not measured (the native extension was building)", step)
        else:
            log.info("fadiag: dispatcher tap installed at step %d", step)

    def _install_tap(self, ext: Any) -> None:
        if self.closed or self.recorder.tap is not None:
            return
        if not getattr(ext, "tap", False):
            self._tap_unavailable("the native extension was built without it (torch < 2.9)")
            return
        try:
            devices = self.recorder.devices
            timers = {k: t for k in ("cpu", "cuda") if (t := devices.native_timer(k, ext))}
            tap = Tap(ext, self.config.steps.max_calls_per_step,
                      self.config.steps.record_no_grad, timers)
            tap.install()
        except Exception as e:
            self._on_error("tap install", e)
            self._tap_unavailable(f"{type(e).__name__}: {e}")
            return
        tap.set_measuring(self.recorder.measuring)
        self.recorder.set_tap(tap)
        self.tap_status = "installed"
        try:
            self._use_builtins(ext)
        except Exception as e:  # the Python wrappers stay: every call is measured as before
            self._on_error("eager builtin", e)
            self.eager_wrapper = f"python ({type(e).__name__}: {e})"

    def _tap_unavailable(self, why: str) -> None:
        self.tap_status = f"unavailable: {why.removeprefix('unavailable: ')}"
        log.warning("fadiag: the dispatcher tap is unavailable (%s): attention in torch.compile'd "
                    "code is not measured; eager code is measured as usual", why)

    def uninstall_tap(self) -> None:
        """Restore the ops' own kernels (the recorder no longer cuts the tap's records)."""
        tap = self.recorder.tap
        self.recorder.set_tap(None)
        if tap is not None:
            try:
                tap.uninstall()
            except Exception as e:
                self._on_error("tap uninstall", e)
