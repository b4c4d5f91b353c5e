"""The one-call copy of many small CPU tensors into a slot (``staging/gather.py``), alone and inside the arena."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_snapshot.plan.planner import plan_layout
from lightning_snapshot.staging.arena import HostArena
from lightning_snapshot.staging.gather import Gather
from lightning_snapshot.state.capture import frozen_predicate, optimized_key


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _sources() -> list[torch.Tensor]:
    base = torch.arange(40, dtype=torch.float32)
    return [
        torch.randn(3, 5),
        torch.randn(7).half(),  # 14 bytes: read 2 bytes at a time
        torch.tensor([True, False, True, True, False]),  # 5 bytes: 1 at a time
        torch.tensor(123456789, dtype=torch.int64),  # 0-d
        torch.empty(0),
        base[3:9],  # contiguous, at an offset into its storage
        torch.randn(4, 4, dtype=torch.float64),
    ]


@pytest.mark.parametrize("picks", [[0, 3, 5, 6], [0, 1, 2, 3, 4, 5, 6]], ids=["word-aligned", "odd-sizes"])
def test_each_tensor_lands_at_its_offset_and_the_gaps_are_zero(picks):
    sources = [_sources()[i] for i in picks]
    sizes = [(str(i), t.numel() * t.element_size()) for i, t in enumerate(sources)]
    placed, size = plan_layout(sizes, 64)
    gather = Gather([t.data_ptr() for t in sources], [n for _, n in sizes], [o for _, o in placed], size)
    region = torch.full((size,), 0xFF, dtype=torch.uint8)
    for _ in range(2):  # (the second time after the sources changed in place: the same gather copies the new values)
        gather(region.view(gather.dtype))
        covered = torch.zeros(size, dtype=torch.bool)
        for t, (_, offset), (_, n) in zip(sources, placed, sizes, strict=True):
            assert torch.equal(region[offset : offset + n], _bytes(t))
            covered[offset : offset + n] = True
        assert not region[~covered].any()  # (alignment gaps: zeros, not whatever memory lies between the tensors)
        for t in sources:
            if t.dtype != torch.bool and t.numel():
                t.add_(1)
    if picks == [0, 3, 5, 6]:
        assert gather.dtype == torch.int32  # (every address and size a multiple of 4: words of 4 bytes)


def test_a_default_device_set_by_the_program_does_not_move_the_gathers_own_memory():
    """(A program may set another default device, e.g. ``torch.set_default_device("cuda")``: the padding's word of
    zeros must still be host memory, or the gather would read an address it cannot.)"""
    a, b = torch.randn(5), torch.randn(3)
    with torch.device("meta"):
        gather = Gather([a.data_ptr(), b.data_ptr()], [20, 12], [0, 64], 76)
    region = torch.full((76,), 0xFF, dtype=torch.uint8)
    gather(region.view(gather.dtype))
    assert torch.equal(region[:20], _bytes(a)) and torch.equal(region[64:], _bytes(b)) and not region[20:64].any()


def test_tensors_that_overlap_in_the_region_or_run_past_it_are_refused():
    a, b = torch.randn(16), torch.randn(16)
    with pytest.raises(ValueError, match="overlap"):
        Gather([a.data_ptr(), b.data_ptr()], [64, 64], [0, 32], 128)
    with pytest.raises(ValueError, match="past its end"):
        Gather([a.data_ptr()], [64], [64], 96)


def _staged(arena: HostArena, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, torch.Tensor]:
    """Stage a plain state dict (no capture plan: the arena checks each tensor's address itself) and read it back."""
    handle = arena.stage_async(
        {"model": model.state_dict(), "opt": opt.state_dict()},
        frozen_predicate([opt]),
        step,
        frozen_key=optimized_key([opt]),
    )
    assert handle is not None
    handle.fence_training()
    handle.wait()
    out = {name: t.clone() for name, t in handle.state.tensors.items()}
    arena.release(handle.slot)
    return out


def test_the_arena_gathers_small_trained_tensors_and_a_new_address_makes_a_new_gather():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(20)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    arena = HostArena()
    try:
        first = _staged(arena, model, opt, 1)
        gather = arena._plan.gather
        assert gather is not None and len(arena._plan.bulk) == 20 * 2 * 4  # (params, step, exp_avg, exp_avg_sq)
        assert torch.equal(first["model/3.weight"], model[3].weight.detach())
        kept = model[3].weight.data  # (kept alive: a stale gather would read its old values, not crash)
        model[3].weight.data = torch.full((8, 8), 2.5)  # the same shape at a new address
        second = _staged(arena, model, opt, 2)
        assert torch.equal(second["model/3.weight"], torch.full((8, 8), 2.5))
        assert arena._plan.gather is not gather
        assert torch.equal(second["model/4.bias"], model[4].bias.detach())
        assert not torch.equal(kept, torch.full((8, 8), 2.5))
    finally:
        arena.close()
