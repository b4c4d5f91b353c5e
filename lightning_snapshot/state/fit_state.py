"""Training state that Lightning's checkpoints leave out, and that callbacks change during fit.

Each kind of state here is a registered part (:mod:`lightning_snapshot.state.builtin` declares them: what is captured,
by which function here, and at which phase the ``restore_*`` function is applied); this module has the functions.

A snapshot of step N holds the state as it is right before step N+1
(:func:`lightning_snapshot.state.capture.capture_late`). After ``on_train_batch_end`` (N) Lightning and its callbacks
change
more than weights, loops, callbacks and schedulers, and Lightning's checkpoints leave some of it out. This module
captures that, at the late point, and applies it on restore:

* **the optimizers' parameter groups** (:func:`merge_param_groups`): hyperparameters change after ``on_train_batch_end``
  (epoch-end and plateau scheduler steps, ``StochasticWeightAveraging``'s SWALR), and ``BackboneFinetuning`` adds a
  group when it unfreezes. The groups taken late replace those of the early optimizer state, so that optimizer,
  scheduler and callback states agree.
* **which parameters are trainable** (``requires_grad``) and whether BatchNorm layers track running statistics
  (:func:`restore_trainable`): ``BaseFinetuning`` freezes the backbone in ``setup`` and unfreezes it at an epoch start;
  after a restore Lightning's own resume leaves the unfrozen parameters frozen (Lightning issue #21901).
* **the gradient accumulation in force** (``trainer.accumulate_grad_batches``; ``GradientAccumulationScheduler`` sets it
  at each epoch start, which a resume within an epoch does not run again).
* **the epoch aggregates of logged training metrics** (``self.log(..., on_epoch=True)`` in ``training_step``): the
  accumulated value and batch count of every tensor metric of the training ``_ResultCollection``, so that the epoch mean
  after a resume within an epoch includes the steps before it (``train_loss_epoch`` monitored by EarlyStopping or
  ModelCheckpoint). Values logged as ``torchmetrics.Metric`` objects keep their state in the metric (next item).
* **the accumulated state of ``torchmetrics.Metric`` objects** in the module
  (:func:`~lightning_snapshot.state.fit_metrics.restore_metrics`): not in the module's ``state_dict``, and a metric
  logged
  with ``on_epoch=True`` accumulates over the epoch.
* **gradients, only where Lightning reuses them**: ``StochasticWeightAveraging``'s BatchNorm-update epoch (the epoch
  after the last averaging epoch, when the model has BatchNorm layers) skips ``zero_grad`` and backward, and its one
  optimizer step applies the gradients left by the last step before it. A snapshot taken right before that epoch holds
  those gradients (:func:`restore_grads`); no other snapshot holds gradients.
* **the epoch the train loaders were made at** (Lightning's ``_last_train_dl_reload_epoch``): a resumed run makes them
  as the interrupted run last did, with ``trainer.current_epoch`` at that epoch (a ``train_dataloader()`` that depends
  on the epoch, ``reload_dataloaders_every_n_epochs``), and reloads them at the same epochs.
* **the model's own random generators** (``torch.Generator`` attributes of the module and its submodules,
  :func:`restore_generators`): neither in the ``state_dict`` nor in Lightning's checkpoints, and unlike the global RNG
  not restored by anyone else.
* **a request to stop** (``trainer.should_stop``, set by ``EarlyStopping``, a ``Timer`` or a callback) with the limits
  the fit ran under (:func:`restore_stop`): a rerun of a fit that stopped early stops where it did, as the run that
  never stopped did; one given larger limits trains on.
* **the checkpoint files of every ModelCheckpoint**
  (:func:`~lightning_snapshot.state.fit_checkpoints.prune_checkpoints`): a
  file written after the snapshot by the interrupted run is written again by the resumed run (same step, same name), and
  would otherwise stay behind as an untracked duplicate (or make ModelCheckpoint save a ``-v1`` copy).
* **what every ModelCheckpoint remembers of its last save**
  (:func:`~lightning_snapshot.state.fit_checkpoints.restore_checkpoint_saves`; private, not in its ``state_dict``): the
  step
  and file of its newest save and a save deferred until validation. From them it decides whether to save again at the
  same step and whether ``save_last`` still owes a ``last.ckpt`` at the end of training (a resumed run that has not
  saved since would write one the uninterrupted run did not).

Everything is tensors and plain values (no pickle); private Lightning attributes used are named where they are read.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
import warnings
import weakref
from collections.abc import Callable
from itertools import chain
from typing import Any, NamedTuple

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_snapshot.errors import StateMismatchError
from lightning_snapshot.staging.meta import dict_version

__all__ = [
    "Structure",
    "Walk",
    "merge_param_groups",
    "metric_classes",
    "module_generators",
    "optimizer_groups",
    "realias_lottery_tickets",
    "restore_generators",
    "restore_grads",
    "restore_stop",
    "restore_trainable",
    "reused_grads",
    "running_stats_tracking",
    "saved_state",
    "stop_limits",
    "train_dl_epoch",
    "trainable_flags",
]

log = logging.getLogger(__name__)


def _raw(opt: Any) -> Any:
    return getattr(opt, "_optimizer", opt)  # a LightningOptimizer wraps the torch optimizer


# ------------------------------------------------------------------------------------------------- capture
class Walk(NamedTuple):
    """One walk of the module for the fit-state parts."""

    modules: list[tuple[str, Any]]  # named_modules()
    param_names: list[str]
    params: list[Any]
    batchnorms: list[tuple[str, Any]]  # the BatchNorm modules, by name
    metrics: list[tuple[str, Any]]  # the torchmetrics modules, by name


def metric_classes() -> tuple[type, ...]:
    """The metric classes whose modules' state is captured: ``(torchmetrics.Metric,)``, or ``()`` without
    torchmetrics."""
    try:
        from torchmetrics import Metric
    except ImportError:  # (a dependency of Lightning's; absent only in unusual installs)
        return ()
    return (Metric,)


def _walk(pl_module: Any) -> Walk:
    modules = list(pl_module.named_modules())
    names, params = _named_parameters(modules)
    norms = [(n, m) for n, m in modules if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    classes = metric_classes()
    metrics = [(n, m) for n, m in modules if isinstance(m, classes)] if classes else []
    return Walk(modules, names, params, norms, metrics)


class Structure:
    """The walk of the module that the fit-state parts make at every snapshot (:class:`Walk`), kept from one snapshot to
    the next while the capture plan's ``token`` vouches that the module tree and its parameters are the very same
    objects (see :class:`~lightning_snapshot.staging.live.LiveCapture`). Weak references only: it keeps nothing
    alive."""

    def __init__(self) -> None:
        self._token: object | None = None
        self._mod_names: list[str] = []
        self._mod_refs: list[Callable[[], Any]] = []
        self._param_names: list[str] = []
        self._param_refs: list[Callable[[], Any]] = []
        self._norms: list[int] = []  # indices into the modules
        self._metrics: list[int] = []
        #: walks made; reused snapshots do not count
        self.builds = 0
        # the generator scan: the version of each module's __dict__ when last scanned, and the names of the
        # generator attributes found in it (names only: nothing kept alive)
        self._dict_versions: list[int] = []
        self._generator_attrs: list[tuple[str, ...]] = []

    def generators(self, modules: list[tuple[str, Any]]) -> dict[str, torch.Generator]:
        """:func:`_module_generators` of the module whose ``named_modules()`` are ``modules``, looking again only
        at the modules whose ``__dict__`` changed since the last call (its version, where dict versions can be
        trusted: see :func:`~lightning_snapshot.staging.meta.dict_version`; a dict's version is never another's, so
        an equal version is the very dict, unchanged, whatever module holds it now)."""
        version = dict_version()
        if version is None:
            return _module_generators(None, modules)
        dicts = list(map(_DICT, map(_SECOND, modules)))
        versions = list(map(version, dicts))
        if versions != self._dict_versions:
            known = dict(zip(self._dict_versions, self._generator_attrs, strict=True))
            self._generator_attrs = [
                known[v] if v in known else _generator_attrs(d) for v, d in zip(versions, dicts, strict=True)
            ]
            self._dict_versions = versions
        out: dict[str, torch.Generator] = {}
        if any(self._generator_attrs):
            for (name, _), d, attrs in zip(modules, dicts, self._generator_attrs, strict=True):
                for attr in attrs:
                    out[f"{name}.{attr}" if name else attr] = d[attr]
        return out

    def get(self, pl_module: Any, token: object | None) -> Walk:
        """The walk of ``pl_module``: the kept one while ``token`` is the token it was kept under (and every object
        in it is still alive), else made afresh (and kept if ``token``)."""
        if token is not None and token is self._token:
            mods = list(map(_call, self._mod_refs))
            params = list(map(_call, self._param_refs))
            # (not `None in params`: that compares each tensor with None, one torch call each)
            if mods[0] is pl_module and not any(map(operator.is_, chain(mods, params), itertools.repeat(None))):
                modules = list(zip(self._mod_names, mods, strict=True))
                return Walk(
                    modules,
                    self._param_names,
                    params,
                    [modules[i] for i in self._norms],
                    [modules[i] for i in self._metrics],
                )
        walk = _walk(pl_module)
        self.builds += 1
        self._token = token
        keep = token is not None
        self._mod_names = [n for n, _ in walk.modules] if keep else []
        self._mod_refs = [weakref.ref(m) for _, m in walk.modules] if keep else []
        self._param_names = walk.param_names if keep else []
        self._param_refs = list(map(weakref.ref, walk.params)) if keep else []
        index = {id(m): i for i, (_, m) in enumerate(walk.modules)} if keep else {}
        self._norms = [index[id(m)] for _, m in walk.batchnorms] if keep else []
        self._metrics = [index[id(m)] for _, m in walk.metrics] if keep else []
        return walk


_call: Callable[[Any], Any] = getattr(operator, "call", lambda f: f())
_DICT = operator.attrgetter("__dict__")
_SECOND = operator.itemgetter(1)


def optimizer_groups(trainer: Any, walk: Walk) -> list[list[dict[str, Any]]]:
    """Per optimizer, its parameter groups: hyperparameters and the names of their parameters (``walk``: the module's
    walk, :class:`Structure`)."""
    names = dict(zip(map(id, walk.params), walk.param_names, strict=True))
    return [_param_groups(_raw(opt), names) for opt in trainer.optimizers]


def module_generators(walk: Walk, structure: Structure | None = None) -> dict[str, torch.Tensor]:
    """The states of the module's own ``torch.Generator`` objects, by path (see :func:`_module_generators`);
    ``structure``: the walk's keeper, which looks again only at the modules that changed."""
    generators = structure.generators(walk.modules) if structure is not None else _module_generators(None, walk.modules)
    return {path: gen.get_state() for path, gen in generators.items()}


