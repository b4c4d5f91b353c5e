"""The Lightning Fabric integration: :class:`~lightning_snapshot.fabric.snapshots.FabricSnapshots` (``docs/fabric.md``).

Two modules: :mod:`~lightning_snapshot.fabric.snapshots` (the class a loop uses: when snapshots are taken and
restored) over :mod:`~lightning_snapshot.fabric.state` (what the user's ``state`` dict becomes in a snapshot, and back).
At the integrations' layer, beside the Trainer's callback, which it does not import.
"""

from lightning_snapshot.fabric.snapshots import FabricSnapshots

__all__ = ["FabricSnapshots"]
