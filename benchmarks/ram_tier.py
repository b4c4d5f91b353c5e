"""RAM tier benchmark: zfec erasure coding (``backends/ram/erasure.py``) and restore from RAM (``RamTier``).

    python benchmarks/ram_tier.py            # ~1.5 GB state (1536 MiB of fp32 tensors)
    python benchmarks/ram_tier.py --quick    # ~200 MB, under 2 minutes on 2 cores

One process, one machine. The state is a dict of fp32 tensors (``randn``, 16 large ones and a few small ones);
for the encode/decode rows it is packed back to back into one buffer, the object the RAM tier erasure codes (what
the arena hands to the tier). Every timed row runs ``--repeats`` times (default 5); the table shows the median and
the spread ``(max - min) / median``. Other processes on the machine show up in the spread. The targets are judged on
the medians; each target line also gives the ratio of the best runs (ours and the reference alike). Erasure code: k=4 data
and m=2 parity shares, blocks of at most ``erasure.DEFAULT_BLOCK`` (128 KiB).

Rows
----
1. **Encode** (input bytes/s: bytes of the object per second):

   * ``memcpy``: one ``ctypes.memmove`` of the object into a preallocated, already touched buffer (one thread);
   * ``zfec raw, 1 core``: ``zfec.Encoder(4, 6).encode(blocks, (4, 5))`` over every stripe of 4 blocks
     of the same bytes (memoryviews, no copy), one thread: zfec's own single-core rate (the parity only; the
     last partial stripe is zero-padded into a scratch buffer as ``erasure.encode`` does);
   * ``zfec raw, N threads``: the same, each of ``N`` threads (the cores ``erasure.encode`` uses) taking its share
     of the stripes: how far zfec itself scales on this machine (on a VM the cores may not give N times one);
   * ``erasure.encode, parity``, 1 thread and ``os.cpu_count()`` threads: the coding itself, the work ``zfec raw``
     does. The data shares are the object's own bytes (contiguous slices, see ``backends/ram/erasure.py``), so they are
     passed as ``None`` and zfec's C ``fec_encode`` reads the object where it lies and writes the 2 parity shares
     straight into preallocated, touched share buffers (0.8 GB of distinct memory, where zfec's Python API hands
     back, and here drops, fresh ``bytes`` per stripe that the allocator recycles in the cache);
   * ``erasure.encode, parity + data shares``: the same, also copying the 4 data shares into share buffers of their
     own (what the RAM tier's write does, into ``/dev/shm`` files), against ``zfec raw + memcpy of the object`` on
     one core (the same output bytes);
   * ``write_snapshot -> RamTier 4+2``: the tier's whole write path for a snapshot staged by the arena (one packed
     buffer): share 0 and the parity shares encoded into fresh ``/dev/shm`` files (page faults, tmpfs
     allocation), xxh3 of every share, manifest. All six shares stay in this process's directory: with one process
     there are no peer nodes, so the tier is bound as node 0 of 6 and its ``distribute`` step (send shares 1..5 to
     nodes 1..5 over gloo, data shares 1..3 straight from the staged object) is replaced by
     ``RamTier._place_all_here``, which writes data shares 1..3 into fresh files here too (what the peers would
     allocate and receive) and the ``layout.json`` that ``distribute`` would have written.

   Target: ``erasure.encode`` with all cores >= 0.9 x (zfec raw 1-core rate x cores used), cores used being
   ``min(os.cpu_count(), stripes)`` (the threads ``erasure.encode`` actually starts).

2. **Decode** (output bytes/s), the same comparisons, from the 4 data shares (no parity needed: copies only) and
   with m=2 shares missing (shares 0 and 1 lost: zfec rebuilds them from shares 2-5). ``zfec raw`` is
   ``zfec.Decoder(4, 6).decode(blocks, nums)`` per stripe on one thread. Every decode is checked bitwise against
   the object once (untimed).

3. **Memory** held per snapshot: the share bytes ``(k + m) x share_nbytes`` from ``erasure.layout`` (padding
   included) against 2x full replication, and the files the RAM tier actually wrote to ``/dev/shm`` (allocated
   blocks, ``st_blocks x 512``, manifest and ``layout.json`` included) for 4+2 and for ``erasure=None``.

4. **Restore** of the whole state into preallocated, touched target tensors (as a model's parameters are) unless
   said otherwise, page cache warm everywhere (one untimed read first):

   * ``memcpy of the state``: ``ctypes.memmove`` of every tensor into one preallocated buffer (one thread); the
     reference of the ratios;
   * ``RAM, all local``: ``RamTier(erasure=None)`` in ``/dev/shm``: ``RamTier.restore`` (``prepare_restore`` +
     ``read_manifest`` + ``read_section(targets=...)``, every 8 MiB chunk verified with xxh3, + ``finish_restore``);
     also into fresh tensors (no targets);
   * ``RAM 4+2, all 6 shares``: the same on the 4+2 tier: the loader reads the object's bytes straight from the 4
     data shares (no whole object is rebuilt, no share hashed up front) and verifies every 8 MiB chunk; a chunk
     that failed would make every share be hashed and the corrupted ones rebuilt (not timed: nothing fails here);
   * ``RAM 4+2, 2 shares missing``: shares 0 and 1 deleted; ``prepare_restore`` rebuilds the two lost data shares
     from parity into share-sized ``/dev/shm`` files, then the loader reads as above;
   * ``LocalTier``: the same read from a ``LocalTier`` in a temporary directory under ``--dir`` (a disk);
   * ``torch.load``: ``torch.load(weights_only=True)`` of a ``torch.save`` of the same state dict in the same
     directory (fresh tensors).

   Target: restore from RAM with all shares local (``RamTier(erasure=None)``, into targets) <= 1.5 x one memcpy of
   the state. The 4+2 tier with all 6 shares local is printed against the same bound (a stricter reading of the
   target).

Everything the benchmark creates lives in a temporary directory under ``/dev/shm`` and one under ``--dir``; both
are removed at the end, also on error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zfec

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # the harness and the library

import _harness as harness  # noqa: E402
from _harness import Timing  # noqa: E402

from lightning_snapshot.backends import LocalTier, RamTier
from lightning_snapshot.backends.ram import erasure as ec
from lightning_snapshot.backends.ram.tier import allocated_bytes
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.format.manifest import step_dirname
from lightning_snapshot.persist.writer import SnapshotJob, write_snapshot
from lightning_snapshot.restore.loader import read_manifest, read_section
from lightning_snapshot.staging import stage, tensor_bytes
from lightning_snapshot.staging.arena import HostArena

K, M = 4, 2
MiB = 1 << 20
GB = 1e9
RESTORE_TARGET = 1.5
ENCODE_TARGET = 0.9
RUN_ID = "bench"


# ================================================================================================ helpers
def touched(nbytes: int) -> torch.Tensor:
    """A buffer of ``nbytes`` whose pages are already faulted in."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(0)
    return t


