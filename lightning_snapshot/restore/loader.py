"""Find committed snapshots and read them back, verifying every chunk. Never unpickles.

Used by the Restorer (restore.py) when a fit resumes, by the CLI and its operations (cli.py, export.py, ops.py), and
by users through ``lightning_snapshot.load_snapshot``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import xxhash

from lightning_snapshot.backends.base import Backend
from lightning_snapshot.backends.registry import parse_tier
from lightning_snapshot.dist.forksafe import Executor
from lightning_snapshot.errors import ChecksumError, ConfigError, ManifestError, SnapshotNotFoundError
from lightning_snapshot.format import tree as _tree
from lightning_snapshot.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    TensorEntry,
    dtype_from_name,
    parse_step_dirname,
    step_dirname,
)
from lightning_snapshot.persist.commit import committed_steps
from lightning_snapshot.plan.planner import Box, chunk_ranges, plan_tensor_reads
from lightning_snapshot.staging import digest, dtensor_box, is_dtensor, tensor_bytes

__all__ = [
    "FragmentRead",
    "ReadStats",
    "ShardTarget",
    "SharedReader",
    "checkpoint_tree",
    "committed_steps",
    "load_snapshot",
    "open_snapshot",
    "read_manifest",
    "read_section",
    "resolve_source",
]


@dataclass(frozen=True)
class ShardTarget:
    """A target of :func:`read_section` that wants one box of a tensor, not all of it.

    Attributes:
        box: the box of the global tensor to read (global coordinates).
        out: where it goes: a tensor of ``box.shape`` (any device and dtype; values are cast like ``copy_``).
        value: what the decoded state holds for this tensor (default: ``out``).
    """

    box: Box
    out: torch.Tensor
    value: Any = None


@dataclass
class ReadStats:
    """What a :func:`read_section` call read: ``bytes_needed`` (the bytes of the tensors or boxes asked for) and
    ``bytes_read`` (the bytes planned and read from the tier: box reads are expanded to whole checksum chunks)."""

    bytes_needed: int = 0
    bytes_read: int = 0
    tensors_resharded: int = 0


log = logging.getLogger(__name__)


def _where(backend: Backend, step: int) -> str:
    return f"{backend.tier} tier {backend.url!r}, {step_dirname(step)}"


def read_manifest(backend: Backend, step: int) -> Manifest:
    """Read and validate the manifest of ``step``.

    Raises:
        SnapshotNotFoundError: the step has no committed manifest.
        ManifestError / FormatVersionError: the manifest is malformed or too new.
    """
    key = f"{step_dirname(step)}/{MANIFEST_NAME}"
    try:
        data = backend.read(key)
    except FileNotFoundError:
        raise SnapshotNotFoundError(
            f"no committed snapshot of step {step} in the {backend.tier} tier {backend.url!r}"
        ) from None
    manifest = Manifest.from_json(data, where=f"{key} in the {backend.tier} tier {backend.url!r}")
    if manifest.step != step:
        raise ManifestError(f"manifest of {_where(backend, step)} says it is step {manifest.step}")
    return manifest


def _shard_target(target: Any, entry: TensorEntry) -> ShardTarget | None:
    """The box a target wants, when it wants a box (a DTensor of the entry's global shape, or a ShardTarget)."""
    if isinstance(target, ShardTarget):
        return target
    if is_dtensor(target) and tuple(target.shape) == entry.global_shape:
        box, _ = dtensor_box(target, entry.name)
        return ShardTarget(box, target.to_local(), target)
    return None


def _contiguous_run(box: Box, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``[start, end)`` in elements when ``box`` is one row-major contiguous run of an array of ``shape``, else None."""
    n = len(shape)
    j = 0  # first dim where the box is not a single index
    while j < n and box.shape[j] == 1:
        j += 1
    if any(box.offsets[d] != 0 or box.shape[d] != shape[d] for d in range(j + 1, n)):
        return None
    start = sum(box.offsets[d] * math.prod(shape[d + 1 :]) for d in range(n))
    return start, start + math.prod(box.shape)


def _box_reads(
    backend: Backend,
    manifest: Manifest,
    entry: TensorEntry,
    shard: ShardTarget,
    reads: list[FragmentRead],
    after: list[tuple[torch.Tensor, torch.Tensor]],
    stats: ReadStats | None,
) -> Any:
    """Plan filling ``shard.out`` with ``shard.box`` of ``entry``: append the reads of the checksum chunks that
    overlap it to ``reads`` (read and verified in parallel with the others by :func:`_read_all`), and to ``after``
    the ``(destination, source)`` copies that must follow them, in order. Returns the value the decoded state holds."""
    dtype = dtype_from_name(entry.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    box, out = shard.box, shard.out
    if tuple(out.shape) != box.shape:
        raise ValueError(f"tensor {entry.name!r}: the target of box {box} has shape {tuple(out.shape)}")
    size = manifest.chunk_bytes
    try:
        items = plan_tensor_reads(entry, entry.global_shape, itemsize, box, size)
    except ValueError as e:
        raise ManifestError(f"step {manifest.step} in the {backend.tier} tier {backend.url!r}: {e}") from e
    direct = out.dtype == dtype and out.device.type == "cpu" and out.layout == torch.strided and out.is_contiguous()
    dst = out.detach() if direct else torch.empty(box.shape, dtype=dtype)
    dst_bytes = tensor_bytes(dst) if dst.numel() else None

    def read(frag: Any, a: int, view: memoryview) -> None:  # whole checksum chunks of ``frag`` from byte ``a``
        first = a // size
        reads.append(
            FragmentRead(
                entry.name,
                frag.object,
                frag.offset + a,
                view,
                tuple(frag.checksums[first : first + -(-view.nbytes // size)]),
            )
        )

    for item in items:
        frag = entry.fragments[item.fragment_index]
        src_run = _contiguous_run(item.src_box, frag.local_shape)
        dst_run = _contiguous_run(item.dst_box, box.shape)
        if (
            dst_bytes is not None
            and src_run is not None
            and dst_run is not None
            and item.read_ranges == ((src_run[0] * itemsize, src_run[1] * itemsize),)
        ):
            # the overlap is one run of the fragment, read whole chunks exactly, and one run of the target: the
            # bytes go straight into the target (no staging buffer, no second copy), verified there
            read(frag, src_run[0] * itemsize, dst_bytes[dst_run[0] * itemsize : dst_run[1] * itemsize])
            continue
        # a fragment-sized buffer whose pages are only touched where the planned ranges land (lazily allocated)
        buf = torch.empty(frag.nbytes, dtype=torch.uint8)
        view = tensor_bytes(buf)
        for a, b in item.read_ranges:
            read(frag, a, view[a:b])
        src = buf.view(dtype).view(frag.local_shape)[item.src_box.slices()]
        after.append((dst[item.dst_box.slices()], src))
    if not direct:
        after.append((out.detach(), dst))
    if stats is not None:
        stats.bytes_needed += box.numel * itemsize
        stats.tensors_resharded += 1
    return shard.value if shard.value is not None else out


@dataclass(frozen=True)
class FragmentRead:
    """One fragment to read into ``view`` (the bytes of its destination) and verify."""

    name: str
    object: str
    offset: int
    view: memoryview
    checksums: tuple[str, ...]


#: Restores of at least this many bytes read in parallel (where the backend allows it).
_PARALLEL_MIN_BYTES = 32 << 20


#: One checksum chunk of a fragment read: the read, the chunk's bytes ``[a, b)`` of its view, its expected checksum.
ChunkUnit = tuple[FragmentRead, int, int, str]


def chunk_units(reads: Sequence[FragmentRead], chunk_bytes: int) -> list[ChunkUnit]:
    """``reads`` cut into their checksum chunks, in object order."""
    return [
        (r, a, b, expected)
        for r in sorted(reads, key=lambda r: (r.object, r.offset))
        for (a, b), expected in zip(chunk_ranges(r.view.nbytes, chunk_bytes), r.checksums, strict=True)
    ]


class SharedReader(Protocol):
    """What carries out a section's reads instead of this rank alone
    (:class:`~lightning_snapshot.restore.read_once.ReadOnce`:
    each chunk read once in the job, then shared). Returns the bytes this rank read from the tier."""

    def __call__(self, backend: Backend, manifest: Manifest, prefix: str, reads: list[FragmentRead]) -> int: ...


def _read_all(backend: Backend, manifest: Manifest, prefix: str, reads: list[FragmentRead]) -> int:
    """Read and verify ``reads`` on this rank alone (:func:`read_units`); returns the bytes read."""
    read_units(backend, manifest, prefix, chunk_units(reads, manifest.chunk_bytes))
    return sum(r.view.nbytes for r in reads)


def read_units(backend: Backend, manifest: Manifest, prefix: str, chunks: Sequence[ChunkUnit]) -> None:
    """Read and verify ``chunks``, in up to ``backend.parallel_reads`` threads.

    The chunks are taken in order: each thread takes the next chunk when it is done with its last (so a thread
    slowed by another process does not hold the restore up, and an object is still read front to back), and hashes
    it right after reading it, while it is still in the cache. Reads and hashes release the GIL.

    Raises:
        ChecksumError: a chunk does not match its checksum, or its object is missing or truncated.
    """
    total = sum(b - a for _r, a, b, _e in chunks)
    workers = min(max(1, int(backend.parallel_reads)), len(chunks), os.cpu_count() or 1)
    if workers <= 1 or total < _PARALLEL_MIN_BYTES:
        for chunk in chunks:
            _read_chunk(backend, manifest, prefix, *chunk)
        return
    units = iter(chunks)
    lock = threading.Lock()
    failed = threading.Event()

    def run() -> None:
        while not failed.is_set():
            with lock:
                unit = next(units, None)
            if unit is None:
                return
            try:
                _read_chunk(backend, manifest, prefix, *unit)
            except BaseException:
                failed.set()  # the other threads stop at their next chunk
                raise

    with Executor(max_workers=workers, thread_name_prefix="lightning-snapshot-read") as pool:
        futures = [pool.submit(run) for _ in range(workers)]
        for f in futures:
            f.result()  # the first failure, in order


def _read_chunk(
    backend: Backend, manifest: Manifest, prefix: str, r: FragmentRead, a: int, b: int, expected: str
) -> None:
    """Read bytes ``[a, b)`` of one fragment (one checksum chunk) and verify them right after (piece by piece,
    each hashed while still in the cache, where the backend has cheap ``read_piece_bytes``)."""
    key = f"{prefix}/{r.object}"
    piece = backend.read_piece_bytes
    try:
        if piece and b - a > piece:
            h = xxhash.xxh3_64()
            for x in range(a, b, piece):
                y = min(x + piece, b)
                backend.read_into(key, r.offset + x, r.view[x:y])
                h.update(r.view[x:y])
            got = h.hexdigest()
        else:
            if b > a:
                backend.read_into(key, r.offset + a, r.view[a:b])
            got = digest(r.view[a:b])
    except (EOFError, FileNotFoundError) as e:
        raise ChecksumError(
            f"tensor {r.name!r}: object {r.object!r} of step {manifest.step} in the {backend.tier} tier"
            f" {backend.url!r} is missing or truncated ({e})"
        ) from e
    if got != expected:
        raise ChecksumError(
            f"checksum mismatch in tensor {r.name!r}, object {r.object!r}, bytes [{r.offset + a},"
            f" {r.offset + b}) of step {manifest.step} in the {backend.tier} tier {backend.url!r}:"
            " the data is corrupted. Use an earlier snapshot"
        )


def read_section(
    backend: Backend,
    manifest: Manifest,
    entries: Sequence[TensorEntry],
    tree: Any,
    targets: Mapping[str, Any] | None = None,
    *,
    stats: ReadStats | None = None,
    shared: SharedReader | None = None,
) -> Any:
    """Read, verify and decode one section (the shared state or a rank's) of a snapshot.

    Args:
        targets: tensors to fill, by entry name:

            * a plain tensor (e.g. a model parameter) wants the whole tensor: one of the right dtype and shape,
              contiguous and on the CPU, is read into directly (no fresh allocation, no extra copy), and the
              decoded state then holds that very tensor; otherwise a new tensor is returned;
            * a ``DTensor`` of the tensor's global shape wants only its local shard (load-time resharding): the box
              of the global tensor this rank's shard covers is computed from its mesh, placements and this
              rank's coordinate, only the checksum chunks of the saved fragments that overlap it are read (and
              verified), and the overlaps are copied into its local tensor, whatever the layout it was saved
              with (another world size, DDP's whole tensors, other shards). The decoded state holds the DTensor;
            * a :class:`ShardTarget` wants one box, read the same way into its ``out``.

            Contents of targets are undefined if this raises.
        stats: if given, the bytes needed and the bytes this rank read from the tier are added to it.
        shared: reads the section together with the other ranks (collective: every rank calls it with its own
            targets); None: this rank reads all it needs itself.

    Raises:
        ChecksumError: a chunk does not match its checksum; the message names tensor, object and step.
    """
    prefix = step_dirname(manifest.step)
    tensors: dict[str, Any] = {}
    reads: list[FragmentRead] = []
    after: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, source) copies that follow the reads
    for entry in entries:
        if entry.alias_of is not None:
            continue
        dtype = dtype_from_name(entry.dtype)
        target = targets.get(entry.name) if targets is not None else None
        shard = _shard_target(target, entry)
        if shard is not None:
            tensors[entry.name] = _box_reads(backend, manifest, entry, shard, reads, after, stats)
            continue
        if (
            isinstance(target, torch.Tensor)
            and target.dtype == dtype
            and tuple(target.shape) == entry.global_shape
            and target.device.type == "cpu"
            and target.is_contiguous()
            and target.layout == torch.strided
        ):
            out = target.detach()
        else:
            out = torch.empty(entry.global_shape, dtype=dtype)
        for frag in entry.fragments:
            box = Box(frag.global_offsets, frag.local_shape)
            run = _contiguous_run(box, entry.global_shape)
            if run is not None:  # the whole tensor, or a slab of whole rows (DTensor Shard(0)): straight into ``out``
                buf = out.reshape(-1)[run[0] : run[1]].view(frag.local_shape)
            else:
                buf = torch.empty(frag.local_shape, dtype=dtype)
                after.append((out[box.slices()], buf))
            reads.append(FragmentRead(entry.name, frag.object, frag.offset, tensor_bytes(buf), frag.checksums))
        tensors[entry.name] = out
        if stats is not None:
            stats.bytes_needed += out.numel() * out.element_size()
    got = (shared or _read_all)(backend, manifest, prefix, reads)
    if stats is not None:
        stats.bytes_read += got
    with torch.no_grad():
        for dst, src in after:
            dst.copy_(src)
    for entry in entries:
        if entry.alias_of is not None:
            tensors[entry.name] = tensors[entry.alias_of]
    return _tree.decode(tree, tensors)


def resolve_source(source: str | os.PathLike[str] | Backend) -> tuple[Backend, int | None]:
    """A backend (plus a step, when ``source`` names one snapshot directory) from a URL, path or backend.

    ``"/snaps/run-1"`` -> that tier, newest step; ``"/snaps/run-1/step-000000000200"`` -> that tier, step 200.
    """
    if isinstance(source, Backend):
        return source, None
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"a snapshot source must be a tier URL, a path or a Backend, got {source!r}")
    text = os.fspath(source)
    base, _, query = text.partition("?")
    head, _, last = base.rstrip("/").rpartition("/")
    step = parse_step_dirname(last)
    if step is not None:
        return parse_tier(head + ("?" + query if query else "")), step
    return parse_tier(text), None


def checkpoint_tree(manifest: Manifest) -> tuple[Any, tuple[TensorEntry, ...]]:
    """The tree of the whole checkpoint-shaped state and the tensor entries it refers to.

    Weights and optimizer state are in the shared section; loops, callbacks, schedulers and the rest, taken right
    before the next step, are stored with each rank's private state (``late``): rank 0's is merged in, as Lightning
    keeps rank 0's.
    """
    tree = manifest.state
    entries = tuple(manifest.tensors)
    section = manifest.rank_section(0)
    if (
        isinstance(tree, dict)
        and section is not None
        and isinstance(section.state, dict)
        and isinstance(section.state.get("late"), dict)
    ):
        tree = {**tree, **section.state["late"]}
        entries += tuple(section.tensors)
    return tree, entries


def _select(tree: Any, keys: Collection[str]) -> dict[str, Any]:
    """The parts of the shared state tree named by ``keys``: '/'-separated paths through dicts and list indices.

    The result nests the selected parts under dicts keyed by the path's components (``"optimizer_states/0"`` ->
    ``{"optimizer_states": {"0": ...}}``).
    """
    if not isinstance(tree, dict):
        raise ManifestError("the shared state is not a dict")
    out: dict[str, Any] = {}
    for key in keys:
        node: Any = tree
        parts = key.split("/")
        # state_dict keys contain dots, not slashes: a path is a top-level key, then nested dict keys
        for i, part in enumerate(parts):
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node and not part.startswith("$"):
                node = node[part]
            else:
                raise SnapshotNotFoundError(
                    f"the snapshot has no {'/'.join(parts[: i + 1])!r}; top-level keys: {sorted(tree)}"
                )
        cursor = out
        for part in parts[:-1]:
            cursor = cursor.setdefault(part, {})
        cursor[parts[-1]] = node
    return out


def _refs(tree: Any) -> set[str]:
    if isinstance(tree, dict):
        if len(tree) == 1 and "$tensor" in tree:
            return {tree["$tensor"]}
        if len(tree) == 1 and "$ndarray" in tree and isinstance(tree["$ndarray"], list) and tree["$ndarray"]:
            return {str(tree["$ndarray"][0])}
        return set().union(*(_refs(v) for v in tree.values())) if tree else set()
    if isinstance(tree, list):
        return set().union(*(_refs(v) for v in tree)) if tree else set()
    return set()


def open_snapshot(source: str | os.PathLike[str] | Backend, step: int | None = None) -> tuple[Backend, Manifest]:
    """The backend and validated manifest of a snapshot: ``step``, else the one ``source`` names, else the newest.

    Creates nothing (a tier that does not exist is an error, not an empty tier).

    Raises:
        SnapshotNotFoundError: the tier does not exist, or nothing committed in it matches.
    """
    backend, named_step = resolve_source(source)
    backend.require_exists()
    if step is None:
        step = named_step
    if step is None:
        steps = committed_steps(backend)
        if not steps:
            raise SnapshotNotFoundError(f"the {backend.tier} tier {backend.url!r} holds no committed snapshot")
        step = steps[0]
    return backend, read_manifest(backend, step)


def load_snapshot(
    source: str | os.PathLike[str] | Backend,
    step: int | None = None,
    *,
    keys: Collection[str] | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
    rank: int | None = None,
) -> dict[str, Any]:
    """Load a snapshot as a plain dict, outside Lightning (evaluation, export, inspection).

    Args:
        source: a tier URL or path (newest committed step), a path to one ``step-*`` directory, or a backend.
        step: the step to load; the newest committed one when None.
        keys: load only these parts of the state: top-level keys (``"state_dict"``) or '/'-separated paths through
            nested dicts (``"state_dict/encoder.layer.0.weight"``, ``"optimizer_states"``). Only their tensors are
            read. None: everything.
        into: a model ``state_dict()`` to fill in place: each snapshot weight of the same name, dtype and shape, on
            the CPU and contiguous, is read straight into that tensor (others are returned as new tensors). A
            ``DTensor`` value (a sharded model's state dict, e.g. ``get_model_state_dict(model)`` under FSDP2)
            gets only its local shard, read from whatever layout the snapshot was saved with; see
            :func:`read_section`.
        rank: also return that rank's private state (RNG, data position, DDP bucket layout) under ``"rank_state"``.

    Returns:
        A dict shaped like a Lightning checkpoint (``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``loops``,
        ``callbacks``, ``epoch``, ``global_step``...), or its ``keys``, with full CPU tensors.

    Raises:
        SnapshotNotFoundError: no committed snapshot at ``source`` (or no step ``step``, or no state for ``rank``).
        ManifestError: the manifest is malformed or truncated.
        FormatVersionError: the manifest was written by a newer format than this library reads.
        ChecksumError: a chunk read back does not match its recorded checksum.
    """
    backend, manifest = open_snapshot(source, step)
    step = manifest.step
    full, entries = checkpoint_tree(manifest)
    tree = full if keys is None else _select(full, keys)
    if keys is not None:
        wanted = _refs(tree)
        by_name = {t.name: t for t in entries}
        wanted |= {a for n in wanted if n in by_name and (a := by_name[n].alias_of)}
        entries = tuple(t for t in entries if t.name in wanted)
    targets = {f"state_dict/{k}": v for k, v in into.items()} if into is not None else None
    state = read_section(backend, manifest, entries, tree, targets=targets)
    if not isinstance(state, dict):
        raise ManifestError(f"shared state of {_where(backend, step)} is not a dict")
    if rank is not None:
        section = manifest.rank_section(rank)
        if section is None:
            raise SnapshotNotFoundError(f"{_where(backend, step)} has no state for rank {rank}")
        state["rank_state"] = read_section(backend, manifest, section.tensors, section.state)
    return state


def state_bytes(manifest: Manifest) -> int:
    """Bytes of tensor data in a manifest (for logs)."""
    return sum(
        math.prod(f.local_shape) * torch.empty((), dtype=dtype_from_name(t.dtype)).element_size()
        for t in manifest.tensors
        for f in t.fragments
    )
