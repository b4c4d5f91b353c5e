"""The snapshot format: typed, versioned manifest dataclasses and their JSON form.

Used wherever a snapshot is written or read: writer.py and persist.py (write), loader.py, restore_records.py,
resume_policy.py, export.py, ops.py and cli.py (read), tree.py and staging (dtypes), and the backends (key
validation, step directory names).

A snapshot is ``<tier root>/step-<global_step:012d>/`` holding ``manifest.json`` and data objects. Data objects
are raw tensor bytes, each fragment aligned to ``alignment`` bytes, with one checksum per ``chunk_bytes`` chunk.
The manifest is written last and atomically: a step without a manifest does not exist.

Parsing is strict. Every field is type-checked, every cross reference is resolved, unknown entry types and unknown
fields are errors, and every failure is a :class:`~lightning_snapshot.errors.ManifestError` (or its subclass
:class:`~lightning_snapshot.errors.FormatVersionError`). Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from lightning_snapshot.collector import deferred_collection
from lightning_snapshot.dtypes import DTYPES, ITEMSIZE, dtype_from_name, dtype_name
from lightning_snapshot.errors import FormatVersionError, ManifestError, UnsafePathError
from lightning_snapshot.manifest_columns import FRAGMENT_FIELDS as _FRAGMENT_FIELDS
from lightning_snapshot.manifest_columns import HEX_RE as _HEX_RE
from lightning_snapshot.manifest_columns import TENSOR_FIELDS as _TENSOR_FIELDS
from lightning_snapshot.manifest_columns import whole_tensor_columns
from lightning_snapshot.planner import missing_region, overlapping_boxes

__all__ = [
    "CHECKSUM_ALGORITHM",
    "DTYPES",
    "FORMAT_VERSION",
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
_STR = frozenset({str})
_MAX_DIMS = 64
_GROUP_RE = re.compile(r"^[A-Za-z0-9._-]{1,100}(/[0-9]{1,6})?$")
_MAX_GROUPS = 4096
#: The most tensors a manifest's replica check names (lightning_snapshot.replicas.MAX_NAMED writes 16).
_MAX_NAMED_REPLICAS = 1024


def health_group(name: str) -> str:
    """The health group of a shared tensor name: ``state_dict`` (the model's parameters and buffers),
    ``optimizer_states/<i>`` (the state of optimizer ``i``), or the name's first part for anything else."""
    head, _, rest = name.partition("/")
    if head == "optimizer_states" and rest:
        index = rest.partition("/")[0]
        if index.isdigit() and len(index) <= 6:
            return f"{head}/{index}"
    return head if _GROUP_RE.match(head) else "other"


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
    """The replica check of one snapshot (:mod:`lightning_snapshot.replicas`): how many tensors were compared
    across the ranks, how many disagreed, and the first of those with the ranks holding another value."""

    checked: int
    disagree_count: int = 0
    disagree: tuple[tuple[str, tuple[int, ...]], ...] = ()


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
    #: The replica check's outcome at this step (:mod:`lightning_snapshot.replicas`), or None: not checked (one
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


class _Reader:
    """Typed field access with the JSON path in every error message."""

    def __init__(self, where: str, tensor: str | None = None) -> None:
        self.where = where
        self.tensor = tensor

    def within(self, tensor: str) -> _Reader:
        """A reader whose errors also name ``tensor`` (the entry being parsed)."""
        return _Reader(self.where, tensor)

    def fail(self, path: str, msg: str) -> ManifestError:
        of = f" (tensor {self.tensor!r})" if self.tensor is not None else ""
        return ManifestError(f"{self.where}: field {path}{of}: {msg}")

    def obj(
        self, value: Any, path: str, keys: AbstractSet[str], optional: AbstractSet[str] = frozenset()
    ) -> Mapping[str, Any]:
        if type(value) is dict and value.keys() == keys:
            return value  # (the common case, one comparison; the checks below say what is wrong otherwise)
        if not isinstance(value, dict):
            raise self.fail(path, f"expected an object, got {type(value).__name__}")
        missing = keys - value.keys()
        if missing:
            raise self.fail(path, f"missing field(s) {sorted(missing)}")
        unknown = value.keys() - keys - optional
        if unknown:
            raise self.fail(path, f"unknown field(s) {sorted(unknown)}; written by a newer lightning-snapshot?")
        return value

    def int_(self, value: Any, path: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"expected an integer, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise self.fail(path, f"{value} is outside [{lo}, {hi}]")
        return value

    def str_(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"expected a string, got {type(value).__name__}")
        return value

    def list_(self, value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(path, f"expected a list, got {type(value).__name__}")
        return value

    def shape(self, value: Any, path: str) -> tuple[int, ...]:
        if type(value) is list and len(value) <= _MAX_DIMS and all(type(v) is int and 0 <= v <= 2**62 for v in value):
            return tuple(value)  # (the common case, checked at once; the loop below says what is wrong)
        items = self.list_(value, path)
        if len(items) > _MAX_DIMS:
            raise self.fail(path, f"{len(items)} dimensions is more than {_MAX_DIMS}")
        return tuple(self.int_(v, f"{path}[{i}]", 0, 2**62) for i, v in enumerate(items))


_ALIAS_FIELDS = frozenset({"type", "name", "dtype", "global_shape", "alias_of"})


def _parse_tensors(
    r: _Reader, value: Any, path: str, m_objects: Mapping[str, int], chunk_bytes: int, alignment: int
) -> tuple[TensorEntry, ...]:
    out: list[TensorEntry] = []
    names: set[str] = set()
    objects = _Objects(m_objects)
    entries = r.list_(value, path)
    # (the whole tensors, the common case, in C-level passes over their columns; the aliases the writer lists after
    # them, and anything the column check does not take, entry by entry, naming what is wrong)
    k = len(entries)
    while k and not (type(entries[k - 1]) is dict and entries[k - 1].get("type") == "tensor"):
        k -= 1
    columns = whole_tensor_columns(
        entries[:k], m_objects, objects.safe, _safe_key, ITEMSIZE, chunk_bytes, alignment, _MAX_DIMS
    )
    rest = enumerate(entries)
    if columns is not None:
        dims = list(map(tuple, columns.shapes))
        fragments = map(
            Fragment,
            columns.objects,
            columns.offsets,
            columns.nbytes,
            map(operator.mul, repeat((0,)), map(len, dims)),
            dims,
            map(tuple, columns.checksums),
        )
        out = list(map(TensorEntry, columns.names, columns.dtypes, dims, zip(fragments)))
        names.update(columns.names)
        rest = enumerate(entries[k:], k)
    for i, raw in rest:
        p = f"{path}[{i}]"
        if not isinstance(raw, dict):
            raise r.fail(p, f"expected an object, got {type(raw).__name__}")
        kind = raw.get("type")
        if kind == "tensor":
            d = r.obj(raw, p, _TENSOR_FIELDS)
        elif kind == "alias":
            d = r.obj(raw, p, _ALIAS_FIELDS)
        else:
            raise r.fail(
                p,
                f"unknown entry type {kind!r} (known: 'tensor', 'alias'); this snapshot needs a newer"
                " lightning-snapshot",
            )
        name = r.str_(d["name"], f"{p}.name")
        if name in names:
            raise r.fail(p, f"duplicate tensor name {name!r}")
        names.add(name)
        out.append(_parse_tensor(r.within(name), d, p, kind, name, objects, chunk_bytes, alignment))
    by_name = {t.name: t for t in out}
    for t in out:
        if t.alias_of is not None:
            target = by_name.get(t.alias_of)
            if target is None or target.alias_of is not None:
                raise r.fail(path, f"{t.name!r} is an alias of {t.alias_of!r}, which is not a stored tensor")
            if target.dtype != t.dtype or target.global_shape != t.global_shape:
                raise r.fail(path, f"alias {t.name!r} does not match dtype/shape of {t.alias_of!r}")
    return tuple(out)


def _safe_key(key: str) -> bool:
    try:
        validate_key(key)
    except UnsafePathError:
        return False
    return True


class _Objects:
    """The objects a manifest lists (name -> size), and which of their keys were already validated: the fragments of
    a section's tensors mostly share one object, whose key is then checked once."""

    def __init__(self, sizes: Mapping[str, int]) -> None:
        self.sizes = sizes
        self.safe: set[str] = set()

    def check(self, r: _Reader, obj: str, fp: str) -> int:
        """``obj``'s size, once its key is known safe and listed."""
        if obj not in self.safe:
            try:
                validate_key(obj)
            except UnsafePathError as e:
                raise r.fail(fp + ".object", str(e)) from None
            if obj not in self.sizes:
                raise r.fail(fp + ".object", f"refers to object {obj!r} that the manifest does not list")
            self.safe.add(obj)
        return self.sizes[obj]


def _parse_tensor(
    r: _Reader,
    d: Mapping[str, Any],
    p: str,
    kind: str,
    name: str,
    objects: _Objects,
    chunk_bytes: int,
    alignment: int,
) -> TensorEntry:
    """One tensor or alias entry ``d`` at JSON path ``p``; ``r`` names the tensor in its errors."""
    dtype = r.str_(d["dtype"], f"{p}.dtype")
    try:
        torch_dtype = dtype_from_name(dtype)
    except ManifestError as e:
        raise r.fail(f"{p}.dtype", str(e)) from None
    global_shape = r.shape(d["global_shape"], f"{p}.global_shape")
    if kind == "alias":
        return TensorEntry(name, dtype, global_shape, (), r.str_(d["alias_of"], f"{p}.alias_of"))
    itemsize = torch_dtype.itemsize
    frags = []
    for j, fraw in enumerate(r.list_(d["fragments"], f"{p}.fragments")):
        fp = f"{p}.fragments[{j}]"
        fd = r.obj(fraw, fp, _FRAGMENT_FIELDS)
        obj = r.str_(fd["object"], f"{fp}.object")
        size = objects.check(r, obj, fp)
        offset = r.int_(fd["offset"], f"{fp}.offset")
        nbytes = r.int_(fd["nbytes"], f"{fp}.nbytes")
        offs = r.shape(fd["global_offsets"], f"{fp}.global_offsets")
        local = r.shape(fd["local_shape"], f"{fp}.local_shape")
        if len(offs) != len(global_shape) or len(local) != len(global_shape):
            raise r.fail(fp, "global_offsets/local_shape do not have the rank of global_shape")
        if any(o + n > g for o, n, g in zip(offs, local, global_shape, strict=True)):
            raise r.fail(fp, f"box {offs}+{local} lies outside global_shape {global_shape}")
        if nbytes != math.prod(local) * itemsize:
            raise r.fail(fp, f"nbytes {nbytes} does not match local_shape {local} of {dtype}")
        if offset % alignment:
            raise r.fail(fp, f"offset {offset} is not aligned to {alignment}")
        if offset + nbytes > size:
            raise r.fail(fp, f"bytes [{offset}, {offset + nbytes}) lie outside object {obj!r} of {size} bytes")
        raw_sums = fd["checksums"]
        if type(raw_sums) is list and all(type(s) is str for s in raw_sums):
            sums = tuple(raw_sums)  # (the common case; the checks below say what is wrong otherwise)
        else:
            sums = tuple(r.str_(s, f"{fp}.checksums[{k}]") for k, s in enumerate(r.list_(raw_sums, f"{fp}.checksums")))
        if len(sums) != max(1, -(-nbytes // chunk_bytes)) or not all(_HEX_RE.match(s) for s in sums):
            raise r.fail(
                fp + ".checksums",
                f"expected {max(1, -(-nbytes // chunk_bytes))} 16-digit hex checksums (one per chunk)",
            )
        frags.append(Fragment(obj, offset, nbytes, offs, local, sums))
    covered = sum(math.prod(f.local_shape) for f in frags)
    pair = overlapping_boxes([(f.global_offsets, f.local_shape) for f in frags]) if len(frags) > 1 else None
    if pair is not None:
        a, b = (frags[k] for k in pair)
        raise r.fail(
            p,
            f"fragments {pair[0]} and {pair[1]} overlap (boxes at"
            f" {list(a.global_offsets)} shape {list(a.local_shape)} and {list(b.global_offsets)}"
            f" shape {list(b.local_shape)}); each element must be stored exactly once",
        )
    if covered != math.prod(global_shape):
        boxes = [(f.global_offsets, f.local_shape) for f in frags]
        raise r.fail(
            p,
            f"fragments cover {covered} of the tensor's {math.prod(global_shape)} elements;"
            f" missing region: {missing_region(global_shape, boxes)}. The snapshot is incomplete"
            " (a lost shard?): use another snapshot",
        )
    return TensorEntry(name, dtype, global_shape, tuple(frags))


_LEAVES = frozenset({int, float, str, bool, type(None)})
_ONLY_DICTS = frozenset({dict})
_REF_KEYS = frozenset({"$tensor"})
_REF = operator.itemgetter("$tensor")


def _refs_ok(tree: Any, names: set[str], depth: int) -> bool:
    """Whether every ``{"$tensor": name}`` in ``tree`` names one of ``names``, within 200 levels (without the paths
    :func:`_check_refs` names a problem by: it looks again only when this finds one)."""
    if depth > 200:
        return False
    if isinstance(tree, dict):
        if len(tree) == 1 and "$tensor" in tree:
            ref = tree["$tensor"]
            return isinstance(ref, str) and ref in names
        values: Any = tree.values()
    elif isinstance(tree, list):
        values = tree
    else:
        return True
    if depth < 200:  # (the children within the limit: C-level passes over them where they are all alike)
        kinds = set(map(type, values))
        if kinds <= _LEAVES:  # plain values (a model's trainable flags and parameter names)
            return True
        if kinds == _ONLY_DICTS and all(map(operator.eq, map(dict.keys, values), repeat(_REF_KEYS))):
            refs = list(map(_REF, values))  # tensor references only (a state dict)
            return set(map(type, refs)) <= _STR and set(refs) <= names
    return all(_refs_ok(v, names, depth + 1) for v in values)


def _check_refs(r: _Reader, tree: Any, path: str, names: set[str], depth: int = 0) -> None:
    """Every ``{"$tensor": name}`` in a state tree must name a tensor of that section."""
    if depth == 0 and _refs_ok(tree, names, 0):
        return
    if depth > 200:
        raise r.fail(path, "state is nested deeper than 200 levels")
    if isinstance(tree, dict):
        if len(tree) == 1 and "$tensor" in tree:
            ref = tree["$tensor"]
            if not isinstance(ref, str) or ref not in names:
                raise r.fail(path, f"refers to tensor {ref!r} that is not in the manifest")
            return
        for k, v in tree.items():
            _check_refs(r, v, f"{path}.{k}", names, depth + 1)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            _check_refs(r, v, f"{path}[{i}]", names, depth + 1)


def _manifest_from_dict(raw: Any, where: str) -> Manifest:
    r = _Reader(where)
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
    tensors = _parse_tensors(r, d["tensors"], "tensors", sizes, chunk_bytes, alignment)
    _check_refs(r, d["state"], "state", {t.name for t in tensors})
    ranks: list[RankSection] = []
    for i, raw_r in enumerate(r.list_(d["ranks"], "ranks")):
        p = f"ranks[{i}]"
        rd = r.obj(raw_r, p, {"rank", "state", "tensors"})
        rank = r.int_(rd["rank"], f"{p}.rank", 0, world_size - 1)
        if any(s.rank == rank for s in ranks):
            raise r.fail(p, f"duplicate section for rank {rank}")
        rt = _parse_tensors(r, rd["tensors"], f"{p}.tensors", sizes, chunk_bytes, alignment)
        _check_refs(r, rd["state"], f"{p}.state", {t.name for t in rt})
        ranks.append(RankSection(rank, rd["state"], rt))
    health = _parse_health(r, d["health"], {t.name for t in tensors}) if "health" in d else None
    replicas = _parse_replicas(r, d["replicas"], world_size) if "replicas" in d else None
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


def _parse_replicas(r: _Reader, value: Any, world_size: int) -> ReplicaRecord:
    """The optional ``replicas`` field: ``{"checked": n, "disagree_count": k, "disagree": [{"tensor": name,
    "ranks": [rank, ...]}, ...]}`` (at most :data:`_MAX_NAMED_REPLICAS` named)."""
    d = r.obj(value, "replicas", {"checked", "disagree_count", "disagree"})
    checked = r.int_(d["checked"], "replicas.checked", 0)
    count = r.int_(d["disagree_count"], "replicas.disagree_count", 0, checked)
    named = r.list_(d["disagree"], "replicas.disagree")
    if len(named) > min(count, _MAX_NAMED_REPLICAS):
        raise r.fail("replicas.disagree", f"names {len(named)} tensors, more than disagree_count or the limit")
    out: list[tuple[str, tuple[int, ...]]] = []
    for i, item in enumerate(named):
        p = f"replicas.disagree[{i}]"
        e = r.obj(item, p, {"tensor", "ranks"})
        tensor = r.str_(e["tensor"], f"{p}.tensor")
        if len(tensor) > 4096:
            raise r.fail(f"{p}.tensor", "longer than 4096 characters")
        ranks = r.list_(e["ranks"], f"{p}.ranks")
        if not ranks or len(ranks) > world_size:
            raise r.fail(f"{p}.ranks", f"expected 1 to {world_size} ranks, got {len(ranks)}")
        out.append((tensor, tuple(r.int_(x, f"{p}.ranks[{j}]", 0, world_size - 1) for j, x in enumerate(ranks))))
    return ReplicaRecord(checked, count, tuple(out))


def _parse_health(r: _Reader, value: Any, names: set[str]) -> dict[str, str | None]:
    """The optional ``health`` field: ``{group: null | first non-finite tensor}``; every group a valid group name
    and every tensor one of the manifest's shared tensors."""
    if not isinstance(value, dict):
        raise r.fail(
            "health", f"expected an object mapping tensor groups to null or a tensor name, got {type(value).__name__}"
        )
    if len(value) > _MAX_GROUPS:
        raise r.fail("health", f"{len(value)} groups is more than {_MAX_GROUPS}")
    out: dict[str, str | None] = {}
    for group, first in value.items():
        if not _GROUP_RE.match(group):
            raise r.fail(
                "health",
                f"group name {group!r} is not a tensor group (like 'state_dict' or"
                " 'optimizer_states/0'); the manifest is corrupted: use another snapshot",
            )
        if first is not None and (not isinstance(first, str) or first not in names):
            raise r.fail(
                f"health.{group}",
                f"expected null (all values finite) or the name of a shared tensor of"
                f" this manifest, got {first!r}; the manifest is corrupted: use another"
                " snapshot",
            )
        out[group] = first
    return out


def tensors_by_name(entries: Sequence[TensorEntry]) -> dict[str, TensorEntry]:
    """Index a section's tensor entries by name."""
    return {t.name: t for t in entries}
