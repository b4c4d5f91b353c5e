"""The state parts registry: the built-in parts map onto the keys snapshots always had (the format is unchanged), and
a part's place, its phase and an older snapshot that lacks it behave as documented."""

from __future__ import annotations

import pytest

from lightning_snapshot.state.builtin import REGISTRY
from lightning_snapshot.state.parts import CaptureContext, Part, Phase, Registry, RestoreContext

FIT_STATE_KEYS = [
    "param_groups",
    "trainable",
    "track_running_stats",
    "accumulate_grad_batches",
    "train_results",
    "logger_connector",
    "checkpoint_files",
    "checkpoint_saves",
    "grads",
    "metrics",
    "train_dl_epoch",
    "validation_pending",
    "stopped",
    "generators",
]


def test_the_built_in_parts_are_the_keys_of_the_format():
    per_rank = [p.path for p in REGISTRY if p.per_rank]
    shared = [p.path for p in REGISTRY if not p.per_rank]
    assert per_rank == [("rng",), ("loaders",), ("weight_averaging_buffers",), ("ddp_layout",)]
    assert shared == [("lightning_snapshot", "fit_state", k) for k in FIT_STATE_KEYS] + [
        ("callbacks",),
        ("tensor_parts", "weight_averaging"),  # (tensors: of the shared tensor state, beside state_dict)
    ]


def _ctx() -> CaptureContext:
    return CaptureContext(None, None, consumed=0, epoch=0, boundary=False, token=None, memo={})


def test_capture_places_parts_and_restore_gives_none_for_an_older_snapshot():
    reg = Registry()
    got: list[tuple[str, object]] = []
    reg.register(Part("a", lambda ctx: 1, lambda ctx, v: got.append(("a", v)), Phase.LOADED, per_rank=True))
    reg.register(Part("s", lambda ctx: {"x": 2}, lambda ctx, v: got.append(("s", v)), Phase.LOADED))
    reg.register(Part("b", lambda ctx: 3, lambda ctx, v: got.append(("b", v)), Phase.EPOCH, per_rank=True))
    section = reg.capture(_ctx(), lambda fill: (lambda late: (fill(late), late)[1])({"loops": {}}))
    assert list(section) == ["a", "late", "b"]
    assert section["late"] == {"loops": {}, "lightning_snapshot": {"fit_state": {"s": {"x": 2}}}}
    ctx = RestoreContext(None, None, 1, "here")
    reg.restore(Phase.LOADED, ctx, section["late"], section)
    assert got == [("a", 1), ("s", {"x": 2})]
    got.clear()
    reg.restore(Phase.LOADED, ctx, {}, {})  # (a snapshot taken before these parts existed)
    assert got == [("a", None), ("s", None)]
    resized = reg.resized(section)
    assert resized is not None and "a" not in resized and resized["exact"] is False


def test_a_name_or_place_taken_or_reserved_is_refused():
    reg = Registry()
    reg.register(Part("a", lambda ctx: 1, lambda ctx, v: None, Phase.LOADED, per_rank=True))
    with pytest.raises(ValueError, match="registered"):
        reg.register(Part("a", lambda ctx: 1, lambda ctx, v: None, Phase.LOADED))
    with pytest.raises(ValueError, match="reserves"):
        Part("late", lambda ctx: 1, lambda ctx, v: None, Phase.LOADED, per_rank=True)
