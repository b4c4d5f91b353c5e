"""Which snapshots an automatic resume may use: healthy ones, and not one the run keeps crashing after.

Two facts decide, besides the commit rule:

* **health**: the manifest's ``health`` field says, per tensor group, whether the staged parameters and optimizer
  state held a NaN or an infinity (see :func:`~lightning_snapshot.staging.nonfinite_tensors`). An unhealthy
  snapshot is skipped unless the user opts out; a manifest without the field counts as healthy.
* **restores**: every restore is recorded next to the snapshot it used, in a small JSON object
  ``step-<N>/restores.json`` (:data:`~lightning_snapshot.manifest.RESTORES_NAME`) of each tier that holds the step
  (the RAM tier keeps it in the memory of rank 0's node, which outlives the trainer):
  ``{"restores": count, "manifest": digest}``. The digest is that of the tier's manifest bytes, so a
  step committed again later (a new snapshot of the same step) starts from zero. The count of a step is the largest
  over the tiers. A snapshot restored ``max_restores`` times is skipped: the run crashed after each of those
  restores and committed nothing newer, so the next resume takes the one before it.

:func:`plan_resume` is pure (no I/O) and decides; the callback gathers the facts on rank 0 and broadcasts the plan,
so every rank of a job agrees.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_snapshot.backends.base import Backend
from lightning_snapshot.errors import SnapshotError
from lightning_snapshot.manifest import MANIFEST_NAME, RESTORES_NAME, Manifest, step_dirname, validate_key
from lightning_snapshot.staging import digest

__all__ = [
    "Candidate",
    "ResumePlan",
    "manifest_digest",
    "plan_resume",
    "read_candidate",
    "read_restores",
    "record_restore",
]

log = logging.getLogger(__name__)

#: Largest restore record read (bytes); a bigger object is not a record.
_MAX_RECORD_BYTES = 4096


@dataclass(frozen=True)
class Candidate:
    """A committed snapshot an automatic resume may use.

    Attributes:
        step: its step.
        tier: the index of its tier in the callback's tiers.
        nonfinite: ``(group, first tensor)`` holding a non-finite value, or None (healthy or not recorded).
        restores: how often it was restored before (the largest count over the tiers holding the step).
    """

    step: int
    tier: int
    nonfinite: tuple[str, str] | None = None
    restores: int = 0


@dataclass(frozen=True)
class ResumePlan:
    """What :func:`plan_resume` decided: the snapshots to try, newest first, and the warnings to give (once)."""

    candidates: tuple[Candidate, ...]
    warnings: tuple[str, ...]
    #: Why nothing is left to resume from (every snapshot was skipped), or None.
    problem: str | None = None


def plan_resume(candidates: Sequence[Candidate], *, max_restores: int | None, resume_unhealthy: bool) -> ResumePlan:
    """Drop unhealthy snapshots (unless ``resume_unhealthy``) and those restored ``max_restores`` times or more
    (unless ``max_restores`` is None) from ``candidates`` (newest first), keeping the order of the rest.

    A step's restore count is the largest over its candidates (tiers). Returns the kept candidates and at most two
    warnings: one naming the newest unhealthy step and its first non-finite tensor, one naming the step a crash loop
    left behind. When every candidate was dropped, ``problem`` says why.
    """
    counts: dict[int, int] = {}
    for c in candidates:
        counts[c.step] = max(counts.get(c.step, 0), c.restores)
    kept: list[Candidate] = []
    unhealthy: list[Candidate] = []
    looping: list[int] = []
    for c in candidates:
        if c.nonfinite is not None and not resume_unhealthy:
            if all(u.step != c.step for u in unhealthy):
                unhealthy.append(c)
        elif max_restores is not None and counts[c.step] >= max_restores:
            if c.step not in looping:
                looping.append(c.step)
        else:
            kept.append(c)
    target = f"step {kept[0].step}" if kept else "none is left"
    messages: list[str] = []
    if unhealthy:
        first = unhealthy[0]
        group, tensor = first.nonfinite or ("", "")
        others = [u.step for u in unhealthy[1:]]
        plural = "s" if len(others) > 1 else ""
        also = f" (also unhealthy: step{plural} {', '.join(map(str, others))})" if others else ""
        messages.append(
            f"lightning-snapshot: skipping the unhealthy snapshot of step {first.step}: tensor {tensor!r} of"
            f" {group!r} holds a NaN or an infinity{also}. Resuming from the newest healthy snapshot ({target}); pass"
            " SnapshotCallback(resume_unhealthy=True) to resume from unhealthy snapshots anyway"
        )
    if looping:
        steps = ", ".join(map(str, looping))
        messages.append(
            f"lightning-snapshot: the snapshot of step {looping[0]} was restored {counts[looping[0]]} times"
            f" (max_restores={max_restores}) and no newer snapshot was committed since: the run crashes after"
            f" restoring it, so this resume takes the snapshot before it ({target})"
            + (f"; skipped for the same reason: steps {steps}" if len(looping) > 1 else "")
            + f". Delete {step_dirname(looping[0])}/{RESTORES_NAME} in its tiers to try it again, or raise"
            " max_restores"
        )
    problem = None
    if not kept and candidates:
        problem = (
            "every committed snapshot was skipped: " + " ".join(messages) + " (or pass resume=False to start fresh)"
        )
    return ResumePlan(tuple(kept), tuple(messages), problem)


def manifest_digest(text: bytes) -> str:
    """The identity of one commit of a step in one tier: the digest of its manifest bytes."""
    return digest(memoryview(text))


def _record_key(step: int) -> str:
    return validate_key(f"{step_dirname(step)}/{RESTORES_NAME}")


def read_restores(backend: Backend, step: int, manifest_id: str) -> int:
    """How often the commit ``manifest_id`` of ``step`` in ``backend`` was restored (0: no record, or a record of
    an earlier commit of the step). The record is untrusted: a malformed one is logged and counts as 0."""
    key = _record_key(step)
    try:
        if not backend.exists(key):
            return 0
        raw = backend.read(key)
    except (OSError, SnapshotError) as e:
        log.warning("lightning-snapshot: cannot read the restore record %s of %s (%s); counting 0", key, backend.url, e)
        return 0
    try:
        if len(raw) > _MAX_RECORD_BYTES:
            raise ValueError(f"{len(raw)} bytes is more than a record holds")
        record = json.loads(bytes(raw).decode("utf-8"))
        count = record.get("restores") if isinstance(record, dict) else None
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= 1 << 30:
            raise ValueError(f"'restores' must be an integer >= 0, got {count!r}")
        if not isinstance(record.get("manifest"), str):
            raise ValueError("'manifest' must be the digest of the manifest it counts")
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        log.warning("lightning-snapshot: ignoring the malformed restore record %s of %s (%s)", key, backend.url, e)
        return 0
    return count if record["manifest"] == manifest_id else 0


def record_restore(backend: Backend, step: int, manifest_id: str, count: int) -> None:
    """Record that the commit ``manifest_id`` of ``step`` in ``backend`` has been restored ``count`` times
    (durable when this returns, through the backend's ``write``). Called by rank 0 only."""
    record = {"restores": count, "manifest": manifest_id, "last_unix": time.time()}
    backend.write(_record_key(step), [json.dumps(record).encode()])


def read_candidate(backend: Backend, step: int, index: int) -> tuple[Candidate, str | None]:
    """The facts about ``step`` in ``backend`` (the callback's tier ``index``): its health and restore count, and
    its manifest digest (None when the manifest cannot be read: the resume itself then reports why)."""
    try:
        text = backend.read(f"{step_dirname(step)}/{MANIFEST_NAME}")
        manifest = Manifest.from_json(text, where=f"manifest of step {step} in {backend.url!r}")
    except Exception as e:  # noqa: BLE001 - never stops a resume: reading the snapshot itself reports the problem
        log.debug("lightning-snapshot: health of step %d in %s unknown: %s", step, backend.url, e)
        return Candidate(step, index), None
    manifest_id = manifest_digest(bytes(text))
    restores = read_restores(backend, step, manifest_id)
    return Candidate(step, index, manifest.first_nonfinite, restores), manifest_id
