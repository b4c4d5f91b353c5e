"""A node-local local tier across nodes: a restore that first fetches the objects a node lacks from the nodes that
hold them over the process group (gloo), then frees them.

:class:`NodeTransfers` is a part that :class:`~lightning_snapshot.backends.local.LocalTier` holds (its ``transfers``)
and its :meth:`~lightning_snapshot.backends.local.LocalTier.restore` delegates to. It moves bytes and agrees on each
step with the other ranks; which objects a step needs is the engine's to say (a :data:`~lightning_snapshot.backends.
base.NeededObjects` function of the manifest's bytes): nothing here reads a manifest.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, cast

from lightning_snapshot.backends.base import NeededObjects, StepObject
from lightning_snapshot.backends.local_files import LocalFiles
from lightning_snapshot.backends.local_layout import LocalLayout
from lightning_snapshot.backends.mapped_files import close_map, exchange, group_of, map_existing, map_new
from lightning_snapshot.dist import agree
from lightning_snapshot.dist.comm import Comm, TensorComm
from lightning_snapshot.errors import SnapshotError, SnapshotNotFoundError
from lightning_snapshot.format.manifest import MANIFEST_NAME, step_dirname

__all__ = ["NodeTransfers"]

log = logging.getLogger(__name__)


def _discard(sends: list[tuple[Any, int]], receives: list[tuple[Any, int]], received: list[tuple[Path, Path]]) -> None:
    """Close the maps of transfers that will not run, and remove the temporary files made to receive into."""
    for mm, _peer in sends + receives:
        close_map(mm)
    for tmp, _path in received:
        with contextlib.suppress(OSError):
            tmp.unlink()


class NodeTransfers:
    """The node-to-node restore of a node-local directory: :meth:`prepare_restore` and :meth:`finish_restore`.

    Args:
        files: the tier's files on this node.
        layout: this rank's place in the job (which ranks are the nodes' first ranks).
    """

    def __init__(self, files: LocalFiles, layout: LocalLayout) -> None:
        self.files = files
        self.layout = layout
        self.init_process_state()

    def init_process_state(self) -> None:
        """This process's list of fetched files (made again where the part was unpickled)."""
        #: Files a node-local restore fetched from other nodes (deleted by :meth:`finish_restore`).
        self.fetched: list[Path] = []

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state.pop("fetched", None)
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.init_process_state()

    def prepare_restore(self, comm: Comm, step: int, needed: NeededObjects | None) -> None:
        """Make every object of ``step`` readable on this node (collective; node-local tiers).

        The first rank of each node says what its node holds; objects a node lacks (the other nodes' ranks' data,
        needed because every rank writes a share of the replicated state, and after a change of world size) are sent
        to it over ``comm`` (gloo) from the lowest node that holds them, and the manifest too where it lacks one.

        Args:
            comm: the tier's group (every rank of the job calls this).
            step: the step to restore.
            needed: the objects a restore of the step reads, from the manifest's bytes (the engine's reading of its
                own format: each object's key, size and writer rank); None: every object some node holds.

        Raises:
            SnapshotError: on every rank together, when some object is on no node of the job (a replaced node with
                an empty disk, or a lost one): naming the nodes that lack the step.
        """
        files, layout, url = self.files, self.layout, self.layout.url
        prefix = step_dirname(step)
        where_ = f"step {step} of the node-local tier {url}"

        def inventory() -> dict[str, Any] | None:
            """(A node's first rank) what its node holds of the step: the manifest, and each object's size."""
            if not layout.node_leader:
                return None
            try:
                held: dict[str, Any] = {
                    "node": layout.node_rank,
                    "manifest": files.exists(f"{prefix}/{MANIFEST_NAME}"),
                    "objects": {},
                }
                for name in files.list(prefix):
                    if name.endswith(".bin"):
                        held["objects"][name] = files.path(f"{prefix}/{name}").stat().st_size
            except OSError as e:
                raise SnapshotError(
                    f"rank {comm.rank} (node {layout.node_rank}) cannot list {where_}: {type(e).__name__}: {e}."
                    " Check that node's disk, or resume from another tier"
                ) from e
            return held

        # every rank takes part even where a node's disk fails: that failure is every rank's error, at once
        gathered = agree.all_gather(cast("TensorComm", comm), f"listing what each node holds of {where_}", inventory)
        invs = {r: i for r, i in enumerate(gathered) if i is not None}  # the node leaders' inventories
        leaders = list(invs)
        holders = [r for r in leaders if invs[r]["manifest"]]
        if not holders:
            raise SnapshotNotFoundError(f"no node holds the manifest of step {step} in the local tier {url}")

        def manifest_bytes() -> bytes:
            try:
                data = files.read(f"{prefix}/{MANIFEST_NAME}")
                data.decode()  # (a manifest is text: bytes that are not fail here, on the rank that read them)
                return data
            except (OSError, UnicodeDecodeError) as e:
                raise SnapshotError(
                    f"rank {comm.rank} (node {layout.node_rank}) cannot read the manifest of {where_}:"
                    f" {type(e).__name__}: {e}. Check that node's disk, or resume from another tier"
                ) from e

        data = agree.broadcast(comm, f"reading the manifest of {where_}", manifest_bytes, src=holders[0])
        if needed is not None:
            objects: list[StepObject] = list(needed(data))
        else:  # (every object held somewhere, at the size its lowest holder has)
            sizes: dict[str, int] = {}
            for r in reversed(leaders):
                sizes.update(invs[r]["objects"])
            objects = [StepObject(key, nbytes, -1) for key, nbytes in sorted(sizes.items())]
        where: dict[str, list[int]] = {
            o.key: [r for r in leaders if invs[r]["objects"].get(o.key) == o.nbytes] for o in objects
        }
        lost = sorted({o.writer for o in objects if not where[o.key]})
        if lost:
            lacking = sorted(invs[r]["node"] for r in leaders if not invs[r]["manifest"]) or sorted(
                invs[r]["node"] for r in leaders
            )
            raise SnapshotError(
                f"node(s) {', '.join(map(str, lacking))} of this job do not hold step {step} of the node-local tier"
                f" {url}, and the data of rank(s) {', '.join(map(str, lost))} is on no node (a replaced node with"
                " an empty disk, or a lost one)"
            )
        transfers = [
            (where[o.key][0], dst, o.key, o.nbytes) for dst in leaders for o in objects if dst not in where[o.key]
        ]
        self.fetched = []
        mine = [t for t in transfers if comm.rank in t[:2]] if comm.rank in leaders else []
        # each rank opens its side of the transfers (a failure: every rank's error before anything is sent), sends
        # and receives, then puts what it received in place (a failure there too: every rank's error, at once)
        opened = agree.agree_on(
            comm, f"opening the files to fetch {where_}", lambda: self.open_transfers(comm, mine, prefix)
        )
        sends, receives, received = opened.value or ([], [], [])
        if not opened.ok:  # (another rank could not open its side: nothing is sent, what this rank made goes)
            _discard(sends, receives, received)
            opened.result()
        if mine:
            exchange(group_of(comm), sends, receives)

        def place() -> None:
            try:
                for tmp, path in received:
                    os.replace(tmp, path)
                    self.fetched.append(path)
                if comm.rank in leaders and not invs[comm.rank]["manifest"]:
                    files.commit(f"{prefix}/{MANIFEST_NAME}", data)
                    self.fetched.append(files.path(f"{prefix}/{MANIFEST_NAME}"))
            except OSError as e:
                raise SnapshotError(
                    f"rank {comm.rank} (node {layout.node_rank}) cannot store what it fetched of {where_}:"
                    f" {type(e).__name__}: {e}. Check that node's disk, or resume from another tier"
                ) from e

        agree.agree_on(comm, f"storing what each node fetched of {where_}", place).result()
        if transfers:
            log.info(
                "lightning-snapshot: local tier %s: fetched %d object(s) of step %d from other nodes",
                url,
                len([t for t in transfers if t[1] == comm.rank]),
                step,
            )

    def open_transfers(
        self, comm: Comm, transfers: list[tuple[int, int, str, int]], prefix: str
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
                path = self.files.path(f"{prefix}/{key}")
                if comm.rank == src:
                    sends.append((map_existing(path, write=False), dist.get_global_rank(group_of(comm), dst)))
                else:
                    tmp = path.with_name(f".{path.name}.fetch-{os.getpid()}")
                    self.files.mkdirs(path.parent)
                    received.append((tmp, path))
                    mapped = map_new(tmp, nbytes, self.files.mode, self.files.file_mode)
                    receives.append((mapped, dist.get_global_rank(group_of(comm), src)))
        except BaseException:
            _discard(sends, receives, received)
            raise
        return sends, receives, received

    def finish_restore(self) -> None:
        """Delete what :meth:`prepare_restore` fetched: each node keeps only its own ranks' objects."""
        fetched, self.fetched = self.fetched, []
        for path in fetched:
            with contextlib.suppress(OSError):
                path.unlink()
        for parent in {p.parent for p in fetched}:
            with contextlib.suppress(OSError):
                parent.rmdir()  # (only if empty: a step this node did not hold)
