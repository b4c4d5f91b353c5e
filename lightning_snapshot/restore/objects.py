"""What a restore reads of a snapshot, from its manifest's bytes: the engine's answer to a tier that moves bytes and
knows no manifest (:class:`~lightning_snapshot.backends.base.NeededObjects`). A node-local tier fetches the objects a
restore needs to the nodes that lack them; the RAM tier commits a step its node agents kept only where every object of
it is held. Light on purpose: the format and the backends' interface only (the simulated nodes of the tests import it
without Lightning).
"""

from __future__ import annotations

from lightning_snapshot.backends.base import NeededObjects, StepObject
from lightning_snapshot.format.manifest import Manifest

__all__ = ["needed_objects", "step_objects"]


def needed_objects(world_size: int, where: str) -> NeededObjects:
    """What a restore into ``world_size`` ranks reads of a snapshot, from its manifest's bytes: the objects of the
    shared tensors and of the rank sections it restores (every rank's at the same world size; at another, rank 0's,
    for the data position), each with its size and the rank that wrote it. A node-local tier fetches these to the
    nodes that lack them (:meth:`~lightning_snapshot.backends.base.Backend.restore`): the tier moves bytes, the
    manifest is read here.

    Args:
        world_size: the ranks of the restore.
        where: the manifest, as its parsing errors name it.
    """

    def objects(data: bytes) -> list[StepObject]:
        manifest = Manifest.from_json(data, where=where)
        ranks = range(world_size) if manifest.world_size == world_size else [0]
        entries = list(manifest.tensors)
        for r in ranks:
            section = manifest.rank_section(r)
            if section is not None:
                entries += section.tensors
        read = {f.object for t in entries for f in t.fragments}
        return [StepObject(o.key, o.nbytes, o.rank) for o in manifest.objects if o.key in read]

    return objects


def step_objects(where: str) -> NeededObjects:
    """Every object of a snapshot, from its manifest's bytes, each with its size and the rank that wrote it: what a
    RAM tier checks its nodes hold before it commits a step its node agents kept for trainers that died
    (:meth:`~lightning_snapshot.backends.base.Backend.collective_steps`)."""

    def objects(data: bytes) -> list[StepObject]:
        manifest = Manifest.from_json(data, where=where)
        return [StepObject(o.key, o.nbytes, o.rank) for o in manifest.objects]

    return objects
