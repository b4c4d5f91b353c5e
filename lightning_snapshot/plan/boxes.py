"""Pure geometry of tensor boxes: the box a rank holds of a global tensor under a device mesh's placements, and the
checks that saved fragments neither overlap nor leave a hole. No I/O, no process group, no torch.distributed.

One job: the boxes :mod:`~lightning_snapshot.plan.planner`'s resharding reads are planned over (:class:`Box`,
:func:`shard_boxes`, :func:`even_shards`), and the manifest's coverage checks (:func:`overlapping_boxes`,
:func:`missing_region`). Re-exported by :mod:`~lightning_snapshot.plan.planner`, where callers import them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Box", "even_shards", "missing_region", "overlapping_boxes", "shard_boxes"]


@dataclass(frozen=True)
class Box:
    """An axis-aligned box of a tensor: ``offsets`` (its first index) and ``shape``, one entry per dimension.

    A 0-d tensor is the box ``Box((), ())`` with one element. A box with a zero in ``shape`` is empty.
    """

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if len(self.offsets) != len(self.shape):
            raise ValueError(f"Box offsets {self.offsets} and shape {self.shape} have different lengths")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.shape):
            raise ValueError(f"Box offsets {self.offsets} and shape {self.shape} must be non-negative")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        """The box of a whole tensor of ``shape``."""
        return cls((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def end(self) -> tuple[int, ...]:
        """One past the last index, per dimension."""
        return tuple(o + s for o, s in zip(self.offsets, self.shape, strict=True))

    @property
    def numel(self) -> int:
        """Number of elements (1 for a 0-d box, 0 for an empty one)."""
        return math.prod(self.shape)

    def intersect(self, other: Box) -> Box | None:
        """The overlap of two boxes, or None when they do not share an element.

        Raises:
            ValueError: the boxes have different numbers of dimensions.
        """
        if self.ndim != other.ndim:
            raise ValueError(f"cannot intersect a {self.ndim}-d box with a {other.ndim}-d box")
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.end, other.end, strict=True))
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))

    def contains(self, other: Box) -> bool:
        """Whether ``other`` lies inside this box (an empty box lies inside any box whose bounds hold it)."""
        if self.ndim != other.ndim:
            return False
        return all(
            a <= b and be <= ae for a, b, ae, be in zip(self.offsets, other.offsets, self.end, other.end, strict=True)
        )

    def translate(self, origin: Sequence[int]) -> Box:
        """This box in the coordinates of a box that starts at ``origin`` (``offsets - origin``)."""
        return Box(tuple(o - g for o, g in zip(self.offsets, origin, strict=True)), self.shape)

    def slices(self) -> tuple[slice, ...]:
        """Index this box out of an array: ``array[box.slices()]``."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.shape, strict=True))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.shape, strict=True)) + "]"


# -- which box each rank of a device mesh owns


def _placement(placement: Any, ndim: int) -> tuple[str, int | None, int]:
    """``(kind, tensor dim, split factor)`` of a placement; kind ``"replicate"`` (dim None), ``"shard"``, ``"strided"``.

    Accepts tuples (``("replicate",)``, ``("shard", dim)``, ``("strided", dim, split_factor)``) or torch's
    ``Replicate``/``Shard``/``_StridedShard`` objects, duck-typed by class name (no torch import here).
    """
    if isinstance(placement, str):
        placement = (placement,)
    split_factor = 1
    if isinstance(placement, (tuple, list)) and placement:
        kind = placement[0]
        if kind == "replicate" and len(placement) == 1:
            return "replicate", None, 1
        if kind == "shard" and len(placement) == 2 and isinstance(placement[1], int):
            dim = placement[1]
        elif (
            kind == "strided"
            and len(placement) == 3
            and isinstance(placement[1], int)
            and isinstance(placement[2], int)
            and placement[2] >= 1
        ):
            dim, split_factor = placement[1], placement[2]
        else:
            raise ValueError(
                f"unknown placement {placement!r}; expected ('shard', dim), ('strided', dim,"
                " split_factor) or ('replicate',)"
            )
    else:
        name = type(placement).__name__  # duck-typed torch.distributed.tensor placements, without importing them
        if name == "Replicate":
            return "replicate", None, 1
        attr = getattr(placement, "dim", None)
        if name == "Shard" and isinstance(attr, int):
            kind, dim = "shard", attr
        elif name == "_StridedShard" and isinstance(attr, int):
            kind, dim = "strided", attr
            try:
                split_factor = int(placement.split_factor)
            except (AttributeError, TypeError, ValueError):
                split_factor = 0
            if split_factor < 1:
                raise ValueError(f"placement {placement!r} has no usable split_factor")
        else:
            raise ValueError(
                f"placement {placement!r} is not supported by the resharding planner: only Shard(dim),"
                " _StridedShard(dim, split_factor) and Replicate() are (no Partial)"
            )
    if not -ndim <= dim < ndim:
        raise ValueError(f"placement {placement!r} shards dim {dim} of a {ndim}-d tensor")
    return kind, dim % ndim, split_factor


