"""SnapshotCallback: the Lightning side. Hooks only; capture, staging, writing and loading live elsewhere."""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_snapshot import compat as _compat
from lightning_snapshot import data as _data
from lightning_snapshot import fit_state as _fit_state
from lightning_snapshot.backends.base import Backend
from lightning_snapshot.backends.registry import parse_tier
from lightning_snapshot.capture import (
    Templates,
    adopt_pruning,
    capture_late,
    capture_rng,
    capture_shared_live,
    check_model,
    check_optimizers,
    frozen_predicate,
    is_sharded,
    optimized_key,
    restore_rng,
    restore_shared,
    restore_targets,
    shared_signature,
    templates,
)
from lightning_snapshot.comm import Comm, GroupComm, LocalComm, StrategyComm, new_gloo_groups
from lightning_snapshot.ddp_layout import apply_layout, capture_layout, check_layout, is_ddp
from lightning_snapshot.errors import (
    CaptureError,
    ConfigError,
    FormatVersionError,
    NotDurableError,
    SnapshotError,
    SnapshotNotFoundError,
    StateMismatchError,
    TierUnavailableError,
    TornSnapshotError,
)
from lightning_snapshot.interval import CostMeter, default_mtbf, parse_duration, young_daly_steps
from lightning_snapshot.loader import ReadStats, read_manifest, read_section, resolve_source
from lightning_snapshot.metrics import MetricsSink, tier_metric_names
from lightning_snapshot.persist import Persister, PersistJob
from lightning_snapshot.resume_policy import Candidate, plan_resume, read_candidate, record_restore
from lightning_snapshot.staging import dtensor_box, is_dtensor, stage
from lightning_snapshot.staging.arena import AsyncStaged, HostArena
from lightning_snapshot.writer import committed_steps

if TYPE_CHECKING:
    from lightning_snapshot.backends.local import LocalTier
    from lightning_snapshot.backends.ram.tier import RamTier

__all__ = ["SnapshotCallback"]

log = logging.getLogger(__name__)

_ON_ERROR = ("raise", "warn")
#: Set to 0 (or off/false/no) to neither store nor give back DDP's gradient-bucket layout (see ddp_layout).
DDP_LAYOUT_ENV = "LIGHTNING_SNAPSHOT_DDP_LAYOUT"


