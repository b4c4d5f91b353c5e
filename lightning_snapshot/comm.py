"""The few collectives the engine needs, over the trainer's strategy or for a single process.

Only the training thread calls these, at points every rank reaches together (never from a background thread).
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Comm", "GroupComm", "LocalComm", "StrategyComm"]


class Comm(Protocol):
    rank: int
    world_size: int

    def barrier(self) -> None: ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (small, plain values only)."""

    def all_true(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is true on every rank."""

    def all_true_each(self, flags: list[bool]) -> list[bool]:
        """Element-wise :meth:`all_true` of equally long lists, in one collective."""

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (small, plain values), in rank order, on rank 0; None on the others."""


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

    def all_true_each(self, flags: list[bool]) -> list[bool]:
        return [bool(f) for f in flags]

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]


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

    def all_true_each(self, flags: list[bool]) -> list[bool]:
        if not flags:
            return []
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=self.strategy.root_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return [bool(v) for v in t.tolist()]

    def gather(self, obj: Any) -> list[Any] | None:
        import torch.distributed as dist

        box: list[Any] = [None] * self.world_size
        dist.all_gather_object(box, obj)
        return box if self.rank == 0 else None


class GroupComm:
    """:class:`~lightning_snapshot.comm.Comm` over a dedicated torch.distributed group (used by a persist thread)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_true(self, flag: bool) -> bool:
        return self.all_true_each([flag])[0]

    def all_true_each(self, flags: list[bool]) -> list[bool]:
        import torch

        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group)
        return [bool(v) for v in t.tolist()]

    def gather(self, obj: Any) -> list[Any] | None:
        box: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self._dist.gather_object(obj, box, dst=self._dist.get_global_rank(self.group, 0), group=self.group)
        return box

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on every rank, in rank order."""
        box: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(box, obj, group=self.group)
        return box
