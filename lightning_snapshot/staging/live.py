"""The per-plan capture cache: a model's and its optimizers' state, encoded at a per-snapshot cost nearly constant in
the number of tensors.

Encoding ``{"state_dict": module.state_dict(), "optimizer_states": [opt.state_dict(), ...]}`` afresh walks every
tensor in Python several times (the module tree, the state dicts, the encoder, the arena's plan check). But between
two snapshots the *structure* of that state almost never changes: the same tensor objects sit in the same module and
optimizer slots, only their values (and the optimizers' hyperparameters) move. :class:`LiveCapture` therefore makes
a *capture plan* from one full capture (the tree with its tensor names, and the ids of the live objects behind it,
each watched through a weak reference that marks the plan dead once it is freed), verifies that the plan
reproduces that capture exactly, and from then on only checks, with C-level passes over flat lists
(``map``/``chain``, no Python loop per tensor), that it still holds:

* the modules are the same objects of the same classes, with the same children; their ``_parameters`` and
  ``_buffers`` hold the same names and the same tensor objects; no buffer changed persistence; no state-dict hook
  appeared;
* the optimizers are the same objects, with the same parameters in their groups, the same tensors in their state
  (state appearing for a parameter, a group added, a tensor replaced: all change these), and no state-dict hook;
* every tensor still has the same address, shape, dtype and strides (resized, or swapped through ``.data``); the
  last three in one C-level check where torch's own can be trusted (:mod:`~lightning_snapshot.staging.meta`).

Once the first two held, the plan records the versions of the dicts they read (each module's ``_modules``,
``_parameters``, ``_buffers`` and state-dict hooks, each optimizer's ``state`` and per-parameter state; CPython
gives a dict a new version at every change of its keys or values, and :func:`~lightning_snapshot.staging.meta.
dict_version` reads it where it can be trusted). While they are unchanged, those dicts hold the very same objects,
and only what no dict version covers is compared (the modules' classes, their non-persistent buffer names, the
parameter groups' lists); any other version, and the objects are compared one by one again. Only plain dicts are
vouched for this way: an ``OrderedDict`` can be reordered without a new version.

Then the snapshot's tree is the plan's template with the few plain values that change every step (the global step,
the optimizers' parameter groups) encoded afresh, and its tensors are the plan's, in order
(:class:`Encoded`, whose ``token`` tells the arena that its own plan for them still holds too). Anything the plan
cannot vouch for (a sharded or custom strategy, state-dict hooks, overridden ``state_dict``, non-tensor optimizer
state, a tensor in a parameter group) is captured the full way, as before. The plan holds no tensor, module or
optimizer alive: only weak references, ids, names, addresses and shapes.
"""

from __future__ import annotations

import operator
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from lightning_snapshot.errors import CaptureError
from lightning_snapshot.format import tree as _tree
from lightning_snapshot.staging.meta import dict_version, metadata_check

__all__ = ["Encoded", "LiveCapture"]

_call: Callable[[Any], Any] = getattr(operator, "call", lambda f: f())
_is = operator.is_
_MODULES = operator.attrgetter("_modules")
_PARAMS_BUFFERS = operator.attrgetter("_parameters", "_buffers")
_NON_PERSISTENT = operator.attrgetter("_non_persistent_buffers_set")
_SD_HOOKS = operator.attrgetter("_state_dict_hooks")
_SD_PRE_HOOKS = operator.attrgetter("_state_dict_pre_hooks")
# (every dict of a module whose keys and values the plan depends on)
_MODULE_DICTS = operator.attrgetter("_modules", "_parameters", "_buffers", "_state_dict_hooks", "_state_dict_pre_hooks")
_ORDERING_DICTS = operator.attrgetter("_modules", "_parameters", "_buffers")
_UNORDERED = frozenset({dict, defaultdict})  # (an OrderedDict can be reordered without a new version)
_GROUP_PARAMS = operator.itemgetter("params")
_PTR = torch.Tensor.data_ptr
_STRIDE = torch.Tensor.stride
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_eq = operator.eq
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_Module = torch.nn.Module
_Optimizer = torch.optim.Optimizer


@dataclass
class Encoded:
    """A state already encoded (:func:`~lightning_snapshot.format.tree.encode`'s result, as lists): its tree, its tensor
    names and tensors in encoding order. ``token`` is the capture plan's (the same object while the plan holds: the
    tensors are then the very ones of the previous snapshot, at the same addresses and shapes), or None."""

    tree: Any
    names: list[str]
    tensors: list[torch.Tensor]
    token: object | None = None


