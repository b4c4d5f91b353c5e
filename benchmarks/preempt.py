"""What preemption handling costs, and what a preemption loses: lightning-snapshot against Lightning's own handling.

Two parts, measured in one run:

* **per-step cost of the agreement**: 2 processes (gloo, 127.0.0.1), each timing ``--calls`` rounds of the check it
  makes once per optimizer step: ours, ``Preemption.poll`` (one all-reduce of an int32 over the library's own gloo
  group; the signals owned); Lightning 2.6's, ``_broadcast_sigterm_tensor`` (a broadcast from rank 0 of a tensor on
  the strategy's device over the trainer's group, then ``.item()``: on a GPU a device synchronisation per batch),
  which the callback turns off while it owns SIGTERM; and ours in one process (no collective).
* **a preemption, per case**: a real torchrun job (2 ranks, gloo, 2 loader workers each, shuffled augmented data,
  dropout, a local tier every 10 steps; tests/scripts/train.py) gets SIGTERM after step 23 (to torchrun, to every
  process, to rank 0, to rank 1, during validation, while an earlier snapshot is written to a slow tier): the time
  from sending the signal to the step's manifest committed in the local tier (its mtime), the steps lost (the last
  step any rank trained minus the step made durable) and each rank's exit status.

Usage: ``python benchmarks/preempt.py [--calls 20000] [--quick]`` (``--quick``: the agreement only).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "tests" / "scripts" / "train.py"
COMMON = [
    "--devices",
    "2",
    "--max-steps",
    "40",
    "--every",
    "10",
    "--shuffle",
    "--dropout",
    "0.1",
    "--workers",
    "2",
    "--augment",
]
CASES = [
    ("SIGTERM to torchrun", ["--signal-to", "launcher"]),
    ("SIGTERM to every process", ["--signal-to", "all"]),
    ("SIGTERM to rank 0 only", ["--signal-to", "self", "--signal-rank", "0"]),
    ("SIGTERM to rank 1 only", ["--signal-to", "self", "--signal-rank", "1"]),
    (
        "during validation",
        ["--signal-to", "all", "--signal-during", "validation", "--val-every", "5", "--val-delay", "0.2"],
    ),
    ("earlier snapshot on a slow tier", ["--signal-to", "launcher", "--slow-write", "1", "--signal-at", "22"]),
]


def _step(us: float) -> None:
    """A training step's worth of work on this rank's CPU (a busy wait)."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def _rank(rank: int, port: int, calls: int, out: str, step_us: float) -> None:
    import torch
    import torch.distributed as dist

    from lightning_snapshot.dist.comm import GroupComm, LocalComm
    from lightning_snapshot.dist.preempt import Preemption

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    ours = Preemption([signal.SIGTERM], GroupComm(group))
    ours._previous = {signal.SIGTERM: signal.SIG_DFL}  # (owned, without replacing this process's handlers)
    alone = Preemption([signal.SIGTERM], LocalComm())
    alone._previous = {signal.SIGTERM: signal.SIG_DFL}

    def lightning() -> None:  # training_epoch_loop._broadcast_sigterm_tensor, as Lightning 2.6 runs it per batch
        t = torch.tensor([0], device="cpu")
        dist.broadcast(t, src=0)
        if t.item() == 1:
            raise RuntimeError("unexpected")

    results = {}
    comm = GroupComm(group)
    for name, fn in (
        ("ours", lambda i: ours.poll(i)),
        ("ours-sync", lambda i: comm.all_max(0)),
        ("lightning", lambda i: lightning()),
        ("ours-1-process", lambda i: alone.poll(i)),
    ):
        for i in range(50):  # warm-up
            fn(-1 - i)
        dist.barrier()
        inside = []
        for i in range(calls):
            _step(step_us)  # the training step between two checks
            t0 = time.perf_counter()
            fn(i)
            inside.append(time.perf_counter() - t0)
        results[name] = statistics.median(inside) * 1e6
        results[name + "-p90"] = sorted(inside)[int(0.9 * len(inside))] * 1e6
        ours._polled, ours._pending = None, None  # (the next variant starts clean)
        ours.settle()
    if rank == 0:
        Path(out).write_text(repr(results))
    dist.barrier()
    dist.destroy_process_group()


