"""The weights and optimizer state of a snapshot on their way into the host arena, on the training thread: planned
ahead, staged (copied in the background while the next step runs), and fenced (waited for) at every point that may
change them.

One :class:`Stager` per fit, held by the :class:`~lightning_snapshot.fit.pipeline.SnapshotPipeline` (which decides when
a snapshot is taken and hands it over).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from lightning_snapshot.config import SnapshotConfig
from lightning_snapshot.dist.agree import agree_on
from lightning_snapshot.dist.comm import Comm
from lightning_snapshot.errors import SnapshotError
from lightning_snapshot.fit.replicas import ReplicaChecker, Verdict, named_tensors
from lightning_snapshot.fit.reporting import Reporter
from lightning_snapshot.fit.source import StateSource
from lightning_snapshot.schedule.schedules import FitSchedule
from lightning_snapshot.staging.arena import AsyncStaged, HostArena, reserve_lead
from lightning_snapshot.staging.live import Encoded
from lightning_snapshot.state.capture import frozen_predicate, optimized_key

__all__ = ["Stager"]

log = logging.getLogger(__name__)


class Stager:
    """Stage the model and optimizer state into the arena, fence the copy in flight, and compare the DDP replicas of
    what was staged.

    Args:
        config: the snapshots' configuration.
        comm: the job's collectives (every rank stages together).
        arena: the host staging memory.
        schedule: which tiers are due (to reserve a second buffer in time).
        reporter: told what happens.
        source: the training state (the integration's).
    """

    def __init__(
        self,
        config: SnapshotConfig,
        comm: Comm,
        arena: HostArena,
        schedule: FitSchedule,
        reporter: Reporter,
        source: StateSource,
    ) -> None:
        self.source = source
        self.tiers = list(config.tiers)
        self.comm = comm
        self.arena = arena
        self.schedule = schedule
        self.reporter = reporter
        #: the staged copy still in flight, until it is fenced
        self.inflight: AsyncStaged | None = None
        self._copied = False  # the copy in flight was waited for before this step's optimizer step (validation)
        self._planned = False
        #: the stall of the snapshot being taken (seconds; reported once its copy was waited for)
        self.stall = 0.0
        #: the capture plan's token of the state last staged
        self.capture_token: object | None = None
        self.replicas = ReplicaChecker(config.replica_check) if config.replica_check else None
        #: the tensor parts' state as last staged: (tree, stable tensors)
        self._parts: tuple[dict[str, Any], list[Any]] = ({}, [])

    def batch_start(self) -> None:
        """``on_train_batch_start``: the point a snapshot is finished at when the loop fetched without its hook."""
        self.fence_if_retrained()
        if self.inflight is not None and self.inflight.copied.is_set():
            self.inflight.settle()  # (copied before training_step: committed without waiting for the step)

    def before_optimizer_step(self) -> float | None:
        """Parameters and optimizer state change in the step that follows: the copy must be complete. Returns the
        stall of the snapshot (ms) once its copy was waited for, else None."""
        if self.fence() or self._copied:
            stall, self.stall, self._copied = self.stall, 0.0, False
            return stall * 1000
        return None

    def fence_if_retrained(self) -> None:
        """A snapshot in flight copies the parameters the optimizers trained when it was staged while training goes
        on. If a hook has frozen one since (``BackboneFinetuning``-style callbacks at an epoch's start, after that
        epoch's last snapshot was finished), code in the coming step may change it in place, even through ``.data``
        which no version counter sees: the copy is waited for now, before that step (counted as stall)."""
        staged = self.inflight
        if staged is None or staged.fenced.is_set():
            return
        optimizers = self.source.optimizers()
        if optimizers and optimized_key(optimizers) != staged.frozen_key:
            self.fence()

    def fence(self) -> bool:
        """Wait until the weights and optimizer state of the snapshot in flight are copied (counted as stall);
        False when none is in flight."""
        if self.inflight is None:
            return False
        t0 = time.perf_counter()
        staged = self.inflight
        with contextlib.suppress(Exception):  # the persist thread reports it
            staged.fence_training()
        if staged.torn:  # (not committed: the persist thread warns)
            self.arena.copy_at_once([t for _, t in staged.torn])
        self.stall += time.perf_counter() - t0
        self.inflight = None
        self._copied = True
        return True

    def capture(self) -> Any:
        """The weights' state to stage: the model and optimizer state, and the tensor parts' (kept for
        :meth:`frozen` and :meth:`check_replicas`)."""
        state, self._parts = self.source.capture_shared(self.arena.live)
        return state

    def frozen(self) -> tuple[Callable[[Any], bool], Any]:
        """The frozen-tensor predicate, computed only if the arena asks (it does not while its plan holds), and
        what it depends on (which parameters the optimizers train: a plan made under other ones is not reused).
        The tensor parts' stable tensors (as last captured) are frozen too."""
        made: list[Callable[[Any], bool]] = []
        stable = self._parts[1]
        optimizers = self.source.optimizers()

        def frozen(t: Any) -> bool:
            if not made:
                made.append(frozen_predicate(optimizers, stable))
            return made[0](t)

        return frozen, optimized_key(optimizers)

    def prepare_arena(self, step: int) -> None:
        """Off the snapshot steps, get the arena ready for the next snapshot, so that it does not wait.

        After the first optimizer step (the optimizer state exists, so the state has its size): plan the snapshot
        and allocate its slot in a background thread. Later, when every slot is still being persisted and a snapshot
        is due within the steps that allocating a slot takes (:func:`reserve_lead`): allocate another slot in the
        background (double buffering, only when needed), so that the snapshot finds it ready.
        """
        arena = self.arena
        if not self._planned:
            self._planned = True
            try:
                state = self.capture()
                frozen, key = self.frozen()
                arena.plan_ahead(
                    state,
                    frozen,
                    rank=self.comm.rank,
                    world_size=self.comm.world_size,
                    frozen_key=key,
                )
            except Exception as e:  # noqa: BLE001 - the snapshot itself reports what cannot be captured
                log.debug("lightning-snapshot: planning ahead failed (%s); the first snapshot plans itself", e)
            return
        size = arena.planned_bytes
        if size is None or not arena.busy():
            return
        lead = reserve_lead(arena.alloc_seconds, self.schedule.recent_step_seconds)
        if any(1 <= (self.schedule.steps_to_due(i, step) or 0) <= lead for i in range(len(self.tiers))):
            arena.reserve(size)

    def stage_shared(self, step: int, last: bool = False, hold: bool = False) -> AsyncStaged | None:
        """Stage the model and optimizer state of ``step`` (collective: every rank stages its own share, and they
        agree); None when some rank could not (an error is handled, an arena without room is reported). Parameters
        and optimizer state are copied in the background until the next optimizer step (:meth:`fence`); buffers,
        which the next forward changes, at once. ``hold``: the background copy waits for the handle's ``go``."""
        staged: AsyncStaged | None = None
        error: SnapshotError | None = None
        self._planned = True  # (the first snapshot plans itself if no earlier step did)
        try:  # every rank stages (and later writes) its own share of the replicated state
            shared = self.capture()
            frozen, key = self.frozen()
            self.capture_token = shared.token if isinstance(shared, Encoded) else None
            staged = self.arena.stage_async(
                shared, frozen, step, rank=self.comm.rank, world_size=self.comm.world_size, frozen_key=key, hold=hold
            )
        except SnapshotError as e:
            error = e
        # in one collective: whether some rank failed (then every rank handles it: all raise, or all warn and train
        # on in step) and whether every rank staged (one without room makes every rank skip the snapshot)
        agreed = agree_on(
            self.comm,
            f"staging the snapshot of step {step}",
            error=error,
            flags=[staged is not None],
            elsewhere=f"another rank could not stage the snapshot of step {step} (see its log)",
        )
        (all_staged,) = agreed.flags
        if agreed.ok and all_staged:
            return staged
        if staged is not None:
            staged.go.set()
            self.arena.release(staged.slot)
        if agreed.error is not None:
            self.reporter.handle(agreed.error, step)
            return None
        reason = self.arena.last_skip_reason if staged is None else "another rank could not stage it"
        self.reporter.skipped(step, reason, last)
        return None

    def check_replicas(self, step: int) -> Verdict | None:
        """Under DDP, compare the replicas of the state this snapshot holds (collective; see
        :mod:`~lightning_snapshot.fit.replicas`). None: not checked."""
        checker = self.replicas
        replicated = self.source.replicated() if checker is not None and self.comm.world_size > 1 else None
        if checker is None or replicated is None:
            return None
        module, ignored = replicated
        optimizers = self.source.optimizers()
        tree, stable = self._parts
        names, tensors = checker.select(
            module,
            optimizers,
            ignored,
            optimized_key(optimizers),
            self.capture_token,
            extra=lambda: named_tensors(tree, stable),
        )
        result = checker.check(step, names, tensors, self.comm.all_gather_ints)
        self.reporter.metrics.add("snapshot/replicas_disagree", len(result.disagree))
        return result
