"""FlexAttention: how its calls are read, its block mask's sparsity, and the compiled callable.

Eager `flex_attention` runs torch's unfused path, which materializes the score matrix (impl
`flex_unfused`); the callable `torch.compile(flex_attention)` returns runs fused kernels (impl
`flex`) and is wrapped where it is made (`torch.compile`) or found (module globals, at attach()).
Flex inside a compiled model runs kernels generated into the graph: counted per graph run.
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .attention_op import AttentionOp, CallInfo, _bhsd, _opt, first_tensor
from .patcher import user_globals

MODULE = "torch.nn.attention.flex_attention"
log = logging.getLogger("fadiag")

_recorder: Any = None
"""The attached session's recorder (set through the session's Patcher, so detach() clears it)."""
_logged: set[str] = set()


def _is_compiling() -> bool:
    return False


if hasattr(torch, "compiler") and hasattr(torch.compiler, "is_compiling"):
    _is_compiling = torch.compiler.is_compiling  # noqa: F811


# ---- reading a call -----------------------------------------------------------------------

def _args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """(q, k, v, score_mod, block_mask, enable_gqa, kernel_options) as flex_attention takes them."""
    return (_opt(kwargs, args, 0, "query", None), _opt(kwargs, args, 1, "key", None),
            _opt(kwargs, args, 2, "value", None), _opt(kwargs, args, 3, "score_mod", None),
            _opt(kwargs, args, 4, "block_mask", None),
            bool(_opt(kwargs, args, 6, "enable_gqa", False)),
            _opt(kwargs, args, 8, "kernel_options", None))


def _options_key(options: Any) -> Any:
    if not options:
        return None
    try:
        return tuple(sorted(options.items()))
    except Exception:  # unhashable or unorderable values: the dict itself stands for them
        return id(options)


def quick_flex(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """q, k, v and what else changes the kernel flex builds: score_mod, block mask, GQA, options."""
    q, k, v, score_mod, block_mask, gqa, options = _args(args, kwargs)
    return q, k, v, (score_mod is not None, block_mask is not None, gqa, _options_key(options))


def _closure_tensors(fn: Any) -> list[Any]:
    """Tensors a score_mod / mask_mod closes over (document ids, biases): flex saves them for
    backward, but they are the caller's, shared by every layer, like q, k, v."""
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.Tensor):
            found.append(value)
    return found


