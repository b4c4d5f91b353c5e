"""The goodput simulator (hand-checked cases, seeds, Young/Daly intervals) and ``lightning-snapshot plan``."""

from __future__ import annotations

import math

import pytest

from lightning_snapshot.cli.main import main
from lightning_snapshot.cli.plan import Figures, figures_from_events, memory_bytes, restore_seconds, setups
from lightning_snapshot.schedule.simulate import TierModel, simulate


def test_no_failures_costs_only_the_snapshots():
    tier = TierModel("local", cost_s=2.0, interval_s=100.0)
    out = simulate([tier], work_s=1000.0, mtbf_s=1e9, restart_s=60.0, failure_times=[])
    assert out.goodput == pytest.approx(1 / 1.02)
    assert out.failures == 0 and out.lost_work_s == 0 and out.restart_s == 0


def test_one_failure_by_hand():
    # snapshots every 10 s of training, free, held at once; a failure at 35 s loses 5 s, then 5 s restart + 2 s
    # restore, then the 70 s left
    tier = TierModel("local", cost_s=0.0, persist_s=0.0, restore_s=2.0, interval_s=10.0)
    out = simulate([tier], work_s=100.0, mtbf_s=1e9, restart_s=5.0, failure_times=[35.0])
    assert out.wall_s == pytest.approx(112.0)
    assert out.goodput == pytest.approx(100 / 112)
    assert (out.failures, out.lost_work_s, out.restart_s, out.restore_s) == (1, pytest.approx(5.0), 5.0, 2.0)


def test_a_snapshot_still_persisting_is_not_held_and_a_failure_during_restart_restarts():
    tier = TierModel("local", cost_s=0.0, persist_s=8.0, restore_s=0.0, interval_s=10.0)
    # at 35 s the snapshot of 30 s is still being written (until 38 s): the one of 20 s is restored
    out = simulate([tier], work_s=100.0, mtbf_s=1e9, restart_s=5.0, failure_times=[35.0, 37.0])
    # 35 trained, 15 lost; restart from 35, fails at 37 (2 s of restart), restarts 37..42, 80 s left
    assert out.lost_work_s == pytest.approx(15.0)
    assert out.failures == 2
    assert out.wall_s == pytest.approx(42.0 + 80.0)


def test_node_loss_falls_back_to_the_tier_that_survives():
    ram = TierModel("ram", cost_s=0.0, interval_s=1.0, restore_s=0.0, survives_node_loss=False)
    local = TierModel("local", cost_s=0.0, interval_s=10.0, restore_s=0.0)
    kept = simulate([ram, local], work_s=100.0, mtbf_s=1e9, restart_s=0.0, node_loss=0.0, failure_times=[35.5])
    lost = simulate([ram, local], work_s=100.0, mtbf_s=1e9, restart_s=0.0, node_loss=1.0, failure_times=[35.5])
    assert kept.lost_work_s == pytest.approx(0.5)
    assert lost.lost_work_s == pytest.approx(5.5)


def test_young_daly_intervals_and_seeded_runs():
    tier = TierModel("local", cost_s=2.0)
    a = simulate([tier], work_s=86400.0, mtbf_s=3600.0, restart_s=60.0, seed=3)
    b = simulate([tier], work_s=86400.0, mtbf_s=3600.0, restart_s=60.0, seed=3)
    c = simulate([tier], work_s=86400.0, mtbf_s=3600.0, restart_s=60.0, seed=4)
    assert a == b and a != c
    assert a.intervals_s == (pytest.approx(math.sqrt(2 * 2.0 * 3600.0)),)
    assert 15 < a.failures < 40  # ~24 h / 1 h, plus failures during restarts
    # Young/Daly beats intervals 4x shorter or longer, on the same failures
    for factor in (0.25, 4.0):
        other = simulate(
            [TierModel("local", cost_s=2.0, interval_s=120.0 * factor)],
            work_s=86400.0,
            mtbf_s=3600.0,
            restart_s=60.0,
            seed=3,
        )
        assert a.goodput > other.goodput
    # a cheap tier that survives every failure lets the costlier one behind it snapshot rarely
    ram = TierModel("ram", cost_s=0.1)
    out = simulate([ram, tier], work_s=86400.0, mtbf_s=3600.0, restart_s=60.0, runs=1)
    assert out.intervals_s[1] == pytest.approx(math.sqrt(2 * 2.0 * 3600.0 / 0.01))


def test_setups_and_memory():
    tiers = setups(Figures(), node_bytes=8e9, erasure=(4, 2), gpus=8)
    assert list(tiers) == ["local", "ram+local", "ram-ec4+2+local+object"]
    assert [t.name for t in tiers["ram-ec4+2+local+object"]] == ["ram-ec", "local", "object"]
    assert memory_bytes("local", 8e9, (4, 2)) == 16e9
    assert memory_bytes("ram+local", 8e9, (4, 2)) == 32e9
    assert memory_bytes("ram-ec4+2+local+object", 8e9, (4, 2)) == pytest.approx(16e9 + 2 * 8e9 * 1.5)


