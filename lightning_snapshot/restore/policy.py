"""Which snapshots an automatic resume may use: healthy ones, and not one the run keeps crashing after.

Two facts decide, besides the commit rule:

* **health**: the manifest's ``health`` field says, per tensor group, whether the staged parameters and optimizer
  state held a NaN or an infinity (see :func:`~lightning_snapshot.staging.nonfinite_tensors`), and its ``replicas``
  field whether the ranks' replicas disagreed (:mod:`~lightning_snapshot.fit.replicas`). An unhealthy snapshot is
  skipped unless the user opts out; a manifest without these fields counts as healthy.
* **restores**: every restore is recorded next to the snapshot it used, in a small JSON object
  ``step-<N>/restores.json`` (:data:`~lightning_snapshot.format.manifest.RESTORES_NAME`) of each tier that holds the
  step
  (the RAM tier keeps it in the memory of rank 0's node, which outlives the trainer):
  ``{"restores": count, "manifest": digest}``. The digest is that of the tier's manifest bytes, so a
  step committed again later (a new snapshot of the same step) starts from zero. The count of a step is the largest
  over the tiers. A snapshot restored ``max_restores`` times is skipped: the run crashed after each of those
  restores and committed nothing newer, so the next resume takes the one before it.

:func:`plan_resume` is pure (no I/O) and decides; :mod:`~lightning_snapshot.restore.records` reads and writes the
records, and the callback's :class:`~lightning_snapshot.restore.restorer.Restorer` gathers the facts on rank 0 and
broadcasts
the plan, so every rank of a job agrees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_snapshot.format.manifest import RESTORES_NAME, step_dirname

__all__ = ["Candidate", "ResumePlan", "plan_resume"]


@dataclass(frozen=True)
class Candidate:
    """A committed snapshot an automatic resume may use.

    Attributes:
        step: its step.
        tier: the index of its tier in the callback's tiers.
        nonfinite: ``(group, first tensor)`` holding a non-finite value, or None (healthy or not recorded).
        restores: how often it was restored before (the largest count over the tiers holding the step).
        replicas: the first tensor whose replicas disagreed at this step (the replica check), or None.
    """

    step: int
    tier: int
    nonfinite: tuple[str, str] | None = None
    restores: int = 0
    replicas: str | None = None

    @property
    def unhealthy(self) -> str | None:
        """Why the snapshot is unhealthy, or None."""
        if self.nonfinite is not None:
            group, tensor = self.nonfinite
            return f"tensor {tensor!r} of {group!r} holds a NaN or an infinity"
        if self.replicas is not None:
            return f"the ranks' replicas of {self.replicas!r} disagreed (the replica check)"
        return None


@dataclass(frozen=True)
class ResumePlan:
    """What :func:`plan_resume` decided: the snapshots to try, newest first, and the warnings to give (once)."""

    candidates: tuple[Candidate, ...]
    warnings: tuple[str, ...]
    #: Why nothing is left to resume from (every snapshot was skipped), or None.
    problem: str | None = None


def plan_resume(candidates: Sequence[Candidate], *, max_restores: int | None, resume_unhealthy: bool) -> ResumePlan:
    """Drop unhealthy snapshots (unless ``resume_unhealthy``) and those restored ``max_restores`` times or more
    (unless ``max_restores`` is None) from ``candidates`` (newest first), keeping the order of the rest.

    A step's restore count is the largest over its candidates (tiers). Returns the kept candidates and at most two
    warnings: one naming the newest unhealthy step and why (its first non-finite tensor, or replicas that
    disagreed), one naming the step a crash loop left behind. When every candidate was dropped, ``problem`` says
    why.
    """
    counts: dict[int, int] = {}
    for c in candidates:
        counts[c.step] = max(counts.get(c.step, 0), c.restores)
    kept: list[Candidate] = []
    unhealthy: list[Candidate] = []
    looping: list[int] = []
    for c in candidates:
        if c.unhealthy is not None and not resume_unhealthy:
            if all(u.step != c.step for u in unhealthy):
                unhealthy.append(c)
        elif max_restores is not None and counts[c.step] >= max_restores:
            if c.step not in looping:
                looping.append(c.step)
        else:
            kept.append(c)
    target = f"step {kept[0].step}" if kept else "none is left"
    messages: list[str] = []
    if unhealthy:
        first = unhealthy[0]
        others = [u.step for u in unhealthy[1:]]
        plural = "s" if len(others) > 1 else ""
        also = f" (also unhealthy: step{plural} {', '.join(map(str, others))})" if others else ""
        messages.append(
            f"lightning-snapshot: skipping the unhealthy snapshot of step {first.step}: {first.unhealthy}{also}."
            f" Resuming from the newest healthy snapshot ({target}); pass"
            " SnapshotCallback(resume_unhealthy=True) to resume from unhealthy snapshots anyway"
        )
    if looping:
        steps = ", ".join(map(str, looping))
        messages.append(
            f"lightning-snapshot: the snapshot of step {looping[0]} was restored {counts[looping[0]]} times"
            f" (max_restores={max_restores}) and no newer snapshot was committed since: the run crashes after"
            f" restoring it, so this resume takes the snapshot before it ({target})"
            + (f"; skipped for the same reason: steps {steps}" if len(looping) > 1 else "")
            + f". Delete {step_dirname(looping[0])}/{RESTORES_NAME} in its tiers to try it again, or raise"
            " max_restores"
        )
    problem = None
    if not kept and candidates:
        problem = (
            "every committed snapshot was skipped: " + " ".join(messages) + " (or pass resume=False to start fresh)"
        )
    return ResumePlan(tuple(kept), tuple(messages), problem)
