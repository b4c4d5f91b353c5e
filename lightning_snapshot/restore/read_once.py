"""Read once, share: a restore in which several ranks need the same bytes (DDP: every rank needs the whole replicated
state) reads each checksum chunk once per job, and the ranks that need it get it from the rank that read it.

Used by the Restorer (restore.py): it hands a :class:`ReadOnce` over the tier's gloo group to
:func:`~lightning_snapshot.restore.loader.read_section` for the shared state of a snapshot, and every rank calls it
together.

1. Every rank plans its reads as it would alone (the loader: whole fragments, or the checksum chunks of its shards
   after a change of world size or strategy) and the ranks exchange which chunks they need: (object, offset,
   length) only, never the bytes.
2. Every rank derives the same plan (:func:`~lightning_snapshot.plan.planner.plan_shared_reads`): each chunk is read by
   one
   of the ranks that need it, balanced by bytes; a chunk only one rank needs is read by that rank (sharded
   strategies where no two ranks need the same bytes read exactly what they read alone).
3. Every rank reads and verifies its part (chunk by chunk, against the manifest's checksums, as the loader always
   does); then the ranks agree. When any rank could not read or verify its part, every rank raises the same
   :class:`~lightning_snapshot.errors.SnapshotError` naming the ranks and their problems, and the Restorer falls
   back to the next snapshot, as it does for a failed read on one rank.
4. Only then do the verified bytes move: in the plan's order (the same on every rank), each batch of chunks is
   broadcast over the group by its reader (when every rank takes part) or sent to each rank that needs it. A rank
   only ever holds bytes it verified itself or received from the rank that verified them.

``LIGHTNING_SNAPSHOT_READ_ONCE=0`` turns it off: every rank reads all it needs itself (the path before it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from lightning_snapshot.backends.base import Backend
from lightning_snapshot.dist.agree import agree_on
from lightning_snapshot.dist.comm import TensorComm
from lightning_snapshot.errors import SnapshotError
from lightning_snapshot.format.manifest import Manifest
from lightning_snapshot.plan.planner import Chunk, SharedBatch, chunk_ranges, plan_shared_reads
from lightning_snapshot.restore.loader import ChunkUnit, FragmentRead, chunk_units, read_units

__all__ = ["READ_ONCE_ENV", "ReadOnce", "enabled"]

#: Environment variable: ``0`` makes every rank read all it needs itself (no read-once restore).
READ_ONCE_ENV = "LIGHTNING_SNAPSHOT_READ_ONCE"


def enabled() -> bool:
    """Whether restores read once and share (``LIGHTNING_SNAPSHOT_READ_ONCE``, default on)."""
    return os.environ.get(READ_ONCE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class ReadOnce:
    """The shared reader of one snapshot's shared state (a
    :class:`~lightning_snapshot.restore.loader.SharedReader`): collective over ``comm``, every rank calls :meth:`start`
    and then
    ``read_section(..., shared=self)`` at the same point.

    Args:
        comm: the tier's group (at least two ranks).
        where: the snapshot, as error messages name it.
        batch_bytes: the most bytes one transfer moves (unless a chunk is larger); the receivers hold one batch at
            a time in a buffer of this size.

    After a read: :attr:`bytes_read` (this rank, from the tier), :attr:`bytes_received` (this rank, from the others)
    and :attr:`job_bytes_read` (all ranks together, from the tier).
    """

    def __init__(self, comm: TensorComm, where: str, *, batch_bytes: int = 64 << 20) -> None:
        self.comm = comm
        self.where = where
        self.batch_bytes = batch_bytes
        self.bytes_read = 0
        self.bytes_received = 0
        self.job_bytes_read = 0

    def start(self, error: BaseException | None) -> None:
        """Collective, before the read: every rank says whether it got ready for it (read the manifest, planned its
        targets). When some rank did not (``error``), every rank raises: its own error, or a
        :class:`SnapshotError` saying that another rank failed; so that no rank waits in a transfer for a rank that
        will never come."""
        agree_on(
            self.comm,
            f"preparing the restore of the {self.where}",
            error=error,
            elsewhere=f"preparing the restore of the {self.where} failed on another rank",
        ).result()

    def __call__(self, backend: Backend, manifest: Manifest, prefix: str, reads: list[FragmentRead]) -> int:
        comm = self.comm
        size = manifest.chunk_bytes
        runs = sorted({(r.object, r.offset, r.view.nbytes) for r in reads})
        needs = [_chunks(rank_runs, size) for rank_runs in comm.all_gather(runs)]
        plan = plan_shared_reads(needs, batch_bytes=self.batch_bytes)
        # this rank's destinations of each chunk it needs (the same chunk may go to several places)
        mine: dict[Chunk, list[ChunkUnit]] = {}
        for unit in chunk_units(reads, size):
            r, a, b, _expected = unit
            mine.setdefault((r.object, r.offset + a, b - a), []).append(unit)
        own = [mine[c][0] for batch in plan if batch.reader == comm.rank for c in batch.chunks]
        problem, unexpected = None, None
        try:
            read_units(backend, manifest, prefix, own)
        except (SnapshotError, OSError) as e:
            problem = str(e) if isinstance(e, SnapshotError) else f"{type(e).__name__}: {backend.redact(str(e))}"
        except Exception as e:  # noqa: BLE001 - a bug: raised here after the others heard of it (they do not wait)
            problem, unexpected = f"{type(e).__name__}: {backend.redact(str(e))}", e
        agreed = agree_on(comm, f"reading the parts of the {self.where}", error=problem)
        if unexpected is not None:
            raise unexpected
        if not agreed.ok:
            raise SnapshotError(f"the ranks could not read their parts of the {self.where}: {agreed.text}")
        received = 0
        for batch in plan:
            if batch.receivers and (comm.rank == batch.reader or comm.rank in batch.receivers):
                received += self._transfer(batch, mine)
        for units in mine.values():  # a chunk this rank needs in several places: copied from the first
            first = units[0]
            for r, a, b, _e in units[1:]:
                r.view[a:b] = first[0].view[first[1] : first[2]]
        self.bytes_read = sum(b - a for _r, a, b, _e in own)
        self.bytes_received = received
        self.job_bytes_read = sum(batch.nbytes for batch in plan)
        return self.bytes_read

    def _transfer(self, batch: SharedBatch, mine: dict[Chunk, list[ChunkUnit]]) -> int:
        """Move one batch from its reader to its receivers (this rank is one of them); returns the bytes received."""
        comm = self.comm
        if batch.nbytes == 0:
            return 0
        sending = comm.rank == batch.reader
        views = [_view(mine[c][0]) for c in batch.chunks]
        buf = _tensor(views[0]) if len(views) == 1 else torch.empty(batch.nbytes, dtype=torch.uint8)
        if sending and len(views) > 1:
            _copy(views, buf, pack=True)
        if len(batch.receivers) + 1 == comm.world_size:
            comm.broadcast_tensor(buf, batch.reader)
        elif sending:
            for dst in batch.receivers:
                comm.send_tensor(buf, dst)
        else:
            comm.recv_tensor(buf, batch.reader)
        if sending:
            return 0
        if len(views) > 1:
            _copy(views, buf, pack=False)
        return batch.nbytes


def _chunks(runs: Sequence[tuple[str, int, int]], chunk_bytes: int) -> list[Chunk]:
    """The checksum chunks of fragment reads given as (object, offset, length) (the loader's cut: chunk_units)."""
    return [(obj, offset + a, b - a) for obj, offset, nbytes in runs for a, b in chunk_ranges(nbytes, chunk_bytes)]


def _view(unit: ChunkUnit) -> memoryview:
    r, a, b, _e = unit
    return r.view[a:b]


def _tensor(view: memoryview) -> torch.Tensor:
    """A uint8 tensor over ``view`` (no copy)."""
    return torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else torch.empty(0, dtype=torch.uint8)


def _copy(views: list[memoryview], buf: torch.Tensor, *, pack: bool) -> None:
    """Copy ``views`` one after another into ``buf`` (``pack``), or back out of it."""
    pos = 0
    for view in views:
        n = view.nbytes
        if n:
            if pack:
                buf[pos : pos + n].copy_(_tensor(view))
            else:
                _tensor(view).copy_(buf[pos : pos + n])
        pos += n
