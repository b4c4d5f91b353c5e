"""The copy of a snapshot into its slot while training goes on: its handle and the thread that runs the copies.

One job: what runs and is waited for once a copy is started. :class:`AsyncStaged` is the handle of one staged
snapshot (wait for the bytes, fence training before the next optimizer step, tell whether it is torn, re-verify the
slot); :class:`CopyThread` runs the copies, one after the other. Made by
:class:`~lightning_snapshot.staging.copier.SlotCopier` (which starts each copy); the handle is used by
:class:`~lightning_snapshot.staging.arena.HostArena` (``stage_async``), the callback and the persist threads.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_snapshot.dist.forksafe import first_use, waiting
from lightning_snapshot.errors import TornSnapshotError
from lightning_snapshot.staging import StagedState, chunk_digests
from lightning_snapshot.staging.layout import data_addresses, version_counters
from lightning_snapshot.staging.slot import ArenaSlot

__all__ = ["AsyncStaged", "CopyThread"]


class CopyThread:
    """One daemon thread that runs the calls submitted to it in order (the arena's copy thread).

    A daemon, unlike a ``ThreadPoolExecutor``'s workers, which the interpreter joins at exit: a copy held back
    (``AsyncStaged.go``) that nothing lets go because the callback's teardown never ran (another callback's
    ``on_exception`` raised first; a ``ddp_spawn`` worker exits without teardown) cannot keep the process from
    exiting. Its snapshot was lost with the process anyway: the persist threads are daemons too.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: queue.SimpleQueue[tuple[cf.Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future[Any]:
        future: cf.Future[Any] = cf.Future()
        self._calls.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            with first_use(self.name):  # (its first copy calls operators a first time: forks wait, see forksafe)
                self._call(*call)
            del call  # (a finished copy's sources are not kept alive by this frame until the next one comes)

    @staticmethod
    def _call(future: cf.Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it, as an executor does
            future.set_exception(e)
        else:
            future.set_result(result)

    def shutdown(self, wait: bool = True) -> None:
        """Run what was submitted, then stop; ``wait``: until then."""
        self._calls.put(None)
        if wait:
            self._thread.join()


def _open() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@dataclass
class AsyncStaged:
    """A snapshot being staged into a slot. ``state`` is usable once :meth:`wait` returned."""

    state: StagedState
    slot: ArenaSlot
    step: int
    future: cf.Future[dict[str, list[str]]]
    cuda_event: Any = None
    #: Whether the copy thread still copies bytes on the CPU (tensors copied while training goes on, or small ones in
    #: bulk): a CUDA fence then waits for it on the host. Small tensors copied at once leave it only hashing, and the
    #: fence just orders the GPU streams (``cuda_event``).
    cpu_pending: bool = True
    started: float = 0.0
    #: Seconds from the start of staging until the copy (and its checksums) finished.
    copy_seconds: float | None = None
    #: CUDA: seconds the side stream spent on the device-to-host copy of the frozen tensors, and their bytes.
    device_copy_seconds: float | None = None
    device_copy_bytes: int = 0
    #: CUDA: set once the copy thread has queued the side-stream copies (``cuda_event`` is recorded then).
    launched: threading.Event | None = None
    #: Set once every byte is in the slot (before the checksums are all taken), or once the copy failed.
    copied: threading.Event = field(default_factory=threading.Event)
    #: The copy thread starts copying once this is set (at once, unless staged with ``hold``: then the training
    #: thread sets it, or anything that waits for the copy does).
    go: threading.Event = field(default_factory=_open)
    #: (names, tensors, version counters at staging, positions of those copied through the tensor object, their
    #: addresses at staging) of the tensors copied while training goes on, or None
    watched: tuple[list[str], list[torch.Tensor], list[int], list[int], list[int]] | None = None
    #: Set by the training thread once it may change the sources again (:meth:`fence_training`), with ``torn``:
    #: the watched tensors changed in place meanwhile (their copy may hold either value, or a mix): not committed.
    fenced: threading.Event = field(default_factory=threading.Event)
    torn: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    #: The ``frozen_key`` it was staged under (which tensors it copies while training goes on).
    frozen_key: Any = None

    def wait_copied(self) -> None:
        """Block until every byte is in the slot, which is then final until the slot is released (the checksums
        may still be being taken); raises what the copy raised."""
        self.go.set()
        self.copied.wait()
        if self.future.done():  # (finished, or failed: then ``copied`` was set when it ended)
            self.future.result()

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        """Block until the copy is finished; raises what the copy raised."""
        self.go.set()
        self.state.checksums = self.future.result()

    def fence_training(self) -> None:
        """Make training safe to mutate the sources: CPU waits for the copy; CUDA only orders the GPU streams.

        Also settles whether the copy holds the staged values: a tensor copied while training went on that was
        changed in place since staging (its version counter moved: user code in ``training_step`` changed a trained
        parameter before ``optimizer.step``) makes the snapshot ``torn``, and it is not committed.
        """
        self.go.set()
        try:
            if self.cuda_event is not None and not self.cpu_pending and not self.future.done():
                if self.launched is not None:
                    self.launched.wait()  # (set in a ``finally``: the copy thread cannot leave it unset)
                    if self.future.done():  # (the launch failed: raise it)
                        self.future.result()
                torch.cuda.current_stream().wait_event(self.cuda_event)
                return
            self.wait_copied()  # (the bytes: the checksums of what was copied in bulk may still be being taken)
        finally:
            self.settle()

    def _moved(self) -> list[tuple[str, torch.Tensor]]:
        if self.watched is None:
            return []
        names, tensors, versions, moved, ptrs = self.watched
        now = version_counters(tensors)
        addresses = data_addresses(list(map(tensors.__getitem__, moved))) if moved else ptrs
        if now == versions and addresses == ptrs:  # (C-level comparisons; the loops below only when something moved)
            return []
        renewed = {i for i, a, p in zip(moved, addresses, ptrs, strict=True) if a != p}  # (new storage: ``.data =``)
        return [
            (name, t)
            for i, (name, t, version, v) in enumerate(zip(names, tensors, versions, now, strict=True))
            if v != version or i in renewed
        ]

    def settle(self) -> None:
        """On the training thread, once nothing can change the copy any more (the sources are fenced, the copy had
        finished, or training is over): record which watched tensors were changed in place (or given new storage)
        since staging (``torn``) and let the persist threads commit, or not. Idempotent."""
        if not self.fenced.is_set():
            self.torn = self._moved()
            self.watched = None
            self.fenced.set()

    def await_fence(self, stop: threading.Event | None = None) -> None:
        """Block until the training thread has settled the copy (:meth:`fence_training`: at the next optimizer
        step, or when training ends); raises :class:`~lightning_snapshot.errors.TornSnapshotError` if it is torn.
        Returns early, without a verdict, once ``stop`` is set (the writer is being stopped)."""
        with waiting():  # (for the training thread, which may be forking: see forksafe)
            while not self.fenced.wait(0.5):
                if stop is not None and stop.is_set():
                    raise TornSnapshotError(f"step {self.step}: stopped before training settled its copy")
        if self.torn:
            raise TornSnapshotError(
                f"step {self.step}: {', '.join(repr(n) for n, _ in self.torn[:3])}"
                f"{' and others' if len(self.torn) > 3 else ''} changed in place (or given new storage through"
                " .data) after it was staged and before"
                " optimizer.step (in training_step?), while being copied; the snapshot could hold either value."
                " They are copied at once from now on"
            )

    def verify(self) -> None:
        """Check the stamp and re-hash the slot: the staged bytes are still the ones of ``step`` (never torn)."""
        if self.slot.step != self.step:
            raise RuntimeError(f"arena slot was reused by step {self.slot.step} while step {self.step} was persisted")
        assert self.state.checksums is not None and self.state.packed is not None
        packed, sums, chunk = self.state.packed, self.state.checksums, self.chunk_bytes
        for name, offset, nbytes in self.state.layout or ():
            if chunk_digests(packed[offset : offset + nbytes], chunk) != sums[name]:
                raise RuntimeError(f"staged bytes of {name!r} changed after staging (step {self.step}); not committed")

    #: The checksum chunk size the copy hashed with (the arena's; set by the copier), which :meth:`verify` uses.
    chunk_bytes: int = 8 << 20
