"""The RNG state of one process: Python's, numpy's, torch's CPU generator and every initialized CUDA device's.

Captured per rank by the snapshot's ``rng`` part (:mod:`lightning_snapshot.state.builtin`) and put back at a resume;
a resumed loader worker's RNG is set with :func:`restore_rng` too (:mod:`lightning_snapshot.data.workers`).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """This rank's RNG states: python, numpy, torch CPU and, once CUDA is initialized, every CUDA device."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set this rank's RNG states from :func:`capture_rng` output."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:  # a different number of GPUs on this node: seed what we can, device by device
            for i, s in enumerate(cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)
