"""The resharding planner: DTensor shard geometry, read plans and their volume, end to end in memory.

Pure: no process group, no files. Saved snapshots are simulated as one fake data object (bytes) per source rank,
holding that rank's fragments laid out by ``plan_layout`` with real xxh3 chunk checksums; a small executor below
applies a plan to those bytes (verifying every chunk it reads) and the result is compared with the global tensor.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_snapshot.format.manifest import Fragment, Manifest, ObjectEntry, TensorEntry
from lightning_snapshot.plan.planner import (
    Box,
    ReadItem,
    bytes_needed,
    bytes_planned,
    chunk_ranges,
    even_shards,
    plan_layout,
    plan_tensor_reads,
    shard_boxes,
)

try:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - older torch
    _compute_local_shape_and_global_offset = None

ALIGNMENT = 64
DTYPES = {"float32": 4, "bfloat16": 2, "int64": 8}
HYP = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

S0, S1, S2, R = ("shard", 0), ("shard", 1), ("shard", 2), ("replicate",)


# ---------------------------------------------------------------------------------------------------- helpers


def make_global(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    """A random global tensor as a numpy array (bfloat16 as its uint16 bit pattern)."""
    rng = np.random.default_rng(seed)
    if dtype == "int64":
        return rng.integers(-(2**62), 2**62, size=shape, dtype=np.int64)
    values = rng.standard_normal(size=shape).astype(np.float32)
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16).view(torch.uint16).numpy()
    return values


def save(
    tensors: dict[str, np.ndarray], boxes: list[Box], chunk_bytes: int, *, dedupe: bool = True, seed: int = 0
) -> tuple[dict[str, bytes], dict[str, TensorEntry]]:
    """Simulate each source rank saving its own shard of every tensor into one data object.

    With ``dedupe`` only the first rank holding a box writes it (as the writer does for replicated shards).
    Padding between fragments is random garbage, so a plan that reads outside its fragments gives wrong values.
    """
    rng = np.random.default_rng(seed + 1)
    objects: dict[str, bytes] = {}
    fragments: dict[str, list[Fragment]] = {name: [] for name in tensors}
    seen: set[tuple[str, Box]] = set()
    for rank, box in enumerate(boxes):
        key = f"rank-{rank}.data"
        blobs = []
        for name, arr in tensors.items():
            if dedupe and (name, box) in seen:
                continue
            seen.add((name, box))
            blobs.append((name, np.ascontiguousarray(arr[box.slices()]).tobytes()))
        placed, size = plan_layout([(name, len(b)) for name, b in blobs], ALIGNMENT)
        buf = bytearray(rng.integers(0, 256, size=size + 17, dtype=np.uint8).tobytes())
        for (name, blob), (_, offset) in zip(blobs, placed):
            buf[offset : offset + len(blob)] = blob
            sums = tuple(xxhash.xxh3_64_hexdigest(blob[s:e]) for s, e in chunk_ranges(len(blob), chunk_bytes))
            fragments[name].append(Fragment(key, offset, len(blob), box.offsets, box.shape, sums))
        objects[key] = bytes(buf)
    entries = {
        name: TensorEntry(name, dtype_of(arr), arr.shape, tuple(fragments[name])) for name, arr in tensors.items()
    }
    return objects, entries


def dtype_of(arr: np.ndarray) -> str:
    return {np.dtype(np.float32): "float32", np.dtype(np.uint16): "bfloat16", np.dtype(np.int64): "int64"}[arr.dtype]


def execute(
    items: list[ReadItem], objects: dict[str, bytes], entry: TensorEntry, target: Box, np_dtype: np.dtype
) -> tuple[np.ndarray, int]:
    """Apply a plan to in-memory objects: read only the planned ranges, verify their chunks, copy the overlaps.

    Returns the target shard and the number of bytes read.
    """
    itemsize = np.dtype(np_dtype).itemsize
    out = np.zeros(target.shape, dtype=np_dtype)
    covered = np.zeros(target.shape, dtype=bool)
    garbage = np.random.default_rng(123)
    read = 0
    for item in items:
        frag = entry.fragments[item.fragment_index]
        assert (item.object, item.offset, item.nbytes) == (frag.object, frag.offset, frag.nbytes)
        assert item.fragment_shape == tuple(frag.local_shape)
        data = np.frombuffer(objects[item.object], dtype=np.uint8)
        buf = garbage.integers(0, 256, size=item.nbytes, dtype=np.uint8)  # bytes not read stay garbage
        mask = np.zeros(item.nbytes, dtype=bool)
        for start, end in item.read_ranges:
            assert 0 <= start < end <= item.nbytes
            buf[start:end] = data[item.offset + start : item.offset + end]
            mask[start:end] = True
            read += end - start
        # the ranges are exactly the listed checksum chunks, and every chunk verifies
        chunk_mask = np.zeros(item.nbytes, dtype=bool)
        for i in item.chunk_indices:
            start, end = item.chunk_range(i)
            assert (start, end) == chunk_ranges(item.nbytes, item.chunk_bytes)[i]
            chunk_mask[start:end] = True
            assert xxhash.xxh3_64_hexdigest(buf[start:end].tobytes()) == frag.checksums[i], "checksum mismatch"
        assert np.array_equal(mask, chunk_mask)
        # every byte of the overlap was read
        elems = np.arange(math.prod(item.fragment_shape)).reshape(item.fragment_shape)[item.src_box.slices()]
        needed = (elems.reshape(-1, 1) * itemsize + np.arange(itemsize)).ravel()
        assert mask[needed].all(), "plan misses bytes of the overlap"
        arr = buf.view(np_dtype).reshape(item.fragment_shape)
        out[item.dst_box.slices()] = arr[item.src_box.slices()]
        covered[item.dst_box.slices()] = True
    assert covered.all(), "plan leaves part of the target unfilled"
    return out, read


def brute_force_ranges(
    shape: tuple[int, ...], src: Box, itemsize: int, chunk_bytes: int, nbytes: int
) -> tuple[list[tuple[int, int]], int]:
    """Reference: enumerate the overlap's elements, split into contiguous runs, expand to chunks, merge.

    Returns (merged ranges, number of runs).
    """
    elems = np.arange(math.prod(shape)).reshape(shape)[src.slices()].ravel()
    if elems.size == 0:
        return [], 0
    breaks = np.nonzero(np.diff(elems) != 1)[0]
    starts = np.concatenate([[elems[0]], elems[breaks + 1]])
    ends = np.concatenate([elems[breaks], [elems[-1]]]) + 1
    merged: list[list[int]] = []
    for s, e in zip(starts * itemsize, ends * itemsize):
        a = int(s) // chunk_bytes * chunk_bytes
        b = min(-(-int(e) // chunk_bytes) * chunk_bytes, nbytes)
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged], len(starts)


def reshard(
    shape: tuple[int, ...], src_mesh, src_pl, tgt_mesh, tgt_pl, chunk_bytes: int, seed: int = 0, dtypes=tuple(DTYPES)
) -> list[tuple[Box, list[ReadItem], int, int]]:
    """Save ``shape``-d tensors of every dtype under one layout, load them under another, check every shard.

    Returns per (tensor, target rank): (target box, items, bytes needed, bytes read).
    """
    tensors = {f"t_{dt}": make_global(shape, dt, seed + i) for i, dt in enumerate(dtypes)}
    objects, entries = save(tensors, shard_boxes(shape, src_mesh, src_pl), chunk_bytes, seed=seed)
    results = []
    for name, arr in tensors.items():
        entry = entries[name]
        for target in shard_boxes(shape, tgt_mesh, tgt_pl):
            items = plan_tensor_reads(entry, shape, arr.itemsize, target, chunk_bytes)
            got, read = execute(items, objects, entry, target, arr.dtype)
            assert got.tobytes() == np.ascontiguousarray(arr[target.slices()]).tobytes(), (name, target)
            assert read == bytes_planned(items)
            assert all(item.tensor == name for item in items)
            for item in items:
                ref, _ = brute_force_ranges(item.fragment_shape, item.src_box, arr.itemsize, chunk_bytes, item.nbytes)
                assert list(item.read_ranges) == ref
            results.append((target, items, bytes_needed(target, arr.itemsize), read))
    return results


# ---------------------------------------------------------------------------------------------------- Box


def test_box_basics():
    a = Box((0, 2), (4, 3))
    b = Box((2, 0), (5, 4))
    assert a.numel == 12 and a.end == (4, 5) and str(a) == "[0:4, 2:5]"
    assert a.intersect(b) == Box((2, 2), (2, 2)) == b.intersect(a)
    assert a.intersect(Box((4, 0), (1, 9))) is None  # touching is not overlapping
    assert a.intersect(Box((1, 3), (0, 1))) is None  # an empty box overlaps nothing
    assert a.contains(Box((1, 3), (2, 1))) and not a.contains(b) and a.contains(a)
    assert Box((), ()).numel == 1 and Box((), ()).intersect(Box((), ())) == Box((), ())
    assert Box.whole((3, 0)).numel == 0
    assert a.translate((0, 2)) == Box((0, 0), (4, 3))
    assert np.arange(30).reshape(6, 5)[a.slices()].shape == (4, 3)
    with pytest.raises(ValueError):
        Box((0,), (1, 2))
    with pytest.raises(ValueError):
        Box((-1,), (1,))
    with pytest.raises(ValueError):
        a.intersect(Box((0,), (1,)))
    with pytest.raises(AttributeError):
        a.offsets = (1, 1)  # frozen


# ---------------------------------------------------------------------------------------------------- shard geometry


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 7, 8, 10, 17])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8])
def test_even_shards_follow_torch_chunk(n, k):
    boxes = even_shards((n, 3), k)
    assert len(boxes) == k
    chunks = torch.arange(n).chunk(k) if n else ()
    start = 0
    for rank, box in enumerate(boxes):
        if rank < len(chunks) and chunks[rank].numel():
            assert box == Box((start, 0), (chunks[rank].numel(), 3))
            assert torch.equal(torch.arange(n)[box.slices()[0]], chunks[rank])
            start += chunks[rank].numel()
        else:  # torch.chunk returns fewer chunks; DTensor gives the rest empty shards at the end of the dim
            assert box == Box((n, 0), (0, 3))
    assert sum(b.numel for b in boxes) == 3 * n


def test_uneven_shards_are_chunk_style_not_tensor_split():
    """DTensor's Shard splits like torch.chunk (2, 2, 1, 0), not like torch.tensor_split (2, 1, 1, 1)."""
    assert [b.shape[0] for b in even_shards((5,), 4)] == [2, 2, 1, 0]
    assert [t.numel() for t in torch.arange(5).tensor_split(4)] == [2, 1, 1, 1]
    assert [b.shape[0] for b in even_shards((2, 3), 4)] == [1, 1, 0, 0]  # a dim smaller than the world
    assert [b.shape[1] for b in even_shards((2, 10), 4, dim=1)] == [3, 3, 3, 1]
    assert [b.shape[1] for b in even_shards((2, 10), 4, dim=-1)] == [3, 3, 3, 1]


