"""The CUDA path: the registered shared-memory arena, side-stream copies with events, CUDA RNG, flush after death.
Skipped where there is no GPU (the CPU suite runs the arena's CUDA path with registration replaced by a no-op:
tests/test_arena_cuda_path.py, and the cuda-registration-noop case in tests/test_ram.py)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_bitwise_equal, assert_resumed, check_flush_after_death, run_train
from torch import nn

from lightning_snapshot.data.rng import capture_rng, restore_rng
from lightning_snapshot.staging.arena import HostArena
from lightning_snapshot.state.capture import frozen_predicate

pytestmark = pytest.mark.gpu


def _frozen(model, opt):
    return frozen_predicate([opt])


def test_cuda_state_is_staged_into_registered_shared_memory_point_in_time():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.BatchNorm1d(1024), nn.Linear(1024, 8)).cuda()
    model[2].to(torch.bfloat16)  # bf16 and fp32 parameters in one state
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def train_step():
        h = model[1](model[0](torch.randn(16, 1024, device="cuda")))
        model[2](h.to(torch.bfloat16)).float().sum().backward()
        opt.step()

    for _ in range(2):
        train_step()
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    arena = HostArena()
    try:
        handle = arena.stage_async(state, _frozen(model, opt), step=2)
        slot = handle.slot
        # one arena: the same shared memory as on CPU (the agent can map it), page-locked for this GPU
        assert slot.fd >= 0 and os.readlink(f"/proc/self/fd/{slot.fd}").startswith("/memfd:")
        assert arena.register_failure is None and slot.device == torch.cuda.current_device()
        assert slot.buffer.is_pinned()
        assert not handle.cpu_pending  # (AdamW's CPU step counters are copied at once: nothing left for the CPU)
        handle.fence_training()  # orders the GPU: the next optimizer step waits for the side-stream copy
        train_step()
        handle.wait()
        for k, v in expected.items():
            got = handle.state.tensors[f"model/{k}"]
            assert got.dtype == v.dtype and torch.equal(got, v), k
        assert handle.state.tensors["model/2.weight"].dtype == torch.bfloat16
        # unregistered before it is unmapped; the memory is then ordinary (pageable) shared memory again
        arena.release(slot)
        arena.pool.registration.unregister(slot)
        assert slot.device is None and not slot.buffer.is_pinned()
    finally:
        arena.close()


def test_a_cuda_parameter_given_new_storage_before_its_copy_is_launched_makes_the_snapshot_torn():
    """The side-stream copy is queued by the copy thread through the tensor object: a trained parameter given new
    storage before that (``.data = ...`` in training_step) would be copied from the new storage, so the snapshot is
    torn (not committed; tests/test_inplace.py has the CPU cases)."""
    torch.manual_seed(0)
    model = nn.Linear(256, 256).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arena = HostArena()
    try:
        state = {"model": model.state_dict(keep_vars=True)}  # (the live parameters, as the capture plan stages them)
        handle = arena.stage_async(state, _frozen(model, opt), step=1, hold=True)  # (not launched until go)
        with torch.no_grad():
            model.weight.data = model.weight.data + 1.0
        handle.fence_training()
        assert [name for name, _ in handle.torn] == ["model/weight"]
        handle.wait()
    finally:
        arena.close()


def test_with_adam_the_fence_orders_the_gpu_instead_of_waiting_for_the_copy_on_the_host():
    """Adam keeps its step counters in CPU tensors even for CUDA parameters; they are copied at once with the other
    small tensors, so nothing is left for the CPU to copy and the fence before the next optimizer step only makes the
    GPU wait (the host goes on queuing work while 1 GB is still being copied). The snapshot is still the staged step's."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(16))).cuda()  # 1.07 GB of weights
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 4096, device="cuda")).sum().backward()
    opt.step()
    assert all(s["step"].device.type == "cpu" for s in opt.state.values())
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    arena = HostArena()
    try:
        state = {"model": model.state_dict(keep_vars=True), "opt": opt.state_dict()}
        handle = arena.stage_async(state, _frozen(model, opt), step=1)
        assert not handle.cpu_pending
        handle.fence_training()
        assert not handle.copied.is_set()  # (returned while the side stream still copies)
        opt.zero_grad()
        model(torch.randn(4, 4096, device="cuda")).sum().backward()
        opt.step()  # (queued behind the copy on the GPU)
        handle.wait()
        assert not handle.torn
        for k, v in expected.items():
            assert torch.equal(handle.state.tensors[f"model/{k}"], v), k
    finally:
        arena.close()


