"""The local tier's place in a job: which node's directory it is (``{node_rank}`` in the path), this rank's place on
its node, and whether that directory is shared by all nodes or node-local, settled when training starts.

:class:`LocalLayout` is a part that :class:`~lightning_snapshot.backends.local.LocalTier` holds (its ``layout``); the
tier's :class:`~lightning_snapshot.backends.base.LayoutSettling` capability delegates to it. It moves the tier's files
(:class:`~lightning_snapshot.backends.local_files.LocalFiles`) to the node's directory when the job places it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from lightning_snapshot.backends.local_files import LocalFiles
from lightning_snapshot.dist.agree import agree_on
from lightning_snapshot.dist.comm import Comm
from lightning_snapshot.errors import ConfigError

__all__ = ["NODE_RANK_PLACEHOLDER", "LocalLayout", "resolve_path"]

#: The placeholder a path may hold for the node's rank (``/nvme/snap/run-42`` on every node, or
#: ``/shared/snap/node{node_rank}`` to give each node its own directory, e.g. in a one-machine simulation).
NODE_RANK_PLACEHOLDER = "{node_rank}"


def resolve_path(template: str, node_rank: object) -> Path:
    """The directory ``template`` names on node ``node_rank`` (``{node_rank}`` replaced), absolute."""
    return Path(template.replace(NODE_RANK_PLACEHOLDER, str(node_rank))).absolute()


class LocalLayout:
    """Where the tier's directory is in the job (:meth:`bind`), and whether it is node-local (:meth:`settle_layout`).

    Args:
        path_template: the path as given, ``~`` expanded (it may hold ``{node_rank}``).
        node_local: the user's choice (None: detect at set-up).
        files: the tier's files, moved to the node's directory by :meth:`bind`.
    """

    def __init__(self, path_template: str, node_local: bool | None, files: LocalFiles) -> None:
        #: The path as given, ``~`` expanded (it may hold ``{node_rank}``).
        self.path_template = path_template
        #: The user's choice (None: detect at set-up).
        self.node_local_option = node_local
        #: Whether each node has its own directory (settled by :meth:`settle_layout` in a multi-node job).
        self.node_local = bool(node_local)
        self.node_rank, self.num_nodes, self.local_rank, self.ranks_per_node = 0, 1, 0, 1
        self.files = files

    @property
    def url(self) -> str:
        return str(self.files.root)

    def bind(self, *, node_rank: int, num_nodes: int, local_rank: int, ranks_per_node: int) -> None:
        """Place this tier in the job (called by the callback at set-up, on every rank)."""
        self.node_rank, self.num_nodes = node_rank, num_nodes
        self.local_rank, self.ranks_per_node = local_rank, ranks_per_node
        root = resolve_path(self.path_template, node_rank)
        if root.exists() and not root.is_dir():
            raise ConfigError(f"LocalTier path {str(root)!r} exists and is not a directory: choose another path")
        self.files.move_to(root)

    @property
    def node_leader(self) -> bool:
        """Whether this rank writes what its node holds once (the manifest copy, retention): node-local only."""
        return self.node_local and self.local_rank == 0

    def settle_layout(self, comm: Comm, run_id: str) -> str:
        """Decide whether the directory is shared by all nodes or node-local (collective: every rank calls it).

        Unless ``node_local`` was given: the first rank of each node writes a probe file, every rank lists the probe
        files it sees, and the ranks compare over ``comm``: all see every node's probe -> shared; each sees its own
        node's only -> node-local; anything else is an error (set ``node_local``). Returns how it was settled.

        Raises:
            ConfigError: on every rank together, when the ranks see inconsistent probes or cannot write one.
        """
        if self.num_nodes <= 1 and self.node_local_option is None:
            self.node_local = False
            return "one node"
        if self.node_local_option is not None or NODE_RANK_PLACEHOLDER in self.path_template:
            self.node_local = self.node_local_option is not False
            return "set" if self.node_local_option is not None else f"{NODE_RANK_PLACEHOLDER} in the path"
        root = self.files.root
        probe = root / f".probe-{run_id}-node{self.node_rank:05d}"
        error = ""
        if self.local_rank == 0:
            try:
                self.files.mkdirs(root)
                probe.write_bytes(b"")
            except OSError as e:
                error = f"cannot write {str(probe)!r}: {e}"
        comm.barrier()
        try:
            seen = sorted(n for n in os.listdir(root) if n.startswith(f".probe-{run_id}-node"))
        except OSError as e:
            seen, error = [], error or f"cannot list {str(root)!r}: {e}"
        agreed = agree_on(comm, f"probing the local tier {self.url}", lambda: seen, error=error or None, gather=True)
        comm.barrier()
        if self.local_rank == 0:
            with contextlib.suppress(OSError):
                probe.unlink()
        if not agreed.ok:
            raise ConfigError(f"cannot tell whether the local tier {self.url} is shared or node-local: {agreed.text}")
        counts = {len(s or []) for s in agreed.values or []}
        if counts == {self.num_nodes}:
            self.node_local = False
        elif counts == {1}:
            self.node_local = True
        else:
            raise ConfigError(
                f"the local tier {self.url}: the ranks see the probe files of different sets of nodes"
                f" ({sorted(counts)} of {self.num_nodes}); is the directory shared by some nodes only? Pass"
                " LocalTier(..., node_local=True) or node_local=False (URL: ?node_local=true|false)"
            )
        return "detected"
