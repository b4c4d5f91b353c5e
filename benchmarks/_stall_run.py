"""benchmarks/stall.py, part 2 of 3: one measured training run and what it records.

One job: train once with a method's callbacks and measure it: peak RSS (sampled and the kernel's high-water mark),
background fsyncs for methods that never fsync, the time inside each callback hook, the snapshot schedule and the
consistency probe, then fill a result ``Row`` with what every method shares (stall, overheads, RSS, noise) and
restore into a fresh model. Imported by ``benchmarks/_stall_methods.py`` and ``benchmarks/stall.py`` (the entry
point); not run on its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import statistics
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _harness as harness
import lightning.pytorch as L
import torch
from _harness import NoiseMeter, evict, timed, trim_memory
from _stall_models import (
    GB,
    GPT,
    MiB,
    ModelConfig,
    RandomTokens,
    compare,
    fingerprint,
    fresh_model,
    fsync_tree,
    mutate,
    rss_bytes,
)
from lightning.pytorch.callbacks import Callback, Checkpoint


# ================================================================================================ measurement
def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def kernel_peak_rss() -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


class RssSampler:
    """Peak RSS of this process, sampled every ``interval`` seconds by a background thread.

    Where the kernel's own high-water mark can be reset (``/proc/self/clear_refs``), ``peak`` also takes it into
    account, so a peak shorter than the sampling interval (or while the sampler waits for the GIL) is not missed.
    """

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self.hwm = reset_peak_rss()
        self.peak = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sampled = max(self.peak, rss_bytes())
        self.peak = max(self.sampled, (kernel_peak_rss() or 0) if self.hwm else 0)


class FsyncLater:
    """Fsyncs what a method wrote (methods that never fsync) in a background thread; records when it is durable."""

    def __init__(self) -> None:
        self.pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-fsync")
        self.written: dict[int, float] = {}
        self.durable: dict[int, float] = {}
        self.paths: dict[int, str] = {}
        self.errors: list[str] = []

    def submit(self, step: int, path: str, wait: Callable[[], Any] | None = None) -> None:
        self.paths[step] = path

        def job() -> None:
            try:
                if wait is not None:
                    wait()
                self.written[step] = time.perf_counter()
                fsync_tree(path)
                self.durable[step] = time.perf_counter()
            except Exception as e:  # noqa: BLE001 - reported in the row
                self.errors.append(f"step {step}: {type(e).__name__}: {e}")

        self.pool.submit(job)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


HOOKS = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")


class HookTimer:
    """Time the training thread spends inside a callback's hooks, by the ``global_step`` at the time of the call.

    The key ``s`` collects ``on_train_batch_end`` of step ``s`` plus ``on_train_batch_start`` and
    ``on_before_optimizer_step`` of the batch after it: the whole blocking cost of a snapshot taken at step ``s``.
    """

    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}
        self.by_hook: dict[tuple[int, str], float] = {}
        self.cpu_by_step: dict[int, float] = {}  # CPU time of the training thread in the hooks (thread_time)

    def wrap(self, callback: Callback) -> Callback:
        for hook in HOOKS:
            original = getattr(callback, hook)

            def timed_hook(
                trainer: Any, *args: Any, _original: Callable[..., Any] = original, _hook: str = hook, **kwargs: Any
            ) -> Any:
                step = trainer.global_step
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return _original(trainer, *args, **kwargs)
                finally:
                    dt = time.perf_counter() - t0
                    self.cpu_by_step[step] = self.cpu_by_step.get(step, 0.0) + time.thread_time() - c0
                    self.by_step[step] = self.by_step.get(step, 0.0) + dt
                    self.by_hook[step, _hook] = self.by_hook.get((step, _hook), 0.0) + dt

            setattr(callback, hook, timed_hook)
        return callback


class Probe(Callback):
    """Plain callback, so it runs before every Checkpoint callback: marks save calls, fingerprints the checked step."""

    def __init__(self, schedule: list[int], check_step: int) -> None:
        self.schedule = set(schedule)
        self.check_step = check_step
        self.save_started: dict[int, float] = {}
        self.reference: dict[str, str] | None = None
        self.fingerprint_s = 0.0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step not in self.schedule or step in self.save_started:
            return
        if step == self.check_step:
            self.reference, self.fingerprint_s = timed(lambda: fingerprint(pl_module, trainer.optimizers[0]))
        self.save_started[step] = time.perf_counter()


class Tail(Checkpoint):
    """Last callback of all: the wall-clock window, and the mutation right before the next optimizer step."""

    def __init__(self, check_step: int, start_step: int = 1) -> None:
        self.check_step = check_step
        self.start_step = start_step
        self.t_start: float | None = None
        self.t_end: float | None = None
        self.mutate_s = 0.0
        self.mutated = False
        self.marks: dict[int, tuple[float, float, float]] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.start_step and self.t_start is None:
            self.t_start = time.perf_counter()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == self.check_step and not self.mutated:
            self.mutated = True
            _, self.mutate_s = timed(lambda: mutate(pl_module, optimizer))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # end of every batch, after every callback: wall clock, machine-wide busy CPU, this process's CPU
        self.marks[trainer.global_step] = mark = NoiseMeter.mark()
        self.t_end = mark[0]


# ================================================================================================ one training run
@dataclass
class Bench:
    cfg: ModelConfig
    steps: int
    every: int
    root: Path
    schedule: list[int] = field(init=False)
    check_step: int = field(init=False)
    state_bytes: int = 0
    memcpy_s: float | None = None
    foreach_s: float | None = None  # one torch._foreach_copy_ of the state's tensors into preallocated buffers
    foreach_in_fit_s: float | None = None  # the same copy inside a fit, at the snapshot points (--model many)
    device: str = "cpu"  # --device cuda: one GPU
    precision: str | None = None
    accumulate: int = 1
    restore: bool = True  # cold restore + consistency check after each run
    pinned_copy_s: float | None = None  # cuda: one device-to-host copy_ of the whole state into pinned memory
    #: the replica check's work on one rank (DDP only): (median ms with the default 4 slices, ms of all of it, tensors)
    replica_check: tuple[float, float, int] | None = None

    def __post_init__(self) -> None:
        self.schedule = [s for s in range(self.every, self.steps + 1, self.every)]
        before_end = [s for s in self.schedule if s < self.steps]
        self.check_step = before_end[-1] if before_end else self.schedule[-1]

    def workdir(self, name: str) -> Path:
        path = self.root / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path


@dataclass
class TrainRun:
    module: GPT
    optimizer: torch.optim.Optimizer
    logger: Any  # harness.memory_logger()
    probe: Probe
    tail: Tail
    hooks: HookTimer
    wall_s: float
    rss_growth: int
    warnings: list[str]
    foreign_cpu_s: float
    fit_s: float
    rss_growth_sampled: int


@dataclass
class Row:
    method: str
    snapshots: int = 0
    stall_ms: list[float] = field(default_factory=list)  # per snapshot, as the row reports it
    ext_stall_ms: list[float] = field(default_factory=list)  # measured around the method's hooks
    wall_s: float | None = None
    durable_s: list[float] = field(default_factory=list)
    durable_mark: str = ""
    rss_growth: int | None = None
    restore_s: float | None = None
    consistency: str = "n/a"
    skipped: int = 0
    note: str = ""
    error: str | None = None
    foreign_cpu_s: float = 0.0
    noise: float = 0.0  # share of the machine's CPU time other processes used during the fit
    periods: list[tuple[float, float]] = field(default_factory=list)  # (seconds, noise) of each snapshot period
    details: list[str] = field(default_factory=list)
    cpu_per_snapshot: float | None = None  # ours: CPU seconds of our hooks and background threads per snapshot
    device_copy: list[tuple[int, float]] = field(default_factory=list)  # ours on CUDA: (bytes, seconds) per copy
    to_agent_s: list[float] = field(default_factory=list)  # ours-agent: save call -> the agent holds it
    step_s: list[float] = field(default_factory=list)  # every optimizer step's duration


def train(
    bench: Bench,
    method_callbacks: list[Callback],
    *,
    plugins: list[Any] | None = None,
    extra: list[Callback] | None = None,
) -> TrainRun:
    """Train ``bench.steps`` steps with the method's callbacks between the probe and the tail callback; ``extra``
    callbacks (part of the training, not of the method: ``EMAWeightAveraging``) after the method's, their hooks not
    timed as the method's."""
    trim_memory()
    module = fresh_model(bench.cfg)
    probe = Probe(bench.schedule, bench.check_step)
    tail = Tail(bench.check_step)
    hooks = HookTimer()
    logger = harness.memory_logger()
    loader = torch.utils.data.DataLoader(
        RandomTokens(bench.steps * bench.cfg.batch * 2 * bench.accumulate, bench.cfg.seq, bench.cfg.vocab),
        batch_size=bench.cfg.batch,
    )
    trainer = L.Trainer(
        accelerator="gpu" if bench.device == "cuda" else "cpu",
        devices=1,
        max_steps=bench.steps,
        logger=logger,
        precision=bench.precision,
        accumulate_grad_batches=bench.accumulate,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        log_every_n_steps=1,
        callbacks=[probe, *(hooks.wrap(cb) for cb in method_callbacks), *(extra or []), tail],
        plugins=plugins or None,
    )
    with warnings.catch_warnings(record=True) as caught, NoiseMeter() as cpu:
        warnings.simplefilter("always")
        pre = rss_bytes()
        with RssSampler() as rss:
            trainer.fit(module, train_dataloaders=loader)
    if tail.t_start is None or tail.t_end is None:
        raise RuntimeError("the training window was not recorded")
    wall = tail.t_end - tail.t_start - probe.fingerprint_s - tail.mutate_s
    ours = [str(w.message) for w in caught if "lightning-snapshot" in str(w.message)]
    optimizer = trainer.optimizers[0]
    del trainer
    return TrainRun(
        module,
        optimizer,
        logger,
        probe,
        tail,
        hooks,
        wall,
        rss.peak - pre,
        ours,
        cpu.foreign,
        cpu.wall,
        max(0, rss.sampled - pre),
    )


