"""SnapshotCallback: the Lightning hooks, each a few lines that hand the work to the parts of a snapshot's way.

The parts (``docs/architecture.md`` has the map): :mod:`~lightning_snapshot.config` (the options, validated once),
:mod:`~lightning_snapshot.fit.session` (a fit's process groups, tiers, agent, arena and persist threads),
:mod:`~lightning_snapshot.state.patches` (every write into Lightning's private state, undone from one registry),
:mod:`~lightning_snapshot.restore.restorer` (the resume; :mod:`~lightning_snapshot.restore.later_phases` its later
phases, over the state
parts of :mod:`~lightning_snapshot.state.builtin`), :mod:`~lightning_snapshot.fit.loaders` (train loader positions),
:mod:`~lightning_snapshot.schedule.schedules` (when each tier is due), :mod:`~lightning_snapshot.fit.pipeline` (stage,
finish, fence,
hand over) and :mod:`~lightning_snapshot.fit.reporting` (metrics, warnings, the ``on_error`` policy).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Sequence
from typing import Any, TypeVar

from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from lightning_snapshot.backends.base import Backend
from lightning_snapshot.config import SnapshotConfig
from lightning_snapshot.dist.preempt import (
    Preemption,
    exit_promptly,
    overdue,
    slurm_requeue_signal,
    spawned_rank_preempted,
    stop,
    stop_if_preempted,
)
from lightning_snapshot.errors import ConfigError, Preempted
from lightning_snapshot.fit.loaders import FitLoaders
from lightning_snapshot.fit.pipeline import SnapshotPipeline
from lightning_snapshot.fit.reporting import Reporter
from lightning_snapshot.fit.session import FitSession
from lightning_snapshot.restore.later_phases import Resumption, report_restore
from lightning_snapshot.restore.restorer import Restorer
from lightning_snapshot.schedule.interval import default_mtbf
from lightning_snapshot.schedule.schedules import FitSchedule
from lightning_snapshot.state import patches as _patches
from lightning_snapshot.state.capture import check_placements, is_sharded
from lightning_snapshot.state.ddp_layout import DDP_LAYOUT_ENV
from lightning_snapshot.state.trainer import TrainerSource

__all__ = ["DDP_LAYOUT_ENV", "SnapshotCallback"]

log = logging.getLogger(__name__)

_C = TypeVar("_C")


class _Option:
    """A read-only view of one field of the callback's :class:`~lightning_snapshot.config.SnapshotConfig`, made for
    every declared option by :func:`_options`."""

    def __init__(self, name: str, settable: bool) -> None:
        self.name, self.settable = name, settable

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = getattr(obj.config, self.name)
        return value if self.settable else list(value)  # (the tiers: a list, as given)

    def __set__(self, obj: Any, value: Any) -> None:
        """A new configuration with this option changed, validated as in ``__init__`` (between fits only)."""
        if not self.settable or obj._session is not None:
            raise AttributeError(f"SnapshotCallback.{self.name} cannot change now: make a new SnapshotCallback")
        obj.config = obj.config.replace(**{self.name: value})
        obj._reporter.on_error = obj.config.on_error


def _options(cls: type[_C]) -> type[_C]:
    """Give ``cls`` an attribute per option declared by :class:`~lightning_snapshot.config.SnapshotConfig`."""
    for f in SnapshotConfig.options():
        setattr(cls, f.name, _Option(f.name, f.metadata["settable"]))
    return cls


@_options
class SnapshotCallback(Checkpoint):
    """Take snapshots of the complete training state into one or more tiers, and resume from them.

    Args:
        tiers: where snapshots go: a backend (e.g. ``LocalTier("/nvme/snap", every_n_train_steps=100)``), a tier URL
            (``"/nvme/snap?every=100&keep=3"``, ``"file:///nvme/snap?every=100"``), or a list of them. Each tier has
            its own schedule and retention.
        resume: what ``trainer.fit`` resumes from. ``True`` (default): the newest committed snapshot that loads and
            verifies, across all tiers, falling back to older ones with a warning. ``False``: start fresh. An ``int``:
            that step, from the first tier that has it. A string: one snapshot directory or tier URL
            (``"/nvme/snap/step-000000001200"``). An explicit ``ckpt_path`` given to ``fit`` wins over all of these.
        on_error: ``"raise"`` (default) stops training when a snapshot cannot be written (at the next scheduled
            snapshot, or at the end of training, on every rank together); ``"warn"`` warns and keeps training. Earlier
            snapshots stay intact either way, and every failure is also a warning and a ``snapshot/failed`` metric.
        max_host_bytes: the most host memory the staging arena may use (bytes). The arena holds two buffers of the
            state's size (staging snapshot N+1 while N is persisted); with room for only one, a snapshot due while
            the buffer is still being persisted is skipped with a warning and counted in ``snapshot/skipped``; with
            room for none, every snapshot is skipped that way. None: no limit. On CUDA these buffers are also
            page-locked (registered with CUDA), so this bounds the locked memory too.
        chunk_bytes: the checksum chunk size of the snapshots written (bytes; default 8 MiB). Every read is
            verified in whole chunks, so a resharded load (each rank reading only its shard) reads up to about two
            chunks more than it needs per tensor and shard boundary: smaller chunks mean less read amplification,
            at the cost of a longer manifest.
        sigterm_grace: seconds the callback may take after a preemption signal (``preemption_signals``) to snapshot
            the current step into every tier and wait until a durable tier holds it; default 25 s, within SLURM's,
            Kubernetes' and torchrun's default 30 s between SIGTERM and SIGKILL.
        collective_timeout: the longest any wait across processes of a snapshot may take (seconds; default 300): a
            collective of a tier's commit (gloo's timeout of the tier's process group), and the snapshot agent's
            wait for the other ranks' parts of a snapshot; and a trainer's wait for its node's agent, which says it is
            alive every second (silent for 60 s or this long, whichever is shorter: ``AgentError``). A rank or agent
            that fails ends these waits at once (its process exits, which breaks its connections, or it leaves a
            failure marker); the bound is for a peer that is alive but stuck. Raise it when one snapshot takes longer
            than this to write.
        shutdown_timeout: the longest ``on_exception`` and ``teardown`` wait for the persist threads (seconds;
            default 30). After an exception the writes in flight are abandoned after this long (a snapshot already
            handed to the snapshot agent is still finished by it) and the exception goes on.
        resume_unhealthy: every snapshot records, per tensor group (the model, each optimizer), whether its
            parameters and optimizer state held a NaN or an infinity. ``False`` (default): ``resume=True`` skips
            unhealthy snapshots, with one warning naming the newest one's step and first non-finite tensor, and
            resumes from the newest healthy one (snapshots written before health was recorded count as healthy).
            ``True``: health does not matter.
        max_restores: the crash-loop breaker. Every restore is recorded next to the snapshot it used
            (``step-<N>/restores.json`` in each tier holding it; rank 0 writes it before training goes on).
            With ``resume=True``, a snapshot restored this many times (default 3) with no newer snapshot committed
            since (the run crashed after each restore) is skipped, with a warning saying why, and the resume takes
            the one before it. The count is the largest over the tiers, read by rank 0 for the whole job. ``None``:
            never skip (restores are still recorded).
        mtbf: the job's mean time between failures, for the tiers with ``every_n_train_steps="auto"`` (URL
            ``every=auto``): seconds, or a string with a unit (``"90m"``, ``"4h"``, ``"2d"``). None (default):
            6000 hours per node divided by the number of nodes (``trainer.num_nodes``), from the failure rate Meta
            reports for Llama 3 (419 interruptions in 54 days on 2,048 nodes). Such a tier snapshots every
            ``sqrt(2 x cost x mtbf)`` of training (Young/Daly), in steps since its last snapshot, with the cost it
            measures (see :mod:`lightning_snapshot.schedule.interval`); rank 0 decides, at snapshot steps, for every
            rank.
        replica_check: under DDP every rank should hold the same parameters and optimizer state; each snapshot
            compares a checksum of a rotating slice of them across the ranks, so that all of them are compared every
            ``replica_check`` snapshots (default 4), and all of them at the first snapshot after the set of trained
            parameters changed (an unfreeze). ``1``: all of them at every snapshot. ``None``: no check. Buffers are
            not compared (DDP broadcasts them at each forward). See :mod:`lightning_snapshot.fit.replicas`.
        on_replica_mismatch: what a snapshot whose replicas disagree does (every rank the same; the warning names
            the tensors and the ranks). ``"warn"`` (default): warn, and commit the snapshot recorded as unhealthy
            ("replicas disagree", shown by ``lightning-snapshot inspect``), so that ``resume=True`` skips it as
            it skips one holding a NaN (unless ``resume_unhealthy=True``). ``"skip"``: warn and do not write it.
            ``"raise"``: stop training with a ``ReplicaMismatchError``.
        preemption_signals: the signals that mean "preempted" (names such as ``"SIGTERM"``, ``"USR1"``, or numbers;
            default ``("SIGTERM",)``). While a fit runs the callback owns them instead of Lightning: the handler only
            records the signal; the ranks agree at the next optimizer step (any rank's signal stops every rank at
            the same step), that step is snapshotted into every tier and made durable within ``sigterm_grace``, and
            ``fit`` raises :class:`~lightning_snapshot.errors.Preempted` (exit status 128 + the signal number, 143
            for SIGTERM). DataLoader workers started during the fit do not receive these signals. Under
            ``SLURMEnvironment(auto_requeue=True)`` its requeue signal (SIGUSR1) is owned too, and the job is
            requeued once the snapshot is durable. An empty list leaves Lightning's own handling. See
            ``docs/preemption.md``.

    Snapshots are taken after the optimizer step of every scheduled ``global_step`` (with gradient accumulation,
    only when ``global_step`` moved). Supported strategies: single device, DDP (``ddp``, ``ddp_spawn``) and
    ``ModelParallelStrategy`` (FSDP2 ``fully_shard``, tensor parallelism, and both on a 2-D data x tensor parallel
    mesh, whose ``_StridedShard`` layout is one box per rank), whose DTensor state every rank saves as its own
    shards, never gathered. A snapshot restores into
    any of them, at any world size: each rank reads only the bytes of its own shards.
    """

    def __init__(
        self,
        tiers: str | Backend | Sequence[str | Backend],
        *,
        resume: bool | int | str = True,
        on_error: str = "raise",
        max_host_bytes: int | None = None,
        chunk_bytes: int = 8 << 20,
        sigterm_grace: float = 25.0,
        collective_timeout: float = 300.0,
        shutdown_timeout: float = 30.0,
        resume_unhealthy: bool = False,
        max_restores: int | None = 3,
        mtbf: float | str | None = None,
        replica_check: int | None = 4,
        on_replica_mismatch: str = "warn",
        preemption_signals: str | int | Sequence[str | int] | None = ("SIGTERM",),
    ) -> None:
        # (the keywords are the options SnapshotConfig declares: tests/unit/test_config.py holds them to each other)
        self.config = SnapshotConfig.create(**SnapshotConfig.pick(locals()))
        self._reporter = Reporter(self.config.tiers, self.config.on_error)
        self._loaders = FitLoaders()
        self._init_fit()
        #: (tier url, step, seconds) of the restore done by the last ``fit``, or None.
        self.restored_from: tuple[str, int, float] | None = None
        #: What this rank read for that restore: bytes of the shared tensors it needed (its shards, or whole
        #: tensors, ``bytes_needed``), bytes it planned to read and read from the tier (``bytes_read``), bytes it got
        #: from the other ranks instead (``bytes_received``: a read-once restore), the bytes the tier counted
        #: (``tier_bytes_read``; None when the tier does not count) and the bytes all ranks together read
        #: (``job_bytes_read``), or None.
        self.restore_stats: dict[str, int | None] | None = None

    def _init_fit(self) -> None:
        """The parts of one fit (made at ``setup``; none outside a fit)."""
        self._session: FitSession | None = None
        self._schedule: FitSchedule | None = None
        self._pipeline: SnapshotPipeline | None = None
        self._restorer: Restorer | None = None
        self._preemption: Preemption | None = None
        self._requeue_signal: int | None = None  # (SLURM auto-requeue: this signal requeues the job)
        self._patches = _patches.Patches()
        #: the restored snapshot's state parts still to apply (at ``on_train_start``, before the first fetch)
        self._resumption: Resumption | None = None

    @property
    def state_key(self) -> str:
        return f"SnapshotCallback{{tiers={[t.url for t in self.config.tiers]}}}"

    @property
    def _meter(self) -> Any:
        """The cost meter of the ``every_n_train_steps="auto"`` tiers in the current or last fit, or None."""
        return self._schedule.meter if self._schedule is not None else None

    @property
    def _arena(self) -> Any:
        """The host staging arena of the current fit, or None."""
        return self._session.arena if self._session is not None else None

    # ------------------------------------------------------------------------------------------- set-up
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)):
            raise ConfigError(
                f"SnapshotCallback does not support the {type(strategy).__name__} strategy in this release; use a"
                " single device, DDP ('ddp', 'ddp_spawn') or ModelParallelStrategy (FSDP2)"
            )
        config = self.config
        fit_ckpt_path = trainer.ckpt_path  # (a tuner may replace trainer.ckpt_path with its own in on_fit_start)
        session = self._session = FitSession.open(config, trainer)
        self._reporter.start(trainer.global_step)
        self._loaders.start()
        mtbf = None
        if any(t.auto_every for t in config.tiers):
            mtbf = config.mtbf if config.mtbf is not None else default_mtbf(getattr(trainer, "num_nodes", 1) or 1)
            log.debug("lightning-snapshot: every='auto' with a job MTBF of %.0f s", mtbf)
        self._schedule = FitSchedule(config.tiers, config.schedules, mtbf, time.monotonic())
        assert session.arena is not None and session.persister is not None
        self._pipeline = SnapshotPipeline(
            config,
            session.comm,
            session.arena,
            session.persister,
            self._schedule,
            self._reporter,
            TrainerSource(trainer, self._loaders.state_before),
            trainer.global_step,
        )
        self._restorer = Restorer(config, session.comm, session.tier_comms, fit_ckpt_path)
        _patches.install_fit_hooks(
            self._patches,
            trainer,
            hooked=lambda: self._hooked(trainer),
            on_train_loader=lambda loader: self._loaders.on_train_loader(loader, trainer),
            before_fetch=lambda: self._before_fetch(trainer),
            between_epochs=lambda: self._between_epochs(trainer),
            end_of_fit=lambda: self._end_of_fit(trainer),
        )
        self._resumption = None
        self._own_signals(trainer, session)
        self._restorer.preload_callbacks(trainer, exclude=self)

    def _own_signals(self, trainer: Any, session: FitSession) -> None:
        """Own the preemption signals for the fit, right after Lightning registers its handlers (so that its
        in-handler broadcast never runs; Lightning's teardown restores what was there before it)."""
        signals = list(self.config.preemption_signals)
        environment = getattr(trainer._accelerator_connector, "cluster_environment", None)  # private, as Lightning
        self._requeue_signal = slurm_requeue_signal(environment)
        if signals and self._requeue_signal is not None and self._requeue_signal not in signals:
            signals.append(self._requeue_signal)  # (Lightning's would save a checkpoint inside its handler)
        if not signals:
            return
        store = session.store() if session.comm.world_size > 1 else None
        preemption = self._preemption = Preemption(
            signals,
            session.step_comm,
            store=store,
            key=f"lightning_snapshot/{session.run_id}/preempted",
            grace=self.config.sigterm_grace,
            on_overdue=self._overdue,
        )
        _patches.own_signals(self._patches, trainer, preemption.install, sigterm=signal.SIGTERM in signals)
        _patches.watch_validation(
            self._patches,
            trainer,
            hooked=lambda: self._hooked(trainer),
            starting=lambda: self._validation_starting(trainer),
            ended=self._validation_ended,
            abandon=preemption.stop_validation,
            agree=lambda: self._validation_agree(trainer),
        )

    def _validation_starting(self, trainer: Any) -> None:
        """A validation (or the sanity check) starts: the watcher asks for the other ranks' signals more often, and
        inside training this rank's state is taken as it is before the validation (see ``SnapshotPipeline.arm``)."""
        if self._preemption is not None:
            # (a sharded strategy's validation batches are collectives: the ranks stop before the same one)
            self._preemption.validation_started(lockstep=is_sharded(trainer.strategy))
            self._preemption.outside = True
        if self._pipeline is not None and not trainer.sanity_checking:
            self._loaders.before_fetch(trainer)  # (a loader fetched ahead: its state before the next fetch)
            self._pipeline.arm()

    def _validation_ended(self) -> None:
        if self._preemption is not None:
            self._preemption.outside = False
        if self._pipeline is not None:
            self._pipeline.disarm()

    def _validation_agree(self, trainer: Any) -> None:
        """Every rank, once per validation, after its epoch-end hooks and before its results count: whether some
        rank was signalled; if so the validation is abandoned (no metric logged, no end hook run) and the step before
        it snapshotted with the state from before it."""
        preemption, pipeline = self._preemption, self._pipeline
        if preemption is None or pipeline is None:
            return
        signum = preemption.agree_now()
        if signum:
            abandoned = not trainer.sanity_checking and pipeline.armed_step() == trainer.global_step
            stop(preemption, pipeline, self._requeue_signal, signum, abandoned=abandoned)

    def _overdue(self, signum: int, since: float) -> None:
        """The preemption watchdog (its own thread): the ranks could not reach a step boundary within three quarters of
        the grace (a training step, a validation batch or a hook longer than that): the snapshots already handed to
        the tiers are made durable, one error line says what is lost, and the process exits with 128 + the signal."""
        overdue(self._pipeline, self._requeue_signal, signum, since)

    def _hooked(self, trainer: Any) -> bool:
        """Whether the trainer's loops run with this callback (False while a tuner, such as LearningRateFinder, runs
        them with its own callback list)."""
        return any(cb is self for cb in trainer.callbacks)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._shutdown(abort=False)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning skips teardown hooks after an exception: stop here. Snapshots already handed to the persist
        # thread are still written (nothing staged is lost); the pending one, without its rank state, is dropped.
        # (Preempted: the stop step was snapshotted before it was raised; SIGTERMException: Lightning's own handling,
        # when the callback owns no signal)
        spawned_rank_preempted(exception, self.config.preemption_signals, fit_running=self._session is not None)
        try:
            if type(exception).__name__ == "SIGTERMException" and self._pipeline is not None:
                self._pipeline.last_snapshot("SIGTERM", time.monotonic())
        finally:
            if self._pipeline is not None:
                self._pipeline.pending = None
            # (after a preemption what sigterm_grace allowed is done: the rest is abandoned at once, before SIGKILL)
            preempted = isinstance(exception, Preempted)
            self._shutdown(abort=True, timeout=1.0 if preempted else None)
            if preempted:
                assert isinstance(exception, Preempted)
                exit_promptly(int(exception.code or 0))

    def _shutdown(self, abort: bool, timeout: float | None = None) -> None:
        """Give the signals back, undo every patch, settle the snapshot in flight and close the fit's session."""
        if self._preemption is not None:
            self._preemption.restore()
            self._preemption = None
        self._patches.undo_all()
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None
        if self._session is not None:
            self._session.close(abort, timeout)
            self._session = None

    # ------------------------------------------------------------------------------------------- resume
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if is_sharded(trainer.strategy):
            check_placements(pl_module)
        assert self._restorer is not None and self._pipeline is not None
        try:
            restored = self._restorer.restore(trainer, pl_module)
        finally:
            self.restore_stats = self._restorer.stats
        if restored is not None:
            self._pipeline.last_step = restored.step
            self.restored_from = (restored.url, restored.step, restored.seconds)
            report_restore(self._reporter.metrics, restored, self.restore_stats)
            self._resumption = restored.resumption
            self._resumption.fit_start(self._loaders, self._patches, lambda: self._hooked(trainer))
        self._loaders.adopt_made(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._loaders.resumed = None
        if self._resumption is not None:
            self._resumption.train_start()

    def _first_fetch(self) -> None:
        if self._resumption is not None:
            self._resumption.first_fetch()

    # ------------------------------------------------------------------------------------------- snapshots
    def _before_fetch(self, trainer: Any) -> None:
        """Right before the training loop fetches a batch: the point a snapshot's RNG, data position, loops,
        callbacks and schedulers are taken at, and restored at."""
        self._first_fetch()
        self._loaders.before_fetch(trainer)
        stop_if_preempted(self._preemption, self._pipeline, self._requeue_signal)
        self._finish_pending(trainer)

    def _between_epochs(self, trainer: Any) -> None:
        stop_if_preempted(self._preemption, self._pipeline, self._requeue_signal)
        self._finish_pending(trainer)

    def _finish_pending(self, trainer: Any, consumed_offset: int = 0) -> None:
        if self._pipeline is not None:
            self._pipeline.finish_pending(consumed_offset)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._pipeline is not None:
            self._pipeline.stager.fence_if_retrained()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._pipeline is not None:
            self._pipeline.stager.batch_start()
        self._first_fetch()  # (a loop that fetched without the epoch loop's fetch hook)
        self._finish_pending(trainer, consumed_offset=1)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        stall = self._pipeline.stager.before_optimizer_step() if self._pipeline is not None else None
        if stall is not None:
            self._reporter.metrics.add("snapshot/stall_ms", stall)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._pipeline is not None:
            self._pipeline.step_ended()
        self._reporter.metrics.flush(trainer)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._schedule is not None:
            self._schedule.pause(time.perf_counter())
        # validation may change the weights in place and back (WeightAveraging swaps the averaged weights in for
        # it): the copy of a snapshot's weights must be complete before
        if self._pipeline is not None:
            self._pipeline.stager.fence()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        # validation inside training is not a step's time (the meter would count it against a tier in flight)
        if self._schedule is not None:
            self._schedule.resume(time.perf_counter())

    def _end_of_fit(self, trainer: Any) -> None:
        """Fit's last snapshot, when the training loop ends, before the ``on_train_end`` hooks."""
        if self._preemption is not None:
            self._preemption.settle()  # (the last step's agreement: every rank started it)
        if self._pipeline is not None:
            self._pipeline.end_of_fit()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_of_fit(trainer)  # (done already when the fit loop ended normally)
        # fit returns once every snapshot is durable (or failed); tiers with a drain_timeout (object stores) are
        # waited for that long at most
        if self._pipeline is not None:
            self._pipeline.wait_written()
        self._reporter.metrics.flush(trainer)
        if self._pipeline is not None:
            self._pipeline.check_end()

    # ------------------------------------------------------------------------------------------- checkpoint state
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    # ------------------------------------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        """The configuration only (``ddp_spawn`` pickles the trainer and its callbacks to start its processes, before
        ``setup``): the tiers leave their locks and clients behind, and ``setup`` makes the rest in each process."""
        if self._session is not None or self._patches:
            raise TypeError(
                "a SnapshotCallback in use by a running fit (its persist threads, staging memory and"
                " agent connection belong to this process) cannot be pickled; pickle it before"
                " trainer.fit or after it returns"
            )
        state = dict(self.__dict__)
        for name in ("_session", "_schedule", "_pipeline", "_restorer", "_patches", "_resumption"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_fit()
