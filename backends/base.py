"""The backend interface every tier implements: small, byte-oriented, key/value.

Implemented by local.py, object_store.py and ram/tier.py. The engine calls tiers only through it: config.py,
session.py (checks, set-up), writer.py and persist.py (write, commit, retention), restore.py and loader.py (read),
reporting.py, ops.py and export.py, and the RAM tier's agent when it writes the durable tiers.

A backend stores opaque objects under '/'-separated keys relative to its root and knows nothing about tensors or
manifests: where a tier needs to know which objects a step's restore reads (a node-local tier fetching what a node
lacks), the engine tells it, as a :data:`NeededObjects` function of the manifest's bytes returning :class:`StepObject`
entries (key, size, writer rank). The collectives a tier takes part in run over a
:class:`~lightning_snapshot.dist.comm.Comm` (a tier's own group). The engine asks a tier what it is
(:attr:`Backend.tier`, :attr:`Backend.durable`); it never checks concrete classes.

A tier's schedule options are declared once, here: :meth:`Backend.__init__` validates them into
:attr:`Backend.schedule_options` (plain data, read back as :attr:`Backend.every_n_train_steps` ... and
:meth:`Backend.is_due`); the callback's configuration builds the schedule from them
(:mod:`lightning_snapshot.schedule.schedules`), which holds no part of it here. A tier in another process
(:meth:`Backend.spec`, pickling) is the mixin :class:`~lightning_snapshot.backends.portable.Portable`.

Capabilities are declared, never probed with ``getattr``. Every optional feature a tier may have is declared here
with a documented default that means "this tier does not do it", so the engine uses it directly:

* values, as class attributes or properties a tier overrides: :attr:`Backend.node_local`,
  :attr:`Backend.node_leader`, :attr:`Backend.retry_initial` and :attr:`Backend.retry_max`,
  :attr:`Backend.max_pending`, :attr:`Backend.drain_timeout`, :attr:`Backend.bytes_read`, :attr:`Backend.root`,
  :attr:`Backend.parallel_reads`, :attr:`Backend.read_piece_bytes`, :attr:`Backend.read_once`;
* behaviours whose default does what the engine did for a tier without them: :meth:`Backend.redact` (the text
  unchanged), :meth:`Backend.restore` (just ``read()``), :meth:`Backend.collective_steps` (None: list the tier on
  one rank), :meth:`Backend.publish` (the node's first rank commits), :meth:`Backend.incomplete_uploads` (none),
  :meth:`Backend.abort_upload` and :meth:`Backend.abort_incomplete_uploads` (nothing to abort);
* behaviours that add a collective step or a set-up step, which a tier either has or not, as runtime-checkable
  protocols the engine tests with ``isinstance``: :class:`Distributing` (``distribute``: place the data over the
  nodes before the commit) and :class:`LayoutSettling` (``bind`` and ``settle_layout``: learn the node's place and
  whether the tier's directory is shared), and :class:`NodeAgentHosting` (the tier's data is held by a per-node agent
  process that outlives the trainer and writes the durable tiers: :meth:`NodeAgentHosting.connect_agent` gives the
  engine a :class:`NodeAgent`, which it tells of each staged snapshot through the typed :class:`AgentJob`). A default
  there would add a collective or a set-up step to every tier.
"""

from __future__ import annotations

import abc
import builtins
import dataclasses
import datetime as _dt
import os
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypedDict, TypeVar, runtime_checkable

from typing_extensions import Unpack

# (relative: the API page's static analysis, which sees backends/ as ``backends``, follows them to Backend's inherited
# members)
from lightning_snapshot.backends.portable import Portable, spec_class
from lightning_snapshot.dist.agree import agree_on
from lightning_snapshot.dist.comm import Comm
from lightning_snapshot.errors import ConfigError, SnapshotError, TierUnavailableError
from lightning_snapshot.schedule.interval import DEFAULT_EVERY_N_TRAIN_STEPS, ScheduleOptions

