"""Does a snapshot's optimizer and scheduler state fit the live trainer? Refuse a changed setup before anything is
applied, accept what Lightning's own callbacks change during fit.

Used by capture.py (:func:`describe` when a snapshot is taken, :func:`check` and :func:`schedulers_to_load` when one
is applied) and by the callback's ``on_train_start`` after a restore (the ``reinstate_*`` functions). The check of one
optimizer, and the helpers it shares with the scheduler checks here, are :mod:`~lightning_snapshot.state.compat_optim`.

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

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_snapshot.errors import StateMismatchError
from lightning_snapshot.state.compat_optim import (
    _NOT_HYPER,
    _check_optimizer,
    _class_name,
    _keys,
    _raw,
    _saved_entry,
    _short,
)

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
_FIX = (
    "Nothing was restored. Pass resume=False to start fresh, or point the callback at the snapshot directory of"
    " this setup"
)


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
