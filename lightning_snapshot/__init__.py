"""lightning-snapshot: cheap, safe, bitwise-exact training snapshots for PyTorch Lightning."""

from __future__ import annotations

import importlib as _importlib
import importlib.util as _ilu
import os as _os
from typing import TYPE_CHECKING, Any

from lightning_snapshot.errors import SnapshotError

__version__ = "0.1.0.dev0"

# ``backends/`` sits at the repository root and is installed as ``lightning_snapshot.backends`` (setuptools
# package-dir mapping). When this package is imported straight from a source checkout (``python -m pytest`` in the
# repository root, with or without an installed copy), make that folder importable under the same name.
_checkout_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _ilu.find_spec(__name__ + ".backends") is None and _os.path.isfile(
    _os.path.join(_checkout_root, "backends", "local.py")
):
    __path__.append(_checkout_root)

__all__ = ["FabricSnapshots", "SnapshotCallback", "SnapshotError", "__version__", "load_snapshot"]

# Imported on first use (PEP 562), so that ``import lightning_snapshot`` (and ``lightning-snapshot --help``) does not
# import torch and Lightning.
_LAZY = {
    "FabricSnapshots": "lightning_snapshot.fabric",
    "SnapshotCallback": "lightning_snapshot.callback",
    "load_snapshot": "lightning_snapshot.restore.loader",
}

if TYPE_CHECKING:
    from lightning_snapshot.callback import SnapshotCallback
    from lightning_snapshot.fabric import FabricSnapshots
    from lightning_snapshot.restore.loader import load_snapshot


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
