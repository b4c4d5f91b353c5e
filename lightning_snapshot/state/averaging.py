"""Lightning's ``WeightAveraging`` callbacks (``EMAWeightAveraging`` among them) as state parts: the averaged model's
parameters and ``n_averaged`` are a tensor part (they take the weights' path: see
:class:`~lightning_snapshot.state.parts.Part`, ``tensors=True``), its buffers a small per-rank part; the callback's
plain state (``latest_update_step``) stays with the callbacks' states.

What Lightning's own checkpoint does with such a callback, and what this part does instead:

* ``WeightAveraging.on_save_checkpoint`` puts ``AveragedModel.state_dict()`` into the checkpoint (the averaged weights
  as ``state_dict``, the model's own as ``current_model_state``, ``n_averaged`` as ``averaging_state``). Done at
  every snapshot, that is a copy of the averaged weights on the training thread, once per rank. Here the callback's
  ``on_save_checkpoint`` is not called: :func:`capture` hands the live tensors of its ``AveragedModel`` to the stager
  with the model's (the parameters copied in the background, :func:`stable`).
* ``WeightAveraging.on_load_checkpoint`` loads that state with ``AveragedModel.load_state_dict`` and the model's own
  weights with ``load_state_dict``. Here the loader reads the averaged state straight into the live
  ``AveragedModel`` (:func:`capture` gives the targets), :func:`restore` applies it with the same
  ``load_state_dict``, and the model's own weights are the snapshot's ``state_dict``, restored with the rest; the
  callback's ``on_load_checkpoint`` is not called for a snapshot that holds this part's state for it (an older
  snapshot, taken through ``on_save_checkpoint``, is restored through it as before).

Only callbacks whose checkpoint hooks are Lightning's own (a subclass that overrides ``on_save_checkpoint`` or
``on_load_checkpoint`` keeps the hook path) and whose ``AveragedModel`` exists (made at ``setup`` of a fit) are
taken. Each is keyed by its ``state_key``. Between the end of one optimizer step and the next the averaged
parameters do not change (Lightning updates them in ``on_train_batch_end``, after the step, and at an epoch's end,
before the snapshot of that step is taken), and under DDP every rank holds the same ones (the average of the same
replicated parameters). The averaged buffers are an average of each rank's own buffers (DDP broadcasts the model's
from rank 0 at each forward, the averaged model's are never broadcast), so they differ across the ranks: they are
a per-rank part (:func:`capture_buffers`; small, BatchNorm statistics), each rank's own, rank 0's after a change of
the number of processes.
"""

from __future__ import annotations

from typing import Any

from lightning_snapshot.errors import StateMismatchError
from lightning_snapshot.state.parts import CaptureContext, RestoreContext

__all__ = ["averagers", "capture", "capture_buffers", "hooks", "restore", "restore_buffers", "stable"]


def _weight_averaging() -> Any:
    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:  # pragma: no cover - a Lightning before 2.6
        return None
    return WeightAveraging


def _taken(cb: Any, base: Any) -> bool:
    cls = type(cb)
    return (
        isinstance(cb, base)
        and cls.on_save_checkpoint is base.on_save_checkpoint
        and cls.on_load_checkpoint is base.on_load_checkpoint
        and "on_save_checkpoint" not in vars(cb)
        and "on_load_checkpoint" not in vars(cb)
        and getattr(cb, "_average_model", None) is not None
    )


def averagers(trainer: Any) -> list[Any]:
    """The trainer's ``WeightAveraging`` callbacks this part takes (see the module docstring), in order."""
    base = _weight_averaging()
    if base is None:
        return []
    return [cb for cb in trainer.callbacks if _taken(cb, base)]


def hooks(callback: Any) -> str | None:
    """The key of this part's state that stands for ``callback``'s checkpoint hooks, or None."""
    base = _weight_averaging()
    return str(callback.state_key) if base is not None and _taken(callback, base) else None


def _plain_module(m: Any) -> bool:
    """Whether ``m``'s ``state_dict`` is ``torch.nn.Module``'s own (no hooks, no extra state): then its entries are
    its ``_parameters`` and persistent ``_buffers``, read directly (:func:`_split`)."""
    from torch.nn import Module

    cls = type(m)
    return (
        cls.state_dict is Module.state_dict
        and cls._save_to_state_dict is Module._save_to_state_dict
        and getattr(cls, "get_extra_state", Module.get_extra_state) is Module.get_extra_state
        and not m._state_dict_hooks
        and not m._state_dict_pre_hooks
    )


