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
                                            # (timed before training, and inside a fit as context)
    python benchmarks/stall.py --model many --layers 1950  # the same with 15,600 tensors
    python benchmarks/stall.py --steps 44 --every 5 --methods ours-local,dcp
    python benchmarks/stall.py --quick --ema  # the stall with and without EMAWeightAveraging (ours-local, -ema)

Other processes on the machine (a test run, say) show up as noise in the wall-clock columns. The ``noise`` column
is the share of the CPUs other processes used during each run (from ``/proc/stat``); a run above 10% is flagged
NOISE (``--retries N`` runs it again up to N times, keeping the quietest run). The baseline runs
first and last; the quieter one is used and the spread of the two is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import _harness as harness  # noqa: E402
from _harness import NOISY, fmt, quiet_median, ratio, trim_memory  # noqa: E402

# the parts of this benchmark (this file is the entry point: methods registry, report, targets, command line):
# _stall_models.py (model, data, state helpers), _stall_run.py (one measured training run), _stall_methods.py (the
# run_* function of each method)
from _stall_methods import run_dcp, run_modelcheckpoint, run_none, run_ours, run_torchsnapshot  # noqa: E402
from _stall_models import FULL, GB, MANY, MEDIUM, QUICK, fresh_model  # noqa: E402
from _stall_run import Bench, Row, train  # noqa: E402

REFERENCE = "ours-local"
OURS = ("ours-ram", "ours-agent", "ours-local", "ours-local-nohealth", "ours-local-1buf", "ours-local-ema")
#: the stall with EMAWeightAveraging (its averaged model staged with the weights) against the stall without it
EMA_STALL_RATIO = 1.5


METHODS = harness.Methods(baseline="none")
METHODS.add("none", run_none, "no snapshots (the baseline; run first and again last: the spread shows the noise)")
METHODS.add(
    "ours-ram",
    lambda b: run_ours(b, "ours-ram"),
    "lightning-snapshot, RAM arena only: a tier that keeps nothing, so staging and the persist thread's"
    " bookkeeping run but no byte reaches a disk",
)
METHODS.add(
    "ours-agent",
    lambda b: run_ours(b, "ours-agent"),
    "lightning-snapshot, ``RamTier`` (no erasure coding): the node's snapshot agent maps the arena and holds"
    " each snapshot once its copy finished (it flushes it if the trainer dies)",
)
METHODS.add(
    "ours-local",
    lambda b: run_ours(b, "ours-local"),
    "lightning-snapshot, arena + ``LocalTier`` on a real disk (the reference row for the ratios)",
)
METHODS.add(
    "ours-local-nohealth",
    lambda b: run_ours(b, "ours-local-nohealth"),
    "``ours-local`` with the health check (the non-finite scan of the staged copy) switched off: the"
    " difference to ``ours-local`` is what the health check costs",
)
METHODS.add(
    "ours-local-1buf",
    lambda b: run_ours(b, "ours-local-1buf"),
    "the same with ``max_host_bytes`` set to one arena buffer (snapshots skipped if it is busy)",
)
METHODS.add(
    "ours-local-ema",
    lambda b: run_ours(b, "ours-local-ema"),
    "``ours-local`` with Lightning's ``EMAWeightAveraging`` in the fit: its averaged model (a copy of the weights)"
    " is snapshotted too; compared with ``ours-local`` for the stall per snapshot (``--ema`` runs the two)",
)
METHODS.add(
    "torch-save",
    lambda b: run_modelcheckpoint(b, "torch-save"),
    "synchronous ``torch.save``, as ``ModelCheckpoint(every_n_train_steps=K, save_top_k=-1)`` does",
)
METHODS.add(
    "async-io",
    lambda b: run_modelcheckpoint(b, "async-io"),
    "Lightning ``AsyncCheckpointIO`` with the same ``ModelCheckpoint``",
)
METHODS.add(
    "dcp",
    run_dcp,
    "``torch.distributed.checkpoint.async_save`` with one reused ``DefaultStager`` (asynchronous staging into"
    " shared memory; pinned memory and non-blocking copies need CUDA), single-process gloo group; the staging"
    " future is awaited before the next optimizer step and the previous upload before the next save, as its"
    " contract requires",
)
METHODS.add(
    "torchsnapshot",
    run_torchsnapshot,
    "``torchsnapshot.Snapshot.async_take`` (if it installs next to this torch; otherwise reported)",
)
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
        runs = harness.Baselines(
            [r for r in rows if r.method == "none" and r.error is None and r.wall_s is not None],
            noise=lambda r: r.noise,
        )
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


