"""Object-store demo: snapshots to S3 (a local S3-protocol server), then a restore from the bucket alone.

    python examples/object_store.py

1. Starts moto's S3 server on 127.0.0.1 (a free port) and creates a bucket. Nothing leaves this machine.
2. Trains 20 steps with two tiers: a local directory every 5 steps and the bucket every 10 steps. The bucket tier
   uploads the local tier's committed files byte for byte, off the training thread.
3. Deletes the local directory, and trains on to step 30 with a new Trainer: it resumes from the bucket alone.
4. Checks the resumed run against an uninterrupted 30-step run, bitwise.

Needs the test extras (moto[server], s3fs): `bash scripts/test.sh` installs them, or
`pip install "lightning-snapshot[s3]" "moto[server]"`.
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends import LocalTier, ObjectStoreTier


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(max_steps: int, tiers: list) -> tuple[Model, SnapshotCallback]:
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 32, generator=g), torch.randn(256, 1, generator=g))
    callback = SnapshotCallback(tiers) if tiers else None
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        callbacks=[callback] if callback else [],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        enable_checkpointing=callback is not None,
    )
    model = Model()
    trainer.fit(model, DataLoader(data, batch_size=16, shuffle=True))
    return model, callback


def main() -> int:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "werkzeug"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server._server.server_port}"
    # credentials come from storage_options (or the environment / provider chain); never from the URL
    options = {
        "key": "demo-key",
        "secret": "demo-secret",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }
    import s3fs

    s3fs.S3FileSystem(**options).call_s3("create_bucket", Bucket="snapshots-demo")
    local_dir = Path(tempfile.mkdtemp(prefix="lightning-snapshot-demo-"))
    try:

        def tiers(with_local: bool) -> list:
            bucket = ObjectStoreTier("s3://snapshots-demo/run-1", storage_options=options, every_n_train_steps=10)
            return ([LocalTier(local_dir, every_n_train_steps=5)] if with_local else []) + [bucket]

        print(f"1/4 S3 server on {endpoint}, bucket snapshots-demo")
        print("2/4 train 20 steps: local tier every 5 steps, bucket every 10")
        fit(20, tiers(with_local=True))
        print(f"    bucket: {tiers(False)[0].list('')}")
        print("3/4 delete the local tier and train on to step 30 from the bucket alone")
        shutil.rmtree(local_dir)
        resumed, cb = fit(30, tiers(with_local=False))
        url, step, seconds = cb.restored_from
        print(f"    resumed from step {step} of {url} in {seconds:.2f} s")
        print("4/4 compare with an uninterrupted 30-step run")
        reference, _ = fit(30, [])
        same = all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), resumed.state_dict().values()))
        print("OK: bitwise identical weights" if same else "MISMATCH")
        return 0 if same else 1
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