def _chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """``[lo, hi)`` of chunk ``i`` when ``torch.chunk`` splits ``n`` elements into ``k`` (empty chunks at the end)."""
    size = -(-n // k)
    lo = min(n, size * i)
    return lo, min(n, lo + size)


def _take(runs: list[tuple[int, int]], lo: int, hi: int, out: list[tuple[int, int]]) -> None:
    """Append elements ``lo:hi`` of a sequence of global indices (as runs ``[a, b)``) to ``out``, merging runs."""
    pos = 0
    for a, b in runs:
        s, e = max(lo, pos), min(hi, pos + b - a)
        if s < e:
            start, stop = a + s - pos, a + e - pos
            if out and out[-1][1] == start:
                out[-1] = (out[-1][0], stop)
            else:
                out.append((start, stop))
        pos += b - a
        if pos >= hi:
            break


def _dim_order(
    mesh_dims: list[int], kinds: dict[int, tuple[str, int]], mesh_shape: tuple[int, ...]
) -> list[int] | None:
    """The order in which the mesh dims that shard one tensor dim split it, when every ``_StridedShard`` among them
    is FSDP2's (its split factor is the product of the sizes of the mesh dims to its right that shard the same tensor
    dim): those mesh dims split first and the strided one splits inside each of their pieces (right to left), the
    others left to right. None when some ``_StridedShard`` is not of that form."""
    order: list[int] = []
    for i in reversed(mesh_dims):
        kind, sf = kinds[i]
        if kind == "strided":
            if sf != math.prod(mesh_shape[j] for j in mesh_dims if j > i):
                return None
            order.append(i)  # after every mesh dim to its right
        else:
            order.insert(0, i)
    return order


def shard_boxes(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any]) -> list[Box]:
    """The box of the global tensor that each rank of a device mesh owns, following DTensor's placements.

    One placement per mesh dimension: ``("shard", dim)``, ``("strided", dim, split_factor)`` or ``("replicate",)``
    (torch's ``Shard(dim)``, ``_StridedShard(dim, split_factor=...)`` and ``Replicate()`` objects are accepted too).
    Mesh dimensions are applied left to right, as
    ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` does; a dim sharded by several mesh
    dimensions is split again inside the previous split.

    Splitting follows ``torch.chunk``: ``n`` elements over ``k`` ranks give chunks of ``ceil(n / k)``; the last
    non-empty chunk may be smaller and later ranks get EMPTY shards (5 over 4 is 2, 2, 1, 0, not
    ``torch.tensor_split``'s 2, 1, 1, 1). Like torch, an empty shard's offset in the split dim is that dim's global
    size (``Box((5, 0), (0, 3))`` for rank 3 above).

    ``_StridedShard`` is the layout FSDP2's ``fully_shard`` gives a parameter that tensor parallelism already sharded
    on the same dim (placements ``(_StridedShard(0, split_factor=tp), Shard(0))`` on a (dp, tp) mesh): the tensor
    is split by the mesh dims to the right first (the tensor-parallel chunk), and the data-parallel split is taken
    inside each of their chunks, so every rank still owns one box. This is what FSDP2 stores (measured with torch
    2.13, including uneven sizes), and where torch's own ``compute_local_shape_and_global_offset`` disagrees for
    uneven sizes (7 rows on a (3, 2) mesh) the local shards follow this geometry. A ``_StridedShard`` whose split
    factor is not the product of the sizes of the mesh dims to its right that shard the same tensor dim is applied
    with torch's strided semantics (split into ``split_factor`` pieces, each split over the mesh dim, the rank's
    parts concatenated); when that leaves a rank with non-contiguous indices it is not a box and raises.

    Args:
        global_shape: shape of the global tensor.
        mesh_shape: sizes of the device mesh's dimensions.
        placements: one placement per mesh dimension.

    Returns:
        One box per rank, ranks enumerated row-major over the mesh (rank = ravel of its mesh coordinate).

    Raises:
        ValueError: mismatched lengths, a mesh dimension below 1, a dim out of range, an unknown placement, or a
            ``_StridedShard`` layout in which some rank's shard is not one box.
    """
    global_shape = tuple(int(g) for g in global_shape)
    mesh_shape = tuple(int(m) for m in mesh_shape)
    if len(mesh_shape) != len(placements):
        raise ValueError(f"mesh_shape {mesh_shape} has {len(mesh_shape)} dims but {len(placements)} placements")
    if any(m < 1 for m in mesh_shape):
        raise ValueError(f"mesh_shape {mesh_shape} has a dimension below 1")
    if any(g < 0 for g in global_shape):
        raise ValueError(f"global_shape {global_shape} has a negative dimension")
    parsed = [_placement(p, len(global_shape)) for p in placements]
    # per sharded tensor dim: the mesh dims that split it, in order, and whether they nest (None: torch's strided
    # semantics, left to right)
    plans: dict[int, tuple[list[int], bool]] = {}
    for dim in sorted({d for _, d, _ in parsed if d is not None}):
        mesh_dims = [i for i, (_, d, _) in enumerate(parsed) if d == dim]
        order = _dim_order(mesh_dims, {i: (parsed[i][0], parsed[i][2]) for i in mesh_dims}, mesh_shape)
        plans[dim] = (order, True) if order is not None else (mesh_dims, False)
    boxes = []
    for rank in range(math.prod(mesh_shape)):
        coord = []
        r = rank
        for m in reversed(mesh_shape):
            coord.append(r % m)
            r //= m
        coord.reverse()
        start = [0] * len(global_shape)
        size = list(global_shape)
        for dim, (order, nested) in plans.items():
            runs = [(0, global_shape[dim])] if global_shape[dim] else []
            for mesh_dim in order:
                kind, _, split_factor = parsed[mesh_dim]
                n = sum(b - a for a, b in runs)
                k, c = mesh_shape[mesh_dim], coord[mesh_dim]
                new: list[tuple[int, int]] = []
                if kind == "shard" or nested:
                    _take(runs, *_chunk(n, k, c), new)
                else:  # torch's _StridedShard: split_factor pieces, each split over the mesh dim, concatenated
                    for j in range(split_factor):
                        lo, hi = _chunk(n, split_factor, j)
                        a, b = _chunk(hi - lo, k, c)
                        _take(runs, lo + a, lo + b, new)
                runs = new
            if not runs:  # torch puts an empty shard at the end of the dim
                start[dim], size[dim] = global_shape[dim], 0
            elif len(runs) == 1:
                start[dim], size[dim] = runs[0][0], runs[0][1] - runs[0][0]
            else:
                shown = ", ".join(f"{a}:{b}" for a, b in runs[:4]) + (", ..." if len(runs) > 4 else "")
                raise ValueError(
                    f"placements {tuple(placements)} on mesh {mesh_shape} give the rank at mesh coordinate"
                    f" {tuple(coord)} the indices [{shown}] of dim {dim} (of {global_shape[dim]}): not one box"
                )
        boxes.append(Box(tuple(start), tuple(size)))
    return boxes


