"""The restore of a fit: which snapshots to try (the resume policy decides), read, verify, apply, record.

One :class:`Restorer` per fit, made by the callback's ``setup`` once the tiers' process groups exist. ``setup``
calls :meth:`Restorer.preload_callbacks` (other callbacks' states, before any ``on_fit_start``, as Lightning's own
restore does); ``on_fit_start`` calls :meth:`Restorer.restore`, which returns a :class:`Restored` (or None: nothing
to restore) that the callback hands to the parts that finish the resume (the loops at ``on_train_start``, the RNG
and data position before the first fetch). Collective: every rank calls both at the same point; rank 0 decides
which snapshot and every rank raises the same error.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_snapshot import fit_state as _fit_state
from lightning_snapshot.backends.base import Backend
from lightning_snapshot.capture import (
    Templates,
    adopt_pruning,
    check_model,
    check_optimizers,
    is_sharded,
    restore_shared,
    restore_targets,
    templates,
)
from lightning_snapshot.comm import Comm, LocalComm, TensorComm, raise_together
from lightning_snapshot.commit import committed_steps
from lightning_snapshot.config import SnapshotConfig
from lightning_snapshot.errors import (
    FormatVersionError,
    SnapshotError,
    SnapshotNotFoundError,
    StateMismatchError,
    TierUnavailableError,
)
from lightning_snapshot.loader import ReadStats, read_manifest, read_section, resolve_source
from lightning_snapshot.parts import Phase, RestoreContext
from lightning_snapshot.progress import human_bytes
from lightning_snapshot.read_once import ReadOnce
from lightning_snapshot.read_once import enabled as read_once_enabled
from lightning_snapshot.restore_records import read_candidate, record_restore
from lightning_snapshot.resume_policy import Candidate, plan_resume
from lightning_snapshot.resuming import Restored, Resumption
from lightning_snapshot.state_parts import REGISTRY

__all__ = ["Restored", "Restorer"]

log = logging.getLogger(__name__)


class Restorer:
    """Finds, reads and applies the snapshot a fit resumes from.

    Args:
        config: the callback's configuration (its tiers, ``resume``, ``resume_unhealthy``, ``max_restores``).
        comm: the trainer's collectives.
        tier_comms: one process group per tier (the node-local tiers' restores are collective over it).
        fit_ckpt_path: the ``ckpt_path`` given to ``fit`` (it wins: no snapshot is restored).
    """

    def __init__(self, config: SnapshotConfig, comm: Comm, tier_comms: Sequence[Comm], fit_ckpt_path: Any) -> None:
        self.config = config
        self.tiers = list(config.tiers)
        self.comm = comm
        self.tier_comms = list(tier_comms)
        self.fit_ckpt_path = fit_ckpt_path
        #: (rank 0) per (step, tier index) of the last candidate list: the manifest digest and the restore count
        self._facts: dict[tuple[int, int], tuple[str, int]] = {}
        #: (tier url, step) of the snapshot whose callback states were loaded at setup, or None
        self.preloaded: tuple[str, int] | None = None
        #: (tier url, step, rank) -> a rank section's state, as read at setup (for on_fit_start: read once)
        self._sections: dict[tuple[str, int, int], Any] = {}
        #: what this rank read for the last snapshot it read (see ``SnapshotCallback.restore_stats``), or None
        self.stats: dict[str, int | None] | None = None

    def preload_callbacks(self, trainer: Any, exclude: Any) -> None:
        """Load the other callbacks' states (all but ``exclude``) from the snapshot that will be restored, now, before
        any callback's ``on_fit_start``, as Lightning's own restore does: callbacks act on their loaded state there
        (``BaseFinetuning`` re-adds its parameter groups, ``StochasticWeightAveraging`` drops the scheduler it
        replaced by SWALR). If ``on_fit_start`` restores another snapshot (this one fails to load), that one's
        callback states are loaded there instead."""
        self.preloaded = None
        if self.config.resume is False or self.fit_ckpt_path:
            return
        try:
            candidates = self.candidates()
            if not candidates:
                return
            backend, step = candidates[0]
            late = self._read_late(backend, step)
        except (SnapshotError, OSError) as e:
            log.debug("lightning-snapshot: callback states not loaded at setup (%s); on_fit_start reports", e)
            return
        if isinstance(late, dict):
            where = f"snapshot of step {step} in the {backend.tier} tier {backend.url!r}"
            ctx = RestoreContext(trainer, trainer.lightning_module, step, where, comm=self.comm, owner=exclude)
            REGISTRY.restore(Phase.SETUP, ctx, late, None)
            self.preloaded = (backend.url, step)

    def _read_late(self, backend: Backend, step: int) -> Any:
        """This rank's late state (loops, callbacks, schedulers) of a snapshot; rank 0's after a change of the
        number of processes."""

        def read() -> Any:
            manifest = read_manifest(backend, step)
            rank = self.comm.rank if manifest.world_size == self.comm.world_size else 0
            state = self._rank_state(backend, manifest, rank)
            return state.get("late") if isinstance(state, dict) else None

        if backend.node_local and backend.read_once:
            # each node's own disk: its own rank's section is there (it wrote it), read without first copying every
            # object a node lacks to it (the restore does that once); where it is not, on_fit_start loads the states
            return read()
        return self._through_tier(backend, step, read)

    def _rank_state(self, backend: Backend, manifest: Any, rank: int) -> Any:
        """The state of ``rank``'s section of a snapshot (its RNG, data position, late state), or None when it has
        none: read once per fit (the callback states are loaded from it at ``setup``, the rest at ``on_fit_start``)."""
        key = (backend.url, manifest.step, rank)
        if key not in self._sections:
            section = manifest.rank_section(rank)
            if section is None:
                return None
            self._sections[key] = read_section(backend, manifest, section.tensors, section.state)
        return self._sections[key]

    def _through_tier(self, backend: Backend, step: int, read: Callable[[], Any]) -> Any:
        """Run ``read`` (a read of snapshot ``step`` of ``backend``). For a node-local tier of this callback (RAM, a
        local tier on each node's own disk) the objects are first made readable on every node (RAM: a corrupted
        share found by the read is repaired from the others) and what the restore added is freed after: collective
        over the tier's group. Any other backend (a snapshot path given as ``resume``) is read directly."""
        if not backend.node_local or backend not in self.tiers:
            return read()
        comm = self.tier_comms[self.tiers.index(backend)] if self.tier_comms else LocalComm()
        return backend.restore(comm, step, read)

    # ------------------------------------------------------------------------------------------- candidates
    def candidates(self, report: bool = False) -> list[tuple[Backend, int]]:
        """Snapshots to try, newest first (ties: tier order). Rank 0 decides; every rank gets the same list.

        With ``resume=True``, unhealthy snapshots (unless ``resume_unhealthy``) and snapshots restored
        ``max_restores`` times are left out; ``report``: rank 0 gives the warnings that say so (once per fit).

        Raises:
            SnapshotNotFoundError: every committed snapshot was left out that way.
        """
        resume = self.config.resume
        if isinstance(resume, str):
            backend, step = resolve_source(resume)
            if step is not None:
                return [(backend, step)]
            # rank 0 lists it, for every rank: a listing per rank could find different newest steps (a commit
            # racing it, a node's own disk) and the ranks would restore different snapshots
            newest_of: tuple[list[int], str] | None = None
            if self.comm.rank == 0:
                try:
                    newest_of = (committed_steps(backend)[:1], "")
                except Exception as e:  # noqa: BLE001 - raised below, on every rank
                    newest_of = ([], f"{type(e).__name__}: {backend.redact(str(e))}")
            newest, problem = self.comm.broadcast(newest_of)
            if problem:
                raise TierUnavailableError(
                    f"lightning-snapshot: cannot list {resume!r} to resume from it ({problem}). Fix access to it and"
                    " run again, or name one snapshot directory in resume"
                )
            return [(backend, s) for s in newest]
        found: list[tuple[int, int]] = []
        unlisted: list[str] = []
        messages: list[str] = []
        skipped_all: str | None = None
        collective: dict[int, list[int] | SnapshotError] = {}
        for i, tier in enumerate(self.tiers):
            if tier.node_local:  # a node-local tier: what any node holds
                try:
                    held = tier.collective_steps(self.tier_comms[i] if self.tier_comms else LocalComm())
                except SnapshotError as e:  # (on every rank alike: the ranks agree on a node's failed listing)
                    collective[i] = e
                    continue
                if held is not None:
                    collective[i] = held
        if self.comm.rank == 0:
            for i, tier in enumerate(self.tiers):
                try:
                    listed = collective[i] if i in collective else committed_steps(tier)
                    if isinstance(listed, SnapshotError):
                        raise listed
                    found += [(step, i) for step in listed]
                except Exception as e:  # noqa: BLE001 - a tier that cannot be listed may hold the newest snapshot
                    detail = str(e) if isinstance(e, SnapshotError) else f"{type(e).__name__}: {tier.redact(str(e))}"
                    unlisted.append(f"cannot list the {tier.tier} tier {tier.url!r} to resume from it ({detail})")
            found.sort(key=lambda x: (-x[0], x[1]))
            if not isinstance(resume, bool):
                found = [f for f in found if f[0] == resume][:1]
            if not unlisted:
                found, messages, skipped_all = self._apply_resume_policy(found)
        found, problem, messages, skipped_all = self.comm.broadcast(
            (found, "; ".join(unlisted), messages, skipped_all) if self.comm.rank == 0 else None
        )
        if problem:
            # it may hold the newest snapshot: starting from an older one or fresh could overwrite its history
            raise TierUnavailableError(
                f"lightning-snapshot: {problem}. Fix access to the tier and run again, or pass"
                " resume=False to start fresh without reading it (snapshots are still taken;"
                " an object store never overwrites a committed step, so give it a new prefix"
                " too)"
            )
        if report and self.comm.rank == 0:
            for message in messages:  # (one warning each, from rank 0 only)
                warnings.warn(message, stacklevel=2)
        if skipped_all:
            raise SnapshotNotFoundError(f"lightning-snapshot cannot resume: {skipped_all}")
        return [(self.tiers[i], step) for step, i in found]

    def _apply_resume_policy(self, found: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[str], str | None]:
        """(Rank 0) Read each candidate's health and restore count, and with ``resume=True`` drop the unhealthy
        ones and those the run keeps crashing after (:func:`~lightning_snapshot.resume_policy.plan_resume`).
        Returns the (step, tier index) pairs left, the warnings to give, and why none is left (or None)."""
        self._facts = {}
        candidates: list[Candidate] = []
        for step, i in found:
            candidate, manifest_id = read_candidate(self.tiers[i], step, i)
            candidates.append(candidate)
            if manifest_id is not None:
                self._facts[(step, i)] = (manifest_id, candidate.restores)
        if self.config.resume is not True:
            return found, [], None
        plan = plan_resume(
            candidates, max_restores=self.config.max_restores, resume_unhealthy=self.config.resume_unhealthy
        )
        return [(c.step, c.tier) for c in plan.candidates], list(plan.warnings), plan.problem

    def _record_restore(self, backend: Backend, step: int) -> None:
        """Collective, right after a restore from one of this callback's tiers and before training goes on: rank 0
        records it (the step's restore count + 1) in every tier holding that step; a tier that cannot be
        written gives a warning (the resume goes on)."""
        problem = None
        if self.comm.rank == 0 and backend in self.tiers:
            count = 1 + max((n for (s, _), (_, n) in self._facts.items() if s == step), default=0)
            failed = []
            for (s, i), (manifest_id, _) in self._facts.items():
                if s != step:
                    continue
                try:
                    record_restore(self.tiers[i], step, manifest_id, count)
                except (OSError, SnapshotError) as e:
                    failed.append(f"{self.tiers[i].tier} {self.tiers[i].url}: {e}")
            if failed:
                problem = "; ".join(failed)
            log.debug("lightning-snapshot: step %d restored %d time(s)", step, count)
        if not self.comm.all_true(problem is None) and problem is not None:
            warnings.warn(
                f"lightning-snapshot: could not record the restore of step {step} ({problem}); the"
                " crash-loop breaker (max_restores) does not count this restore there",
                stacklevel=2,
            )

    # ------------------------------------------------------------------------------------------- restore
    def restore(self, trainer: Any, pl_module: Any) -> Restored | None:
        """Restore the newest snapshot that loads and verifies (``resume``), falling back to older ones with a
        warning; None when there is nothing to restore. Collective.

        Raises:
            SnapshotNotFoundError: ``resume`` names a step or snapshot that no tier holds.
            SnapshotError: no snapshot could be restored (each one's reason in the message).
            FormatVersionError, StateMismatchError: a snapshot that does not fit this run (never skipped).
        """
        resume = self.config.resume
        if resume is False:
            return None
        # (the one given to fit, seen at setup: a tuner such as LearningRateFinder sets trainer.ckpt_path to its own
        # temporary checkpoint in its on_fit_start)
        if self.fit_ckpt_path:
            log.info(
                "lightning-snapshot: fit(ckpt_path=%r) was given; not resuming from a snapshot", self.fit_ckpt_path
            )
            return None
        t0 = time.monotonic()
        candidates = self.candidates(report=True)
        if not candidates:
            if resume is not True:
                raise SnapshotNotFoundError(
                    f"resume={resume!r}: no committed snapshot matches it in {[t.url for t in self.tiers]}"
                )
            return None
        reasons = []
        live: Templates | None = None
        for backend, step in candidates:
            where = f"snapshot of step {step} in the {backend.tier} tier {backend.url!r}"
            loaded, fatal, error = None, None, None
            try:
                if live is None:  # (sharded: creates the optimizer state, so only once there is one to restore)
                    live = templates(trainer, pl_module)
                loaded = self._read(backend, step, trainer, pl_module, live)
            except (FormatVersionError, StateMismatchError) as e:
                fatal = e
            except (SnapshotError, OSError) as e:
                error = e
            raise_together(self.comm, fatal, f"restoring the {where} failed on another rank (see its log)")
            if self.comm.all_true(error is None):
                shared, rank_state = cast("tuple[dict[str, Any], Any]", loaded)  # (read without an error everywhere)
                return self._apply(trainer, pl_module, backend, step, shared, rank_state, live, t0)
            reason = str(error) if error is not None else "it failed to load on another rank"
            reasons.append(f"step {step} ({backend.tier} {backend.url}): {reason}")
            if resume is not True:
                break
            if self.comm.rank == 0:
                log.warning("lightning-snapshot: cannot restore the %s (%s); trying the next snapshot", where, reason)
            warnings.warn(
                f"lightning-snapshot: skipping the {where}: {reason}. Falling back to an earlier snapshot.",
                stacklevel=2,
            )
        raise SnapshotError(
            "no snapshot could be restored; tried "
            + "; ".join(reasons)
            + ". The snapshots were left untouched: fix or move them, or pass resume=False to start fresh"
        )

    def _apply(
        self,
        trainer: Any,
        pl_module: Any,
        backend: Backend,
        step: int,
        shared: dict[str, Any],
        rank_state: dict[str, Any] | None,
        live: Templates | None,
        t0: float,
    ) -> Restored:
        """Put a snapshot read on every rank into the trainer and the model (collective): the checkpoint-shaped state
        and the state parts up to LOADED; the later ones go with the returned :class:`Restored`."""
        where = f"snapshot of step {step} in the {backend.tier} tier {backend.url!r}"
        self._sections.clear()
        self._job_bytes_read()
        exact = rank_state.get("exact", True) if rank_state is not None else True
        ctx = RestoreContext(trainer, pl_module, step, where, comm=self.comm, exact=exact)
        preloaded = self.preloaded == (backend.url, step)

        def parts(phase: Phase) -> None:
            if not (phase is Phase.SETUP and preloaded):  # (the callbacks' states, loaded at setup already)
                REGISTRY.restore(phase, ctx, shared, rank_state)

        restore_shared(trainer, pl_module, shared, where, live, parts)
        progress = trainer.fit_loop.epoch_progress.current
        # a snapshot taken when an epoch had just ended (the end of training) starts the next epoch from its
        # beginning; any other continues the epoch it was taken in (see patches.resume_loops)
        ctx.resumed = resumed = "boundary" if progress.ready == progress.processed else "mid"
        _fit_state.realias_lottery_tickets(trainer, trainer.current_epoch)
        self._record_restore(backend, step)
        parts(Phase.LOADED)  # (ModelCheckpoint's files and record, DDP's bucket layout: every rank together)
        seconds = time.monotonic() - t0
        job = self.stats.get("job_bytes_read") if self.stats is not None else None
        once = (
            f" (read once for {self.comm.world_size} ranks: {human_bytes(job)} from the tier)"
            if self._read_once(backend, where) is not None and isinstance(job, int)
            else ""
        )
        rank_zero_info(
            f"lightning-snapshot: restored step {step} from the {backend.tier} tier {backend.url} in {seconds:.2f} s"
            + once
        )
        return Restored(
            url=backend.url,
            step=step,
            seconds=seconds,
            tier_index=self.tiers.index(backend) if backend in self.tiers else None,
            resumed=resumed,
            resumption=Resumption(ctx, shared, rank_state),
        )

    def _read(
        self, backend: Backend, step: int, trainer: Any, pl_module: Any, live: Templates
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        return self._through_tier(backend, step, lambda: self._read_tier(backend, step, trainer, pl_module, live))

    def _read_tier(
        self, backend: Backend, step: int, trainer: Any, pl_module: Any, live: Templates
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        where = f"snapshot of step {step} in the {backend.tier} tier {backend.url!r}"
        shared_reader = self._read_once(backend, where)
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
            rank_state = REGISTRY.resized(self._rank_state(backend, manifest, 0))
        else:
            rank_state = self._rank_state(backend, manifest, self.comm.rank)
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
        return restore_targets(trainer, live, manifest.state, where)

    def _read_once(self, backend: Backend, where: str) -> ReadOnce | None:
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

    def _job_bytes_read(self) -> None:
        """Collective: the bytes every rank read from the tier for the shared state, summed (``job_bytes_read``)."""
        mine = self.stats.get("bytes_read") if self.stats is not None else None
        gathered = self.comm.gather(mine if isinstance(mine, int) else 0)
        total = self.comm.broadcast(sum(gathered) if gathered is not None else None)
        if self.stats is not None:
            self.stats["job_bytes_read"] = int(total)