def _named_parameters(modules: list[tuple[str, Any]]) -> tuple[list[str], list[Any]]:
    """``named_parameters()`` of the module whose ``named_modules()`` are ``modules``, as (names, parameters): the same
    order and the same de-duplication, by identity (``named_parameters`` hashes each parameter through Python)."""
    seen: set[int] = set()
    names: list[str] = []
    params: list[Any] = []
    for prefix, module in modules:
        for key, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            names.append(f"{prefix}.{key}" if prefix else key)
            params.append(p)
    return names, params


def _module_generators(pl_module: Any, modules: list[tuple[str, Any]] | None = None) -> dict[str, torch.Generator]:
    """The ``torch.Generator`` objects the module and its submodules hold as attributes, by ``module.attribute``
    path (a random masking or noise drawn from a generator of the model's own, not the global RNG). ``modules``:
    ``pl_module.named_modules()``, if the caller has it."""
    # (on the training thread at every snapshot: one C-level pass over every module's attributes; the modules are
    # looked at one by one only when some attribute is a generator)
    named = modules if modules is not None else list(pl_module.named_modules())
    out: dict[str, torch.Generator] = {}
    if _GEN not in map(type, chain.from_iterable(map(dict.values, map(_DICT, map(_SECOND, named))))):
        return out
    for name, module in named:
        d = module.__dict__
        for attr in _generator_attrs(d):
            out[f"{name}.{attr}" if name else attr] = d[attr]
    return out


