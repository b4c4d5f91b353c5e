"""Asynchronous staging: point-in-time copies, the arena, the metrics, O_DIRECT, the memory budget."""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
import warnings

import lightning as L
import pytest
import torch
from conftest import run_script
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader
from train import Model, Squares

from lightning_snapshot import SnapshotCallback, load_snapshot
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.persist.writer import SnapshotJob, committed_steps, write_snapshot
from lightning_snapshot.staging import stage
from lightning_snapshot.staging.arena import HostArena
from lightning_snapshot.staging.pool import SlotPool
from lightning_snapshot.state.capture import frozen_predicate


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone() if t.numel() else t.detach().clone()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "opt": opt.state_dict()}


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256), nn.Linear(256, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(8, 256)).sum().backward()
        opt.step()
    return model, opt


def _frozen(model, opt):
    return frozen_predicate([opt])


@pytest.mark.parametrize("fence", [True, False], ids=["fenced", "negative-control-unfenced"])
def test_slowed_copy_with_optimizer_step_right_behind_is_point_in_time(fence):
    model, opt = _trained()
    expected = {k: _bits(v) for k, v in stage(_state(model, opt)).tensors.items()}  # synchronous reference
    arena = HostArena()
    stepped = threading.Event()
    # fenced: a slowed copy; unfenced (negative control): the copy starts only once the optimizer step is done, so
    # the control does not depend on how fast this machine runs the step
    hook = (lambda: time.sleep(0.3)) if fence else (lambda: stepped.wait(30))
    try:
        handle = arena.stage_async(_state(model, opt), _frozen(model, opt), step=2, copy_hook=hook)
        if fence:
            handle.fence_training()  # what the callback does in on_before_optimizer_step
        model(torch.randn(8, 256)).sum().backward()  # forward changes BN buffers, the step changes the rest
        opt.step()
        stepped.set()
        handle.wait()
        got = {k: _bits(v) for k, v in handle.state.tensors.items()}
    finally:
        arena.close()
    torn = [k for k in expected if not torch.equal(expected[k], got[k])]
    if fence:
        assert torn == [], f"snapshot is torn: {torn}"
    else:  # proves the test can fail: without the fence the optimizer step lands in the copy
        assert torn, "the unfenced copy should have seen the optimizer step"


@pytest.mark.parametrize("which", [0, 17, 39])
def test_a_byte_changed_in_one_of_many_small_staged_tensors_is_found_and_named(which):
    """(The many-small-tensor case: each tensor is one checksum chunk, hashed in one call.)"""
    tensors = {f"t{i}": torch.full((8,), float(i)) for i in range(40)}
    arena = HostArena()
    try:
        handle = arena.stage_async(tensors, lambda t: True, step=3)
        handle.wait()
        handle.verify()
        offset = {name: off for name, off, _ in handle.state.layout}[f"t{which}"]
        handle.state.packed[offset + 5] ^= 0x01
        with pytest.raises(RuntimeError, match=f"staged bytes of 't{which}' changed after staging"):
            handle.verify()
    finally:
        arena.close()


def test_stamp_and_checksums_are_verified_before_commit(tmp_path):
    model, opt = _trained()
    arena = HostArena()
    try:
        handle = arena.stage_async(_state(model, opt), _frozen(model, opt), step=7)
        handle.wait()
        handle.verify()  # intact
        handle.state.packed[100] ^= 0xFF  # something overwrote the slot after staging
        with pytest.raises(RuntimeError, match="changed after staging"):
            handle.verify()
        tier = LocalTier(tmp_path)
        with pytest.raises(RuntimeError, match="changed after staging"):
            write_snapshot(
                tier,
                LocalComm(),
                SnapshotJob(7, 0, handle.state, stage({}, "rank")),
                "run",
                before_commit=handle.verify,
            )
        assert committed_steps(tier) == []  # never committed
        handle.state.packed[100] ^= 0xFF
        handle.slot.step = 8  # the slot now holds another snapshot
        with pytest.raises(RuntimeError, match="reused by step 8"):
            handle.verify()
    finally:
        arena.close()