if TYPE_CHECKING:
    import threading

    from lightning_snapshot.staging import StagedState

__all__ = [
    "DEFAULT_EVERY_N_TRAIN_STEPS",
    "DEFAULT_KEEP_LAST",
    "AgentJob",
    "Backend",
    "Distributing",
    "LayoutSettling",
    "NeededObjects",
    "NodeAgent",
    "NodeAgentHosting",
    "ScheduleOptionsKwargs",
    "SharedSlot",
    "StepObject",
]

DEFAULT_KEEP_LAST = 3

Buffer = "bytes | bytearray | memoryview"
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class StepObject:
    """An object a restore of a step reads, as the engine tells a tier of it (the tier knows no manifest).

    Attributes:
        key: its name under the step's directory (``<run>-<rank>.bin``).
        nbytes: its size.
        writer: the rank that wrote it (named when it is lost).
    """

    key: str
    nbytes: int
    writer: int


#: What a restore of a step reads, from the bytes of the step's manifest (the engine's function: it reads its own
#: format). A node-local tier fetches these to the nodes that lack them before the engine reads
#: (:meth:`Backend.restore`).
NeededObjects = Callable[[bytes], Sequence[StepObject]]


class ScheduleOptionsKwargs(TypedDict, total=False):
    """The schedule options every tier takes, as keyword arguments (``LocalTier(path, every_n_train_steps=100,
    keep_last=3)``), declared once here; :class:`Backend` validates them and reads them back.

    Attributes:
        every_n_train_steps: snapshot when ``global_step`` is a multiple of this (>= 1). When neither this nor
            ``train_time_interval`` is given, it defaults to ``DEFAULT_EVERY_N_TRAIN_STEPS`` (100). ``"auto"``: the
            callback picks the interval, in steps since the tier's last snapshot, from Young/Daly's
            ``sqrt(2 x cost x MTBF)`` with the tier's measured cost and the callback's ``mtbf``, and re-estimates it
            as training runs (see :mod:`lightning_snapshot.schedule.interval`); the attribute then holds the first
            interval (``FIRST_AUTO_INTERVAL`` = 10 steps, within the bounds) and :attr:`Backend.auto_every` is True.
        train_time_interval: also snapshot when this much wall time passed since the last snapshot of the tier
            (a ``datetime.timedelta`` or seconds as a number).
        keep_last: how many committed snapshots the tier keeps (>= 1), or ``None`` to keep all; default: the tier
            class's :attr:`Backend.default_keep_last` (3; the RAM tier: 2). The newest snapshot is never deleted, nor
            is the newest healthy one (no NaN or infinity recorded in its manifest).
        min_every: the smallest interval (steps, >= 1) ``every_n_train_steps="auto"`` picks; only with ``"auto"``.
            Default 1.
        max_every: the largest interval (steps) ``every_n_train_steps="auto"`` picks; only with ``"auto"``. Default:
            no bound.
    """

    every_n_train_steps: int | str | None
    train_time_interval: _dt.timedelta | float | None
    keep_last: int | None
    min_every: int | None
    max_every: int | None


