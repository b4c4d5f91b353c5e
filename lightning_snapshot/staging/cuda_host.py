"""CUDA page-locked registration of host memory (``cudaHostRegister``), and its stand-in for tests.

One job: register and unregister a range of host memory with CUDA, reporting why when the driver refuses
(:class:`HostRegisterError`), plus the no-op registrar :data:`FAKE_REGISTER_ENV` selects to run the CUDA arena path
on machines without a GPU. Called by :class:`~lightning_snapshot.staging.arena.HostArena` (which looks the functions
up in :mod:`~lightning_snapshot.staging.arena` at each call, where tests substitute them) and by the GPU tests.
"""

from __future__ import annotations

import os
import resource
from typing import Any

import torch

__all__ = [
    "FAKE_REGISTER_ENV",
    "HostRegisterError",
    "cuda_host_register",
    "cuda_host_unregister",
    "noop_host_register",
    "noop_host_unregister",
]

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
