"""The tensor dtypes the snapshot format stores, by their names in the manifest (docs/format.md, "Dtypes").

Used by manifest.py (which re-exports these names), and through it by the writer, the loader and export.
"""

from __future__ import annotations

import torch

from lightning_snapshot.errors import ManifestError

__all__ = ["DTYPES", "ITEMSIZE", "dtype_from_name", "dtype_name"]

_DTYPE_NAMES = [
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "complex64",
    "complex128",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
]
#: Every dtype the format stores, by its name in the manifest (only those this torch build has).
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_TO_NAME = {dt: name for name, dt in DTYPES.items()}
ITEMSIZE = {name: dt.itemsize for name, dt in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Name of ``dtype`` in the manifest; raises ``KeyError`` for dtypes the format does not store."""
    return _DTYPE_TO_NAME[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a manifest dtype name.

    Raises:
        ManifestError: ``name`` is not a dtype this build of torch has (the message says what to do; the manifest
            parser adds the file, the tensor and the field).
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise ManifestError(
            f"unknown dtype {name!r} (this build of torch knows {', '.join(sorted(DTYPES))}). If the snapshot was"
            " written with a newer torch or lightning-snapshot, upgrade both; otherwise the manifest is corrupted:"
            " use another snapshot"
        ) from None
