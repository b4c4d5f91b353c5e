"""The capture plan (staging/live.py) and the arena plan reused through it: reused while the state holds the same
tensors, rebuilt when one is replaced, resized or added, snapshots after a change hold the new values bitwise, and
no replaced tensor is kept alive by the cache. Real modules, optimizers and arena; no timing is asserted."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_snapshot import SnapshotCallback, load_snapshot
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.format.tree import decode, encode
from lightning_snapshot.staging import live
from lightning_snapshot.staging.arena import HostArena
from lightning_snapshot.staging.live import Encoded
from lightning_snapshot.state.capture import frozen_predicate, optimized_key


@pytest.fixture(autouse=True, params=["torch-guard", "python"])
def metadata_path(request, monkeypatch):
    """Every test here runs twice: the plan's shapes, dtypes and strides checked by torch's guard
    (staging/meta.py), and by Python (where that guard cannot be trusted)."""
    import torch._dynamo.guards  # noqa: F401  (imported as Lightning's fit imports it)

    made = []
    real = live.metadata_check

    def check(tensors):
        made.append(None if request.param == "python" else real(tensors))
        return made[-1]

    monkeypatch.setattr(live, "metadata_check", check)
    yield
    if request.param == "torch-guard" and made:
        assert any(m is not None for m in made), "no plan used torch's guard"


@pytest.fixture(autouse=True, params=["dict-versions", "compared"])
def structure_path(request, monkeypatch):
    """... and twice again: the structure vouched for by the versions of its dicts once it held (staging/meta.py's
    dict_version), and compared object by object at every snapshot (where those versions cannot be trusted)."""
    fast = []
    real = live._Plan._unchanged

    def unchanged(self, module, optimizers):
        fast.append(real(self, module, optimizers))
        return fast[-1]

    if request.param == "compared":
        monkeypatch.setattr(live, "dict_version", lambda: None)
    monkeypatch.setattr(live._Plan, "_unchanged", unchanged)
    yield request.param, fast
    if request.param == "compared":
        assert not fast


def _full(head: dict[str, Any], model: nn.Module, opts: list[torch.optim.Optimizer]) -> dict[str, Any]:
    return {**head, "state_dict": model.state_dict(), "optimizer_states": [o.state_dict() for o in opts]}


def _snapshot(arena: HostArena, model: nn.Module, opts: list[torch.optim.Optimizer], step: int) -> tuple[Any, Any]:
    """Capture and stage like the callback does; returns (what was captured, the staged state decoded)."""
    head = {"global_step": step}
    captured = arena.live.capture(head, model, opts, lambda: _full(head, model, opts))
    handle = arena.stage_async(captured, frozen_predicate(opts), step, frozen_key=optimized_key(opts))
    assert handle is not None
    handle.fence_training()
    handle.wait()
    staged = handle.state
    tensors = {name: t.clone() for name, t in staged.tensors.items()}
    tensors.update({alias: tensors[target] for alias, target in staged.aliases.items()})
    state = decode(staged.tree, tensors)
    arena.release(handle.slot)
    return captured, state


def _assert_same(got: Any, want: Any, path: str = "") -> None:
    """Bitwise equal (tensors: dtype, shape and bytes), the same structure and plain values."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.detach().reshape(-1).view(torch.uint8)), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), path
        for k in want:
            _assert_same(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{path}/{i}")
    else:
        assert got == want, path


def _train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()


def _setup(layers: int = 6) -> tuple[nn.Sequential, torch.optim.Optimizer, HostArena]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(layers)), nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train_step(model, opt)
    return model, opt, HostArena()


def test_the_plan_is_reused_across_snapshots_and_each_snapshot_holds_that_steps_values(structure_path):
    model, opt, arena = _setup()
    try:
        tokens, plans = [], []
        for step in range(1, 5):
            captured, state = _snapshot(arena, model, [opt], step)
            _assert_same(state, _full({"global_step": step}, model, [opt]))
            assert isinstance(captured, Encoded)
            if step > 1:  # (the first snapshot makes the plan from a full capture)
                assert captured.tree == encode(_full({"global_step": step}, model, [opt]))[0]
                tokens.append(captured.token)
                plans.append(arena._plan)
            _train_step(model, opt)
        assert arena.live.builds == 1
        assert all(t is tokens[0] for t in tokens) and all(p is plans[0] for p in plans)
        path, fast = structure_path
        if path == "dict-versions":  # (from the third snapshot on: the second compared and recorded the versions)
            assert len(fast) == 2 and all(t is not None for t in fast)
    finally:
        arena.close()


