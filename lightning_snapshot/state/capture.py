"""Trainer <-> training state: walk the trainer into tensor fragments and plain state, and put them back on restore.

Called by the callback's snapshot pipeline (pipeline.py) at each snapshot step and by the Restorer (restore.py) when
it applies a snapshot; the callback (placement checks), fit_loaders.py and data/workers.py (``restore_rng``) use its
helpers.

Together the pieces have the shape of a Lightning checkpoint (``state_dict``, ``optimizer_states``,
``lr_schedulers``, ``loops``, ``callbacks``, precision and datamodule state), so a snapshot can be exported and
inspected like one.

A snapshot of step N holds the state as it is when training step N+1 begins: everything is taken right before the
next batch is fetched (or when the training loop ends), after step N's validation, the callbacks reacting to it,
epoch-end hooks and scheduler steps. Weights and optimizer state (:func:`capture_shared`) do not change before the
next ``optimizer.step``, so they are copied in the background while the next step runs; loops, callbacks,
schedulers, logged metrics (:func:`capture_late`), RNG and data position are stored per rank, because Lightning's
checkpoints keep rank 0's only.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Callable, Iterable
from typing import Any

import lightning
import torch

from lightning_snapshot.errors import CaptureError, ConfigError, StateMismatchError
from lightning_snapshot.staging import dtensor_box, is_dtensor, local_tensor
from lightning_snapshot.staging.live import Encoded, LiveCapture
from lightning_snapshot.state import compat as _compat

__all__ = [
    "capture_late",
    "capture_shared",
    "capture_shared_live",
    "check_model",
    "check_placements",
    "checkpoint_view",
    "frozen_predicate",
    "is_sharded",
    "loop_state_dict",
    "optimized_key",
    "raw_optimizer",
]


def is_sharded(strategy: Any) -> bool:
    """Whether ``strategy`` holds model and optimizer state as DTensors (``ModelParallelStrategy``: FSDP2/TP)."""
    try:
        from lightning.pytorch.strategies import ModelParallelStrategy
    except ImportError:  # pragma: no cover - lightning without it
        return False
    return isinstance(strategy, ModelParallelStrategy)


def check_placements(pl_module: Any) -> None:
    """Fail at the start of fit, not at the first snapshot, when a sharded layout cannot be stored as boxes."""
    for name, param in pl_module.named_parameters():
        if is_dtensor(param):
            try:
                dtensor_box(param, name)
            except CaptureError as e:
                raise ConfigError(f"SnapshotCallback cannot snapshot this model's sharding: {e}") from None


def raw_optimizer(opt: Any) -> Any:
    return getattr(opt, "_optimizer", opt)  # a LightningOptimizer wraps the torch optimizer


def _sharded_state_dicts(trainer: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Model and optimizer state of a sharded strategy, as each rank's DTensor shards: no gather, no copy (the
    values are the live parameters and optimizer state), optimizer state keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=False, cpu_offload=False)
    model = trainer.strategy.model
    return (
        get_model_state_dict(model, options=options),
        [get_optimizer_state_dict(model, raw_optimizer(opt), options=options) for opt in trainer.optimizers],
    )


def capture_shared(trainer: Any, pl_module: Any, parts: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint-shaped tensor state of a step: model and optimizer, and ``parts`` (the tensor parts' tree,
    :meth:`~lightning_snapshot.state.parts.Registry.capture_tensors`: its keys are added as they are). Tensors are
    live views: stage them before training goes on.

    Taken right before the next batch is fetched (parameters and optimizer state do not change until the next
    ``optimizer.step``), with the rest of the state (:func:`capture_late`).

    Under a sharded strategy (``ModelParallelStrategy``) the model and optimizer state are this rank's DTensor
    shards, never gathered (whatever the strategy's ``save_distributed_checkpoint`` says), and the optimizer state
    is keyed by parameter name (``torch.distributed.checkpoint.state_dict``'s layout) rather than by index.
    """
    if is_sharded(trainer.strategy):
        state_dict, optimizer_states = _sharded_state_dicts(trainer)
    else:
        state_dict = trainer.strategy.lightning_module_state_dict()
        optimizer_states = [trainer.strategy.optimizer_state(opt) for opt in trainer.optimizers]
    ckpt: dict[str, Any] = {
        "global_step": trainer.global_step,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": state_dict,
        "optimizer_states": optimizer_states,
    }
    if parts:
        ckpt.update(parts)
    return ckpt


