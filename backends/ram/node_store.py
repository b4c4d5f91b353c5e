"""A node's RAM-tier store: the files of the node's memory directory (tmpfs: no O_DIRECT, owner-only), which the
tier reads and writes on its node and where the node's snapshot agent keeps a step for trainers that died.

Below both :mod:`~lightning_snapshot.backends.ram.tier` and the agent (:mod:`~lightning_snapshot.agent`),
which open the same store.
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning_snapshot.backends.local import LocalTier

__all__ = ["PROPOSED", "NodeStore", "node_store"]

#: The end of the name (``<run>-proposed-manifest.json``) under which the node's snapshot agent keeps, next to a
#: trainer's data objects it wrote into the RAM tier after that trainer died, the manifest the agents committed to a
#: durable tier for the step. Not a manifest of this tier: the step counts only once the trainers committed it
#: (:func:`~lightning_snapshot.backends.ram.rebuild.commit_kept`).
PROPOSED = "proposed-manifest.json"


class NodeStore(LocalTier):
    """The node's files: no O_DIRECT (tmpfs), owner-only permissions."""

    tier = "ram"
    durable = False
    copy_source = False
    file_mode = 0o600


def node_store(node_dir: Path) -> NodeStore:
    """The store of the RAM tier whose node memory directory is ``node_dir`` (made, owner-only, if missing): what the
    tier reads and writes on this node, and where the node's agent keeps a snapshot for a trainer that died."""
    node_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(node_dir, 0o700)
    (node_dir / "store").mkdir(mode=0o700, exist_ok=True)
    store = NodeStore(node_dir / "store", keep_last=None)
    store.direct_io = False
    return store
