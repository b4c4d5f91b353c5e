"""Make docs/img/tensorboard-scalars.png: TensorBoard's scalars page for a tiny run with the callback.

    python docs/scripts/tensorboard_screenshot.py [--out docs/img/tensorboard-scalars.png] [--keep DIR]

What it does, with nothing reached but 127.0.0.1:

1. Trains a tiny model on CPU for 60 steps with ``SnapshotCallback`` (a local tier every 5 steps and a second local
   tier at ``every_n_train_steps="auto"``, so the per-tier metrics show up as ``local0`` and ``local1`` and the
   ``every="auto"`` metrics appear) and a ``TensorBoardLogger``,
   then fits again to 80 steps from the same tiers, so the restore metrics are logged too.
2. Starts ``tensorboard --logdir <run> --host 127.0.0.1 --port <free port>`` and waits until it answers.
3. Screenshots its scalars page, filtered to the callback's metrics, with headless Chromium
   (``chromium`` or ``chromium-browser`` on PATH; ``apt-get install -y chromium`` on Debian).

If Chromium is missing or its screenshot fails, the script says so and exits with status 1: the documentation never
ships a hand-made picture.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

__all__ = ["main", "screenshot", "train"]

log = logging.getLogger(__name__)

_ROOT = Path(__file__).resolve().parents[2]
_BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def train(run_dir: Path) -> Path:
    """Train the tiny run (two fits, the second one resumed) and return the TensorBoard log directory."""
    import lightning as L
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning_snapshot.backends import LocalTier
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_snapshot import SnapshotCallback

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    L.seed_everything(0)
    data = TensorDataset(torch.randn(512, 64), torch.randn(512, 1))
    logs = run_dir / "logs"
    for max_steps in (60, 80):
        snapshots = SnapshotCallback(
            [
                LocalTier(run_dir / "snapshots" / "fast", every_n_train_steps=5, keep_last=2),
                LocalTier(run_dir / "snapshots" / "auto", every_n_train_steps="auto", keep_last=2),
            ]
        )
        trainer = L.Trainer(
            max_steps=max_steps,
            callbacks=[snapshots],
            logger=TensorBoardLogger(logs, name="tiny", version=0),
            log_every_n_steps=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
            devices=1,
        )
        trainer.fit(Model(), DataLoader(data, batch_size=16, shuffle=True))
    return logs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tensorboard exited with status {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"tensorboard did not answer {url} within {timeout:.0f} s")


def _browser() -> str:
    for name in _BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError(f"no headless browser found (looked for {', '.join(_BROWSERS)}); apt-get install -y chromium")


def screenshot(url: str, out: Path, size: tuple[int, int] = (1400, 2000), budget_ms: int = 20000) -> None:
    """Screenshot ``url`` with headless Chromium into ``out`` (PNG), letting the page render for ``budget_ms``."""
    browser = _browser()
    with tempfile.TemporaryDirectory(prefix="ls-chromium-") as profile:
        cmd = [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={size[0]},{size[1]}",
            f"--virtual-time-budget={budget_ms}",
            f"--screenshot={out}",
            url,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0 or not out.is_file() or out.stat().st_size < 10_000:
        raise RuntimeError(f"chromium made no screenshot (status {proc.returncode}): {proc.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=_ROOT / "docs" / "img" / "tensorboard-scalars.png")
    parser.add_argument("--keep", type=Path, default=None, help="train into this directory and keep it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    work = Path(tempfile.mkdtemp(prefix="ls-tb-")) if args.keep is None else args.keep
    try:
        logs = train(work)
        port = _free_port()
        tb = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorboard.main",
                "--logdir",
                str(logs),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_for(f"{base}/data/runs", tb)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            # the scalars dashboard, filtered to the callback's snapshot/... metrics, no smoothing
            screenshot(f"{base}/#scalars&tagFilter=snapshot%2F&_smoothingWeight=0&_ignoreYOutliers=false", args.out)
        finally:
            tb.terminate()
            tb.wait(timeout=30)
    except RuntimeError as e:
        log.error("tensorboard_screenshot: %s", e)
        return 1
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    log.info("wrote %s (%d bytes)", args.out, args.out.stat().st_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
