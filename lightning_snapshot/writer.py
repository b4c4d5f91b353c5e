"""Persist staged state to a backend under the commit rule: data objects first, manifest last and atomically.

Every rank writes its own data objects (rank 0 also the shared state) and, when there are several ranks, a small
JSON *part* describing them. After all ranks agree that their data is durable, rank 0 merges the parts into the
manifest, validates it with the same parser the loader uses, and commits it. Object names carry a per-run nonce, so
re-writing a step (a resumed run passing the same step again) never touches the bytes of the committed one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol, cast

import lightning_snapshot
from lightning_snapshot.backends.base import Backend
from lightning_snapshot.comm import Comm
from lightning_snapshot.errors import ChecksumError, SnapshotError, SnapshotWriteError
from lightning_snapshot.manifest import (
    MANIFEST_NAME,
    RESTORES_NAME,
    Manifest,
    dtype_name,
    health_group,
    overlapping_boxes,
    parse_step_dirname,
    step_dirname,
)
from lightning_snapshot.planner import chunk_ranges, plan_layout
from lightning_snapshot.staging import StagedState, chunk_digests, nonfinite_tensors, tensor_bytes

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DEFAULT_CHUNK_BYTES",
    "SnapshotJob",
    "apply_retention",
    "committed_steps",
    "copy_snapshot",
    "delete_step",
    "expired_snapshots",
    "verify_object",
    "write_snapshot",
]

log = logging.getLogger(__name__)


class _NodeLocal(Protocol):
    """A tier whose nodes each hold their own objects (``node_local``): the local and RAM tiers."""

    def publish(self, comm: Any, key: str, data: bytes) -> None:
        """Commit ``key`` on every node (collective)."""


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


def _write_part(
    backend: Backend, job: SnapshotJob, rank: int, run_id: str, alignment: int, chunk_bytes: int
) -> dict[str, Any]:
    """Write this rank's data objects; returns its manifest part (objects, shared section, rank section)."""
    prefix = step_dirname(job.step)
    part: dict[str, Any] = {
        "rank": rank,
        "objects": [],
        "tensors": None,
        "state": None,
        "nonfinite": nonfinite_tensors(job.shared) if job.shared is not None else [],
    }
    sections = [("rank", job.private)] + ([("shared", job.shared)] if job.shared is not None else [])
    for kind, staged in sections:
        obj = f"{run_id}-{kind}-{rank:05d}.bin"
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