def _generator_attrs(d: dict[str, Any]) -> tuple[str, ...]:
    """The keys of the ``torch.Generator`` values of a module's ``__dict__``."""
    if _GEN not in map(type, d.values()):
        return ()
    return tuple(k for k, v in d.items() if type(v) is _GEN)


_GEN = torch.Generator
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def trainable_flags(walk: Walk) -> dict[str, bool]:
    """``requires_grad`` of every parameter, by name."""
    return dict(zip(walk.param_names, map(_REQUIRES_GRAD, walk.params), strict=True))


def running_stats_tracking(walk: Walk) -> dict[str, bool]:
    """``track_running_stats`` of every BatchNorm layer, by name."""
    return {n: bool(m.track_running_stats) for n, m in walk.batchnorms}


def restore_generators(pl_module: Any, saved: dict[str, Any] | None) -> None:
    """Put the states of the module's own ``torch.Generator`` objects back (see :func:`_module_generators`); one
    that the snapshot holds and the module no longer has, or a state that does not fit, is named in a warning."""
    states = saved.get("generators") if isinstance(saved, dict) else None
    if not isinstance(states, dict) or not states:
        return
    live = _module_generators(pl_module)
    problems = []
    for path, state in states.items():
        gen = live.get(path)
        if gen is None:
            problems.append(f"{path!r} is not a torch.Generator of the model now")
            continue
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
            problems.append(f"{path!r}: the saved state is not a generator state")
            continue
        try:
            gen.set_state(state)
        except (RuntimeError, TypeError, ValueError) as e:  # (another device or generator kind)
            problems.append(f"{path!r}: {e}")
    if problems:
        warnings.warn(
            "lightning-snapshot: the model's own random generators were not all restored, so what they draw will"
            f" differ from the interrupted run: {'; '.join(problems)}",
            stacklevel=2,
        )


