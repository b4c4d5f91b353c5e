"""The snapshot format's names and entries: the typed records a manifest is made of, and the names of its files.

One job: what the format's parts are, without the JSON (:mod:`~lightning_snapshot.format.manifest` writes and parses it,
:mod:`~lightning_snapshot.format.decode` checks each entry). The format version, the checksum algorithm and the
reserved file names; the step directory names (:func:`step_dirname`, :func:`parse_step_dirname`); storage key
validation (:func:`validate_key`); the tensor groups of the health record (:func:`health_group`); and the frozen
entry dataclasses :class:`Fragment`, :class:`TensorEntry`, :class:`ObjectEntry`, :class:`RankSection` and
:class:`ReplicaRecord`. All are re-exported by :mod:`~lightning_snapshot.format.manifest`, where callers import them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_snapshot.errors import UnsafePathError

__all__ = [
    "CHECKSUM_ALGORITHM",
    "FORMAT_VERSION",
    "GROUP_RE",
    "MANIFEST_NAME",
    "RESTORES_NAME",
    "Fragment",
    "ObjectEntry",
    "RankSection",
    "ReplicaRecord",
    "TensorEntry",
    "health_group",
    "parse_step_dirname",
    "step_dirname",
    "tensors_by_name",
    "validate_key",
]

FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "xxh3_64"
MANIFEST_NAME = "manifest.json"
#: The crash-loop breaker's record of restores, next to the manifest of the step it counts (not part of the snapshot:
#: never listed in a manifest, never checksummed, removed with its step).
RESTORES_NAME = "restores.json"

_STEP_RE = re.compile(r"^step-(\d{12})$")
_KEY_PART_RE = re.compile(r"^[A-Za-z0-9._-]+$")
#: A health group's name (:func:`health_group`), as the health record's keys must be
GROUP_RE = re.compile(r"^[A-Za-z0-9._-]{1,100}(/[0-9]{1,6})?$")


def health_group(name: str) -> str:
    """The health group of a shared tensor name: ``state_dict`` (the model's parameters and buffers),
    ``optimizer_states/<i>`` (the state of optimizer ``i``), or the name's first part for anything else."""
    head, _, rest = name.partition("/")
    if head == "optimizer_states" and rest:
        index = rest.partition("/")[0]
        if index.isdigit() and len(index) <= 6:
            return f"{head}/{index}"
    return head if GROUP_RE.match(head) else "other"


def step_dirname(step: int) -> str:
    """Directory name of the snapshot of ``step``: ``step-000000000042``."""
    if not isinstance(step, int) or step < 0 or step >= 10**12:
        raise ValueError(f"step must be an int in [0, 10**12), got {step!r}")
    return f"step-{step:012d}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a snapshot directory name, or None when ``name`` is not one."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def validate_key(key: str) -> str:
    """Check that ``key`` is a relative, '/'-separated key that cannot escape its root.

    Raises:
        UnsafePathError: for absolute keys, ``..``/``.`` parts, empty parts, backslashes or odd characters.
    """
    if not isinstance(key, str) or not key:
        raise UnsafePathError(f"storage key {key!r} is empty or not a string")
    for part in key.split("/"):
        if part in ("", ".", "..") or not _KEY_PART_RE.match(part):
            raise UnsafePathError(
                f"storage key {key!r} would escape the tier root or holds characters outside [A-Za-z0-9._-]"
                " (absolute paths, '..', empty parts and backslashes are refused). The manifest or the path was"
                " tampered with or corrupted: use another snapshot"
            )
    return key


# ---------------------------------------------------------------------------------------------------- dataclasses


@dataclass(frozen=True)
class Fragment:
    """A contiguous run of a tensor's bytes stored in one data object.

    ``global_offsets``/``local_shape`` place the fragment inside the tensor's ``global_shape`` (a box); a fragment
    that is the whole tensor has zero offsets and ``local_shape == global_shape``.
    """

    object: str
    offset: int
    nbytes: int
    global_offsets: tuple[int, ...]
    local_shape: tuple[int, ...]
    checksums: tuple[str, ...]


@dataclass(frozen=True)
class TensorEntry:
    """A tensor: dtype, global shape and where its fragments live; or an alias of another entry (tied weights)."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    fragments: tuple[Fragment, ...] = ()
    alias_of: str | None = None


@dataclass(frozen=True)
class ObjectEntry:
    """A data object of the snapshot: its key (relative to the step directory), size and writing rank."""

    key: str
    nbytes: int
    rank: int


@dataclass(frozen=True)
class RankSection:
    """State private to one rank (RNG, data position): a JSON tree plus its tensors."""

    rank: int
    state: Any
    tensors: tuple[TensorEntry, ...] = ()


@dataclass(frozen=True)
class ReplicaRecord:
    """The replica check of one snapshot (:mod:`lightning_snapshot.fit.replicas`): how many tensors were compared
    across the ranks, how many disagreed, and the first of those with the ranks holding another value."""

    checked: int
    disagree_count: int = 0
    disagree: tuple[tuple[str, tuple[int, ...]], ...] = ()


def tensors_by_name(entries: Sequence[TensorEntry]) -> dict[str, TensorEntry]:
    """Index a section's tensor entries by name."""
    return {t.name: t for t in entries}