@pytest.mark.skipif(_compute_local_shape_and_global_offset is None, reason="torch without DTensor utils")
@pytest.mark.parametrize("n", [1, 5, 7, 16])
@pytest.mark.parametrize("k", [1, 3, 4, 6])
def test_even_shards_match_dtensor_split_tensor(n, k):
    """The data DTensor's distribute_tensor puts on each rank (Shard._split_tensor) is global[box]."""
    t = torch.arange(n * 2).reshape(n, 2)
    pieces, _ = Shard(0)._split_tensor(t, k, with_padding=False)
    for box, piece in zip(even_shards((n, 2), k), pieces):
        assert torch.equal(t[box.slices()], piece)


@st.composite
def layouts(draw, ndim: int):
    """A device mesh (1-D up to 6 ranks, or 2-D up to 3x3) and one placement per mesh dim."""
    mesh_ndim = draw(st.integers(1, 2))
    mesh = tuple(draw(st.integers(1, 6 if mesh_ndim == 1 else 3)) for _ in range(mesh_ndim))
    kinds = st.just(R) if ndim == 0 else st.one_of(st.just(R), st.integers(0, ndim - 1).map(lambda d: ("shard", d)))
    return mesh, [draw(kinds) for _ in mesh]


def _torch_placement(p):
    return Replicate() if p == R else Shard(p[1])


