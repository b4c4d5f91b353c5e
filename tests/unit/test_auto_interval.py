"""every="auto": the Young/Daly formula, the cost meter on synthetic step times, the URL/YAML forms, bad input, and a
real fit whose chosen interval grows when its tier's writes cost training time."""

from __future__ import annotations

import logging
import math
import time

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends.local import LocalTier
from lightning_snapshot.backends.ram.tier import RamTier
from lightning_snapshot.backends.registry import parse_tier
from lightning_snapshot.errors import ConfigError
from lightning_snapshot.schedule.interval import (
    DEFAULT_NODE_MTBF_S,
    CostMeter,
    default_mtbf,
    parse_duration,
    young_daly_seconds,
    young_daly_steps,
)

# ---------------------------------------------------------------------------------------------------- formula


def test_young_daly_formula():
    assert young_daly_seconds(2.0, 3600.0) == pytest.approx(math.sqrt(2 * 2.0 * 3600.0)) == pytest.approx(120.0)
    assert young_daly_seconds(0.0, 3600.0) == 0.0
    # 120 s of training at 0.5 s a step
    assert young_daly_steps(2.0, 3600.0, 0.5) == 240
    assert young_daly_steps(2.0, 3600.0, 0.5, min_every=300) == 300
    assert young_daly_steps(2.0, 3600.0, 0.5, max_every=100) == 100
    assert young_daly_steps(0.0, 3600.0, 0.5) == 1  # a free snapshot: every step
    # 4x the cost: 2x the interval
    assert young_daly_steps(8.0, 3600.0, 0.5) == 2 * young_daly_steps(2.0, 3600.0, 0.5)


def test_default_mtbf_is_per_node_mtbf_over_nodes():
    assert DEFAULT_NODE_MTBF_S == 6000 * 3600
    assert default_mtbf(1) == DEFAULT_NODE_MTBF_S
    assert default_mtbf(2048) == pytest.approx(DEFAULT_NODE_MTBF_S / 2048)  # ~2.9 h, as Llama 3's job saw


@pytest.mark.parametrize(
    "value, seconds",
    [
        (90, 90.0),
        (1.5, 1.5),
        ("90", 90.0),
        ("90s", 90.0),
        ("30m", 1800.0),
        ("4h", 14400.0),
        ("2d", 172800.0),
        ("0.5h", 1800.0),
    ],
)
def test_parse_duration(value, seconds):
    assert parse_duration(value, "mtbf") == seconds


@pytest.mark.parametrize("value", [0, -5, "0h", "4 hours", "h", "", float("nan"), float("inf"), True, None, [4]])
def test_parse_duration_rejects(value):
    with pytest.raises(
        ConfigError,
        match=r"mtbf must be a positive duration: seconds \(14400\) or a number with s,"
        r" m, h or d",
    ):
        parse_duration(value, "mtbf")


# ---------------------------------------------------------------------------------------------------- estimator


def test_meter_measures_excess_over_clean_steps():
    m = CostMeter(2)
    for _ in range(10):
        m.step(0.100)
    assert m.step_seconds == pytest.approx(0.100)
    assert m.cost(0) is None
    m.opened(0)  # staged at the end of a step: the next steps count
    m.step(0.150)  # stall 50 ms
    m.step(0.120)  # background work: 20 ms
    m.step(0.110)  # 10 ms
    m.closed(0)
    assert m.cost(0) == pytest.approx(0.080)
    assert m.cost(1) is None
    m.step(0.100)
    assert m.step_seconds == pytest.approx(0.100)  # in-flight steps never enter the baseline


def test_meter_shares_excess_between_snapshots_in_flight():
    m = CostMeter(2)
    for _ in range(5):
        m.step(1.0)
    m.opened(0)
    m.opened(1)
    m.step(1.4)  # 0.4 shared: 0.2 each
    m.closed(1)
    m.step(1.3)  # only tier 0 in flight
    m.opened(0)  # a second snapshot of tier 0 before the first committed: they share the excess
    m.step(1.1)
    m.closed(0)
    assert m.cost(1) == pytest.approx(0.2)
    assert m.cost(0) == pytest.approx(0.2 + 0.3 + 0.05)
    assert m.in_flight(0) == 1
    m.step(1.2)
    m.closed(0)
    assert m.cost(0) == pytest.approx(0.55 + 0.3 * (0.25 - 0.55))


