"""The one C-level check of the capture plan's tensor metadata (staging/meta.py): it sees every change the plan
must see, and it is not used where torch's guard does not behave as expected."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.guards
from torch import nn

from lightning_snapshot.staging import meta


def _tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    return [layer.weight, layer.bias, torch.zeros(5), torch.tensor(2.0), torch.empty(0), torch.arange(12.0)[2:8]]


def test_it_accepts_the_same_tensors_and_the_same_metadata_in_other_tensors():
    tensors = _tensors()
    check = meta.metadata_check(tensors)
    assert check is not None
    assert check(list(tensors))
    with torch.no_grad():
        tensors[0].add_(1.0)  # (values are not metadata)
    assert check(list(tensors))


@pytest.mark.parametrize(
    "change",
    [
        lambda ts: setattr(ts[0], "data", torch.zeros(4, 3)),  # .data swapped: another shape
        lambda ts: setattr(ts[0], "data", torch.zeros(4, 3).t()),  # .data swapped: the same shape, other strides
        lambda ts: setattr(ts[1], "data", ts[1].data.double()),  # .data swapped: another dtype
        lambda ts: ts[2].resize_(6),  # resized in place
        lambda ts: ts[3].unsqueeze_(0),  # a dimension added in place
        lambda ts: ts[5].t_() if ts[5].dim() > 1 else ts[5].as_strided_((3,), (2,)),  # other strides in place
        lambda ts: ts.__setitem__(2, nn.Parameter(ts[2])),  # another type
        lambda ts: ts.append(torch.zeros(1)),  # one more
        lambda ts: ts.pop(),  # one fewer
    ],
    ids=["data-shape", "data-strides", "data-dtype", "resize", "unsqueeze", "as-strided", "type", "more", "fewer"],
)
def test_it_rejects_every_change_of_shape_dtype_strides_type_or_count(change):
    tensors = _tensors()
    check = meta.metadata_check(tensors)
    assert check is not None
    with torch.no_grad():
        change(tensors)
    assert not check(tensors)


def test_a_guard_that_does_not_see_a_change_is_never_used(monkeypatch):
    monkeypatch.setattr(meta, "_trusted", None)
    monkeypatch.setattr(meta, "_build", lambda tensors: lambda given: True)  # (a torch whose guard changed meaning)
    assert meta.metadata_check(_tensors()) is None
    assert meta._trusted is False


def test_without_torch_dynamo_imported_python_compares(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "torch._dynamo.guards")
    assert meta.metadata_check(_tensors()) is None


def test_the_self_test_holds_whatever_default_device_and_dtype_the_program_set(monkeypatch):
    monkeypatch.setattr(meta, "_trusted", None)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            assert meta.metadata_check(_tensors()) is not None
    finally:
        torch.set_default_dtype(previous)
    assert meta._trusted is True


# ------------------------------------------------------------------------------------------------- dict versions
def test_dict_versions_change_with_a_modules_and_an_optimizers_dicts_and_are_trusted_here(monkeypatch):
    monkeypatch.setattr(meta, "_versions_trusted", None)
    version = meta.dict_version()
    assert version is not None and meta._versions_trusted is True
    layer = nn.Linear(2, 2)
    opt = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(1, 2)).sum().backward()
    opt.step()
    dicts = [layer._parameters, layer._buffers, layer._modules, opt.state, opt.state[layer.bias]]
    before = list(map(version, dicts))
    layer(torch.ones(1, 2)).sum().backward()
    opt.step()  # (values change in place: no dict changes)
    assert list(map(version, dicts)) == before
    layer.weight = nn.Parameter(torch.zeros(2, 2))
    layer.register_buffer("b", torch.zeros(1))
    layer.add_module("child", nn.Identity())
    opt.state[layer.weight]  # (a read of a defaultdict that inserts)
    opt.state[layer.bias]["exp_avg"] = torch.zeros(2)
    after = list(map(version, dicts))
    assert all(a != b for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize(
    "version",
    [lambda d: 0, id, len, lambda d: hash(tuple(d))],
    ids=["constant", "id", "length", "keys-only"],
)
def test_a_dict_version_that_misses_a_change_is_never_used(monkeypatch, version):
    monkeypatch.setattr(meta, "_versions_trusted", None)
    monkeypatch.setattr(__import__("sys").modules["torch._C._dynamo.guards"], "dict_version", version)
    assert meta.dict_version() is None
    assert meta._versions_trusted is False


def test_without_torch_dynamo_imported_no_dict_version(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "torch._dynamo.guards")
    assert meta.dict_version() is None