def _ddp_layout_enabled() -> bool:
    return os.environ.get(DDP_LAYOUT_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


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
        sigterm_grace: seconds the callback may take after a SIGTERM (a preempted SLURM or Kubernetes job, through
            Lightning's signal handling) to snapshot the current step into every tier and wait until a durable tier
            holds it; default 25 s, within SLURM's and Kubernetes' default 30 s between SIGTERM and SIGKILL.
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
            measures (see :mod:`lightning_snapshot.interval`); rank 0 decides, at snapshot steps, for every rank.

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
    ) -> None:
        if isinstance(tiers, (str, Backend)):
            tiers = [tiers]
        if not isinstance(tiers, Sequence) or not tiers:
            raise ConfigError(f"tiers must be a tier URL, a Backend or a non-empty list of them, got {tiers!r}")
        self.tiers: list[Backend] = [parse_tier(t) for t in tiers]
        if sum(1 for t in self.tiers if t.tier == "ram") > 1:
            raise ConfigError("SnapshotCallback takes at most one RAM tier (one agent per node and run)")
        if not isinstance(resume, (bool, int, str)) or (
            isinstance(resume, int) and not isinstance(resume, bool) and resume < 0
        ):
            raise ConfigError(f"resume must be True, False, a step number >= 0 or a snapshot path/URL, got {resume!r}")
        if on_error not in _ON_ERROR:
            raise ConfigError(f"on_error must be one of {', '.join(map(repr, _ON_ERROR))}, got {on_error!r}")
        if max_host_bytes is not None and (
            isinstance(max_host_bytes, bool) or not isinstance(max_host_bytes, int) or max_host_bytes < 1
        ):
            raise ConfigError(f"max_host_bytes must be a positive number of bytes or None, got {max_host_bytes!r}")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 64:
            raise ConfigError(f"chunk_bytes must be a number of bytes >= 64, got {chunk_bytes!r}")
        self.resume = resume
        self.on_error = on_error
        self.max_host_bytes = max_host_bytes
        self.chunk_bytes = chunk_bytes
        if isinstance(sigterm_grace, bool) or not isinstance(sigterm_grace, (int, float)) or sigterm_grace <= 0:
            raise ConfigError(f"sigterm_grace must be a positive number of seconds, got {sigterm_grace!r}")
        self.sigterm_grace = float(sigterm_grace)
        for option, value in (("collective_timeout", collective_timeout), ("shutdown_timeout", shutdown_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{option} must be a positive number of seconds, got {value!r}")
        self.collective_timeout = float(collective_timeout)
        self.shutdown_timeout = float(shutdown_timeout)
        if not isinstance(resume_unhealthy, bool):
            raise ConfigError(f"resume_unhealthy must be True or False, got {resume_unhealthy!r}")
        if max_restores is not None and (
            isinstance(max_restores, bool) or not isinstance(max_restores, int) or max_restores < 1
        ):
            raise ConfigError(
                f"max_restores must be an integer >= 1 (or None to never skip a snapshot the run keeps"
                f" crashing after), got {max_restores!r}"
            )
        self.resume_unhealthy = resume_unhealthy
        self.max_restores = max_restores
        #: (rank 0) per (step, tier index) of the last candidate list: the manifest digest and the restore count
        self._facts: dict[tuple[int, int], tuple[str, int]] = {}
        self.mtbf = None if mtbf is None else parse_duration(mtbf, "mtbf")
        #: every_n_train_steps="auto": the cost meter, the job's MTBF (seconds, settled at setup), each tier's last
        #: snapshot step in this fit, the end of the last optimizer step, and the interval last logged at INFO
        self._meter: CostMeter | None = None
        self._mtbf_s = 0.0
        self._last_snap_step: list[int] = []
        self._step_clock: float | None = None
        self._paused = 0.0
        self._validation_clock: float | None = None
        self._logged_interval: list[int] = [t.every_n_train_steps or 0 for t in self.tiers]
        self._arena: HostArena | None = None
        self._persister: Persister | None = None
        self._inflight: AsyncStaged | None = None
        self._copied = False  # the copy in flight was waited for before this step's optimizer step (validation)
        self._fit_ckpt_path: Any = None  # fit(ckpt_path=...), as setup saw it
        # the model's signature and what the optimizers train, when the pending step was staged
        self._staged_signature: tuple[Any, ...] | None = None
        self._ended = False  # the snapshot of the end of fit was taken
        self._metrics = MetricsSink()
        self._metric_names = tier_metric_names(self.tiers)
        self._committed: dict[int, int] = {}
        #: per tier index: the last step handed to its persist worker in this fit, and why its last write failed
        self._submitted: dict[int, int] = {}
        self._tier_problem: dict[int, str] = {}
        #: the newest step snapshotted for a durable tier in this fit
        self._last_durable_due: int | None = None
        self._stall = 0.0
        self._skipped = 0
        self._torn_steps: set[int] = set()
        self._failed = 0
        self._errors: list[BaseException] = []
        self._comm: Comm = LocalComm()
        self._tier_comms: list[Comm] = []
        self._agent: Any = None
        self._run_id = ""
        self._last_step = -1
        self._last_time: list[float] = []
        #: (step, staged tensors, due tier indices) of the snapshot whose rest of the state is taken right before
        #: the next batch is fetched (:meth:`_before_fetch`), or at the end of training.
        self._pending: tuple[int, AsyncStaged | None, list[int]] | None = None
        #: After a restore: "mid" (the restored run continues an epoch), "boundary" (a finished epoch: the next one
        #: starts from its beginning); None when nothing was restored.
        self._resumed: str | None = None
        #: Stateful train-loader states recorded before each fetch of a loader without a length, by fetch index.
        self._fetch_states: dict[int, Any] = {}
        self._patched_loop: Any = None
        self._patched_fit_loop: Any = None
        #: (tier url, step) of the snapshot whose callback states ``setup`` loaded, or None.
        self._preloaded: tuple[str, int] | None = None
        #: The restored snapshot's :mod:`~lightning_snapshot.fit_state`, applied at ``on_train_start``.
        self._restored_fit_state: dict[str, Any] | None = None
        #: The fit loop whose next setup_data makes the loaders at a resumed run's saved epoch, and the restored
        #: epoch while it does (see _make_loaders_as_saved).
        self._patched_setup_data: Any = None
        self._loader_epoch: int | None = None
        self._fit_start_step = 0
        self._tier_skipped = [0] * len(self.tiers)
        self._pending_rng: dict[str, Any] | None = None
        self._pending_loaders: list[dict[str, Any] | None] = []
        self._pending_loaders_count = 0
        self._exact_data = True
        self._warned_loaders: set[int | str] = set()
        self._patched_strategy: Any = None
        self._planned = False
        self._warned_layout = False
        #: (tier url, step, seconds) of the restore done by the last ``fit``, or None.
        self.restored_from: tuple[str, int, float] | None = None
        #: What this rank read for that restore: bytes of the shared tensors it needed (its shards, or whole
        #: tensors), bytes planned to read, and the bytes the tier counted (``tier_bytes_read``; None when the tier
        #: does not count), or None.
        self.restore_stats: dict[str, int | None] | None = None

    @property
    def state_key(self) -> str:
        return f"SnapshotCallback{{tiers={[t.url for t in self.tiers]}}}"

    # ------------------------------------------------------------------------------------------- set-up
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        supported = (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)
        if not isinstance(strategy, supported):
            raise ConfigError(
                f"SnapshotCallback does not support the {type(strategy).__name__} strategy in this release; use a"
                " single device, DDP ('ddp', 'ddp_spawn') or ModelParallelStrategy (FSDP2)"
            )
        self._fit_ckpt_path = trainer.ckpt_path
        self._comm = StrategyComm(strategy) if strategy.world_size > 1 else LocalComm()
        self._run_id = str(self._comm.broadcast(uuid.uuid4().hex[:12]))
        self._committed, self._submitted, self._tier_problem = {}, {}, {}
        self._last_durable_due = None
        self._last_time = [time.monotonic()] * len(self.tiers)
        self._setup_auto(trainer)
        self._last_step = trainer.global_step  # a snapshot needs an optimizer step since this one
        self._fit_start_step = trainer.global_step
        self._pending = None
        self._arena = HostArena(max_host_bytes=self.max_host_bytes, chunk_bytes=self.chunk_bytes)
        self._planned = False
        comms: list[Comm] = [LocalComm() for _ in self.tiers]
        if strategy.world_size > 1:
            import datetime as dt

            # each tier's persist thread has a group of its own: background collectives never touch the trainer's
            # main group, and a tier in an outage never blocks another's commits; a stuck peer fails a collective
            # after collective_timeout (a dead one at once)
            timeout = dt.timedelta(seconds=self.collective_timeout)
            groups = new_gloo_groups([f"the {t.tier} tier {t.url}" for t in self.tiers], timeout, self._run_id)
            comms = [GroupComm(group) for group in groups]
        self._tier_comms = comms
        self._setup_node_local_tiers(trainer)
        self._check_tiers()  # (after the local tiers know their node's directory; before the agent starts)
        self._setup_ram_tier(trainer)
        self._persister = Persister(self.tiers, comms, self._run_id, self._arena, agent=self._agent)
        for tier in self.tiers:
            abort = getattr(tier, "abort_incomplete_uploads", None)
            if abort is not None and self._comm.rank == 0:
                abort()  # multipart uploads left behind by a crashed run
        # Wrap train loaders' samplers as Lightning builds them, before their first iterator exists.
        original = strategy.process_dataloader

        def process_dataloader(dataloader: object) -> object:
            dataloader = original(dataloader)
            if trainer.training and self._hooked(trainer):
                self._on_train_loader(dataloader, trainer)
            return dataloader

        strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]  # undone in teardown
        self._patched_strategy = strategy
        # The rest of a snapshot (loops, callbacks, schedulers, RNG, data position) is taken right before the next
        # batch is fetched: after validation, epoch end and everything that reacts to them. Lightning's epoch loop
        # calls its ``_on_before_fetch`` (given to the data fetcher as its profiler start) right before each fetch.
        epoch_loop = trainer.fit_loop.epoch_loop
        original_before_fetch = epoch_loop._on_before_fetch

        # (the loops run without this callback too: LearningRateFinder trains with its own callback list, then puts
        # the state back; nothing of such a run is snapshotted or restored into)
        def on_before_fetch() -> None:
            if self._hooked(trainer):
                self._before_fetch(trainer)
            original_before_fetch()

        epoch_loop._on_before_fetch = on_before_fetch
        self._patched_loop = epoch_loop
        self._fetch_states = {}
        # A snapshot of an epoch's last step is finished between epochs: after the epoch's end (validation,
        # epoch-end callbacks and scheduler steps, logged epoch metrics), before the next epoch's start hooks. It
        # resumes at the epoch boundary, so those hooks run again in the resumed run, as in one that never stopped
        # (callbacks that change the model or optimizer there: BackboneFinetuning, StochasticWeightAveraging).
        fit_loop = trainer.fit_loop
        original_advance_start = fit_loop.on_advance_start

        def on_advance_start() -> None:
            if self._pending is not None and self._hooked(trainer):
                t0 = time.perf_counter()
                self._finish(trainer)
                self._stall += time.perf_counter() - t0
            original_advance_start()

        fit_loop.on_advance_start = on_advance_start
        # fit's last snapshot is taken when the training loop ends, before the on_train_end hooks (_end_of_fit)
        original_run_end = fit_loop.on_run_end

        def on_run_end() -> None:
            if self._hooked(trainer):
                self._end_of_fit(trainer, trainer.lightning_module)
            original_run_end()

        fit_loop.on_run_end = on_run_end
        self._ended, self._copied = False, False
        self._patched_fit_loop = fit_loop
        self._preload_callbacks(trainer)

    def _hooked(self, trainer: Any) -> bool:
        """Whether the trainer's loops run with this callback (False while a tuner, such as LearningRateFinder, runs
        them with its own callback list)."""
        return any(cb is self for cb in trainer.callbacks)

    def _setup_auto(self, trainer: Any) -> None:
        """Start measuring for the ``every_n_train_steps="auto"`` tiers (a new meter each fit)."""
        self._last_snap_step, self._step_clock, self._paused = [], None, 0.0
        if not any(t.auto_every for t in self.tiers):
            self._meter = None
            return
        self._meter = CostMeter(len(self.tiers))
        self._mtbf_s = self.mtbf if self.mtbf is not None else default_mtbf(getattr(trainer, "num_nodes", 1) or 1)
        log.debug("lightning-snapshot: every='auto' with a job MTBF of %.0f s", self._mtbf_s)

    def _preload_callbacks(self, trainer: Any) -> None:
        """Load the other callbacks' states from the snapshot that will be restored, now, before any callback's
        ``on_fit_start``, as Lightning's own restore does: callbacks act on their loaded state there
        (``BaseFinetuning`` re-adds its parameter groups, ``StochasticWeightAveraging`` drops the scheduler it
        replaced by SWALR). If ``on_fit_start`` restores another snapshot (this one fails to load), that one's
        callback states are loaded there instead."""
        self._preloaded = None
        self._restored_fit_state = None
        if self.resume is False or self._fit_ckpt_path:
            return
        try:
            candidates = self._candidates()
            if not candidates:
                return
            backend, step = candidates[0]
            late = self._read_late(backend, step)
        except (SnapshotError, OSError) as e:
            log.debug("lightning-snapshot: callback states not loaded at setup (%s); on_fit_start reports", e)
            return
        if isinstance(late, dict):
            _fit_state.load_callback_states(trainer, late.get("callbacks"), exclude=self)
            self._preloaded = (backend.url, step)

    def _read_late(self, backend: Backend, step: int) -> Any:
        """This rank's late state (loops, callbacks, schedulers) of a snapshot; rank 0's after a change of the
        number of processes."""

        def read() -> Any:
            manifest = read_manifest(backend, step)
            rank = self._comm.rank if manifest.world_size == self._comm.world_size else 0
            section = manifest.rank_section(rank)
            if section is None:
                return None
            state = read_section(backend, manifest, section.tensors, section.state)
            return state.get("late") if isinstance(state, dict) else None

        return self._through_tier(backend, step, read)

    def _through_tier(self, backend: Backend, step: int, read: Callable[[], Any]) -> Any:
        """Run ``read`` (a read of snapshot ``step`` of ``backend``). For a node-local tier of this callback (RAM, a
        local tier on each node's own disk) the objects are first made readable on every node (RAM: a corrupted
        share found by the read is repaired from the others) and what the restore added is freed after: collective
        over the tier's group. Any other backend (a snapshot path given as ``resume``) is read directly."""
        restore = getattr(backend, "restore", None)
        if restore is None or not getattr(backend, "node_local", False) or backend not in self.tiers:
            return read()
        comm = self._tier_comms[self.tiers.index(backend)] if self._tier_comms else LocalComm()
        return restore(comm, step, read)

    def _check_tiers(self) -> None:
        """Before training: every rank checks that it can write each durable tier (a probe object written and
        deleted: the directory is writable, the bucket exists, the credentials are accepted, the endpoint answers).

        Collective: every rank raises the same :class:`TierUnavailableError`, naming the rank, the tier and the fix,
        when any rank's check failed.
        """
        problems: list[str] = []
        for tier in self.tiers:
            if not tier.durable:
                continue  # (the RAM tier is checked when its agent starts)
            try:
                tier.check()
            except TierUnavailableError as e:
                problems.append(str(e))
        message = self._agree_problem("; ".join(problems) or None)
        if message is not None:
            raise TierUnavailableError(
                f"lightning-snapshot cannot use its tiers, so training does not start: {message}"
            )

    def _agree_problem(self, problem: str | None) -> str | None:
        """Collective: None when no rank has a problem, else every rank's problem (prefixed with its rank under
        DDP) joined, the same text on every rank, so that all raise the same error together."""
        if self._comm.all_true(problem is None):
            return None
        gathered = self._comm.gather(problem)
        text = None
        if gathered is not None:  # (rank 0) the same problem on several ranks is said once
            ranks: dict[str, list[int]] = {}
            for rank, p in enumerate(gathered):
                if p:
                    ranks.setdefault(p, []).append(rank)
            text = "; ".join(
                p if self._comm.world_size == 1 else f"on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {p}"
                for p, r in ranks.items()
            )
        return str(self._comm.broadcast(text))

    def _placement(self, trainer: Any) -> dict[str, int]:
        """Where this rank is in the job, as the tiers' ``bind`` takes it: its node, the number of nodes, its rank on
        the node and the ranks per node (at least 1)."""
        strategy = trainer.strategy
        num_nodes = max(1, int(getattr(trainer, "num_nodes", 1) or 1))
        return {
            "node_rank": int(getattr(strategy, "node_rank", 0) or 0),
            "num_nodes": num_nodes,
            "local_rank": int(getattr(strategy, "local_rank", 0) or 0),
            "ranks_per_node": max(1, self._comm.world_size // num_nodes),
        }

    def _setup_node_local_tiers(self, trainer: Any) -> None:
        """Tell each local tier which node this rank is on, and settle whether its directory is shared by all nodes
        or node-local (detected with probe files unless set; one log line each)."""
        placement = self._placement(trainer)
        for i, tier in enumerate(self.tiers):
            settle = getattr(tier, "settle_layout", None)
            if settle is None:
                continue
            local = cast("LocalTier", tier)  # (the tiers with a layout to settle)
            local.bind(**placement)
            how = settle(self._tier_comms[i], self._run_id)
            if placement["num_nodes"] > 1:
                layout = (
                    "node-local: each node writes its own ranks' data and a copy of the manifest, commits are"
                    " agreed over the process group"
                    if local.node_local
                    else "shared by all nodes"
                )
                rank_zero_info(f"lightning-snapshot: the {tier.tier} tier {tier.url} is {layout} ({how})")

    def _setup_ram_tier(self, trainer: Any) -> None:
        """Place the RAM tier in the job (which node this rank is on) and attach this rank to its node's agent."""
        found = next((t for t in self.tiers if t.tier == "ram"), None)
        if found is None:
            return
        ram = cast("RamTier", found)
        from lightning_snapshot.backends.ram.agent import AgentClient, ensure_agent
        from lightning_snapshot.backends.ram.tier import default_run_name

        placement = self._placement(trainer)
        world, num_nodes = self._comm.world_size, placement["num_nodes"]
        if world % num_nodes:
            raise ConfigError(
                f"the RAM tier needs the same number of processes on every node ({world} processes on"
                f" {num_nodes} nodes)"
            )
        name = self._comm.broadcast(default_run_name([t.url for t in self.tiers if t is not ram]))
        ram.bind(**placement, default_name=name)
        error: BaseException | None = None
        if ram.node_leader:
            try:
                ensure_agent(ram.node_dir, idle_timeout=ram.idle_timeout)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                error = e
        if not self._comm.all_true(error is None):
            raise error or SnapshotError("starting the snapshot agent failed on another node (see its log)")
        # the agent writes the durable tiers whose commit it can see from its node (not the node-local ones, whose
        # commit the trainers agree on over their process group)
        self._agent = AgentClient(
            ram.node_dir,
            rank=self._comm.rank,
            world_size=world,
            run_id=self._run_id,
            tiers=[t for t in self.tiers if t is not ram and t.durable and not getattr(t, "node_local", False)],
            part_wait=self.collective_timeout,
        )

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._shutdown(abort=False)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning skips teardown hooks after an exception: stop here. Snapshots already handed to the persist
        # thread are still written (nothing staged is lost); the pending one, without its rank state, is dropped.
        try:
            if type(exception).__name__ == "SIGTERMException" and self._persister is not None:
                self._snapshot_on_sigterm(trainer, pl_module)
        finally:
            self._pending = None
            self._shutdown(abort=True)

    def _snapshot_on_sigterm(self, trainer: Any, pl_module: Any) -> None:
        """Preemption (SIGTERM, through Lightning's signal handling, on every rank together): snapshot the current
        step into every tier and wait, within ``sigterm_grace`` seconds, until a durable tier holds it."""
        assert self._persister is not None
        t0 = time.monotonic()
        step = trainer.global_step
        self._fence_copy()  # (training stopped between steps: the copy in flight is settled, not torn by it)
        self._persister.drain(timeout=self.sigterm_grace / 2)
        if self._pending is not None and self._pending[0] == step:
            self._pending = (step, self._pending[1], list(range(len(self.tiers))))
        elif step > self._fit_start_step:
            if self._pending is not None:
                self._finish(trainer)
            self._final_snapshot(trainer, pl_module, step)
        if self._pending is not None:
            self._finish(trainer)
        late = self._persister.drain(timeout=max(0.0, self.sigterm_grace - (time.monotonic() - t0)))
        self._collect_results(step)
        held = [t.url for i, t in enumerate(self.tiers) if self._committed.get(i) == step]
        durable = [t.url for i, t in enumerate(self.tiers) if t.durable and self._committed.get(i) == step]
        if durable:
            rank_zero_info(
                f"lightning-snapshot: SIGTERM: step {step} is held by {', '.join(held)} ({time.monotonic() - t0:.1f} s)"
            )
        else:
            log.error(
                "lightning-snapshot: SIGTERM: step %d did not become durable within sigterm_grace=%s s"
                " (held by: %s; still writing: %s)",
                step,
                self.sigterm_grace,
                held or "none",
                [t.url for t in late] or "none",
            )

    def _shutdown(self, abort: bool) -> None:
        """Stop the background machinery, waiting at most ``shutdown_timeout`` for the persist threads (``abort``:
        after an exception, snapshots still queued are dropped and retries stop)."""
        if self._patched_strategy is not None:
            self._patched_strategy.__dict__.pop("process_dataloader", None)
            self._patched_strategy = None
        if self._patched_loop is not None:
            for name in ("_on_before_fetch", "on_run_start"):
                self._patched_loop.__dict__.pop(name, None)
            self._patched_loop = None
        if self._patched_setup_data is not None:
            self._patched_setup_data.__dict__.pop("setup_data", None)
            self._patched_setup_data = None
        if self._patched_fit_loop is not None:
            for name in ("on_advance_start", "on_run_end"):
                self._patched_fit_loop.__dict__.pop(name, None)
            self._patched_fit_loop = None
        if self._pending is not None:
            _, staged, _ = self._pending
            self._pending = None
            if staged is not None and self._arena is not None:
                self._arena.release(staged.slot)
        if self._inflight is not None:
            with contextlib.suppress(Exception):  # reported by the persist thread
                self._inflight.fence_training()
            self._inflight = None
        if self._persister is not None:
            self._persister.close(timeout=self.shutdown_timeout, abort=abort)
            self._persister = None
        if self._agent is not None:
            self._agent.close()
            self._agent = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def _on_train_loader(self, loader: object, trainer: Any) -> None:
        wrapper = _data.install(loader)
        if self._pending_loaders:
            count = self._pending_loaders_count
            index = count - len(self._pending_loaders)
            pending = self._pending_loaders.pop(0)
            recorder = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
            if isinstance(recorder, _data.DrawRecorder) and isinstance(pending, dict) and self._exact_data:
                recorder.replay = pending.get("draw_rng")  # (the rest of its position is Lightning's to restore)
            if wrapper is not None and pending is not None:
                epoch = trainer.current_epoch if self._loader_epoch is None else self._loader_epoch
                target = _data.plan_resume(wrapper, loader, pending, self._exact_data, epoch)
                if target is not None and count == 1 and index == 0:
                    self._shift_batch_counters(trainer, target)
                elif target is not None:
                    warnings.warn(
                        "lightning-snapshot: with several train dataloaders, the epoch's batch count after a"
                        " change of the number of processes follows Lightning's restored count, not the"
                        " data left",
                        stacklevel=2,
                    )
        workers = int(getattr(loader, "num_workers", 0) or 0)
        if (
            self._resumed == "mid"
            and _data.is_stateful(loader)
            and workers > 0
            and "workers" not in self._warned_loaders
        ):
            self._warned_loaders.add("workers")
            warnings.warn(
                f"lightning-snapshot: the train loader ({type(loader).__name__}) restores its own position, and its"
                f" {workers} worker processes restart their global RNG (torch, numpy, random) from their"
                " seeds: random augmentation drawn there is not resumed exactly. Keep the augmentation's RNG in the"
                " dataset's state_dict(), or use a torch DataLoader (lightning-snapshot restores its workers' RNG)",
                stacklevel=2,
            )
        held = _data.dataset_generators(getattr(loader, "dataset", None))
        if held and "generators" not in self._warned_loaders:
            self._warned_loaders.add("generators")
            warnings.warn(
                f"lightning-snapshot: the train dataset holds random generators of its own ({', '.join(held)}):"
                " lightning-snapshot restores the global RNGs (torch, numpy, python; in loader workers too), not"
                " these, so a resumed run draws differently from them. Draw from the global RNGs (torch.rand,"
                " np.random, random), or give the dataset state_dict()/load_state_dict() and use torchdata's"
                " StatefulDataLoader",
                stacklevel=2,
            )
        reason = _data.unsupported_reason(loader)
        if reason is not None and id(type(loader)) not in self._warned_loaders:
            self._warned_loaders.add(id(type(loader)))
            warnings.warn(
                f"lightning-snapshot cannot restore the exact position of a train dataloader: {reason}.", stacklevel=2
            )

    @staticmethod
    def _shift_batch_counters(trainer: Any, consumed: int) -> None:
        """Make the restored epoch count ``consumed`` batches as done, so that the batches left in this rank's stream
        end the epoch exactly at the loader's length (after a change of the number of data-parallel ranks the same
        global sample is a different batch index). Only the epoch's ``current`` counters move, all by the same
        amount, so Lightning's restart repair (``completed += 1``) still applies; totals are untouched."""
        current = trainer.fit_loop.epoch_loop.batch_progress.current
        delta = consumed - current.ready
        if delta:
            current.ready += delta
            current.started += delta
            current.processed += delta
            current.completed += delta

    # ------------------------------------------------------------------------------------------- resume
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._restore(trainer, pl_module)
        self._make_loaders_as_saved(trainer)
        # Train loaders that exist already (a tuner such as LearningRateFinder ran the fit loop in its on_fit_start,
        # and Lightning keeps the loaders it set up) are not processed again: follow them, and resume them, now
        combined = getattr(trainer.fit_loop, "_combined_loader", None)  # private: the fit loop's loaders
        loaders = getattr(combined, "flattened", None) or []
        for loader in loaders:
            self._on_train_loader(loader, trainer)
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)  # private: it holds the epoch's iterators
        if loaders and fetcher is not None and self._resumed is not None:
            # Lightning created the epoch's iterators when it set the loaders up, before this restore, and does not
            # create them again for a resumed epoch: create them now, from the restored position (as Lightning
            # does when it sets the loaders up after a restore)
            iter(fetcher)

    def _make_loaders_as_saved(self, trainer: Any) -> None:
        """A resumed run makes its train loaders as the interrupted run last made them: Lightning calls
        ``train_dataloader()`` with ``trainer.current_epoch`` at the epoch it last (re)loaded them at in that run (a
        curriculum that reads the epoch), and ``reload_dataloaders_every_n_epochs`` reloads them at the same epochs
        as in that run (at an epoch boundary: after the restored RNG, which the reload's new iterator draws from).
        Lightning itself makes them with the restored epoch and counts the reloads from it. One shot: the fit
        loop's next ``setup_data`` only."""
        saved = self._restored_fit_state
        made = saved.get("train_dl_epoch") if isinstance(saved, dict) else None
        fit_loop = trainer.fit_loop
        if not isinstance(made, int) or isinstance(made, bool) or not 0 <= made < trainer.current_epoch:
            return  # (not resumed, a snapshot of an older version, or made at the restored epoch: as Lightning does)
        original = fit_loop.setup_data

        def setup_data() -> None:
            if not self._hooked(trainer):  # (a tuner's own run of the loops)
                original()
                return
            fit_loop.__dict__.pop("setup_data", None)
            progress = fit_loop.epoch_progress.current
            epoch = progress.completed  # (trainer.current_epoch)
            self._loader_epoch = epoch
            progress.completed = made
            try:
                original()  # (sets _last_train_dl_reload_epoch to the epoch it made them at)
            finally:
                progress.completed = epoch
                self._loader_epoch = None

        fit_loop.setup_data = setup_data
        self._patched_setup_data = fit_loop

    def _restore(self, trainer: Any, pl_module: Any) -> None:
        if is_sharded(trainer.strategy):
            self._check_placements(pl_module)
        if self.resume is False:
            return
        # (the one given to fit, seen at setup: a tuner such as LearningRateFinder sets trainer.ckpt_path to its own
        # temporary checkpoint in its on_fit_start)
        if self._fit_ckpt_path:
            log.info(
                "lightning-snapshot: fit(ckpt_path=%r) was given; not resuming from a snapshot", self._fit_ckpt_path
            )
            return
        t0 = time.monotonic()
        candidates = self._candidates(report=True)
        if not candidates:
            if self.resume is not True:
                raise SnapshotNotFoundError(
                    f"resume={self.resume!r}: no committed snapshot matches it in {[t.url for t in self.tiers]}"
                )
            return
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
            if not self._comm.all_true(fatal is None):
                raise fatal or SnapshotError(f"restoring the {where} failed on another rank (see its log)")
            if self._comm.all_true(error is None):
                shared, rank_state = cast("tuple[dict[str, Any], Any]", loaded)  # (read without an error everywhere)
                restore_shared(
                    trainer, pl_module, shared, where, live, load_callbacks=self._preloaded != (backend.url, step)
                )
                self._apply_rank_state(trainer, rank_state)
                _fit_state.realias_lottery_tickets(trainer, trainer.current_epoch)
                self._record_restore(backend, step)
                self._restored_fit_state = _fit_state.saved_state(shared)
                _fit_state.prune_checkpoints(trainer, self._restored_fit_state, step)
                self._restore_ddp_layout(trainer, rank_state, where)
                self._last_step = step
                seconds = time.monotonic() - t0
                self.restored_from = (backend.url, step, seconds)
                self._metrics.add("restore/ms", seconds * 1000)
                self._metrics.add("restore/step", step)
                if self.restore_stats is not None:
                    self._metrics.add("restore/bytes_read", self.restore_stats["bytes_read"] or 0)
                if backend in self.tiers:
                    self._metrics.add("restore/tier_index", self.tiers.index(backend))
                rank_zero_info(
                    f"lightning-snapshot: restored step {step} from the {backend.tier} tier {backend.url}"
                    f" in {seconds:.2f} s"
                )
                return
            reason = str(error) if error is not None else "it failed to load on another rank"
            reasons.append(f"step {step} ({backend.tier} {backend.url}): {reason}")
            if self.resume is not True:
                break
            if self._comm.rank == 0:
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

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        resumed, self._resumed = self._resumed, None
        saved, self._restored_fit_state = self._restored_fit_state, None
        if resumed is None:
            return
        _fit_state.restore_stop(trainer, saved, trainer.global_step)
        _fit_state.restore_generators(pl_module, saved)
        # Lightning's restart logic is made for checkpoints taken inside a step (at on_train_batch_end, on
        # validation end, at epoch end); a snapshot is the state right before the next batch is fetched, so the
        # restored loops must neither repeat nor skip anything from there.
        fit_loop = trainer.fit_loop
        epoch_loop = fit_loop.epoch_loop
        if resumed == "boundary":
            # a finished epoch: the next one starts as in a run that never stopped (its start hooks, a new loader
            # iterator, counters from zero)
            _Loop.restarting.fset(fit_loop, False)  # type: ignore[attr-defined]  # mypy does not type a property's fset
            fit_loop._resuming_from_checkpoint = False
            _fit_state.restore_grads(pl_module, saved)
            _compat.reinstate_swalr_after_averaging(trainer, pl_module)
            if self._pending_rng is not None:
                restore_rng(self._pending_rng)
                self._pending_rng = None
            return
        # Within an epoch. The fit loop would stay "restarting" until the epoch ends and then skip the epoch-end
        # plateau scheduler step; its start hooks ran before the snapshot, which its counters already say.
        fit_loop._restarting = False
        # What the epoch's start hooks set up, which do not run again: SWA's SWALR, the gradient accumulation
        # (GradientAccumulationScheduler), and the epoch's accumulated training metrics.
        _compat.reinstate_epoch_start_schedulers(trainer, pl_module)
        _compat.reinstate_swalr_after_averaging(trainer, pl_module)
        _fit_state.restore_in_epoch(trainer, saved)
        # The epoch loop keeps its counters while it resets (restarting), and must then not take its restart path
        # on the first batch: that would re-run or fast-forward step N's validation, which the snapshot holds done.
        original = epoch_loop.on_run_start

        def on_run_start(data_fetcher: Any) -> None:
            epoch_loop.__dict__.pop("on_run_start", None)
            original(data_fetcher)
            epoch_loop._restarting = False

        epoch_loop.on_run_start = on_run_start

    @staticmethod
    def _check_placements(pl_module: Any) -> None:
        """Fail at the start of fit, not at the first snapshot, when a sharded layout cannot be stored as boxes."""
        for name, param in pl_module.named_parameters():
            if is_dtensor(param):
                try:
                    dtensor_box(param, name)
                except CaptureError as e:
                    raise ConfigError(f"SnapshotCallback cannot snapshot this model's sharding: {e}") from None

    def _candidates(self, report: bool = False) -> list[tuple[Backend, int]]:
        """Snapshots to try, newest first (ties: tier order). Rank 0 decides; every rank gets the same list.

        With ``resume=True``, unhealthy snapshots (unless ``resume_unhealthy``) and snapshots restored
        ``max_restores`` times are left out; ``report``: rank 0 gives the warnings that say so (once per fit).

        Raises:
            SnapshotNotFoundError: every committed snapshot was left out that way.
        """
        if isinstance(self.resume, str):
            backend, step = resolve_source(self.resume)
            steps = [step] if step is not None else committed_steps(backend)[:1]
            return [(backend, s) for s in steps]
        found: list[tuple[int, int]] = []
        unlisted: list[str] = []
        messages: list[str] = []
        skipped_all: str | None = None
        collective: dict[int, list[int]] = {}
        for i, tier in enumerate(self.tiers):
            steps_of = getattr(tier, "collective_steps", None)
            if steps_of is not None and getattr(tier, "node_local", False):  # a node-local tier: what any node holds
                collective[i] = steps_of(self._tier_comms[i] if self._tier_comms else LocalComm())
        if self._comm.rank == 0:
            for i, tier in enumerate(self.tiers):
                try:
                    found += [(step, i) for step in (collective[i] if i in collective else committed_steps(tier))]
                except Exception as e:  # noqa: BLE001 - a tier that cannot be listed may hold the newest snapshot
                    redact = getattr(tier, "redact", str)
                    detail = str(e) if isinstance(e, SnapshotError) else f"{type(e).__name__}: {redact(str(e))}"
                    unlisted.append(f"cannot list the {tier.tier} tier {tier.url!r} to resume from it ({detail})")
            found.sort(key=lambda x: (-x[0], x[1]))
            if not isinstance(self.resume, bool):
                found = [f for f in found if f[0] == self.resume][:1]
            if not unlisted:
                found, messages, skipped_all = self._apply_resume_policy(found)
        found, problem, messages, skipped_all = self._comm.broadcast(
            (found, "; ".join(unlisted), messages, skipped_all) if self._comm.rank == 0 else None
        )
        if problem:
            # it may hold the newest snapshot: starting from an older one or fresh could overwrite its history
            raise TierUnavailableError(
                f"lightning-snapshot: {problem}. Fix access to the tier and run again, or pass"
                " resume=False to start fresh without reading it (snapshots are still taken;"
                " an object store never overwrites a committed step, so give it a new prefix"
                " too)"
            )
        if report and self._comm.rank == 0:
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
        if self.resume is not True:
            return found, [], None
        plan = plan_resume(candidates, max_restores=self.max_restores, resume_unhealthy=self.resume_unhealthy)
        return [(c.step, c.tier) for c in plan.candidates], list(plan.warnings), plan.problem

    def _record_restore(self, backend: Backend, step: int) -> None:
        """Collective, right after a restore from one of this callback's tiers and before training goes on: rank 0
        records it (the step's restore count + 1) in every tier holding that step; a tier that cannot be
        written gives a warning (the resume goes on)."""
        problem = None
        if self._comm.rank == 0 and backend in self.tiers:
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
        if not self._comm.all_true(problem is None) and problem is not None:
            warnings.warn(
                f"lightning-snapshot: could not record the restore of step {step} ({problem}); the"
                " crash-loop breaker (max_restores) does not count this restore there",
                stacklevel=2,
            )

    def _read(
        self, backend: Backend, step: int, trainer: Any, pl_module: Any, live: Templates
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        return self._through_tier(backend, step, lambda: self._read_tier(backend, step, trainer, pl_module, live))

    def _read_tier(
        self, backend: Backend, step: int, trainer: Any, pl_module: Any, live: Templates
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        manifest = read_manifest(backend, step)
        where = f"snapshot of step {step} in the {backend.tier} tier {backend.url!r}"
        saved_model = manifest.state.get("state_dict") if isinstance(manifest.state, dict) else None
        if isinstance(saved_model, dict) and not is_sharded(trainer.strategy):
            pruned = adopt_pruning(pl_module, saved_model)
            if pruned:  # (ModelPruning had pruned them): the model reads into its new tensors
                live.model.clear()
                live.model.update(pl_module.state_dict())
                log.info("lightning-snapshot: %d pruned parameter(s) reparametrized as in the snapshot", len(pruned))
        # the model's own tensors are read into directly (verified chunk by chunk); under a sharded strategy the
        # optimizer state too, and each rank reads only its shards; the rest is allocated
        targets = restore_targets(trainer, live, manifest.state, where)
        stats = ReadStats()
        counted = getattr(backend, "bytes_read", None)
        shared = read_section(backend, manifest, manifest.tensors, manifest.state, targets=targets, stats=stats)
        after = getattr(backend, "bytes_read", None)
        self.restore_stats = {
            "bytes_needed": stats.bytes_needed,
            "bytes_read": stats.bytes_read,
            "tier_bytes_read": after - counted if isinstance(counted, int) and isinstance(after, int) else None,
            "tensors_resharded": stats.tensors_resharded,
        }
        if not isinstance(shared, dict):
            raise SnapshotError(f"{where} holds no training state")
        check_model(pl_module, shared.get("state_dict"), where)
        rank_state = None
        section = manifest.rank_section(self._comm.rank)
        if manifest.world_size != self._comm.world_size:
            warnings.warn(
                f"lightning-snapshot: the {where} was taken with {manifest.world_size} process(es), this run has"
                f" {self._comm.world_size}: weights, optimizer and loop state are restored, and the data continues"
                " from the saved global sample, but per-rank RNG is not restored, so the run will not be bitwise"
                " identical to an uninterrupted one.",
                stacklevel=2,
            )
            # the data position, as a global sample count, from rank 0's section (the same on every rank)
            first = manifest.rank_section(0)
            if first is not None:
                saved = read_section(backend, manifest, first.tensors, first.state)
                rank_state = {
                    "rng": None,
                    "loaders": saved.get("loaders", []),
                    "exact": False,
                    "late": saved.get("late"),
                }
        elif section is not None:
            rank_state = read_section(backend, manifest, section.tensors, section.state)
        # loops, callbacks, schedulers: taken with the rank state, right before the next step (this rank's own)
        late = rank_state.get("late") if isinstance(rank_state, dict) else None
        if isinstance(late, dict):
            shared.update(late)
        if "loops" not in shared:
            raise SnapshotError(f"{where} holds no training state")
        _fit_state.merge_param_groups(shared, where)  # the optimizer's groups as they were with the late state
        check_optimizers(trainer, shared, where)  # before anything is applied
        return shared, rank_state

    def _apply_rank_state(self, trainer: Any, rank_state: dict[str, Any] | None) -> None:
        progress = trainer.fit_loop.epoch_progress.current
        # a snapshot taken when an epoch had just ended (the end of training) starts the next epoch from its
        # beginning; any other continues the epoch it was taken in (see on_train_start)
        self._resumed = "boundary" if progress.ready == progress.processed else "mid"
        if rank_state is None:
            return
        self._pending_rng = rank_state.get("rng")
        self._pending_loaders = list(rank_state.get("loaders", []))
        self._pending_loaders_count = len(self._pending_loaders)
        self._exact_data = rank_state.get("exact", True)
        if self._pending_loaders and all(p is not None for p in self._pending_loaders):
            # Lightning cannot see that our sampler restores the position of plain DataLoaders, and would warn
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")

    def _restore_ddp_layout(self, trainer: Any, rank_state: dict[str, Any] | None, where: str) -> None:
        """Give DDP the gradient-bucket layout the snapshot's process all-reduced with (see ``ddp_layout``).

        Called on every rank together in ``on_fit_start``: the strategy has wrapped the model in DDP and nothing has
        run a forward through it yet (the sanity check and training come later). The layout is untrusted input: it
        is applied only when every rank holds the same layout and it fits the live DDP module (the parameters that
        require grad, their sizes and dtypes); otherwise a warning names why and the resume goes on without it (the
        weights and all other state are restored either way; only the float summation order of the next
        all-reduces may differ from an uninterrupted run). Only at the same world size (``_read_tier`` passes no
        layout after a change of the number of processes) and only into DDP (another strategy has no buckets).
        """
        model = trainer.strategy.model
        if not is_ddp(model) or self._comm.world_size < 2:
            return
        layout = rank_state.get("ddp_layout") if isinstance(rank_state, dict) else None
        if not _ddp_layout_enabled():
            layout = None
        problem = None
        try:
            check_layout(model, layout)
        except ValueError as e:
            problem = str(e)
        except (AttributeError, TypeError, RuntimeError) as e:  # torch's private internals changed
            problem = f"this torch is not supported ({type(e).__name__}: {e})"
        first = self._comm.broadcast(layout)
        if problem is None and layout != first:
            problem = f"rank {self._comm.rank} holds another layout than rank 0"
        none_stored, all_fit = self._comm.all_true_each([layout is None, problem is None])
        if none_stored:  # taken before this feature, without DDP, or where DDP never rebuilds; or turned off
            return
        if not all_fit:
            warnings.warn(
                f"lightning-snapshot: the {where} holds a DDP gradient-bucket layout that is not applied"
                f" ({problem or 'it does not fit on another rank'}); the resume goes on without it, so"
                " with 3 or more ranks the next steps may differ in the last bits from an uninterrupted"
                " run",
                stacklevel=2,
            )
            return
        error: BaseException | None = None
        try:
            apply_layout(model, layout)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            error = e
        if not self._comm.all_true(error is None):
            raise SnapshotError(
                f"giving DDP the gradient-bucket layout of the {where} failed"
                f" ({f'{type(error).__name__}: {error}' if error is not None else 'on another rank'}); set"
                f" {DDP_LAYOUT_ENV}=0 to resume without it (with 3 or more ranks not bitwise identical to an"
                " uninterrupted run)"
            ) from error
        log.debug("lightning-snapshot: DDP gradient-bucket layout restored: %s", first["buckets"])

    # ------------------------------------------------------------------------------------------- capture
    def _before_fetch(self, trainer: Any) -> None:
        """Right before the training loop fetches a batch: the point a snapshot's RNG, data position, loops,
        callbacks and schedulers are taken at, and restored at."""
        if self._pending_rng is not None:
            restore_rng(self._pending_rng)  # where the interrupted run took it
            self._pending_rng = None
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        index = int(getattr(fetcher, "fetched", 0))
        if getattr(fetcher, "length", 0) is None:
            # a loader without a length is fetched one batch ahead: keep what Lightning would save for a stateful
            # loader before each fetch, so that a snapshot records the position of the first batch not consumed
            combined = getattr(trainer.fit_loop, "_combined_loader", None)
            states = combined._state_dicts() if combined is not None else []
            if states:
                self._fetch_states = {i: v for i, v in self._fetch_states.items() if i >= index - 2}
                self._fetch_states[index] = states
        if self._pending is not None:
            t0 = time.perf_counter()
            self._finish(trainer)
            self._stall += time.perf_counter() - t0

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._fence_if_retrained(trainer)

    def _fence_if_retrained(self, trainer: Any) -> None:
        """A snapshot in flight copies the parameters the optimizers trained when it was staged while training goes
        on. If a hook has frozen one since (``BackboneFinetuning``-style callbacks at an epoch's start, after that
        epoch's last snapshot was finished), code in the coming step may change it in place, even through ``.data``
        which no version counter sees: the copy is waited for now, before that step (counted as stall)."""
        staged = self._inflight
        if staged is None or staged.fenced.is_set() or not trainer.optimizers:
            return
        if optimized_key(trainer.optimizers) != staged.frozen_key:
            self._fence_copy()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._fence_if_retrained(trainer)
        if self._inflight is not None and self._inflight.copied.is_set():
            self._inflight.settle()  # (copied before training_step: committed without waiting for the step)
        if self._pending_rng is not None:  # (a loop that fetched without the epoch loop's fetch hook)
            restore_rng(self._pending_rng)
            self._pending_rng = None
        if self._pending is not None:
            t0 = time.perf_counter()
            self._finish(trainer, consumed_offset=1)
            self._stall += time.perf_counter() - t0

    def _fence_copy(self) -> bool:
        """Wait until the weights and optimizer state of the snapshot in flight are copied (counted as stall);
        False when none is in flight."""
        if self._inflight is None:
            return False
        t0 = time.perf_counter()
        staged = self._inflight
        with contextlib.suppress(Exception):  # the persist thread reports it
            staged.fence_training()
        if staged.torn and self._arena is not None:  # (not committed: the persist thread warns)
            self._arena.copy_at_once([t for _, t in staged.torn])
        self._stall += time.perf_counter() - t0
        self._inflight = None
        self._copied = True
        return True

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # parameters and optimizer state change in the step that follows: the copy must be complete
        if self._fence_copy() or self._copied:
            self._metrics.add("snapshot/stall_ms", self._stall * 1000)
            self._stall = 0.0
            self._copied = False

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step != self._last_step:
            self._time_step()
        self._collect_results(step)
        if step != self._last_step:
            if not self._last_snap_step:
                self._last_snap_step = [self._last_step] * len(self.tiers)  # the step this fit started from
            self._last_step = step
            if not self._maybe_snapshot(trainer, pl_module, step):
                self._prepare_arena(trainer, pl_module, step)
        self._metrics.flush(trainer)

    def _frozen(self, trainer: Any) -> tuple[Callable[[Any], bool], Any]:
        """The frozen-tensor predicate, computed only if the arena asks (it does not while its plan holds), and
        what it depends on (which parameters the optimizers train: a plan made under other ones is not reused)."""
        made: list[Callable[[Any], bool]] = []

        def frozen(t: Any) -> bool:
            if not made:
                made.append(frozen_predicate(trainer.optimizers))
            return made[0](t)

        return frozen, optimized_key(trainer.optimizers)

    def _prepare_arena(self, trainer: Any, pl_module: Any, step: int) -> None:
        """Off the snapshot steps, get the arena ready for the next snapshot, so that it does not wait.

        After the first optimizer step (the optimizer state exists, so the state has its size): plan the snapshot
        and allocate its slot in a background thread. Later, when a snapshot is due within two steps and every slot
        is still being persisted: allocate another slot in the background (double buffering, only when needed).
        """
        arena = self._arena
        if arena is None:
            return
        if not self._planned:
            self._planned = True
            try:
                frozen, key = self._frozen(trainer)
                arena.plan_ahead(
                    capture_shared_live(trainer, pl_module, arena.live),
                    frozen,
                    rank=self._comm.rank,
                    world_size=self._comm.world_size,
                    frozen_key=key,
                )
            except Exception as e:  # noqa: BLE001 - the snapshot itself reports what cannot be captured
                log.debug("lightning-snapshot: planning ahead failed (%s); the first snapshot plans itself", e)
            return
        size = arena.planned_bytes
        if size is None or not arena.busy():
            return
        if any(self._steps_to_due(i, step) in (1, 2) for i in range(len(self.tiers))):
            arena.reserve(size)

    def _steps_to_due(self, index: int, step: int) -> int | None:
        """Optimizer steps from ``step`` until tier ``index`` is next due by its step schedule (None: no such)."""
        tier = self.tiers[index]
        if tier.every_n_train_steps is None:
            return None
        if tier.auto_every:
            last = self._last_snap_step[index] if self._last_snap_step else step
            return max(0, last + tier.every_n_train_steps - step)
        return -step % tier.every_n_train_steps

    # ------------------------------------------------------------------------------------------- every="auto"
    def _time_step(self) -> None:
        """One optimizer step ended (every rank's clock; only rank 0's decides): give its wall time to the meter."""
        if self._meter is None:
            return
        now = time.perf_counter()
        if self._step_clock is not None:
            self._meter.step(now - self._step_clock - self._paused)
        self._step_clock, self._paused = now, 0.0

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._validation_clock = time.perf_counter()
        # validation may change the weights in place and back (WeightAveraging swaps the averaged weights in for
        # it): the copy of a snapshot's weights must be complete before
        self._fence_copy()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        # validation inside training is not a step's time (the meter would count it against a tier in flight)
        if self._validation_clock is not None:
            self._paused += time.perf_counter() - self._validation_clock
            self._validation_clock = None

    def _retune(self) -> None:
        """New intervals for the ``"auto"`` tiers, from rank 0's measurements, at a step every rank snapshots."""
        if self._meter is None:
            return
        meter = self._meter
        proposal = []
        for tier, cost in zip(self.tiers, (meter.cost(i) for i in range(len(self.tiers))), strict=True):
            step_s = meter.step_seconds
            if not tier.auto_every or cost is None or step_s is None:
                proposal.append(tier.every_n_train_steps)
            else:
                proposal.append(young_daly_steps(cost, self._mtbf_s, step_s, tier.min_every, tier.max_every))
        if self._comm.world_size > 1:
            proposal = self._comm.broadcast(proposal)  # the same snapshot steps on every rank
        for i, (tier, steps) in enumerate(zip(self.tiers, proposal, strict=True)):
            if not tier.auto_every or steps is None:  # (an "auto" tier always has an interval)
                continue
            tier.every_n_train_steps = int(steps)
            name = self._metric_names[i]
            self._metrics.add(f"snapshot/{name}/interval_steps", tier.every_n_train_steps)
            cost = meter.cost(i)
            if cost is not None:
                self._metrics.add(f"snapshot/{name}/cost_ms", cost * 1000)
            old = self._logged_interval[i] or tier.every_n_train_steps
            if max(old, tier.every_n_train_steps) > 2 * min(old, tier.every_n_train_steps):
                self._logged_interval[i] = tier.every_n_train_steps
                if self._comm.rank == 0:
                    log.info(
                        "lightning-snapshot: the %s tier %s now snapshots every %d steps (was %d): measured"
                        " cost %.1f ms per snapshot, step %.1f ms, MTBF %.0f s",
                        tier.tier,
                        tier.url,
                        tier.every_n_train_steps,
                        old,
                        (meter.cost(i) or 0) * 1000,
                        (meter.step_seconds or 0) * 1000,
                        self._mtbf_s,
                    )
        if meter.step_seconds is not None:
            self._metrics.add("snapshot/step_ms", meter.step_seconds * 1000)

    def _maybe_snapshot(self, trainer: Any, pl_module: Any, step: int) -> bool:
        """Take the snapshot of ``step`` if one is due in some tier; returns whether one was due."""
        now = time.monotonic()
        last = self._last_snap_step or [self._fit_start_step] * len(self.tiers)
        due = [i for i, t in enumerate(self.tiers) if t.is_due(step, now - self._last_time[i], step - last[i])]
        if any(t.train_time_interval is not None for t in self.tiers):
            due = self._comm.broadcast(due)  # wall clocks differ across ranks; rank 0 decides
        if not due:
            return False
        self._retune()  # (a step every rank snapshots: every rank takes rank 0's intervals here)
        t0 = time.perf_counter()
        # background failures stop every rank together, at this collective point
        if not self._comm.all_true(not (self._errors and self.on_error == "raise")):
            self._raise_background_error()
        for i in due:
            self._last_time[i] = now
            if self._last_snap_step:
                self._last_snap_step[i] = step
        # Parameters, optimizer state, schedulers and loops stay frozen until the next optimizer.step: they are
        # copied in the background. Buffers (forward changes them) are copied now. The rank state follows at the
        # next batch, right before training_step.
        staged = self._stage_shared(trainer, pl_module, step)
        if staged is None:
            return True
        self._metrics.add("snapshot/bytes", staged.state.nbytes)
        self._inflight = staged
        self._pending = (step, staged, due)
        if self._meter is not None:
            for i in due:
                self._meter.opened(i)
        self._stall = time.perf_counter() - t0
        return True

    def _stage_shared(self, trainer: Any, pl_module: Any, step: int, last: bool = False) -> AsyncStaged | None:
        """Stage the model and optimizer state of ``step`` (collective: every rank stages its own share, and they
        agree); None when some rank could not (an error is handled, an arena without room is warned and, unless it
        is fit's ``last`` snapshot, counted). Records the model's signature (see :meth:`_restage_if_changed`)."""
        staged: AsyncStaged | None = None
        error: SnapshotError | None = None
        assert self._arena is not None
        self._planned = True  # (the first snapshot plans itself if no earlier step did)
        try:  # every rank stages (and later writes) its own share of the replicated state
            shared = capture_shared_live(trainer, pl_module, self._arena.live)
            frozen, key = self._frozen(trainer)
            self._staged_signature = (shared_signature(trainer, pl_module, self._arena.live, shared), key)
            staged = self._arena.stage_async(
                shared,
                frozen,
                step,
                rank=self._comm.rank,
                world_size=self._comm.world_size,
                frozen_key=key,
            )
        except SnapshotError as e:
            error = e
        if self._comm.all_true(error is None and staged is not None):
            return staged
        if staged is not None:
            self._arena.release(staged.slot)
        if error is not None:
            self._handle(error, step)
            return None
        reason = self._arena.last_skip_reason if staged is None else "another rank could not stage it"
        if last:
            warnings.warn(f"lightning-snapshot: no snapshot of the last step {step}: {reason}", stacklevel=2)
            return None
        self._skipped += 1
        self._metrics.add("snapshot/skipped", self._skipped)
        warnings.warn(
            f"lightning-snapshot: skipped the snapshot of step {step}: {reason}. Raise max_host_bytes or snapshot"
            " less often.",
            stacklevel=2,
        )
        return None

    def _restage_if_changed(self, trainer: Any, step: int, staged: AsyncStaged) -> AsyncStaged | None:
        """At the late capture point: if the model's tensors or the optimizer state were changed or replaced after
        they were staged at ``on_train_batch_end`` (epoch-end and validation hooks may: ``ModelPruning`` prunes and
        resets weights, ``StochasticWeightAveraging`` copies its averages in), stage them again, now, so that the
        snapshot is the state before the next step. Collective (every rank restages if any must). None: the snapshot
        is dropped."""
        pl_module = trainer.lightning_module
        # (and whether the optimizers still train the same parameters: a parameter frozen at the start of an epoch
        # is one user code may now change in place during the step, which only a copy made at once keeps)
        live = self._arena.live if self._arena is not None else None
        now = (shared_signature(trainer, pl_module, live), optimized_key(trainer.optimizers))
        if self._comm.all_true(now == self._staged_signature and not staged.changed()):
            return staged  # (nor was the optimizer state: a callback may reset it at the end of an epoch)
        log.debug("lightning-snapshot: the model changed after step %d was staged; staging it again", step)
        with contextlib.suppress(Exception):  # the persist thread reports it
            staged.fence_training()
        if self._inflight is staged:
            self._inflight = None
        assert self._arena is not None
        self._arena.release(staged.slot)
        restaged = self._stage_shared(trainer, pl_module, step)
        self._inflight = restaged
        return restaged

    def _end_of_fit(self, trainer: Any, pl_module: Any) -> None:
        """Fit ends with a snapshot of its last step in every tier (a later, longer run continues from it), taken
        when the training loop ends, before any ``on_train_end`` hook: those may change the weights
        (``WeightAveraging`` copies the averaged weights into the model there), and a run that never stopped would
        not have run them. Returns once the weights are copied."""
        if self._persister is None or self._ended:
            return
        self._ended = True
        self._persister.drain()  # the last snapshot waits for room in every tier instead of being skipped
        step = trainer.global_step
        if self._pending is None or self._pending[0] != step:
            if self._pending is not None:
                self._finish(trainer)
            self._final_snapshot(trainer, pl_module, step)
        elif set(self._pending[2]) != set(range(len(self.tiers))):
            self._pending = (step, self._pending[1], list(range(len(self.tiers))))
        staged = self._pending[1] if self._pending is not None else self._inflight
        if self._pending is not None:
            self._finish(trainer)  # (which may stage the weights again: then that copy is the one in flight)
        for copy in (staged, self._inflight):
            if copy is not None:
                with contextlib.suppress(Exception):  # the persist thread reports it
                    copy.fence_training()
        self._inflight = None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_of_fit(trainer, pl_module)  # (done already when the fit loop ended normally)
        # fit returns once every snapshot is durable (or failed); tiers with a drain_timeout (object stores) are
        # waited for that long at most
        late = self._persister.drain() if self._persister is not None else []
        self._collect_results(trainer.global_step)
        for tier in late:
            i = self.tiers.index(tier)
            self._tier_problem.setdefault(
                i,
                f"its uploads did not finish within drain_timeout="
                f"{getattr(tier, 'drain_timeout', None)} s"
                f" (last error: {self._last_error(i) or 'none'})",
            )
            warnings.warn(
                f"lightning-snapshot: the {tier.tier} tier {tier.url!r} did not finish its uploads within"
                f" drain_timeout={getattr(tier, 'drain_timeout', None)} s; {self._holders()}",
                stacklevel=2,
            )
        self._metrics.flush(trainer)
        if not self._comm.all_true(not (self._errors and self.on_error == "raise")):
            self._raise_background_error()
        self._check_durable()

    def _last_error(self, index: int) -> str | None:
        return self._persister.last_error(index) if self._persister is not None else None

    def _holders(self) -> str:
        """Which tiers hold the last snapshot taken for a durable tier in this fit (from the results so far)."""
        step = self._last_durable_due
        held = [f"{t.tier} {t.url}" for i, t in enumerate(self.tiers) if self._committed.get(i, -1) >= (step or 0)]
        return f"step {step} is held by {', '.join(held)}" if held else f"no tier holds step {step} yet"

    def _check_durable(self) -> None:
        """End of fit (collective): the last snapshot taken in this fit must be held by some durable tier; if it is
        not, raise :class:`NotDurableError` (``on_error="raise"``) or log an error (``"warn"``), naming each durable
        tier and why it does not hold it."""
        step = self._last_durable_due
        durable = [i for i, t in enumerate(self.tiers) if t.durable]
        problem = None
        if step is not None and durable and not any(self._committed.get(i, -1) >= step for i in durable):
            why = "; ".join(
                f"the {self.tiers[i].tier} tier {self.tiers[i].url!r}: "
                + (self._tier_problem.get(i) or f"it was not given step {step}")
                for i in durable
            )
            ram = [t.url for i, t in enumerate(self.tiers) if not t.durable and self._committed.get(i, -1) >= step]
            only = f" Only the memory of the RAM tier holds it ({', '.join(ram)})." if ram else ""
            problem = f"{why}.{only}"
        message = self._agree_problem(problem)
        if message is None:
            return
        text = (
            f"lightning-snapshot: the last snapshot of this fit (step {step}) is not durable: no durable tier"
            f" holds it. {message} Fix the tier (see the reason), then rerun to resume from the newest snapshot"
            " that is durable"
        )
        if self.on_error == "raise":
            raise NotDurableError(text)
        log.error("%s (on_error='warn': fit returns normally)", text)
        warnings.warn(text, stacklevel=2)

    def _final_snapshot(self, trainer: Any, pl_module: Any, step: int) -> None:
        """Stage the state of the last step for every tier (synchronously: training is over)."""
        if step <= self._fit_start_step or self._arena is None:
            return  # nothing trained in this fit: the step it started from is already held
        if self._inflight is not None:
            self._inflight.fence_training()
            self._inflight = None
        staged = self._stage_shared(trainer, pl_module, step, last=True)
        if staged is None:
            return
        staged.settle()  # (training is over: nothing changes it while it is copied)
        self._staged_signature = None  # (staged right now)
        self._pending = (step, staged, list(range(len(self.tiers))))

    def _rank_state(self, trainer: Any, consumed: int) -> dict[str, Any]:
        epoch_progress = trainer.fit_loop.epoch_progress.current
        ended = epoch_progress.ready == epoch_progress.processed  # the fit loop counted the epoch as finished
        batches = trainer.fit_loop.epoch_loop.batch_progress
        # max_steps can end training inside an epoch, and Lightning then counts that epoch as finished too: the
        # snapshot records it as unfinished, so that a longer run continues it from the next batch
        unfinished = ended and not batches.is_last_batch and consumed < trainer.num_training_batches
        boundary = ended and not unfinished  # training ended with an epoch: the next starts from its beginning
        epoch = trainer.current_epoch - 1 if unfinished else trainer.current_epoch
        # (at an epoch boundary only persistent loader workers carry something into the next epoch: their RNG)
        train_loaders = _data.flatten_loaders(trainer.train_dataloader)
        # several loaders (a CombinedLoader) of a known length, fetched as they are consumed: each is at its own
        # batch (a shorter one starts again within the epoch, or ran out)
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        own = len(train_loaders) > 1 and getattr(fetcher, "length", None) is not None
        loaders = [
            _data.position(dl, epoch, 0, ended=True)
            if boundary
            else _data.position(dl, epoch, _data.own_batches(dl, consumed) if own else consumed)
            for dl in train_loaders
        ]
        # a loader fetched ahead: its state before the first batch this snapshot has not consumed (fetch indices
        # count the epoch's batches, as the loop does)
        loader_states = None if boundary else self._fetch_states.get(consumed)
        late = capture_late(trainer, trainer.lightning_module, loader_states)
        if unfinished:
            late["epoch"] = epoch
            for counters in late["loops"]["fit_loop"]["epoch_progress"].values():
                counters["processed"] -= 1
                counters["completed"] -= 1
        return {"rng": capture_rng(), "loaders": loaders, "late": late, "ddp_layout": self._ddp_layout(trainer)}

    def _ddp_layout(self, trainer: Any) -> dict[str, Any] | None:
        """DDP's rebuilt gradient-bucket layout (plain data), or None (not DDP, not rebuilt, or turned off).

        Every rank calls this at the same point on the training thread: when the rebuild is still pending (the
        snapshot of a process's first step) it is done here, with DDP's own broadcast from rank 0, exactly as the
        next forward would do it.
        """
        model = trainer.strategy.model
        if not is_ddp(model) or not _ddp_layout_enabled():
            return None
        try:
            return capture_layout(model, rebuild_pending=True)
        except (AttributeError, TypeError, RuntimeError) as e:  # torch's private internals changed
            if not self._warned_layout:
                self._warned_layout = True
                warnings.warn(
                    f"lightning-snapshot: cannot read DDP's gradient-bucket layout with this torch"
                    f" ({type(e).__name__}: {e}); snapshots are taken without it, and a resume with 3 or"
                    f" more ranks will not be bitwise identical to an uninterrupted run",
                    stacklevel=2,
                )
            return None

    def _finish(self, trainer: Any, consumed_offset: int = 0) -> None:
        """Add the rest of the state (loops, callbacks, schedulers, this rank's RNG and data position) to the
        pending snapshot and hand it to the persist thread."""
        assert self._pending is not None and self._persister is not None
        step, shared, due = self._pending
        self._pending = None
        if shared is not None and self._staged_signature is not None:
            shared = self._restage_if_changed(trainer, step, shared)
            if shared is None:
                self._close_measurements(due)
                return
        self._staged_signature = None
        if shared is not None and shared.copied.is_set():
            shared.settle()  # (copied before this step's training_step: what that changes cannot tear it)
        epoch = trainer.current_epoch
        try:
            consumed = max(0, trainer.fit_loop.epoch_loop.batch_progress.current.ready - consumed_offset)
            private = stage(self._rank_state(trainer, consumed), "rank")
        except SnapshotError as e:  # the same state shape on every rank: they all fail here together
            if shared is not None and self._arena is not None:
                shared.fence_training()
                self._arena.release(shared.slot)
            self._close_measurements(due)
            self._handle(e, step)
            return
        if any(self.tiers[i].durable for i in due):
            self._last_durable_due = step  # (the end of fit checks that some durable tier holds it)
        # a tier whose queue is full (an object store in an outage) skips this snapshot; every rank agrees
        room = self._comm.all_true_each([self._persister.has_room(i) for i in due])
        accepted = [i for i, ok in zip(due, room, strict=True) if ok]
        self._close_measurements([i for i, ok in zip(due, room, strict=True) if not ok])
        for i, ok in zip(due, room, strict=True):
            if not ok:
                self._tier_skipped[i] += 1
                self._metrics.add(f"snapshot/{self._metric_names[i]}/skipped", self._tier_skipped[i])
                self._tier_problem.setdefault(
                    i,
                    f"step {step} was skipped there: {self._persister.pending(i)}"
                    " snapshot(s) still pending (max_pending)",
                )
                log.info(
                    "lightning-snapshot: step %d skipped for the %s tier %s: %d snapshot(s) still pending there",
                    step,
                    self.tiers[i].tier,
                    self.tiers[i].url,
                    self._persister.pending(i),
                )
        self._persister.submit(PersistJob(step, epoch, shared, private, [self.tiers[i] for i in accepted]), accepted)
        for i in accepted:
            self._submitted[i] = step

    def _close_measurements(self, indices: list[int]) -> None:
        """Snapshots of these tiers that will not be written: they end their cost measurement unmeasured."""
        if self._meter is not None:
            for i in indices:
                self._meter.closed(i, measured=False)

    def _collect_results(self, step: int) -> None:
        """Turn what the persist thread finished into metrics, and failures into warnings."""
        if self._persister is None:
            return
        while not self._persister.results.empty():
            r = self._persister.results.get_nowait()
            name = self._metric_names[self.tiers.index(r.tier)] if r.tier in self.tiers else r.tier.tier
            index = self.tiers.index(r.tier) if r.tier in self.tiers else None
            if r.error is not None and index is not None and not isinstance(r.error, TornSnapshotError):
                self._tier_problem[index] = f"step {r.step} failed: {r.error}"
            if index is not None and self._meter is not None:
                self._meter.closed(index, measured=not r.abandoned and not isinstance(r.error, TornSnapshotError))
            if isinstance(r.error, TornSnapshotError):  # (every tier of that step reports it: one warning)
                if r.step not in self._torn_steps:
                    self._torn_steps.add(r.step)
                    self._skipped += 1
                    self._metrics.add("snapshot/skipped", self._skipped)
                    warnings.warn(f"lightning-snapshot: skipped the snapshot of {r.error}", stacklevel=2)
                continue
            if r.abandoned:
                warnings.warn(
                    f"lightning-snapshot: gave up uploading step {r.step} to the {r.tier.tier} tier"
                    f" {r.tier.url!r} at the end of training (drain_timeout): {r.error}",
                    stacklevel=2,
                )
                continue
            if r.error is not None:
                self._failed += 1
                self._errors.append(r.error)
                self._metrics.add("snapshot/failed", self._failed)
                policy = "training goes on (on_error='warn')" if self.on_error == "warn" else "training will stop"
                warnings.warn(
                    f"lightning-snapshot: the snapshot of step {r.step} to the {r.tier.tier} tier"
                    f" {r.tier.url!r} failed; {policy}: {r.error}",
                    stacklevel=2,
                )
                continue
            self._committed[self.tiers.index(r.tier)] = r.step
            self._tier_problem.pop(self.tiers.index(r.tier), None)
            self._metrics.add(f"snapshot/{name}/persist_ms", r.seconds * 1000)
            self._metrics.add(f"snapshot/{name}/throughput_MBps", r.nbytes / 1e6 / max(r.seconds, 1e-9))
            if r.stage_seconds is not None:
                self._metrics.add("snapshot/stage_ms", r.stage_seconds * 1000)
        for i in self._submitted:  # (a tier that never committed in this fit lags from where the fit started)
            self._metrics.add(
                f"snapshot/{self._metric_names[i]}/lag_steps", step - self._committed.get(i, self._fit_start_step)
            )
            if getattr(self.tiers[i], "retry_initial", None):
                self._metrics.add(f"snapshot/{self._metric_names[i]}/retries", self._persister.retries(i))

    def _raise_background_error(self) -> None:
        errors, self._errors = self._errors, []
        if errors:
            raise errors[0]
        raise SnapshotError("a snapshot failed to persist on another rank (see its log); stopping (on_error='raise')")

    def _handle(self, error: BaseException, step: int, tier: Backend | None = None) -> None:
        where = f" to the {tier.tier} tier {tier.url!r}" if tier is not None else ""
        if self.on_error == "raise":
            raise error
        warnings.warn(
            f"lightning-snapshot: the snapshot of step {step}{where} failed and training goes on"
            f" (on_error='warn'): {error}",
            stacklevel=2,
        )

    # ------------------------------------------------------------------------------------------- checkpoint state
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    # ------------------------------------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        """The configuration only (``ddp_spawn`` pickles the trainer and its callbacks to start its processes, before
        ``setup``): the tiers leave their locks and clients behind, and ``setup`` makes the rest in each process."""
        if (
            self._persister is not None
            or self._arena is not None
            or self._agent is not None
            or self._patched_strategy is not None
            or self._pending is not None
        ):
            raise TypeError(
                "a SnapshotCallback in use by a running fit (its persist threads, staging memory and"
                " agent connection belong to this process) cannot be pickled; pickle it before"
                " trainer.fit or after it returns"
            )
        state = dict(self.__dict__)
        for name in (
            "_comm",
            "_tier_comms",
            "_inflight",
            "_patched_loop",
            "_patched_fit_loop",
            "_patched_setup_data",
            "_fetch_states",
            "_restored_fit_state",
        ):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._comm = LocalComm()
        self._tier_comms = []
        self._inflight = None
        self._patched_loop = None
        self._patched_fit_loop = None
        self._patched_setup_data = None
        self._restored_fit_state = None
        self._fetch_states = {}
