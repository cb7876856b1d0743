"""The Prometheus endpoint, the JSONL run log and the port policy, on CPU with real HTTP scrapes."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import fadiag
from fadiag.export.jsonl import JsonlSink, read_run
from fadiag.export.prometheus import Metrics
from fadiag.steps.records import CallRecord, Flag, StepReport
from tests.models import GPT, train

CONTRACT = {
    "fadiag_attention_forward_seconds": "histogram",
    "fadiag_attention_backward_seconds": "histogram",
    "fadiag_attention_backward_forward_ratio": "gauge",
    "fadiag_attention_memory_savings_ratio": "gauge",
    "fadiag_attention_kept_bytes": "gauge",
    "fadiag_attention_standard_bytes": "gauge",
    "fadiag_attention_peak_bytes": "gauge",
    "fadiag_step_peak_memory_bytes": "gauge",
    "fadiag_steps": "counter",
    "fadiag_attention_calls": "counter",
    "fadiag_flags": "counter",
    "fadiag_attention_oldest_inflight_seconds": "gauge",
    "fadiag_internal_errors": "counter",
    "fadiag_resolver_cpu_seconds": "counter",
    "fadiag_build_info": "gauge",
    "fadiag_capture_info": "gauge",
}


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_a_scrape_after_five_steps_holds_every_contract_metric():
    s = fadiag.attach(port=0)
    train(GPT(layers=3), steps=5)
    assert s.flush(10)
    fams = families(scrape(s.port))
    missing = {n for n in CONTRACT if n not in fams}
    # peak bytes come from a device allocator; on CPU the step peak is the process RSS
    assert missing <= {"fadiag_attention_peak_bytes"}
    for name, kind in CONTRACT.items():
        if name in fams:
            assert fams[name].type == kind, name
    fwd = {s.name: s for s in fams["fadiag_attention_forward_seconds"].samples
           if s.name.endswith("_count")}
    [count] = fwd.values()
    assert count.value == 5 * 3 and count.labels == {"rank": "0", "impl": "cpu_flash"}
    savings = fams["fadiag_attention_memory_savings_ratio"].samples[0].value
    assert 0.0 <= savings <= 1.0
    assert fams["fadiag_steps"].samples[0].value == 5
    # Host-clock windows hold no device wait: a series for each measured impl, at 0.
    [host_bound] = fams["fadiag_attention_host_bound_calls"].samples
    assert host_bound.labels == {"rank": "0", "impl": "cpu_flash"} and host_bound.value == 0
    assert not any(s.name.endswith("_created") for f in fams.values() for s in f.samples)


def test_the_regression_ratio_is_served_once_a_baseline_exists():
    # Every step compared (max_cpu_wait 1), so a busy machine leaves the baseline to form.
    s = fadiag.attach(port=0, **{"rules.regression.warmup_steps": 1, "rules.regression.window": 3,
                                 "rules.regression.max_cpu_wait": 1.0})
    train(GPT(layers=2), steps=3)
    assert s.flush(10)
    fams = families(scrape(s.port))
    assert "fadiag_attention_regression_ratio" not in fams  # still collecting its baseline
    train(GPT(layers=2), steps=3)
    assert s.flush(10)
    [sample] = families(scrape(s.port))["fadiag_attention_regression_ratio"].samples
    assert sample.labels == {"rank": "0"} and sample.value == s.rules.regression_ratio
    last = s.last_step()
    assert sample.value == pytest.approx(last.attention_seconds / s.rules.baseline_seconds)


def test_the_resolver_threads_cpu_time_is_served_and_grows_with_the_steps_it_resolves():
    s = fadiag.attach(port=0)
    train(GPT(layers=2), steps=3)
    assert s.flush(10)
    [first] = families(scrape(s.port))["fadiag_resolver_cpu_seconds"].samples
    assert first.labels == {"rank": "0"} and first.value > 0.0
    train(GPT(layers=2), steps=3)
    assert s.flush(10)
    [then] = families(scrape(s.port))["fadiag_resolver_cpu_seconds"].samples
    assert then.value > first.value


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_check_metrics_passes_on_a_real_scrape():
    s = fadiag.attach(port=0, per_site=True)
    train(GPT(layers=2), steps=3)
    assert s.flush(10)
    text = scrape(s.port)
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_per_site_series_are_capped():
    registry = CollectorRegistry()
    metrics = Metrics(rank=0, registry=registry, per_site=True, max_sites=2)
    calls = [CallRecord(site=f"m.py:1#{i}", impl="flash", shape=(1, 1, 8, 8, 8), dtype="float16",
                        causal=True, forward_seconds=1e-3, backward_seconds=2e-3) for i in range(5)]
    metrics.emit(StepReport(step=1, forward_seconds=5e-3, backward_seconds=1e-2, kept_bytes=None,
                            standard_bytes=0, peak_bytes=None, calls=calls))
    sites = {s.labels["site"] for f in registry.collect() for s in f.samples if "site" in s.labels}
    assert sites == {"m.py:1#0", "m.py:1#1", "other"}
    assert registry.get_sample_value("fadiag_attention_forward_seconds_count",
                                     {"rank": "0", "impl": "flash", "site": "other"}) == 3


def test_calls_whose_windows_may_hold_host_time_are_counted_by_impl():
    registry = CollectorRegistry()
    metrics = Metrics(rank=0, registry=registry)
    kw = dict(site="m.py:1#0", shape=(2, 16, 2048, 2048, 128), dtype="bfloat16", causal=True,
              device="cuda", forward_seconds=1e-4, backward_seconds=3e-4)
    calls = [CallRecord(impl="cudnn", backward_host_seconds=1e-4, **kw),   # host-bound
             CallRecord(impl="cudnn", backward_host_seconds=1e-6, **kw),   # 0.3 %: device work
             CallRecord(impl="flash", forward_host_seconds=2e-5, **kw)]    # host-bound
    metrics.emit(StepReport(step=1, forward_seconds=3e-4, backward_seconds=9e-4, kept_bytes=None,
                            standard_bytes=0, peak_bytes=None, calls=calls))
    value = registry.get_sample_value
    assert value("fadiag_attention_host_bound_calls_total", {"rank": "0", "impl": "cudnn"}) == 1
    assert value("fadiag_attention_host_bound_calls_total", {"rank": "0", "impl": "flash"}) == 1
    assert value("fadiag_attention_calls_total", {"rank": "0", "impl": "cudnn"}) == 2


def test_the_ratio_gauge_is_the_steps_device_bound_calls_and_absent_when_there_are_none():
    # A starved device's window holds the host's launches: the gauge divides the calls whose
    # windows are device work (here 3.3x), not the sum of every window (here 1.8x).
    registry = CollectorRegistry()
    metrics = Metrics(rank=0, registry=registry)
    kw = dict(impl="cudnn", shape=(2, 16, 2048, 2048, 128), dtype="bfloat16", causal=True,
              device="cuda")
    device_work = CallRecord(site="m.py:1#0", forward_seconds=1e-4, backward_seconds=3.3e-4, **kw)
    starved = CallRecord(site="m.py:1#1", forward_seconds=4e-4, backward_seconds=3.7e-4,
                         forward_host_seconds=3e-4, **kw)
    step = StepReport(step=1, forward_seconds=5e-4, backward_seconds=7e-4, kept_bytes=None,
                      standard_bytes=0, peak_bytes=None, calls=[device_work, starved])
    metrics.emit(step)
    ratio = {"rank": "0"}
    assert registry.get_sample_value("fadiag_attention_backward_forward_ratio", ratio) == pytest.approx(3.3)
    assert registry.get_sample_value("fadiag_step_attention_forward_seconds", ratio) == 5e-4
    metrics.emit(StepReport(step=2, forward_seconds=4e-4, backward_seconds=3.7e-4, kept_bytes=None,
                            standard_bytes=0, peak_bytes=None, calls=[starved]))
    assert registry.get_sample_value("fadiag_attention_backward_forward_ratio", ratio) is None
    assert registry.get_sample_value("fadiag_attention_host_bound_calls_total",
                                     {"rank": "0", "impl": "cudnn"}) == 2


def test_flags_are_counted_once_per_episode_and_active_while_open():
    registry = CollectorRegistry()
    metrics = Metrics(rank=3, registry=registry)
    flag = Flag(rule="hang", value=400, threshold=300, step=7, site="*", message="stuck",
                severity="critical")
    metrics.flag(flag)
    labels = {"rank": "3", "rule": "hang"}
    active = {**labels, "severity": "critical"}
    assert registry.get_sample_value("fadiag_flags_total", labels) == 1
    assert registry.get_sample_value("fadiag_flag_active", active) == 1
    metrics.flag(Flag(rule="hang", value=0, threshold=300, step=8, site="*", message="", cleared=True))
    assert registry.get_sample_value("fadiag_flags_total", labels) == 1
    assert registry.get_sample_value("fadiag_flag_active", active) == 0


def test_an_info_ratio_flag_is_active_as_info_and_a_warning_one_as_warning():
    registry = CollectorRegistry()
    metrics = Metrics(rank=0, registry=registry)

    def active(severity):
        return registry.get_sample_value("fadiag_flag_active", {
            "rank": "0", "rule": "backward_forward_ratio", "severity": severity})

    metrics.flag(Flag(rule="backward_forward_ratio", value=3.3, threshold=3.0, step=4,
                      site="m.py:1#0", message="within", severity="info"))
    assert (active("info"), active("warning")) == (1, 0)
    metrics.flag(Flag(rule="backward_forward_ratio", value=4.6, threshold=3.0, step=5,
                      site="m.py:2#0", message="beyond", severity="warning"))
    assert (active("info"), active("warning")) == (1, 1)
    metrics.flag(Flag(rule="backward_forward_ratio", value=4.6, threshold=3.0, step=9,
                      site="m.py:2#0", message="", cleared=True, severity="warning"))
    assert (active("info"), active("warning")) == (1, 0)


def _busy_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def test_port_in_use_moves_to_the_next_free_port(caplog):
    sock = _busy_port()
    taken = sock.getsockname()[1]
    with sock:
        s = fadiag.attach(port=taken)
        assert s.port is not None and s.port != taken
    assert "was taken" in caplog.text


def test_port_in_use_can_disable_the_exporter_and_training_continues(caplog):
    with _busy_port() as sock:
        s = fadiag.attach(port=sock.getsockname()[1], **{"exporter.on_port_in_use": "disable"})
        assert s.port is None
        train(GPT(layers=1), steps=2)
        assert s.flush(10) and s.last_step().step == 2
    assert "continuing without the exporter" in caplog.text


def test_port_in_use_can_fail_attach():
    with _busy_port() as sock, pytest.raises(fadiag.FadiagError, match="on_port_in_use"):
        fadiag.attach(port=sock.getsockname()[1], **{"exporter.on_port_in_use": "fail"})
    assert fadiag.current_session() is None


def test_detach_closes_the_port():
    s = fadiag.attach(port=0)
    port = s.port
    fadiag.detach()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_jsonl_written_during_a_run_reads_back_into_step_reports(tmp_path):
    s = fadiag.attach(port=0, jsonl=str(tmp_path))
    train(GPT(layers=2), steps=4)
    assert s.flush(10)
    fadiag.detach()
    run = read_run(tmp_path / "fadiag-rank0.jsonl")
    assert run.meta["rank"] == 0 and run.bad_lines == 0
    assert [r.step for r in run.steps] == [1, 2, 3, 4]
    assert run.steps[-1].calls[0].shape == s.history()[-1].calls[0].shape
    assert run.steps[-1].forward_seconds == pytest.approx(s.history()[-1].forward_seconds)


def test_jsonl_rotates_by_size_and_reads_back_in_order(tmp_path):
    sink = JsonlSink(tmp_path, rank=1, meta={"run_id": "r"}, max_bytes=2048, backups=2)
    calls = [CallRecord(site="a#0", impl="flash", shape=(1, 2, 3, 4, 5), dtype="bf16", causal=True)]
    for i in range(1, 41):
        sink.emit(StepReport(step=i, forward_seconds=1.0, backward_seconds=2.0, kept_bytes=1,
                             standard_bytes=2, peak_bytes=None, calls=calls))
    sink.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["fadiag-rank1.jsonl", "fadiag-rank1.jsonl.1", "fadiag-rank1.jsonl.2"]
    steps = [r.step for r in read_run(tmp_path / "fadiag-rank1.jsonl").steps]
    assert steps == sorted(steps) and steps[-1] == 40 and len(steps) < 40


def test_unwritable_jsonl_directory_is_counted_and_training_continues(tmp_path):
    target = tmp_path / "file-not-dir"
    target.write_text("x")
    s = fadiag.attach(port=0, jsonl=str(target / "sub"))
    train(GPT(layers=1), steps=2)
    assert s.flush(10)
    assert s.last_step().step == 2


TORCHRUN_SCRIPT = textwrap.dedent("""
    import os, sys, time, urllib.request
    import torch, torch.distributed as dist
    sys.path.insert(0, {root!r})
    import fadiag
    from tests.models import GPT, train
    dist.init_process_group("gloo")
    s = fadiag.attach(port={port})
    model = torch.nn.parallel.DistributedDataParallel(GPT(layers=2))
    train(model, steps=3)
    s.flush(10)
    dist.barrier()
    text = urllib.request.urlopen(f"http://127.0.0.1:{{s.port}}/metrics").read().decode()
    lines = ["RANK %d PORT %d STEPS %s" % (dist.get_rank(), s.port,
             [l for l in text.splitlines() if l.startswith("fadiag_steps_total")][0])]
    if dist.get_rank() == 0:
        other = urllib.request.urlopen(f"http://127.0.0.1:{port_1}/metrics").read().decode()
        lines.append("OTHER " + [l for l in other.splitlines()
                                 if l.startswith("fadiag_steps_total")][0])
    with open({out!r} + str(dist.get_rank()), "w") as f:
        f.write(chr(10).join(lines))
    dist.barrier()
    dist.destroy_process_group()
