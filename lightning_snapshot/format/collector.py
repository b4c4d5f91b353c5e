"""Short bursts of allocation without Python's cyclic garbage collector running in the middle of them.

Used by the persist threads (writer.py, commit.py) around the CPU-only steps that build and parse a snapshot's
manifest: with many tensors these make tens of thousands of short-lived dicts and lists (1,564 tensor entries: the
part, the merged manifest, the manifest parsed back). The collector, which runs every few hundred allocations, would
find them alive mid-way and move them to its older generations; those fill up after a few snapshots and set off a
full collection of every object of the process (hundreds of thousands in a training process: 50-500 ms), which holds
the GIL and so stops the training thread too. Measured on the ``--model many`` benchmark model, 30 snapshots: 9 full
collections without these windows, 2 with them.

Inside :func:`deferred_collection` the collector does not run (``gc.disable()``); the objects freed inside never
reach an older generation, and what is still alive at the end is collected as usual afterwards. Each window is a few
to a few tens of milliseconds of CPU work with no I/O and no waiting in it, so nothing is deferred for long. Windows
of several threads nest (the collector is enabled again when the last one ends, and only if it was enabled when the
first began). A program that disables the collector itself keeps it disabled, unless it does so from another thread
while a window is open: then it is enabled again at the window's end. A process forked while a window is open (a
``DataLoader`` worker) starts with the collector as the program had it, not disabled for good.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["deferred_collection"]

_lock = threading.Lock()
_open = 0  # windows open, in every thread
_enable_after = False  # whether the collector was enabled when the first of them began


@contextmanager
def deferred_collection() -> Iterator[None]:
    """Run the body with the cyclic garbage collector disabled (see the module's documentation)."""
    global _open, _enable_after
    with _lock:
        if _open == 0:
            _enable_after = gc.isenabled()
            gc.disable()
        _open += 1
    try:
        yield
    finally:
        with _lock:
            _open -= 1
            if _open == 0 and _enable_after:
                gc.enable()


def _after_fork_in_child() -> None:
    """In a child forked while a window was open in some thread of the parent: no thread of the child will end it."""
    global _lock, _open
    _lock = threading.Lock()  # (one held by another thread at the fork would stay held in the child)
    if _open:
        _open = 0
        if _enable_after:
            gc.enable()


os.register_at_fork(after_in_child=_after_fork_in_child)
