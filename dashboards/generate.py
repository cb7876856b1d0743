"""Builds fadiag's Grafana dashboards, the JSON files beside this script.

    python dashboards/generate.py           # rewrite fadiag-overview.json and fadiag-sites.json
    python dashboards/generate.py --check   # exit 1 when a committed file differs from its source

Edit the dashboards here, not in the JSON; tests check that the JSON equals this script's output.
Every query goes through the `datasource` template variable, so the files provision as they are.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION = 39
RATE = "$__rate_interval"

SEL = 'job=~"$job", instance=~"$instance", rank=~"$rank"'
SITE_SEL = SEL + ', site=~"$site"'
BY_RANK = "job, instance, rank"

Panel = dict[str, Any]


# --- building blocks --------------------------------------------------------------------------


def target(expr: str, legend: str = "", *, instant: bool = False, table: bool = False) -> dict:
    t: dict[str, Any] = {
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": expr,
        "legendFormat": legend or "__auto",
        "range": not instant,
        "instant": instant,
    }
    if table:
        t["format"] = "table"
    return t


def thresholds(*steps: tuple[str, float | None]) -> dict:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in steps]}


def timeseries(
    title: str,
    description: str,
    targets: list[dict],
    *,
    unit: str,
    w: int = 12,
    h: int = 8,
    threshold: tuple[float, bool] | None = None,
    min_: float | None = None,
    bars: bool = False,
    stack: bool = False,
    overrides: list[dict] | None = None,
) -> Panel:
    """A time series panel; `threshold=(value, high_is_bad)` draws a dashed line at value."""
    custom: dict[str, Any] = {
        "drawStyle": "bars" if bars else "line",
        "lineWidth": 1,
        "fillOpacity": 60 if bars else 10,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        "thresholdsStyle": {"mode": "off"},
    }
    steps = thresholds(("green", None))
    if threshold is not None:
        value, high_is_bad = threshold
        custom["thresholdsStyle"] = {"mode": "dashed"}
        steps = (
            thresholds(("green", None), ("red", value))
            if high_is_bad
            else thresholds(("red", None), ("green", value))
        )
    defaults: dict[str, Any] = {
        "unit": unit,
        "color": {"mode": "palette-classic"},
        "custom": custom,
        "thresholds": steps,
    }
    if min_ is not None:
        defaults["min"] = min_
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "_size": (w, h),
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": targets,
    }


def stat(
    title: str,
    description: str,
    expr: str,
    *,
    unit: str,
    steps: dict | None = None,
    w: int = 6,
    h: int = 4,
) -> Panel:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "_size": (w, h),
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "color": {"mode": "thresholds"},
                "thresholds": steps or thresholds(("green", None)),
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": "auto",
        },
        "targets": [target(expr)],
    }


def table(title: str, description: str, targets: list[dict], *, hide: list[str], w: int = 24, h: int = 6) -> Panel:
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "_size": (w, h),
        "fieldConfig": {"defaults": {"custom": {"align": "auto"}}, "overrides": []},
        "options": {"showHeader": True, "cellHeight": "sm", "footer": {"show": False, "reducer": ["sum"]}},
        "targets": targets,
        "transformations": [
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {"excludeByName": {name: True for name in hide}}},
        ],
    }


def state_timeline(title: str, description: str, targets: list[dict], *, w: int = 12, h: int = 8) -> Panel:
    return {
        "type": "state-timeline",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "_size": (w, h),
        "fieldConfig": {
            "defaults": {
                "color": {"mode": "thresholds"},
                "thresholds": thresholds(("green", None), ("red", 1)),
                "mappings": [
                    {
                        "type": "value",
                        "options": {
                            "0": {"text": "ok", "color": "green", "index": 0},
                            "1": {"text": "flagged", "color": "red", "index": 1},
                        },
                    }
                ],
                "custom": {"fillOpacity": 70, "lineWidth": 0},
            },
            "overrides": [],
        },
        "options": {
            "showValue": "never",
            "mergeValues": True,
            "alignValue": "left",
            "rowHeight": 0.9,
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "single", "sort": "none"},
        },
        "targets": targets,
    }


def row(title: str) -> Panel:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "_size": (24, 1)}


def dashed(name_regex: str) -> dict:
    """An override drawing the series whose display name matches as a dashed line."""
    return {
        "matcher": {"id": "byRegexp", "options": name_regex},
        "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}],
    }


def layout(panels: list[Panel]) -> list[Panel]:
    """Assign ids, refIds and gridPos left to right, wrapping at Grafana's 24 columns."""
    x = y = row_h = 0
    out = []
    for pid, p in enumerate(panels, start=1):
        w, h = p.pop("_size")
        if x + w > 24:
            x, y, row_h = 0, y + row_h, 0
        p = {"id": pid, "gridPos": {"h": h, "w": w, "x": x, "y": y}, **p}
        for i, t in enumerate(p.get("targets", [])):
            t["refId"] = chr(ord("A") + i)
        out.append(p)
        x += w
        row_h = max(row_h, h)
        if x >= 24:
            x, y, row_h = 0, y + row_h, 0
    return out


