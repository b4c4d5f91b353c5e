"""The reads of a restore: a snapshot's shared state into the live tensors (read once in the job where the tier
allows), each rank's section (read once per fit), and what was read.

One :class:`SnapshotReader` per fit, held by the :class:`~lightning_snapshot.restore.restorer.Restorer`. Collective
where the
Restorer's calls are: every rank reads the same snapshot at the same point.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from lightning_snapshot.backends.base import Backend
from lightning_snapshot.dist.comm import Comm, LocalComm, TensorComm
from lightning_snapshot.errors import SnapshotError
from lightning_snapshot.format.manifest import step_dirname
from lightning_snapshot.restore.loader import ReadStats, read_manifest, read_section
from lightning_snapshot.restore.objects import needed_objects
from lightning_snapshot.restore.read_once import ReadOnce
from lightning_snapshot.restore.read_once import enabled as read_once_enabled
from lightning_snapshot.restore.targets import Templates, adopt_pruning, check_optimizers, restore_targets
from lightning_snapshot.state.builtin import REGISTRY, capture_tensor_parts
from lightning_snapshot.state.capture import check_model, is_sharded
from lightning_snapshot.state.parts import Phase, RestoreContext

__all__ = ["SnapshotReader"]

log = logging.getLogger(__name__)


class SnapshotReader:
    """Reads snapshots for one fit's restore.

    Args:
        tiers: the callback's tiers.
        comm: the trainer's collectives.
        tier_comms: one process group per tier (the node-local tiers' reads are collective over it).
    """

    def __init__(self, tiers: Sequence[Backend], comm: Comm, tier_comms: Sequence[Comm]) -> None:
        self.tiers = list(tiers)
        self.comm = comm
        self.tier_comms = list(tier_comms)
        #: (tier url, step, rank) -> a rank section's state, as read at setup (for on_fit_start: read once)
        self._sections: dict[tuple[str, int, int], Any] = {}
        #: what this rank read for the last snapshot it read (see ``SnapshotCallback.restore_stats``), or None
        self.stats: dict[str, int | None] | None = None

    def forget(self) -> None:
        """Drop the sections read (a snapshot was applied)."""
        self._sections.clear()

    def read_late(self, backend: Backend, step: int) -> Any:
        """This rank's late state (loops, callbacks, schedulers) of a snapshot; rank 0's after a change of the
        number of processes."""

        def read() -> Any:
            manifest = read_manifest(backend, step)
            rank = self.comm.rank if manifest.world_size == self.comm.world_size else 0
            state = self.rank_state(backend, manifest, rank)
            return state.get("late") if isinstance(state, dict) else None

        if backend.node_local and backend.read_once:
            # each node's own disk: its own rank's section is there (it wrote it), read without first copying every
            # object a node lacks to it (the restore does that once); where it is not, on_fit_start loads the states
            return read()
        return self.through_tier(backend, step, read)

    def rank_state(self, backend: Backend, manifest: Any, rank: int) -> Any:
        """The state of ``rank``'s section of a snapshot (its RNG, data position, late state), or None when it has
        none: read once per fit (the callback states are loaded from it at ``setup``, the rest at ``on_fit_start``)."""
        key = (backend.url, manifest.step, rank)
        if key not in self._sections:
            section = manifest.rank_section(rank)
            if section is None:
                return None
            self._sections[key] = read_section(backend, manifest, section.tensors, section.state)
        return self._sections[key]

    def through_tier(self, backend: Backend, step: int, read: Callable[[], Any]) -> Any:
        """Run ``read`` (a read of snapshot ``step`` of ``backend``). For a node-local tier of this callback (RAM, a
        local tier on each node's own disk) the objects are first made readable on every node (RAM: a corrupted
        share found by the read is repaired from the others) and what the restore added is freed after: collective
        over the tier's group. Any other backend (a snapshot path given as ``resume``) is read directly."""
        if not backend.node_local or backend not in self.tiers:
            return read()
        comm = self.tier_comms[self.tiers.index(backend)] if self.tier_comms else LocalComm()
        where = f"manifest of {step_dirname(step)} in the {backend.tier} tier {backend.url}"
        return backend.restore(comm, step, read, needed_objects(comm.world_size, where))

    def read(
        self, backend: Backend, step: int, trainer: Any, pl_module: Any, live: Templates
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        return self.through_tier(backend, step, lambda: self._read_tier(backend, step, trainer, pl_module, live))

    def _read_tier(
        self, backend: Backend, step: int, trainer: Any, pl_module: Any, live: Templates
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        where = f"snapshot of step {step} in the {backend.tier} tier {backend.url!r}"
        shared_reader = self.read_once(backend, where)
        try:
            manifest = read_manifest(backend, step)
            targets = self._targets(trainer, pl_module, live, manifest, where)
        except Exception as e:
            if shared_reader is not None:
                shared_reader.start(e)  # (raises on every rank)
            raise
        if shared_reader is not None:
            shared_reader.start(None)
        stats = ReadStats()
        counted = backend.bytes_read
        shared = read_section(
            backend, manifest, manifest.tensors, manifest.state, targets=targets, stats=stats, shared=shared_reader
        )
        after = backend.bytes_read
        self.stats = {
            "bytes_needed": stats.bytes_needed,
            "bytes_read": stats.bytes_read,
            "bytes_received": shared_reader.bytes_received if shared_reader is not None else 0,
            "tier_bytes_read": after - counted if isinstance(counted, int) and isinstance(after, int) else None,
            "tensors_resharded": stats.tensors_resharded,
            "job_bytes_read": None,  # (summed over the ranks once every rank has read: _apply)
        }
        if not isinstance(shared, dict):
            raise SnapshotError(f"{where} holds no training state")
        check_model(pl_module, shared.get("state_dict"), where)
        rank_state = None
        if manifest.world_size != self.comm.world_size:
            warnings.warn(
                f"lightning-snapshot: the {where} was taken with {manifest.world_size} process(es), this run has"
                f" {self.comm.world_size}: weights, optimizer and loop state are restored, and the data continues"
                " from the saved global sample, but per-rank RNG is not restored, so the run will not be bitwise"
                " identical to an uninterrupted one.",
                stacklevel=2,
            )
            # the data position, as a global sample count, from rank 0's section (the same on every rank); the state
            # parts that are not resharded (RNG, DDP's layout) are not restored
            rank_state = REGISTRY.resized(self.rank_state(backend, manifest, 0))
        else:
            rank_state = self.rank_state(backend, manifest, self.comm.rank)
        # loops, callbacks, schedulers: taken with the rank state, right before the next step (this rank's own)
        late = rank_state.get("late") if isinstance(rank_state, dict) else None
        if isinstance(late, dict):
            shared.update(late)
        if "loops" not in shared:
            raise SnapshotError(f"{where} holds no training state")
        # the state parts applied to the state as read (the optimizer's groups as they were with the late state)
        ctx = RestoreContext(trainer, pl_module, step, where, comm=self.comm, shared=shared)
        REGISTRY.restore(Phase.READ, ctx, shared, rank_state)
        check_optimizers(trainer, shared, where)  # before anything is applied
        return shared, rank_state

    @staticmethod
    def _targets(trainer: Any, pl_module: Any, live: Templates, manifest: Any, where: str) -> dict[str, Any]:
        """The tensors the shared state is read into (a pruned model first reparametrized as in the snapshot)."""
        saved_model = manifest.state.get("state_dict") if isinstance(manifest.state, dict) else None
        if isinstance(saved_model, dict) and not is_sharded(trainer.strategy):
            pruned = adopt_pruning(pl_module, saved_model)
            if pruned:  # (ModelPruning had pruned them): the model reads into its new tensors
                live.model.clear()
                live.model.update(pl_module.state_dict())
                log.info("lightning-snapshot: %d pruned parameter(s) reparametrized as in the snapshot", len(pruned))
        # the model's own tensors are read into directly (verified chunk by chunk); under a sharded strategy the
        # optimizer state too, and each rank reads only its shards; the rest is allocated
        # (and the tensor parts' live tensors: an averaged model is read into in place, resharded as the weights)
        parts, _ = capture_tensor_parts(trainer, {})
        return restore_targets(trainer, live, manifest.state, where, parts)

    def read_once(self, backend: Backend, where: str) -> ReadOnce | None:
        """The shared reader of a restore from ``backend`` (each byte read once in the job, then shared over the
        tier's group), or None: every rank reads all it needs itself (one process; a snapshot path given as
        ``resume``, which has no group; a tier that declares ``read_once`` False; ``LIGHTNING_SNAPSHOT_READ_ONCE=0``).
        The same on every rank."""
        if not read_once_enabled() or not backend.read_once or backend not in self.tiers or not self.tier_comms:
            return None
        comm = self.tier_comms[self.tiers.index(backend)]
        if comm.world_size < 2 or not isinstance(comm, TensorComm):
            return None
        return ReadOnce(comm, where)

    def job_bytes_read(self) -> None:
        """Collective: the bytes every rank read from the tier for the shared state, summed (``job_bytes_read``)."""
        mine = self.stats.get("bytes_read") if self.stats is not None else None
        gathered = self.comm.gather(mine if isinstance(mine, int) else 0)
        total = self.comm.broadcast(sum(gathered) if gathered is not None else None)
        if self.stats is not None:
            self.stats["job_bytes_read"] = int(total)
