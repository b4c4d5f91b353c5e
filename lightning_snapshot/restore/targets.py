"""What a restore puts back into the live model and optimizers: the templates of the live state, the targets the
snapshot is read into (resharded where the strategy shards), the optimizer state re-keyed, and the shared state
applied; the restore side of :mod:`~lightning_snapshot.state.capture`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_snapshot.errors import ManifestError, StateMismatchError
from lightning_snapshot.format import tree as _tree
from lightning_snapshot.staging import dtensor_box, is_dtensor, local_tensor
from lightning_snapshot.state import compat as _compat
from lightning_snapshot.state.capture import check_model, checkpoint_view, is_sharded, raw_optimizer
from lightning_snapshot.state.parts import Phase

__all__ = ["Templates", "adopt_pruning", "check_optimizers", "restore_shared", "restore_targets", "templates"]


class _Ref:
    """Stands for a stored tensor while the snapshot's structure is matched against the live state."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class _Refs(dict[str, Any]):
    def __contains__(self, name: object) -> bool:
        return isinstance(name, str)

    def __missing__(self, name: str) -> _Ref:
        return _Ref(name)


def _skeleton(tree: Any) -> Any:
    """A part of the stored state tree decoded with :class:`_Ref` in place of its tensors (None if it cannot be)."""
    try:
        return _tree.decode(tree, _Refs())
    except (ManifestError, AttributeError, TypeError):
        return None


class Templates:
    """The live state a restore fills, computed once per ``fit`` (see :func:`templates`)."""

    def __init__(self, model: dict[str, Any], optimizers: list[dict[str, Any]] | None) -> None:
        self.model = model
        self.optimizers = optimizers


def templates(trainer: Any, pl_module: Any) -> Templates:
    """The live tensors a restore reads into.

    Sharded strategy: ``get_model_state_dict(model)`` and ``get_optimizer_state_dict(model, opt)`` (DTensors; the
    latter creates the optimizer state with a zero-learning-rate step if it does not exist yet, so call this only
    when a snapshot is going to be restored). Otherwise the model's ``state_dict()`` (plain tensors).
    """
    if is_sharded(trainer.strategy):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        model = trainer.strategy.model
        return Templates(
            get_model_state_dict(model),
            [get_optimizer_state_dict(model, raw_optimizer(opt)) for opt in trainer.optimizers],
        )
    return Templates(pl_module.state_dict(), None)


def adopt_pruning(pl_module: Any, saved_keys: Iterable[str]) -> list[str]:
    """Reparametrize the live model as pruning left the snapshot's, so that it loads: returns the names done.

    ``torch.nn.utils.prune`` (Lightning's ``ModelPruning`` callback prunes at epoch ends) replaces a parameter
    ``name`` by the same parameter registered as ``name_orig`` plus a buffer ``name_mask``, applied by a forward
    pre-hook. A model built afresh has ``name``; a snapshot taken after a pruning epoch has ``name_orig`` and
    ``name_mask``. Each such parameter is reparametrized with ``prune.identity`` (the same parameter object, so the
    optimizer keeps it), whose mask the restore then overwrites with the saved one: the model computes the same
    weights as the interrupted one, and later pruning combines with the saved mask as it would have.
    """
    from torch.nn.utils import prune

    keys = set(saved_keys)
    params = dict(pl_module.named_parameters())
    done = []
    for key in sorted(keys):
        base = key[: -len("_orig")]
        if not key.endswith("_orig") or f"{base}_mask" not in keys or base in keys or base not in params:
            continue
        module_name, _, attr = base.rpartition(".")
        prune.identity(pl_module.get_submodule(module_name) if module_name else pl_module, attr)
        done.append(base)
    return done


def _optimizer_keys(trainer: Any, live: Templates) -> list[list[list[Any]]]:
    """Per optimizer, per parameter group, the keys its state is stored under in this strategy (names or ids)."""
    if live.optimizers is not None:
        return [[list(g["params"]) for g in osd["param_groups"]] for osd in live.optimizers]
    return [[list(g["params"]) for g in raw_optimizer(opt).state_dict()["param_groups"]] for opt in trainer.optimizers]


def _key_map(saved: Any, keys: list[list[Any]], where: str) -> dict[Any, Any]:
    """Stored optimizer-state key -> this strategy's key, by position in the parameter groups.

    A snapshot taken under DDP keys optimizer state by parameter index, one taken under ModelParallel by parameter
    name; both list the keys of every group in the order of the optimizer's parameters, so position maps them.
    """
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if (
        not isinstance(groups, list)
        or len(groups) != len(keys)
        or any(
            not isinstance(g, dict) or not isinstance(g.get("params"), list) or len(g["params"]) != len(k)
            for g, k in zip(groups, keys, strict=True)
        )
    ):
        have = [len(g.get("params", [])) if isinstance(g, dict) else "?" for g in groups or []]
        raise StateMismatchError(
            f"{where}: the optimizer state does not fit this optimizer: the snapshot has parameter groups of"
            f" {have} parameters, the optimizer {[len(k) for k in keys]}. Restore into the same optimizer setup, or"
            " pass resume=False"
        )
    return {s: t for g, k in zip(groups, keys, strict=True) for s, t in zip(g["params"], k, strict=True)}


