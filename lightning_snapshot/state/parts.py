"""Training state as registered parts: the interface, and the registry the engine iterates over.

Model: torchsnapshot's ``app_state`` of ``Stateful`` objects, DCP's ``Stateful`` protocol. A snapshot holds, besides
the model, the optimizers and Lightning's own checkpoint state (loops, schedulers, precision, datamodule: the
checkpoint-shaped core of :func:`~lightning_snapshot.state.capture.capture_late`), every other kind of state as a
:class:`Part`: a name, a capture, a restore, the :class:`Phase` at which the restore is applied, and whether the
state is per rank. The built-in parts (fit state, loader positions, RNG, callback states, ModelCheckpoint's record,
...) are registered in :mod:`lightning_snapshot.state.builtin`, in order; adding a kind of state is one
:meth:`Registry.register` call there (``docs/architecture.md``, "Adding a kind of state").

Where a part's state lives in a snapshot (the format is unchanged by this module: the built-in parts map onto the keys
snapshots always had):

* **per rank** (``per_rank=True``): at ``path`` (default ``(name,)``) of each rank's section (the state only that
  rank holds: its RNG, its data position). After a change of the number of processes it is not restored (the
  restore gets None), unless the part is ``resharded`` (then it gets rank 0's, and ``ctx.exact`` is False).
* **shared**: at ``path`` (default ``("lightning_snapshot", "fit_state", name)``) of the late state each rank stores
  in its section, next to Lightning's loops and schedulers; restored from this rank's own, or rank 0's after a change
  of the number of processes.
* **tensors** (``tensors=True``): state that is tensors (an averaged copy of the model, an EMA teacher) takes the
  weights' path: at ``path`` (default ``("tensor_parts", name)``) of the shared tensor state, beside ``state_dict``
  and ``optimizer_states``. It is captured with the weights (:meth:`Registry.capture_tensors`), staged into the host
  arena by the weights' stager (the tensors of ``stable`` in the background until the next ``optimizer.step``, the
  others at once), written once under DDP (each replicated tensor by one rank; the others by rank 0, as buffers),
  as each rank's shard where a tensor is a DTensor, replica-checked with the weights (the ``stable`` ones), and
  read back by the weights' loader straight into the live tensors the part's ``capture`` returns at restore
  (:meth:`Registry.tensor_targets`): resharded to this run's layout, whatever the world size it was saved with.

The engine: :meth:`Registry.capture` (the pipeline, at each snapshot, right before the next batch is fetched),
:meth:`Registry.restore` (the Restorer and the callback's hooks, at each phase). A part whose snapshot does not hold
it (an older snapshot) is restored with None: every restore treats None as "nothing stored". No I/O, no Lightning
here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from lightning_snapshot.dist.comm import Comm, LocalComm

__all__ = ["TENSOR_PARTS", "CaptureContext", "Part", "Phase", "Registry", "RestoreContext"]

#: keys of a rank's section the engine itself uses (no part may use them)
_RESERVED = ("late", "exact")
#: the key of the shared tensor state (beside ``state_dict`` and ``optimizer_states``) the tensor parts live under
TENSOR_PARTS = "tensor_parts"


class Phase(enum.Enum):
    """When a part's restore is applied, in the order a resumed fit reaches them."""

    #: at ``setup``, before any callback's ``on_fit_start``, from the snapshot about to be restored (as Lightning's own
    #: restore loads callback states); if another one is restored instead (that one failed to load), at its LOAD
    #: phase, after the callbacks' ``on_load_checkpoint``
    SETUP = "setup"
    #: on the snapshot as read, before anything is applied (a part may rewrite the shared state, or refuse it)
    READ = "read"
    #: right after the weights are loaded, before the callbacks' ``on_load_checkpoint`` (at ``on_fit_start``)
    LOAD = "load"
    #: once the checkpoint-shaped state is in (``on_fit_start``; every rank together: a part may be collective)
    LOADED = "loaded"
    #: at the end of ``on_fit_start``, before Lightning makes the train loaders
    FIT_START = "fit_start"
    #: at ``on_train_start`` (after every callback's ``on_fit_start``), before the loops are set to resume
    TRAIN_START = "train_start"
    #: at ``on_train_start``, once the loops are set to resume and the epoch's start schedulers are reinstated
    EPOCH = "epoch"
    #: right before the first batch is fetched, where the interrupted run took it; at an epoch boundary at
    #: ``on_train_start`` (the new epoch's iterators are made before that fetch)
    FIRST_FETCH = "first_fetch"


