"""Persist staged state to a backend: the data objects, and retention; the commit rule itself (data objects first,
manifest last and atomically) is :mod:`lightning_snapshot.persist.commit`'s.

Every rank writes its own data objects (rank 0 also the shared state) and, when there are several ranks, a small
JSON *part* describing them (:func:`write_part`). After all ranks agree that their data is durable, rank 0 merges the
parts into the manifest, validates it with the same parser the loader uses, and commits it. Object names carry a
per-run nonce, so re-writing a step (a resumed run passing the same step again) never touches the bytes of the
committed one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from lightning_snapshot.backends.base import Backend
from lightning_snapshot.dist.comm import Comm
from lightning_snapshot.errors import ChecksumError, SnapshotError, SnapshotWriteError
from lightning_snapshot.format.collector import deferred_collection
from lightning_snapshot.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    dtype_name,
    parse_step_dirname,
    step_dirname,
)
from lightning_snapshot.persist.commit import (  # (committed_steps: re-exported, the writer's name for it)
    CollectiveTransport,
    Commit,
    Transport,
    commit_snapshot,
    committed_steps,
    merge_parts,
)
from lightning_snapshot.plan.planner import chunk_ranges, plan_layout
from lightning_snapshot.staging import StagedState, chunk_digests, nonfinite_tensors, tensor_bytes

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DEFAULT_CHUNK_BYTES",
    "SnapshotJob",
    "apply_retention",
    "commit_job",
    "committed_steps",
    "copy_snapshot",
    "delete_step",
    "expired_snapshots",
    "verify_object",
    "write_part",
    "write_snapshot",
]

log = logging.getLogger(__name__)


DEFAULT_CHUNK_BYTES = 8 << 20
DEFAULT_ALIGNMENT = 64
_ZEROS = bytes(4096)


@dataclass
class SnapshotJob:
    """What one rank contributes to the snapshot of ``step``: its share of the shared state and its own state."""

    step: int
    epoch: int
    shared: StagedState | None
    private: StagedState
    #: the replica check's outcome (the manifest's ``replicas``), or None: not checked
    replicas: dict[str, Any] | None = None


def _section(
    staged: StagedState, object_key: str, alignment: int, chunk_bytes: int
) -> tuple[list[memoryview | bytes], list[dict[str, Any]], int]:
    """Lay out one section's tensors in one object; returns (buffers, tensor entries as JSON, object size).

    A staged state that is already packed (the arena) is written as its region, with its staging checksums.
    """
    buffers: list[memoryview | bytes] = []
    if staged.packed is not None and staged.layout is not None:
        # the arena's region, laid out when it was planned: written as it is, with the staging checksums
        placed = staged.layout
        size = placed[-1][1] + placed[-1][2] if placed else 0
        buffers.append(staged.packed[:size])
        views = None
    else:
        if staged.packed is not None:
            alignment = staged.alignment
        names = list(staged.tensors)
        views = {n: tensor_bytes(staged.tensors[n]) for n in names}
        planned, size = plan_layout([(n, views[n].nbytes) for n in names], alignment)
        placed = [(n, offset, views[n].nbytes) for n, offset in planned]
        if staged.packed is not None:
            buffers.append(staged.packed[:size])
    entries: list[dict[str, Any]] = []
    pos = 0
    for name, offset, nbytes in placed:
        if views is not None and staged.packed is None:
            if offset > pos:
                buffers.append(_ZEROS[: offset - pos])
            buffers.append(views[name])
        pos = offset + nbytes
        t = staged.tensors[name]
        shape = list(t.shape)
        global_shape, offsets = staged.shards.get(name, (shape, [0] * len(shape)))
        if staged.checksums is not None:
            sums = staged.checksums[name]
        else:
            assert views is not None
            sums = chunk_digests(views[name], chunk_bytes)
        entries.append(
            {
                "type": "tensor",
                "name": name,
                "dtype": dtype_name(t.dtype),
                "global_shape": list(global_shape),
                "fragments": [
                    {
                        "object": object_key,
                        "offset": offset,
                        "nbytes": nbytes,
                        "global_offsets": list(offsets),
                        "local_shape": shape,
                        "checksums": sums,
                    }
                ],
            }
        )
    for name, target in staged.aliases.items():
        t = staged.tensors[target]
        global_shape = staged.shards[target][0] if target in staged.shards else tuple(t.shape)
        entries.append(
            {
                "type": "alias",
                "name": name,
                "dtype": dtype_name(t.dtype),
                "global_shape": list(global_shape),
                "alias_of": target,
            }
        )
    return buffers, entries, size


def write_part(
    backend: Backend, job: SnapshotJob, rank: int, run_id: str, alignment: int, chunk_bytes: int
) -> dict[str, Any]:
    """Write this rank's data objects of ``job``; returns its manifest part (objects, shared section, rank section),
    the input of :func:`~lightning_snapshot.persist.commit.merge_parts`."""
    prefix = step_dirname(job.step)
    part: dict[str, Any] = {
        "rank": rank,
        "objects": [],
        "tensors": None,
        "state": None,
        "nonfinite": nonfinite_tensors(job.shared) if job.shared is not None else [],
        "replicas": job.replicas if rank == 0 else None,
    }
    sections = [("rank", job.private)] + ([("shared", job.shared)] if job.shared is not None else [])
    for kind, staged in sections:
        obj = f"{run_id}-{kind}-{rank:05d}.bin"
        with deferred_collection():  # (an entry per tensor: see collector.py)
            buffers, entries, size = _section(staged, obj, alignment, chunk_bytes)
        written = backend.write(f"{prefix}/{obj}", buffers)
        if written != size:
            raise SnapshotWriteError(f"wrote {written} of {size} bytes of {obj!r}")
        part["objects"].append({"type": "object", "key": obj, "nbytes": size, "rank": rank})
        if kind == "rank":
            part["rank_section"] = {"rank": rank, "state": staged.tree, "tensors": entries}
        else:
            part["tensors"], part["state"] = entries, staged.tree if rank == 0 else None
    return part


def write_snapshot(
    backend: Backend,
    comm: Comm,
    job: SnapshotJob,
    run_id: str,
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    prepare: Callable[[], None] | None = None,
    before_commit: Callable[[], None] | None = None,
) -> Manifest:
    """Write and commit the snapshot of ``job.step``. Called by every rank, at the same point.

    Every rank raises when any rank failed (the same kind of error, so no rank is left waiting in a collective),
    and the step stays uncommitted: the loader never sees it and earlier snapshots are untouched.

    ``prepare`` runs first on every rank (waiting for an asynchronous copy); its failure counts as a failed write.
    ``before_commit`` runs on every rank once its data is durable and before any manifest is committed; raising from
    it keeps the step uncommitted (the arena re-checks there that the staged bytes were not torn).

    Returns:
        the committed manifest (as parsed back, so what was committed is known to be loadable).
    """
    node_local = backend.node_local
    transport = CollectiveTransport(comm, backend, job.step, run_id, node_local=node_local, distribute=True)
    done = commit_job(
        backend,
        transport,
        job,
        run_id,
        alignment=alignment,
        chunk_bytes=chunk_bytes,
        prepare=prepare,
        before_commit=before_commit,
    )
    assert done.manifest is not None  # (a collective commit gives every rank the manifest)
    return done.manifest


def commit_job(
    backend: Backend,
    transport: Transport,
    job: SnapshotJob,
    run_id: str,
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    prepare: Callable[[], None] | None = None,
    before_commit: Callable[[], None] | None = None,
    where: str = "new manifest of {prefix}",
) -> Commit:
    """Write this rank's data objects of ``job`` and commit the snapshot under the commit rule
    (:func:`~lightning_snapshot.persist.commit.commit_snapshot`), the ranks agreeing through ``transport``: the
    trainer's
    collectives (:func:`write_snapshot`) or the snapshot agents' marker files. ``prepare`` and ``before_commit``: as
    in :func:`write_snapshot`."""
    if job.shared is not None and job.shared.chunk_bytes is not None:
        chunk_bytes = job.shared.chunk_bytes  # the checksums were taken while staging, with the arena's chunk size

    def write() -> dict[str, Any]:
        if prepare is not None:
            prepare()
        part = write_part(backend, job, transport.rank, run_id, alignment, chunk_bytes)
        if before_commit is not None:
            before_commit()
        return part

    def merge(parts: list[dict[str, Any]]) -> str:
        with deferred_collection():  # (see collector.py)
            raw = merge_parts(parts, job.step, job.epoch, transport.world_size, alignment, chunk_bytes)
            # (no cycle check: the parts are trees the encoder made, depth-limited, or parsed JSON)
            return json.dumps(raw, separators=(",", ":"), allow_nan=False, check_circular=False)

    return commit_snapshot(backend, transport, job.step, write, merge, run_id=run_id, where=where)


def copy_snapshot(
    src: Backend,
    dst: Backend,
    step: int,
    comm: Comm,
    *,
    verify: bool = False,
    on_object: Callable[[int], None] | None = None,
) -> Manifest:
    """Copy the committed snapshot of ``step`` from ``src`` to ``dst`` byte for byte, under ``dst``'s commit rule.

    Each rank copies the objects it wrote; rank 0 commits the very same manifest bytes once all are durable
    (:func:`~lightning_snapshot.persist.commit.commit_snapshot`: a manifest ``dst`` refuses because an earlier attempt
    of
    this copy committed it stands, and objects the manifest does not reference are removed afterwards).
    Called by every rank, at the same point.

    Args:
        verify: check every object read from ``src`` against the manifest's sizes and checksums before writing it
            (:func:`verify_object`); a mismatch fails the copy and nothing is committed.
        on_object: called with the size of each object once it is written (progress).
    """
    prefix = step_dirname(step)
    text = b""

    def write() -> None:
        nonlocal text
        text = src.read(f"{prefix}/{MANIFEST_NAME}")
        manifest = Manifest.from_json(text, where=f"manifest of {prefix} in {src.url!r}")
        for obj in manifest.objects:
            if obj.rank % comm.world_size == comm.rank:
                data = src.read_view(f"{prefix}/{obj.key}")
                if verify:
                    verify_object(manifest, obj.key, data, where=f"the {src.tier} tier {src.url!r}")
                dst.write(f"{prefix}/{obj.key}", [data])
                if on_object is not None:
                    on_object(obj.nbytes)

    failure = f"copying step {step} to {dst.url!r} failed on another rank (see its log)"
    transport = CollectiveTransport(comm, dst, step, failure=failure)
    done = commit_snapshot(dst, transport, step, write, lambda parts: text)
    assert done.manifest is not None  # (a collective commit gives every rank the manifest)
    return done.manifest


def verify_object(manifest: Manifest, key: str, data: memoryview | bytes, where: str = "") -> None:
    """Check the bytes ``data`` of the object ``key`` of ``manifest``: its size, and the checksum of every chunk of
    every tensor fragment stored in it (shared and per-rank sections).

    Raises:
        ChecksumError: naming the object, the tensor and the byte range that differ.
    """
    view = memoryview(data).cast("B")
    step = f"step {manifest.step}" + (f" in {where}" if where else "")
    expected = manifest.object(key).nbytes
    if view.nbytes != expected:
        raise ChecksumError(
            f"object {key!r} of {step} holds {view.nbytes} bytes, the manifest says {expected}:"
            " it is truncated or was replaced. Use another snapshot"
        )
    entries = list(manifest.tensors) + [t for section in manifest.ranks for t in section.tensors]
    for entry in entries:
        for frag in entry.fragments:
            if frag.object != key:
                continue
            got = chunk_digests(view[frag.offset : frag.offset + frag.nbytes], manifest.chunk_bytes)
            for i, (a, b) in enumerate(chunk_ranges(frag.nbytes, manifest.chunk_bytes)):
                if got[i] != frag.checksums[i]:
                    raise ChecksumError(
                        f"checksum mismatch in tensor {entry.name!r}, object {key!r}, bytes [{frag.offset + a},"
                        f" {frag.offset + b}) of {step}: the data is corrupted. Use an earlier snapshot"
                    )


def expired_snapshots(committed: list[int], keep_last: int | None, keep: Collection[int] = ()) -> list[int]:
    """The committed steps (newest first, as :func:`committed_steps` lists them) that ``keep_last`` lets go: all
    but the ``keep_last`` newest (none when it is None), except the steps in ``keep``. Decides; deletes nothing."""
    if keep_last is None:
        return []
    return [step for step in committed[keep_last:] if step not in keep]


def delete_step(backend: Backend, step: int) -> None:
    """Delete the snapshot of ``step`` from ``backend``: its manifest first, so that a concurrent reader sees it
    committed and whole or not committed at all (never a manifest whose objects are half deleted), then the rest."""
    name = step_dirname(step)
    backend.delete(f"{name}/{MANIFEST_NAME}")
    backend.delete(name)


def apply_retention(
    backend: Backend, newest: int, pinned: Collection[int] = (), manifest: Manifest | None = None
) -> list[int]:
    """Delete committed snapshots beyond ``keep_last`` and uncommitted leftovers older than ``newest``.

    ``newest`` (the step just committed and verified) is never deleted, whatever ``keep_last`` says, nor is the newest
    healthy snapshot (no NaN or infinity recorded in its manifest), nor are the ``pinned`` steps (another tier still
    uploads them from this one; a later retention deletes them). Called by rank 0 only, after the commit, when no
    write of this run is in flight. ``manifest``: ``newest``'s, when the caller has it parsed already (it is not read
    again).

    Returns the deleted steps.
    """
    deleted: list[int] = []
    committed = committed_steps(backend)
    keep = {newest, *pinned}
    if backend.keep_last is not None:
        keep |= _newest_healthy(backend, committed, {newest: manifest} if manifest is not None else {})
    expired = set(expired_snapshots(committed, backend.keep_last, keep))
    for name in backend.list(""):
        step = parse_step_dirname(name)
        if step is None or step in keep:
            continue
        if step in expired or (step not in committed and step < newest):  # old snapshot, or a crashed write's leftovers
            try:
                delete_step(backend, step)
                deleted.append(step)
            except OSError as e:  # retention must never break training
                log.warning("lightning-snapshot: could not delete %s from %s: %s", name, backend.url, e)
    return deleted


def _newest_healthy(backend: Backend, committed: list[int], parsed: dict[int, Manifest]) -> set[int]:
    """The newest committed step whose manifest records no non-finite value (or no health: written before it was
    recorded), as a one-element set; empty when none is. Retention keeps it whatever ``keep_last`` says, so that a run
    that went on training with NaNs still has a healthy snapshot to resume from. Reads the newest manifest only,
    unless it is unhealthy (``parsed``: manifests the caller has, by step, not read again)."""
    for step in committed:
        try:
            manifest = parsed.get(step) or Manifest.from_json(
                backend.read(f"{step_dirname(step)}/{MANIFEST_NAME}"),
                where=f"manifest of step {step} in {backend.url!r}",
            )
        except Exception as e:  # noqa: BLE001 - retention must never break training: this step counts as unhealthy
            log.debug("lightning-snapshot: retention cannot read the health of step %d: %s", step, e)
            continue
        if manifest.healthy:
            return {step}
    return set()


def describe_error(e: BaseException) -> str:
    return str(e) if isinstance(e, SnapshotError) else f"{type(e).__name__}: {e}"
