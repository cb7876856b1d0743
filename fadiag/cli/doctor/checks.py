"""`fadiag doctor`: what this machine can run — torch build, devices, SDPA backends, packages.

Backend verdicts come from torch's own checks, with the warnings those checks emit as the reason.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import platform
import re
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PACKAGES = ("flash_attn", "torch_npu", "transformers", "lightning", "pytorch_lightning",
            "prometheus_client")
_TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)\.?\s*$")


@dataclass(frozen=True, kw_only=True)
class Query:
    """The attention call to check backends for, in SDPA's (B, H, S, D) layout.

    Example::

        report = diagnose(Query(device="cpu", seq_len=4096, heads=16, head_dim=128))
        report["sdpa"]["backends"]["cpu_flash"]["usable"]
    """

    device: str = "cpu"
    batch: int = 1
    heads: int = 16
    seq_len: int = 2048
    head_dim: int = 128
    dtype: str = "float32"
    causal: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq_len", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


def diagnose(query: Query, build_native: bool = False) -> dict[str, Any]:
    """Everything `fadiag doctor` reports, as plain JSON-able data."""
    from ...version import __version__

    devices = _devices()
    return {
        "fadiag": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _torch_build(),
        "devices": devices,
        "sdpa": _sdpa(query, devices),
        "native": _native(devices, build_native),
        "tap": _tap(devices),
        "packages": {name: _package(name) for name in PACKAGES},
    }


def _native(devices: dict[str, Any], build: bool) -> dict[str, Any]:
    """The native marks per device kind: built (cached), and with `build`, built or why not."""
    from ...capture import native

    kinds = ["cpu"] + (["cuda"] if devices.get("cuda", {}).get("available") else [])
    out: dict[str, Any] = {"toolchain": native.toolchain()}
    for kind in kinds:
        if build:
            native.load(kind)
        out[kind] = {"cached": native.cached(kind), "fresh": native.fresh(kind),
                     "status": native.status(kind)}
    return out


def _tap(devices: dict[str, Any]) -> dict[str, Any]:
    """The dispatcher tap (attention in torch.compile'd code): what it would wrap here, and why
    it cannot run where it cannot."""
    from ...capture import native
    from ...capture.tap import supported
    from ...capture.tap_ops import specs

    kind = "cuda" if devices.get("cuda", {}).get("available") else "cpu"
    why = supported()
    status = native.status(kind)
    if why is None and status.startswith("unavailable"):
        why = f"the native extension for {kind}: {status.removeprefix('unavailable: ')}"
    elif why is None and status == "not built" and not native.fresh(kind):
        built = "older than its sources" if native.cached(kind) else "not built yet"
        why = (f"the native extension is {built}: the first attach() builds it in the background "
               "and compiled attention is measured from the step after; `fadiag doctor "
               "--build-native` builds it now")
    ops = sorted(f"{s['name']} [{', '.join(s['backends'])}]" for s in specs()) if supported() is None else []
    return {"kind": kind, "usable": why is None, "why_not": why, "ops": ops}


def _torch_build() -> dict[str, Any]:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "version": torch.__version__,
        "git": torch.version.git_version,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "cudnn": cudnn,
        "debug": torch.version.debug,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }


def _devices() -> dict[str, Any]:
    # A read-only listing for the report; training-time device access stays in fadiag.capture.device.
    out: dict[str, Any] = {"cpu": {"available": True, "logical_cores": os.cpu_count()}}
    out["cuda"] = _accelerator(torch.cuda if torch.cuda.is_available() else None)
    npu_error = None
    try:
        import torch_npu  # noqa: F401  - registers torch.npu
    except ImportError as e:
        npu_error = f"torch_npu not importable: {e}"
    npu = getattr(torch, "npu", None)
    out["npu"] = _accelerator(npu if npu is not None and npu.is_available() else None)
    if npu_error and not out["npu"]["available"]:
        out["npu"]["reason"] = npu_error
    return out


def _accelerator(module: Any) -> dict[str, Any]:
    if module is None:
        return {"available": False, "count": 0, "devices": []}
    found = []
    for i in range(module.device_count()):
        props = module.get_device_properties(i)
        entry: dict[str, Any] = {"index": i, "name": str(module.get_device_name(i)),
                                 "memory_bytes": int(getattr(props, "total_memory", 0))}
        if hasattr(props, "major"):
            entry["capability"] = f"{props.major}.{props.minor}"
        found.append(entry)
    return {"available": True, "count": len(found), "devices": found}


def _sdpa(query: Query, devices: dict[str, Any]) -> dict[str, Any]:
    kind = query.device
    out: dict[str, Any] = {"query": asdict(query), "enabled": _enabled_flags()}
    if not devices.get(kind, {}).get("available"):
        out["error"] = f"device {kind!r} is not available on this machine"
        out["backends"] = {}
        return out
    if kind == "cpu":
        out.update(_sdpa_cpu(query))
    elif kind == "cuda":
        out.update(_sdpa_cuda(query))
    else:
        out["backends"] = {"npu_fusion": {
            "usable": True, "reasons": [],
            "note": "SDPA on Ascend routes to torch_npu.npu_fusion_attention; "
                    "torch has no ahead-of-time check for its limits",
        }}
        out["chosen"] = "npu_fusion"
    return out


def _enabled_flags() -> dict[str, bool]:
    b = torch.backends.cuda
    return {
        "flash": b.flash_sdp_enabled(),
        "efficient": b.mem_efficient_sdp_enabled(),
        "cudnn": b.cudnn_sdp_enabled(),
        "math": b.math_sdp_enabled(),
    }


def _inputs(query: Query, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of the query's shape that cost one row each: expanded along the sequence."""
    dtype = DTYPES[query.dtype]
    base = torch.empty(query.batch, query.heads, 1, query.head_dim, device=device, dtype=dtype,
                       requires_grad=True)
    x = base.expand(query.batch, query.heads, query.seq_len, query.head_dim)
    return x, x, x


def _sdpa_cpu(query: Query) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend

    q, k, v = _inputs(query, "cpu")
    choice = int(torch._fused_sdp_choice(q, k, v, None, query.dropout, query.causal))
    flash_usable = choice == int(SDPBackend.FLASH_ATTENTION.value)
    reasons = [] if flash_usable else _cpu_flash_reasons(query)
    if not flash_usable and not reasons and not torch.backends.cuda.flash_sdp_enabled():
        reasons = ["disabled by torch.backends.cuda.enable_flash_sdp(False) or sdpa_kernel()"]
    return {
        "chosen": "cpu_flash" if flash_usable else "math",
        "backends": {
            "cpu_flash": {"usable": flash_usable, "reasons": reasons},
            "math": {"usable": True, "reasons": []},
        },
        "note": "CPU builds have two SDPA kernels: the fused flash kernel and the math path",
    }


def _cpu_flash_reasons(query: Query) -> list[str]:
    """Force the CPU flash kernel on a tiny call with the same properties; torch says why not.

    The CPU checks look at dtype, head dim, dropout, mask and strides — none at sequence length —
    so one row stands in for the whole shape.
    """
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x = torch.zeros(1, 1, 2, query.head_dim, dtype=DTYPES[query.dtype], requires_grad=True)

    def attempt() -> None:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(x, x, x, dropout_p=query.dropout, is_causal=query.causal)

    _, reasons = _captured(attempt)
    return reasons


def _sdpa_cuda(query: Query) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend

    b = torch.backends.cuda
    q, k, v = _inputs(query, "cuda")
    params = b.SDPAParams(q, k, v, None, query.dropout, query.causal, False)
    checks: dict[str, Callable[..., bool]] = {
        "flash": b.can_use_flash_attention,
        "efficient": b.can_use_efficient_attention,
        "cudnn": b.can_use_cudnn_attention,
    }
    backends: dict[str, Any] = {}
    for name, check in checks.items():
        usable, reasons = _captured(functools.partial(check, params, True))
        backends[name] = {"usable": bool(usable), "reasons": [] if usable else reasons}
    backends["math"] = {"usable": True, "reasons": []}
    choice = int(torch._fused_sdp_choice(q, k, v, None, query.dropout, query.causal))
    names = {int(SDPBackend.FLASH_ATTENTION.value): "flash",
             int(SDPBackend.EFFICIENT_ATTENTION.value): "efficient",
             int(SDPBackend.CUDNN_ATTENTION.value): "cudnn",
             int(SDPBackend.MATH.value): "math"}
    return {"chosen": names.get(choice, f"backend {choice}"), "backends": backends}


def _captured(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """Run fn, returning its result (None if it raised) and the warnings torch emitted, cleaned."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn()
        except RuntimeError as e:
            result = None
            last = str(e).strip()
        else:
            last = ""
    reasons = []
    for w in caught:
        text = _TRIGGERED.sub("", str(w.message)).strip()
        if text and not text.endswith("because:"):
            reasons.append(text)
    if not reasons and last:
        reasons.append(last)
    return result, reasons


def _package(name: str) -> dict[str, Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a deprecation notice is not a failure to import
            module = importlib.import_module(name)
    except ImportError as e:
        installed = _dist_version(name)
        if installed is None:
            return {"importable": False, "version": None, "error": "not installed"}
        return {"importable": False, "version": installed, "error": f"{type(e).__name__}: {e}"}
    except Exception as e:  # a broken install raises anything (ABI mismatch, missing driver)
        return {"importable": False, "version": _dist_version(name),
                "error": f"{type(e).__name__}: {e}"}
    version = getattr(module, "__version__", None) or _dist_version(name)
    return {"importable": True, "version": None if version is None else str(version), "error": None}


def _dist_version(name: str) -> str | None:
    for dist in (name, name.replace("_", "-")):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def format_text(report: dict[str, Any]) -> str:
    """The human-readable form of `diagnose()`'s result."""
    t = report["torch"]
    lines = [
        f"fadiag {report['fadiag']}  python {report['python']}  {report['platform']}",
        f"torch {t['version']} (git {t['git'][:10]})  cuda {t['cuda'] or '-'}  "
        f"cudnn {t['cudnn'] or '-'}  hip {t['hip'] or '-'}  cpu {t['cpu_capability']}  "
        f"threads {t['threads']}",
        "",
        "devices",
    ]
    for kind, d in report["devices"].items():
        if kind == "cpu":
            lines.append(f"  cpu   available, {d['logical_cores']} logical cores")
        elif not d["available"]:
            lines.append(f"  {kind:<5} not available" + (f" ({d['reason']})" if d.get("reason") else ""))
        else:
            for dev in d["devices"]:
                cap = f", sm {dev['capability']}" if "capability" in dev else ""
                lines.append(f"  {kind}:{dev['index']} {dev['name']}, "
                             f"{dev['memory_bytes'] / 2**30:.1f} GiB{cap}")
    s = report["sdpa"]
    qy = s["query"]
    lines += ["", f"sdpa on {qy['device']} for B={qy['batch']} H={qy['heads']} S={qy['seq_len']} "
                  f"D={qy['head_dim']} {qy['dtype']} causal={qy['causal']} dropout={qy['dropout']}"]
    if "error" in s:
        lines.append(f"  {s['error']}")
    for name, b in s["backends"].items():
        lines.append(f"  {name:<10} {'usable' if b['usable'] else 'not usable'}")
        lines += [f"      - {r}" for r in b["reasons"]]
        if b.get("note"):
            lines.append(f"      {b['note']}")
    if "chosen" in s:
        lines.append(f"  torch would run: {s['chosen']}")
    off = [k for k, v in s["enabled"].items() if not v]
    if off:
        lines.append(f"  disabled by torch.backends.cuda flags: {', '.join(off)}")
    n = report["native"]
    tc = n["toolchain"]
    lines += ["", f"native marks (compiler {tc['compiler'] or 'not found'}, "
                  f"ninja {tc['ninja'] or 'not found'})"]
    for kind, st in n.items():
        if kind != "toolchain":
            built = "built" if st["fresh"] else (
                "built, older than its sources (rebuilt at the next use)" if st["cached"] else "not built")
            lines.append(f"  {kind:<5} {built}"
                         + ("" if st["status"] == "not built" else f"; {st['status']}"))
    t = report["tap"]
    lines += ["", f"dispatcher tap (torch.compile'd attention) on {t['kind']}: "
                  + ("ready" if t["usable"] else f"not ready: {t['why_not']}")]
    lines += [f"  {op}" for op in t["ops"]]
    lines += ["", "packages"]
    for name, p in report["packages"].items():
        if p["importable"]:
            lines.append(f"  {name:<18} {p['version'] or '(no version)'}")
        else:
            lines.append(f"  {name:<18} - {p['error']}")
    return "\n".join(lines)
