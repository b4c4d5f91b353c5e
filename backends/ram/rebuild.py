"""A node's part of a RAM-tier restore: what the node holds of a step (its inventory: the manifest, whole objects,
the shares that pass the check), then fetching what it lacks from the other nodes and rebuilding every
erasure-coded object readable from ``k`` good shares. Also what a node holds of the steps its agent kept for
trainers that died (:data:`PROPOSED`), which the restore commits once every object is held somewhere.

Functions of the node's store, with no tier state: :meth:`~lightning_snapshot.backends.ram.tier.RamTier.prepare_restore`
calls them on each node's first rank (it gathers the inventories and plans the transfers).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from lightning_snapshot.backends.base import NeededObjects
from lightning_snapshot.backends.local import LocalTier
from lightning_snapshot.backends.mapped_files import close_map, exchange, group_of, map_existing, map_new
from lightning_snapshot.backends.ram import erasure as _ec
from lightning_snapshot.backends.ram.node_store import PROPOSED
from lightning_snapshot.backends.ram.shares import EC, LAYOUT_FILE, READING_FILE, parse_layout, share_ok, view_of
from lightning_snapshot.dist.agree import agree_on
from lightning_snapshot.dist.comm import Comm
from lightning_snapshot.dist.forksafe import Executor
from lightning_snapshot.errors import SnapshotError

__all__ = ["PROPOSED", "commit_kept", "fetch_and_rebuild", "inventory"]

log = logging.getLogger(__name__)


def inventory(store: LocalTier, prefix: str, *, leader: bool, verify: bool, threads: int | None) -> dict[str, Any]:
    """What this node's ``store`` holds of ``prefix``: the manifest text, whole objects (key: size) and its shares of
    the right size (``verify``: only those whose xxh3 matches the layout's, hashed on up to ``threads`` threads).
    Only the node's ``leader`` rank looks (the others return an empty inventory)."""
    from lightning_snapshot.format.manifest import MANIFEST_NAME

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
            with contextlib.suppress(OSError):  # (gone meanwhile: not held)
                inv["whole"][f"{prefix}/{name}"] = store.files.path(f"{prefix}/{name}").stat().st_size

    def check(item: tuple[str, int, str, dict[str, Any]]) -> bool:
        _key, i, share, layout = item
        return share_ok(store.files.path(share), layout["stripes"] * layout["block"], layout["checksums"][i], verify)

    # every share hashed once, on as many threads as the tier codes with (xxh3 releases the GIL)
    workers = min(len(checks), threads or min(8, os.cpu_count() or 1)) if verify else 1
    if workers > 1:
        with Executor(max_workers=workers, thread_name_prefix="lightning-snapshot-verify") as pool:
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
    comm: Comm,
    transfers: list[tuple[int, int, str, int]],
    layouts: dict[str, dict[str, Any]],
    me: int,
    prefix: str,
    sizes: dict[str, int],
    verified: dict[str, set[int]],
    verify: bool,
    threads: int | None,
) -> None:
    """Run this node leader's (rank ``me``) part of the ``transfers`` (src, dst, key, share index; -1: the whole
    object, of ``sizes[key]`` bytes) over ``comm`` and rebuild every erasure-coded object of ``layouts`` in ``store``
    from ``k`` good shares: its own that :func:`inventory` listed (``verified``), the others checked here
    (``verify``: hashed), on up to ``threads`` threads. Writes each object's ``reading.json``; received shares it did
    not use are removed."""
    sends: list[tuple[Any, int]] = []
    receives: list[tuple[Any, int]] = []
    received: dict[str, dict[int, Any]] = {}
    try:
        if transfers and comm.world_size > 1:
            for src, dst, key, i in transfers:
                if src == dst or me not in (src, dst):
                    continue
                if i < 0:
                    path = store.files.path(key)
                    size = sizes[key]
                else:
                    path = store.files.path(f"{key}{EC}/{i}")
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
    exchange(group_of(comm), sends, receives)
    # make every erasure-coded object readable from its data shares, rebuilding the lost ones from parity
    for key, layout in layouts.items():
        if store.exists(key):
            continue
        lay = _ec.ShareLayout(layout["k"], layout["m"], layout["nbytes"], layout["block"], layout["stripes"])
        paths: dict[int, Path] = dict(received.get(key, {}))
        inv_dir = store.files.path(key + EC)
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


def _proposed(store: LocalTier) -> tuple[dict[int, tuple[str, str]], list[int]]:
    """What ``store`` (a node's) holds: the steps not committed there that hold a manifest its agent proposed
    (:data:`PROPOSED`), ``{step: (its name in the step's directory, its text)}``, and the steps committed there. What
    cannot be listed or read counts as not there (logged): every rank goes on to the collective that follows."""
    from lightning_snapshot.format.manifest import MANIFEST_NAME, parse_step_dirname

    found: dict[int, tuple[str, str]] = {}
    committed: list[int] = []
    try:
        for name in store.list(""):
            step = parse_step_dirname(name)
            if step is None:
                continue
            if store.exists(f"{name}/{MANIFEST_NAME}"):
                committed.append(step)
                continue
            entry = next((e for e in store.list(name) if e.endswith(PROPOSED)), None)
            if entry is not None:
                found[step] = (entry, store.read(f"{name}/{entry}").decode())
    except Exception as e:  # noqa: BLE001 - a leader that raised here would leave the other ranks in the collective
        log.warning("lightning-snapshot: cannot look for the steps kept by the snapshot agent in %s: %s", store.root, e)
    return found, committed