def test_arena_is_allocated_once_and_reused_and_private(tmp_path):
    model, opt = _trained()
    arena = HostArena()
    try:
        seen = set()
        for step in range(6):
            h = arena.stage_async(_state(model, opt), _frozen(model, opt), step)
            h.wait()
            seen.add(h.slot.buffer.data_ptr())
            # private: the memory has no name anywhere (a memfd, or a 0600 /dev/shm file unlinked at once)
            st = os.fstat(h.slot.fd)
            assert st.st_nlink == 0
            assert os.readlink(f"/proc/self/fd/{h.slot.fd}").startswith("/memfd:") or st.st_mode & 0o777 == 0o600
            arena.release(h.slot)
        assert len(seen) == 1 and len(arena.slots) == 1
    finally:
        arena.close()


class Slow(L.Callback):
    """Slow every background copy down, and record a synchronous copy of the state at each snapshot step."""

    def __init__(self, cb: SnapshotCallback, steps: set[int]) -> None:
        self.cb, self.steps, self.expected = cb, steps, {}

    def on_fit_start(self, trainer, pl_module):
        arena = self.cb._arena
        original = arena.stage_async
        arena.stage_async = lambda *a, **k: original(*a, copy_hook=lambda: time.sleep(0.2), **k)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.steps:  # runs before SnapshotCallback (Lightning orders it last)
            self.expected[trainer.global_step] = {
                "state_dict": copy.deepcopy(pl_module.state_dict()),
                "opt": copy.deepcopy(trainer.optimizers[0].state_dict()["state"]),
            }


def test_lightning_run_with_slowed_copy_gives_point_in_time_snapshots(tmp_path):
    L.seed_everything(0, verbose=False)
    cb = SnapshotCallback(LocalTier(tmp_path, every_n_train_steps=2, keep_last=None))
    slow = Slow(cb, {2, 4, 6})
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=6,
        callbacks=[cb, slow],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(0.2), DataLoader(Squares(), batch_size=4, shuffle=True))
    for step, expected in slow.expected.items():
        snap = load_snapshot(str(tmp_path), step=step)
        for k, v in expected["state_dict"].items():
            assert torch.equal(_bits(v), _bits(snap["state_dict"][k])), f"step {step}: {k} torn"
        for pid, st in expected["opt"].items():
            for k, v in st.items():
                assert torch.equal(_bits(v), _bits(snap["optimizer_states"][0]["state"][pid][k])), (step, pid, k)


def test_metrics_reach_tensorboard(tmp_path):
    def run(max_steps):
        L.seed_everything(0, verbose=False)
        logger = TensorBoardLogger(tmp_path / "logs", name="", version=f"v{max_steps}")
        cb = SnapshotCallback(LocalTier(tmp_path / "snaps", every_n_train_steps=2, keep_last=3))
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=max_steps,
            callbacks=[cb],
            logger=logger,
            log_every_n_steps=1,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Model(0.2), DataLoader(Squares(), batch_size=4, shuffle=True))
        logger.finalize("success")
        acc = EventAccumulator(logger.log_dir)
        acc.Reload()
        return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

    first = run(8)
    for tag in (
        "snapshot/stall_ms",
        "snapshot/stage_ms",
        "snapshot/bytes",
        "snapshot/local/persist_ms",
        "snapshot/local/throughput_MBps",
        "snapshot/local/lag_steps",
    ):
        assert tag in first, f"{tag} missing from {sorted(first)}"
    state_bytes = sum(p.numel() * 4 for p in Model(0.2).state_dict().values())
    assert all(v >= state_bytes for v in first["snapshot/bytes"])  # weights + optimizer state
    assert all(0 <= v < 60_000 for v in first["snapshot/stall_ms"])
    assert all(v > 0 for v in first["snapshot/local/persist_ms"] + first["snapshot/local/throughput_MBps"])
    assert all(0 <= v <= 8 for v in first["snapshot/local/lag_steps"])
    assert len(first["snapshot/stall_ms"]) >= 3
    second = run(10)  # resumes from step 8
    assert second["restore/step"] == [8.0] and second["restore/tier_index"] == [0.0]
    assert 0 < second["restore/ms"][0] < 60_000


