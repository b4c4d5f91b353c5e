"""The commit rule, written once: every rank writes its data objects and its manifest part, the parts are merged, and
the manifest is committed last (``Backend.commit``); a snapshot without a manifest does not exist.

:func:`commit_snapshot` runs the rule. How the ranks hand over their parts and learn each other's failures is a
:class:`Transport`: :class:`CollectiveTransport` (the trainer's ranks, through a
:class:`~lightning_snapshot.dist.comm.Comm`:
:func:`~lightning_snapshot.persist.writer.write_snapshot`, :func:`~lightning_snapshot.persist.writer.copy_snapshot`) or
:class:`MarkerTransport` (the nodes' snapshot agents, through part and ``failed`` marker files in the tier itself,
with a bounded wait). What is written as data, and how the parts become a manifest, the callers pass in
(:mod:`lightning_snapshot.persist.writer`). Also here: the merge of the parts (:func:`merge_parts`), the "already
committed" rule (:func:`commit_manifest`) and the cleanup around a commit (:func:`remove_unreferenced`,
:func:`discard_run_objects`).
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import lightning_snapshot
from lightning_snapshot.backends.base import Backend, Distributing
from lightning_snapshot.dist.agree import PROBLEM_CHARS, agree_on, problem_text, waiting_failed
from lightning_snapshot.dist.comm import Comm
from lightning_snapshot.errors import SnapshotError, SnapshotWriteError
from lightning_snapshot.format.committed import committed_steps
from lightning_snapshot.format.manifest import (
    MANIFEST_NAME,
    RESTORES_NAME,
    Manifest,
    health_group,
    step_dirname,
)
from lightning_snapshot.plan.planner import overlapping_boxes

__all__ = [
    "CollectiveTransport",
    "Commit",
    "MarkerTransport",
    "Transport",
    "commit_manifest",
    "commit_snapshot",
    "committed_steps",
    "discard_run_objects",
    "merge_parts",
    "remove_unreferenced",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Commit:
    """What :func:`commit_snapshot` did on this rank."""

    #: the committed manifest as parsed back; None where this rank does not learn it (:class:`MarkerTransport`,
    #: ranks other than 0) or when nothing was written (``written`` False)
    manifest: Manifest | None
    #: False when the step was committed already (an earlier attempt of this write) and this call wrote nothing
    written: bool = True


class _Committed(Exception):
    """The step was committed meanwhile (an earlier attempt): nothing more to do."""


# ----------------------------------------------------------------------------------------------- merge
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


def merge_parts(
    parts: list[dict[str, Any]], step: int, epoch: int, world_size: int, alignment: int, chunk_bytes: int
) -> dict[str, Any]:
    """One manifest (as JSON) from every rank's part: the shared tensors are the union of the ranks' shares (each rank
    wrote a disjoint share of the replicated state, and its own shards of sharded state); the shared JSON tree is rank
    0's. Pure: no I/O."""
    parts = sorted(parts, key=lambda p: p["rank"])
    if parts[0]["rank"] != 0 or parts[0]["state"] is None:
        raise SnapshotWriteError("rank 0 did not contribute the shared state tree")
    tensors = _merge_tensors(parts)
    replicas = {"replicas": parts[0]["replicas"]} if parts[0].get("replicas") is not None else {}
    return {
        "format_version": 1,
        "step": step,
        "epoch": epoch,
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
        **replicas,
    }


# ----------------------------------------------------------------------------------------------- the manifest, cleanup
def commit_manifest(backend: Backend, key: str, text: str | bytes) -> None:
    """Commit the manifest ``text`` at ``key``. A tier that never overwrites a committed manifest (the object store)
    refuses it when an earlier attempt of this very write committed it and only its answer was lost (a timeout, a
    dropped connection) before a retry: a committed manifest describing the same snapshot (every field but its
    creation time equal: the same objects, sizes and checksums) is then taken as this commit."""
    try:
        backend.commit(key, text if isinstance(text, bytes) else text.encode())
    except SnapshotWriteError:
        try:
            held = json.loads(backend.read(key))
        except Exception:  # noqa: BLE001 - nothing readable there: the refusal stands
            held = None
        raw = json.loads(text)
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


