"""Erasure coding of snapshot objects with zfec: k data shares and m parity shares, any k of which rebuild the object.

An object of ``n`` bytes is cut into *stripes* of ``k`` blocks of ``block`` bytes (the last stripe zero-padded);
share ``i`` is block ``i`` of every stripe, back to back, so every share has ``stripes * block`` bytes. Data shares
(``i < k``) are the object's own bytes; parity shares (``i >= k``) are zfec's Reed-Solomon blocks. Stripes are
independent, so encoding and decoding run on several threads (zfec releases the GIL): about 1 GB/s per core.

Pure functions over buffers: no I/O, no process group.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import os
from dataclasses import dataclass

import numpy as np
import zfec

from lightning_snapshot.errors import ChecksumError, ConfigError

__all__ = ["ShareLayout", "layout", "encode", "decode", "check_params", "DEFAULT_BLOCK"]

#: Largest block (bytes of one share per stripe): k blocks of a stripe stay in the L2 cache while they are copied
#: and encoded (measured here: 128 KiB scales better on two threads than 1 MiB).
DEFAULT_BLOCK = 128 << 10
_ALIGN = 64


def check_params(k: object, m: object) -> tuple[int, int]:
    """Validate ``(k, m)``; returns them as ints. zfec allows k + m <= 256."""
    for name, v, low in (("k", k, 1), ("m", m, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"erasure {name} must be an integer >= {low}, got {v!r} (erasure=(k, m), e.g. (4, 2))")
    assert isinstance(k, int) and isinstance(m, int)
    if k + m > 256:
        raise ConfigError(f"erasure=({k}, {m}): k + m must be at most 256 (zfec's limit)")
    return k, m


@dataclass(frozen=True)
class ShareLayout:
    """How an object of ``nbytes`` is cut: ``stripes`` stripes of ``k`` blocks of ``block`` bytes."""

    k: int
    m: int
    nbytes: int
    block: int
    stripes: int

    @property
    def share_nbytes(self) -> int:
        return self.stripes * self.block

    @property
    def padding(self) -> int:
        return self.stripes * self.k * self.block - self.nbytes


def layout(nbytes: int, k: int, m: int, block: int = DEFAULT_BLOCK) -> ShareLayout:
    """The share layout of an ``nbytes`` object: as few stripes as blocks of at most ``block`` bytes allow, with
    the block sized to the object, so the padding stays below ``64 * k * stripes`` bytes."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes == 0:
        return ShareLayout(k, m, 0, _ALIGN, 0)
    stripes = -(-nbytes // (k * block))
    per = -(-nbytes // (k * stripes))
    b = -(-per // _ALIGN) * _ALIGN
    return ShareLayout(k, m, nbytes, b, stripes)


def _addr(view: memoryview) -> int:
    """The address of a buffer's first byte (read-only buffers too), for copies that release the GIL."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def _copy(dst: int, src: int, n: int) -> None:
    if n:
        ctypes.memmove(dst, src, n)  # a ctypes call: the GIL is released while it copies


def _threads(stripes: int, threads: int | None) -> int:
    n = threads if threads is not None else min(8, os.cpu_count() or 1)
    return max(1, min(n, stripes))


def _run(fn, stripes: int, threads: int | None) -> None:  # type: ignore[no-untyped-def]
    n = _threads(stripes, threads)
    if n == 1:
        fn(0, stripes)
        return
    step = -(-stripes // n)
    with cf.ThreadPoolExecutor(max_workers=n, thread_name_prefix="lightning-snapshot-zfec") as pool:
        for f in [pool.submit(fn, a, min(a + step, stripes)) for a in range(0, stripes, step)]:
            f.result()


def encode(data: memoryview, lay: ShareLayout, shares: list[memoryview], *, threads: int | None = None) -> None:
    """Fill ``shares`` (``k + m`` writable buffers of ``lay.share_nbytes`` each) with the shares of ``data``."""
    k, m, b = lay.k, lay.m, lay.block
    if data.nbytes != lay.nbytes or len(shares) != k + m or any(s.nbytes != lay.share_nbytes for s in shares):
        raise ValueError("encode: buffers do not match the share layout")
    data = data.cast("B") if data.format != "B" else data
    enc = zfec.Encoder(k, k + m)
    parity = tuple(range(k, k + m))

    src = _addr(data)
    dst = [_addr(sh) for sh in shares]

    def work(a: int, z: int) -> None:
        pad = bytearray(k * b)
        pv = memoryview(pad)
        pad_addr = _addr(pv)
        for s in range(a, z):
            base = s * k * b
            if base + k * b <= lay.nbytes:
                blocks = tuple(data[base + i * b: base + (i + 1) * b] for i in range(k))
                origin = src + base
            else:  # the last stripe: zero-padded
                tail = lay.nbytes - base
                ctypes.memset(pad_addr, 0, k * b)
                _copy(pad_addr, src + base, tail)
                blocks = tuple(pv[i * b: (i + 1) * b] for i in range(k))
                origin = pad_addr
            for i in range(k):
                _copy(dst[i] + s * b, origin + i * b, b)
            if m:
                for j, blk in enumerate(enc.encode(blocks, parity)):
                    _copy(dst[k + j] + s * b, _addr(memoryview(blk)), b)

    _run(work, lay.stripes, threads)


def decode(shares: dict[int, memoryview], lay: ShareLayout, out: memoryview, *, threads: int | None = None) -> None:
    """Rebuild the object into ``out`` (``lay.nbytes`` writable bytes) from any ``k`` of its shares.

    ``shares`` maps share index -> buffer. Raises :class:`~lightning_snapshot.errors.ChecksumError` with fewer than ``k`` shares.
    """
    k, b = lay.k, lay.block
    if len(shares) < k:
        raise ChecksumError(f"{len(shares)} of the {k} shares needed to rebuild an object are available")
    if out.nbytes != lay.nbytes:
        raise ValueError("decode: output buffer does not match the share layout")
    out = out.cast("B") if out.format != "B" else out
    use = sorted(shares)[:k]
    for i in use:
        if not 0 <= i < lay.k + lay.m or shares[i].nbytes != lay.share_nbytes:
            raise ValueError(f"decode: share {i} does not match the share layout")
    data_only = use == list(range(k))
    dec = None if data_only else zfec.Decoder(k, lay.k + lay.m)
    nums = tuple(use)

    out_addr = _addr(out)
    share_addr = {i: _addr(shares[i]) for i in use}

    def work(a: int, z: int) -> None:
        for s in range(a, z):
            base = s * k * b
            if dec is None:
                prim_addr = [share_addr[i] + s * b for i in use]
            else:
                prim = dec.decode(tuple(shares[i][s * b: (s + 1) * b] for i in use), nums)
                prim_addr = [_addr(memoryview(p)) for p in prim]
            for i in range(k):
                lo = base + i * b
                if lo >= lay.nbytes:
                    break
                _copy(out_addr + lo, prim_addr[i], min(b, lay.nbytes - lo))

    _run(work, lay.stripes, threads)