def test_meter_running_estimate_follows_a_slowed_tier_and_ignores_dropped_snapshots():
    m = CostMeter(1, alpha=0.5)
    for _ in range(8):
        m.step(0.01)
    for cost in (0.01, 0.01, 0.09, 0.09):
        m.opened(0)
        m.step(0.01 + cost)
        m.closed(0)
    assert m.cost(0) == pytest.approx(0.01 + 0.5 * 0.08 + 0.25 * 0.08)  # 0.07: halfway there, then 3/4
    m.opened(0)
    m.step(5.0)
    m.closed(0, measured=False)  # skipped (no room): not a sample
    assert m.cost(0) == pytest.approx(0.07)
    m.closed(0)  # nothing in flight: no effect
    assert m.cost(0) == pytest.approx(0.07)


def test_meter_noise_below_baseline_is_not_a_negative_cost():
    m = CostMeter(1)
    for t in (0.10, 0.11, 0.09, 0.10, 0.10):
        m.step(t)
    m.opened(0)
    m.step(0.09)
    m.closed(0)
    assert m.cost(0) == 0.0


# ---------------------------------------------------------------------------------------------------- options


def test_every_auto_url_and_bounds(tmp_path):
    tier = parse_tier(f"{tmp_path}/a?every=auto&min_every=5&max_every=500&keep=2")
    assert isinstance(tier, LocalTier) and tier.auto_every
    assert (tier.every_n_train_steps, tier.min_every, tier.max_every) == (10, 5, 500)  # the first interval: 10
    assert "every_n_train_steps=auto" in repr(tier)
    assert parse_tier(f"{tmp_path}/b?every=auto&min_every=20").every_n_train_steps == 20
    assert parse_tier(f"{tmp_path}/c?every=auto&max_every=4").every_n_train_steps == 4
    ram = parse_tier("ram://?every=auto&max_every=50")
    assert isinstance(ram, RamTier) and ram.auto_every and ram.max_every == 50
    obj = parse_tier("memory://bucket/run?every=auto")
    assert obj.auto_every and obj.min_every == 1 and obj.max_every is None
    plain = parse_tier(f"{tmp_path}/d?every=7")
    assert not plain.auto_every and plain.every_n_train_steps == 7
    # the spec the snapshot agent rebuilds the tier from keeps "auto"
    assert type(ram).from_spec(ram.spec()).auto_every


@pytest.mark.parametrize(
    "query, message",
    [
        ("every=often", "tier URL option every='often' must be a number of steps or auto"),
        ("every=auto&min_every=x", "tier URL option min_every='x' must be an integer"),
        ("every=auto&min_every=0", "min_every must be an integer >= 1 (steps) or None, got 0"),
        ("every=auto&max_every=-3", "max_every must be an integer >= 1 (steps) or None, got -3"),
        ("every=auto&min_every=50&max_every=5", "min_every (50) must not be larger than max_every (5)"),
        (
            "every=10&max_every=50",
            "max_every bounds the interval of every_n_train_steps='auto' (URL every=auto); set"
            " every_n_train_steps='auto' or drop it",
        ),
        ("every=auto&every=auto", "tier URL option 'every' is given twice"),
    ],
)
def test_every_auto_bad_input(tmp_path, query, message):
    with pytest.raises(ConfigError) as e:
        parse_tier(f"{tmp_path}?{query}")
    assert message in str(e.value)


def test_every_auto_object_form_bad_input(tmp_path):
    with pytest.raises(ConfigError, match="every_n_train_steps must be an integer >= 1, 'auto' or None, got 'Auto'"):
        LocalTier(tmp_path, every_n_train_steps="Auto")
    with pytest.raises(ConfigError, match="min_every must be an integer >= 1"):
        LocalTier(tmp_path, every_n_train_steps="auto", min_every=2.5)


def test_callback_mtbf_option(tmp_path):
    assert SnapshotCallback(f"{tmp_path}?every=auto", mtbf="4h").mtbf == 14400.0
    assert SnapshotCallback(f"{tmp_path}?every=auto", mtbf=600).mtbf == 600.0
    assert SnapshotCallback(f"{tmp_path}?every=auto").mtbf is None  # from the number of nodes at setup
    with pytest.raises(ConfigError, match=r"mtbf must be a positive duration.*got '4 hours'"):
        SnapshotCallback(str(tmp_path), mtbf="4 hours")
    with pytest.raises(ConfigError, match=r"mtbf must be a positive duration.*got -1"):
        SnapshotCallback(str(tmp_path), mtbf=-1)


