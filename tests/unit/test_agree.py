"""comm.agree and comm.raise_together over a fake communicator: ranks are threads that meet at a barrier
(``thread_comm.ThreadComm``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lightning_snapshot.comm import agree, raise_together
from lightning_snapshot.errors import SnapshotError
from thread_comm import ThreadComm, run_ranks


def _check(problem_on: dict[int, str]) -> Callable[[ThreadComm], None]:
    def body(comm: ThreadComm) -> None:
        message = agree(comm, problem_on.get(comm.rank))
        if message is not None:
            raise SnapshotError(f"cannot start: {message}")

    return body


def test_one_failing_rank_makes_every_rank_raise_the_same_error():
    results = run_ranks(4, _check({2: "the tier /snap is not writable"}))
    assert all(isinstance(r, SnapshotError) for r in results), results
    assert {str(r) for r in results} == {"cannot start: on rank 2: the tier /snap is not writable"}


def test_the_same_problem_on_several_ranks_is_said_once_with_its_ranks():
    results = run_ranks(4, _check({0: "disk full", 3: "disk full", 1: "no bucket"}))
    assert {str(r) for r in results} == {"cannot start: on ranks 0, 3: disk full; on rank 1: no bucket"}


def test_no_problem_on_any_rank_raises_nowhere():
    assert run_ranks(3, _check({})) == [None, None, None]


def test_one_process_says_the_problem_without_a_rank():
    assert str(run_ranks(1, _check({0: "bad"}))[0]) == "cannot start: bad"


def test_raise_together_raises_on_every_rank_the_failing_ranks_own_error():
    own = ValueError("agent did not start")

    def body(comm: ThreadComm) -> str:
        raise_together(comm, own if comm.rank == 1 else None, "starting the agent failed on another node")
        return "went on"

    results = run_ranks(3, body)
    assert results[1] is own
    assert [type(r) for r in results] == [SnapshotError, ValueError, SnapshotError]
    assert str(results[0]) == str(results[2]) == "starting the agent failed on another node"
    assert run_ranks(3, lambda comm: raise_together(comm, None, "unused") or "went on") == ["went on"] * 3


@pytest.mark.parametrize("world_size", [2, 5])
def test_thread_comm_collectives_agree(world_size):
    """(The fake itself: its collectives give what the Comm protocol promises.)"""
    out = run_ranks(world_size, lambda c: (c.broadcast(c.rank + 10), c.all_true(c.rank != 1),
                                           c.all_true_each([True, c.rank != 0]), c.gather(c.rank)))
    assert all(o[0] == 10 and o[1] is False and o[2] == [True, False] for o in out)
    assert out[0][3] == list(range(world_size)) and all(o[3] is None for o in out[1:])
