"""The restore records next to each snapshot (``step-<N>/restores.json``), and the facts a resume decides on.

Read by rank 0's :class:`~lightning_snapshot.restore.restorer.Restorer` (and the CLI's ``list``/``inspect``) for every
candidate snapshot, written by it after each restore; :mod:`~lightning_snapshot.restore.policy` decides from the facts.
A record is untrusted input: an object too large, not JSON or of another commit counts as no restore.
"""

from __future__ import annotations

import json
import logging
import time

from lightning_snapshot.backends.base import Backend
from lightning_snapshot.errors import SnapshotError
from lightning_snapshot.format.manifest import MANIFEST_NAME, RESTORES_NAME, Manifest, step_dirname, validate_key
from lightning_snapshot.restore.policy import Candidate
from lightning_snapshot.staging import digest

__all__ = ["manifest_digest", "read_candidate", "read_restores", "record_restore"]

log = logging.getLogger(__name__)

#: Largest restore record read (bytes); a bigger object is not a record.
_MAX_RECORD_BYTES = 4096


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
    replicas = manifest.replicas.disagree[0][0] if manifest.replicas and manifest.replicas.disagree else None
    if replicas is None and manifest.replicas_disagree:
        replicas = "(not named)"
    return Candidate(step, index, manifest.first_nonfinite, restores, replicas), manifest_id
