"""Nested training state <-> JSON tree plus named tensors.

Used by staging (staging/__init__.py, live.py, plan.py: encode when a snapshot is captured) and by capture.py,
loader.py and export.py (decode when one is read).

Lightning's checkpoint pieces are nested dicts/lists/tuples of tensors and plain values. :func:`encode` turns such a
structure into standard JSON, replacing each tensor by ``{"$tensor": name}`` and returning the tensors by name;
:func:`decode` is the inverse. Types JSON lacks are tagged with one-key objects whose key starts with ``$``:

======================  ===========================================
``{"$tensor": name}``   a tensor (the same object twice decodes to the same tensor)
``{"$tuple": [...]}``   a tuple (``torch.Size`` too)
``{"$dict": [[k, v]]}`` a dict with non-string keys (optimizer state is keyed by int) or ``$``-prefixed keys
``{"$float": "nan"}``   ``nan``, ``inf`` or ``-inf``
``{"$ndarray": [name, dtype]}``  a numpy array, stored as a tensor
``{"$dtype": "float32"}``, ``{"$device": "cpu"}``, ``{"$bytes": base64}``
======================  ===========================================

Anything else is a :class:`~lightning_snapshot.errors.CaptureError` naming where it was found. Decoding never
evaluates or unpickles anything.
"""

from __future__ import annotations

import base64
import enum
import math
import operator
import os
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lightning_snapshot.errors import CaptureError, ManifestError
from lightning_snapshot.format.manifest import DTYPES

__all__ = ["decode", "encode"]

_MAX_DEPTH = 200


