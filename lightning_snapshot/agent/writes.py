"""What a node's snapshot agent writes: a staged snapshot to a durable tier under the commit rule (the trainer's
request, or a flush after the trainer died), and the part of a step it keeps in the node's RAM tier for trainers that
died before they committed it there. Functions of the message and the staged bytes; the agent's state
(:class:`~lightning_snapshot.agent.server.Agent`) stays in the server.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lightning_snapshot.backends.ram.agent_protocol import PART_WAIT_S, rebuild_staged
from lightning_snapshot.errors import SnapshotError

__all__ = ["describe", "flush", "keep_in_ram", "write_tier"]

log = logging.getLogger("lightning_snapshot.agent")


def _verify(staged: Any) -> None:
    from lightning_snapshot.staging import chunk_digests, tensor_bytes

    if staged.checksums is None:
        return
    chunk = staged.chunk_bytes or (8 << 20)
    for name, t in staged.tensors.items():
        if chunk_digests(tensor_bytes(t), chunk) != staged.checksums[name]:
            raise SnapshotError(f"the staged bytes of {name!r} changed after staging (the slot was reused)")


def flush(node_dir: Path, hello: dict[str, Any], entry: dict[str, Any], arena: Any) -> None:
    """Write a snapshot the trainer staged but could not make durable to the tiers it was due in; if it was due
    in the RAM tier too, keep it there as well (:func:`keep_in_ram`)."""
    durable: int | None = None  # a durable tier that holds it committed
    for index in entry["tiers"]:
        try:
            if write_tier(hello, entry, arena, int(index), after_death=True):
                log.info("step %s committed to tier %d after rank %s died", entry["step"], index, hello["rank"])
            durable = int(index) if durable is None else durable
        except Exception as e:  # noqa: BLE001 - logged; the other tiers still get it
            log.warning(
                "flushing step %s of rank %s failed: %s",
                entry["step"],
                hello["rank"],
                describe(hello, entry, e),
            )
    if durable is not None and entry.get("ram"):
        try:
            keep_in_ram(node_dir, hello, entry, arena, durable)
        except Exception as e:  # noqa: BLE001 - logged; the durable tier holds it
            log.warning(
                "keeping step %s of rank %s in the RAM tier failed: %s",
                entry["step"],
                hello["rank"],
                describe(hello, {"tier": durable}, e),
            )


def keep_in_ram(node_dir: Path, hello: dict[str, Any], entry: dict[str, Any], arena: Any, index: int) -> None:
    """Keep this rank's part of the snapshot ``entry`` in the node's RAM tier: the trainers did not commit it
    there (the trainer died first), the agents committed it to the durable tier ``index``.

    Writes this rank's data objects into the node's memory (byte for byte those of the durable copy; whole, not
    erasure coded: the durable copy protects them) and, next to them, the durable manifest as a proposal
    (:data:`~lightning_snapshot.backends.ram.node_store.PROPOSED`). The agents of different nodes cannot agree on
    a commit of the RAM tier: the trainers that restore next commit it, on every node, once they saw that every
    rank's objects are held (:meth:`~lightning_snapshot.backends.ram.tier.RamTier.collective_steps`). Nothing is
    kept when the RAM tier holds this step or a newer one.
    """
    from lightning_snapshot.backends.base import Backend
    from lightning_snapshot.backends.ram.node_store import PROPOSED, node_store
    from lightning_snapshot.backends.ram.shares import EC
    from lightning_snapshot.format.manifest import MANIFEST_NAME, Manifest, step_dirname
    from lightning_snapshot.persist.commit import committed_steps
    from lightning_snapshot.persist.writer import SnapshotJob, write_part

    step, rank, run_id = int(entry["step"]), int(hello["rank"]), str(hello["run_id"])
    store = node_store(node_dir)
    held = committed_steps(store)
    if held and held[0] >= step:
        return
    prefix = step_dirname(step)
    tier = Backend.from_spec(hello["tiers"][index])
    text = tier.read(f"{prefix}/{MANIFEST_NAME}")
    want = {
        o.key: o.nbytes
        for o in Manifest.from_json(text, where=f"manifest of {prefix} in {tier.url}").objects
        if o.rank == rank
    }
    for key in want:  # (shares the trainer placed before it died: the whole object replaces them here)
        store.delete(f"{prefix}/{key}{EC}")
    shared = rebuild_staged(entry["shared"], memoryview(arena) if arena is not None else None)
    job = SnapshotJob(step, int(entry["epoch"]), shared, rebuild_staged(entry["private"], None))
    part = write_part(store, job, rank, run_id, shared.alignment, shared.chunk_bytes or (8 << 20))
    wrote = {o["key"]: o["nbytes"] for o in part["objects"]}
    if wrote != want:
        raise SnapshotError(f"the objects of rank {rank} ({wrote}) are not those of the manifest ({want})")
    store.commit(f"{prefix}/{run_id}-{PROPOSED}", text)
    log.info("step %d of rank %d kept in the RAM tier (committed there by the next restore)", step, rank)


def describe(hello: dict[str, Any] | None, msg: dict[str, Any], e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}" if not isinstance(e, SnapshotError) else str(e)
    try:
        from lightning_snapshot.backends.base import Backend

        tier = Backend.from_spec((hello or {})["tiers"][int(msg.get("tier", msg.get("tiers", [0])[0]))])
        return tier.redact(text)
    except Exception:  # noqa: BLE001 - cannot build the tier: say nothing that could hold a secret
        return type(e).__name__


def write_tier(
    hello: dict[str, Any], entry: dict[str, Any], arena: Any, index: int, *, after_death: bool = False
) -> int:
    """Write the staged snapshot ``entry`` to the trainer's tier ``index`` under the commit rule.

    Every rank's agent writes that rank's data objects and manifest part; the agent of rank 0 waits for every
    part, merges them, commits the manifest and applies retention; the others wait for the commit. A rank whose
    write failed leaves a ``failed`` marker so that rank 0 stops waiting. Returns the bytes committed (0 when
    the step was already committed).
    """
    from lightning_snapshot.backends.base import Backend
    from lightning_snapshot.persist.commit import MarkerTransport
    from lightning_snapshot.persist.writer import SnapshotJob, apply_retention, commit_job

    step, rank, world = int(entry["step"]), int(hello["rank"]), int(hello["world_size"])
    run_id = str(hello["run_id"])
    region = memoryview(arena) if arena is not None else None
    shared = rebuild_staged(entry["shared"], region)
    private = rebuild_staged(entry["private"], None)
    _verify(shared)
    tier = Backend.from_spec(hello["tiers"][index])
    replicas = entry.get("replicas")
    if replicas is not None and not isinstance(replicas, dict):
        raise ValueError(f"a staged snapshot's 'replicas' must be an object or null, got {type(replicas).__name__}")
    job = SnapshotJob(step, int(entry["epoch"]), shared, private, replicas)
    transport = MarkerTransport(tier, step, run_id, rank, world, float(hello.get("part_wait") or PART_WAIT_S))

    def flushing() -> None:
        if after_death:
            log.info("rank %d died before step %d reached %s: flushing it", rank, step, tier.url)

    done = commit_job(
        tier,
        transport,
        job,
        run_id,
        alignment=shared.alignment,
        chunk_bytes=shared.chunk_bytes or (8 << 20),
        prepare=flushing,
        where="manifest of {prefix} written by the snapshot agent",
    )
    if not done.written:
        return 0
    if done.manifest is None:  # (a rank other than 0: rank 0 committed it)
        return shared.nbytes + private.nbytes
    try:
        apply_retention(tier, step, manifest=done.manifest)
    except Exception as e:  # noqa: BLE001 - the snapshot is committed; cleanup waits for the next one
        log.warning("retention in %s failed: %s", tier.url, describe(hello, {"tier": index}, e))
    return done.manifest.total_bytes
