"""Preemption: the signals a fit owns, the ranks' agreement to stop, and loader workers kept out of the way.

A preempted job gets a signal (SIGTERM from Kubernetes, SLURM or torchrun; SIGUSR1 from SLURM's ``--signal``) on one
rank, on every process, or through its launcher, and SIGKILL some seconds later. While a fit runs
:class:`Preemption` owns those signals:

- the handler (:func:`_record`) only records the signal number and when it came: no collective, no I/O, nothing
  that can block (Lightning's own handler broadcasts from inside the handler, which hangs against the training's
  collectives when one rank is signalled);
- the ranks agree once per optimizer step, at the point a snapshot is taken (right before the next batch is
  fetched, after validation and epoch-end hooks), with one all-reduce of the signal number over the library's own
  gloo group (Megatron-LM's per-iteration all-gather of a flag; never the trainer's NCCL group, so no device
  synchronisation), started at one step and read at the next (no rank waits for it): any rank's signal stops every
  rank at the same step, the one after the step it came in;
- DataLoader workers started during the fit are created with the preemption signals blocked, so a signal sent to
  the whole process group (torchrun and SLURM do) cannot kill them: a worker killed by it would otherwise crash the
  training thread mid-step before the step could be made durable.

The callback then snapshots the step into every tier, waits until a durable tier holds it (``sigterm_grace``), and
raises :class:`~lightning_snapshot.errors.Preempted`, a ``SystemExit`` with status 128 + the signal number. Pure
bookkeeping apart from the signal module: no I/O, no process group of its own (the comm is given).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from lightning_snapshot.dist.comm import Comm
from lightning_snapshot.errors import ConfigError, Preempted

__all__ = [
    "DEFAULT_SIGNALS",
    "Preemption",
    "exit_now",
    "exit_promptly",
    "overdue",
    "parse_signals",
    "requeue_slurm_job",
    "slurm_requeue_signal",
    "spawned_rank_preempted",
    "stop",
    "stop_if_preempted",
]

log = logging.getLogger(__name__)

#: seconds a preempted process may still take to clean up once its snapshot is durable, at least (or until the grace
#: ends, if later), before it exits at once (:func:`exit_promptly`)
EXIT_WITHIN = 2.0

#: The signals a fit owns unless told otherwise.
DEFAULT_SIGNALS = ("SIGTERM",)

#: [signal number of the first preemption signal (0: none), time.monotonic() when it came]: set by the handler only
#: (preallocated; the handler assigns into it and returns)
_received: list[Any] = [0, 0.0]

#: the grace of the fit that owns the signals (seconds)
_grace: list[float] = [25.0]

#: the share of the grace after which a stop no step boundary took is overdue (the rest is left for the writes)
_OVERDUE = 0.75

#: seconds past the grace after which a process still stopping exits at once
_LAST_WORD = 3.0

#: Signals that cannot be owned: they are not a preemption notice, or Python cannot handle them.
_REFUSED = {"SIGKILL", "SIGSTOP", "SIGCHLD", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGPIPE"}


def _record(signum: int, frame: Any) -> None:
    """The preemption signals' handler: record, nothing else (a second signal changes nothing)."""
    if not _received[0]:
        _received[1] = time.monotonic()
        _received[0] = signum


def parse_signals(value: Any) -> tuple[int, ...]:
    """The signal numbers of a ``preemption_signals`` option: names (``"SIGTERM"``, ``"TERM"``, ``"USR1"``) or
    numbers, one or a list; empty: Lightning's own handling is left as it is.

    Raises:
        ConfigError: naming the value that is not a signal this library can own, and what it accepts.
    """
    if value is None:
        return ()
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, Sequence):
        raise ConfigError(f"preemption_signals must be a signal name, a number or a list of them, got {value!r}")
    out: list[int] = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (str, int)):
            raise ConfigError(f"preemption_signals: {item!r} is not a signal name or number (e.g. 'SIGTERM', 'USR1')")
        try:
            sig = signal.Signals(item) if isinstance(item, int) else signal.Signals[_signal_name(item)]
        except (KeyError, ValueError):
            raise ConfigError(
                f"preemption_signals: {item!r} is not a signal of this platform (e.g. 'SIGTERM', 'SIGUSR1', 15)"
            ) from None
        if sig.name in _REFUSED:
            raise ConfigError(
                f"preemption_signals: {sig.name} cannot be a preemption signal (it cannot be handled, or it means"
                " something else); clusters send SIGTERM, SIGUSR1/SIGUSR2 (SLURM --signal), SIGINT or SIGHUP"
            )
        if int(sig) not in out:
            out.append(int(sig))
    return tuple(out)


