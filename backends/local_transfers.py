"""A node-local local tier across nodes: the steps any node holds, and a restore that first fetches the objects a
node lacks from the nodes that hold them over the process group (gloo), then frees them (:class:`NodeTransfers`, a
base class of :class:`~lightning_snapshot.backends.local.LocalTier`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from lightning_snapshot.backends.base import node_steps
from lightning_snapshot.backends.local_layout import LocalLayout
from lightning_snapshot.backends.mapped_files import close_map, exchange, map_existing, map_new
from lightning_snapshot.dist import agree
from lightning_snapshot.errors import SnapshotError, SnapshotNotFoundError

__all__ = ["NodeTransfers"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


def _needed_objects(manifest: Any, world_size: int) -> set[str]:
    """The objects a restore into ``world_size`` ranks reads: those of the shared tensors, and those of the rank
    sections it restores (every rank's at the same world size; at another, rank 0's, for the data position)."""
    ranks = range(world_size) if manifest.world_size == world_size else [0]
    entries = list(manifest.tensors)
    for r in ranks:
        section = manifest.rank_section(r)
        if section is not None:
            entries += section.tensors
    return {f.object for t in entries for f in t.fragments}


class NodeTransfers(LocalLayout):
    """The collective steps of a node-local directory: :meth:`collective_steps` and :meth:`restore`."""

    #: Files a node-local restore fetched from other nodes (deleted by :meth:`finish_restore`).
    _fetched: list[Path]

    def collective_steps(self, comm: Any) -> list[int]:
        """Steps whose manifest any node holds, newest first (collective; node-local tiers: see
        :func:`~lightning_snapshot.backends.base.node_steps`)."""
        return node_steps(self, comm)

    def restore(self, comm: Any, step: int, read: Callable[[], _T]) -> _T:
        """Restore ``step`` (collective): node-local, first make every object of it readable on this node
        (:meth:`prepare_restore`), then ``read()``, then free what was fetched. Shared: ``read()``."""
        if not self.node_local:
            return read()
        try:
            self.prepare_restore(comm, step)
            return read()
        finally:
            self.finish_restore()

    def prepare_restore(self, comm: Any, step: int) -> None:
        """Make every object of ``step`` readable on this node (collective; node-local tiers).

        The first rank of each node says what its node holds; objects a node lacks (the other nodes' ranks' data,
        needed because every rank writes a share of the replicated state, and after a change of world size) are sent
        to it over ``comm`` (gloo) from the lowest node that holds them, and the manifest too where it lacks one.

        Raises:
            SnapshotError: on every rank together, when some object is on no node of the job (a replaced node with
                an empty disk, or a lost one): naming the nodes that lack the step.
        """
        from lightning_snapshot.format.manifest import MANIFEST_NAME, Manifest, step_dirname

        prefix = step_dirname(step)
        world = getattr(comm, "world_size", 1)
        where_ = f"step {step} of the node-local tier {self.url}"

        def inventory() -> dict[str, Any] | None:
            """(A node's first rank) what its node holds of the step: the manifest, and each object's size."""
            if not self.node_leader:
                return None
            try:
                held: dict[str, Any] = {
                    "node": self.node_rank,
                    "manifest": self.exists(f"{prefix}/{MANIFEST_NAME}"),
                    "objects": {},
                }
                for name in self.list(prefix):
                    if name.endswith(".bin"):
                        held["objects"][name] = self._path(f"{prefix}/{name}").stat().st_size
            except OSError as e:
                raise SnapshotError(
                    f"rank {comm.rank} (node {self.node_rank}) cannot list {where_}: {type(e).__name__}: {e}."
                    " Check that node's disk, or resume from another tier"
                ) from e
            return held

        # every rank takes part even where a node's disk fails: that failure is every rank's error, at once
        gathered = agree.all_gather(comm, f"listing what each node holds of {where_}", inventory)
        invs = {r: i for r, i in enumerate(gathered) if i is not None}  # the node leaders' inventories
        leaders = list(invs)
        holders = [r for r in leaders if invs[r]["manifest"]]
        if not holders:
            raise SnapshotNotFoundError(f"no node holds the manifest of step {step} in the local tier {self.url}")

        def manifest_text() -> str:
            try:
                return self.read(f"{prefix}/{MANIFEST_NAME}").decode()
            except (OSError, UnicodeDecodeError) as e:
                raise SnapshotError(
                    f"rank {comm.rank} (node {self.node_rank}) cannot read the manifest of {where_}:"
                    f" {type(e).__name__}: {e}. Check that node's disk, or resume from another tier"
                ) from e

        text = agree.broadcast(comm, f"reading the manifest of {where_}", manifest_text, src=holders[0])
        manifest = Manifest.from_json(text, where=f"manifest of {prefix} in the local tier {self.url}")
        needed = _needed_objects(manifest, world)
        where: dict[str, list[int]] = {}
        for o in manifest.objects:
            where[o.key] = [r for r in leaders if invs[r]["objects"].get(o.key) == o.nbytes]
        lost = sorted({o.rank for o in manifest.objects if o.key in needed and not where[o.key]})
        if lost:
            lacking = sorted(invs[r]["node"] for r in leaders if not invs[r]["manifest"]) or sorted(
                invs[r]["node"] for r in leaders
            )
            raise SnapshotError(
                f"node(s) {', '.join(map(str, lacking))} of this job do not hold step {step} of the node-local tier"
                f" {self.url}, and the data of rank(s) {', '.join(map(str, lost))} is on no node (a replaced node with"
                " an empty disk, or a lost one)"
            )
        transfers = [
            (where[o.key][0], dst, o.key, o.nbytes)
            for dst in leaders
            for o in manifest.objects
            if o.key in needed and dst not in where[o.key]
        ]
        self._fetched = []
        mine = [t for t in transfers if comm.rank in t[:2]] if comm.rank in leaders else []
        # each rank opens its side of the transfers (a failure: every rank's error before anything is sent), sends
        # and receives, then puts what it received in place (a failure there too: every rank's error, at once)
        opened = agree.agree_on(
            comm, f"opening the files to fetch {where_}", lambda: self._open_transfers(comm, mine, prefix)
        )
        sends, receives, received = opened.value or ([], [], [])
        if not opened.ok:
            for mm, _peer in sends + receives:
                close_map(mm)
            opened.result()
        if mine:
            exchange(comm.group, sends, receives)

        def place() -> None:
            try:
                for tmp, path in received:
                    os.replace(tmp, path)
                    self._fetched.append(path)
                if comm.rank in leaders and not invs[comm.rank]["manifest"]:
                    self.commit(f"{prefix}/{MANIFEST_NAME}", text.encode())
                    self._fetched.append(self._path(f"{prefix}/{MANIFEST_NAME}"))
            except OSError as e:
                raise SnapshotError(
                    f"rank {comm.rank} (node {self.node_rank}) cannot store what it fetched of {where_}:"
                    f" {type(e).__name__}: {e}. Check that node's disk, or resume from another tier"
                ) from e

        agree.agree_on(comm, f"storing what each node fetched of {where_}", place).result()
        if transfers:
            log.info(
                "lightning-snapshot: local tier %s: fetched %d object(s) of step %d from other nodes",
                self.url,
                len([t for t in transfers if t[1] == comm.rank]),
                step,
            )

    def _open_transfers(
        self, comm: Any, transfers: list[tuple[int, int, str, int]], prefix: str
    ) -> tuple[list[tuple[Any, int]], list[tuple[Any, int]], list[tuple[Path, Path]]]:
        """This rank's side of ``transfers`` ((src, dst, object key, bytes)): the files it sends, mapped; the files
        it receives, mapped under a temporary name (renamed into place once complete). Every map is closed again
        when one cannot be opened."""
        if not transfers:
            return [], [], []
        import torch.distributed as dist

        sends: list[tuple[Any, int]] = []
        receives: list[tuple[Any, int]] = []
        received: list[tuple[Path, Path]] = []
        try:
            for src, dst, key, nbytes in transfers:
                path = self._path(f"{prefix}/{key}")
                if comm.rank == src:
                    sends.append((map_existing(path, write=False), dist.get_global_rank(comm.group, dst)))
                else:
                    tmp = path.with_name(f".{path.name}.fetch-{os.getpid()}")
                    self._mkdirs(path.parent)
                    received.append((tmp, path))
                    receives.append(
                        (map_new(tmp, nbytes, self.mode, self.file_mode), dist.get_global_rank(comm.group, src))
                    )
        except BaseException:
            for mm, _peer in sends + receives:
                close_map(mm)
            raise
        return sends, receives, received

    def finish_restore(self) -> None:
        """Delete what :meth:`prepare_restore` fetched: each node keeps only its own ranks' objects."""
        fetched, self._fetched = self._fetched, []
        for path in fetched:
            with contextlib.suppress(OSError):
                path.unlink()
        for parent in {p.parent for p in fetched}:
            with contextlib.suppress(OSError):
                parent.rmdir()  # (only if empty: a step this node did not hold)