class CaptureContext:
    """What a part's capture sees, at the late capture point (right before the next batch is fetched, or between
    epochs; the training thread, every rank).

    Attributes:
        trainer, pl_module: the fit's.
        consumed: the batches of the current epoch consumed so far.
        epoch: the epoch the snapshot continues (one less when ``max_steps`` ended training inside an epoch).
        boundary: the snapshot ends an epoch (the next one starts from its beginning).
        token: the capture plan's token (it vouches for the module's structure while it holds), or None.
        memo: a dict kept for the whole fit (a part's caches, warn-once flags), shared by all parts.
        cache: a dict kept for this capture only (a walk of the module several parts use).
    """

    def __init__(
        self,
        trainer: Any,
        pl_module: Any,
        *,
        consumed: int,
        epoch: int,
        boundary: bool,
        token: object | None,
        memo: dict[str, Any],
    ) -> None:
        self.trainer = trainer
        self.pl_module = pl_module
        self.consumed = consumed
        self.epoch = epoch
        self.boundary = boundary
        self.token = token
        #: taken as a validation started (a preemption abandoned it: the resumed run validates again first)
        self.validation_pending = False
        self.memo = memo
        self.cache: dict[str, Any] = {}


@dataclass
class RestoreContext:
    """What a part's restore sees. The Restorer fills it when a snapshot is read; the callback adds the fit's own
    objects (``loaders``, ``patches``, ``hooked``) before ``FIT_START``.

    Attributes:
        trainer, pl_module: the fit's.
        step: the restored snapshot's step.
        where: names the snapshot in messages.
        comm: the trainer's collectives (a LOADED part may be collective: every rank calls it).
        shared: the shared state as read (a READ part may rewrite it).
        exact: the snapshot was taken with this number of processes (per-rank state is this rank's own).
        resumed: "boundary" (the snapshot ended an epoch) or "mid"; None before LOADED.
        owner: the SnapshotCallback (its own state is not a callback state to load).
        loaders: the fit's :class:`~lightning_snapshot.fit.loaders.FitLoaders`.
        patches: the fit's :class:`~lightning_snapshot.state.patches.Patches`.
        hooked: whether the trainer's loops run with the callback now (False while a tuner runs them).
        validation_pending: the snapshot was taken as a validation started: the resumed run validates first.
    """

    trainer: Any
    pl_module: Any
    step: int
    where: str
    comm: Comm = field(default_factory=LocalComm)
    shared: Any = None
    exact: bool = True
    resumed: str | None = None
    owner: Any = None
    loaders: Any = None
    patches: Any = None
    hooked: Callable[[], bool] = field(default=lambda: True)
    validation_pending: bool = False


