"""A real Prometheus and Alertmanager on loopback, for end-to-end tests of fadiag's rules and dashboards.

`PromStack` runs both servers on free ports with temporary configs: 1 s scrape and evaluation,
the shipped rules with every `for:` cut to a few seconds, the shipped Alertmanager routing with
its webhook pointed at a `WebhookReceiver` on loopback. Prometheus scrapes ~6 s after it starts.

    with PromStack({"fadiag": ["127.0.0.1:9464"]}) as stack:
        alert = stack.wait_for(lambda: stack.firing_alerts("FadiagMemorySavingsLow"), timeout=40)
        stack.webhook.wait_for_alert("FadiagMemorySavingsLow")

Also the shared helpers of the deploy tests: repository paths, the metrics contract, the
promtool/amtool runners and the PromQL found in the dashboards.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import yaml

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "fadiag-rules.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "fadiag-rules.test.yml"
PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
ALERTMANAGER_CONFIG = REPO / "deploy" / "alertmanager" / "alertmanager.yml"
DASHBOARD_DIR = REPO / "dashboards"

PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
PROMTOOL = shutil.which("promtool")
AMTOOL = shutil.which("amtool")
NICE = shutil.which("nice")
TASKSET = shutil.which("taskset")

ALERTS = (
    "FadiagBackwardForwardRatioHigh",
    "FadiagMemorySavingsLow",
    "FadiagAttentionRegression",
    "FadiagStraggler",
    "FadiagHang",
    "FadiagExporterDown",
)

# The metrics contract: name -> (type, label names fadiag sets; Prometheus adds job and instance).
# Per-call histograms also carry `site` when exporter.per_site is on.
CONTRACT: dict[str, tuple[str, frozenset[str]]] = {
    name: (kind, frozenset(labels))
    for name, kind, labels in [
        ("fadiag_attention_forward_seconds", "histogram", {"rank", "impl"}),
        ("fadiag_attention_backward_seconds", "histogram", {"rank", "impl"}),
        ("fadiag_step_attention_seconds", "histogram", {"rank"}),
        ("fadiag_step_attention_forward_seconds", "gauge", {"rank"}),
        ("fadiag_step_attention_backward_seconds", "gauge", {"rank"}),
        ("fadiag_attention_backward_forward_ratio", "gauge", {"rank"}),
        ("fadiag_attention_memory_savings_ratio", "gauge", {"rank"}),
        ("fadiag_attention_kept_bytes", "gauge", {"rank"}),
        ("fadiag_attention_standard_bytes", "gauge", {"rank"}),
        ("fadiag_attention_peak_bytes", "gauge", {"rank"}),
        ("fadiag_step_peak_memory_bytes", "gauge", {"rank"}),
        ("fadiag_attention_baseline_seconds", "gauge", {"rank"}),
        ("fadiag_attention_regression_ratio", "gauge", {"rank"}),
        ("fadiag_steps_total", "counter", {"rank"}),
        ("fadiag_attention_calls_total", "counter", {"rank", "impl"}),
        ("fadiag_attention_host_bound_calls_total", "counter", {"rank", "impl"}),
        ("fadiag_attention_uninstrumented_calls_total", "counter", {"rank", "reason"}),
        ("fadiag_flags_total", "counter", {"rank", "rule"}),
        ("fadiag_flag_active", "gauge", {"rank", "rule", "severity"}),
        ("fadiag_attention_oldest_inflight_seconds", "gauge", {"rank"}),
        ("fadiag_internal_errors_total", "counter", {"rank"}),
        ("fadiag_resolver_cpu_seconds_total", "counter", {"rank"}),
        ("fadiag_last_step_timestamp_seconds", "gauge", {"rank"}),
        ("fadiag_build_info", "gauge", {"version", "torch", "device"}),
        ("fadiag_run_info", "gauge", {"rank", "run_id", "world_size", "hostname", "device_name"}),
        ("fadiag_capture_info", "gauge", {"rank", "tap", "eager_wrapper"}),
    ]
}
FLAG_RULES = ("backward_forward_ratio", "memory_savings", "regression", "hang")


def series_names() -> set[str]:
    """Every series name the contract puts on the wire (histograms as _bucket, _sum, _count)."""
    names = set()
    for name, (kind, _) in CONTRACT.items():
        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
    return names


def metric_names_in(expr: str) -> set[str]:
    """fadiag series names an expression reads (recording-rule names `fadiag:...` excluded)."""
    return set(re.findall(r"(?<![\w:])fadiag_[a-z_]+\b", expr))


def run_tool(*args: str | Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, check=False
    )


def load_yaml(path: Path) -> Any:
    with open(path) as f:
        return yaml.safe_load(f)


# --- PromQL in dashboards ---------------------------------------------------------------------

GRAFANA_INTERVALS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def grafana_to_promql(expr: str, variable_value: str = ".*") -> str:
    """Substitute Grafana's interval macros and template variables so Prometheus can run it."""
    for macro, value in GRAFANA_INTERVALS.items():
        expr = expr.replace(macro, value)
    return re.sub(r"\$\{?\w+\}?", variable_value, expr)


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def panels(dashboard: dict) -> Iterator[dict]:
    for p in dashboard.get("panels", []):
        yield p
        yield from p.get("panels", [])  # collapsed rows hold their panels


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target, annotation and variable query of a dashboard."""
    out = []
    for p in panels(dashboard):
        for t in p.get("targets", []):
            out.append((f"panel {p['id']} {p['title']!r} target {t['refId']}", t["expr"]))
    for a in dashboard.get("annotations", {}).get("list", []):
        if "expr" in a:
            out.append((f"annotation {a['name']!r}", a["expr"]))
    for v in dashboard.get("templating", {}).get("list", []):
        if v["type"] != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"label_values\((.+),\s*\w+\)", q)
        out.append((f"variable {v['name']!r}", m.group(1) if m else q))
    return out


# --- the servers ------------------------------------------------------------------------------


def pinned(argv: list[str], cpus: Iterable[int] | None) -> list[str]:
    """argv run on the given CPUs only (taskset), or unchanged without them or taskset."""
    if cpus is None or TASKSET is None:
        return argv
    return [TASKSET, "-c", ",".join(map(str, cpus)), *argv]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


T = TypeVar("T")


def wait_for(
    check: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 0.5,
    diagnose: Callable[[], str] | None = None,
) -> T:
    """Call check() until it returns something truthy; AssertionError after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"\n{diagnose()}" if diagnose else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")
        time.sleep(interval)


