"""Staging: copy captured tensors into host memory so training can go on mutating the originals.

This is the synchronous stager; the asynchronous arena builds on the same :class:`StagedState`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_snapshot import tree as _tree
from lightning_snapshot.errors import CaptureError
from lightning_snapshot.manifest import DTYPES, dtype_name

__all__ = ["StagedState", "stage", "tensor_bytes"]


@dataclass
class StagedState:
    """A point-in-time host copy of a state structure.

    Attributes:
        tree: the JSON tree (tensors as ``{"$tensor": name}``).
        tensors: host tensors by name, contiguous, one per distinct storage view.
        aliases: ``name -> canonical name`` for tensors that were views of the very same memory (tied weights).
        packed, alignment, checksums: set by the arena (see below).
    """

    tree: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    #: When the tensors are laid out back to back in one region (the arena): that region, its alignment, and the
    #: checksums taken at staging time (name -> one per chunk). The writer then writes the region as it is.
    packed: memoryview | None = None
    alignment: int = 64
    checksums: dict[str, list[str]] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _check(t: torch.Tensor, name: str) -> None:
    if t.layout != torch.strided:
        raise CaptureError(f"tensor {name!r} has layout {t.layout}; only dense (strided) tensors can be stored")
    if t.is_meta:
        raise CaptureError(f"tensor {name!r} is on the meta device and holds no data")
    if t.is_quantized or t.dtype not in DTYPES.values():
        raise CaptureError(f"tensor {name!r} has dtype {t.dtype}, which the format does not store: {sorted(DTYPES)}")
    if type(t).__name__ == "DTensor":
        raise CaptureError(
            f"tensor {name!r} is a DTensor; sharded strategies are not supported by this release (use DDP or a"
            " single device)"
        )


def _identity(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _prepare(obj: Any, prefix: str) -> tuple[Any, list[tuple[str, torch.Tensor]], dict[str, str]]:
    """Encode ``obj``; returns (tree, [(name, tensor to copy)], aliases) with tied views found and checked."""
    tree, tensors = _tree.encode(obj, prefix)
    items: list[tuple[str, torch.Tensor]] = []
    aliases: dict[str, str] = {}
    canonical: dict[tuple[Any, ...], str] = {}
    for name, t in tensors.items():
        _check(t, name)
        t = t.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        key = _identity(t) if t.numel() else None
        if key is not None and key in canonical:
            aliases[name] = canonical[key]
            continue
        items.append((name, t))
        if key is not None:
            canonical[key] = name
    return tree, items, aliases


def stage(obj: Any, prefix: str = "") -> StagedState:
    """Encode ``obj`` and copy every tensor in it to fresh contiguous host memory (synchronously).

    Tensors that are the very same view of the same memory (tied weights) are copied once and recorded as aliases.

    Raises:
        CaptureError: a value or tensor the format cannot store.
    """
    tree, items, aliases = _prepare(obj, prefix)
    staged = StagedState(tree, aliases=aliases)
    for name, t in items:
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        host.copy_(t)
        staged.tensors[name] = host
    return staged


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def dtype_str(t: torch.Tensor) -> str:
    return dtype_name(t.dtype)