@dataclass(frozen=True)
class Part:
    """One kind of training state.

    Args:
        name: unique among the registered parts.
        capture: ``capture(ctx)`` -> the state (tensors and plain values: see :mod:`~lightning_snapshot.format.tree`; no
            pickle), at every snapshot, on every rank. Views are fine: the engine stages them before training goes
            on.
        restore: ``restore(ctx, state)`` at ``phase``, on every rank; ``state`` is what ``capture`` returned (tensors
            on the CPU), or None where the snapshot holds none (taken before the part existed, or per rank after a
            change of the number of processes).
        phase: when the restore is applied (:class:`Phase`).
        per_rank: the state is this rank's own (see the module docstring).
        path: where it lives in a rank's section (per rank) or in the late state (shared); default from ``name``.
        resharded: (per rank) after a change of the number of processes, restore rank 0's state (``ctx.exact`` is
            False) instead of None.
        tensors: the state is tensors that take the weights' path (see the module docstring). ``capture`` then
            returns the *live* tensors (a tree of dicts and lists of tensors and plain values; no copies: the stager
            copies them), is called on the training thread at every snapshot and once at each restore (its tensors
            are the read's targets: ``ctx.consumed`` is 0 and ``ctx.boundary`` False there, and no capture may
            depend on them), and must be cheap and without side effects. Not per rank.
        stable: (tensors) ``stable(ctx)`` -> the captured tensors that do not change from the end of one
            ``optimizer.step`` until the next begins and are the same on every data-parallel rank (an EMA of the
            parameters): copied in the background, written by any one rank, compared across the ranks by the
            replica check. The part's other tensors are copied on the training thread and written by rank 0 (as
            the model's buffers). None: all of them are.
        hooks: (tensors) ``hooks(callback)`` -> the key of the part's state that stands for that callback's
            ``on_save_checkpoint``/``on_load_checkpoint`` (its tensors are in the part, not copied into the late
            state), or None. At a restore the callback's ``on_load_checkpoint`` is then not called when the part's
            state holds that key (the part's restore does what it would); a snapshot without it (an older one)
            calls it as before.
    """

    name: str
    capture: Callable[[CaptureContext], Any]
    restore: Callable[[RestoreContext, Any], object]
    phase: Phase
    per_rank: bool = False
    path: tuple[str, ...] = ()
    resharded: bool = False
    tensors: bool = False
    stable: Callable[[CaptureContext], Iterable[Any]] | None = None
    hooks: Callable[[Any], str | None] | None = None

    def __post_init__(self) -> None:
        if self.tensors and self.per_rank:
            raise ValueError(
                f"state part {self.name!r}: tensors=True takes the weights' path, which is shared, not per rank;"
                " pass per_rank=False, or capture per-rank tensors as a per-rank part without tensors=True"
            )
        if (self.stable is not None or self.hooks is not None) and not self.tensors:
            raise ValueError(f"state part {self.name!r}: stable= and hooks= apply to tensors=True parts only")
        if not self.path:
            if self.tensors:
                path: tuple[str, ...] = (TENSOR_PARTS, self.name)
            else:
                path = (self.name,) if self.per_rank else ("lightning_snapshot", "fit_state", self.name)
            object.__setattr__(self, "path", path)
        if self.per_rank and self.path[0] in _RESERVED:
            raise ValueError(f"state part {self.name!r}: a rank's section reserves {self.path[0]!r}")
        if self.tensors and self.path[0] != TENSOR_PARTS:
            raise ValueError(
                f"state part {self.name!r}: a tensors=True part lives under {TENSOR_PARTS!r} of the shared tensor"
                f" state; its path must start with it, not {self.path[0]!r}"
            )


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, dict):
            return None
        tree = tree.get(key)
    return tree


def _put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


