"""How much a training-state snapshot costs the training loop: lightning-snapshot against its peers.

One process trains a GPT-style decoder-only transformer with AdamW under Lightning (CPU), once per method, and
snapshots it every ``--every`` optimizer steps:

{methods}

Measured per method
-------------------
* **stall**: time the training thread is blocked per snapshot. For lightning-snapshot the ``snapshot/stall_ms``
  metric it logs; for every method (ours included, as a cross-check) also measured from outside: the time spent
  inside the method's own callback hooks from ``on_train_batch_end`` of the snapshot step up to and including
  ``on_before_optimizer_step`` of the next step (for ModelCheckpoint that is the save call itself).
* **overhead**: added wall time per snapshot, ``(wall_method - wall_baseline) / n_snapshots``. The wall clock runs
  from the start of the second batch (the first allocates the optimizer state) to the end of the last batch,
  after every callback. ``--steps`` leaves ``--every - 1`` steps after the last snapshot so that each snapshot's
  background work lands inside the window (what is still running after the last batch, e.g. a final drain, is
  not counted). The time the benchmark itself spends fingerprinting and mutating the state (below) is subtracted.
  Because other processes on a shared machine and one-off costs (the first snapshot allocates buffers) weigh on
  that figure, **ovh p50** is shown as well: the median duration of a *snapshot period* (the ``--every`` batches
  from the one that ends with the snapshot, so one stall plus the background work that follows it) among the
  periods other processes left quiet, minus the same median of the baseline runs.
* **CPU per snapshot** (ours only, in the notes under the table and as ``info`` lines): CPU time (``thread_time``)
  of the training thread inside our hooks plus that of our copy, allocation and persist threads, per snapshot. It
  does not depend on what other processes do, unlike the wall-clock overheads; on 2 busy cores it is about the
  compute training loses (memory-bandwidth contention aside).
* **durable**: from the save call until the bytes are on disk: ours, until ``LocalTier.commit`` of the step's
  ``manifest.json`` returned (it runs after every data object is fsynced, and fsyncs the manifest, renames it into
  place and fsyncs the directory); DCP, until its upload future is done (``FileSystemWriter`` fsyncs). Lightning's
  ``torch.save`` path and torchsnapshot never fsync: there the benchmark fsyncs each file in a background thread as
  soon as it is written and reports save call -> fsync done (marked ``+`` in the table). ``n/a`` for the RAM arena.
* **peak extra RSS**: resident set size sampled every 10 ms from ``/proc/self/statm`` during ``fit`` (and the
  kernel's exact high-water mark ``VmHWM``, reset before each fit through ``/proc/self/clear_refs``, the larger wins):
  ``(peak - RSS before fit) - the same for the baseline`` (so the optimizer state, gradients and activations that
  every run allocates cancel out; the smaller of the two baseline runs is used), in GB and as a multiple of the
  state size (fp32 params + AdamW moments).
  Shared-memory buffers (our arena, DCP's stager) count once their pages are touched; the page cache does not.
* **restore**: loading the newest snapshot into a fresh model + optimizer (ours: ``load_snapshot`` reading the
  weights into the model's tensors (``into=``, as the callback's own restore does) + ``load_state_dict``;
  torch.save: ``torch.load`` + ``load_state_dict``; DCP: ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``;
  torchsnapshot: ``Snapshot.restore``), cold: the snapshot's files are dropped from the page cache
  (``posix_fadvise(DONTNEED)`` after fsync) before reading.
* **consistency**: at ``on_train_batch_end`` of the last snapshot step (before any method's save call; Lightning
  runs ``Checkpoint`` callbacks after plain ones) the benchmark takes an xxh3-128 fingerprint of every parameter
  and optimizer-state tensor, a stand-in for a deep copy that keeps the copy's memory out of the RSS figures.
  Then it mutates every one of those tensors in place (``add_(1)``) in ``on_before_optimizer_step`` of the next
  step, after all other callbacks (its callback is the last ``Checkpoint``): exactly where the optimizer step
  would mutate them, which is the documented contract of every asynchronous method here (parameters and optimizer
  state stay frozen until ``optimizer.step``), while a background copy or write of that snapshot may still be
  running; the optimizer step that follows changes them again. After training, the restored state's fingerprint
  must equal the one taken at save time, bitwise: PASS, else FAIL with the number of differing tensors.

Snapshots go to a temporary directory under ``--dir`` (default ``/tmp``), removed at the end; ours keep the last
2 (``keep_last=2``), ModelCheckpoint all of them (``save_top_k=-1``). A short untimed run comes first so that
one-time costs (lazy imports, thread pools) land in no row. Ratios against ``ours-local`` read ``ref~0`` where its
overhead is within the baseline spread (no ratio is meaningful then).

The one-off "memcpy of the state into a preallocated buffer" above the table copies every parameter and
optimizer-state tensor with ``ctypes.memmove`` on one thread into one touched buffer (median of 3); a
``torch`` ``copy_`` (all intra-op threads) is shown too.

Usage::

    python benchmarks/stall.py              # full: ~124M params (GPT-2 small, tied embeddings), 1.49 GB state
    python benchmarks/stall.py --quick      # ~21M params, under 2 minutes on 2 cores
    python benchmarks/stall.py --model many # 195 Linear(8, 8): per-tensor cost, against one torch._foreach_copy_
    python benchmarks/stall.py --steps 44 --every 5 --methods ours-local,dcp

Other processes on the machine (a test run, say) show up as noise in the wall-clock columns. The ``noise`` column
is the share of the CPUs other processes used during each run (from ``/proc/stat``); a run above 10% is flagged
NOISE (``--retries N`` runs it again up to N times, keeping the quietest run). The baseline runs
first and last; the quieter one is used and the spread of the two is printed.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import xxhash
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import _harness as harness  # noqa: E402
from _harness import NOISY, NoiseMeter, evict, fmt, quiet_median, ratio, timed, trim_memory  # noqa: E402

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback, Checkpoint, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

from lightning_snapshot import SnapshotCallback, load_snapshot
from lightning_snapshot.backends import Backend, LocalTier
from lightning_snapshot.manifest import MANIFEST_NAME, parse_step_dirname, step_dirname

GB = 1e9
MiB = 1 << 20
REFERENCE = "ours-local"
OURS = ("ours-ram", "ours-agent", "ours-local", "ours-local-nohealth", "ours-local-1buf")


# ================================================================================================ model and data
@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    d_model: int
    layers: int
    heads: int
    positions: int
    batch: int
    seq: int
    kind: str = "gpt"  # "many": ``Many``, hundreds of tiny layers (layers x Linear(d_model, d_model))


FULL = ModelConfig(vocab=50257, d_model=768, layers=12, heads=12, positions=1024, batch=2, seq=64)  # 124.4M
QUICK = ModelConfig(vocab=16384, d_model=512, layers=4, heads=8, positions=1024, batch=2, seq=32)  # 21.5M
# --device cuda: GPT-2 medium (354.8M params, 4.26 GB of fp32 params + AdamW state), 8 x 1024 tokens per micro-batch
MEDIUM = ModelConfig(vocab=50257, d_model=1024, layers=24, heads=16, positions=1024, batch=8, seq=1024)
# --model many: 195 Linear(8, 8) layers, 390 parameters (1,560 tensors with AdamW's exp_avg, exp_avg_sq and step),
# a few hundred bytes each: what the snapshot costs per tensor, with next to no bytes to copy
MANY = ModelConfig(vocab=256, d_model=8, layers=195, heads=1, positions=0, batch=4, seq=8, kind="many")


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(L.LightningModule):
    """Decoder-only transformer, GPT-2 layout, token embedding tied to the output head, AdamW."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.positions, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)


