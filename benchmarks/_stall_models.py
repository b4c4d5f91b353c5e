"""benchmarks/stall.py, part 1 of 3: the model, its data, and helpers on its state.

One job: what every method of ``stall.py`` trains and checks: the model configurations (``FULL``, ``QUICK``,
``MEDIUM``, ``MANY``), the GPT-style transformer and the many-tiny-layers model, random token data, and the state
helpers (the state's tensors and bytes, bitwise fingerprints, the in-place mutation of the consistency check, RSS,
fsync, a single-process gloo group). Imported by ``benchmarks/_stall_run.py``, ``benchmarks/_stall_methods.py`` and
``benchmarks/stall.py`` (the entry point); not run on its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import _harness as harness
import lightning.pytorch as L
import torch
import torch.nn.functional as F
import xxhash
from torch import nn

GB = 1e9
MiB = 1 << 20


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
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, dim=2)
        )
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
    for p in [path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]:
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