def addr(t: torch.Tensor) -> int:
    return t.data_ptr()


def make_state(nbytes: int) -> dict[str, torch.Tensor]:
    """16 large fp32 tensors and a few small ones, ~``nbytes`` in all."""
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    small = [(1024,), (768,), (3, 5), (4096,)]
    small_bytes = sum(4 * int(torch.Size(s).numel()) for s in small)
    n = (nbytes - small_bytes) // 4 // 16
    for i in range(16):
        state[f"layer{i:02d}.weight"] = torch.randn(n, generator=g)
        if i < len(small):
            state[f"layer{i:02d}.bias"] = torch.randn(small[i], generator=g)
    return state


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def memcpy_state(state: dict[str, torch.Tensor], dst: torch.Tensor) -> None:
    harness.memmove_into(state.values(), addr(dst))


# ================================================================================================ raw zfec
def stripes_of(data: memoryview, lay: ec.ShareLayout, pad: bytearray, which: range | None = None):  # type: ignore[no-untyped-def]
    """The k input blocks of every stripe of ``data`` (or of the stripes ``which``; block i of stripe s: the
    object's bytes at ``lay.data_offset(i, s)``; a block past the object's end zero-padded into ``pad``)."""
    k, b, n = lay.k, lay.block, lay.nbytes
    pv = memoryview(pad)
    for s in which if which is not None else range(lay.stripes):
        blocks = []
        for i in range(k):
            lo = lay.data_offset(i, s)
            if lo + b <= n:
                blocks.append(data[lo : lo + b])
            else:
                have = max(0, n - lo)
                pad[i * b : (i + 1) * b] = bytes(b)
                pad[i * b : i * b + have] = data[lo : lo + have]
                blocks.append(pv[i * b : (i + 1) * b])
        yield tuple(blocks)