""")


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        try:
            with socket.socket() as b:
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def test_torchrun_two_ranks_serve_two_endpoints_with_their_rank(tmp_path):
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = _free_port_pair()
    script = tmp_path / "ddp.py"
    script.write_text(TORCHRUN_SCRIPT.format(root=root, port=port, port_1=port + 1,
                                             out=str(tmp_path / "rank")))
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port_pair()), str(script)],
        capture_output=True, text=True, timeout=240, cwd=root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    out.stdout = (tmp_path / "rank0").read_text() + "\n" + (tmp_path / "rank1").read_text()
    assert f'RANK 0 PORT {port} STEPS fadiag_steps_total{{rank="0"}} 3.0' in out.stdout
    assert f'RANK 1 PORT {port + 1} STEPS fadiag_steps_total{{rank="1"}} 3.0' in out.stdout
    assert 'OTHER fadiag_steps_total{rank="1"} 3.0' in out.stdout


def test_scrapes_during_step_resolution_stay_consistent():
    s = fadiag.attach(port=0)
    stop = time.monotonic() + 3
    errors = []

    def scraper():
        while time.monotonic() < stop:
            try:
                families(scrape(s.port))
            except Exception as e:  # pragma: no cover - the assertion reports it
                errors.append(e)

    import threading

    threads = [threading.Thread(target=scraper) for _ in range(3)]
    for t in threads:
        t.start()
    train(GPT(layers=2), steps=20)
    for t in threads:
        t.join()
    assert errors == [] and s.errors == 0
    assert json.dumps(s.last_step().to_dict())


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_metrics_are_served_over_tls_when_configured(tmp_path):
    import http.client
    import ssl

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    s = fadiag.attach(port=0, **{"exporter.certfile": str(cert), "exporter.keyfile": str(key)})
    ctx = ssl.create_default_context(cafile=str(cert))
    ctx.check_hostname = False
    with urllib.request.urlopen(f"https://127.0.0.1:{s.port}/metrics", context=ctx, timeout=10) as r:
        assert b"fadiag_build_info" in r.read()
    with pytest.raises((OSError, http.client.HTTPException)):
        urllib.request.urlopen(f"http://127.0.0.1:{s.port}/metrics", timeout=5).read()


def test_detach_returns_promptly_with_the_exporter_running():
    s = fadiag.attach(port=0)
    train(GPT(layers=1), steps=2)
    # Right after a request the serving thread starts a fresh wait for the next one: the wait
    # that a shutdown has to outlast is then a whole poll interval.
    scrape(s.port)
    started = time.perf_counter()
    fadiag.detach()
    took = time.perf_counter() - started
    # At most about 0.05 s (the serving thread looks for a shutdown every 50 ms); prometheus_client's
    # own server made every detach() wait out its 0.5 s poll. The bound leaves room for a busy host.
    assert took < 0.25


def test_capture_info_says_what_sees_attention_so_a_compiled_rank_without_the_tap_shows():
    """A rank whose steps report no calls: no attention, or compiled attention no tap sees. The
    capture gauge tells them apart on a dashboard, as the log and `fadiag doctor` do."""
    s = fadiag.attach(port=0, tap="off")
    train(GPT(layers=1), steps=2)
    assert s.flush(10)
    [sample] = families(scrape(s.port))["fadiag_capture_info"].samples
    assert sample.value == 1 and sample.labels == {"rank": "0", "tap": "off", "eager_wrapper": "python"}
    s.capture.tap_status = "unavailable: no C++ compiler"  # as a container without one reports
    assert s.flush(10)
    [sample] = families(scrape(s.port))["fadiag_capture_info"].samples
    assert sample.labels["tap"] == "unavailable"
    assert "installed, loading, off, not loaded, unavailable" in _help_texts(s.port)["fadiag_capture_info"]


def _help_texts(port: int) -> dict[str, str]:
    return {f.name: f.documentation for f in text_string_to_metric_families(scrape(port))}


def test_help_texts_say_what_the_info_gauges_and_the_step_memory_gauge_hold():
    s = fadiag.attach(port=0)
    train(GPT(layers=1), steps=2)
    assert s.flush(10)
    docs = _help_texts(s.port)
    assert "fadiag and torch versions" in docs["fadiag_build_info"]
    assert "rank, run_id, world_size, hostname, device_name" in docs["fadiag_run_info"]
    step_memory = docs["fadiag_step_peak_memory_bytes"]
    assert "on GPU/NPU the device allocator's peak" in step_memory
    assert "on CPU the process's resident set size" in step_memory