def snapshot_periods(bench: Bench, marks: dict[int, tuple[float, float, float]]) -> list[tuple[float, float]]:
    """Duration and noise of each snapshot's period: the K batches from the one that ends with snapshot ``s``
    (end of batch ``s - 1`` to end of batch ``s - 1 + K``), so that each period holds one snapshot's stall and the
    background work that follows it; the same step ranges in the baseline. Noise: share of the CPUs other processes
    used during the period.
    """
    out = []
    for s in bench.schedule:
        a, b = marks.get(s - 1), marks.get(s - 1 + bench.every)
        if a is not None and b is not None:
            out.append(NoiseMeter.between(a, b))
    return out


def fill_common(bench: Bench, row: Row, run: TrainRun, done: dict[int, float] | None) -> None:
    """Wall time, external stall, durability and memory, the same way for every method."""
    row.snapshots = len(bench.schedule)
    row.wall_s = run.wall_s
    row.rss_growth = run.rss_growth
    row.ext_stall_ms = [run.hooks.by_step.get(s, 0.0) * 1000 for s in bench.schedule]
    if not row.stall_ms:
        row.stall_ms = list(row.ext_stall_ms)
    parts = []
    for hook in HOOKS:
        values = [run.hooks.by_hook.get((s, hook), 0.0) * 1000 for s in bench.schedule]
        if any(values):
            parts.append(f"{hook} {statistics.median(values):.2f} (max {max(values):.1f})")
    if parts:
        row.details.append("blocking per snapshot by hook, ms median: " + ", ".join(parts))
    others = [v * 1000 for s, v in run.hooks.by_step.items() if s not in bench.schedule]
    if others:
        row.details.append(
            f"hook time on steps without a snapshot: median {statistics.median(others):.2f} ms,"
            f" max {max(others):.2f} ms"
        )
    if done is not None:
        started = run.probe.save_started
        row.durable_s = [done[s] - started[s] for s in bench.schedule if s in done and s in started]
        missing = [s for s in bench.schedule if s not in done]
        if missing:
            row.details.append(f"never durable: steps {missing}")
    for w in sorted(set(run.warnings)):
        row.details.append(f"warning: {w[:300]}")
    row.periods = snapshot_periods(bench, run.tail.marks)
    marks = run.tail.marks
    row.step_s = [marks[s][0] - marks[s - 1][0] for s in sorted(marks) if s - 1 in marks and s > 1]
    row.foreign_cpu_s = run.foreign_cpu_s
    row.noise = run.foreign_cpu_s / (run.fit_s * (os.cpu_count() or 1))
    if run.rss_growth > run.rss_growth_sampled + 16 * MiB:
        row.details.append(
            f"peak RSS growth {run.rss_growth / GB:.3f} GB (kernel VmHWM) vs"
            f" {run.rss_growth_sampled / GB:.3f} GB seen by the 10 ms sampler"
        )


def restore_into_fresh(
    bench: Bench, load: Callable[[GPT, torch.optim.Optimizer], None], path: str | Path, reference: dict[str, str] | None
) -> tuple[float, str]:
    """Cold-restore into a fresh model + optimizer with ``load``; returns (seconds, consistency verdict)."""
    trim_memory()
    module = fresh_model(bench.cfg)
    optimizer = module.configure_optimizers()
    evict(path)
    _, seconds = timed(lambda: load(module, optimizer))
    return seconds, compare(reference, module, optimizer)