class Wide(Model):
    def __init__(self) -> None:
        super().__init__(0.2)
        self.net = nn.Sequential(nn.Linear(8, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 1))


def test_local_tier_writes_the_arena_with_o_direct(tmp_path):
    tier = LocalTier(tmp_path / "snaps", every_n_train_steps=2)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=4,
        callbacks=[SnapshotCallback(tier)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Wide(), DataLoader(Squares(), batch_size=4))
    if not tier.direct_io:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    assert tier.direct_bytes > 0
    assert committed_steps(tier) == [4, 2]
    load_snapshot(str(tmp_path / "snaps"), rank=0)  # what O_DIRECT wrote verifies


def _state_bytes() -> int:
    model = Model(0.2)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3


def test_budget_below_one_snapshot_skips_with_warning_and_metric(tmp_path):
    class Rec(L.pytorch.loggers.Logger):
        name, version = "rec", 0

        def __init__(self):
            super().__init__()
            self.metrics = []

        def log_metrics(self, metrics, step=None):
            self.metrics.append(dict(metrics))

        def log_hyperparams(self, *a, **k):
            pass

    rec = Rec()
    L.seed_everything(0, verbose=False)
    cb = SnapshotCallback(LocalTier(tmp_path, every_n_train_steps=2), max_host_bytes=1024)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=6,
        callbacks=[cb],
        logger=rec,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Model(0.2), DataLoader(Squares(), batch_size=4))
    msgs = [str(w.message) for w in caught if "skipped the snapshot" in str(w.message)]
    assert len(msgs) == 3 and "max_host_bytes is 1024" in msgs[0]
    assert committed_steps(LocalTier(tmp_path)) == []
    assert [m["snapshot/skipped"] for m in rec.metrics if "snapshot/skipped" in m] == [1.0, 2.0, 3.0]


def test_budget_of_one_buffer_never_holds_two(tmp_path):
    budget = 4 << 20  # one 2 MiB-rounded slot fits, two do not
    L.seed_everything(0, verbose=False)
    cb = SnapshotCallback(
        LocalTier(tmp_path, every_n_train_steps=1, keep_last=None), max_host_bytes=budget, on_error="raise"
    )
    peak = []

    class Watch(L.Callback):
        def on_train_batch_end(self, *a):
            peak.append(cb._arena.allocated_bytes)

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=12,
        callbacks=[cb, Watch()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Model(0.2), DataLoader(Squares(), batch_size=4))
    assert max(peak) <= budget
    assert committed_steps(LocalTier(tmp_path))  # some snapshots still made it


def test_a_snapshot_waiting_long_for_a_buffer_is_reported_and_none_is_lost(tmp_path, monkeypatch, caplog):
    """A tier stuck writing (a hung mount) holds every staging buffer; without max_host_bytes the next snapshot waits
    for one (back-pressure) and training with it: each STUCK_REPORT_S of that wait is reported with what to do, and
    once the tier moves again every scheduled snapshot is committed."""
    import lightning_snapshot.staging.slot as slot

    monkeypatch.setattr(slot, "STUCK_REPORT_S", 0.3)
    moving = threading.Event()
    timers: list[threading.Timer] = []

    class StuckLocal(LocalTier):
        def write(self, key, buffers):
            if key.startswith("step-"):  # (the first snapshot's write hangs 2.5 s)
                if not timers:
                    timers.append(threading.Timer(2.5, moving.set))
                    timers[0].start()
                moving.wait(30)
            return super().write(key, buffers)

    cb = SnapshotCallback(StuckLocal(tmp_path, every_n_train_steps=1, keep_last=None), on_error="raise")
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=6,
        callbacks=[cb],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with caplog.at_level(logging.WARNING, logger="lightning_snapshot.staging.slot"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Model(0.2), DataLoader(Squares(), batch_size=4))
    reports = [r.getMessage() for r in caplog.records if "for a staging buffer" in r.getMessage()]
    assert reports, "no report of the wait"
    assert "every one is still being persisted" in reports[0] and "max_host_bytes" in reports[0]
    assert committed_steps(LocalTier(tmp_path)) == [6, 5, 4, 3, 2, 1]