def discard_run_objects(backend: Backend, prefix: str, run_id: str) -> None:
    """Best-effort removal of this run's objects of an uncommitted step."""
    for name in backend.list(prefix):
        if name.startswith(run_id + "-"):
            with contextlib.suppress(OSError):
                backend.delete(f"{prefix}/{name}")
    if not backend.list(prefix):
        backend.delete(prefix)


def remove_unreferenced(backend: Backend, prefix: str, manifest: Manifest) -> None:
    """After a commit: drop parts and objects the manifest does not reference (older writes of the same step)."""
    keep = {o.key for o in manifest.objects} | {MANIFEST_NAME, RESTORES_NAME}
    for name in backend.list(prefix):
        if name not in keep:
            backend.delete(f"{prefix}/{name}")


# ----------------------------------------------------------------------------------------------- transports
class Transport(abc.ABC):
    """How the ranks of one commit hand over their parts and learn each other's failures.

    :func:`commit_snapshot` calls, on every rank, in this order: :meth:`committed`, :meth:`begin` (with the data
    write), :meth:`share`, :meth:`place`, then on rank 0 the merge and the manifest commit, then :meth:`settle`
    (:meth:`abort` on rank 0 instead, when an interrupt ends it). Every method that fails raises on the rank it runs
    on; a transport makes the other ranks stop waiting (and raise) too.
    """

    rank: int
    world_size: int
    #: whether rank 0 commits the manifest through ``Backend.commit`` (else :meth:`settle` publishes it)
    rank0_commits: bool = True
    #: whether this rank removes the objects the committed manifest does not reference
    cleans_up: bool = False

    def committed(self, key: str) -> bool:
        """Whether the manifest ``key`` is committed already (then nothing is written)."""
        return False

    def begin(self) -> None:
        """Before this rank writes its data (a failure counts as a failed write)."""
        return  # (nothing to do by default)

    @abc.abstractmethod
    def share(self, part: dict[str, Any] | None, error: BaseException | None) -> list[dict[str, Any]] | None:
        """Hand over this rank's part (or the error its write raised); every part on rank 0, None on the others.

        Raises on every rank when any rank failed; ``_Committed`` when the step was committed meanwhile."""

    def place(self, backend: Backend, prefix: str, run_id: str | None) -> None:
        """Once every rank's data is written, before anything is committed (the erasure-coded RAM tier spreads its
        shares here)."""
        return  # (nothing to do by default)

    @abc.abstractmethod
    def settle(self, backend: Backend, key: str, text: str | bytes | None, error: BaseException | None) -> Any:
        """Rank 0 passes the manifest it committed (or its error); every rank learns the outcome: returns the
        committed manifest text, or None where this rank does not learn it. Raises on every rank when it failed."""

    def abort(self) -> None:
        """Rank 0 was interrupted between the parts and the commit: the other ranks stop waiting."""
        return  # (nothing to do by default)


