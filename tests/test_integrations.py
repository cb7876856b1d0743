"""Trainer callbacks: attach/detach ownership, figures into trainer logs, lazy framework imports."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fadiag
from fadiag.integrations import TrainingRun
from fadiag.steps.records import Flag, StepReport

ROOT = Path(__file__).resolve().parents[1]


class FakeSession:
    def __init__(self) -> None:
        self.steps: list[StepReport] = []

    def history(self) -> list[StepReport]:
        return list(self.steps)

    def flush(self, timeout: float) -> bool:
        return True


def _report(n: int, flags: tuple[str, ...] = ()) -> StepReport:
    return StepReport(step=n, forward_seconds=0.002, backward_seconds=0.005, kept_bytes=100,
                      standard_bytes=1000, peak_bytes=None,
                      flags=[Flag(rule=r, value=1.0, threshold=0.5, step=n, site="s", message="m")
                             for r in flags])


@pytest.fixture
def fake_fadiag(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    state: dict[str, Any] = {"session": None, "attached": 0, "detached": 0}

    def attach(config: Any = None, **overrides: Any) -> FakeSession:
        # As fadiag.attach: the session already attached, if any (its settings then ignored).
        if state["session"] is not None:
            state["ignored"] = overrides
            return state["session"]
        state["attached"] += 1
        state["overrides"] = overrides
        state["session"] = FakeSession()
        return state["session"]

    def detach() -> None:
        state["detached"] += 1
        state["session"] = None

    monkeypatch.setattr(fadiag, "attach", attach)
    monkeypatch.setattr(fadiag, "detach", detach)
    monkeypatch.setattr(fadiag, "current_session", lambda: state["session"])
    return state


def test_importing_fadiag_and_its_integrations_imports_no_framework() -> None:
    code = ("import sys, fadiag, fadiag.integrations.hf, fadiag.integrations.lightning; "
            "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning') "
            "if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_run_that_attached_detaches_at_the_end(fake_fadiag: dict[str, Any]) -> None:
    run = TrainingRun(overrides={"port": 0})
    run.start()
    assert fake_fadiag["attached"] == 1 and fake_fadiag["overrides"] == {"port": 0}
    run.stop()
    assert fake_fadiag["detached"] == 1


def test_a_run_leaves_a_session_it_did_not_attach(fake_fadiag: dict[str, Any]) -> None:
    fake_fadiag["session"] = existing = FakeSession()
    run = TrainingRun(overrides={"port": 0})
    assert run.start() is existing
    # through attach(), which warns that this run's settings are ignored
    assert fake_fadiag["ignored"] == {"port": 0}
    run.stop()
    assert fake_fadiag["attached"] == 0 and fake_fadiag["detached"] == 0


def test_metrics_report_each_new_step_once_with_flags_by_rule(fake_fadiag: dict[str, Any]) -> None:
    run = TrainingRun()
    session = run.start()
    assert run.metrics() == {}
    session.steps += [_report(1, ("memory_savings",)), _report(2, ("memory_savings", "hang"))]
    figures = run.metrics()
    assert figures["fadiag/step"] == 2.0
    assert figures["fadiag/forward_ms"] == pytest.approx(2.0)
    assert figures["fadiag/backward_forward_ratio"] == pytest.approx(2.5)
    assert figures["fadiag/memory_savings"] == pytest.approx(0.9)
    assert figures["fadiag/flags"] == 3.0
    assert figures["fadiag/flags/memory_savings"] == 2.0
    assert run.metrics() == {}


def _forget_built_class(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType) -> None:
    """Drop the class the module built and cached, now and again after the test, so a class
    built on a fake framework never outlives the fake. Through the module's dict: getattr()
    would call the module's __getattr__, which builds the class on whatever is imported now."""
    monkeypatch.setitem(vars(module), "FadiagCallback", None)
    monkeypatch.delitem(vars(module), "FadiagCallback")


def _fake_transformers(monkeypatch: pytest.MonkeyPatch) -> type:
    module = types.ModuleType("transformers")

    class TrainerCallback:
        pass

    module.TrainerCallback = TrainerCallback  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", module)
    import fadiag.integrations.hf as hf

    _forget_built_class(monkeypatch, hf)
    return TrainerCallback


