"""CUDA page-locked registration of host memory (``cudaHostRegister``), and its stand-in for tests.

One job: register and unregister a range of host memory with CUDA, reporting why when the driver refuses
(:class:`HostRegisterError`), plus the no-op registrar :data:`FAKE_REGISTER_ENV` selects to run the CUDA arena path
on machines without a GPU; and :class:`HostRegistration`, the arena's registrar (its own thread, one warning on the
first failure). Used by :class:`~lightning_snapshot.staging.pool.SlotPool` (through :class:`HostRegistration`, which
looks the functions up in this module at each call, where tests substitute them) and by the GPU tests.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import resource
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_snapshot.dist.forksafe import Executor

if TYPE_CHECKING:
    from lightning_snapshot.staging.slot import ArenaSlot

__all__ = [
    "FAKE_REGISTER_ENV",
    "HostRegisterError",
    "HostRegistration",
    "cuda_host_register",
    "cuda_host_unregister",
    "noop_host_register",
    "noop_host_unregister",
]

log = logging.getLogger(__name__)

#: ``cudaHostRegisterPortable``: the memory counts as page-locked for every CUDA context, not only the current one.
_HOST_REGISTER_PORTABLE = 1
#: Testing hook, set to a file path: every slot is treated as CUDA-registered, even for CPU-only state, and registered
#: through :func:`noop_host_register` / :func:`noop_host_unregister`, which change nothing and append their calls to
#: that file. This runs the CUDA arena path (registration, unregistration before unmapping, the agent mapping the
#: registered memory) on machines without a GPU; it is not for users.
FAKE_REGISTER_ENV = "LIGHTNING_SNAPSHOT_FAKE_CUDA_REGISTER"


class HostRegisterError(RuntimeError):
    """Host memory could not be registered with (or unregistered from) CUDA; the message says why."""


def cuda_host_register(ptr: int, nbytes: int, device: int) -> None:
    """Page-lock ``nbytes`` of host memory at ``ptr`` for CUDA (``cudaHostRegister``, portable), as ``device``.

    Call it from a thread that launches no CUDA work (the arena has one for this): a failed call leaves CUDA's
    per-thread "last error" set (torch's binding does not clear it), which torch would otherwise report at that
    thread's next kernel launch, as if that kernel had failed. It makes ``device`` the calling thread's current
    device (and leaves it so: switching back to device 0 would create a context there on every rank of a node).

    Raises:
        HostRegisterError: CUDA is not usable in this process, or the driver refused (out of memory, a limit); the
            message names the CUDA error and, where one is set, ``RLIMIT_MEMLOCK``.
    """
    cudart = _cudart_on(device)
    code = int(cudart.cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE))
    if code != 0:
        raise HostRegisterError(
            f"cudaHostRegister of {nbytes} bytes for cuda:{device} failed with"
            f" {_cuda_error(cudart, code)}{_memlock_note()}"
        )


def cuda_host_unregister(ptr: int, device: int) -> None:
    """Undo :func:`cuda_host_register` of the memory at ``ptr``; call it while the memory is still mapped, from the
    same kind of thread (it makes ``device`` the thread's current device too).

    Raises:
        HostRegisterError: CUDA refused (the message names the CUDA error).
    """
    cudart = _cudart_on(device)
    code = int(cudart.cudaHostUnregister(ptr))
    if code != 0:
        raise HostRegisterError(f"cudaHostUnregister for cuda:{device} failed with {_cuda_error(cudart, code)}")


def _cudart_on(device: int) -> Any:
    """torch's CUDA runtime bindings, with ``device`` made the calling thread's current device (a new thread's is 0:
    never touch another GPU's context)."""
    try:
        cudart = torch.cuda.cudart()
        torch.cuda.set_device(device)
    except (AssertionError, AttributeError, RuntimeError) as e:  # torch without CUDA, no driver, CUDA after fork
        raise HostRegisterError(f"CUDA is not usable in this process ({e})") from None
    return cudart


def _cuda_error(cudart: Any, code: int) -> str:
    try:
        return f"{cudart.cudaGetErrorString(cudart.cudaError(code))} (CUDA error {code})"
    except (TypeError, ValueError, RuntimeError):
        return f"CUDA error {code}"


def _memlock_note() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "" if soft == resource.RLIM_INFINITY else f"; RLIMIT_MEMLOCK (ulimit -l) is {soft} bytes"


def noop_host_register(ptr: int, nbytes: int, device: int) -> None:
    """The stand-in for :func:`cuda_host_register` under :data:`FAKE_REGISTER_ENV`: registers nothing and appends
    ``register <ptr> <nbytes> <device>`` to the file that variable names."""
    _record_fake(f"register {ptr} {nbytes} {device}")


def noop_host_unregister(ptr: int, device: int) -> None:
    """The stand-in for :func:`cuda_host_unregister` under :data:`FAKE_REGISTER_ENV` (appends
    ``unregister <ptr> <device>``)."""
    _record_fake(f"unregister {ptr} {device}")


def _record_fake(line: str) -> None:
    path = os.environ.get(FAKE_REGISTER_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


class HostRegistration:
    """Registers arena slots with CUDA as page-locked memory, on a thread of its own that launches no CUDA work (see
    :func:`cuda_host_register`), and unregisters them before they are unmapped. The first failure is reported once (a
    warning naming the reason); nothing is registered after it (:attr:`failure`).

    Under :data:`FAKE_REGISTER_ENV` the no-op registrars are used, looked up in this module at each call (tests
    substitute them).
    """

    def __init__(self, lock: threading.Condition) -> None:
        self._lock = lock
        self.fake = bool(os.environ.get(FAKE_REGISTER_ENV))
        self._thread: cf.ThreadPoolExecutor | None = None
        #: Why registration failed (then nothing more is registered), or None.
        self.failure: str | None = None

    def _registrar(self) -> tuple[Callable[[int, int, int], None], Callable[[int, int], None]]:
        """The (register, unregister) functions in use, looked up at each call (tests substitute them)."""
        if self.fake:
            return noop_host_register, noop_host_unregister
        return cuda_host_register, cuda_host_unregister

    def _on_thread(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the registration thread (it launches no CUDA work: see :func:`cuda_host_register`)
        and wait for it; raises what ``fn`` raised."""
        with self._lock:
            if self._thread is None:
                self._thread = Executor(max_workers=1, thread_name_prefix="lightning-snapshot-cuda-host")
            pool = self._thread
        pool.submit(fn, *args).result()

    def register(self, slot: ArenaSlot, device: int) -> None:
        """Register ``slot`` for CUDA ``device`` once; on the first failure, warn once and register nothing more."""
        if slot.device is not None or self.failure is not None or slot.capacity == 0:
            return
        register, _ = self._registrar()
        try:
            self._on_thread(register, slot.buffer.data_ptr(), slot.capacity, device)
        except HostRegisterError as e:
            with self._lock:
                first = self.failure is None
                self.failure = str(e)
            if first:
                warnings.warn(
                    f"lightning-snapshot: could not page-lock the snapshot staging memory for CUDA: {e}. Snapshots"
                    " are staged in unregistered (pageable) shared memory instead: device-to-host copies are slower"
                    " and hold up the training thread while they run (the snapshot agent still maps the memory, so a"
                    " staged snapshot still survives a crash). If a memory limit is the cause, raise it (ulimit -l,"
                    " the container's locked-memory limit) or lower max_host_bytes.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        slot.device = device

    def unregister(self, slot: ArenaSlot) -> None:
        """Unregister ``slot`` from CUDA if it is registered; the buffer must still be mapped (it is: the slot holds
        it)."""
        if slot.device is None:
            return
        device, slot.device = slot.device, None
        _, unregister = self._registrar()
        try:
            self._on_thread(unregister, slot.buffer.data_ptr(), device)
        except HostRegisterError as e:
            log.warning("lightning-snapshot: %s; the staging buffer is freed anyway", e)

    def close(self) -> None:
        """Stop the registration thread (after the slots were unregistered)."""
        with self._lock:
            pool, self._thread = self._thread, None
        if pool is not None:
            pool.shutdown(wait=True)
