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

import functools
import logging
import time
import warnings
from collections.abc import MutableMapping, Sequence
from types import SimpleNamespace
from typing import Any

from lightning_snapshot import data as _data
from lightning_snapshot.backends.base import Backend
from lightning_snapshot.config import SnapshotConfig
from lightning_snapshot.dist.agree import agree_on
from lightning_snapshot.dist.preempt import (
    Preemption,
    exit_promptly,
    overdue,
    slurm_requeue_signal,
    stop_if_preempted,
)
from lightning_snapshot.errors import ConfigError, FormatVersionError, Preempted, SnapshotError, StateMismatchError
from lightning_snapshot.fabric import state as fstate
from lightning_snapshot.fit.pipeline import SnapshotPipeline
from lightning_snapshot.fit.reporting import Reporter
from lightning_snapshot.fit.session import FitSession
from lightning_snapshot.restore.loader import read_manifest, read_section
from lightning_snapshot.restore.restorer import Restorer
from lightning_snapshot.schedule.interval import default_mtbf
from lightning_snapshot.schedule.schedules import FitSchedule

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
            ``resume_unhealthy``, ``max_restores``, ``mtbf``, ``preemption_signals``, ``replica_check``,
            ``on_replica_mismatch``), with the callback's meanings.

    Call order, on every rank: :meth:`resume` once before the loop (also for a fresh run: it starts the snapshot
    machinery, takes the preemption signals and follows the train loaders), :meth:`step` after each optimizer step
    (after ``scheduler.step()``, right before the next batch is fetched), and :meth:`close` (or leave the ``with``
    block) at the end. Training thread only.
    """

    def __init__(self, fabric: Any, tiers: str | Backend | Sequence[str | Backend], **options: Any) -> None:
        self.config = SnapshotConfig.create(tiers, **options)
        self.fabric = fabric
        self._reporter = Reporter(self.config.tiers, self.config.on_error)
        #: (tier url, step, seconds) of the restore done by :meth:`resume`, or None
        self.restored_from: tuple[str, int, float] | None = None
        self._session: FitSession | None = None
        self._source: fstate.FabricSource | None = None
        self._pipeline: SnapshotPipeline | None = None
        self._restorer: Restorer | None = None
        self._preemption: Preemption | None = None
        self._requeue_signal: int | None = None
        self._hooks: list[Any] = []
        self._hooked: set[int] = set()

    @property
    def global_step(self) -> int:
        """The number of optimizer steps taken (:meth:`step` calls, counted on from a restored snapshot's)."""
        return self._source.global_step if self._source is not None else 0

    # ------------------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> FabricSnapshots:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        if error is None:
            self.close()
        elif isinstance(error, Preempted):  # (the stop step is durable: the rest is abandoned at once, before SIGKILL)
            self._shutdown(drop=True, timeout=1.0)
            exit_promptly(int(error.code or 0))
        else:
            self.close(abort=True)

    @property
    def _comm(self) -> Any:
        assert self._session is not None
        return self._session.comm

    def _open(self, state: MutableMapping[str, Any]) -> None:
        """Start the machinery (collective): the session, the schedule, the pipeline, the preemption signals, the
        loaders' tracking and the optimizers' fence."""
        config = self.config
        strategy = self.fabric.strategy
        job = SimpleNamespace(strategy=strategy, num_nodes=int(getattr(strategy, "num_nodes", 1) or 1))
        session = self._session = FitSession.open(config, job)
        self._reporter.start(0)
        mtbf = None
        if any(t.auto_every for t in config.tiers):
            mtbf = config.mtbf if config.mtbf is not None else default_mtbf(job.num_nodes)
        schedule = FitSchedule(config.tiers, config.schedules, mtbf, time.monotonic())
        assert session.arena is not None and session.persister is not None
        self._source = fstate.FabricSource(state, strategy)
        self._pipeline = SnapshotPipeline(
            config, session.comm, session.arena, session.persister, schedule, self._reporter, self._source, 0
        )
        self._restorer = Restorer(config, session.comm, session.tier_comms, None)
        self._own_signals(session)
        self._follow(state)

    def _own_signals(self, session: FitSession) -> None:
        """Own the preemption signals (and SLURM's requeue signal, under ``SLURMEnvironment(auto_requeue=True)``)
        until :meth:`close`; a watchdog ends the process within the grace when a step outlasts it."""
        signals = list(self.config.preemption_signals)
        # (one device has no cluster environment in its strategy: Fabric's connector chose it; private, as the callback
        # reads the Trainer's)
        connector = getattr(self.fabric, "_connector", None)
        environment = getattr(self.fabric.strategy, "cluster_environment", None) or getattr(
            connector, "cluster_environment", None
        )
        self._requeue_signal = slurm_requeue_signal(environment)
        if signals and self._requeue_signal is not None and self._requeue_signal not in signals:
            signals.append(self._requeue_signal)
        if not signals:
            return
        self._preemption = Preemption(
            signals,
            session.step_comm,
            store=session.store() if session.comm.world_size > 1 else None,
            key=f"lightning_snapshot/{session.run_id}/preempted",
            grace=self.config.sigterm_grace,
            on_overdue=lambda signum, since: overdue(self._pipeline, self._requeue_signal, signum, since),
        )
        self._preemption.install()

    def _started_at(self, step: int) -> None:
        """The loop goes on from ``step`` (a restored snapshot's)."""
        assert self._source is not None and self._pipeline is not None
        self._source.global_step = self._pipeline.start_step = self._pipeline.last_step = step
        self._reporter.start(step)

    def _follow(self, state: MutableMapping[str, Any]) -> None:
        """Follow the train loaders (their position is recorded as they are iterated) and fence the copy in flight
        before each optimizer's step (the weights and optimizer state are copied while the next forward and backward
        run)."""
        assert self._source is not None
        self._source.state = state
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
        """Give everything back; ``drop``: snapshots still queued are dropped (after a preemption, whose snapshot is
        durable already)."""
        if self._preemption is not None:
            self._preemption.restore()
            self._preemption = None
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._hooked = [], set()
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None
        session, self._session = self._session, None
        if session is not None:
            session.close(drop, timeout)

    def _end(self) -> None:
        pipeline = self._pipeline
        assert pipeline is not None
        if self._preemption is not None:
            self._preemption.settle()
        pipeline.end_of_fit()
        pipeline.wait_written()
        self._flush()
        pipeline.check_end()

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
                self._started_at(step)
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
        assert self._source is not None and self._restorer is not None
        where = f"snapshot of step {step} in the {backend.tier} tier {backend.url!r}"
        manifest = read_manifest(backend, step)
        kinds = fstate.split(self._source.state)
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
        assert self._source is not None and self._pipeline is not None
        if state is not None and state is not self._source.state:
            self._follow(state)
        self._source.global_step += 1
        self._pipeline.step_ended()
        stop_if_preempted(self._preemption, self._pipeline, self._requeue_signal)
        self._pipeline.finish_pending()
        self._flush()

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """An optimizer's step pre-hook: the weights and optimizer state are about to change, so the copy in flight
        must be complete (the stall a snapshot costs: ``snapshot/stall_ms``)."""
        stall = self._pipeline.stager.before_optimizer_step() if self._pipeline is not None else None
        if stall is not None:
            self._reporter.metrics.add("snapshot/stall_ms", stall)

    def _flush(self) -> None:
        """The metrics so far to Fabric's loggers (``fabric.log_dict``, rank 0)."""
        metrics = self._reporter.metrics
        if not metrics.pending:
            return
        pending, metrics.pending = metrics.pending, {}
        if getattr(self.fabric, "global_rank", 0) == 0 and getattr(self.fabric, "loggers", None):
            self.fabric.log_dict(pending, step=self.global_step)