class Many(L.LightningModule):
    """``layers`` tiny linear layers in a row (``--model many``): a state of many small tensors, AdamW."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.d, self.vocab = cfg.d_model, cfg.vocab
        self.layers = nn.ModuleList(nn.Linear(cfg.d_model, cfg.d_model) for _ in range(cfg.layers))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = batch[:, : self.d].float() / self.vocab
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (self.seq + 1,), generator=torch.Generator().manual_seed(i))


def fresh_model(cfg: ModelConfig) -> GPT:
    torch.manual_seed(0)
    return Many(cfg) if cfg.kind == "many" else GPT(cfg)  # type: ignore[return-value]  # (the same interface)


# ================================================================================================ state helpers
def state_tensors(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter (tied ones once) and every optimizer-state tensor, under stable names."""
    out: dict[str, torch.Tensor] = {}
    params = dict(module.named_parameters())
    for name, p in params.items():
        out[f"param:{name}"] = p
    for name, p in params.items():
        for key, value in optimizer.state.get(p, {}).items():
            if torch.is_tensor(value):
                out[f"optim:{name}:{key}"] = value
    return out


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for t in state_tensors(module, optimizer).values())


def _digest(t: torch.Tensor) -> str:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return f"{t.dtype}{tuple(t.shape)}:{xxhash.xxh3_128_hexdigest(flat.numpy())}"


def fingerprint(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """Bitwise fingerprint (xxh3-128 per tensor) of the parameters and optimizer state."""
    return {name: _digest(t) for name, t in state_tensors(module, optimizer).items()}


def compare(expected: dict[str, str] | None, module: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    if expected is None:
        return "no ref"
    got = fingerprint(module, optimizer)
    bad = sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))
    if not bad:
        return "PASS"
    return f"FAIL({len(bad)}/{len(expected)})"