class _Died:
    """The callback of the weak references through which a plan watches the objects it identifies by ``id()``: run
    as one is freed (before its address can be reused), it marks the plan dead. While it is not, an equal ``id()`` is
    the same object, and the plan's checks compare ids in one C-level pass without touching the objects. (It holds
    nothing: no reference cycle, nothing kept alive.)"""

    __slots__ = ("dead",)

    def __init__(self) -> None:
        self.dead = False

    def __call__(self, _: Any) -> None:
        self.dead = True


def _same(objs: list[Any], refs: Sequence[Callable[[], Any]]) -> bool:
    """Whether ``objs`` are, one by one, the objects ``refs`` refer to (a dead reference matches nothing)."""
    return len(objs) == len(refs) and all(map(_is, objs, map(_call, refs)))


def _module_eligible(m: _Module) -> bool:
    cls = type(m)
    return (
        cls.state_dict is _Module.state_dict
        and cls._save_to_state_dict is _Module._save_to_state_dict
        and getattr(cls, "get_extra_state", _Module.get_extra_state) is _Module.get_extra_state
        and not m._state_dict_hooks
        and not m._state_dict_pre_hooks
    )


class _Plan:
    """What one full capture looked like, and how to check cheaply that a capture now would look the same."""

    def __init__(self, head: dict[str, Any], module: _Module, optimizers: list[Any], obj: Any, full: Encoded) -> None:
        """A plan for ``obj``, encoded as ``full``; ``ok`` says whether one could be made."""
        self.ok = False
        tree, values = full.tree, full.tensors
        names = self.names = full.names
        if not (
            type(obj) is dict
            and list(obj) == [*head, "state_dict", "optimizer_states"]
            and type(tree.get("state_dict")) is dict
            and len(obj["optimizer_states"]) == len(optimizers)
        ):
            return
        mods = [m for _, m in module.named_modules(remove_duplicate=False)]
        prefixes = [p for p, _ in module.named_modules(remove_duplicate=False)]
        if not all(map(_module_eligible, mods)):
            return
        # --- the model: state_dict's order (a module's parameters, its persistent buffers, then its children)
        self._died = _Died()
        self._watched: list[weakref.ref[Any]] = []  # (kept: a weak reference's callback runs while it lives)
        self.mod_refs = [weakref.ref(m) for m in mods]
        self.mod_types = list(map(type, mods))
        self.children = list(map(id, chain.from_iterable(map(dict.values, map(_MODULES, mods)))))
        self.non_persistent = [set(s) for s in map(_NON_PERSISTENT, mods)]
        dicts = list(chain.from_iterable(map(_PARAMS_BUFFERS, mods)))
        self.keys = list(chain.from_iterable(dicts))
        vals = list(chain.from_iterable(map(dict.values, dicts)))
        self.val_ids = self._ids(vals)
        live: dict[str, int] = {}  # tensor name in the encoding -> where the live tensor behind it is in the pool
        pool: list[Any] = list(vals)  # the model's values, then each optimizer's state values, as holds() lists them
        sd_tree = tree["state_dict"]
        at = 0
        for prefix, m in zip(prefixes, mods, strict=True):
            for kind, d in enumerate((m._parameters, m._buffers)):
                for k, v in d.items():
                    pos, at = at, at + 1
                    if v is None or (kind == 1 and k in m._non_persistent_buffers_set):
                        continue
                    key = f"{prefix}.{k}" if prefix else k
                    ref = sd_tree.get(key)
                    if not (type(ref) is dict and type(ref.get("$tensor")) is str) or vals[pos] is not v:
                        return
                    live[ref["$tensor"]] = pos
        self.model_tensors = [i for i, v in enumerate(vals) if v is not None]
        # --- the optimizers: the same parameters in their groups, the same tensors in their state
        self.opt_refs = [weakref.ref(o) for o in optimizers]
        self.group_sizes: list[list[int]] = []
        self.group_ids: list[list[int]] = []
        self.group_index: list[list[list[int]]] = []
        self.state_ids: list[list[int]] = []
        self.state_keys: list[list[str]] = []
        self.state_val_ids: list[list[int]] = []
        self.state_trees: list[Any] = []
        for j, (opt, packed) in enumerate(zip(optimizers, obj["optimizer_states"], strict=True)):
            cls = type(opt)
            if (
                cls.state_dict is not _Optimizer.state_dict
                or opt._optimizer_state_dict_pre_hooks
                or opt._optimizer_state_dict_post_hooks
                or type(packed) is not dict
                or list(packed) != ["state", "param_groups"]
            ):
                return
            groups = opt.param_groups
            self.group_sizes.append([len(g["params"]) for g in groups])
            self.group_ids.append(self._ids(chain.from_iterable(map(_GROUP_PARAMS, groups))))
            self.group_index.append([list(g["params"]) for g in packed["param_groups"]])
            self.state_ids.append(self._ids(opt.state))
            sdicts = list(opt.state.values())
            if not all(type(s) is dict for s in sdicts):
                return
            self.state_keys.append(list(chain.from_iterable(sdicts)))
            svals = list(chain.from_iterable(map(dict.values, sdicts)))
            if not all(isinstance(v, torch.Tensor) for v in svals):
                return  # non-tensor optimizer state (a step count as a number) changes every step
            self.state_val_ids.append(self._ids(svals))
            at = len(pool)
            pool.extend(svals)
            state_tree = tree["optimizer_states"][j]["state"]
            self.state_trees.append(state_tree)
            pairs = state_tree.get("$dict") if type(state_tree) is dict else None
            if sdicts and (pairs is None or len(pairs) != len(sdicts)):
                return
            for (_, sub), s in zip(pairs or [], sdicts, strict=True):
                if type(sub) is not dict or list(sub) != list(s):
                    return
                for k in s:
                    ref = sub[k]
                    if not (type(ref) is dict and type(ref.get("$tensor")) is str):
                        return
                    live[ref["$tensor"]], at = at, at + 1
        if set(live) != set(names):
            return  # a tensor the plan cannot find (in a parameter group, or the head)
        self.order = [live[n] for n in names]
        order = list(map(pool.__getitem__, self.order))
        if not all(
            type(t) in _PLAIN
            and t.layout == torch.strided
            and not t.is_conj()
            and not t.is_neg()
            and t.data_ptr() == v.data_ptr()
            and t.shape == v.shape
            and t.stride() == v.stride()
            and t.dtype == v.dtype
            for t, v in zip(order, values, strict=True)
        ):
            return
        self.tensor_refs = list(map(weakref.ref, order))
        #: the versions of every dict the structure depends on, as they were when it last held; None: not recorded
        #: (see :meth:`_unchanged`)
        self.versions: tuple[list[int], list[list[int]]] | None = None
        self._version: Callable[[Any], int] = id  # (set with the versions)
        self.ptrs = list(map(_PTR, order))
        self.shapes = list(map(_SHAPE, order))
        self.dtypes = list(map(_DTYPE, order))
        self.strides = list(map(_STRIDE, order))
        # (their shapes, dtypes and strides in one C-level check where trusted: made once the plan has held, so that
        # a state whose plan never holds does not pay for it)
        self.meta: Callable[[list[torch.Tensor]], bool] | None = None
        self._meta_pending = True
        self.template = {k: tree[k] for k in tree}
        self.token = object()
        self.ok = self.tree(head, optimizers) == tree

    def _ids(self, objs: Iterable[Any]) -> list[int]:
        """The ids of ``objs`` (None among them), each watched from now on (see :class:`_Died`)."""
        out = []
        for x in objs:
            if x is not None:
                self._watched.append(weakref.ref(x, self._died))
            out.append(id(x))
        return out

    def holds(self, module: _Module, optimizers: list[Any]) -> list[torch.Tensor] | None:
        """The plan's tensors (in encoding order) if a capture now would find the very same ones, else None."""
        tensors = None
        if self.versions is not None:
            try:
                tensors = self._unchanged(module, optimizers)
            except Exception:  # noqa: BLE001 - (a dict replaced by something that has no version: compared below)
                tensors = None
        if tensors is None:
            tensors = self._same_structure(module, optimizers)
            if tensors is None:
                return None
        if list(map(_PTR, tensors)) != self.ptrs:
            return None
        if self.meta is not None:
            return tensors if self.meta(tensors) else None
        # (compared one by one as they are made, not collected in lists first: a list of 1,000s of new tuples
        # would set off the garbage collector on the training thread, which then costs more than the check)
        if not (
            all(map(_eq, map(_SHAPE, tensors), self.shapes))
            and all(map(_is, map(_DTYPE, tensors), self.dtypes))
            and all(map(_eq, map(_STRIDE, tensors), self.strides))
        ):
            return None
        if self._meta_pending:  # (the plan held: from the next snapshot on, one C-level check of the same metadata)
            self._meta_pending = False
            self.meta = metadata_check(tensors)
        return tensors

    def _unchanged(self, module: _Module, optimizers: list[Any]) -> list[torch.Tensor] | None:
        """The plan's tensors if no dict the structure depends on changed since :meth:`_same_structure` last found
        it the same (each has the version it had then: its keys and values are the same objects), else None (the
        caller then compares the full way). What no version covers is checked as the full way checks it
        (:meth:`_uncovered_same`)."""
        assert self.versions is not None
        version = self._version
        mods = list(map(_call, self.mod_refs))
        if self._died.dead or not self._uncovered_same(mods, module, optimizers):
            return None
        if list(map(version, chain.from_iterable(map(_MODULE_DICTS, mods)))) != self.versions[0]:
            return None
        for j, opt in enumerate(optimizers):
            state = opt.state
            if [version(state), *map(version, state.values())] != self.versions[1][j]:
                return None
        return list(map(_call, self.tensor_refs))

    def _uncovered_same(self, mods: list[Any], module: _Module, optimizers: list[Any]) -> bool:
        """Whether what no dict version covers is as the plan has it: the root module and the modules' classes (a
        dead module is None, of another type), their non-persistent buffer names, the optimizers, the parameters in
        their groups (lists, not dicts) and their state-dict hooks."""
        return (
            mods[0] is module
            and list(map(type, mods)) == self.mod_types
            and list(map(_NON_PERSISTENT, mods)) == self.non_persistent
            and _same(optimizers, self.opt_refs)
            and all(
                list(map(len, map(_GROUP_PARAMS, opt.param_groups))) == self.group_sizes[j]
                and list(map(id, chain.from_iterable(map(_GROUP_PARAMS, opt.param_groups)))) == self.group_ids[j]
                and not (opt._optimizer_state_dict_pre_hooks or opt._optimizer_state_dict_post_hooks)
                for j, opt in enumerate(optimizers)
            )
        )

    def _record_versions(self, mods: list[_Module], optimizers: list[Any]) -> None:
        """Record the versions of the dicts the structure depends on, found the same just now (only where every one
        of them is a plain dict, and the dict versions can be trusted here)."""
        version = dict_version()
        if version is None:
            return
        states = [[opt.state, *opt.state.values()] for opt in optimizers]
        # (the dicts whose order is the state's order must be plain: an OrderedDict reordered keeps its version; the
        # hook dicts need not, they are empty)
        if not set(map(type, chain(chain.from_iterable(map(_ORDERING_DICTS, mods)), *states))) <= _UNORDERED:
            return
        if not all(isinstance(d, dict) for d in chain(map(_SD_HOOKS, mods), map(_SD_PRE_HOOKS, mods))):
            return
        self._version = version
        self.versions = (
            list(map(version, chain.from_iterable(map(_MODULE_DICTS, mods)))),
            [list(map(version, s)) for s in states],
        )

    def _same_structure(self, module: _Module, optimizers: list[Any]) -> list[torch.Tensor] | None:
        """The plan's tensors if the modules and optimizers hold the very same objects as the plan, in the same
        places (compared the full way), else None."""
        self.versions = None
        mods = list(map(_call, self.mod_refs))
        if not self._uncovered_same(mods, module, optimizers):
            return None
        if list(map(id, chain.from_iterable(map(dict.values, map(_MODULES, mods))))) != self.children:
            return None
        dicts = list(chain.from_iterable(map(_PARAMS_BUFFERS, mods)))
        if list(chain.from_iterable(dicts)) != self.keys:
            return None
        pool = list(chain.from_iterable(map(dict.values, dicts)))
        if self._died.dead or list(map(id, pool)) != self.val_ids:
            return None  # (ids: see _Died)
        if any(map(len, map(_SD_HOOKS, mods))) or any(map(len, map(_SD_PRE_HOOKS, mods))):
            return None
        for j, opt in enumerate(optimizers):
            state = opt.state
            if list(map(id, state)) != self.state_ids[j]:
                return None
            sdicts = list(state.values())
            if list(chain.from_iterable(sdicts)) != self.state_keys[j]:
                return None
            svals = list(chain.from_iterable(map(dict.values, sdicts)))
            if list(map(id, svals)) != self.state_val_ids[j]:
                return None
            pool.extend(svals)
        self._record_versions(mods, optimizers)
        return list(map(pool.__getitem__, self.order))

    def tree(self, head: dict[str, Any], optimizers: list[Any]) -> Any | None:
        """The snapshot's tree: the template, with the head and the parameter groups encoded afresh; None when a
        parameter group now holds a tensor (then the full capture names it)."""
        out: dict[str, Any] = {}
        for k, v in head.items():
            out[k], tensors = _tree.encode(v, k)
            if tensors:
                return None
        out["state_dict"] = self.template["state_dict"]
        states = []
        for j, opt in enumerate(optimizers):
            groups = []
            for g, index in zip(opt.param_groups, self.group_index[j], strict=True):
                packed = {k: v for k, v in g.items() if k != "params"}
                packed["params"] = index
                groups.append(packed)
            encoded, tensors = _tree.encode(groups, f"optimizer_states/{j}/param_groups")
            if tensors:
                return None
            states.append({"state": self.state_trees[j], "param_groups": encoded})
        out["optimizer_states"] = states
        return out