class SlowLocal(LocalTier):
    def write(self, key, buffers):
        time.sleep(1.5)  # slower than the snapshot interval (30 steps, even on a loaded machine): a second buffer
        return super().write(key, buffers)


def test_a_second_buffer_is_asked_for_as_many_steps_ahead_as_allocating_one_takes(tmp_path, monkeypatch):
    """While the only buffer is still being persisted, the next one is allocated early enough to be ready when the
    snapshot is due: as many steps ahead as the last allocation took (here 1 s, 100 steps of 10 ms: more than the 29
    steps to the next snapshot, so at once, even on a loaded machine where a step takes several times longer), not a
    fixed two steps (a GPT-2 medium snapshot on a GPU waited 1.2-4.4 s for a 4 GB buffer that was asked for too
    late)."""
    new_slot, reserve = SlotPool._new_slot, HostArena.reserve

    def slow_new_slot(self, nbytes):
        time.sleep(1.0)
        return new_slot(self, nbytes)

    started = []

    def spy_reserve(self, nbytes):
        ok = reserve(self, nbytes)
        if ok:
            started.append(trainer.global_step)
        return ok

    monkeypatch.setattr(SlotPool, "_new_slot", slow_new_slot)
    monkeypatch.setattr(HostArena, "reserve", spy_reserve)

    class Paced(Model):
        def training_step(self, batch, batch_idx):
            time.sleep(0.01)
            return super().training_step(batch, batch_idx)

    L.seed_everything(0, verbose=False)
    cb = SnapshotCallback(SlowLocal(tmp_path, every_n_train_steps=30, keep_last=None), on_error="raise")
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=61,
        callbacks=[cb],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Paced(0.2), DataLoader(Squares(), batch_size=4))
    assert started[0] == 1  # the first buffer, right after the first optimizer step
    assert len(started) == 2, started
    assert 31 <= started[1] <= 55, started  # (a fixed two steps ahead: 58; 29 ahead unless a step took 0.2 s)
    assert committed_steps(LocalTier(tmp_path)) == [61, 60, 30]


class SlowRemote(LocalTier):
    """A real filesystem tier that is not ``local`` (as an NFS mount or a bucket would be): it uploads each step
    from the local tier's committed copy, and here it is slower to start than training is to take snapshots."""

    tier = "remote"

    def write(self, key, buffers):
        time.sleep(0.3)
        return super().write(key, buffers)


def test_a_slower_tier_uploads_every_step_although_the_local_tier_keeps_one(tmp_path, caplog):
    """The local tier's retention keeps a step until the slower tier finished uploading it from there."""
    L.seed_everything(0, verbose=False)
    local = LocalTier(tmp_path / "local", every_n_train_steps=1, keep_last=1)
    remote = SlowRemote(tmp_path / "remote", every_n_train_steps=1, keep_last=None)
    cb = SnapshotCallback([local, remote])
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=6,
        callbacks=[cb],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with caplog.at_level("WARNING"):
        trainer.fit(Model(0.2), DataLoader(Squares(), batch_size=4, shuffle=True))
    assert committed_steps(remote) == [6, 5, 4, 3, 2, 1]
    assert committed_steps(local) == [6]  # and the pins did not keep old steps once uploaded
    assert sorted(os.listdir(tmp_path / "local")) == ["step-000000000006"]
    assert "failing" not in caplog.text, caplog.text
    for step in range(1, 7):
        assert load_snapshot(str(tmp_path / "remote"), step=step)["global_step"] == step