def _plain_state_dicts(trainer: Any) -> bool:
    """Whether the strategy's model and optimizer state dicts are the module's and the optimizers' own
    (single device, DDP): then a capture plan (:class:`~lightning_snapshot.staging.live.LiveCapture`) may stand
    for them."""
    from lightning.pytorch.strategies import Strategy

    cls = type(trainer.strategy)
    return (
        not is_sharded(trainer.strategy)
        and cls.lightning_module_state_dict is Strategy.lightning_module_state_dict
        and cls.optimizer_state is Strategy.optimizer_state
        and not any(hasattr(raw_optimizer(o), "consolidate_state_dict") for o in trainer.optimizers)
    )


def capture_shared_live(
    trainer: Any, pl_module: Any, live: LiveCapture, parts: dict[str, Any] | None = None
) -> Encoded | dict[str, Any]:
    """:func:`capture_shared`, through the capture plan ``live`` where the strategy allows (then, while the plan
    holds, already encoded, at a cost nearly constant in the number of tensors; the tensor parts' tree ``parts`` is
    encoded and added, :meth:`~lightning_snapshot.staging.live.LiveCapture.extend`); the same state either way."""
    if not _plain_state_dicts(trainer):
        live.clear()
        return capture_shared(trainer, pl_module, parts)
    head = {"global_step": trainer.global_step, "pytorch-lightning_version": lightning.__version__}
    optimizers = [raw_optimizer(opt) for opt in trainer.optimizers]
    core = live.capture(head, trainer.strategy.lightning_module, optimizers, lambda: capture_shared(trainer, pl_module))
    if not parts:
        return core
    if not isinstance(core, Encoded):
        core.update(parts)
        return core
    return live.extend(core, parts)


