"""The CUDA arena path on CPU: slots registered with CUDA through a no-op (``FAKE_REGISTER_ENV``), the same code
otherwise. The end-to-end part (the agent flushes a killed trainer's registered arena) is in ``test_ram.py``; the
same on a real GPU in ``test_gpu.py``."""

from __future__ import annotations

import gc
import threading
import warnings

import pytest
import torch
from torch import nn

from lightning_snapshot.staging import cuda_host as arena_mod
from lightning_snapshot.staging import stage
from lightning_snapshot.staging.arena import FAKE_REGISTER_ENV, HostArena
from lightning_snapshot.state.capture import frozen_predicate


@pytest.fixture
def record(tmp_path, monkeypatch):
    """Every arena made in this test takes the CUDA path, with registration recorded in the returned file."""
    path = tmp_path / "register.log"
    monkeypatch.setenv(FAKE_REGISTER_ENV, str(path))
    return path


def _calls(path) -> list[tuple[str, int]]:
    return [(line.split()[0], int(line.split()[1])) for line in path.read_text().splitlines()] if path.exists() else []


def _trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    return model, opt


def _stage(arena: HostArena, model, opt, step: int):
    handle = arena.stage_async({"model": model.state_dict(), "opt": opt.state_dict()}, frozen_predicate([opt]), step)
    handle.wait()
    return handle


def _expected(model, opt) -> dict[str, torch.Tensor]:
    return stage({"model": model.state_dict(), "opt": opt.state_dict()}).tensors


def _assert_staged(handle, expected) -> None:
    assert handle.state.tensors.keys() == expected.keys()
    for name, t in expected.items():
        got = handle.state.tensors[name]
        assert got.dtype == t.dtype and torch.equal(
            got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
        ), name


def _arena_mapping_at(ptr: int) -> bool:
    """Whether an arena buffer (a memfd or an unlinked shared-memory file of ours) is mapped at ``ptr``."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi and len(parts) == 6 and "lightning-snapshot" in parts[5]:
                return True
    return False


def test_each_slot_is_registered_once_and_unregistered_before_it_is_unmapped(record, monkeypatch):
    seen_at_unregister: list[tuple[int, bool, str]] = []
    original = arena_mod.noop_host_unregister

    def unregister(ptr: int, device: int) -> None:  # records whether the memory is still mapped at that moment
        seen_at_unregister.append((ptr, _arena_mapping_at(ptr), threading.current_thread().name))
        original(ptr, device)

    monkeypatch.setattr(arena_mod, "noop_host_unregister", unregister)
    model, opt = _trained()
    expected = _expected(model, opt)
    arena = HostArena()
    try:
        first = _stage(arena, model, opt, 1)
        second = _stage(arena, model, opt, 2)  # the first is still held: a second slot
        for handle in (first, second):
            _assert_staged(handle, expected)
            assert handle.slot.device == 0 and handle.slot.fd >= 0  # registered, and shared with the agent
        arena.release(first.slot)
        arena.release(second.slot)
        for step in range(3, 7):  # reused: no new registration
            handle = _stage(arena, model, opt, step)
            _assert_staged(handle, expected)
            arena.release(handle.slot)
        slots = {s.buffer.data_ptr(): s.capacity for s in arena.slots}
        assert len(slots) == 2
        registered = _calls(record)
        assert sorted(registered) == sorted(("register", p) for p in slots), registered
        sizes = [int(line.split()[2]) for line in record.read_text().splitlines()]
        assert sorted(sizes) == sorted(slots.values())  # the whole buffer
        assert not seen_at_unregister
        assert arena.register_failure is None
    finally:
        del first, second, handle
        arena.close()
    gc.collect()
    assert sorted(p for p, _, _ in seen_at_unregister) == sorted(slots), seen_at_unregister
    assert all(mapped for _, mapped, _ in seen_at_unregister), "a slot was unregistered after it was unmapped"
    # (on the arena's registration thread, which launches no CUDA work)
    assert {name for _, _, name in seen_at_unregister} == {"lightning-snapshot-cuda-host_0"}
    assert not any(_arena_mapping_at(p) for p in slots), "the slots were not unmapped after unregistering"
    assert [c for c, _ in _calls(record)].count("unregister") == 2


def test_failed_registration_warns_once_with_the_reason_and_stages_in_shared_memory(record, monkeypatch):
    # the real cuda_host_register, on this CPU-only torch: it fails the way it does where CUDA is not usable
    calls: list[int] = []

    def register(ptr: int, nbytes: int, device: int) -> None:
        calls.append(ptr)
        arena_mod.cuda_host_register(ptr, nbytes, device)

    monkeypatch.setattr(arena_mod, "noop_host_register", register)
    model, opt = _trained()
    expected = _expected(model, opt)
    arena = HostArena()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = _stage(arena, model, opt, 1)
            second = _stage(arena, model, opt, 2)  # a second slot: not registered, no second warning
        ours = [w for w in caught if "page-lock" in str(w.message)]
        assert len(ours) == 1, [str(w.message) for w in caught]
        message = str(ours[0].message)
        assert "could not page-lock the snapshot staging memory for CUDA: CUDA is not usable in this process" in message
        assert "Torch not compiled with CUDA enabled" in message  # the reason, as torch gives it
        assert "the snapshot agent still maps the memory" in message
        assert arena.register_failure is not None and "CUDA is not usable" in arena.register_failure
        assert len(calls) == 1, "registration must not be retried for every slot"
        for handle in (first, second):
            _assert_staged(handle, expected)
            assert handle.slot.device is None and handle.slot.fd >= 0  # still shared memory the agent can map
    finally:
        del first, second
        arena.close()
    assert _calls(record) == [], "nothing was registered, so nothing may be unregistered"


def test_cpu_state_is_not_registered_without_the_hook(tmp_path, monkeypatch):
    monkeypatch.delenv(FAKE_REGISTER_ENV, raising=False)
    calls: list[int] = []
    monkeypatch.setattr(arena_mod, "cuda_host_register", lambda ptr, nbytes, device: calls.append(ptr))
    model, opt = _trained()
    arena = HostArena()
    try:
        handle = _stage(arena, model, opt, 1)
        assert handle.slot.device is None and calls == []
        assert not any(t.name.startswith("lightning-snapshot-cuda-host") for t in threading.enumerate())
    finally:
        del handle
        arena.close()
