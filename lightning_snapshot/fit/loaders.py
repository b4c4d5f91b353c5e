"""The fit's train loaders, as the callback sees them: followed as Lightning makes them, put back where a restored
snapshot left them, and recorded before each fetch of a loader fetched ahead.

One :class:`FitLoaders` per callback, on the training thread. The callback's patched ``process_dataloader`` hands
it each train loader (:meth:`FitLoaders.on_train_loader`); a restore hands it the saved positions
(:meth:`FitLoaders.resume`, from the ``loaders`` state part); the snapshot pipeline reads the states recorded before
each fetch (:meth:`FitLoaders.state_before`). The position arithmetic and the samplers live
in :mod:`lightning_snapshot.data`.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning_snapshot import data as _data
from lightning_snapshot.state.patches import shift_batch_counters

__all__ = ["FitLoaders"]


class FitLoaders:
    """Train loader positions of a fit, and of the snapshot it resumed from."""

    def __init__(self) -> None:
        #: warnings given once per callback (by kind, or by loader type)
        self._warned: set[int | str] = set()
        self.start()

    def start(self) -> None:
        """A fit starts: nothing restored yet."""
        #: Stateful train-loader states recorded before each fetch of a loader without a length, by fetch index.
        self._fetch_states: dict[int, Any] = {}
        self._pending: list[dict[str, Any] | None] = []
        self._count = 0
        self._exact = True
        #: after a restore: "mid" (the run continues an epoch) or "boundary"; None when nothing was restored
        self.resumed: str | None = None
        #: the epoch a resumed run's loaders are being made at (``patches.make_loaders_at_epoch``), or None
        self.making_epoch: int | None = None

    def resume(self, resumed: str, loaders: list[Any], exact: bool) -> None:
        """A snapshot was restored: each train loader's position is put back as the loaders are made."""
        self.resumed = resumed
        self._pending = list(loaders)
        self._count = len(self._pending)
        self._exact = exact

    def set_making_epoch(self, epoch: int | None) -> None:
        self.making_epoch = epoch

    def before_fetch(self, trainer: Any) -> None:
        """Right before the training loop fetches a batch: a loader without a length (fetched one batch ahead) has its
        state recorded, so that a snapshot records the position of the first batch not consumed (what Lightning
        would save for a stateful loader)."""
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        index = int(getattr(fetcher, "fetched", 0))
        if getattr(fetcher, "length", 0) is None:
            combined = getattr(trainer.fit_loop, "_combined_loader", None)
            states = combined._state_dicts() if combined is not None else []
            if states:
                self._fetch_states = {i: v for i, v in self._fetch_states.items() if i >= index - 2}
                self._fetch_states[index] = states

    def adopt_made(self, trainer: Any) -> None:
        """At the end of ``on_fit_start``: train loaders that exist already (a tuner such as LearningRateFinder ran the
        fit loop in its on_fit_start, and Lightning keeps the loaders it set up) are not processed again: follow
        them, and resume them, now."""
        combined = getattr(trainer.fit_loop, "_combined_loader", None)  # private: the fit loop's loaders
        loaders = getattr(combined, "flattened", None) or []
        for loader in loaders:
            self.on_train_loader(loader, trainer)
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)  # private: it holds the epoch's iterators
        if loaders and fetcher is not None and self.resumed is not None:
            # Lightning created the epoch's iterators when it set the loaders up, before this restore, and does not
            # create them again for a resumed epoch: create them now, from the restored position (as Lightning
            # does when it sets the loaders up after a restore)
            iter(fetcher)

    def state_before(self, index: int) -> Any:
        """The loaders' states recorded before fetch ``index`` of the epoch, or None."""
        return self._fetch_states.get(index)

    def on_train_loader(self, loader: object, trainer: Any) -> None:
        """A train loader as Lightning makes it: its sampler is wrapped (position and order recorded), its restored
        position given back, and what cannot be resumed exactly is warned about once."""
        wrapper = _data.install(loader)
        if self._pending:
            count = self._count
            index = count - len(self._pending)
            pending = self._pending.pop(0)
            recorder = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
            if isinstance(recorder, _data.DrawRecorder) and isinstance(pending, dict) and self._exact:
                recorder.replay = pending.get("draw_rng")  # (the rest of its position is Lightning's to restore)
            if wrapper is not None and pending is not None:
                epoch = trainer.current_epoch if self.making_epoch is None else self.making_epoch
                target = _data.plan_resume(wrapper, loader, pending, self._exact, epoch)
                if target is not None and count == 1 and index == 0:
                    shift_batch_counters(trainer, target)
                elif target is not None:
                    warnings.warn(
                        "lightning-snapshot: with several train dataloaders, the epoch's batch count after a"
                        " change of the number of processes follows Lightning's restored count, not the"
                        " data left",
                        stacklevel=2,
                    )
        workers = int(getattr(loader, "num_workers", 0) or 0)
        if self.resumed == "mid" and _data.is_stateful(loader) and workers > 0 and "workers" not in self._warned:
            self._warned.add("workers")
            warnings.warn(
                f"lightning-snapshot: the train loader ({type(loader).__name__}) restores its own position, and its"
                f" {workers} worker processes restart their global RNG (torch, numpy, random) from their"
                " seeds: random augmentation drawn there is not resumed exactly. Keep the augmentation's RNG in the"
                " dataset's state_dict(), or use a torch DataLoader (lightning-snapshot restores its workers' RNG)",
                stacklevel=2,
            )
        held = _data.dataset_generators(getattr(loader, "dataset", None))
        if held and "generators" not in self._warned:
            self._warned.add("generators")
            warnings.warn(
                f"lightning-snapshot: the train dataset holds random generators of its own ({', '.join(held)}):"
                " lightning-snapshot restores the global RNGs (torch, numpy, python; in loader workers too), not"
                " these, so a resumed run draws differently from them. Draw from the global RNGs (torch.rand,"
                " np.random, random), or give the dataset state_dict()/load_state_dict() and use torchdata's"
                " StatefulDataLoader",
                stacklevel=2,
            )
        reason = _data.unsupported_reason(loader)
        if reason is not None and id(type(loader)) not in self._warned:
            self._warned.add(id(type(loader)))
            warnings.warn(
                f"lightning-snapshot cannot restore the exact position of a train dataloader: {reason}.", stacklevel=2
            )
