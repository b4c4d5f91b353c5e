"""The CUDA path: pinned arena, side-stream copies with events, CUDA RNG. Skipped where there is no GPU."""

from __future__ import annotations

import os
import random

import pytest
import torch
from conftest import assert_bitwise_equal, run_train
from torch import nn

from lightning_snapshot.arena import HostArena
from lightning_snapshot.capture import capture_rng, frozen_predicate, restore_rng

pytestmark = pytest.mark.gpu


def _frozen(model, opt):
    return frozen_predicate(model.parameters(), [opt])


def test_cuda_state_is_staged_into_pinned_memory_point_in_time():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.BatchNorm1d(1024), nn.Linear(1024, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(16, 1024, device="cuda")).sum().backward()
        opt.step()
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    arena = HostArena()
    try:
        handle = arena.stage_async(state, _frozen(model, opt), step=2)
        assert handle.slot.buffer.is_pinned()
        handle.fence_training()  # orders the GPU: the next optimizer step waits for the side-stream copy
        model(torch.randn(16, 1024, device="cuda")).sum().backward()
        opt.step()
        handle.wait()
        for k, v in expected.items():
            assert torch.equal(handle.state.tensors[f"model/{k}"], v), k
    finally:
        arena.close()


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
def test_single_gpu_sigkill_and_resume_is_bitwise_exact(tmp_path, reference_runs, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    args = ("--accelerator", "gpu", "--shuffle", "--dropout", "0.2")
    ref = reference_runs(*args)
    crash_at = random.randint(5, 15)
    snaps = tmp_path / "snaps"
    run_train(snaps, tmp_path / "crashed.pt", *args, "--crash-at", str(crash_at), expect_kill=True)
    proc = run_train(snaps, tmp_path / "resumed.pt", *args)
    assert "RESTORED step=" in proc.stdout
    assert_bitwise_equal(ref, tmp_path / "resumed.pt")
