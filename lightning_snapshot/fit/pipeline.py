"""A snapshot's way on the training thread: due, stage, finish, hand over; and the fences that keep it exact.

States of one fit's pipeline (one :class:`SnapshotPipeline`, made by an integration as its training starts: the
callback's ``setup``, ``FabricSnapshots.resume``). What the state is, the pipeline asks of a
:class:`~lightning_snapshot.fit.source.StateSource`; when the integration calls it decides where its points are:

- **idle**: nothing pending. At a step some tier is due (:class:`~lightning_snapshot.schedule.schedules.FitSchedule`),
  the
  snapshot of that step becomes *pending*.
- **pending**: the whole state is taken right before the next batch is fetched (``finish``; between epochs or at the
  end of fit when that comes first; under Fabric at once, in ``step``), after the step's validation, the callbacks
  reacting to it and epoch-end hooks,
  which may change or replace the model's tensors (pruning, weight averaging): the model and optimizer state are
  *staged* (copied into the host arena in the background while the next step runs), then the rest (loops,
  callbacks, schedulers, RNG, data position) is taken, and ``finish`` hands the snapshot to the persist threads.
  Taking everything at one point checks the capture plan once per snapshot, and nothing can change the weights
  between the two parts.
- **in flight** (``inflight``): until the background copy of the weights is complete, every point that may change
  them waits for it first (``fence``: the next optimizer step, validation, a parameter frozen since).

The end of fit and a preemption take a last snapshot of every tier synchronously. What happens is told to the
:class:`~lightning_snapshot.fit.reporting.Reporter`; the pipeline owns no policy.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from typing import Any

from lightning_snapshot.config import SnapshotConfig
from lightning_snapshot.dist.agree import agree_on
from lightning_snapshot.dist.comm import Comm
from lightning_snapshot.errors import ReplicaMismatchError, SnapshotError
from lightning_snapshot.fit.reporting import Reporter
from lightning_snapshot.fit.source import StateSource
from lightning_snapshot.fit.stager import Stager
from lightning_snapshot.persist.threads import Persister, PersistJob
from lightning_snapshot.schedule.schedules import FitSchedule
from lightning_snapshot.staging import stage
from lightning_snapshot.staging.arena import AsyncStaged, HostArena

__all__ = ["SnapshotPipeline"]

log = logging.getLogger(__name__)


class SnapshotPipeline:
    """One fit's snapshots on the training thread (see the module's docstring for its states).

    Args:
        config: the snapshots' configuration.
        comm: the job's collectives (every rank stages, finishes and skips together).
        arena: the host staging memory.
        persister: the persist threads the finished snapshots go to.
        schedule: which tiers are due.
        reporter: told what happens.
        source: the training state (the integration's).
        start_step: the step the training starts from.
    """

    def __init__(
        self,
        config: SnapshotConfig,
        comm: Comm,
        arena: HostArena,
        persister: Persister,
        schedule: FitSchedule,
        reporter: Reporter,
        source: StateSource,
        start_step: int,
    ) -> None:
        self.config = config
        self.tiers = list(config.tiers)
        self.comm = comm
        self.arena = arena
        self.persister = persister
        self.schedule = schedule
        self.reporter = reporter
        self.source = source
        #: the step of the last optimizer step seen (a snapshot needs an optimizer step since this one)
        self.last_step = start_step
        self.start_step = start_step
        #: (step, staged tensors or None: staged when finished, due tier indices) of the snapshot finished right
        #: before the next fetch
        self.pending: tuple[int, AsyncStaged | None, list[int]] | None = None
        #: the weights and optimizer state on their way into the arena (the copy in flight, its fences)
        self.stager = Stager(config, comm, arena, schedule, reporter, source)
        self._ended = False  # the snapshot of the end of fit was taken
        #: (step, this rank's state staged) as it was when the validation after that step started: what a preemption
        #: that abandons that validation snapshots (see :meth:`arm`)
        self._armed: tuple[int, Any] | None = None
        self._abandoned = False
        #: the newest step handed to the persist threads, and the tiers it was handed to (the last snapshot of a fit
        #: is not taken twice for a tier)
        self._handed: tuple[int, set[int]] = (start_step, set(range(len(self.tiers))))

    # ------------------------------------------------------------------------------------------- steps
    def step_ended(self) -> None:
        """After each batch (``on_train_batch_end``; Fabric: each optimizer step): collect results; after an
        optimizer step, snapshot if due, else prepare."""
        step = self.source.step()
        if step != self.last_step:
            self.schedule.step_ended(time.perf_counter())
        self.reporter.collect(self.persister, step, self.schedule)
        if step != self.last_step:
            self.schedule.begin(self.last_step)  # (the step this fit started from)
            self.last_step = step
            if not self._maybe_snapshot(step):
                self.stager.prepare_arena(step)

    def finish_pending(self, consumed_offset: int = 0) -> None:
        """If a snapshot is staged, finish it now (counted as stall)."""
        if self.pending is not None:
            t0 = time.perf_counter()
            self._finish(consumed_offset)
            self.stager.stall += time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------- due
    def _maybe_snapshot(self, step: int) -> bool:
        """Take the snapshot of ``step`` if one is due in some tier; returns whether one was due."""
        now = time.monotonic()
        due = self.schedule.due(step, now, self.start_step)
        if self.schedule.time_based:
            due = self.comm.broadcast(due)  # wall clocks differ across ranks; rank 0 decides
        if not due:
            return False
        self._retune()  # (a step every rank snapshots: every rank takes rank 0's intervals here)
        t0 = time.perf_counter()
        self.reporter.stop_if_failed(self.comm)  # background failures stop every rank together, here
        self.schedule.taken(due, step, now)
        # The whole state is taken right before the next batch (finish_pending): after this step's validation,
        # epoch-end hooks and the callbacks reacting to them, which may change the weights
        self.pending = (step, None, due)
        self.schedule.opened(due)
        self.stager.stall = time.perf_counter() - t0
        return True

    def _retune(self) -> None:
        """New intervals for the ``"auto"`` tiers, from rank 0's measurements, at a step every rank snapshots."""
        proposal = self.schedule.propose()
        if proposal is None:
            return
        if self.comm.world_size > 1:
            proposal = self.comm.broadcast(proposal)  # the same snapshot steps on every rank
        for name, value in self.schedule.adopt(proposal, self.comm.rank, self.reporter.names).items():
            self.reporter.metrics.add(name, value)

    # ------------------------------------------------------------------------------------------- finish
    def _finish(self, consumed_offset: int = 0) -> None:
        """Add the rest of the state (loops, callbacks, schedulers, this rank's RNG and data position) to the
        pending snapshot and hand it to the persist thread."""
        assert self.pending is not None
        step, shared, due = self.pending
        self.pending = None
        if shared is None:  # (else staged synchronously just now: the last snapshot of fit)
            # (the background copy starts once this rank's state is taken: a copy running alongside would slow that
            # Python work down on a machine of few cores)
            shared = self.stager.stage_shared(step, hold=True)
            if shared is None:
                self._unmeasured(due)
                return
            self.reporter.metrics.add("snapshot/bytes", shared.state.nbytes)
            self.stager.inflight = shared
        try:
            self._hand_over(step, shared, due, consumed_offset)
        finally:
            shared.go.set()  # (whatever happened: nothing may wait for a copy that never starts)

    def _hand_over(self, step: int, shared: AsyncStaged, due: list[int], consumed_offset: int) -> None:
        """The rest of :meth:`_finish`: the replica check, this rank's state, and the hand-over."""
        # the capture plan's token vouches for the module's structure (as staged just now; see capture_section)
        token = self.stager.capture_token
        replicas = self.stager.check_replicas(step)
        if replicas is not None and not replicas.ok:
            action = self.config.on_replica_mismatch
            if action == "warn":
                warnings.warn(
                    f"{replicas.describe()}. The snapshot is committed as unhealthy (resume=True skips it);"
                    " on_replica_mismatch='skip' drops such snapshots, 'raise' stops training",
                    stacklevel=2,
                )
            else:
                with contextlib.suppress(Exception):  # the persist thread reports it
                    shared.fence_training()
                self.arena.release(shared.slot)
                self._unmeasured(due)
                if action == "raise":
                    raise ReplicaMismatchError(f"{replicas.describe()} (on_replica_mismatch='raise')")
                warnings.warn(replicas.describe(), stacklevel=2)
                self.reporter.skipped(
                    step,
                    "its replicas disagree (on_replica_mismatch='skip')",
                    False,
                    "See the warning before this one.",
                )
                return
        epoch = self.source.epoch()
        error: SnapshotError | None = None
        armed = self._armed if self._abandoned and self._armed is not None and self._armed[0] == step else None
        try:
            if armed is not None:  # (the state from before the abandoned validation)
                private = armed[1]
            else:
                private = stage(self.source.capture_rank(token, consumed_offset, False), "rank")
        except SnapshotError as e:
            error = e
        shared.go.set()  # (the copy may start: what follows is cheap, or waits for the other ranks)
        # in one collective, every rank agrees on whether every rank took its own state (one may fail alone: a value
        # only it holds), on the tiers with room (one whose queue is full, an object store in an outage, skips it)
        # and on whether the nodes' agents write the durable tiers (a rank may have lost the link to its agent)
        agent = self.persister.agent
        agreed = agree_on(
            self.comm,
            f"taking the ranks' state for the snapshot of step {step}",
            error=error,
            flags=[self.persister.has_room(i) for i in due] + [agent is None or agent.linked],
            elsewhere=f"another rank could not take its state for the snapshot of step {step} (see its log)",
        )
        *room, by_agent = agreed.flags
        if agreed.error is not None:
            shared.fence_training()
            self.arena.release(shared.slot)
            self._unmeasured(due)
            self.reporter.handle(agreed.error, step)
            return
        if any(self.tiers[i].durable for i in due):
            self.reporter.last_durable_due = step  # (the end of fit checks that some durable tier holds it)
        accepted = [i for i, ok in zip(due, room, strict=True) if ok]
        full = [i for i, ok in zip(due, room, strict=True) if not ok]
        self._unmeasured(full)
        for i in full:
            self.reporter.queue_full(i, step, self.persister.pending(i))
        job = PersistJob(step, epoch, shared, private, [self.tiers[i] for i in accepted])
        job.replicas = replicas.record() if replicas is not None else None
        job.by_agent = by_agent
        self.persister.submit(job, accepted)
        self.reporter.handed_over(step, accepted)
        if self._handed[0] != step:
            self._handed = (step, set())
        self._handed[1].update(accepted)

    def _unmeasured(self, indices: list[int]) -> None:
        """Snapshots of these tiers that will not be written: they end their cost measurement unmeasured."""
        for i in indices:
            self.schedule.closed(i, measured=False)

    def _final_snapshot(self, step: int) -> None:
        """Stage the state of the last step for every tier that was not handed it yet (synchronously: training is
        over)."""
        if step <= self.start_step:
            return  # nothing trained in this fit: the step it started from is already held
        handed = self._handed[1] if self._handed[0] == step else set()
        missing = [i for i in range(len(self.tiers)) if i not in handed]
        if not missing:
            return  # (every tier has it: a step finished before the loop ended)
        if self.stager.inflight is not None:
            self.stager.inflight.fence_training()
            self.stager.inflight = None
        staged = self.stager.stage_shared(step, last=True)
        if staged is None:
            return
        staged.settle()  # (training is over: nothing changes it while it is copied)
        self.pending = (step, staged, missing)

    def end_of_fit(self) -> None:
        """Fit ends with a snapshot of its last step in every tier (a later, longer run continues from it), taken
        when the training loop ends, before any ``on_train_end`` hook: those may change the weights
        (``WeightAveraging`` copies the averaged weights into the model there), and a run that never stopped would
        not have run them. Returns once the weights are copied. Once per fit."""
        if self._ended:
            return
        self._ended = True
        # the copy in flight is settled first: its commit waits for that (no optimizer step comes to do it when the
        # loop stopped after a batch that only accumulated gradients), and draining waits for its commit
        self.stager.fence()
        self.persister.drain()  # the last snapshot waits for room in every tier instead of being skipped
        step = self.source.step()
        if self.pending is None or self.pending[0] != step:
            if self.pending is not None:
                self._finish()
            self._final_snapshot(step)
        elif set(self.pending[2]) != set(range(len(self.tiers))):
            self.pending = (step, self.pending[1], list(range(len(self.tiers))))
        staged = self.pending[1] if self.pending is not None else self.stager.inflight
        if self.pending is not None:
            self._finish()  # (which may stage the weights again: then that copy is the one in flight)
        for copy in (staged, self.stager.inflight):
            if copy is not None:
                with contextlib.suppress(Exception):  # the persist thread reports it
                    copy.fence_training()
        self.stager.inflight = None

    def wait_written(self) -> None:
        """After :meth:`end_of_fit`: wait until every snapshot handed over is written (tiers with a ``drain_timeout``,
        object stores, that long at most), and report what was (the metrics are then ready to log)."""
        late = self.persister.drain()
        self.reporter.collect(self.persister, self.source.step(), self.schedule)
        self.reporter.late_tiers(late, self.persister)

    def check_end(self) -> None:
        """After :meth:`wait_written` (collective): a snapshot that failed in the background on any rank stops every
        rank (``on_error="raise"``), and the last snapshot due in a durable tier must be held by one."""
        self.reporter.stop_if_failed(self.comm)
        self.reporter.check_durable(self.comm)

    # ------------------------------------------------------------------------------------------- validation
    def arm(self) -> None:
        """A validation inside the fit is about to start (the training thread, every rank): this rank's state is
        taken now (RNG, loops, callbacks, schedulers, data position: a few kilobytes, no collective), so that a
        preemption which abandons that validation snapshots the step as it was before it, and the requeued run
        validates it again in full. The weights are not copied: a validation leaves them as they were once its
        epoch-end hooks ran (those that swap averaged weights in swap them back)."""
        self._armed = None
        step = self.source.step()
        if step <= self.start_step:
            return  # (nothing trained in this fit: the step it started from is held already)
        try:
            self._armed = (step, stage(self.source.capture_rank(None, 0, True), "rank"))
        except SnapshotError as e:
            log.debug("lightning-snapshot: the state before the validation of step %d was not taken: %s", step, e)

    def disarm(self) -> None:
        """The validation ended (or training went on): the state taken before it is dropped."""
        self._armed = None

    def armed_step(self) -> int | None:
        """The step whose state was taken before the validation running now, or None."""
        return self._armed[0] if self._armed is not None else None

    # ------------------------------------------------------------------------------------------- last snapshots
    def last_snapshot(
        self,
        reason: str,
        since: float,
        since_what: str = "the signal",
        abandoned: bool = False,
    ) -> tuple[int, bool]:
        """Preemption (every rank together, at the point a snapshot is taken): snapshot the current step into every
        tier (a snapshot of it already pending is extended to every tier: one capture) and wait until a durable tier
        holds it, within ``sigterm_grace`` seconds of ``since`` (``time.monotonic()`` when the signal came). Returns
        the step and whether a durable tier holds it. ``abandoned``: a validation was abandoned, and the snapshot
        takes this rank's state from before it (:meth:`arm`)."""
        self._abandoned = abandoned
        grace = self.config.sigterm_grace
        deadline = since + grace
        step = self.source.step()
        self.stager.fence()  # (training stopped between steps: the copy in flight is settled, not torn by it)
        self.persister.drain(timeout=max(0.0, (deadline - time.monotonic()) / 2))
        if self.pending is not None and self.pending[0] == step:
            self.pending = (step, self.pending[1], list(range(len(self.tiers))))
        elif step > self.start_step:
            if self.pending is not None:
                self._finish()
            self._final_snapshot(step)
        if self.pending is not None:
            self._finish()
        self.stager.fence()  # (the weights it staged: the persist threads commit once the copy is settled)
        late = self.persister.drain(timeout=max(0.0, deadline - time.monotonic()))
        self.reporter.collect(self.persister, step, self.schedule)
        committed = self.reporter.committed
        held = [t.url for i, t in enumerate(self.tiers) if committed.get(i) == step]
        durable = [t.url for i, t in enumerate(self.tiers) if t.durable and committed.get(i) == step]
        seconds = time.monotonic() - since
        if step <= self.start_step:  # (no optimizer step in this fit: nothing new to lose)
            if self.comm.rank == 0:
                log.warning(
                    "lightning-snapshot: %s: at step %d, where this fit started; nothing to snapshot", reason, step
                )
            return step, True
        if durable:
            if self.comm.rank == 0:
                log.warning(
                    "lightning-snapshot: %s: step %d is held by %s (%.1f s after %s)",
                    reason,
                    step,
                    ", ".join(held),
                    seconds,
                    since_what,
                )
        else:
            log.error(
                "lightning-snapshot: %s: step %d did not become durable within sigterm_grace=%s s"
                " (held by: %s; still writing: %s)",
                reason,
                step,
                grace,
                held or "none",
                [t.url for t in late] or "none",
            )
        return step, bool(durable)

    def overdue(self, reason: str, since: float) -> tuple[int | None, int]:
        """The watchdog's way (another thread), when a stop was known for three quarters of the grace and the training
        thread did not reach a step boundary to take it (a training step, a validation batch or a hook longer than
        that): the snapshots already handed to the tiers are waited for until the grace ends, and one error line says
        which step is durable and how many steps are lost. Returns (that step or None, the step the job was at)."""
        self.persister.wait_idle(max(0.0, since + self.config.sigterm_grace - time.monotonic()))
        newest = dict(self.persister.newest)
        durable = [s for i, s in newest.items() if self.tiers[i].durable]
        held = [s for i, s in newest.items() if not self.tiers[i].durable]
        best = max(durable) if durable else None
        at = self.last_step
        where = (
            f"step {best} is the newest durable snapshot" if best is not None else "no snapshot of this fit is durable"
        )
        if held and (best is None or max(held) > best):
            where += f" (step {max(held)} is held in node memory by the RAM tier)"
        lost = at - best if best is not None else at - self.start_step
        log.error(
            "lightning-snapshot: %s: the job was at step %d and could not reach the next step boundary within"
            " sigterm_grace=%g s (a training step, validation batch or hook outlasted it): %s; %d step(s) lost",
            reason,
            at,
            self.config.sigterm_grace,
            where,
            lost,
        )
        return best, at

    def close(self) -> None:
        """Drop the snapshot still staged (it has no rank state) and settle the copy in flight (after an exception,
        or at teardown)."""
        if self.pending is not None:
            _, staged, _ = self.pending
            self.pending = None
            if staged is not None:
                self.arena.release(staged.slot)
        if self.stager.inflight is not None:
            with contextlib.suppress(Exception):  # reported by the persist thread
                self.stager.inflight.fence_training()
            self.stager.inflight = None