@pytest.mark.skipif(_compute_local_shape_and_global_offset is None, reason="torch without DTensor utils")
@HYP
@given(data=st.data(), shape=st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple))
def test_shard_boxes_match_dtensor(data, shape):
    """Offsets and shapes equal torch's compute_local_shape_and_global_offset for every mesh coordinate.

    The public helper needs a DeviceMesh (hence a process group); its mesh-shape/coordinate form is pure.
    """
    mesh, placements = data.draw(layouts(len(shape)))
    boxes = shard_boxes(shape, mesh, placements)
    tp = [_torch_placement(p) for p in placements]
    for rank, box in enumerate(boxes):
        coord = list(np.unravel_index(rank, mesh))
        local, offset = _compute_local_shape_and_global_offset(shape, mesh, [int(c) for c in coord], tp)
        assert box == Box(offset, local), (rank, coord)
    assert shard_boxes(shape, mesh, tp) == boxes  # torch placement objects are accepted too


def test_shard_boxes_2d_mesh():
    # 2x2 mesh, Shard(0) x Shard(1), ranks row-major over the mesh
    assert shard_boxes((4, 6), (2, 2), [S0, S1]) == [
        Box((0, 0), (2, 3)),
        Box((0, 3), (2, 3)),
        Box((2, 0), (2, 3)),
        Box((2, 3), (2, 3)),
    ]
    # the same dim sharded by both mesh dims: split again inside the first split (5 -> 3, 2 -> 2, 1, 1, 1)
    assert shard_boxes((5,), (2, 2), [S0, S0]) == [Box((0,), (2,)), Box((2,), (1,)), Box((3,), (1,)), Box((4,), (1,))]
    # replicate x shard: both rows of the mesh hold the same boxes
    assert shard_boxes((4,), (2, 2), [R, S0]) == [Box((0,), (2,)), Box((2,), (2,))] * 2
    assert shard_boxes((), (3,), [R]) == [Box((), ())] * 3


