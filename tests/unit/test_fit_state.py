"""lightning_snapshot.state.fit_state: the late parameter groups replace the early ones (a group added by a callback after
``on_train_batch_end`` included), and the merged state loads into the optimizer as the callback left it."""

from __future__ import annotations

import pytest
import torch

from lightning_snapshot.errors import StateMismatchError
from lightning_snapshot.state import fit_state


def _late(groups: list[tuple[dict, list[str]]]) -> dict:
    return {"lightning_snapshot": {"fit_state": {"param_groups": [[{"hyper": h, "names": n} for h, n in groups]]}}}


def test_a_group_added_after_the_early_capture_is_in_the_merged_state():
    head, backbone = torch.nn.Linear(2, 1), torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(head.parameters(), lr=0.1)
    head(torch.ones(1, 2)).sum().backward()
    opt.step()
    early = opt.state_dict()  # at on_train_batch_end: one group
    # at the epoch start that follows: the scheduler lowered the lr, a callback added the backbone's group
    opt.param_groups[0]["lr"] = 0.05
    opt.add_param_group({"params": list(backbone.parameters()), "lr": 0.01})
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    ckpt = {
        "optimizer_states": [early],
        **_late([(hyper[0], ["head.weight", "head.bias"]), (hyper[1], ["backbone.weight", "backbone.bias"])]),
    }
    fit_state.merge_param_groups(ckpt, "test")
    merged = ckpt["optimizer_states"][0]
    assert [g["params"] for g in merged["param_groups"]] == [[0, 1], [2, 3]]
    assert [g["lr"] for g in merged["param_groups"]] == [0.05, 0.01]
    assert set(merged["state"]) == {0, 1}  # only the head has state yet
    # loads into an optimizer set up the way the callback re-adds its group on resume
    fresh = torch.optim.AdamW(head.parameters(), lr=0.1)
    fresh.add_param_group({"params": list(backbone.parameters()), "lr": 0.5})
    fresh.load_state_dict(merged)
    assert [g["lr"] for g in fresh.param_groups] == [0.05, 0.01]
    assert torch.equal(fresh.state[head.weight]["exp_avg"], opt.state[head.weight]["exp_avg"])


def test_name_keyed_state_keeps_its_names_and_names_the_added_parameters():
    early = {"state": {"a": {}}, "param_groups": [{"lr": 1.0, "params": ["a"]}]}
    ckpt = {"optimizer_states": [early], **_late([({"lr": 0.5}, ["a"]), ({"lr": 0.1}, ["b"])])}
    fit_state.merge_param_groups(ckpt, "test")
    assert ckpt["optimizer_states"][0]["param_groups"] == [{"lr": 0.5, "params": ["a"]}, {"lr": 0.1, "params": ["b"]}]


def test_older_snapshots_without_late_groups_are_left_as_they_are():
    early = {"state": {}, "param_groups": [{"lr": 1.0, "params": [0]}]}
    ckpt = {"optimizer_states": [early], "lightning_snapshot": {"optimizers": {}}}
    fit_state.merge_param_groups(ckpt, "test")
    assert ckpt["optimizer_states"][0]["param_groups"] == [{"lr": 1.0, "params": [0]}]


def test_malformed_late_groups_are_refused_with_the_optimizer_named():
    ckpt = {"optimizer_states": [{"state": {}, "param_groups": [{"params": [0]}]}], **_late([({"lr": 1.0}, ["a"])])}
    ckpt["lightning_snapshot"]["fit_state"]["param_groups"][0][0]["names"] = "a"
    with pytest.raises(StateMismatchError, match="parameter groups of optimizer 0 are malformed"):
        fit_state.merge_param_groups(ckpt, "test")


def test_trainable_flags_and_batchnorm_tracking_are_restored():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    saved = {"trainable": {"0.weight": False, "0.bias": True}, "track_running_stats": {"1": False}}
    fit_state.restore_trainable(model, saved)
    assert [p.requires_grad for p in model[0].parameters()] == [False, True]
    assert model[1].track_running_stats is False