def agreement(calls: int, step_us: float) -> dict[str, float]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.txt")
        mp.spawn(_rank, args=(port, calls, out, step_us), nprocs=2)
        return eval(Path(out).read_text())


def preemption_case(extra: list[str]) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        args = [*COMMON, "--signal-at", "23", *extra]
        if "--signal-at" in extra:
            args = [*COMMON, *extra]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(TRAIN),
            "--dir",
            str(base / "local"),
            "--out",
            str(base / "out.pt"),
            *args,
        ]
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
        said = proc.stdout + proc.stderr
        held = re.findall(r"step (\d+) is held by .+? \(([\d.]+) s after ", said)
        sent_at = re.findall(r"SIGNAL-SENT step=(\d+) to=\S+ at=([\d.]+)", proc.stdout)
        sent = [int(s) for s, _ in sent_at]
        ended = [int(s) for s in re.findall(r"STEP-END step=(\d+)", proc.stdout)]
        status = sorted(set(re.findall(r"EXITING status=(\d+)", proc.stdout)))
        step = int(held[0][0]) if held else None
        durable = None
        manifest = base / "local" / f"step-{step or 0:012d}" / "manifest.json"
        if step is not None and sent_at and manifest.exists():  # (committed: its manifest was renamed into place)
            durable = round(manifest.stat().st_mtime - float(sent_at[0][1]), 2)
        return {
            "sent": sent[0] if sent else None,
            "durable step": step,
            "to durable (s)": durable,
            "steps lost": (max(ended) - step) if (ended and step is not None) else "all since the last snapshot",
            "exit": ",".join(status) or f"launcher {proc.returncode}",
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--step-ms", type=float, default=5.0, help="the work between two checks (a training step)")
    p.add_argument("--quick", action="store_true", help="the per-step agreement only")
    a = p.parse_args()
    cost = agreement(a.calls, a.step_ms * 1000)
    print(
        f"\nPer-step preemption check, 2 ranks on gloo over 127.0.0.1, {a.calls} steps of {a.step_ms:g} ms of work:"
        " time the training thread spends in the check (median; p90)"
    )
    print("| check | us per step (median) | p90 |\n|---|---|---|")
    print(
        f"| lightning-snapshot: Preemption.poll (all-reduce over its own gloo group, started at one step and read"
        f" at the next) | {cost['ours']:.1f} | {cost['ours-p90']:.1f} |"
    )
    print(
        f"| the same all-reduce waited for at once (a synchronous agreement) | {cost['ours-sync']:.1f} | {cost['ours-sync-p90']:.1f} |"
    )
    print(
        f"| Lightning 2.6: _broadcast_sigterm_tensor (broadcast + .item(); off while we own SIGTERM) |"
        f" {cost['lightning']:.1f} | {cost['lightning-p90']:.1f} |"
    )
    print(
        f"| lightning-snapshot, one process (no collective) | {cost['ours-1-process']:.2f} | {cost['ours-1-process-p90']:.2f} |"
    )
    if a.quick:
        return
    print("\nPreemption of a 2-rank torchrun job (SIGTERM after step 23; the step durable, then exit)")
    print(
        "| case | signal sent after step | durable step | signal sent -> step durable (s) | steps lost | exit status |"
    )
    print("|---|---|---|---|---|---|")
    for name, extra in CASES:
        r = preemption_case(extra)
        print(
            f"| {name} | {r['sent']} | {r['durable step']} | {r['to durable (s)']} | {r['steps lost']} | {r['exit']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