class Backend(Portable, abc.ABC):
    """A storage tier: where snapshots go, how often, and how many are kept.

    Keys are '/'-separated and relative to the tier's root; every method that takes one refuses a key that could
    leave the root (absolute, ``..``, empty parts, characters outside ``[A-Za-z0-9._-]``) with ``UnsafePathError``
    before touching anything. ``tests/backend_conformance.py`` checks this contract; a new tier's tests subclass
    its ``BackendTests``.

    Every tier takes the schedule options of :class:`ScheduleOptionsKwargs` as keyword arguments, declared there once
    and validated here.

    Thread-safety: the engine calls one backend from one thread at a time, except ``read_into``, which it may call
    from up to :attr:`parallel_reads` threads at once.

    Concurrent readers: other processes (another rank's snapshot agent, the CLI, a restarted job) read a tier while
    it is written, through their own instance of it. Each method below says what such a reader can see; in short,
    an object is visible only whole (``write``, ``commit``), and only ``delete`` of a prefix is seen in part.
    """

    #: Short tier name used in logs and metric names (``local``, ``ram``, ``s3``...).
    tier: str = "backend"  # (an instance may name itself: the object-store tier says its scheme, ``s3``...)
    #: Whether data survives the loss of the training process and the node's memory.
    durable: ClassVar[bool] = True
    #: What to do when :meth:`check` finds the tier unusable (the end of its error message).
    check_hint: ClassVar[str] = "fix the tier's location or permissions, or remove it from the tiers"
    #: Whether a slower tier that snapshots the same step uploads this tier's committed files byte for byte instead
    #: of writing from the staging buffer, which this tier then frees sooner (files on a local disk).
    copy_source: ClassVar[bool] = False
    #: How many ``read_into`` calls the engine may make at once, from different threads (restores read large
    #: snapshots in parallel where the backend allows it; 1: one call at a time).
    parallel_reads: ClassVar[int] = 1
    #: If set, the engine reads a checksum chunk in pieces of this many bytes and hashes each right after it is
    #: read, while it is still in the CPU cache (for memory-speed tiers, where a call is cheap); None: one
    #: ``read_into`` per chunk (object stores, where a request costs more than the hash pass it saves).
    read_piece_bytes: ClassVar[int | None] = None
    #: Whether each node holds its own objects (node-local disks, node memory): the writer commits the manifest on
    #: every node (:meth:`publish`), the steps held are listed over the process group (:meth:`collective_steps`) and a
    #: restore first makes the objects readable on every node (:meth:`restore`). A tier may settle it at set-up.
    node_local: bool = False
    #: Whether a restore with several ranks reads each byte once in the job and the ranks share it over the tier's
    #: group (:mod:`lightning_snapshot.restore.read_once`): right where reading costs more than a transfer (object
    #: stores,
    #: disks); False where each rank reads a copy in its node's memory faster than gloo would move it (RAM).
    read_once: ClassVar[bool] = True
    #: Seconds before a failed write is retried, doubling up to :attr:`retry_max`, until it succeeds (object
    #: stores); None (or 0): a failed write is not retried.
    retry_initial: float | None = None
    #: The longest wait between two retries (seconds), with :attr:`retry_initial`; None without retries.
    retry_max: float | None = None
    #: Snapshots that may wait for this tier at once (the one being written included); past it a due snapshot is
    #: skipped for the tier. None: no limit (the engine waits for the tier).
    max_pending: int | None = None
    #: At the end of ``fit``, how long to wait for this tier's pending writes (seconds); None: as long as it takes.
    drain_timeout: float | None = None
    #: Bytes read from the tier in this process so far (``read_into``; restore statistics), or None when the tier
    #: does not count them.
    bytes_read: int | None = None
    #: Where the tier's objects live, where it has such a place: a directory (a ``Path``) for files, ``bucket/prefix``
    #: for object stores; None otherwise. A ``Path`` root that a failed copy created is removed with it.
    root: Path | str | None = None

    @staticmethod
    def from_spec(spec: Any) -> Backend:
        """The tier :meth:`spec` describes. Only classes of ``lightning_snapshot.backends`` are accepted."""
        cls = spec_class(spec)
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise ConfigError(f"tier spec names {spec['module']}.{spec['class']}, which is not a tier class")
        return cls(*spec["args"], **spec["kwargs"])

    #: ``keep_last`` when the tier is given none
    default_keep_last: int | None = DEFAULT_KEEP_LAST

    def __init__(self, **schedule: Unpack[ScheduleOptionsKwargs]) -> None:
        unknown = sorted(set(schedule) - set(ScheduleOptionsKwargs.__annotations__))
        if unknown:
            raise ConfigError(
                f"{type(self).__name__} got unknown schedule option(s) {', '.join(unknown)}; the schedule options"
                f" are {', '.join(ScheduleOptionsKwargs.__annotations__)}"
            )
        every_n_train_steps = schedule.get("every_n_train_steps")
        train_time_interval = schedule.get("train_time_interval")
        keep_last = schedule.get("keep_last", self.default_keep_last)
        min_every, max_every = schedule.get("min_every"), schedule.get("max_every")
        #: the schedule options, validated: plain data (the callback's configuration builds the tier's schedule from
        #: them, and that schedule holds the interval in use)
        self.schedule_options = ScheduleOptions.of(every_n_train_steps, train_time_interval, min_every, max_every)
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigError(f"keep_last must be an integer >= 1, or None to keep every snapshot, got {keep_last!r}")
        self.keep_last = keep_last

    # ------------------------------------------------------------------------------------------- schedule options
    @property
    def every_n_train_steps(self) -> int | None:
        """The step interval the tier starts with (with ``"auto"``: the first one, which the callback's schedule then
        re-estimates), or None (by time only)."""
        return self.schedule_options.every

    @property
    def auto_every(self) -> bool:
        """Whether ``every_n_train_steps="auto"`` was asked for."""
        return self.schedule_options.auto

    @property
    def train_time_interval(self) -> _dt.timedelta | None:
        return self.schedule_options.time_interval

    @property
    def min_every(self) -> int:
        return self.schedule_options.min_every

    @property
    def max_every(self) -> int | None:
        return self.schedule_options.max_every

    def is_due(self, step: int, seconds_since_last: float | None, steps_since_last: int | None = None) -> bool:
        """Whether a snapshot of ``step`` is due in this tier, by its options (with ``"auto"``: at the first interval;
        a fit decides with its own schedule of the tier, which holds the interval in use).

        Args:
            step: the trainer's ``global_step`` after the optimizer step that just finished.
            seconds_since_last: wall time since this tier's last snapshot (or since training started).
            steps_since_last: optimizer steps since this tier's last snapshot in this fit (or since it started);
                with ``every_n_train_steps="auto"`` the snapshot is due when it reaches the interval.
        """
        options = self.schedule_options
        return options.is_due(step, seconds_since_last, steps_since_last, options.every)

    # ------------------------------------------------------------------------------------------- identity
    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Where the tier lives, safe to log (no credentials)."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.url!r}, every_n_train_steps="
            f"{'auto' if self.auto_every else self.every_n_train_steps},"
            f" train_time_interval={self.train_time_interval}, keep_last={self.keep_last})"
        )

    # ------------------------------------------------------------------------------------------- bytes
    @abc.abstractmethod
    def write(self, key: str, buffers: Iterable[bytes | bytearray | memoryview]) -> int:
        """Create or replace the object ``key`` with the concatenation of ``buffers``; durable on return.

        Concurrent readers see no object (or the object it replaces) until the whole new one is there, never an
        empty or partial one: an object another process polls for with :meth:`exists` can be read as soon as it is
        seen (local files: written to a hidden temporary name, then renamed; object stores: an upload is published
        when it completes).

        Returns the number of bytes written. Raises ``StorageFullError`` when the tier is out of space and
        ``SnapshotWriteError`` for other failures; a failed write leaves what was there before (nothing, for a new
        key) and no partial object.
        """

    @abc.abstractmethod
    def commit(self, key: str, data: bytes) -> None:
        """Publish ``key`` atomically and durably: concurrent readers see the old object (or none) or the whole new
        one, never a part. Tiers differ on a key that is already committed (see the conformance suite's
        ``replaces_committed``): files and RAM replace it, object stores refuse it."""

    @abc.abstractmethod
    def read(self, key: str) -> bytes:
        """The whole object ``key``. Raises ``FileNotFoundError`` naming ``key`` when it does not exist.

        Concurrent writers: an object replaced meanwhile reads as the old or the new one, whole."""

    def read_view(self, key: str) -> memoryview:
        """The whole object ``key`` as a read-only buffer (a backend may map it instead of copying it)."""
        return memoryview(self.read(key))

    @abc.abstractmethod
    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``key`` starting at ``offset``, and only ``out``.

        Raises ``EOFError`` naming ``key`` when the object ends before ``offset + len(out)`` (also when ``offset`` is
        past its end), ``FileNotFoundError`` when it does not exist. Reading no bytes reads nothing.
        """

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Names of the objects and sub-prefixes directly under ``prefix`` (no recursion), sorted; names starting
        with a dot are left out (a write in progress is not listed). A prefix that does not exist, or an object,
        lists as empty."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete ``key`` and everything under it; deleting what does not exist is not an error.

        Not atomic for a prefix: a concurrent reader can see some of its objects gone and others still there (each
        object itself is there whole or not at all). Retention and ``gc`` delete a step's manifest first where it
        matters, so a half-deleted step is an uncommitted one."""

    def exists(self, key: str) -> bool:
        """Whether the object ``key`` exists (a prefix with objects under it is not an object). True only once it
        can be read whole (see :meth:`write`)."""
        from lightning_snapshot.format.manifest import validate_key  # (lazy: the manifest module imports torch)

        parent, _, name = validate_key(key).rpartition("/")
        return name in self.list(parent) and not self.list(key)  # (an object lists as empty, a prefix does not)

    def modified(self, key: str) -> float | None:
        """When ``key`` (an object, or a prefix and everything under it) last changed, as Unix time: the newest
        modification of what it holds. ``None`` when the tier cannot tell or ``key`` holds nothing.

        ``lightning-snapshot gc`` removes an uncommitted step only when this is older than its grace period, so a
        tier that cannot tell (the default) never loses a snapshot that is being written.
        """
        return None

    def require_exists(self) -> None:
        """Check that the tier itself exists, for callers that only read (``load_snapshot``, the CLI).

        Creates nothing. The default accepts every tier; tiers that can tell a missing root from an empty one say so.

        Raises:
            SnapshotNotFoundError: the tier's root does not exist; the message names it and the likely fix.
        """

    # ------------------------------------------------------------------------------------------- start
    def check(self) -> None:
        """Check that this process can write to the tier: write a small probe object and delete it.

        Called by the callback at ``setup`` on every rank (each rank writes its own objects), before training, for
        every durable tier. The probe's name starts with a dot, so a probe left by a crash is never listed.

        Raises:
            TierUnavailableError: naming the tier (never its credentials), what failed and :attr:`check_hint`.
        """
        key = f".lightning-snapshot-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.write(key, [b"lightning-snapshot probe"])
            self.delete(key)
        except TierUnavailableError:
            raise
        except Exception as e:  # any failure makes the tier unusable; translated here
            raise TierUnavailableError(
                f"the {self.tier} tier {self.url!r} cannot be written (probe object {key!r}): {e}. {self.check_hint}"
            ) from e

    # ------------------------------------------------------------------------------------------- capabilities
    # (each default is what the engine does with a tier that lacks the capability: see the module docstring)
    @property
    def node_leader(self) -> bool:
        """Whether this rank writes what its node holds once (the node's manifest copy, retention) in a
        :attr:`node_local` tier: its first rank on the node. The default, False: rank 0 alone does (shared tiers)."""
        return False

    def redact(self, text: str) -> str:
        """``text`` (an error message) with this tier's credentials removed; the default returns it unchanged."""
        return text

    def publish(self, comm: Comm, key: str, data: bytes) -> None:
        """Commit the manifest ``key`` on this node (collective over ``comm``, :attr:`node_local` tiers only: the
        writer commits a shared tier's manifest once, with :meth:`commit`). The default: the node's
        :attr:`node_leader` commits the node's copy."""
        if self.node_leader:
            self.commit(key, data)

    def collective_steps(
        self, comm: Comm, objects: NeededObjects | None = None
    ) -> builtins.list[int] | None:  # (``list`` here is the method above)
        """Steps committed on any node, newest first (collective: every rank calls it; :attr:`node_local` tiers,
        whose nodes each hold their own). The default, None: the tier is listed by one rank, as a shared one.

        ``objects`` is the engine's reading of a step's manifest bytes into every object of the step (a tier moves
        bytes and knows no manifest): the RAM tier commits a step its node agents kept for trainers that died only
        where each of those objects is held; None: such a step stays uncommitted there (its durable copy remains)."""
        return None

    def restore(self, comm: Comm, step: int, read: Callable[[], _T], needed: NeededObjects | None = None) -> _T:
        """Restore ``step`` through ``read()`` (collective over ``comm`` for :attr:`node_local` tiers: each node
        first makes every object of the step readable, and what that added is freed after). The default: ``read()``.

        ``needed`` is the engine's answer to which objects the read needs, from the manifest's bytes (a tier moves
        bytes and knows no manifest); a node-local tier that fetches objects between nodes fetches those. None: every
        object of the step that some node holds.

        Raises:
            SnapshotError: the step's objects cannot be made readable (and whatever ``read`` raises).
        """
        return read()

    def incomplete_uploads(self) -> builtins.list[dict[str, Any]]:  # (``list`` here is the method above)
        """Uploads started under the tier root and neither completed nor aborted, each ``{"key": key relative to the
        root, "upload_id": ..., "modified": Unix time}`` (object stores with multipart uploads). Default: none."""
        return []

    def abort_upload(self, upload: dict[str, Any]) -> None:
        """Abort one upload of :meth:`incomplete_uploads`. The default does nothing (the tier has none)."""

    def abort_incomplete_uploads(self, older_than: float | None = None) -> int:
        """Abort the uploads a crashed writer left (best effort); returns how many. Default: 0 (the tier has none).

        Args:
            older_than: only those whose newest part is at least this many seconds old (None: all of them).
        """
        return 0


