"""Local (NVMe) tier: snapshots as files under a directory.

:class:`LocalTier` is made by registry.py (a path or ``file://`` URL) or by the user, and driven through the
:class:`~lightning_snapshot.backends.base.Backend` interface by the engine (writer.py, persist.py, restore.py,
loader.py) and by the RAM tier's agent; the RAM tier (ram/tier.py, ram/rebuild.py) also uses it as a node's store.

The tier is written in three parts, each a base class of :class:`LocalTier`: its files
(:mod:`~lightning_snapshot.backends.local_files`), its place in a multi-node job and whether its directory is shared
(:mod:`~lightning_snapshot.backends.local_layout`), and the transfers of a node-local restore
(:mod:`~lightning_snapshot.backends.local_transfers`). This module holds its options.
"""

from __future__ import annotations

import datetime as _dt
import os
import threading
from pathlib import Path

from lightning_snapshot.backends.base import DEFAULT_KEEP_LAST
from lightning_snapshot.backends.local_files import dir_mode_for, parse_mode
from lightning_snapshot.backends.local_layout import NODE_RANK_PLACEHOLDER
from lightning_snapshot.backends.local_transfers import NodeTransfers
from lightning_snapshot.errors import ConfigError

__all__ = ["NODE_RANK_PLACEHOLDER", "LocalTier", "dir_mode_for", "parse_mode"]


class LocalTier(NodeTransfers):
    """Snapshots as files on a local filesystem (node-local NVMe, or any POSIX path).

    Commit rule: data objects are written and fsynced first; the manifest is written to a temporary file, fsynced
    and moved into place with ``os.replace``, then the directory is fsynced. A step without a manifest does not
    exist for the loader.

    In a multi-node job the directory may be shared by all nodes (a network filesystem) or *node-local* (each node's
    own disk). Node-local: every node holds its own ranks' data objects and a copy of the manifest; the commit is
    agreed over the process group (every rank's data written, then every node commits the same manifest), and a
    restore fetches the objects a node lacks from the nodes that hold them, over the process group (see
    :meth:`restore`). Which one it is, is detected when training starts (each node writes a probe file and the ranks
    compare what they see) unless ``node_local`` says so.

    Args:
        path: the tier's root directory (created if missing). ``~`` is expanded; ``{node_rank}`` is replaced by the
            node's rank (each node its own directory: node-local; ``NODE_RANK`` or 0 until training binds it).
        every_n_train_steps, train_time_interval, keep_last, min_every, max_every: see
            :class:`~lightning_snapshot.backends.base.Backend`.
        node_local: ``None`` (default): detect at the start of training; ``True``: each node has its own directory;
            ``False``: one directory shared by all nodes.
        mode: permissions of the files the tier creates, exactly (e.g. ``0o600``: only the owner can read them);
            the directories it creates get the matching search bits (``0o700``). ``None`` (default): files
            ``0o666`` and directories ``0o777`` less the process umask, as ``torch.save`` and ``open`` do (umask
            022: 0644 and 0755). The snapshot agent, writing in the trainer's place, keeps the same mode.

    URL form: ``"/path?every=100&keep=3&interval=600&node_local=auto&mode=0600"`` or ``"file:///path?..."``
    (``node_local`` is ``auto``, ``true`` or ``false``; ``mode`` is octal, ``0600`` to ``0777``).
    """

    tier = "local"
    copy_source = True
    durable = True
    root: Path  # (the declared capabilities this tier always has, with their types here)
    bytes_read: int
    #: Permissions of the files the tier creates, less the umask, unless ``mode`` is given.
    file_mode = 0o666
    parallel_reads = 4
    check_hint = (
        "Choose a path that is (or can be created as) a directory this process may write: check the"
        " permissions, that no part of the path is a file, and that the filesystem is mounted read-write"
    )

    def __init__(
        self,
        path: str | os.PathLike[str],
        every_n_train_steps: int | str | None = None,
        train_time_interval: _dt.timedelta | float | None = None,
        keep_last: int | None = DEFAULT_KEEP_LAST,
        *,
        min_every: int | None = None,
        max_every: int | None = None,
        node_local: bool | None = None,
        mode: int | str | None = None,
    ) -> None:
        super().__init__(
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            keep_last=keep_last,
            min_every=min_every,
            max_every=max_every,
        )
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ConfigError(f"LocalTier path must be a non-empty path, got {path!r}")
        if node_local is not None and not isinstance(node_local, bool):
            raise ConfigError(f"LocalTier node_local must be True, False or None (detect), got {node_local!r}")
        #: Exact permissions of the files the tier creates (None: ``file_mode`` less the umask).
        self.mode = parse_mode(mode)
        self.path_template = os.path.expanduser(os.fspath(path))
        if NODE_RANK_PLACEHOLDER in self.path_template and node_local is False:
            raise ConfigError(
                f"LocalTier path {self.path_template!r} gives each node its own directory"
                f" ({NODE_RANK_PLACEHOLDER}), so it cannot be node_local=False: drop one of the two"
            )
        #: The user's choice (None: detect at set-up).
        self.node_local_option = node_local
        #: Whether each node has its own directory (settled by :meth:`settle_layout` in a multi-node job).
        self.node_local = bool(node_local)
        self.node_rank, self.num_nodes, self.local_rank, self.ranks_per_node = 0, 1, 0, 1
        self.root = self._resolve(os.environ.get("NODE_RANK", "0"))
        #: Write page-aligned buffers with O_DIRECT (turned off by itself where the filesystem refuses it).
        self.direct_io = hasattr(os, "O_DIRECT")
        self._init_process_state()
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"LocalTier path {str(self.root)!r} exists and is not a directory: choose another path")

    _process_local = ("direct_bytes", "bytes_read", "_count_lock", "_fetched")

    def _init_process_state(self) -> None:
        super()._init_process_state()
        #: Bytes written with O_DIRECT so far in this process (a counter for tests and benchmarks).
        self.direct_bytes = 0
        #: Bytes read with ranged reads in this process (``read_into``; a counter: resharding reads only what each
        #: rank needs).
        self.bytes_read = 0
        self._count_lock = threading.Lock()
        #: Files a node-local restore fetched from other nodes (deleted by :meth:`finish_restore`).
        self._fetched = []

    @property
    def url(self) -> str:
        return str(self.root)
