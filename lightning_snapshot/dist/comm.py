"""The few collectives the engine needs, over the trainer's strategy, a tier's own gloo group or a single process;
:func:`agree_on`: the one way ranks agree on an outcome (one rank's failure is every rank's error, naming it).

Used by session.py (which makes the fit's comms and the tiers' gloo groups), pipeline.py, restore.py and
reporting.py on the training thread; by the persist threads (persist.py, writer.py) to agree on each commit over
their tier's group (:class:`GroupComm`); and by ops.py (:class:`LocalComm`, for the CLI). The trainer's strategy
(:class:`StrategyComm`) is only called from the training thread, at points every rank reaches together.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, cast, overload, runtime_checkable

__all__ = [
    "Agreed",
    "Comm",
    "GroupComm",
    "LocalComm",
    "Pending",
    "StrategyComm",
    "TensorComm",
    "agree_on",
    "new_gloo_groups",
    "problem_text",
    "wait_as_long_as",
    "waiting_failed",
]

log = logging.getLogger(__name__)


class Pending(Protocol):
    """A collective started and not yet waited for (:meth:`Comm.all_max_start`)."""

    def result(self) -> int: ...


class _Ready:
    """A :class:`Pending` whose result is known already (one process)."""

    def __init__(self, value: int) -> None:
        self.value = int(value)

    def result(self) -> int:
        return self.value


class _Started:
    """A gloo all-reduce in flight and the tensor it reduces into."""

    def __init__(self, work: Any, box: Any) -> None:
        self.work, self.box = work, box

    def result(self) -> int:
        self.work.wait()
        return int(self.box[0])


class Comm(Protocol):
    rank: int
    world_size: int

    def barrier(self) -> None: ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (small, plain values only)."""

    def all_true(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is true on every rank."""

    def all_true_each(self, flags: list[bool]) -> list[bool]:
        """Element-wise :meth:`all_true` of equally long lists, in one collective."""

    def all_max(self, value: int) -> int:
        """The largest of every rank's ``value`` (an int32), on every rank; one collective of a small tensor."""

    def all_max_start(self, value: int) -> Pending:
        """:meth:`all_max`, started without waiting for it (the preemption agreement, once per training step, reads
        it a step later): its ``result()`` waits. Every rank starts the same ones in the same order."""

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (small, plain values), in rank order, on rank 0; None on the others."""

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (int64, equally long on every rank), in rank order, on every rank; one collective
        of a tensor (nothing pickled)."""


@runtime_checkable
class TensorComm(Comm, Protocol):
    """A :class:`Comm` that also moves tensors (a restore's read-once transfers, :mod:`~lightning_snapshot.restore.read_once`):
    :class:`GroupComm` over a tier's gloo group. Ranks are the group's."""

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (small, plain values), in rank order, on every rank."""

    def broadcast_tensor(self, tensor: Any, src: int) -> None:
        """Rank ``src``'s ``tensor`` (contiguous, CPU) into ``tensor`` on every rank."""

    def send_tensor(self, tensor: Any, dst: int) -> None:
        """Send ``tensor`` to rank ``dst`` (blocking), which receives it with :meth:`recv_tensor`."""

    def recv_tensor(self, tensor: Any, src: int) -> None:
        """Receive into ``tensor`` what rank ``src`` sends with :meth:`send_tensor` (blocking)."""


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


class LocalComm:
    """One process, no process group."""

    rank = 0
    world_size = 1

    def barrier(self) -> None:
        pass

    def broadcast(self, obj: Any) -> Any:
        return obj

    def all_true(self, flag: bool) -> bool:
        return bool(flag)

    def all_true_each(self, flags: list[bool]) -> list[bool]:
        return [bool(f) for f in flags]

    def all_max(self, value: int) -> int:
        return int(value)

    def all_max_start(self, value: int) -> Pending:
        return _Ready(value)

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return [list(values)]


class StrategyComm:
    """Collectives through a Lightning strategy's public API (gloo or nccl, whatever the run uses)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.rank = int(strategy.global_rank)
        self.world_size = int(strategy.world_size)

    def barrier(self) -> None:
        self.strategy.barrier("lightning_snapshot")

    def broadcast(self, obj: Any) -> Any:
        return self.strategy.broadcast(obj, src=0)

    def all_true(self, flag: bool) -> bool:
        return bool(self.strategy.reduce_boolean_decision(bool(flag), all=True))

    def all_true_each(self, flags: list[bool]) -> list[bool]:
        if not flags:
            return []
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=self.strategy.root_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return [bool(v) for v in t.tolist()]

    def all_max(self, value: int) -> int:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int32, device=self.strategy.root_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def all_max_start(self, value: int) -> Pending:
        return _Ready(self.all_max(value))  # (the trainer's group may be NCCL: not used for this per step)

    def gather(self, obj: Any) -> list[Any] | None:
        import torch.distributed as dist

        box: list[Any] = [None] * self.world_size
        dist.all_gather_object(box, obj)
        return box if self.rank == 0 else None

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64, device=self.strategy.root_device)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t)
        return [o.tolist() for o in out]


class GroupComm:
    """:class:`~lightning_snapshot.dist.comm.Comm` over a dedicated torch.distributed group (used by a persist thread)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_true(self, flag: bool) -> bool:
        return self.all_true_each([flag])[0]

    def all_true_each(self, flags: list[bool]) -> list[bool]:
        import torch

        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group)
        return [bool(v) for v in t.tolist()]

    def all_max(self, value: int) -> int:
        return self.all_max_start(value).result()

    def all_max_start(self, value: int) -> Pending:
        import torch

        box = torch.tensor([value], dtype=torch.int32)
        work = self._dist.all_reduce(box, op=self._dist.ReduceOp.MAX, group=self.group, async_op=True)
        return _Started(work, box)

    def gather(self, obj: Any) -> list[Any] | None:
        box: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self._dist.gather_object(obj, box, dst=self._dist.get_global_rank(self.group, 0), group=self.group)
        return box

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on every rank, in rank order."""
        box: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(box, obj, group=self.group)
        return box

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        import torch

        t = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._dist.all_gather(out, t, group=self.group)
        return [o.tolist() for o in out]

    def broadcast_tensor(self, tensor: Any, src: int) -> None:
        self._dist.broadcast(tensor, src=self._dist.get_global_rank(self.group, src), group=self.group)

    def send_tensor(self, tensor: Any, dst: int) -> None:
        self._dist.send(tensor, dst=self._dist.get_global_rank(self.group, dst), group=self.group)

    def recv_tensor(self, tensor: Any, src: int) -> None:
        self._dist.recv(tensor, src=self._dist.get_global_rank(self.group, src), group=self.group)


#: The keys under which gloo publishes a rank's address while a group connects (``<group>/cpu//<n>/<rank>``, under
#: the default group's prefix): read once, while the group forms.
_GLOO_ADDRESS_KEY = re.compile(r"^default_pg/.*cpu//\d+/\d+$")


def new_gloo_groups(names: list[str], timeout: datetime.timedelta, nonce: str) -> list[Any]:
    """A new gloo process group of every rank per entry of ``names`` (collective: every rank calls it at the same
    point, with the same ``nonce``: a random hex string agreed over the default group), whose rendezvous keys no
    earlier attempt of the job used.

    ``dist.new_group`` names a group by a counter that starts again in every process, and under torchrun the
    relaunched processes of an attempt share the rendezvous store with the attempts before (the store torchrun's
    agent hosts): a relaunched rank could read the address its peer published there before it died, a port nobody
    listens on any more, and fail, or hang until gloo gives up. The groups are named from ``nonce`` instead. Once
    they (and the default group) are connected, rank 0 also removes the gloo addresses published in that shared
    store, so that a later attempt's groups, the trainer's default group included, cannot read them either.

    Raises:
        SnapshotError: a group did not form within ``timeout``; the message names it (``names``) and what to do.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from lightning_snapshot.errors import SnapshotError

    world: Any = getattr(c10d, "_world", None)
    named = world is not None and isinstance(getattr(world, "group_count", None), int)
    saved = world.group_count if named else 0
    groups = []
    try:
        if named:  # (a torch that names groups otherwise keeps its own names)
            world.group_count = (1 << 62) + (int(nonce, 16) % (1 << 52)) * 1024
        for name in names:
            try:
                group = dist.new_group(backend="gloo", timeout=timeout)
                dist.barrier(group=group)
            except RuntimeError as e:
                raise SnapshotError(
                    f"rank {dist.get_rank()} could not form the process group of {name} within"
                    f" {timeout.total_seconds():g} s (collective_timeout): {e}. Another rank may have failed"
                    " before it (see its log), or cannot reach this one (firewall, MASTER_ADDR). Under torchrun,"
                    " launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so that every restart gets a fresh"
                    " rendezvous store"
                ) from e
            groups.append(group)
    finally:
        if named:
            world.group_count = saved
    dist.barrier()
    if dist.get_rank() == 0:
        _forget_gloo_addresses(timeout)
    return groups


