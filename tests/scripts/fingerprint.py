"""What the test scripts record of a finished fit, and how the tests compare two records: everything the README says
a resume restores, in one place.

The scripts (train.py, setups.py, ...) call :func:`capture` after ``trainer.fit`` and ``torch.save`` the result; the
tests compare two results with :func:`assert_same_run` (``conftest.assert_bitwise_equal`` reads the files). A script
reports a restore when it happens with :class:`ReportRestore` (a run that is killed later still prints it), and
records the values it logged with :class:`MemoryLogger`.
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers.logger import Logger

__all__ = [
    "MemoryLogger",
    "ReportRestore",
    "assert_same",
    "assert_same_logged",
    "assert_same_run",
    "capture",
    "checkpoint_files",
    "plain",
    "rng_states",
]


def plain(obj: Any, root: str = "") -> Any:
    """``obj`` with tensors cloned to the CPU and everything else JSON-like (for torch.save/weights_only); ``root`` in
    strings (checkpoint paths) becomes ``<DIR>``, so runs in other directories compare equal."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {plain(k, root): plain(v, root) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v, root) for v in obj]
    if isinstance(obj, str):
        return obj.replace(root, "<DIR>") if root else obj
    if obj is None or isinstance(obj, (bool, int, float)):
        return obj
    return repr(obj)


def rng_states() -> dict[str, Any]:
    """This process's torch, CUDA (every device, once initialized), numpy and python RNG states, as tensors."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": [t.clone() for t in torch.cuda.get_rng_state_all()] if torch.cuda.is_initialized() else [],
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss_next},
    }


def _harness(cb: Any) -> bool:
    """The snapshot callback itself and the scripts' own crash/report callbacks: not part of the training compared."""
    from lightning_snapshot import SnapshotCallback

    return isinstance(cb, SnapshotCallback) or getattr(cb, "test_harness", False)


def capture(trainer: Any, model: Any, root: str = "", logger: MemoryLogger | None = None) -> dict[str, Any]:
    """Everything a resume restores, as plain data: weights, every optimizer's state and param groups, every
    scheduler, loop progress, every callback's ``state_dict`` (the snapshot callback and the scripts' harness
    callbacks left out), the precision plugin's state, the torch, CUDA, numpy and python RNG, and (with ``logger``)
    every value logged, as ``{"METRIC@STEP": value}``."""
    return {
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "model": plain(model.state_dict(), root),
        "optimizers": [plain(o.state_dict(), root) for o in trainer.optimizers],
        "schedulers": [plain(c.scheduler.state_dict(), root) for c in trainer.lr_scheduler_configs],
        "loops": plain(trainer.fit_loop.state_dict(), root),
        "callbacks": {
            str(cb.state_key): plain(cb.state_dict(), root)
            for cb in trainer.callbacks
            if not _harness(cb) and cb.state_dict()
        },
        "precision": plain(trainer.precision_plugin.state_dict(), root),
        "rng": rng_states(),
        "logged": dict(logger.values) if logger is not None else {},
    }


#: the scripts' own callbacks (and ours), whose entries in a Lightning checkpoint are not training state
_HARNESS_KEYS = ("SnapshotCallback", "ReportRestore", "Crash", "Preempt")


def checkpoint_files(directory: str, root: str = "") -> dict[str, Any]:
    """The checkpoint files ModelCheckpoint left in ``directory``, by name, with their contents as plain data (loaded
    with ``weights_only=True``): weights, optimizer and scheduler states, loops, every callback's entry but the
    harness's and ours (a run without the library must write the same files), and the rest of Lightning's keys;
    ``root`` in paths becomes ``<DIR>``."""
    if not os.path.isdir(directory):
        return {}
    out = {}
    for name in sorted(os.listdir(directory)):
        ckpt = torch.load(os.path.join(directory, name), map_location="cpu", weights_only=True)
        ckpt["callbacks"] = {k: v for k, v in ckpt.get("callbacks", {}).items() if not str(k).startswith(_HARNESS_KEYS)}
        out[name] = plain(ckpt, root)
    return out


