"""benchmarks/stall.py, part 3 of 3: the methods compared, one ``run_*`` function each.

One job: run one method through a measured training run (``_stall_run.train``) and fill its ``Row``: the baseline
(``run_none``, also the one-off memcpy and pinned-copy references), lightning-snapshot (``run_ours``, with the copy
and background-CPU instrumentation), ``ModelCheckpoint`` with ``torch.save`` or ``AsyncCheckpointIO``, DCP
``async_save`` and torchsnapshot. Registered in ``METHODS`` by ``benchmarks/stall.py`` (the entry point); not run on
its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as harness
import torch
from _harness import timed
from _stall_models import GB, GPT, MiB, gloo_group, state_bytes, state_tensors
from _stall_run import Bench, FsyncLater, Row, fill_common, restore_into_fresh, train
from lightning.pytorch.callbacks import Callback, Checkpoint, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from torch import nn

from lightning_snapshot import SnapshotCallback, load_snapshot
from lightning_snapshot.backends import Backend, LocalTier
from lightning_snapshot.format.manifest import MANIFEST_NAME, parse_step_dirname, step_dirname


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
            if bench.cfg.kind == "many":
                bench.foreach_in_fit_s, more = foreach_copy_in_fit(bench)
                line += "\n" + more
        bench.replica_check, more = replica_check(run.module, run.optimizer)
        print(line + "\n" + more, flush=True)
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
    return one, (
        f"state: {total / GB:.3f} GB ({len(tensors)} tensors: fp32 params + AdamW exp_avg/exp_avg_sq/step)"
        f" on {torch.cuda.get_device_name()}\none pinned device-to-host copy_ of the state's bytes:"
        f" {one * 1000:.1f} ms ({total / one / GB:.1f} GB/s)"
    )


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
            buf[pos : pos + n].copy_(t.reshape(-1).view(torch.uint8))
            pos += n

    one = statistics.median(timed(memmove)[1] for _ in range(3))
    threads = statistics.median(timed(torch_copy)[1] for _ in range(3))
    return one, (
        f"state: {total / GB:.3f} GB ({len(tensors)} tensors: fp32 params + AdamW exp_avg/exp_avg_sq/step)\n"
        f"one memcpy of the state into a preallocated buffer: {one:.3f} s (ctypes.memmove, 1 thread,"
        f" {total / one / GB:.1f} GB/s); torch copy_ with {torch.get_num_threads()} threads: {threads:.3f} s"
    )


def foreach_copy(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, str]:
    """One ``torch._foreach_copy_`` of every parameter and optimizer-state tensor into preallocated buffers (the
    least of five medians of 21: a moment of noise must not make the reference, and so the target, larger): the least
    a copy of that many tensors costs, per-tensor work included (the ``--model many`` reference)."""
    tensors = [t.detach() for t in state_tensors(module, optimizer).values()]
    buffers = [torch.empty_like(t) for t in tensors]

    def copy() -> None:
        with torch.no_grad():
            torch._foreach_copy_(buffers, tensors)

    copy()
    one = min(statistics.median(timed(copy)[1] for _ in range(21)) for _ in range(5))
    return one, (
        f"one torch._foreach_copy_ of the state's {len(tensors)} tensors into preallocated buffers:"
        f" {one * 1000:.3f} ms (the least of 5 medians of 21)"
    )


class _ForeachAtSnapshots(Callback):
    """One ``torch._foreach_copy_`` of the state's tensors into preallocated buffers right after the fetch that
    follows each snapshot step, where ours takes its snapshot: the same copy, with the caches as a training step
    leaves them."""

    def __init__(self, schedule: list[int]) -> None:
        self.schedule = set(schedule)
        self.buffers: list[torch.Tensor] | None = None
        self.seconds: list[float] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step not in self.schedule:
            return
        tensors = [t.detach() for t in state_tensors(pl_module, trainer.optimizers[0]).values()]
        if self.buffers is None:
            self.buffers = [torch.empty_like(t) for t in tensors]
        with torch.no_grad():
            start = time.perf_counter()
            torch._foreach_copy_(self.buffers, tensors)
            self.seconds.append(time.perf_counter() - start)


def foreach_copy_in_fit(bench: Bench) -> tuple[float, str]:
    """The same copy as :func:`foreach_copy`, timed inside a fit of its own (no snapshot library) at each snapshot
    step, right after the next batch is fetched (median): context for the ``--model many`` reference, not a target."""
    probe = _ForeachAtSnapshots(bench.schedule)
    train(bench, [probe])
    one = statistics.median(probe.seconds)
    return one, (
        f"the same _foreach_copy_ inside a fit, right after the fetch following each snapshot step (where"
        f" ours snapshots; caches as a training step leaves them): {one * 1000:.3f} ms (median of"
        f" {len(probe.seconds)})"
    )


def replica_check(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[tuple[float, float, int], str]:
    """The replica check's work on one rank under DDP (lightning_snapshot.fit.replicas: which tensors, their checksums on
    their device, the result on the host), with the default 4 slices (median over 20 checks: 5 rounds of the 4
    slices) and with everything at once (``replica_check=1``, median of 5). Not in the table's stall, whose runs are
    one process; the collective (8 bytes per tensor compared) is not included."""
    from lightning_snapshot.fit.replicas import ReplicaChecker, checksums
    from lightning_snapshot.state.capture import optimized_key

    trained = optimized_key([optimizer])
    token = object()  # (the capture plan holds in these runs: its plan is reused)
    out = []
    for slices, rounds in ((4, 20), (1, 5)):
        checker = ReplicaChecker(slices)

        def check(checker: ReplicaChecker = checker) -> None:
            checksums(checker.select(module, [optimizer], set(), trained, token)[1])

        check()
        out.append(harness.repeat(check, rounds).median * 1000)
    count = len(ReplicaChecker(1).select(module, [optimizer], set(), trained)[0])
    return (out[0], out[1], count), (
        f"replica check on one rank (DDP only, not in the stall below): {out[0]:.3f} ms per snapshot with the default"
        f" replica_check=4 (median of 20), {out[1]:.3f} ms for all {count} tensors (replica_check=1, median of 5)"
    )


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
        from lightning_snapshot.backends.ram import agent_client
        from lightning_snapshot.staging import copier

        super().__init__()
        self.copies: list[tuple[int, float]] = []
        self.to_agent: dict[int, float] = {}

        def timed_copy(copy: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(stager_self: Any, handle: Any, *args: Any, **kwargs: Any) -> Any:
                out = copy(stager_self, handle, *args, **kwargs)
                if handle.device_copy_seconds:
                    self.copies.append((handle.device_copy_bytes, handle.device_copy_seconds))
                return out

            return wrapped

        def timed_staged(staged: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(client: Any, job: Any) -> None:
                staged(client, job)
                self.to_agent.setdefault(job.step, time.perf_counter())

            return wrapped

        self.patch(copier.SlotCopier, "_copy", timed_copy)
        self.patch(agent_client.AgentClient, "staged", timed_staged)


class BackgroundCpu(Patches):
    """CPU seconds lightning-snapshot's background threads spend, by thread (benchmark instrumentation only).

    Wall-clock overheads are at the mercy of other processes on a shared machine; CPU time is not. On 2 cores,
    where training keeps both busy, CPU time of the background threads is compute training loses. Wraps, for the
    duration of a run, the functions each thread runs: the copy (``SlotCopier._copy``: memmove + staging checksums),
    the allocation of arena buffers (``SlotPool._grow``), and the persist thread's work per snapshot and tier
    (``_TierWorker._persist``: re-verifying the staged bytes, writing, committing, retention).
    """

    def __init__(self) -> None:
        from lightning_snapshot.persist import threads as persist
        from lightning_snapshot.staging import copier, pool

        super().__init__()
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        for owner, name, label in (
            (copier.SlotCopier, "_copy", "copy"),
            (pool.SlotPool, "_grow", "allocate"),
            (persist._TierWorker, "_persist", "persist"),
        ):
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
    from lightning_snapshot.persist import writer

    health = writer.nonfinite_tensors
    if method == "ours-local-nohealth":
        writer.nonfinite_tensors = lambda staged: []  # every snapshot recorded healthy without looking
    copies = DeviceCopies()
    extra: list[Callback] = []
    if method.endswith("-ema"):
        from lightning.pytorch.callbacks import EMAWeightAveraging

        extra.append(EMAWeightAveraging(decay=0.999))
        row.note = "with EMAWeightAveraging (its own update each step is in the wall-clock columns)"
    try:
        run = train(bench, [callback], extra=extra)
    finally:
        background.close()
        copies.close()
        writer.nonfinite_tensors = health
        if method == "ours-agent":
            from lightning_snapshot.agent import stop_agent

            stop_agent(tier.node_dir)  # type: ignore[attr-defined]
    started = run.probe.save_started
    row.device_copy = copies.copies
    row.to_agent_s = [copies.to_agent[s] - started[s] for s in bench.schedule if s in copies.to_agent and s in started]
    if row.device_copy:
        row.details.append(
            "device-to-host copy per snapshot (side stream, CUDA events): "
            + ", ".join(f"{n / GB:.2f} GB in {t * 1000:.0f} ms ({n / t / GB:.1f} GB/s)" for n, t in row.device_copy)
        )
    if row.to_agent_s:
        row.details.append(
            f"save call -> held by the snapshot agent (crash-safe): {[round(x * 1000) for x in row.to_agent_s]} ms"
        )
    row.stall_ms = run.logger.values("snapshot/stall_ms")
    fill_common(bench, row, run, committed if local else None)
    n = len(bench.schedule)
    hooks_cpu = sum(run.hooks.cpu_by_step.get(s, 0.0) for s in bench.schedule)
    row.cpu_per_snapshot = (hooks_cpu + sum(background.seconds.values())) / n
    row.details.append(
        "CPU per snapshot (thread time, all "
        + str(n)
        + " snapshots): "
        + ", ".join(
            [f"training-thread hooks {hooks_cpu / n * 1000:.1f} ms"]
            + [
                f"{k} thread {v / n:.3f} s ({background.calls.get(k, 0)} calls, {v:.2f} s in all)"
                for k, v in sorted(background.seconds.items())
            ]
        )
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
        row.details.append(
            f"snapshot/{tier.tier}/persist_ms median {statistics.median(persist):.0f},"
            f" throughput median {statistics.median(mbps):.0f} MB/s (n={len(persist)})"
        )
    n_stall = len(row.stall_ms)
    if n_stall != len(bench.schedule) - row.skipped:
        row.details.append(
            f"snapshot/stall_ms logged {n_stall} times for {len(bench.schedule)} scheduled and"
            f" {row.skipped} skipped snapshots"
        )
    if row.stall_ms and row.ext_stall_ms:
        taken = [e for e in row.ext_stall_ms if e > 0.5]
        diff = statistics.median(taken or row.ext_stall_ms) - statistics.median(row.stall_ms)
        row.details.append(
            f"stall measured around the callback's hooks: median"
            f" {statistics.median(taken or row.ext_stall_ms):.2f} ms (metric + {diff:.2f} ms),"
            f" per snapshot {[round(x, 1) for x in row.ext_stall_ms]}"
        )
    if local and bench.restore:
        reference = run.probe.reference
        del run
        if (path / step_dirname(bench.check_step) / MANIFEST_NAME).is_file():

            def load(module: GPT, optimizer: torch.optim.Optimizer) -> None:
                # the weights are read straight into the model's tensors (as the callback's own restore does)
                ckpt = load_snapshot(str(path), step=bench.check_step, into=module.state_dict())
                module.load_state_dict(ckpt["state_dict"])
                optimizer.load_state_dict(ckpt["optimizer_states"][0])

            row.restore_s, row.consistency = restore_into_fresh(
                bench, load, path / step_dirname(bench.check_step), reference
            )
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


def _stager_closed(stager: Any) -> bool:
    """Whether a ``DefaultStager`` closed its state-dict copier itself (torch 2.11, pytorch/pytorch#183413)."""
    inner = getattr(stager, "_state_dict_stager", None)
    return inner is not None and not getattr(inner, "_deepcopy_dispatch", True)


class DcpCallback(Checkpoint):
    """``dcp.async_save`` every K steps with one reused stager; waits for staging before the next optimizer step.

    torch 2.11's ``DefaultStager`` closes its own copier at the end of each staging, so a reused stager fails at its
    second save (``KeyError: <class 'type'>``, pytorch/pytorch#183413): where that happened, the next save gets a new
    stager from ``make_stager`` (its pinned buffers allocated again), counted in ``fresh_stagers``."""

    def __init__(self, root: Path, every: int, make_stager: Callable[[], Any]) -> None:
        self.root, self.every, self.make_stager = root, every, make_stager
        self.stager = make_stager()
        self.fresh_stagers = 0
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
        if _stager_closed(self.stager):
            self.stager.close()
            self.stager = self.make_stager()
            self.fresh_stagers += 1
        model_sd, optim_sd = get_state_dict(pl_module, trainer.optimizers[0])
        state, dropped = dcp_stageable({"model": model_sd, "optim": optim_sd})
        self.dropped.update(dropped)
        response = dcp.async_save(
            state, storage_writer=dcp.FileSystemWriter(str(self.root / f"step-{step}")), async_stager=self.stager
        )
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
        cuda = bench.device == "cuda"  # its pinned-memory stager, non-blocking copies
        options = StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=not cuda, use_async_staging=True, use_non_blocking_copy=cuda
        )
        row.note = "DefaultStager(pinned, async, non-blocking, reused)" if cuda else "DefaultStager(shm, async, reused)"
        callback = DcpCallback(path, bench.every, lambda: DefaultStager(options))
        try:
            run = train(bench, [callback])
        finally:
            callback.stager.close()
        if callback.fresh_stagers:
            row.details.append(
                f"a new stager for {callback.fresh_stagers} of the saves: torch {torch.__version__}'s"
                " stager closes itself after each staging (pytorch/pytorch#183413)"
            )
        fill_common(bench, row, run, callback.done)
        if callback.dropped:
            row.details.append(
                "left out of DCP's state (its stager cannot copy them): " + ", ".join(sorted(callback.dropped))
            )
        staging = [callback.staged[s] - callback.started[s] for s in bench.schedule if s in callback.staged]
        if staging:
            row.details.append(
                f"staging (save call -> staging future done) per snapshot: {[round(x, 3) for x in staging]} s"
            )
        reference = run.probe.reference
        del run, callback
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
        self._pending = Snapshot.async_take(
            str(self.root / f"step-{step}"), {"model": pl_module, "optim": trainer.optimizers[0]}
        )
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