COLUMNS = [
    "method",
    "snaps",
    "stall med",
    "stall max",
    "overhead",
    "ovh p50",
    "durable",
    "peak extra RSS",
    "restore",
    "consistency",
    "stall/ours",
    "ovh/ours",
    "p50/ours",
    "noise",
]


def report(bench: Bench, rows: list[Row], out: harness.Report) -> None:
    base = Baseline.from_rows(rows)
    ref = next((r for r in rows if r.method == REFERENCE and r.error is None), None)
    ref_stall = _median(ref.stall_ms) if ref else None
    ref_over, ref_p50 = base.overhead(ref), base.overhead_p50(ref)
    state = bench.state_bytes or 1
    out.say()
    out.say(
        f"{len(bench.schedule)} snapshots per run (steps {bench.schedule[0]}..{bench.schedule[-1]}, every"
        f" {bench.every}, {bench.steps} steps). stall: ms the training thread was blocked per snapshot."
        f" overhead: added wall s per snapshot over the run; ovh p50: the same from the median snapshot period"
        f" ({bench.every} steps) among those other processes left quiet. durable: s from the save call to fsynced."
        f" restore: cold, s. Ratios against {REFERENCE}. noise: share of the CPUs other processes used during"
        " the run."
    )
    spread = base.runs.spread(lambda r: r.wall_s) / len(bench.schedule)
    if base.runs.runs:
        windows = base.runs.describe(lambda r: r.wall_s, per=len(bench.schedule), per_unit=" per snapshot")
        out.say(
            f"baseline windows {windows};"
            f" median quiet baseline period {fmt(base.period_s, '.3f')} s; RSS growth during fit"
            f" {', '.join(f'{(r.rss_growth or 0) / GB:.2f}' for r in base.runs.runs)} GB (the smaller is"
            " subtracted)"
        )
    table = harness.Table(
        f"stall benchmark, {len(bench.schedule)} snapshots per run",
        COLUMNS,
        key="stall",
        notes=[
            "+: the method never fsyncs; the benchmark fsyncs each file in a background thread once it is written."
            " 'N-Ms' in snaps: N taken, M skipped. ref~0: the reference's overhead is within the baseline spread"
            " (or <= 0), so no ratio is meaningful"
        ],
    )
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
        durable_s = (
            f"{durable:.2f}{r.durable_mark}"
            if durable is not None
            else ("n/a" if r.method in ("none", "ours-ram") else "-")
        )
        snaps = f"{r.snapshots - r.skipped}" + (f"-{r.skipped}s" if r.skipped else "")
        table.add(
            r.method,
            snaps,
            fmt(stall, ".1f"),
            fmt(stall_max, ".1f"),
            fmt(over, ".3f"),
            fmt(p50, ".3f"),
            durable_s,
            extra_s,
            fmt(r.restore_s, ".2f", "n/a"),
            r.consistency,
            "-" if is_base else ratio(stall, ref_stall),
            ratio(over, ref_over, spread),
            ratio(p50, ref_p50, spread),
            f"{r.noise:.0%}",
            data={
                "method": r.method,
                "snapshots": r.snapshots - r.skipped,
                "skipped": r.skipped,
                "stall_ms_median": stall,
                "stall_ms_max": stall_max,
                "overhead_s": over,
                "overhead_p50_s": p50,
                "durable_s_median": durable,
                "durable_fsynced_by_benchmark": bool(r.durable_mark),
                "extra_rss_bytes": extra,
                "restore_s": r.restore_s,
                "consistency": r.consistency,
                "noise": r.noise,
                "unreliable": r.noise > NOISY,
            },
        )
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
    out.say(
        f"\nGPU: {torch.cuda.get_device_name()}; median step (baseline) {fmt(step and step * 1000, '.1f')} ms"
        f" ({bench.accumulate} micro-batches of {bench.cfg.batch} x {bench.cfg.seq} tokens, {bench.precision});"
        f" one pinned copy_ of the state {fmt(pinned and pinned * 1000, '.1f')} ms"
    )
    table = harness.Table(
        "GPU: stall against step time",
        [
            "method",
            "step med ms",
            "stall med ms",
            "stall/step",
            "copy GB/s",
            "copy/pinned",
            "to agent ms",
            "agent/pinned",
        ],
        key="gpu",
    )
    pinned_bw = bench.state_bytes / pinned if pinned else None
    for r in rows:
        if r.error is not None or r.method == "none":
            continue
        st = statistics.median(r.step_s) if r.step_s else None
        stall = _median(r.stall_ms)
        bw = _median([n / t for n, t in r.device_copy]) if r.device_copy else None
        agent = _median(r.to_agent_s)
        table.add(
            r.method,
            fmt(st and st * 1000, ".1f"),
            fmt(stall, ".2f"),
            "-" if stall is None or not step else f"{stall / (step * 1000):.2%}",
            fmt(bw and bw / GB, ".1f"),
            "-" if bw is None or not pinned_bw else f"{bw / pinned_bw:.0%}",
            fmt(agent and agent * 1000, ".0f"),
            "-" if agent is None or not pinned else f"{agent / pinned:.2f}x",
            data={
                "method": r.method,
                "step_ms_median": st and st * 1000,
                "stall_ms_median": stall,
                "copy_GBps": bw and bw / GB,
                "to_agent_ms_median": agent and agent * 1000,
            },
        )
        if r.method in OURS and stall is not None and step:
            check.check(
                stall <= 0.01 * step * 1000,
                f"{r.method}: median stall {stall:.2f} ms <= 1% of the median step {step * 1000:.1f} ms",
                stall,
                0.01 * step * 1000,
            )
        if bw is not None and pinned_bw:
            check.check(
                bw >= 0.8 * pinned_bw,
                f"{r.method}: device-to-host copy {bw / GB:.1f} GB/s >= 80% of one"
                f" pinned copy_ ({pinned_bw / GB:.1f} GB/s)",
                bw / GB,
                0.8 * pinned_bw / GB,
            )
        if agent is not None and pinned:
            check.check(
                agent <= 1.5 * pinned,
                f"{r.method}: held by the agent {agent * 1000:.0f} ms after the save"
                f" call <= 1.5 x the pinned copy ({pinned * 1000:.0f} ms)",
                agent * 1000,
                1.5 * pinned * 1000,
            )
    out.table(table)