def zfec_encode_raw(data: memoryview, lay: ec.ShareLayout, threads: int = 1) -> None:
    """zfec's Python API over every stripe; with ``threads`` > 1, each thread its own share of the stripes (zfec
    releases the GIL while it encodes): how far zfec itself scales on this machine's cores."""
    parity = tuple(range(lay.k, lay.k + lay.m))

    def part(t: int) -> None:
        enc = zfec.Encoder(lay.k, lay.k + lay.m)
        pad = bytearray(lay.k * lay.block)
        for blocks in stripes_of(data, lay, pad, range(t, lay.stripes, threads)):
            enc.encode(blocks, parity)

    if threads == 1:
        part(0)
        return
    with cf.ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(part, range(threads)))


def zfec_decode_raw(shares: dict[int, memoryview], lay: ec.ShareLayout) -> None:
    dec = zfec.Decoder(lay.k, lay.k + lay.m)
    use = sorted(shares)[: lay.k]
    nums, b = tuple(use), lay.block
    for s in range(lay.stripes):
        dec.decode(tuple(shares[i][s * b : (s + 1) * b] for i in use), nums)


# ================================================================================================ RAM tier
def keep_all_shares_here(ram: RamTier) -> None:
    """Replace ``ram.distribute`` (send shares to peer nodes over gloo) for a one-process run: every share is kept
    in this node's directory (data shares 1..3, which ``distribute`` sends from the staged object itself, are
    written into files here) with the ``layout.json`` that ``distribute`` writes."""
    ram.distribute = lambda comm, prefix, run_id: ram._place_all_here()  # type: ignore[method-assign]


def restore(tier: Any, step: int, targets: dict[str, torch.Tensor] | None) -> Any:
    def read() -> Any:
        manifest = read_manifest(tier, step)
        return read_section(tier, manifest, manifest.tensors, manifest.state, targets)

    return tier.restore(LocalComm(), step, read) if hasattr(tier, "restore") else read()


def check_equal(got: Any, state: dict[str, torch.Tensor], what: str) -> None:
    for name, t in state.items():
        if not torch.equal(got[name], t):
            raise AssertionError(f"{what}: tensor {name} differs from the saved state")


# ================================================================================================ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="~200 MB state (under 2 minutes)")
    p.add_argument("--mib", type=int, default=None, help="state size in MiB (default 1536, --quick 200)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"), help="disk directory for LocalTier/torch.save")
    p.add_argument("--shm", default="/dev/shm", help="shared-memory directory for the RAM tier")
    harness.add_arguments(p, strict=True)
    args = p.parse_args(argv)
    nbytes = (args.mib or (200 if args.quick else 1536)) * MiB
    repeats = max(1, args.repeats)
    cores = os.cpu_count() or 1

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    shm_root = tempfile.mkdtemp(prefix="ls-ram-bench-", dir=args.shm)
    disk_root = tempfile.mkdtemp(prefix="ls-ram-bench-", dir=args.dir)
    arena = HostArena(shm_dir=shm_root)
    out = harness.Report("ram-tier", args)
    try:
        return run(args, nbytes, repeats, cores, Path(shm_root), Path(disk_root), arena, out)
    finally:
        arena.close()
        shutil.rmtree(shm_root, ignore_errors=True)
        shutil.rmtree(disk_root, ignore_errors=True)


