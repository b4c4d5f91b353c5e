"""Two processes under DDP (gloo), one failure on rank 0 only; the ranks must stay in step (their collectives
paired), whatever the failure:

- ``--fail stage``: from step 4 rank 0 cannot capture its share of the weights (a ``CaptureError`` while staging):
  with ``on_error="raise"`` every rank raises (rank 1 used to skip the snapshot, warn and train on alone, its next
  collective then failing when rank 0 was gone; NCCL would hang); with ``"warn"`` both train on to the end.
- ``--fail cleanup``: after step 4's commit, rank 0's removal of older objects fails once (a listing error) on a
  tier that retries failed writes: rank 0 alone retried the commit, and the tier's collectives went out of step for
  the rest of the fit (the later snapshots never committed).
- ``--fail list``: a node-local tier; at setup rank 0 (the node's lister) cannot list it once (a transient error):
  rank 0 alone left the listing's collective (rank 1 timed out there, then both crashed); the ranks now agree that
  the callbacks' states are not loaded at setup, and both resume at the fit's start.
- ``--fail stale-listing --resume PATH``: resuming from a snapshot directory given by path, rank 1's listing of it
  is stale (it misses the newest step, as a listing racing a commit can): every rank must restore the step rank 0
  found (each listed it itself, and restored different snapshots).

Usage: python one_rank_fails.py --dir SNAPDIR --fail none|stage|cleanup|list|stale-listing [--on-error raise|warn]
       [--max-steps N] [--resume PATH]
Each rank prints ``rank R: FIT RETURNED step=S from=STEP`` (the step restored, or None) or ``rank R: RAISED <type>:
<message>``.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_snapshot.persist.commit as commit
import lightning_snapshot.state.trainer as source
from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.errors import CaptureError

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--fail", choices=["none", "stage", "cleanup", "list", "stale-listing"], required=True)
p.add_argument("--on-error", choices=["warn", "raise"], default="raise")
p.add_argument("--max-steps", type=int, default=12)
p.add_argument("--resume", default=None, help="resume from this snapshot directory (default: the tier's newest)")
a = p.parse_args()
rank = int(os.environ.get("LOCAL_RANK", "0"))

if a.fail == "stage":
    capture = source.capture_shared_live

    def capture_shared_live(trainer, pl_module, live, parts=None):
        if trainer.global_rank == 0 and trainer.global_step >= 4:
            raise CaptureError("injected: rank 0 cannot capture its share of the weights")
        return capture(trainer, pl_module, live, parts)

    source.capture_shared_live = capture_shared_live
elif a.fail == "list":
    listing = LocalTier.list
    listed: list[str] = []

    def list_once_failing(self, prefix=""):
        if rank == 0 and prefix == "" and not listed:
            listed.append(prefix)
            raise OSError(5, "injected: input/output error listing the tier, once")
        return listing(self, prefix)

    LocalTier.list = list_once_failing
elif a.fail == "stale-listing":
    import lightning_snapshot.restore.restorer as restore

    newest_first = restore.committed_steps

    def stale(backend):
        steps = newest_first(backend)
        return steps[1:] if rank == 1 and backend.url != tier_url else steps  # (rank 1 misses the newest step)

    restore.committed_steps = stale
elif a.fail == "cleanup":
    remove = commit.remove_unreferenced
    failed: list[str] = []

    def remove_unreferenced(backend, prefix, manifest):
        if rank == 0 and prefix.endswith("04") and not failed:
            failed.append(prefix)
            raise OSError(5, "injected: listing failed after the commit")
        return remove(backend, prefix, manifest)

    commit.remove_unreferenced = remove_unreferenced

tier = LocalTier(a.dir, every_n_train_steps=4, keep_last=None, node_local=a.fail in ("none", "list"))
tier_url = tier.url
if a.fail == "cleanup":
    tier.retry_initial, tier.retry_max = 0.2, 0.4  # (retries failed writes, as an object store does)
snapshots = SnapshotCallback(
    tier, on_error=a.on_error, collective_timeout=20, shutdown_timeout=10, resume=a.resume if a.resume else True
)
trainer = L.Trainer(
    max_steps=a.max_steps,
    callbacks=[snapshots],
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    limit_val_batches=0,
    accelerator="cpu",
    devices=2,
    strategy="ddp",
)
try:
    trainer.fit(BoringModel())
    restored = snapshots.restored_from[1] if snapshots.restored_from else None
    print(f"rank {trainer.global_rank}: FIT RETURNED step={trainer.global_step} from={restored}", flush=True)
except Exception as e:  # noqa: BLE001 - (what each rank raised is the outcome)
    print(f"rank {trainer.global_rank}: RAISED {type(e).__name__}: {str(e)[:300]}", flush=True)
