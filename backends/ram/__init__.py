"""The RAM tier, in its parts.

Re-exports :class:`RamTier`, which registry.py loads for ``ram://NAME`` URLs (and ``lightning_snapshot.backends``
re-exports for users).

- :mod:`~lightning_snapshot.backends.ram.tier`: :class:`RamTier`, the tier a trainer uses (write, commit, restore
  across nodes, retention): its options; the parts it holds and delegates to,
  :mod:`~lightning_snapshot.backends.ram.placement` (the node, its store and agent),
  :mod:`~lightning_snapshot.backends.ram.store` (bytes), :mod:`~lightning_snapshot.backends.ram.distribution` (shares
  to their nodes) and :mod:`~lightning_snapshot.backends.ram.restoring` (the collective restore).
- :mod:`~lightning_snapshot.backends.ram.shares`: the share files of an erasure-coded object (their layout file,
  which bytes each data share holds, hashing and reading them), for the tier.
- :mod:`~lightning_snapshot.backends.ram.node`: where a node keeps the tier's memory, how much it holds, and the run
  name, for the tier, the agent and the callback.
- :mod:`~lightning_snapshot.backends.ram.erasure`: zfec erasure coding of a data object into ``k + m`` shares that
  live on different nodes, and rebuilding lost or corrupted shares.
- :mod:`~lightning_snapshot.agent`: the node's snapshot agent, a process that owns the shared-memory
  directory, outlives the trainer (a killed trainer's staged snapshot is still written) and frees it when idle.
"""

from __future__ import annotations

from lightning_snapshot.backends.ram.tier import RamTier

__all__ = ["RamTier"]
