"""Training run used by the resume tests: a small model, real Lightning, real snapshots, optional SIGKILL.

Usage: python train.py --dir SNAPDIR --out RESULT.pt [--max-steps N] [--every K] [--crash-at S] [--devices 2] ...
Writes the final weights and optimizer state to RESULT.pt (torch.save of plain tensors, read back by the test
with weights_only=True).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time

import lightning as L
import numpy as np
import torch
from fingerprint import MemoryLogger, ReportRestore, capture, checkpoint_files
from lightning.pytorch.callbacks import Checkpoint
from processes import job_processes
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends import LocalTier

IMPORTED = time.time()  # (the imports are done: the restart timeline's first phase)


class Squares(Dataset):
    """Regression samples; with ``augment`` each sample adds noise drawn from torch, numpy and python ``random`` (in
    whichever process loads it)."""

    def __init__(self, n: int = 64, augment: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 1, generator=g)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i]
        if self.augment:
            x = x + 0.1 * torch.randn(8) + float(np.random.uniform(-0.1, 0.1)) + random.uniform(-0.1, 0.1)
        return x, self.y[i]


class Stream(IterableDataset):
    def __iter__(self):
        data = Squares()
        return iter([data[i] for i in range(len(data))])


class Model(L.LightningModule):
    def __init__(self, dropout: float, tied: bool = False, tiny: bool = False, hidden: int = 16) -> None:
        super().__init__()
        if tiny:  # one parameter: DDP's gradient buckets are the same before and after their rebuild (3+ ranks)
            self.net = nn.Sequential(nn.Linear(8, 1, bias=False))
        else:
            self.net = nn.Sequential(
                nn.Linear(8, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1)
            )
        self.seen = []
        self.val_delay = 0.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        if self.val_delay:
            time.sleep(self.val_delay)
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def s3_options(endpoint: str) -> dict:
    return {
        "key": "testing-key",
        "secret": "testing-secret",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


class CrashBeforeManifest(LocalTier):
    """A real local tier that SIGKILLs the process after the data of step ``at`` is durable, before its manifest."""

    def __init__(self, path, at: int, **kw) -> None:
        super().__init__(path, **kw)
        self.at = at

    def commit(self, key: str, data: bytes) -> None:
        if key == f"step-{self.at:012d}/manifest.json":
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        super().commit(key, data)


class SlowLocalTier(LocalTier):
    """A real local tier whose data writes take ``delay`` seconds longer (a slow disk); ``writing`` is set while one is
    in progress."""

    def __init__(self, path, delay: float, **kw) -> None:
        super().__init__(path, **kw)
        self.delay = delay
        self.writing = __import__("threading").Event()

    def write(self, key, buffers):
        self.writing.set()
        time.sleep(self.delay)
        return super().write(key, buffers)


class Raise(L.Callback):
    """Raise in the training thread of rank ``rank`` at ``global_step == at``, while a snapshot write is in flight."""

    def __init__(self, at: int, rank: int, tier) -> None:
        self.at, self.rank, self.tier = at, rank, tier

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at and trainer.global_rank == self.rank:
            writing = getattr(self.tier, "writing", None)
            if writing is not None:
                writing.wait(30)
            print(f"RAISING rank={self.rank} step={self.at} at={time.time():.3f}", flush=True)
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.at}")


class Crash(Checkpoint):
    """SIGKILL this process at ``global_step == at`` (in the next step, right before its optimizer step), once at
    least one snapshot is durable (persisting is asynchronous: on a slow disk the first commit may land a few steps
    after it was taken). A ``Checkpoint``, so that Lightning runs it after the ``SnapshotCallback`` listed before it:
    the snapshot of step ``at`` is committed only once that callback has seen its copy was not changed meanwhile."""

    def __init__(self, at: int, tiers, newest: bool = False) -> None:
        self.at = at
        self.tiers = tiers
        self.newest = newest  # wait until every tier holds the newest step due in it (not just any)

    def _ready(self, tier) -> bool:
        from lightning_snapshot.persist.writer import committed_steps

        steps = committed_steps(tier)
        if not self.newest:
            return bool(steps)
        # (the snapshot of step ``at`` itself is taken before this hook, right before its batch is fetched)
        due = self.at // tier.every_n_train_steps * tier.every_n_train_steps
        return bool(steps) and steps[0] >= due

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.at:
            deadline = time.monotonic() + 30
            while not all(self._ready(t) for t in self.tiers) and time.monotonic() < deadline:
                time.sleep(0.01)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def _ram_kill_plan(plan: str) -> int | None:
    """The step of ``--kill-in-ram-write ATTEMPT:RANK:STEP`` if it is this process' (this attempt, this rank)."""
    if not plan:
        return None
    when, rank, step = (int(x) for x in plan.split(":"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return step if (when, rank) == (attempt, int(os.environ.get("RANK", "0"))) else None


def _agent_holds(node_dir, step: int, rank: int) -> bool:
    from lightning_snapshot.agent import agent_status

    st = agent_status(node_dir) or {}
    return any(p["step"] == step and p["rank"] == rank for p in st.get("pending") or ())


def make_ram_tier(kill_at: int | None, **kw):
    """The RAM tier; with ``kill_at``, one whose trainer SIGKILLs itself as its persist thread starts writing step
    ``kill_at`` to it, once the node's agent holds that snapshot (staged, fenced, due in a durable tier): the RAM tier
    never gets this rank's data of that step, the trainers never commit it there, and only the agent can write it
    anywhere."""
    from lightning_snapshot.backends import RamTier

    class RamKilledInWrite(RamTier):
        def write(self, key, buffers):
            if key.startswith(f"step-{kill_at:012d}/"):
                rank = int(os.environ.get("RANK", "0"))
                deadline = time.monotonic() + 60
                while not _agent_holds(self.node_dir, kill_at, rank) and time.monotonic() < deadline:
                    time.sleep(0.01)
                sys.stdout.flush()
                os.write(sys.stdout.fileno(), f"KILLED-IN-RAM-WRITE step={kill_at} rank={rank}\n".encode())
                os.kill(os.getpid(), signal.SIGKILL)
            return super().write(key, buffers)

    return RamTier(**kw) if kill_at is None else RamKilledInWrite(**kw)


class Hold(Checkpoint):
    """Hold the training thread at ``global_step == at`` (right before its optimizer step, after the snapshot
    callback's fence) until another thread of the process SIGKILLs it, so that no later snapshot is staged meanwhile.
    A ``Checkpoint``, so that Lightning runs it after the ``SnapshotCallback``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.at:
            time.sleep(120)
            raise RuntimeError(f"held at step {self.at} for 120 s and not killed")


def wait_for_agent_idle(node_dir, timeout: float = 120.0) -> None:
    """Wait until the node's agent has no trainer attached and writes nothing (the trainers of the attempt before
    are gone and it flushed what they left it), or no agent answers."""
    from lightning_snapshot.agent import agent_status

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = agent_status(node_dir)
        if st is None or (st["attached"] == 0 and not st["flushing"]):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the agent of {node_dir} was still busy after {timeout:g} s: {st}")


class NanGradient(L.Callback):
    """Put a NaN into the first parameter's gradient right before the optimizer step that follows ``global_step ==
    at``: the parameters and optimizer state after that step (snapshots of ``at + 1`` on) hold NaNs, while the state
    of step ``at`` and everything up to it are as in a run without this callback (it draws no random numbers)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.at:
            next(pl_module.parameters()).grad.view(-1)[0] = float("nan")


class CrashAfterRestore(L.Callback):
    """SIGKILL this process when training starts after a restore (a run that crashes right after every restore,
    which ``ReportRestore`` listed before it has reported); a run that restored nothing trains normally."""

    test_harness = True

    def __init__(self, snapshot_callback) -> None:
        self.cb = snapshot_callback

    def on_train_start(self, trainer, pl_module):
        if self.cb.restored_from is not None:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


class SendSignal(L.Callback):
    """Preempt the job as a cluster would: at ``global_step == at`` (after that step's optimizer step; ``during``
    "validation": during the first validation batch from that step on), send ``sig`` to ``to``: "self" (this process,
    rank ``rank``), "launcher" (torchrun, which forwards it to its workers' process groups) or "all" (every process
    of the job, loader workers included). Prints ``SIGNAL-SENT step=S`` first."""

    test_harness = True

    def __init__(self, at: int, to: str, rank: int, during: str, sig: int, again: float = 0.0) -> None:
        self.at, self.to, self.rank, self.during, self.sig = at, to, rank, during, sig
        self.again = again
        self.sent = False

    def _send(self, trainer) -> None:
        # ("launchers": each node's torchrun, by its local rank 0)
        sender = trainer.local_rank == 0 if self.to == "launchers" else trainer.global_rank == self.rank
        if self.sent or not sender or trainer.global_step < self.at:
            return
        self.sent = True
        sys.stdout.flush()
        os.write(
            sys.stdout.fileno(), f"SIGNAL-SENT step={trainer.global_step} to={self.to} at={time.time():.3f}\n".encode()
        )
        if self.again:  # a second signal while the preemption's snapshot is being written
            import threading

            threading.Timer(self.again, os.kill, (os.getpid(), self.sig)).start()
        if self.to == "self":
            os.kill(os.getpid(), self.sig)
        elif self.to in ("launcher", "launchers"):
            os.kill(os.getppid(), self.sig)
        else:  # "all": the torchrun job; "tree": this process and its loader workers
            # (sent by another process, as the cluster's agent does: a worker tells its parent's signal apart)
            pids = job_processes(os.getppid() if self.to == "all" else os.getpid())
            subprocess.run(["kill", f"-{self.sig}", *map(str, pids)], check=False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.during == "train":
            self._send(trainer)
        if self.sent or trainer.global_step >= self.at:  # (the steps trained from the signal on: none may be lost)
            os.write(sys.stdout.fileno(), f"STEP-END step={trainer.global_step} rank={trainer.global_rank}\n".encode())

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if self.sent:
            os.write(sys.stdout.fileno(), f"VAL-BATCH-AFTER-SIGNAL rank={trainer.global_rank}\n".encode())
        if self.during == "validation" and trainer.training is False and trainer.state.fn == "fit":
            self._send(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        if self.during == "epoch_end":  # (in an epoch-end hook, after the epoch's last step)
            self._send(trainer)

    def on_after_backward(self, trainer, pl_module):
        # "backward": in the middle of a step; "accumulating": after the backward of a batch that does not step
        if self.during == "backward" or (
            self.during == "accumulating" and trainer.fit_loop.epoch_loop._should_accumulate()
        ):
            self._send(trainer)


class Rank0Delay(L.Callback):
    """Rank 0 alone sleeps after the batch of one step (work only rank 0 does, such as an evaluation in a rank-zero
    callback), while the other ranks go on to the next step boundary and wait there in the next collective."""

    test_harness = True

    def __init__(self, step: str, seconds: str) -> None:
        self.step, self.seconds = int(step), float(seconds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == 0:
            time.sleep(self.seconds)


class TrainDelay(L.Callback):
    """Every rank sleeps in the batch of one step (a training step longer than the grace)."""

    test_harness = True

    def __init__(self, step: str, seconds: str) -> None:
        self.step, self.seconds = int(step), float(seconds)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step:
            os.write(sys.stdout.fileno(), f"SLOW-STEP step={trainer.global_step}\n".encode())
            time.sleep(self.seconds)


def _print_timeline() -> None:
    """Print, per rank, when the phases of a start and of a stop end (``TIMELINE <phase> rank=R at=<time.time()>``):
    imports done (printed by main), the trainer's process group formed (the callback's ``setup`` begins), the library's
    session open (``setup`` returned), the restore done (``on_fit_start`` returned), the first step trained (its
    ``on_train_batch_end``), and a preempted step durable (``last_snapshot`` returned)."""
    from lightning_snapshot.fit.pipeline import SnapshotPipeline

    def mark(phase: str, rank: int) -> None:
        os.write(sys.stdout.fileno(), f"TIMELINE {phase} rank={rank} at={time.time():.4f}\n".encode())

    def wrap(cls, name, before=None, after=None):
        original = getattr(cls, name)

        def run(self, trainer, *args, **kwargs):
            if before:
                mark(before, trainer.global_rank)
            result = original(self, trainer, *args, **kwargs)
            if after:
                mark(after, trainer.global_rank)
            return result

        setattr(cls, name, run)

    wrap(SnapshotCallback, "setup", before="rendezvous", after="session")
    wrap(SnapshotCallback, "on_fit_start", after="restore")
    first = []

    def first_step(self, trainer, *args, **kwargs):
        if not first:
            first.append(1)
            mark("first_step", trainer.global_rank)
        return original_end(self, trainer, *args, **kwargs)

    original_end = SnapshotCallback.on_train_batch_end
    SnapshotCallback.on_train_batch_end = first_step
    wrap(SnapshotPipeline, "last_snapshot", after="durable")


def _print_captures() -> None:
    """Print a line each time this rank stages the model and optimizer state (a capture), with its step."""
    from lightning_snapshot.fit.stager import Stager

    original = Stager.stage_shared

    def stage_shared(self, step, *args, **kwargs):
        os.write(sys.stdout.fileno(), f"CAPTURE step={step} rank={self.comm.rank}\n".encode())
        return original(self, step, *args, **kwargs)

    Stager.stage_shared = stage_shared


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--loader", choices=["plain", "stateful", "iterable"], default="plain")
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--persistent", action="store_true", help="persistent loader workers")
    p.add_argument("--augment", action="store_true", help="random augmentation in the dataset")
    p.add_argument(
        "--crash-after-newest",
        action="store_true",
        help="with --crash-at: wait until the newest step due is committed (not just any)",
    )
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--ema", action="store_true", help="Lightning's EMAWeightAveraging (its averaged model is compared)")
    p.add_argument("--kill-before-commit", type=int, default=-1)
    p.add_argument("--s3", default=None, help="also snapshot to this s3:// URL (with --endpoint)")
    p.add_argument("--endpoint", default=None)
    p.add_argument("--s3-every", type=int, default=None)
    p.add_argument("--ram-every", type=int, default=None, help="also snapshot to a RAM tier this often")
    p.add_argument("--ram-erasure", default=None, help="k+m")
    p.add_argument("--num-nodes", type=int, default=1, help="nodes (processes launched outside, one per node)")
    p.add_argument("--no-local", action="store_true", help="no local tier (RAM tier only)")
    p.add_argument("--samples", type=int, default=64, help="dataset size")
    p.add_argument("--find-unused", action="store_true", help="DDP(find_unused_parameters=True)")
    p.add_argument("--static-graph", action="store_true", help="DDP(static_graph=True)")
    p.add_argument("--tiny", action="store_true", help="a one-parameter model")
    p.add_argument("--hidden", type=int, default=16, help="the model's hidden width")
    p.add_argument(
        "--count-reads",
        default=None,
        help="count the bytes read from the local tier's data objects at the OS interface (io_count.py)"
        " and write them to this path + .rank<global rank>",
    )
    p.add_argument(
        "--node-local", choices=["auto", "true", "false"], default="auto", help="the local tier's node_local option"
    )
    p.add_argument("--keep-last", type=int, default=2, help="the local tier's keep_last (0: keep every snapshot)")
    p.add_argument("--slow-write", type=float, default=0.0, help="seconds added to each local-tier data write")
    p.add_argument("--collective-timeout", type=float, default=300.0, help="SnapshotCallback(collective_timeout=)")
    p.add_argument("--raise-at", type=int, default=-1, help="raise in the training thread at this step...")
    p.add_argument("--raise-rank", type=int, default=1, help="...on this rank")
    p.add_argument(
        "--nan-at", type=int, default=-1, help="a NaN into the gradient of the optimizer step after this global step"
    )
    p.add_argument("--crash-after-restore", action="store_true", help="SIGKILL right after a restore")
    p.add_argument("--max-restores", type=int, default=3, help="SnapshotCallback(max_restores=)")
    p.add_argument(
        "--kill-plan",
        default="",
        help="under torchrun: ATTEMPT:RANK:STEP,... SIGKILL that rank at that step of that attempt"
        " (TORCHELASTIC_RESTART_COUNT), once the RAM tier (if any) holds the newest step due in it",
    )
    p.add_argument(
        "--kill-at",
        type=int,
        default=-1,
        help="SIGKILL at this global step, waiting only for the RAM tier (if any) to hold the newest step"
        " due in it (its agent has it then), not for any durable tier",
    )
    p.add_argument(
        "--kill-in-ram-write",
        default="",
        help="under torchrun: ATTEMPT:RANK:STEP: that rank of that attempt is SIGKILLed as it starts writing"
        " step STEP to the RAM tier, once its agent holds it; its training thread waits at STEP + 1",
    )
    p.add_argument(
        "--wait-agent-idle",
        action="store_true",
        help="under torchrun, from the second attempt on: before training, wait until the RAM tier's agent"
        " flushed what the attempt before left it",
    )
    p.add_argument("--signal-at", type=int, default=-1, help="send a preemption signal at this global step...")
    p.add_argument(
        "--signal-to",
        choices=["self", "launcher", "launchers", "all", "tree"],
        default="self",
        help="...to these processes ('launchers': each node's torchrun)",
    )
    p.add_argument("--signal-rank", type=int, default=0, help="...from (or, with 'self', to) this rank")
    p.add_argument(
        "--signal-during", choices=["train", "validation", "backward", "accumulating", "epoch_end"], default="train"
    )
    p.add_argument("--signal", default="SIGTERM", help="the signal sent (and the one the callback owns)")
    p.add_argument("--val-every", type=int, default=0, help="validate every N training batches (0: never)")
    p.add_argument("--val-delay", type=float, default=0.0, help="seconds each validation batch sleeps")
    p.add_argument("--val-samples", type=int, default=16, help="validation samples (batches of --batch-size)")
    p.add_argument(
        "--val-monitor",
        action="store_true",
        help="ModelCheckpoint monitoring val_loss (top 2, in DIR/../ckpts) and EarlyStopping on it, logged values kept",
    )
    p.add_argument("--sanity", type=int, default=0, help="num_sanity_val_steps (with --val-every)")
    p.add_argument("--timeline", action="store_true", help="print when each phase of a start and a stop ends")
    p.add_argument("--train-delay", default="", help="STEP:SECONDS: every rank sleeps in that step's batch")
    p.add_argument("--sigterm-grace", type=float, default=25.0)
    p.add_argument("--signal-again", type=float, default=0.0, help="send the signal again this many seconds later")
    p.add_argument("--rank0-delay", default="", help="STEP:SECONDS: rank 0 alone sleeps after that step's batch")
    p.add_argument(
        "--print-captures",
        action="store_true",
        help="print CAPTURE step=S rank=R each time the model and optimizer state is staged",
    )
    p.add_argument(
        "--slurm-requeue",
        action="store_true",
        help="SLURMEnvironment(auto_requeue=True) (the SLURM_* variables come from the test)",
    )
    a = p.parse_args()
    a.dir = os.path.expandvars(a.dir)  # (a path from an environment variable: each simulated node its own)

    L.seed_everything(42, verbose=False)
    model = Model(a.dropout, tiny=a.tiny, hidden=a.hidden)
    if a.count_reads:
        import io_count

        rank = int(os.environ.get("NODE_RANK", "0")) * a.devices + int(os.environ.get("LOCAL_RANK", "0"))
        io_count.install(a.dir.replace("{node_rank}", os.environ.get("NODE_RANK", "0")), f"{a.count_reads}.rank{rank}")
    if a.loader == "plain":
        loader = DataLoader(
            Squares(a.samples, a.augment),
            batch_size=a.batch_size,
            shuffle=a.shuffle,
            num_workers=a.workers,
            persistent_workers=a.persistent,
        )
    elif a.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(Squares(), batch_size=a.batch_size, shuffle=a.shuffle, num_workers=a.workers)
    else:
        loader = DataLoader(Stream(), batch_size=a.batch_size)
    if a.kill_before_commit >= 0:
        tier = CrashBeforeManifest(a.dir, a.kill_before_commit, every_n_train_steps=a.every, keep_last=2)
    elif a.slow_write:
        tier = SlowLocalTier(
            a.dir,
            a.slow_write,
            every_n_train_steps=a.every,
            keep_last=2,
            node_local={"auto": None, "true": True, "false": False}[a.node_local],
        )
    else:
        tier = LocalTier(
            a.dir,
            every_n_train_steps=a.every,
            keep_last=a.keep_last or None,
            node_local={"auto": None, "true": True, "false": False}[a.node_local],
        )
    tiers = [] if a.no_local else [tier]
    if a.ram_every:
        ram = make_ram_tier(
            _ram_kill_plan(a.kill_in_ram_write),
            every_n_train_steps=a.ram_every,
            keep_last=2,
            erasure=a.ram_erasure,
            name="test",
            idle_timeout=120,
        )
        tiers.insert(0, ram)
        if a.wait_agent_idle and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            wait_for_agent_idle(ram.node_dir)
    if a.s3:
        from lightning_snapshot.backends import ObjectStoreTier

        tiers.append(
            ObjectStoreTier(
                a.s3,
                storage_options=s3_options(a.endpoint),
                every_n_train_steps=a.s3_every or a.every,
                keep_last=2,
                retry_initial=0.1,
            )
        )
    callbacks = [
        SnapshotCallback(
            tiers,
            resume=not a.no_resume,
            collective_timeout=a.collective_timeout,
            max_restores=a.max_restores,
            sigterm_grace=a.sigterm_grace,
            preemption_signals=("SIGTERM",) if a.slurm_requeue else [a.signal],
        )
    ]
    callbacks.append(ReportRestore(callbacks[0]))  # (before CrashAfterRestore: the restore is reported first)
    if a.ema:
        from lightning.pytorch.callbacks import EMAWeightAveraging

        callbacks.append(EMAWeightAveraging(decay=0.9))
    if a.nan_at >= 0:
        callbacks.append(NanGradient(a.nan_at))
    if a.crash_after_restore:
        callbacks.append(CrashAfterRestore(callbacks[0]))
    if a.crash_at >= 0:
        callbacks.append(Crash(a.crash_at, tiers, newest=bool(a.ram_every) or a.crash_after_newest))
    if a.raise_at >= 0:
        callbacks.append(Raise(a.raise_at, a.raise_rank, tier))
    if a.rank0_delay:
        callbacks.append(Rank0Delay(*a.rank0_delay.split(":")))
    if a.train_delay:
        callbacks.append(TrainDelay(*a.train_delay.split(":")))
    ckpt_dir = os.path.join(os.path.dirname(a.dir.rstrip("/")), "ckpts")
    if a.val_monitor:
        from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=2, filename="{step}"))
        callbacks.append(EarlyStopping(monitor="val_loss", patience=50))
    if a.print_captures:
        _print_captures()
    if a.timeline:
        import atexit

        atexit.register(
            lambda: os.write(
                sys.stdout.fileno(),
                f"TIMELINE atexit_last rank={os.environ.get('RANK', '0')} at={time.time():.4f}\n".encode(),
            )
        )
        _print_timeline()
        os.write(
            sys.stdout.fileno(), f"TIMELINE imports rank={os.environ.get('RANK', '0')} at={IMPORTED:.4f}\n".encode()
        )
    if a.signal_at >= 0:
        callbacks.append(
            SendSignal(
                a.signal_at, a.signal_to, a.signal_rank, a.signal_during, int(getattr(signal, a.signal)), a.signal_again
            )
        )
    if a.kill_at >= 0:
        callbacks.append(Crash(a.kill_at, tiers[:1] if a.ram_every else [], newest=True))
    if _ram_kill_plan(a.kill_in_ram_write) is not None:
        callbacks.append(Hold(_ram_kill_plan(a.kill_in_ram_write) + 1))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for entry in filter(None, a.kill_plan.split(",")):
        when, rank, step = (int(x) for x in entry.split(":"))
        if when == attempt and rank == int(os.environ.get("RANK", "0")):
            callbacks.append(Crash(step, tiers[:1] if a.ram_every else [], newest=True))
    strategy = "ddp" if a.devices > 1 or a.num_nodes > 1 else "auto"
    if a.find_unused or a.static_graph:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(find_unused_parameters=a.find_unused, static_graph=a.static_graph)
    model.val_delay = a.val_delay
    val_loader = None
    if a.val_every:
        val_loader = DataLoader(Squares(a.val_samples), batch_size=a.batch_size, num_workers=a.workers)
    validation = dict(val_check_interval=a.val_every, num_sanity_val_steps=a.sanity) if a.val_every else {}
    if a.slurm_requeue:
        from lightning.pytorch.plugins.environments import SLURMEnvironment

        validation["plugins"] = [SLURMEnvironment(auto_requeue=True)]
    trainer = L.Trainer(
        **validation,
        accelerator=a.accelerator,
        devices=a.devices,
        num_nodes=a.num_nodes,
        strategy=strategy,
        max_steps=a.max_steps,
        accumulate_grad_batches=a.accumulate,
        callbacks=callbacks,
        logger=MemoryLogger() if a.val_monitor else False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    try:
        trainer.fit(model, loader, val_loader)
    except SystemExit as e:  # (a preemption: report the status each rank exits with)
        sys.stdout.flush()
        os.write(
            sys.stdout.fileno(), f"EXITING status={e.code} rank={trainer.global_rank} at={time.time():.3f}\n".encode()
        )
        if a.timeline:
            import atexit
            import threading

            rank = trainer.global_rank
            atexit.register(
                lambda: os.write(
                    sys.stdout.fileno(), f"TIMELINE atexit_first rank={rank} at={time.time():.4f}\n".encode()
                )
            )
            live = [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
            os.write(sys.stdout.fileno(), f"NONDAEMON rank={rank} {live}\n".encode())
        raise
    root = os.path.dirname(a.dir.rstrip("/")) if a.val_monitor else ""
    result = capture(trainer, model, root, logger=trainer.logger if a.val_monitor else None)
    if a.val_monitor:
        result["checkpoint_files"] = checkpoint_files(ckpt_dir, os.path.dirname(a.dir.rstrip("/")))
    if a.ema:  # (the model's weights are the averaged ones now: on_train_end copied them in)
        ema = next(cb for cb in callbacks if hasattr(cb, "_average_model"))
        result["averaged"] = {k: v.detach().clone() for k, v in ema._average_model.state_dict().items()}
    out = a.out if trainer.global_rank == 0 else f"{a.out}.rank{trainer.global_rank}"
    torch.save(result, out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
