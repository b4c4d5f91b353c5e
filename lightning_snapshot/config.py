"""The callback's configuration: one frozen object, validated once when :class:`SnapshotCallback` is made.

Called by ``SnapshotCallback.__init__`` only; every other part reads the result. The options are documented on
:class:`~lightning_snapshot.callback.SnapshotCallback`; each error message names the option and what it accepts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_snapshot.backends.base import Backend
from lightning_snapshot.backends.registry import parse_tier
from lightning_snapshot.errors import ConfigError
from lightning_snapshot.interval import parse_duration
from lightning_snapshot.preempt import DEFAULT_SIGNALS, parse_signals

__all__ = ["ON_ERROR", "ON_REPLICA_MISMATCH", "SnapshotConfig"]

#: The values ``on_error`` takes.
ON_ERROR = ("raise", "warn")
#: The values ``on_replica_mismatch`` takes (see :mod:`lightning_snapshot.replicas`).
ON_REPLICA_MISMATCH = ("warn", "raise", "skip")


@dataclass(frozen=True)
class SnapshotConfig:
    """What :class:`~lightning_snapshot.callback.SnapshotCallback` was asked to do (see its arguments)."""

    tiers: tuple[Backend, ...]
    resume: bool | int | str
    on_error: str
    max_host_bytes: int | None
    chunk_bytes: int
    sigterm_grace: float
    collective_timeout: float
    shutdown_timeout: float
    resume_unhealthy: bool
    max_restores: int | None
    #: the job's mean time between failures (seconds), or None for the default from the number of nodes
    mtbf: float | None
    #: the replica check's slices (the state is compared across ranks over this many snapshots), or None: off
    replica_check: int | None = 4
    on_replica_mismatch: str = "warn"
    #: the signal numbers the fit owns as a preemption notice (empty: Lightning's own handling)
    preemption_signals: tuple[int, ...] = (15,)

    @classmethod
    def create(
        cls,
        tiers: str | Backend | Sequence[str | Backend],
        *,
        resume: bool | int | str,
        on_error: str,
        max_host_bytes: int | None,
        chunk_bytes: int,
        sigterm_grace: float,
        collective_timeout: float,
        shutdown_timeout: float,
        resume_unhealthy: bool,
        max_restores: int | None,
        mtbf: float | str | None,
        replica_check: int | None = 4,
        on_replica_mismatch: str = "warn",
        preemption_signals: Any = DEFAULT_SIGNALS,
    ) -> SnapshotConfig:
        """Validate the callback's arguments (tier URLs are parsed into backends).

        Raises:
            ConfigError: naming the first option that is not valid and what it accepts.
        """
        if isinstance(tiers, (str, Backend)):
            tiers = [tiers]
        if not isinstance(tiers, Sequence) or not tiers:
            raise ConfigError(f"tiers must be a tier URL, a Backend or a non-empty list of them, got {tiers!r}")
        backends = tuple(parse_tier(t) for t in tiers)
        if sum(1 for t in backends if t.tier == "ram") > 1:
            raise ConfigError("SnapshotCallback takes at most one RAM tier (one agent per node and run)")
        if not isinstance(resume, (bool, int, str)) or (
            isinstance(resume, int) and not isinstance(resume, bool) and resume < 0
        ):
            raise ConfigError(f"resume must be True, False, a step number >= 0 or a snapshot path/URL, got {resume!r}")
        if on_error not in ON_ERROR:
            raise ConfigError(f"on_error must be one of {', '.join(map(repr, ON_ERROR))}, got {on_error!r}")
        if max_host_bytes is not None and not _positive_int(max_host_bytes):
            raise ConfigError(f"max_host_bytes must be a positive number of bytes or None, got {max_host_bytes!r}")
        if not _positive_int(chunk_bytes) or chunk_bytes < 64:
            raise ConfigError(f"chunk_bytes must be a number of bytes >= 64, got {chunk_bytes!r}")
        if isinstance(sigterm_grace, bool) or not isinstance(sigterm_grace, (int, float)) or sigterm_grace <= 0:
            raise ConfigError(f"sigterm_grace must be a positive number of seconds, got {sigterm_grace!r}")
        for option, value in (("collective_timeout", collective_timeout), ("shutdown_timeout", shutdown_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{option} must be a positive number of seconds, got {value!r}")
        if not isinstance(resume_unhealthy, bool):
            raise ConfigError(f"resume_unhealthy must be True or False, got {resume_unhealthy!r}")
        if max_restores is not None and not _positive_int(max_restores):
            raise ConfigError(
                f"max_restores must be an integer >= 1 (or None to never skip a snapshot the run keeps"
                f" crashing after), got {max_restores!r}"
            )
        if replica_check is not None and not _positive_int(replica_check):
            raise ConfigError(
                f"replica_check must be an integer >= 1 (the replicas are compared over that many snapshots; 1: all"
                f" of the state at every snapshot) or None to turn the check off, got {replica_check!r}"
            )
        if on_replica_mismatch not in ON_REPLICA_MISMATCH:
            raise ConfigError(
                f"on_replica_mismatch must be one of {', '.join(map(repr, ON_REPLICA_MISMATCH))}, got"
                f" {on_replica_mismatch!r}"
            )
        return cls(
            tiers=backends,
            resume=resume,
            on_error=on_error,
            max_host_bytes=max_host_bytes,
            chunk_bytes=chunk_bytes,
            sigterm_grace=float(sigterm_grace),
            collective_timeout=float(collective_timeout),
            shutdown_timeout=float(shutdown_timeout),
            resume_unhealthy=resume_unhealthy,
            max_restores=max_restores,
            mtbf=None if mtbf is None else parse_duration(mtbf, "mtbf"),
            replica_check=replica_check,
            on_replica_mismatch=on_replica_mismatch,
            preemption_signals=parse_signals(preemption_signals),
        )


def _positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1