def _rekey(saved: dict[str, Any], keys: list[list[Any]], where: str) -> dict[str, Any]:
    """``saved`` (an optimizer state dict) keyed the way this strategy's optimizer state is."""
    mapping = _key_map(saved, keys, where)
    state = saved.get("state", {})
    unknown = [k for k in state if k not in mapping]
    if unknown:
        raise StateMismatchError(
            f"{where}: optimizer state for parameter(s) {unknown[:5]} that no parameter group lists"
        )
    return {
        **saved,
        "state": {mapping[k]: v for k, v in state.items()},
        "param_groups": [{**g, "params": list(k)} for g, k in zip(saved["param_groups"], keys, strict=True)],
    }


def _part_targets(saved: Any, live: Any, targets: dict[str, Any]) -> None:
    """Add the targets of the tensor parts: where the stored skeleton ``saved`` and the live tree ``live`` (what the
    parts' captures return now) both have a tensor at the same place (dict keys, list positions)."""
    if isinstance(saved, _Ref):
        if isinstance(live, torch.Tensor):
            targets[saved.name] = live
    elif isinstance(saved, dict) and isinstance(live, dict):
        for k, v in saved.items():
            if k in live:
                _part_targets(v, live[k], targets)
    elif isinstance(saved, list) and isinstance(live, (list, tuple)) and len(saved) == len(live):
        for v, t in zip(saved, live, strict=True):
            _part_targets(v, t, targets)


def restore_targets(trainer: Any, live: Templates, tree: Any, where: str, parts: Any = None) -> dict[str, Any]:
    """Stored tensor name -> the live tensor to read it into, for the model, (sharded) the optimizer state, and the
    tensor parts (``parts``: their live state, the tree :meth:`~lightning_snapshot.state.parts.Registry.
    capture_tensors` returns; each stored tensor goes into the live one at the same place).

    Under a sharded strategy the targets are DTensors, so each rank reads only its shard, from whatever layout the
    snapshot was saved with (DDP's whole tensors, another sharding); so are a tensor part's DTensors.
    """
    targets: dict[str, Any] = {}
    if not isinstance(tree, dict):
        return targets
    if isinstance(parts, dict):
        for key, value in parts.items():
            if key in tree:
                _part_targets(_skeleton(tree[key]), value, targets)
    saved_model = _skeleton(tree.get("state_dict"))
    if isinstance(saved_model, dict):
        for k, ref in saved_model.items():
            t = live.model.get(k)
            if isinstance(ref, _Ref) and isinstance(t, torch.Tensor):
                targets[ref.name] = t
    if live.optimizers is None:
        return targets
    saved_opts = tree.get("optimizer_states")
    if not isinstance(saved_opts, list) or len(saved_opts) != len(live.optimizers):
        return targets  # restore_shared reports the mismatch
    for saved_tree, osd, keys in zip(saved_opts, live.optimizers, _optimizer_keys(trainer, live), strict=True):
        saved = _skeleton(saved_tree)
        if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
            continue
        mapping = _key_map(saved, keys, where)
        for key, values in saved["state"].items():
            template = osd["state"].get(mapping.get(key), {}) if key in mapping else {}
            if not isinstance(values, dict):
                continue
            for name, ref in values.items():
                t = template.get(name)
                if isinstance(ref, _Ref) and isinstance(t, torch.Tensor):
                    targets[ref.name] = t
    return targets


def _into_template(template: Any, value: Any, where: str, what: str) -> Any:
    """A loaded value for a DTensor template: the template itself once it holds the value's data."""
    if not is_dtensor(template) or value is template:
        return value
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(template.shape):
        raise StateMismatchError(
            f"{where}: {what} has shape {getattr(value, 'shape', None)}, the model {tuple(template.shape)}"
        )
    box, _ = dtensor_box(template, what)
    with torch.no_grad():
        template.to_local().copy_(local_tensor(value)[box.slices()])
    return template


