"""The shipped Prometheus rules: valid, unit-tested with promtool, complete and consistent."""

from __future__ import annotations

import re

import pytest
from promstack import (
    ALERTS,
    PROMTOOL,
    REPO,
    RULE_TESTS,
    RULES,
    load_yaml,
    metric_names_in,
    run_tool,
    series_names,
)

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: prometheus)")

# Where the rule file points its runbook links (docs/deploy.md says how to change it).
RUNBOOK_BASE = re.findall(r"https://\S+/blob/main/", RULES.read_text())[0]
# Alerts on per-step figures must stay silent while a rank is not stepping.
STEPPING_GUARD = "and on(job, instance, rank) fadiag:steps:rate5m > 0"
UNGUARDED = {"FadiagHang", "FadiagExporterDown"}


def rules() -> list[dict]:
    return [r for g in load_yaml(RULES)["groups"] for r in g["rules"]]


def alert_rules() -> list[dict]:
    return [r for r in rules() if "alert" in r]


@needs_promtool
def test_promtool_check_rules_passes():
    r = run_tool(PROMTOOL, "check", "rules", RULES)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_rule_unit_tests_pass():
    r = run_tool(PROMTOOL, "test", "rules", RULE_TESTS, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_the_issue_names_is_shipped():
    assert {r["alert"] for r in alert_rules()} == set(ALERTS)


def test_regression_alert_has_a_baseline_form_and_a_trailing_window_form():
    exprs = [r["expr"] for r in alert_rules() if r["alert"] == "FadiagAttentionRegression"]
    assert any(e.startswith("fadiag:attention_regression_ratio:median5m") for e in exprs)
    assert any("[1h] offset 15m" in e and "unless on(job, instance, rank) last_over_time(fadiag_attention_baseline_seconds[1h])" in e
               for e in exprs)


def test_every_alert_is_unit_tested_firing_and_silent():
    tested: dict[str, set[bool]] = {}
    for group in load_yaml(RULE_TESTS)["tests"]:
        for case in group.get("alert_rule_test", []):
            tested.setdefault(case["alertname"], set()).add(bool(case["exp_alerts"]))
    assert tested == {name: {True, False} for name in ALERTS}


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: f"{r['alert']}-{r['labels'].get('baseline', r['labels'].get('cause', ''))}")
def test_alert_carries_severity_summary_description_and_a_runbook_in_the_repo(rule):
    assert rule["labels"]["severity"] in {"warning", "critical"}
    annotations = rule["annotations"]
    assert annotations["summary"].strip() and annotations["description"].strip()
    assert "$value" in annotations["description"] or "$labels" in annotations["description"]
    path = f"docs/runbooks/{rule['alert']}.md"
    assert annotations["runbook_url"] == RUNBOOK_BASE + path
    assert (REPO / path).is_file()
    assert re.fullmatch(r"\d+[smh]", rule["for"])


@pytest.mark.parametrize("rule", [r for r in alert_rules() if r["alert"] not in UNGUARDED], ids=lambda r: r["alert"])
def test_per_step_alerts_stay_silent_while_a_rank_is_not_stepping(rule):
    assert STEPPING_GUARD in " ".join(rule["expr"].split())


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r.get("alert") or r["record"])
def test_rules_read_only_contract_metrics(rule):
    assert metric_names_in(rule["expr"]) <= series_names()


def test_recording_rules_follow_the_level_metric_operations_convention():
    for r in rules():
        if "record" in r:
            assert re.fullmatch(r"fadiag:[a-z_]+:[a-z0-9_]+", r["record"]), r["record"]


def test_the_memory_runbook_says_to_lower_the_threshold_for_a_true_low_savings():
    # savings fire *below* the threshold, so quieting a true flag means lowering it
    text = (REPO / "docs/runbooks/FadiagMemorySavingsLow.md").read_text()
    assert "raise the threshold" not in text
    assert "lower the threshold" in text
