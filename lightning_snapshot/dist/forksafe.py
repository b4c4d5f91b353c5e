"""Forks that cannot inherit a lock held by one of the library's threads: a loader worker that would hang for ever.

glibc's ``fork()`` resets the locks of malloc, stdio and the dynamic loader in the child, not the lock of the list
of exit handlers (``__exit_funcs_lock``, taken by ``__cxa_atexit``). torch registers an exit handler the first time
the process calls each of its operators (the operator's cached handle, a function-local static). A DataLoader worker
forked at the moment one of the library's threads (the copy thread, a persist thread) is inside such a first call
starts with that lock held and no thread to release it: it hangs at its own first registration (measured: in
``torch.set_num_threads(1)``, the first line of torch's worker loop), and the training thread waits for its batch
for ever, with the worker alive (torch's check for dead workers does not fire). A background thread's first snapshot
calls operators the training thread never has (the checksums, the copies into the arena); later ones find them
registered already.

So while a library thread does a kind of work for the first time in this process (:func:`first_use`), a fork
from another thread (``os.fork``: the loaders' worker processes, Lightning's ``ddp_fork``) waits for it to end,
at most :data:`WAIT_S` seconds. A thread that waits for the training thread inside such work steps out for the wait
(:func:`waiting`), so that a fork from the training thread never waits for itself. Pure bookkeeping: no I/O, no
process group, nothing torch.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["WAIT_S", "Executor", "first_use", "waiting"]

_T = TypeVar("_T")

log = logging.getLogger(__name__)

#: The longest a fork waits for the library's threads' first work (the operators' first calls come at the start of
#: a write; a first upload to an object store can take minutes, and a fork waits that long only once per process).
WAIT_S = 10.0

_cond = threading.Condition()
#: thread ident -> the kind of work it does for the first time in this process
_busy: dict[int, str] = {}
#: the kinds of work done once already (kept by a forked child: what the parent had initialised, it has)
_done: set[str] = set()


@contextlib.contextmanager
def first_use(what: str) -> Iterator[None]:
    """Around a library thread's work of kind ``what``: the first time that kind runs in this process, forks from
    other threads wait until it ends (see the module's documentation); later times cost a set lookup."""
    if what in _done:
        yield
        return
    me = threading.get_ident()
    with _cond:
        outer = _busy.get(me)
        _busy[me] = what
    try:
        yield
    finally:
        with _cond:
            _done.add(what)
            if outer is None:
                _busy.pop(me, None)
            else:
                _busy[me] = outer
            _cond.notify_all()


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Around a wait for the training thread inside :func:`first_use` work (a fence, a hold): forks do not wait for
    this thread meanwhile (the training thread may be the one forking)."""
    me = threading.get_ident()
    with _cond:
        what = _busy.pop(me, None)
        if what is not None:
            _cond.notify_all()
    try:
        yield
    finally:
        if what is not None:
            with _cond:
                _busy[me] = what


class Executor(cf.ThreadPoolExecutor):
    """The library's thread pools: a ``ThreadPoolExecutor`` whose tasks are :func:`first_use` work of the kind
    ``thread_name_prefix`` (the first ones run with forks held off; later ones as in the plain executor)."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._kind = f"{thread_name_prefix} threads"

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> cf.Future[_T]:
        if self._kind in _done:
            return super().submit(fn, *args, **kwargs)
        return super().submit(_first, self._kind, fn, args, kwargs)


def _first(kind: str, fn: Callable[..., _T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _T:
    with first_use(kind):
        return fn(*args, **kwargs)


def _before_fork() -> None:
    """``os.fork``'s hook, in the forking thread: wait until no other thread is in its first work."""
    me = threading.get_ident()
    deadline = None
    with _cond:
        while any(ident != me for ident in _busy):
            now = time.monotonic()
            if deadline is None:
                deadline = now + WAIT_S
                log.debug("lightning-snapshot: a fork waits for %s", sorted(set(_busy.values())))
            elif now >= deadline:
                log.warning(
                    "lightning-snapshot: a process is forked (a DataLoader's workers?) while the library's %s has"
                    " run for more than %.0f s; forking anyway (a child that inherits a lock that thread holds"
                    " can hang)",
                    " and ".join(sorted(set(_busy.values()))),
                    WAIT_S,
                )
                return
            _cond.wait(deadline - now)


def _after_fork_in_child() -> None:
    """The child has only the forking thread: nobody is busy, and the condition's lock may have been held."""
    global _cond
    _cond = threading.Condition()
    _busy.clear()


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
