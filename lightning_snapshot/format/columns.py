"""A manifest section's whole-tensor entries checked in C-level passes over their columns.

The commit parses every manifest it writes back with the loader's strict parser, on a persist thread that holds
the GIL while it does: with thousands of small tensors, checking each entry's dozen fields one entry at a time costs
milliseconds per snapshot that training waits for. Nearly every entry is the same kind: a tensor stored whole in one
fragment of an object of the section. :func:`whole_tensor_columns` checks a whole list of such entries at once, a
column at a time (``map``, ``set``, ``all``: no Python loop per entry), and gives their values as columns; when any
entry is anything else, or anything is wrong, it gives None and :mod:`~lightning_snapshot.format.manifest` parses the
entries one by one, naming what is wrong. It accepts exactly what that entry-by-entry parse accepts for such entries
(the tests run both on the same manifests). Pure: no I/O.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from itertools import chain, repeat
from typing import Any, NamedTuple

__all__ = ["FRAGMENT_FIELDS", "HEX_RE", "TENSOR_FIELDS", "Columns", "whole_tensor_columns"]

#: The fields of a tensor entry, of its fragments, and the form of a checksum (the manifest's, shared with
#: :mod:`~lightning_snapshot.format.manifest`).
TENSOR_FIELDS = frozenset({"type", "name", "dtype", "global_shape", "fragments"})
FRAGMENT_FIELDS = frozenset({"object", "offset", "nbytes", "global_offsets", "local_shape", "checksums"})
HEX_RE = re.compile(r"^[0-9a-f]{16}$")
_HEX_MATCH = HEX_RE.match
_INT = frozenset({int})
_STR = frozenset({str})
_LIST = frozenset({list})
_DICT = frozenset({dict})
_ONE = frozenset({1})
_eq = operator.eq
_ENTRY = operator.itemgetter("type", "name", "dtype", "global_shape", "fragments")
_FIRST = operator.itemgetter(0)
_FRAGMENT = operator.itemgetter("object", "offset", "nbytes", "global_offsets", "local_shape", "checksums")


class Columns(NamedTuple):
    """The entries' values, one list per field, in the entries' order."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    objects: list[str]
    offsets: list[int]
    nbytes: list[int]
    checksums: list[list[str]]


def whole_tensor_columns(
    entries: list[Any],
    sizes: Mapping[str, int],
    safe: set[str],
    is_safe_key: Callable[[str], bool],
    itemsize: Mapping[str, int],
    chunk_bytes: int,
    alignment: int,
    max_dims: int,
) -> Columns | None:
    """The columns of ``entries`` if every one is a well-formed tensor stored whole in one fragment (its dtype known
    to ``itemsize``, its object listed in ``sizes`` with a key ``is_safe_key`` accepts, its bytes aligned, inside the
    object and as many as its shape and dtype make, one 16-digit hex checksum per chunk), with no name twice; else
    None. Object keys found safe are added to ``safe``."""
    if not entries or set(map(type, entries)) != _DICT:
        return None
    if not all(map(_eq, map(dict.keys, entries), repeat(TENSOR_FIELDS))):
        return None
    kinds, names, dtypes, shapes, frags = map(list, zip(*map(_ENTRY, entries), strict=True))
    if set(map(type, kinds)) != _STR or set(kinds) != {"tensor"}:
        return None
    if set(map(type, names)) != _STR or len(set(names)) != len(names):
        return None
    if set(map(type, dtypes)) != _STR or set(map(type, shapes)) != _LIST:
        return None
    sizes_of = list(map(itemsize.get, dtypes))
    if None in sizes_of or set(map(type, frags)) != _LIST or set(map(len, frags)) != _ONE:
        return None
    fragments = list(map(_FIRST, frags))
    if set(map(type, fragments)) != _DICT or not all(map(_eq, map(dict.keys, fragments), repeat(FRAGMENT_FIELDS))):
        return None
    objects, offsets, nbytes, offs, local, sums = map(list, zip(*map(_FRAGMENT, fragments), strict=True))
    if set(map(type, objects)) != _STR:
        return None
    for key in set(objects) - safe:
        if key not in sizes or not is_safe_key(key):
            return None
        safe.add(key)
    if set(map(type, local)) != _LIST or set(map(type, offs)) != _LIST or max(map(len, shapes)) > max_dims:
        return None
    # ([True] == [1] and [0.0] == [0] in Python: the types first)
    all_dims = chain(chain.from_iterable(shapes), chain.from_iterable(local), chain.from_iterable(offs))
    if not set(map(type, all_dims)) <= _INT:
        return None
    dims = list(chain.from_iterable(shapes))
    if dims and (min(dims) < 0 or max(dims) > 2**62):
        return None
    if not all(map(_eq, local, shapes)) or not all(map(_eq, offs, map(operator.mul, repeat([0]), map(len, shapes)))):
        return None
    if set(map(type, offsets)) != _INT or set(map(type, nbytes)) != _INT or min(offsets) < 0:
        return None
    if any(map(operator.mod, offsets, repeat(alignment))):
        return None
    if not all(map(_eq, nbytes, map(operator.mul, map(math.prod, shapes), sizes_of))):
        return None
    if not all(map(operator.le, map(operator.add, offsets, nbytes), map(sizes.__getitem__, objects))):
        return None
    if set(map(type, sums)) != _LIST:
        return None
    # one checksum per chunk, one for an empty tensor: max(1, ceil(nbytes / chunk_bytes))
    chunks = map(
        max, repeat(1), map(operator.neg, map(operator.floordiv, map(operator.neg, nbytes), repeat(chunk_bytes)))
    )
    if not all(map(_eq, map(len, sums), chunks)):
        return None
    flat = list(chain.from_iterable(sums))
    if not set(map(type, flat)) <= _STR or not all(map(_HEX_MATCH, flat)):
        return None
    return Columns(names, dtypes, shapes, objects, offsets, nbytes, sums)
