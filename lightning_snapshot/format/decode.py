"""Decoding a manifest's entries: typed field access with the JSON path in every error, and the strict parse of
tensor entries, their fragments, state trees' tensor references, the replica check and the health record.

One job: the checks of :meth:`Manifest.from_json <lightning_snapshot.format.manifest.Manifest.from_json>` below the top
level (which :func:`lightning_snapshot.format.manifest._manifest_from_dict` reads with these). Every failure is a
:class:`~lightning_snapshot.errors.ManifestError` (or :class:`~lightning_snapshot.errors.UnsafePathError` for a key
that would escape its root). Pure: no I/O.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from itertools import repeat
from typing import Any

from lightning_snapshot.errors import ManifestError, UnsafePathError
from lightning_snapshot.format.columns import FRAGMENT_FIELDS as _FRAGMENT_FIELDS
from lightning_snapshot.format.columns import HEX_RE as _HEX_RE
from lightning_snapshot.format.columns import TENSOR_FIELDS as _TENSOR_FIELDS
from lightning_snapshot.format.columns import whole_tensor_columns
from lightning_snapshot.format.dtypes import ITEMSIZE, dtype_from_name
from lightning_snapshot.format.entries import GROUP_RE, Fragment, ReplicaRecord, TensorEntry, validate_key
from lightning_snapshot.plan.planner import missing_region, overlapping_boxes

__all__ = ["Reader", "check_refs", "parse_health", "parse_replicas", "parse_tensors"]

_STR = frozenset({str})
#: The most dimensions of a tensor (and of a fragment's offsets and sizes)
_MAX_DIMS = 64
#: The most groups of a health record
_MAX_GROUPS = 4096
#: The most tensors a manifest's replica check names (lightning_snapshot.fit.replicas.MAX_NAMED writes 16).
_MAX_NAMED_REPLICAS = 1024


class Reader:
    """Typed field access with the JSON path in every error message."""

    def __init__(self, where: str, tensor: str | None = None) -> None:
        self.where = where
        self.tensor = tensor

    def within(self, tensor: str) -> Reader:
        """A reader whose errors also name ``tensor`` (the entry being parsed)."""
        return Reader(self.where, tensor)

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


def parse_tensors(
    r: Reader, value: Any, path: str, m_objects: Mapping[str, int], chunk_bytes: int, alignment: int
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

    def check(self, r: Reader, obj: str, fp: str) -> int:
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
    r: Reader,
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
    :func:`check_refs` names a problem by: it looks again only when this finds one)."""
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


def check_refs(r: Reader, tree: Any, path: str, names: set[str], depth: int = 0) -> None:
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
            check_refs(r, v, f"{path}.{k}", names, depth + 1)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            check_refs(r, v, f"{path}[{i}]", names, depth + 1)


def parse_replicas(r: Reader, value: Any, world_size: int) -> ReplicaRecord:
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


def parse_health(r: Reader, value: Any, names: set[str]) -> dict[str, str | None]:
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
        if not GROUP_RE.match(group):
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