def _signal_name(text: str) -> str:
    name = text.strip().upper()
    return name if name.startswith("SIG") else f"SIG{name}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Preemption:
    """One fit's ownership of the preemption signals and its ranks' agreement to stop.

    Args:
        signals: the signal numbers owned (:func:`parse_signals`).
        comm: the collective the ranks agree over (the library's training-thread gloo group; a single process: a
            local one). Called only from the training thread, at points every rank reaches together.
    """

    def __init__(
        self,
        signals: Sequence[int],
        comm: Comm,
        *,
        store: Any = None,
        key: str = "",
        grace: float = 25.0,
        on_overdue: Callable[[int, float], None] | None = None,
    ) -> None:
        self.signals = tuple(signals)
        self.comm = comm
        self._previous: dict[int, Any] = {}
        self._polled: int | None = None
        self._pending: Any = None  # (the all-reduce started at the previous step)
        self._iter_init: Any = None
        #: the signal number the ranks agreed to stop for (0: none yet)
        self.agreed = 0
        #: the job's key-value store (torch.distributed's default store; None in a single process) and this fit's key
        #: in it: a signalled rank publishes its signal there, and the others learn it without a collective
        self._store, self._key = store, key
        self._peer: tuple[int, float] | None = None
        self.grace = grace
        #: called from the watchdog thread when a stop is known and the training thread has not taken it within three
        #: quarters of the grace (a step or hook longer than that): makes what it can durable and exits the process
        self.on_overdue = on_overdue
        #: set by the training thread while it is outside a training step (validation, the sanity check): the watcher
        #: then asks the store ten times a second instead of once
        self.outside = False
        #: set once the training thread took the stop (it makes the step durable itself)
        self.handled = threading.Event()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        # a validation whose batches are collectives (a sharded strategy): the ranks stop before the same batch
        self._val_lock = threading.Lock()
        self._val_index = -1  # (the validations of this fit so far, the sanity check's included; -1: none yet)
        self._val_started = 0  # (the batches this rank started in the validation running now)
        self._val_published: int | None = None  # (what this rank published of it, once a stop is known)
        self._val_stop: int | None = None  # (the batch every rank stops before)
        self._val_lockstep = False

    # ------------------------------------------------------------------------------------------- ownership
    def install(self) -> bool:
        """Own the signals (replacing Lightning's handlers, kept to be given back); False when this is not the main
        thread (Python delivers signals there only): the previous handling stays."""
        if not self.signals or self._previous:
            return bool(self._previous)
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "lightning-snapshot: trainer.fit runs outside the main thread, so the preemption signals (%s) cannot"
                " be handled by the library; a preemption is handled by Lightning, if at all",
                ", ".join(signal_name(s) for s in self.signals),
            )
            return False
        _received[0], _received[1] = 0, 0.0
        _grace[0] = self.grace
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, _record)
        self._guard_workers()
        self._stop.clear()
        self._watcher = threading.Thread(target=self._watch, name="lightning-snapshot-preemption", daemon=True)
        self._watcher.start()
        return True

    def restore(self) -> None:
        """Give the signals back to the handlers they had (where the handler is still this module's: Lightning's
        teardown may have restored its originals already). Idempotent."""
        for sig, handler in self._previous.items():
            if signal.getsignal(sig) is _record and threading.current_thread() is threading.main_thread():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
        self._unguard_workers()
        self._stop.set()
        watcher, self._watcher = self._watcher, None
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=1.0)  # (it wakes every 0.1 s; a store request in flight may take longer)

    @staticmethod
    def received() -> tuple[int, float]:
        """(the first preemption signal this process recorded, or 0; when, in ``time.monotonic()``)."""
        return int(_received[0]), float(_received[1])

    # ------------------------------------------------------------------------------------------- agreement
    def poll(self, step: int) -> int:
        """Collective, once per ``step`` (the trainer's ``global_step``, the same on every rank; later calls at the
        same step return 0 without a collective): the signal some rank received (the highest number when several
        did), or 0 when none did. Every rank gets the same answer at the same step.

        Under several processes each call starts the all-reduce of this step's signal and reads the one the previous
        call started, which finished while that step trained: no rank waits for the others here (a network round
        trip per step), and a signal stops the ranks one optimizer step after the one it reached them in."""
        if not self._previous or self.agreed or step == self._polled:
            return 0
        self._polled = step
        local = self._local()
        if self.comm.world_size == 1:
            agreed = local
        else:
            earlier, self._pending = self._pending, self.comm.all_max_start(local)
            if earlier is None:
                # the first one waited for at once: gloo's thread calls its operators a first time then, which must
                # not be while the training thread forks loader workers (see forksafe)
                self._pending.result()
            agreed = earlier.result() if earlier is not None else 0
        if agreed:
            self.agreed = agreed
            self.settle()
        return agreed

    def settle(self) -> None:
        """Wait for the agreement still in flight (every rank started it: at a stop, or at the end of the fit), so
        that no collective of the group is left running. Not after an exception: a peer may be gone."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except Exception as e:  # noqa: BLE001 - a peer that failed: its own error says why
                log.debug("lightning-snapshot: the last preemption agreement did not complete: %s", e)

    def _local(self) -> int:
        """The signal this rank knows of (0: none): its own, or one a peer published."""
        return self.known()[0]

    def known(self) -> tuple[int, float]:
        """The stop this rank knows of without a collective (no I/O: the watcher thread reads the store): its own
        signal, else one another rank published, or 0; and when it came (``time.monotonic()``)."""
        if _received[0]:
            return int(_received[0]), float(_received[1])
        return self._peer if self._peer is not None else (0, 0.0)

    def agree_now(self) -> int:
        """Collective, at a point every rank reaches together outside the training step (the end of a validation):
        the signal some rank knows of, or 0; the same on every rank. The per-step agreement still in flight is read
        first (every rank started it)."""
        if not self._previous or self.agreed:
            return self.agreed
        if self.comm.world_size == 1:
            agreed = self.known()[0]
        else:
            pending, self._pending = self._pending, None
            earlier = pending.result() if pending is not None else 0
            agreed = max(earlier, self.comm.all_max(self.known()[0]))
        if agreed:
            self.agreed = agreed
        return agreed

    # ------------------------------------------------------------------------------------------- validation
    def validation_started(self, lockstep: bool) -> None:
        """The training thread: a validation starts (the sanity check too; every rank counts the same ones).
        ``lockstep``: its batches are collectives (a sharded strategy's forward gathers the weights), so the ranks
        must stop it before the same batch."""
        with self._val_lock:
            self._val_index += 1
            self._val_started = 0
            self._val_published = self._val_stop = None
            self._val_lockstep = lockstep and self._store is not None and self.comm.world_size > 1

    def stop_validation(self) -> bool:
        """The training thread, before each validation batch: whether to run no more of them (a stop is known). No
        collective. When the batches are collectives the ranks stop before the same batch: each rank publishes in
        the store how many it started when it learns of the stop (its watcher thread does it for a rank that is
        inside a batch, held there by a rank that stopped), and every rank runs up to the most any rank started
        (at most one more: the collectives keep the ranks within a batch of each other)."""
        if not self._val_lockstep:
            return bool(self.known()[0])
        with self._val_lock:
            if self._val_published is None:
                if not self.known()[0]:
                    self._val_started += 1
                    return False
                self._publish_started()
        if self._val_stop is None:
            self._val_stop = self._stop_batch()
        with self._val_lock:
            if self._val_started < self._val_stop:
                self._val_started += 1
                return False
        return True

    def _val_key(self, rank: int) -> str:
        return f"{self._key}/validation{self._val_index}/rank{rank}"

    def _publish_started(self) -> None:
        """(holding ``_val_lock``) Publish the batches this rank started in the validation running now."""
        self._val_published = self._val_started
        try:
            self._store.set(self._val_key(self.comm.rank), str(self._val_started))
        except Exception as e:  # noqa: BLE001 - the waits below end with the grace; the watchdog then acts
            log.warning("lightning-snapshot: could not publish where this rank stops its validation: %s", e)

    def _stop_batch(self) -> int:
        """The batch every rank stops its validation before: the most batches a rank started (waits for every
        rank's number, which each publishes within a batch or its watcher's next look at the store)."""
        keys = [self._val_key(r) for r in range(self.comm.world_size)]
        deadline = time.monotonic() + max(1.0, self.grace)
        try:
            # (asked, not waited for in the store: a wait would hold the store's client from this rank's watcher,
            # which must still publish this rank's signal for the others to learn of it)
            while not self._store.check(keys):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not every rank said where it stops within {self.grace:g} s")
                time.sleep(0.005)
            return max(int(self._store.get(k).decode()) for k in keys)
        except Exception as e:  # noqa: BLE001 - the watchdog makes what it can durable within the grace
            log.warning("lightning-snapshot: the ranks could not agree where to stop the validation: %s", e)
            return self._val_started

    # ------------------------------------------------------------------------------------------- the watcher
    def _watch(self) -> None:
        """The watcher thread: publishes this rank's signal in the store and reads the others' (ten times a second
        while the training thread is outside a step, once a second inside one), and runs :attr:`on_overdue` once when
        a stop is known and the training thread has not taken it within three quarters of the grace."""
        published = overdue = False
        tick = 0
        while not self._stop.wait(0.1):
            tick += 1
            if self._store is not None:
                try:
                    if _received[0] and not published:
                        published = True
                        wall = time.time() - (time.monotonic() - _received[1])
                        self._store.set(self._key, f"{int(_received[0])} {wall!r}")
                    elif self._peer is None and not _received[0] and (self.outside or tick % 10 == 0):
                        if self._store.check([self._key]):
                            sig, wall = self._store.get(self._key).decode().split()
                            self._peer = (int(sig), time.monotonic() - max(0.0, time.time() - float(wall)))
                except Exception as e:  # noqa: BLE001 - the per-step agreement still stops the ranks
                    log.debug("lightning-snapshot: the preemption store could not be used: %s", e)
            signum, since = self.known()
            if not signum:
                continue
            if self._val_lockstep and self.outside:  # (a rank held inside a validation batch by a rank that stopped)
                with self._val_lock:
                    if self._val_lockstep and self.outside and self._val_published is None:
                        self._publish_started()
            now = time.monotonic()
            if (
                not overdue
                and self.on_overdue is not None
                and not self.handled.is_set()
                and now >= since + self.grace * _OVERDUE
            ):
                overdue = True
                self.on_overdue(signum, since)
            elif now >= since + self.grace + _LAST_WORD:
                # the stop path itself is stuck (a collective with a rank that is gone): the SIGKILL is due
                log.error(
                    "lightning-snapshot: %s: the process was still stopping %.0f s after the signal (sigterm_grace=%g):"
                    " it exits now",
                    signal_name(signum),
                    now - since,
                    self.grace,
                )
                exit_now(128 + signum)

    # ------------------------------------------------------------------------------------------- loader workers
    def _guard_workers(self) -> None:
        """Start every multi-process loader iterator of the fit with the signals blocked: its workers (forked or
        spawned: a child inherits the signal mask) never receive a signal sent to the whole process group, and the
        main thread gets the ones that came meanwhile when the mask is restored. The main process can still stop a
        worker: a forked worker exits when its parent sends it one of them (``terminate``, as torch's own worker
        handler does), through a thread that waits for them (:func:`_after_fork`); a worker of another start method
        is killed instead."""
        try:
            from torch.utils.data import dataloader
        except ImportError:  # pragma: no cover - torch always has it
            return
        cls = dataloader._MultiProcessingDataLoaderIter  # private: where a loader starts its workers
        original = cls.__dict__["__init__"]
        signals = set(self.signals)

        def __init__(it: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
            if threading.current_thread() is not threading.main_thread():
                original(it, loader, *args, **kwargs)
                return
            before = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
            _forking[0] = tuple(signals)
            _forking_thread[0] = threading.get_ident()
            init = loader.worker_init_fn
            loader.worker_init_fn = _GuardWorker(tuple(signals), init)  # (a spawned worker: see _GuardWorker)
            try:
                original(it, loader, *args, **kwargs)
            finally:
                loader.worker_init_fn = init
                _forking[0] = ()
                signal.pthread_sigmask(signal.SIG_SETMASK, before)
                for worker in getattr(it, "_workers", ()):
                    # a spawned worker ignores the signal terminate() sends: it is killed instead (also by
                    # multiprocessing's exit handler, which terminates daemonic children through their Popen)
                    popen = getattr(worker, "_popen", None)
                    if popen is not None and type(popen).__module__ != "multiprocessing.popen_fork":
                        popen.terminate = popen.kill

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(cls, "__init__", __init__)  # noqa: B010 - (a method replaced for the fit)
        self._iter_init = (cls, original, __init__)

    def _unguard_workers(self) -> None:
        if self._iter_init is None:
            return
        cls, original, installed = self._iter_init
        self._iter_init = None
        if cls.__dict__.get("__init__") is installed:
            setattr(cls, "__init__", original)  # noqa: B010


#: the signals blocked while a guarded loader iterator forks its workers (empty otherwise), and the thread forking
_forking: list[tuple[int, ...]] = [()]
_forking_thread: list[int] = [0]


#: the signals this worker process guards against (set once its guard runs)
_guarded: list[tuple[int, ...]] = [()]


def _guard_this_worker(signals: tuple[int, ...], parent: int) -> None:
    """In a loader worker: block ``signals`` and start a thread that takes them as they come, exiting the worker
    when ``parent`` (the main process stopping it: ``terminate``) sent one, as torch's own worker handler does, and
    ignoring the others (the cluster's signal to the process group, which the main process handles). Once."""
    if _guarded[0] or not signals:
        return
    _guarded[0] = signals
    signal.pthread_sigmask(signal.SIG_BLOCK, set(signals))

    def watch() -> None:
        while True:
            info = signal.sigwaitinfo(signals)
            if info.si_pid == parent:
                os._exit(0)

    threading.Thread(target=watch, name="lightning-snapshot-worker-signals", daemon=True).start()


def _after_fork() -> None:
    """In a process forked by a guarded loader iterator (a worker; the signals are blocked already, inherited)."""
    signals = _forking[0]
    if signals:
        _forking[0] = ()
        if threading.get_ident() == _forking_thread[0]:  # (not a fork another thread made meanwhile)
            _guard_this_worker(signals, os.getppid())


class _GuardWorker:
    """The loader's ``worker_init_fn`` while a guarded iterator starts its workers. A worker started by spawn or
    forkserver does not inherit the signal mask: it ignores the signals from the moment it unpickles this object,
    before torch's worker loop runs (a signal during the interpreter's start-up before that can still kill it); a
    forked worker is guarded already (:func:`_after_fork`). Then the user's own ``worker_init_fn`` runs."""

    def __init__(self, signals: tuple[int, ...], inner: Any) -> None:
        self.signals = signals
        self.inner = inner

    def __getstate__(self) -> dict[str, Any]:
        return {"signals": self.signals, "inner": self.inner}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (a spawned worker: threads that started with its imports, OpenMP's, do not block the signals and would
        # take them: they are ignored instead, and the main process stops such a worker with SIGKILL)
        self.signals, self.inner = state["signals"], state["inner"]
        self._ignore = True
        self._ignore_signals()

    def _ignore_signals(self) -> None:
        if getattr(self, "_ignore", False) and threading.current_thread() is threading.main_thread():
            signal.pthread_sigmask(signal.SIG_BLOCK, set(self.signals))
            for sig in self.signals:
                signal.signal(sig, signal.SIG_IGN)

    def __call__(self, worker_id: int) -> None:
        self._ignore_signals()  # (again: torch's worker loop installed its own SIGTERM handler since)
        if self.inner is not None:
            self.inner(worker_id)


os.register_at_fork(after_in_child=_after_fork)


def slurm_requeue_signal(environment: Any) -> int | None:
    """The signal of Lightning's SLURM auto-requeue (``SLURMEnvironment(auto_requeue=True)``, SIGUSR1 by default), or
    None when the job does not requeue itself."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
        return None
    signum = environment.requeue_signal
    return int(signum) if signum is not None else None


def requeue_slurm_job() -> str:
    """``scontrol requeue`` this SLURM job (what Lightning's auto-requeue does on its signal); returns what happened,
    for the log. Called by global rank 0 only, once the snapshot is durable."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}" if array_job else os.environ.get("SLURM_JOB_ID")
    if not job or not re.fullmatch(r"[0-9]+(_[0-9]+)?", job):
        return f"not requeued: no valid SLURM job id in the environment ({job!r})"
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"requeueing SLURM job {job} failed: {e}"
    if result.returncode != 0:
        return f"requeueing SLURM job {job} failed (scontrol exit status {result.returncode}): {result.stderr.strip()}"
    return f"SLURM job {job} requeued"


def stop_if_preempted(preemption: Preemption | None, pipeline: Any, requeue_signal: int | None) -> None:
    """The integrations' check, once per optimizer step, at the point snapshots are taken (every rank): the ranks agree whether one of
    them was sent a preemption signal; if so every rank snapshots this step into every tier (``pipeline``), waits
    until a durable tier holds it (``sigterm_grace``), and stops with :class:`Preempted` (``requeue_signal``: the
    SLURM job is requeued first)."""
    if preemption is None or pipeline is None:
        return
    signum = preemption.poll(pipeline.source.step())
    if signum:
        stop(preemption, pipeline, requeue_signal, signum)


def stop(preemption: Preemption, pipeline: Any, requeue_signal: int | None, signum: int, abandoned: bool = False) -> None:
    """Every rank together, once the ranks agreed on ``signum``: the current step made durable in every tier within
    the grace (``abandoned``: a validation was abandoned, and the snapshot holds the state from before it), then
    :class:`Preempted` (``requeue_signal``: the SLURM job is requeued first)."""
    preemption.handled.set()
    mine, since = preemption.received()
    if not mine:
        known, learned = preemption.known()
        since = learned if known else time.monotonic()
    what = "the signal reached this rank" if mine else "the ranks agreed to stop (another rank was signalled)"
    name = signal_name(signum)
    step, durable = pipeline.last_snapshot(name, since, what, abandoned=abandoned)
    if signum == requeue_signal and pipeline.comm.rank == 0:
        log.warning("lightning-snapshot: %s", requeue_slurm_job())
    raise Preempted(signum, step, durable)


def overdue(pipeline: Any, requeue_signal: int | None, signum: int, since: float) -> None:
    """The preemption watchdog's way (its own thread), when the ranks could not reach a step boundary within three
    quarters of the grace (a training step, a validation batch or a hook longer than that): the snapshots already
    handed to the tiers are made durable (``pipeline.overdue``: one error line says what is lost), the SLURM job is
    requeued (``requeue_signal``), and the process exits with 128 + the signal."""
    try:
        if pipeline is not None:
            pipeline.overdue(signal_name(signum), since)
        if signum == requeue_signal and pipeline is not None and pipeline.comm.rank == 0:
            log.warning("lightning-snapshot: %s", requeue_slurm_job())
    finally:
        exit_now(128 + signum)


def exit_promptly(code: int, seconds: float = EXIT_WITHIN) -> None:
    """Once a preempted step is durable (``fit`` is raising :class:`Preempted`): the process exits with ``code`` as
    soon as its Python code has run (the exception's way out through the caller's ``finally`` blocks, Lightning's
    teardown, the exit handlers registered before this one), skipping the interpreter's own teardown, which takes
    from about a second per process to many with many ranks on few cores (freeing every module, the process
    groups' destructors); and at the latest ``seconds`` from now, or when the grace of the signal ends if that is
    later, whatever its cleanup still waits for (a logger's upload), so that it never outlives the grace."""
    import multiprocessing

    if multiprocessing.parent_process() is None:  # (a ddp_spawn rank ends through multiprocessing's own exit)
        atexit.register(exit_now, code)  # (run first: exit handlers run last-registered first)
    since = float(_received[1]) if _received[0] else time.monotonic()
    left = _grace[0] - (time.monotonic() - since)

    def run() -> None:
        time.sleep(max(seconds, left))
        log.warning(
            "lightning-snapshot: the preempted process was still cleaning up %.0f s after its snapshot was durable:"
            " it exits now (status %d)",
            max(seconds, left),
            code,
        )
        exit_now(code)

    threading.Thread(target=run, name="lightning-snapshot-exit", daemon=True).start()


def exit_now(code: int) -> None:
    """Flush the log handlers and the standard streams, and end the process with ``code`` at once."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001, S110 - exiting anyway
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - exiting anyway
            pass
    os._exit(code)


def spawned_rank_preempted(exception: BaseException, signals: Sequence[int], fit_running: bool) -> None:
    """In the process that launched ``ddp_spawn`` ranks (no fit of its own runs here): a rank that ended with
    :class:`Preempted` makes torch raise ``ProcessExitedException``; this process exits with the rank's status
    (128 + the signal number) instead of 1, as the ranks do."""
    code = getattr(exception, "exit_code", None)
    spawned = not fit_running and type(exception).__name__ == "ProcessExitedException"
    if spawned and isinstance(code, int) and code - 128 in signals:
        log.warning("lightning-snapshot: a spawned rank was preempted (exit status %d): so is this process", code)
        raise SystemExit(code) from exception
