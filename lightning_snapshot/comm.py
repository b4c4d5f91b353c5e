"""The few collectives the engine needs, over the trainer's strategy or for a single process.

Only the training thread calls these, at points every rank reaches together (never from a background thread).
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Comm", "LocalComm", "StrategyComm"]


class Comm(Protocol):
    rank: int
    world_size: int

    def barrier(self) -> None: ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (small, plain values only)."""

    def all_true(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is true on every rank."""


class LocalComm:
    """One process, no process group."""

    rank = 0
    world_size = 1

    def barrier(self) -> None:
        pass

    def broadcast(self, obj: Any) -> Any:
        return obj

    def all_true(self, flag: bool) -> bool:
        return bool(flag)


class StrategyComm:
    """Collectives through a Lightning strategy's public API (gloo or nccl, whatever the run uses)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.rank = int(strategy.global_rank)
        self.world_size = int(strategy.world_size)

    def barrier(self) -> None:
        self.strategy.barrier("lightning_snapshot")

    def broadcast(self, obj: Any) -> Any:
        return self.strategy.broadcast(obj, src=0)

    def all_true(self, flag: bool) -> bool:
        return bool(self.strategy.reduce_boolean_decision(bool(flag), all=True))