def stop_limits(trainer: Any) -> dict[str, Any]:
    """The limits a fit runs under (``max_steps``, ``max_epochs``, a ``Timer``'s duration in seconds)."""
    timers = [cb for cb in trainer.callbacks if type(cb).__name__ == "Timer"]
    duration = getattr(timers[0], "_duration", None) if timers else None  # private: Timer's max_time, seconds
    return {
        "max_steps": int(trainer.max_steps),
        "max_epochs": None if trainer.max_epochs is None else int(trainer.max_epochs),
        "max_time": float(duration) if isinstance(duration, (int, float)) else None,
    }


def restore_stop(trainer: Any, saved: dict[str, Any] | None, step: int) -> bool:
    """A snapshot taken after something asked training to stop (``trainer.should_stop``: ``EarlyStopping``, a
    ``Timer``, a callback) stops the resumed fit there too, as in the run that never stopped, when it runs under the
    same limits; a fit given more (``max_steps``, ``max_epochs``, ``max_time``) trains on, as Lightning's own resume
    does. Returns whether it stops."""
    stopped = saved.get("stopped") if isinstance(saved, dict) else None
    if not isinstance(stopped, dict) or stopped != stop_limits(trainer):
        return False
    trainer.should_stop = True
    rank_zero_info(
        f"lightning-snapshot: the snapshot of step {step} was taken after training was asked to stop"
        " (trainer.should_stop: EarlyStopping, a Timer or a callback), so this fit stops there too; give it a larger"
        " max_steps, max_epochs or max_time to train on"
    )
    return True


def train_dl_epoch(trainer: Any) -> int | None:
    """The epoch at which Lightning last made the train loaders (``train_dataloader()`` saw it as
    ``trainer.current_epoch``; ``reload_dataloaders_every_n_epochs`` counts from it), or None before that."""
    epoch = getattr(trainer.fit_loop, "_last_train_dl_reload_epoch", None)  # private: float("-inf") before
    return int(epoch) if isinstance(epoch, (int, float)) and math.isfinite(epoch) else None


