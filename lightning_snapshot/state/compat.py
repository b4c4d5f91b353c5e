"""Does a snapshot's optimizer and scheduler state fit the live trainer? Refuse a changed setup before anything is
applied, accept what Lightning's own callbacks change during fit.

Used by capture.py (:func:`describe` when a snapshot is taken, :func:`check` and :func:`schedulers_to_load` when one
is applied) and by the callback's ``on_train_start`` after a restore (the ``reinstate_*`` functions). The check of one
optimizer is :func:`_check_optimizer` (class, parameter groups, hyperparameters, and, for ``torch.optim`` classes,
the per-parameter state keys found by a dry run of one step on a scalar copy); the scheduler checks share its helpers.

What Lightning does (2.6, ``fit(ckpt_path=...)``): callback states are loaded before ``strategy.setup`` and before
``on_fit_start`` (``_restore_modules_and_callbacks``); every callback's ``on_fit_start`` runs; only then are the
optimizer and scheduler states applied (``restore_training_state``):

* optimizers: ``strategy.load_optimizer_state_dict`` zips the live optimizers with the saved states (no count
  check) and calls ``torch.optim.Optimizer.load_state_dict``, which requires the same number of parameter groups and
  of parameters per group (``ValueError`` otherwise) but not the same class: each live group's hyperparameters are
  *replaced* by the saved group's (only ``params`` is kept), then the class's ``__setstate__`` fills in the keys it
  knows defaults for. AdamW state loaded into ``SGD(momentum=0.9)`` therefore loads, and the first ``step`` fails
  with ``KeyError: 'momentum'``; Adam state loaded into AdamW loads and silently trains as Adam.
* schedulers: ``restore_lr_schedulers`` zips ``trainer.lr_scheduler_configs`` with the saved states (no count check)
  and calls ``scheduler.load_state_dict``, which is ``__dict__.update``: anything loads into anything.

Built-in callbacks rely on the zips and on the order:

* ``StochasticWeightAveraging`` swaps the user's scheduler for ``SWALR`` (or appends one) at ``swa_epoch_start``;
  its own state holds the SWALR state. On resume its ``on_fit_start`` sees that state and *clears*
  ``trainer.lr_scheduler_configs``, so Lightning's zip pairs nothing and the saved SWALR state is dropped there; SWA
  re-creates SWALR at the next ``on_train_epoch_start`` from its own copy. SWALR also adds ``swa_lr`` (and
  ``initial_lr``) to the optimizer's parameter groups.
* ``BaseFinetuning`` (``BackboneFinetuning``) adds parameter groups when it unfreezes; its state holds every group
  (parameters by name), and on resume its ``on_fit_start`` re-installs them, so that the optimizer has the saved
  number of groups by the time its state is loaded.

The rule (what :func:`check` enforces), given the live trainer *after every callback's on_fit_start*:

1. Optimizers: the same number; the same class at each position (when the snapshot records it); the same number of
   parameter groups and parameters per group (as torch requires; a callback that adds groups must have re-added them
   in its ``on_fit_start``); the saved groups, loaded the way torch loads them, hold every hyperparameter the live
   groups have; and for ``torch.optim`` classes, the saved per-parameter state has the keys the live class keeps
   for those hyperparameters (found by a dry run of one step on a scalar copy: CPU, a few bytes, not the live
   optimizer, no hooks). Extra saved hyperparameters (``initial_lr``, ``swa_lr`` ...) are harmless and allowed.
   No built-in callback changes an optimizer's class or count, so there is no exception here.
2. Schedulers: paired by position like Lightning's zip. Each pair must be of the same class (when the snapshot
   records it; otherwise the class-specific keys of the state must agree) and both or neither ReduceLROnPlateau.
   A live scheduler without a saved state is refused (a scheduler was added). A saved state without a live
   scheduler is refused unless a live callback restores it itself: a ``StochasticWeightAveraging`` that holds a
   scheduler state (it cleared the list in its ``on_fit_start``) owns one saved ``SWALR`` state.
3. Anything else the snapshot does not record (e.g. learning rates, scheduler intervals) is restored as saved, as
   Lightning does.

So a check accepts what Lightning's restore accepts *and trains on correctly*, and refuses what would crash later
(a missing hyperparameter), what torch refuses (group counts and sizes), and what Lightning would silently drop or
reinterpret (a different count of optimizers or schedulers, another optimizer or scheduler class) unless a built-in
callback explains it. :func:`schedulers_to_load` gives the (live config, saved state) pairs to apply, which is
Lightning's zip once the check has passed.

A snapshot resumes *within* an epoch, whose ``on_train_epoch_start`` hooks ran before it and do not run again
(Lightning's mid-epoch ``ckpt_path`` resume is the same). SWA creates SWALR in that hook, so after such a resume it
would be missing until the next epoch; :func:`reinstate_epoch_start_schedulers` (at ``on_train_start``) puts it back.
SWA creates SWALR only within its averaging epochs, so after a restore past them (its BatchNorm-update epoch)
:func:`reinstate_swalr_after_averaging` puts it back.

Snapshots written before :func:`describe` existed have no description (``saved=None``): classes are then unknown,
and the check relies on what the states themselves show (group structure, hyperparameter and state keys, SWALR and
ReduceLROnPlateau recognised by their keys, scheduler classes compared by their class-specific keys).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_snapshot.errors import StateMismatchError

__all__ = [
    "DESCRIPTION_VERSION",
    "check",
    "describe",
    "reinstate_epoch_start_schedulers",
    "reinstate_swalr_after_averaging",
    "schedulers_to_load",
]

DESCRIPTION_VERSION = 1

#: Keys every ``LRScheduler`` state has (across torch versions); the rest are the class's own.
_BASE_SCHEDULER_KEYS = frozenset(
    {
        "base_lrs",
        "last_epoch",
        "verbose",
        "_step_count",
        "_get_lr_called_within_step",
        "_last_lr",
        "_is_initial",
        "_initial_step",
        "optimizer",
    }
)
#: Parameter-group entries that are not hyperparameters.
_NOT_HYPER = frozenset({"params", "param_names"})
#: Hyperparameters a scheduler adds to the groups; a live group may have them without the saved one
#: (SWA re-adds ``initial_lr``/``swa_lr`` itself).
_SCHEDULER_KEYS = frozenset({"initial_lr", "swa_lr"})
#: Device- and implementation-only flags; forced off for the dry run (they do not change which state is kept).
_IMPL_FLAGS = {"foreach": False, "fused": None, "capturable": False, "differentiable": False}
_FIX = (
    "Nothing was restored. Pass resume=False to start fresh, or point the callback at the snapshot directory of"
    " this setup"
)


# ------------------------------------------------------------------------------------------------- helpers
def _class_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _raw(opt: Any) -> Any:
    return getattr(opt, "_optimizer", opt)  # a LightningOptimizer wraps the torch optimizer


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


# ------------------------------------------------------------------------------------------------- describe
def _is_plateau(scheduler: Any) -> bool:
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def describe(trainer: Any) -> dict[str, Any]:
    """A plain (JSON-able) description of the trainer's optimizers and LR schedulers, to store with a snapshot.

    Take it where the scheduler states are taken (``capture_late``), so that it describes the same schedulers::

        {"version": 1,
         "optimizers": [{"class": "torch.optim.adamw.AdamW",
                         "param_groups": [{"keys": ["amsgrad", "betas", ...], "params": 4}, ...]}],
         "schedulers": [{"class": "torch.optim.lr_scheduler.StepLR", "plateau": false, "optimizer": 0,
                         "interval": "epoch", "frequency": 1, "monitor": null, "name": null}]}
    """
    optimizers = [_raw(o) for o in trainer.optimizers]
    out_opts = []
    for opt in optimizers:
        out_opts.append(
            {
                "class": _class_name(opt),
                "param_groups": [
                    {"keys": sorted(str(k) for k in g if k not in _NOT_HYPER), "params": len(g["params"])}
                    for g in opt.param_groups
                ],
            }
        )
    out_scheds = []
    for cfg in trainer.lr_scheduler_configs:
        sched = cfg.scheduler
        target = getattr(sched, "optimizer", None)
        index = next((i for i, o in enumerate(optimizers) if o is _raw(target)), None) if target is not None else None
        out_scheds.append(
            {
                "class": _class_name(sched),
                "plateau": _is_plateau(sched),
                "optimizer": index,
                "interval": getattr(cfg, "interval", None),
                "frequency": getattr(cfg, "frequency", None),
                "monitor": getattr(cfg, "monitor", None),
                "name": getattr(cfg, "name", None),
            }
        )
    return {"version": DESCRIPTION_VERSION, "optimizers": out_opts, "schedulers": out_scheds}


# ------------------------------------------------------------------------------------------------- optimizers
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


# ------------------------------------------------------------------------------------------------- schedulers
def _is_swalr(desc: dict[str, Any] | None, state: Any) -> bool:
    if isinstance(desc, dict) and desc.get("class"):
        return str(desc["class"]).endswith(".SWALR")
    return isinstance(state, dict) and "anneal_epochs" in state


def _saved_plateau(desc: dict[str, Any] | None, state: Any) -> bool:
    if isinstance(desc, dict) and "plateau" in desc:
        return bool(desc["plateau"])
    # ReduceLROnPlateau keeps these, LRScheduler subclasses do not
    return isinstance(state, dict) and {"patience", "num_bad_epochs", "cooldown_counter"} <= set(state)


def _owners(trainer: Any) -> list[Any]:
    """Live callbacks that restore a saved scheduler themselves (see the module docstring)."""
    try:
        from lightning.pytorch.callbacks import StochasticWeightAveraging
    except ImportError:  # pragma: no cover
        return []
    return [
        cb
        for cb in getattr(trainer, "callbacks", []) or []
        if isinstance(cb, StochasticWeightAveraging) and getattr(cb, "_scheduler_state", None) is not None
    ]


def _swa_hint(trainer: Any, desc: dict[str, Any] | None, state: Any) -> str:
    """Why a saved SWALR state has no place here, if it is one."""
    if not _is_swalr(desc, state):
        return ""
    try:
        from lightning.pytorch.callbacks import StochasticWeightAveraging
    except ImportError:  # pragma: no cover
        return ""
    swa = [cb for cb in getattr(trainer, "callbacks", []) or [] if isinstance(cb, StochasticWeightAveraging)]
    if not swa:
        return (
            " (SWALR is StochasticWeightAveraging's scheduler: resume this snapshot with that callback, as it was"
            " configured)"
        )
    if all(getattr(cb, "_scheduler_state", None) is None for cb in swa):
        return (
            " (StochasticWeightAveraging restores SWALR from its own state, which must be loaded before its"
            " on_fit_start; it was not)"
        )
    return (
        " (StochasticWeightAveraging clears the schedulers in its on_fit_start: check after every callback's"
        " on_fit_start)"
    )


def _check_schedulers(trainer: Any, saved: dict[str, Any] | None, lr_schedulers: list[Any]) -> list[str]:
    configs = list(trainer.lr_scheduler_configs)
    problems: list[str] = []
    # pairs by position; the counts are compared elsewhere (saved states beyond the live list are SWA's SWALR)
    for i, (cfg, state) in enumerate(zip(configs, lr_schedulers, strict=False)):
        sched = cfg.scheduler
        desc = _saved_entry(saved, "schedulers", i)
        live_name = _class_name(sched)
        saved_name = desc.get("class") if desc else None
        if saved_name:
            if saved_name != live_name:
                problems.append(
                    f"LR scheduler {i} is {_short(saved_name)} in the snapshot but {_short(live_name)}"
                    " now" + _swa_hint(trainer, desc, state)
                )
                continue
        elif _saved_plateau(desc, state) != _is_plateau(sched):
            problems.append(
                f"LR scheduler {i} is {'' if _saved_plateau(desc, state) else 'not '}ReduceLROnPlateau"
                f" in the snapshot but {_short(live_name)} now"
            )
            continue
        elif isinstance(state, dict):
            live_keys = set(map(str, sched.state_dict())) - _BASE_SCHEDULER_KEYS
            saved_keys = set(map(str, state)) - _BASE_SCHEDULER_KEYS
            if live_keys != saved_keys:
                problems.append(
                    f"LR scheduler {i}: the saved state has {_keys(saved_keys - live_keys)} where the live"
                    f" {type(sched).__name__} has {_keys(live_keys - saved_keys)}" + _swa_hint(trainer, desc, state)
                )
                continue
        if not isinstance(state, dict):
            problems.append(f"LR scheduler {i}: the snapshot holds no scheduler state_dict")
    if len(configs) > len(lr_schedulers):
        added = ", ".join(_short(_class_name(c.scheduler)) for c in configs[len(lr_schedulers) :])
        problems.append(
            f"the snapshot has {len(lr_schedulers)} LR scheduler(s), configure_optimizers() now"
            f" {len(configs)} (added: {added})"
        )
    elif len(lr_schedulers) > len(configs):
        rest = list(range(len(configs), len(lr_schedulers)))
        owners = _owners(trainer)
        owned = [j for j in rest if owners and _is_swalr(_saved_entry(saved, "schedulers", j), lr_schedulers[j])]
        if owners and len(owned) == len(rest) == 1:
            return problems  # StochasticWeightAveraging re-creates its SWALR from its own state
        names = []
        for j in rest:
            d = _saved_entry(saved, "schedulers", j)
            names.append(
                _short(d.get("class"))
                if d and d.get("class")
                else ("SWALR" if _is_swalr(d, lr_schedulers[j]) else "a scheduler")
            )
        hint = next(
            (
                _swa_hint(trainer, _saved_entry(saved, "schedulers", j), lr_schedulers[j])
                for j in rest
                if _is_swalr(_saved_entry(saved, "schedulers", j), lr_schedulers[j])
            ),
            "",
        )
        problems.append(
            f"the snapshot has {len(lr_schedulers)} LR scheduler(s), the trainer now {len(configs)}"
            f" (not restored: {', '.join(names)}){hint}"
        )
    return problems


# ------------------------------------------------------------------------------------------------- API
def check(
    trainer: Any, saved: dict[str, Any] | None, optimizer_states: list[Any], lr_schedulers: list[Any], where: str
) -> None:
    """Raise :class:`StateMismatchError` if the saved optimizer and scheduler states do not fit the live trainer
    (the rule is in the module docstring); return None if they do.

    Call it at ``on_fit_start`` once every other callback's ``on_fit_start`` has run (and after the callbacks'
    states were loaded, before it), and before anything is applied, in particular before ``templates()`` under a
    sharded strategy (it creates optimizer state). ``saved``: what :func:`describe` returned at capture (None for
    snapshots that have none); ``optimizer_states`` / ``lr_schedulers``: the snapshot's lists (tensors may be
    placeholders: only keys and structure are read).
    """
    optimizers = [_raw(o) for o in trainer.optimizers]
    optimizer_states = list(optimizer_states or [])
    lr_schedulers = list(lr_schedulers or [])
    problems: list[str] = []
    saved_opts = saved.get("optimizers") if isinstance(saved, dict) else None
    if len(optimizer_states) != len(optimizers):
        saved_names = (
            [_short(d.get("class")) for d in saved_opts if isinstance(d, dict)]
            if isinstance(saved_opts, list)
            else None
        )
        live_names = [_short(_class_name(o)) for o in optimizers]
        problems.append(
            f"the snapshot has {len(optimizer_states)} optimizer(s)"
            + (f" ({', '.join(saved_names)})" if saved_names else "")
            + f", configure_optimizers() now returns {len(optimizers)}"
            + (f" ({', '.join(live_names)})" if live_names else "")
        )
    else:
        finetuning = [type(cb).__name__ for cb in getattr(trainer, "callbacks", []) or [] if _is_finetuning(cb)]
        for i, (opt, state) in enumerate(zip(optimizers, optimizer_states, strict=True)):
            problem = _check_optimizer(i, opt, _saved_entry(saved, "optimizers", i), state, finetuning)
            if problem:
                problems.append(problem)
    problems.extend(_check_schedulers(trainer, saved, lr_schedulers))
    if problems:
        raise StateMismatchError(
            f"{where} was taken with a different optimizer or LR scheduler setup: " + "; ".join(problems) + f". {_FIX}"
        )


def _is_finetuning(cb: Any) -> bool:
    try:
        from lightning.pytorch.callbacks import BaseFinetuning
    except ImportError:  # pragma: no cover
        return False
    return isinstance(cb, BaseFinetuning)


def schedulers_to_load(trainer: Any, lr_schedulers: list[Any]) -> list[tuple[Any, Any]]:
    """The (live ``LRSchedulerConfig``, saved state) pairs to load, after :func:`check` passed: Lightning's pairing
    by position. Saved states beyond the live list are those a callback restores itself (SWA's SWALR) and are left
    to it."""
    return list(zip(trainer.lr_scheduler_configs, lr_schedulers or [], strict=False))


def reinstate_epoch_start_schedulers(trainer: Any, pl_module: Any) -> list[str]:
    """Put back the schedulers a callback installs in ``on_train_epoch_start``, after a restore *within* an epoch.

    A within-epoch resume does not run the epoch's start hooks again (they ran before the snapshot). That loses what
    ``StochasticWeightAveraging`` does there: it creates SWALR (from its restored state) and puts it in
    ``trainer.lr_scheduler_configs``; without it the resumed epoch ends without the SWALR step and every later
    learning rate is one epoch behind (Lightning's own mid-epoch ``ckpt_path`` resume has the same gap). This runs
    that part of its epoch start: SWALR is created and loaded from the callback's state, swapped in, and the
    optimizer's hyperparameters, which SWALR's constructor changes, are set back to the restored ones. Its weight
    averaging is not repeated (its restored ``latest_update_epoch`` is the current epoch).

    Call it once everything is restored (``on_train_start``), only when the resume is within an epoch (not at an
    epoch boundary, where the next epoch's start hooks run anyway). Returns the names of the callbacks it ran.
    """
    ran = []
    for cb in _restored_swa(trainer):
        epoch = trainer.current_epoch
        if not (cb.swa_start <= epoch <= cb.swa_end) or getattr(cb, "_latest_update_epoch", -1) < epoch:
            continue  # not inside an SWA epoch whose start already ran
        with _hyperparameters_kept(trainer.optimizers):
            cb.on_train_epoch_start(trainer, pl_module)
        ran.append(type(cb).__name__)
    return ran


def _restored_swa(trainer: Any) -> list[Any]:
    """The StochasticWeightAveraging callbacks that hold a restored SWALR state and have not created SWALR yet."""
    try:
        from lightning.pytorch.callbacks import StochasticWeightAveraging
    except ImportError:  # pragma: no cover
        return []
    return [
        cb
        for cb in getattr(trainer, "callbacks", []) or []
        if isinstance(cb, StochasticWeightAveraging)
        and not getattr(cb, "_initialized", True)
        and getattr(cb, "_scheduler_state", None) is not None
    ]


@contextmanager
def _hyperparameters_kept(optimizers: list[Any]) -> Iterator[None]:
    """Set the optimizers' parameter-group hyperparameters back to what they are now, after the block."""
    groups = [[{k: v for k, v in g.items() if k != "params"} for g in _raw(o).param_groups] for o in optimizers]
    yield
    for opt, saved_groups in zip(optimizers, groups, strict=True):
        # (a group the block added has no saved hyperparameters and keeps its own)
        for g, hyper in zip(_raw(opt).param_groups, saved_groups, strict=False):
            g.update(hyper)


def reinstate_swalr_after_averaging(trainer: Any, pl_module: Any) -> list[str]:
    """Put back ``StochasticWeightAveraging``'s SWALR after a restore *past* its averaging epochs.

    SWA creates SWALR (from its restored state) only in an epoch start within ``swa_start..swa_end``; a run restored
    later (its BatchNorm-update epoch, or training past ``max_epochs`` raised) would end without SWALR in the
    trainer's schedulers and without its state in SWA's ``state_dict``, where a run that never stopped keeps both.
    This does what SWA's epoch start does for SWALR (private attributes of Lightning 2.x's SWA: ``_swa_lrs``,
    ``_annealing_epochs``, ``_annealing_strategy``, ``_init_n_averaged``), loads its saved state, and sets the
    optimizer's hyperparameters back to the restored ones (SWALR's constructor changes them).

    Call it at ``on_train_start`` after any restore (within an epoch or at a boundary). Returns the names of the
    callbacks it ran.
    """
    ran = []
    for cb in _restored_swa(trainer):
        if getattr(cb, "_max_epochs", -1) == -1 or trainer.current_epoch <= cb.swa_end:
            continue  # its own epoch start creates SWALR
        with _hyperparameters_kept(trainer.optimizers):
            _install_swalr(trainer, pl_module, cb)
        ran.append(type(cb).__name__)
    return ran


def _install_swalr(trainer: Any, pl_module: Any, cb: Any) -> None:
    """What SWA's epoch start does to create SWALR, with its saved state loaded."""
    from lightning.pytorch.utilities.types import LRSchedulerConfig
    from torch.optim.swa_utils import SWALR

    optimizer = trainer.optimizers[0]
    if isinstance(cb._swa_lrs, float):
        cb._swa_lrs = [cb._swa_lrs] * len(optimizer.param_groups)
    for lr, group in zip(cb._swa_lrs, optimizer.param_groups, strict=False):  # as Lightning's SWA pairs them
        group["initial_lr"] = lr
    scheduler = SWALR(
        optimizer,
        swa_lr=cb._swa_lrs,
        anneal_epochs=cb._annealing_epochs,
        anneal_strategy=cb._annealing_strategy,
        last_epoch=trainer.max_epochs if cb._annealing_strategy == "cos" else -1,
    )
    scheduler.load_state_dict(cb._scheduler_state)
    cb._swa_scheduler = scheduler
    cb._initialized = True
    if cb.n_averaged is None:
        cb.n_averaged = torch.tensor(cb._init_n_averaged, dtype=torch.long, device=pl_module.device)
    config = LRSchedulerConfig(scheduler)
    if trainer.lr_scheduler_configs:
        trainer.lr_scheduler_configs[0] = config
    else:
        trainer.lr_scheduler_configs.append(config)
