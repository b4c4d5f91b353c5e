"""Which steps a tier holds committed: the step directories that have a manifest.

One job, below the commit rule and the backends: :func:`committed_steps` reads a tier's listing through the
:class:`~lightning_snapshot.backends.base.Backend` interface alone, so that the backends
(:func:`~lightning_snapshot.backends.base.node_steps`) and everything above them (commit.py, which re-exports it,
the writer, the loader, the restorer, the command) share one definition without the backends importing the commit
rule. A snapshot without a manifest does not exist (``docs/format.md``, "The commit rule").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_snapshot.format.entries import MANIFEST_NAME, parse_step_dirname

if TYPE_CHECKING:
    from lightning_snapshot.backends.base import Backend

__all__ = ["committed_steps"]


def committed_steps(backend: Backend) -> list[int]:
    """Steps that have a committed manifest in ``backend``, newest first."""
    steps = []
    for name in backend.list(""):
        step = parse_step_dirname(name)
        if step is not None and backend.exists(f"{name}/{MANIFEST_NAME}"):
            steps.append(step)
    return sorted(steps, reverse=True)
