"""Trainer <-> training state, through Lightning's public API only.

The shared state has the shape of a Lightning checkpoint (``state_dict``, ``optimizer_states``, ``lr_schedulers``,
``loops``, ``callbacks``, precision and datamodule state), so it can be exported and inspected like one. Per-rank
state (RNG, data position) is kept apart because Lightning's checkpoints save rank 0's only.

Where the pieces are taken (measured, see DESIGN.md and the internals notes): weights, optimizer, schedulers and loop
counters at ``on_train_batch_end`` of step N, when they are frozen until the next ``optimizer.step``; RNG and data
position at ``on_train_batch_start`` of step N+1 (or at ``on_train_end``), the point that makes resume exact.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any

import lightning
import numpy as np
import torch

from lightning_snapshot.errors import StateMismatchError

__all__ = ["capture_shared", "restore_shared", "capture_rng", "restore_rng", "check_model", "frozen_predicate"]


def capture_shared(trainer: Any, pl_module: Any) -> dict[str, Any]:
    """The checkpoint-shaped shared state. Tensors are live views: stage them before training goes on."""
    ckpt: dict[str, Any] = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": trainer.strategy.lightning_module_state_dict(),
        "loops": {"fit_loop": trainer.fit_loop.state_dict()},
        "callbacks": {},
        "optimizer_states": [trainer.strategy.optimizer_state(opt) for opt in trainer.optimizers],
        "lr_schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
    }
    for cb in trainer.callbacks:
        state = cb.state_dict()
        if state:
            ckpt["callbacks"][cb.state_key] = state
    precision = trainer.precision_plugin.state_dict()
    if precision:
        ckpt[type(trainer.precision_plugin).__qualname__] = precision
    datamodule = trainer.datamodule
    if datamodule is not None:
        dm_state = datamodule.state_dict()
        if dm_state:
            ckpt[type(datamodule).__qualname__] = dm_state
    pl_module.on_save_checkpoint(ckpt)
    return ckpt


def frozen_predicate(parameters: Iterable[torch.Tensor], optimizers: Iterable[Any]) -> Callable[[torch.Tensor], bool]:
    """Which tensors stay unchanged until the next ``optimizer.step``: parameters and optimizer state.

    Everything else (buffers such as BatchNorm statistics) may change in the next forward and must be copied at once.
    """
    storages: set[int] = {p.untyped_storage().data_ptr() for p in parameters}
    for opt in optimizers:
        for state in opt.state.values():
            storages.update(v.untyped_storage().data_ptr() for v in state.values()
                            if isinstance(v, torch.Tensor) and v.numel())
    return lambda t: t.numel() > 0 and t.untyped_storage().data_ptr() in storages


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
        f"{where} was taken from a different model: " + "; ".join(parts)
        + ". Point the callback at this model's snapshot directory, or pass resume=False to start fresh"
    )


def restore_shared(trainer: Any, pl_module: Any, ckpt: dict[str, Any], where: str) -> None:
    """Load the shared state into a trainer whose strategy is set up (optimizers exist): at ``on_fit_start``."""
    check_model(pl_module, ckpt.get("state_dict"), where)
    optimizer_states = ckpt.get("optimizer_states", [])
    schedulers = ckpt.get("lr_schedulers", [])
    if len(optimizer_states) != len(trainer.optimizers) or len(schedulers) != len(trainer.lr_scheduler_configs):
        raise StateMismatchError(
            f"{where} has {len(optimizer_states)} optimizer(s) and {len(schedulers)} LR scheduler(s), but"
            f" configure_optimizers() returned {len(trainer.optimizers)} and {len(trainer.lr_scheduler_configs)}."
            " Restore into the same optimizer setup, or pass resume=False"
        )
    pl_module.on_load_checkpoint(ckpt)
    trainer.strategy.load_model_state_dict(ckpt, strict=True)
    datamodule = trainer.datamodule
    if datamodule is not None and type(datamodule).__qualname__ in ckpt:
        datamodule.load_state_dict(ckpt[type(datamodule).__qualname__])
    callback_states = ckpt.get("callbacks", {})
    for cb in trainer.callbacks:
        state = callback_states.get(cb.state_key)
        if state:
            cb.load_state_dict(state)
    precision_key = type(trainer.precision_plugin).__qualname__
    if precision_key in ckpt:
        trainer.precision_plugin.load_state_dict(ckpt[precision_key])
    trainer.fit_loop.load_state_dict(ckpt["loops"]["fit_loop"])
    try:
        trainer.strategy.load_optimizer_state_dict(ckpt)
    except (ValueError, KeyError) as e:
        raise StateMismatchError(f"{where}: the optimizer state does not fit this optimizer: {e}") from e
    for cfg, state in zip(trainer.lr_scheduler_configs, schedulers):
        cfg.scheduler.load_state_dict(state)


def capture_rng() -> dict[str, Any]:
    """This rank's RNG states: python, numpy, torch CPU and, once CUDA is initialized, every CUDA device."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set this rank's RNG states from :func:`capture_rng` output."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:  # a different number of GPUs on this node: seed what we can, device by device
            for i, s in enumerate(cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)