def read_flex(args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallInfo:
    """flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, …): (B, H, S, D)."""
    q, k, v, score_mod, block_mask, _, _ = _args(args, kwargs)
    shape, dv, kvh = _bhsd(q, k, v)
    others: list[Any] = _closure_tensors(score_mod)
    if block_mask is not None:
        others += [t for t in block_mask.as_tuple() if isinstance(t, torch.Tensor)]
        others += _closure_tensors(getattr(block_mask, "mask_mod", None))
    return CallInfo(q, k, v, shape, dv, kvh, False, 0.0, "BHSD", block_mask, others)


# ---- per-call figures: the block mask's sparsity ---------------------------------------------

class FlexFigures:
    """One call's block-mask sparsity and arguments, read before its timed window and turned into
    CallRecord fields by the resolver, once the device has passed the call."""

    __slots__ = ("sparsity", "score_mod", "block_mask", "enable_gqa", "options")

    def __init__(self, sparsity: Any, score_mod: bool, block_mask: bool, enable_gqa: bool,
                 options: Any):
        self.sparsity = sparsity
        self.score_mod = score_mod
        self.block_mask = block_mask
        self.enable_gqa = enable_gqa
        self.options = options

    def resolve(self) -> dict[str, Any]:
        s = self.sparsity
        if isinstance(s, _Pending):
            s = s.value()
        detail: dict[str, Any] = {"score_mod": self.score_mod, "block_mask": self.block_mask,
                                  "enable_gqa": self.enable_gqa}
        if self.options:
            detail["kernel_options"] = {str(k): v for k, v in dict(self.options).items()}
        return {"sparsity": s, "flex": detail}


class _Pending:
    """Computed blocks counted on the device, copied to pinned host memory without a sync; read
    by the resolver after the call's marks have passed (the copy was queued before them)."""

    __slots__ = ("host", "scale")

    def __init__(self, host: torch.Tensor, scale: float):
        self.host = host
        self.scale = scale

    def value(self) -> float:
        return _clamp(1.0 - float(self.host.item()) * self.scale)


def _clamp(x: float) -> float:
    return min(1.0, max(0.0, x))


_SPARSITY_CACHE = 4
_sparsity_cache: list[tuple[weakref.ref[Any], Any]] = []
"""The sparsity of the last few BlockMask objects: a model passes the same one to every layer."""


def block_sparsity(block_mask: Any) -> Any:
    """Fraction of the score matrix's blocks the mask skips (torch's `BlockMask.sparsity()` / 100),
    without a host sync: a float on CPU, a pending device count elsewhere. 0.0 with no mask."""
    if block_mask is None:
        return 0.0
    for ref, cached in _sparsity_cache:
        if ref() is block_mask:
            return cached
    shape = block_mask.shape
    total = 1
    for n in shape:
        total *= int(n)
    bq, bk = block_mask.BLOCK_SIZE
    scale = float(bq) * float(bk) / total
    computed = block_mask.kv_num_blocks.sum()
    if block_mask.full_kv_num_blocks is not None:
        computed = computed + block_mask.full_kv_num_blocks.sum()
    value: Any
    if computed.device.type == "cpu":
        value = _clamp(1.0 - float(computed.item()) * scale)
    else:
        host = torch.empty((), dtype=computed.dtype, pin_memory=True)
        host.copy_(computed, non_blocking=True)
        value = _Pending(host, scale)
    _sparsity_cache.append((weakref.ref(block_mask), value))
    del _sparsity_cache[:-_SPARSITY_CACHE]
    return value


def flex_figures(args: tuple[Any, ...], kwargs: dict[str, Any]) -> FlexFigures:
    _, _, _, score_mod, block_mask, gqa, options = _args(args, kwargs)
    return FlexFigures(block_sparsity(block_mask), score_mod is not None, block_mask is not None,
                       gqa, options)


# ---- around the function: dynamo tracing and compiling -------------------------------------

def _graphs_compiled() -> int:
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def _count(reason: str, n: int = 1) -> None:
    rec = _recorder
    if rec is not None:
        rec.unmeasured[reason] = rec.unmeasured.get(reason, 0) + n


def prepare(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as the recorder should call it: drops the timing of a call during which dynamo
    compiled (its first call per shape: seconds of compiling, not the kernel), counting it as
    ``compiling``, and marks the call under way so the compiled graphs it runs are not counted
    as unmeasured flex."""

    @functools.wraps(fn)
    def fadiag_flex(*args: Any, **kwargs: Any) -> Any:
        global _inside
        if _is_compiling():  # traced into a larger graph: counted when that graph runs
            return fn(*args, **kwargs)
        before = _graphs_compiled()
        _inside += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            _inside -= 1
        if _graphs_compiled() != before:
            _drop_in_flight()
        return out

    fadiag_flex.__wrapped_by_fadiag__ = True  # type: ignore[attr-defined]
    return fadiag_flex


def _drop_in_flight() -> None:
    rec = _recorder
    if rec is None or not rec.depth or not rec.calls:
        return
    call = rec.calls[-1]
    if call.fwd1 is None and not call.aborted:  # the call this one runs inside, not yet ended
        call.aborted = True
        _count("compiling")


# ---- flex inside a compiled model: counted each time its graph runs -----------------------

_inside = 0
"""Flex calls fadiag measures, under way: the compiled graphs they run are theirs."""
_counting = False
"""inductor's compiled graphs count the flex calls they run (set through the session's Patcher)."""
_FORWARD = "torch.ops.higher_order.flex_attention("
_BACKWARD = "torch.ops.higher_order.flex_attention_backward("
_graphs: dict[int, tuple[Any, int, int]] = {}
"""id(graph) -> (weak reference, flex forwards, flex backwards): what one run of it holds."""
_measured_ids: set[Any] = set()
"""inductor graph ids of measured torch.compile(flex_attention) callables: the backward graph of
one (compiled at its first backward, outside the call) holds the measured call's backward."""


def _forget_graph(key: int, _ref: Any) -> None:
    _graphs.pop(key, None)


def flex_in(graph: Any) -> tuple[int, int]:
    """(flex forwards, flex backwards) one run of an inductor graph makes, read from the post-grad
    graph it lowered: inductor keeps that text with the graph in its caches, so a graph loaded
    from a cache is read like a fresh one."""
    text = (getattr(graph, "inductor_post_grad_graph_str", None)
            or getattr(graph, "runnable_graph_str", None))
    if not text:
        if "unreadable_graph" not in _logged:
            _logged.add("unreadable_graph")
            log.warning("fadiag: this torch's compiled graphs do not say which ops they lowered; "
                        "flex_attention inside torch.compile'd code is not counted")
        return 0, 0
    return text.count(_FORWARD), text.count(_BACKWARD)


def _learn(graph: Any) -> tuple[Any, int, int]:
    forwards, backwards = flex_in(graph)
    kwargs = getattr(graph, "fx_kwargs", None) or {}
    graph_id = kwargs.get("graph_id")
    if _inside:
        if graph_id is not None:
            _measured_ids.add(graph_id)
        forwards = backwards = 0
    elif kwargs.get("is_backward") and graph_id is not None and graph_id in _measured_ids:
        forwards = backwards = 0
    key = id(graph)
    entry = (weakref.ref(graph, functools.partial(_forget_graph, key)), forwards, backwards)
    _graphs[key] = entry
    if (forwards or backwards) and "flex_compiled" not in _logged:
        _logged.add("flex_compiled")
        log.warning("fadiag: flex_attention inside torch.compile'd code runs kernels generated "
                    "into the graph and is not timed; each run is counted in "
                    "fadiag_attention_uninstrumented_calls_total{reason=\"flex_compiled\"} "
                    "(forward) and {reason=\"flex_compiled_backward\"}")
    return entry


def _ran(graph: Any) -> None:
    """One run of an inductor graph: count the flex calls it holds, unless fadiag measures them."""
    entry = _graphs.get(id(graph))
    if entry is None or entry[0]() is not graph:
        entry = _learn(graph)
    if _inside:
        return
    _, forwards, backwards = entry
    if forwards:
        _count("flex_compiled", forwards)
    if backwards:
        _count("flex_compiled_backward", backwards)


def count_compiled_graphs(patcher: Any) -> None:
    """Count, per run, the flex calls of the graphs inductor compiled (made before or after now).

    A compiled graph runs its flex kernels with no dispatcher op or Python call fadiag could see;
    the graph's own call is the one place left, a Python call per graph run (not per op). It
    changes nothing dynamo or inductor compile, and runs nothing in the graphs.
    """
    module = sys.modules.get("torch._inductor.output_code")
    graph_class = getattr(module, "CompiledFxGraph", None)
    if _counting or graph_class is None:
        return
    original = graph_class.__call__
    rec = _recorder

    @functools.wraps(original)
    def __call__(self: Any, inputs: Any) -> Any:
        try:
            _ran(self)
        except Exception as e:
            rec._on_error("flex.compiled_graph", e)
        return original(self, inputs)

    patcher.replace(sys.modules[__name__], "_counting", True)
    patcher.replace(sys.modules[__name__], "_graphs", {})
    patcher.replace(sys.modules[__name__], "_measured_ids", set())
    patcher.replace(graph_class, "__call__", __call__)


# ---- torch.compile(flex_attention) ----------------------------------------------------------

def unwrapped(fn: Any) -> Any:
    while getattr(fn, "__wrapped_by_fadiag__", False):
        fn = fn.__wrapped__
    return fn


def _flex_function() -> Any:
    module = sys.modules.get(MODULE)
    return unwrapped(getattr(module, "flex_attention", None)) if module is not None else None


def _compiled_from(value: Any, flex: Any) -> bool:
    """Whether `value` is what torch.compile returned for flex_attention (not yet wrapped)."""
    return (callable(value) and not getattr(value, "__wrapped_by_fadiag__", False)
            and unwrapped(getattr(value, "_torchdynamo_orig_callable", None)) is flex)


def install(patcher: Any, recorder: Any) -> None:
    """Wrap what `torch.compile` returns for flex_attention from now on, and the compiled flex
    callables module globals already hold."""
    flex = _flex_function()
    if flex is None:
        return
    patcher.replace(sys.modules[__name__], "_recorder", recorder)
    original_compile = torch.compile

    def measured(compiled: Any) -> Any:
        return recorder.wrap(prepare(compiled), COMPILED)

    @functools.wraps(original_compile)
    def compile(model: Any = None, *args: Any, **kwargs: Any) -> Any:  # noqa: A001 - torch's name
        target = unwrapped(model) if model is not None else None
        if target is not flex or kwargs.get("disable"):
            compiled = original_compile(model, *args, **kwargs)
            if not _counting:  # torch.compile has imported inductor by now
                try:
                    count_compiled_graphs(patcher)
                except Exception as e:
                    recorder._on_error("flex.count_compiled_graphs", e)
            return compiled
        return measured(original_compile(target, *args, **kwargs))

    compile.__wrapped_by_fadiag__ = True  # type: ignore[attr-defined]
    patcher.replace(torch, "compile", compile)
    count_compiled_graphs(patcher)
    for module, attr, value in user_globals():
        if _compiled_from(value, flex):
            patcher.replace(module, attr, measured(value))


EAGER = AttentionOp(
    name="flex_attention",
    config_key="flex",
    targets=(f"{MODULE}:flex_attention",),
    read=read_flex,
    impl="flex_unfused",
    output=first_tensor,
    quick=quick_flex,
    per_call=flex_figures,
    prepare=prepare,
)
COMPILED = AttentionOp(
    name="flex_attention_compiled",
    config_key="flex",
    targets=(),
    read=read_flex,
    impl="flex",
    output=first_tensor,
    quick=quick_flex,
    per_call=flex_figures,
    install=install,
)