def wait_as_long_as(group: Any, timeout: datetime.timedelta) -> None:
    """Make the collectives of ``group`` (formed within ``collective_timeout``) wait for a peer as long as
    ``timeout``: the trainer's own process-group timeout (Lightning's ``timeout=``, 30 min by default). The
    preemption agreement's group carries an all-reduce every training step, so a rank that reaches a step boundary
    later than the others (work only rank 0 does, such as an evaluation in a rank-zero callback) must not fail it
    any sooner than the training's own collectives would fail. A peer that died still fails it at once."""
    setter = getattr(group, "set_timeout", None)
    if setter is None:  # (an older torch without it: the group keeps collective_timeout)
        log.debug("lightning-snapshot: the preemption agreement keeps its group's timeout (no set_timeout)")
        return
    setter(timeout)


def _forget_gloo_addresses(timeout: datetime.timedelta) -> None:
    """Under torchrun's shared rendezvous store, delete the gloo addresses published there (every group of every
    rank has connected: nothing reads them any more), so a relaunched attempt never connects to a dead port."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return
    if os.environ.get("TORCH_GLOO_LAZY_INIT", "0").lower() not in ("0", "false", ""):
        return  # (lazily connected pairs read their peer's address at their first collective: keep them)
    try:
        import torch.distributed as dist

        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        for key in store.list_keys():
            if _GLOO_ADDRESS_KEY.match(key):
                store.delete_key(key)
    except Exception as e:  # noqa: BLE001 - an older torch (no list_keys), or no store: only a later restart may race
        log.debug("lightning-snapshot: could not clear the gloo addresses of the rendezvous store: %s", e)
