"""Erasure coding of snapshot objects with zfec: k data shares and m parity shares, any k of which rebuild the object.

Every share has ``S = stripes * block`` bytes. Data share ``i`` (``i < k``) is the object's own bytes ``[i * S,
(i + 1) * S)``, contiguous, zero-padded past the object's end (the padding stays below ``64 * k * stripes`` bytes);
parity share ``k + j`` is zfec's Reed-Solomon parity. Stripe ``s`` is block ``[s * block, (s + 1) * block)`` of every
share: zfec codes each stripe's ``k`` data blocks into its ``m`` parity blocks. Because the data shares are slices of
the object, coding needs no copy of the data (``encode`` takes ``None`` for a data share it need not copy), and a
reader finds any byte of the object in one data share. Stripes are independent, so encoding and decoding run on
several threads: about 1.2 GB/s per core.

zfec's C functions (``fec_encode``/``fec_decode`` of its ``fec.c``, exported by the ``zfec._fec`` extension module)
are called through ctypes, which releases the GIL during the call: their input pointers point straight into the
object or the shares and their output pointers straight into the parity shares (or the rebuilt object), so nothing
is allocated or copied per stripe (but the block of a stripe that runs past the object's end, zero-padded into a
scratch block). Where they cannot be loaded (another zfec build), the same shares are made through zfec's Python API
(``zfec.Encoder``/``zfec.Decoder``), which returns fresh ``bytes`` per block that are then copied.

Pure functions over buffers: no I/O, no process group. Called by the RAM tier: ram/tier.py (checking
``erasure``, encoding an object), ram/shares.py (share layouts) and ram/rebuild.py (rebuilding lost shares).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import zfec

from lightning_snapshot.dist.forksafe import Executor
from lightning_snapshot.errors import ChecksumError, ConfigError

__all__ = ["DEFAULT_BLOCK", "ShareLayout", "check_params", "decode", "encode", "layout", "rebuild"]

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

    def data_offset(self, i: int, stripe: int) -> int:
        """Where block ``i`` (``i < k``) of ``stripe`` starts in the object (it may run past the object's end)."""
        return i * self.share_nbytes + stripe * self.block


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


class _Native:
    """zfec's C functions through ctypes (see the module docstring)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, ptr, u16, size = ctypes.c_void_p, ctypes.POINTER, ctypes.c_ushort, ctypes.c_size_t
        lib.fec_init.argtypes, lib.fec_init.restype = [], None
        lib.fec_new.argtypes, lib.fec_new.restype = [u16, u16], vp
        lib.fec_free.argtypes, lib.fec_free.restype = [vp], None
        lib.fec_encode.argtypes = [vp, ptr(vp), ptr(vp), ptr(ctypes.c_uint), size, size]
        lib.fec_encode.restype = None
        lib.fec_decode.argtypes = [vp, ptr(vp), ptr(vp), ptr(ctypes.c_uint), size]
        lib.fec_decode.restype = None
        lib.fec_init()  # idempotent (zfec's module init already ran it); fec_new returns NULL without it
        self.lib = lib

    def new(self, k: int, n: int) -> int:
        """A ``fec_t*`` for ``k`` of ``n`` blocks; free it with ``self.lib.fec_free``. Thread-safe to use."""
        code = self.lib.fec_new(k, n)
        if not code:
            raise RuntimeError(f"zfec's fec_new({k}, {n}) failed")
        return int(code)


def _load_native() -> _Native | None:
    """Bind zfec's C functions and check them against zfec's Python API on a small object; None if that fails."""
    try:
        from zfec import _fec  # noqa: PLC2701

        nat = _Native(ctypes.CDLL(_fec.__file__))
        k, n, b = 3, 5, 256
        blocks = [bytes((i * 7 + j * 13) % 251 for j in range(b)) for i in range(k)]
        want = list(zfec.Encoder(k, n).encode(blocks, tuple(range(k, n))))
        src = [ctypes.create_string_buffer(x, b) for x in blocks]
        out = [ctypes.create_string_buffer(b) for _ in range(n - k)]
        code = nat.new(k, n)
        try:
            nat.lib.fec_encode(
                code,
                (ctypes.c_void_p * k)(*[ctypes.addressof(x) for x in src]),
                (ctypes.c_void_p * (n - k))(*[ctypes.addressof(x) for x in out]),
                (ctypes.c_uint * (n - k))(*range(k, n)),
                n - k,
                b,
            )
        finally:
            nat.lib.fec_free(code)
    except (ImportError, OSError, AttributeError, TypeError, ValueError, RuntimeError, ctypes.ArgumentError):
        return None
    return nat if [x.raw for x in out] == want else None


#: zfec's C functions, or None where they cannot be loaded (zfec's Python API is used then).
_NATIVE = _load_native()


def _addr(view: memoryview) -> int:
    """The address of a buffer's first byte (read-only buffers too), for copies that release the GIL."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def _copy(dst: int, src: int, n: int) -> None:
    if n:
        ctypes.memmove(dst, src, n)  # a ctypes call: the GIL is released while it copies


def _threads(stripes: int, threads: int | None) -> int:
    n = threads if threads is not None else min(8, os.cpu_count() or 1)
    return max(1, min(n, stripes))


#: Stripes a thread takes at a time (16 x 4 x 128 KiB = 8 MiB of a 4+2 object: a few milliseconds of zfec).
_GRAIN = 16


def _run(fn: Callable[[int, int], None], stripes: int, threads: int | None) -> None:
    """``fn(a, z)`` over stripes ``[0, stripes)`` on up to ``threads`` threads, each taking the next ``_GRAIN``
    stripes when it is done with its last (a core slowed by another process does not hold the others up)."""
    n = _threads(stripes, threads)
    if n == 1:
        fn(0, stripes)
        return
    grain = max(1, min(_GRAIN, stripes // (4 * n)))
    starts = iter(range(0, stripes, grain))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                a = next(starts, None)
            if a is None:
                return
            fn(a, min(a + grain, stripes))

    with Executor(max_workers=n, thread_name_prefix="lightning-snapshot-zfec") as pool:
        for f in [pool.submit(worker) for _ in range(n)]:
            f.result()


def encode(data: memoryview, lay: ShareLayout, shares: list[memoryview | None], *, threads: int | None = None) -> None:
    """Fill ``shares`` (``k + m`` writable buffers of ``lay.share_nbytes`` each) with the shares of ``data``.

    A data share given as ``None`` is not copied (its bytes are ``data``'s, see the module docstring): with every
    data share ``None`` only the parity is computed, reading the object where it lies.
    """
    k, m = lay.k, lay.m
    if (
        data.nbytes != lay.nbytes
        or len(shares) != k + m
        or any((s is None and i >= k) or (s is not None and s.nbytes != lay.share_nbytes) for i, s in enumerate(shares))
    ):
        raise ValueError("encode: buffers do not match the share layout")
    data = data.cast("B") if data.format != "B" else data
    (_encode_native if _NATIVE is not None else _encode_py)(data, lay, shares, threads)


def _fill(dst: int, src: int, lo: int, size: int, n: int) -> None:
    """Copy bytes ``[lo, lo + size)`` of the ``n``-byte object at ``src`` to ``dst``, zeros past its end."""
    have = max(0, min(size, n - lo))
    _copy(dst, src + lo, have)
    if have < size:
        ctypes.memset(dst + have, 0, size - have)


def _encode_native(data: memoryview, lay: ShareLayout, shares: list[memoryview | None], threads: int | None) -> None:
    assert _NATIVE is not None
    k, m, b, n, lib = lay.k, lay.m, lay.block, lay.nbytes, _NATIVE.lib
    src = _addr(data)
    dst = [_addr(sh) if sh is not None else 0 for sh in shares]
    code = _NATIVE.new(k, k + m) if m else 0
    nums = (ctypes.c_uint * max(1, m))(*range(k, k + m))

    def work(a: int, z: int) -> None:
        ins = (ctypes.c_void_p * k)()
        outs = (ctypes.c_void_p * max(1, m))()
        pad = None
        for s in range(a, z):
            off = s * b
            for i in range(k):
                lo = lay.data_offset(i, s)
                if dst[i]:  # copied into its share, which zfec then reads (still in the cache)
                    _fill(dst[i] + off, src, lo, b, n)
                    ins[i] = dst[i] + off
                elif lo + b <= n:
                    ins[i] = src + lo
                else:  # a block past the object's end: zero-padded
                    if pad is None:
                        pad = ctypes.create_string_buffer(k * b)
                    _fill(ctypes.addressof(pad) + i * b, src, lo, b, n)
                    ins[i] = ctypes.addressof(pad) + i * b
            if m:
                for j in range(m):
                    outs[j] = dst[k + j] + off
                lib.fec_encode(code, ins, outs, nums, m, b)  # the GIL is released while it encodes

    try:
        _run(work, lay.stripes, threads)
    finally:
        if code:
            lib.fec_free(code)


def _encode_py(data: memoryview, lay: ShareLayout, shares: list[memoryview | None], threads: int | None) -> None:
    """zfec's Python API: a fresh ``bytes`` per parity block, copied into its share."""
    k, m, b, n = lay.k, lay.m, lay.block, lay.nbytes
    enc = zfec.Encoder(k, k + m)
    parity = tuple(range(k, k + m))
    src = _addr(data)
    dst = [_addr(sh) if sh is not None else 0 for sh in shares]

    def work(a: int, z: int) -> None:
        pad = bytearray(k * b)
        pv = memoryview(pad)
        pad_addr = _addr(pv)
        for s in range(a, z):
            blocks = []
            for i in range(k):
                lo = lay.data_offset(i, s)
                if dst[i]:
                    _fill(dst[i] + s * b, src, lo, b, n)
                if lo + b <= n:
                    blocks.append(data[lo : lo + b])
                else:  # a block past the object's end: zero-padded
                    _fill(pad_addr + i * b, src, lo, b, n)
                    blocks.append(pv[i * b : (i + 1) * b])
            if m:
                for j, blk in enumerate(enc.encode(tuple(blocks), parity)):
                    _copy(dst[k + j] + s * b, _addr(memoryview(blk)), b)

    _run(work, lay.stripes, threads)


def decode(shares: dict[int, memoryview], lay: ShareLayout, out: memoryview, *, threads: int | None = None) -> None:
    """Rebuild the object into ``out`` (``lay.nbytes`` writable bytes) from any ``k`` of its shares.

    ``shares`` maps share index -> buffer; the data shares among them are used first, then the parity shares with
    the lowest indices. Raises :class:`~lightning_snapshot.errors.ChecksumError` with fewer than ``k`` shares.
    """
    k = lay.k
    if len(shares) < k:
        raise ChecksumError(f"{len(shares)} of the {k} shares needed to rebuild an object are available")
    if out.nbytes != lay.nbytes:
        raise ValueError("decode: output buffer does not match the share layout")
    out = out.cast("B") if out.format != "B" else out
    use = sorted(shares)[:k]
    for i in use:
        if not 0 <= i < lay.k + lay.m or shares[i].nbytes != lay.share_nbytes:
            raise ValueError(f"decode: share {i} does not match the share layout")
    (_decode_native if _NATIVE is not None else _decode_py)({i: shares[i] for i in use}, lay, out, threads)


def _positions(have: Iterable[int], k: int) -> list[int]:
    """zfec's input order for the ``k`` shares ``have``: data share i, when given, sits at position i; the parity
    shares fill the other positions in index order, and the data share of each such position is the one rebuilt."""
    have = set(have)
    parity = iter(sorted(i for i in have if i >= k))
    return [i if i in have else next(parity) for i in range(k)]


def _decode_native(shares: dict[int, memoryview], lay: ShareLayout, out: memoryview, threads: int | None) -> None:
    assert _NATIVE is not None
    k, b, n, lib = lay.k, lay.block, lay.nbytes, _NATIVE.lib
    share_addr = {i: _addr(v) for i, v in shares.items()}
    out_addr = _addr(out)
    index = _positions(shares, k)
    lost = [r for r in range(k) if index[r] >= k]
    code = _NATIVE.new(k, lay.k + lay.m) if lost else 0
    idx = (ctypes.c_uint * k)(*index)

    def work(a: int, z: int) -> None:
        for r in range(k):  # the data shares at hand: their stripes [a, z) are one run of the object
            lo = lay.data_offset(r, a)
            if index[r] < k and lo < n:
                _copy(out_addr + lo, share_addr[r] + a * b, min((z - a) * b, n - lo))
        if not lost:
            return
        ins = (ctypes.c_void_p * k)()
        outs = (ctypes.c_void_p * len(lost))()
        scratch = ctypes.create_string_buffer(len(lost) * b)
        for s in range(a, z):
            for r in range(k):
                ins[r] = share_addr[index[r]] + s * b
            for j, r in enumerate(lost):
                lo = lay.data_offset(r, s)
                outs[j] = out_addr + lo if lo + b <= n else ctypes.addressof(scratch) + j * b
            lib.fec_decode(code, ins, outs, idx, b)  # the GIL is released while it decodes
            for j, r in enumerate(lost):
                lo = lay.data_offset(r, s)
                if n - b < lo < n:  # the block runs past the object's end: its head only
                    _copy(out_addr + lo, ctypes.addressof(scratch) + j * b, n - lo)

    try:
        _run(work, lay.stripes, threads)
    finally:
        if code:
            lib.fec_free(code)


def _decode_py(shares: dict[int, memoryview], lay: ShareLayout, out: memoryview, threads: int | None) -> None:
    """zfec's Python API: fresh ``bytes`` per rebuilt block, copied into ``out``."""
    k, b, n = lay.k, lay.block, lay.nbytes
    use = sorted(shares)
    data_only = use == list(range(k))
    dec = None if data_only else zfec.Decoder(k, lay.k + lay.m)
    nums = tuple(use)

    out_addr = _addr(out)
    share_addr = {i: _addr(shares[i]) for i in use}

    def work(a: int, z: int) -> None:
        for s in range(a, z):
            if dec is None:
                prim_addr = [share_addr[i] + s * b for i in use]
            else:
                prim = dec.decode(tuple(shares[i][s * b : (s + 1) * b] for i in use), nums)
                prim_addr = [_addr(memoryview(p)) for p in prim]
            for i in range(k):
                lo = lay.data_offset(i, s)
                if lo < n:
                    _copy(out_addr + lo, prim_addr[i], min(b, n - lo))

    _run(work, lay.stripes, threads)


def rebuild(
    shares: dict[int, memoryview], lay: ShareLayout, out: dict[int, memoryview], *, threads: int | None = None
) -> None:
    """Rebuild lost *data shares* from any ``k`` shares: ``out`` maps each data share index missing from
    ``shares`` to a writable buffer of ``lay.share_nbytes``, filled with that share's bytes (the object's bytes, as
    :func:`encode` laid them out, padding included). The data shares present need no copy: a reader takes the
    object's bytes straight from the data shares (see ``RamTier``).

    Raises :class:`~lightning_snapshot.errors.ChecksumError` with fewer than ``k`` shares.
    """
    k = lay.k
    if len(shares) < k:
        raise ChecksumError(f"{len(shares)} of the {k} shares needed to rebuild an object are available")
    use = sorted(shares)[:k]
    lost = [r for r in range(k) if r not in use]
    if sorted(out) != lost:
        raise ValueError(f"rebuild: out must hold exactly the lost data shares {lost}, got {sorted(out)}")
    for i, v in [*((i, shares[i]) for i in use), *out.items()]:
        if not 0 <= i < lay.k + lay.m or v.nbytes != lay.share_nbytes:
            raise ValueError(f"rebuild: share {i} does not match the share layout")
    if not lost:
        return
    b = lay.block
    share_addr = {i: _addr(shares[i]) for i in use}
    out_addr = {r: _addr(v) for r, v in out.items()}
    if _NATIVE is None:
        dec = zfec.Decoder(k, lay.k + lay.m)
        nums = tuple(use)

        def work_py(a: int, z: int) -> None:
            for s in range(a, z):
                prim = dec.decode(tuple(shares[i][s * b : (s + 1) * b] for i in use), nums)
                for r in lost:
                    _copy(out_addr[r] + s * b, _addr(memoryview(prim[r])), b)

        _run(work_py, lay.stripes, threads)
        return
    lib = _NATIVE.lib
    index = _positions(use, k)
    code = _NATIVE.new(k, lay.k + lay.m)
    idx = (ctypes.c_uint * k)(*index)

    def work(a: int, z: int) -> None:
        ins = (ctypes.c_void_p * k)()
        outs = (ctypes.c_void_p * len(lost))()
        for s in range(a, z):  # one stripe a call: its k input and lost output blocks stay in the L2 cache
            for r in range(k):
                ins[r] = share_addr[index[r]] + s * b
            for j, r in enumerate(lost):
                outs[j] = out_addr[r] + s * b
            lib.fec_decode(code, ins, outs, idx, b)  # the GIL is released while it decodes

    try:
        _run(work, lay.stripes, threads)
    finally:
        lib.fec_free(code)