def query_var(name: str, label: str, query: str, *, sort: int = 1) -> dict:
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "refresh": 2,
        "regex": "",
        "sort": sort,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "hide": 0,
    }


def variables(*extra: dict) -> list[dict]:
    return [
        {
            "type": "datasource",
            "name": "datasource",
            "label": "Data source",
            "query": "prometheus",
            "regex": "",
            "current": {},
            "options": [],
            "refresh": 1,
            "hide": 0,
            "includeAll": False,
            "multi": False,
        },
        query_var("job", "Job", "label_values(fadiag_steps_total, job)"),
        query_var("instance", "Instance", 'label_values(fadiag_steps_total{job=~"$job"}, instance)'),
        query_var(
            "rank", "Rank", 'label_values(fadiag_steps_total{job=~"$job", instance=~"$instance"}, rank)', sort=3
        ),
        *extra,
    ]


def dashboard(uid: str, title: str, description: str, panels: list[Panel], templating: list[dict]) -> dict:
    return {
        "id": None,
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["fadiag", "attention", "pytorch"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "weekStart": "",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "templating": {"list": templating},
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                },
                {
                    "datasource": DATASOURCE,
                    "enable": True,
                    "hide": False,
                    "iconColor": "red",
                    "name": "fadiag flags",
                    "expr": f"sum by (rank, rule) (increase(fadiag_flags_total{{{SEL}}}[{RATE}])) > 0",
                    "step": "1m",
                    "titleFormat": "{{rule}} flagged",
                    "textFormat": "rank {{rank}}",
                    "useValueForTime": False,
                },
            ]
        },
        "links": [
            {
                "type": "dashboards",
                "title": "fadiag",
                "tags": ["fadiag"],
                "asDropdown": False,
                "includeVars": True,
                "keepTime": True,
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "panels": layout(panels),
    }


def per_step(metric: str, sel: str = SEL) -> str:
    """Mean seconds of `metric` (a per-call histogram) per training step, by rank."""
    return (
        f"sum by ({BY_RANK}) (rate({metric}_sum{{{sel}}}[{RATE}]))\n"
        f"  / sum by ({BY_RANK}) (rate(fadiag_steps_total{{{sel}}}[{RATE}]))"
    )


STEP_MEAN = (
    f"sum by ({BY_RANK}) (rate(fadiag_step_attention_seconds_sum{{{SEL}}}[{RATE}]))\n"
    f"  / sum by ({BY_RANK}) (rate(fadiag_step_attention_seconds_count{{{SEL}}}[{RATE}]))"
)
# STEP_MEAN with each rank's run_id (from fadiag_run_info), to compare ranks within a run.
BY_RUN = f"(\n  {STEP_MEAN}\n) * on({BY_RANK}) group_left(run_id) fadiag_run_info"


# --- the overview -----------------------------------------------------------------------------


def overview() -> dict:
    panels: list[Panel] = [
        row("Run"),
        stat(
            "Steps per second",
            "Optimizer steps per second fadiag resolved, summed over the selected ranks.",
            f"sum(rate(fadiag_steps_total{{{SEL}}}[{RATE}]))",
            unit="suffix: steps/s",
        ),
        stat(
            "Active flags",
            "Flag episodes of severity warning or critical active now (fadiag_flag_active), over "
            "all rules and the selected ranks. 0 is healthy; info flags (a ratio within what its "
            "kernel measures when healthy) are not counted; the Flags row shows which rule.",
            f'sum(fadiag_flag_active{{{SEL}, severity!="info"}})',
            unit="none",
            steps=thresholds(("green", None), ("red", 1)),
        ),
        stat(
            "Ranks exporting",
            "Selected ranks whose fadiag endpoint answers (fadiag_run_info series). Compare with "
            "the world size in the table below.",
            f"count(fadiag_run_info{{{SEL}}})",
            unit="none",
        ),
        stat(
            "Oldest unfinished attention call",
            "Largest age, over the selected ranks, of an attention call the device has not "
            "finished. Near 0 while training; growing without bound is a hang (alert at 5 min).",
            f"max(fadiag_attention_oldest_inflight_seconds{{{SEL}}})",
            unit="s",
            steps=thresholds(("green", None), ("orange", 60), ("red", 300)),
        ),
        table(
            "Ranks",
            "One row per rank: run id, world size, host and device (fadiag_run_info), the "
            "fadiag build serving it (fadiag_build_info), and what sees its attention "
            "(fadiag_capture_info): a compiled model's steps report no calls where the tap is not "
            "installed.",
            [
                target(f"fadiag_run_info{{{SEL}}}", instant=True, table=True),
                target(
                    f"fadiag_build_info * on(job, instance) group_right(version, torch, device) "
                    f"group by (job, instance, rank) (fadiag_run_info{{{SEL}}})",
                    instant=True,
                    table=True,
                ),
                target(f"fadiag_capture_info{{{SEL}}}", instant=True, table=True),
            ],
            hide=["Time", "Value #A", "Value #B", "Value #C", "__name__", "job"],
        ),
        row("Attention time"),
        timeseries(
            "Attention forward time per step",
            "Seconds of attention forward per training step, by rank: the forward time of every "
            "attention call over the number of steps in the interval (device time).",
            [target(per_step("fadiag_attention_forward_seconds"), "rank {{rank}}")],
            unit="s",
            min_=0,
        ),
        timeseries(
            "Attention backward time per step",
            "Seconds of attention backward per training step, by rank: the backward time of every "
            "attention call over the number of steps in the interval (device time).",
            [target(per_step("fadiag_attention_backward_seconds"), "rank {{rank}}")],
            unit="s",
            min_=0,
        ),
        timeseries(
            "Backward / forward ratio",
            "Attention backward seconds over forward seconds of every call measured in the "
            "interval, by rank (what the ratio alert judges over 5 minutes). The dashed line is "
            "the 3x rule; fused kernels stay near 2-2.5x.",
            [
                target(
                    f"sum by ({BY_RANK}) (rate(fadiag_attention_backward_seconds_sum{{{SEL}}}[{RATE}]))\n"
                    f"  / sum by ({BY_RANK}) (rate(fadiag_attention_forward_seconds_sum{{{SEL}}}[{RATE}]))",
                    "rank {{rank}}",
                )
            ],
            unit="suffix:x",
            threshold=(3, True),
            min_=0,
        ),
        timeseries(
            "Step attention time vs baseline",
            "Attention seconds (forward + backward) of the last resolved step at each scrape, by "
            "rank, and the regression baseline fadiag holds for it (dashed: rolling median or "
            "baseline file, for that step's shapes and the sites the file covers). The "
            "regression alert fires while fadiag's regression flag is open (sustained, beyond "
            "the warm-up's spread) and shows the 5-minute median of their ratio "
            "(fadiag_attention_regression_ratio).",
            [
                target(
                    f"fadiag_step_attention_forward_seconds{{{SEL}}}\n"
                    f"  + fadiag_step_attention_backward_seconds{{{SEL}}}",
                    "rank {{rank}}",
                ),
                target(f"fadiag_attention_baseline_seconds{{{SEL}}}", "baseline rank {{rank}}"),
            ],
            unit="s",
            min_=0,
            overrides=[dashed("baseline.*")],
        ),
        row("Memory"),
        timeseries(
            "Memory savings vs standard attention",
            "1 - kept / standard in the last resolved step, by rank: the share of standard "
            "attention's saved-for-backward memory that attention did not keep. The dashed line "
            "is the 80% rule; about 50% or less means the math path ran.",
            [target(f"fadiag_attention_memory_savings_ratio{{{SEL}}}", "rank {{rank}}")],
            unit="percentunit",
            threshold=(0.8, False),
        ),
        timeseries(
            "Kept vs standard bytes",
            "Bytes attention kept from forward for backward in the last step (solid), and what "
            "standard unfused attention would keep for the same calls (dashed), by rank.",
            [
                target(f"fadiag_attention_kept_bytes{{{SEL}}}", "kept rank {{rank}}"),
                target(f"fadiag_attention_standard_bytes{{{SEL}}}", "standard rank {{rank}}"),
            ],
            unit="bytes",
            min_=0,
            overrides=[dashed("standard.*")],
        ),
        timeseries(
            "Peak memory",
            "Allocator peak over the whole last step (solid) and the peak attention itself "
            "added above its starting level (dashed), by rank.",
            [
                target(f"fadiag_step_peak_memory_bytes{{{SEL}}}", "step rank {{rank}}"),
                target(f"fadiag_attention_peak_bytes{{{SEL}}}", "attention rank {{rank}}"),
            ],
            unit="bytes",
            min_=0,
            overrides=[dashed("attention.*")],
            w=24,
        ),
        row("Flags and calls"),
        timeseries(
            "Flags raised by rule",
            "Flags fadiag raised in each interval, by rule (backward_forward_ratio, "
            "memory_savings, regression, hang), over the selected ranks.",
            [target(f"sum by (rule) (increase(fadiag_flags_total{{{SEL}}}[{RATE}]))", "{{rule}}")],
            unit="short",
            bars=True,
            stack=True,
            min_=0,
        ),
        state_timeline(
            "Active flags by rank and rule",
            "Red while a flag episode is active (fadiag_flag_active = 1) for that rank and rule.",
            [target(f"max by (rank, rule) (fadiag_flag_active{{{SEL}}})", "rank {{rank}} {{rule}}")],
        ),
        timeseries(
            "Attention calls per second by implementation",
            "Attention calls per second by the backend that really ran (flash, efficient, cudnn, "
            "math, cpu_flash, npu_fusion, flash_attn, ...), over the selected ranks. Any math "
            "calls on a GPU are a fallback worth explaining.",
            [target(f"sum by (impl) (rate(fadiag_attention_calls_total{{{SEL}}}[{RATE}]))", "{{impl}}")],
            unit="ops",
            stack=True,
            min_=0,
        ),
        timeseries(
            "Host-bound attention calls per second by implementation",
            "Measured calls whose device window may hold host time: the device reached the "
            "window before the host had queued all of the op's work — idle when it opened, dry "
            "inside it, or done before it closed (a starved device: a small batch, or "
            "checkpointing's recomputation queued by Python) — and may have waited inside it for "
            "the host. Their seconds are an upper bound, and ratios and the ratio rule leave "
            "them out. 0 when the device runs ahead of the host, as in GPU-bound training; a "
            "share of the calls panel's rate here means the ratios rest on the other calls.",
            [target(f"sum by (impl) (rate(fadiag_attention_host_bound_calls_total{{{SEL}}}[{RATE}]))",
                    "{{impl}}")],
            unit="ops",
            min_=0,
        ),
        timeseries(
            "Uninstrumented attention calls per second",
            "Attention calls fadiag saw but did not measure, by reason: sampling (steps left out "
            "by sampling.every_n_steps), per_step_cap (calls beyond steps.max_calls_per_step), "
            "other_device (calls on an accelerator that is not the process's current device), "
            "cuda_graph (calls replayed inside CUDA graphs, per replay), graph_capture (an "
            "eager call captured into one, without the dispatcher tap), graph_capture_backward "
            "(a measured forward whose backward was captured into one), flex_compiled and "
            "flex_compiled_backward (flex_attention inside a compiled graph, per graph run), "
            "compiling, no_grad (evaluation forwards), untapped (calls of a bypassed eager "
            "step that no fused op served, such as SDPA's math path), unpaired_backward, "
            "unreadable and unrecorded (the dispatcher tap's exceptions). Normally 0 or only the "
            "configured "
            "sampling; compiled models whose graphs replay under CUDA graphs show cuda_graph.",
            [
                target(
                    f"sum by (reason) (rate(fadiag_attention_uninstrumented_calls_total{{{SEL}}}[{RATE}]))",
                    "{{reason}}",
                )
            ],
            unit="ops",
            min_=0,
        ),
        row("Progress and ranks"),
        timeseries(
            "Steps per second",
            "Training steps per second fadiag resolved, by rank. A dip on one rank only points "
            "at that rank; a dip on all ranks is the job (data loading, checkpointing, evaluation).",
            [target(f"sum by ({BY_RANK}) (rate(fadiag_steps_total{{{SEL}}}[{RATE}]))", "rank {{rank}}")],
            unit="suffix: steps/s",
            w=8,
            min_=0,
        ),
        timeseries(
            "Hang: oldest unfinished attention call",
            "Age of the oldest attention call the device has not finished, by rank (0 when none). "
            "The dashed line is the 5-minute hang alert.",
            [target(f"fadiag_attention_oldest_inflight_seconds{{{SEL}}}", "rank {{rank}}")],
            unit="s",
            threshold=(300, True),
            w=8,
            min_=0,
        ),
        timeseries(
            "Time since last step",
            "Seconds since each rank last resolved a step (fadiag_last_step_timestamp_seconds). "
            "Grows during evaluation, checkpointing and hangs.",
            [target(f"time() - fadiag_last_step_timestamp_seconds{{{SEL}}}", "rank {{rank}}")],
            unit="s",
            w=8,
            min_=0,
        ),
        timeseries(
            "Straggler: step attention time vs fastest rank",
            "Each rank's mean attention seconds per step over the fastest rank of the same run "
            "(run_id of fadiag_run_info; 1 = fastest), as the straggler alert computes it. The "
            "dashed line is that alert's 1.3x.",
            [target(f"{BY_RUN}\n/ on(run_id) group_left()\nmin by (run_id) (\n  {BY_RUN}\n)",
                    "rank {{rank}} ({{run_id}})")],
            unit="suffix:x",
            threshold=(1.3, True),
        ),
        timeseries(
            "Step attention time by rank (p50, p90)",
            "Median (solid) and 90th percentile (dashed) of attention seconds per step, by rank, "
            "from the fadiag_step_attention_seconds histogram (as precise as its buckets).",
            [
                target(
                    f"histogram_quantile(0.5, sum by ({BY_RANK}, le) "
                    f"(rate(fadiag_step_attention_seconds_bucket{{{SEL}}}[{RATE}])))",
                    "p50 rank {{rank}}",
                ),
                target(
                    f"histogram_quantile(0.9, sum by ({BY_RANK}, le) "
                    f"(rate(fadiag_step_attention_seconds_bucket{{{SEL}}}[{RATE}])))",
                    "p90 rank {{rank}}",
                ),
            ],
            unit="s",
            min_=0,
            overrides=[dashed("p90.*")],
        ),
        timeseries(
            "fadiag internal errors per second",
            "Errors fadiag caught inside itself (counted and logged once; training never sees "
            "them), by rank. Anything above 0 is worth a bug report with the log.",
            [target(f"sum by ({BY_RANK}) (rate(fadiag_internal_errors_total{{{SEL}}}[{RATE}]))", "rank {{rank}}")],
            unit="ops",
            w=12,
            h=6,
            min_=0,
        ),
        timeseries(
            "fadiag's resolver CPU per step",
            "CPU time of fadiag's resolver thread (marks to seconds, the reports, the rules, the "
            "sinks) per resolved step, by rank: fadiag's own cost beside training. Where the host "
            "is the bottleneck (a launch-bound step) it adds to the step time; set "
            "sampling.reports_per_second there (every call still timed) or "
            "sampling.every_n_steps.",
            [target(f"sum by ({BY_RANK}) (rate(fadiag_resolver_cpu_seconds_total{{{SEL}}}[{RATE}]))\n"
                    f"  / sum by ({BY_RANK}) (rate(fadiag_steps_total{{{SEL}}}[{RATE}]))",
                    "rank {{rank}}")],
            unit="s",
            w=12,
            h=6,
            min_=0,
        ),
    ]
    return dashboard(
        "fadiag-overview",
        "fadiag / Attention overview",
        "Attention forward and backward time, memory savings, flags and stragglers per training rank, "
        "from fadiag's exporter.",
        panels,
        variables(),
    )


# --- per-site drill-down ----------------------------------------------------------------------


def by_site(metric: str, agg: str) -> str:
    return f"sum by ({agg}) (rate({metric}{{{SITE_SEL}}}[{RATE}]))"


def site_mean(kind: str, agg: str = "site") -> str:
    m = f"fadiag_attention_{kind}_seconds"
    return f"{by_site(m + '_sum', agg)}\n  / {by_site(m + '_count', agg)}"


def site_quantile(kind: str, q: float) -> str:
    return f"histogram_quantile({q}, {by_site(f'fadiag_attention_{kind}_seconds_bucket', 'site, le')})"


def sites() -> dict:
    panels: list[Panel] = [
        table(
            "Sites",
            "Each attention call site (layer) with the backend that ran there: calls per second "
            "and mean forward and backward seconds per call over the dashboard's interval.",
            [
                target(by_site("fadiag_attention_forward_seconds_count", "site, impl"), instant=True, table=True),
                target(site_mean("forward", "site, impl"), instant=True, table=True),
                target(site_mean("backward", "site, impl"), instant=True, table=True),
            ],
            hide=["Time"],
            h=8,
        ),
        timeseries(
            "Forward time per call by site",
            "Mean device seconds of one attention forward call, by call site.",
            [target(site_mean("forward"), "{{site}}")],
            unit="s",
            min_=0,
        ),
        timeseries(
            "Backward time per call by site",
            "Mean device seconds of one attention backward, by call site.",
            [target(site_mean("backward"), "{{site}}")],
            unit="s",
            min_=0,
        ),
        timeseries(
            "Forward p90 per call by site",
            "90th percentile of attention forward seconds per call, by site (histogram buckets).",
            [target(site_quantile("forward", 0.9), "{{site}}")],
            unit="s",
            min_=0,
        ),
        timeseries(
            "Backward p90 per call by site",
            "90th percentile of attention backward seconds per call, by site (histogram buckets).",
            [target(site_quantile("backward", 0.9), "{{site}}")],
            unit="s",
            min_=0,
        ),
        timeseries(
            "Backward / forward ratio by site",
            "Backward seconds over forward seconds of each call site in the interval. The dashed "
            "line is the 3x rule; one site far above the others points at its backend or shape.",
            [
                target(
                    f"{by_site('fadiag_attention_backward_seconds_sum', 'site')}\n"
                    f"  / {by_site('fadiag_attention_forward_seconds_sum', 'site')}",
                    "{{site}}",
                )
            ],
            unit="suffix:x",
            threshold=(3, True),
            min_=0,
        ),
        timeseries(
            "Attention seconds per step by site",
            "Forward plus backward seconds each site adds to a training step (stacked: the total "
            "is the step's attention time), averaged over the selected ranks.",
            [
                target(
                    f"(\n  {by_site('fadiag_attention_forward_seconds_sum', 'site')}\n"
                    f"  + {by_site('fadiag_attention_backward_seconds_sum', 'site')}\n)\n"
                    f"/ on() group_left() sum(rate(fadiag_steps_total{{{SEL}}}[{RATE}]))",
                    "{{site}}",
                )
            ],
            unit="s",
            stack=True,
            min_=0,
        ),
        timeseries(
            "Calls per second by site and implementation",
            "Attention forward calls per second at each site, by the backend that ran. A site "
            "that switches backend mid-run shows as two series.",
            [target(by_site("fadiag_attention_forward_seconds_count", "site, impl"), "{{site}} {{impl}}")],
            unit="ops",
            w=24,
            min_=0,
        ),
    ]
    site_var = query_var(
        "site",
        "Site",
        'label_values(fadiag_attention_forward_seconds_count{job=~"$job", instance=~"$instance", rank=~"$rank"}, site)',
    )
    return dashboard(
        "fadiag-sites",
        "fadiag / Attention by call site",
        "Per call site (layer) attention time, ratio and backend. Needs the site label: "
        "exporter.per_site: true in fadiag's configuration.",
        panels,
        variables(site_var),
    )


DASHBOARDS = {"fadiag-overview.json": overview, "fadiag-sites.json": sites}


def render() -> dict[str, str]:
    """File name -> JSON text, exactly as committed."""
    return {name: json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = HERE / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)}; run python dashboards/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