@runtime_checkable
class Distributing(Protocol):
    """A tier that places each rank's new objects over the nodes once every rank's data is written and before
    anything is committed (the erasure-coded RAM tier): the writer calls :meth:`distribute` on every rank and then
    agrees on the result over the process group, a collective step other tiers do not take."""

    def distribute(self, comm: Comm, prefix: str, run_id: str | None) -> None:
        """Send this rank's new objects under ``prefix`` (of ``run_id``) where they belong (collective)."""


@runtime_checkable
class LayoutSettling(Protocol):
    """A tier whose layout is settled when training starts (the local tier): the callback tells it where this rank
    is (:meth:`bind`), then asks whether its directory is shared by all nodes or node-local (:meth:`settle_layout`,
    which sets :attr:`Backend.node_local`)."""

    def bind(self, *, node_rank: int, num_nodes: int, local_rank: int, ranks_per_node: int) -> None:
        """Place the tier in the job (every rank, at set-up)."""

    def settle_layout(self, comm: Comm, run_id: str) -> str:
        """Decide whether the directory is shared or node-local (collective); returns how it was settled."""


class SharedSlot(Protocol):
    """Host memory a snapshot is staged in, as a node agent maps it (the staging arena's slot)."""

    @property
    def fd(self) -> int:
        """The shared-memory file behind the slot, which the agent maps; -1 when there is none (anonymous memory)."""

    @property
    def capacity(self) -> int:
        """Its size in bytes."""