def test_shard_boxes_rejects_bad_input():
    with pytest.raises(ValueError, match="placements"):
        shard_boxes((4,), (2, 2), [S0])
    with pytest.raises(ValueError, match="dim 1"):
        shard_boxes((4,), (2,), [S1])
    with pytest.raises(ValueError, match="below 1"):
        shard_boxes((4,), (0,), [S0])
    with pytest.raises(ValueError, match="unknown placement"):
        shard_boxes((4,), (2,), [("partial",)])
    with pytest.raises(ValueError, match="unknown placement"):
        shard_boxes((4,), (2,), [("strided", 0, 0)])
    if _compute_local_shape_and_global_offset is not None:
        from torch.distributed.tensor import Partial
        from torch.distributed.tensor.placement_types import _StridedShard

        # torch's strided semantics on a 1-D mesh: rank 0 gets rows 0, 1, 4, 5 of 8: not one box
        with pytest.raises(ValueError, match=r"indices \[0:2, 4:6\] of dim 0 \(of 8\): not one box"):
            shard_boxes((8,), (2,), [_StridedShard(0, split_factor=2)])
        with pytest.raises(ValueError, match="not supported"):
            shard_boxes((8,), (2,), [Partial()])


# ---------------------------------------------------------------------------------- 2-D FSDP2 x tensor parallel

SS2 = ("strided", 0, 2)  # _StridedShard(0, split_factor=2): FSDP2's data-parallel placement over a tp=2 Shard(0)


def test_strided_shard_fsdp2_x_tp_boxes_by_hand():
    """(dp=2, tp=2) mesh, placements (_StridedShard(0, sf=2), Shard(0)): the tensor-parallel chunk first, the
    data-parallel chunk inside it (torch.chunk both times); ranks row-major (dp, tp)."""
    # 8 rows: tp chunks 0:4, 4:8; dp inside: 0:2, 2:4 | 4:6, 6:8
    assert shard_boxes((8, 3), (2, 2), [SS2, S0]) == [
        Box((0, 0), (2, 3)),
        Box((4, 0), (2, 3)),
        Box((2, 0), (2, 3)),
        Box((6, 0), (2, 3)),
    ]
    # 5 rows: tp chunks 0:3, 3:5; dp inside: 0:2, 2:3 | 3:4, 4:5
    assert shard_boxes((5,), (2, 2), [SS2, S0]) == [Box((0,), (2,)), Box((3,), (1,)), Box((2,), (1,)), Box((4,), (1,))]
    # 7 rows: tp chunks 0:4, 4:7; dp inside: 0:2, 2:4 | 4:6, 6:7
    assert shard_boxes((7, 2), (2, 2), [SS2, S0]) == [
        Box((0, 0), (2, 2)),
        Box((4, 0), (2, 2)),
        Box((2, 0), (2, 2)),
        Box((6, 0), (1, 2)),
    ]
    # 3 rows: tp chunks 0:2, 2:3; dp inside: 0:1, 1:2 | 2:3, empty (at the end of the dim, like torch)
    assert shard_boxes((3,), (2, 2), [SS2, S0]) == [Box((0,), (1,)), Box((2,), (1,)), Box((1,), (1,)), Box((3,), (0,))]
    # row-wise TP (Shard(1) on tp) under FSDP2 is plain (Shard(0), Shard(1)); a strided dim next to a sharded one
    assert shard_boxes((5, 4), (2, 2), [("strided", 1, 2), S1]) == [
        Box((0, 0), (5, 1)),
        Box((0, 2), (5, 1)),
        Box((0, 1), (5, 1)),
        Box((0, 3), (5, 1)),
    ]
    # 3-D mesh (HSDP x TP): replicate, strided shard, shard
    boxes = shard_boxes((7,), (2, 2, 2), [R, SS2, S0])
    assert boxes[:4] == boxes[4:] == [Box((0,), (2,)), Box((4,), (2,)), Box((2,), (2,)), Box((6,), (1,))]