class WebhookReceiver:
    """Alertmanager's webhook target: a stdlib HTTP server on loopback keeping every payload."""

    def __init__(self) -> None:
        self.payloads: list[dict] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._lock:
                    receiver.payloads.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="webhook", daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_port}/alerts"

    def alerts(self, alertname: str | None = None, status: str = "firing") -> list[dict]:
        with self._lock:
            payloads = list(self.payloads)
        return [
            a
            for p in payloads
            for a in p["alerts"]
            if a["status"] == status and alertname in (None, a["labels"]["alertname"])
        ]

    def wait_for_alert(self, alertname: str, timeout: float = 30, **labels: str) -> dict:
        def received() -> dict | None:
            for a in self.alerts(alertname):
                if all(a["labels"].get(k) == v for k, v in labels.items()):
                    return a
            return None

        return wait_for(
            received,
            timeout=timeout,
            what=f"webhook delivery of {alertname} {labels}",
            diagnose=lambda: f"payloads received: {json.dumps(self.payloads)[:2000]}",
        )

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def fast_rules(src: Path, dst: Path, for_seconds: int) -> Path:
    """Copy a rule file with every alert's `for:` (and `keep_firing_for:`) cut to for_seconds."""
    doc = load_yaml(src)
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = f"{for_seconds}s"
                rule.pop("keep_firing_for", None)
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dst