def targets(bench: Bench, rows: list[Row], base: Baseline, check: harness.Targets) -> None:
    """The issue's targets, checked against this run (overhead both ways: whole window, and median period)."""
    by = {r.method: r for r in rows if r.error is None and r.method != "none"}
    peers = [r for r in by.values() if r.method not in OURS and not r.consistency.startswith("FAIL")]
    best = min(
        (r for r in peers if base.overhead_p50(r) is not None), key=lambda r: base.overhead_p50(r) or 0.0, default=None
    )
    check.title = "targets" + (
        f" (best peer: {best.method}, the consistent peer with the smallest ovh p50)" if best else ""
    )
    for m in OURS:
        if m in by and by[m].stall_ms:
            s = statistics.median(by[m].stall_ms)
            check.check(s <= 5.0, f"{m}: median stall {s:.1f} ms <= 5 ms", s, 5.0)
            if bench.cfg.kind == "many" and bench.foreach_s:
                ref = bench.foreach_s * 1000
                check.check(
                    s <= 3 * ref,
                    f"{m}: median stall {s:.2f} ms <= 3 x one _foreach_copy_ of the same"
                    f" tensors ({ref:.3f} ms) = {3 * ref:.2f} ms ({s / ref:.1f}x)",
                    s,
                    3 * ref,
                )
                if bench.foreach_in_fit_s:
                    fit_ref = bench.foreach_in_fit_s * 1000
                    check.info(
                        f"{m}: median stall {s:.2f} ms = {s / fit_ref:.1f}x the same _foreach_copy_ inside a fit"
                        f" at the snapshot points ({fit_ref:.3f} ms; context, not a target)",
                        s / fit_ref,
                    )
    plain, ema = by.get("ours-local"), by.get("ours-local-ema")
    if plain and ema and plain.stall_ms and ema.stall_ms:
        a, b = statistics.median(plain.stall_ms), statistics.median(ema.stall_ms)
        check.check(
            b <= EMA_STALL_RATIO * a,
            f"ours-local-ema: median stall {b:.2f} ms with EMAWeightAveraging <= {EMA_STALL_RATIO} x ours-local's"
            f" {a:.2f} ms without it = {EMA_STALL_RATIO * a:.2f} ms ({b / a:.2f}x)",
            b,
            EMA_STALL_RATIO * a,
        )
    ref = by.get(REFERENCE)
    if ref and best:
        for name, fn in (("overhead", base.overhead), ("ovh p50", base.overhead_p50)):
            o, ob = fn(ref), fn(best)
            if o is not None and ob is not None:
                check.check(
                    o <= 0.2 * ob,
                    f"{REFERENCE}: {name} {o:.3f} s <= 0.2 x {best.method}'s {ob:.3f} s = {0.2 * ob:.3f} s",
                    o,
                    0.2 * ob,
                )
        d, db = _median(ref.durable_s), _median(best.durable_s)
        if d is not None and db is not None:
            check.check(
                d <= 0.5 * db, f"{REFERENCE}: durable in {d:.2f} s <= 0.5 x {best.method}'s {db:.2f} s", d, 0.5 * db
            )
    # --model many: a state of 50 KB, whose copy takes microseconds and whose size is within the process's memory
    # noise: the targets relative to its bytes are printed, not judged (this mode's target is the stall's)
    tiny = bench.cfg.kind == "many"
    unjudged = " (not judged with --model many: the state is a few KB)" if tiny else ""
    if "ours-ram" in by and bench.memcpy_s:
        for name, fn in (("overhead", base.overhead), ("ovh p50", base.overhead_p50)):
            o = fn(by["ours-ram"])
            if o is not None:
                check.check(
                    None if tiny else o <= 1.5 * bench.memcpy_s,
                    f"ours-ram: {name} {o:.3f} s <= 1.5 x one memcpy ({bench.memcpy_s:.3f} s)"
                    f" = {1.5 * bench.memcpy_s:.3f} s{unjudged}",
                    o,
                    1.5 * bench.memcpy_s,
                )
    for m in OURS:
        cpu = by[m].cpu_per_snapshot if m in by else None
        if cpu is not None and bench.memcpy_s:
            check.info(
                f"{m}: CPU time per snapshot (hooks + background threads, not a wall-clock target)"
                f" {cpu:.3f} s = {cpu / bench.memcpy_s:.2f} x one memcpy",
                cpu,
            )
    if ref and "dcp" in by and ref.restore_s and by["dcp"].restore_s:
        check.check(
            ref.restore_s <= 0.5 * by["dcp"].restore_s,
            f"{REFERENCE}: restore {ref.restore_s:.2f} s <= 0.5 x dcp's {by['dcp'].restore_s:.2f} s",
            ref.restore_s,
            0.5 * by["dcp"].restore_s,
        )
    for m in ("ours-local", "ours-local-1buf"):
        if m in by and bench.restore:
            check.check(by[m].consistency == "PASS", f"{m}: consistency {by[m].consistency}")
    for m, limit in (("ours-local", 2.1), ("ours-ram", 2.1), ("ours-local-1buf", 1.1)):
        extra = base.extra_rss(by[m]) if m in by else None
        if extra is not None and bench.state_bytes:
            check.check(
                None if tiny else extra / bench.state_bytes <= limit,
                f"{m}: peak extra host memory {extra / bench.state_bytes:.2f}x the state <= {limit}x{unjudged}",
                extra / bench.state_bytes,
                limit,
            )


