"""One C-level check that a list of tensors still has the metadata it had: type, dtype, device, shape and strides;
and a dict's version (:func:`dict_version`), which tells that a dict's keys and values are the very ones they were.

The capture plan (:mod:`~lightning_snapshot.staging.live`) checks at every snapshot that each of its tensors still
has the shape, dtype and strides it was planned with (a ``.data`` swap or a ``resize_`` changes them without moving
any version counter). Read from Python, that is a ``torch.Size`` and a tuple made per tensor: about 1 us each, 1-2
ms for 1,560 tensors inside a fit. torch has one C++ check of exactly this, the per-tensor check of the
``TENSOR_MATCH`` guards that ``torch.compile`` evaluates before every call of a compiled function;
:func:`metadata_check` builds one ``TensorGuards`` object holding that check for every tensor of the plan: about
1.5 ms to build for 1,560 tensors (a guard tree with a manager per tensor took 30 ms, at the first snapshot) and
0.1 ms to check out of a fit; inside one, its compact table costs less to read cold than such a tree (the plan
check 1.1-1.2 -> 0.8-0.9 ms).

It is used only where it can be trusted, else the caller compares in Python:

* ``torch._dynamo`` is already imported (Lightning's ``fit`` imports it; importing it here would take seconds);
* a self-test, once per process, shows that the guard accepts a tensor with the same metadata and rejects every
  kind of change the plan must see (shape, strides, dtype, type, one more tensor). A torch whose guards changed
  meaning fails it and is never used;
* it accepts the very tensors it was built from.

The guard also compares what the plan does not need (``requires_grad``, the dispatch keys under the current
thread-local state): a difference there only makes the caller capture the full way once and plan again. It holds
no reference to any tensor.

:func:`dict_version` is trusted on the same terms: ``torch._dynamo`` imported, and a self-test once per process (a
new version at every kind of change, none shared by two dicts). Where it is not, the plan compares its structure
object by object at every snapshot, as before.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["dict_version", "metadata_check"]

_trusted: bool | None = None  # the self-test's verdict, once per process
_versions_trusted: bool | None = None  # the same for dict_version


def _build(tensors: list[torch.Tensor]) -> Callable[[Any], bool]:
    guards = sys.modules["torch._C._dynamo.guards"]
    count = len(tensors)
    # (one C++ object for the whole list: 1-2 ms to build for 1,560 tensors, against 30 ms for a guard tree with a
    # manager per item, at the first snapshot; as fast to check)
    check = guards.TensorGuards(
        *tensors,
        dynamic_dims_sizes=[list(t.size()) for t in tensors],
        dynamic_dims_strides=[list(t.stride()) for t in tensors],
    ).check

    def matches(given: Any) -> bool:
        return len(given) == count and check(*given) is True

    return matches


def _self_test() -> bool:
    """Whether this torch's guard sees every change the plan must see (and accepts what it must accept)."""

    def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype)  # (float32 whatever default dtype the program set)

    check = _build([zeros(2, 3)])
    same = [torch.ones(2, 3, dtype=torch.float32)]
    changed = [
        [zeros(3, 2)],  # shape
        [zeros(3, 2).t()],  # the same shape, other strides
        [zeros(2, 4)[:, :3]],  # the same shape, other strides
        [zeros(2, 3, dtype=torch.float64)],  # dtype
        [zeros(2, 3, dtype=torch.int32)],  # dtype of the same size
        [zeros(1, 2, 3)],  # one more dimension
        [torch.nn.Parameter(zeros(2, 3))],  # type
        [zeros(2, 3), zeros(2, 3)],  # one more tensor
        [],
    ]
    return check(same) is True and not any(check(c) for c in changed)


def metadata_check(tensors: list[torch.Tensor]) -> Callable[[list[torch.Tensor]], bool] | None:
    """A function telling whether a list of tensors has, one by one, the type, dtype, device, shape and strides
    (and ``requires_grad``) of ``tensors`` now; None where no such check can be trusted here (see the module's
    documentation): then the caller compares them itself."""
    global _trusted
    if "torch._dynamo.guards" not in sys.modules:
        return None
    if _trusted is None:
        try:
            with torch.device("cpu"):  # (its probes in host memory, whatever default device the program set)
                _trusted = _self_test()
        except Exception:  # noqa: BLE001 - private torch API: anything unexpected means not here
            _trusted = False
    if not _trusted:
        return None
    try:
        check = _build(tensors)
        return check if check(tensors) is True else None
    except Exception:  # noqa: BLE001 - (a tensor it cannot guard: compared in Python)
        return None


def _versions_self_test(version: Callable[[Any], int]) -> bool:
    """Whether ``version`` gives a dict a new version at every change of its keys or values (a value replaced by
    another object, a key added or removed, by every method that does, and an object's ``__dict__`` through
    ``setattr``), and never gives a new dict a version an earlier dict had (one freed before it, at the same
    address)."""
    seen: set[int] = set()

    def fresh(d: dict[Any, Any]) -> bool:
        v = version(d)
        new = type(v) is int and v not in seen
        seen.add(v)
        return new

    d: dict[Any, Any] = {"a": object()}
    steps = [
        lambda: d.__setitem__("a", object()),
        lambda: d.__setitem__("b", object()),
        lambda: d.__delitem__("b"),
        lambda: d.pop("a"),
        lambda: d.update(c=1),
        lambda: d.setdefault("e", 2),
        lambda: d.popitem(),
        lambda: d.clear(),
    ]
    if not fresh(d):
        return False
    for step in steps:
        step()
        if not fresh(d):
            return False
    lazy: defaultdict[str, dict[str, int]] = defaultdict(dict)
    fresh(lazy)
    _ = lazy["x"]  # (a read that inserts)
    if not fresh(lazy) or not all(fresh({"k": i}) for i in range(64)):
        return False
    # an object's __dict__ (a module's attributes), changed through setattr and delattr
    probe = _Probe()
    attrs = probe.__dict__
    if not fresh(attrs):
        return False
    for change in (
        lambda: setattr(probe, "a", object()),
        lambda: setattr(probe, "a", object()),
        lambda: setattr(probe, "b", 1),
        lambda: delattr(probe, "a"),
    ):
        change()
        if not fresh(attrs):
            return False
    return True


class _Probe:
    def __init__(self) -> None:
        self.x = 0


def dict_version() -> Callable[[Any], int] | None:
    """A function giving a dict's version (CPython's ``ma_version_tag``, read by torch's own C++: the one the
    guards of ``torch.compile`` compare to tell that a module's or a frame's dicts did not change), which changes
    at every change of the dict's keys or values and is never shared by two dicts; None where it cannot be
    trusted here (``torch._dynamo`` not imported, a Python without it, a self-test that fails). It does not see an
    ``OrderedDict`` reordered: the caller uses it on plain dicts only."""
    global _versions_trusted
    guards = sys.modules.get("torch._C._dynamo.guards")
    if "torch._dynamo.guards" not in sys.modules or guards is None:
        return None
    version = getattr(guards, "dict_version", None)
    if _versions_trusted is None:
        try:
            _versions_trusted = version is not None and _versions_self_test(version)
        except Exception:  # noqa: BLE001 - private torch API: anything unexpected means not here
            _versions_trusted = False
    return version if _versions_trusted else None
