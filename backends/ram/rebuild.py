"""A node's part of a RAM-tier restore: what the node holds of a step (its inventory: the manifest, whole objects,
the shares that pass the check), then fetching what it lacks from the other nodes and rebuilding every
erasure-coded object readable from ``k`` good shares.

Functions of the node's store, with no tier state: :meth:`~lightning_snapshot.backends.ram.tier.RamTier.prepare_restore`
calls them on each node's first rank (it gathers the inventories and plans the transfers).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
from pathlib import Path
from typing import Any

from lightning_snapshot.backends.local import LocalTier
from lightning_snapshot.backends.mapped_files import close_map, exchange, map_existing, map_new
from lightning_snapshot.backends.ram import erasure as _ec
from lightning_snapshot.backends.ram.shares import EC, LAYOUT_FILE, READING_FILE, parse_layout, share_ok, view_of
from lightning_snapshot.errors import SnapshotError

__all__ = ["fetch_and_rebuild", "inventory"]


def inventory(store: LocalTier, prefix: str, *, leader: bool, verify: bool, threads: int | None) -> dict[str, Any]:
    """What this node's ``store`` holds of ``prefix``: the manifest text, whole objects and its shares of the right
    size (``verify``: only those whose xxh3 matches the layout's, hashed on up to ``threads`` threads). Only the
    node's ``leader`` rank looks (the others return an empty inventory)."""
    from lightning_snapshot.manifest import MANIFEST_NAME

    inv: dict[str, Any] = {"manifest": None, "whole": {}, "shares": {}, "bad": [], "broken": {}}
    if not leader:
        return inv
    with contextlib.suppress(OSError, UnicodeDecodeError):
        inv["manifest"] = store.read(f"{prefix}/{MANIFEST_NAME}").decode()
    checks: list[tuple[str, int, str, dict[str, Any]]] = []  # (key, share index, share key, layout)
    for name in store.list(prefix):
        if name.endswith(EC):
            key = f"{prefix}/{name[: -len(EC)]}"
            try:
                layout = parse_layout(store.read(f"{prefix}/{name}/{LAYOUT_FILE}"), key)
            except (OSError, SnapshotError) as e:
                inv["bad"].append(f"{key}: {e}")
                inv["broken"][key] = str(e)
                continue
            inv["shares"][key] = {"layout": layout, "good": []}
            for entry in store.list(f"{prefix}/{name}"):
                if entry.isdigit() and int(entry) < len(layout["checksums"]):
                    checks.append((key, int(entry), f"{prefix}/{name}/{entry}", layout))
        elif name.endswith(".bin"):
            inv["whole"][f"{prefix}/{name}"] = True

    def check(item: tuple[str, int, str, dict[str, Any]]) -> bool:
        _key, i, share, layout = item
        return share_ok(store._path(share), layout["stripes"] * layout["block"], layout["checksums"][i], verify)

    # every share hashed once, on as many threads as the tier codes with (xxh3 releases the GIL)
    workers = min(len(checks), threads or min(8, os.cpu_count() or 1)) if verify else 1
    if workers > 1:
        with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lightning-snapshot-verify") as pool:
            results = list(pool.map(check, checks))
    else:
        results = [check(c) for c in checks]
    for (key, i, _share, _layout), ok in zip(checks, results, strict=True):
        if ok:
            inv["shares"][key]["good"].append(i)
        else:
            why = "checksum mismatch" if verify else "wrong size"
            inv["bad"].append(f"{key} share {i} ({why}: corrupted, treated as missing)")
    return inv


def fetch_and_rebuild(
    store: LocalTier,
    comm: Any,
    transfers: list[tuple[int, int, str, int]],
    layouts: dict[str, dict[str, Any]],
    me: int,
    prefix: str,
    manifest: str,
    verified: dict[str, set[int]],
    verify: bool,
    threads: int | None,
) -> None:
    """Run this node leader's (rank ``me``) part of the ``transfers`` (src, dst, key, share index; -1: the whole
    object) over ``comm`` and rebuild every erasure-coded object of ``layouts`` in ``store`` from ``k`` good shares:
    its own that :func:`inventory` listed (``verified``), the others checked here (``verify``: hashed), on up to
    ``threads`` threads. Writes each object's ``reading.json``; received shares it did not use are removed."""
    from lightning_snapshot.manifest import Manifest

    sizes = {o.key: o.nbytes for o in Manifest.from_json(manifest, where=f"RAM tier manifest of {prefix}").objects}
    sends: list[tuple[Any, int]] = []
    receives: list[tuple[Any, int]] = []
    received: dict[str, dict[int, Any]] = {}
    try:
        if transfers and getattr(comm, "world_size", 1) > 1:
            for src, dst, key, i in transfers:
                if src == dst or me not in (src, dst):
                    continue
                if i < 0:
                    path = store._path(key)
                    size = sizes[key.rsplit("/", 1)[1]]
                else:
                    path = store._path(f"{key}{EC}/{i}")
                    size = layouts[key]["stripes"] * layouts[key]["block"]
                if me == src:
                    sends.append((map_existing(path), dst))
                else:
                    rpath = path if i < 0 else path.with_name(f".{i}.restore")
                    rpath.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                    receives.append((map_new(rpath, size), src))
                    if i >= 0:
                        received.setdefault(key, {})[i] = rpath
    except BaseException:
        for mm, _peer in sends + receives:
            close_map(mm)
        raise
    exchange(getattr(comm, "group", None), sends, receives)
    # make every erasure-coded object readable from its data shares, rebuilding the lost ones from parity
    for key, layout in layouts.items():
        if store.exists(key):
            continue
        lay = _ec.ShareLayout(layout["k"], layout["m"], layout["nbytes"], layout["block"], layout["stripes"])
        paths: dict[int, Path] = dict(received.get(key, {}))
        inv_dir = store._path(key + EC)
        for entry in sorted(os.listdir(inv_dir)) if inv_dir.is_dir() else []:
            if entry.isdigit() and int(entry) not in paths and int(entry) < lay.k + lay.m:
                paths[int(entry)] = inv_dir / entry
        maps: dict[int, Any] = {}
        used: set[Path] = set()
        try:
            for i, p in sorted(paths.items()):
                if i not in verified.get(key, ()) and not share_ok(p, lay.share_nbytes, layout["checksums"][i], verify):
                    continue
                maps[i] = map_existing(p, write=False)
                if len(maps) == lay.k:
                    break
            lost = [i for i in range(lay.k) if i not in maps]
            outs = {i: map_new(inv_dir / f".{i}.rebuilt", lay.share_nbytes) for i in lost if len(maps) >= lay.k}
            try:
                _ec.rebuild(
                    {i: view_of(mm) for i, mm in maps.items()},
                    lay,
                    {i: view_of(mm) for i, mm in outs.items()},
                    threads=threads,
                )
            finally:
                for mm in outs.values():
                    close_map(mm)
            files = [f".{i}.rebuilt" if i in outs else paths[i].name for i in range(lay.k)]
            used = {inv_dir / f for f in files}
            store.write(
                f"{key}{EC}/{READING_FILE}",
                [
                    json.dumps(
                        {"k": lay.k, "share_nbytes": lay.share_nbytes, "nbytes": lay.nbytes, "files": files}
                    ).encode()
                ],
            )
        finally:
            for mm in maps.values():
                close_map(mm)
            for p in received.get(key, {}).values():
                if p not in used:
                    with contextlib.suppress(OSError):
                        os.unlink(p)
