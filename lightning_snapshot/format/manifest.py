"""The snapshot format: typed, versioned manifest dataclasses and their JSON form.

Used wherever a snapshot is written or read: writer.py and persist.py (write), loader.py, restore_records.py,
resume_policy.py, export.py, ops.py and cli.py (read), tree.py and staging (dtypes), and the backends (key
validation, step directory names).

A snapshot is ``<tier root>/step-<global_step:012d>/`` holding ``manifest.json`` and data objects. Data objects
are raw tensor bytes, each fragment aligned to ``alignment`` bytes, with one checksum per ``chunk_bytes`` chunk.
The manifest is written last and atomically: a step without a manifest does not exist.

This module is the :class:`Manifest` and its JSON (encoding, and the top level of decoding), and re-exports the
format's names as imported before the split: the entries and file names are in
:mod:`~lightning_snapshot.format.entries`, the checks of each entry in :mod:`~lightning_snapshot.format.decode`.

Parsing is strict. Every field is type-checked, every cross reference is resolved, unknown entry types and unknown
fields are errors, and every failure is a :class:`~lightning_snapshot.errors.ManifestError` (or its subclass
:class:`~lightning_snapshot.errors.FormatVersionError`). Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_snapshot.errors import FormatVersionError, ManifestError, UnsafePathError
from lightning_snapshot.format.collector import deferred_collection
from lightning_snapshot.format.decode import Reader, check_refs, parse_health, parse_replicas, parse_tensors
from lightning_snapshot.format.dtypes import DTYPES, dtype_from_name, dtype_name
from lightning_snapshot.format.entries import (
    CHECKSUM_ALGORITHM,
    FORMAT_VERSION,
    MANIFEST_NAME,
    RESTORES_NAME,
    Fragment,
    ObjectEntry,
    RankSection,
    ReplicaRecord,
    TensorEntry,
    health_group,
    parse_step_dirname,
    step_dirname,
    tensors_by_name,
    validate_key,
)

__all__ = [
    "CHECKSUM_ALGORITHM",
    "DTYPES",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "RESTORES_NAME",
    "Fragment",
    "Manifest",
    "ObjectEntry",
    "RankSection",
    "ReplicaRecord",
    "TensorEntry",
    "dtype_from_name",
    "dtype_name",
    "health_group",
    "parse_step_dirname",
    "step_dirname",
    "tensors_by_name",
    "validate_key",
]


@dataclass(frozen=True)
class Manifest:
    """The manifest of one snapshot. ``state`` is a JSON tree whose tensors are ``{"$tensor": name}`` refs."""

    step: int
    epoch: int
    world_size: int
    created_unix: float
    library_version: str
    objects: tuple[ObjectEntry, ...]
    tensors: tuple[TensorEntry, ...]
    state: Any
    ranks: tuple[RankSection, ...]
    chunk_bytes: int = 8 << 20
    alignment: int = 64
    checksum: str = CHECKSUM_ALGORITHM
    format_version: int = FORMAT_VERSION
    #: Per tensor group (:func:`health_group`): None when every floating-point value of its tensors is finite, else
    #: the name of its first tensor holding a NaN or an infinity. None for the whole field: not recorded (a snapshot
    #: written before lightning-snapshot recorded health), which counts as healthy.
    health: Mapping[str, str | None] | None = None
    #: The replica check's outcome at this step (:mod:`lightning_snapshot.fit.replicas`), or None: not checked (one
    #: process, not data parallel, the check off, or written before lightning-snapshot checked replicas).
    replicas: ReplicaRecord | None = None

    # -- lookups
    def object(self, key: str) -> ObjectEntry:
        for o in self.objects:
            if o.key == key:
                return o
        raise KeyError(key)

    def rank_section(self, rank: int) -> RankSection | None:
        for section in self.ranks:
            if section.rank == rank:
                return section
        return None

    @property
    def total_bytes(self) -> int:
        return sum(o.nbytes for o in self.objects)

    @property
    def first_nonfinite(self) -> tuple[str, str] | None:
        """``(group, tensor name)`` of the first tensor group holding a non-finite value (groups in manifest
        order), or None when the snapshot is healthy or its health was not recorded."""
        for group, first in (self.health or {}).items():
            if first is not None:
                return group, first
        return None

    @property
    def replicas_disagree(self) -> bool:
        """Whether the replica check of this step found ranks whose copies of the state disagree."""
        return self.replicas is not None and self.replicas.disagree_count > 0

    @property
    def healthy(self) -> bool:
        """Neither a NaN or an infinity recorded nor replicas that disagree (a snapshot whose health was not
        recorded counts as healthy)."""
        return self.first_nonfinite is None and not self.replicas_disagree

    @property
    def health_text(self) -> str:
        """One word for listings: ``healthy``, ``NaN/inf``, ``replicas disagree`` or ``unknown`` (not recorded)."""
        if self.first_nonfinite is not None:
            return "NaN/inf"
        if self.replicas_disagree:
            return "replicas disagree"
        return "unknown" if self.health is None else "healthy"

    # -- JSON
    def to_json(self) -> str:
        """Serialize to JSON text (standard JSON: no NaN/Infinity literals)."""
        # (no cycle check: a manifest is a tree, made from parsed JSON or from the encoder's depth-limited trees)
        return json.dumps(_manifest_to_dict(self), separators=(",", ":"), allow_nan=False, check_circular=False)

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "manifest") -> Manifest:
        """Parse and validate manifest JSON.

        Args:
            text: the manifest's bytes or text.
            where: a description used in error messages (e.g. the tier and step).

        Raises:
            FormatVersionError: the manifest was written by a newer format.
            ManifestError: anything else is wrong with it.
        """
        with deferred_collection():  # (tens of thousands of short-lived objects: see collector.py)
            return _parse(text, where)


def _parse(text: str | bytes, where: str) -> Manifest:
    """:meth:`Manifest.from_json`'s work."""
    try:
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8")
        raw = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except ManifestError as e:
        raise ManifestError(f"{where}: {e}; it is corrupted: use another snapshot or re-create it") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(
            f"{where} is not valid JSON (truncated or corrupted?): {e}. Use another snapshot or re-create it"
        ) from e
    try:
        return _manifest_from_dict(raw, where)
    except (ManifestError, UnsafePathError):
        raise
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RecursionError) as e:  # safety net
        raise ManifestError(f"{where} is malformed: {type(e).__name__}: {e}") from e


