"""One C-level copy of many small CPU tensors into one region of a slot: the per-snapshot copy whose cost does not
grow with the number of tensors.

Copying a few thousand tensors of a few hundred bytes each, even in one ``torch._foreach_copy_``, costs a dispatch
per tensor (1-4 ms for 1,560 tensors on a 2-core VM inside a fit, where the bytes themselves take microseconds).
:class:`Gather` is made once per staging plan from the tensors' addresses: a read-only ``uint8``-like view of the
process's memory from the lowest to the highest of those addresses (``torch.frombuffer`` over it; no byte is touched
until read), and, for every word of the destination region, the word of that view it comes from (the alignment
padding between the tensors comes from a word of zeros the gather holds). Each snapshot is then one
``torch.index_select`` into the slot.

It is only ever used while the plan it belongs to matches the state it stages (the arena checks every tensor's
address, shape, strides and dtype first, and holds the tensors during the copy), so every word it reads lies inside
a live tensor's own bytes; anything it cannot vouch for (another device, a plan rebuilt at every snapshot) keeps the
per-tensor copy.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["Gather"]

#: The word size read at a time, by the largest that divides every address and size, and its dtype.
_UNITS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


class Gather:
    """Copies tensors that live at ``ptrs`` (``nbytes`` each, contiguous, on the CPU) to ``offsets`` of a region
    of ``size`` bytes, in one ``index_select``; the region's other bytes get zeros.

    Raises:
        ValueError: the tensors do not fit the region (overlapping or past its end).
    """

    def __init__(self, ptrs: Sequence[int], nbytes: Sequence[int], offsets: Sequence[int], size: int) -> None:
        kept = [i for i, n in enumerate(nbytes) if n]  # (an empty tensor has no bytes, and may have no address)
        ptrs, nbytes, offsets = ([v[i] for i in kept] for v in (ptrs, nbytes, offsets))
        self._zeros = torch.zeros(1, dtype=torch.int64, device="cpu")  # (the padding's source, held while it lives)
        zero = self._zeros.data_ptr()
        unit, dtype = next((u, d) for u, d in _UNITS if all(v % u == 0 for v in (*ptrs, *nbytes, *offsets, size, zero)))
        src = np.asarray(ptrs, dtype=np.int64)
        count = np.asarray(nbytes, dtype=np.int64) // unit
        dst = np.asarray(offsets, dtype=np.int64) // unit
        ends = dst + count
        order = np.argsort(dst, kind="stable")
        if (ends[order][:-1] > dst[order][1:]).any() or (ends > size // unit).any():
            raise ValueError("the tensors overlap in the region or run past its end")
        lo = min([zero, *ptrs])
        hi = max([zero + unit, *(p + n for p, n in zip(ptrs, nbytes, strict=True))])
        words = (hi - lo) // unit
        index = np.full(size // unit, (zero - lo) // unit, dtype=np.int64 if words > 2**31 - 1 else np.int32)
        # every destination word of a tensor: its first word's index plus its place in the tensor
        total = int(count.sum())
        starts = np.repeat(np.cumsum(count) - count, count)
        within = np.arange(total, dtype=np.int64) - starts
        index[np.repeat(dst, count) + within] = np.repeat((src - lo) // unit, count) + within
        self.index = torch.from_numpy(index)
        self._memory = (ctypes.c_char * (hi - lo)).from_address(lo)  # (the view below keeps it too)
        self.source = torch.frombuffer(self._memory, dtype=dtype)
        self.dtype = dtype
        self.size = size

    def __call__(self, region: torch.Tensor) -> None:
        """Copy the tensors into ``region`` (``size`` contiguous bytes, viewed as this gather's ``dtype``)."""
        torch.index_select(self.source, 0, self.index, out=region)