def test_a_replaced_parameter_rebuilds_the_plan_and_is_not_kept_alive_by_it():
    model, opt, arena = _setup()
    try:
        _snapshot(arena, model, [opt], 1)
        _snapshot(arena, model, [opt], 2)
        assert arena.live.builds == 1
        old = model[2].weight
        gone = weakref.ref(old)
        new = nn.Parameter(torch.randn(8, 8))
        model[2].weight = new  # (the optimizer still holds the old one: replace it there too, as a user would)
        opt.param_groups[0]["params"] = [new if p is old else p for p in opt.param_groups[0]["params"]]
        opt.state[new] = opt.state.pop(old)
        del old
        gc.collect()
        assert gone() is None  # the cache holds no reference to it, even before the next snapshot
        _, state = _snapshot(arena, model, [opt], 3)
        assert arena.live.builds == 2
        _assert_same(state, _full({"global_step": 3}, model, [opt]))
        assert torch.equal(state["state_dict"]["2.weight"], new.detach())
        _train_step(model, opt)
        _, state = _snapshot(arena, model, [opt], 4)
        assert arena.live.builds == 2  # (reused again)
        _assert_same(state, _full({"global_step": 4}, model, [opt]))
    finally:
        arena.close()


def test_a_resized_or_swapped_tensor_rebuilds_the_plan_and_the_snapshot_holds_the_new_values():
    model, opt, arena = _setup()
    try:
        _snapshot(arena, model, [opt], 1)
        _snapshot(arena, model, [opt], 2)
        bn = model[-1]
        with torch.no_grad():
            bn.num_batches_tracked.resize_(3).copy_(torch.tensor([7, 8, 9]))  # resized in place: the same object
        _, state = _snapshot(arena, model, [opt], 3)
        assert arena.live.builds == 2
        assert state["state_dict"]["6.num_batches_tracked"].tolist() == [7, 8, 9]
        _assert_same(state, _full({"global_step": 3}, model, [opt]))
        model[0].bias.data = torch.full((8,), 5.0)  # new memory behind the same Parameter object
        _, state = _snapshot(arena, model, [opt], 4)
        assert arena.live.builds == 3
        assert torch.equal(state["state_dict"]["0.bias"], torch.full((8,), 5.0))
        _assert_same(state, _full({"global_step": 4}, model, [opt]))
        # an optimizer-state tensor replaced by another object
        exp_avg = opt.state[model[1].weight]["exp_avg"]
        opt.state[model[1].weight]["exp_avg"] = exp_avg.clone().fill_(3.0)
        _, state = _snapshot(arena, model, [opt], 5)
        assert arena.live.builds == 4
        _assert_same(state, _full({"global_step": 5}, model, [opt]))
    finally:
        arena.close()


def _put_parameter(module: nn.Module, name: str, new: nn.Parameter, opt: torch.optim.Optimizer) -> None:
    old = module._parameters[name]
    module._parameters[name] = new
    params = opt.param_groups[0]["params"]
    params[next(i for i, p in enumerate(params) if p is old)] = new
    opt.state[new] = opt.state.pop(old)


def _hook(module, state_dict, prefix, local_metadata):
    state_dict[prefix + "extra"] = torch.tensor([1.0, 2.0])


@pytest.mark.parametrize(
    "change",
    [
        # a parameter put into the module's dict directly (no __setattr__), and into the optimizer in its place
        lambda m, o: _put_parameter(m[3], "bias", nn.Parameter(torch.full((8,), 4.0)), o),
        lambda m, o: m[-1]._buffers.__setitem__("running_mean", torch.full((8,), 6.0)),  # a buffer, directly
        lambda m, o: o.state[m[4].weight].__setitem__("exp_avg", torch.full((8, 8), 2.0)),  # optimizer state
        lambda m, o: o.state[m[4].weight].pop("exp_avg_sq"),  # optimizer state removed
        lambda m, o: m[-1]._non_persistent_buffers_set.add("running_var"),  # a buffer made non-persistent
        lambda m, o: m[2]._register_state_dict_hook(_hook),  # a state-dict hook (captured the full way)
        lambda m, o: m.add_module("7", nn.Linear(2, 2)),  # a module added (not trained)
        lambda m, o: setattr(m[2], "__class__", _ExtraState),  # another class (whose state has one more entry)
        lambda m, o: o.add_param_group({"params": [nn.Parameter(torch.ones(3))], "lr": 0.5}),  # a group, no state
        lambda m, o: o.param_groups[0]["params"].reverse(),  # the parameters reordered (the state's indices move)
    ],
    ids=[
        "parameter",
        "buffer",
        "optimizer-state",
        "state-removed",
        "non-persistent",
        "state-dict-hook",
        "module",
        "class",
        "group-added",
        "group-reordered",
    ],
)
def test_a_change_made_in_a_modules_or_an_optimizers_dicts_directly_is_in_the_next_snapshot(change):
    """Changes that no ``__setattr__`` or ``register_*`` call makes (a dict written directly), after the plan held
    twice (the second time, the dicts' versions were recorded): the next snapshot is the full capture's."""
    model, opt, arena = _setup()
    try:
        for step in (1, 2, 3):
            _snapshot(arena, model, [opt], step)
        assert arena.live.builds == 1
        change(model, opt)
        _, state = _snapshot(arena, model, [opt], 4)
        want = _full({"global_step": 4}, model, [opt])
        _assert_same(state, want)
        _snapshot(arena, model, [opt], 5)
        _, state = _snapshot(arena, model, [opt], 6)  # (a new plan, reused)
        _assert_same(state, _full({"global_step": 6}, model, [opt]))
    finally:
        arena.close()