def _fsdp2_local(t: torch.Tensor, dp: int, tp: int, d: int, c: int) -> torch.Tensor:
    """What FSDP2 stores on mesh coordinate (d, c) of a (dp, tp) mesh for a column-wise (Shard(0)) TP parameter:
    DTensor's Shard(0) split over tp (parallelize_module), then FSDP2's own chunking of that over dp (fully_shard)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    tp_local = Shard(0)._split_tensor(t, tp, with_padding=False)[0][c]
    return _chunk_with_empty(tp_local, dp, dim=0)[d]


@pytest.mark.skipif(_compute_local_shape_and_global_offset is None, reason="torch without DTensor utils")
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 8, 13, 27])
@pytest.mark.parametrize("dp,tp", [(2, 2), (2, 3), (3, 2), (4, 2), (3, 4), (1, 2)])
def test_strided_shard_boxes_are_what_fsdp2_stores(n, dp, tp):
    """Each rank's box holds exactly the rows FSDP2 x TP puts on it (torch's own splitting code, no process group),
    with torch's _StridedShard object; the boxes tile the tensor."""
    from torch.distributed.tensor.placement_types import _StridedShard

    t = torch.arange(n * 3).reshape(n, 3)
    boxes = shard_boxes((n, 3), (dp, tp), [_StridedShard(0, split_factor=tp), Shard(0)])
    assert boxes == shard_boxes((n, 3), (dp, tp), [("strided", 0, tp), S0])
    covered = torch.zeros(n, 3, dtype=torch.int64)
    for rank, box in enumerate(boxes):
        d, c = divmod(rank, tp)
        stored = _fsdp2_local(t, dp, tp, d, c)
        if stored.numel() == 0:  # FSDP2's empty chunk is a 1-d tensor([]); its local shard is (0, 3)
            assert box.numel == 0 and box.offsets[0] == n, (rank, box)
        else:
            assert torch.equal(t[box.slices()], stored), (rank, box)
        covered[box.slices()] += 1
    assert bool((covered == 1).all())


@pytest.mark.skipif(_compute_local_shape_and_global_offset is None, reason="torch without DTensor utils")
@pytest.mark.parametrize("n", range(0, 20))
def test_strided_shard_2x2_matches_torch_compute_local_shape_and_global_offset(n):
    """On a 2x2 mesh torch's own geometry for (_StridedShard(0, sf=2), Shard(0)) gives the same boxes. (On larger
    meshes with uneven sizes, e.g. 7 rows on (3, 2), torch's compute_local_shape_and_global_offset disagrees with
    the rows FSDP2 actually stores, measured with torch 2.13; the boxes follow the stored rows.)"""
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = [_StridedShard(0, split_factor=2), Shard(0)]
    for rank, box in enumerate(shard_boxes((n, 4), (2, 2), placements)):
        local, offset = _compute_local_shape_and_global_offset((n, 4), (2, 2), list(divmod(rank, 2)), placements)
        assert box.shape == tuple(local), rank
        if box.numel:
            assert box.offsets == tuple(offset), rank


def _torch_split_indices(n: int, mesh: tuple[int, ...], coord: tuple[int, ...], placements) -> list[int]:
    """The global indices (of a 1-d tensor of n) that distribute_tensor's splitting puts on ``coord``, applying
    torch's own Shard/_StridedShard._split_tensor left to right."""
    local = torch.arange(n)
    for m, c, p in zip(mesh, coord, placements):
        if type(p).__name__ != "Replicate":
            local = p._split_tensor(local, m, with_padding=False)[0][c]
    return local.tolist()


@pytest.mark.skipif(_compute_local_shape_and_global_offset is None, reason="torch without DTensor utils")
@HYP
@given(n=st.integers(0, 17), mesh=st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple), data=st.data())
def test_other_strided_shards_follow_torch_or_are_refused(n, mesh, data):
    """A _StridedShard that is not FSDP2's (split factor not the product of the later mesh dims sharding the dim)
    follows torch's strided semantics: the box of every rank holds exactly what torch's splitting gives it, or,
    when some rank's indices are not contiguous, shard_boxes refuses the layout."""
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = [
        data.draw(st.sampled_from([Replicate(), Shard(0), _StridedShard(0, split_factor=data.draw(st.integers(1, 4)))]))
        for _ in mesh
    ]
    fsdp2_like = all(
        p.split_factor
        == math.prod(mesh[j] for j in range(i + 1, len(mesh)) if type(placements[j]).__name__ != "Replicate")
        for i, p in enumerate(placements)
        if type(p).__name__ == "_StridedShard"
    )
    coords = list(np.ndindex(*mesh))
    expected = [_torch_split_indices(n, mesh, c, placements) for c in coords]
    contiguous = all(idx == list(range(idx[0], idx[0] + len(idx))) for idx in expected if idx)
    if fsdp2_like:  # covered against FSDP2's own chunking above
        return
    if not contiguous:
        with pytest.raises(ValueError, match="not one box"):
            shard_boxes((n,), mesh, placements)
        return
    for c, box, idx in zip(coords, shard_boxes((n,), mesh, placements), expected):
        assert box.shape == (len(idx),), c
        if idx:
            assert box.offsets == (idx[0],), c


# ---------------------------------------------------------------------------------------------------- end to end

