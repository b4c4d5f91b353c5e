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
from collections.abc import Sequence
from typing import Any, cast

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_snapshot.backends.base import Backend
from lightning_snapshot.config import SnapshotConfig
from lightning_snapshot.dist import agree
from lightning_snapshot.dist.agree import agree_on
from lightning_snapshot.dist.comm import Comm, LocalComm
from lightning_snapshot.errors import (
    FormatVersionError,
    SnapshotError,
    SnapshotNotFoundError,
    StateMismatchError,
    TierUnavailableError,
)
from lightning_snapshot.persist.commit import committed_steps
from lightning_snapshot.restore.later_phases import Restored, Resumption
from lightning_snapshot.restore.loader import resolve_source
from lightning_snapshot.restore.objects import step_objects
from lightning_snapshot.restore.policy import Candidate, plan_resume
from lightning_snapshot.restore.progress import human_bytes
from lightning_snapshot.restore.reads import SnapshotReader
from lightning_snapshot.restore.records import read_candidate, record_restore
from lightning_snapshot.restore.targets import Templates, restore_shared, templates
from lightning_snapshot.state import fit_state as _fit_state
from lightning_snapshot.state.builtin import REGISTRY
from lightning_snapshot.state.parts import Phase, RestoreContext

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
        #: reads the snapshots (the state of each rank's section read once per fit)
        self.reader = SnapshotReader(self.tiers, comm, self.tier_comms)

    @property
    def stats(self) -> dict[str, int | None] | None:
        """What this rank read for the last snapshot it read (see ``SnapshotCallback.restore_stats``), or None."""
        return self.reader.stats

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
            late = self.reader.read_late(backend, step)
        except (SnapshotError, OSError) as e:
            log.debug("lightning-snapshot: callback states not loaded at setup (%s); on_fit_start reports", e)
            return
        if isinstance(late, dict):
            where = f"snapshot of step {step} in the {backend.tier} tier {backend.url!r}"
            ctx = RestoreContext(trainer, trainer.lightning_module, step, where, comm=self.comm, owner=exclude)
            REGISTRY.restore(Phase.SETUP, ctx, late, None)
            self.preloaded = (backend.url, step)

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

            def list_newest() -> tuple[list[int], str]:
                try:
                    return committed_steps(backend)[:1], ""
                except Exception as e:  # noqa: BLE001 - raised below, on every rank
                    return [], f"{type(e).__name__}: {backend.redact(str(e))}"

            newest, problem = agree.broadcast(self.comm, f"listing {resume!r} to resume from it", list_newest)
            if problem:
                raise TierUnavailableError(
                    f"lightning-snapshot: cannot list {resume!r} to resume from it ({problem}). Fix access to it and"
                    " run again, or name one snapshot directory in resume"
                )
            return [(backend, s) for s in newest]
        collective: dict[int, list[int] | SnapshotError] = {}
        for i, tier in enumerate(self.tiers):
            if tier.node_local:  # a node-local tier: what any node holds
                try:
                    held = tier.collective_steps(
                        self.tier_comms[i] if self.tier_comms else LocalComm(),
                        step_objects(f"a manifest kept by the node agents in the {tier.tier} tier {tier.url!r}"),
                    )
                except SnapshotError as e:  # (on every rank alike: the ranks agree on a node's failed listing)
                    collective[i] = e
                    continue
                if held is not None:
                    collective[i] = held

        def decide() -> tuple[list[tuple[int, int]], str, list[str], str | None]:
            """(Rank 0) Every tier's committed steps, newest first, through the resume policy; the tiers that could
            not be listed; the warnings to give; why no snapshot is left (or None)."""
            found: list[tuple[int, int]] = []
            unlisted: list[str] = []
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
            if unlisted:
                return found, "; ".join(unlisted), [], None
            kept, messages, skipped_all = self._apply_resume_policy(found)
            return kept, "", messages, skipped_all

        # rank 0 decides for every rank (a failure there, reading a candidate's manifest, is every rank's error)
        found, problem, messages, skipped_all = agree.broadcast(
            self.comm, "choosing the snapshot to resume from", decide
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
        ones and those the run keeps crashing after (:func:`~lightning_snapshot.restore.policy.plan_resume`).
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

    def record_restored(self, backend: Backend, step: int) -> None:
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
        agreed = agree_on(self.comm, f"recording the restore of step {step}", error=problem)
        if not agreed.ok and problem is not None:
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
                loaded = self.reader.read(backend, step, trainer, pl_module, live)
            except (FormatVersionError, StateMismatchError) as e:
                fatal = e
            except (SnapshotError, OSError) as e:
                error = e
            # in one collective: a snapshot that does not fit this run (on any rank) stops every rank; one that
            # failed to load on some rank is skipped by every rank
            (loaded_everywhere,) = agree_on(
                self.comm,
                f"restoring the {where}",
                error=fatal,
                flags=[error is None],
                elsewhere=f"restoring the {where} failed on another rank (see its log)",
            ).flags_or_raise()
            if loaded_everywhere:
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
        self.reader.forget()
        self.reader.job_bytes_read()
        exact = rank_state.get("exact", True) if rank_state is not None else True
        ctx = RestoreContext(trainer, pl_module, step, where, comm=self.comm, exact=exact)
        preloaded = self.preloaded == (backend.url, step)

        def parts(phase: Phase) -> None:
            if not (phase is Phase.SETUP and preloaded):  # (the callbacks' states, loaded at setup already)
                REGISTRY.restore(phase, ctx, shared, rank_state)

        restore_shared(
            trainer, pl_module, shared, where, live, parts, replaced=lambda cb: REGISTRY.replaces_hooks(cb, shared)
        )
        progress = trainer.fit_loop.epoch_progress.current
        # a snapshot taken when an epoch had just ended (the end of training) starts the next epoch from its
        # beginning; any other continues the epoch it was taken in (see patches.resume_loops)
        ctx.resumed = resumed = "boundary" if progress.ready == progress.processed else "mid"
        _fit_state.realias_lottery_tickets(trainer, trainer.current_epoch)
        self.record_restored(backend, step)
        parts(Phase.LOADED)  # (ModelCheckpoint's files and record, DDP's bucket layout: every rank together)
        seconds = time.monotonic() - t0
        job = self.stats.get("job_bytes_read") if self.stats is not None else None
        once = (
            f" (read once for {self.comm.world_size} ranks: {human_bytes(job)} from the tier)"
            if self.reader.read_once(backend, where) is not None and isinstance(job, int)
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
