"""The library's own gloo process groups: formed under names no earlier attempt of the job used, and the timeout of
the preemption agreement's group.

Called once per fit by :mod:`~lightning_snapshot.fit.session`, at a point every rank reaches together.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
from typing import Any

__all__ = ["new_gloo_groups", "wait_as_long_as"]

log = logging.getLogger(__name__)


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
