"""How ranks agree on an outcome: one rank's failure is every rank's error, naming the rank (after DCP's
``_DistWrapper``), over any :class:`~lightning_snapshot.dist.comm.Comm`.

:func:`agree_on` is the general form (a step run on every rank, flags, a gathered value); the named forms say what
they exchange:

- :func:`broadcast`: one rank computes a value, every rank gets it; if that rank's computation raised, every rank
  raises (the source rank its own error, the others an error naming the source rank and its problem).
- :func:`all_gather`: every rank computes a value, every rank gets all of them; if some rank's computation raised,
  every rank raises, naming the ranks that failed.

Nothing here waits for a peer's failure by a timeout: a rank that fails still takes part in the exchange. Used on
the training thread (the session, the pipeline, the restore, the reporting), by the persist threads over their
tier's group, and by the tiers' collective steps (listing a node-local tier, a node-to-node restore).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast, overload

from lightning_snapshot.dist.comm import Comm, TensorComm

__all__ = [
    "PROBLEM_CHARS",
    "Agreed",
    "agree_on",
    "all_gather",
    "broadcast",
    "problem_text",
    "waiting_failed",
]

log = logging.getLogger(__name__)


def _joined(comm: Comm, problems: list[str | None]) -> str:
    """Every rank's problem (None: none), each prefixed with the ranks that have it under several processes (the same
    problem on several ranks said once), joined into one text."""
    ranks: dict[str, list[int]] = {}
    for rank, p in enumerate(problems):
        if p:
            ranks.setdefault(p, []).append(rank)
    return "; ".join(
        p if comm.world_size == 1 else f"on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {p}"
        for p, r in ranks.items()
    )


#: The longest text of one rank's problem sent to the other ranks (a listing or a traceback in a message is cut).
PROBLEM_CHARS = 2000

T = TypeVar("T")


def problem_text(error: BaseException | str | None) -> str | None:
    if error is None:
        return None
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return text if len(text) <= PROBLEM_CHARS else text[: PROBLEM_CHARS - 3] + "..."


@dataclass
class Agreed(Generic[T]):
    """What :func:`agree_on` agreed, on this rank: the same on every rank but ``value``, ``values`` aside.

    Attributes:
        value: what ``fn`` returned on this rank (None where it raised, or without ``fn``).
        flags: each extra flag given, true iff it is true on every rank.
        values: with ``gather=True``, every rank's ``value`` in rank order (on every rank); else None.
        failed: the ranks whose ``fn`` raised (or that gave an ``error``), in order; empty when none did.
        text: the failed ranks' problems, "on rank 1: OSError: ..." (the same on every rank); "" when none failed.
        error: None when no rank failed; else what this rank raises (:meth:`result`): its own error, or, on a rank
            that did not fail, a ``failed`` error that says ``elsewhere`` and ``text`` (so it names the rank).
    """

    value: T | None = None
    flags: list[bool] = field(default_factory=list)
    values: list[Any] | None = None
    failed: list[int] = field(default_factory=list)
    text: str = ""
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return not self.failed

    def flags_or_raise(self) -> list[bool]:
        """``flags``, or raise ``error`` (on every rank together)."""
        if self.error is not None:
            raise self.error
        return self.flags

    def result(self) -> T | None:
        """``value``, or raise ``error`` (on every rank together: each rank's :class:`Agreed` has one)."""
        if self.error is not None:
            raise self.error
        return self.value


def waiting_failed(comm: Comm, what: str, error: BaseException, kind: type[BaseException]) -> BaseException:
    """The error of a rank whose collective on ``what`` failed (a peer died, the group's timeout ran out)."""
    return kind(
        f"rank {comm.rank}: waiting for the other ranks to agree on {what} failed ({type(error).__name__}: {error}):"
        " another rank failed, exited or is stuck (see its log)"
    )


@overload
def agree_on(
    comm: Comm,
    what: str,
    fn: None = ...,
    *,
    error: BaseException | str | None = ...,
    flags: Sequence[bool] = ...,
    catch: type[BaseException] | tuple[type[BaseException], ...] = ...,
    elsewhere: str | None = ...,
    failed: type[BaseException] | None = ...,
    gather: bool = ...,
    on_failure: Callable[[], None] | None = ...,
    translate: bool = ...,
) -> Agreed[None]: ...


@overload
def agree_on(
    comm: Comm,
    what: str,
    fn: Callable[[], T],
    *,
    error: BaseException | str | None = ...,
    flags: Sequence[bool] = ...,
    catch: type[BaseException] | tuple[type[BaseException], ...] = ...,
    elsewhere: str | None = ...,
    failed: type[BaseException] | None = ...,
    gather: bool = ...,
    on_failure: Callable[[], None] | None = ...,
    translate: bool = ...,
) -> Agreed[T]: ...


def agree_on(
    comm: Comm,
    what: str,
    fn: Callable[[], T] | None = None,
    *,
    error: BaseException | str | None = None,
    flags: Sequence[bool] = (),
    catch: type[BaseException] | tuple[type[BaseException], ...] = Exception,
    elsewhere: str | None = None,
    failed: type[BaseException] | None = None,
    gather: bool = False,
    on_failure: Callable[[], None] | None = None,
    translate: bool = False,
) -> Agreed[T]:
    """The one way ranks agree on an outcome (after DCP's ``_DistWrapper``): collective, called by every rank at the
    same point with the same ``what`` and as many ``flags``.

    Runs ``fn`` here (an exception of ``catch`` is this rank's failure, as is a given ``error``: an exception, or a
    problem's text), then one collective tells every rank whether some rank failed, and each extra flag's
    all-true; with ``gather=True``, every rank's value too (the same collective). Only when some rank failed, a
    second exchange gives every rank the same text naming the ranks that failed and their problems. No rank learns
    of a peer's failure by a timeout.

    Args:
        what: the step, named in the errors ("writing the data of the snapshot of step 7 in the local tier ...").
        elsewhere: the message of the error of the ranks that did not fail (followed by ``text``); default
            "``what`` failed on another rank (see its log)".
        failed: the type of that error (default :class:`~lightning_snapshot.errors.SnapshotError`), also of the
            error that says the collective itself failed (a peer died, the group's timeout ran out).
        on_failure: called on every rank (best effort: an exception of its own is logged) when some rank failed,
            before the errors are raised (clean-up of what the failed step left).
        translate: an exception of the collective itself (a peer died, the group's timeout ran out) is raised as a
            ``failed`` error naming this rank and ``what``; False (the default): as it is.

    Returns:
        What was agreed; :meth:`Agreed.result` raises the agreed failure. It does not raise itself, except when the
        collective fails.
    """
    from lightning_snapshot.errors import SnapshotError

    kind = failed or SnapshotError
    value: T | None = None
    if fn is not None and error is None:
        try:
            value = fn()
        except catch as e:
            error = e
    mine = problem_text(error)
    try:
        if gather:
            entry = (value, mine, [bool(f) for f in flags])
            # (gather=True: a TensorComm, a tier's group)
            seen = cast("TensorComm", comm).all_gather(entry) if comm.world_size > 1 else [entry]
            problems: list[str | None] | None = [p for _, p, _ in seen]
            values: list[Any] | None = [v for v, _, _ in seen]
            agreed = [all(f) for f in zip(*(fs for _, _, fs in seen), strict=True)] if flags else []
            no_failure = not any(problems or ())
        else:
            values, problems = None, None
            no_failure, *agreed = comm.all_true_each([mine is None, *flags])
        if no_failure:
            return Agreed(value, agreed, values)
        if problems is None:  # (the failure path only: every rank knows by now that some rank failed)
            gathered = comm.gather(mine)
            problems = comm.broadcast(list(gathered) if gathered is not None else None)
    except Exception as e:
        if not translate:
            raise
        raise waiting_failed(comm, what, e, kind) from e
    assert problems is not None
    text = _joined(comm, problems)
    if on_failure is not None:
        try:
            on_failure()
        except Exception as e:  # noqa: BLE001 - best effort: the failure itself is what is raised
            log.debug("lightning-snapshot: cleaning up after %s failed: %s", what, e)
    if isinstance(error, BaseException):
        own: BaseException = error
    else:
        lead = error if error is not None else (elsewhere or f"{what} failed on another rank (see its log)")
        own = kind(f"{lead}: {text}" if error is None else lead)
    return Agreed(value, agreed, values, [r for r, p in enumerate(problems) if p], text, own)


def broadcast(
    comm: Comm,
    what: str,
    fn: Callable[[], T],
    *,
    src: int = 0,
    failed: type[BaseException] | None = None,
    catch: type[BaseException] | tuple[type[BaseException], ...] = Exception,
) -> T:
    """Rank ``src`` runs ``fn`` and every rank gets its value (collective: every rank calls it at the same point with
    the same ``what`` and ``src``; ``fn`` runs on ``src`` only).

    Raises:
        BaseException: on rank ``src``, what ``fn`` raised (an exception of ``catch``); on every other rank at the
            same time, a ``failed`` error (default :class:`~lightning_snapshot.errors.SnapshotError`) that says
            ``what`` failed on rank ``src`` and why. Also a ``failed`` error naming this rank and ``what`` when the
            exchange itself fails (a peer died, the group's timeout ran out).
    """
    from lightning_snapshot.errors import SnapshotError

    kind = failed or SnapshotError
    value: T | None = None
    error: BaseException | None = None
    if comm.rank == src:
        try:
            value = fn()
        except catch as e:
            error = e
    if comm.world_size > 1:
        try:
            value, problem = comm.broadcast((value, problem_text(error)), src=src)
        except Exception as e:
            raise waiting_failed(comm, what, e, kind) from e
    else:
        problem = problem_text(error)
    if error is not None:
        raise error
    if problem is not None:
        raise kind(f"{what} failed on rank {src}: {problem}")
    return cast("T", value)


def all_gather(
    comm: TensorComm,
    what: str,
    fn: Callable[[], T],
    *,
    failed: type[BaseException] | None = None,
    catch: type[BaseException] | tuple[type[BaseException], ...] = Exception,
) -> list[T]:
    """Every rank runs ``fn`` and gets every rank's value, in rank order (collective, over a
    :class:`~lightning_snapshot.dist.comm.TensorComm`: a tier's own group, or one process).

    Raises:
        BaseException: when ``fn`` raised on some rank, on every rank at the same time: that rank its own error, the
            others a ``failed`` error (default :class:`~lightning_snapshot.errors.SnapshotError`) naming the ranks
            that failed and their problems (as :func:`agree_on` does).
    """
    agreed = agree_on(comm, what, fn, catch=catch, failed=failed, gather=True, translate=True)
    agreed.result()
    assert agreed.values is not None  # (gather=True: every rank's value)
    return cast("list[T]", agreed.values)
