"""The RAM tier's restore (collective): the nodes exchange what they hold, every node makes each object of the step
readable from ``k`` shares (fetching and rebuilding what it lacks), a chunk that fails its checksum has every node
verify its shares and rebuild the corrupted ones, and what the restore added is freed after.

:class:`RamRestore` is a part that :class:`~lightning_snapshot.backends.ram.tier.RamTier` holds (its ``restoring``)
and its ``restore`` delegates to; a node's inventory and rebuild are functions of the node's store
(:mod:`~lightning_snapshot.backends.ram.rebuild`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar, cast

from lightning_snapshot.backends.ram.node_store import NodeStore
from lightning_snapshot.backends.ram.placement import RamPlacement
from lightning_snapshot.backends.ram.rebuild import fetch_and_rebuild, inventory
from lightning_snapshot.backends.ram.shares import EC, READING_FILE, SHARE_FILE
from lightning_snapshot.backends.ram.store import RamStore
from lightning_snapshot.dist.agree import agree_on
from lightning_snapshot.dist.comm import Comm, TensorComm
from lightning_snapshot.errors import SnapshotError, SnapshotNotFoundError

__all__ = ["RamRestore"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class RamRestore:
    """:meth:`restore`, :meth:`prepare_restore` and :meth:`finish_restore` (collective)."""

    def __init__(self, placement: RamPlacement, objects: RamStore) -> None:
        self.placement = placement
        self.objects = objects

    @property
    def store(self) -> NodeStore:
        """The node's store (the placement's)."""
        return self.placement.store

    @property
    def url(self) -> str:
        return self.placement.url

    def restore(self, comm: Comm, step: int, read: Callable[[], _T]) -> _T:
        """Restore ``step`` from this tier (collective): :meth:`prepare_restore`, ``read()``, :meth:`finish_restore`.

        ``read`` reads what this rank needs and verifies every chunk against the manifest's checksums (the
        loader's :func:`~lightning_snapshot.restore.loader.read_section` does). Shares are trusted at first, so that an
        intact snapshot costs one verified read of its bytes and no hashing of shares; if a chunk fails its
        checksum on any rank (a corrupted share), every node hashes its shares, corrupted ones are treated as
        missing and rebuilt from the good ones, and the ranks whose read failed read again.

        Raises:
            what ``read`` raises (after the verified retry, for a checksum mismatch), or what
            :meth:`prepare_restore` raises.
        """
        from lightning_snapshot.errors import ChecksumError

        world = comm.world_size
        self.prepare_restore(comm, step)
        try:
            error: Exception | None = None
            result: Any = None
            try:
                result = read()
            except Exception as e:  # noqa: BLE001 - every rank must reach the collective below
                error = e
            corrupt = isinstance(error, ChecksumError)
            if world > 1:
                corrupt = not agree_on(comm, f"reading step {step} from the RAM tier", flags=[not corrupt]).flags[0]
            if corrupt and self.placement.erasure is not None:
                if comm.rank == 0:
                    log.warning(
                        "lightning-snapshot: RAM tier %s: a chunk of step %d failed its checksum; verifying"
                        " every share and rebuilding the corrupted ones from the others (%s)",
                        self.url,
                        step,
                        error if error is not None else "on another rank",
                    )
                self.finish_restore(step)
                if world > 1:
                    comm.barrier()
                self.prepare_restore(comm, step, verify=True)
                if error is not None:
                    error = None
                    try:
                        result = read()
                    except Exception as e:  # noqa: BLE001 - raised below, after finish_restore
                        error = e
            if error is not None:
                raise error
            return result
        finally:
            self.finish_restore(step)

    def prepare_restore(self, comm: Comm, step: int, *, verify: bool = False) -> None:
        """Make every object of ``step`` readable on this node, rebuilding erasure-coded ones (collective).

        ``verify=False`` trusts every share of the right size (the loader verifies each chunk it reads: see
        :meth:`restore`); ``verify=True`` hashes every share first and treats a mismatching one as missing.

        Raises:
            SnapshotError: some object has fewer than ``k`` good shares left on all nodes together (naming it).
        """
        from lightning_snapshot.format.manifest import MANIFEST_NAME, step_dirname

        prefix = step_dirname(step)
        world = comm.world_size
        self.objects.forget_readings()
        inv = inventory(
            self.store,
            prefix,
            leader=self.placement.node_leader,
            verify=verify,
            threads=self.placement.threads,
        )
        for bad in inv["bad"]:
            log.warning("lightning-snapshot: RAM tier %s, node %d: %s", self.url, self.placement.node_rank, bad)
        invs = cast("TensorComm", comm).all_gather(inv) if world > 1 else [inv]
        leaders = [r for r in range(world) if r % self.placement.ranks_per_node == 0]
        manifest = next((invs[r]["manifest"] for r in leaders if invs[r]["manifest"]), None)
        if manifest is None:
            raise SnapshotNotFoundError(f"no node holds the manifest of step {step} in the RAM tier {self.url}")
        # what exists where (by leader rank)
        keys = set()
        for r in leaders:
            keys |= set(invs[r]["whole"]) | set(invs[r]["shares"])
        layouts: dict[str, dict[str, Any]] = {}
        holders: dict[str, dict[int, list[int]]] = {}  # key -> share index -> leader ranks holding it
        whole_at: dict[str, list[int]] = {}
        for r in leaders:
            for key in invs[r]["whole"]:
                whole_at.setdefault(key, []).append(r)
            for key, e in invs[r]["shares"].items():
                layouts.setdefault(key, e["layout"])
                for i in e["good"]:
                    holders.setdefault(key, {}).setdefault(i, []).append(r)
        broken = {key: why for r in leaders for key, why in invs[r]["broken"].items()}
        for key in sorted(keys | set(broken)):
            if key in whole_at:
                continue
            if key not in layouts:
                raise SnapshotError(f"the RAM tier {self.url} cannot rebuild {key!r} of step {step}: {broken[key]}")
            k = layouts[key]["k"]
            have = sorted(holders.get(key, {}))
            if len(have) < k:
                raise SnapshotError(
                    f"the RAM tier {self.url} cannot rebuild {key!r} of step {step}: {len(have)} good share(s) of"
                    f" the {k} needed are left (shares {have}; nodes lost or shares corrupted)"
                )
        # plan: every leader gets what it lacks, from the lowest leader that has it
        transfers: list[tuple[int, int, str, int]] = []  # (src, dst, key, share index; -1 = whole object)
        for dst in leaders:
            for key in sorted(keys):
                if key in invs[dst]["whole"]:
                    continue
                if key in whole_at:
                    transfers.append((whole_at[key][0], dst, key, -1))
                    continue
                own = set(invs[dst]["shares"].get(key, {}).get("good", []))
                need = layouts[key]["k"] - len(own)
                for i in sorted(holders[key]):
                    if need <= 0:
                        break
                    if i not in own:
                        transfers.append((holders[key][i][0], dst, key, i))
                        need -= 1
        me = comm.rank
        if me in leaders:
            verified = {key: set(e["good"]) for key, e in invs[me]["shares"].items()}
            sizes = {key: invs[at[0]]["whole"][key] for key, at in whole_at.items()}  # (as its holder has it)
            fetch_and_rebuild(
                self.store,
                comm,
                transfers,
                layouts,
                me,
                prefix,
                sizes,
                verified,
                verify,
                self.placement.threads,
            )
        if world > 1:
            comm.barrier()
        if me in leaders and not self.store.exists(f"{prefix}/{MANIFEST_NAME}"):
            self.store.commit(f"{prefix}/{MANIFEST_NAME}", manifest.encode())
        if world > 1:
            comm.barrier()

    def finish_restore(self, step: int) -> None:
        """Free what :meth:`prepare_restore` added: received and rebuilt shares, whole objects it got from peers
        (the node's own shares stay). Every rank calls it."""
        from lightning_snapshot.format.manifest import step_dirname

        self.objects.forget_readings()
        if self.placement.erasure is None or not self.placement.node_leader:
            return
        prefix = step_dirname(step)
        for name in self.store.list(prefix):
            if name.endswith(EC):
                self.store.delete(f"{prefix}/{name[: -len(EC)]}")
                ec_dir = self.store.files.path(f"{prefix}/{name}")
                for entry in os.listdir(ec_dir) if ec_dir.is_dir() else []:
                    if entry == READING_FILE or (entry.startswith(".") and SHARE_FILE.match(entry)):
                        with contextlib.suppress(OSError):
                            os.unlink(ec_dir / entry)