def _overrides_on_save_checkpoint(callbacks: list[Any], pl_module: Any) -> bool:
    """Whether any of ``callbacks`` or the ``LightningModule`` has an ``on_save_checkpoint`` of its own (Lightning's are
    no-ops): only then is the checkpoint dict for the hooks, with the model's ``state_dict``, worth making."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.core.hooks import CheckpointHooks

    if "on_save_checkpoint" in vars(pl_module) or (
        getattr(type(pl_module), "on_save_checkpoint", None) is not CheckpointHooks.on_save_checkpoint
    ):
        return True
    return any(
        "on_save_checkpoint" in vars(cb) or type(cb).on_save_checkpoint is not Callback.on_save_checkpoint
        for cb in callbacks
    )


def capture_late(
    trainer: Any,
    pl_module: Any,
    loader_states: list[Any] | None = None,
    parts: Callable[[dict[str, Any]], None] | None = None,
    replaced: Callable[[Any], bool] | None = None,
) -> dict[str, Any]:
    """The rest of the training state, as it is right before the next training step begins: after the previous
    step's validation, the callbacks that reacted to it, epoch-end hooks and scheduler steps.

    ``loader_states``: the states of Lightning-restored (stateful) train loaders to record instead of their current
    ones (a loader without a length is fetched one batch ahead; the callback passes the state before that batch).
    ``parts``: captures the shared state parts into the late state (the callbacks' states, the fit state: see
    :mod:`lightning_snapshot.state.builtin`), before the ``on_save_checkpoint`` hooks. ``replaced(callback)``: a tensor
    part stands for that callback's ``on_save_checkpoint`` (its tensors take the weights' path: see
    :class:`~lightning_snapshot.state.parts.Part`), which is then not called.

    The ``on_save_checkpoint`` hooks are called here as Lightning's ``dump_checkpoint`` calls them (every callback's,
    then the ``LightningModule``'s), on a checkpoint dict that also holds the model's ``state_dict``; what they add is
    kept (copied by the caller, on the training thread). A ``state_dict`` a callback put in its place
    (``EMAWeightAveraging`` puts the averaged weights there and moves the model's own to ``current_model_state``) is
    kept under ``lightning_snapshot/checkpoint_state_dict``; the model's own weights stay the snapshot's
    ``state_dict``, and keys that hold the model's own ``state_dict`` object are recorded by name
    (``lightning_snapshot/state_dict_aliases``) instead of copying the weights twice. :func:`restore_shared` gives
    the hooks' ``on_load_checkpoint`` the same view back.
    """
    loops = loop_state_dict(trainer.fit_loop)
    if loader_states is not None and isinstance(loops.get("state_dict"), dict):
        loops["state_dict"] = {**loops["state_dict"], "combined_loader": loader_states}
    late: dict[str, Any] = {
        "epoch": trainer.current_epoch,
        "loops": {"fit_loop": loops},
        "callbacks": {},
        "lr_schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
        # what ReduceLROnPlateau, EarlyStopping and ModelCheckpoint read between validations
        "callback_metrics": {k: v for k, v in trainer.callback_metrics.items() if isinstance(v, torch.Tensor)},
        # the optimizer and scheduler classes and layout, checked before a restore applies anything
        "lightning_snapshot": {
            "optimizers": _compat.describe(trainer),
            # parameter groups, trainable flags, accumulation, epoch metrics, checkpoint files (state parts)
            "fit_state": {},
        },
    }
    if parts is not None:
        parts(late)
    precision = trainer.precision_plugin.state_dict()
    if precision:
        late[type(trainer.precision_plugin).__qualname__] = precision
    datamodule = trainer.datamodule
    if datamodule is not None:
        dm_state = datamodule.state_dict()
        if dm_state:
            late[type(datamodule).__qualname__] = dm_state
    hooked = [cb for cb in trainer.callbacks if replaced is None or not replaced(cb)]
    if not _overrides_on_save_checkpoint(hooked, pl_module):
        return late
    state_dict = trainer.strategy.lightning_module_state_dict() if not is_sharded(trainer.strategy) else {}
    ckpt = {
        **late,
        "global_step": trainer.global_step,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": state_dict,
    }
    for cb in hooked:
        cb.on_save_checkpoint(trainer, pl_module, ckpt)
    pl_module.on_save_checkpoint(ckpt)
    own = late["lightning_snapshot"]
    if ckpt.get("state_dict") is not state_dict:
        own["checkpoint_state_dict"] = ckpt["state_dict"]
    aliases = sorted(k for k, v in ckpt.items() if v is state_dict and k != "state_dict")
    if aliases:
        own["state_dict_aliases"] = aliases
    skip = {"global_step", "pytorch-lightning_version", "state_dict", *aliases}
    late.update({k: v for k, v in ckpt.items() if k not in skip})
    return late


#: Values ``dataclasses.asdict`` keeps as they are (``copy.deepcopy`` returns them unchanged).
_ATOMS = frozenset({int, float, bool, str, type(None)})
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def loop_state_dict(loop: Any) -> dict[str, Any]:
    """``loop.state_dict()``: the same dict, made without ``dataclasses.asdict`` where Lightning's own methods would
    make it (``_Loop.state_dict`` and ``_BaseProgress.state_dict``, not overridden).

    Lightning's progress counters are dataclasses of integers, and ``asdict`` deep-copies each through generic
    machinery: 0.15-0.2 ms for the fit loop's 40 counters inside a fit, at every snapshot, on the training thread.
    Here a progress whose fields are plain numbers, strings, None or such dataclasses in turn is read field by field
    (what ``asdict`` would return: those values are immutable); anything else goes to ``asdict`` as before."""
    from lightning.pytorch.loops.loop import _Loop  # noqa: PLC2701

    if type(loop).state_dict is not _Loop.state_dict:
        out: dict[str, Any] = loop.state_dict()  # (called as Lightning's checkpoint calls the fit loop's)
        return out
    return _loop_state(loop, {}, "")


def _loop_state(loop: Any, destination: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``_Loop.state_dict(loop, destination, prefix)``, with :func:`_progress_state` for its progress; a child loop
    that overrides ``state_dict`` is called as ``_Loop.state_dict`` calls it."""
    from lightning.pytorch.loops.loop import _Loop  # noqa: PLC2701
    from lightning.pytorch.loops.progress import _BaseProgress  # noqa: PLC2701

    destination[prefix + "state_dict"] = loop.on_save_checkpoint()
    for k, v in loop.__dict__.items():
        key = prefix + k
        if isinstance(v, _BaseProgress):
            destination[key] = _progress_state(v) if type(v).state_dict is _BaseProgress.state_dict else v.state_dict()
        elif isinstance(v, _Loop):
            if type(v).state_dict is _Loop.state_dict:
                _loop_state(v, destination, key + ".")
            else:
                v.state_dict(destination, key + ".")
    return destination


def _progress_state(progress: Any) -> dict[str, Any]:
    """``dataclasses.asdict(progress)``: field by field while every value is immutable or such a dataclass."""
    out = _fields_state(progress)
    return out if out is not None else dataclasses.asdict(progress)


def _fields_state(obj: Any) -> dict[str, Any] | None:
    cls = type(obj)
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(obj))
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(obj, name)
        if type(value) in _ATOMS:
            out[name] = value
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            nested = _fields_state(value)
            if nested is None:
                return None
            out[name] = nested
        else:
            return None
    return out


