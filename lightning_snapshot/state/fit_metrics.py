"""The metrics a fit accumulates that Lightning's checkpoints leave out, captured and put back by the registered parts
(:mod:`~lightning_snapshot.state.builtin`): ``torchmetrics.Metric`` states in the module, the epoch aggregates of
logged training metrics and the logger connector's state, and the gradient accumulation in force within an epoch.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch

from lightning_snapshot.state.fit_state import metric_classes

log = logging.getLogger(__name__)

_RESULT_FLAGS = ("prog_bar", "logger", "on_step", "on_epoch", "enable_graph", "add_dataloader_idx")
_REDUCTIONS = ("mean", "sum", "max", "min")

__all__ = ["logger_connector_state", "metric_states", "restore_in_epoch", "restore_metrics", "train_results"]


def metric_states(metrics: list[tuple[str, Any]]) -> dict[str, Any]:
    """The accumulated state of every ``torchmetrics.Metric`` in the module (``metrics``: them by module name, from
    :func:`_walk`): its states (tensors, or lists of tensors for concatenating metrics) and its update count. They
    are not in the module's ``state_dict`` (torchmetrics states are not persistent by default), and a metric logged
    with ``on_epoch=True`` accumulates over the epoch."""
    out: dict[str, Any] = {}
    for name, module in metrics:
        states = {}
        for key in getattr(module, "_defaults", {}):  # torchmetrics' registry of add_state names
            value = getattr(module, key, None)
            if isinstance(value, torch.Tensor) or (
                isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value)
            ):
                states[key] = list(value) if isinstance(value, list) else value
        out[name] = {"states": states, "update_count": int(getattr(module, "_update_count", 0))}
    return out


def restore_metrics(pl_module: Any, saved: dict[str, Any] | None) -> None:
    """Put the captured state back into the module's ``torchmetrics.Metric`` objects (see :func:`metric_states`),
    on each metric's device; a metric the snapshot does not name is left as it is."""
    metrics = saved.get("metrics") if isinstance(saved, dict) else None
    classes = metric_classes()
    if not isinstance(metrics, dict) or not metrics or not classes:
        return
    for name, module in pl_module.named_modules():
        entry = metrics.get(name)
        if not isinstance(module, classes) or not isinstance(entry, dict):
            continue
        module = cast("Any", module)
        defaults = getattr(module, "_defaults", {})
        for key, value in (entry.get("states") or {}).items():
            if key not in defaults:
                continue
            current = getattr(module, key, None)
            if isinstance(value, list):
                device = current[0].device if isinstance(current, list) and current else module.device
                setattr(module, key, [v.to(device) for v in value if isinstance(v, torch.Tensor)])
            elif isinstance(value, torch.Tensor):
                device = current.device if isinstance(current, torch.Tensor) else module.device
                setattr(module, key, value.to(device))
        module._update_count = int(entry.get("update_count", 0))
        module._computed = None  # (compute() caches its result until the next update)


def train_results(trainer: Any) -> list[dict[str, Any]]:
    """The tensor metrics the training loop has accumulated in this epoch (Lightning's ``_ResultCollection``)."""
    results = getattr(trainer.fit_loop.epoch_loop, "_results", None)  # private: the training ResultCollection
    out: list[dict[str, Any]] = []
    for key, metric in (results or {}).items():
        meta = getattr(metric, "meta", None)
        if meta is None or not getattr(metric, "is_tensor", False) or metric.has_reset:
            continue
        reduce = getattr(meta.reduce_fx, "__name__", "")
        if reduce not in _REDUCTIONS:
            continue
        sync = meta._sync
        entry: dict[str, Any] = {
            "key": key,
            "fx": meta.fx,
            "name": meta.name,
            "reduce_fx": reduce,
            "dataloader_idx": meta.dataloader_idx,
            "metric_attribute": meta.metric_attribute,
            "sync_dist": bool(sync is not None and sync._should),
            "rank_zero_only": bool(sync is not None and sync.rank_zero_only),
            "value": metric.value,
            "cumulated_batch_size": getattr(metric, "cumulated_batch_size", None) if meta.is_mean_reduction else None,
            "forward_cache": metric._forward_cache if isinstance(metric._forward_cache, torch.Tensor) else None,
            "update_count": int(getattr(metric, "_update_count", 0)),
        }
        entry.update({flag: bool(getattr(meta, flag)) for flag in _RESULT_FLAGS})
        out.append(entry)
    return out


def logger_connector_state(trainer: Any) -> dict[str, Any]:
    """Whether the next ``self.log`` of a hook resets that hook's accumulated metrics (Lightning's logger connector
    resets them at the first batch of an epoch and after a validation: its private ``_first_loop_iter`` and
    ``_current_fx``)."""
    connector = trainer._logger_connector
    first = getattr(connector, "_first_loop_iter", None)
    fx = getattr(connector, "_current_fx", None)
    return {
        "first_loop_iter": first if isinstance(first, bool) else None,
        "current_fx": fx if isinstance(fx, str) else None,
    }


def restore_in_epoch(trainer: Any, saved: dict[str, Any] | None) -> None:
    """After a restore *within* an epoch (at ``on_train_start``, after every other callback's): the gradient
    accumulation in force and the epoch's accumulated training metrics."""
    if not isinstance(saved, dict):
        return
    accumulate = saved.get("accumulate_grad_batches")
    if isinstance(accumulate, int) and accumulate >= 1:
        trainer.accumulate_grad_batches = accumulate
    entries = saved.get("train_results")
    if isinstance(entries, list) and entries:
        _restore_train_results(trainer, entries)
    connector = saved.get("logger_connector")
    if isinstance(connector, dict):
        trainer._logger_connector._first_loop_iter = connector.get("first_loop_iter")
        trainer._logger_connector._current_fx = connector.get("current_fx")


def _restore_train_results(trainer: Any, entries: list[dict[str, Any]]) -> None:
    results = trainer.fit_loop.epoch_loop._results  # private: the training ResultCollection
    for e in entries:
        value = e.get("value")
        if not isinstance(value, torch.Tensor) or e.get("reduce_fx") not in _REDUCTIONS:
            continue
        # Lightning's own log call makes the metric exactly as training_step's self.log makes it (its metadata must
        # match at the next self.log); its accumulated state is then set to the saved one
        results.log(
            e["fx"],
            e["name"],
            value.clone(),
            reduce_fx=getattr(torch, e["reduce_fx"]),
            sync_dist=e["sync_dist"],
            sync_dist_fn=trainer.strategy.reduce,
            batch_size=1,
            metric_attribute=e["metric_attribute"],
            rank_zero_only=e["rank_zero_only"],
            **{flag: e[flag] for flag in _RESULT_FLAGS},
        )
        metric = results.get(e["key"])
        if metric is None:
            log.debug("lightning-snapshot: logged metric %s not restored (key %s)", e["name"], e["key"])
            continue
        metric.value = value
        if isinstance(e.get("cumulated_batch_size"), torch.Tensor):
            metric.cumulated_batch_size = e["cumulated_batch_size"]
        metric._forward_cache = e.get("forward_cache")
        metric._update_count = int(e.get("update_count", 1))
        metric._computed = None
        metric.has_reset = False
