"""deploy/: Prometheus and Alertmanager configs, docker compose, Grafana provisioning, Kubernetes.

Nothing here runs docker or kubectl: files are parsed, validated against JSON Schemas that
follow the compose specification and the Kubernetes / Prometheus Operator APIs (the subset
these files use, closed to unknown keys so a typo fails), and cross-checked with each other.
promtool and amtool check what they can.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path, PurePosixPath

import jsonschema
import pytest
from promstack import (
    ALERTMANAGER_CONFIG,
    AMTOOL,
    DASHBOARD_DIR,
    PROMETHEUS_CONFIG,
    PROMTOOL,
    REPO,
    RULES,
    load_yaml,
    run_tool,
)

DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
K8S = DEPLOY / "k8s"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
FADIAG_PORTS = list(range(9464, 9472))

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: prometheus)")
needs_amtool = pytest.mark.skipif(AMTOOL is None, reason="amtool is not installed (Debian: prometheus-alertmanager)")


def validate(instance: object, schema: dict) -> None:
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(instance), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


# --- schemas ----------------------------------------------------------------------------------

STRINGS = {"type": "array", "items": {"type": "string"}}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
DURATION = {"type": "string", "pattern": r"^(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?$", "minLength": 2}
DNS_1123 = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$", "maxLength": 253}
# Kubernetes label keys: optional DNS-subdomain prefix, then a name of at most 63 characters.
LABELS = {
    "type": "object",
    "propertyNames": {"pattern": r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"},
    "additionalProperties": {"type": "string", "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"},
}
OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {"name": DNS_1123, "namespace": DNS_1123, "labels": LABELS, "annotations": STRING_MAP},
}
LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": LABELS,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": STRINGS,
                },
            },
        },
    },
}
# A container port name (IANA_SVC_NAME): at most 15 lower-case alphanumerics and dashes, one letter.
PORT_NAME = {"type": "string", "maxLength": 15, "pattern": r"^(?=.*[a-z])[a-z0-9]([a-z0-9]|-(?!-))*[a-z0-9]$"}

POD_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": OBJECT_META,
        "spec": {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": LABEL_SELECTOR,
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"any": {"type": "boolean"}, "matchNames": STRINGS},
                },
                "jobLabel": {"type": "string"},
                "podTargetLabels": STRINGS,
                "sampleLimit": {"type": "integer", "minimum": 0},
                "targetLimit": {"type": "integer", "minimum": 0},
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": PORT_NAME,
                            "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": DURATION,
                            "scrapeTimeout": DURATION,
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array", "items": {"type": "object"}},
                            "metricRelabelings": {"type": "array", "items": {"type": "object"}},
                        },
                    },
                },
            },
        },
    },
}

RULE = {
    "type": "object",
    "required": ["expr"],
    "additionalProperties": False,
    "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
    "properties": {
        "record": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
        "alert": {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"},
        "expr": {"type": "string", "minLength": 1},
        "for": DURATION,
        "keep_firing_for": DURATION,
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
}
RULE_GROUPS = {
    "type": "object",
    "required": ["groups"],
    "additionalProperties": False,
    "properties": {
        "groups": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "rules"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string"},
                    "interval": DURATION,
                    "limit": {"type": "integer"},
                    "rules": {"type": "array", "items": RULE},
                },
            },
        }
    },
}
PROMETHEUS_RULE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": OBJECT_META,
        "spec": RULE_GROUPS,
    },
}
CONFIG_MAP = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "data"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "v1"},
        "kind": {"const": "ConfigMap"},
        "metadata": OBJECT_META,
        "data": {
            "type": "object",
            "propertyNames": {"pattern": r"^[-._a-zA-Z0-9]+$", "maxLength": 253},
            "additionalProperties": {"type": "string"},
        },
    },
}

# The compose specification, for the keys these files use; anything else fails.
SERVICE = {
    "type": "object",
    "additionalProperties": False,
    "anyOf": [{"required": ["image"]}, {"required": ["build"]}],
    "properties": {
        "image": {"type": "string", "pattern": r"^[a-z0-9./_-]+(:[A-Za-z0-9._-]+)?$"},
        "build": {"type": ["string", "object"]},
        "command": {"oneOf": [{"type": "string"}, STRINGS]},
        "entrypoint": {"oneOf": [{"type": "string"}, STRINGS]},
        "environment": {
            "oneOf": [
                {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean", "null"]}},
                {"type": "array", "items": {"type": "string", "pattern": "^[^=]+=.*$"}},
            ]
        },
        "ports": {
            "type": "array",
            "items": {"type": "string", "pattern": r"^((\d{1,3}\.){3}\d{1,3}:)?(\d+(-\d+)?:)?\d+(-\d+)?(/(tcp|udp))?$"},
        },
        "volumes": {"type": "array", "items": {"type": "string", "pattern": r"^[^:]+:/[^:]*(:(ro|rw|z|Z))?$"}},
        "extra_hosts": {"type": "array", "items": {"type": "string", "pattern": r"^[a-zA-Z0-9.-]+[:=][a-zA-Z0-9.:-]+$"}},
        "depends_on": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "restart": {"enum": ["no", "always", "on-failure", "unless-stopped"]},
        "networks": {"type": ["array", "object"]},
        "network_mode": {"type": "string"},
        "healthcheck": {"type": "object"},
        "labels": {"type": ["array", "object"]},
        "user": {"type": "string"},
        "profiles": STRINGS,
        "container_name": {"type": "string"},
    },
}
COMPOSE_SCHEMA = {
    "type": "object",
    "required": ["services"],
    "additionalProperties": False,
    "patternProperties": {"^x-": {}},
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9][a-z0-9_-]*$"},
        "services": {
            "type": "object",
            "propertyNames": {"pattern": "^[a-zA-Z0-9._-]+$"},
            "additionalProperties": SERVICE,
        },
        "volumes": {"type": "object", "additionalProperties": {"type": ["object", "null"]}},
        "networks": {"type": "object"},
    },
}

GRAFANA_DATASOURCES = {
    "type": "object",
    "required": ["apiVersion", "datasources"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": 1},
        "deleteDatasources": {"type": "array"},
        "datasources": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "type", "uid", "access", "url"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string"},
                    "type": {"enum": ["prometheus", "alertmanager"]},
                    "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,40}$"},
                    "access": {"enum": ["proxy", "direct"]},
                    "url": {"type": "string", "pattern": "^https?://"},
                    "isDefault": {"type": "boolean"},
                    "editable": {"type": "boolean"},
                    "orgId": {"type": "integer"},
                    "jsonData": {"type": "object"},
                },
            },
        },
    },
}
GRAFANA_DASHBOARD_PROVIDERS = {
    "type": "object",
    "required": ["apiVersion", "providers"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": 1},
        "providers": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "type", "options"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string"},
                    "orgId": {"type": "integer"},
                    "folder": {"type": "string"},
                    "folderUid": {"type": "string"},
                    "type": {"const": "file"},
                    "disableDeletion": {"type": "boolean"},
                    "allowUiUpdates": {"type": "boolean"},
                    "updateIntervalSeconds": {"type": "integer", "minimum": 10},
                    "options": {
                        "type": "object",
                        "required": ["path"],
                        "additionalProperties": False,
                        "properties": {"path": {"type": "string"}, "foldersFromFilesStructure": {"type": "boolean"}},
                    },
                },
            },
        },
    },
}


# --- Prometheus and Alertmanager --------------------------------------------------------------


@needs_promtool
def test_promtool_check_config_passes_on_the_compose_prometheus_config():
    r = run_tool(PROMTOOL, "check", "config", PROMETHEUS_CONFIG)
    assert r.returncode == 0, r.stdout + r.stderr


def test_prometheus_config_loads_the_shipped_rules_and_scrapes_every_local_rank_port():
    cfg = load_yaml(PROMETHEUS_CONFIG)
    assert [(PROMETHEUS_CONFIG.parent / f).resolve() for f in cfg["rule_files"]] == [RULES.resolve()]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "fadiag"]
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert sorted(int(t.rsplit(":", 1)[1]) for t in targets) == FADIAG_PORTS


@needs_amtool
def test_amtool_check_config_passes():
    r = run_tool(AMTOOL, "check-config", ALERTMANAGER_CONFIG)
    assert r.returncode == 0, r.stdout + r.stderr


def webhook_receivers() -> set[str]:
    return {r["name"] for r in load_yaml(ALERTMANAGER_CONFIG)["receivers"] if r.get("webhook_configs")}


@needs_amtool
@pytest.mark.parametrize(
    "labels, to_webhook",
    [
        (["alertname=FadiagMemorySavingsLow", "severity=warning"], True),
        (["alertname=FadiagHang", "severity=critical"], True),
        (["alertname=FadiagExporterDown", "cause=target_gone"], True),
        (["alertname=NodeFilesystemAlmostFull", "severity=warning"], False),
    ],
)
def test_alertmanager_routes_fadiag_alerts_to_the_webhook(labels, to_webhook):
    r = run_tool(AMTOOL, "config", "routes", "test", f"--config.file={ALERTMANAGER_CONFIG}", *labels)
    receiver = r.stdout.strip()
    assert r.returncode == 0 and receiver, r.stdout + r.stderr
    assert (receiver in webhook_receivers()) == to_webhook, receiver


# --- docker compose ---------------------------------------------------------------------------


def compose() -> dict:
    return load_yaml(COMPOSE)


def mounts(service: dict) -> dict[PurePosixPath, str]:
    """Container path -> source (a path relative to deploy/, or a named volume)."""
    out = {}
    for v in service.get("volumes", []):
        source, target = v.split(":")[:2]
        out[PurePosixPath(target)] = source
    return out


def host_path(service: dict, container_path: str) -> Path | None:
    """Where a file the container reads lives in this repository, through its bind mounts."""
    path = PurePosixPath(container_path)
    for target, source in sorted(mounts(service).items(), key=lambda m: -len(m[0].parts)):
        if source.startswith(".") and (path == target or target in path.parents):
            return (DEPLOY / source / path.relative_to(target)).resolve()
    return None


def test_compose_file_follows_the_compose_specification():
    validate(compose(), COMPOSE_SCHEMA)


def test_compose_runs_prometheus_alertmanager_and_grafana_with_pinned_images():
    services = compose()["services"]
    assert set(services) >= {"prometheus", "alertmanager", "grafana"}
    for s in services.values():
        assert ":" in s["image"] and not s["image"].endswith(":latest")


def test_compose_bind_mounts_exist_and_named_volumes_are_declared():
    c = compose()
    for name, s in c["services"].items():
        for target, source in mounts(s).items():
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} -> {target}"
            else:
                assert source in c.get("volumes", {}), f"{name}: volume {source} is not declared"
        for dep in s.get("depends_on", []):
            assert dep in c["services"]


def test_compose_config_files_resolve_to_the_shipped_ones():
    services = compose()["services"]
    flags = {
        name: dict(a.removeprefix("--").split("=", 1) for a in s.get("command", []) if "=" in a)
        for name, s in services.items()
    }
    assert host_path(services["prometheus"], flags["prometheus"]["config.file"]) == PROMETHEUS_CONFIG.resolve()
    assert host_path(services["alertmanager"], flags["alertmanager"]["config.file"]) == ALERTMANAGER_CONFIG.resolve()
    # Prometheus resolves rule_files against its config file's folder, inside the container too.
    prom_dir = PurePosixPath(flags["prometheus"]["config.file"]).parent
    for rule_file in load_yaml(PROMETHEUS_CONFIG)["rule_files"]:
        assert host_path(services["prometheus"], str(prom_dir / rule_file)) == RULES.resolve()
    assert host_path(services["grafana"], "/etc/grafana/provisioning") == PROVISIONING.resolve()


def test_compose_publishes_ports_on_loopback_only():
    for s in compose()["services"].values():
        for p in s.get("ports", []):
            assert p.startswith("127.0.0.1:"), p


def test_compose_prometheus_reaches_training_processes_on_the_docker_host():
    prometheus = compose()["services"]["prometheus"]
    assert "host.docker.internal:host-gateway" in prometheus["extra_hosts"]


def test_prometheus_sends_alerts_to_the_compose_alertmanager():
    services = compose()["services"]
    cfg = load_yaml(PROMETHEUS_CONFIG)
    targets = [t for am in cfg["alerting"]["alertmanagers"] for sc in am["static_configs"] for t in sc["targets"]]
    assert targets and all(t.split(":")[0] in services for t in targets)


# --- Grafana provisioning ---------------------------------------------------------------------


def test_grafana_datasources_have_fixed_uids_and_point_at_compose_services():
    doc = load_yaml(PROVISIONING / "datasources" / "fadiag.yaml")
    validate(doc, GRAFANA_DATASOURCES)
    services = compose()["services"]
    (prometheus,) = [d for d in doc["datasources"] if d["type"] == "prometheus"]
    assert prometheus["uid"] and prometheus["isDefault"] is True
    for d in doc["datasources"]:
        assert re.match(r"https?://([^:/]+)", d["url"]).group(1) in services


def test_grafana_dashboard_provider_reads_the_mounted_dashboards_folder():
    doc = load_yaml(PROVISIONING / "dashboards" / "fadiag.yaml")
    validate(doc, GRAFANA_DASHBOARD_PROVIDERS)
    (provider,) = doc["providers"]
    grafana = compose()["services"]["grafana"]
    assert host_path(grafana, provider["options"]["path"]) == DASHBOARD_DIR.resolve()


# --- Kubernetes -------------------------------------------------------------------------------


def load_k8s_generator():
    spec = importlib.util.spec_from_file_location("k8s_generate", K8S / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_k8s_files_equal_the_generator_output():
    for name, text in load_k8s_generator().render().items():
        assert (K8S / name).read_text() == text, f"{name} is stale: run python deploy/k8s/generate.py"


def test_pod_monitor_is_valid_and_scrapes_one_named_port_per_local_rank():
    doc = load_yaml(K8S / "podmonitor.yaml")
    validate(doc, POD_MONITOR)
    ports = [e["port"] for e in doc["spec"]["podMetricsEndpoints"]]
    assert ports == [f"fadiag-{i}" for i in range(8)]
    assert doc["spec"]["selector"]["matchLabels"]


def test_prometheus_rule_is_valid_and_carries_exactly_the_shipped_rules():
    doc = load_yaml(K8S / "prometheusrule.yaml")
    validate(doc, PROMETHEUS_RULE)
    assert doc["spec"] == load_yaml(RULES)


def test_shipped_rules_follow_the_rule_file_schema():
    validate(load_yaml(RULES), RULE_GROUPS)


def test_dashboards_configmap_is_labelled_for_the_grafana_sidecar_and_holds_the_dashboards():
    doc = load_yaml(K8S / "dashboards-configmap.yaml")
    validate(doc, CONFIG_MAP)
    assert doc["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = {p.name: json.loads(p.read_text()) for p in DASHBOARD_DIR.glob("*.json")}
    assert {k: json.loads(v) for k, v in doc["data"].items()} == shipped
    assert len((K8S / "dashboards-configmap.yaml").read_bytes()) < 900 * 1024  # ConfigMaps hold 1 MiB


def test_deploy_doc_shows_the_container_ports_the_pod_monitor_expects():
    text = (REPO / "docs" / "deploy.md").read_text()
    for i, port in enumerate(FADIAG_PORTS):
        assert re.search(rf"name: fadiag-{i}\s+containerPort: {port}", text), f"fadiag-{i}"