def _reject_constant(name: str) -> Any:
    raise ManifestError(f"manifest holds the non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    """A JSON number with a fraction or an exponent; one past the range of a double (``1e999``, which Python would
    read as infinity) is refused like the constants: a manifest never holds one (non-finite values are written as
    ``{"$float": ...}``), and it could not be written back."""
    value = float(text)
    if not math.isfinite(value):
        raise ManifestError(f"manifest holds the number {text[:40]}, which is out of the range of a double")
    return value


# ---------------------------------------------------------------------------------------------------- encoding


def _fragment_to_dict(f: Fragment) -> dict[str, Any]:
    return {
        "object": f.object,
        "offset": f.offset,
        "nbytes": f.nbytes,
        "global_offsets": list(f.global_offsets),
        "local_shape": list(f.local_shape),
        "checksums": list(f.checksums),
    }


def _tensor_to_dict(t: TensorEntry) -> dict[str, Any]:
    d: dict[str, Any] = {
        "type": "alias" if t.alias_of is not None else "tensor",
        "name": t.name,
        "dtype": t.dtype,
        "global_shape": list(t.global_shape),
    }
    if t.alias_of is not None:
        d["alias_of"] = t.alias_of
    else:
        d["fragments"] = [_fragment_to_dict(f) for f in t.fragments]
    return d


def _manifest_to_dict(m: Manifest) -> dict[str, Any]:
    d = {
        "format_version": m.format_version,
        "step": m.step,
        "epoch": m.epoch,
        "world_size": m.world_size,
        "created_unix": m.created_unix,
        "library_version": m.library_version,
        "checksum": m.checksum,
        "chunk_bytes": m.chunk_bytes,
        "alignment": m.alignment,
        "objects": [{"type": "object", "key": o.key, "nbytes": o.nbytes, "rank": o.rank} for o in m.objects],
        "tensors": [_tensor_to_dict(t) for t in m.tensors],
        "state": m.state,
        "ranks": [
            {"rank": r.rank, "state": r.state, "tensors": [_tensor_to_dict(t) for t in r.tensors]} for r in m.ranks
        ],
    }
    if m.health is not None:
        d["health"] = dict(m.health)
    if m.replicas is not None:
        d["replicas"] = {
            "checked": m.replicas.checked,
            "disagree_count": m.replicas.disagree_count,
            "disagree": [{"tensor": t, "ranks": list(ranks)} for t, ranks in m.replicas.disagree],
        }
    return d


# ---------------------------------------------------------------------------------------------------- decoding


def _manifest_from_dict(raw: Any, where: str) -> Manifest:
    r = Reader(where)
    if isinstance(raw, dict) and "format_version" in raw:
        version = raw["format_version"]
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            raise FormatVersionError(
                f"{where}: format_version {version} is newer than this lightning-snapshot reads ({FORMAT_VERSION})."
                " Upgrade with: pip install -U lightning-snapshot"
            )
    d = r.obj(
        raw,
        "$",
        {
            "format_version",
            "step",
            "epoch",
            "world_size",
            "created_unix",
            "library_version",
            "checksum",
            "chunk_bytes",
            "alignment",
            "objects",
            "tensors",
            "state",
            "ranks",
        },
        optional={"health", "replicas"},
    )
    r.int_(d["format_version"], "format_version", 1, FORMAT_VERSION)
    checksum = r.str_(d["checksum"], "checksum")
    if checksum != CHECKSUM_ALGORITHM:
        raise r.fail("checksum", f"unknown checksum algorithm {checksum!r} (known: {CHECKSUM_ALGORITHM!r})")
    chunk_bytes = r.int_(d["chunk_bytes"], "chunk_bytes", 1)
    alignment = r.int_(d["alignment"], "alignment", 1, 1 << 30)
    if alignment & (alignment - 1):
        raise r.fail("alignment", f"{alignment} is not a power of two")
    created = d["created_unix"]
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        raise r.fail("created_unix", "expected a number")
    world_size = r.int_(d["world_size"], "world_size", 1, 1 << 24)
    objects: list[ObjectEntry] = []
    sizes: dict[str, int] = {}
    for i, raw_o in enumerate(r.list_(d["objects"], "objects")):
        p = f"objects[{i}]"
        if not isinstance(raw_o, dict) or raw_o.get("type") != "object":
            kind = raw_o.get("type") if isinstance(raw_o, dict) else type(raw_o).__name__
            raise r.fail(
                p, f"unknown entry type {kind!r} (known: 'object'); this snapshot needs a newer lightning-snapshot"
            )
        od = r.obj(raw_o, p, {"type", "key", "nbytes", "rank"})
        key = r.str_(od["key"], f"{p}.key")
        try:
            validate_key(key)
        except UnsafePathError as e:
            raise UnsafePathError(f"{where}: field {p}.key: {e}") from None
        if key in sizes or key == MANIFEST_NAME:
            raise r.fail(p, f"duplicate or reserved object key {key!r}")
        sizes[key] = r.int_(od["nbytes"], f"{p}.nbytes")
        objects.append(ObjectEntry(key, sizes[key], r.int_(od["rank"], f"{p}.rank", 0, world_size - 1)))
    tensors = parse_tensors(r, d["tensors"], "tensors", sizes, chunk_bytes, alignment)
    check_refs(r, d["state"], "state", {t.name for t in tensors})
    ranks: list[RankSection] = []
    for i, raw_r in enumerate(r.list_(d["ranks"], "ranks")):
        p = f"ranks[{i}]"
        rd = r.obj(raw_r, p, {"rank", "state", "tensors"})
        rank = r.int_(rd["rank"], f"{p}.rank", 0, world_size - 1)
        if any(s.rank == rank for s in ranks):
            raise r.fail(p, f"duplicate section for rank {rank}")
        rt = parse_tensors(r, rd["tensors"], f"{p}.tensors", sizes, chunk_bytes, alignment)
        check_refs(r, rd["state"], f"{p}.state", {t.name for t in rt})
        ranks.append(RankSection(rank, rd["state"], rt))
    health = parse_health(r, d["health"], {t.name for t in tensors}) if "health" in d else None
    replicas = parse_replicas(r, d["replicas"], world_size) if "replicas" in d else None
    return Manifest(
        step=r.int_(d["step"], "step", 0, 10**12 - 1),
        epoch=r.int_(d["epoch"], "epoch", 0),
        world_size=world_size,
        created_unix=float(created),
        library_version=r.str_(d["library_version"], "library_version"),
        objects=tuple(objects),
        tensors=tensors,
        state=d["state"],
        ranks=tuple(ranks),
        chunk_bytes=chunk_bytes,
        alignment=alignment,
        checksum=checksum,
        format_version=d["format_version"],
        health=health,
        replicas=replicas,
    )
