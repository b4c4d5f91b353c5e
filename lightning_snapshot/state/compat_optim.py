"""Does a snapshot's optimizer state fit a live optimizer? The optimizer half of
:mod:`~lightning_snapshot.state.compat`.

One job: :func:`_check_optimizer`, the rule for one optimizer (class, parameter groups, hyperparameters, and, for
``torch.optim`` classes, the per-parameter state keys found by a dry run of one step on a scalar copy), and the
helpers it shares with the scheduler checks of :mod:`~lightning_snapshot.state.compat`, which calls it from
:func:`~lightning_snapshot.state.compat.check`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

#: Parameter-group entries that are not hyperparameters.
_NOT_HYPER = frozenset({"params", "param_names"})
#: Hyperparameters a scheduler adds to the groups; a live group may have them without the saved one
#: (SWA re-adds ``initial_lr``/``swa_lr`` itself).
_SCHEDULER_KEYS = frozenset({"initial_lr", "swa_lr"})
#: Device- and implementation-only flags; forced off for the dry run (they do not change which state is kept).
_IMPL_FLAGS = {"foreach": False, "fused": None, "capturable": False, "differentiable": False}


def _class_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _raw(opt: Any) -> Any:
    return getattr(opt, "_optimizer", opt)  # a LightningOptimizer wraps the torch optimizer


# ------------------------------------------------------------------------------------------------- helpers
def _short(name: str | None) -> str:
    """``torch.optim.adamw.AdamW`` -> ``torch.optim.AdamW`` (as users write it); other names unchanged."""
    if not name:
        return "an unrecorded class"
    module, _, qual = name.rpartition(".")
    if module.startswith("torch.optim.") and module.count(".") == 2 and module != "torch.optim.swa_utils":
        return f"torch.optim.{qual}"
    return name


def _keys(keys: Iterable[Any]) -> str:
    keys = sorted(str(k) for k in keys)
    return ", ".join(keys) if keys else "none"


def _saved_entry(saved: dict[str, Any] | None, kind: str, i: int) -> dict[str, Any] | None:
    if not isinstance(saved, dict):
        return None
    entries = saved.get(kind)
    if not isinstance(entries, list) or i >= len(entries) or not isinstance(entries[i], dict):
        return None
    return entries[i]


def _groups(state: Any) -> list[dict[str, Any]] | None:
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return None
    return groups


def _param_state_keys(state: dict[str, Any]) -> dict[Any, frozenset[str]]:
    """Saved parameter key -> the names of its (non-empty) per-parameter state."""
    per_param = state.get("state")
    if not isinstance(per_param, dict):
        return {}
    return {k: frozenset(str(n) for n in v) for k, v in per_param.items() if isinstance(v, dict) and v}


def _loaded_groups(cls: type, live_opt: Any, saved_groups: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The hyperparameters the live optimizer's groups would have after ``load_state_dict`` of the saved groups
    (torch keeps the saved ones, then ``__setstate__`` fills in defaults), computed on a scalar copy; None when the
    class cannot be copied that way."""
    dummy = _dummy(cls, live_opt, [[0] for _ in saved_groups])
    if dummy is None:
        return None
    opt, _ = dummy
    try:
        opt.load_state_dict(
            {
                "state": {},
                "param_groups": [
                    {**{k: v for k, v in g.items() if k not in _NOT_HYPER}, "params": [j]}
                    for j, g in enumerate(saved_groups)
                ],
            }
        )
    except Exception:  # noqa: BLE001 - inconclusive: the caller falls back to the plain key comparison
        return None
    return [{k: v for k, v in g.items() if k not in _NOT_HYPER} for g in opt.param_groups]


def _dummy(cls: type, live_opt: Any, ndims: list[list[int]]) -> tuple[Any, list[list[torch.Tensor]]] | None:
    """A copy of the live optimizer's class over tiny CPU parameters (one per entry of ``ndims``, per group)."""
    if not (cls.__module__.startswith("torch.optim.") and issubclass(cls, torch.optim.Optimizer)):
        return None  # only classes known to have no side effects in their constructor and step
    params = [[torch.zeros((2,) * d, requires_grad=True) for d in group] for group in ndims]
    try:
        accepted = inspect.signature(cls.__init__).parameters
        defaults = dict(getattr(live_opt, "defaults", {}) or {})
        defaults.update({k: v for k, v in _IMPL_FLAGS.items() if k in defaults})
        kwargs = {k: v for k, v in defaults.items() if k in accepted and k not in ("params", "self")}
        opt = cls([{"params": ps} for ps in params], **kwargs)
    except Exception:  # noqa: BLE001 - e.g. a constructor that needs more than its defaults
        return None
    return opt, params


