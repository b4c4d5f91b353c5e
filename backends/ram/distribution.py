"""The RAM tier's erasure distribution: once every rank's data is written and before the commit, each rank sends
the shares of its new objects to the nodes they belong on and keeps those of its own node, with each object's
``layout.json``.

:class:`ErasureDistribution` is a part that :class:`~lightning_snapshot.backends.ram.tier.RamTier` holds (its
``distribution``); the tier's :class:`~lightning_snapshot.backends.base.Distributing` capability delegates to it. It
takes the new objects from the tier's :class:`~lightning_snapshot.backends.ram.store.RamStore` and places their shares
through its :class:`~lightning_snapshot.backends.ram.placement.RamPlacement`.
"""

from __future__ import annotations

import json
from typing import cast

from lightning_snapshot.backends.mapped_files import as_tensor, close_map, group_of, map_existing, map_new
from lightning_snapshot.backends.ram.placement import RamPlacement
from lightning_snapshot.backends.ram.shares import EC, LAYOUT_FILE, data_share, data_share_nbytes, layout_of, view_of
from lightning_snapshot.backends.ram.store import RamStore
from lightning_snapshot.dist.comm import Comm, TensorComm

__all__ = ["ErasureDistribution"]


class ErasureDistribution:
    """:meth:`distribute` (collective), and :meth:`place_all_here` for one process standing for every node."""

    def __init__(self, placement: RamPlacement, objects: RamStore) -> None:
        self.placement = placement
        self.objects = objects

    def distribute(self, comm: Comm, prefix: str, run_id: str | None) -> None:
        """Send every share of this rank's new objects to its node and keep the ones of this node (collective)."""
        pending, sources = self.objects.take_new()
        place = self.placement
        if place.erasure is None:
            return
        k, m = place.erasure
        mine = {key: meta for key, meta in pending.items() if key.startswith(prefix + "/")}
        everyone = cast("TensorComm", comm).all_gather(mine) if comm.world_size > 1 else [mine]
        import torch.distributed as dist

        n, n_nodes = place.node_rank, place.num_nodes
        sends, recvs, keep, held = [], [], [], []
        try:
            for i in range(1, k + m):
                dst = place.rank_of((n + i) % n_nodes, place.local_rank)
                src = place.rank_of((n - i) % n_nodes, place.local_rank)
                for key, meta in sorted(mine.items()):
                    if i < k:  # the object's bytes of data share i (past the object's end the share is zeros)
                        part, _pad = data_share(sources[key], layout_of(meta), i)
                        if part.nbytes:
                            held.append(as_tensor(part))
                            sends.append(dist.isend(held[-1], dst, group=group_of(comm)))
                        continue
                    mm = map_existing(place.store.files.path(f"{key}{EC}/{i}"))
                    if mm is not None:
                        keep.append(mm)
                        sends.append(dist.isend(as_tensor(mm), dst, group=group_of(comm)))
                for key, meta in sorted(everyone[src].items()):
                    path = place.store.files.path(f"{key}{EC}/{i}")
                    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                    lay = layout_of(meta)
                    mm = map_new(path, lay.share_nbytes)  # (zeros until received)
                    if mm is not None:
                        keep.append(mm)
                        size = data_share_nbytes(lay, i) if i < k else lay.share_nbytes
                        if size:
                            recvs.append(dist.irecv(as_tensor(mm)[:size], src, group=group_of(comm)))
            for w in sends + recvs:
                if w is not None:  # (None: this rank is not in the group, nothing was posted)
                    w.wait()
        finally:
            sends.clear()
            recvs.clear()
            held.clear()
            for mm in keep:
                close_map(mm)
        # this node keeps share 0 of its own objects and share i of the objects of node n - i
        for key in mine:
            for i in range(k, k + m):
                place.store.delete(f"{key}{EC}/{i}")
        for r, objs in enumerate(everyone):
            if r % place.ranks_per_node != place.local_rank:
                continue  # the ranks with this local rank exchange with each other
            for key, meta in objs.items():
                i = (n - place.node_of(r)) % n_nodes
                if i >= k + m:
                    continue
                layout = {**meta, "nodes": [(place.node_of(r) + j) % n_nodes for j in range(k + m)]}
                place.store.write(f"{key}{EC}/{LAYOUT_FILE}", [json.dumps(layout).encode()])

    def place_all_here(self) -> None:
        """What :meth:`distribute` does, for one process standing for every node (benchmarks, unit tests): every
        share of the new objects is kept in this node's directory, with the ``layout.json`` of each."""
        pending, sources = self.objects.take_new()
        place = self.placement
        for key, meta in pending.items():
            lay = layout_of(meta)
            for i in range(1, lay.k):
                part, _pad = data_share(sources[key], lay, i)
                mm = map_new(place.store.files.path(f"{key}{EC}/{i}"), lay.share_nbytes)
                try:
                    view_of(mm)[: part.nbytes] = part
                finally:
                    close_map(mm)
            layout = {**meta, "nodes": [place.node_rank] * (lay.k + lay.m)}
            place.store.write(f"{key}{EC}/{LAYOUT_FILE}", [json.dumps(layout).encode()])
