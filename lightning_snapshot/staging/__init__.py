"""Staging: copy captured tensors into host memory so training can go on mutating the originals.

Used by the snapshot pipeline (fit/pipeline.py: :func:`stage`, and the arena), the persist threads
(persist/threads.py, persist/writer.py: :class:`StagedState`, checksums, health) and the RAM tier's agent; its tensor
helpers and checksums also by state/capture.py, restore/loader.py, cli/export.py, restore/records.py and
backends/ram/shares.py. May import: format, plan, dist, errors.

Two parts, one unit:

- this module: :class:`StagedState` (a point-in-time host copy of a state structure, what every tier writes), the
  synchronous stager :func:`stage`, checksums (:func:`digest`, :func:`chunk_digests`) and the health check
  (:func:`nonfinite_tensors`);
- :mod:`~lightning_snapshot.staging.arena`: the host arena (reused, page-aligned shared-memory slots, CUDA-registered
  when the state is on a GPU) and the asynchronous copy into it that training overlaps with; it produces the same
  :class:`StagedState`. Its parts: :mod:`~lightning_snapshot.staging.cuda_host` (``cudaHostRegister``),
  :mod:`~lightning_snapshot.staging.pool` and :mod:`~lightning_snapshot.staging.slot` (the memory),
  :mod:`~lightning_snapshot.staging.layout` (where each tensor goes in a slot),
  :mod:`~lightning_snapshot.staging.copier` (the copy scheduling) and :mod:`~lightning_snapshot.staging.transfer` (the
  copy in flight).

Sharded tensors (``DTensor``, as ``ModelParallelStrategy``/FSDP2 hold them) are never gathered: each rank stages its
local shard only, recorded with the box of the global tensor it covers (:func:`dtensor_box`). A shard that several
ranks hold (replicated over a mesh dimension) is staged by one of them only, and empty shards stage nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
import torch
import xxhash

from lightning_snapshot.errors import CaptureError
from lightning_snapshot.format import tree as _tree
from lightning_snapshot.format.manifest import DTYPES, dtype_name
from lightning_snapshot.plan.planner import Box, chunk_ranges, shard_boxes

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "StagedState",
    "block_finite",
    "chunk_digests",
    "digest",
    "dtensor_box",
    "is_dtensor",
    "local_tensor",
    "nonfinite_tensors",
    "prepare_tensors",
    "stage",
    "tensor_bytes",
]


@dataclass
class StagedState:
    """A point-in-time host copy of a state structure.

    Attributes:
        tree: the JSON tree (tensors as ``{"$tensor": name}``).
        tensors: host tensors by name, contiguous, one per distinct storage view.
        aliases: ``name -> canonical name`` for tensors that were views of the very same memory (tied weights).
        packed, alignment, checksums: set by the arena (see below).
    """

    tree: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    #: When the tensors are laid out back to back in one region (the arena): that region, its alignment, and the
    #: checksums taken at staging time (name -> one per chunk). The writer then writes the region as it is.
    packed: memoryview | None = None
    alignment: int = 64
    checksums: dict[str, list[str]] | None = None
    #: The checksum chunk size ``checksums`` were taken with (the manifest records it); None: the writer's default.
    chunk_bytes: int | None = None
    #: Tensors that are one shard of a larger global tensor (a rank's part of a DTensor): name -> (global shape,
    #: global offsets of the shard). The others are whole tensors.
    shards: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    #: With ``packed``: (name, offset in the region, bytes) of every tensor, in region order.
    layout: list[tuple[str, int, int]] | None = None
    #: The staged tensors holding a NaN or an infinity, the first of each health group (see
    #: :func:`nonfinite_tensors`); None until computed.
    nonfinite: list[str] | None = None
    #: The bytes of ``tensors`` when the stager knows them already (the arena's plan), else None.
    total_bytes: int | None = None

    @property
    def nbytes(self) -> int:
        if self.total_bytes is not None:
            return self.total_bytes
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


_DTENSOR: Any = None


def _dtensor_type() -> Any:
    """torch's DTensor class, or False where torch.distributed is not built in (imported once, lazily)."""
    global _DTENSOR
    if _DTENSOR is None:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover - torch without distributed
            _DTENSOR = False
        else:
            _DTENSOR = DTensor
    return _DTENSOR