def test_wait_copied_returns_once_the_bytes_are_staged_and_raises_a_failed_copy():
    """``wait_copied`` (what the agent link waits for before telling the agent) returns with every byte in the slot,
    and raises when the copy failed instead of waiting for ever."""
    model, opt = _trained()
    expected = {k: _bits(v) for k, v in stage(_state(model, opt)).tensors.items()}
    arena = HostArena()
    try:
        handle = arena.stage_async(_state(model, opt), _frozen(model, opt), step=2)
        handle.wait_copied()
        assert all(torch.equal(expected[k], _bits(v)) for k, v in handle.state.tensors.items())
        handle.wait()
        arena.release(handle.slot)

        def broken() -> None:
            raise OSError("copy failed")

        failed = arena.stage_async(_state(model, opt), _frozen(model, opt), step=3, copy_hook=broken)
        with pytest.raises(OSError, match="copy failed"):
            failed.wait_copied()
    finally:
        arena.close()


@pytest.mark.parametrize(
    "flags,raised",
    [
        ((), "RuntimeError: injected: the other ranks did not answer within the collective timeout"),
        (("--other-on-exception-raises",), "OSError: injected: another callback's on_exception failed"),
        (("--spawn",), "ProcessRaisedException"),
    ],
    ids=["teardown", "no-teardown", "ddp-spawn"],
)
def test_a_failed_agreement_after_staging_raises_and_the_process_exits(tmp_path, flags, raised):
    """The collective right after a snapshot's weights were staged (copy held back until the rank's state is taken)
    fails, as when a peer died or the group's timeout ran out: the fit raises and the process ends. The copy was
    never let go: the callback's teardown lets it go; where no teardown runs (another callback's on_exception raised
    first; a ddp_spawn worker), the copy thread must not keep the process alive at exit. Each case hung before."""
    proc = run_script("agree_fail.py", "--dir", str(tmp_path / "snaps"), *flags, timeout=90)
    assert f"RAISED {raised}" in proc.stdout
    assert proc.stdout.rstrip().endswith("END")


def test_a_fit_stopped_after_a_batch_without_optimizer_step_ends_with_the_copy_in_flight(tmp_path):
    """should_stop (Timer, EarlyStopping on a training metric) right after a batch that only accumulated gradients,
    while the previous snapshot's copy is still in flight: no optimizer step comes to settle it, and the end of fit
    settles it before waiting for the commits (it waited for that commit first: a deadlock, fit never returned)."""
    proc = run_script("stop_unfenced.py", "--dir", str(tmp_path / "snaps"), timeout=90)
    assert "FIT RETURNED step=2" in proc.stdout
    assert committed_steps(LocalTier(str(tmp_path / "snaps"))) == [2]


@pytest.mark.parametrize("on_error", ["warn", "raise"])
def test_under_ddp_a_state_only_one_rank_cannot_take_is_agreed_on_by_every_rank(tmp_path, on_error):
    """Two ranks; from step 4 rank 0 alone adds a value the format cannot store in on_save_checkpoint. The ranks agree
    on it: with on_error='warn' both warn (rank 0 naming the value, rank 1 pointing at the other rank) and train on in
    step to the end, no snapshot committed; with 'raise' both raise. Rank 0 used to return before a collective rank 1
    entered: the ranks' collectives went out of step and gloo aborted the process."""
    snaps = tmp_path / "snaps"
    proc = run_script("rank_state_one_rank.py", "--dir", str(snaps), "--on-error", on_error, timeout=180)
    if on_error == "warn":
        assert "rank 0: FIT RETURNED step=12" in proc.stdout and "rank 1: FIT RETURNED step=12" in proc.stdout
        # (steps 4, 8, 12: rank 0 warns of its own error, rank 1 of the agreed one, which names rank 0's)
        assert proc.stderr.count("cannot store the value at 'rank/late/rank0_only'") == 6
        for step in (4, 8, 12):
            assert (
                f"another rank could not take its state for the snapshot of step {step} (see its log): on rank 0:"
                " CaptureError: cannot store the value at 'rank/late/rank0_only'"
            ) in proc.stderr
        assert committed_steps(LocalTier(str(snaps))) == []
    else:
        assert "rank 0: RAISED CaptureError: cannot store the value at 'rank/late/rank0_only'" in proc.stdout
        assert (
            "rank 1: RAISED SnapshotError: another rank could not take its state for the snapshot of step 4"
            in proc.stdout
        )


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_under_ddp_a_staging_failure_on_one_rank_is_handled_by_every_rank(tmp_path, on_error):
    """Rank 0 alone cannot stage the weights from step 4: with 'raise' every rank raises (rank 1 the agreed error,
    not the broken connection it met when it skipped, warned and trained on alone), with 'warn' both train on."""
    proc = run_script(
        "one_rank_fails.py", "--dir", str(tmp_path / "snaps"), "--fail", "stage", "--on-error", on_error, timeout=180
    )
    if on_error == "raise":
        assert "rank 0: RAISED CaptureError: injected: rank 0 cannot capture its share of the weights" in proc.stdout
        assert (
            "rank 1: RAISED SnapshotError: another rank could not stage the snapshot of step 4 (see its log)"
            in proc.stdout
        )
    else:
        assert "rank 0: FIT RETURNED step=12 from=None" in proc.stdout
        assert "rank 1: FIT RETURNED step=12 from=None" in proc.stdout


