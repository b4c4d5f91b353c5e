"""The RAM tier, in its three parts.

- :mod:`~lightning_snapshot.backends.ram.tier`: :class:`RamTier`, the tier a trainer uses (write, commit, restore
  across nodes, retention).
- :mod:`~lightning_snapshot.backends.ram.erasure`: zfec erasure coding of a data object into ``k + m`` shares that
  live on different nodes, and rebuilding lost or corrupted shares.
- :mod:`~lightning_snapshot.backends.ram.agent`: the node's snapshot agent, a process that owns the shared-memory
  directory, outlives the trainer (a killed trainer's staged snapshot is still written) and frees it when idle.
"""

from __future__ import annotations

from lightning_snapshot.backends.ram.tier import RamTier

__all__ = ["RamTier"]