def checkpoint_view(ckpt: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint dict the ``on_save_checkpoint`` hooks left (see :func:`capture_late`), for their
    ``on_load_checkpoint``: the keys that held the model's ``state_dict`` hold the restored one again, and
    ``state_dict`` is the one a callback put in its place, if any."""
    own = ckpt.get("lightning_snapshot")
    own = own if isinstance(own, dict) else {}
    view = dict(ckpt)
    aliases = own.get("state_dict_aliases")
    for key in aliases if isinstance(aliases, list) else []:
        if isinstance(key, str):
            view[key] = ckpt.get("state_dict")
    replaced = own.get("checkpoint_state_dict")
    if isinstance(replaced, dict):
        view["state_dict"] = replaced
    return view


def optimized_key(optimizers: Iterable[Any]) -> tuple[Any, ...]:
    """What :func:`frozen_predicate` depends on: each optimizer's parameters, and which of them require a gradient,
    as two tuples (the parameters' ids, their ``requires_grad``). Cheap (no data is read, two C-level passes); a
    staging plan made under another key is not reused."""
    params = list(itertools.chain.from_iterable(g["params"] for opt in optimizers for g in opt.param_groups))
    return tuple(map(id, params)), tuple(map(_REQUIRES_GRAD, params))


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def frozen_predicate(optimizers: Iterable[Any], stable: Iterable[Any] = ()) -> Callable[[torch.Tensor], bool]:
    """Which tensors stay unchanged until the next ``optimizer.step``: the parameters an optimizer trains (in one of
    its parameter groups, requiring a gradient), the optimizers' state, and ``stable`` (the tensor parts' tensors
    that declare so: :class:`~lightning_snapshot.state.parts.Part`). They are copied while the next forward and
    backward run.

    Everything else must be copied at once: buffers (BatchNorm statistics) change in the next forward, and
    parameters that no optimizer trains (an EMA teacher, a frozen backbone) are the ones user code changes in place
    during a step (``teacher.mul_(m).add_(student)``, also through ``.data``, which no version counter sees).
    """
    storages: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            storages.update(
                local_tensor(p).untyped_storage().data_ptr() for p in group["params"] if p.requires_grad and p.numel()
            )
        for state in opt.state.values():
            storages.update(
                local_tensor(v).untyped_storage().data_ptr()
                for v in state.values()
                if isinstance(v, torch.Tensor) and v.numel()
            )
    storages.update(local_tensor(t).untyped_storage().data_ptr() for t in stable if t.numel())

    def frozen(t: torch.Tensor) -> bool:
        t = local_tensor(t)  # a DTensor's storage is its local shard's
        return t.numel() > 0 and t.untyped_storage().data_ptr() in storages

    return frozen


def _shapes(sd: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in sd.items() if isinstance(v, torch.Tensor)}


def check_model(pl_module: Any, state_dict: Any, where: str) -> None:
    """Raise :class:`StateMismatchError` listing missing, unexpected and shape-mismatched keys, if any."""
    if not isinstance(state_dict, dict):
        raise StateMismatchError(f"{where} holds no model state_dict")
    want = _shapes(pl_module.state_dict())
    have = _shapes(state_dict)
    missing = sorted(want.keys() - have.keys())
    unexpected = sorted(have.keys() - want.keys())
    mismatched = sorted(k for k in want.keys() & have.keys() if want[k] != have[k])
    if not (missing or unexpected or mismatched):
        return

    def show(keys: list[str], fmt: Any = str) -> str:
        return ", ".join(fmt(k) for k in keys[:10]) + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")

    parts = []
    if missing:
        parts.append(f"missing keys (in the model, not in the snapshot): {show(missing)}")
    if unexpected:
        parts.append(f"unexpected keys (in the snapshot, not in the model): {show(unexpected)}")
    if mismatched:
        parts.append("shape mismatches: " + show(mismatched, lambda k: f"{k} snapshot {have[k]} vs model {want[k]}"))
    raise StateMismatchError(
        f"{where} was taken from a different model: "
        + "; ".join(parts)
        + ". Point the callback at this model's snapshot directory, or pass resume=False to start fresh"
    )