def test_under_ddp_a_cleanup_failure_after_a_commit_on_one_rank_keeps_the_tier_in_step(tmp_path):
    """After step 4's commit rank 0's removal of older objects fails once, on a tier that retries failed writes: it is
    logged, the commit stands, and the later snapshots commit (rank 0 alone used to retry: the tier's collectives went
    out of step and no later snapshot of the fit became durable)."""
    snaps = tmp_path / "snaps"
    proc = run_script("one_rank_fails.py", "--dir", str(snaps), "--fail", "cleanup", "--on-error", "warn", timeout=180)
    assert "rank 0: FIT RETURNED step=12 from=None" in proc.stdout
    assert "rank 1: FIT RETURNED step=12 from=None" in proc.stdout
    assert "could not remove older objects of step-000000000004" in proc.stderr
    assert "not durable" not in proc.stderr and "step 8 failed" not in proc.stderr
    assert committed_steps(LocalTier(str(snaps))) == [12, 8, 4]


def test_under_ddp_a_node_local_tier_one_rank_cannot_list_once_at_setup_resumes_on_every_rank(tmp_path):
    """A node-local tier holds steps 4 and 8. At the next fit's setup rank 0, which lists it for the node, fails once
    (a transient error): every rank learns it from the listing's collective, so they give up loading the callbacks'
    states there together, and both resume from step 8 at the fit's start (rank 0 used to leave the collective alone:
    rank 1 timed out in it and both crashed)."""
    snaps = str(tmp_path / "snaps")
    first = run_script("one_rank_fails.py", "--dir", snaps, "--fail", "none", "--max-steps", "8", timeout=180)
    assert "rank 0: FIT RETURNED step=8 from=None" in first.stdout
    proc = run_script("one_rank_fails.py", "--dir", snaps, "--fail", "list", timeout=180)
    assert "rank 0: FIT RETURNED step=12 from=8" in proc.stdout and "rank 1: FIT RETURNED step=12 from=8" in proc.stdout


def test_under_ddp_resuming_from_a_path_every_rank_restores_the_step_rank_0_found(tmp_path):
    """resume='<snapshot dir>' holding steps 4 and 8; rank 1's listing of it is stale (misses step 8, as a listing
    racing a commit can): every rank restores step 8, the one rank 0 found (each rank used to list it itself, and the
    ranks restored different snapshots: weights and optimizer state silently out of step)."""
    old = str(tmp_path / "old")
    first = run_script("one_rank_fails.py", "--dir", old, "--fail", "none", "--max-steps", "8", timeout=180)
    assert "rank 0: FIT RETURNED step=8 from=None" in first.stdout
    proc = run_script(
        "one_rank_fails.py", "--dir", str(tmp_path / "new"), "--fail", "stale-listing", "--resume", old, timeout=180
    )
    assert "rank 0: FIT RETURNED step=12 from=8" in proc.stdout and "rank 1: FIT RETURNED step=12 from=8" in proc.stdout