class _ExtraState(nn.Linear):
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "extra"] = torch.tensor([3.0])


def test_a_dict_changed_and_changed_back_keeps_the_plan_and_its_fast_path(structure_path):
    """A parameter replaced and put back (its module's dict gets a new version, the structure is the same): the plan
    is kept, the next snapshots hold the new values, and the structure is vouched for by the new versions."""
    model, opt, arena = _setup()
    try:
        for step in (1, 2, 3):
            _snapshot(arena, model, [opt], step)
        weight = model[2].weight
        model[2].weight = nn.Parameter(torch.zeros(8, 8))
        model[2].weight = weight
        for step in (4, 5, 6):
            _train_step(model, opt)
            _, state = _snapshot(arena, model, [opt], step)
            _assert_same(state, _full({"global_step": step}, model, [opt]))
        assert arena.live.builds == 1
        path, fast = structure_path
        if path != "compared":  # 3: versions held; 4: changed, compared, recorded again; 5, 6: held again
            assert [t is not None for t in fast] == [True, False, True, True]
    finally:
        arena.close()


def test_parameters_reordered_in_an_ordered_dict_are_snapshotted_in_their_new_order():
    """An OrderedDict reordered keeps its dict version: a module whose parameters sit in one is compared the full
    way at every snapshot, and the state's order is state_dict()'s."""
    from collections import OrderedDict

    model, opt, arena = _setup()
    try:
        model[0]._parameters = OrderedDict(model[0]._parameters)
        for step in (1, 2, 3):
            _snapshot(arena, model, [opt], step)
        model[0]._parameters.move_to_end("weight")  # (bias first now)
        _, state = _snapshot(arena, model, [opt], 4)
        want = _full({"global_step": 4}, model, [opt])
        assert list(want["state_dict"])[:2] == ["0.bias", "0.weight"]
        _assert_same(state, want)
    finally:
        arena.close()


@pytest.mark.parametrize(
    "change",
    [
        lambda m, o: setattr(m[0].weight, "data", m[0].weight.data.view(64)),  # another shape
        lambda m, o: m[1].weight.t_(),  # the same shape, other strides (transposed in place)
        # another dtype (optimizer state)
        lambda m, o: setattr(o.state[m[2].bias]["exp_avg"], "data", o.state[m[2].bias]["exp_avg"].view(torch.int32)),
        lambda m, o: setattr(m[-1].running_var, "data", m[-1].running_var.view(torch.int32)),  # (a buffer)
    ],
    ids=["shape", "strides", "dtype", "buffer-dtype"],
)
def test_a_tensor_viewed_otherwise_at_the_same_address_rebuilds_the_plan(change):
    model, opt, arena = _setup()
    try:
        _snapshot(arena, model, [opt], 1)
        _snapshot(arena, model, [opt], 2)
        tensors = lambda: [*model.parameters(), *model.buffers(), *(v for s in opt.state.values() for v in s.values())]
        ptrs = [t.data_ptr() for t in tensors()]
        with torch.no_grad():
            change(model, opt)
        assert [t.data_ptr() for t in tensors()] == ptrs  # (only the metadata tells)
        _, state = _snapshot(arena, model, [opt], 3)
        assert arena.live.builds == 2
        _assert_same(state, _full({"global_step": 3}, model, [opt]))
    finally:
        arena.close()