def _split(cb: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The averaged model's live state (``AveragedModel.state_dict(keep_vars=True)``: the same names, order and
    tensor objects) as (its parameters and ``n_averaged``; its buffers). Read from the modules' own dicts where every
    module's ``state_dict`` is ``Module``'s (one walk, a fraction of ``state_dict``'s cost on the training thread);
    else through ``state_dict``."""
    model = cb._average_model
    modules = list(model.named_modules(remove_duplicate=False))
    if not all(_plain_module(m) for _, m in modules):
        state = model.state_dict(keep_vars=True)
        buffers = {f"module.{name}" for name, _ in model.module.named_buffers()}
        return (
            {k: v for k, v in state.items() if k not in buffers},
            {k: v for k, v in state.items() if k in buffers},
        )
    params: dict[str, Any] = {}
    bufs: dict[str, Any] = {}
    for prefix, m in modules:
        head = f"{prefix}." if prefix else ""
        for name, p in m._parameters.items():
            if p is not None:
                params[head + name] = p
        skip = m._non_persistent_buffers_set
        for name, b in m._buffers.items():
            if b is not None and name not in skip:
                # (the averaged module's buffers are each rank's own; the AveragedModel's own, n_averaged, is not)
                (bufs if prefix == "module" or prefix.startswith("module.") else params)[head + name] = b
    return params, bufs


def _splits(ctx: CaptureContext) -> list[tuple[Any, dict[str, Any], dict[str, Any]]]:
    """(callback, parameters and ``n_averaged``, buffers) of each callback taken, once per capture."""
    got = ctx.cache.get("weight_averaging")
    if got is None:
        got = ctx.cache["weight_averaging"] = [(cb, *_split(cb)) for cb in averagers(ctx.trainer)]
    return got


def capture(ctx: CaptureContext) -> dict[str, Any] | None:
    """(The tensor part) ``{state_key: {name: tensor}}``: each callback's averaged parameters and ``n_averaged``, the
    live tensors (the stager copies them); None when no callback is taken."""
    out = {str(cb.state_key): params for cb, params, _ in _splits(ctx)}
    return out or None


def capture_buffers(ctx: CaptureContext) -> dict[str, Any] | None:
    """(The per-rank part) ``{state_key: {name: tensor}}``: each callback's averaged buffers, this rank's own (an
    average of this rank's BatchNorm statistics, which DDP does not keep equal across the ranks); None when no
    callback is taken or none has buffers."""
    out = {str(cb.state_key): buffers for cb, _, buffers in _splits(ctx) if buffers}
    return out or None


def stable(ctx: CaptureContext) -> list[Any]:
    """The averaged parameters (not ``n_averaged``, copied at once): unchanged until the next optimizer step, and the
    same on every data-parallel rank."""
    return [t for _, params, _ in _splits(ctx) for k, t in params.items() if k.startswith("module.")]


def _load(ctx: RestoreContext, state: Any, part: int) -> None:
    """Load each callback's saved half ``part`` (0: parameters and ``n_averaged``, 1: buffers) of its averaged model
    as its ``on_load_checkpoint`` would: ``AveragedModel.load_state_dict``, strict (the other half as it is now)."""
    if not isinstance(state, dict):
        return
    for cb in averagers(ctx.trainer):
        key = str(cb.state_key)
        saved = state.get(key)
        if not isinstance(saved, dict):
            continue
        halves = _split(cb)
        want = halves[part]
        if set(saved) != set(want):
            missing = sorted(set(want) - set(saved))[:5]
            unexpected = sorted(set(saved) - set(want))[:5]
            raise StateMismatchError(
                f"{ctx.where}: the averaged model of the {key} callback does not fit this model (missing {missing},"
                f" unexpected {unexpected}). Resume with the same model and averaging callback, or pass resume=False"
                " to start fresh"
            )
        try:
            cb._average_model.load_state_dict({**halves[0], **halves[1], **saved})
        except (RuntimeError, KeyError, TypeError) as e:
            raise StateMismatchError(
                f"{ctx.where}: the averaged model of the {key} callback does not fit this model: {e}. Resume with the"
                " same model and averaging callback, or pass resume=False to start fresh"
            ) from e


def restore(ctx: RestoreContext, state: Any) -> None:
    """(The tensor part) Load the averaged parameters and ``n_averaged``. A callback the snapshot holds nothing for
    is left to its ``on_load_checkpoint`` (called with the late state, as before this part existed)."""
    _load(ctx, state, 0)


def restore_buffers(ctx: RestoreContext, state: Any) -> None:
    """(The per-rank part) Load this rank's averaged buffers (rank 0's after a change of the number of processes,
    as Lightning's checkpoint, written by rank 0, gives every rank)."""
    _load(ctx, state, 1)