class ReportRestore(L.Callback):
    """Prints ``RESTORED step=S from=URL rank=R`` when a restore happened, at ``on_train_start`` (before any step
    runs, so a run killed later has printed it too), or at ``on_fit_end`` for a run with nothing left to train."""

    test_harness = True

    def __init__(self, snapshot_callback: Any) -> None:
        self.cb = snapshot_callback
        self.reported = False

    def report(self, trainer: Any) -> None:
        if self.cb.restored_from is not None and not self.reported:
            self.reported = True
            url, step = self.cb.restored_from[:2]
            # one write of the whole line: the ranks share the pipe, and print() may write the line and its newline
            # apart, between which another rank's line can land
            sys.stdout.flush()
            st = self.cb.restore_stats or {}
            os.write(sys.stdout.fileno(), f"RESTORED step={step} from={url} rank={trainer.global_rank}\n".encode())
            os.write(
                sys.stdout.fileno(),
                (
                    f"RESTORE_STATS rank={trainer.global_rank} needed={st.get('bytes_needed')} read={st.get('bytes_read')}"
                    f" received={st.get('bytes_received')} tier={st.get('tier_bytes_read')} job={st.get('job_bytes_read')}"
                    "\n"
                ).encode(),
            )

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.report(trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.report(trainer)


class MemoryLogger(Logger):
    """A Lightning logger that keeps every value logged, as ``{"METRIC@STEP": value}`` (the library's own
    ``snapshot/`` and ``restore/`` metrics left out: timings and byte counts, not training results)."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, float] = {}

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            if not key.startswith(("snapshot/", "restore/")):
                self.values[f"{key}@{step}"] = float(value)


def assert_same(ref: Any, got: Any, path: str = "result") -> None:
    """Recursive equality, tensors bitwise (dtype, shape and bytes)."""
    if isinstance(ref, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: {type(got).__name__} instead of a tensor"
        assert ref.dtype == got.dtype and ref.shape == got.shape, f"{path}: {got.dtype}{tuple(got.shape)}"
        same = torch.equal(ref.reshape(-1).view(torch.uint8), got.reshape(-1).view(torch.uint8))
        assert same, f"{path} differs: {ref.flatten()[:4].tolist()} vs {got.flatten()[:4].tolist()}"
    elif isinstance(ref, dict):
        assert isinstance(got, dict) and ref.keys() == got.keys(), (
            f"{path}: keys {sorted(map(str, ref))} vs {sorted(map(str, got)) if isinstance(got, dict) else got!r}"
        )
        for k in ref:
            assert_same(ref[k], got[k], f"{path}/{k}")
    elif isinstance(ref, list):
        assert isinstance(got, list) and len(ref) == len(got), f"{path}: {ref!r:.300} vs {got!r:.300}"
        for i, (r, g) in enumerate(zip(ref, got, strict=True)):
            assert_same(r, g, f"{path}[{i}]")
    else:
        assert ref == got or (ref != ref and got != got), f"{path}: {ref!r:.300} vs {got!r:.300}"


def assert_same_logged(ref: dict[str, float], got: dict[str, float], since: int | None) -> None:
    """Every value the compared run logged equals the reference's, and it logged every value of the steps after
    ``since`` (the step it resumed from; None: it ran from the start, every value). (A resumed process logs only
    from its restore on: the values before it were logged by the killed process.)"""
    differ = {k: (ref.get(k), v) for k, v in got.items() if ref.get(k) != v}
    assert not differ, f"logged values differ (reference, compared): {dict(list(differ.items())[:6])}"
    missing = sorted(k for k in ref if (since is None or int(k.rsplit("@", 1)[1]) > since) and k not in got)
    assert not missing, f"not logged: {missing[:10]}"


def assert_same_run(ref: dict[str, Any], got: dict[str, Any], since: int | None = None) -> None:
    """Two results of :func:`capture` (plus whatever else a script recorded) are the same run: everything bitwise,
    the logged values as :func:`assert_same_logged` says (``since``: the step the compared run resumed from)."""
    ref, got = dict(ref), dict(got)
    assert_same_logged(ref.pop("logged", {}), got.pop("logged", {}), since)
    assert_same(ref, got)