def _restore_sharded(trainer: Any, ckpt: dict[str, Any], live: Templates, where: str) -> None:
    """Model and optimizer state into a sharded strategy, through torch.distributed.checkpoint.state_dict."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model = trainer.strategy.model
    model_sd = {k: _into_template(live.model.get(k), v, where, k) for k, v in ckpt["state_dict"].items()}
    set_model_state_dict(model, model_sd)
    for opt, saved, osd, keys in zip(
        trainer.optimizers, ckpt["optimizer_states"], live.optimizers or [], _optimizer_keys(trainer, live), strict=True
    ):
        state = _rekey(saved, keys, where)
        for key, values in state["state"].items():
            template = osd["state"].get(key, {})
            for name, v in list(values.items()):
                values[name] = _into_template(template.get(name), v, where, f"optimizer state {key}/{name}")
        set_optimizer_state_dict(model, raw_optimizer(opt), state)


def check_optimizers(trainer: Any, ckpt: dict[str, Any], where: str) -> None:
    """Raise :class:`StateMismatchError` when the snapshot's optimizers or LR schedulers do not fit the live ones
    (another class, count, parameter groups or state keys; see :mod:`lightning_snapshot.state.compat`)."""
    own = ckpt.get("lightning_snapshot")
    description = own.get("optimizers") if isinstance(own, dict) else None
    _compat.check(trainer, description, ckpt.get("optimizer_states", []), ckpt.get("lr_schedulers", []), where)


def restore_shared(
    trainer: Any,
    pl_module: Any,
    ckpt: dict[str, Any],
    where: str,
    live: Templates | None = None,
    parts: Callable[[Phase], None] | None = None,
    replaced: Callable[[Any], bool] | None = None,
) -> None:
    """Load the shared state into a trainer whose strategy is set up (optimizers exist): at ``on_fit_start``.

    Works across strategies: optimizer state stored by parameter index (DDP, single device) or by parameter name
    (ModelParallel) is re-keyed to what this strategy's optimizer uses. Under a sharded strategy ``live`` are the
    templates the state was read into (see :func:`restore_targets`), applied with ``set_model_state_dict`` and
    ``set_optimizer_state_dict`` (Lightning's own loading hooks do nothing there). ``parts(phase)`` applies the state
    parts of a phase (:mod:`lightning_snapshot.state.builtin`): LOAD right after the weights, SETUP (the callbacks'
    states, unless they were loaded at ``setup``) after the callbacks' ``on_load_checkpoint``. ``replaced(callback)``:
    a tensor part restores what that callback's ``on_load_checkpoint`` would (its LOAD phase), which is not called.
    """
    check_model(pl_module, ckpt.get("state_dict"), where)
    optimizer_states = ckpt.get("optimizer_states", [])
    schedulers = ckpt.get("lr_schedulers", [])
    check_optimizers(trainer, ckpt, where)
    view = checkpoint_view(ckpt)
    pl_module.on_load_checkpoint({**view, "state_dict": ckpt["state_dict"]})
    sharded = is_sharded(trainer.strategy)
    if sharded:
        if live is None or live.optimizers is None:
            live = templates(trainer, pl_module)
        try:
            _restore_sharded(trainer, ckpt, live, where)
        except (ValueError, KeyError, RuntimeError) as e:
            if isinstance(e, StateMismatchError):
                raise
            raise StateMismatchError(f"{where}: the state does not fit this model and optimizer: {e}") from e
    else:
        trainer.strategy.load_model_state_dict(ckpt, strict=True)
    if parts is not None:
        parts(Phase.LOAD)  # (trainable flags, BatchNorm tracking, metric states)
    datamodule = trainer.datamodule
    if datamodule is not None and type(datamodule).__qualname__ in ckpt:
        datamodule.load_state_dict(ckpt[type(datamodule).__qualname__])
    # the callbacks' on_load_checkpoint, then their load_state_dict (Lightning's order; the states loaded at setup,
    # before the callbacks' on_fit_start, are not loaded again: ``parts`` knows)
    for cb in trainer.callbacks:
        if replaced is None or not replaced(cb):
            cb.on_load_checkpoint(trainer, pl_module, view)
    if parts is not None:
        parts(Phase.SETUP)
    precision_key = type(trainer.precision_plugin).__qualname__
    if precision_key in ckpt:
        trainer.precision_plugin.load_state_dict(ckpt[precision_key])
    trainer.fit_loop.load_state_dict(ckpt["loops"]["fit_loop"])
    metrics = ckpt.get("callback_metrics")
    if isinstance(metrics, dict):
        trainer.callback_metrics.update(metrics)
    if not sharded:
        keys = _optimizer_keys(trainer, Templates({}, None))
        try:
            rekeyed = [_rekey(saved, k, where) for saved, k in zip(optimizer_states, keys, strict=True)]
            trainer.strategy.load_optimizer_state_dict({**ckpt, "optimizer_states": rekeyed})
        except (ValueError, KeyError) as e:
            raise StateMismatchError(f"{where}: the optimizer state does not fit this optimizer: {e}") from e
    for cfg, state in _compat.schedulers_to_load(trainer, schedulers):
        cfg.scheduler.load_state_dict(state)