class CollectiveTransport(Transport):
    """The trainer's ranks agree through collectives (:class:`~lightning_snapshot.dist.comm.Comm`): a rank's failure
    becomes every rank's error, no rank is left waiting in a collective.

    Args:
        backend: the tier written (named in the errors; its objects are discarded after a failure).
        run_id: the nonce of this write's object names; the objects of a failed write that carry it are discarded
            (rank 0, or every rank of a node-local tier). None: nothing is discarded.
        node_local: the tier's nodes each hold their own objects: one rank per node commits the manifest
            (``publish``) and every rank cleans up.
        distribute: call the tier's ``distribute`` (when it has one) once every rank's data is written.
        failure: when given, the message of the error raised on the ranks that did not fail themselves, and the
            collectives' own errors are not translated (the copy's behaviour).
    """

    def __init__(
        self,
        comm: Comm,
        backend: Backend,
        step: int,
        run_id: str | None = None,
        *,
        node_local: bool = False,
        distribute: bool = False,
        failure: str | None = None,
    ) -> None:
        self.comm, self.backend, self.step, self.run_id = comm, backend, step, run_id
        self.rank, self.world_size = comm.rank, comm.world_size
        self.node_local, self.distribute = node_local, distribute
        self.failure = failure
        self.rank0_commits = not node_local
        self.cleans_up = comm.rank == 0 or node_local

    def _what(self, what: str) -> str:
        return f"{what} of the snapshot of step {self.step} in the {self.backend.tier} tier {self.backend.url}"

    def _collective(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A collective that moves data (the parts, the manifest) once every rank agreed that none failed."""
        if self.failure is not None:
            return fn(*args)
        try:
            return fn(*args)
        except Exception as e:  # a peer died or the group's timeout ran out
            raise waiting_failed(self.comm, self._what(what), e, SnapshotWriteError) from e

    def _discard(self) -> None:
        if self.run_id is not None and (self.comm.rank == 0 or self.node_local):
            # a node-local tier (RAM) holds each node's objects on that node only
            discard_run_objects(self.backend, step_dirname(self.step), self.run_id)

    def _agree(self, what: str, error: BaseException | None) -> None:
        agree_on(
            self.comm,
            self._what(what),
            error=error,
            elsewhere=self.failure,
            failed=SnapshotWriteError,
            on_failure=self._discard,
            translate=self.failure is None,
        ).result()

    def share(self, part: dict[str, Any] | None, error: BaseException | None) -> list[dict[str, Any]] | None:
        self._agree("writing the data", error)
        return cast("list[dict[str, Any]] | None", self._collective("the manifest parts", self.comm.gather, part))

    def place(self, backend: Backend, prefix: str, run_id: str | None) -> None:
        # a tier that spreads each rank's objects over nodes (the erasure-coded RAM tier) places them now, once every
        # rank's data is written and before anything is committed
        if not (self.distribute and isinstance(backend, Distributing)):
            return
        error: BaseException | None = None
        try:
            backend.distribute(self.comm, prefix, run_id)
        except Exception as e:  # noqa: BLE001 - re-raised below on every rank
            error = e
        self._agree("placing the data", error)

    def settle(self, backend: Backend, key: str, text: str | bytes | None, error: BaseException | None) -> Any:
        self._agree("committing the manifest", error)
        text = self._collective("the manifest", self.comm.broadcast, text)
        if self.node_local:
            # every node holds the manifest of the snapshots it has shares of: one rank per node commits it
            try:
                assert text is not None
                backend.publish(self.comm, key, text if isinstance(text, bytes) else text.encode())
            except Exception as e:  # noqa: BLE001 - re-raised below on every rank
                error = e
            self._agree("committing the manifest", error)
        return text


class MarkerTransport(Transport):
    """The nodes' snapshot agents agree through files in the tier itself: each rank writes its part
    (``<run>-part-<rank>.json``) or, when its write failed, a ``<run>-failed-<rank>.json`` marker; rank 0 waits for
    every part, commits the manifest (or leaves its own marker), the others wait for the manifest. Every wait is
    bounded (``wait`` seconds from the part's write) and ends at once at a failure marker.

    Args:
        tier: the tier written (every rank's agent must see the same directory or bucket).
        step, run_id, rank, world_size: the write, and which rank of it this is.
        wait: the bounded wait (``collective_timeout``).
    """

    def __init__(self, tier: Backend, step: int, run_id: str, rank: int, world_size: int, wait: float) -> None:
        self.tier, self.step, self.run_id = tier, step, run_id
        self.rank, self.world_size = rank, world_size
        self.wait = wait
        self.prefix = step_dirname(step)
        self.cleans_up = rank == 0
        self.deadline = time.monotonic() + wait
        self._failed = f"{self.prefix}/{run_id}-failed-{rank:05d}.json"

    def committed(self, key: str) -> bool:
        return self.tier.exists(key)

    def _fail(self, error: BaseException | None = None) -> None:
        """Leave this rank's failure marker, with its error's text for the other ranks' errors."""
        if self.world_size > 1:
            with contextlib.suppress(Exception):  # (the tier may be what fails)
                marker = {"error": problem_text(error)} if error is not None else {}
                self.tier.write(self._failed, [json.dumps(marker).encode()])

    def begin(self) -> None:
        if self.world_size > 1 and self.tier.exists(self._failed):
            self.tier.delete(self._failed)  # a new attempt

    def share(self, part: dict[str, Any] | None, error: BaseException | None) -> list[dict[str, Any]] | None:
        try:
            if error is not None:
                raise error
            if self.world_size > 1:
                self.tier.write(f"{self.prefix}/{self.run_id}-part-{self.rank:05d}.json", [json.dumps(part).encode()])
        except Exception as e:
            self._fail(e)
            raise
        self.deadline = time.monotonic() + self.wait
        if self.rank != 0:
            return None
        assert part is not None
        try:  # (any failure of rank 0 leaves its marker: the other ranks' agents stop waiting at once)
            parts = _gather_parts(self.tier, self.prefix, self.run_id, self.world_size, part, self.deadline)
        except BaseException as e:
            self._fail(e)
            raise
        if parts is None or self.tier.exists(f"{self.prefix}/{MANIFEST_NAME}"):
            raise _Committed
        return parts

    def settle(self, backend: Backend, key: str, text: str | bytes | None, error: BaseException | None) -> Any:
        if self.rank == 0:
            if error is not None:
                self._fail(error)
                raise error
            return text
        while not self.tier.exists(key):
            if self.tier.exists(f"{self.prefix}/{self.run_id}-failed-00000.json"):
                raise SnapshotError(
                    f"rank {self.rank}'s agent: rank 0 failed to commit step {self.step} to the {self.tier.tier}"
                    f" tier {self.tier.url} (see its log)"
                    + _marker_problem(self.tier, f"{self.prefix}/{self.run_id}-failed-00000.json")
                )
            if time.monotonic() > self.deadline:
                raise SnapshotError(
                    f"rank {self.rank}'s agent: waited {self.wait:g} s for rank 0 to commit step {self.step} to"
                    f" the {self.tier.tier} tier {self.tier.url} (collective_timeout); is that directory"
                    " shared by all nodes? If not, use LocalTier(..., node_local=True)"
                )
            time.sleep(0.1)
        return None

    def abort(self) -> None:
        self._fail()


def _gather_parts(
    tier: Any, prefix: str, run_id: str, world: int, own: dict[str, Any], deadline: float
) -> list[dict[str, Any]] | None:
    """Rank 0's agent: every rank's manifest part of the step ``prefix``, in rank order (``own`` is rank 0's), or
    None when the step was committed meanwhile (an earlier attempt). A part that is not there, or not readable yet,
    is waited for until ``deadline`` (``time.monotonic``).

    Raises:
        SnapshotError: a rank left its ``failed`` marker, or the deadline passed; naming the rank, step and tier.
    """
    wait = max(0.0, deadline - time.monotonic())
    parts = [own]
    for r in range(1, world):
        key = f"{prefix}/{run_id}-part-{r:05d}.json"
        unreadable = ""
        while (got := _read_part(tier, key)) is None or isinstance(got, str):
            unreadable = got or unreadable
            if tier.exists(f"{prefix}/{run_id}-failed-{r:05d}.json"):
                raise SnapshotError(
                    f"rank {r} could not write its part of {prefix} to the {tier.tier} tier {tier.url} (see its log)"
                    + _marker_problem(tier, f"{prefix}/{run_id}-failed-{r:05d}.json")
                )
            if time.monotonic() > deadline:
                if unreadable:
                    raise SnapshotError(
                        f"rank 0's agent: rank {r}'s part of {prefix} in the {tier.tier} tier {tier.url} was still"
                        f" unreadable after {wait:.0f} s (collective_timeout): {unreadable}. Is another job writing"
                        " the same directory? Give each run its own"
                    )
                raise SnapshotError(
                    f"rank 0's agent: waited {wait:.0f} s for rank {r}'s part of {prefix} in the {tier.tier} tier"
                    f" {tier.url} (collective_timeout); is that directory shared by all nodes? If not, use"
                    " LocalTier(..., node_local=True)"
                )
            if tier.exists(f"{prefix}/{MANIFEST_NAME}"):
                return None
            time.sleep(0.05)
        parts.append(got)
    return parts


def _marker_problem(tier: Any, key: str) -> str:
    """ ": <the error>" a rank's failure marker ``key`` holds (a file in the tier: read as JSON, any other content
    ignored), or "" when it says none or cannot be read."""
    try:
        got = json.loads(tier.read(key))
    except Exception:  # noqa: BLE001 - the marker's presence is the message; its text only adds to it
        return ""
    text = got.get("error") if isinstance(got, dict) else None
    return f": {text[:PROBLEM_CHARS]}" if isinstance(text, str) and text else ""


def _read_part(tier: Any, key: str) -> dict[str, Any] | str | None:
    """Another agent's manifest part ``key``: the part, ``None`` while it is not there, or why it cannot be read yet.

    Every tier publishes an object whole (``Backend.write``), but a part is still taken as not there yet, never as an
    error, when it cannot be read or parsed: the caller waits for it within its bounded wait, so a tier or a
    filesystem that shows an object before its bytes (a network filesystem's caching, a tier of another library)
    costs a retry, not the snapshot.
    """
    try:
        if not tier.exists(key):
            return None
        part = json.loads(tier.read(key))
    except FileNotFoundError:  # (deleted between exists and read: a new attempt of that rank)
        return None
    except (OSError, EOFError, ValueError, SnapshotError) as e:  # (JSONDecodeError is a ValueError)
        return f"{type(e).__name__}: {e}"
    if not isinstance(part, dict) or not isinstance(part.get("objects"), list):
        return f"not a manifest part (a JSON {type(part).__name__})"
    return part


# ----------------------------------------------------------------------------------------------- the rule
def commit_snapshot(
    backend: Backend,
    transport: Transport,
    step: int,
    write: Callable[[], dict[str, Any] | None],
    merge: Callable[[list[dict[str, Any]]], str | bytes],
    *,
    run_id: str | None = None,
    where: str = "new manifest of {prefix}",
) -> Commit:
    """Commit the snapshot of ``step`` to ``backend`` under the commit rule. Called by every rank, at the same point.

    ``write`` writes this rank's data objects and returns its manifest part; once every rank's is written, rank 0
    turns the parts into the manifest text (``merge``), parses it back with the loader's parser (``where`` names it
    in errors; ``{prefix}`` is the step's directory) and commits it, last. A failure anywhere raises on every rank
    (as ``transport`` tells them) and leaves the step uncommitted: the loader never sees it. A step committed
    already is left as it is where ``transport`` checks for it; a manifest the tier refuses because an earlier
    attempt of this very write committed the same snapshot stands (:func:`commit_manifest`). After the commit, the
    objects the manifest does not reference (older writes of the same step) are removed.
    """
    prefix = step_dirname(step)
    key = f"{prefix}/{MANIFEST_NAME}"
    if transport.committed(key):
        return Commit(None, written=False)
    error: BaseException | None = None
    part: dict[str, Any] | None = None
    try:
        transport.begin()
        part = write()
    except Exception as e:  # noqa: BLE001 - re-raised by the transport on every rank
        error = e
    try:
        parts = transport.share(part, error)
    except _Committed:
        return Commit(None, written=False)
    transport.place(backend, prefix, run_id)
    error = None
    text: str | bytes | None = None
    manifest: Manifest | None = None  # rank 0's, parsed once as the check of what it commits
    if transport.rank == 0:
        try:
            assert parts is not None
            text = merge(parts)
            manifest = Manifest.from_json(text, where=where.format(prefix=prefix))
            if transport.rank0_commits:
                commit_manifest(backend, key, text)
        except Exception as e:  # noqa: BLE001 - re-raised by the transport on every rank
            error = e
        except BaseException:
            transport.abort()
            raise
    text = transport.settle(backend, key, text, error)
    if text is None:
        return Commit(None)
    if manifest is None:
        manifest = Manifest.from_json(text, where=f"manifest of {prefix}")
    if transport.cleans_up:
        try:  # (best effort, on some ranks only: a failure here must not make only them retry, out of step)
            remove_unreferenced(backend, prefix, manifest)
        except Exception as e:  # noqa: BLE001 - the snapshot is committed; leftovers go with its retention
            log.warning("lightning-snapshot: could not remove older objects of %s in %s: %s", prefix, backend.url, e)
    return Commit(manifest)
