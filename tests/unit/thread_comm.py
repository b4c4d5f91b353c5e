"""A fake communicator for unit tests: the :class:`~lightning_snapshot.comm.Comm` protocol for ranks that are threads
of one process. Every collective writes to a shared table and meets at two barriers (all have written; all have
read); a barrier with a timeout stands in for a process group's timeout (a rank that is gone breaks it)."""

from __future__ import annotations

import threading
from typing import Any


class ThreadComm:
    def __init__(self, rank: int, world_size: int, table: list[Any], barrier: threading.Barrier) -> None:
        self.rank, self.world_size, self._table, self._barrier = rank, world_size, table, barrier

    def _exchange(self, obj: Any) -> list[Any]:
        self._table[self.rank] = obj
        self._barrier.wait()
        seen = list(self._table)
        self._barrier.wait()
        return seen

    def barrier(self) -> None:
        self._barrier.wait()

    def broadcast(self, obj: Any) -> Any:
        return self._exchange(obj)[0]

    def all_true(self, flag: bool) -> bool:
        return all(self._exchange(bool(flag)))

    def all_true_each(self, flags: list[bool]) -> list[bool]:
        return [all(f) for f in zip(*self._exchange(list(flags)), strict=True)]

    def gather(self, obj: Any) -> list[Any] | None:
        seen = self._exchange(obj)
        return seen if self.rank == 0 else None
