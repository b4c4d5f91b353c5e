"""forksafe: a fork waits while another thread does a kind of work for the first time, never for a thread that waits
for the forking one, at most WAIT_S, and not for work done once already. Real os.fork, real threads."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import pytest

from lightning_snapshot.dist import forksafe


def _fork_seconds() -> float:
    """How long os.fork() takes in this thread (the child exits at once)."""
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    took = time.monotonic() - t0
    os.waitpid(pid, 0)
    return took


def _in_thread(body) -> tuple[threading.Thread, threading.Event]:
    inside = threading.Event()
    thread = threading.Thread(target=body, args=(inside,), daemon=True)
    thread.start()
    assert inside.wait(10)
    return thread, inside


def _kind() -> str:
    return f"test work {uuid.uuid4().hex}"


def test_a_fork_waits_for_another_threads_first_work():
    kind = _kind()

    def body(inside):
        with forksafe.first_use(kind):
            inside.set()
            time.sleep(0.6)

    thread, _ = _in_thread(body)
    assert _fork_seconds() >= 0.4
    thread.join()


def test_work_done_once_already_does_not_hold_forks_off(monkeypatch):
    monkeypatch.setattr(forksafe, "WAIT_S", 10.0)  # (a fork that waited would take 10 s)
    kind, release = _kind(), threading.Event()
    with forksafe.first_use(kind):
        pass

    def body(inside):
        with forksafe.first_use(kind):
            inside.set()
            release.wait(20)

    thread, _ = _in_thread(body)
    assert _fork_seconds() < 5.0
    release.set()
    thread.join()


def test_a_fork_does_not_wait_for_a_thread_waiting_for_the_forking_thread(monkeypatch):
    """The copy thread held back until the training thread lets it go, a persist thread waiting for the fence: the
    training thread's fork must not wait for them (it would wait WAIT_S, the thread waiting for it meanwhile)."""
    monkeypatch.setattr(forksafe, "WAIT_S", 10.0)  # (a fork that waited would take 10 s)
    kind, go = _kind(), threading.Event()

    def body(inside):
        with forksafe.first_use(kind):
            with forksafe.waiting():
                inside.set()
                go.wait(20)
            time.sleep(0.01)

    thread, _ = _in_thread(body)
    assert _fork_seconds() < 5.0
    go.set()
    thread.join()


def test_a_fork_waits_at_most_wait_s_and_says_what_for(monkeypatch, caplog):
    monkeypatch.setattr(forksafe, "WAIT_S", 0.3)
    kind, release = _kind(), threading.Event()

    def body(inside):
        with forksafe.first_use(kind):
            inside.set()
            release.wait(10)

    thread, _ = _in_thread(body)
    with caplog.at_level(logging.WARNING, logger="lightning_snapshot.dist.forksafe"):
        took = _fork_seconds()
    release.set()
    thread.join()
    assert 0.25 <= took < 8.0
    assert any(kind in r.getMessage() and "forking anyway" in r.getMessage() for r in caplog.records), caplog.text


def test_the_library_pools_first_tasks_hold_forks_off(monkeypatch):
    monkeypatch.setattr(forksafe, "WAIT_S", 10.0)
    pool = forksafe.Executor(1, thread_name_prefix=f"test-pool-{uuid.uuid4().hex[:8]}")
    started = threading.Event()

    def task():
        started.set()
        time.sleep(0.6)
        return 7

    future = pool.submit(task)
    assert started.wait(10)
    assert _fork_seconds() >= 0.4
    assert future.result() == 7
    release = threading.Event()
    later = pool.submit(release.wait, 20)  # (its kind is done: a later task does not hold forks off)
    time.sleep(0.1)
    assert _fork_seconds() < 5.0
    release.set()
    later.result()
    pool.shutdown()


def test_the_forking_thread_never_waits_for_itself(monkeypatch):
    monkeypatch.setattr(forksafe, "WAIT_S", 10.0)
    with forksafe.first_use(_kind()):
        assert _fork_seconds() < 5.0


@pytest.mark.parametrize("nested", [False, True])
def test_nested_first_work_keeps_the_thread_busy_until_the_outer_one_ends(nested):
    outer, inner = _kind(), _kind()
    phase = threading.Event()

    def body(inside):
        with forksafe.first_use(outer):
            if nested:
                with forksafe.first_use(inner):
                    pass
            inside.set()
            phase.wait(10)
            time.sleep(0.5)

    thread, _ = _in_thread(body)
    phase.set()
    assert _fork_seconds() >= 0.3
    thread.join()