CASES = {
    # name: (global shape, source mesh, source placements, target mesh, target placements)
    "8->4": ((40, 24), (8,), [S0], (4,), [S0]),
    "4->3": ((10, 7), (4,), [S0], (3,), [S0]),
    "4->8": ((37, 5), (4,), [S0], (8,), [S0]),
    "2x2->4": ((12, 10), (2, 2), [S0, S1], (4,), [S0]),
    "4->2x2": ((12, 10), (4,), [S0], (2, 2), [S0, S1]),
    "8->1": ((9, 4, 3), (8,), [S0], (1,), [S0]),
    "2x2->1": ((7, 9), (2, 2), [S0, S1], (1,), [R]),
    "1->5": ((13, 3), (1,), [R], (5,), [S0]),
    "1d-8->3": ((37,), (8,), [S0], (3,), [S0]),
    "dim<world-8->4": ((3, 5), (8,), [S0], (4,), [S0]),
    "dim<world-2->6": ((4, 2), (2,), [S1], (6,), [S1]),
    "replicated-source": ((11, 6), (2, 2), [R, S0], (3,), [S0]),
    "replicated-target": ((11, 6), (4,), [S0], (2, 3), [S0, R]),
    "col->row": ((10, 13), (3,), [S1], (4,), [S0]),
    "row->col": ((10, 13), (4,), [S0], (3,), [S1]),
    "3d-2x2->3": ((5, 6, 7), (2, 2), [S1, S2], (3,), [S0]),
    "3d-3->2x2": ((5, 6, 7), (3,), [S2], (2, 2), [S0, S1]),
    "same-dim-2x2->3": ((11, 3), (2, 2), [S0, S0], (3,), [S0]),
    "fsdp2xtp-2x2->4": ((7, 6), (2, 2), [SS2, S0], (4,), [S0]),  # 2-D FSDP2 x TP, uneven rows
    "4->fsdp2xtp-2x2": ((5, 6), (4,), [S0], (2, 2), [SS2, S0]),
    "fsdp2xtp-2x2->1": ((5, 3), (2, 2), [SS2, S0], (1,), [R]),
    "fsdp2xtp-2x2->row-wise-2x2": ((7, 6), (2, 2), [SS2, S0], (2, 2), [S0, S1]),
    "empty-tensor": ((0, 4), (2,), [S0], (3,), [S0]),
    "scalar": ((), (2,), [R], (3,), [R]),
}


@pytest.mark.parametrize("chunk_bytes", [7, 256])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_reshard_end_to_end(case, chunk_bytes):
    shape, src_mesh, src_pl, tgt_mesh, tgt_pl = case
    results = reshard(shape, src_mesh, src_pl, tgt_mesh, tgt_pl, chunk_bytes)
    assert len(results) == len(DTYPES) * math.prod(tgt_mesh)


@HYP
@given(
    data=st.data(),
    shape=st.lists(st.integers(0, 8), min_size=0, max_size=3).map(tuple),
    chunk_bytes=st.sampled_from([1, 5, 16, 64, 256]),
    dtype=st.sampled_from(list(DTYPES)),
    seed=st.integers(0, 2**16),
)
def test_reshard_random(data, shape, chunk_bytes, dtype, seed):
    src_mesh, src_pl = data.draw(layouts(len(shape)), label="source")
    tgt_mesh, tgt_pl = data.draw(layouts(len(shape)), label="target")
    for _target, items, needed, read in reshard(
        shape, src_mesh, src_pl, tgt_mesh, tgt_pl, chunk_bytes, seed, dtypes=(dtype,)
    ):
        # the general bound: every run grows by less than a chunk at each end, and no fragment is over-read
        for item in items:
            _, n_runs = brute_force_ranges(item.fragment_shape, item.src_box, DTYPES[dtype], chunk_bytes, item.nbytes)
            need = item.src_box.numel * DTYPES[dtype]
            assert need <= item.bytes_planned <= min(item.nbytes, need + 2 * (chunk_bytes - 1) * n_runs)
        assert needed <= read


# ---------------------------------------------------------------------------------------------------- volume

VOLUME_CASES = {
    "8->4": ((4096, 16), (8,), [S0], (4,), [S0]),
    "8->3": ((4099, 16), (8,), [S0], (3,), [S0]),
    "3->8": ((4099, 16), (3,), [S0], (8,), [S0]),
    "4->6": ((1001, 33), (4,), [S0], (6,), [S0]),
    "2x2->4": ((256, 1024), (2, 2), [S0, S1], (4,), [S0]),
    "4->2x2": ((256, 1024), (4,), [S0], (2, 2), [S0, S1]),
    "3d-4->3": ((60, 33, 17), (4,), [S0], (3,), [S0]),
}