def run(
    args: argparse.Namespace,
    nbytes: int,
    repeats: int,
    cores: int,
    shm: Path,
    disk: Path,
    arena: HostArena,
    report: harness.Report,
) -> int:
    t_start = time.perf_counter()
    state = make_state(nbytes)
    total = state_nbytes(state)
    # the object the RAM tier codes: the state packed back to back
    obj = torch.empty(total, dtype=torch.uint8)
    memcpy_state(state, obj)
    data = tensor_bytes(obj)
    lay = ec.layout(total, K, M)
    used = ec._threads(lay.stripes, cores)
    report.header(
        state=f"{total / GB:.3f} GB in {len(state)} tensors",
        erasure=f"{K}+{M}, block {lay.block} B, {lay.stripes} stripes",
        cores=f"{cores} (encode/decode threads used: {used})",
        repeats=repeats,
    )

    # ------------------------------------------------------------------------------------- 1. encode
    copy_dst = touched(total)
    memcpy_obj = harness.repeat(lambda: ctypes.memmove(addr(copy_dst), addr(obj), total), repeats)
    zraw_enc = harness.repeat(lambda: zfec_encode_raw(data, lay), repeats)
    zraw_enc_n = harness.repeat(lambda: zfec_encode_raw(data, lay, used), repeats)
    share_bufs = [touched(lay.share_nbytes) for _ in range(K + M)]
    shares = [tensor_bytes(t) for t in share_bufs]
    parity_only = [None] * K + shares[K:]
    enc1 = harness.repeat(lambda: ec.encode(data, lay, parity_only, threads=1), repeats)
    encn = harness.repeat(lambda: ec.encode(data, lay, parity_only, threads=cores), repeats)
    enc_copy = harness.repeat(lambda: ec.encode(data, lay, shares, threads=cores), repeats)
    # correctness: parity shares must equal raw zfec's
    enc = zfec.Encoder(K, K + M)
    pad = bytearray(K * lay.block)
    b = lay.block
    for s, blocks in enumerate(stripes_of(data, lay, pad)):
        if s % max(1, lay.stripes // 8):
            continue
        for j, blk in enumerate(enc.encode(blocks, (4, 5))):
            if bytes(shares[K + j][s * b : (s + 1) * b]) != blk:
                raise AssertionError(f"erasure.encode: parity share {K + j} of stripe {s} differs from zfec's")
    print(f"encode done ({time.perf_counter() - t_start:.0f} s)", flush=True)

    # ------------------------------------------------------------------------------------- 2. decode
    out = touched(total)
    out_view = tensor_bytes(out)
    all_data = {i: shares[i] for i in range(K)}
    missing = {i: shares[i] for i in range(M, K + M)}  # shares 0 and 1 lost
    dec_rows: dict[str, tuple[Timing, Timing, Timing]] = {}
    for label, have in (("4 data shares", all_data), (f"{M} shares missing", missing)):
        zr = harness.repeat(lambda have=have: zfec_decode_raw(have, lay), repeats)
        d1 = harness.repeat(lambda have=have: ec.decode(have, lay, out_view, threads=1), repeats)
        out.fill_(0)
        dn = harness.repeat(lambda have=have: ec.decode(have, lay, out_view, threads=cores), repeats)
        if not torch.equal(out, obj):
            raise AssertionError(f"erasure.decode from {sorted(have)} did not rebuild the object")
        dec_rows[label] = (zr, d1, dn)
    # free the buffers (memory for the rows below; the timed lambdas above hold these names)
    share_bufs = shares = all_data = missing = out = out_view = copy_dst = data = obj = None  # type: ignore[assignment]
    print(f"decode done ({time.perf_counter() - t_start:.0f} s)", flush=True)

    # ------------------------------------------------------------------------------------- 3. write + memory
    staged_handle = arena.stage_async(state, lambda t: True, step=1)
    staged_handle.wait()
    staged = staged_handle.state
    empty_rank = stage({}, "rank")
    ram_ec = RamTier(every_n_train_steps=1, keep_last=None, erasure=(K, M), name="ec", shm_dir=str(shm))
    ram_ec.bind(node_rank=0, num_nodes=K + M, local_rank=0, ranks_per_node=1, default_name="ec")
    keep_all_shares_here(ram_ec)
    ram_plain = RamTier(every_n_train_steps=1, keep_last=None, erasure=None, name="plain", shm_dir=str(shm))
    ram_plain.bind(node_rank=0, num_nodes=1, local_rank=0, ranks_per_node=1, default_name="plain")
    local = LocalTier(disk / "local", keep_last=None)
    step = [0]

    def write_to(tier: Any) -> Callable[[], None]:
        def go() -> None:
            step[0] += 1
            write_snapshot(tier, LocalComm(), SnapshotJob(step[0], 0, staged, empty_rank), RUN_ID)

        return go

    def drop_old(tier: Any) -> Callable[[], None]:
        def go() -> None:
            if step[0]:
                tier.delete(step_dirname(step[0]))

        return go

    write_ec = harness.repeat(write_to(ram_ec), repeats, before=drop_old(ram_ec))
    step_ec = step[0]
    write_plain = harness.repeat(write_to(ram_plain), repeats, before=drop_old(ram_plain))
    step_plain = step[0]
    write_snapshot(local, LocalComm(), SnapshotJob(step_plain, 0, staged, empty_rank), RUN_ID)
    obj_nbytes = read_manifest(ram_ec, step_ec).objects
    obj_total = sum(o.nbytes for o in obj_nbytes)
    obj_lay = ec.layout(obj_total, K, M)  # the tier codes the object as written (the arena's packed region)
    held_ec = allocated_bytes(ram_ec.node_dir)
    held_plain = allocated_bytes(ram_plain.node_dir)
    ec_files = [p for p in (ram_ec.node_dir / "store").rglob("*") if p.is_file() and p.name.isdigit()]
    share_files = sum(p.stat().st_size for p in ec_files)
    torch_file = disk / "state.pt"
    torch.save(state, torch_file)
    print(f"writes done ({time.perf_counter() - t_start:.0f} s)", flush=True)

    # ------------------------------------------------------------------------------------- 4. restore
    targets = {f"shared/{n}": torch.empty_like(t).fill_(0) for n, t in state.items()}
    manifest = read_manifest(ram_plain, step_plain)
    names = {e.name for e in manifest.tensors}
    if not set(targets) <= names:  # the entry names are the staging prefix + the key; map by suffix otherwise
        by_suffix = {n.rsplit("/", 1)[-1]: n for n in names}
        targets = {by_suffix[n]: t for n, t in zip(state, targets.values())}
    state_dst = touched(total)
    memcpy_st = harness.repeat(lambda: memcpy_state(state, state_dst), repeats)

    def restored(tier: Any, st: int, tg: dict[str, torch.Tensor] | None, what: str) -> Callable[[], None]:
        def go() -> None:
            got = restore(tier, st, tg)
            holder["last"] = got

        holder: dict[str, Any] = {}

        def check() -> None:
            got = holder["last"]
            flat = {n: got[n] for n in state} if all(n in got for n in state) else None
            if flat is None:  # nested under the section's prefix
                flat = {n: _lookup(got, n) for n in state}
            check_equal(flat, state, what)

        go.check = check  # type: ignore[attr-defined]
        return go

    rows: list[tuple[str, Timing]] = []
    cases: list[tuple[str, Any, int, dict[str, torch.Tensor] | None]] = [
        ("RAM, all local (erasure=None), into targets", ram_plain, step_plain, targets),
        ("RAM, all local (erasure=None), fresh tensors", ram_plain, step_plain, None),
        (f"RAM {K}+{M}, all {K + M} shares local", ram_ec, step_ec, targets),
    ]
    for label, tier, st, tg in cases:
        fn = restored(tier, st, tg, label)
        fn()  # warm (and checked)
        fn.check()  # type: ignore[attr-defined]
        rows.append((label, harness.repeat(fn, repeats)))
    for i in range(M):  # lose shares 0 .. m-1 (data shares: the rebuild needs parity)
        ram_ec.store.delete(f"{step_dirname(step_ec)}/{RUN_ID}-shared-00000.bin.ec/{i}")
    fn = restored(ram_ec, step_ec, targets, "missing")
    fn()
    fn.check()  # type: ignore[attr-defined]
    rows.append((f"RAM {K}+{M}, {M} shares missing (decode)", harness.repeat(fn, repeats)))
    fn = restored(local, step_plain, targets, "local")
    fn()
    fn.check()  # type: ignore[attr-defined]
    rows.append(("LocalTier on disk, page cache warm", harness.repeat(fn, repeats)))

    def tload() -> None:
        torch.load(torch_file, weights_only=True)

    check_equal(torch.load(torch_file, weights_only=True), state, "torch.load")
    rows.append(("torch.load(weights_only=True), warm", harness.repeat(tload, repeats)))
    print(f"restores done ({time.perf_counter() - t_start:.0f} s)", flush=True)

    # ------------------------------------------------------------------------------------- report
    def rate(t: Timing, n: int = total) -> float:
        return n / t.median / GB

    zr1 = rate(zraw_enc)
    mc = rate(memcpy_obj)
    rate_columns = ["", "GB/s", "spread", "x memcpy", "x zfec1c*thr"]

    def rate_row(table: harness.Table, label: str, t: Timing, per_zfec: float | None) -> None:
        """A row of GB/s; ``per_zfec``: the rate it is compared with (zfec raw 1-core x threads), if any."""
        r = rate(t)
        versus = None if per_zfec is None else r / per_zfec
        table.add(
            label,
            f"{r:.2f}",
            f"{t.spread:.0%}",
            f"{r / mc:.2f}",
            harness.fmt(versus, ".2f", ""),
            data={"row": label, "GBps": r, "spread": t.spread, "x_memcpy": r / mc, "x_zfec": versus, "runs_s": t.runs},
        )

    enc_table = harness.Table(
        f"Encode {K}+{M} of a {total / GB:.3f} GB object (input GB/s, median of {repeats})", rate_columns, key="encode"
    )
    enc_rows = [
        ("memcpy (ctypes.memmove, 1 thread)", memcpy_obj, None),
        ("zfec raw, 1 core (parity only)", zraw_enc, 1),
        (f"zfec raw, {used} threads (how zfec itself scales here)", zraw_enc_n, used),
        ("zfec raw + memcpy of the object, 1 core", Timing([zraw_enc.median + memcpy_obj.median]), 1),
        ("erasure.encode, parity, 1 thread", enc1, 1),
        (f"erasure.encode, parity, {used} threads", encn, used),
        (f"erasure.encode, parity + data shares, {used} threads", enc_copy, used),
        (f"write_snapshot -> RamTier {K}+{M} (/dev/shm, {ram_ec.threads or 'default'} thr)", write_ec, None),
        ("write_snapshot -> RamTier erasure=None (/dev/shm)", write_plain, None),
    ]
    for label, t, thr in enc_rows:
        rate_row(enc_table, label, t, zr1 * thr if thr else None)
    report.table(enc_table)

    dec_table = harness.Table(
        f"Decode {K}+{M} (output GB/s, median of {repeats})",
        rate_columns,
        key="decode",
        notes=["n/a: from the data shares zfec only hands its inputs back: no rate to scale by"],
    )
    rate_row(dec_table, "memcpy (ctypes.memmove, 1 thread)", memcpy_obj, None)
    for label, (zr, d1, dn) in dec_rows.items():
        zrr = rate(zr)
        for name, t, thr in (
            (f"zfec raw, 1 core, {label}", zr, 1),
            (f"erasure.decode, 1 thread, {label}", d1, 1),
            (f"erasure.decode, {used} threads, {label}", dn, used),
        ):
            if "missing" in label:
                rate_row(dec_table, name, t, zrr * thr)
            else:
                r = rate(t)
                dec_table.add(
                    name,
                    f"{r:.2f}",
                    f"{t.spread:.0%}",
                    f"{r / mc:.2f}",
                    "n/a",
                    data={"row": name, "GBps": r, "spread": t.spread, "x_memcpy": r / mc, "runs_s": t.runs},
                )
    report.table(dec_table)

    mem_table = harness.Table(
        "Memory held per snapshot",
        ["", "GB", "x state"],
        key="memory",
        notes=[
            f"{K}+{M} vs 2x replication: {(K + M) * lay.share_nbytes / (2 * total):.3f}x the memory; layout padding"
            f" {lay.padding} B; the object written by the tier is {obj_total} B ({obj_lay.padding} B padding)"
        ],
    )
    mem_rows = [
        ("state (one copy)", total),
        (f"{K}+{M} shares from erasure.layout ((k+m) x share_nbytes)", (K + M) * lay.share_nbytes),
        ("2x full replication", 2 * total),
        (f"RamTier {K}+{M}: share files written (st_size, all {K + M})", share_files),
        (f"RamTier {K}+{M}: /dev/shm allocated (st_blocks, all files)", held_ec),
        ("RamTier erasure=None: /dev/shm allocated (one local copy)", held_plain),
    ]
    for label, n in mem_rows:
        mem_table.add(label, f"{n / GB:.3f}", f"{n / total:.3f}", data={"row": label, "bytes": n})
    report.table(mem_table)

    ref = memcpy_st.median
    res_table = harness.Table(
        f"Restore of the {total / GB:.3f} GB state (seconds, median of {repeats}; x memcpy of the state)",
        ["", "s", "GB/s", "spread", "x memcpy"],
        key="restore",
    )
    for label, t in [("memcpy of the state (ctypes.memmove, 1 thread)", memcpy_st)] + rows:
        res_table.add(
            label,
            f"{t.median:.3f}",
            f"{rate(t):.2f}",
            f"{t.spread:.0%}",
            f"{t.median / ref:.2f}",
            data={
                "row": label,
                "s": t.median,
                "GBps": rate(t),
                "spread": t.spread,
                "x_memcpy": t.median / ref,
                "runs_s": t.runs,
            },
        )
    report.table(res_table)

    check = report.targets
    enc_goal = ENCODE_TARGET * zr1 * used
    check.check(
        rate(encn) >= enc_goal,
        f"erasure.encode (parity) with {used} threads >= {ENCODE_TARGET} x {zr1:.2f} GB/s x {used} ="
        f" {enc_goal:.2f} GB/s: {rate(encn):.2f} GB/s = {rate(encn) / (zr1 * used):.2f}x"
        f" (best runs: {zraw_enc.best / encn.best / used:.2f}x)",
        rate(encn),
        enc_goal,
    )
    check.info(
        f"erasure.encode against zfec raw on {used} threads, {rate(zraw_enc_n):.2f} GB/s:"
        f" {rate(encn) / rate(zraw_enc_n):.2f}x"
    )
    zc1 = total / (zraw_enc.median + memcpy_obj.median) / GB
    check.info(
        f"encode copying the {K} data shares too, {total / GB:.3f} GB, which zfec raw does not: against"
        f" zfec raw + that memcpy on one core, {zc1:.2f} GB/s x {used}, it is"
        f" {rate(enc_copy) / (zc1 * used):.2f}x"
    )
    ram_all = rows[0][1].median
    check.check(
        ram_all <= RESTORE_TARGET * ref,
        f"restore from RAM, all local <= {RESTORE_TARGET} x memcpy ({RESTORE_TARGET * ref:.3f} s):"
        f" {ram_all:.3f} s = {ram_all / ref:.2f}x (best runs: {rows[0][1].best / memcpy_st.best:.2f}x)",
        ram_all,
        RESTORE_TARGET * ref,
    )
    ec_all = rows[2][1].median  # (not ``ram_ec``: that name is the 4+2 tier above)
    check.info(
        f"the {K}+{M} tier with all {K + M} shares local: {ec_all:.3f} s = {ec_all / ref:.2f}x ->"
        f" {'within' if ec_all <= RESTORE_TARGET * ref else 'over'} the same bound"
    )
    return report.finish()


def _lookup(tree: Any, name: str) -> torch.Tensor:
    if isinstance(tree, dict):
        if name in tree:
            return tree[name]
        for v in tree.values():
            try:
                return _lookup(v, name)
            except KeyError:
                pass
    raise KeyError(name)


if __name__ == "__main__":
    sys.exit(main())
