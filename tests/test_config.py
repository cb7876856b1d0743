"""Tests for fadiag.config: defaults, layering, validation messages, YAML loading, fuzzing."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fadiag.config import Config, ExporterConfig, HangRuleConfig
from fadiag.config.keys import config_keys
from fadiag.config.loader import ALIASES, config_issues, load_config, validate_mapping
from fadiag.errors import ConfigError

NO_ENV: dict[str, str] = {}


def nested(dotted: str, value: object) -> dict[str, object]:
    """{"a": {"b": value}} for "a.b"."""
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value  # type: ignore[return-value]


def write(tmp_path: Path, text: str, name: str = "fadiag.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- defaults and precedence ------------------------------------------------------------------


def test_defaults_load_when_nothing_is_given():
    assert load_config(environ=NO_ENV) == Config()


def test_defaults_are_the_documented_ones():
    cfg = load_config(environ=NO_ENV)
    assert (cfg.exporter.port, cfg.exporter.addr, cfg.device) == (9464, "127.0.0.1", "auto")
    assert cfg.rules.backward_forward_ratio.threshold == 3.0
    assert cfg.rules.memory_savings.threshold == 0.8


def test_yaml_file_values_replace_defaults(tmp_path):
    path = write(tmp_path, "exporter:\n  port: 9000\ndevice: cpu\n")
    cfg = load_config(path, environ=NO_ENV)
    assert (cfg.exporter.port, cfg.device) == (9000, "cpu")


def test_path_may_be_a_string(tmp_path):
    path = write(tmp_path, "exporter:\n  port: 9000\n")
    assert load_config(str(path), environ=NO_ENV).exporter.port == 9000


def test_partial_section_keeps_the_other_defaults():
    cfg = load_config({"rules": {"hang": {"timeout_seconds": 5}}}, environ=NO_ENV)
    assert cfg.rules.hang == HangRuleConfig(timeout_seconds=5.0)
    assert cfg.rules.regression == Config().rules.regression


def test_overrides_win_over_the_source():
    cfg = load_config(
        {"exporter": {"port": 1000, "addr": "0.0.0.0"}}, {"port": 2000}, environ=NO_ENV
    )
    assert (cfg.exporter.port, cfg.exporter.addr) == (2000, "0.0.0.0")


def test_overrides_win_over_a_yaml_file(tmp_path):
    path = write(tmp_path, "exporter:\n  port: 1000\n")
    assert load_config(path, {"exporter.port": 0}, environ=NO_ENV).exporter.port == 0


def test_a_config_source_is_returned_equal():
    cfg = Config(exporter=ExporterConfig(port=0))
    assert load_config(cfg, environ=NO_ENV) == cfg


def test_overrides_apply_on_top_of_a_config_source():
    cfg = load_config(Config(device="cpu"), {"port": 0}, environ=NO_ENV)
    assert (cfg.device, cfg.exporter.port) == ("cpu", 0)


def test_FADIAG_CONFIG_is_read_when_no_source_is_given(tmp_path):
    path = write(tmp_path, "exporter:\n  port: 7000\n")
    assert load_config(environ={"FADIAG_CONFIG": str(path)}).exporter.port == 7000


def test_FADIAG_CONFIG_is_read_from_the_process_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FADIAG_CONFIG", str(write(tmp_path, "device: cpu\n")))
    assert load_config().device == "cpu"


def test_FADIAG_CONFIG_is_ignored_when_a_source_is_given(tmp_path):
    env = {"FADIAG_CONFIG": str(tmp_path / "missing.yaml")}
    assert load_config({"device": "cpu"}, environ=env).device == "cpu"


def test_overrides_apply_on_top_of_FADIAG_CONFIG(tmp_path):
    env = {"FADIAG_CONFIG": str(write(tmp_path, "exporter:\n  port: 7000\n  addr: 0.0.0.0\n"))}
    cfg = load_config(None, {"port": 0}, environ=env)
    assert (cfg.exporter.port, cfg.exporter.addr) == (0, "0.0.0.0")


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_FADIAG_DISABLE_forces_enabled_off_over_everything(value):
    cfg = load_config({"enabled": True}, {"enabled": True}, environ={"FADIAG_DISABLE": value})
    assert cfg.enabled is False


@pytest.mark.parametrize("value", ["0", "", "false", "no"])
def test_FADIAG_DISABLE_set_to_a_false_value_changes_nothing(value):
    assert load_config(environ={"FADIAG_DISABLE": value}).enabled is True


# --- overrides --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["port", "exporter.port", "exporter__port"])
def test_override_key_forms_set_the_same_key(key):
    assert load_config(None, {key: 1234}, environ=NO_ENV).exporter.port == 1234


@pytest.mark.parametrize(
    ("alias", "value"),
    [
        ("port", 1234),
        ("addr", "0.0.0.0"),
        ("jsonl", "/tmp/run"),
        ("device", "cpu"),
        ("enabled", False),
        ("every_n_steps", 4),
        ("per_site", True),
    ],
)
def test_short_override_names_set_their_dotted_keys(alias, value):
    cfg = load_config(None, {alias: value}, environ=NO_ENV).to_dict()
    *sections, leaf = ALIASES[alias].split(".")
    for section in sections:
        cfg = cfg[section]
    assert cfg[leaf] == value


def test_a_mapping_override_merges_into_its_section():
    cfg = load_config(None, {"jsonl": {"path": "/tmp/run", "backups": 0}}, environ=NO_ENV)
    assert (cfg.jsonl.path, cfg.jsonl.backups, cfg.jsonl.max_bytes) == ("/tmp/run", 0, 64 << 20)


def test_a_section_instance_is_accepted_as_an_override():
    cfg = load_config(None, {"exporter": ExporterConfig(port=0)}, environ=NO_ENV)
    assert cfg.exporter == ExporterConfig(port=0)


def test_later_overrides_win_over_earlier_ones():
    cfg = load_config(None, {"exporter.port": 1, "port": 2}, environ=NO_ENV)
    assert cfg.exporter.port == 2


def test_unknown_override_key_suggests_the_nearest_key():
    with pytest.raises(ConfigError, match=r"unknown key prot; did you mean exporter\.port\?"):
        load_config(None, {"prot": 1}, environ=NO_ENV)


def test_overrides_that_are_not_a_mapping_are_rejected():
    with pytest.raises(ConfigError, match="overrides must be a mapping"):
        load_config(None, [("port", 1)], environ=NO_ENV)  # type: ignore[arg-type]


# --- values -----------------------------------------------------------------------------------


def test_float_keys_accept_integers_and_store_floats():
    cfg = load_config({"rules": {"backward_forward_ratio": {"threshold": 4}}}, environ=NO_ENV)
    assert type(cfg.rules.backward_forward_ratio.threshold) is float


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("exporter.port", -1, "exporter.port must be an integer 0..65535, got -1"),
        ("exporter.port", 65536, "exporter.port must be an integer 0..65535, got 65536"),
        ("exporter.port", "9464", "exporter.port must be an integer 0..65535, got '9464'"),
        ("exporter.port", True, "exporter.port must be an integer 0..65535, got True"),
        ("exporter.port", 9464.0, "exporter.port must be an integer 0..65535, got 9464.0"),
        (
            "exporter.on_port_in_use",
            "retry",
            "exporter.on_port_in_use must be one of next|disable|fail, got 'retry'",
        ),
        ("exporter.max_sites", 0, "exporter.max_sites must be an integer >= 1, got 0"),
        ("exporter.addr", "", "exporter.addr must be an IP address or a host name, got ''"),
        ("exporter.addr", "1.2.3", "exporter.addr must be an IP address or a host name, got '1.2.3'"),
        ("exporter.addr", "my host", "exporter.addr must be an IP address or a host name, got 'my host'"),
        (
            "exporter.enabled",
            "yes",
            "exporter.enabled must be a boolean (true or false), got 'yes'",
        ),
        ("exporter.per_site", 1, "exporter.per_site must be a boolean (true or false), got 1"),
        ("device", "gpu", "device must be one of auto|cpu|cuda|npu, got 'gpu'"),
        ("enabled", "true", "enabled must be a boolean (true or false), got 'true'"),
        ("sampling.every_n_steps", 0, "sampling.every_n_steps must be an integer >= 1, got 0"),
        (
            "interceptors.sdpa",
            None,
            "interceptors.sdpa must be a boolean (true or false), got None",
        ),
        ("steps.history", 0, "steps.history must be an integer >= 1, got 0"),
        ("steps.history", 1.5, "steps.history must be an integer >= 1, got 1.5"),
        ("steps.fallback_after", 0, "steps.fallback_after must be an integer >= 1, got 0"),
        (
            "steps.max_calls_per_step",
            -5,
            "steps.max_calls_per_step must be an integer >= 1, got -5",
        ),
        ("rules.per_site", "no", "rules.per_site must be a boolean (true or false), got 'no'"),
        (
            "rules.backward_forward_ratio.threshold",
            0,
            "rules.backward_forward_ratio.threshold must be a number > 0, got 0",
        ),
        (
            "rules.backward_forward_ratio.threshold",
            math.nan,
            "rules.backward_forward_ratio.threshold must be a number > 0, got nan",
        ),
        (
            "rules.backward_forward_ratio.threshold",
            math.inf,
            "rules.backward_forward_ratio.threshold must be a number > 0, got inf",
        ),
        (
            "rules.backward_forward_ratio.min_forward_seconds",
            -1e-6,
            "rules.backward_forward_ratio.min_forward_seconds must be a number >= 0, got -1e-06",
        ),
        (
            "rules.backward_forward_ratio.per_impl",
            {"cudnn": 3.7, "flash": "fast"},
            "rules.backward_forward_ratio.per_impl.flash must be a number > 0, got 'fast'",
        ),
        (
            "rules.backward_forward_ratio.per_impl",
            3.7,
            "rules.backward_forward_ratio.per_impl must be a mapping of impl names to numbers > 0, "
            "got 3.7",
        ),
        (
            "rules.backward_forward_ratio.host_window_steps",
            0,
            "rules.backward_forward_ratio.host_window_steps must be an integer >= 1, got 0",
        ),
        (
            "rules.backward_forward_ratio.max_cpu_wait",
            1.5,
            "rules.backward_forward_ratio.max_cpu_wait must be a number 0..1, got 1.5",
        ),
        (
            "rules.regression.max_cpu_wait",
            -0.1,
            "rules.regression.max_cpu_wait must be a number 0..1, got -0.1",
        ),
        (
            "rules.regression.sustain_seconds",
            -1,
            "rules.regression.sustain_seconds must be a number >= 0, got -1",
        ),
        (
            "rules.memory_savings.threshold",
            1.5,
            "rules.memory_savings.threshold must be a number 0..1, got 1.5",
        ),
        (
            "rules.memory_savings.threshold",
            -0.1,
            "rules.memory_savings.threshold must be a number 0..1, got -0.1",
        ),
        (
            "rules.memory_savings.threshold",
            "80%",
            "rules.memory_savings.threshold must be a number 0..1, got '80%'",
        ),
        ("rules.regression.tolerance", 0, "rules.regression.tolerance must be a number > 0, got 0"),
        (
            "rules.regression.consecutive",
            0,
            "rules.regression.consecutive must be an integer >= 1, got 0",
        ),
        (
            "rules.regression.warmup_steps",
            -1,
            "rules.regression.warmup_steps must be an integer >= 0, got -1",
        ),
        ("rules.regression.window", 0, "rules.regression.window must be an integer >= 1, got 0"),
        (
            "rules.regression.baseline_file",
            3,
            "rules.regression.baseline_file must be a non-empty string or null, got 3",
        ),
        ("rules.hang.timeout_seconds", 0, "rules.hang.timeout_seconds must be a number > 0, got 0"),
        (
            "rules.hang.enabled",
            "off",
            "rules.hang.enabled must be a boolean (true or false), got 'off'",
        ),
        ("jsonl.path", 5, "jsonl.path must be a non-empty string or null, got 5"),
        ("jsonl.max_bytes", 1023, "jsonl.max_bytes must be an integer >= 1024, got 1023"),
        ("jsonl.backups", -1, "jsonl.backups must be an integer >= 0, got -1"),
        (
            "log.flag_interval_seconds",
            -1,
            "log.flag_interval_seconds must be a number >= 0, got -1",
        ),
    ],
)
def test_bad_value_is_rejected_naming_its_dotted_key(key, value, message):
    with pytest.raises(ConfigError) as info:
        load_config(nested(key, value), environ=NO_ENV)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("exporter.port", 0),
        ("exporter.port", 65535),
        ("rules.memory_savings.threshold", 0),
        ("rules.memory_savings.threshold", 1.0),
        ("rules.backward_forward_ratio.min_forward_seconds", 0),
        ("rules.regression.warmup_steps", 0),
        ("jsonl.max_bytes", 1024),
        ("jsonl.backups", 0),
        ("log.flag_interval_seconds", 0),
        ("rules.regression.baseline_file", None),
        ("exporter.addr", "::"),
        ("exporter.addr", "node-3.cluster.local"),
    ],
)
def test_boundary_value_is_accepted(key, value):
    assert load_config(nested(key, value), environ=NO_ENV)


def test_building_a_section_directly_validates_with_its_dotted_key():
    with pytest.raises(
        ConfigError, match=r"^rules\.hang\.timeout_seconds must be a number > 0, got 0$"
    ):
        HangRuleConfig(timeout_seconds=0)


def test_building_a_config_with_a_dict_section_is_rejected():
    with pytest.raises(ConfigError, match=r"^exporter must be of type ExporterConfig"):
        Config(exporter={"port": 0})  # type: ignore[arg-type]


@pytest.mark.parametrize(("have", "lack"), [("certfile", "keyfile"), ("keyfile", "certfile")])
def test_tls_certfile_and_keyfile_must_come_together(have, lack):
    with pytest.raises(
        ConfigError,
        match=rf"exporter\.{have} is set but exporter\.{lack} is not; set both or neither",
    ):
        load_config({"exporter": {have: "/etc/tls/x.pem"}}, environ=NO_ENV)


def test_tls_pair_may_come_from_two_layers(tmp_path):
    cert, key = write(tmp_path, "", "c.pem"), write(tmp_path, "", "k.pem")
    cfg = load_config(
        {"exporter": {"certfile": str(cert)}}, {"exporter.keyfile": str(key)}, environ=NO_ENV
    )
    assert (cfg.exporter.certfile, cfg.exporter.keyfile) == (str(cert), str(key))


@pytest.mark.parametrize("key", ["certfile", "keyfile"])
def test_a_missing_tls_file_is_rejected_naming_its_key(tmp_path, key):
    files = {"certfile": str(write(tmp_path, "", "c.pem")), "keyfile": str(write(tmp_path, "", "k.pem"))}
    files[key] = str(tmp_path / "gone.pem")
    with pytest.raises(ConfigError) as info:
        load_config({"exporter": files}, environ=NO_ENV)
    assert str(info.value) == (
        f"exporter.{key} must name a readable file, got {files[key]!r} (no such file)"
    )


def test_a_directory_as_tls_file_is_rejected(tmp_path):
    cert = str(write(tmp_path, "", "c.pem"))
    issues = config_issues({"exporter": {"certfile": cert, "keyfile": str(tmp_path)}}, environ=NO_ENV)
    assert [(i.key, i.reason) for i in issues] == [
        ("exporter.keyfile", f"must name a readable file, got {str(tmp_path)!r} (not a file)")
    ]


def test_a_missing_baseline_file_is_rejected_naming_its_key_and_line(tmp_path):
    path = write(tmp_path, "rules:\n  regression:\n    baseline_file: /nonexistent/b.json\n")
    (issue,) = config_issues(path, environ=NO_ENV)
    assert (issue.key, issue.line) == ("rules.regression.baseline_file", 3)
    assert issue.reason.startswith("must name a baseline written by `fadiag baseline save`: ")
    assert "/nonexistent/b.json" in issue.reason


@pytest.mark.parametrize("content", ["not json", '{"version": 99}'])
def test_a_broken_baseline_file_is_rejected_at_load(tmp_path, content):
    baseline = write(tmp_path, content, "b.json")
    with pytest.raises(ConfigError, match=r"^rules\.regression\.baseline_file must name a baseline"):
        load_config({"rules": {"regression": {"baseline_file": str(baseline)}}}, environ=NO_ENV)


@pytest.mark.parametrize(("text", "native"), [("native: off", "off"), ("native: on", "on"),
                                              ("native: 'off'", "off"), ("native: auto", "auto")])
def test_native_reads_a_bare_yaml_on_and_off(tmp_path, text, native):
    # YAML 1.1 reads a bare on/off as a boolean; the README writes `native: off`.
    assert load_config(write(tmp_path, text + "\n"), environ=NO_ENV).native == native


def test_a_key_given_twice_is_rejected_with_both_lines(tmp_path):
    path = write(tmp_path, "exporter:\n  port: 1\n  port: 2\nrules: {}\nrules: {}\n")
    assert [str(i) for i in config_issues(path, environ=NO_ENV)] == [
        f"{path}:3: exporter.port: is given twice (lines 2 and 3); keep one",
        f"{path}:5: rules: is given twice (lines 4 and 5); keep one",
    ]


def test_a_bad_value_replaced_by_an_override_is_not_an_error():
    assert load_config({"exporter": {"port": -1}}, {"port": 0}, environ=NO_ENV).exporter.port == 0


def test_validate_mapping_returns_every_problem():
    issues = validate_mapping(
        {
            "exporter": {"port": -1, "prot": 1},
            "device": "gpu",
            "rules": {"hang": {"timeout_seconds": 0}},
        }
    )
    assert sorted(issue.key for issue in issues) == [
        "device",
        "exporter.port",
        "exporter.prot",
        "rules.hang.timeout_seconds",
    ]


def test_validate_mapping_returns_nothing_for_a_valid_document():
    assert validate_mapping({"exporter": {"port": 0}}) == []


def test_load_config_error_lists_every_problem_one_per_line():
    with pytest.raises(ConfigError) as info:
        load_config({"device": "gpu", "exporter": {"port": -1}}, environ=NO_ENV)
    assert sorted(str(info.value).splitlines()) == [
        "device must be one of auto|cpu|cuda|npu, got 'gpu'",
        "exporter.port must be an integer 0..65535, got -1",
    ]


@pytest.mark.parametrize("source", [42, b"fadiag.yaml", ["exporter"]])
def test_source_of_another_type_is_rejected(source):
    with pytest.raises(ConfigError, match="must be a YAML path, a mapping or a Config"):
        load_config(source, environ=NO_ENV)


# --- keys and structure -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"exporter": {"prot": 1}}, "unknown key exporter.prot; did you mean exporter.port?"),
        (
            {"rules": {"hang": {"timeout": 1}}},
            "unknown key rules.hang.timeout; did you mean rules.hang.timeout_seconds?",
        ),
        ({"port": 1}, "unknown key port; did you mean exporter.port?"),
        ({"hang": {}}, "unknown key hang; did you mean rules.hang?"),
        (
            {"rules": {"enabled": False}},
            "unknown key rules.enabled; did you mean rules.backward_forward_ratio.enabled"
            " or rules.memory_savings.enabled or rules.regression.enabled or rules.hang.enabled?",
        ),
        (
            {"exporter.port": 1},
            "unknown key exporter.port; dotted keys work only as overrides; nest it: exporter: {port: ...}",
        ),
        (
            {"qqqq": 1},
            "unknown key qqqq; expected one of enabled, device, native, tap, sampling, interceptors, steps, rules, exporter, jsonl, log",
        ),
        (
            {1: 2},
            "unknown key 1; expected one of enabled, device, native, tap, sampling, interceptors, steps, rules, exporter, jsonl, log",
        ),
    ],
)
def test_unknown_key_is_rejected_with_a_suggestion(document, message):
    with pytest.raises(ConfigError) as info:
        load_config(document, environ=NO_ENV)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("exporter: 5\n", "exporter"),
        ("exporter: [1, 2]\n", "exporter"),
        ("rules:\n  hang: fast\n", "rules.hang"),
    ],
)
def test_non_mapping_section_is_rejected_by_its_key(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:\d+: {key} must be a mapping"):
        load_config(path, environ=NO_ENV)


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "42\n", "just some text\n"])
def test_non_mapping_document_is_rejected(tmp_path, text):
    with pytest.raises(
        ConfigError, match=r":1: the configuration must be a mapping of keys to values"
    ):
        load_config(write(tmp_path, text), environ=NO_ENV)


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n", "~\n"])
def test_empty_yaml_document_gives_the_defaults(tmp_path, text):
    assert load_config(write(tmp_path, text), environ=NO_ENV) == Config()


def test_empty_section_keeps_its_defaults(tmp_path):
    assert load_config(write(tmp_path, "exporter:\nrules:\n  hang:\n"), environ=NO_ENV) == Config()


# --- files ------------------------------------------------------------------------------------


def test_missing_file_is_rejected_naming_its_path(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}: configuration file not found$"
    ):
        load_config(path, environ=NO_ENV)


def test_missing_FADIAG_CONFIG_file_is_rejected_naming_the_variable(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(str(path))}: configuration file not found \(named by FADIAG_CONFIG\)$",
    ):
        load_config(environ={"FADIAG_CONFIG": str(path)})


def test_directory_instead_of_a_file_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the configuration file"):
        load_config(tmp_path, environ=NO_ENV)


def test_file_that_is_not_utf8_is_rejected(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("device: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(path, environ=NO_ENV)


def test_yaml_syntax_error_gives_line_and_column(tmp_path):
    path = write(tmp_path, "exporter:\n  port: 1\n bad: [\n")
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}:3: invalid YAML at column 2: "
    ):
        load_config(path, environ=NO_ENV)


def test_unclosed_flow_sequence_gives_a_line(tmp_path):
    path = write(tmp_path, "device: cpu\nexporter: {port: [1\n")
    (issue,) = config_issues(path, environ=NO_ENV)
    assert issue.line is not None and issue.message.startswith("invalid YAML at column")


def test_yaml_python_tags_are_not_executed(tmp_path):
    path = write(tmp_path, "device: !!python/object/apply:os.getcwd []\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(path, environ=NO_ENV)


def test_yaml_anchors_and_merge_keys_are_resolved(tmp_path):
    text = (
        "rules:\n  regression: &on {enabled: true}\n  hang:\n    <<: *on\n    timeout_seconds: 5\n"
    )
    assert load_config(write(tmp_path, text), environ=NO_ENV).rules.hang.timeout_seconds == 5.0


def test_issues_carry_the_line_of_their_key(tmp_path):
    path = write(
        tmp_path,
        "# fadiag\nexporter:\n  prot: 1\n  port: -1\nrules:\n  hang:\n    timeout_seconds: 0\n",
    )
    issues = config_issues(path, environ=NO_ENV)
    assert [(i.key, i.line, i.source) for i in issues] == [
        ("exporter.prot", 3, str(path)),
        ("exporter.port", 4, str(path)),
        ("rules.hang.timeout_seconds", 7, str(path)),
    ]


def test_issue_prints_as_file_line_key_reason(tmp_path):
    path = write(tmp_path, "exporter:\n  port: -1\n")
    (issue,) = config_issues(path, environ=NO_ENV)
    assert str(issue) == f"{path}:2: exporter.port: must be an integer 0..65535, got -1"


def test_load_config_error_carries_file_and_line(tmp_path):
    path = write(tmp_path, "exporter:\n  port: -1\n")
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(str(path))}:2: exporter\.port must be an integer 0\.\.65535, got -1$",
    ):
        load_config(path, environ=NO_ENV)


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        load_config({"device": "gpu"}, environ=NO_ENV)


# --- serialisation ----------------------------------------------------------------------------


def test_to_dict_round_trips_through_yaml(tmp_path):
    cert, key = str(write(tmp_path, "", "c")), str(write(tmp_path, "", "k"))
    cfg = load_config(
        {"exporter": {"port": 0, "certfile": cert, "keyfile": key}, "jsonl": {"path": "/x"}},
        environ=NO_ENV,
    )
    assert load_config(yaml.safe_load(yaml.safe_dump(cfg.to_dict())), environ=NO_ENV) == cfg


def test_config_keys_list_every_leaf_with_its_default():
    keys = {key.key: key.default for key in config_keys()}
    assert keys["exporter.port"] == 9464
    assert keys["rules.hang.timeout_seconds"] == 300.0
    assert keys["rules.regression.min_increase_seconds"] == 0.0005
    assert len(keys) == 50
    assert keys["native"] == "auto"
    assert keys["steps.verify_every"] == 100


# --- fuzzing ----------------------------------------------------------------------------------

_NAMES = sorted({part for key in config_keys() for part in key.key.split(".")})
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["auto", "cpu", "next", "fail", "/tmp/x", "", "yes"])
)
_keys = st.sampled_from(_NAMES) | st.text(max_size=8) | st.integers() | st.booleans()
_documents = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_keys, children, max_size=5),
    max_leaves=25,
)


@st.composite
def _schema_documents(draw: st.DrawFn) -> dict[str, object]:
    """Documents built from real dotted keys with random values: mostly-valid configurations."""
    document: dict[str, object] = {}
    for key in draw(st.lists(st.sampled_from([k.key for k in config_keys()]), max_size=8)):
        *sections, leaf = key.split(".")
        inner = document
        for section in sections:
            child = inner.setdefault(section, {})
            if not isinstance(child, dict):
                break
            inner = child
        else:
            inner[leaf] = draw(_scalars)
    return document


def _loads_or_config_error(source: Any) -> None:
    try:
        result = load_config(source, environ=NO_ENV)
    except ConfigError:
        return
    assert isinstance(result, Config)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


_FUZZ = settings(deadline=None)


@_FUZZ
@given(document=_documents | _schema_documents())
def test_any_yaml_document_gives_a_config_or_a_config_error(fuzz_dir, document):
    path = fuzz_dir / "doc.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    _loads_or_config_error(path)


@_FUZZ
@given(document=_documents | _schema_documents())
@example(document="\x00")  # a string is a file name: one with a NUL byte raised ValueError
def test_any_mapping_gives_a_config_or_a_config_error(document):
    _loads_or_config_error(document)


def test_a_file_name_with_a_nul_byte_is_a_config_error_that_names_it():
    with pytest.raises(ConfigError, match="not a configuration file name"):
        load_config("fadiag\x00.yaml", environ=NO_ENV)


@_FUZZ
@given(
    text=st.text(max_size=200) | st.text(alphabet=":-[]{}&*!|>'\"%@`#,? \n\tabcxyz019", max_size=80)
)
def test_any_text_gives_a_config_or_a_config_error(fuzz_dir, text):
    path = fuzz_dir / "text.yaml"
    path.write_text(text, encoding="utf-8")
    _loads_or_config_error(path)


@_FUZZ
@given(document=_schema_documents())
def test_issues_are_empty_exactly_when_the_document_loads(document):
    issues = validate_mapping(document)
    try:
        load_config(document, environ=NO_ENV)
    except ConfigError:
        assert issues
    else:
        assert issues == []


def test_a_disabled_configuration_does_not_read_the_files_it_names():
    # The kill switch must work whatever else the file says.
    cfg = load_config({"enabled": False, "rules": {"regression": {"baseline_file": "/nonexistent.json"}}},
                      environ=NO_ENV)
    assert not cfg.enabled


def test_yaml_merge_keys_are_not_keys_given_twice(tmp_path):
    path = write(tmp_path, "x-port: &p {port: 9464, per_site: true}\n"
                           "exporter:\n  <<: *p\n  port: 9500\n")
    issues = config_issues(path, environ=NO_ENV)
    assert [i.key for i in issues] == ["x-port"]  # unknown top-level key, and nothing else
    path = write(tmp_path, "exporter:\n  <<: {port: 9464, per_site: true}\n  port: 9500\n", "b.yaml")
    assert load_config(path, environ=NO_ENV).exporter.port == 9500


@pytest.mark.parametrize("content", ['{"version": 1, "entries": {}, "steps": null}',
                                     '{"version": 1, "entries": {"k": {"forward_seconds": "a", "backward_seconds": 1}}}'])
def test_a_malformed_baseline_is_a_config_issue_not_a_traceback(tmp_path, content):
    baseline = write(tmp_path, content, "b.json")
    (issue,) = config_issues({"rules": {"regression": {"baseline_file": str(baseline)}}}, environ=NO_ENV)
    assert issue.key == "rules.regression.baseline_file"


def test_per_impl_thresholds_from_a_file_and_an_override_merge_entry_by_entry(tmp_path):
    path = tmp_path / "calibrated.yaml"
    path.write_text("rules:\n  backward_forward_ratio:\n    per_impl: {cudnn: 3.7, flash: 4}\n")
    cfg = load_config(path, {"rules.backward_forward_ratio.per_impl.efficient": 3.5},
                      environ=NO_ENV)
    assert cfg.rules.backward_forward_ratio.per_impl == {"cudnn": 3.7, "flash": 4.0,
                                                         "efficient": 3.5}
    assert cfg.rules.backward_forward_ratio.threshold_for("math") == 3.0


def test_a_bad_per_impl_entry_in_a_file_names_its_line_and_its_dotted_key(tmp_path):
    path = tmp_path / "calibrated.yaml"
    path.write_text("rules:\n  backward_forward_ratio:\n    per_impl:\n      cudnn: 3.7\n"
                    "      flash: -1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, environ=NO_ENV)
    assert str(e.value) == (f"{path}:5: rules.backward_forward_ratio.per_impl.flash must be a "
                            "number > 0, got -1")