@torch.no_grad()
def mutate(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for t in state_tensors(module, optimizer).values():
        t.add_(1)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fsync_tree(path: str | Path) -> None:
    path = Path(path)
    for p in ([path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(path if path.is_dir() else path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class gloo_group:
    """A single-process gloo default group (DCP and torchsnapshot want one), torn down afterwards."""

    def __enter__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.owned = not dist.is_initialized()
        if self.owned:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{harness.free_port()}", rank=0, world_size=1)

    def __exit__(self, *exc: object) -> None:
        if self.owned:
            self.dist.destroy_process_group()


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

            def timed_hook(trainer: Any, *args: Any, _original: Callable[..., Any] = original, _hook: str = hook,
                           **kwargs: Any) -> Any:
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
    device: str = "cpu"  # --device cuda: one GPU
    precision: str | None = None
    accumulate: int = 1
    restore: bool = True  # cold restore + consistency check after each run
    pinned_copy_s: float | None = None  # cuda: one device-to-host copy_ of the whole state into pinned memory

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


def train(bench: Bench, method_callbacks: list[Callback], *, plugins: list[Any] | None = None) -> TrainRun:
    """Train ``bench.steps`` steps with the method's callbacks between the probe and the tail callback."""
    trim_memory()
    module = fresh_model(bench.cfg)
    probe = Probe(bench.schedule, bench.check_step)
    tail = Tail(bench.check_step)
    hooks = HookTimer()
    logger = harness.memory_logger()
    loader = torch.utils.data.DataLoader(RandomTokens(bench.steps * bench.cfg.batch * 2 * bench.accumulate,
                                                      bench.cfg.seq, bench.cfg.vocab), batch_size=bench.cfg.batch)
    trainer = L.Trainer(
        accelerator="gpu" if bench.device == "cuda" else "cpu", devices=1, max_steps=bench.steps, logger=logger,
        precision=bench.precision, accumulate_grad_batches=bench.accumulate, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=1,
        callbacks=[probe, *(hooks.wrap(cb) for cb in method_callbacks), tail], plugins=plugins or None,
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
    return TrainRun(module, optimizer, logger, probe, tail, hooks, wall, rss.peak - pre, ours, cpu.foreign, cpu.wall,
                    max(0, rss.sampled - pre))


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
        row.details.append(f"hook time on steps without a snapshot: median {statistics.median(others):.2f} ms,"
                           f" max {max(others):.2f} ms")
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
        row.details.append(f"peak RSS growth {run.rss_growth / GB:.3f} GB (kernel VmHWM) vs"
                           f" {run.rss_growth_sampled / GB:.3f} GB seen by the 10 ms sampler")


def restore_into_fresh(bench: Bench, load: Callable[[GPT, torch.optim.Optimizer], None], path: str | Path,
                       reference: dict[str, str] | None) -> tuple[float, str]:
    """Cold-restore into a fresh model + optimizer with ``load``; returns (seconds, consistency verdict)."""
    trim_memory()
    module = fresh_model(bench.cfg)
    optimizer = module.configure_optimizers()
    evict(path)
    _, seconds = timed(lambda: load(module, optimizer))
    return seconds, compare(reference, module, optimizer)


# ================================================================================================ methods
def run_none(bench: Bench) -> Row:
    row = Row("none")
    run = train(bench, [])
    fill_common(bench, row, run, None)
    row.stall_ms = [0.0] * len(bench.schedule)
    if not bench.state_bytes:
        bench.state_bytes = state_bytes(run.module, run.optimizer)
        if bench.device == "cuda":
            bench.pinned_copy_s, line = pinned_copy(run.module, run.optimizer)
        else:
            bench.memcpy_s, line = memcpy(run.module, run.optimizer)
            bench.foreach_s, more = foreach_copy(run.module, run.optimizer)
            line += "\n" + more
        print(line, flush=True)
    return row


def pinned_copy(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, str]:
    """One device-to-host ``copy_`` of the state's bytes (one contiguous GPU buffer) into pinned memory (from
    ``torch.empty(pin_memory=True)``), timed with CUDA events, median of 3: the bandwidth ours is compared with."""
    tensors = list(state_tensors(module, optimizer).values())
    total = sum(t.numel() * t.element_size() for t in tensors)
    src = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    dst = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    one = statistics.median(times)
    del src, dst
    return one, (f"state: {total / GB:.3f} GB ({len(tensors)} tensors: fp32 params + AdamW exp_avg/exp_avg_sq/step)"
                 f" on {torch.cuda.get_device_name()}\none pinned device-to-host copy_ of the state's bytes:"
                 f" {one * 1000:.1f} ms ({total / one / GB:.1f} GB/s)")


def memcpy(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, str]:
    """One copy of the state into a preallocated, touched buffer: memmove on one thread, and torch copy_."""
    tensors = [t.detach() for t in state_tensors(module, optimizer).values()]
    total = sum(t.numel() * t.element_size() for t in tensors)
    buf = torch.zeros(total, dtype=torch.uint8)
    base = buf.data_ptr()

    def memmove() -> None:
        harness.memmove_into(tensors, base)

    def torch_copy() -> None:
        pos = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            buf[pos:pos + n].copy_(t.reshape(-1).view(torch.uint8))
            pos += n

    one = statistics.median(timed(memmove)[1] for _ in range(3))
    threads = statistics.median(timed(torch_copy)[1] for _ in range(3))
    return one, (f"state: {total / GB:.3f} GB ({len(tensors)} tensors: fp32 params + AdamW exp_avg/exp_avg_sq/step)\n"
            f"one memcpy of the state into a preallocated buffer: {one:.3f} s (ctypes.memmove, 1 thread,"
            f" {total / one / GB:.1f} GB/s); torch copy_ with {torch.get_num_threads()} threads: {threads:.3f} s")


def foreach_copy(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, str]:
    """One ``torch._foreach_copy_`` of every parameter and optimizer-state tensor into preallocated buffers (median of
    21): the least a copy of that many tensors costs, per-tensor work included (the ``--model many`` reference)."""
    tensors = [t.detach() for t in state_tensors(module, optimizer).values()]
    buffers = [torch.empty_like(t) for t in tensors]

    def copy() -> None:
        with torch.no_grad():
            torch._foreach_copy_(buffers, tensors)

    copy()
    one = statistics.median(timed(copy)[1] for _ in range(21))
    return one, (f"one torch._foreach_copy_ of the state's {len(tensors)} tensors into preallocated buffers:"
                 f" {one * 1000:.3f} ms (median of 21)")


class NullTier(Backend):
    """A tier that keeps nothing: staging and persist bookkeeping run, no byte is stored."""

    tier = "null"
    durable = False

    @property
    def url(self) -> str:
        return "null://"

    def write(self, key: str, buffers: Any) -> int:
        return sum(memoryview(b).nbytes for b in buffers)

    def commit(self, key: str, data: bytes) -> None:
        pass

    def read(self, key: str) -> bytes:
        raise FileNotFoundError(key)

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        raise FileNotFoundError(key)

    def list(self, prefix: str = "") -> list[str]:
        return []

    def delete(self, key: str) -> None:
        pass

    def exists(self, key: str) -> bool:
        return False


def record_manifest_commits(tier: Backend) -> dict[int, float]:
    """When each step's manifest commit returned: for LocalTier that is after the data objects were fsynced and the
    manifest was fsynced, renamed into place and its directory fsynced, i.e. durable. (Wraps the instance's method.)
    """
    done: dict[int, float] = {}
    commit = tier.commit

    def timed_commit(key: str, data: bytes) -> None:
        commit(key, data)
        head, _, name = key.rpartition("/")
        step = parse_step_dirname(head)
        if name == MANIFEST_NAME and step is not None:
            done[step] = time.perf_counter()

    tier.commit = timed_commit  # type: ignore[method-assign]
    return done


class Patches:
    """Methods of the library replaced by instrumented ones for the duration of a run (benchmark only); ``close``
    puts the originals back."""

    def __init__(self) -> None:
        self._restore: list[tuple[Any, str, Any]] = []

    def patch(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replace ``owner.name`` by ``make(original)``."""
        original = owner.__dict__[name]
        self._restore.append((owner, name, original))
        setattr(owner, name, make(original))

    def close(self) -> None:
        for owner, name, original in self._restore:
            setattr(owner, name, original)


class DeviceCopies(Patches):
    """CUDA: each snapshot's device-to-host copy (bytes, seconds on the side stream, from the arena's timing events)
    and when the snapshot agent was told a snapshot is staged (then it survives the trainer)."""

    def __init__(self) -> None:
        from lightning_snapshot.backends.ram import agent
        from lightning_snapshot.staging import arena

        super().__init__()
        self.copies: list[tuple[int, float]] = []
        self.to_agent: dict[int, float] = {}

        def timed_copy(copy: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(arena_self: Any, handle: Any, *args: Any, **kwargs: Any) -> Any:
                out = copy(arena_self, handle, *args, **kwargs)
                if handle.device_copy_seconds:
                    self.copies.append((handle.device_copy_bytes, handle.device_copy_seconds))
                return out

            return wrapped

        def timed_staged(staged: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(client: Any, job: Any) -> None:
                staged(client, job)
                self.to_agent.setdefault(job.step, time.perf_counter())

            return wrapped

        self.patch(arena.HostArena, "_copy", timed_copy)
        self.patch(agent.AgentClient, "staged", timed_staged)


class BackgroundCpu(Patches):
    """CPU seconds lightning-snapshot's background threads spend, by thread (benchmark instrumentation only).

    Wall-clock overheads are at the mercy of other processes on a shared machine; CPU time is not. On 2 cores,
    where training keeps both busy, CPU time of the background threads is compute training loses. Wraps, for the
    duration of a run, the functions each thread runs: the copy (``HostArena._copy``: memmove + staging checksums),
    the allocation of arena buffers (``HostArena._grow``), and the persist thread's work per snapshot and tier
    (``_TierWorker._persist``: re-verifying the staged bytes, writing, committing, retention).
    """

    def __init__(self) -> None:
        from lightning_snapshot import persist
        from lightning_snapshot.staging import arena

        super().__init__()
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        for owner, name, label in ((arena.HostArena, "_copy", "copy"), (arena.HostArena, "_grow", "allocate"),
                                   (persist._TierWorker, "_persist", "persist")):
            self.patch(owner, name, lambda original, label=label: self._wrap(original, label))

    def _wrap(self, original: Callable[..., Any], label: str) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds[label] = self.seconds.get(label, 0.0) + time.thread_time() - t0
                    self.calls[label] = self.calls.get(label, 0) + 1

        return wrapped


def run_ours(bench: Bench, method: str) -> Row:
    row = Row(method)
    local = method not in ("ours-ram", "ours-agent")
    path = bench.workdir(method)
    tier: Backend
    if method == "ours-agent":
        from lightning_snapshot.backends import RamTier

        tier = RamTier(every_n_train_steps=bench.every, keep_last=2, name=f"stall-{os.getpid()}")
    elif local:
        tier = LocalTier(path, every_n_train_steps=bench.every, keep_last=2)
    else:
        tier = NullTier(every_n_train_steps=bench.every, keep_last=2)
    budget = None
    if method == "ours-local-1buf":
        # one arena buffer: the state rounded up to 2 MiB (with room for the 64-byte alignment), plus a little
        budget = -(-(bench.state_bytes + MiB) // (2 * MiB)) * 2 * MiB + MiB
        row.note = f"max_host_bytes={budget / GB:.3f} GB"
    callback = SnapshotCallback(tier, resume=False, max_host_bytes=budget)
    committed = record_manifest_commits(tier)
    background = BackgroundCpu()
    from lightning_snapshot import writer

    health = writer.nonfinite_tensors
    if method == "ours-local-nohealth":
        writer.nonfinite_tensors = lambda staged: []  # every snapshot recorded healthy without looking
    copies = DeviceCopies()
    try:
        run = train(bench, [callback])
    finally:
        background.close()
        copies.close()
        writer.nonfinite_tensors = health
        if method == "ours-agent":
            from lightning_snapshot.backends.ram.agent import stop_agent

            stop_agent(tier.node_dir)  # type: ignore[attr-defined]
    started = run.probe.save_started
    row.device_copy = copies.copies
    row.to_agent_s = [copies.to_agent[s] - started[s] for s in bench.schedule if s in copies.to_agent and s in started]
    if row.device_copy:
        row.details.append("device-to-host copy per snapshot (side stream, CUDA events): " + ", ".join(
            f"{n / GB:.2f} GB in {t * 1000:.0f} ms ({n / t / GB:.1f} GB/s)" for n, t in row.device_copy))
    if row.to_agent_s:
        row.details.append(f"save call -> held by the snapshot agent (crash-safe): "
                           f"{[round(x * 1000) for x in row.to_agent_s]} ms")
    row.stall_ms = run.logger.values("snapshot/stall_ms")
    fill_common(bench, row, run, committed if local else None)
    n = len(bench.schedule)
    hooks_cpu = sum(run.hooks.cpu_by_step.get(s, 0.0) for s in bench.schedule)
    row.cpu_per_snapshot = (hooks_cpu + sum(background.seconds.values())) / n
    row.details.append(
        "CPU per snapshot (thread time, all " + str(n) + " snapshots): "
        + ", ".join([f"training-thread hooks {hooks_cpu / n * 1000:.1f} ms"]
                    + [f"{k} thread {v / n:.3f} s ({background.calls.get(k, 0)} calls, {v:.2f} s in all)"
                       for k, v in sorted(background.seconds.items())])
        + f"; total {row.cpu_per_snapshot:.3f} s"
    )
    if not local and committed:
        started = run.probe.save_started
        hand = [committed[s] - started[s] for s in bench.schedule if s in committed and s in started]
        row.details.append(f"null-tier 'commit' (nothing stored) after median {statistics.median(hand):.3f} s")
    skipped = run.logger.values("snapshot/skipped")
    row.skipped = int(max(skipped)) if skipped else 0
    failed = run.logger.values("snapshot/failed")
    if failed:
        row.details.append(f"snapshot/failed = {int(max(failed))}")
    stage = run.logger.values("snapshot/stage_ms")
    persist = run.logger.values(f"snapshot/{tier.tier}/persist_ms")
    mbps = run.logger.values(f"snapshot/{tier.tier}/throughput_MBps")
    if stage:
        row.details.append(f"snapshot/stage_ms median {statistics.median(stage):.0f} (n={len(stage)})")
    if persist:
        row.details.append(f"snapshot/{tier.tier}/persist_ms median {statistics.median(persist):.0f},"
                           f" throughput median {statistics.median(mbps):.0f} MB/s (n={len(persist)})")
    n_stall = len(row.stall_ms)
    if n_stall != len(bench.schedule) - row.skipped:
        row.details.append(f"snapshot/stall_ms logged {n_stall} times for {len(bench.schedule)} scheduled and"
                           f" {row.skipped} skipped snapshots")
    if row.stall_ms and row.ext_stall_ms:
        taken = [e for e in row.ext_stall_ms if e > 0.5]
        diff = statistics.median(taken or row.ext_stall_ms) - statistics.median(row.stall_ms)
        row.details.append(f"stall measured around the callback's hooks: median"
                           f" {statistics.median(taken or row.ext_stall_ms):.2f} ms (metric + {diff:.2f} ms),"
                           f" per snapshot {[round(x, 1) for x in row.ext_stall_ms]}")
    if local and bench.restore:
        reference = run.probe.reference
        del run
        if (path / step_dirname(bench.check_step) / MANIFEST_NAME).is_file():

            def load(module: GPT, optimizer: torch.optim.Optimizer) -> None:
                # the weights are read straight into the model's tensors (as the callback's own restore does)
                ckpt = load_snapshot(str(path), step=bench.check_step, into=module.state_dict())
                module.load_state_dict(ckpt["state_dict"])
                optimizer.load_state_dict(ckpt["optimizer_states"][0])

            row.restore_s, row.consistency = restore_into_fresh(bench, load, path / step_dirname(bench.check_step),
                                                                reference)
        else:
            row.consistency = "SKIPPED"
            row.details.append(f"step {bench.check_step} (the checked snapshot) is not in the tier")
    shutil.rmtree(path, ignore_errors=True)
    return row


class TimedTorchIO(TorchCheckpointIO):
    """Lightning's torch.save IO; hands every written file to the background fsync (Lightning never fsyncs)."""

    def __init__(self, later: FsyncLater) -> None:
        super().__init__()
        self.later = later

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        self.later.submit(int(checkpoint["global_step"]), str(path))


def run_modelcheckpoint(bench: Bench, method: str) -> Row:
    """``torch-save`` (synchronous) and ``async-io`` (Lightning AsyncCheckpointIO): the same ModelCheckpoint."""
    row = Row(method, durable_mark="+")
    path = bench.workdir(method)
    later = FsyncLater()
    io = TimedTorchIO(later)
    plugin = AsyncCheckpointIO(io) if method == "async-io" else io
    checkpoint = ModelCheckpoint(dirpath=path, every_n_train_steps=bench.every, save_top_k=-1)
    try:
        run = train(bench, [checkpoint], plugins=[plugin])
    finally:
        later.close()
    fill_common(bench, row, run, later.durable)
    row.details += later.errors
    reference = run.probe.reference
    del run
    file = later.paths.get(bench.check_step)
    if bench.restore and file is None:
        row.consistency = "SKIPPED"
    elif bench.restore:

        def load(module: GPT, optimizer: torch.optim.Optimizer) -> None:
            ckpt = torch.load(file, map_location="cpu", weights_only=False)
            module.load_state_dict(ckpt["state_dict"])
            optimizer.load_state_dict(ckpt["optimizer_states"][0])

        row.restore_s, row.consistency = restore_into_fresh(bench, load, file, reference)
    shutil.rmtree(path, ignore_errors=True)
    return row


_DROP = object()


def dcp_stageable(state: Any, path: str = "") -> tuple[Any, list[str]]:
    """``state`` with only what DCP's stager can copy (tensors, numbers, strings, bools, None, and dicts, lists and
    tuples of them), as a user of DCP would hand it the model's and the optimizer's state dicts; returns it with the
    paths of the values left out. (torch 2.11's stager raised ``KeyError: <class 'type'>`` on the GPU, it seems
    copying a tensor subclass through its ``__reduce_ex__``: those go in as plain tensors on the same storage.)
    Containers are new; the tensors are the state's own."""
    dropped: list[str] = []

    def keep(x: Any, at: str) -> Any:
        if isinstance(x, dict):
            out = {}
            for k, v in x.items():
                kept = keep(v, f"{at}/{k}")
                if kept is not _DROP:
                    out[k] = kept
            return out
        if isinstance(x, (list, tuple)):
            items = [keep(v, f"{at}/{i}") for i, v in enumerate(x)]
            if any(v is _DROP for v in items):
                return _DROP
            return items if isinstance(x, list) else tuple(items)
        if isinstance(x, torch.Tensor) and type(x) is not torch.Tensor:
            # a tensor subclass (nn.Parameter): torch 2.11's stager copies it through __reduce_ex__, whose
            # arguments hold its class (KeyError: <class 'type'>); a plain tensor on the same storage
            return x.detach().as_subclass(torch.Tensor)
        if x is None or isinstance(x, (torch.Tensor, bool, int, float, str)):
            return x
        dropped.append(f"{at} ({type(x).__name__})")
        return _DROP

    return keep(state, path), dropped


def merge_loaded(into: Any, loaded: Any) -> None:
    """Put the non-tensor values DCP loaded into ``loaded`` (a :func:`dcp_stageable` copy) back into ``into``, the
    state dicts it was made from (tensors are loaded in place, so they are there already)."""
    if isinstance(into, dict) and isinstance(loaded, dict):
        for k, v in loaded.items():
            if isinstance(into.get(k), (dict, list)) and isinstance(v, (dict, list)):
                merge_loaded(into[k], v)
            elif not isinstance(v, torch.Tensor):
                into[k] = v
    elif isinstance(into, list) and isinstance(loaded, list) and len(into) == len(loaded):
        for i, v in enumerate(loaded):
            if isinstance(into[i], (dict, list)) and isinstance(v, (dict, list)):
                merge_loaded(into[i], v)
            elif not isinstance(v, torch.Tensor):
                into[i] = v


class DcpCallback(Checkpoint):
    """``dcp.async_save`` every K steps with one reused stager; waits for staging before the next optimizer step."""

    def __init__(self, root: Path, every: int, stager: Any) -> None:
        self.root, self.every, self.stager = root, every, stager
        self.done: dict[int, float] = {}
        self.staged: dict[int, float] = {}
        self.started: dict[int, float] = {}
        self._staging: cf.Future[Any] | None = None
        self._upload: cf.Future[Any] | None = None
        self._last = -1
        self.dropped: set[str] = set()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        step = trainer.global_step
        if step % self.every or step == self._last:
            return
        self._last = step
        self.started[step] = time.perf_counter()
        if self._upload is not None:
            self._upload.result()  # the reused stager's buffers may still be being written out
        model_sd, optim_sd = get_state_dict(pl_module, trainer.optimizers[0])
        state, dropped = dcp_stageable({"model": model_sd, "optim": optim_sd})
        self.dropped.update(dropped)
        response = dcp.async_save(state,
                                  storage_writer=dcp.FileSystemWriter(str(self.root / f"step-{step}")),
                                  async_stager=self.stager)
        response.staging_completion.add_done_callback(lambda _, s=step: self.staged.__setitem__(s, time.perf_counter()))
        response.upload_completion.add_done_callback(lambda _, s=step: self.done.__setitem__(s, time.perf_counter()))
        self._staging, self._upload = response.staging_completion, response.upload_completion

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._staging is not None:
            self._staging.result()  # parameters and optimizer state change in this step
            self._staging = None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._upload is not None:
            self._upload.result()


def run_dcp(bench: Bench) -> Row:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    row = Row("dcp")
    path = bench.workdir("dcp")
    with gloo_group():
        # pinned memory and non-blocking copies need CUDA; on CPU the best is async staging into shared memory,
        # with the stager (and so its cached staging storages) reused across saves
        if bench.device == "cuda":  # its pinned-memory stager, non-blocking copies
            stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                  use_async_staging=True, use_non_blocking_copy=True))
            row.note = "DefaultStager(pinned, async, non-blocking, reused)"
        else:
            stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                  use_async_staging=True, use_non_blocking_copy=False))
            row.note = "DefaultStager(shm, async, reused)"
        callback = DcpCallback(path, bench.every, stager)
        try:
            run = train(bench, [callback])
        finally:
            stager.close()
        fill_common(bench, row, run, callback.done)
        if callback.dropped:
            row.details.append("left out of DCP's state (its stager cannot copy them): "
                               + ", ".join(sorted(callback.dropped)))
        staging = [callback.staged[s] - callback.started[s] for s in bench.schedule if s in callback.staged]
        if staging:
            row.details.append(f"staging (save call -> staging future done) per snapshot:"
                               f" {[round(x, 3) for x in staging]} s")
        reference = run.probe.reference
        del run, stager, callback
        target = path / f"step-{bench.check_step}"
        if not bench.restore:
            shutil.rmtree(path, ignore_errors=True)
            return row

        def load(module: GPT, optimizer: torch.optim.Optimizer) -> None:
            model_sd, optim_sd = get_state_dict(module, optimizer)
            state, _ = dcp_stageable({"model": model_sd, "optim": optim_sd})
            dcp.load(state, checkpoint_id=str(target))
            merge_loaded({"model": model_sd, "optim": optim_sd}, state)
            set_state_dict(module, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

        row.restore_s, row.consistency = restore_into_fresh(bench, load, target, reference)
    shutil.rmtree(path, ignore_errors=True)
    return row


def torchsnapshot_status() -> str | None:
    """None when torchsnapshot is importable next to this torch, else why not."""
    try:
        import torchsnapshot  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"not installable without changing torch ({type(e).__name__}: {e})"
    return None


class TorchSnapshotCallback(Checkpoint):
    """``Snapshot.async_take`` every K steps; the previous one must have completed before the next is taken."""

    def __init__(self, root: Path, every: int, later: FsyncLater) -> None:
        self.root, self.every, self.later = root, every, later
        self._pending: Any = None
        self._last = -1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        from torchsnapshot import Snapshot

        step = trainer.global_step
        if step % self.every or step == self._last:
            return
        self._last = step
        if self._pending is not None:
            self._pending.wait()
        self._pending = Snapshot.async_take(str(self.root / f"step-{step}"),
                                            {"model": pl_module, "optim": trainer.optimizers[0]})
        self.later.submit(step, str(self.root / f"step-{step}"), wait=self._pending.wait)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._pending is not None:
            self._pending.wait()


def run_torchsnapshot(bench: Bench) -> Row:
    row = Row("torchsnapshot", durable_mark="+")
    status = torchsnapshot_status()
    if status is not None:
        row.error = status
        return row
    from torchsnapshot import Snapshot

    path = bench.workdir("torchsnapshot")
    with gloo_group():
        later = FsyncLater()
        callback = TorchSnapshotCallback(path, bench.every, later)
        try:
            run = train(bench, [callback])
        finally:
            later.close()
        fill_common(bench, row, run, later.durable)
        row.details += later.errors
        reference = run.probe.reference
        del run, callback
        target = path / f"step-{bench.check_step}"

        def load(module: GPT, optimizer: torch.optim.Optimizer) -> None:
            Snapshot(path=str(target)).restore({"model": module, "optim": optimizer})

        row.restore_s, row.consistency = restore_into_fresh(bench, load, target, reference)
    shutil.rmtree(path, ignore_errors=True)
    return row


METHODS = harness.Methods(baseline="none")
METHODS.add("none", run_none, "no snapshots (the baseline; run first and again last: the spread shows the noise)")
METHODS.add("ours-ram", lambda b: run_ours(b, "ours-ram"),
            "lightning-snapshot, RAM arena only: a tier that keeps nothing, so staging and the persist thread's"
            " bookkeeping run but no byte reaches a disk")
METHODS.add("ours-agent", lambda b: run_ours(b, "ours-agent"),
            "lightning-snapshot, ``RamTier`` (no erasure coding): the node's snapshot agent maps the arena and holds"
            " each snapshot once its copy finished (it flushes it if the trainer dies)")
METHODS.add("ours-local", lambda b: run_ours(b, "ours-local"),
            "lightning-snapshot, arena + ``LocalTier`` on a real disk (the reference row for the ratios)")
METHODS.add("ours-local-nohealth", lambda b: run_ours(b, "ours-local-nohealth"),
            "``ours-local`` with the health check (the non-finite scan of the staged copy) switched off: the"
            " difference to ``ours-local`` is what the health check costs")
METHODS.add("ours-local-1buf", lambda b: run_ours(b, "ours-local-1buf"),
            "the same with ``max_host_bytes`` set to one arena buffer (snapshots skipped if it is busy)")
METHODS.add("torch-save", lambda b: run_modelcheckpoint(b, "torch-save"),
            "synchronous ``torch.save``, as ``ModelCheckpoint(every_n_train_steps=K, save_top_k=-1)`` does")
METHODS.add("async-io", lambda b: run_modelcheckpoint(b, "async-io"),
            "Lightning ``AsyncCheckpointIO`` with the same ``ModelCheckpoint``")
METHODS.add("dcp", run_dcp,
            "``torch.distributed.checkpoint.async_save`` with one reused ``DefaultStager`` (asynchronous staging into"
            " shared memory; pinned memory and non-blocking copies need CUDA), single-process gloo group; the staging"
            " future is awaited before the next optimizer step and the previous upload before the next save, as its"
            " contract requires")
METHODS.add("torchsnapshot", run_torchsnapshot,
            "``torchsnapshot.Snapshot.async_take`` (if it installs next to this torch; otherwise reported)")
__doc__ = METHODS.document(__doc__)


# ================================================================================================ report
def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


@dataclass
class Baseline:
    wall_s: float | None  # training window of the quieter baseline run
    period_s: float | None  # median quiet snapshot period over both baseline runs
    rss_growth: int | None  # the smaller RSS growth of the two
    runs: harness.Baselines[Row]

    @classmethod
    def from_rows(cls, rows: list[Row]) -> Baseline:
        runs = harness.Baselines([r for r in rows if r.method == "none" and r.error is None and r.wall_s is not None],
                                 noise=lambda r: r.noise)
        quieter = runs.quieter
        period, _ = quiet_median([p for r in runs.runs for p in r.periods])
        growth = runs.smallest(lambda r: r.rss_growth)
        return cls(quieter.wall_s if quieter else None, period, None if growth is None else int(growth), runs)

    def overhead(self, row: Row | None) -> float | None:
        """Added wall time per snapshot over the whole window (the definition of the issue)."""
        if row is None or row.wall_s is None or self.wall_s is None or not row.snapshots or row.method == "none":
            return None
        return (row.wall_s - self.wall_s) / row.snapshots

    def overhead_p50(self, row: Row | None) -> float | None:
        """Median quiet snapshot period minus the baseline's: robust to other processes and to one-off costs."""
        if row is None or self.period_s is None or row.method == "none":
            return None
        period, _ = quiet_median(row.periods)
        return None if period is None else period - self.period_s

    def extra_rss(self, row: Row) -> int | None:
        if row.rss_growth is None or self.rss_growth is None or row.method == "none":
            return None
        return row.rss_growth - self.rss_growth


COLUMNS = ["method", "snaps", "stall med", "stall max", "overhead", "ovh p50", "durable", "peak extra RSS", "restore",
           "consistency", "stall/ours", "ovh/ours", "p50/ours", "noise"]


def report(bench: Bench, rows: list[Row], out: harness.Report) -> None:
    base = Baseline.from_rows(rows)
    ref = next((r for r in rows if r.method == REFERENCE and r.error is None), None)
    ref_stall = _median(ref.stall_ms) if ref else None
    ref_over, ref_p50 = base.overhead(ref), base.overhead_p50(ref)
    state = bench.state_bytes or 1
    out.say()
    out.say(f"{len(bench.schedule)} snapshots per run (steps {bench.schedule[0]}..{bench.schedule[-1]}, every"
            f" {bench.every}, {bench.steps} steps). stall: ms the training thread was blocked per snapshot."
            f" overhead: added wall s per snapshot over the run; ovh p50: the same from the median snapshot period"
            f" ({bench.every} steps) among those other processes left quiet. durable: s from the save call to fsynced."
            f" restore: cold, s. Ratios against {REFERENCE}. noise: share of the CPUs other processes used during"
            " the run.")
    spread = base.runs.spread(lambda r: r.wall_s) / len(bench.schedule)
    if base.runs.runs:
        windows = base.runs.describe(lambda r: r.wall_s, per=len(bench.schedule), per_unit=" per snapshot")
        out.say(f"baseline windows {windows};"
                f" median quiet baseline period {fmt(base.period_s, '.3f')} s; RSS growth during fit"
                f" {', '.join(f'{(r.rss_growth or 0) / GB:.2f}' for r in base.runs.runs)} GB (the smaller is"
                " subtracted)")
    table = harness.Table(f"stall benchmark, {len(bench.schedule)} snapshots per run", COLUMNS, key="stall", notes=[
        "+: the method never fsyncs; the benchmark fsyncs each file in a background thread once it is written."
        " 'N-Ms' in snaps: N taken, M skipped. ref~0: the reference's overhead is within the baseline spread"
        " (or <= 0), so no ratio is meaningful"])
    for r in rows:
        if r.error is not None:
            table.add_span(r.method, r.error, data={"method": r.method, "error": r.error})
            continue
        is_base = r.method == "none"
        stall = None if is_base else _median(r.stall_ms)
        stall_max = None if is_base else max(r.stall_ms, default=None)
        over, p50 = base.overhead(r), base.overhead_p50(r)
        durable = _median(r.durable_s)
        extra = base.extra_rss(r)
        extra_s = "-" if extra is None else f"{extra / GB:4.2f} GB {extra / state:4.2f}x"
        durable_s = (f"{durable:.2f}{r.durable_mark}" if durable is not None
                     else ("n/a" if r.method in ("none", "ours-ram") else "-"))
        snaps = f"{r.snapshots - r.skipped}" + (f"-{r.skipped}s" if r.skipped else "")
        table.add(r.method, snaps, fmt(stall, ".1f"), fmt(stall_max, ".1f"), fmt(over, ".3f"), fmt(p50, ".3f"),
                  durable_s, extra_s, fmt(r.restore_s, ".2f", "n/a"), r.consistency,
                  "-" if is_base else ratio(stall, ref_stall), ratio(over, ref_over, spread),
                  ratio(p50, ref_p50, spread), f"{r.noise:.0%}",
                  data={"method": r.method, "snapshots": r.snapshots - r.skipped, "skipped": r.skipped,
                        "stall_ms_median": stall, "stall_ms_max": stall_max, "overhead_s": over,
                        "overhead_p50_s": p50, "durable_s_median": durable, "durable_fsynced_by_benchmark":
                        bool(r.durable_mark), "extra_rss_bytes": extra, "restore_s": r.restore_s,
                        "consistency": r.consistency, "noise": r.noise, "unreliable": r.noise > NOISY})
    out.table(table)
    out.say()
    for r in rows:
        lines = row_lines(r)
        if r.periods:
            lines.append("snapshot periods s (noise): " + ", ".join(f"{w:.2f} ({n:.0%})" for w, n in r.periods))
        if lines and r.error is None:
            out.say(f"[{r.method}] " + f"\n[{r.method}] ".join(lines))
    if bench.device == "cuda":
        gpu_report(bench, rows, out)
    else:
        targets(bench, rows, base, out.targets)


def row_lines(r: Row) -> list[str]:
    """A row's note and details, as printed under the table."""
    return ([r.note] if r.note else []) + r.details


def gpu_report(bench: Bench, rows: list[Row], out: harness.Report) -> None:
    """--device cuda: step time, stall as a share of it, the copy's bandwidth against one pinned copy_, and the
    time until the snapshot agent holds the snapshot; the GPU issue's targets."""
    check = out.targets
    base = [st for r in rows if r.method == "none" and r.error is None for st in r.step_s]
    step = statistics.median(base) if base else None
    pinned = bench.pinned_copy_s
    out.say(f"\nGPU: {torch.cuda.get_device_name()}; median step (baseline) {fmt(step and step * 1000, '.1f')} ms"
            f" ({bench.accumulate} micro-batches of {bench.cfg.batch} x {bench.cfg.seq} tokens, {bench.precision});"
            f" one pinned copy_ of the state {fmt(pinned and pinned * 1000, '.1f')} ms")
    table = harness.Table("GPU: stall against step time", ["method", "step med ms", "stall med ms", "stall/step",
                                                          "copy GB/s", "copy/pinned", "to agent ms", "agent/pinned"],
                          key="gpu")
    pinned_bw = bench.state_bytes / pinned if pinned else None
    for r in rows:
        if r.error is not None or r.method == "none":
            continue
        st = statistics.median(r.step_s) if r.step_s else None
        stall = _median(r.stall_ms)
        bw = _median([n / t for n, t in r.device_copy]) if r.device_copy else None
        agent = _median(r.to_agent_s)
        table.add(r.method, fmt(st and st * 1000, ".1f"), fmt(stall, ".2f"),
                  "-" if stall is None or not step else f"{stall / (step * 1000):.2%}",
                  fmt(bw and bw / GB, ".1f"), "-" if bw is None or not pinned_bw else f"{bw / pinned_bw:.0%}",
                  fmt(agent and agent * 1000, ".0f"), "-" if agent is None or not pinned else f"{agent / pinned:.2f}x",
                  data={"method": r.method, "step_ms_median": st and st * 1000, "stall_ms_median": stall,
                        "copy_GBps": bw and bw / GB, "to_agent_ms_median": agent and agent * 1000})
        if r.method in OURS and stall is not None and step:
            check.check(stall <= 0.01 * step * 1000, f"{r.method}: median stall {stall:.2f} ms <= 1% of the median"
                        f" step {step * 1000:.1f} ms", stall, 0.01 * step * 1000)
        if bw is not None and pinned_bw:
            check.check(bw >= 0.8 * pinned_bw, f"{r.method}: device-to-host copy {bw / GB:.1f} GB/s >= 80% of one"
                        f" pinned copy_ ({pinned_bw / GB:.1f} GB/s)", bw / GB, 0.8 * pinned_bw / GB)
        if agent is not None and pinned:
            check.check(agent <= 1.5 * pinned, f"{r.method}: held by the agent {agent * 1000:.0f} ms after the save"
                        f" call <= 1.5 x the pinned copy ({pinned * 1000:.0f} ms)", agent * 1000, 1.5 * pinned * 1000)
    out.table(table)


def targets(bench: Bench, rows: list[Row], base: Baseline, check: harness.Targets) -> None:
    """The issue's targets, checked against this run (overhead both ways: whole window, and median period)."""
    by = {r.method: r for r in rows if r.error is None and r.method != "none"}
    peers = [r for r in by.values() if r.method not in OURS and not r.consistency.startswith("FAIL")]
    best = min((r for r in peers if base.overhead_p50(r) is not None), key=lambda r: base.overhead_p50(r) or 0.0,
               default=None)
    check.title = "targets" + (f" (best peer: {best.method}, the consistent peer with the smallest ovh p50)"
                               if best else "")
    for m in OURS:
        if m in by and by[m].stall_ms:
            s = statistics.median(by[m].stall_ms)
            check.check(s <= 5.0, f"{m}: median stall {s:.1f} ms <= 5 ms", s, 5.0)
            if bench.cfg.kind == "many" and bench.foreach_s:
                ref = bench.foreach_s * 1000
                check.check(s <= 3 * ref, f"{m}: median stall {s:.2f} ms <= 3 x one _foreach_copy_ of the same"
                                          f" tensors ({ref:.3f} ms) = {3 * ref:.2f} ms ({s / ref:.1f}x)", s, 3 * ref)
    ref = by.get(REFERENCE)
    if ref and best:
        for name, fn in (("overhead", base.overhead), ("ovh p50", base.overhead_p50)):
            o, ob = fn(ref), fn(best)
            if o is not None and ob is not None:
                check.check(o <= 0.2 * ob, f"{REFERENCE}: {name} {o:.3f} s <= 0.2 x {best.method}'s {ob:.3f} s"
                                           f" = {0.2 * ob:.3f} s", o, 0.2 * ob)
        d, db = _median(ref.durable_s), _median(best.durable_s)
        if d is not None and db is not None:
            check.check(d <= 0.5 * db, f"{REFERENCE}: durable in {d:.2f} s <= 0.5 x {best.method}'s {db:.2f} s",
                        d, 0.5 * db)
    if "ours-ram" in by and bench.memcpy_s:
        for name, fn in (("overhead", base.overhead), ("ovh p50", base.overhead_p50)):
            o = fn(by["ours-ram"])
            if o is not None:
                check.check(o <= 1.5 * bench.memcpy_s, f"ours-ram: {name} {o:.3f} s <= 1.5 x one memcpy"
                                                       f" ({bench.memcpy_s:.3f} s) = {1.5 * bench.memcpy_s:.3f} s",
                            o, 1.5 * bench.memcpy_s)
    for m in OURS:
        cpu = by[m].cpu_per_snapshot if m in by else None
        if cpu is not None and bench.memcpy_s:
            check.info(f"{m}: CPU time per snapshot (hooks + background threads, not a wall-clock target)"
                       f" {cpu:.3f} s = {cpu / bench.memcpy_s:.2f} x one memcpy", cpu)
    if ref and "dcp" in by and ref.restore_s and by["dcp"].restore_s:
        check.check(ref.restore_s <= 0.5 * by["dcp"].restore_s,
                    f"{REFERENCE}: restore {ref.restore_s:.2f} s <= 0.5 x dcp's {by['dcp'].restore_s:.2f} s",
                    ref.restore_s, 0.5 * by["dcp"].restore_s)
    for m in ("ours-local", "ours-local-1buf"):
        if m in by and bench.restore:
            check.check(by[m].consistency == "PASS", f"{m}: consistency {by[m].consistency}")
    for m, limit in (("ours-local", 2.1), ("ours-ram", 2.1), ("ours-local-1buf", 1.1)):
        extra = base.extra_rss(by[m]) if m in by else None
        if extra is not None and bench.state_bytes:
            check.check(extra / bench.state_bytes <= limit,
                        f"{m}: peak extra host memory {extra / bench.state_bytes:.2f}x the state <= {limit}x",
                        extra / bench.state_bytes, limit)


# ================================================================================================ main
def run_method(method: str, bench: Bench, retries: int) -> Row:
    """Run one method; again (up to ``retries`` times) while other processes disturbed it, keeping the quietest."""
    kept = harness.run_quietest(
        method, lambda: METHODS.run(method, bench), retries=retries, noise=lambda r: r.noise,
        failed=lambda r: r.error is not None,
        on_error=lambda e: Row(method, error=f"ERROR {type(e).__name__}: {str(e)[:200]}"),
        describe=lambda r: f"wall window {r.wall_s or 0:.2f} s")
    if kept.noise > NOISY:
        kept.details.append(harness.unreliable_line(kept.foreign_cpu_s, kept.noise))
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="~21M-parameter model, fewer steps (< 2 minutes)")
    parser.add_argument("--model", choices=["gpt", "many"], default="gpt",
                        help="many: 195 Linear(8, 8) layers (1,560 tensors with AdamW, a few hundred bytes each),"
                             " snapshot every 4 steps, 20 snapshots; the stall is compared with one"
                             " torch._foreach_copy_ of the same tensors")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: full 44, quick 14)")
    parser.add_argument("--every", type=int, help="snapshot every K steps, K >= 2 (default: full 5, quick 3)")
    parser.add_argument("--methods", default=",".join(METHODS.names),
                        help=f"comma-separated subset of {','.join(METHODS.names)} (the baseline always runs)")
    parser.add_argument("--dir", default=None, help="where snapshots are written (default: a temp dir in /tmp)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: one GPU, GPT-2 medium (354.8M params), bf16-mixed, 4 micro-batches of 8 x 1024"
                             " tokens per step, the peers' GPU options (DCP's pinned stager)")
    parser.add_argument("--accumulate", type=int, default=None, help="micro-batches per step (default: cuda 4, cpu 1)")
    parser.add_argument("--no-restore", dest="restore", action="store_false",
                        help="skip the cold restore and consistency check after each run")
    parser.add_argument("--retries", type=int, default=0,
                        help=f"run a method again (keeping the quieter run) when other processes used more than"
                             f" {NOISY * 100:.0f}%% of the CPUs during it (default 0)")
    harness.add_arguments(parser)
    args = parser.parse_args(argv)

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU")
    many = args.model == "many"
    if many and cuda:
        parser.error("--model many runs on CPU")
    every = args.every or (4 if many else 10 if cuda else 3 if args.quick else 5)
    steps = args.steps or (21 * every - 1 if many else (3 if args.quick else 6) * every + 2 if cuda
                           else 5 * every - 1 if args.quick else 9 * every - 1)
    if every < 2 or steps < every:
        parser.error("need --every >= 2 and --steps >= --every")
    methods = METHODS.schedule(METHODS.select(args.methods, parser))

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    root = Path(tempfile.mkdtemp(prefix="ls-stall-", dir=args.dir))
    bench = Bench(MANY if many else MEDIUM if cuda else QUICK if args.quick else FULL, steps, every, root,
                  device=args.device,
                  precision="bf16-mixed" if cuda else None, accumulate=args.accumulate or (4 if cuda else 1),
                  restore=args.restore)
    n_params = sum(p.numel() for p in fresh_model(bench.cfg).parameters())
    out = harness.Report("stall", args)
    out.header(model=f"{n_params / 1e6:.1f}M params ({bench.cfg})", steps=steps, every=every,
               methods=",".join(methods), snapshots_in=root)
    # one short run first, so that one-time costs (lazy imports, thread pools, allocator growth) land in no row
    train(Bench(bench.cfg, 2, 2, root, device=bench.device, precision=bench.precision, accumulate=bench.accumulate),
          [])
    trim_memory()
    rows: list[Row] = []
    try:
        for method in methods:
            rows.append(run_method(method, bench, args.retries))
            if cuda:  # (GPU time is scarce: what each run showed, as soon as it is known)
                r = rows[-1]
                step_ms = statistics.median(r.step_s) * 1000 if r.step_s else float("nan")
                stall = statistics.median(r.stall_ms) if r.stall_ms else float("nan")
                print(f"    {method}: median step {step_ms:.1f} ms, median stall {stall:.2f} ms"
                      f" (max {max(r.stall_ms, default=0):.1f}), stalls {[round(x, 1) for x in r.stall_ms]}"
                      + "".join(f"\n    [{method}] {line}" for line in row_lines(r) + ([r.error] if r.error else [])),
                      flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(bench, rows, out)
    foreign = sum(r.foreign_cpu_s for r in rows)
    out.say(f"\nother processes used {foreign:.0f} CPU-s during the training runs that were kept")
    return out.finish(state_bytes=bench.state_bytes, memcpy_s=bench.memcpy_s, foreach_s=bench.foreach_s,
                      pinned_copy_s=bench.pinned_copy_s,
                      runs=rows)


if __name__ == "__main__":
    sys.exit(main())