def fast_alertmanager(src: Path, dst: Path, webhook_url: str) -> Path:
    """Copy an Alertmanager config with every webhook sent to webhook_url and 1 s grouping."""
    doc = copy.deepcopy(load_yaml(src))

    def speed_up(route: dict) -> None:
        for key in ("group_wait", "group_interval"):
            if key in route or route is doc["route"]:
                route[key] = "1s"
        for child in route.get("routes", []):
            speed_up(child)

    speed_up(doc["route"])
    for receiver in doc["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = webhook_url
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dst


class PromStack:
    """Prometheus + Alertmanager + webhook receiver on loopback; a context manager.

    `scrape` maps a job name to its targets ("127.0.0.1:PORT"); `cpus` pins both servers to those
    CPUs, keeping the others for processes whose timings a test measures.
    """

    def __init__(
        self,
        scrape: dict[str, Iterable[str]],
        *,
        rules: Path = RULES,
        alertmanager_config: Path = ALERTMANAGER_CONFIG,
        for_seconds: int = 2,
        cpus: Iterable[int] | None = None,
    ) -> None:
        if not (PROMETHEUS and ALERTMANAGER):
            raise RuntimeError("prometheus and prometheus-alertmanager must be installed")
        self.binaries = {"prometheus": PROMETHEUS, "alertmanager": ALERTMANAGER}
        self.scrape = {job: list(targets) for job, targets in scrape.items()}
        self.rules = rules
        self.alertmanager_config = alertmanager_config
        self.for_seconds = for_seconds
        self.cpus = cpus
        self.webhook: WebhookReceiver | None = None
        self._procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    # lifecycle

    def __enter__(self) -> PromStack:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="fadiag-promstack-")
        work = Path(self._tmp.name)
        self.webhook = WebhookReceiver()

        am_port, prom_port = free_port(), free_port()
        self.alertmanager_url = f"http://127.0.0.1:{am_port}"
        self.prometheus_url = f"http://127.0.0.1:{prom_port}"
        am_yml = fast_alertmanager(self.alertmanager_config, work / "alertmanager.yml", self.webhook.url)
        fast_rules(self.rules, work / "rules.yml", self.for_seconds)
        prom_yml = work / "prometheus.yml"
        prom_yml.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                    "rule_files": ["rules.yml"],
                    "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
                    "scrape_configs": [
                        {"job_name": job, "static_configs": [{"targets": targets}]}
                        for job, targets in self.scrape.items()
                    ],
                },
                sort_keys=False,
            )
        )
        self._spawn(
            "alertmanager",
            [
                self.binaries["alertmanager"],
                f"--config.file={am_yml}",
                f"--storage.path={work / 'am-data'}",
                f"--web.listen-address=127.0.0.1:{am_port}",
                "--cluster.listen-address=",
            ],
            work,
        )
        self._spawn(
            "prometheus",
            [
                self.binaries["prometheus"],
                f"--config.file={prom_yml}",
                f"--storage.tsdb.path={work / 'prom-data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            work,
        )
        for url in (self.alertmanager_url, self.prometheus_url):
            wait_for(partial(self._ready, url), timeout=30, what=f"{url}/-/ready", diagnose=self.logs)

    def _spawn(self, name: str, argv: list[str], work: Path) -> None:
        log = work / f"{name}.log"
        argv = pinned(argv, self.cpus)
        if NICE:
            # Below the processes under test: their timings are what the tests look at.
            argv = [NICE, "-n", "10", *argv]
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=work)
        self._procs.append((name, proc, log))

    def _ready(self, url: str) -> bool:
        for name, proc, _ in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.logs()}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def close(self) -> None:
        for _, proc, _ in reversed(self._procs):
            proc.terminate()
        for _, proc, _ in reversed(self._procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
        if self.webhook is not None:
            self.webhook.close()
            self.webhook = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def logs(self, tail: int = 3000) -> str:
        out = []
        for name, _, log in self._procs:
            text = log.read_text(errors="replace") if log.exists() else ""
            out.append(f"--- {name} log (tail) ---\n{text[-tail:]}")
        return "\n".join(out)

    # Prometheus API

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        answer = get_json(f"{self.prometheus_url}/api/v1/{path}{query}")
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant vector result of expr now: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def values(self, expr: str) -> list[float]:
        return [float(r["value"][1]) for r in self.query(expr)]

    def alerts(self) -> list[dict]:
        """Pending and firing alerts, from /api/v1/alerts."""
        return list(self.api("alerts")["alerts"])

    def firing_alerts(self, alertname: str, **labels: str) -> list[dict]:
        return [
            a
            for a in self.alerts()
            if a["state"] == "firing"
            and a["labels"]["alertname"] == alertname
            and all(a["labels"].get(k) == v for k, v in labels.items())
        ]

    def rule_groups(self) -> list[dict]:
        return list(self.api("rules")["groups"])

    def unhealthy_rules(self) -> list[str]:
        """'name: lastError' for every rule whose last evaluation failed."""
        return [
            f"{r['name']}: {r.get('lastError', '')}"
            for g in self.rule_groups()
            for r in g["rules"]
            if r.get("health") not in ("ok", "unknown") or r.get("lastError")
        ]

    def targets(self) -> list[dict]:
        return list(self.api("targets")["activeTargets"])

    def wait_for_scrapes(self, timeout: float = 30) -> None:
        """Until every target has been scraped successfully at least once."""
        wait_for(
            lambda: all(t["health"] == "up" for t in self.targets()) and len(self.targets()) > 0,
            timeout=timeout,
            what="every target up",
            diagnose=lambda: json.dumps(self.targets(), indent=1)[:3000],
        )

    # Alertmanager API

    def am_alerts(self) -> list[dict]:
        return list(get_json(f"{self.alertmanager_url}/api/v2/alerts"))

    def wait_for(self, check: Callable[[], T | None], *, timeout: float = 40, what: str = "a condition") -> T:
        def diagnose() -> str:
            try:
                state = json.dumps(self.alerts(), indent=1)[:3000]
            except OSError as e:
                state = repr(e)
            return f"alerts: {state}\n{self.logs()}"

        return wait_for(check, timeout=timeout, what=what, diagnose=diagnose)


def finite(result: list[dict]) -> bool:
    """True when an instant query result holds at least one finite value."""
    return any(math.isfinite(float(r["value"][1])) for r in result)
