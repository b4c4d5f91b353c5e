"""Operator tools behind ``lightning-snapshot gc`` and ``lightning-snapshot copy``.

:func:`plan_gc` decides what a garbage collection removes (reading only), :func:`run_gc` does it; :func:`copy_step`
promotes one committed snapshot to another tier, verified and under the destination's commit rule. Called by the
CLI's ``gc`` and ``copy`` commands (cli.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_snapshot.backends.base import Backend
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.errors import ConfigError, SnapshotError, SnapshotWriteError
from lightning_snapshot.format.manifest import MANIFEST_NAME, Manifest, parse_step_dirname, step_dirname
from lightning_snapshot.persist.writer import (
    committed_steps,
    copy_snapshot,
    delete_step,
    expired_snapshots,
)

__all__ = ["DATA_SUFFIX", "DEFAULT_GRACE_S", "GcPlan", "copy_step", "plan_gc", "run_gc"]

log = logging.getLogger(__name__)

#: The name ending of the data objects a write creates (``<run>-<kind>-<rank>.bin``).
DATA_SUFFIX = ".bin"
#: How long an uncommitted write must have been idle before ``gc`` counts it as a crashed write's leftovers (its
#: newest object or part is older than this): one hour. A write in progress changes its objects far more often.
DEFAULT_GRACE_S = 3600.0


@dataclass
class GcPlan:
    """What :func:`run_gc` removes from one tier, and what it leaves and why. Plain values (``--json``).

    Attributes:
        tier: the tier's URL.
        protected: the newest committed snapshot whose manifest is valid: never removed (None: there is none). The
            newest healthy one is never removed either.
        kept: committed steps that stay, newest first.
        snapshots: committed snapshots to delete: ``{"step", "reason" ("keep-last" or "older-than"), "bytes",
            "age_s"}`` (bytes and age are None when the manifest cannot be read).
        leftovers: objects or step directories of crashed writes: ``{"key", "reason" ("uncommitted" or
            "unreferenced"), "age_s"}``.
        uploads: stale multipart uploads to abort: ``{"key", "upload_id", "age_s"}``.
        in_progress: writes younger than the grace period, left alone: ``{"key", "age_s"}`` (age None: unknown).
    """

    tier: str
    protected: int | None = None
    kept: list[int] = field(default_factory=list)
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    leftovers: list[dict[str, Any]] = field(default_factory=list)
    uploads: list[dict[str, Any]] = field(default_factory=list)
    in_progress: list[dict[str, Any]] = field(default_factory=list)

    @property
    def actions(self) -> int:
        """How many removals the plan holds."""
        return len(self.snapshots) + len(self.leftovers) + len(self.uploads)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _age(backend: Backend, key: str, now: float) -> float | None:
    modified = backend.modified(key)
    return None if modified is None else max(0.0, now - modified)


def _manifests(backend: Backend, steps: list[int]) -> dict[int, Manifest | None]:
    """The parsed manifest of each step; None for one that cannot be parsed (it is reported, never trusted)."""
    from lightning_snapshot.restore.loader import read_manifest

    out: dict[int, Manifest | None] = {}
    for step in steps:
        try:
            out[step] = read_manifest(backend, step)
        except (SnapshotError, ValueError) as e:
            if isinstance(e, SnapshotWriteError):  # the tier is unreachable: not a bad manifest
                raise
            log.warning("lightning-snapshot: step %d in %s has an unreadable manifest: %s", step, backend.url, e)
            out[step] = None
    return out


def plan_gc(
    backend: Backend,
    *,
    keep_last: int | None = None,
    older_than: float | None = None,
    grace: float = DEFAULT_GRACE_S,
    now: float | None = None,
) -> GcPlan:
    """Decide what a garbage collection of ``backend`` (a durable tier) removes; reads only.

    * committed snapshots beyond the ``keep_last`` newest (the retention rule of training,
      :func:`~lightning_snapshot.persist.writer.expired_snapshots`) and those created at least ``older_than`` seconds
      ago;
      the newest committed snapshot with a valid manifest is never among them, nor the newest healthy one (no NaN
      or infinity recorded in its manifest);
    * leftovers of crashed writes: step directories without a committed manifest, and data objects (``*.bin``) of
      a committed step that its manifest does not reference, once nothing in them changed for ``grace`` seconds;
    * multipart uploads (S3) whose newest part is at least ``grace`` seconds old.

    :func:`run_gc` checks each uncommitted step again right before removing it, and keeps one committed meanwhile.

    A write younger than ``grace``, a step directory with a younger upload under it, and anything whose age the tier
    cannot tell are left alone (:attr:`GcPlan.in_progress`).
    """
    if not backend.durable:
        raise ConfigError(
            f"gc prunes durable tiers; the {backend.tier} tier {backend.url!r} keeps its own keep_last"
            " and is freed by its agent (lightning-snapshot agent --stop)"
        )
    if keep_last is not None and keep_last < 1:
        raise ConfigError(f"keep_last must be >= 1, got {keep_last!r}")
    now = time.time() if now is None else now
    plan = GcPlan(tier=backend.url)
    committed = committed_steps(backend)
    manifests = _manifests(backend, committed)
    plan.protected = next((s for s in committed if manifests[s] is not None), None)
    # and the newest healthy one (no NaN or infinity recorded), as training's retention keeps it
    healthy = next((s for s in committed if (m := manifests[s]) is not None and m.healthy), None)
    protect = {s for s in (plan.protected, healthy) if s is not None}
    expired = dict.fromkeys(expired_snapshots(committed, keep_last, protect), "keep-last")
    if older_than is not None:
        for step in committed:
            m = manifests[step]
            if step not in protect and step not in expired and m is not None and now - m.created_unix >= older_than:
                expired[step] = "older-than"
    for step in committed:
        m = manifests[step]
        if step in expired:
            plan.snapshots.append(
                {
                    "step": step,
                    "reason": expired[step],
                    "bytes": m and m.total_bytes,
                    "age_s": m and max(0.0, now - m.created_unix),
                }
            )
        else:
            plan.kept.append(step)

    busy: set[str] = set()  # step directories with a young upload under them
    for upload in backend.incomplete_uploads():
        age = max(0.0, now - upload["modified"])
        if age >= grace:
            plan.uploads.append({"key": upload["key"], "upload_id": upload["upload_id"], "age_s": age})
        else:
            plan.in_progress.append({"key": upload["key"], "age_s": age})
            busy.add(upload["key"].split("/", 1)[0])

    def leftover(key: str, reason: str) -> None:
        age = _age(backend, key, now)
        if age is not None and age >= grace and key.split("/", 1)[0] not in busy:
            plan.leftovers.append({"key": key, "reason": reason, "age_s": age})
        elif age is not None or reason == "uncommitted":
            plan.in_progress.append({"key": key, "age_s": age})

    for name in backend.list(""):
        listed = parse_step_dirname(name)
        if listed is None or listed in expired:
            continue
        if listed not in manifests:
            leftover(name, "uncommitted")
        elif (manifest := manifests[listed]) is not None:
            referenced = {o.key for o in manifest.objects}
            for obj in backend.list(name):  # data objects only: other files next to a manifest are not leftovers
                if obj.endswith(DATA_SUFFIX) and obj not in referenced:
                    leftover(f"{name}/{obj}", "unreferenced")
    return plan


def run_gc(backend: Backend, plan: GcPlan, on_action: Callable[[], None] | None = None) -> None:
    """Carry out ``plan`` on ``backend``: abort the uploads, delete the snapshots (each manifest first, so a
    snapshot is never seen half deleted), then the leftovers. ``on_action`` is called after each (progress)."""
    for upload in plan.uploads:
        backend.abort_upload(upload)
        if on_action is not None:
            on_action()
    for entry in plan.snapshots:
        delete_step(backend, entry["step"])
        if on_action is not None:
            on_action()
    for entry in plan.leftovers:
        if entry["reason"] == "uncommitted" and backend.exists(f"{entry['key']}/{MANIFEST_NAME}"):
            log.warning("lightning-snapshot: %s was committed while gc ran; kept", entry["key"])
        else:
            backend.delete(entry["key"])
        if on_action is not None:
            on_action()


def copy_step(src: Backend, dst: Backend, step: int, on_object: Callable[[int], None] | None = None) -> Manifest:
    """Copy the committed snapshot of ``step`` from ``src`` to ``dst``: every object checked against the manifest's
    checksums as it is read, written, and the manifest committed last (``dst``'s commit rule), so ``dst`` never
    shows a partial snapshot. One process (:class:`~lightning_snapshot.dist.comm.LocalComm`).

    Raises:
        ConfigError: ``src`` and ``dst`` are the same tier, or ``dst`` is not durable (a RAM tier).
        SnapshotWriteError: ``dst`` already holds a committed snapshot of ``step`` (it is never overwritten).
        ChecksumError / SnapshotError: reading, checking or writing failed; what this call wrote is removed again
            and nothing is committed.
    """
    if not dst.durable:
        raise ConfigError(
            f"copy writes to a durable tier; the {dst.tier} tier {dst.url!r} is filled by training"
            " and its agent: give a path or an object-store URL as the destination"
        )
    if src.url == dst.url:
        raise ConfigError(f"the source and the destination are the same tier {src.url!r}: give another destination")
    prefix = step_dirname(step)
    if dst.exists(f"{prefix}/{MANIFEST_NAME}"):
        raise SnapshotWriteError(
            f"the {dst.tier} tier {dst.url!r} already holds a committed snapshot of step {step}; a committed snapshot"
            " is never overwritten: copy another --step, or remove it first (lightning-snapshot gc)"
        )
    created = _missing_dirs(dst)
    had = set(dst.list(prefix))
    try:
        manifest = copy_snapshot(src, dst, step, LocalComm(), verify=True, on_object=on_object)
    except BaseException:
        _undo_copy(dst, prefix, had, created)
        raise
    return manifest  # (copy_snapshot removed what the manifest does not reference)


def _missing_dirs(backend: Backend) -> list[Path]:
    """The directories of a local tier's root that do not exist yet (root first): a failed copy removes them."""
    root = backend.root
    missing: list[Path] = []
    if isinstance(root, Path):
        while not root.exists() and root.parent != root:
            missing.append(root)
            root = root.parent
    return missing


def _undo_copy(dst: Backend, prefix: str, had: set[str], created: list[Path]) -> None:
    """Best effort after a failed copy: remove the objects and directories it created (never what ``dst`` held
    before)."""
    try:
        for name in dst.list(prefix):
            if name not in had:
                dst.delete(f"{prefix}/{name}")
        if not had and not dst.list(prefix):
            dst.delete(prefix)
        for directory in created:
            directory.rmdir()
    except Exception as e:  # noqa: BLE001 - the copy's own error is the one to report
        log.warning("lightning-snapshot: could not remove the partial copy of %s from %s: %s", prefix, dst.url, e)
