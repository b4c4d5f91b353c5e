"""What a fit does before its loaders fork workers, so that no worker inherits a lock held by another thread of the
trainer and hangs in the child (see "Forks and the library's threads" in docs/architecture.md; the library's own
threads are kept clear by :mod:`~lightning_snapshot.dist.forksafe`): the operators torch's gloo run loop would call a
first time are called on the training thread (:func:`prime_operators`, glibc's exit-handler lock), and gloo's worker
threads get Python thread states that they keep (:func:`pin_gloo_thread_states`, CPython's thread-list lock).

Called by session.py when a fit's session opens, on the training thread.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any

__all__ = ["pin_gloo_thread_states", "prime_operators"]


def prime_operators() -> None:
    """Call, on the training thread before a fit's first collective (each fit: it costs microseconds), the operators
    gloo's run loop calls on a collective's tensors (``view``, ``select``, ``as_strided``, ``copy_``), so that its
    collectives never call them a first time in the process:
    torch registers an exit handler at an operator's first call, and a loader worker forked while another thread is
    inside that registration can hang for ever (glibc's exit-handler lock: see :mod:`~lightning_snapshot.dist.forksafe`,
    which covers the library's own threads; gloo's are torch's)."""
    import torch

    t = torch.zeros(8)
    t.view(2, 4).select(0, 1).as_strided((2,), (1,)).copy_(torch.ones(2))
    # (and those the library's threads call at their first snapshot, which forksafe's gate covers too)
    t.unsqueeze(0).gt(t).sum()
    torch.empty(0).resize_(2)


#: the process groups whose worker threads are pinned already (held: an ``id`` alone could be a later group's)
_pinned_groups: list[Any] = []


def pin_gloo_thread_states(timeout: float = 0.5, rounds: int = 3) -> int:
    """Give each worker thread of this rank's gloo process groups a Python thread state that it keeps (collective:
    every rank calls it at the same point, with the same groups; once per group and process). Returns the number of
    threads pinned by this call.

    Why: with torch 2.10 and later, a tensor that has a Python object takes a reference to it while C++ holds the
    tensor too, and gives it back, under the GIL, when C++ lets go. gloo's worker threads let go of a collective's
    tensors as it ends, so each collective on tensors made in Python makes that thread create a Python thread state
    and delete it again (``PyThreadState_New``; measured: 140 to 180 times per rank in a 20-step DDP job). CPython
    before 3.12 takes its thread-list lock there without the GIL, and a child forked at that moment (a DataLoader
    worker) waits for that lock for ever before it returns from ``os.fork`` (CPython gh-112275: the child's
    ``_PyThreadState_DeleteExcept``); the training thread then waits for its batch for ever. A thread that has a
    thread state of its own reuses it and never takes that lock without the GIL.

    How: per group, ``rounds`` times (the same number on every rank: each round is collectives), as many small
    all-reduces at once as the group has worker threads. Each one's completion callback runs on the worker thread
    that ran it (gloo completes its futures there), raises the count of that thread's state once
    (``PyGILState_Ensure``, never released), and waits for the round's others, so that each worker thread runs one.
    A callback that ran on the calling thread (its all-reduce had ended before the callback was attached) pins
    nothing and ends the round's wait; the next rounds cover it. Nothing is done from Python 3.12 on."""
    if sys.version_info >= (3, 12):
        return 0
    import ctypes

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_available() or not dist.is_initialized():
        return 0
    world: Any = getattr(c10d, "_world", None)
    pinned = 0
    me = threading.get_ident()
    for group in list(getattr(world, "pg_map", {}) or {}):
        if any(group is done for done in _pinned_groups):
            continue
        try:
            backend = group._get_backend(torch.device("cpu"))
            threads = int(backend.options._threads)
        except (AttributeError, RuntimeError, TypeError, ValueError):
            continue  # (no gloo backend for CPU tensors: an NCCL-only group)
        if type(backend).__name__ != "ProcessGroupGloo" or threads < 1:
            continue
        _pinned_groups.append(group)
        seen: set[int] = set()  # (this group's threads: a thread id of a group that ended may be reused)
        for _ in range(rounds):
            barrier = threading.Barrier(threads, timeout=timeout)

            def pin(_: Any, barrier: threading.Barrier = barrier, seen: set[int] = seen) -> None:
                if threading.get_ident() == me:
                    barrier.abort()  # (ran here: this round cannot reach every worker thread)
                    return
                native = threading.get_native_id()
                if native not in seen:
                    ctypes.pythonapi.PyGILState_Ensure()  # (kept: the thread keeps its thread state)
                    seen.add(native)
                with contextlib.suppress(threading.BrokenBarrierError):
                    barrier.wait()

            started = []
            for _ in range(threads):
                box = torch.zeros(1)
                work = dist.all_reduce(box, group=group, async_op=True)
                started.append((work.get_future().then(pin), box))
            for future, _box in started:
                future.wait()
        pinned += len(seen)
    return pinned