class LiveCapture:
    """Captures ``{**head, "state_dict": module.state_dict(), "optimizer_states": [opt.state_dict(), ...]}`` through
    a capture plan (see the module's documentation); one per callback (per fit)."""

    def __init__(self) -> None:
        self._plan: _Plan | None = None
        #: Full captures made (a new plan each); reused snapshots do not count.
        self.builds = 0
        #: After a state no plan could be made for: captures left to make the full way before trying again, and how
        #: many the next failure skips (doubling: a state that cannot be planned costs a plan attempt rarely).
        self._skip = 0
        self._backoff = 1
        #: the last :meth:`extend`: (the core's token, weak references to the added tensors, their keys, the token)
        self._extended: tuple[object, list[weakref.ref[Any]], list[Any], object] | None = None

    def capture(
        self, head: dict[str, Any], module: _Module, optimizers: list[Any], full: Callable[[], dict[str, Any]]
    ) -> Encoded | dict[str, Any]:
        """The state, encoded (:class:`Encoded`): from the plan while it holds; else from ``full()`` (which must
        return exactly the dict above, made the ordinary way: ``state_dict()`` calls), from which a new plan is made
        (its token is then new; None when no plan could be made). After a state no plan could be made for, the next
        captures (1, 2, 4, ... up to 64) return ``full()`` as it is, without trying."""
        plan = self._plan
        tensors = plan.holds(module, optimizers) if plan is not None else None
        if plan is not None and tensors is not None:
            tree = plan.tree(head, optimizers)
            if tree is not None:
                return Encoded(tree, plan.names, tensors, plan.token)
        self._plan = None
        obj = full()
        if self._skip:
            self._skip -= 1
            return obj
        self.builds += 1
        tree, named = _tree.encode(obj, "")
        encoded = Encoded(tree, list(named), list(named.values()))
        plan = _Plan(head, module, optimizers, obj, encoded)
        if plan.ok:
            self._plan, self._backoff = plan, 1
            encoded.token = plan.token
        else:
            self._skip, self._backoff = self._backoff, min(2 * self._backoff, 64)
        return encoded

    def extend(self, core: Encoded, more: dict[str, Any]) -> Encoded:
        """``core`` (:meth:`capture`'s result) with the tree ``more`` (tensor state beside the model's and the
        optimizers': the tensor parts, :class:`~lightning_snapshot.state.parts.Part`) encoded and added under its
        keys, which ``core`` must not have (CaptureError otherwise).

        The result's token vouches for all its tensors: it is the previous call's while ``core``'s token is the one
        that call had and ``more`` holds the very same tensor objects as then (weak references: a freed one never
        matches), at the same addresses, with the same shapes, strides and dtypes; a new one otherwise; None when
        ``core`` has none (then nothing vouches: the arena compares the tensors itself)."""
        tree, named = _tree.encode(more, "")
        clash = sorted(set(tree) & set(core.tree))
        if clash:
            raise CaptureError(f"the tensor parts' state uses the key(s) {clash} of the weights' state; rename them")
        tensors = list(named.values())
        token: object | None = None
        if core.token is not None:
            try:
                keys = [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors]
            except (RuntimeError, TypeError, AttributeError):  # (a tensor without storage of its own)
                keys = None
            last = self._extended
            if (
                keys is not None
                and last is not None
                and last[0] is core.token
                and last[2] == keys
                and all(map(_is, map(_call, last[1]), tensors))
            ):
                token = last[3]
            if token is None and keys is not None:
                token = object()
                self._extended = (core.token, [weakref.ref(t) for t in tensors], keys, token)
        return Encoded({**core.tree, **tree}, [*core.names, *named], [*core.tensors, *tensors], token)

    def clear(self) -> None:
        self._plan = None
        self._extended = None
