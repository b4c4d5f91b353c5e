"""agree.agree_on, the one way ranks agree on an outcome, over a fake communicator: ranks are threads that meet at a
barrier (``thread_comm.ThreadComm``) whose timeout stands in for a process group's."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from thread_comm import ThreadComm, run_ranks

from lightning_snapshot.dist.agree import Agreed, agree_on
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.errors import ConfigError, SnapshotError, SnapshotWriteError


class Counting(ThreadComm):
    """A ThreadComm that counts the collectives this rank took part in."""

    def __init__(self, inner: ThreadComm) -> None:
        super().__init__(inner.rank, inner.world_size, inner._table, inner._barrier, inner._mailboxes)
        self.collectives = 0

    def _exchange(self, obj):
        self.collectives += 1
        return super()._exchange(obj)


def _on_ranks(world: int, body: Callable[[Counting], object], timeout: float = 30.0) -> list[object]:
    return run_ranks(world, lambda comm: body(Counting(comm)))


def test_one_rank_raises_every_rank_raises_the_same_error_naming_the_rank():
    def body(comm: Counting) -> object:
        def work() -> int:
            if comm.rank == 2:
                raise OSError("the tier /snap is not writable")
            return comm.rank * 10

        return agree_on(comm, "writing step 7", work, failed=SnapshotWriteError).result()

    t0 = time.monotonic()
    results = _on_ranks(4, body)
    assert time.monotonic() - t0 < 10  # (the barrier's timeout is 30 s: nobody waited for it)
    assert isinstance(results[2], OSError) and str(results[2]) == "the tier /snap is not writable"
    others = [results[r] for r in (0, 1, 3)]
    assert all(type(e) is SnapshotWriteError for e in others), results
    assert {str(e) for e in others} == {
        "writing step 7 failed on another rank (see its log): on rank 2: OSError: the tier /snap is not writable"
    }


def test_no_rank_waits_for_a_timeout_to_learn_of_a_failure():
    """The barrier's timeout is far longer than the test: a rank that had to wait for it would hang the test, and
    the error it then saw (a broken barrier) could not name the failing rank's error."""

    def body(comm: Counting) -> object:
        try:
            agree_on(comm, "placing", error=RuntimeError("boom") if comm.rank == 0 else None).result()
        except BaseException as e:  # noqa: BLE001 - compared below
            return e, comm.collectives
        return None, comm.collectives

    table: list[object] = [None] * 3
    barrier = threading.Barrier(3, timeout=600)
    out: list[object] = [None] * 3

    def main(rank: int) -> None:
        out[rank] = body(Counting(ThreadComm(rank, 3, table, barrier)))

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    errors = [e for e, _ in out]  # type: ignore[misc]
    assert isinstance(errors[0], RuntimeError) and all(isinstance(e, SnapshotError) for e in errors[1:]), errors
    assert all("on rank 0: RuntimeError: boom" in str(e) for e in errors[1:]), errors
    # the failure path: the flag all-reduce, then the problems gathered and broadcast; nothing else
    assert {n for _, n in out} == {3}, out  # type: ignore[misc]


def test_success_takes_one_collective_with_the_extra_flags():
    def body(comm: Counting) -> tuple[Agreed[int], int]:
        agreed = agree_on(comm, "staging", lambda: comm.rank, flags=[True, comm.rank != 1])
        return agreed, comm.collectives

    out = _on_ranks(3, body)
    for rank, (agreed, n) in enumerate(out):  # type: ignore[misc]
        assert agreed.ok and agreed.value == rank and agreed.flags == [True, False] and agreed.error is None
        assert n == 1


def test_several_failing_ranks_are_said_once_per_problem_and_each_raises_its_own():
    problems = {0: "disk full", 3: "disk full", 1: "no bucket"}

    def body(comm: Counting) -> object:
        agreed = agree_on(comm, "checking the tiers", error=problems.get(comm.rank))
        return agreed.failed, agreed.text, agreed.error

    out = _on_ranks(4, body)
    assert all(o[0] == [0, 1, 3] for o in out)  # type: ignore[index]
    assert {o[1] for o in out} == {"on ranks 0, 3: disk full; on rank 1: no bucket"}  # type: ignore[index]
    assert str(out[1][2]) == "no bucket" and str(out[0][2]) == "disk full"  # type: ignore[index]
    assert "on ranks 0, 3: disk full; on rank 1: no bucket" in str(out[2][2])  # type: ignore[index]


def test_gather_gives_every_rank_every_value_and_the_failures_in_the_same_collective():
    def body(comm: Counting) -> object:
        error = "cannot list /d" if comm.rank == 1 else None
        agreed = agree_on(comm, "listing", lambda: [comm.rank], error=error, gather=True)
        return agreed.values, agreed.text, comm.collectives

    out = _on_ranks(3, body)
    assert all(o == ([[0], None, [2]], "on rank 1: cannot list /d", 1) for o in out), out