def test_the_models_own_generators_are_captured_by_path_and_restored():
    """A torch.Generator the model holds (random masking drawn from a generator of its own) is in no state_dict:
    its state is captured by module path and put back, so that it draws what it drew in the interrupted run."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    model.gen = torch.Generator().manual_seed(1)
    model[1].mask_gen = torch.Generator().manual_seed(2)
    torch.rand(3, generator=model.gen)
    saved = {"generators": {p: g.get_state() for p, g in fit_state._module_generators(model).items()}}
    assert sorted(saved["generators"]) == ["1.mask_gen", "gen"]
    expected = (torch.rand(4, generator=model.gen), torch.rand(4, generator=model[1].mask_gen))
    fresh = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    fresh.gen, fresh[1].mask_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    fit_state.restore_generators(fresh, saved)
    assert torch.equal(torch.rand(4, generator=fresh.gen), expected[0])
    assert torch.equal(torch.rand(4, generator=fresh[1].mask_gen), expected[1])


def test_a_generator_that_cannot_be_restored_is_named_in_a_warning():
    model = torch.nn.Linear(2, 2)
    model.gen = torch.Generator()
    saved = {"generators": {"gen": torch.zeros(3), "gone": torch.Generator().get_state()}}
    with pytest.warns(UserWarning, match="random generators were not all restored") as record:
        fit_state.restore_generators(model, saved)
    message = str(record[0].message)
    assert "'gone' is not a torch.Generator of the model now" in message
    assert "'gen': the saved state is not a generator state" in message


def _names_and_ids(walk: fit_state.Walk) -> tuple:
    return (
        [(n, id(m)) for n, m in walk.modules],
        walk.param_names,
        list(map(id, walk.params)),
        [(n, id(m)) for n, m in walk.batchnorms],
        [(n, id(m)) for n, m in walk.metrics],
    )


def test_the_late_capture_walk_is_kept_while_the_plan_token_holds_and_keeps_nothing_alive():
    """The walk of the module at the late capture (its modules, parameters and their names, BatchNorm modules) is
    reused while the capture plan's token is the same, made again for a new token or when an object in it died,
    equals a fresh walk either way, and holds no replaced parameter alive."""
    import gc
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))
    model.tied = model[0]  # (a module reached twice is walked once, as named_modules() does)
    kept = fit_state.Structure()
    token = object()
    first = kept.get(model, token)
    again = kept.get(model, token)
    assert kept.builds == 1
    assert _names_and_ids(first) == _names_and_ids(again) == _names_and_ids(fit_state._walk(model))
    assert [n for n, _ in again.batchnorms] == ["1"] and again.param_names[:2] == ["0.weight", "0.bias"]
    # a parameter replaced: the plan makes a new token, and the walk is made again with the new parameter
    old = weakref.ref(model[2].weight)
    model[2].weight = torch.nn.Parameter(torch.zeros(1, 3))
    del first, again
    gc.collect()
    assert old() is None  # the kept walk held it by a weak reference only
    new = kept.get(model, object())
    assert kept.builds == 2 and new.params[new.param_names.index("2.weight")] is model[2].weight
    # without a token nothing is kept
    kept.get(model, None)
    kept.get(model, None)
    assert kept.builds == 4


@pytest.mark.parametrize("versions", [True, False], ids=["dict-versions", "scanned"])
def test_generators_appearing_changing_and_going_between_snapshots_are_each_snapshots_own(monkeypatch, versions):
    """The generator scan looks again only at modules whose attributes changed (by their dict's version): a
    generator given to a module, replaced, moved to another module or deleted is seen at the next capture."""
    import torch._dynamo.guards

    if not versions:
        monkeypatch.setattr(fit_state, "dict_version", lambda: None)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    structure = fit_state.Structure()
    named = lambda: list(model.named_modules())  # noqa: E731
    assert structure.generators(named()) == {}
    first = torch.Generator().manual_seed(1)
    model[1][0].noise = first
    assert structure.generators(named()) == {"1.0.noise": first}
    assert structure.generators(named()) == {"1.0.noise": first}  # (unchanged: not looked at again)
    second = torch.Generator().manual_seed(2)
    model[1][0].noise = second  # replaced
    model.mask = first  # another module (the root)
    assert structure.generators(named()) == {"1.0.noise": second, "mask": first}
    del model[1][0].noise
    model[0] = torch.nn.Linear(2, 2)  # a new module in place of another
    model[0].g = second
    assert structure.generators(named()) == {"0.g": second, "mask": first}
    assert structure.generators(named()) == fit_state._module_generators(model)
    moved = torch.nn.Sequential(model[1], model[0])  # the same modules under other names
    assert structure.generators(list(moved.named_modules())) == {"1.g": second}