# ================================================================================================ main
def run_method(method: str, bench: Bench, retries: int) -> Row:
    """Run one method; again (up to ``retries`` times) while other processes disturbed it, keeping the quietest."""
    kept = harness.run_quietest(
        method,
        lambda: METHODS.run(method, bench),
        retries=retries,
        noise=lambda r: r.noise,
        failed=lambda r: r.error is not None,
        on_error=lambda e: Row(method, error=f"ERROR {type(e).__name__}: {str(e)[:200]}"),
        describe=lambda r: f"wall window {r.wall_s or 0:.2f} s",
    )
    if kept.noise > NOISY:
        kept.details.append(harness.unreliable_line(kept.foreign_cpu_s, kept.noise))
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="~21M-parameter model, fewer steps (< 2 minutes)")
    parser.add_argument(
        "--model",
        choices=["gpt", "many"],
        default="gpt",
        help="many: 195 Linear(8, 8) layers (1,560 tensors with AdamW, a few hundred bytes each),"
        " snapshot every 4 steps, 20 snapshots; the stall is compared with one"
        " torch._foreach_copy_ of the same tensors",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="with --model many: the number of Linear(8, 8) layers (default 195; 1950 gives 15,600"
        " tensors, for how the stall grows with the tensor count)",
    )
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: full 44, quick 14)")
    parser.add_argument("--every", type=int, help="snapshot every K steps, K >= 2 (default: full 5, quick 3)")
    parser.add_argument(
        "--methods",
        default=",".join(METHODS.names),
        help=f"comma-separated subset of {','.join(METHODS.names)} (the baseline always runs)",
    )
    parser.add_argument(
        "--ema",
        action="store_true",
        help="the stall per snapshot with and without Lightning's EMAWeightAveraging: runs ours-local and"
        " ours-local-ema (instead of --methods) and prints both",
    )
    parser.add_argument("--dir", default=None, help="where snapshots are written (default: a temp dir in /tmp)")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: one GPU, GPT-2 medium (354.8M params), bf16-mixed, 4 micro-batches of 8 x 1024"
        " tokens per step, the peers' GPU options (DCP's pinned stager)",
    )
    parser.add_argument("--accumulate", type=int, default=None, help="micro-batches per step (default: cuda 4, cpu 1)")
    parser.add_argument(
        "--no-restore",
        dest="restore",
        action="store_false",
        help="skip the cold restore and consistency check after each run",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=0,
        help=f"run a method again (keeping the quieter run) when other processes used more than"
        f" {NOISY * 100:.0f}%% of the CPUs during it (default 0)",
    )
    harness.add_arguments(parser)
    args = parser.parse_args(argv)

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU")
    many = args.model == "many"
    if many and cuda:
        parser.error("--model many runs on CPU")
    if args.layers is not None and (not many or args.layers < 1):
        parser.error("--layers needs --model many and a positive count")
    every = args.every or (4 if many else 10 if cuda else 3 if args.quick else 5)
    steps = args.steps or (
        21 * every - 1
        if many
        else (3 if args.quick else 6) * every + 2
        if cuda
        else 5 * every - 1
        if args.quick
        else 9 * every - 1
    )
    if every < 2 or steps < every:
        parser.error("need --every >= 2 and --steps >= --every")
    methods = METHODS.schedule(METHODS.select("ours-local,ours-local-ema" if args.ema else args.methods, parser))

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    root = Path(tempfile.mkdtemp(prefix="ls-stall-", dir=args.dir))
    model = dataclasses.replace(MANY, layers=args.layers) if many and args.layers else MANY if many else None
    bench = Bench(
        model if model is not None else MEDIUM if cuda else QUICK if args.quick else FULL,
        steps,
        every,
        root,
        device=args.device,
        precision="bf16-mixed" if cuda else None,
        accumulate=args.accumulate or (4 if cuda else 1),
        restore=args.restore,
    )
    n_params = sum(p.numel() for p in fresh_model(bench.cfg).parameters())
    out = harness.Report("stall", args)
    out.header(
        model=f"{n_params / 1e6:.1f}M params ({bench.cfg})",
        steps=steps,
        every=every,
        methods=",".join(methods),
        snapshots_in=root,
    )
    # one short run first, so that one-time costs (lazy imports, thread pools, allocator growth) land in no row
    train(Bench(bench.cfg, 2, 2, root, device=bench.device, precision=bench.precision, accumulate=bench.accumulate), [])
    trim_memory()
    rows: list[Row] = []
    try:
        for method in methods:
            rows.append(run_method(method, bench, args.retries))
            if cuda:  # (GPU time is scarce: what each run showed, as soon as it is known)
                r = rows[-1]
                step_ms = statistics.median(r.step_s) * 1000 if r.step_s else float("nan")
                stall = statistics.median(r.stall_ms) if r.stall_ms else float("nan")
                print(
                    f"    {method}: median step {step_ms:.1f} ms, median stall {stall:.2f} ms"
                    f" (max {max(r.stall_ms, default=0):.1f}), stalls {[round(x, 1) for x in r.stall_ms]}"
                    + "".join(f"\n    [{method}] {line}" for line in row_lines(r) + ([r.error] if r.error else [])),
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(bench, rows, out)
    by = {r.method: r for r in rows if r.error is None}
    if "ours-local" in by and "ours-local-ema" in by and by["ours-local"].stall_ms and by["ours-local-ema"].stall_ms:
        a, b = (statistics.median(by[m].stall_ms) for m in ("ours-local", "ours-local-ema"))
        out.say(
            f"\nstall per snapshot (median snapshot/stall_ms): without EMAWeightAveraging {a:.2f} ms"
            f" {[round(x, 1) for x in by['ours-local'].stall_ms]}, with it {b:.2f} ms"
            f" {[round(x, 1) for x in by['ours-local-ema'].stall_ms]}: {b / a:.2f}x (target <= {EMA_STALL_RATIO}x)"
        )
    foreign = sum(r.foreign_cpu_s for r in rows)
    out.say(f"\nother processes used {foreign:.0f} CPU-s during the training runs that were kept")
    if bench.replica_check is not None:
        quarter, full, count = bench.replica_check
        out.say(
            f"replica check per snapshot on each rank under DDP (not in the stall above: these runs are one"
            f" process): {quarter:.3f} ms with replica_check=4, {full:.3f} ms for all {count} tensors"
            f" (replica_check=1), plus one collective of 8 bytes per tensor compared"
        )
    return out.finish(
        state_bytes=bench.state_bytes,
        memcpy_s=bench.memcpy_s,
        foreach_s=bench.foreach_s,
        pinned_copy_s=bench.pinned_copy_s,
        replica_check_ms=bench.replica_check,
        runs=rows,
    )


if __name__ == "__main__":
    sys.exit(main())
