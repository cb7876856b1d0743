"""The Grafana dashboards: generated from dashboards/generate.py, structurally sound, valid PromQL."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import yaml
from promstack import (
    DASHBOARD_DIR,
    PROMTOOL,
    dashboard_queries,
    dashboards,
    grafana_to_promql,
    metric_names_in,
    panels,
    run_tool,
    series_names,
)

DASHBOARDS = dashboards()
NAMES = sorted(DASHBOARDS)
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def load_generator():
    spec = importlib.util.spec_from_file_location("dashboards_generate", DASHBOARD_DIR / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_dashboards_are_shipped():
    assert NAMES == ["fadiag-overview.json", "fadiag-sites.json"]


def test_committed_json_equals_the_generator_output():
    rendered = load_generator().render()
    assert sorted(rendered) == NAMES
    for name, text in rendered.items():
        assert (DASHBOARD_DIR / name).read_text() == text, f"{name} is stale: run python dashboards/generate.py"


@pytest.mark.parametrize("name", NAMES)
def test_uid_title_and_schema(name):
    d = DASHBOARDS[name]
    assert 0 < len(d["uid"]) <= 40 and re.fullmatch(r"[a-zA-Z0-9_-]+", d["uid"])
    assert d["title"] and d["schemaVersion"] >= 36
    assert "fadiag" in d["tags"]


def test_uids_are_unique_across_dashboards():
    uids = [d["uid"] for d in DASHBOARDS.values()]
    assert len(uids) == len(set(uids))


@pytest.mark.parametrize("name", NAMES)
def test_panel_ids_are_unique_and_ref_ids_unique_per_panel(name):
    ids = [p["id"] for p in panels(DASHBOARDS[name])]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids))
    for p in panels(DASHBOARDS[name]):
        refs = [t["refId"] for t in p.get("targets", [])]
        assert all(refs) and len(refs) == len(set(refs)), p["title"]


@pytest.mark.parametrize("name", NAMES)
def test_panels_fit_in_24_columns_without_overlapping(name):
    taken: set[tuple[int, int]] = set()
    for p in panels(DASHBOARDS[name]):
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0
        assert g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells


@pytest.mark.parametrize("name", NAMES)
def test_a_datasource_variable_and_job_instance_rank_variables(name):
    variables = {v["name"]: v for v in DASHBOARDS[name]["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for var in ("job", "instance", "rank"):
        assert variables[var]["type"] == "query" and variables[var]["datasource"] == DATASOURCE


def test_sites_dashboard_has_a_site_variable_from_label_values():
    site = {v["name"]: v for v in DASHBOARDS["fadiag-sites.json"]["templating"]["list"]}["site"]
    assert site["query"]["query"].startswith("label_values(fadiag_attention_forward_seconds_count")
    assert site["query"]["query"].endswith(", site)")


@pytest.mark.parametrize("name", NAMES)
def test_every_panel_and_target_uses_the_datasource_variable(name):
    d = DASHBOARDS[name]
    for p in panels(d):
        if p["type"] == "row":
            continue
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE, p["title"]


@pytest.mark.parametrize("name", NAMES)
def test_nothing_hard_codes_a_datasource(name):
    text = (DASHBOARD_DIR / name).read_text()
    assert "${DS_" not in text and "__inputs" not in json.loads(text)
    uids = re.findall(r'"uid":\s*"([^"]*)"', text)
    allowed = {"${datasource}", "-- Grafana --", DASHBOARDS[name]["uid"]}
    assert set(uids) <= allowed


@pytest.mark.parametrize("name", NAMES)
def test_every_panel_has_a_description_and_every_graph_a_unit(name):
    for p in panels(DASHBOARDS[name]):
        if p["type"] == "row":
            continue
        assert len(p.get("description", "")) > 20, p["title"]
        if p["type"] in ("timeseries", "stat"):
            assert p["fieldConfig"]["defaults"].get("unit"), p["title"]


@pytest.mark.parametrize("name", NAMES)
def test_dashboards_read_only_contract_metrics(name):
    for where, expr in dashboard_queries(DASHBOARDS[name]):
        assert metric_names_in(expr) <= series_names(), where


def test_overview_draws_the_rule_thresholds():
    by_title = {p["title"]: p for p in panels(DASHBOARDS["fadiag-overview.json"])}

    def lines(title: str) -> list[float]:
        defaults = by_title[title]["fieldConfig"]["defaults"]
        assert defaults["custom"]["thresholdsStyle"]["mode"] != "off"
        return [s["value"] for s in defaults["thresholds"]["steps"] if s["value"] is not None]

    assert lines("Backward / forward ratio") == [3]
    assert lines("Memory savings vs standard attention") == [0.8]
    assert lines("Hang: oldest unfinished attention call") == [300]


def test_overview_covers_every_view_the_issue_asks_for():
    queries = dashboard_queries(DASHBOARDS["fadiag-overview.json"])
    exprs = " ".join(e for _, e in queries)
    # The ratio as the alert judges it: backward over forward seconds of the interval's calls.
    [ratio] = [e for where, e in queries if "'Backward / forward ratio'" in where]
    assert ratio.index("fadiag_attention_backward_seconds_sum") < ratio.index("/") < ratio.index(
        "fadiag_attention_forward_seconds_sum")
    for metric in [
        "fadiag_attention_forward_seconds_sum",
        "fadiag_attention_backward_seconds_sum",
        "fadiag_attention_memory_savings_ratio",
        "fadiag_attention_kept_bytes",
        "fadiag_attention_standard_bytes",
        "fadiag_step_peak_memory_bytes",
        "fadiag_flags_total",
        "fadiag_attention_calls_total",
        "fadiag_steps_total",
        "fadiag_attention_oldest_inflight_seconds",
        "fadiag_step_attention_seconds_sum",
    ]:
        assert metric in exprs


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: prometheus)")
def test_every_dashboard_expression_parses_as_promql(tmp_path):
    rules = []
    for name in NAMES:
        for i, (where, expr) in enumerate(dashboard_queries(DASHBOARDS[name])):
            stem = name.removesuffix(".json").replace("-", "_")
            rules.append({"record": f"dashboard:{stem}:q{i}", "expr": grafana_to_promql(expr), "labels": {"where": where}})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    r = run_tool(PROMTOOL, "check", "rules", path)
    assert r.returncode == 0, r.stdout + r.stderr