def _merge_tensors(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The shared tensor entries of all parts, one per name: the fragments that several ranks wrote of one tensor
    (each its shard of a DTensor) become the fragments of one entry; their dtype and global shape must agree and
    their boxes must not overlap. Alias entries that several ranks recorded are kept once."""
    merged: dict[str, dict[str, Any]] = {}
    for p in parts:
        for t in p["tensors"] or ():
            name = t["name"]
            have = merged.get(name)
            if have is None:
                merged[name] = {**t, "fragments": list(t["fragments"])} if t["type"] == "tensor" else dict(t)
                continue
            if have["type"] != t["type"] or have["dtype"] != t["dtype"] or have["global_shape"] != t["global_shape"]:
                raise SnapshotWriteError(
                    f"ranks disagree about shared tensor {name!r}: {have['type']} {have['dtype']}"
                    f" {have['global_shape']} vs {t['type']} {t['dtype']} {t['global_shape']} (rank {p['rank']}); the"
                    " ranks captured different state"
                )
            if t["type"] == "alias":
                if have["alias_of"] != t["alias_of"]:
                    raise SnapshotWriteError(f"ranks disagree about what shared tensor {name!r} is an alias of")
                continue
            have["fragments"].extend(t["fragments"])
    for entry in merged.values():
        if entry["type"] == "tensor" and len(entry["fragments"]) > 1:
            pair = overlapping_boxes([(f["global_offsets"], f["local_shape"]) for f in entry["fragments"]])
            if pair is not None:
                a, b = (entry["fragments"][i] for i in pair)
                raise SnapshotWriteError(
                    f"two ranks wrote the same shared tensor {entry['name']!r} (fragments at {a['global_offsets']}"
                    f" and {b['global_offsets']} overlap); the write plans disagree"
                )
    return list(merged.values())


def _merge_health(parts: list[dict[str, Any]], tensors: list[dict[str, Any]]) -> dict[str, str | None]:
    """The manifest's ``health``: every group of the shared tensors, with the first tensor (in manifest order) that a
    rank found holding a non-finite value, or None."""
    reported = {name for p in parts for name in p.get("nonfinite") or ()}
    health: dict[str, str | None] = {}
    for t in tensors:
        group = health_group(t["name"])
        if health.get(group) is None:
            health[group] = t["name"] if t["name"] in reported else None
    return health


def _merge(
    parts: list[dict[str, Any]], job: SnapshotJob, world_size: int, alignment: int, chunk_bytes: int
) -> dict[str, Any]:
    """One manifest from every rank's part: the shared tensors are the union of the ranks' shares (each rank wrote a
    disjoint share of the replicated state, and its own shards of sharded state); the shared JSON tree is rank
    0's."""
    parts = sorted(parts, key=lambda p: p["rank"])
    if parts[0]["rank"] != 0 or parts[0]["state"] is None:
        raise SnapshotWriteError("rank 0 did not contribute the shared state tree")
    tensors = _merge_tensors(parts)
    return {
        "format_version": 1,
        "step": job.step,
        "epoch": job.epoch,
        "world_size": world_size,
        "created_unix": time.time(),
        "library_version": lightning_snapshot.__version__,
        "checksum": "xxh3_64",
        "chunk_bytes": chunk_bytes,
        "alignment": alignment,
        "objects": [o for p in parts for o in p["objects"]],
        "tensors": tensors,
        "state": parts[0]["state"],
        "ranks": [p["rank_section"] for p in parts],
        "health": _merge_health(parts, tensors),
    }


def _commit_manifest(backend: Backend, key: str, raw: dict[str, Any], text: str) -> None:
    """Commit the manifest ``text`` (parsed: ``raw``) at ``key``. A tier that never overwrites a committed manifest
    (the object store) refuses it when an earlier attempt of this very write committed it and only its answer was
    lost (a timeout, a dropped connection) before a retry: a committed manifest describing the same snapshot (every
    field but its creation time equal: the same objects, sizes and checksums) is then taken as this commit."""
    try:
        backend.commit(key, text.encode())
    except SnapshotWriteError:
        try:
            held = json.loads(backend.read(key))
        except Exception:  # noqa: BLE001 - nothing readable there: the refusal stands
            held = None
        if not isinstance(held, dict) or {k: v for k, v in held.items() if k != "created_unix"} != {
            k: v for k, v in raw.items() if k != "created_unix"
        }:
            raise
        log.info(
            "lightning-snapshot: %s in %s was already committed by an earlier attempt of this write (its answer was"
            " lost); it describes the same snapshot, so it stands",
            key,
            backend.url,
        )


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
    prefix = step_dirname(job.step)
    if job.shared is not None and job.shared.chunk_bytes is not None:
        chunk_bytes = job.shared.chunk_bytes  # the checksums were taken while staging, with the arena's chunk size
    node_local = bool(getattr(backend, "node_local", False))
    error: BaseException | None = None
    part: dict[str, Any] | None = None
    try:
        if prepare is not None:
            prepare()
        part = _write_part(backend, job, comm.rank, run_id, alignment, chunk_bytes)
        if before_commit is not None:
            before_commit()
    except Exception as e:  # noqa: BLE001 - re-raised below on every rank
        error = e

    def collective(what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # a peer died or the group's timeout ran out
            raise SnapshotWriteError(
                f"rank {comm.rank}: waiting for the other ranks to agree on {what} of the snapshot of step {job.step}"
                f" in the {backend.tier} tier {backend.url} failed ({type(e).__name__}: {e}): another rank failed,"
                " exited or is stuck (see its log)"
            ) from e

    def agree(what: str) -> None:
        if collective(what, comm.all_true, error is None):
            return
        if comm.rank == 0 or node_local:  # a node-local tier (RAM) holds each node's objects on that node only
            try:
                _discard_run_objects(backend, prefix, run_id)
            except Exception as e:  # noqa: BLE001 - best effort (the tier may be unreachable): the error says why
                log.debug("lightning-snapshot: could not discard the objects of step %d: %s", job.step, e)
        if error is not None:
            raise error
        raise SnapshotWriteError(f"{what} of the snapshot of step {job.step} failed on another rank (see its log)")

    agree("writing the data")
    parts = collective("the manifest parts", comm.gather, part)
    # a tier that spreads each rank's objects over nodes (the erasure-coded RAM tier) places them now, once every
    # rank's data is written and before anything is committed
    distribute = getattr(backend, "distribute", None)
    if distribute is not None:
        try:
            distribute(comm, prefix, run_id)
        except Exception as e:  # noqa: BLE001 - re-raised below on every rank
            error = e
        agree("placing the data")
    text: str | None = None
    manifest: Manifest | None = None  # rank 0's, parsed once as the check of what it commits
    if comm.rank == 0:
        try:
            assert parts is not None
            raw = _merge(parts, job, comm.world_size, alignment, chunk_bytes)
            text = json.dumps(raw, separators=(",", ":"), allow_nan=False)
            manifest = Manifest.from_json(text, where=f"new manifest of {prefix}")
            if not node_local:
                _commit_manifest(backend, f"{prefix}/{MANIFEST_NAME}", raw, text)
        except Exception as e:  # noqa: BLE001 - re-raised below on every rank
            error = e
    agree("committing the manifest")
    text = collective("the manifest", comm.broadcast, text)
    if node_local:
        # every node holds the manifest of the snapshots it has shares of: one rank per node commits it
        try:
            cast(_NodeLocal, backend).publish(comm, f"{prefix}/{MANIFEST_NAME}", text.encode())
        except Exception as e:  # noqa: BLE001 - re-raised below on every rank
            error = e
        agree("committing the manifest")
    if manifest is None:
        manifest = Manifest.from_json(text, where=f"manifest of {prefix}")
    if comm.rank == 0 or node_local:
        _remove_unreferenced(backend, prefix, manifest)
    return manifest


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

    Each rank copies the objects it wrote; rank 0 commits the very same manifest bytes once all are durable.
    Called by every rank, at the same point.

    Args:
        verify: check every object read from ``src`` against the manifest's sizes and checksums before writing it
            (:func:`verify_object`); a mismatch fails the copy and nothing is committed.
        on_object: called with the size of each object once it is written (progress).
    """
    prefix = step_dirname(step)
    error: BaseException | None = None
    manifest: Manifest | None = None
    text = b""
    try:
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
    except Exception as e:  # noqa: BLE001 - re-raised below on every rank
        error = e
    if comm.all_true(error is None) and comm.rank == 0:
        try:
            dst.commit(f"{prefix}/{MANIFEST_NAME}", text)
        except Exception as e:  # noqa: BLE001
            error = e
    if not comm.all_true(error is None):
        if error is not None:
            raise error
        raise SnapshotWriteError(f"copying step {step} to {dst.url!r} failed on another rank (see its log)")
    assert manifest is not None
    return manifest


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


def _discard_run_objects(backend: Backend, prefix: str, run_id: str) -> None:
    """Best-effort removal of this run's objects of an uncommitted step."""
    for name in backend.list(prefix):
        if name.startswith(run_id + "-"):
            with contextlib.suppress(OSError):
                backend.delete(f"{prefix}/{name}")
    if not backend.list(prefix):
        backend.delete(prefix)


def _remove_unreferenced(backend: Backend, prefix: str, manifest: Manifest) -> None:
    """After a commit: drop parts and objects the manifest does not reference (older writes of the same step)."""
    keep = {o.key for o in manifest.objects} | {MANIFEST_NAME, RESTORES_NAME}
    for name in backend.list(prefix):
        if name not in keep:
            backend.delete(f"{prefix}/{name}")


def committed_steps(backend: Backend) -> list[int]:
    """Steps that have a committed manifest in ``backend``, newest first."""
    steps = []
    for name in backend.list(""):
        step = parse_step_dirname(name)
        if step is not None and backend.exists(f"{name}/{MANIFEST_NAME}"):
            steps.append(step)
    return sorted(steps, reverse=True)


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
        if manifest.first_nonfinite is None:
            return {step}
    return set()


def describe_error(e: BaseException) -> str:
    return str(e) if isinstance(e, SnapshotError) else f"{type(e).__name__}: {e}"