class AgentJob(Protocol):
    """A staged snapshot, as the engine tells a :class:`NodeAgent` of it (the persist thread's job)."""

    @property
    def step(self) -> int: ...

    @property
    def epoch(self) -> int: ...

    @property
    def tiers(self) -> builtins.list[Backend]:
        """The tiers it is due in."""

    @property
    def slot(self) -> SharedSlot | None:
        """Where its shared state is staged; None when it is not in a slot (then no agent can write it)."""

    @property
    def shared_state(self) -> StagedState | None:
        """The layout of the shared state (the tensors) staged in :attr:`slot`."""

    @property
    def private(self) -> StagedState:
        """This rank's own small state (sent inline)."""

    @property
    def replicas(self) -> dict[str, Any] | None:
        """The replica check's outcome for the manifest, or None."""


class NodeAgent(Protocol):
    """A trainer rank's link to its node's agent, as the engine uses it (made by
    :meth:`NodeAgentHosting.connect_agent`). Thread-safe: the persist threads and the training thread call it."""

    @property
    def linked(self) -> bool:
        """Whether the link still works (the ranks agree on it at each hand-over)."""

    def handles(self, job: AgentJob, tier: Backend) -> bool:
        """Whether the agent writes ``job`` to ``tier`` (a durable tier it was told of, ``job`` staged in a slot it
        can map)."""

    def persist(self, job: AgentJob, tier: Backend, stop: threading.Event) -> tuple[int, float]:
        """Have the agent write ``job`` to ``tier``; returns (bytes, seconds) once committed.

        Raises:
            SnapshotWriteError: it failed (the caller may retry).
            AgentError: the agent stopped answering.
            TimeoutError: ``stop`` was set meanwhile (the agent finishes the write on its own).
        """

    def staged(self, job: AgentJob) -> None:
        """``job`` is staged (its copy finished): the agent writes it if this trainer dies before releasing it."""

    def release(self, slot: SharedSlot, ok: bool) -> None:
        """Every tier is done with ``slot`` (``ok``: all committed it)."""

    def close(self) -> None:
        """End the link (the agent keeps what it holds)."""


