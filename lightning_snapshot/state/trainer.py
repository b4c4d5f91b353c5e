"""The Trainer's training state, as the snapshot pipeline takes it (:class:`~lightning_snapshot.fit.source.
StateSource`): the LightningModule and its optimizers (staged), and this rank's section (loops, callbacks,
schedulers, RNG, data position and the registered parts: :mod:`~lightning_snapshot.state.builtin`).

One :class:`TrainerSource` per fit, made by the callback's ``setup``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_snapshot.staging.live import LiveCapture
from lightning_snapshot.state.builtin import capture_section, capture_tensor_parts
from lightning_snapshot.state.capture import capture_shared_live, raw_optimizer
from lightning_snapshot.state.ddp_layout import is_ddp

__all__ = ["TrainerSource"]


class TrainerSource:
    """The state of ``trainer``'s fit. ``fetch_states``: the train loaders' states recorded before a fetch, by the
    epoch's fetch index."""

    def __init__(self, trainer: Any, fetch_states: Callable[[int], Any]) -> None:
        self.trainer = trainer
        self._fetch_states = fetch_states
        #: the parts' memory across the fit's snapshots: the tensor parts' (at each staging) and the rank section's
        self._tensor_memo: dict[str, Any] = {}
        self._memo: dict[str, Any] = {}

    def step(self) -> int:
        return int(self.trainer.global_step)

    def epoch(self) -> int:
        return int(self.trainer.current_epoch)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [raw_optimizer(o) for o in self.trainer.optimizers]

    def capture_shared(self, live: LiveCapture) -> tuple[Any, tuple[dict[str, Any], list[torch.Tensor]]]:
        trainer = self.trainer
        parts = capture_tensor_parts(trainer, self._tensor_memo)
        return capture_shared_live(trainer, trainer.lightning_module, live, parts[0]), parts

    def capture_rank(self, token: object | None, consumed_offset: int, validation_pending: bool) -> dict[str, Any]:
        trainer = self.trainer
        consumed = max(0, trainer.fit_loop.epoch_loop.batch_progress.current.ready - consumed_offset)
        return capture_section(
            trainer, consumed, token, self._fetch_states, self._memo, validation_pending=validation_pending
        )

    def replicated(self) -> tuple[Any, set[str]] | None:
        model = self.trainer.strategy.model
        if not is_ddp(model):
            return None
        return self.trainer.lightning_module, set(getattr(model, "parameters_to_ignore", None) or ())
