"""A small GPT pretrained with Lightning Fabric in LitGPT's style, snapshots in three tiers, a SIGKILL and a resume.

    python examples/fabric_gpt.py                 # the demo (about a minute on 2 CPU cores)
    python examples/fabric_gpt.py train --dir D   # one training run (what the demo starts three times)

What the demo does:
1. A reference run pretrains a tiny GPT (from scratch, on generated token sequences: no download) for 60 steps.
2. The same run is started with snapshots: the RAM tier every 5 steps (its node agent keeps them in memory and
   outlives the trainer), a local directory every 10 and an object store every 20 (moto's S3 server on 127.0.0.1
   when ``moto[server]`` and ``s3fs`` are installed; skipped otherwise). The demo SIGKILLs it at step 37.
3. The run is started again, unchanged: ``snapshots.resume(state)`` finds the newest snapshot that verifies in any
   tier (the RAM tier's step 35) and the loop goes on from there.
4. The final weights, optimizer state and losses of the resumed run are compared, bitwise, with the reference run.

The loop is LitGPT's ``pretrain`` loop cut down: a ``state`` dict, gradient accumulation with
``fabric.no_backward_sync``, gradient clipping, a warmup-then-cosine learning rate set by hand on every iteration,
dropout and a shuffled loader from ``fabric.setup_dataloaders``. The three lines it adds are marked ``# <-``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

VOCAB, BLOCK, MAX_STEPS, KILL_AT = 64, 32, 60, 37


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).transpose(1, 3).unbind(2)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, dim), nn.Embedding(BLOCK, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # (tied, as GPT-2's)
        nn.init.normal_(self.wte.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


class Sequences(torch.utils.data.Dataset):
    """Token sequences from a fixed random Markov chain (generated: nothing is downloaded)."""

    def __init__(self, n: int = 1024) -> None:
        g = torch.Generator().manual_seed(42)
        transitions = torch.softmax(3 * torch.randn(VOCAB, VOCAB, generator=g), dim=-1)
        tokens = torch.empty(n, BLOCK + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(VOCAB, (n,), generator=g)
        for t in range(BLOCK):
            tokens[:, t + 1] = torch.multinomial(transitions[tokens[:, t]], 1, generator=g).squeeze(1)
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i, :-1], self.tokens[i, 1:]


def get_lr(step: int, lr: float = 3e-3, warmup: int = 10) -> float:
    """LitGPT's schedule: linear warmup, then cosine decay to a tenth."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, MAX_STEPS - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(args: argparse.Namespace) -> None:
    import lightning as L

    from lightning_snapshot.fabric import FabricSnapshots

    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    fabric.launch()
    fabric.seed_everything(1337)
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=get_lr(0), weight_decay=0.1, betas=(0.9, 0.95))
    model, optimizer = fabric.setup(model, optimizer)
    loader = torch.utils.data.DataLoader(Sequences(), batch_size=8, shuffle=True)
    loader = fabric.setup_dataloaders(loader)
    state = {"model": model, "optimizer": optimizer, "train_dataloader": loader, "iter_num": 0, "step_count": 0}
    state["losses"] = []
    accumulate = 2

    tiers: list = []
    if args.dir:
        tiers = ["ram://fabric-gpt?every=5&erasure=none", f"{args.dir}/local?every=10"]
        if args.endpoint:
            from lightning_snapshot.backends import ObjectStoreTier

            options = {"key": "demo", "secret": "demo", "client_kwargs": {"endpoint_url": args.endpoint}}
            tiers.append(ObjectStoreTier("s3://fabric-gpt/run", storage_options=options, every_n_train_steps=20))
    snapshots = FabricSnapshots(fabric, tiers or [f"{tempfile.mkdtemp()}?every=1000"], resume=bool(args.dir))  # <-
    with snapshots:
        if snapshots.resume(state) is not None:  # <- into `state`, in place
            fabric.print(f"resumed from step {state['step_count']} ({snapshots.restored_from[0]})")
        while state["step_count"] < MAX_STEPS:
            for x, y in loader:
                state["iter_num"] += 1
                accumulating = state["iter_num"] % accumulate != 0
                with fabric.no_backward_sync(model, enabled=accumulating):
                    logits = model(x)
                    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
                    fabric.backward(loss / accumulate)
                if accumulating:
                    continue
                for group in optimizer.param_groups:
                    group["lr"] = get_lr(state["step_count"])
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad()
                state["step_count"] += 1
                state["losses"].append(loss.item())
                if state["step_count"] == args.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)  # (the demo's crash)
                snapshots.step(state)  # <- a snapshot when a tier is due
                if state["step_count"] % 10 == 0:
                    fabric.print(f"step {state['step_count']}: loss {loss.item():.4f}")
                if state["step_count"] >= MAX_STEPS:
                    break
    if args.out:
        result = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "losses": state["losses"]}
        torch.save(result, args.out)


def start_object_store() -> tuple[object | None, str | None]:
    """moto's S3 server on 127.0.0.1 with a bucket, or (None, None) when moto or s3fs are not installed."""
    try:
        import boto3
        import s3fs  # noqa: F401
        from moto.server import ThreadedMotoServer
    except ImportError:
        print("(moto[server] or s3fs not installed: the object-store tier is left out)")
        return None, None
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server._server.server_port}"  # (moto's bound port)
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="demo", aws_secret_access_key="demo")
    s3.create_bucket(Bucket="fabric-gpt")
    return server, endpoint


def demo(workdir: Path) -> int:
    from lightning_snapshot.agent import stop_agent

    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    env = {**os.environ, "LIGHTNING_SNAPSHOT_SHM_DIR": str(workdir / "shm"), "AWS_DEFAULT_REGION": "us-east-1"}
    server, endpoint = start_object_store()
    me = [sys.executable, __file__, "train"]
    store = ["--endpoint", endpoint] if endpoint else []
    try:
        print("1. reference run, uninterrupted")
        subprocess.run([*me, "--out", str(workdir / "ref.pt")], check=True, env=env)
        print(f"2. run with snapshots, SIGKILLed at step {KILL_AT}")
        killed = subprocess.run([*me, "--dir", str(workdir), "--kill-at", str(KILL_AT), *store], env=env)
        assert killed.returncode == -signal.SIGKILL, killed.returncode
        print("3. the same run again: it resumes")
        subprocess.run([*me, "--dir", str(workdir), "--out", str(workdir / "out.pt"), *store], check=True, env=env)
    finally:
        for sock in list((workdir / "shm").glob("**/agent.sock")):
            stop_agent(sock.parent)  # (the RAM tier's agent would keep its memory until stopped)
        if server is not None:
            server.stop()  # type: ignore[attr-defined]
    ref, got = torch.load(workdir / "ref.pt"), torch.load(workdir / "out.pt")
    same = ref["losses"] == got["losses"] and all(torch.equal(ref["model"][k], v) for k, v in got["model"].items())
    same = same and all(
        torch.equal(a, b)
        for i, s in ref["optimizer"]["state"].items()
        for a, b in zip(s.values(), got["optimizer"]["state"][i].values(), strict=True)
    )
    print(f"4. the resumed run is bitwise equal to the reference: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", nargs="?", default="demo", choices=["demo", "train"])
    parser.add_argument("--dir", default=None, help="the snapshot directory (none: a run without snapshots)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--endpoint", default=None, help="an S3 endpoint for the object-store tier")
    parser.add_argument("--workdir", default="fabric-gpt-demo")
    args = parser.parse_args()
    if args.command == "train":
        train(args)
    else:
        sys.exit(demo(Path(args.workdir)))