def test_registered_arena_copies_from_cuda_are_correct_across_reuse():
    g = torch.Generator(device="cuda").manual_seed(1)
    tensors = {
        "a": torch.randn(3, 1000, device="cuda", generator=g),
        "b": torch.randn(777, device="cuda", generator=g).to(torch.bfloat16),
        "c": torch.arange(5, device="cuda", dtype=torch.int64),
    }
    params = [tensors["a"], tensors["b"]]
    frozen = frozen_predicate([torch.optim.SGD([torch.nn.Parameter(t) for t in params], lr=0.1)])  # (trained)
    arena = HostArena()
    try:
        for step in range(3):
            for t in params:
                t.add_(1)
            want = {k: v.cpu() for k, v in tensors.items()}
            handle = arena.stage_async(dict(tensors), frozen, step)
            handle.wait()
            assert handle.slot.buffer.is_pinned()
            for k, v in want.items():
                assert torch.equal(handle.state.tensors[k], v), (step, k)
            handle.verify()  # the checksums taken by the copy thread are those of the registered memory
            arena.release(handle.slot)
        assert len(arena.slots) == 1
    finally:
        arena.close()


@pytest.mark.slow
def test_agent_flushes_a_staged_snapshot_after_a_gpu_trainer_died(tmp_path, shm, reference_runs, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))

    def registered(killed):  # the arena was page-locked for the GPU (no fallback), and the agent mapped it
        assert "could not page-lock" not in killed.stderr, killed.stderr[-3000:]

    check_flush_after_death(tmp_path, shm, reference_runs, monkeypatch, "--accelerator", "gpu", after_kill=registered)


def test_cuda_rng_is_captured_and_restored():
    torch.cuda.init()
    torch.cuda.manual_seed_all(3)
    state = capture_rng()
    assert "cuda" in state and len(state["cuda"]) == torch.cuda.device_count()
    a = torch.rand(4, device="cuda")
    torch.cuda.manual_seed_all(99)
    restore_rng(state)
    assert torch.equal(a, torch.rand(4, device="cuda"))


@pytest.mark.slow
def test_single_gpu_sigkill_and_resume_is_bitwise_exact(tmp_path, reference_runs, monkeypatch, crash_rng):
    from lightning_snapshot.backends import LocalTier
    from lightning_snapshot.persist.writer import committed_steps

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    args = ("--accelerator", "gpu", "--shuffle", "--dropout", "0.2")
    ref = reference_runs(*args)
    crash_at = crash_rng.randint(5, 15)
    snaps = tmp_path / "snaps"
    run_train(snaps, tmp_path / "crashed.pt", *args, "--crash-at", str(crash_at), expect_kill=True)
    newest = committed_steps(LocalTier(snaps))[0]
    proc = run_train(snaps, tmp_path / "resumed.pt", *args)
    assert_resumed(proc, newest, snaps)
    assert torch.load(ref, weights_only=True)["rng"]["cuda"], "the run did not use the GPU"
    assert_bitwise_equal(ref, tmp_path / "resumed.pt", since=newest)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true"])
def test_gpu_precisions_sigkill_and_resume_match_an_uninterrupted_run(tmp_path, monkeypatch, precision):
    """Lightning on one GPU in each precision (16-mixed: the GradScaler's scale and growth tracker; bf16-true:
    bf16 parameters and optimizer state), with validation, EarlyStopping and ModelCheckpoint, dropout drawing from
    the CUDA generator: SIGKILLed right after a snapshot + validation step and mid-interval, resumed, and compared
    with an uninterrupted run (weights, optimizer, callbacks, logged values, CPU and CUDA RNG, precision state)."""
    from test_setups import assert_resume_matches

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    args = ("--trainer", 'accelerator="gpu"', "--trainer", f'precision="{precision}"')
    ref = assert_resume_matches(tmp_path, "val-interval", args, (5, 14))
    assert ref["rng"]["cuda"], "the run did not use the GPU"
    if precision == "16-mixed":
        assert "scale" in ref["precision"], ref["precision"]  # the GradScaler's state was compared


@pytest.mark.slow
def test_model_parallel_on_one_gpu_sigkill_and_resume_is_bitwise_exact(tmp_path, monkeypatch, crash_rng):
    """ModelParallelStrategy on one GPU (NCCL, FSDP2 on a mesh of one: DTensor parameters and optimizer state)."""
    from conftest import run_script

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    monkeypatch.setenv("RESHARD_FULLY_SHARD", "1")
    common = ("--strategy", "mp", "--devices", "1", "--accelerator", "gpu", "--max-steps", "12")
    run_script("reshard_train.py", "--dir", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.pt"), *common)
    snaps = tmp_path / "snaps"
    crash_at = crash_rng.randint(5, 11)
    run_script(
        "reshard_train.py",
        "--dir",
        str(snaps),
        "--out",
        str(tmp_path / "crashed.pt"),
        *common,
        "--crash-at",
        str(crash_at),
        expect_kill=True,
    )
    from lightning_snapshot.backends import LocalTier
    from lightning_snapshot.persist.writer import committed_steps

    newest = committed_steps(LocalTier(snaps))[0]
    proc = run_script("reshard_train.py", "--dir", str(snaps), "--out", str(tmp_path / "resumed.pt"), *common)
    assert f"RESTORED step={newest} rank=0" in proc.stdout, proc.stdout
    assert "cuda_rng" in torch.load(tmp_path / "ref.pt", weights_only=True)
    try:
        assert_bitwise_equal(tmp_path / "ref.pt", tmp_path / "resumed.pt")
    except AssertionError as e:
        raise AssertionError(f"crash at global_step {crash_at}: {e}") from None