@runtime_checkable
class NodeAgentHosting(Protocol):
    """A tier whose data a per-node agent process holds (the RAM tier): the agent outlives the trainer and writes the
    durable tiers, so a snapshot staged before a crash still reaches them. At most one per callback.

    Set-up (session.py, every rank): rank 0's :meth:`propose_name` is broadcast, :meth:`bind` places the tier, the
    node's first rank (:attr:`Backend.node_leader`) calls :meth:`start_agent` (the ranks agree on the outcome), then
    :meth:`connect_agent` links this rank; the persist threads use the :class:`NodeAgent` it returns.
    """

    def propose_name(self, others: Sequence[str]) -> str:
        """The run's name this rank proposes when none was given (``others``: the URLs of the callback's other
        tiers); rank 0's is used."""

    def bind(self, *, node_rank: int, num_nodes: int, local_rank: int, ranks_per_node: int, default_name: str) -> None:
        """Place the tier in the job (every rank, at set-up)."""

    def start_agent(self) -> None:
        """Start the node's agent unless one runs (the node's first rank).

        Raises:
            SnapshotError: it did not start (its log says why).
        """

    def connect_agent(
        self, *, rank: int, world_size: int, run_id: str, tiers: Sequence[Backend], part_wait: float
    ) -> NodeAgent:
        """Link this rank to its node's agent, which will write ``tiers`` (durable, shared ones) for it."""


def node_steps(tier: Backend, comm: Comm) -> builtins.list[int]:
    """:meth:`Backend.collective_steps` of a :attr:`~Backend.node_local` tier: the steps committed on any node, newest
    first (collective: every rank calls it; each node's first rank lists its node). A listing that fails on some node
    fails on every rank, with the same error naming the rank, so that the ranks stay in step (the ranks that listed
    would otherwise go on to the next collective while the failed one left).

    Raises:
        SnapshotError: some node's listing failed.
    """
    from lightning_snapshot.format.committed import committed_steps

    mine: builtins.list[int] = []
    error: str | None = None
    if tier.node_leader:
        try:
            mine = committed_steps(tier)
        except Exception as e:  # noqa: BLE001 - agreed on below, on every rank
            error = f"{type(e).__name__}: {tier.redact(str(e))}"
    agreed = agree_on(comm, f"listing the {tier.tier} tier {tier.url}", lambda: mine, error=error, gather=True)
    if not agreed.ok:
        raise SnapshotError(f"listing the {tier.tier} tier {tier.url} failed: {agreed.text}")
    return sorted({s for steps in agreed.values or [] if steps for s in steps}, reverse=True)
