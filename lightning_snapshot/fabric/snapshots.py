"""FabricSnapshots: the Lightning Fabric integration, on the same engine as the Trainer's callback.

A loop written with Fabric (LitGPT's style) adopts it in three places::

    snapshots = FabricSnapshots(fabric, ["ram://?every=10", "/nvme/snap/run-42?every=100"])
    with snapshots:
        snapshots.resume(state)          # before the loop: the newest snapshot that verifies, into ``state``
        for batch in train_loader:
            ...                          # forward, backward, optimizer.step(), scheduler.step()
            snapshots.step(state)        # after each optimizer step: a snapshot when a tier is due

``state`` is the user's dict (LitGPT's ``state``): what each kind of entry becomes is
:mod:`~lightning_snapshot.fabric.state`'s. This module decides when: the machinery's lifecycle, the resume (which
snapshot, read and verified on every rank), the steps, the preemption stop, and the asynchronous snapshot itself.

The parts are the engine's (``docs/architecture.md``): :class:`~lightning_snapshot.fit.session.FitSession` (groups,
tiers, agent, arena, persist threads), :class:`~lightning_snapshot.schedule.schedules.FitSchedule` (when each tier is
due), the host arena's asynchronous copy (:meth:`~lightning_snapshot.staging.arena.HostArena.stage_async`), the persist
threads (:class:`~lightning_snapshot.persist.threads.Persister`), the
:class:`~lightning_snapshot.restore.restorer.Restorer`'s choice of snapshot (the resume policy) and its reader, the
data position of :mod:`lightning_snapshot.data`, and :class:`~lightning_snapshot.dist.preempt.Preemption`. What is the
Trainer's (loops, callbacks, Lightning's checkpoint hooks, the state parts) is not used here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
from collections.abc import Callable, MutableMapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from lightning_snapshot import data as _data
from lightning_snapshot.backends.base import Backend
from lightning_snapshot.config import SnapshotConfig
from lightning_snapshot.dist.agree import agree_on
from lightning_snapshot.dist.preempt import Preemption, signal_name
from lightning_snapshot.errors import ConfigError, FormatVersionError, Preempted, SnapshotError, StateMismatchError
from lightning_snapshot.fabric import state as fstate
from lightning_snapshot.fit.reporting import Reporter
from lightning_snapshot.fit.session import FitSession
from lightning_snapshot.persist.threads import PersistJob
from lightning_snapshot.restore.loader import read_manifest, read_section
from lightning_snapshot.restore.restorer import Restorer
from lightning_snapshot.schedule.interval import default_mtbf
from lightning_snapshot.schedule.schedules import FitSchedule
from lightning_snapshot.staging import stage
from lightning_snapshot.staging.arena import AsyncStaged
from lightning_snapshot.state.capture import frozen_predicate, optimized_key

__all__ = ["FabricSnapshots"]

log = logging.getLogger(__name__)


class FabricSnapshots:
    """Snapshots of a Fabric training loop's ``state`` into one or more tiers, and the resume from them.

    Args:
        fabric: the ``lightning.fabric.Fabric`` the loop runs with (launched: every process makes this object).
        tiers: where snapshots go, as for :class:`~lightning_snapshot.callback.SnapshotCallback`: a backend, a tier
            URL (``"/nvme/snap?every=100&keep=3"``, ``"ram://?every=10"``, ``"s3://bucket/run?every=1000"``), or a
            list of them. ``every`` counts calls of :meth:`step` (optimizer steps).
        **options: the options of :class:`~lightning_snapshot.config.SnapshotConfig` (``resume``, ``on_error``,
            ``max_host_bytes``, ``chunk_bytes``, ``sigterm_grace``, ``collective_timeout``, ``shutdown_timeout``,
            ``resume_unhealthy``, ``max_restores``, ``mtbf``, ``preemption_signals``; ``replica_check`` and
            ``on_replica_mismatch`` are accepted and not used here), with the callback's meanings.

    Call order, on every rank: :meth:`resume` once before the loop (also for a fresh run: it starts the snapshot
    machinery, takes the preemption signals and follows the train loaders), :meth:`step` after each optimizer step
    (after ``scheduler.step()``, right before the next batch is fetched), and :meth:`close` (or leave the ``with``
    block) at the end. Training thread only.
    """

    def __init__(self, fabric: Any, tiers: str | Backend | Sequence[str | Backend], **options: Any) -> None:
        self.config = SnapshotConfig.create(tiers, **options)
        self.fabric = fabric
        self._reporter = Reporter(self.config.tiers, self.config.on_error)
        #: the number of optimizer steps taken (:meth:`step` calls, counted on from a restored snapshot's)
        self.global_step = 0
        #: (tier url, step, seconds) of the restore done by :meth:`resume`, or None
        self.restored_from: tuple[str, int, float] | None = None
        self._session: FitSession | None = None
        self._schedule: FitSchedule | None = None
        self._restorer: Restorer | None = None
        self._preemption: Preemption | None = None
        self._state: MutableMapping[str, Any] | None = None
        self._start_step = 0
        self._inflight: AsyncStaged | None = None
        self._stall = 0.0
        self._hooks: list[Any] = []
        self._hooked: set[int] = set()
        #: step -> the tier indices it was handed to (the last snapshots are not taken twice)
        self._taken: dict[int, set[int]] = {}

    # ------------------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> FabricSnapshots:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        if error is None:
            self.close()
        elif isinstance(error, Preempted):  # (the stop step is durable: the rest is abandoned at once, before SIGKILL)
            self._shutdown(drop=True, timeout=1.0)
        else:
            self.close(abort=True)

    @property
    def _comm(self) -> Any:
        assert self._session is not None
        return self._session.comm

    def _open(self, state: MutableMapping[str, Any]) -> None:
        """Start the machinery (collective): the session, the schedule, the preemption signals, the loaders' tracking
        and the optimizers' fence."""
        config = self.config
        strategy = self.fabric.strategy
        job = SimpleNamespace(strategy=strategy, num_nodes=int(getattr(strategy, "num_nodes", 1) or 1))
        session = self._session = FitSession.open(config, job)
        self._reporter.start(self.global_step)
        mtbf = None
        if any(t.auto_every for t in config.tiers):
            mtbf = config.mtbf if config.mtbf is not None else default_mtbf(job.num_nodes)
        self._schedule = FitSchedule(config.tiers, config.schedules, mtbf, time.monotonic())
        self._restorer = Restorer(config, session.comm, session.tier_comms, None)
        if config.preemption_signals:
            self._preemption = Preemption(list(config.preemption_signals), session.step_comm)
            self._preemption.install()
        self._follow(state)

    def _follow(self, state: MutableMapping[str, Any]) -> None:
        """Follow the train loaders (their position is recorded as they are iterated) and fence the copy in flight
        before each optimizer's step (the weights and optimizer state are copied while the next forward and backward
        run)."""
        self._state = state
        kinds = fstate.split(state)
        for loader in kinds["loaders"].values():
            inner = fstate.inner_loader(loader)
            # (a stateful loader's own sampler, when it keeps no state, gets its draws recorded: DrawRecorder)
            _data.install(inner)
            reason = _data.unsupported_reason(inner)
            if reason is not None:
                warnings.warn(
                    f"lightning-snapshot cannot restore the exact position of a loader: {reason}.", stacklevel=2
                )
        for opt in kinds["optimizers"].values():
            raw = fstate.raw_optimizer(opt)
            if id(raw) not in self._hooked:
                self._hooked.add(id(raw))
                self._hooks.append(raw.register_step_pre_hook(self._before_optimizer_step))

    def close(self, abort: bool = False, timeout: float | None = None) -> None:
        """End (collective): without ``abort``, the last step is snapshotted into every tier, and this returns once
        every snapshot is durable (or failed: ``on_error``); with ``abort`` (the loop raised: the ``with`` block does
        this), no snapshot is taken, and the ones handed over already are written for at most ``timeout`` seconds
        (default ``shutdown_timeout``). Threads, process groups, the optimizers' hooks and the signals are given back
        either way. Idempotent."""
        if self._session is None:
            return
        try:
            if not abort:
                self._end()
        finally:
            self._shutdown(drop=False, timeout=timeout)

    def _shutdown(self, drop: bool, timeout: float | None) -> None:
        """Give everything back; ``drop``: snapshots still queued are dropped (after a preemption, whose snapshot
        is durable already)."""
        if self._preemption is not None:
            self._preemption.restore()
            self._preemption = None
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._hooked = [], set()
        if self._inflight is not None:
            with contextlib.suppress(Exception):  # (reported by the persist thread)
                self._inflight.fence_training()
            self._inflight = None
        session, self._session = self._session, None
        if session is not None:
            session.close(drop, timeout)

    def _end(self) -> None:
        session, schedule = self._session, self._schedule
        assert session is not None and session.persister is not None
        if self._preemption is not None:
            self._preemption.settle()
        self._fence()
        session.persister.drain()  # (the last snapshot waits for room in every tier instead of being skipped)
        step = self.global_step
        missing = [i for i in range(len(self.config.tiers)) if i not in self._taken.get(step, set())]
        if step > self._start_step and missing and self._state is not None:
            self._take(self._state, step, missing, last=True)
        self._fence()
        late = session.persister.drain()
        self._reporter.collect(session.persister, step, schedule)
        self._reporter.late_tiers(late, session.persister)
        self._flush()
        self._reporter.stop_if_failed(session.comm)
        self._reporter.check_durable(session.comm)

    # ------------------------------------------------------------------------------------------- resume
    def resume(self, state: MutableMapping[str, Any]) -> int | None:
        """Start (collective, every rank, once, before the loop) and restore the newest snapshot that loads and
        verifies in any tier (``resume``), falling back to older ones with a warning: every entry of ``state`` is put
        back in place. Returns the step restored (also :attr:`global_step`), or None (nothing to restore)."""
        if self._session is not None:
            raise ConfigError("FabricSnapshots.resume() is called once, before the training loop")
        self._open(state)
        assert self._restorer is not None
        resume = self.config.resume
        if resume is False:
            return None
        t0 = time.monotonic()
        candidates = self._restorer.candidates(report=True)
        if not candidates:
            if resume is not True:
                raise SnapshotError(
                    f"resume={resume!r}: no committed snapshot matches it in {[t.url for t in self.config.tiers]}"
                )
            return None
        reasons = []
        for backend, step in candidates:
            where = f"snapshot of step {step} in the {backend.tier} tier {backend.url!r}"
            loaded: tuple[dict[str, Any], dict[str, Any], dict[str, Any], bool] | None = None
            fatal: SnapshotError | None = None
            error: BaseException | None = None
            try:
                loaded = self._restorer.reader.through_tier(backend, step, functools.partial(self._read, backend, step))
            except (FormatVersionError, StateMismatchError) as e:
                fatal = e
            except (SnapshotError, OSError) as e:
                error = e
            (everywhere,) = agree_on(
                self._comm,
                f"restoring the {where}",
                error=fatal,
                flags=[error is None],
                elsewhere=f"restoring the {where} failed on another rank (see its log)",
            ).flags_or_raise()
            if everywhere and loaded is not None:
                modules, shared, rank_state, exact = loaded
                fstate.apply(state, modules, shared, rank_state, exact, where)
                self._restorer.record_restored(backend, step)
                seconds = time.monotonic() - t0
                self.global_step = self._start_step = step
                self._reporter.start(step)
                self.restored_from = (backend.url, step, seconds)
                self._reporter.metrics.add("snapshot/restore_s", seconds)
                if self._comm.rank == 0:
                    log.info("lightning-snapshot: restored step %d from %s in %.2f s", step, backend.url, seconds)
                return step
            reasons.append(f"step {step} ({backend.tier} {backend.url}): {error or 'failed on another rank'}")
            if resume is not True:
                break
            warnings.warn(
                f"lightning-snapshot: skipping the {where}: {reasons[-1]}. Trying an earlier one.", stacklevel=2
            )
        raise SnapshotError(
            "no snapshot could be restored; tried "
            + "; ".join(reasons)
            + ". The snapshots were left untouched: fix or move them, or pass resume=False to start fresh"
        )

    def _read(self, backend: Backend, step: int) -> tuple[dict[str, Any], dict[str, Any], Any, bool]:
        """Read the shared state (the modules' tensors straight into the live ones, each rank its own shards) and
        this rank's section (rank 0's after a change of the number of processes: then not ``exact``)."""
        assert self._state is not None and self._restorer is not None
        where = f"snapshot of step {step} in the {backend.tier} tier {backend.url!r}"
        manifest = read_manifest(backend, step)
        kinds = fstate.split(self._state)
        targets, prefixes = fstate.read_targets(kinds, manifest.state, where)
        shared = read_section(backend, manifest, manifest.tensors, manifest.state, targets=targets)
        modules = fstate.split_modules(kinds, shared, prefixes, where)
        exact = manifest.world_size == self._comm.world_size
        if not exact:
            warnings.warn(
                f"lightning-snapshot: the {where} was taken with {manifest.world_size} process(es), this run has"
                f" {self._comm.world_size}: weights, optimizers and values are restored, the data continues from the"
                " saved global sample, and the per-rank RNG is not restored (not bitwise equal to an uninterrupted"
                " run)",
                stacklevel=2,
            )
        rank_state = self._restorer.reader.rank_state(backend, manifest, self._comm.rank if exact else 0)
        if not isinstance(rank_state, dict):
            raise SnapshotError(f"the {where} has no state of rank {self._comm.rank if exact else 0}")
        return modules, shared, rank_state, exact

    # ------------------------------------------------------------------------------------------- steps
    def step(self, state: MutableMapping[str, Any] | None = None) -> None:
        """After each optimizer step (and ``scheduler.step()``), right before the next batch is fetched: count the step,
        stop every rank together when one was preempted, and snapshot when a tier is due (the training thread pays
        for starting the copy; the weights are copied while the next step runs). Collective: every rank calls it."""
        if self._session is None:
            raise ConfigError(
                "call FabricSnapshots.resume(state) once before the training loop (also for a fresh run): it starts"
                " the snapshots and follows the train loaders from their first batch"
            )
        if state is not None and state is not self._state:
            self._follow(state)
        assert self._state is not None and self._schedule is not None
        session, schedule = self._session, self._schedule
        assert session.persister is not None
        self.global_step += 1
        step = self.global_step
        schedule.step_ended(time.perf_counter())
        self._reporter.collect(session.persister, step, schedule)
        schedule.begin(step - 1)
        if self._preemption is not None:
            signum = self._preemption.poll(step)
            if signum:
                self._preempted(signum, step)
        now = time.monotonic()
        due = schedule.due(step, now, self._start_step)
        if schedule.time_based:
            due = session.comm.broadcast(due)  # (wall clocks differ across ranks; rank 0 decides)
        if due:
            t0 = time.perf_counter()
            self._retune()
            self._reporter.stop_if_failed(session.comm)
            schedule.taken(due, step, now)
            schedule.opened(due)
            self._stall = time.perf_counter() - t0
            self._take(self._state, step, due)
        self._flush()

    def _retune(self) -> None:
        """New intervals for the ``every="auto"`` tiers from rank 0's measurements, at a step every rank snapshots (as
        the callback's pipeline does)."""
        assert self._schedule is not None
        proposal = self._schedule.propose()
        if proposal is None:
            return
        if self._comm.world_size > 1:
            proposal = self._comm.broadcast(proposal)  # (the same snapshot steps on every rank)
        for name, value in self._schedule.adopt(proposal, self._comm.rank, self._reporter.names).items():
            self._reporter.metrics.add(name, value)

    def _preempted(self, signum: int, step: int) -> None:
        """Every rank agreed to stop at ``step``: snapshot it into every tier, wait until a durable tier holds it
        (within ``sigterm_grace`` of the signal), and raise :class:`Preempted`."""
        session = self._session
        assert session is not None and session.persister is not None and self._preemption is not None
        mine, since = self._preemption.received()
        since = since if mine else time.monotonic()
        deadline = since + self.config.sigterm_grace
        self._fence()
        session.persister.drain(timeout=max(0.0, (deadline - time.monotonic()) / 2))
        if step > self._start_step and self._state is not None:
            self._take(self._state, step, list(range(len(self.config.tiers))), last=True)
            self._fence()
        late = session.persister.drain(timeout=max(0.0, deadline - time.monotonic()))
        self._reporter.collect(session.persister, step, self._schedule)
        committed = self._reporter.committed
        durable = step <= self._start_step or any(
            t.durable and committed.get(i) == step for i, t in enumerate(self.config.tiers)
        )
        name = signal_name(signum)
        if durable:
            log.warning("lightning-snapshot: %s: step %d is durable; stopping every rank", name, step)
        else:
            log.error(
                "lightning-snapshot: %s: step %d did not become durable within sigterm_grace=%s s (still writing: %s)",
                name,
                step,
                self.config.sigterm_grace,
                [t.url for t in late] or "none",
            )
        raise Preempted(signum, step, durable)

    # ------------------------------------------------------------------------------------------- snapshots
    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """An optimizer's step pre-hook: the weights and optimizer state are about to change, so the copy in flight
        must be complete (the stall a snapshot costs: ``snapshot/stall_ms``)."""
        if self._fence():
            self._reporter.metrics.add("snapshot/stall_ms", self._stall * 1000)
            self._stall = 0.0

    def _fence(self) -> bool:
        staged = self._inflight
        if staged is None:
            return False
        t0 = time.perf_counter()
        with contextlib.suppress(Exception):  # (the persist thread reports it)
            staged.fence_training()
        if staged.torn and self._session is not None and self._session.arena is not None:
            self._session.arena.copy_at_once([t for _, t in staged.torn])
        self._inflight = None
        self._stall += time.perf_counter() - t0
        return True

    def _take(self, state: MutableMapping[str, Any], step: int, due: list[int], last: bool = False) -> None:
        """Stage the snapshot of ``step`` for the tiers ``due`` and hand it to their persist threads (collective)."""
        session = self._session
        assert session is not None and session.arena is not None and session.persister is not None
        arena, persister, comm = session.arena, session.persister, session.comm
        t0 = time.perf_counter()
        self._fence()
        kinds = fstate.split(state)
        optimizers = [fstate.raw_optimizer(o) for o in kinds["optimizers"].values()]
        shared = fstate.shared_tree(kinds, step)
        frozen = _lazy_frozen(optimizers)
        staged: AsyncStaged | None = None
        error: SnapshotError | None = None
        try:
            staged = arena.stage_async(
                shared,
                frozen,
                step,
                rank=comm.rank,
                world_size=comm.world_size,
                frozen_key=optimized_key(optimizers),
                hold=True,
            )
        except SnapshotError as e:
            error = e
        agreed = agree_on(
            comm,
            f"staging the snapshot of step {step}",
            error=error,
            flags=[staged is not None],
            elsewhere=f"another rank could not stage the snapshot of step {step} (see its log)",
        )
        (all_staged,) = agreed.flags
        if not (agreed.ok and all_staged) or staged is None:
            if staged is not None:
                staged.go.set()
                arena.release(staged.slot)
            self._unmeasured(due)
            if agreed.error is not None:
                self._reporter.handle(agreed.error, step)
                return
            reason = arena.last_skip_reason if staged is None else "another rank could not stage it"
            self._reporter.skipped(step, reason, last)
            return
        private = None
        error = None
        try:
            private = stage(fstate.rank_tree(kinds, step), "rank")
        except SnapshotError as e:
            error = e
        staged.go.set()  # (the copy may start: what follows is cheap, or waits for the other ranks)
        agent = persister.agent
        agreed = agree_on(
            comm,
            f"taking the ranks' state for the snapshot of step {step}",
            error=error,
            flags=[persister.has_room(i) for i in due] + [agent is None or agent.linked],
            elsewhere=f"another rank could not take its state for the snapshot of step {step} (see its log)",
        )
        *room, by_agent = agreed.flags
        if agreed.error is not None or private is None:
            with contextlib.suppress(Exception):
                staged.fence_training()
            arena.release(staged.slot)
            self._unmeasured(due)
            self._reporter.handle(agreed.error or SnapshotError("no rank state"), step)
            return
        if any(self.config.tiers[i].durable for i in due):
            self._reporter.last_durable_due = step
        accepted = [i for i, ok in zip(due, room, strict=True) if ok]
        full = [i for i, ok in zip(due, room, strict=True) if not ok]
        self._unmeasured(full)
        for i in full:
            self._reporter.queue_full(i, step, persister.pending(i))
        epoch = state.get("epoch", 0)
        job = PersistJob(
            step, epoch if isinstance(epoch, int) else 0, staged, private, [self.config.tiers[i] for i in accepted]
        )
        job.by_agent = by_agent
        persister.submit(job, accepted)
        self._reporter.handed_over(step, accepted)
        self._taken = {s: v for s, v in self._taken.items() if s >= step}
        self._taken.setdefault(step, set()).update(accepted)
        self._reporter.metrics.add("snapshot/bytes", staged.state.nbytes)
        self._inflight = staged
        self._stall += time.perf_counter() - t0

    def _unmeasured(self, indices: list[int]) -> None:
        if self._schedule is not None:
            for i in indices:
                self._schedule.closed(i, measured=False)

    def _flush(self) -> None:
        """The metrics so far to Fabric's loggers (``fabric.log_dict``, rank 0)."""
        metrics = self._reporter.metrics
        if not metrics.pending:
            return
        pending, metrics.pending = metrics.pending, {}
        if getattr(self.fabric, "global_rank", 0) == 0 and getattr(self.fabric, "loggers", None):
            self.fabric.log_dict(pending, step=self.global_step)


def _lazy_frozen(optimizers: list[torch.optim.Optimizer]) -> Callable[[torch.Tensor], bool]:
    """The frozen-tensor predicate (:func:`~lightning_snapshot.state.capture.frozen_predicate`), made only if the
    arena asks (it does not while its plan holds)."""
    made: list[Callable[[torch.Tensor], bool]] = []

    def frozen(t: torch.Tensor) -> bool:
        if not made:
            made.append(frozen_predicate(optimizers))
        return made[0](t)

    return frozen