def test_plan_command_prints_every_node_count(capsys):
    assert main(["plan", "--nodes", "1,8,16384", "--work", "2d", "--runs", "1", "--state-bytes", "2GB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["nodes", "job", "MTBF", "set-up"]
    assert "DDP restore from object store" in lines[0] and lines[1].split() == ["every", "rank", "read", "once"]
    assert len(lines) == 2 + 3 * 3
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["1"] * 3 + ["8"] * 3 + ["16384"] * 3
    assert all(0 < float(r[3]) <= 1 for r in rows)
    assert "RAM erasure needs >= 6 nodes" in lines[4]
    # the restore columns beside the goodput: 2 GB per GPU, 8 GPUs, 1 GB/s per node, 200 GB/s for the store
    # 16384 x 8 x 2 GB at 200 GB/s = 21.8 min; read once: 2 GB / 200 GB/s + 2 GB / 10 GB/s twice (network, node)
    assert rows[-1][7:9] == ["21.8m", "0.4s"]


def test_restore_model_arithmetic():
    f = Figures(object_gbps=1.0, store_gbps=100.0, net_gbps=10.0, ram_read_gbps=20.0)
    # every rank reads the whole 4 GB: a node of 8 reads 32 GB at 1 GB/s, until the store's 100 GB/s is the limit
    assert restore_seconds(1, 8, 4e9, f, read_once=False) == pytest.approx(32.0)
    assert restore_seconds(1024, 8, 4e9, f, read_once=False) == pytest.approx(1024 * 32 / 100)
    # read once: one node reads the 4 GB at 1 GB/s, its 8 ranks share it through memory (4 GB / 20 GB/s)
    assert restore_seconds(1, 8, 4e9, f, read_once=True) == pytest.approx(4.0 + 0.2)
    # 4 nodes read 1 GB each, and each node receives the other 3 GB over the network at 10 GB/s
    assert restore_seconds(4, 8, 4e9, f, read_once=True) == pytest.approx(1.0 + 0.3 + 0.2)
    # many nodes: the store's 100 GB/s bounds the read (4 GB / 100 GB/s), the network the rest
    assert restore_seconds(16384, 1, 4e9, f, read_once=True) == pytest.approx(0.04 + 0.4 * 16383 / 16384)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "0"], "node counts must be 1 to 16384"),
        (["--nodes", "20000"], "node counts must be 1 to 16384"),
        (["--node-mtbf", "soon"], "must be a positive duration"),
        (["--state-bytes", "lots"], "expected bytes such as 2e9, 16GiB or 500MB"),
        (["--erasure", "4"], "expected k+m such as 4+2"),
        (["--node-loss", "1.5"], "--node-loss must be a probability from 0 to 1"),
        (["--local-gbps", "0"], "bandwidths must be positive"),
    ],
)
def test_plan_bad_input(capsys, args, message):
    try:
        status = main(["plan", *args])
    except SystemExit as e:  # (argparse's own usage errors)
        status = e.code
    assert status == 2
    assert message in capsys.readouterr().err


def test_plan_from_tensorboard_metrics(tmp_path, capsys):
    """The figures of a run's event files (written by Lightning's TensorBoardLogger, as the callback's are)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path, name="", version="run")
    for step in range(1, 4):
        logger.log_metrics(
            {
                "snapshot/bytes": 1e9,
                "snapshot/stall_ms": 100.0,
                "snapshot/local/persist_ms": 500.0,
                "snapshot/local/cost_ms": 150.0,
            },
            step=step,
        )
    logger.log_metrics({"restore/ms": 250.0}, step=4)
    logger.finalize("success")
    figures = figures_from_events(tmp_path)
    assert figures.stall_gbps == pytest.approx(10.0)  # 1 GB in 100 ms
    assert figures.local_gbps == pytest.approx(2.0)
    assert figures.interference == pytest.approx(0.1)  # (150 - 100) ms of 500 ms in the background
    assert figures.local_read_gbps == pytest.approx(4.0)
    assert main(["plan", "--nodes", "64", "--work", "1d", "--runs", "1", "--metrics", str(tmp_path)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 5
    assert main(["plan", "--metrics", str(tmp_path / "nothing")]) == 1
    assert "no TensorBoard events with snapshot metrics" in capsys.readouterr().err


def test_a_failure_during_start_up_starts_the_job_again():
    tier = TierModel("local", cost_s=0.0, interval_s=10.0)
    # start-up 10 s, a failure at 4 s: 5 s of restart from there, then 100 s of training
    out = simulate([tier], work_s=100.0, mtbf_s=1e9, restart_s=5.0, failure_times=[4.0], start_s=10.0)
    assert out.wall_s == pytest.approx(109.0)
    assert out.failures == 1 and out.lost_work_s == 0
