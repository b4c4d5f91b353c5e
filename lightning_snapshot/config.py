"""The callback's configuration: one frozen object, validated once when :class:`SnapshotCallback` is made.

Every option is declared once, here: a field of :class:`SnapshotConfig` made by :func:`option`, which holds the value
a user gets by default and the check that validates (and normalises) what a user gives. From these declarations come
:meth:`SnapshotConfig.create` (defaults and validation), the callback's option attributes (read, and set between
fits) and the test that holds ``SnapshotCallback.__init__``'s explicit signature (which type checkers and LightningCLI
read) and the documentation (the callback's docstring, ``docs/configuration.md``) to them. Adding an option: a field
here, its keyword in ``SnapshotCallback.__init__`` and its line in both docs (``tests/unit/test_config.py`` fails until
all agree).

Called by ``SnapshotCallback.__init__`` only; every other part reads the result. Each error message names the option
and what it accepts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_snapshot.backends.base import Backend, NodeAgentHosting
from lightning_snapshot.backends.registry import parse_tier
from lightning_snapshot.dist.preempt import DEFAULT_SIGNALS, parse_signals
from lightning_snapshot.errors import ConfigError
from lightning_snapshot.schedule.interval import parse_duration
from lightning_snapshot.schedule.schedules import TierSchedule

__all__ = ["ON_ERROR", "ON_REPLICA_MISMATCH", "REQUIRED", "SnapshotConfig", "option"]

#: The values ``on_error`` takes.
ON_ERROR = ("raise", "warn")
#: The values ``on_replica_mismatch`` takes (see :mod:`lightning_snapshot.fit.replicas`).
ON_REPLICA_MISMATCH = ("warn", "raise", "skip")
#: The default of an option without one (``tiers``).
REQUIRED: Any = dataclasses.MISSING


def option(default: Any, check: Callable[[Any], Any], *, settable: bool = True) -> Any:
    """Declare one option of the callback (a field of :class:`SnapshotConfig`).

    Args:
        default: the value of the callback's keyword when not given (as a user writes it; :data:`REQUIRED`: none).
        check: the given value -> the value held; raises ``ConfigError`` naming the option and what it accepts.
        settable: whether the callback's attribute may be set between fits (a new configuration, checked again).
    """
    return dataclasses.field(metadata={"default": default, "check": check, "settable": settable})


def _positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _tiers(tiers: Any) -> tuple[Backend, ...]:
    if isinstance(tiers, (str, Backend)):
        tiers = [tiers]
    if not isinstance(tiers, Sequence) or not tiers:
        raise ConfigError(f"tiers must be a tier URL, a Backend or a non-empty list of them, got {tiers!r}")
    backends = tuple(parse_tier(t) for t in tiers)
    if sum(1 for t in backends if isinstance(t, NodeAgentHosting)) > 1:
        raise ConfigError("SnapshotCallback takes at most one RAM tier (one agent per node and run)")
    return backends


def _resume(resume: Any) -> bool | int | str:
    if not isinstance(resume, (bool, int, str)) or (
        isinstance(resume, int) and not isinstance(resume, bool) and resume < 0
    ):
        raise ConfigError(f"resume must be True, False, a step number >= 0 or a snapshot path/URL, got {resume!r}")
    return resume


def _one_of(name: str, values: tuple[str, ...]) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in values:
            raise ConfigError(f"{name} must be one of {', '.join(map(repr, values))}, got {value!r}")
        return str(value)

    return check


def _max_host_bytes(value: Any) -> int | None:
    if value is not None and not _positive_int(value):
        raise ConfigError(f"max_host_bytes must be a positive number of bytes or None, got {value!r}")
    return value


def _chunk_bytes(value: Any) -> int:
    if not _positive_int(value) or value < 64:
        raise ConfigError(f"chunk_bytes must be a number of bytes >= 64, got {value!r}")
    return int(value)


def _seconds(name: str) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        return float(value)

    return check


def _resume_unhealthy(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"resume_unhealthy must be True or False, got {value!r}")
    return value


def _max_restores(value: Any) -> int | None:
    if value is not None and not _positive_int(value):
        raise ConfigError(
            f"max_restores must be an integer >= 1 (or None to never skip a snapshot the run keeps"
            f" crashing after), got {value!r}"
        )
    return value


def _mtbf(value: Any) -> float | None:
    return None if value is None else parse_duration(value, "mtbf")


def _replica_check(value: Any) -> int | None:
    if value is not None and not _positive_int(value):
        raise ConfigError(
            f"replica_check must be an integer >= 1 (the replicas are compared over that many snapshots; 1: all"
            f" of the state at every snapshot) or None to turn the check off, got {value!r}"
        )
    return value


@dataclass(frozen=True)
class SnapshotConfig:
    """What :class:`~lightning_snapshot.callback.SnapshotCallback` was asked to do (see its arguments): one field
    per option, in the order of the callback's keywords, each declared with :func:`option`."""

    tiers: tuple[Backend, ...] = option(REQUIRED, _tiers, settable=False)
    resume: bool | int | str = option(True, _resume)
    on_error: str = option("raise", _one_of("on_error", ON_ERROR))
    max_host_bytes: int | None = option(None, _max_host_bytes)
    chunk_bytes: int = option(8 << 20, _chunk_bytes)
    sigterm_grace: float = option(25.0, _seconds("sigterm_grace"))
    collective_timeout: float = option(300.0, _seconds("collective_timeout"))
    shutdown_timeout: float = option(30.0, _seconds("shutdown_timeout"))
    resume_unhealthy: bool = option(False, _resume_unhealthy)
    max_restores: int | None = option(3, _max_restores)
    #: the job's mean time between failures (seconds), or None for the default from the number of nodes
    mtbf: float | None = option(None, _mtbf)
    #: the replica check's slices (the state is compared across ranks over this many snapshots), or None: off
    replica_check: int | None = option(4, _replica_check)
    on_replica_mismatch: str = option("warn", _one_of("on_replica_mismatch", ON_REPLICA_MISMATCH))
    #: the signal numbers the fit owns as a preemption notice (empty: Lightning's own handling)
    preemption_signals: tuple[int, ...] = option(DEFAULT_SIGNALS, parse_signals)
    #: not an option: each tier's schedule, built from the tier's options (:attr:`Backend.schedule_options`); it holds
    #: the interval in use, which ``every_n_train_steps="auto"`` re-estimates, from one fit of the callback to the next
    schedules: tuple[TierSchedule, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedules", tuple(TierSchedule.of(t.schedule_options) for t in self.tiers))

    @classmethod
    def options(cls) -> tuple[dataclasses.Field[Any], ...]:
        """The declared options, in order (each field's ``metadata`` holds its default, check and settable)."""
        return tuple(f for f in dataclasses.fields(cls) if "check" in f.metadata)

    @classmethod
    def create(cls, tiers: Any = REQUIRED, **options: Any) -> SnapshotConfig:
        """Validate the callback's arguments (tier URLs are parsed into backends); an option not given takes its
        declared default.

        Raises:
            ConfigError: naming the first option that is not valid and what it accepts.
            TypeError: an option that is not declared, or no ``tiers``.
        """
        given = {"tiers": tiers, **options}
        unknown = sorted(set(given) - {f.name for f in cls.options()})
        if unknown:
            raise TypeError(f"SnapshotConfig.create() got unexpected options {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for f in cls.options():
            value = given.get(f.name, REQUIRED)
            if value is REQUIRED:
                value = f.metadata["default"]
            if value is REQUIRED:
                raise TypeError(f"SnapshotConfig.create() needs {f.name}")
            values[f.name] = f.metadata["check"](value)
        return cls(**values)

    def replace(self, **changes: Any) -> SnapshotConfig:
        """This configuration with some options changed, validated as in :meth:`create` (the tiers, which cannot
        change, keep their schedules)."""
        config = self.create(**{**self.given(), **changes})
        if config.tiers == self.tiers:
            object.__setattr__(config, "schedules", self.schedules)
        return config

    def given(self) -> dict[str, Any]:
        """The options as :meth:`create` takes them (they validate again to this configuration)."""
        return {f.name: getattr(self, f.name) for f in self.options()}

    @classmethod
    def pick(cls, namespace: Mapping[str, Any]) -> dict[str, Any]:
        """The options in ``namespace`` (``SnapshotCallback.__init__``'s ``locals()``: its keywords are the options)."""
        return {f.name: namespace[f.name] for f in cls.options() if f.name in namespace}