def even_shards(global_shape: Sequence[int], world: int, dim: int = 0) -> list[Box]:
    """The boxes of ``Shard(dim)`` over a 1-D mesh of ``world`` ranks (FSDP2's layout); see :func:`shard_boxes`."""
    return shard_boxes(global_shape, (world,), [("shard", dim)])


def overlapping_boxes(boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[int, int] | None:
    """Indices of two non-empty boxes (``(offsets, shape)``) that share an element, or None when none do.

    A sweep along the dimension where the boxes start at the most distinct places (dim 0 for row shards, dim 1 for
    column shards): each box is only compared with the boxes that start before it ends there.
    """
    live = [(tuple(o), tuple(s), i) for i, (o, s) in enumerate(boxes) if math.prod(s) > 0]
    if len(live) < 2:
        return None
    ndim = len(live[0][0])
    if ndim == 0:
        return live[0][2], live[1][2]
    dim = max(range(ndim), key=lambda d: len({o[d] for o, _, _ in live}))
    live.sort(key=lambda b: b[0][dim])
    for n, (o, s, i) in enumerate(live):
        end = o[dim] + s[dim]
        for o2, s2, j in live[n + 1 :]:
            if o2[dim] >= end:
                break
            if all(a < b2 + c2 and b2 < a + c for a, c, b2, c2 in zip(o, s, o2, s2, strict=True)):
                return (i, j) if i < j else (j, i)
    return None


def missing_region(global_shape: tuple[int, ...], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> str:
    """Bounding box of the elements no box (``(offsets, shape)``) covers, or that several cover, as text."""
    if not boxes:
        return f"offsets {[0] * len(global_shape)} shape {list(global_shape)} (the whole tensor)"
    if math.prod(global_shape) > 1 << 24:
        return "not computed for tensors this large"
    import numpy as np

    count = np.zeros(global_shape, dtype=np.int32)
    for offsets, shape in boxes:
        count[tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))] += 1
    bad = np.argwhere(count != 1)
    lo, hi = bad.min(axis=0), bad.max(axis=0) + 1
    return f"offsets {lo.tolist()} shape {(hi - lo).tolist()}"