def test_on_failure_cleans_up_on_every_rank_and_its_own_failure_does_not_hide_the_error():
    cleaned: list[int] = []

    def body(comm: Counting) -> object:
        def cleanup() -> None:
            cleaned.append(comm.rank)
            raise OSError("the tier is gone")

        agree_on(comm, "x", error=ConfigError("bad") if comm.rank == 1 else None, on_failure=cleanup).result()
        return "went on"

    out = _on_ranks(2, body)
    assert sorted(cleaned) == [0, 1]
    assert isinstance(out[1], ConfigError) and isinstance(out[0], SnapshotError) and "bad" in str(out[0])


def test_a_failing_collective_is_named_when_translated_and_kept_as_it_is_otherwise():
    class Broken(LocalComm):
        world_size = 2

        def all_true_each(self, flags: list[bool]) -> list[bool]:
            raise RuntimeError("Connection closed by peer")

    with pytest.raises(
        SnapshotWriteError,
        match="rank 0: waiting for the other ranks to agree on committing step 3"
        " failed .RuntimeError: Connection closed by peer",
    ):
        agree_on(Broken(), "committing step 3", failed=SnapshotWriteError, translate=True)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        agree_on(Broken(), "committing step 3")


def test_one_process_says_the_problem_without_a_rank():
    agreed = agree_on(LocalComm(), "starting", error="bad")
    assert agreed.text == "bad" and agreed.failed == [0]
    with pytest.raises(SnapshotError, match="^bad$"):
        agreed.result()
    assert agree_on(LocalComm(), "starting", lambda: 5).result() == 5


@pytest.mark.parametrize("world_size", [2, 5])
def test_thread_comm_collectives_agree(world_size):
    """(The fake itself: its collectives give what the Comm protocol promises.)"""
    out = run_ranks(
        world_size,
        lambda c: (
            c.broadcast(c.rank + 10),
            c.all_true(c.rank != 1),
            c.all_true_each([True, c.rank != 0]),
            c.gather(c.rank),
        ),
    )
    assert all(o[0] == 10 and o[1] is False and o[2] == [True, False] for o in out)
    assert out[0][3] == list(range(world_size)) and all(o[3] is None for o in out[1:])


def test_broadcast_gives_every_rank_the_source_value_and_a_source_failure_is_every_rank_error():
    from lightning_snapshot.dist import agree

    got = run_ranks(3, lambda comm: agree.broadcast(comm, "reading the manifest", lambda: f"from {comm.rank}", src=1))
    assert got == ["from 1"] * 3

    def failing(comm: ThreadComm) -> object:
        def read() -> str:
            raise OSError("EIO reading manifest.json")

        return agree.broadcast(comm, "reading the manifest of step 7", read, src=2)

    raised = run_ranks(3, failing)
    assert isinstance(raised[2], OSError) and "EIO" in str(raised[2])
    for e in raised[:2]:  # the others at once, naming the source rank and its problem (no barrier timeout)
        assert isinstance(e, SnapshotError), e
        assert str(e) == "reading the manifest of step 7 failed on rank 2: OSError: EIO reading manifest.json"


def test_all_gather_gives_every_value_in_rank_order_and_names_the_ranks_that_failed():
    from lightning_snapshot.dist import agree

    assert run_ranks(3, lambda comm: agree.all_gather(comm, "listing", lambda: comm.rank * 2)) == [[0, 2, 4]] * 3

    def failing(comm: ThreadComm) -> object:
        def listing() -> int:
            if comm.rank == 1:
                raise PermissionError("cannot list /nvme/snap")
            return comm.rank

        return agree.all_gather(comm, "listing what each node holds", listing)

    raised = run_ranks(3, failing)
    assert isinstance(raised[1], PermissionError)
    for r in (0, 2):
        assert isinstance(raised[r], SnapshotError) and "on rank 1: PermissionError: cannot list /nvme/snap" in str(
            raised[r]
        ), raised[r]


def test_a_failure_of_rank_0_choosing_the_snapshot_to_resume_from_is_every_rank_error(tmp_path, monkeypatch):
    """The restore's choice is rank 0's, broadcast to every rank: when rank 0 fails making it (here reading a
    candidate's facts), every rank raises at once, naming rank 0, instead of waiting for a broadcast that never
    comes."""
    from lightning_snapshot import SnapshotCallback
    from lightning_snapshot.backends import LocalTier
    from lightning_snapshot.restore import restorer

    config = SnapshotCallback([LocalTier(tmp_path, every_n_train_steps=1)]).config
    monkeypatch.setattr(restorer, "committed_steps", lambda tier: [12, 8])

    def unreadable(*args: object) -> object:
        raise OSError(5, "Input/output error", "step-000000000012/restores.json")

    monkeypatch.setattr(restorer, "read_candidate", unreadable)
    raised = run_ranks(2, lambda comm: restorer.Restorer(config, comm, [], None).candidates())
    assert isinstance(raised[0], OSError)
    assert isinstance(raised[1], SnapshotError), raised[1]
    assert "choosing the snapshot to resume from failed on rank 0: OSError: [Errno 5] Input/output error" in str(
        raised[1]
    )
