"""The health check of a packed (arena) state: whole runs of one dtype checked at once must name exactly the tensors
a check of each tensor on its own names: the first non-finite tensor of each health group, whatever sits in the
padding between tensors or next to them in another dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_snapshot.staging import StagedState, _finite_runs, nonfinite_tensors


def packed(specs: list[tuple[str, torch.dtype, int]], align: int = 64, fill: float | None = None) -> StagedState:
    """A packed state: tensors laid out back to back at ``align``-byte offsets in one region, filled with ones; the
    padding holds ``fill`` (as float32) where given, else zeros."""
    layout, offset = [], 0
    for name, dtype, n in specs:
        layout.append((name, offset, n * dtype.itemsize))
        offset = -(-(offset + n * dtype.itemsize) // align) * align
    region = torch.zeros(offset // 4 + 1, dtype=torch.float32)
    if fill is not None:
        region.fill_(fill)
    raw = region.view(torch.uint8)
    tensors = {}
    for (name, dtype, n), (_, at, nbytes) in zip(specs, layout, strict=True):
        t = raw[at : at + nbytes].view(dtype)
        t.fill_(1)
        tensors[name] = t
    return StagedState(tree={}, tensors=tensors, packed=memoryview(raw.numpy()), layout=layout)


def one_by_one(staged: StagedState) -> list[str]:
    """The reference: the same check with no run proven finite (every tensor checked on its own)."""
    plain = StagedState(tree={}, tensors=staged.tensors)
    return nonfinite_tensors(plain)


MODEL = [(f"state_dict/l{i}.weight", torch.float32, 64) for i in range(200)]
OPT = [(f"optimizer_states/0/state/{i}/exp_avg", torch.float32, 64) for i in range(200)]


def test_an_all_finite_state_is_proven_in_runs_and_named_clean():
    staged = packed(MODEL + OPT)
    assert _finite_runs(staged) == set(staged.tensors)  # (every tensor proven by its run: none checked alone)
    assert nonfinite_tensors(staged) == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_names_the_first_tensor_of_each_group_as_one_by_one(bad):
    staged = packed(MODEL + OPT)
    staged.tensors["state_dict/l7.weight"][3] = bad
    staged.tensors["state_dict/l150.weight"][0] = bad
    staged.tensors["optimizer_states/0/state/42/exp_avg"][63] = bad
    expected = ["state_dict/l7.weight", "optimizer_states/0/state/42/exp_avg"]
    assert one_by_one(staged) == expected
    staged.nonfinite = None
    assert nonfinite_tensors(staged) == expected


def test_garbage_in_the_padding_is_never_reported():
    staged = packed(MODEL + OPT, fill=float("nan"))  # (every padding byte a NaN, the tensors all ones)
    assert nonfinite_tensors(staged) == []


def test_other_dtypes_in_between_are_checked_on_their_own():
    nan_bits = np.array([np.nan], dtype=np.float32).view(np.int32)[0]
    specs = [
        ("state_dict/a", torch.float32, 10),
        ("state_dict/steps", torch.int32, 10),
        ("state_dict/b", torch.float32, 10),
        ("state_dict/c", torch.bfloat16, 10),
        ("state_dict/d", torch.float16, 10),
        ("optimizer_states/0/x", torch.float64, 10),
    ]
    staged = packed(specs, align=4)
    staged.tensors["state_dict/steps"].fill_(int(nan_bits))  # (an int whose bytes read as float32 are a NaN)
    assert nonfinite_tensors(staged) == []
    staged.nonfinite = None
    staged.tensors["state_dict/c"][2] = float("inf")
    staged.tensors["optimizer_states/0/x"][9] = float("nan")
    assert nonfinite_tensors(staged) == one_by_one(staged) == ["state_dict/c", "optimizer_states/0/x"]