def test_optimizer_state_appearing_later_and_an_added_parameter_group_rebuild_the_plan():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    opt = torch.optim.AdamW(model[0].parameters(), lr=0.01)  # the rest is frozen at first (a backbone)
    arena = HostArena()
    try:
        _snapshot(arena, model, [opt], 0)  # no optimizer state yet
        _snapshot(arena, model, [opt], 0)
        assert arena.live.builds == 1
        _train_step(model, opt)  # the state appears
        _, state = _snapshot(arena, model, [opt], 1)
        assert arena.live.builds == 2
        _assert_same(state, _full({"global_step": 1}, model, [opt]))
        opt.add_param_group({"params": list(model[1].parameters()), "lr": 0.001})  # as a finetuning callback does
        _, state = _snapshot(arena, model, [opt], 1)
        assert arena.live.builds == 3
        assert len(state["optimizer_states"][0]["param_groups"]) == 2
        _train_step(model, opt)  # the new group's state appears
        _, state = _snapshot(arena, model, [opt], 2)
        assert arena.live.builds == 4
        _assert_same(state, _full({"global_step": 2}, model, [opt]))
        _train_step(model, opt)
        _, state = _snapshot(arena, model, [opt], 3)
        assert arena.live.builds == 4  # (the structure held since the last snapshot)
        _assert_same(state, _full({"global_step": 3}, model, [opt]))
        # a hyperparameter changed in place (a scheduler) needs no new plan, and is in the snapshot
        opt.param_groups[1]["lr"] = 0.5
        _, state = _snapshot(arena, model, [opt], 3)
        assert arena.live.builds == 4
        assert state["optimizer_states"][0]["param_groups"][1]["lr"] == 0.5
    finally:
        arena.close()


def test_a_replaced_submodule_rebuilds_the_plan_and_is_not_kept_alive():
    model, opt, arena = _setup()
    try:
        _snapshot(arena, model, [opt], 1)
        gone = weakref.ref(model[5])
        model[5] = nn.Linear(8, 8)  # (not trained: its parameters are copied at once)
        gc.collect()
        assert gone() is None
        _, state = _snapshot(arena, model, [opt], 2)
        assert arena.live.builds == 2
        _assert_same(state, _full({"global_step": 2}, model, [opt]))
    finally:
        arena.close()


class _AddGroup(L.Callback):
    """Adds the second layer to the optimizer at step 3, as ``BackboneFinetuning`` unfreezes a backbone."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 3 and len(trainer.optimizers[0].param_groups) == 1:
            trainer.optimizers[0].add_param_group({"params": list(pl_module.second.parameters()), "lr": 0.01})


class _Two(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.second(torch.tanh(self.first(batch))).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.first.parameters(), lr=0.01)


def test_in_a_fit_a_parameter_group_added_by_a_callback_is_in_the_next_snapshots(tmp_path):
    torch.manual_seed(0)
    model = _Two()
    trainer = L.Trainer(
        max_steps=6,
        logger=False,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_AddGroup(), SnapshotCallback(LocalTier(tmp_path / "snaps", every_n_train_steps=1, keep_last=10))],
    )
    trainer.fit(model, torch.utils.data.DataLoader(torch.randn(24, 4), batch_size=4))
    opt = trainer.optimizers[0]
    last = load_snapshot(str(tmp_path / "snaps"), step=6)
    _assert_same(last["state_dict"], model.state_dict())
    _assert_same(last["optimizer_states"][0], opt.state_dict())
    assert len(load_snapshot(str(tmp_path / "snaps"), step=2)["optimizer_states"][0]["param_groups"]) == 1
    assert len(load_snapshot(str(tmp_path / "snaps"), step=4)["optimizer_states"][0]["param_groups"]) == 2


def test_a_state_no_plan_can_be_made_for_is_captured_the_full_way_and_planning_is_retried_rarely():
    model, opt, arena = _setup()
    # a state-dict hook may change what state_dict() returns: no plan stands for it
    model[1]._register_state_dict_hook(lambda module, sd, prefix, local: sd.update({prefix + "extra": torch.ones(2)}))
    try:
        for step in range(1, 8):
            captured, state = _snapshot(arena, model, [opt], step)
            assert not isinstance(captured, Encoded) or captured.token is None
            _assert_same(state, _full({"global_step": step}, model, [opt]))
            assert torch.equal(state["state_dict"]["1.extra"], torch.ones(2))
            _train_step(model, opt)
        assert arena.live.builds == 3  # tried at the 1st, 3rd and 6th capture only
    finally:
        arena.close()


def test_a_modules_dict_replaced_by_a_mapping_without_a_version_is_compared_the_full_way():
    """A dict the plan vouched for by its version, replaced by a mapping that has none: no error, and the snapshot is
    the full capture's."""

    model, opt, arena = _setup()
    try:
        for step in (1, 2, 3):
            _snapshot(arena, model, [opt], step)
        model[1]._state_dict_hooks = _NoVersion()
        _, state = _snapshot(arena, model, [opt], 4)
        _assert_same(state, _full({"global_step": 4}, model, [opt]))
    finally:
        arena.close()


class _NoVersion:
    """An empty mapping that is not a dict (no version to read)."""

    def __len__(self) -> int:
        return 0

    def __bool__(self) -> bool:
        return False

    def values(self) -> list:
        return []

    def items(self) -> list:
        return []
