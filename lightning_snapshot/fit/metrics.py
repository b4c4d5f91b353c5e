"""Snapshot metrics -> the Trainer's loggers (TensorBoard by default), logged from the training thread.

:class:`MetricsSink` is held by the callback's Reporter (reporting.py), which adds the values it collects; the
callback adds the stall time and flushes the sink to the loggers at each step. The metrics:

=====================================  ============================================================================
``snapshot/stall_ms``                   time the training thread was blocked by one snapshot (capture, synchronous
                                        copies, waiting for the copy before the next optimizer step, hand-off)
``snapshot/stage_ms``                   from the start of staging until the host copy and its checksums finished
``snapshot/bytes``                      bytes staged for one snapshot on rank 0 (shared state + its own)
``snapshot/skipped``                    snapshots skipped so far (arena busy or over ``max_host_bytes``)
``snapshot/failed``                     snapshots that failed to persist so far, all tiers
``snapshot/<tier>/persist_ms``          from hand-off to the persist thread until committed in that tier
``snapshot/<tier>/throughput_MBps``     bytes committed / persist time, for that tier
``snapshot/<tier>/lag_steps``           steps since the newest snapshot committed in that tier
``snapshot/<tier>/interval_steps``      ``every="auto"``: the interval in use (logged at snapshot steps)
``snapshot/<tier>/cost_ms``             ``every="auto"``: measured training time lost per snapshot (running mean)
``snapshot/step_ms``                    ``every="auto"``: median step time with no snapshot in flight
``restore/ms``                          time the restore took (logged once, at the first step after it)
``restore/step``                        the step restored
``restore/tier_index``                  index in ``tiers`` of the tier it came from
=====================================  ============================================================================

``<tier>`` is the tier's kind (``local``), with its index appended when several tiers share a kind (``local0``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MetricsSink", "tier_metric_names"]


def tier_metric_names(tiers: list[Any]) -> list[str]:
    """Metric name of each tier: its kind, plus its index where kinds repeat."""
    kinds = [t.tier for t in tiers]
    return [k if kinds.count(k) == 1 else f"{k}{i}" for i, k in enumerate(kinds)]


class MetricsSink:
    """Collects metric values and logs them at the training thread's next flush."""

    def __init__(self) -> None:
        self.pending: dict[str, float] = {}

    def add(self, name: str, value: float) -> None:
        self.pending[name] = float(value)

    def flush(self, trainer: Any) -> None:
        if not self.pending:
            return
        metrics, self.pending = self.pending, {}
        if trainer.global_rank != 0:
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