@pytest.mark.parametrize("case", VOLUME_CASES.values(), ids=VOLUME_CASES.keys())
def test_read_volume_within_5_percent(case):
    """Shards of tens of KB with 256-byte chunks: each target rank reads at most 1.05x the bytes it needs."""
    shape, src_mesh, src_pl, tgt_mesh, tgt_pl = case
    results = reshard(shape, src_mesh, src_pl, tgt_mesh, tgt_pl, 256, dtypes=("float32",))
    for target, _items, needed, read in results:
        assert needed >= 20_000
        assert read <= 1.05 * needed, (target, read / needed)


@settings(max_examples=100, deadline=None)
@given(
    n_rows=st.integers(1, 300),
    row=st.integers(1, 40),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    src=st.integers(1, 9),
    tgt=st.integers(1, 9),
    chunk_bytes=st.integers(1, 300),
)
def test_overhead_at_most_two_chunks_per_pair_for_row_shards(n_rows, row, itemsize, src, tgt, chunk_bytes):
    """When each overlap is one row-major run (Shard(0) -> Shard(0), or anything -> whole), a (fragment, target)
    pair reads fewer than 2 chunks more than it needs: one partial chunk at each end."""
    shape = (n_rows, row)
    frags = [fake_fragment(b, itemsize, chunk_bytes) for b in even_shards(shape, src)]
    for target in even_shards(shape, tgt) + [Box.whole(shape)]:
        items = plan_tensor_reads(frags, shape, itemsize, target, chunk_bytes, name="w")
        for item in items:
            need = item.src_box.numel * itemsize
            assert len(item.read_ranges) == 1
            assert need <= item.bytes_planned <= need + 2 * (chunk_bytes - 1)
            assert len(item.chunk_indices) <= -(-need // chunk_bytes) + 2
        assert bytes_planned(items) <= bytes_needed(target, itemsize) + 2 * (chunk_bytes - 1) * len(items)


def test_overhead_is_per_run_not_per_pair_for_column_shards():
    """A column overlap is one run per row: the 2-chunk bound then holds per run, not per (fragment, target) pair,
    and small runs read whole chunks (here, with 64-byte rows and 256-byte chunks, the whole fragment)."""
    shape, itemsize, chunk_bytes = (1024, 16), 4, 256
    frags = [fake_fragment(b, itemsize, chunk_bytes) for b in even_shards(shape, 2)]
    target = even_shards(shape, 4, dim=1)[0]  # columns 0:4 of every row
    items = plan_tensor_reads(frags, shape, itemsize, target, chunk_bytes, name="w")
    assert bytes_needed(target, itemsize) == 16 * 1024
    assert bytes_planned(items) == 64 * 1024  # 4x what is needed, far beyond 2 chunks per pair
    for item in items:
        assert item.read_ranges == ((0, item.nbytes),)
        _, n_runs = brute_force_ranges(item.fragment_shape, item.src_box, itemsize, chunk_bytes, item.nbytes)
        assert n_runs == 512
        assert item.bytes_planned <= item.src_box.numel * itemsize + 2 * (chunk_bytes - 1) * n_runs
    # with chunks smaller than a row, only the chunks holding the columns are read
    frags = [fake_fragment(b, itemsize, 16) for b in even_shards(shape, 2)]
    items = plan_tensor_reads(frags, shape, itemsize, target, 16, name="w")
    assert bytes_planned(items) == bytes_needed(target, itemsize)


def test_column_plan_is_cheap_for_many_rows():
    """Planning walks chunks, not rows: 2M one-element runs inside 8 MiB chunks plan in a few steps."""
    shape, itemsize, chunk_bytes = (2_000_000, 8), 4, 8 << 20
    frag = fake_fragment(Box.whole(shape), itemsize, chunk_bytes)
    items = plan_tensor_reads([frag], shape, itemsize, Box((0, 3), (2_000_000, 1)), chunk_bytes, name="w")
    assert items[0].read_ranges == ((0, frag.nbytes),)
    assert items[0].chunk_indices == tuple(range(len(frag.checksums)))


# ---------------------------------------------------------------------------------------------------- errors and edges


def fake_fragment(box: Box, itemsize: int, chunk_bytes: int, obj: str = "obj", offset: int = 0) -> Fragment:
    nbytes = box.numel * itemsize
    return Fragment(obj, offset, nbytes, box.offsets, box.shape, ("0" * 16,) * max(1, -(-nbytes // chunk_bytes)))


def test_missing_fragment_names_tensor_and_region():
    frags = [fake_fragment(b, 4, 64) for b in even_shards((8, 3), 4)]
    entry = TensorEntry("layers.0.weight", "float32", (8, 3), tuple(frags[:1] + frags[2:]))
    with pytest.raises(ValueError, match=r"missing fragment.*'layers\.0\.weight'.*\[2:4, 0:3\]"):
        plan_tensor_reads(entry, (8, 3), 4, Box.whole((8, 3)), 64)
    # a target that does not touch the hole plans fine
    assert len(plan_tensor_reads(entry, (8, 3), 4, Box((4, 0), (4, 3)), 64)) == 2
    # a 2-D hole: only the uncovered corner is named
    frags = [fake_fragment(b, 4, 64) for b in shard_boxes((4, 6), (2, 2), [S0, S1])]
    with pytest.raises(ValueError, match=r"'w'.*\[2:4, 3:6\]") as err:
        plan_tensor_reads(frags[:3], (4, 6), 4, Box((1, 1), (3, 5)), 64, name="w")
    assert "0:2" not in str(err.value).split("requested")[0]
    with pytest.raises(ValueError, match="missing fragment.*'w'"):
        plan_tensor_reads([], (4,), 4, Box.whole((4,)), 64, name="w")


def test_bad_plan_input():
    frag = fake_fragment(Box.whole((4, 4)), 4, 64)
    with pytest.raises(ValueError, match="does not fit"):
        plan_tensor_reads([frag], (4, 4), 4, Box((2, 0), (3, 4)), 64, name="w")
    with pytest.raises(ValueError, match="does not fit"):
        plan_tensor_reads([frag], (4, 4), 4, Box((0,), (4,)), 64, name="w")
    with pytest.raises(ValueError, match="bytes"):
        plan_tensor_reads([frag], (4, 4), 2, Box.whole((4, 4)), 64, name="w")
    with pytest.raises(ValueError, match="checksums"):
        plan_tensor_reads([frag], (4, 4), 4, Box.whole((4, 4)), 16, name="w")
    with pytest.raises(ValueError, match="does not fit"):
        plan_tensor_reads([fake_fragment(Box((2, 0), (4, 4)), 4, 64)], (4, 4), 4, Box.whole((4, 4)), 64, name="w")
    assert plan_tensor_reads([frag], (4, 4), 4, Box((4, 0), (0, 4)), 64, name="w") == []  # empty target


def test_replicated_fragments_are_read_once():
    """Duplicate fragments (replicated shards saved by every replica) are read from the first copy only."""
    arr = {"w": make_global((12, 5), "float32", 0)}
    boxes = shard_boxes((12, 5), (2, 3), [R, S0])  # ranks 3..5 repeat ranks 0..2
    objects, entries = save(arr, boxes, 32, dedupe=False)
    assert len(entries["w"].fragments) == 6
    target = Box.whole((12, 5))
    items = plan_tensor_reads(entries["w"], (12, 5), 4, target, 32)
    assert [i.fragment_index for i in items] == [0, 1, 2]
    got, read = execute(items, objects, entries["w"], target, np.float32)
    assert np.array_equal(got, arr["w"]) and read == 12 * 5 * 4


def test_plan_from_parsed_manifest():
    """Fragments saved per rank form a valid manifest; plans from the parsed manifest rebuild the tensors."""
    shape = (10, 6)
    tensors = {"a": make_global(shape, "bfloat16", 1), "b": make_global(shape, "int64", 2)}
    objects, entries = save(tensors, shard_boxes(shape, (2, 2), [S0, S1]), 64)
    manifest = Manifest(
        step=1,
        epoch=0,
        world_size=4,
        created_unix=0.0,
        library_version="test",
        objects=tuple(ObjectEntry(k, len(v), int(k.split("-")[1].split(".")[0])) for k, v in objects.items()),
        tensors=tuple(entries.values()),
        state={},
        ranks=(),
        chunk_bytes=64,
        alignment=ALIGNMENT,
    )
    parsed = Manifest.from_json(manifest.to_json())
    assert parsed == manifest
    for entry in parsed.tensors:
        arr = tensors[entry.name]
        for target in even_shards(shape, 3, dim=1):
            items = plan_tensor_reads(entry, entry.global_shape, arr.itemsize, target, parsed.chunk_bytes)
            got, _ = execute(items, objects, entry, target, arr.dtype)
            assert np.array_equal(got, arr[target.slices()])


def test_read_item_is_frozen_and_self_describing():
    frag = fake_fragment(Box.whole((8, 8)), 4, 64, obj="rank-0.data", offset=128)
    (item,) = plan_tensor_reads([frag], (8, 8), 4, Box((2, 0), (3, 8)), 64, name="w")
    assert item == ReadItem(
        tensor="w",
        object="rank-0.data",
        offset=128,
        fragment_index=0,
        fragment_shape=(8, 8),
        nbytes=256,
        chunk_bytes=64,
        read_ranges=((64, 192),),
        chunk_indices=(1, 2),
        src_box=Box((2, 0), (3, 8)),
        dst_box=Box((0, 0), (3, 8)),
    )
    assert item.object_ranges() == ((192, 320),) and item.bytes_planned == 128
    assert bytes_needed(Box((2, 0), (3, 8)), 4) == 96
    with pytest.raises(AttributeError):
        item.offset = 0
