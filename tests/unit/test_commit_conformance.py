"""The commit rule (lightning_snapshot.persist.commit), once per transport: the trainer's collectives and the snapshot
agents' marker files. Two ranks as threads writing a real local tier; what is committed is read back by the loader.

Each transport must: make a normal commit readable; leave no committed step when a rank fails, or rank 0 is aborted,
between the data objects and the manifest (and let a later commit of that step succeed); accept an identical
re-commit of a committed step and leave the same snapshot, on a tier that replaces a committed manifest (files, RAM)
and on one that refuses it (object stores)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from thread_comm import ThreadComm

from lightning_snapshot.backends.local import LocalTier
from lightning_snapshot.errors import SnapshotError, SnapshotWriteError
from lightning_snapshot.format.manifest import MANIFEST_NAME, step_dirname
from lightning_snapshot.persist.commit import CollectiveTransport, MarkerTransport, Transport
from lightning_snapshot.persist.writer import SnapshotJob, commit_job, committed_steps
from lightning_snapshot.restore.loader import load_snapshot
from lightning_snapshot.staging import stage

WORLD = 2
TRANSPORTS = ["collective", "markers"]


class Abort(BaseException):
    """What a SIGKILL does to the code it interrupts: nothing after it runs (not an Exception: no handler of the
    rule's own catches it as a failure to report)."""


class Tier(LocalTier):
    """A real local tier whose manifest commit can be made to abort once (``abort_commit``) or to refuse a manifest
    already committed, as object stores do (``refuses_committed``)."""

    abort_commit = False
    refuses_committed = False

    def commit(self, key: str, data: bytes) -> None:
        if self.abort_commit:
            self.abort_commit = False
            raise Abort
        if self.refuses_committed and self.exists(key):
            raise SnapshotWriteError(f"{key} is committed already")
        super().commit(key, data)


def job(step: int, rank: int, value: float) -> SnapshotJob:
    """Rank 0 writes the shared state (replicated: one rank's share is all of it), every rank its own state."""
    shared = stage({"w": torch.full((64,), value), "b": torch.arange(8)}) if rank == 0 else None
    return SnapshotJob(step, 0, shared=shared, private=stage({"rank": rank, "v": value}, "rank"))


def transport(kind: str, tier: Tier, comm_state: dict[str, Any], step: int, run_id: str, rank: int) -> Transport:
    if kind == "collective":
        comm = ThreadComm(rank, WORLD, comm_state["slots"], comm_state["barrier"])
        return CollectiveTransport(comm, tier, step, run_id)
    return MarkerTransport(tier, step, run_id, rank, WORLD, wait=10.0)


def commit_all(
    kind: str,
    tier: Tier,
    step: int,
    value: float,
    run_id: str = "run1",
    before_commit: dict[int, Callable[[], None]] | None = None,
) -> list[Any]:
    """Every rank (a thread) commits ``step``; returns each rank's Commit, or the exception it raised."""
    state = {"slots": [None] * WORLD, "barrier": threading.Barrier(WORLD, timeout=10)}
    out: list[Any] = [None] * WORLD

    def rank_main(rank: int) -> None:
        try:
            out[rank] = commit_job(
                tier,
                transport(kind, tier, state, step, run_id, rank),
                job(step, rank, value),
                run_id,
                before_commit=(before_commit or {}).get(rank),
            )
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            out[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    return out


def assert_readable(tier: Tier, step: int, value: float) -> None:
    got = load_snapshot(tier, step=step, rank=0)
    assert torch.equal(got["w"], torch.full((64,), value))
    assert torch.equal(got["b"], torch.arange(8))


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_a_normal_commit_is_readable(tmp_path, kind):
    tier = Tier(tmp_path)
    out = commit_all(kind, tier, 5, 1.5)
    assert not any(isinstance(o, BaseException) for o in out), out
    assert out[0].written and out[0].manifest is not None and out[0].manifest.step == 5
    assert committed_steps(tier) == [5]
    assert_readable(tier, 5, 1.5)
    # nothing but the manifest and the objects it names is left in the step's directory (no parts, no markers)
    names = set(tier.list(step_dirname(5)))
    assert names == {MANIFEST_NAME} | {o.key for o in out[0].manifest.objects}


def _fail_after_data() -> None:
    raise RuntimeError("rank 1 died after writing its data")


@pytest.mark.parametrize("crash", ["rank-1-fails-after-its-data", "rank-0-aborted-at-the-manifest"])
@pytest.mark.parametrize("kind", TRANSPORTS)
def test_a_crash_between_data_and_manifest_commits_nothing_and_a_later_commit_works(tmp_path, kind, crash):
    tier = Tier(tmp_path)
    assert not any(isinstance(o, BaseException) for o in commit_all(kind, tier, 3, 0.5))
    if crash == "rank-1-fails-after-its-data":
        out = commit_all(kind, tier, 6, 2.0, before_commit={1: _fail_after_data})
        assert isinstance(out[1], RuntimeError)
        assert isinstance(out[0], SnapshotError)  # the other rank fails too, not left waiting
        # told by the failing rank (its error named), not left to learn it by a timeout
        assert "rank 1 died after writing its data" in str(out[0]), out[0]
    else:
        tier.abort_commit = True
        out = commit_all(kind, tier, 6, 2.0)
        assert isinstance(out[0], Abort)
        assert isinstance(out[1], SnapshotError)  # told (marker) or timed out (collective), not left waiting
    assert not tier.exists(f"{step_dirname(6)}/{MANIFEST_NAME}")
    assert committed_steps(tier) == [3]
    assert load_snapshot(tier, rank=0)["w"][0].item() == 0.5  # the loader sees the earlier snapshot only
    out = commit_all(kind, tier, 6, 2.0, run_id="run2")  # a later attempt (a resumed run) of the same step
    assert not any(isinstance(o, BaseException) for o in out), out
    assert committed_steps(tier) == [6, 3]
    assert_readable(tier, 6, 2.0)
    assert_readable(tier, 3, 0.5)


@pytest.mark.parametrize("refuses", [False, True], ids=["replacing-tier", "refusing-tier"])
@pytest.mark.parametrize("kind", TRANSPORTS)
def test_an_identical_recommit_is_accepted_and_leaves_the_same_snapshot(tmp_path, kind, refuses):
    tier = Tier(tmp_path)
    tier.refuses_committed = refuses
    first = commit_all(kind, tier, 9, 4.0)
    assert not any(isinstance(o, BaseException) for o in first), first
    before = json.loads(tier.read(f"{step_dirname(9)}/{MANIFEST_NAME}"))
    again = commit_all(kind, tier, 9, 4.0)  # the same write once more (a retry whose first answer was lost)
    assert not any(isinstance(o, BaseException) for o in again), again
    after = json.loads(tier.read(f"{step_dirname(9)}/{MANIFEST_NAME}"))
    before.pop("created_unix"), after.pop("created_unix")
    assert after == before
    assert committed_steps(tier) == [9]
    assert set(tier.list(step_dirname(9))) == {MANIFEST_NAME} | {o["key"] for o in after["objects"]}
    assert_readable(tier, 9, 4.0)
