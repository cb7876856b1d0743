"""A 16-layer HF Llama on a CUDA GPU with and without non-reentrant gradient checkpointing: fadiag's
per-site backward/forward ratio in both, and the largest per-site difference.

Needs `transformers`. Prints one JSON object.

    python benchmarks/hf_checkpointing.py [--steps 8] [--batch 2] [--seq 2048] [--marks tap]

`--marks`: what times the calls — `tap` (the default once the native marks are built: the
dispatcher tap), `native` (the wrapper's C++ marks, tap off) or `python` (its Python marks).

Steps after the third are read. A site's ratio in the report is its device-bound windows' (a
window the device spent waiting for the host's launches holds host time, CallRecord.host_bound);
`every_window_*` divides every window, host-bound ones too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from marks_first import marks_first  # noqa: E402

import fadiag  # noqa: E402
from fadiag.rules.engine import ratio_calls  # noqa: E402
from fadiag.steps.records import ratio, summarize  # noqa: E402

MARKS = {"tap": {}, "native": {"native": "on", "tap": "off"}, "python": {"native": "off", "tap": "off"}}


def ratios(args: argparse.Namespace, checkpointing: bool) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                      max_position_embeddings=args.seq, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).cuda().to(torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    tokens = torch.randint(0, 32000, (args.batch, args.seq), device="cuda")
    session = fadiag.attach(**{"exporter.enabled": False}, **MARKS[args.marks])
    try:
        for _ in range(args.steps):
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert session.flush(60)
        per_site: dict[str, list[float]] = {}  # the report's: its device-bound windows
        every_window: dict[str, list[float]] = {}  # host-bound windows too
        judged: dict[str, list[float]] = {}  # the ratio rule's: no probe, no host-bound window
        seconds: dict[str, list[float]] = {"forward": [], "recompute_forward": [], "backward": []}
        calls = recomputed = host_bound = 0
        for r in session.history()[3:]:
            calls += len(r.calls)
            recomputed += sum(c.recompute for c in r.calls)
            host_bound += r.host_bound_calls
            for s in summarize(ratio_calls(r.calls)):
                if s.ratio is not None:
                    judged.setdefault(s.site, []).append(s.ratio)
            for c in r.calls:
                seconds["recompute_forward" if c.recompute else "forward"].append(c.forward_seconds)
                if c.backward_seconds:
                    seconds["backward"].append(c.backward_seconds)
            for s in r.sites():
                if s.ratio is not None:
                    per_site.setdefault(s.site, []).append(s.ratio)
                every = ratio(s.backward_seconds, s.ratio_forward_seconds)
                if every is not None:
                    every_window.setdefault(s.site, []).append(every)
        # Each flag with its step and worst site, and each read step's per-site ratios: a flag
        # on one step among steady ones can then be traced to the site and step that raised it.
        flags = [(f.rule, f.severity, round(f.value, 2), f.step, f.message)
                 for r in session.history() for f in r.flags]
        by_step = {r.step: {s.site: round(s.ratio, 3) for s in r.sites() if s.ratio is not None}
                   for r in session.history()}
        tap = session.recorder.tap
        tap_backwards = tap.backward_starts() if tap is not None else 0  # calls the tap timed
    finally:
        fadiag.detach()
        del model, opt
        torch.cuda.empty_cache()
    medians = {k: statistics.median(v) for k, v in per_site.items()}
    read = max(1, len(session.history()[3:]))
    return {"sites": len(medians), "calls_per_step": calls / read,
            "recomputed_per_step": recomputed / read,
            # None: no site had a device-bound window in the read steps (all host-bound).
            "ratio_min": min(medians.values(), default=None),
            "ratio_max": max(medians.values(), default=None),
            "per_site": medians, "flags": flags[:20], "ratios_by_step": by_step,
            "every_window_per_site": {k: statistics.median(v) for k, v in every_window.items()},
            "steps_per_site": {k: len(v) for k, v in per_site.items()},
            "host_bound_per_step": host_bound / read,
            "judged_per_site": {k: statistics.median(v) for k, v in judged.items()},
            "judged_steps_per_site": {k: len(v) for k, v in judged.items()},
            "median_ms": {k: round(statistics.median(v) * 1e3, 4) for k, v in seconds.items() if v},
            "tap_timed_backwards": tap_backwards, "marks": session.devices.marks()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--marks", choices=sorted(MARKS), default="tap")
    args = p.parse_args()
    marks = marks_first()  # before attach(): measured with the native marks from the first step
    try:
        import transformers
    except ImportError:
        sys.exit("benchmarks/hf_checkpointing.py needs transformers")
    plain, ckpt = ratios(args, False), ratios(args, True)
    def max_diff(key: str) -> float | None:
        diffs = [abs(ckpt[key][k] / v - 1) for k, v in plain[key].items() if k in ckpt[key]]
        return max(diffs) if diffs else None

    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"),
                      "command": " ".join(sys.argv), "native_marks": marks, "plain": plain, "non_reentrant": ckpt,
                      # The report's per-site ratios (device-bound windows; a site with none in
                      # the read steps has no ratio, and is listed in sites_only_in_one).
                      "max_rel_diff": max_diff("per_site"),
                      "every_window_max_rel_diff": max_diff("every_window_per_site"),
                      # What the ratio rule judges: host-bound calls left out (0 sites: none left).
                      "judged_max_rel_diff": max_diff("judged_per_site"),
                      "judged_sites": [len(plain["judged_per_site"]), len(ckpt["judged_per_site"])],
                      "sites_only_in_one": sorted(set(plain["per_site"]) ^ set(ckpt["per_site"]))},
                     indent=1))


if __name__ == "__main__":
    main()
