"""lightning-snapshot: cheap, safe, bitwise-exact training snapshots for PyTorch Lightning."""

from __future__ import annotations

import importlib.util as _ilu
import os as _os

__version__ = "0.1.0.dev0"

# ``backends/`` sits at the repository root and is installed as ``lightning_snapshot.backends`` (setuptools
# package-dir mapping). When this package is imported straight from a source checkout (``python -m pytest`` in the
# repository root, with or without an installed copy), make that folder importable under the same name.
_checkout_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _ilu.find_spec(__name__ + ".backends") is None and _os.path.isfile(
    _os.path.join(_checkout_root, "backends", "local.py")
):
    __path__.append(_checkout_root)  # type: ignore[name-defined]  # noqa: F821

from lightning_snapshot.callback import SnapshotCallback  # noqa: E402
from lightning_snapshot.errors import SnapshotError  # noqa: E402
from lightning_snapshot.loader import load_snapshot  # noqa: E402

__all__ = ["SnapshotCallback", "SnapshotError", "load_snapshot", "__version__"]
