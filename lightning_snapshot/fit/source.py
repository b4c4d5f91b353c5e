"""What the snapshot pipeline asks of the training state it snapshots: one integration's answer each.

The pipeline (:mod:`~lightning_snapshot.fit.pipeline`) and its stager (:mod:`~lightning_snapshot.fit.stager`) decide
*when* a snapshot is taken, stage it, fence it and hand it over; they know nothing of the Trainer or of Fabric. A
:class:`StateSource` says *what* the state is: the Trainer's
(:class:`~lightning_snapshot.state.trainer.TrainerSource`: the LightningModule, its loops, callbacks and parts) and
Fabric's (:class:`~lightning_snapshot.fabric.state.FabricSource`: the user's ``state`` dict).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from lightning_snapshot.staging.live import LiveCapture

__all__ = ["Captured", "StateSource"]

#: what :meth:`StateSource.capture_shared` returns: the state to stage (a tree, or already encoded by the capture
#: plan), and the tensor parts' tree and stable tensors beside it (copied in the background like the parameters, and
#: compared by the replica check; ``({}, [])`` where there are none)
Captured = tuple[Any, tuple[dict[str, Any], list[torch.Tensor]]]


class StateSource(Protocol):
    """One integration's training state, as the pipeline takes it (training thread, every rank)."""

    def step(self) -> int:
        """The optimizer steps taken (the snapshot's step)."""

    def epoch(self) -> int:
        """The epoch a snapshot of now is recorded in."""

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers (unwrapped): which parameters they train decides what is copied in the background."""

    def capture_shared(self, live: LiveCapture) -> Captured:
        """The state every rank holds alike (weights, optimizer state): staged into the host arena, through the
        capture plan ``live`` where the state allows."""

    def capture_rank(self, token: object | None, consumed_offset: int, validation_pending: bool) -> dict[str, Any]:
        """This rank's own section (RNG, data position, what else the integration keeps per rank). ``token``: the
        capture plan's token of the shared state staged for it; ``consumed_offset``: batches fetched but not trained
        on yet; ``validation_pending``: taken as a validation starts (the resumed run validates again first)."""

    def replicated(self) -> tuple[Any, set[str]] | None:
        """Under DDP, the module whose replicas the replica check compares and the names DDP ignores; None when
        the state is not replicated (one process, a sharded strategy)."""
