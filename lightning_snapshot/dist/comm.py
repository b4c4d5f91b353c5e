"""The few collectives the engine needs, over the trainer's strategy, a tier's own gloo group or a single process.

:class:`Comm` is what every rank calls at the same point (:class:`TensorComm` adds the tensor collectives of a
tier's own group); :class:`LocalComm` is one process, :class:`StrategyComm` the trainer's strategy (only called from
the training thread, at points every rank reaches together) and :class:`GroupComm` a dedicated gloo group (a tier's,
used by its persist thread). How ranks agree on an outcome over them is :mod:`~lightning_snapshot.dist.agree`; how
the library's own groups are formed is :mod:`~lightning_snapshot.dist.groups`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Comm", "GroupComm", "LocalComm", "Pending", "Ready", "StrategyComm", "TensorComm"]


class Pending(Protocol):
    """A collective started and not yet waited for (:meth:`Comm.all_max_start`)."""

    def result(self) -> int: ...


class Ready:
    """A :class:`Pending` whose result is known already (one process)."""

    def __init__(self, value: int) -> None:
        self.value = int(value)

    def result(self) -> int:
        return self.value


class _Started:
    """A gloo all-reduce in flight and the tensor it reduces into."""

    def __init__(self, work: Any, box: Any) -> None:
        self.work, self.box = work, box

    def result(self) -> int:
        self.work.wait()
        return int(self.box[0])


class Comm(Protocol):
    rank: int
    world_size: int

    def barrier(self) -> None: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank 0's ``obj`` on every rank (small, plain values only)."""

    def all_true(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is true on every rank."""

    def all_true_each(self, flags: list[bool]) -> list[bool]:
        """Element-wise :meth:`all_true` of equally long lists, in one collective."""

    def all_max(self, value: int) -> int:
        """The largest of every rank's ``value`` (an int32), on every rank; one collective of a small tensor."""

    def all_max_start(self, value: int) -> Pending:
        """:meth:`all_max`, started without waiting for it (the preemption agreement, once per training step, reads
        it a step later): its ``result()`` waits. Every rank starts the same ones in the same order."""

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (small, plain values), in rank order, on rank 0; None on the others."""

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (int64, equally long on every rank), in rank order, on every rank; one collective
        of a tensor (nothing pickled)."""


@runtime_checkable
class TensorComm(Comm, Protocol):
    """A :class:`Comm` that also moves tensors (a restore's read-once transfers,
    :mod:`~lightning_snapshot.restore.read_once`):
    :class:`GroupComm` over a tier's gloo group. Ranks are the group's."""

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (small, plain values), in rank order, on every rank."""

    def broadcast_tensor(self, tensor: Any, src: int) -> None:
        """Rank ``src``'s ``tensor`` (contiguous, CPU) into ``tensor`` on every rank."""

    def send_tensor(self, tensor: Any, dst: int) -> None:
        """Send ``tensor`` to rank ``dst`` (blocking), which receives it with :meth:`recv_tensor`."""

    def recv_tensor(self, tensor: Any, src: int) -> None:
        """Receive into ``tensor`` what rank ``src`` sends with :meth:`send_tensor` (blocking)."""


class LocalComm:
    """One process, no process group."""

    rank = 0
    world_size = 1

    def barrier(self) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_true(self, flag: bool) -> bool:
        return bool(flag)

    def all_true_each(self, flags: list[bool]) -> list[bool]:
        return [bool(f) for f in flags]

    def all_max(self, value: int) -> int:
        return int(value)

    def all_max_start(self, value: int) -> Pending:
        return Ready(value)

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return [list(values)]


class StrategyComm:
    """Collectives through a Lightning strategy's public API (gloo or nccl, whatever the run uses)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.rank = int(strategy.global_rank)
        self.world_size = int(strategy.world_size)

    def barrier(self) -> None:
        self.strategy.barrier("lightning_snapshot")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.strategy.broadcast(obj, src=src)

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

    def all_max(self, value: int) -> int:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int32, device=self.strategy.root_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def all_max_start(self, value: int) -> Pending:
        return Ready(self.all_max(value))  # (the trainer's group may be NCCL: not used for this per step)

    def gather(self, obj: Any) -> list[Any] | None:
        import torch.distributed as dist

        box: list[Any] = [None] * self.world_size
        dist.all_gather_object(box, obj)
        return box if self.rank == 0 else None

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64, device=self.strategy.root_device)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t)
        return [o.tolist() for o in out]


class GroupComm:
    """:class:`~lightning_snapshot.dist.comm.Comm` over a dedicated torch.distributed group (used by a persist
    thread)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._dist.get_global_rank(self.group, src), group=self.group)
        return box[0]

    def all_true(self, flag: bool) -> bool:
        return self.all_true_each([flag])[0]

    def all_true_each(self, flags: list[bool]) -> list[bool]:
        import torch

        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group)
        return [bool(v) for v in t.tolist()]

    def all_max(self, value: int) -> int:
        return self.all_max_start(value).result()

    def all_max_start(self, value: int) -> Pending:
        import torch

        box = torch.tensor([value], dtype=torch.int32)
        work = self._dist.all_reduce(box, op=self._dist.ReduceOp.MAX, group=self.group, async_op=True)
        return _Started(work, box)

    def gather(self, obj: Any) -> list[Any] | None:
        box: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self._dist.gather_object(obj, box, dst=self._dist.get_global_rank(self.group, 0), group=self.group)
        return box

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on every rank, in rank order."""
        box: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(box, obj, group=self.group)
        return box

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        import torch

        t = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._dist.all_gather(out, t, group=self.group)
        return [o.tolist() for o in out]

    def broadcast_tensor(self, tensor: Any, src: int) -> None:
        self._dist.broadcast(tensor, src=self._dist.get_global_rank(self.group, src), group=self.group)

    def send_tensor(self, tensor: Any, dst: int) -> None:
        self._dist.send(tensor, dst=self._dist.get_global_rank(self.group, dst), group=self.group)

    def recv_tensor(self, tensor: Any, src: int) -> None:
        self._dist.recv(tensor, src=self._dist.get_global_rank(self.group, src), group=self.group)