def is_dtensor(t: Any) -> TypeGuard[DTensor]:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (a sharded or replicated distributed tensor)."""
    cls = _dtensor_type()
    return bool(cls) and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor (no copy), or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def dtensor_box(t: Any, name: str = "<tensor>") -> tuple[Box, bool]:
    """The box of the global tensor that this rank's shard of DTensor ``t`` covers, and whether this rank writes it.

    The box follows DTensor's ``Shard``/``_StridedShard``/``Replicate`` geometry
    (:func:`~lightning_snapshot.plan.planner.shard_boxes`, indexed by this rank's mesh coordinate); the 2-D FSDP2 x
    tensor
    parallel layout (``_StridedShard`` on the data-parallel dim) is one box per rank: the data-parallel chunk of the
    tensor-parallel chunk. Of the ranks holding the same box (replicated mesh dimensions, or copies on sibling
    sub-meshes of the world mesh) only the one at coordinate 0 on those dimensions writes it; nobody writes an empty
    shard, except that the rank at coordinate 0 of an empty global tensor writes its (empty) box so the tensor is
    still recorded.

    Raises:
        CaptureError: a placement the format cannot describe as boxes (``Partial``, or a ``_StridedShard`` that is
            not FSDP2's and leaves a rank non-contiguous indices), a rank not in the tensor's mesh, or a local shard
            whose shape is not the one DTensor's geometry gives.
    """
    mesh = t.device_mesh
    placements = tuple(t.placements)
    try:
        boxes = shard_boxes(tuple(t.shape), tuple(mesh.shape), placements)
    except ValueError as e:
        raise CaptureError(
            f"tensor {name!r} is a DTensor with placements {placements} on mesh {tuple(mesh.shape)}: {e}. Snapshots"
            " store each rank's shard as one box of the global tensor: use Shard/Replicate placements, or FSDP2's"
            " _StridedShard layout (fully_shard applied after parallelize_module), or redistribute this tensor"
            " (e.g. to Replicate) before the snapshot"
        ) from None
    coord = mesh.get_coordinate()
    if coord is None:
        raise CaptureError(f"tensor {name!r}: this rank is not part of the DTensor's device mesh {mesh}")
    index = 0
    for c, m in zip(coord, mesh.shape, strict=True):
        index = index * int(m) + int(c)
    box = boxes[index]
    local = t.to_local()
    if tuple(local.shape) != box.shape:
        raise CaptureError(
            f"tensor {name!r}: the local shard has shape {tuple(local.shape)}, but DTensor's geometry for placements"
            f" {placements} on mesh {tuple(mesh.shape)} gives {box.shape} at coordinate {tuple(coord)} (uneven"
            " sharding the format cannot describe)"
        )
    writer = all(c == 0 for c, p in zip(coord, placements, strict=True) if type(p).__name__ == "Replicate")
    writer = writer and _first_copy_in_world(mesh, name)
    if box.numel == 0:
        writer = writer and math.prod(t.shape) == 0 and all(int(c) == 0 for c in coord)
    return box, writer


def _first_copy_in_world(mesh: Any, name: str) -> bool:
    """Whether this rank's mesh is the first of its copies in the world: a DTensor on a sub-mesh (the data-parallel
    dimension of a 2-D mesh) is held, identically, by the ranks of every sibling sub-mesh."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or mesh.size() == dist.get_world_size():
        return True
    root_of = getattr(mesh, "_get_root_mesh", None)
    root = root_of() if callable(root_of) else None
    names = getattr(mesh, "mesh_dim_names", None) or ()
    root_names = getattr(root, "mesh_dim_names", None) or ()
    root_coord = root.get_coordinate() if root is not None else None
    if root is None or root_coord is None or not names or any(n not in root_names for n in names):
        raise CaptureError(
            f"tensor {name!r} is a DTensor on a sub-mesh {mesh} of the world that cannot be related to the world"
            " mesh; which rank writes its shard is unknown. Use a mesh whose dimensions are named sub-dimensions of"
            " the world mesh (as ModelParallelStrategy's are)"
        )
    return all(int(c) == 0 for n, c in zip(root_names, root_coord, strict=True) if n not in names)


def _check(t: torch.Tensor, name: str) -> None:
    if t.layout != torch.strided:
        raise CaptureError(f"tensor {name!r} has layout {t.layout}; only dense (strided) tensors can be stored")
    if t.is_meta:
        raise CaptureError(f"tensor {name!r} is on the meta device and holds no data")
    if t.is_quantized or t.dtype not in DTYPES.values():
        raise CaptureError(f"tensor {name!r} has dtype {t.dtype}, which the format does not store: {sorted(DTYPES)}")


def _identity(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def prepare_tensors(
    tensors: dict[str, torch.Tensor],
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str], dict[str, tuple[tuple[int, ...], tuple[int, ...]]]]:
    """The tensors of an encoding (:func:`~lightning_snapshot.format.tree.encode`) as they are staged.

    Returns ([(name, tensor to copy)], aliases, shards), with tied views found and every tensor checked. DTensors
    become their local shard, listed in ``shards`` as (global shape, global offsets); shards this rank does not
    write (a replica another rank writes, an empty shard) are left out of the tensors to copy.
    """
    items: list[tuple[str, torch.Tensor]] = []
    aliases: dict[str, str] = {}
    shards: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    canonical: dict[tuple[Any, ...], str] = {}
    for name, t in tensors.items():
        if is_dtensor(t):
            box, writer = dtensor_box(t, name)
            if not writer:
                continue
            shards[name] = (tuple(int(g) for g in t.shape), box.offsets)
            t = t.to_local()
        _check(t, name)
        t = t.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        key = (_identity(t), shards.get(name)) if t.numel() else None  # a shard only ties to the same box
        if key is not None and key in canonical:
            aliases[name] = canonical[key]
            continue
        items.append((name, t))
        if key is not None:
            canonical[key] = name
    return items, aliases, shards


def _prepare(
    obj: Any, prefix: str
) -> tuple[Any, list[tuple[str, torch.Tensor]], dict[str, str], dict[str, tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Encode ``obj``; returns (tree, [(name, tensor to copy)], aliases, shards) (see :func:`prepare_tensors`)."""
    tree, tensors = _tree.encode(obj, prefix)
    return (tree, *prepare_tensors(tensors))


def stage(obj: Any, prefix: str = "") -> StagedState:
    """Encode ``obj`` and copy every tensor in it to fresh contiguous host memory (synchronously).

    Tensors that are the very same view of the same memory (tied weights) are copied once and recorded as aliases.

    Raises:
        CaptureError: a value or tensor the format cannot store.
    """
    tree, items, aliases, shards = _prepare(obj, prefix)
    staged = StagedState(tree, aliases=aliases, shards=shards)
    for name, t in items:  # (one call per tensor: a contiguous copy in host memory)
        staged.tensors[name] = t.to("cpu", copy=True, memory_format=torch.contiguous_format)
    return staged


#: Elements checked at once by :func:`nonfinite_tensors` (bounds its temporary memory to 4 MiB of booleans).
_FINITE_BLOCK = 4 << 20


#: dtypes numpy checks itself (single-threaded, without the GIL: it does not compete with torch's intra-op threads of
#: the training thread); the others go through torch.
_NUMPY_FINITE = (torch.float64, torch.float32, torch.float16)


def block_finite(block: np.ndarray) -> bool:
    """Whether every value of the real floating-point array ``block`` is finite.

    A NaN or an infinity makes the sum non-finite, so a finite sum proves the block finite in one pass without
    allocating a mask; a non-finite sum (or an overflow of finite values) is checked exactly.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.add.reduce(block))) or bool(np.isfinite(block).all())


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every value of the contiguous host tensor ``t`` (real floating point) is finite; checked in blocks
    of :data:`_FINITE_BLOCK` elements, stopping at the first block with a NaN or an infinity."""
    flat = t.reshape(-1)
    as_numpy = flat.numpy() if t.dtype in _NUMPY_FINITE else None
    for a in range(0, flat.numel(), _FINITE_BLOCK):
        if as_numpy is not None:
            ok = block_finite(as_numpy[a : a + _FINITE_BLOCK])
        else:
            part = flat[a : a + _FINITE_BLOCK]
            try:
                ok = bool(torch.isfinite(part).all())
            except (RuntimeError, TypeError, NotImplementedError):  # a dtype without isfinite (some float8 kinds)
                ok = bool(torch.isfinite(part.to(torch.float32)).all())
        if not ok:
            return False
    return True


def _finite_runs(staged: StagedState) -> set[str]:
    """The tensors of a packed state (the arena's region) proven finite by checking whole runs of the region at once:
    consecutive tensors of one dtype that numpy checks are viewed, padding included, as one array of that dtype (a
    few numpy calls for any number of small tensors). A run that is not all finite (a NaN or an infinity in one of
    its tensors, or in the padding between them) proves nothing: its tensors are then checked one by one."""
    if staged.packed is None or not staged.layout:
        return set()
    runs: list[list[Any]] = []  # [dtype, start, end, names]
    run: list[Any] | None = None
    tensors = staged.tensors
    for name, offset, nbytes in staged.layout:
        dtype = tensors[name].dtype
        if dtype not in _NUMPY_FINITE or offset % dtype.itemsize or nbytes % dtype.itemsize:
            run = None  # (a run never spans another dtype's bytes)
        elif run is not None and run[0] == dtype and run[2] <= offset:
            run[2] = offset + nbytes
            run[3].append(name)
        else:
            run = [dtype, offset, offset + nbytes, [name]]
            runs.append(run)
    region = np.frombuffer(staged.packed, dtype=np.uint8)
    finite: set[str] = set()
    for dtype, start, end, names in runs:
        view = region[start:end].view(_NUMPY_DTYPES[dtype])
        if all(block_finite(view[a : a + _FINITE_BLOCK]) for a in range(0, view.size, _FINITE_BLOCK)):
            finite.update(names)
    return finite


_NUMPY_DTYPES = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16}


def nonfinite_tensors(staged: StagedState) -> list[str]:
    """The staged (host) tensors of ``staged`` that hold a NaN or an infinity: the first of each health group
    (:func:`~lightning_snapshot.format.manifest.health_group`), in staging order. Integer and bool tensors are always
    finite.

    One pass over the staged floating-point bytes, off the training thread: the persist thread or the snapshot agent
    calls it while it writes. Not in the arena's copy thread, although its blocks are in the cache there: the
    training thread waits for that thread before the next optimizer step, so its work can add to the stall, and a
    finite-check fused into it cost as much CPU as this separate pass (benchmarks/stall.py, ``ours-local-nohealth``).
    The result is kept in ``staged.nonfinite``, so several tiers compute it once.
    """
    if staged.nonfinite is not None:
        return staged.nonfinite
    from lightning_snapshot.format.manifest import health_group

    finite = _finite_runs(staged)
    bad: dict[str, str] = {}
    for name, t in staged.tensors.items():
        if name in finite:
            continue
        group = health_group(name)
        if group in bad or not (t.dtype.is_floating_point or t.dtype.is_complex) or not t.numel():
            continue
        if not _all_finite(torch.view_as_real(t) if t.dtype.is_complex else t):
            bad[group] = name
    staged.nonfinite = list(bad.values())
    return staged.nonfinite


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # numpy's stubs: buffer only on 3.12+


def dtype_str(t: torch.Tensor) -> str:
    return dtype_name(t.dtype)


#: Below this, the one-shot hash (which holds the GIL) is cheaper than the streaming one (which releases it).
SMALL_HASH = 64 << 10


def digest(view: memoryview) -> str:
    """The xxh3-64 hex digest of ``view``; large buffers through the streaming API, which releases the GIL."""
    if view.nbytes < SMALL_HASH:
        return xxhash.xxh3_64_hexdigest(view)
    h = xxhash.xxh3_64()
    h.update(view)
    return h.hexdigest()


def chunk_digests(view: memoryview, chunk_bytes: int) -> list[str]:
    """xxh3-64 hex digests of ``view``'s checksum chunks (the GIL is released while hashing large chunks)."""
    if view.nbytes <= chunk_bytes and view.nbytes < SMALL_HASH:  # (one small chunk, in one call: most tensors)
        return [xxhash.xxh3_64_hexdigest(view)]
    return [digest(view[a:b]) for a, b in chunk_ranges(view.nbytes, chunk_bytes)]
