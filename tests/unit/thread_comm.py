"""A fake communicator for unit tests: the :class:`~lightning_snapshot.dist.comm.Comm` protocol for ranks that are
threads
of one process. Every collective writes to a shared table and meets at two barriers (all have written; all have
read); a barrier with a timeout stands in for a process group's timeout (a rank that is gone breaks it). Tensors
move as :class:`~lightning_snapshot.dist.comm.TensorComm` moves them (broadcast, send and receive), as copies."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch


class ThreadComm:
    def __init__(
        self,
        rank: int,
        world_size: int,
        table: list[Any],
        barrier: threading.Barrier,
        mailboxes: dict[tuple[int, int], queue.Queue] | None = None,
    ) -> None:
        self.rank, self.world_size, self._table, self._barrier = rank, world_size, table, barrier
        self._mailboxes = mailboxes if mailboxes is not None else {}
        #: bytes this rank sent (broadcast or point to point), for tests of the traffic
        self.bytes_sent = 0

    def _exchange(self, obj: Any) -> list[Any]:
        self._table[self.rank] = obj
        self._barrier.wait()
        seen = list(self._table)
        self._barrier.wait()
        return seen

    def barrier(self) -> None:
        self._barrier.wait()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._exchange(obj)[src]

    def all_true(self, flag: bool) -> bool:
        return all(self._exchange(bool(flag)))

    def all_true_each(self, flags: list[bool]) -> list[bool]:
        return [all(f) for f in zip(*self._exchange(list(flags)), strict=True)]

    def all_max(self, value: int) -> int:
        return max(self._exchange(int(value)))

    def all_max_start(self, value: int):
        from lightning_snapshot.dist.comm import Ready

        return Ready(self.all_max(value))

    def gather(self, obj: Any) -> list[Any] | None:
        seen = self._exchange(obj)
        return seen if self.rank == 0 else None

    def all_gather(self, obj: Any) -> list[Any]:
        return self._exchange(obj)

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        seen = self._exchange(tensor.clone() if self.rank == src else None)
        if self.rank == src:
            self.bytes_sent += tensor.numel() * tensor.element_size()
        else:
            tensor.copy_(seen[src])

    def send_tensor(self, tensor: torch.Tensor, dst: int) -> None:
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self._mailboxes[(self.rank, dst)].put(tensor.clone())

    def recv_tensor(self, tensor: torch.Tensor, src: int) -> None:
        tensor.copy_(self._mailboxes[(src, self.rank)].get(timeout=30))


def run_ranks(world_size: int, body: Callable[[ThreadComm], Any]) -> list[Any]:
    """Run ``body(comm)`` on every rank; each rank's return value or the exception it raised, in rank order."""
    table: list[Any] = [None] * world_size
    barrier = threading.Barrier(world_size, timeout=30)
    mailboxes = {(a, b): queue.Queue() for a in range(world_size) for b in range(world_size)}
    out: list[Any] = [None] * world_size

    def main(rank: int) -> None:
        try:
            out[rank] = body(ThreadComm(rank, world_size, table, barrier, mailboxes))
        except BaseException as e:  # noqa: BLE001 - compared by the test
            out[rank] = e

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out