def _holdings(store: LocalTier, prefix: str, threads: int | None) -> dict[str, Any]:
    """What ``store`` (a node's) holds of the step ``prefix``: ``{"whole": {key: size}, "shares": {key: [k, [share
    indices]]}}``, the shares only where their checksum matches their layout's (hashed on up to ``threads``
    threads). Never raises: what cannot be read counts as not held."""
    whole: dict[str, int] = {}
    shares: dict[str, list[Any]] = {}
    try:
        inv = inventory(store, prefix, leader=True, verify=True, threads=threads)
        whole = dict(inv["whole"])
        shares = {key: [e["layout"]["k"], e["good"]] for key, e in inv["shares"].items()}
    except Exception as e:  # noqa: BLE001 - a leader that raised here would leave the other ranks in the collective
        log.warning("lightning-snapshot: cannot list %s in %s: %s", prefix, store.root, e)
    return {"whole": whole, "shares": shares}


def _missing_objects(text: str, prefix: str, held: list[dict[str, Any]], objects: NeededObjects | None) -> list[str]:
    """The objects of the step ``prefix`` (``objects``: the engine's reading of its manifest ``text``) that none of
    the nodes' :func:`_holdings` ``held`` holds whole (of their size) or as ``k`` good shares; a manifest the engine
    cannot read misses everything, and so does every step when the engine gave no ``objects``. Pure."""
    if objects is None:
        return ["the list of its objects (the caller gave none)"]
    try:
        listed = objects(text.encode())
    except Exception as e:  # noqa: BLE001 - not a manifest: nothing of it is committed
        return [f"its manifest ({type(e).__name__}: {e})"]
    missing = []
    for obj in listed:
        key = f"{prefix}/{obj.key}"
        if any(h["whole"].get(key) == obj.nbytes for h in held):
            continue
        k, good = 0, set()
        for h in held:
            if key in h["shares"]:
                k = h["shares"][key][0]
                good.update(h["shares"][key][1])
        if not k or len(good) < k:
            missing.append(obj.key)
    return missing


def commit_kept(
    store: LocalTier, comm: Comm, objects: NeededObjects | None, *, leader: bool, url: str, threads: int | None
) -> None:
    """Commit on every node the steps the nodes' snapshot agents kept in the RAM tier ``url`` for trainers that died
    before the trainers committed them there, but after the agents had committed them to a durable tier (collective:
    every rank of the tier's group calls it, before the tier is listed; ``leader``: this rank is its node's first,
    which looks at and writes the node's ``store``).

    Each rank's agent keeps that rank's data objects, byte for byte those of the durable copy, and the durable
    manifest as a proposal (:data:`PROPOSED`). The agents of different nodes cannot agree on a commit; the trainers do
    it here, under the tier's commit rule: a proposed step is committed only when every object of its manifest is held
    on some node (whole, of its size, or as ``k`` shares that pass their checksums, hashed on up to ``threads``
    threads). One that is not stays uncommitted, with a warning (retention removes it later); one the trainers
    committed on some node is left as it is. Raises nothing a single rank could raise alone: every rank takes the
    same decisions, from what the leaders gathered.
    """
    from lightning_snapshot.format.manifest import MANIFEST_NAME, step_dirname

    mine, committed = _proposed(store) if leader else ({}, [])
    everyone = agree_on(comm, f"the steps kept in the RAM tier {url}", lambda: (mine, committed), gather=True).values
    assert everyone is not None
    done = {step for _found, steps in everyone for step in steps}  # (committed on some node: listed as it is)
    texts: dict[int, str] = {}
    for found, _steps in everyone:
        for step, (_name, text) in found.items():
            if step not in done:
                texts.setdefault(step, text)
    if not texts:
        return
    here = {s: _holdings(store, step_dirname(s), threads) for s in texts} if leader else {}
    held = agree_on(comm, f"what the nodes hold of the kept steps in {url}", lambda: here, gather=True).values
    assert held is not None
    first = comm.rank == 0
    for step, text in sorted(texts.items()):
        prefix = step_dirname(step)
        missing = _missing_objects(text, prefix, [h[step] for h in held if step in h], objects)
        if missing:
            if first:
                log.warning(
                    "lightning-snapshot: RAM tier %s: step %d, kept by the snapshot agents for trainers that died,"
                    " stays uncommitted: %s not held on any node (its durable copy remains)",
                    url,
                    step,
                    ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""),
                )
            continue
        if leader:
            try:
                store.commit(f"{prefix}/{MANIFEST_NAME}", text.encode())
                if step in mine:
                    store.delete(f"{prefix}/{mine[step][0]}")
            except OSError as e:  # (the other nodes' copies count: a step is committed where any node holds it)
                log.warning("lightning-snapshot: RAM tier %s: committing step %d kept by its agent: %s", url, step, e)
        if first:
            log.info(
                "lightning-snapshot: RAM tier %s: step %d, which the snapshot agents wrote to a durable tier after the"
                " trainers died, is committed here too (every rank's data is held)",
                url,
                step,
            )
