"""What a snapshot costs a Lightning Fabric training loop: ``FabricSnapshots`` against ``fabric.save``.

    python benchmarks/fabric_stall.py [--quick] [--steps 31] [--every 5] [--dir /tmp]

One process trains ``stall.py``'s GPT-style transformer (``_stall_models.QUICK``: 21.5M parameters, AdamW; ``--full``:
GPT-2 small's 124M) with Fabric on the CPU, once per method, and snapshots the same ``state`` (model, optimizer,
step) every ``--every`` optimizer steps:

* ``baseline``: no snapshot;
* ``fabric-snapshots``: ``FabricSnapshots`` with one local tier (``<dir>?every=<every>&keep=2``);
* ``fabric.save``: ``fabric.save(path, state)`` (``torch.save`` on the training thread), a file per snapshot.

Measured per method:

* **stall**: the time the training thread is blocked per snapshot. ``fabric.save``: the call. ``FabricSnapshots``:
  its ``step()`` call at a snapshot step, plus its wait in the next ``optimizer.step()`` for the copy still running
  (timed between two step pre-hooks of the benchmark's, one registered before ``FabricSnapshots.resume`` and one
  after, so that its own pre-hook runs between them).
* **overhead**: added wall time per snapshot, ``(wall_method - wall_baseline) / snapshots``, over the whole loop
  (the first step, which allocates the optimizer state, excluded). What runs after the loop (the final snapshot, the
  drain) is not counted; background work of a snapshot overlaps the steps that follow it.

The numbers depend on the machine and on what else runs on it (see the note printed with the table).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _stall_models import FULL, QUICK, RandomTokens, fresh_model

from lightning_snapshot.fabric import FabricSnapshots


def run(method: str, cfg, steps: int, every: int, root: Path) -> dict:
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = fresh_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(RandomTokens(steps * cfg.batch, cfg.seq, cfg.vocab), batch_size=cfg.batch)
    )
    state = {"model": model, "optimizer": optimizer, "step": 0}
    marks: dict[str, float] = {}
    raw = optimizer.optimizer
    raw.register_step_pre_hook(lambda *_: marks.__setitem__("before", time.perf_counter()))
    snapshots = FabricSnapshots(fabric, f"{root / 'snaps'}?every={every}&keep=2", resume=False)
    if method == "fabric-snapshots":
        snapshots.resume(state)
    raw.register_step_pre_hook(lambda *_: marks.__setitem__("after", time.perf_counter()))
    stalls: list[float] = []
    waits: list[float] = []
    pending = False
    t0 = None
    for batch in loader:
        if state["step"] == 1 and t0 is None:
            t0 = time.perf_counter()
        logits = model(batch[:, :-1])
        fabric.backward(F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()))
        optimizer.step()
        if pending:
            waits.append(marks["after"] - marks["before"])
            pending = False
        optimizer.zero_grad()
        state["step"] += 1
        if method == "fabric-snapshots":
            t = time.perf_counter()
            snapshots.step(state)
            if state["step"] % every == 0:
                stalls.append(time.perf_counter() - t)
                pending = True
        elif method == "fabric.save" and state["step"] % every == 0:
            t = time.perf_counter()
            fabric.save(root / f"step-{state['step']}.ckpt", state)
            stalls.append(time.perf_counter() - t)
    wall = time.perf_counter() - (t0 or time.perf_counter())
    if method == "fabric-snapshots":
        snapshots.close()
    total = [s + w for s, w in zip(stalls, waits + [0.0] * (len(stalls) - len(waits)), strict=True)]
    return {"wall": wall, "stalls": total, "n": len(stalls)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--full", action="store_true", help="GPT-2 small (124M) instead of the 21.5M model")
    p.add_argument("--steps", type=int, default=31)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--dir", default="/tmp")
    args = p.parse_args()
    cfg = FULL if args.full else QUICK
    torch.manual_seed(0)
    probe = fresh_model(cfg)
    state_mb = sum(t.numel() for t in probe.parameters()) * 4 * 3 / 1e6  # (fp32 weights + AdamW's two moments)
    del probe
    results = {}
    for method in ("baseline", "fabric-snapshots", "fabric.save", "baseline"):
        root = Path(tempfile.mkdtemp(prefix="fabric-stall-", dir=args.dir))
        try:
            r = run(method, cfg, args.steps, args.every, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if method in results:  # (two baselines: the faster one)
            r = min(r, results[method], key=lambda x: x["wall"])
        results[method] = r
    base = results["baseline"]["wall"]
    print(f"model: {cfg}, state {state_mb:.0f} MB (fp32 weights + AdamW), {args.steps} steps, every {args.every}")
    print(f"torch {torch.__version__}, lightning {L.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"{'method':<18} {'stall p50 ms':>12} {'stall max ms':>12} {'overhead/snap ms':>17} {'wall s':>7}")
    for method in ("baseline", "fabric-snapshots", "fabric.save"):
        r = results[method]
        stalls = [s * 1000 for s in r["stalls"]]
        p50 = f"{statistics.median(stalls):.1f}" if stalls else "-"
        mx = f"{max(stalls):.1f}" if stalls else "-"
        ovh = f"{(r['wall'] - base) * 1000 / r['n']:.1f}" if r["n"] else "-"
        print(f"{method:<18} {p50:>12} {mx:>12} {ovh:>17} {r['wall']:>7.2f}")


if __name__ == "__main__":
    main()