class Registry:
    """The registered parts, in order: captured in that order (the shared ones inside the late state, then the per-rank
    ones), and restored in that order within each phase."""

    def __init__(self) -> None:
        self._parts: list[Part] = []

    def register(self, part: Part) -> Part:
        """Add ``part`` (after the ones registered before it). Raises ValueError when its name or place is taken."""
        for other in self._parts:
            if other.name == part.name or (other.per_rank == part.per_rank and other.path == part.path):
                raise ValueError(f"a state part named {other.name!r} is registered at {'/'.join(other.path)} already")
        self._parts.append(part)
        return part

    def unregister(self, name: str) -> None:
        """Remove the part named ``name`` (a test's own part); nothing if none is."""
        self._parts = [p for p in self._parts if p.name != name]

    def __iter__(self) -> Iterator[Part]:
        return iter(list(self._parts))

    def at(self, phase: Phase) -> list[Part]:
        return [p for p in self._parts if p.phase is phase]

    def capture_shared(self, ctx: CaptureContext, late: dict[str, Any]) -> None:
        """Capture the shared parts into ``late`` (the late state, as :func:`capture_late` builds it)."""
        for part in self._parts:
            if not part.per_rank and not part.tensors:
                _put(late, part.path, part.capture(ctx))

    def capture(self, ctx: CaptureContext, late: Callable[[Callable[[dict[str, Any]], None]], dict[str, Any]]) -> Any:
        """A rank's section of a snapshot: ``late(fill)`` makes the late state (``fill`` captures the shared parts
        into it), then the per-rank parts are captured (after the checkpoint hooks ``late`` runs: the RNG as they
        left it). Keys in registration order, the late state where the first shared part is registered."""
        core = late(lambda into: self.capture_shared(ctx, into))
        values = [(p, p.capture(ctx)) for p in self._parts if p.per_rank]
        section: dict[str, Any] = {}
        captured = iter(values)
        for part in self._parts:
            if part.per_rank:
                _, value = next(captured)
                _put(section, part.path, value)
            elif "late" not in section and not part.tensors:
                section["late"] = core
        section.setdefault("late", core)
        return section

    def capture_tensors(self, ctx: CaptureContext) -> tuple[dict[str, Any], list[Any]]:
        """The tensor parts' live state, as the tree they add to the shared tensor state (``{TENSOR_PARTS: {...}}``;
        empty when no part captured anything), and their ``stable`` tensors (see :class:`Part`). Training thread,
        every rank, at each snapshot (and at a restore, for the read's targets)."""
        tree: dict[str, Any] = {}
        stable: list[Any] = []
        for part in self._parts:
            if not part.tensors:
                continue
            value = part.capture(ctx)
            if value is None:
                continue
            _put(tree, part.path, value)
            if part.stable is not None:
                stable.extend(part.stable(ctx))
        return tree, stable

    def replaces_hooks(self, callback: Any, shared: Any = None) -> bool:
        """Whether a tensor part stands for ``callback``'s checkpoint hooks (see :class:`Part`): at a snapshot
        (``shared`` None), whether one claims it; at a restore, whether the snapshot's ``shared`` state holds that
        part's state for it."""
        for part in self._parts:
            if part.hooks is None:
                continue
            key = part.hooks(callback)
            if key is None:
                continue
            if shared is None:
                return True
            state = _get(shared, part.path)
            if isinstance(state, dict) and key in state:
                return True
        return False

    def resized(self, saved: Any) -> dict[str, Any] | None:
        """The section a rank restores after a change of the number of processes, from rank 0's ``saved``: the late
        state and the ``resharded`` per-rank parts (the others: none)."""
        if not isinstance(saved, dict):
            return None
        section: dict[str, Any] = {"exact": False, "late": saved.get("late")}
        for part in self._parts:
            if part.per_rank and part.resharded:
                _put(section, part.path, _get(saved, part.path))
        return section

    def extract(self, phases: tuple[Phase, ...], shared: Any, section: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """Only the states of the parts of ``phases``, as (shared, section): what a restore keeps for its later
        phases (not the weights and optimizer state it read)."""
        kept: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
        for part in self._parts:
            if part.phase in phases:
                value = _get(section if part.per_rank else shared, part.path)
                if value is not None:
                    _put(kept[1] if part.per_rank else kept[0], part.path, value)
        return kept

    def restore(self, phase: Phase, ctx: RestoreContext, shared: Any, section: Any) -> None:
        """Apply the parts of ``phase``: each gets its state from ``section`` (per rank: this rank's section) or
        ``shared`` (the shared state, the late state merged in), or None."""
        for part in self.at(phase):
            part.restore(ctx, _get(section if part.per_rank else shared, part.path))
