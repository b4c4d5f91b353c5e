"""Local (NVMe) tier: snapshots as files under a directory.

:class:`LocalTier` is made by registry.py (a path or ``file://`` URL) or by the user, and driven through the
:class:`~lightning_snapshot.backends.base.Backend` interface by the engine (writer.py, persist.py, restore.py,
loader.py) and by the RAM tier's agent; the RAM tier (ram/tier.py, ram/rebuild.py) also uses it as a node's store.

The tier is one class that holds three parts and delegates to them: its files (``files``,
:class:`~lightning_snapshot.backends.local_files.LocalFiles`: paths under the root, writes, reads, listing, deletion,
fsync, ``O_DIRECT``), its place in a multi-node job and whether its directory is shared (``layout``,
:class:`~lightning_snapshot.backends.local_layout.LocalLayout`) and the node-to-node transfers of a node-local restore
(``transfers``, :class:`~lightning_snapshot.backends.local_transfers.NodeTransfers`). This module holds its options
and the delegation.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from typing_extensions import Unpack

from lightning_snapshot.backends.base import Backend, NeededObjects, ScheduleOptionsKwargs, node_steps
from lightning_snapshot.backends.local_files import LocalFiles, dir_mode_for, parse_mode
from lightning_snapshot.backends.local_layout import NODE_RANK_PLACEHOLDER, LocalLayout, resolve_path
from lightning_snapshot.backends.local_transfers import NodeTransfers
from lightning_snapshot.dist.comm import Comm
from lightning_snapshot.errors import ConfigError

__all__ = ["NODE_RANK_PLACEHOLDER", "LocalTier", "dir_mode_for", "parse_mode"]

_T = TypeVar("_T")


class LocalTier(Backend):
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
        **schedule: the schedule options every tier takes (``every_n_train_steps``, ``train_time_interval``,
            ``keep_last``, ``min_every``, ``max_every``):
            :class:`~lightning_snapshot.backends.base.ScheduleOptionsKwargs`.
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
        *,
        node_local: bool | None = None,
        mode: int | str | None = None,
        **schedule: Unpack[ScheduleOptionsKwargs],
    ) -> None:
        super().__init__(**schedule)
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ConfigError(f"LocalTier path must be a non-empty path, got {path!r}")
        if node_local is not None and not isinstance(node_local, bool):
            raise ConfigError(f"LocalTier node_local must be True, False or None (detect), got {node_local!r}")
        path_template = os.path.expanduser(os.fspath(path))
        if NODE_RANK_PLACEHOLDER in path_template and node_local is False:
            raise ConfigError(
                f"LocalTier path {path_template!r} gives each node its own directory"
                f" ({NODE_RANK_PLACEHOLDER}), so it cannot be node_local=False: drop one of the two"
            )
        root = resolve_path(path_template, os.environ.get("NODE_RANK", "0"))
        #: The files under the root (the bytes).
        self.files = LocalFiles(
            root, mode=parse_mode(mode), file_mode=type(self).file_mode, direct_io=hasattr(os, "O_DIRECT")
        )
        #: Where the directory is in the job, and whether it is node-local.
        self.layout = LocalLayout(path_template, node_local, self.files)
        #: The node-to-node transfers of a node-local restore.
        self.transfers = NodeTransfers(self.files, self.layout)
        if root.exists() and not root.is_dir():
            raise ConfigError(f"LocalTier path {str(root)!r} exists and is not a directory: choose another path")

    # ------------------------------------------------------------------------------------------- identity, parts
    @property
    def url(self) -> str:
        return str(self.files.root)

    @property
    def root(self) -> Path:  # type: ignore[override]  # (the directory: the layout moves it when the job places the tier)
        return self.files.root

    @property
    def bytes_read(self) -> int:  # type: ignore[override]  # (counted by the files)
        return self.files.bytes_read

    @property
    def mode(self) -> int | None:
        """Exact permissions of the files the tier creates (None: ``file_mode`` less the umask)."""
        return self.files.mode

    @property
    def direct_io(self) -> bool:
        """Whether page-aligned buffers are written with ``O_DIRECT`` (turned off where the filesystem refuses)."""
        return self.files.direct_io

    @direct_io.setter
    def direct_io(self, value: bool) -> None:
        self.files.direct_io = value

    @property
    def direct_bytes(self) -> int:
        """Bytes written with ``O_DIRECT`` so far in this process."""
        return self.files.direct_bytes

    @property
    def path_template(self) -> str:
        """The path as given, ``~`` expanded (it may hold ``{node_rank}``)."""
        return self.layout.path_template

    @property
    def node_local_option(self) -> bool | None:
        """The user's choice (None: detect at set-up)."""
        return self.layout.node_local_option

    @property
    def node_local(self) -> bool:  # type: ignore[override]  # (settled by the layout)
        """Whether each node has its own directory (settled by :meth:`settle_layout` in a multi-node job)."""
        return self.layout.node_local

    @property
    def node_leader(self) -> bool:
        """Whether this rank writes what its node holds once (the manifest copy, retention): node-local only."""
        return self.layout.node_leader

    # ------------------------------------------------------------------------------------------- bytes
    def write(self, key: str, buffers: Iterable[bytes | bytearray | memoryview]) -> int:
        """See :meth:`LocalFiles.write <lightning_snapshot.backends.local_files.LocalFiles.write>`: a hidden
        temporary file, fsynced and renamed into place; ``O_DIRECT`` for page-aligned buffers."""
        return self.files.write(key, buffers)

    def commit(self, key: str, data: bytes) -> None:
        """Publish ``key`` atomically and durably: :meth:`write` already writes to a temporary name, fsyncs, renames
        into place and fsyncs the directory, which is this tier's commit rule."""
        self.files.commit(key, data)

    def read(self, key: str) -> bytes:
        return self.files.read(key)

    def read_view(self, key: str) -> memoryview:
        """The object mapped read-only into memory (no copy; pages come from the page cache or the disk)."""
        return self.files.read_view(key)

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        """Thread-safe; ``preadv`` straight into ``out`` (the GIL is released while the kernel copies)."""
        self.files.read_into(key, offset, out)

    def list(self, prefix: str = "") -> builtins.list[str]:
        """Raises ``OSError`` when the tier's root exists and cannot be listed (not a directory, no permission);
        a root or prefix that does not exist lists as empty."""
        return self.files.list(prefix)

    def delete(self, key: str) -> None:
        self.files.delete(key)

    def exists(self, key: str) -> bool:
        return self.files.exists(key)

    def modified(self, key: str) -> float | None:
        """The newest ``st_mtime`` of ``key`` and of every file and directory under it (see
        :meth:`LocalFiles.modified <lightning_snapshot.backends.local_files.LocalFiles.modified>`)."""
        return self.files.modified(key)

    def require_exists(self) -> None:
        self.files.require_exists()

    # ------------------------------------------------------------------------------------------- the job
    def bind(self, *, node_rank: int, num_nodes: int, local_rank: int, ranks_per_node: int) -> None:
        """Place this tier in the job (called by the callback at set-up, on every rank)."""
        self.layout.bind(node_rank=node_rank, num_nodes=num_nodes, local_rank=local_rank, ranks_per_node=ranks_per_node)

    def settle_layout(self, comm: Comm, run_id: str) -> str:
        """Decide whether the directory is shared by all nodes or node-local (collective: see
        :meth:`LocalLayout.settle_layout <lightning_snapshot.backends.local_layout.LocalLayout.settle_layout>`)."""
        return self.layout.settle_layout(comm, run_id)

    def collective_steps(self, comm: Comm, objects: NeededObjects | None = None) -> builtins.list[int]:
        """Steps whose manifest any node holds, newest first (collective; node-local tiers: see
        :func:`~lightning_snapshot.backends.base.node_steps`)."""
        return node_steps(self, comm)

    def restore(self, comm: Comm, step: int, read: Callable[[], _T], needed: NeededObjects | None = None) -> _T:
        """Restore ``step`` (collective): node-local, first make every object ``needed`` readable on this node
        (:meth:`NodeTransfers.prepare_restore <lightning_snapshot.backends.local_transfers.NodeTransfers.\
prepare_restore>`), then ``read()``, then free what was fetched. Shared: ``read()``."""
        if not self.node_local:
            return read()
        try:
            self.transfers.prepare_restore(comm, step, needed)
            return read()
        finally:
            self.transfers.finish_restore()