def _dry_run(
    cls: type, live_opt: Any, groups: list[dict[str, Any]], ndims: list[list[int]]
) -> list[dict[int, frozenset[str]]] | None:
    """Per group, per parameter dimensionality: the names of the per-parameter state the live class keeps after one
    step with these hyperparameters. None when that cannot be found out cheaply and safely."""
    dummy = _dummy(cls, live_opt, ndims)
    if dummy is None:
        return None
    opt, params = dummy
    with torch.random.fork_rng(devices=[]):
        try:
            for g, (hyper, ps) in enumerate(zip(groups, params, strict=True)):
                opt.param_groups[g].update({k: v for k, v in hyper.items() if k not in _NOT_HYPER})
                for k, v in _IMPL_FLAGS.items():
                    if k in opt.param_groups[g]:
                        opt.param_groups[g][k] = v
                for p in ps:
                    p.grad = torch.ones_like(p)
            step = type(opt).step
            # the function under torch's profiling wrapper: the global optimizer hooks users may have registered
            # must not see this copy
            raw_step = step.__wrapped__ if getattr(step, "hooked", False) and hasattr(step, "__wrapped__") else None
            if raw_step is not None:
                raw_step(opt)
            else:
                opt.step()
        except Exception:  # noqa: BLE001 - LBFGS (needs a closure), SparseAdam (sparse gradients), ...
            return None
    out: list[dict[int, frozenset[str]]] = []
    for ps, dims in zip(params, ndims, strict=True):
        out.append({d: frozenset(str(n) for n in opt.state.get(p, {})) for p, d in zip(ps, dims, strict=True)})
    return out


# ------------------------------------------------------------------------------------------------- optimizers
def _check_optimizer(
    i: int, live_opt: Any, saved_desc: dict[str, Any] | None, state: Any, finetuning: list[str]
) -> str | None:
    """What is wrong with optimizer ``i``, as one clause (None: it fits)."""
    live_cls = type(live_opt)
    live_name = _class_name(live_opt)
    saved_name = saved_desc.get("class") if isinstance(saved_desc, dict) else None
    if saved_name and saved_name != live_name:
        head = f"optimizer {i} is {_short(saved_name)} in the snapshot but {_short(live_name)} now"
    elif saved_name:
        head = f"optimizer {i} ({_short(live_name)})"
    else:
        head = (
            f"optimizer {i} ({_short(live_name)} now; the snapshot does not record its class, it was taken by an"
            " older version)"
        )
    parts: list[str] = []
    groups = _groups(state)
    if groups is None:
        parts.append("the snapshot holds no optimizer state_dict (no param_groups)")
        return f"{head}: {', and '.join(parts)}"
    live_groups = live_opt.param_groups
    have = [len(g["params"]) if isinstance(g.get("params"), list) else "?" for g in groups]
    want = [len(g["params"]) for g in live_groups]
    if have != want:
        hint = ""
        if len(groups) != len(live_groups) and finetuning:
            hint = (
                f" ({', '.join(finetuning)} adds parameter groups during fit and re-adds them in its on_fit_start"
                " from its own state: that state must be loaded before on_fit_start, and be the one saved with"
                " this optimizer state)"
            )
        parts.append(
            f"the snapshot has {len(groups)} parameter group(s) of {have} parameters, the optimizer"
            f" {len(live_groups)} of {want}{hint}"
        )
        return f"{head}: {', and '.join(parts)}"  # keys cannot be compared group by group
    # hyperparameters: torch replaces the live groups' with the saved ones, then fills in the defaults it knows
    saved_hyper = [{k: v for k, v in g.items() if k not in _NOT_HYPER} for g in groups]
    loaded = _loaded_groups(live_cls, live_opt, groups)
    if loaded is not None:
        after = [set(map(str, g)) for g in loaded]
    elif saved_name == live_name:
        after = None  # a class we cannot dry-run, the same as saved: its own __setstate__ may fill in defaults
    else:
        after = [set(map(str, g)) for g in saved_hyper]
    if after is not None:
        missing = set().union(
            *(
                {str(k) for k in lg if k not in _NOT_HYPER and k not in _SCHEDULER_KEYS} - a
                for lg, a in zip(live_groups, after, strict=True)
            )
        )
        if missing:
            extra = (
                set().union(*(set(map(str, g)) for g in saved_hyper))
                - set().union(*(set(map(str, lg)) for lg in live_groups))
                - _SCHEDULER_KEYS
            )
            parts.append(
                f"its saved parameter groups lack {_keys(missing)}, which {live_cls.__name__} reads"
                + (f" (they have {_keys(extra)} instead)" if extra else "")
            )
    # per-parameter state: what the live class keeps for the saved hyperparameters
    saved_keys = _param_state_keys(state)
    if saved_keys:
        params_of = [list(g["params"]) for g in groups]
        live_params = [list(g["params"]) for g in live_groups]
        ndims = [sorted({p.dim() for p in ps}) or [1] for ps in live_params]
        # a missing hyperparameter is reported above; run with the live value to find the expected state
        run_groups = [
            {**{k: v for k, v in lg.items() if k not in _NOT_HYPER}, **g}
            for g, lg in zip(saved_hyper, live_groups, strict=True)
        ]
        expected = _dry_run(live_cls, live_opt, run_groups, ndims)
        if expected is not None:
            wrong: dict[frozenset[str], frozenset[str]] = {}
            for g, (keys, lps) in enumerate(zip(params_of, live_params, strict=True)):
                for key, lp in zip(keys, lps, strict=True):
                    have_k = saved_keys.get(key)
                    if have_k is None:
                        continue  # no state yet (no gradient so far): nothing to disagree with
                    want_k = expected[g].get(lp.dim(), frozenset())
                    if have_k != want_k:
                        wrong.setdefault(have_k, want_k)
            if wrong:
                have_k, want_k = next(iter(wrong.items()))
                parts.append(
                    f"its saved per-parameter state has {_keys(have_k)} where {live_cls.__name__} with these"
                    f" hyperparameters keeps {_keys(want_k) if want_k else 'no per-parameter state'}"
                )
    if saved_name and saved_name != live_name:
        return f"{head}" + (f": {', and '.join(parts)}" if parts else "")
    return f"{head}: {', and '.join(parts)}" if parts else None