def encode(obj: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Encode ``obj`` as a JSON tree; returns ``(tree, tensors)`` with tensors keyed by a path-derived name.

    The same tensor object reached twice gets one name (both refs decode to one tensor).

    Raises:
        CaptureError: a value of a type the format cannot store, with its path in the structure.
    """
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}

    def name_for(t: torch.Tensor, path: str) -> str:
        if id(t) in seen:
            return seen[id(t)]
        name = path or "tensor"
        if name in tensors:
            i = 1
            while f"{name}#{i}" in tensors:
                i += 1
            name = f"{name}#{i}"
        tensors[name] = t
        seen[id(t)] = name
        return name

    def walk(x: Any, path: str, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise CaptureError(f"state at {path!r} is nested deeper than {_MAX_DEPTH} levels")
        # the common types first, by exact type (a state of hundreds of tensors is walked at every snapshot)
        kind = type(x)
        if kind is dict or kind is OrderedDict:
            # (C-level passes: string keys, none starting with "$")
            plain = set(map(type, x)) <= _STR and _no_dollar_key(x)
            if plain:
                if set(map(type, x.values())) <= _EXACT_JSON:  # (trainable flags, names: as they are)
                    return dict(x)
                prefix = path + "/" if path else ""
                return {k: walk(v, prefix + k, depth + 1) for k, v in x.items()}
            if all(type(k) is int for k in x):  # optimizer state, keyed by parameter index
                return {"$dict": [[k, walk(v, f"{path}/{k}", depth + 1)] for k, v in x.items()]}
        elif kind in _TENSOR_TYPES:
            return {"$tensor": name_for(x, path)}
        elif kind in _SCALAR_TYPES:
            return x if kind is not float or math.isfinite(x) else {"$float": repr(x)}
        elif kind is list or kind is tuple:
            if set(map(type, x)) <= _EXACT_JSON:  # ints, strings, bools, None only (an RNG state): as they are
                return list(x) if kind is list else {"$tuple": list(x)}
            items = [walk(v, f"{path}/{i}", depth + 1) for i, v in enumerate(x)]
            return items if kind is list else {"$tuple": items}
        return general(x, path, depth)

    def general(x: Any, path: str, depth: int) -> Any:
        if x is None or isinstance(x, bool):
            return x
        if isinstance(x, torch.Tensor):
            return {"$tensor": name_for(x, path)}
        if isinstance(x, enum.Enum):
            x = x.value
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float):
            return float(x) if math.isfinite(x) else {"$float": repr(float(x))}
        if isinstance(x, str):
            return str(x)
        if isinstance(x, np.ndarray):
            kind = str(x.dtype.newbyteorder("="))
            if kind not in _NUMPY_KINDS:
                raise CaptureError(
                    f"numpy array at {path!r} has dtype {x.dtype}, which cannot be stored;"
                    f" supported: {sorted(_NUMPY_KINDS)}"
                )
            arr = x.astype(x.dtype.newbyteorder("="), order="C", copy=True)  # native order, C layout, 0-d kept
            if kind in ("uint32", "uint16"):
                arr = arr.astype(np.int64)
            elif kind == "uint64":
                arr = arr.view(np.int64)
            return {"$ndarray": [name_for(torch.from_numpy(arr), path), kind]}
        if isinstance(x, np.generic):
            return walk(x.item(), path, depth + 1)
        if isinstance(x, torch.dtype):
            if x not in _DTYPE_VALUES:
                raise CaptureError(f"the dtype at {path!r} ({x}) is not one the format stores: {sorted(DTYPES)}")
            return {"$dtype": str(x).removeprefix("torch.")}
        if isinstance(x, torch.device):
            return {"$device": str(x)}
        if isinstance(x, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(x)).decode("ascii")}
        if isinstance(x, os.PathLike):
            return os.fspath(x)
        if isinstance(x, tuple):
            return {"$tuple": [walk(v, f"{path}/{i}", depth + 1) for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [walk(v, f"{path}/{i}", depth + 1) for i, v in enumerate(x)]
        if isinstance(x, Mapping):
            if all(isinstance(k, str) and not k.startswith("$") for k in x):
                return {k: walk(v, f"{path}/{k}" if path else k, depth + 1) for k, v in x.items()}
            return {
                "$dict": [
                    [walk(k, f"{path}/<key>", depth + 1), walk(v, f"{path}/{k}", depth + 1)] for k, v in x.items()
                ]
            }
        raise CaptureError(
            f"cannot store the value at {path!r} of type {type(x).__module__}.{type(x).__qualname__}: snapshots hold"
            " tensors, numbers, strings, bools, None, bytes and lists/tuples/dicts of them. Convert it in your"
            " state_dict()/on_save_checkpoint (no pickle is ever used)"
        )

    return walk(obj, prefix, 0), tensors


def decode(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild the structure encoded by :func:`encode` from its JSON tree and tensors.

    Raises:
        ManifestError: an unknown ``$`` tag or a malformed tagged value.
    """

    def bad(msg: str) -> ManifestError:
        return ManifestError(f"state tree: {msg}")

    def walk(x: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise bad(f"nested deeper than {_MAX_DEPTH} levels")
        if isinstance(x, list):
            return [walk(v, depth + 1) for v in x]
        if not isinstance(x, dict):
            if isinstance(x, (str, int, float, bool)) or x is None:
                return x
            raise bad(f"unexpected JSON value of type {type(x).__name__}")
        tags = [k for k in x if k.startswith("$")]
        if not tags:
            return {k: walk(v, depth + 1) for k, v in x.items()}
        if len(x) != 1:
            raise bad(f"tagged object with extra keys {sorted(x)}")
        tag, val = next(iter(x.items()))
        if tag == "$tensor":
            if not isinstance(val, str) or val not in tensors:
                raise bad(f"reference to unknown tensor {val!r}")
            return tensors[val]
        if tag == "$tuple":
            if not isinstance(val, list):
                raise bad("$tuple must hold a list")
            return tuple(walk(v, depth + 1) for v in val)
        if tag == "$dict":
            if not isinstance(val, list) or not all(isinstance(p, list) and len(p) == 2 for p in val):
                raise bad("$dict must hold [key, value] pairs")
            out = {}
            for k, v in val:
                key = walk(k, depth + 1)
                try:
                    hash(key)
                except TypeError:
                    raise bad(f"unhashable dict key {key!r}") from None
                out[key] = walk(v, depth + 1)
            return out
        if tag == "$float":
            if not isinstance(val, str) or val not in ("nan", "inf", "-inf"):
                raise bad(f"$float must be 'nan', 'inf' or '-inf', got {val!r}")
            return float(val)
        if tag == "$ndarray":
            if not (isinstance(val, list) and len(val) == 2 and all(isinstance(v, str) for v in val)):
                raise bad("$ndarray must hold [tensor name, numpy dtype]")
            name, kind = val
            if name not in tensors:
                raise bad(f"reference to unknown tensor {name!r}")
            if kind not in _NUMPY_KINDS:
                raise bad(f"unsupported numpy dtype {kind!r}")
            t = tensors[name]
            stored = _NUMPY_STORAGE[kind]
            if t.dtype != stored:
                raise bad(f"$ndarray {name!r} of numpy dtype {kind} must be stored as {stored}, not {t.dtype}")
            arr = t.numpy()
            return arr.view(np.uint64) if kind == "uint64" else arr.astype(kind, copy=False)
        if tag == "$dtype":
            if not isinstance(val, str) or val not in DTYPES:
                raise bad(f"unknown dtype {val!r}")
            return DTYPES[val]
        if tag == "$device":
            if not isinstance(val, str):
                raise bad("$device must hold a string")
            try:
                return torch.device(val)
            except (RuntimeError, ValueError) as e:
                raise bad(f"invalid device {val!r}") from e
        if tag == "$bytes":
            if not isinstance(val, str):
                raise bad("$bytes must hold base64 text")
            try:
                return base64.b64decode(val, validate=True)
            except ValueError as e:
                raise bad("invalid base64 in $bytes") from e
        raise bad(f"unknown tag {tag!r}; written by a newer lightning-snapshot?")

    return walk(tree, 0)


#: numpy dtype -> the torch dtype it is stored as (unsigned wider types widen to, or reinterpret as, int64)
_NUMPY_STORAGE = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "uint16": torch.int64,
    "uint32": torch.int64,
    "uint64": torch.int64,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
_NUMPY_KINDS = set(_NUMPY_STORAGE)
_DTYPE_VALUES = frozenset(DTYPES.values())
_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_SCALAR_TYPES = frozenset({int, float, str, bool, type(None)})
_EXACT_JSON = frozenset({int, str, bool, type(None)})  # encoded as they are
_STR = frozenset({str})
_DOLLAR = operator.methodcaller("startswith", "$")


def _no_dollar_key(keys: Any) -> bool:
    """Whether none of ``keys`` (strings) starts with ``$``: one search of the keys joined by NULs (each key then
    follows a NUL), and a key-by-key look only when that search finds a NUL followed by ``$``."""
    return "\0$" not in "\0" + "\0".join(keys) or not any(map(_DOLLAR, keys))