def reused_grads(trainer: Any, pl_module: Any) -> dict[str, torch.Tensor]:
    """The gradients the next epoch's optimizer step reuses without computing new ones: before the BatchNorm-update
    epoch of ``StochasticWeightAveraging`` (its private ``_model_contains_batch_norm`` and ``_max_epochs``, set in
    its ``on_fit_start``); {} otherwise."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    epoch = trainer.current_epoch
    if not any(
        isinstance(cb, StochasticWeightAveraging)
        and getattr(cb, "_model_contains_batch_norm", False)
        and getattr(cb, "_max_epochs", -1) != -1
        and epoch == cb.swa_end + 1
        for cb in trainer.callbacks
    ):
        return {}
    return {n: p.grad for n, p in pl_module.named_parameters() if p.grad is not None}


def _param_groups(opt: Any, names: dict[int, str]) -> list[dict[str, Any]]:
    """The optimizer's groups: hyperparameters and the names of their parameters, in the optimizer's order."""
    return [
        {
            "hyper": {k: v for k, v in g.items() if k not in ("params", "param_names")},
            "names": list(map(names.get, map(id, g["params"]), itertools.repeat(""))),
        }
        for g in opt.param_groups
    ]


def saved_state(ckpt: Any) -> dict[str, Any]:
    """What the fit-state parts stored in a restored snapshot (``ckpt["lightning_snapshot"]["fit_state"]``); {} in
    snapshots of older versions."""
    own = ckpt.get("lightning_snapshot") if isinstance(ckpt, dict) else None
    state = own.get("fit_state") if isinstance(own, dict) else None
    return state if isinstance(state, dict) else {}


def merge_param_groups(ckpt: dict[str, Any], where: str) -> None:
    """Replace the parameter groups of the snapshot's (early) optimizer states with those taken late, in place.

    The early state keys its parameters by position (DDP, single device) or by name (sharded strategies), in group
    order; a callback adds groups at the end (``BaseFinetuning``). A late parameter at a position the early state
    has takes the early key; one beyond takes its position (or, for name-keyed state, its name). Snapshots without
    late groups (older versions) are left as they are.
    """
    late = saved_state(ckpt).get("param_groups")
    states = ckpt.get("optimizer_states")
    if not isinstance(late, list) or not isinstance(states, list) or len(late) != len(states):
        return  # (the optimizer check reports a different count)
    for i, (state, groups) in enumerate(zip(states, late, strict=True)):
        early = state.get("param_groups") if isinstance(state, dict) else None
        if not isinstance(early, list) or not isinstance(groups, list):
            continue
        keys = [k for g in early if isinstance(g, dict) for k in g.get("params", [])]
        by_index = all(isinstance(k, int) for k in keys)
        position = 0
        merged = []
        for g in groups:
            if not isinstance(g, dict) or not isinstance(g.get("hyper"), dict) or not isinstance(g.get("names"), list):
                raise StateMismatchError(f"{where}: the parameter groups of optimizer {i} are malformed")
            params = []
            for name in g["names"]:
                params.append(keys[position] if position < len(keys) else (position if by_index else name))
                position += 1
            merged.append({**g["hyper"], "params": params})
        state["param_groups"] = merged


def restore_trainable(pl_module: Any, saved: dict[str, Any] | None) -> None:
    """Set ``requires_grad`` of the parameters and ``track_running_stats`` of the BatchNorm layers as captured."""
    if not isinstance(saved, dict):
        return
    trainable = saved.get("trainable")
    if isinstance(trainable, dict):
        for name, param in pl_module.named_parameters():
            if name in trainable and param.requires_grad != bool(trainable[name]):
                param.requires_grad_(bool(trainable[name]))
    tracking = saved.get("track_running_stats")
    if isinstance(tracking, dict):
        for name, module in pl_module.named_modules():
            if name in tracking and isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.track_running_stats = bool(tracking[name])


def realias_lottery_tickets(trainer: Any, epoch: int) -> int:
    """After a restore into a model that ``ModelPruning`` had pruned (see
    :func:`~lightning_snapshot.restore.targets.adopt_pruning`): give its lottery-ticket copies the aliasing the
    interrupted run had; returns how many tensors were aliased.

    ``ModelPruning.apply_lottery_ticket_hypothesis`` (run after each pruning, unless ``resample_parameters``) resets a
    pruned parameter by assigning it the *storage* of the copy of the layer it took in ``setup``
    (``param.data = copy.data``). From then on the copy and the parameter share their storage: training changes both,
    and a later reset is a no-op. A restored run holds a fresh copy instead, and its next reset would rewind the
    weights. Once a reset has happened before the snapshot's epoch, the copy is made to share the restored
    parameter's storage again. (Private attributes of ``ModelPruning``, Lightning 2.6: ``_original_layers``,
    ``_parameters_to_prune``, ``_use_lottery_ticket_hypothesis``, ``_resample_parameters``, ``_apply_pruning``.)
    """
    from lightning.pytorch.callbacks import ModelPruning

    aliased = 0
    for cb in trainer.callbacks:
        layers = getattr(cb, "_original_layers", None)
        if not isinstance(cb, ModelPruning) or not layers or getattr(cb, "_resample_parameters", False):
            continue

        def pruned_at(e: int, cb: Any = cb) -> bool:
            prune = cb._apply_pruning(e) if callable(cb._apply_pruning) else cb._apply_pruning
            amount = cb.amount(e) if callable(cb.amount) else cb.amount
            lth = cb._use_lottery_ticket_hypothesis
            return bool(prune and amount and (lth(e) if callable(lth) else lth))

        if not any(pruned_at(e) for e in range(epoch)):
            continue
        for layer in layers.values():
            for i, name in layer["names"]:
                module, _ = cb._parameters_to_prune[i]
                live = getattr(module, f"{name}_orig", None)
                copy = getattr(layer["data"], name, None)
                if isinstance(live, torch.Tensor) and isinstance(copy, torch.Tensor) and live.shape == copy.shape:
                    copy.data = live.data
                    aliased += 1
    return aliased


def restore_grads(pl_module: Any, saved: dict[str, Any] | None) -> None:
    """Set the gradients a snapshot holds (see the module docstring) on the parameters of the same name."""
    grads = saved.get("grads") if isinstance(saved, dict) else None
    if not isinstance(grads, dict) or not grads:
        return
    for name, param in pl_module.named_parameters():
        grad = grads.get(name)
        if isinstance(grad, torch.Tensor):
            param.grad = grad.to(device=param.device, dtype=param.dtype).reshape(param.shape)
