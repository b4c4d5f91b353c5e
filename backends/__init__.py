"""Storage tiers of lightning-snapshot (installed as ``lightning_snapshot.backends``).

Re-exports the tier classes and :func:`parse_tier` for users (``from lightning_snapshot.backends import LocalTier``,
as in examples/); the RAM tier's agent imports it to load the tiers up front. The engine imports the submodules it
needs (base.py, registry.py) directly.
"""

from __future__ import annotations

from lightning_snapshot.backends.base import Backend
from lightning_snapshot.backends.local import LocalTier
from lightning_snapshot.backends.object_store import ObjectStoreTier
from lightning_snapshot.backends.ram.tier import RamTier
from lightning_snapshot.backends.registry import parse_tier

__all__ = ["Backend", "LocalTier", "ObjectStoreTier", "RamTier", "parse_tier"]