def test_hf_callback_attaches_logs_figures_and_detaches(monkeypatch: pytest.MonkeyPatch,
                                                         fake_fadiag: dict[str, Any]) -> None:
    base = _fake_transformers(monkeypatch)
    from fadiag.integrations.hf import FadiagCallback

    assert issubclass(FadiagCallback, base)
    cb = FadiagCallback(port=0)
    state = types.SimpleNamespace(global_step=1, log_history=[{"loss": 2.0, "step": 1}])
    cb.on_train_begin(None, state, None)
    fake_fadiag["session"].steps.append(_report(1, ("backward_forward_ratio",)))
    logs = {"loss": 2.0}
    cb.on_log(None, state, None, logs=logs)
    assert logs["fadiag/flags/backward_forward_ratio"] == 1.0
    assert state.log_history[-1]["fadiag/forward_ms"] == pytest.approx(2.0)
    # a step resolved after the last log reaches the history at the end of training
    fake_fadiag["session"].steps.append(_report(2))
    state.global_step = 2
    cb.on_train_end(None, state, None)
    assert state.log_history[-1]["step"] == 2 and state.log_history[-1]["fadiag/step"] == 2.0
    assert fake_fadiag["detached"] == 1


def test_hf_callback_without_transformers_says_how_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    import fadiag.integrations.hf as hf

    _forget_built_class(monkeypatch, hf)
    with pytest.raises(ImportError, match="pip install transformers"):
        hf.FadiagCallback  # noqa: B018


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_callback_logs_through_the_module_and_detaches(
        package: str, monkeypatch: pytest.MonkeyPatch, fake_fadiag: dict[str, Any]) -> None:
    class Callback:
        pass

    module = types.ModuleType(package)
    module.Callback = Callback  # type: ignore[attr-defined]
    if package == "lightning.pytorch":
        monkeypatch.setitem(sys.modules, "lightning", types.ModuleType("lightning"))
    else:  # hide Lightning, also where an earlier test imported the real one
        monkeypatch.setitem(sys.modules, "lightning", None)
        monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.setitem(sys.modules, package, module)
    import fadiag.integrations.lightning as lt

    _forget_built_class(monkeypatch, lt)
    cb = lt.FadiagCallback()
    assert isinstance(cb, Callback)
    logged: list[dict[str, float]] = []
    pl_module = types.SimpleNamespace(log_dict=lambda d, **kw: logged.append(d))
    cb.on_train_start(None, pl_module)
    cb.on_train_batch_end(None, pl_module, None, None, 0)
    fake_fadiag["session"].steps.append(_report(1))
    cb.on_train_batch_end(None, pl_module, None, None, 1)
    assert len(logged) == 1 and logged[0]["fadiag/step"] == 1.0
    cb.on_exception(None, pl_module, RuntimeError("boom"))
    assert fake_fadiag["detached"] == 1


def test_a_run_with_the_real_session_reports_measured_steps() -> None:
    run = TrainingRun(overrides={"exporter.enabled": False})
    session = run.start()
    try:
        q = torch.randn(1, 2, 64, 16, requires_grad=True)
        opt = torch.optim.SGD([q], lr=0.1)
        for _ in range(3):
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            opt.step()
            opt.zero_grad()
        session.flush()
        figures = run.metrics()
    finally:
        run.stop()
    assert fadiag.current_session() is None
    assert figures["fadiag/step"] >= 2
    assert figures["fadiag/forward_ms"] > 0 and figures["fadiag/backward_ms"] > 0


def test_hf_callback_is_a_real_trainer_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    import fadiag.integrations.hf as hf

    _forget_built_class(monkeypatch, hf)
    from fadiag.integrations.hf import FadiagCallback

    assert issubclass(FadiagCallback, transformers.TrainerCallback)


def test_lightning_callback_is_a_real_lightning_callback() -> None:
    try:
        from lightning.pytorch import Callback
    except ImportError:
        Callback = pytest.importorskip("pytorch_lightning").Callback
    from fadiag.integrations.lightning import FadiagCallback

    assert issubclass(FadiagCallback, Callback)


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # Lightning's own use of torch's pytree
def test_a_lightning_fit_logs_its_last_step_at_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.loggers import Logger

    import fadiag.integrations.lightning as lt
    from fadiag.steps import resolver

    # A fit shorter than the resolver's batching interval: no step resolves while it trains, so
    # only the wait at the end of training brings the figures to the logger.
    monkeypatch.setattr(resolver, "_BATCH_S", 60.0)
    _forget_built_class(monkeypatch, lt)

    class Recorder(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int | None, dict[str, float]]] = []

        name = "recorder"
        version = 0

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.append((step, dict(metrics)))

    class Attention(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            (x,) = batch
            q, k, v = self.qkv(x).view(x.shape[0], 32, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(40, 32, 16)), batch_size=2)
    logger = Recorder()
    trainer = lightning.Trainer(
        max_steps=20, logger=logger, callbacks=[lt.FadiagCallback(port=0)], accelerator="cpu",
        devices=1, log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False)
    trainer.fit(Attention(), data)
    assert fadiag.current_session() is None  # the callback attached, so it detached
    steps = [metrics["fadiag/step"] for _, metrics in logger.rows if "fadiag/step" in metrics]
    assert steps and steps[-1] == trainer.global_step == 20
    assert logger.rows[-1][0] == 20
