"""What callbacks hold of a fit that Lightning's checkpoints leave out, captured and put back by the registered parts
(:mod:`~lightning_snapshot.state.builtin`): ModelCheckpoint's files and its record of its last save (pruned to the
restored step), and the callbacks' own states loaded before the others' hooks run.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

#: ModelCheckpoint's private record of its last save (Lightning 2.6): attribute -> type
_SAVE_RECORD = {"_last_global_step_saved": int, "_last_checkpoint_saved": str, "_defer_save_until_validation": bool}

__all__ = [
    "checkpoint_files",
    "checkpoint_saves",
    "load_callback_states",
    "prune_checkpoints",
    "restore_checkpoint_saves",
]


def _model_checkpoints(trainer: Any) -> list[Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]


def _local_dir(cb: Any) -> str | None:
    dirpath = getattr(cb, "dirpath", None)
    if not dirpath or "://" in str(dirpath):
        return None  # remote checkpoint directories are left alone
    return str(dirpath)


def checkpoint_files(trainer: Any) -> dict[str, list[str]]:
    """Per ModelCheckpoint (by state key): the checkpoint files in its local directory now (global rank 0 only,
    which is the rank that writes them)."""
    if getattr(trainer, "global_rank", 0) != 0:
        return {}
    out: dict[str, list[str]] = {}
    for cb in _model_checkpoints(trainer):
        dirpath = _local_dir(cb)
        if dirpath is None:
            continue
        try:
            out[cb.state_key] = sorted(f for f in os.listdir(dirpath) if f.endswith(cb.FILE_EXTENSION))
        except FileNotFoundError:
            out[cb.state_key] = []
    return out


def checkpoint_saves(trainer: Any) -> dict[str, dict[str, Any]]:
    """Per ModelCheckpoint (by state key): its record of its last save (the attributes of ``_SAVE_RECORD`` it has)
    and its directory."""
    return {
        cb.state_key: {
            "dirpath": str(cb.dirpath),
            **{k: kind(getattr(cb, k)) for k, kind in _SAVE_RECORD.items() if hasattr(cb, k)},
        }
        for cb in _model_checkpoints(trainer)
    }


# ------------------------------------------------------------------------------------------------- restore


def prune_checkpoints(trainer: Any, saved: dict[str, Any] | None, step: int) -> list[str]:
    """Delete the checkpoint files each ModelCheckpoint's local directory gained after the snapshot was taken (the
    interrupted run wrote them after step ``step``; the resumed run writes them again), unless the restored
    ModelCheckpoint state names them. Global rank 0 only. Returns the paths removed."""
    files = saved.get("checkpoint_files") if isinstance(saved, dict) else None
    if not isinstance(files, dict) or getattr(trainer, "global_rank", 0) != 0:
        return []
    removed: list[str] = []
    for cb in _model_checkpoints(trainer):
        before = files.get(cb.state_key)
        dirpath = _local_dir(cb)
        if not isinstance(before, list) or dirpath is None or not os.path.isdir(dirpath):
            continue
        known = {os.path.basename(str(p)) for p in (*cb.best_k_models, cb.last_model_path, cb.best_model_path) if p}
        for name in sorted(os.listdir(dirpath)):
            if name.endswith(cb.FILE_EXTENSION) and name not in before and name not in known:
                path = os.path.join(dirpath, name)
                if os.path.isfile(path):
                    os.remove(path)
                    removed.append(path)
    if removed:
        log.info(
            "lightning-snapshot: removed %d checkpoint file(s) the interrupted run wrote after step %d (the"
            " resumed run writes them again): %s",
            len(removed),
            step,
            ", ".join(removed),
        )
    return removed


def restore_checkpoint_saves(trainer: Any, saved: dict[str, Any] | None) -> None:
    """Give every ModelCheckpoint back its record of its last save (:func:`checkpoint_saves`), where the snapshot
    holds one for its state key and the same directory (as ``ModelCheckpoint.load_state_dict`` reloads its state only
    then); a snapshot of an older version holds none (nothing changes)."""
    records = (saved or {}).get("checkpoint_saves")
    if not isinstance(records, dict):
        return
    for cb in _model_checkpoints(trainer):
        record = records.get(cb.state_key)
        if not isinstance(record, dict) or record.get("dirpath") != str(cb.dirpath):
            continue
        for attr, kind in _SAVE_RECORD.items():
            value = record.get(attr)
            if hasattr(cb, attr) and type(value) is kind:
                setattr(cb, attr, value)


def load_callback_states(trainer: Any, states: Any, exclude: Any = None) -> int:
    """Load each callback's saved state (by state key), as Lightning's restore does; returns how many were loaded.

    Also what a built-in callback's ``state_dict`` holds and its ``load_state_dict`` leaves out:
    ``ModelCheckpoint.current_score`` (the score of the newest checkpoint it saved, which it changes only when it
    saves one again), so that the resumed callback's ``state_dict`` equals the uninterrupted one's.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    if not isinstance(states, dict):
        return 0
    loaded = 0
    for cb in trainer.callbacks:
        if cb is exclude:
            continue
        state = states.get(cb.state_key)
        if state:
            cb.load_state_dict(state)
            loaded += 1
            if isinstance(cb, ModelCheckpoint) and state.get("dirpath", cb.dirpath) == cb.dirpath:
                cb.current_score = state.get("current_score", cb.current_score)
    return loaded