def test_yaml_form(tmp_path):
    """LightningCLI builds the callback from YAML through the same constructors (jsonargparse)."""
    pytest.importorskip("jsonargparse")
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(SnapshotCallback, "snap")
    cfg = parser.parse_string(f"snap:\n  tiers: ['{tmp_path}/y?every=auto&min_every=3&max_every=30']\n  mtbf: 2h\n")
    cb = parser.instantiate(cfg).snap
    assert cb.mtbf == 7200.0
    assert cb.tiers[0].auto_every and (cb.tiers[0].min_every, cb.tiers[0].max_every) == (3, 30)
    bad = parser.parse_string(f"snap:\n  tiers: ['{tmp_path}/y?every=auto']\n  mtbf: soon\n")
    with pytest.raises(ConfigError, match="mtbf must be a positive duration"):
        parser.instantiate(bad)


# ---------------------------------------------------------------------------------------------------- end to end


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class BusyTier(LocalTier):
    """A real local tier whose writes first spend ``busy`` seconds of pure-Python work in the persist thread
    (compression or checksums on the CPU): that competes with the training thread for the interpreter."""

    def __init__(self, path, busy: float, **kw) -> None:
        super().__init__(path, **kw)
        self.busy = busy

    def write(self, key, buffers):
        end = time.perf_counter() + self.busy
        n = 0
        while time.perf_counter() < end:
            n += 1
        return super().write(key, buffers)


class RecordingCallback(SnapshotCallback):
    """Records, after every re-tuning from a measured cost, the interval chosen and the step time it was converted
    with."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.decisions: list[tuple[int, float]] = []

    def setup(self, trainer, pl_module, stage) -> None:
        super().setup(trainer, pl_module, stage)
        pipeline = self._pipeline
        retune = pipeline._retune

        def recording_retune() -> None:
            retune()
            if self._meter is not None and self._meter.cost(0) is not None:  # (decided from a measured cost)
                self.decisions.append((self.config.schedules[0].every, self._meter.step_seconds))

        pipeline._retune = recording_retune


def _fit(tmp_path, name: str, busy: float) -> tuple[LocalTier, RecordingCallback]:
    L.seed_everything(0, verbose=False)
    tier = BusyTier(tmp_path / name, busy, every_n_train_steps="auto", min_every=2, max_every=2000, keep_last=1)
    cb = RecordingCallback(tier, mtbf=2.0, resume=False)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = L.Trainer(
        max_steps=150, callbacks=[cb], logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(_Net(), DataLoader(data, batch_size=4))
    return tier, cb


def test_interval_reacts_to_a_slowed_tier(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lightning_snapshot")
    fast, fast_cb = _fit(tmp_path, "fast", 0.0)
    # (1.5 s of work per write: far above what a loaded machine adds to the fast tier's measured cost, which CI saw
    # reach 0.2 s with other tests running beside it)
    slow, slow_cb = _fit(tmp_path, "slow", 1.5)
    fast_cost, slow_cost = fast_cb._meter.cost(0), slow_cb._meter.cost(0)
    fast_every, slow_every = fast_cb.config.schedules[0].every, slow_cb.config.schedules[0].every
    print(
        f"fast: cost {fast_cost * 1e3:.1f} ms interval {fast_every}; slow: cost"
        f" {slow_cost * 1e3:.1f} ms interval {slow_every}"
    )
    # (margins for a loaded machine: other processes add noise to the fast tier's few-ms cost)
    assert slow_cost > 3 * fast_cost
    # Young/Daly: the time between snapshots grows with the sqrt of the cost ratio. Compared in seconds of training
    # as each run decided it (the last interval chosen x the step time it was converted with): on a loaded machine
    # the two runs' step times differ, so their intervals in steps need not.
    (fast_steps, fast_step_s), (slow_steps, slow_step_s) = fast_cb.decisions[-1], slow_cb.decisions[-1]
    assert slow_steps * slow_step_s > 1.5 * fast_steps * fast_step_s, (fast_cb.decisions, slow_cb.decisions)
    assert any(
        "now snapshots every" in r.getMessage() and str(tmp_path / "slow") in r.getMessage() for r in caplog.records
    )
